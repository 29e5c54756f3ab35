//! Snapshot lifecycle to applications: after the coordinator has stored a snapshot's end,
//! every member's application hears it (`SnapshotCompleted` or `SnapshotAborted`), at
//! least once and in id order, and an application that was away hears on reattaching what
//! ended meanwhile. Two pure halves:
//!
//! - [`Told`], the coordinator's: it tells stored ends in id order — an end waits while a
//!   lower id is still open (in flight, or its end not stored) — keeps the newest
//!   [`MAX_TOLD`] outcomes told, and answers a daemon's catch-up from them. Every message it
//!   makes names the id told just before it (`after`), so a daemon sees a gap.
//! - [`Relay`], the daemon's: it follows one application session from the id the
//!   application names at attach, asks the coordinator to catch up (at attach, after every
//!   registration, after a gap, after its queue for a slow application filled), and queues
//!   each outcome above its cursor for the application, in order, once per catch-up.
//!
//! Together: an outcome is told only once stored; an outcome the daemon could have missed
//! (a lost push, a dropped session, a new leader) is asked for again, so delivery is at
//! least once; the cursor only grows, so it is in id order.

use std::collections::{BTreeMap, VecDeque};

use crate::SnapshotId;

/// The most outcomes the coordinator keeps told (and so can tell again on a catch-up), and
/// the most a daemon queues for its application before it waits for it and asks again.
pub const MAX_TOLD: usize = 4096;
/// The longest reason an outcome carries (bytes; cut at a character boundary).
pub const MAX_REASON: usize = 512;

/// How a snapshot ended, as applications hear it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotOutcome {
    /// The snapshot.
    pub snapshot: SnapshotId,
    /// `None`: it completed (stored and verified); `Some(why)`: it failed or was aborted.
    pub failure: Option<String>,
}

impl SnapshotOutcome {
    /// A completed snapshot.
    pub fn completed(snapshot: SnapshotId) -> Self {
        Self {
            snapshot,
            failure: None,
        }
    }

    /// A snapshot that failed or was aborted, for `why` (cut to [`MAX_REASON`]).
    pub fn aborted(snapshot: SnapshotId, why: &str) -> Self {
        Self {
            snapshot,
            failure: Some(cut(why, MAX_REASON).to_owned()),
        }
    }
}

/// `s` cut to at most `max` bytes, at a character boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Outcomes as the coordinator sends them to a daemon: pushed as they are told, or as the
/// answer to a catch-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcomes {
    /// A push: the highest id told before these (every stored end at or below it was told
    /// before). A catch-up's answer: the `after` it was asked.
    pub after: u64,
    /// The outcomes, in increasing id order, all above `after`.
    pub outcomes: Vec<SnapshotOutcome>,
    /// Every stored end at or below this id has been told (it is at least the last of
    /// `outcomes`); later pushes carry only ids above it.
    pub through: u64,
    /// An answer to a catch-up, not a push.
    pub catch_up: bool,
}

/// The coordinator's side: which ends were told, in order.
#[derive(Debug, Default)]
pub struct Told {
    /// Stored ends not told yet: a lower id is still open.
    waiting: BTreeMap<SnapshotId, SnapshotOutcome>,
    /// The newest outcomes told, oldest first.
    told: VecDeque<SnapshotOutcome>,
    /// The highest id told.
    through: u64,
}

impl Told {
    /// At a term's start: the ends stored by earlier terms (every record is ended by then),
    /// as told — a daemon that missed one hears it on its catch-up.
    pub fn loaded(&mut self, outcomes: impl IntoIterator<Item = SnapshotOutcome>) {
        let mut all: BTreeMap<SnapshotId, SnapshotOutcome> =
            self.told.drain(..).map(|o| (o.snapshot, o)).collect();
        for o in outcomes {
            all.insert(o.snapshot, o);
        }
        while all.len() > MAX_TOLD {
            all.pop_first();
        }
        if let Some((id, _)) = all.last_key_value() {
            self.through = self.through.max(id.0);
        }
        self.told = all.into_values().collect();
    }

    /// The end of `outcome`'s snapshot is stored; `lowest_open` is the lowest id still open
    /// (in flight, or its end not stored), if any. Returns the push to broadcast, if any
    /// end can be told now: in id order, each only once every lower id is closed.
    pub fn stored(
        &mut self,
        outcome: SnapshotOutcome,
        lowest_open: Option<SnapshotId>,
    ) -> Option<Outcomes> {
        if self.told.iter().any(|o| o.snapshot == outcome.snapshot) {
            return None; // told already (a term's start loaded it): never twice from here
        }
        self.waiting.insert(outcome.snapshot, outcome);
        self.release(lowest_open)
    }

    /// Tells what waits below `lowest_open` (see [`Self::stored`]).
    pub fn release(&mut self, lowest_open: Option<SnapshotId>) -> Option<Outcomes> {
        let after = self.through;
        let mut outcomes = Vec::new();
        while let Some(entry) = self.waiting.first_entry() {
            if lowest_open.is_some_and(|open| *entry.key() >= open) {
                break;
            }
            let outcome = entry.remove();
            self.through = self.through.max(outcome.snapshot.0);
            self.told.push_back(outcome.clone());
            if self.told.len() > MAX_TOLD {
                self.told.pop_front();
            }
            outcomes.push(outcome);
        }
        (!outcomes.is_empty()).then_some(Outcomes {
            after,
            outcomes,
            through: self.through,
            catch_up: false,
        })
    }

    /// A daemon's catch-up: every outcome told above `after` that is still kept (the
    /// newest [`MAX_TOLD`]), in order.
    pub fn after(&self, after: u64) -> Outcomes {
        Outcomes {
            after,
            outcomes: self
                .told
                .iter()
                .filter(|o| o.snapshot.0 > after)
                .cloned()
                .collect(),
            through: self.through,
            catch_up: true,
        }
    }

    /// The highest id told.
    pub fn through(&self) -> u64 {
        self.through
    }
}

/// The daemon's side: the outcomes due to the attached application.
#[derive(Debug, Default)]
pub struct Relay {
    following: Option<Following>,
}

#[derive(Debug)]
struct Following {
    /// The highest id queued for the application (or named by it at attach).
    cursor: u64,
    /// A catch-up asked with this `after`, not answered yet: pushes are ignored meanwhile
    /// (what they carry is in the answer, or above its `through`).
    asked: Option<u64>,
    /// Outcomes for the application, in order.
    due: VecDeque<SnapshotOutcome>,
    /// The queue filled: ask again from the cursor once it drained.
    behind: bool,
}

impl Relay {
    /// An application attached. `after`: it follows outcomes above this id (`None`: it
    /// does not follow them). Returns the catch-up to ask the coordinator for.
    pub fn attach(&mut self, after: Option<u64>) -> Option<u64> {
        self.following = after.map(|cursor| Following {
            cursor,
            asked: Some(cursor),
            due: VecDeque::new(),
            behind: false,
        });
        after
    }

    /// The application left: nothing is queued for it any more.
    pub fn detach(&mut self) {
        self.following = None;
    }

    /// The daemon registered with a coordinator (perhaps a new leader, perhaps after
    /// pushes were lost with the old session): the catch-up to ask for, if an application
    /// follows.
    pub fn registered(&mut self) -> Option<u64> {
        let f = self.following.as_mut()?;
        f.asked = Some(f.cursor);
        Some(f.cursor)
    }

    /// Outcomes from the coordinator. Returns a catch-up to ask for, if these show a gap.
    pub fn heard(&mut self, heard: Outcomes) -> Option<u64> {
        let f = self.following.as_mut()?;
        if heard.catch_up {
            if f.asked != Some(heard.after) {
                return None; // the answer to an earlier ask: a later one is coming
            }
            f.asked = None;
        } else if f.asked.is_some() || f.behind {
            return None; // what this carries, the answer has (or will ask for)
        } else if heard.after > f.cursor {
            // Outcomes above the cursor were told and not heard (a push dropped).
            f.asked = Some(f.cursor);
            return Some(f.cursor);
        }
        for outcome in heard.outcomes {
            if outcome.snapshot.0 <= f.cursor {
                continue;
            }
            if f.due.len() >= MAX_TOLD {
                // The application is behind: the rest is asked for again once it caught up.
                f.behind = true;
                return None;
            }
            f.cursor = outcome.snapshot.0;
            f.due.push_back(outcome);
        }
        f.cursor = f.cursor.max(heard.through);
        None
    }

    /// Whether an outcome is due to the application.
    pub fn has_due(&self) -> bool {
        self.following.as_ref().is_some_and(|f| !f.due.is_empty())
    }

    /// The next outcome for the application; with it, a catch-up to ask for if the queue
    /// had filled and has now drained.
    pub fn next_due(&mut self) -> (Option<SnapshotOutcome>, Option<u64>) {
        let Some(f) = self.following.as_mut() else {
            return (None, None);
        };
        let next = f.due.pop_front();
        if f.due.is_empty() && f.behind && f.asked.is_none() {
            f.behind = false;
            f.asked = Some(f.cursor);
            return (next, Some(f.cursor));
        }
        (next, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(id: u64) -> SnapshotOutcome {
        SnapshotOutcome::completed(SnapshotId(id))
    }

    fn failed(id: u64) -> SnapshotOutcome {
        SnapshotOutcome::aborted(SnapshotId(id), "node n2 lost")
    }

    fn ids(o: &Outcomes) -> Vec<u64> {
        o.outcomes.iter().map(|o| o.snapshot.0).collect()
    }

    fn drain(relay: &mut Relay) -> Vec<u64> {
        let mut out = Vec::new();
        while let (Some(o), _) = relay.next_due() {
            out.push(o.snapshot.0);
        }
        out
    }

    #[test]
    fn an_end_waits_while_a_lower_id_is_open_and_then_both_go_in_order() {
        let mut told = Told::default();
        // 2 ends first while 1 is still in flight.
        assert_eq!(told.stored(done(2), Some(SnapshotId(1))), None);
        let push = told.stored(failed(1), None).expect("both told");
        assert_eq!(ids(&push), vec![1, 2]);
        assert_eq!((push.after, push.through, push.catch_up), (0, 2, false));
        let push = told.stored(done(3), Some(SnapshotId(4))).expect("told");
        assert_eq!((push.after, ids(&push), push.through), (2, vec![3], 3));
        assert_eq!(ids(&told.after(1)), vec![2, 3]);
        assert!(told.after(1).catch_up);
    }

    #[test]
    fn a_term_tells_nothing_twice_and_keeps_only_the_newest() {
        let mut told = Told::default();
        told.loaded((1..=(MAX_TOLD as u64 + 10)).map(done));
        assert_eq!(told.through(), MAX_TOLD as u64 + 10);
        let all = told.after(0);
        assert_eq!(all.outcomes.len(), MAX_TOLD);
        assert_eq!(all.outcomes[0].snapshot, SnapshotId(11));
        assert_eq!(told.stored(done(20), None), None, "loaded: told already");
    }

    #[test]
    fn a_reason_is_bounded() {
        let long = "é".repeat(MAX_REASON);
        let o = SnapshotOutcome::aborted(SnapshotId(1), &long);
        assert!(o.failure.expect("failed").len() <= MAX_REASON);
    }

    #[test]
    fn a_relay_catches_up_then_follows_pushes_in_order() {
        let mut told = Told::default();
        let mut relay = Relay::default();
        told.stored(done(1), None);
        told.stored(failed(2), None);
        assert_eq!(relay.attach(Some(0)), Some(0));
        // A push while the catch-up is asked is ignored: the answer has it.
        let push = told.stored(done(3), None).expect("told");
        assert_eq!(relay.heard(push), None);
        assert_eq!(relay.heard(told.after(0)), None);
        assert_eq!(drain(&mut relay), vec![1, 2, 3]);
        let push = told.stored(done(4), None).expect("told");
        relay.heard(push);
        assert_eq!(drain(&mut relay), vec![4]);
    }

    #[test]
    fn a_lost_push_is_seen_as_a_gap_and_asked_for() {
        let mut told = Told::default();
        let mut relay = Relay::default();
        relay.attach(Some(0));
        relay.heard(told.after(0));
        let _lost = told.stored(done(1), None);
        let push = told.stored(done(2), None).expect("told");
        assert_eq!(relay.heard(push), Some(0), "a gap above the cursor");
        assert_eq!(relay.heard(told.after(0)), None);
        assert_eq!(drain(&mut relay), vec![1, 2]);
    }

    #[test]
    fn reattach_and_a_new_leader_tell_at_least_once_and_never_backwards() {
        let mut old = Told::default();
        let mut relay = Relay::default();
        relay.attach(Some(0));
        relay.heard(old.after(0));
        relay.heard(old.stored(done(1), None).expect("told"));
        assert_eq!(drain(&mut relay), vec![1]);
        // The application goes away after handling 1; 2 ends meanwhile.
        relay.detach();
        relay.heard(old.stored(done(2), None).expect("told"));
        assert!(!relay.has_due());
        // It comes back naming 1; the old leader is gone, and the new one loaded 1..=3
        // (3 was stored by the old leader but its push never left).
        let mut new = Told::default();
        new.loaded([done(1), done(2), failed(3)]);
        assert_eq!(relay.attach(Some(1)), Some(1));
        assert_eq!(relay.registered(), Some(1));
        // The answer to the first ask is dropped (a later one is coming) only if it names
        // another `after`: both name 1 here, so the first is taken and the second adds
        // nothing.
        relay.heard(new.after(1));
        relay.heard(new.after(1));
        assert_eq!(drain(&mut relay), vec![2, 3]);
        relay.heard(new.stored(done(4), None).expect("told"));
        assert_eq!(drain(&mut relay), vec![4]);
    }

    #[test]
    fn a_slow_application_holds_a_bounded_queue_and_the_rest_is_asked_again() {
        let mut told = Told::default();
        let mut relay = Relay::default();
        relay.attach(Some(0));
        relay.heard(told.after(0));
        let n = MAX_TOLD as u64 + 5;
        for id in 1..=n {
            if let Some(push) = told.stored(done(id), None)
                && let Some(ask) = relay.heard(push)
            {
                panic!("no gap expected, asked {ask}");
            }
        }
        let mut seen = Vec::new();
        let mut ask = None;
        while let (Some(o), again) = relay.next_due() {
            seen.push(o.snapshot.0);
            ask = ask.or(again);
        }
        assert_eq!(seen.len(), MAX_TOLD);
        let ask = ask.expect("asked again once drained");
        assert_eq!(ask, MAX_TOLD as u64);
        relay.heard(told.after(ask));
        seen.extend(drain(&mut relay));
        assert_eq!(seen, (1..=n).collect::<Vec<_>>());
    }

    #[test]
    fn an_application_that_does_not_follow_hears_nothing() {
        let mut told = Told::default();
        let mut relay = Relay::default();
        assert_eq!(relay.attach(None), None);
        relay.heard(told.stored(done(1), None).expect("told"));
        assert_eq!(relay.registered(), None);
        assert!(!relay.has_due());
    }
}
