//! Why a snapshot can fail: each reason names the process or channel concerned.

use std::fmt;

use crate::types::{ChannelId, NodeId};
use crate::verifier::Violation;

/// Why a snapshot failed or was aborted. Each names the process or channel concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureReason {
    /// The snapshot passed its timeout waiting for these processes.
    Timeout {
        /// The processes that had not recorded their state, or else not reported.
        missing: Vec<NodeId>,
    },
    /// A participant crashed, left or restarted.
    NodeLost(NodeId),
    /// A channel was reset: its peer came back with a new incarnation.
    ChannelReset(ChannelId),
    /// The verifier rejected the cut.
    Inconsistent(Violation),
    /// The process had no application attached when it had to record its local state.
    NoApplication(NodeId),
    /// The coordinator restarted while the snapshot was in flight.
    CoordinatorRestarted,
    /// The coordinator that led the snapshot lost its leadership; the next leader failed
    /// it when it took over (what happened, for people).
    CoordinatorFailover(String),
    /// A restore fenced the cluster with a new epoch.
    Restore,
    /// A process shut down while the snapshot was in flight.
    Shutdown(NodeId),
    /// Storing the snapshot's parts failed: the nodes whose parts could not be stored (none
    /// when it was the snapshot's record), and why.
    Storage {
        /// The nodes whose parts failed.
        nodes: Vec<NodeId>,
        /// What failed, for people.
        why: String,
    },
    /// A user aborted it.
    Aborted(String),
    /// The membership or the topology changed while it was in flight (what changed).
    MembershipChanged(String),
    /// A part was recorded in another epoch than the snapshot's: a cut across a restore is
    /// no cut. Names the nodes that disagree with the snapshot.
    MixedEpochs {
        /// The nodes whose part disagrees.
        nodes: Vec<NodeId>,
        /// What each part says, for people.
        detail: String,
    },
    /// A process's application cut its state where the process cannot place the cut (it
    /// cut at a record request's early copy, docs/architecture.md §4.2, and named a count
    /// of consumed messages that does not match what it was handed).
    BadCut {
        /// The process.
        node: NodeId,
        /// Why, for people.
        why: String,
    },
}

/// What kind of reason a [`FailureReason`] is: its stable word is how the store, the wire's
/// JSON and scripts name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// [`FailureReason::Aborted`]: stored as `ABORTED`.
    Aborted,
    /// [`FailureReason::Timeout`].
    Timeout,
    /// [`FailureReason::NodeLost`].
    NodeLost,
    /// [`FailureReason::ChannelReset`].
    ChannelReset,
    /// [`FailureReason::Inconsistent`].
    Inconsistent,
    /// [`FailureReason::NoApplication`].
    NoApplication,
    /// [`FailureReason::CoordinatorRestarted`].
    CoordinatorRestarted,
    /// [`FailureReason::Restore`].
    Restore,
    /// [`FailureReason::Shutdown`].
    Shutdown,
    /// [`FailureReason::Storage`].
    Storage,
    /// [`FailureReason::MembershipChanged`].
    MembershipChanged,
    /// [`FailureReason::MixedEpochs`].
    MixedEpochs,
    /// [`FailureReason::CoordinatorFailover`].
    CoordinatorFailover,
    /// [`FailureReason::BadCut`].
    BadCut,
}

impl FailureKind {
    /// Every kind.
    pub const ALL: [Self; 14] = [
        Self::Aborted,
        Self::Timeout,
        Self::NodeLost,
        Self::ChannelReset,
        Self::Inconsistent,
        Self::NoApplication,
        Self::CoordinatorRestarted,
        Self::Restore,
        Self::Shutdown,
        Self::Storage,
        Self::MembershipChanged,
        Self::MixedEpochs,
        Self::CoordinatorFailover,
        Self::BadCut,
    ];

    /// The kind's stable word, as the store and scripts spell it.
    pub fn word(self) -> &'static str {
        match self {
            Self::Aborted => "ABORTED",
            Self::Timeout => "TIMEOUT",
            Self::NodeLost => "NODE_LOST",
            Self::ChannelReset => "CHANNEL_RESET",
            Self::Inconsistent => "INCONSISTENT",
            Self::NoApplication => "NO_APPLICATION",
            Self::CoordinatorRestarted => "COORDINATOR_RESTARTED",
            Self::Restore => "RESTORE",
            Self::Shutdown => "SHUTDOWN",
            Self::Storage => "STORAGE",
            Self::MembershipChanged => "MEMBERSHIP_CHANGED",
            Self::MixedEpochs => "MIXED_EPOCHS",
            Self::CoordinatorFailover => "COORDINATOR_FAILOVER",
            Self::BadCut => "BAD_CUT",
        }
    }

    /// The kind of a stable word ([`Self::word`]'s inverse); `None` for a word no kind has.
    pub fn of_word(word: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.word() == word)
    }
}

impl FailureReason {
    /// Its kind.
    pub fn kind(&self) -> FailureKind {
        match self {
            Self::Timeout { .. } => FailureKind::Timeout,
            Self::NodeLost(_) => FailureKind::NodeLost,
            Self::ChannelReset(_) => FailureKind::ChannelReset,
            Self::Inconsistent(_) => FailureKind::Inconsistent,
            Self::NoApplication(_) => FailureKind::NoApplication,
            Self::CoordinatorRestarted => FailureKind::CoordinatorRestarted,
            Self::CoordinatorFailover(_) => FailureKind::CoordinatorFailover,
            Self::Restore => FailureKind::Restore,
            Self::Shutdown(_) => FailureKind::Shutdown,
            Self::Storage { .. } => FailureKind::Storage,
            Self::Aborted(_) => FailureKind::Aborted,
            Self::MembershipChanged(_) => FailureKind::MembershipChanged,
            Self::MixedEpochs { .. } => FailureKind::MixedEpochs,
            Self::BadCut { .. } => FailureKind::BadCut,
        }
    }

    /// The nodes it names (none for a kind that names none).
    pub fn nodes(&self) -> Vec<NodeId> {
        match self {
            Self::Timeout { missing: nodes }
            | Self::Storage { nodes, .. }
            | Self::MixedEpochs { nodes, .. } => nodes.clone(),
            Self::NodeLost(node)
            | Self::NoApplication(node)
            | Self::Shutdown(node)
            | Self::BadCut { node, .. } => {
                vec![node.clone()]
            }
            Self::ChannelReset(_)
            | Self::Inconsistent(_)
            | Self::CoordinatorRestarted
            | Self::CoordinatorFailover(_)
            | Self::Restore
            | Self::Aborted(_)
            | Self::MembershipChanged(_) => Vec::new(),
        }
    }

    /// The channel it names, for a channel's reset.
    pub fn channel(&self) -> Option<&ChannelId> {
        match self {
            Self::ChannelReset(channel) => Some(channel),
            _ => None,
        }
    }

    /// The reason's own words beyond its kind, its nodes and its channel: what its
    /// sentence says after the kind's words. Empty for a kind that has none.
    pub fn detail(&self) -> String {
        match self {
            Self::Inconsistent(violation) => violation.to_string(),
            Self::CoordinatorFailover(what)
            | Self::MembershipChanged(what)
            | Self::Aborted(what) => what.clone(),
            Self::MixedEpochs { detail, .. } => detail.clone(),
            Self::Storage { why, .. } | Self::BadCut { why, .. } => why.clone(),
            Self::Timeout { .. }
            | Self::NodeLost(_)
            | Self::ChannelReset(_)
            | Self::NoApplication(_)
            | Self::CoordinatorRestarted
            | Self::Restore
            | Self::Shutdown(_) => String::new(),
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Timeout { missing } => {
                write!(f, "timed out waiting for ")?;
                let names: Vec<&str> = missing.iter().map(NodeId::as_str).collect();
                f.write_str(&names.join(", "))
            }
            Self::NodeLost(node) => write!(f, "node {node} was lost"),
            Self::ChannelReset(channel) => write!(f, "channel {channel} was reset"),
            Self::Inconsistent(violation) => write!(f, "inconsistent cut: {violation}"),
            Self::NoApplication(node) => write!(f, "node {node} has no application attached"),
            Self::CoordinatorRestarted => f.write_str("coordinator restarted"),
            Self::CoordinatorFailover(what) => write!(f, "coordinator failover: {what}"),
            Self::Restore => f.write_str("a restore started a new epoch"),
            Self::Shutdown(node) => write!(f, "node {node} shut down"),
            Self::MembershipChanged(what) => write!(f, "membership changed: {what}"),
            Self::MixedEpochs { detail, .. } => {
                write!(f, "parts recorded in different epochs: {detail}")
            }
            Self::Storage { why, .. } => write!(f, "storage failed: {why}"),
            Self::Aborted(why) => write!(f, "aborted: {why}"),
            Self::BadCut { node, why } => write!(f, "bad cut at node {node}: {why}"),
        }
    }
}
