//! The history a cluster is on after its restores, as a reader outside it can tell from
//! the restores (each epoch and the snapshot it was restored from) and the snapshots'
//! epochs: every snapshot of the current epoch; then, of the epoch the restored snapshot
//! belongs to, the snapshots up to it; and so on back. A snapshot outside it belongs to a
//! history a restore discarded: cairn restores it if asked, but effects written outside
//! the cluster (the ledger) no longer hold that history's rows. The nemesis restores only
//! inside it (asking conditionally on the epoch it read), and the checker holds every
//! restore of the run to it (`check_restores_stay_in_history`).

use std::collections::BTreeMap;

use cairn_core::coordinator::restore_epoch;

use super::history::{Entry, SnapshotView};
use super::verdict::Verdict;

/// The history a cluster in `epoch` is on: per epoch on it, the newest snapshot id of it
/// that belongs (`u64::MAX` for the current epoch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lineage {
    bounds: BTreeMap<u64, u64>,
}

impl Lineage {
    /// The history of a cluster in `epoch`, from `restored` (epoch → the snapshot the
    /// restore that made it restored) and `epochs` (snapshot id → its epoch, where known).
    /// The walk back stops at an epoch no restore made (the first), or at a restored
    /// snapshot whose epoch is not known: what lies behind is then left out.
    pub fn of(epoch: u64, restored: &BTreeMap<u64, u64>, epochs: &BTreeMap<u64, u64>) -> Self {
        let mut bounds = BTreeMap::from([(epoch, u64::MAX)]);
        let mut at = epoch;
        while let Some(snapshot) = restored.get(&at)
            && let Some(&from) = epochs.get(snapshot)
            // A restore brings back an older epoch's snapshot; anything else is not a walk.
            && from < at
        {
            bounds.insert(from, *snapshot);
            at = from;
        }
        Self { bounds }
    }

    /// Whether snapshot `id` of `epoch` is on this history.
    pub fn contains(&self, id: u64, epoch: u64) -> bool {
        self.bounds.get(&epoch).is_some_and(|&bound| id <= bound)
    }
}

/// Every restore of the run restored a snapshot of the history the cluster was on when it
/// started — automatic recovery's (which picks its candidates so) and the nemesis's own
/// (asked on the condition that the epoch it chose in is still the cluster's). One that did
/// not would bring back effects the ledger deleted. Restores whose snapshot's epoch the
/// history does not hold (older histories) are not checked.
pub(super) fn check_restores_stay_in_history(
    entries: &[Entry],
    snapshots: &BTreeMap<u64, &SnapshotView>,
    v: &mut Verdict,
) {
    let epochs: BTreeMap<u64, u64> = snapshots
        .values()
        .filter_map(|s| Some((s.id, s.epoch?)))
        .collect();
    let mut restores: Vec<(u64, &str, u64)> = entries
        .iter()
        .filter_map(|e| match e {
            Entry::Restore {
                restore_id,
                snapshot,
                ..
            } => Some((restore_epoch(restore_id)?, restore_id.as_str(), *snapshot)),
            _ => None,
        })
        .collect();
    restores.sort_unstable();
    let mut restored = BTreeMap::new();
    let mut epoch = 0;
    for (new_epoch, restore_id, snapshot) in restores {
        if let Some(&of) = epochs.get(&snapshot) {
            if !Lineage::of(epoch, &restored, &epochs).contains(snapshot, of) {
                v.violation(format!(
                    "{restore_id} restored snapshot {snapshot} (of epoch {of}), which is not \
                     on the history the cluster was on in epoch {epoch}: a restore discarded \
                     it before"
                ));
            }
            v.restores_in_history_checked += 1;
        }
        restored.insert(new_epoch, snapshot);
        epoch = new_epoch;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_history_runs_back_through_each_restored_snapshot() {
        // Epoch 0: snapshots 1..=5. Restore 3 → epoch 1: snapshots 6, 7. Restore 6 →
        // epoch 2: snapshot 8.
        let epochs = BTreeMap::from([
            (1, 0),
            (2, 0),
            (3, 0),
            (4, 0),
            (5, 0),
            (6, 1),
            (7, 1),
            (8, 2),
        ]);
        let restored = BTreeMap::from([(1, 3), (2, 6)]);
        let now = Lineage::of(2, &restored, &epochs);
        let on: Vec<u64> = (1..=8)
            .filter(|&id| now.contains(id, epochs[&id]))
            .collect();
        assert_eq!(on, [1, 2, 3, 6, 8], "4, 5 and 7 were discarded");
        // Before the second restore, 7 was on it.
        let before = Lineage::of(1, &restored, &epochs);
        assert!(before.contains(7, 1) && !before.contains(4, 0));
        // No restore yet: everything of epoch 0.
        assert!(Lineage::of(0, &BTreeMap::new(), &epochs).contains(5, 0));
        // A restored snapshot of unknown epoch ends the walk: nothing older is claimed.
        let unknown = Lineage::of(2, &restored, &BTreeMap::from([(8, 2)]));
        assert!(unknown.contains(8, 2) && !unknown.contains(6, 1));
    }

    fn view(id: u64, epoch: u64) -> SnapshotView {
        SnapshotView {
            id,
            term: 1,
            mode: "CHANDY_LAMPORT".into(),
            status: "COMPLETED".into(),
            failure_kind: String::new(),
            failure: String::new(),
            started_at_ms: 0,
            finished_at_ms: 0,
            channels: Vec::new(),
            nodes: Vec::new(),
            epoch: Some(epoch),
        }
    }

    fn restore(epoch: u64, snapshot: u64) -> Entry {
        Entry::Restore {
            restore_id: format!("restore-{epoch}"),
            snapshot,
            requested_by: "user".into(),
            done: true,
            failure: String::new(),
            started_at_ms: 0,
        }
    }

    #[test]
    fn a_restore_of_a_discarded_history_is_a_violation() {
        let views = [view(1, 0), view(2, 0), view(3, 0), view(4, 1)];
        let snapshots = views.iter().map(|s| (s.id, s)).collect();
        // Restore 1 → epoch 1 (2 and 3 discarded), then 4 → epoch 2, then 1 again: fine.
        let mut good = Verdict::default();
        let entries = [restore(1, 1), restore(2, 4), restore(3, 1)];
        check_restores_stay_in_history(&entries, &snapshots, &mut good);
        assert!(good.violations.is_empty(), "{:?}", good.violations);
        assert_eq!(good.restores_in_history_checked, 3);
        // Restore 1 → epoch 1, then 3 (taken before that restore, discarded by it).
        let mut bad = Verdict::default();
        check_restores_stay_in_history(&[restore(2, 3), restore(1, 1)], &snapshots, &mut bad);
        assert_eq!(bad.violations.len(), 1, "{:?}", bad.violations);
        assert!(bad.violations[0].starts_with("restore-2 restored snapshot 3"));
    }
}
