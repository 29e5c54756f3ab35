//! What the coordinator and the node daemons tell each other about membership, restores and
//! snapshots, as data: the coordinator's task takes and gives these, and only the edges
//! (its RPC handlers and node sessions) meet the wire's messages (`cairn-proto` converts).

use crate::{ChannelId, NodeId, Plan, SnapshotId};

/// A node daemon registering with the coordinator (the first message of its session).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Registration {
    /// The cluster it belongs to.
    pub cluster: String,
    /// Its node id (checked not empty by the coordinator).
    pub node: String,
    /// The address peers reach it at.
    pub address: String,
    /// The daemon's incarnation.
    pub incarnation: u64,
    /// The epoch the daemon is in (0 for a new daemon).
    pub epoch: u64,
    /// The last restore whose state its application applied (empty if none).
    pub applied_restore_id: String,
    /// The highest snapshot id the daemon has seen.
    pub highest_snapshot_id: u64,
}

/// What the coordinator tells one node. Each leaves carrying the leader's term.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeCommand {
    /// The answer to its registration: the membership, with the epoch it is to be in.
    Registered(Membership),
    /// The membership changed.
    Membership(Membership),
    /// Start a snapshot as an initiator.
    Initiate(Plan),
    /// Drop a snapshot that ended without completing.
    Abort {
        /// The snapshot.
        snapshot: SnapshotId,
        /// Why (its failure's sentence).
        reason: String,
    },
    /// Restore a snapshot's state.
    Restore(NodeRestore),
    /// The answer to its leaving: `None` if it was removed, else why not.
    Left(Option<String>),
    /// Snapshot ends told to the applications (pushed in id order as they are stored, or
    /// the answer to the node's catch-up).
    Outcomes(crate::lifecycle::Outcomes),
}

/// A restore as one node is told it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRestore {
    /// The operation's id.
    pub restore_id: String,
    /// The snapshot restored.
    pub snapshot: SnapshotId,
    /// The epoch the node enters with it.
    pub epoch: u64,
}

/// The cluster as a node (and `ListNodes`) sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Membership {
    /// Every node on the roster, connected or not.
    pub nodes: Vec<NodeInfo>,
    /// Every channel of the topology.
    pub channels: Vec<ChannelId>,
    /// The epoch the node is to be in.
    pub epoch: u64,
    /// Nodes removed and not back.
    pub removed: Vec<NodeId>,
}

/// One node of the roster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// Its id.
    pub node: NodeId,
    /// The address its daemon is reached at.
    pub address: String,
    /// The incarnation admitted last.
    pub incarnation: u64,
    /// Whether an application is attached (connected nodes only).
    pub application_attached: bool,
    /// Milliseconds since the Unix epoch of its last heartbeat (0: not connected).
    pub last_seen_ms: u64,
    /// Whether its daemon has a session now.
    pub connected: bool,
    /// Its channels as of its last heartbeat (connected nodes only).
    pub channels: Vec<ChannelStatus>,
}

/// A channel as a daemon reports it in its heartbeat (and `GetNodeStatus` shows it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelStatus {
    /// The channel.
    pub channel: ChannelId,
    /// Whether the stream is up.
    pub connected: bool,
    /// Frames queued or sent and not yet acknowledged (outgoing).
    pub unacked_frames: u64,
    /// Data messages through the channel since the daemon started.
    pub data_messages: u64,
    /// Times the stream reconnected.
    pub reconnects: u64,
    /// Whether an aligned snapshot or a fault holds it back (incoming).
    pub held: bool,
    /// Frames held back (incoming) or items not yet on the wire (outgoing).
    pub queued: u64,
    /// The credit limit granted.
    pub credit_limit: u64,
    /// The next data index.
    pub next_index: u64,
    /// Markers through the channel.
    pub markers: u64,
    /// Held back by an aligned snapshot.
    pub alignment_blocked: bool,
    /// Held back by a fault.
    pub fault_held: bool,
    /// Frames a held channel may still release.
    pub release_budget: u64,
    /// The kind of the next held frame (incoming).
    pub next_held: FrameKind,
}

/// The kind of a frame on a peer channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FrameKind {
    /// None (nothing held).
    #[default]
    None,
    /// A data message.
    Data,
    /// A marker.
    Marker,
}

/// How a snapshot went on a node until its application recorded the state, as the node
/// measured it (its monotonic clock); each absent from a daemon that does not say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateTimes {
    /// Milliseconds from its first sight of the snapshot (a marker, or its initiation) to
    /// its report of the state recorded.
    pub recording_for_ms: Option<u64>,
    /// Milliseconds from that first sight until it asked its application for the state
    /// (ALIGNED: the alignment).
    pub aligned_ms: Option<u64>,
    /// Data messages waiting on its held channels when it asked.
    pub held_messages: Option<u64>,
}

/// What a node's session says happened to a snapshot on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeReport {
    /// It recorded its local state.
    StateRecorded(StateTimes),
    /// Its part failed, for this reason (who it concerns already settled at the edge).
    Failed(crate::FailureReason),
}
