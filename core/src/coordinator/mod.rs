//! The coordinator's engine, sans-IO: what the coordinator decides, as data in and data
//! out (docs/architecture.md §6.2).
//!
//! [`CoordinatorEngine::handle`] takes an [`Input`] with the time it happened; the engine
//! changes its state and queues [`Action`]s, which the runtime (the coordinator's task)
//! takes with [`CoordinatorEngine::next_action`] and carries out in order. An action whose
//! answer the engine needs — taking an id, storing a record — is answered by feeding the
//! result back as an input before the next action is taken ([`Input::IdTaken`],
//! [`Input::Persisted`]): a record is stored before anyone hears of it *by construction*,
//! because the engine only queues the telling ([`Action::Send`], [`Action::Ended`],
//! [`Action::Reply`]) when the store's acknowledgement comes in.
//!
//! Nothing here does I/O, reads a clock or spawns: tests drive it synchronously and
//! compare the actions it queued ([`CoordinatorEngine::drain_actions`]).
//!
//! The engine is being moved in role by role. The snapshot lifecycle ([`snapshots`]: the
//! tracker, the records in flight, ends not yet stored, the id floor) is here; membership,
//! restores, retention and the schedule are still the runtime's, and tell the engine what
//! concerns a snapshot ([`Input::FailAll`], [`Input::NodeLost`], [`Input::IdSeen`]).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use crate::control::{NodeCommand, NodeReport};
use crate::record::SnapshotRecord;
use crate::tracker::{SnapshotTracker, StartRequest};
use crate::types::{NodeId, Plan, SnapshotId};
use crate::verifier::NodePart;
use crate::{FailureReason, StartError, Topology};

mod snapshots;
#[cfg(test)]
mod tests;

pub use snapshots::PartSizes;

/// An answer awaited by whoever asked, matched by the token they gave.
pub type Token = u64;

/// What the engine is told. `E` is the store's error, carried back to whoever asked.
#[derive(Debug)]
pub enum Input<E> {
    /// Start a snapshot of `topology` (the checks of the roles not in the engine yet —
    /// the restore fence, an empty roster — passed).
    Start {
        /// Whose answer ([`Answer::Started`]).
        token: Token,
        /// What the user asked.
        request: StartRequest,
        /// The topology it spans.
        topology: Topology,
        /// How long it may take.
        timeout: Duration,
        /// The user's labels.
        labels: BTreeMap<String, String>,
        /// The cluster's epoch now.
        epoch: u64,
        /// The leader's term.
        term: u64,
    },
    /// The stored id counter answered [`Action::TakeId`] (or [`Action::SetIdCounter`]).
    IdTaken {
        /// The id it handed out (for `SetIdCounter`: the id it was set to).
        result: Result<SnapshotId, E>,
    },
    /// The store answered an [`Action::Persist`].
    Persisted {
        /// Which record.
        what: Persist,
        /// Whether it is stored.
        result: Result<(), E>,
    },
    /// A node reported on a snapshot.
    Report {
        /// The node.
        node: NodeId,
        /// The snapshot.
        id: SnapshotId,
        /// What it said.
        report: NodeReport,
    },
    /// A node's part is stored.
    PartStored {
        /// The part.
        part: NodePart,
        /// What it weighs.
        sizes: PartSizes,
        /// The epoch the node recorded it in.
        epoch: u64,
        /// The last restore the node's application applied (for the failure's words).
        applied_restore_id: String,
    },
    /// Storing a node's part failed.
    StorageFailed {
        /// The snapshot.
        id: SnapshotId,
        /// The node.
        node: NodeId,
        /// Why, naming the node and the cause.
        why: String,
    },
    /// A snapshot's timer ([`Action::SetTimer`]) went off.
    TimedOut {
        /// The snapshot.
        id: SnapshotId,
    },
    /// A user aborts a snapshot.
    Abort {
        /// Whose answer ([`Answer::Aborted`]).
        token: Token,
        /// The snapshot.
        id: SnapshotId,
        /// Why (empty: "aborted by a user").
        reason: String,
    },
    /// Every snapshot in flight fails for `reason` (the membership changed, a restore
    /// fenced the cluster, the term ended).
    FailAll {
        /// Why.
        reason: FailureReason,
    },
    /// A node was lost: the snapshots it takes part in fail.
    NodeLost {
        /// The node.
        node: NodeId,
    },
    /// A daemon reported the highest snapshot id it saw: ids are handed out above it.
    IdSeen {
        /// That id.
        highest: u64,
    },
    /// The runtime's periodic tick: ends the store refused are stored again.
    Tick,
}

/// A record the engine asks to have stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persist {
    /// A snapshot's record at its start.
    Started(SnapshotId),
    /// A snapshot's record at its end.
    End(SnapshotId),
}

/// What the engine asks the runtime to do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action<E> {
    /// Take the next id from the stored counter; answer with [`Input::IdTaken`].
    TakeId,
    /// Set the stored id counter to `id` (it was behind ids the daemons have seen); answer
    /// with [`Input::IdTaken`].
    SetIdCounter {
        /// The id handed out.
        id: SnapshotId,
        /// The highest id the daemons reported.
        floor: u64,
    },
    /// Store `record`; answer with [`Input::Persisted`] before taking the next action.
    Persist {
        /// Which record.
        what: Persist,
        /// The record.
        record: SnapshotRecord,
        /// The how-manyth time this record is tried (1 the first).
        attempt: u64,
    },
    /// Send `command` to `node` (if it has a session).
    Send {
        /// The node.
        node: NodeId,
        /// The command.
        command: NodeCommand,
    },
    /// Send `command` to every node with a session.
    Broadcast {
        /// The command.
        command: NodeCommand,
    },
    /// Tell [`Input::TimedOut`] for `id` after `after`.
    SetTimer {
        /// The snapshot.
        id: SnapshotId,
        /// When.
        after: Duration,
    },
    /// Answer whoever asked.
    Reply {
        /// Who.
        token: Token,
        /// The answer.
        answer: Answer<E>,
    },
    /// A snapshot started (its record stored): for its trace.
    Started {
        /// Its plan.
        plan: Plan,
    },
    /// A snapshot in flight progressed: its watchers may read
    /// [`CoordinatorEngine::live_record`].
    Progress {
        /// The snapshot.
        id: SnapshotId,
    },
    /// A step of a snapshot's timeline was added (for its trace).
    Step {
        /// The snapshot.
        id: SnapshotId,
        /// The step.
        event: crate::record::EventRecord,
    },
    /// A snapshot's end is stored: tell it (watchers, retention, metrics, the schedule).
    Ended {
        /// The stored record (its `failure` says why, if it did not complete).
        record: SnapshotRecord,
    },
}

/// An answer to a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer<E> {
    /// To [`Input::Start`]: the snapshot's id, once its record is stored.
    Started(Result<SnapshotId, Refusal<E>>),
    /// To [`Input::Abort`]: the stored record of the aborted snapshot.
    Aborted(Result<Box<SnapshotRecord>, Refusal<E>>),
}

/// Why the engine refused or could not do what was asked.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal<E> {
    /// The tracker refused the start.
    Start(StartError),
    /// The store failed (or its answer was lost: `E` says which).
    Store(E),
    /// The snapshot is not in flight (it ended, or never was: the store knows which).
    NotInFlight(SnapshotId),
    /// The snapshot ended and its end is not stored yet: nothing can change it now.
    EndNotStored(SnapshotId),
    /// The abort ended the snapshot but its record is not stored yet (tried again at each
    /// tick while the term lasts).
    AbortNotStored(SnapshotId),
    /// The node is not a participant of the snapshot.
    NotAParticipant(SnapshotId, NodeId),
}

/// The coordinator's engine. See the module's documentation.
pub struct CoordinatorEngine<E> {
    snapshots: snapshots::Snapshots,
    actions: Actions<E>,
}

/// The queue of actions, which each role pushes onto.
#[derive(Debug)]
pub(crate) struct Actions<E>(VecDeque<Action<E>>);

impl<E> Actions<E> {
    fn push(&mut self, action: Action<E>) {
        self.0.push_back(action);
    }
}

impl<E: std::fmt::Display> CoordinatorEngine<E> {
    /// An engine that runs at most `max_in_flight` snapshots at once (at least one).
    pub fn new(max_in_flight: usize) -> Self {
        Self {
            snapshots: snapshots::Snapshots::new(SnapshotTracker::new(max_in_flight.max(1))),
            actions: Actions(VecDeque::new()),
        }
    }

    /// Takes `input`, which happened at `now_ms` (milliseconds since the Unix epoch),
    /// and queues what follows from it.
    pub fn handle(&mut self, now_ms: u64, input: Input<E>) {
        self.snapshots.handle(&mut self.actions, now_ms, input);
    }

    /// The next action to carry out, oldest first.
    pub fn next_action(&mut self) -> Option<Action<E>> {
        self.actions.0.pop_front()
    }

    /// Every action queued, oldest first.
    pub fn drain_actions(&mut self) -> Vec<Action<E>> {
        self.actions.0.drain(..).collect()
    }

    /// The snapshot tracker (to read the snapshots in flight and the limit).
    pub fn tracker(&self) -> &SnapshotTracker {
        self.snapshots.tracker()
    }

    /// A snapshot in flight's record as it stands, with the tracker's progress; `None` if
    /// it is not in flight.
    pub fn live_record(&self, id: SnapshotId) -> Option<SnapshotRecord> {
        self.snapshots.live_record(id)
    }

    /// The snapshots in flight.
    pub fn in_flight(&self) -> usize {
        self.snapshots.in_flight()
    }

    /// Whether snapshot `id` is not over for the store: in flight, or ended and its end
    /// not stored yet.
    pub fn is_open(&self, id: SnapshotId) -> bool {
        self.snapshots.is_open(id)
    }

    /// Whether `node` may upload its part of snapshot `id` (it is in flight and `node`
    /// takes part).
    pub fn check_upload(&self, id: SnapshotId, node: &NodeId) -> Result<(), Refusal<E>> {
        self.snapshots.check_upload(id, node)
    }

    /// The highest snapshot id a daemon reported.
    pub fn id_floor(&self) -> u64 {
        self.snapshots.id_floor()
    }

    /// Ends whose store failed, waiting for the next [`Input::Tick`].
    pub fn unstored(&self) -> usize {
        self.snapshots.unstored()
    }
}
