//! Messages handed to the application and not yet known to be consumed, kept while a cut
//! may still fall before them. A record request that overtakes the inbox also goes to the
//! application ahead of its deliveries (its early copy, on `App/Consumed`): the
//! application may then cut between two messages it was handed, and names the cut by the
//! messages it had consumed. Those handed over before the request and consumed after the
//! cut were in flight at it: they are recorded as channel state, from here. Flink does the
//! same with its input buffers' unconsumed data when a barrier overtakes them (FLIP-76).
//!
//! What is kept is bounded by the delivery window: a message goes once the application's
//! consumption count passes it, unless an early request's cut may still fall before it —
//! between the count known when the early copy went out and the request's place, at most a
//! window — until that request's cut is known. Nothing waits for a cut: deliveries go on.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;
use cairn_core::{ChannelId, SnapshotId};

/// One message handed over.
#[derive(Debug)]
struct Message {
    /// Its place among the messages handed over in the session (from 0).
    at: u64,
    channel: ChannelId,
    generation: u64,
    index: u64,
    payload: Bytes,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Handed {
    /// Messages handed over, in order (with gaps where none can be needed).
    kept: VecDeque<Message>,
    /// Their payload bytes.
    kept_bytes: u64,
    /// What the application says it consumed.
    acked: u64,
    /// Early requests whose cut is not known: it falls at or after these consumed counts.
    pins: BTreeMap<SnapshotId, u64>,
    /// Where each request's in-band copy was handed over (messages handed before it).
    asked: BTreeMap<SnapshotId, u64>,
    /// Requests whose early copy went out and whose in-band copy has not been handed over.
    early: BTreeSet<SnapshotId>,
}

impl Handed {
    /// Kept messages start at the session's `at`-th (an epoch or a membership changed:
    /// nothing before is the current channels').
    pub(crate) fn starting_at(at: u64) -> Self {
        Self {
            acked: at,
            ..Self::default()
        }
    }

    /// The `at`-th message of the session (from 0) was handed over; kept only if `keep`
    /// (the application acknowledges what it consumes).
    pub(crate) fn push(
        &mut self,
        at: u64,
        keep: bool,
        channel: &ChannelId,
        generation: u64,
        index: u64,
        payload: &Bytes,
    ) {
        if keep {
            self.kept_bytes = self.kept_bytes.saturating_add(payload.len() as u64);
            self.kept.push_back(Message {
                at,
                channel: channel.clone(),
                generation,
                index,
                payload: payload.clone(),
            });
        }
    }

    /// Messages kept, and their payload bytes.
    pub(crate) fn size(&self) -> (u64, u64) {
        (self.kept.len() as u64, self.kept_bytes)
    }

    /// Whether a cut may still fall before the `at`-th message.
    fn needed(&self, at: u64) -> bool {
        at >= self.acked
            || self
                .pins
                .iter()
                .any(|(id, pin)| *pin <= at && self.asked.get(id).is_some_and(|a| at < *a))
    }

    /// The application has consumed `consumed` messages: what no cut can fall before goes.
    pub(crate) fn consumed(&mut self, consumed: u64) {
        self.acked = self.acked.max(consumed);
        if self.pins.is_empty() {
            while self.kept.front().is_some_and(|m| m.at < self.acked) {
                if let Some(m) = self.kept.pop_front() {
                    self.kept_bytes = self.kept_bytes.saturating_sub(m.payload.len() as u64);
                }
            }
        } else {
            let kept = std::mem::take(&mut self.kept);
            self.kept = kept.into_iter().filter(|m| self.needed(m.at)).collect();
            self.kept_bytes = self.kept.iter().map(|m| m.payload.len() as u64).sum();
        }
    }

    /// An early copy of `id`'s request went out with `handed` messages handed over (the
    /// in-band copy's place) and `consumed` known consumed.
    pub(crate) fn asked_early(&mut self, id: SnapshotId, handed: u64, consumed: u64) {
        self.pins.insert(id, consumed);
        self.asked.insert(id, handed);
        self.early.insert(id);
    }

    /// `id`'s in-band request is handed over after `handed` messages; whether its early
    /// copy went out before (it was asked then, at the same place).
    pub(crate) fn asked_in_band(&mut self, id: SnapshotId, handed: u64) -> bool {
        if self.early.remove(&id) {
            return true;
        }
        self.asked.insert(id, handed);
        false
    }

    /// The request of `id` will not be answered (aborted, or its state is in). What it
    /// kept goes at the next [`Self::consumed`] (not before: the cut's messages are copied
    /// from here once it is placed).
    pub(crate) fn forget(&mut self, id: SnapshotId) {
        self.pins.remove(&id);
        self.asked.remove(&id);
    }

    /// The application cut `id`'s state after `consumed` messages (`None`: where it was
    /// asked). For each incoming channel (of its current `generation`, from `current`), how
    /// many of the messages handed over before the request it had not consumed. An error
    /// says why the cut cannot be placed; the snapshot fails with it.
    pub(crate) fn cut(
        &mut self,
        id: SnapshotId,
        consumed: Option<u64>,
        current: impl Fn(&ChannelId) -> Option<u64>,
    ) -> Result<Vec<(ChannelId, u64)>, String> {
        let asked = self.asked.get(&id).copied();
        let early = self.pins.contains_key(&id);
        let counted = self.count(consumed, asked, early, current);
        self.forget(id);
        counted
    }

    fn count(
        &self,
        consumed: Option<u64>,
        asked: Option<u64>,
        early: bool,
        current: impl Fn(&ChannelId) -> Option<u64>,
    ) -> Result<Vec<(ChannelId, u64)>, String> {
        let (Some(consumed), Some(asked)) = (consumed, asked) else {
            return Ok(Vec::new());
        };
        if consumed > asked {
            return Err(format!(
                "the application cut its state after {consumed} messages consumed, but was \
                 asked after {asked} handed over"
            ));
        }
        if consumed == asked {
            return Ok(Vec::new());
        }
        if !early {
            return Err(format!(
                "the application cut its state after {consumed} messages consumed, before \
                 the {asked} handed over ahead of a request that had no early copy"
            ));
        }
        let between = |m: &&Message| (consumed..asked).contains(&m.at);
        let found = self.kept.iter().filter(between).count() as u64;
        if found != asked - consumed {
            return Err(format!(
                "the application cut its state after {consumed} messages consumed, before \
                 what the daemon kept of the {asked} it handed over ahead of the request \
                 ({found} of the {} after the cut)",
                asked - consumed
            ));
        }
        let mut unconsumed: BTreeMap<ChannelId, u64> = BTreeMap::new();
        for m in self.kept.iter().filter(between) {
            // A channel reset or removed since holds no snapshot's messages (its messages
            // of an older instance are in no cut of the current one).
            if current(&m.channel) == Some(m.generation) {
                *unconsumed.entry(m.channel.clone()).or_default() += 1;
            }
        }
        Ok(unconsumed.into_iter().collect())
    }

    /// The payloads of `indices` of `channel` (of `generation`) kept here, in order.
    pub(crate) fn copy(
        &self,
        channel: &ChannelId,
        generation: u64,
        indices: &std::ops::Range<u64>,
    ) -> Vec<(u64, Bytes)> {
        self.kept
            .iter()
            .filter(|m| {
                &m.channel == channel && m.generation == generation && indices.contains(&m.index)
            })
            .map(|m| (m.index, m.payload.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ch(from: &str) -> ChannelId {
        ChannelId::new(from, "b")
    }

    fn hand(h: &mut Handed, at: u64, from: &str, index: u64) {
        h.push(
            at,
            true,
            &ch(from),
            0,
            index,
            &Bytes::from(format!("{from}{index}")),
        );
    }

    fn ats(h: &Handed) -> Vec<u64> {
        h.kept.iter().map(|m| m.at).collect()
    }

    #[test]
    fn an_early_cut_names_per_channel_what_was_handed_before_the_request_and_not_consumed() {
        let mut h = Handed::default();
        // a0 a1 c0 a2 c1 handed (0..5); the application acknowledged 1.
        for (at, (from, index)) in [("a", 0), ("a", 1), ("c", 0), ("a", 2), ("c", 1)]
            .into_iter()
            .enumerate()
        {
            hand(&mut h, at as u64, from, index);
        }
        h.consumed(1);
        h.asked_early(SnapshotId(7), 5, 1);
        // Deliveries go on (a3, a4); the application goes on consuming: of what it
        // consumed, only what the cut may fall before stays.
        hand(&mut h, 5, "a", 3);
        hand(&mut h, 6, "a", 4);
        h.consumed(6);
        assert_eq!(ats(&h), vec![1, 2, 3, 4, 6]);
        // It had cut after 2: c0 a2 c1 were in flight.
        let current = |_: &ChannelId| Some(0);
        assert_eq!(
            h.cut(SnapshotId(7), Some(2), current),
            Ok(vec![(ch("a"), 1), (ch("c"), 2)])
        );
        assert_eq!(
            h.copy(&ch("c"), 0, &(0..2)),
            vec![(0, Bytes::from("c0")), (1, Bytes::from("c1"))]
        );
        // The cut is known: the pin is gone, and what was consumed goes.
        h.consumed(6);
        assert_eq!(ats(&h), vec![6]);
        // The in-band copy, handed over later, is known as the early one's.
        assert!(h.asked_in_band(SnapshotId(7), 5));
        assert!(!h.asked_in_band(SnapshotId(8), 5));
    }

    #[test]
    fn a_cut_that_cannot_be_placed_is_refused() {
        let mut h = Handed::default();
        for at in 0..4 {
            hand(&mut h, at, "a", at);
        }
        h.consumed(2);
        let current = |_: &ChannelId| Some(0);
        h.asked_early(SnapshotId(1), 4, 2);
        let after = h.cut(SnapshotId(1), Some(5), current).unwrap_err();
        assert!(
            after.contains("after 5 messages consumed, but was asked after 4"),
            "{after}"
        );
        h.asked_early(SnapshotId(2), 4, 2);
        let before = h.cut(SnapshotId(2), Some(1), current).unwrap_err();
        assert!(before.contains("(2 of the 3 after the cut)"), "{before}");
        // Where it was asked, or with no count (an application that predates early cuts):
        // no channel state — even once what it consumed since is gone.
        h.asked_early(SnapshotId(3), 4, 2);
        assert_eq!(h.cut(SnapshotId(3), Some(4), current), Ok(vec![]));
        h.asked_in_band(SnapshotId(6), 3);
        h.consumed(4);
        assert_eq!(h.cut(SnapshotId(6), Some(3), current), Ok(vec![]));
        h.asked_early(SnapshotId(4), 4, 2);
        assert_eq!(h.cut(SnapshotId(4), None, current), Ok(vec![]));
        // Before the place of a request that had no early copy.
        h.asked_in_band(SnapshotId(5), 4);
        let in_band = h.cut(SnapshotId(5), Some(3), current).unwrap_err();
        assert!(in_band.contains("had no early copy"), "{in_band}");
        // Without acknowledgements nothing is kept, and an early count cannot be matched.
        h.push(4, false, &ch("a"), 0, 4, &Bytes::new());
        h.asked_early(SnapshotId(9), 5, 4);
        let unkept = h.cut(SnapshotId(9), Some(4), current).unwrap_err();
        assert!(unkept.contains("(0 of the 1 after the cut)"), "{unkept}");
        // A fresh start (a new epoch): nothing before it is kept or needed.
        let h = Handed::starting_at(9);
        assert_eq!((h.acked, h.kept.len()), (9, 0));
    }

    #[test]
    fn what_is_kept_is_counted_in_messages_and_bytes() {
        let mut h = Handed::default();
        let c = ChannelId::new("a", "b");
        for at in 0..4 {
            h.push(at, true, &c, 0, at, &Bytes::from(vec![0u8; 10]));
        }
        h.push(4, false, &c, 0, 4, &Bytes::from(vec![0u8; 10]));
        assert_eq!(h.size(), (4, 40));
        h.consumed(3);
        assert_eq!(h.size(), (1, 10), "the three consumed go");
        h.asked_early(SnapshotId(1), 5, 3);
        h.consumed(5);
        assert_eq!(h.size(), (1, 10), "a pinned cut keeps it");
    }
}
