//! The daemon's errors, each with a deliberate gRPC status code.

use cairn_core::{ChannelId, FailureReason, NodeId, SnapshotId};
use tonic::{Code, Status};

use cairn_proto::convert::ConvertError;

/// What can go wrong serving a request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A message that cannot become a domain value (a field missing or invalid).
    #[error("invalid input: {0}")]
    InvalidInput(#[from] ConvertError),
    /// The request or frame is malformed in a way the daemon checks itself (a stream
    /// that does not begin with its handshake, a frame with nothing in it, …).
    #[error("invalid input: {0}")]
    Malformed(String),
    /// A peer of another cluster.
    #[error("cluster mismatch: this node is in cluster `{ours}`, the peer says `{theirs}`")]
    WrongCluster {
        /// Ours.
        ours: String,
        /// Theirs.
        theirs: String,
    },
    /// A node that is not a member, or a channel that is not in the topology.
    #[error("unknown node or channel: {0}")]
    Unknown(String),
    /// A frame whose sequence number leaves a gap.
    #[error("frame out of sequence on {channel}: expected {expected}, got {got}")]
    OutOfSequence {
        /// The channel.
        channel: ChannelId,
        /// The next sequence number expected.
        expected: u64,
        /// What arrived.
        got: u64,
    },
    /// A payload larger than allowed.
    #[error("payload of {size} bytes exceeds the limit of {limit}")]
    PayloadTooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// An application is already attached.
    #[error("an application session is already attached to node {0}")]
    AlreadyAttached(NodeId),
    /// No snapshot part with that id.
    #[error("snapshot {0} has no complete part on this node (yet)")]
    NoSuchPart(SnapshotId),
    /// The snapshot already exists on this node.
    #[error("snapshot {0} is already known to this node")]
    DuplicateSnapshot(SnapshotId),
    /// The snapshot failed on this node.
    #[error("snapshot {id} failed on this node: {reason}")]
    SnapshotFailed {
        /// The snapshot.
        id: SnapshotId,
        /// Why.
        reason: FailureReason,
    },
    /// The two ends of a channel are in different epochs (one of them has not restored
    /// yet); the sender retries until they agree.
    #[error("{channel}: the sender is in epoch {theirs}, this node in epoch {ours}")]
    EpochMismatch {
        /// The channel.
        channel: ChannelId,
        /// This node's epoch.
        ours: u64,
        /// The sender's.
        theirs: u64,
    },
    /// A peer stream from a daemon incarnation the coordinator has not admitted for that
    /// node id: a second process with the same id, or a restarted one the membership has
    /// not caught up with yet (it retries).
    #[error(
        "{channel}: node {node} is admitted as incarnation {admitted}, not {claimed}: a \
         second daemon with that node id, or one not yet admitted by the coordinator"
    )]
    NotAdmitted {
        /// The channel.
        channel: ChannelId,
        /// The node the stream claims to be.
        node: NodeId,
        /// The incarnation it claims.
        claimed: u64,
        /// The incarnation admitted.
        admitted: u64,
    },
    /// Fault injection is off.
    #[error("fault injection is disabled; start the daemon with --fault-injection")]
    FaultInjectionDisabled,
    /// `NodeAdmin/InitiateSnapshot` on a daemon with a coordinator: the coordinator hands
    /// out snapshot ids, and one chosen here could collide with them.
    #[error(
        "this daemon has a coordinator, which chooses snapshot ids: start snapshots with \
         Coordinator/StartSnapshot (`cairnctl snapshot start`), not NodeAdmin/InitiateSnapshot"
    )]
    Coordinated,
    /// The daemon is shutting down.
    #[error("the node is shutting down")]
    ShuttingDown,
}

impl From<Error> for Status {
    fn from(error: Error) -> Self {
        let code = match &error {
            Error::InvalidInput(_) | Error::Malformed(_) => Code::InvalidArgument,
            Error::WrongCluster { .. } => Code::FailedPrecondition,
            Error::Unknown(_) => Code::NotFound,
            Error::OutOfSequence { .. } => Code::OutOfRange,
            Error::PayloadTooLarge { .. } => Code::ResourceExhausted,
            Error::AlreadyAttached(_) => Code::FailedPrecondition,
            Error::NoSuchPart(_) => Code::NotFound,
            Error::DuplicateSnapshot(_) => Code::AlreadyExists,
            Error::SnapshotFailed { .. } => Code::FailedPrecondition,
            Error::EpochMismatch { .. } | Error::NotAdmitted { .. } => Code::Aborted,
            Error::FaultInjectionDisabled => Code::PermissionDenied,
            Error::Coordinated => Code::FailedPrecondition,
            Error::ShuttingDown => Code::Unavailable,
        };
        Status::new(code, error.to_string())
    }
}
