//! What the coordinator's task is asked ([`Msg`]) and what it hands its node sessions and
//! watchers.

use std::collections::BTreeMap;
use std::time::Duration;

use cairn_core::control::{ChannelStatus, Membership, NodeCommand, NodeReport, Registration};
use cairn_core::{NodeId, NodePart, SnapshotId, StartRequest};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::error::Error;
use crate::policy;
use crate::store::{RestoreRecord, SnapshotRecord};

/// A command to a node, with the term it leaves in.
pub(crate) struct ToNode {
    /// The leader's term.
    pub term: u64,
    /// What the node is to do.
    pub command: NodeCommand,
}

/// The stream a node's session reads its commands from.
pub(crate) type NodeTx = mpsc::Sender<Result<ToNode, Status>>;
/// A watcher's stream: the snapshot's record at each step, one shared by every watcher
/// (its session makes the progress of it).
pub(crate) type WatchTx = mpsc::Sender<Result<std::sync::Arc<SnapshotRecord>, Status>>;

/// What a stored part weighs.
pub(crate) use cairn_core::coordinator::PartSizes;

/// The most channels a heartbeat's status may list (a node of a full mesh of 2048 nodes
/// has 4094).
pub(crate) const MAX_HEARTBEAT_CHANNELS: usize = 4096;

pub(crate) enum Msg {
    Register {
        registration: Registration,
        session: u64,
        tx: NodeTx,
        reply: oneshot::Sender<Result<Membership, Error>>,
    },
    SessionEnded {
        node: NodeId,
        session: u64,
    },
    NodeEvent {
        node: NodeId,
        id: SnapshotId,
        report: NodeReport,
    },
    Heartbeat {
        node: NodeId,
        application_attached: bool,
        /// Its channels' status, checked to be its own and bounded.
        channels: Vec<ChannelStatus>,
    },
    CheckUpload {
        id: SnapshotId,
        node: NodeId,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    PartStored {
        part: NodePart,
        sizes: PartSizes,
        /// The epoch the node recorded the part in.
        epoch: u64,
        /// The last restore the node's application applied.
        applied_restore_id: String,
    },
    /// Storing a part failed (`why` names the node and the cause).
    StorageFailed {
        id: SnapshotId,
        node: NodeId,
        why: String,
    },
    Start {
        request: StartRequest,
        timeout: Duration,
        labels: BTreeMap<String, String>,
        /// The client's request id (empty for none).
        request_id: String,
        reply: oneshot::Sender<Result<SnapshotId, Error>>,
    },
    Abort {
        id: SnapshotId,
        reason: String,
        reply: oneshot::Sender<Result<SnapshotRecord, Error>>,
    },
    Delete {
        id: SnapshotId,
        reply: oneshot::Sender<Result<u64, Error>>,
    },
    TimedOut {
        id: SnapshotId,
    },
    Watch {
        id: SnapshotId,
        tx: WatchTx,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    ListNodes {
        reply: oneshot::Sender<Membership>,
    },
    RemoveNode {
        node: NodeId,
        reply: oneshot::Sender<Result<Membership, Error>>,
    },
    /// A node's daemon leaves for good (`--leave-on-shutdown`).
    Leave {
        node: NodeId,
    },
    /// A node's daemon catches up on the snapshots' ends told above `after`.
    OutcomesAfter {
        node: NodeId,
        after: u64,
    },
    /// The record of a snapshot in flight, with its progress; `None` if it has ended.
    Live {
        id: SnapshotId,
        reply: oneshot::Sender<Option<SnapshotRecord>>,
    },
    GetPolicy {
        reply: oneshot::Sender<policy::View>,
    },
    Restore {
        snapshot_id: SnapshotId,
        /// `RestoreSnapshotRequest.if_epoch`.
        if_epoch: Option<u64>,
        reply: oneshot::Sender<Result<RestoreRecord, Error>>,
    },
    RestoreApplied {
        node: NodeId,
        restore_id: String,
    },
    RestoreFailed {
        node: NodeId,
        restore_id: String,
        message: String,
    },
    RestoreTimedOut {
        epoch: u64,
    },
    /// A garbage collection, run off the task, came back: the bytes it freed.
    Collected {
        result: Result<u64, Error>,
    },
    /// A restore's verification, run off the task, came back: the snapshot that verified
    /// (the first of its candidates that did), and those that did not, with why.
    Verified {
        chosen: Option<SnapshotId>,
        skipped: Vec<(SnapshotId, Error)>,
    },
    SetPolicy {
        change: policy::Change,
        reply: oneshot::Sender<Result<policy::View, Error>>,
    },
}
