//! The coordinator's errors, each with a deliberate gRPC status code.

use tonic::{Code, Status};

use cairn_core::SnapshotId;

use crate::store::{RestoreStatus, SnapshotStatus, StoreError};

/// What can go wrong serving a request: one variant per cause, each with one deliberate
/// gRPC code (see `From<Error> for Status`), as the node's errors are.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The request is malformed or out of its limits (names the field).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No snapshot with that id.
    #[error("snapshot {0} not found")]
    SnapshotNotFound(SnapshotId),
    /// The snapshot has ended; it cannot be aborted (or uploaded to) any more.
    #[error("snapshot {id} is already {status}")]
    AlreadyEnded {
        /// The snapshot.
        id: SnapshotId,
        /// How it ended.
        status: SnapshotStatus,
    },
    /// The snapshot is in flight: it cannot be deleted yet.
    #[error("snapshot {0} is in progress; abort it first")]
    StillInProgress(SnapshotId),
    /// The snapshot is not in flight (an upload for it).
    #[error("snapshot {0} is not in progress")]
    NotInProgress(SnapshotId),
    /// The snapshot did not complete; `only` says what only a completed one allows.
    #[error("snapshot {id} is {status}; only a COMPLETED snapshot {only}")]
    NotCompleted {
        /// The snapshot.
        id: SnapshotId,
        /// Where it is.
        status: SnapshotStatus,
        /// "can be restored", "has data to verify".
        only: &'static str,
    },
    /// A restore is running, or did not finish, or nodes are in other epochs: the cluster
    /// is fenced (the reason names the restore or the nodes).
    #[error("{0}")]
    Fenced(String),
    /// A restore is running; another cannot start.
    #[error("{restore} (of snapshot {snapshot}) is in progress")]
    RestoreInProgress {
        /// The restore.
        restore: String,
        /// Its snapshot.
        snapshot: SnapshotId,
    },
    /// A conditional restore (`if_epoch`) found the cluster in another epoch.
    #[error(
        "the cluster is in epoch {current}, not {expected} as the request's if_epoch asked: \
         another restore ran since (see ListRestores), so the snapshot may belong to a \
         history it discarded; choose again"
    )]
    EpochMoved {
        /// The epoch the request named.
        expected: u64,
        /// The cluster's.
        current: u64,
    },
    /// A restore refers to the snapshot: it cannot be deleted.
    #[error(
        "snapshot {id} is being restored by {restore} ({status}); it can be deleted once a \
         restore has finished"
    )]
    HeldByRestore {
        /// The snapshot.
        id: SnapshotId,
        /// The restore.
        restore: String,
        /// Where the restore is.
        status: RestoreStatus,
    },
    /// Nodes a snapshot or a restore needs are not connected (the sentence names them).
    #[error("{0}")]
    NodesNotConnected(String),
    /// Nodes joined after the snapshot a restore would bring back.
    #[error(
        "cannot restore snapshot {snapshot}: {} joined after it was taken and has no state in it",
        nodes.join(", ")
    )]
    JoinedSince {
        /// The snapshot.
        snapshot: SnapshotId,
        /// The nodes.
        nodes: Vec<String>,
    },
    /// No node has registered yet.
    #[error("no node has registered with the coordinator")]
    NoMembers,
    /// Too many snapshots in flight, or an aligned one already is.
    #[error("{0}")]
    TooManyInFlight(String),
    /// A node of another cluster.
    #[error("cluster mismatch: the coordinator serves `{ours}`, the node says `{theirs}`")]
    ClusterMismatch {
        /// This coordinator's cluster.
        ours: String,
        /// The node's.
        theirs: String,
    },
    /// A node `--topology` does not name.
    #[error("{0}")]
    NotInTopology(String),
    /// A second daemon for a node id whose holder is connected (the sentence names both).
    #[error("{0}")]
    NodeIdHeld(String),
    /// A node that is not a participant of the snapshot (an upload).
    #[error("node {node} is not a participant of snapshot {id}")]
    NotAParticipant {
        /// The snapshot.
        id: SnapshotId,
        /// The node.
        node: String,
    },
    /// A node without a part in the snapshot (a restore's fetch).
    #[error("node {node} has no part in snapshot {id}")]
    NoPart {
        /// The snapshot.
        id: SnapshotId,
        /// The node.
        node: String,
    },
    /// A counter (snapshot ids, epochs) at its largest value.
    #[error("the {0} counter is exhausted")]
    CounterExhausted(&'static str),
    /// A daemon process whose node was removed while it ran, registering again.
    #[error(
        "node {0} was removed from the cluster while this daemon ran: its peers dropped their \
         channels to it; restart the daemon (a new process joins as a new member)"
    )]
    Removed(String),
    /// `RemoveNode` of a node not on the roster.
    #[error("node {0} is not a member of the cluster (ListNodes shows the members)")]
    NotAMember(String),
    /// `RemoveNode` of a node whose daemon is connected.
    #[error(
        "node {node} is connected (its daemon at {address}): stop the daemon first, then \
         remove it (a daemon stopped with --leave-on-shutdown removes itself)"
    )]
    StillConnected {
        /// The node.
        node: String,
        /// Its daemon's address.
        address: String,
    },
    /// The metadata store cannot be reached.
    #[error("{0}")]
    Store(#[from] StoreError),
    /// The blob store failed reading.
    #[error("blob store: {0}")]
    Blob(String),
    /// Stored data is missing or corrupt (names the chunk and the node).
    #[error("data loss: {0}")]
    DataLoss(String),
    /// The blob store could not store a part (names the node and the cause).
    #[error("blob store: {0}")]
    Storage(String),
    /// The request's stream failed (a message over its limit, a stalled or cancelled
    /// stream): its own status, passed on unchanged.
    #[error("{}", .0.message())]
    Stream(Status),
    /// A metadata record that does not parse.
    #[error("the metadata record {key} is corrupt: {why}")]
    CorruptRecord {
        /// Its key.
        key: String,
        /// What is wrong with it.
        why: String,
    },
    /// The coordinator is shutting down.
    #[error("the coordinator is shutting down")]
    ShuttingDown,
    /// A bug: the coordinator's engine did not answer a request (see its log).
    #[error("the coordinator did not answer {0} (a bug: see its log)")]
    Unanswered(&'static str),
    /// A response would hold more memory than the budget has left (`budget.rs`).
    #[error("{0}")]
    TooMuchMemory(String),
    /// A write whose answer was lost and not read back before its term ended (or not yet
    /// stored): it may or may not take effect, and the store decides — never a failure.
    #[error("outcome unknown: {what} may or may not have been stored ({cause}); see {see}")]
    OutcomeUnknown {
        /// What was asked.
        what: String,
        /// The call that reads the outcome back.
        see: String,
        /// Why it is unknown.
        cause: String,
    },
}

impl Error {
    /// A blob store error while reading `what` (e.g. "node n1's state"): `DataLoss` if
    /// the bytes are missing or corrupt, else `Blob`.
    pub fn reading(what: &str, e: &std::io::Error) -> Self {
        if cairn_blob::is_data_loss(e) {
            Self::DataLoss(format!("{what}: {e}"))
        } else {
            Self::Blob(format!("{what}: {e}"))
        }
    }
}

impl From<Error> for Status {
    fn from(error: Error) -> Self {
        if let Error::Stream(status) = error {
            return status;
        }
        let code = match &error {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::SnapshotNotFound(_) => Code::NotFound,
            Error::AlreadyEnded { .. }
            | Error::StillInProgress(_)
            | Error::NotInProgress(_)
            | Error::NotCompleted { .. }
            | Error::Fenced(_)
            | Error::RestoreInProgress { .. }
            | Error::EpochMoved { .. }
            | Error::HeldByRestore { .. }
            | Error::NodesNotConnected(_)
            | Error::JoinedSince { .. }
            | Error::NoMembers
            | Error::ClusterMismatch { .. }
            | Error::NotInTopology(_)
            | Error::NodeIdHeld(_)
            | Error::NotAParticipant { .. }
            | Error::NoPart { .. }
            | Error::CounterExhausted(_)
            | Error::StillConnected { .. }
            | Error::Removed(_) => Code::FailedPrecondition,
            Error::NotAMember(_) => Code::NotFound,
            Error::TooManyInFlight(_) | Error::TooMuchMemory(_) => Code::ResourceExhausted,
            Error::Store(e) if e.outcome_unknown => Code::Aborted,
            Error::OutcomeUnknown { .. } => Code::Aborted,
            Error::Store(_) | Error::ShuttingDown => Code::Unavailable,
            Error::Blob(_) | Error::Storage(_) | Error::Unanswered(_) => Code::Internal,
            Error::DataLoss(_) | Error::CorruptRecord { .. } => Code::DataLoss,
            Error::Stream(status) => status.code(),
        };
        Status::new(code, error.to_string())
    }
}
