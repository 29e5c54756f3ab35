//! Messages handed to the application and not yet known to be consumed, kept while a cut
//! may still fall before them. A record request that overtakes the inbox also goes to the
//! application ahead of its deliveries (its early copy, on `App/Consumed`): the
//! application may then cut between two messages it was handed, and names the cut by the
//! messages it had consumed. Those handed over before the request and consumed after the
//! cut were in flight at it: they are recorded as channel state, from here. Flink does the
//! same with its input buffers' unconsumed data when a barrier overtakes them (FLIP-76).
//!
//! What is kept is bounded by the delivery window: entries go as the application's
//! consumption counts pass them, except after the count an early request was sent at, until
//! that request's cut is known; deliveries wait while twice the window is kept.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;
use cairn_core::{ChannelId, SnapshotId};

/// One message handed over.
#[derive(Debug)]
struct Message {
    channel: ChannelId,
    generation: u64,
    index: u64,
    payload: Bytes,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Handed {
    /// Consecutive messages handed over, the first being the `from`-th of the session (from
    /// 0).
    kept: VecDeque<Message>,
    from: u64,
    bytes: u64,
    /// Early requests whose cut is not known: it falls at or after these consumed counts.
    pins: BTreeMap<SnapshotId, u64>,
    /// Where each request's in-band copy was handed over (messages handed before it).
    asked: BTreeMap<SnapshotId, u64>,
    /// Requests whose early copy went out and whose in-band copy has not been handed over.
    early: BTreeSet<SnapshotId>,
}

impl Handed {
    /// The `at`-th message of the session (from 0) was handed over; kept if `keep` (the
    /// application acknowledges what it consumes), else nothing before it can be.
    pub(crate) fn push(
        &mut self,
        at: u64,
        keep: bool,
        channel: &ChannelId,
        generation: u64,
        index: u64,
        payload: &Bytes,
    ) {
        if !keep || self.from.saturating_add(self.kept.len() as u64) != at {
            self.kept.clear();
            self.bytes = 0;
            self.from = at;
        }
        if !keep {
            self.from = at.saturating_add(1);
            return;
        }
        self.bytes = self.bytes.saturating_add(payload.len() as u64);
        self.kept.push_back(Message {
            channel: channel.clone(),
            generation,
            index,
            payload: payload.clone(),
        });
    }

    /// The application has consumed `consumed` messages: what no cut can fall before goes.
    pub(crate) fn consumed(&mut self, consumed: u64) {
        let floor = self
            .pins
            .values()
            .copied()
            .min()
            .map_or(consumed, |pin| pin.min(consumed));
        while self.from < floor {
            let Some(m) = self.kept.pop_front() else {
                self.from = floor;
                break;
            };
            self.bytes = self.bytes.saturating_sub(m.payload.len() as u64);
            self.from += 1;
        }
    }

    /// Whether as much as `limit` (messages, bytes) is kept: deliveries wait.
    pub(crate) fn full(&self, limit: (u64, u64)) -> bool {
        self.kept.len() as u64 >= limit.0 || self.bytes >= limit.1
    }

    /// An early copy of `id`'s request went out with `handed` messages handed over and
    /// `consumed` known consumed.
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

    /// The request of `id` will not be answered (aborted, or its state is in).
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
        self.forget(id);
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
            // Where it was asked (what it consumed since may be gone already).
            return Ok(Vec::new());
        }
        if consumed < self.from {
            return Err(format!(
                "the application cut its state after {consumed} messages consumed, before \
                 what the daemon kept of the {asked} it handed over before asking (from {})",
                self.from
            ));
        }
        let mut unconsumed: BTreeMap<ChannelId, u64> = BTreeMap::new();
        let skip = (consumed - self.from) as usize;
        let take = (asked - consumed) as usize;
        if self.kept.len() < skip + take {
            return Err(format!(
                "the application cut its state after {consumed} messages consumed, but the \
                 daemon kept messages {} to {} only",
                self.from,
                self.from + self.kept.len() as u64
            ));
        }
        for m in self.kept.iter().skip(skip).take(take) {
            // A channel reset since fails the snapshot anyway; its old messages do not count.
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
        // The application goes on consuming: nothing after the pin goes.
        h.consumed(4);
        assert_eq!(h.from, 1);
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
        h.consumed(4);
        assert_eq!((h.from, h.kept.len()), (4, 1));
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
        assert!(before.contains("before what the daemon kept"), "{before}");
        // Where it was asked, or with no count (an application that predates early cuts):
        // no channel state — even once what it consumed since is gone.
        h.asked_early(SnapshotId(3), 4, 2);
        assert_eq!(h.cut(SnapshotId(3), Some(4), current), Ok(vec![]));
        h.asked_in_band(SnapshotId(6), 3);
        h.consumed(4);
        assert_eq!(h.cut(SnapshotId(6), Some(3), current), Ok(vec![]));
        h.asked_early(SnapshotId(4), 4, 2);
        assert_eq!(h.cut(SnapshotId(4), None, current), Ok(vec![]));
        // Without acknowledgements nothing is kept, and an early count cannot be matched.
        h.push(4, false, &ch("a"), 0, 4, &Bytes::new());
        h.asked_in_band(SnapshotId(5), 5);
        let unkept = h.cut(SnapshotId(5), Some(4), current).unwrap_err();
        assert!(unkept.contains("before what the daemon kept"), "{unkept}");
    }
}
