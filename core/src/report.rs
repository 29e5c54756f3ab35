//! What a process reports when its part of a snapshot is complete (why a snapshot can
//! fail is [`crate::failure`]).

use std::collections::BTreeMap;
use std::ops::Range;

use crate::types::{ChannelId, NodeId, SnapshotId};

/// The receiving side of one incoming channel's cut (docs/architecture.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IncomingCut {
    /// Data messages delivered to the application before it recorded its state.
    pub delivered: u64,
    /// Data messages that preceded the snapshot's marker on the channel.
    pub marker_at: u64,
}

impl IncomingCut {
    /// The data indices the receiver records: after its state, before the marker.
    pub fn recorded(&self) -> Range<u64> {
        self.delivered.min(self.marker_at)..self.marker_at
    }
}

/// The sending side of one outgoing channel's cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutgoingCut {
    /// Data messages the application sent on the channel before it recorded its state.
    pub sent: u64,
    /// Data messages that preceded the snapshot's marker on the channel.
    pub marker_at: u64,
}

impl OutgoingCut {
    /// The data indices the sender records: after the marker, before its state (an
    /// unaligned marker overtook them, or the application sent them while the marker was
    /// already out).
    pub fn recorded(&self) -> Range<u64> {
        self.marker_at..self.sent.max(self.marker_at)
    }
}

/// One process's counters for one snapshot, emitted by the engine when the process's part
/// is complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReport {
    /// The snapshot.
    pub id: SnapshotId,
    /// The reporting process.
    pub node: NodeId,
    /// One entry per incoming channel.
    pub incoming: BTreeMap<ChannelId, IncomingCut>,
    /// One entry per outgoing channel.
    pub outgoing: BTreeMap<ChannelId, OutgoingCut>,
}
