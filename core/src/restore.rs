//! Restoring a snapshot, sans-IO: which recorded messages each node replays, and the
//! coordinator's view of one restore operation.
//!
//! A completed snapshot holds, per channel, the messages that were in flight at the cut —
//! recorded at the receiver (Chandy–Lamport, aligned) or partly at the sender (unaligned:
//! what was still queued there). [`replay`] merges what every part recorded for a channel
//! into the one ordered list its receiver must be handed after its state, before any new
//! traffic. The sender of that channel starts the new epoch as if it had already sent and
//! transmitted that many messages on it, and the receiver as if it had received them: the
//! counters of the next snapshot then agree on both ends.
//!
//! ```
//! use cairn_core::restore::replay;
//! use cairn_core::ChannelId;
//!
//! let c = ChannelId::new("a", "b");
//! // The sender recorded message 2 (still queued), the receiver 0 and 1 (in its inbox).
//! let plan = replay([(c.clone(), 2, "m2"), (c.clone(), 0, "m0"), (c.clone(), 1, "m1")]);
//! assert_eq!(plan[&c], ["m0", "m1", "m2"]);
//! ```

use std::collections::{BTreeMap, BTreeSet};

use crate::types::{ChannelId, NodeId};

/// Merges recorded messages `(channel, index, payload)` from every part into each channel's
/// replay list, in index order; an index recorded twice counts once.
pub fn replay<T>(
    recorded: impl IntoIterator<Item = (ChannelId, u64, T)>,
) -> BTreeMap<ChannelId, Vec<T>> {
    let mut by_channel: BTreeMap<ChannelId, BTreeMap<u64, T>> = BTreeMap::new();
    for (channel, index, payload) in recorded {
        by_channel
            .entry(channel)
            .or_default()
            .entry(index)
            .or_insert(payload);
    }
    by_channel
        .into_iter()
        .map(|(channel, messages)| (channel, messages.into_values().collect()))
        .collect()
}

/// How a restore operation stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreState {
    /// Some nodes have not applied their state yet.
    InProgress,
    /// Every node applied its state.
    Done,
    /// It failed; the reason names the nodes.
    Failed(String),
}

/// The coordinator's view of one restore: who must apply, who did.
#[derive(Debug, Clone)]
pub struct RestoreProgress {
    nodes: BTreeSet<NodeId>,
    applied: BTreeSet<NodeId>,
    state: RestoreState,
}

impl RestoreProgress {
    /// A restore every one of `nodes` must apply.
    pub fn new(nodes: impl IntoIterator<Item = NodeId>) -> Self {
        let nodes: BTreeSet<NodeId> = nodes.into_iter().collect();
        let state = if nodes.is_empty() {
            RestoreState::Done
        } else {
            RestoreState::InProgress
        };
        Self {
            nodes,
            applied: BTreeSet::new(),
            state,
        }
    }

    /// The nodes taking part.
    pub fn nodes(&self) -> &BTreeSet<NodeId> {
        &self.nodes
    }

    /// The nodes that applied their state.
    pub fn applied(&self) -> &BTreeSet<NodeId> {
        &self.applied
    }

    /// Where it stands.
    pub fn state(&self) -> &RestoreState {
        &self.state
    }

    /// `node` applied its state. True if that finished the restore.
    pub fn node_applied(&mut self, node: &NodeId) -> bool {
        if self.state != RestoreState::InProgress || !self.nodes.contains(node) {
            return false;
        }
        self.applied.insert(node.clone());
        if self.applied.len() == self.nodes.len() {
            self.state = RestoreState::Done;
            return true;
        }
        false
    }

    /// `node` could not apply its state (or was lost). True if that failed the restore.
    pub fn node_failed(&mut self, node: &NodeId, why: &str) -> bool {
        if self.state != RestoreState::InProgress
            || !self.nodes.contains(node)
            || self.applied.contains(node)
        {
            return false;
        }
        self.state = RestoreState::Failed(format!("node {node}: {why}"));
        true
    }

    /// `node` restarted while the restore was under way. If its previous process applied
    /// its state, it went on from there together with the nodes that applied too (they
    /// took its messages of this epoch), so restoring it alone again would have the new
    /// process send those messages a second time. Whether it applied is known only if its
    /// acknowledgement arrived: one lost with a coordinator or a session is unknown, and
    /// taken as applied. So any restart fails the restore, which starts over for every
    /// node. True if that failed it.
    pub fn node_restarted(&mut self, node: &NodeId) -> bool {
        if self.state != RestoreState::InProgress || !self.nodes.contains(node) {
            return false;
        }
        let what = if self.applied.contains(node) {
            "after applying the restored state"
        } else {
            "during the restore, and whether its previous process applied the restored state \
             is unknown (its acknowledgement may have been lost with a coordinator or a \
             session)"
        };
        self.state = RestoreState::Failed(format!(
            "node {node} restarted {what}; the nodes that applied it may have gone on from it \
             with its previous process, so the restore starts over for every node"
        ));
        true
    }

    /// The deadline passed. True if that failed the restore.
    pub fn timed_out(&mut self) -> bool {
        if self.state != RestoreState::InProgress {
            return false;
        }
        let missing: Vec<&str> = self
            .nodes
            .difference(&self.applied)
            .map(NodeId::as_str)
            .collect();
        self.state = RestoreState::Failed(format!(
            "timed out waiting for {} to apply the restored state",
            missing.join(", ")
        ));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_merges_both_ends_in_order_without_duplicates() {
        let ab = ChannelId::new("a", "b");
        let ba = ChannelId::new("b", "a");
        let plan = replay([
            (ab.clone(), 5, 50),
            (ba.clone(), 0, 7),
            (ab.clone(), 3, 30),
            (ab.clone(), 5, 99),
            (ab.clone(), 4, 40),
        ]);
        assert_eq!(plan[&ab], [30, 40, 50]);
        assert_eq!(plan[&ba], [7]);
        assert!(replay(Vec::<(ChannelId, u64, u8)>::new()).is_empty());
    }

    #[test]
    fn a_restore_is_done_when_every_node_applied() {
        let mut r = RestoreProgress::new([NodeId::from("a"), NodeId::from("b")]);
        assert!(!r.node_applied(&NodeId::from("a")));
        assert!(!r.node_applied(&NodeId::from("zz")), "not a participant");
        assert!(
            !r.node_failed(&NodeId::from("a"), "late"),
            "a already applied"
        );
        assert!(r.node_applied(&NodeId::from("b")));
        assert_eq!(r.state(), &RestoreState::Done);
        assert!(!r.timed_out());
    }

    #[test]
    fn a_failure_or_the_deadline_names_the_nodes() {
        let mut r = RestoreProgress::new([NodeId::from("a"), NodeId::from("b")]);
        r.node_applied(&NodeId::from("a"));
        assert!(r.timed_out());
        assert_eq!(
            r.state(),
            &RestoreState::Failed("timed out waiting for b to apply the restored state".into())
        );
        let mut r = RestoreProgress::new([NodeId::from("a")]);
        assert!(r.node_failed(&NodeId::from("a"), "session lost"));
        assert_eq!(
            r.state(),
            &RestoreState::Failed("node a: session lost".into())
        );
        assert!(!r.node_applied(&NodeId::from("a")));
    }

    #[test]
    fn a_node_restarted_during_a_restore_fails_it_whether_or_not_it_was_heard_applying() {
        let mut r = RestoreProgress::new([NodeId::from("a"), NodeId::from("b")]);
        assert!(
            !r.node_restarted(&NodeId::from("c")),
            "not one of its nodes"
        );
        r.node_applied(&NodeId::from("a"));
        assert!(r.node_restarted(&NodeId::from("a")));
        assert!(
            matches!(r.state(), RestoreState::Failed(why) if why.contains("node a restarted after applying")),
            "{:?}",
            r.state()
        );
        assert!(!r.node_applied(&NodeId::from("b")));
        // Not heard applying: its acknowledgement may have been lost, so it may have.
        let mut r = RestoreProgress::new([NodeId::from("a"), NodeId::from("b")]);
        assert!(r.node_restarted(&NodeId::from("a")));
        assert!(
            matches!(r.state(), RestoreState::Failed(why) if why.contains("is unknown")),
            "{:?}",
            r.state()
        );
        assert!(!r.node_restarted(&NodeId::from("b")), "failed once");
    }
}
