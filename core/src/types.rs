//! The domain's names: nodes, channels, snapshot ids and modes, and a snapshot's plan.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A process's stable id (`n1`, or a StatefulSet pod name). Shared, so that the copies a
/// channel id makes for every message on the daemons' hot paths cost no allocation.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(Arc<str>);

impl NodeId {
    /// Wraps an id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(Arc::from(id.into()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for NodeId {
    fn from(id: &str) -> Self {
        Self::new(id)
    }
}

impl From<String> for NodeId {
    fn from(id: String) -> Self {
        Self::new(id)
    }
}

/// A snapshot's cluster-unique, increasing id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SnapshotId(pub u64);

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A directed channel `from → to`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChannelId {
    /// The sending process.
    pub from: NodeId,
    /// The receiving process.
    pub to: NodeId,
}

impl ChannelId {
    /// The channel `from → to`.
    pub fn new(from: impl Into<NodeId>, to: impl Into<NodeId>) -> Self {
        Self {
            from: from.into(),
            to: to.into(),
        }
    }
}

impl fmt::Display for ChannelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}->{}", self.from, self.to)
    }
}

/// How a snapshot's markers travel (docs/architecture.md §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum SnapshotMode {
    /// Markers travel in order behind queued messages.
    #[default]
    ChandyLamport,
    /// The record request and the markers overtake queued messages, which become channel
    /// state (Flink FLIP-76).
    Unaligned,
    /// A process blocks each incoming channel once its marker arrived and records when the
    /// markers of all its non-feedback channels arrived (Flink's aligned checkpoints).
    Aligned,
}

impl fmt::Display for SnapshotMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::ChandyLamport => "CHANDY_LAMPORT",
            Self::Unaligned => "UNALIGNED",
            Self::Aligned => "ALIGNED",
        })
    }
}

/// What every process needs to know to take part in a snapshot. Every marker carries it,
/// so a process that meets a snapshot first through a marker knows how to take part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The snapshot's id.
    pub id: SnapshotId,
    /// How markers travel.
    pub mode: SnapshotMode,
    /// The processes that record spontaneously; with the topology they determine the
    /// feedback channels of an aligned snapshot.
    pub initiators: BTreeSet<NodeId>,
    /// Aligned mode: after this long aligning, a process switches to unaligned recording.
    pub alignment_timeout: Option<Duration>,
    /// Carried by a marker that overtook because the alignment timeout passed at its
    /// sender: the snapshot has taken longer than its timeout, so the receiver stops
    /// aligning at once rather than start its own timeout (the timeout runs from the
    /// snapshot's start, as Flink's does, without comparing clocks).
    pub timed_out: bool,
    /// When the snapshot started, in milliseconds since the Unix epoch by the clock of
    /// whoever started it (0: not known). A node counts its alignment timeout from here
    /// rather than from when it joined, as Flink counts from the checkpoint's start; a
    /// clock that disagrees only moves the timeout, never the cut.
    pub started_at_ms: u64,
}

impl Plan {
    /// A plan with one initiator and no alignment timeout.
    pub fn new(id: u64, mode: SnapshotMode, initiator: impl Into<NodeId>) -> Self {
        Self {
            id: SnapshotId(id),
            mode,
            initiators: BTreeSet::from([initiator.into()]),
            alignment_timeout: None,
            timed_out: false,
            started_at_ms: 0,
        }
    }
}
