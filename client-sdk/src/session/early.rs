//! Early copies of record requests (`Taken.record_state`, docs/architecture.md §4.2): which
//! copy of each request the application answers — the first it meets, once.

use std::collections::{BTreeSet, VecDeque};

/// Most record requests remembered as answered from one copy while the other is due (as
/// many snapshots as could be in flight at once, and more).
pub(super) const ANSWERED_MEMORY: usize = 1024;

/// Which copy of each record request the application answers: the first it meets, once.
#[derive(Debug, Default)]
pub(super) struct Copies {
    /// Requests answered at their early copy, whose in-band copy is still to come...
    answered_early: BTreeSet<u64>,
    /// ...and answered in band, whose early copy is still to come.
    answered_in_band: BTreeSet<u64>,
}

impl Copies {
    /// An early copy of `id`: whether the cut is here.
    pub(super) fn early(&mut self, id: u64) -> bool {
        if self.answered_in_band.remove(&id) {
            return false;
        }
        remember(&mut self.answered_early, id);
        true
    }

    /// The in-band copy of `id` (`early_copy`: one went ahead): whether the cut is here.
    pub(super) fn in_band(&mut self, id: u64, early_copy: bool) -> bool {
        if self.answered_early.remove(&id) {
            return false;
        }
        if early_copy {
            remember(&mut self.answered_in_band, id);
        }
        true
    }

    /// The next early copy to cut at from those that came (`due`: and whether no more
    /// come); skips those answered in band.
    pub(super) fn take_early(&mut self, due: &mut (VecDeque<u64>, bool)) -> Option<u64> {
        while let Some(id) = due.0.pop_front() {
            if self.early(id) {
                return Some(id);
            }
        }
        if due.1 {
            // Every copy that came was met, and no more come: none is waited for.
            self.answered_in_band.clear();
        }
        None
    }
}

/// Record requests that came ahead of the session's deliveries (`Taken.record_state`).
#[derive(Default)]
pub(super) struct EarlyRecords {
    /// Requests not taken yet, and whether the stream bringing them ended (no more come).
    pub(super) due: std::sync::Mutex<(VecDeque<u64>, bool)>,
    /// Wakes the session waiting for deliveries.
    pub(super) wake: tokio::sync::Notify,
}

impl EarlyRecords {
    pub(super) fn arrived(&self, ids: Vec<u64>, ended: bool) {
        let mut due = self.due.lock().expect("never poisoned");
        due.0.extend(ids);
        // Bounded whatever the daemon sends: the newest are the ones still due.
        while due.0.len() > ANSWERED_MEMORY {
            due.0.pop_front();
        }
        due.1 |= ended;
        drop(due);
        self.wake.notify_one();
    }
}

/// Remembers `id` in a set bounded by [`ANSWERED_MEMORY`] (the oldest goes first).
fn remember(set: &mut BTreeSet<u64>, id: u64) {
    set.insert(id);
    while set.len() > ANSWERED_MEMORY {
        set.pop_first();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::Copies;

    #[test]
    fn each_record_request_is_answered_once_at_the_first_copy_met() {
        let mut c = Copies::default();
        // Early first: the in-band copy is skipped.
        assert!(c.early(1));
        assert!(!c.in_band(1, true));
        // In band first: the early copy is skipped...
        assert!(c.in_band(2, true));
        assert!(!c.early(2));
        // ...even when it comes with the stream's end: the copies that came are met before
        // what was answered in band is forgotten.
        assert!(c.in_band(3, true));
        let mut due = (VecDeque::from([3, 4]), true);
        assert_eq!(c.take_early(&mut due), Some(4), "3 was answered in band");
        assert_eq!(c.take_early(&mut due), None);
        assert!(
            c.answered_in_band.is_empty(),
            "no early copy comes any more"
        );
        // A request with no early copy is answered in band, and nothing is remembered.
        assert!(c.in_band(5, false));
        assert!(c.answered_in_band.is_empty());
        // Each is met once more at most: memory does not grow.
        assert!(!c.in_band(4, true));
        assert!(c.answered_early.is_empty() && c.answered_in_band.is_empty());
    }
}
