//! What the services and channel tasks tell the node loop. (What they share without
//! asking it is in [`crate::shared`].)

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cairn_core::{ChannelId, Plan, SnapshotId, SnapshotMode};
use cairn_proto::v1 as pb;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tonic::Status;

use crate::error::Error;
use crate::part::Part;
use crate::shared::{ChannelHandles, StateChunk, Wiring};

/// One frame of an incoming channel, decoded.
#[derive(Debug, Clone)]
pub(crate) enum InItem {
    /// An application message.
    Data(Bytes),
    /// A marker.
    Marker(Plan),
}

/// One frame of an outgoing channel, handed to its sending task.
#[derive(Debug, Clone)]
pub(crate) enum OutFrame {
    /// An application message.
    Data(Bytes),
    /// A marker.
    Marker(Plan),
}

/// The stream the node loop writes to the attached application.
pub(crate) type AppTx = mpsc::Sender<Result<pb::NodeToApp, Status>>;

/// A request to the node loop.
pub(crate) enum LoopMsg {
    /// A peer opened (or reopened) an incoming channel; the reply is the highest sequence
    /// number already held from that incarnation.
    InboundOpened {
        channel: ChannelId,
        incarnation: u64,
        /// The epoch the handshake was checked in.
        epoch: u64,
        /// The highest sequence number taken in; `None` if the node left `epoch` since.
        reply: oneshot::Sender<Option<u64>>,
    },
    /// Frames of an incoming channel, numbered from `first_seq`. Their data items hold
    /// credits of the channel's incoming semaphore.
    InboundFrames {
        channel: ChannelId,
        incarnation: u64,
        /// The epoch the stream was opened in; frames of another epoch are dropped.
        epoch: u64,
        first_seq: u64,
        items: Vec<InItem>,
        /// Whether the loop kept them: the stream acknowledges only frames the loop kept
        /// (a stream already replaced by another incarnation, or of a left epoch, is
        /// closed without acknowledging, so its sender keeps and resends them).
        kept: oneshot::Sender<bool>,
    },
    /// An outgoing channel's task wants up to `max` frames.
    Pull {
        channel: ChannelId,
        /// The sending task's channel handles: a task of a channel since removed and added
        /// again holds the old ones, and the loop ignores what it says.
        link: Arc<ChannelHandles>,
        max: usize,
        reply: oneshot::Sender<Pulled>,
    },
    /// Fault injection on an incoming channel; answered once it is in force (false: the
    /// loop has no such channel).
    Fault {
        channel: ChannelId,
        fault: HoldFault,
        reply: oneshot::Sender<bool>,
    },
    /// An outgoing channel's task withdraws its waiting pull (before a reset).
    CancelPull {
        channel: ChannelId,
        /// The sending task's channel handles: a task of a channel since removed and added
        /// again holds the old ones, and the loop ignores what it says.
        link: Arc<ChannelHandles>,
    },
    /// An outgoing channel's peer granted credits up to data index `limit` (`u64::MAX`: a
    /// peer without credit-based flow control), in `epoch`.
    Credit {
        channel: ChannelId,
        /// The sending task's channel handles: a task of a channel since removed and added
        /// again holds the old ones, and the loop ignores what it says.
        link: Arc<ChannelHandles>,
        epoch: u64,
        limit: u64,
    },
    /// An outgoing channel's peer restarted; `requeue` is the data it never acknowledged,
    /// `lost_markers` the snapshots whose markers it never acknowledged.
    OutboundReset {
        channel: ChannelId,
        /// The sending task's channel handles: a task of a channel since removed and added
        /// again holds the old ones, and the loop ignores what it says.
        link: Arc<ChannelHandles>,
        /// The epoch of the requeued data; dropped if the node has moved on.
        epoch: u64,
        requeue: Vec<Bytes>,
        lost_markers: Vec<SnapshotId>,
    },
    /// An application wants to attach. `records` counts the record requests handed to it
    /// and not yet answered (the loop adds, the session reader takes away).
    AppAttach {
        session: u64,
        /// Deliveries as runs (`DeliverBatch.runs`).
        packed: bool,
        /// The key its `Consumed` stream must present (told in `Attached`).
        flow_key: u64,
        /// It attached with `acknowledges_deliveries`: its `Consumed` stream is to come.
        acknowledges: bool,
        /// It follows the snapshots' ends above this id (`Attach.snapshot_outcomes_after`).
        outcomes_after: Option<u64>,
        tx: AppTx,
        records: Arc<RecordsDue>,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    /// Messages from the application; each holds a credit of its outgoing channel.
    AppSend {
        session: u64,
        sends: Vec<(ChannelId, Bytes)>,
    },
    /// A chunk of the application's recorded state.
    AppState {
        session: u64,
        id: SnapshotId,
        chunk: StateChunk,
        last: bool,
        /// On the first chunk: the messages the application had consumed at its cut.
        consumed: Option<u64>,
    },
    /// The application's session ended.
    AppDetached { session: u64 },
    /// The application's flow-control stream (`App/Consumed`) opened (`on`) or ended: a
    /// delivery window applies exactly while it is open. A session whose stream never
    /// opens (refused, or an application without one) has no window, rather than one that
    /// fills and is never acknowledged.
    AppWindow { session: u64, on: bool },
    /// The application has consumed this many delivered messages (and bytes) so far.
    AppConsumed {
        session: u64,
        messages: u64,
        bytes: u64,
    },
    /// The application applied a restored state: its sends count again.
    AppRestoreApplied { session: u64, restore_id: String },
    /// Restore a snapshot: enter its epoch, hand the application the recorded state (its
    /// pieces follow as `RestorePiece`s) and replay the recorded messages ahead of any new
    /// traffic.
    Restore(Box<RestoreData>),
    /// The next piece of a restore's state, from fetch `fetch` (it took a permit of the
    /// restore's feed room). Pieces, ends and aborts name the fetch, not only the restore:
    /// a restore sent twice (a node that registered again) may be fetched twice, and only
    /// the fetch the loop took may feed it.
    RestorePiece { fetch: u64, piece: Bytes },
    /// A restore's state is whole: its last piece is the one before.
    RestoreEnd { fetch: u64 },
    /// A restore's state broke off after the loop entered its epoch.
    RestoreAborted { fetch: u64, reason: String },
    /// The coordinator's epoch differs from this node's at registration: enter it.
    AdoptEpoch { epoch: u64 },
    /// Start a snapshot here (NodeAdmin).
    Initiate {
        id: SnapshotId,
        mode: SnapshotMode,
        alignment_timeout: Option<Duration>,
        reply: oneshot::Sender<Result<Plan, Error>>,
    },
    /// This node's part of a snapshot (NodeAdmin).
    GetPart {
        id: SnapshotId,
        reply: oneshot::Sender<Result<Part, Error>>,
    },
    /// The node's status (NodeAdmin).
    Status {
        reply: oneshot::Sender<pb::NodeStatus>,
    },
    /// A scheduled alignment timeout passed.
    AlignmentTimedOut { id: SnapshotId },
    /// The coordinator made this node an initiator of a snapshot.
    InitiatePlan { plan: Plan },
    /// The coordinator aborted a snapshot.
    Abort {
        id: SnapshotId,
        reason: cairn_core::FailureReason,
    },
    /// The daemon registered with a coordinator (perhaps a new leader): the application's
    /// outcomes are caught up from its cursor.
    Registered,
    /// Snapshots' ends from the coordinator, for the application.
    Outcomes(cairn_core::lifecycle::Outcomes),
    /// The membership grew: publish the new wiring and take up its channels. The loop
    /// publishes it itself, so that whoever sees a new channel in `Shared` finds it in the
    /// loop too.
    Rewire {
        wiring: Arc<Wiring>,
        what: String,
        reply: oneshot::Sender<()>,
    },
}

/// Most record requests remembered as due, or early copies waiting to go out (far more
/// than snapshots in flight at once).
const RECORDS_MEMORY: usize = 1024;

/// Record requests an application session has been given (either copy) and has not
/// answered in full, nor been relieved of by an abort.
#[derive(Debug, Default)]
pub(crate) struct RecordsDue {
    due: std::sync::Mutex<BTreeSet<SnapshotId>>,
    /// Woken when one is handed over (a session waiting for credits reads ahead then).
    pub wake: tokio::sync::Notify,
    /// Early copies of record requests for the session's `App/Consumed` stream to send
    /// (`Taken.record_state`)...
    pub early: std::sync::Mutex<Vec<u64>>,
    /// ...woken when there are some.
    pub early_wake: tokio::sync::Notify,
}

impl RecordsDue {
    /// The application was asked for `id`'s state.
    pub(crate) fn asked(&self, id: SnapshotId) {
        let mut due = self.due.lock().expect("never poisoned");
        due.insert(id);
        while due.len() > RECORDS_MEMORY {
            due.pop_first();
        }
        drop(due);
        self.wake.notify_waiters();
    }

    /// `id`'s state was read in full, or the snapshot failed: whether none is due now.
    pub(crate) fn settled(&self, id: SnapshotId) -> bool {
        let mut due = self.due.lock().expect("never poisoned");
        due.remove(&id);
        due.is_empty()
    }

    /// How many are due.
    pub(crate) fn count(&self) -> u64 {
        self.due.lock().expect("never poisoned").len() as u64
    }

    /// An early copy of `id`'s request for the `Consumed` stream to send (a stream that is
    /// not read keeps only the newest).
    pub(crate) fn send_early(&self, id: SnapshotId) {
        let mut early = self.early.lock().expect("never poisoned");
        early.push(id.0);
        if early.len() > RECORDS_MEMORY {
            early.remove(0);
        }
        drop(early);
        self.early_wake.notify_one();
    }
}

/// Frames an outgoing channel's task pulled, with the epoch they belong to.
#[derive(Debug)]
pub(crate) struct Pulled {
    pub epoch: u64,
    pub frames: Vec<OutFrame>,
}

/// What a node needs to restore a snapshot (fetched from the coordinator): all of it but
/// the state, which follows in pieces through `feed`.
#[derive(Debug)]
pub(crate) struct RestoreData {
    pub restore_id: String,
    pub snapshot_id: u64,
    pub epoch: u64,
    /// Recorded messages of each incoming channel, in order.
    pub incoming: BTreeMap<ChannelId, Vec<Bytes>>,
    /// How many recorded messages each outgoing channel replays at its receiver.
    pub outgoing: BTreeMap<ChannelId, u64>,
    /// Where the state's pieces wait for the application.
    pub feed: RestoreFeed,
}

/// A restored state on its way to the application: the pieces that have come and not been
/// handed over yet, and the room the fetch gets a permit of for each piece it sends. The
/// loop gives a permit back as the application takes a piece; dropping the feed (the restore
/// superseded, abandoned or done) closes the room, which stops the fetch.
#[derive(Debug)]
pub(crate) struct RestoreFeed {
    /// The fetch feeding it (unique in this process).
    pub(crate) fetch: u64,
    room: Arc<Semaphore>,
    pieces: VecDeque<Bytes>,
    /// The fetch sent the last piece.
    ended: bool,
}

impl RestoreFeed {
    pub(crate) fn new(fetch: u64, room: Arc<Semaphore>) -> Self {
        Self {
            fetch,
            room,
            pieces: VecDeque::new(),
            ended: false,
        }
    }

    /// A whole state that is here already (tests).
    #[cfg(test)]
    pub(crate) fn whole(pieces: Vec<Bytes>) -> Self {
        let mut feed = Self::new(0, Arc::new(Semaphore::new(0)));
        feed.pieces.extend(pieces);
        feed.ended = true;
        feed
    }

    pub(super) fn push(&mut self, piece: Bytes) {
        self.pieces.push_back(piece);
    }

    pub(super) fn end(&mut self) {
        self.ended = true;
    }

    /// A piece can be handed over: the next one is here, or the state ended (an empty last
    /// piece closes it).
    pub(super) fn ready(&self) -> bool {
        !self.pieces.is_empty() || self.ended
    }

    /// The next piece and whether it is the last; gives its permit back.
    pub(super) fn next(&mut self) -> (Bytes, bool) {
        let piece = match self.pieces.pop_front() {
            Some(piece) => {
                self.room.add_permits(1);
                piece
            }
            None => Bytes::new(),
        };
        (piece, self.ended && self.pieces.is_empty())
    }
}

impl Drop for RestoreFeed {
    fn drop(&mut self) {
        self.room.close();
    }
}

/// Holding back an incoming channel's frames (fault injection).
#[derive(Debug, Clone, Copy)]
pub(crate) enum HoldFault {
    /// Stop taking frames in.
    Hold,
    /// Take this many more frames in, then hold again.
    Release(u64),
    /// Take frames in freely again.
    Resume,
}
