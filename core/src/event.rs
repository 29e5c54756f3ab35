//! The engine's inputs ([`Event`]) and outputs ([`Command`]).
//!
//! Data messages are counted per channel by their *data index*: the k-th application
//! message sent on a channel has index k (from 0) at both ends, since channels are FIFO
//! and markers do not count. Counting events come in batches so the hot path costs one
//! call per batch, not per message.

use std::ops::Range;
use std::time::Duration;

use crate::failure::FailureReason;
use crate::report::LocalReport;
use crate::topology::Topology;
use crate::types::{ChannelId, Plan, SnapshotId};

/// Something that happened at the process; the engine's only input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// This process was asked to initiate a snapshot.
    SnapshotInitiated {
        /// The snapshot.
        plan: Plan,
    },
    /// A marker arrived on an incoming channel, after every data message that preceded it.
    MarkerReceived {
        /// The incoming channel.
        channel: ChannelId,
        /// The plan the marker carries.
        plan: Plan,
    },
    /// `count` data messages arrived on an incoming channel and were appended to the
    /// application's inbox. The runtime reports nothing for a blocked channel.
    DataReceived {
        /// The incoming channel.
        channel: ChannelId,
        /// How many.
        count: u64,
    },
    /// The application was handed the next `count` messages of an incoming channel.
    DataDelivered {
        /// The incoming channel.
        channel: ChannelId,
        /// How many.
        count: u64,
    },
    /// The application sent `count` messages on an outgoing channel; they were appended to
    /// its outgoing queue.
    DataQueued {
        /// The outgoing channel.
        channel: ChannelId,
        /// How many.
        count: u64,
    },
    /// The next `count` messages left an outgoing queue for the wire; a marker can no
    /// longer overtake them.
    DataTransmitted {
        /// The outgoing channel.
        channel: ChannelId,
        /// How many.
        count: u64,
    },
    /// The application answered the record request: everything it sent before this is in
    /// its state, nothing after it.
    StateRecorded {
        /// The snapshot.
        id: SnapshotId,
        /// Messages the application had been handed before a request that overtook the
        /// inbox and had not consumed when it took its cut (it took the request's early
        /// copy): for each incoming channel, how many of the last ones handed over belong
        /// after the cut. They become channel state. Empty when the cut is where the
        /// request was handed over.
        unconsumed: Vec<(ChannelId, u64)>,
    },
    /// A marker left an outgoing queue for the wire: it can no longer overtake anything.
    MarkerTransmitted {
        /// The outgoing channel.
        channel: ChannelId,
        /// The marker's snapshot.
        id: SnapshotId,
    },
    /// The alignment timeout scheduled by [`Command::ScheduleAlignmentTimeout`] passed.
    AlignmentTimedOut {
        /// The snapshot.
        id: SnapshotId,
    },
    /// An incoming or outgoing channel was reset (its peer has a new incarnation): its
    /// data indices start again at 0 and every snapshot in flight here fails.
    ChannelReset {
        /// The channel.
        channel: ChannelId,
    },
    /// The snapshot was aborted elsewhere (by the coordinator, a user, a failure).
    SnapshotAborted {
        /// The snapshot.
        id: SnapshotId,
        /// Why.
        reason: FailureReason,
    },
    /// The cluster's topology changed (a member joined or was removed). Every snapshot in
    /// flight here fails, since it was planned over the old topology; channels that remain
    /// keep their counters, new ones start at 0, removed ones are forgotten.
    TopologyChanged {
        /// The new topology; it must contain this process.
        topology: Topology,
        /// What changed, for the failure reason.
        what: String,
    },
}

/// Something the runtime must do; the engine's only output, executed in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Put a record request for `id` into the application's inbox: at the front when
    /// `front` (overtaking the messages waiting there), else at the back.
    EnqueueRecordState {
        /// The snapshot.
        id: SnapshotId,
        /// Overtake the inbox.
        front: bool,
    },
    /// Put a marker on an outgoing channel: at the front of its queue when `front`
    /// (overtaking every message not yet transmitted), else at the back.
    SendMarker {
        /// The outgoing channel.
        channel: ChannelId,
        /// The plan the marker carries.
        plan: Plan,
        /// Overtake the queue.
        front: bool,
    },
    /// Keep a copy of these messages as channel state of snapshot `id`. They are in the
    /// inbox (incoming channel) or the outgoing queue (outgoing channel) right now.
    RecordChannelMessages {
        /// The snapshot.
        id: SnapshotId,
        /// The channel.
        channel: ChannelId,
        /// Their data indices on the channel.
        indices: Range<u64>,
    },
    /// Stop reporting the channel's frames (aligned mode): hold them until unblocked.
    BlockChannel {
        /// The incoming channel.
        channel: ChannelId,
    },
    /// Resume the channel's frames, starting with the held ones.
    UnblockChannel {
        /// The incoming channel.
        channel: ChannelId,
    },
    /// Move snapshot `id`'s marker, still in the channel's outgoing queue, to the front,
    /// and mark its plan [`Plan::timed_out`] (an aligned snapshot's alignment timeout
    /// passed while it waited there: it overtakes, and the messages it overtook are
    /// recorded as channel state).
    ///
    /// [`Plan::timed_out`]: crate::Plan::timed_out
    OvertakeMarker {
        /// The snapshot.
        id: SnapshotId,
        /// The outgoing channel.
        channel: ChannelId,
    },
    /// Send [`Event::AlignmentTimedOut`] this long after `since_ms` (the plan's
    /// `started_at_ms`; 0: from now).
    ScheduleAlignmentTimeout {
        /// The snapshot.
        id: SnapshotId,
        /// The delay.
        after: Duration,
        /// Wall-clock milliseconds the delay counts from; 0: from now.
        since_ms: u64,
    },
    /// This process's part is complete: report it with the local state and the recorded
    /// messages.
    ReportLocalDone {
        /// The counters.
        report: LocalReport,
    },
    /// The snapshot failed here: drop what was recorded for it and report the reason.
    Abort {
        /// The snapshot.
        id: SnapshotId,
        /// Why.
        reason: FailureReason,
    },
}

/// What the engine made of an event. Ordinary oddities are outcomes, not errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The event changed the engine's state.
    Applied,
    /// The event was valid but changed nothing.
    Ignored(Ignored),
}

/// Why an event changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// The snapshot already finished (completed or aborted) at this process.
    FinishedSnapshot,
    /// The snapshot is already in flight here.
    AlreadyInFlight,
    /// No snapshot with that id is in flight here.
    UnknownSnapshot,
    /// A second marker for the same snapshot on the same channel.
    DuplicateMarker,
    /// The channel is not one of this process's channels in that direction.
    UnknownChannel,
    /// The state was not requested, or was already recorded.
    StateNotAwaited,
    /// The alignment already ended.
    NotAligning,
    /// A new topology that does not contain this process.
    NotAMember,
}
