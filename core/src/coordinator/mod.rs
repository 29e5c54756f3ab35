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

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use crate::control::{NodeCommand, NodeReport};
use crate::record::{RestoreRecord, SnapshotRecord};
use crate::tracker::{SnapshotTracker, StartRequest};
use crate::types::{NodeId, Plan, SnapshotId};
use crate::verifier::NodePart;
use crate::{FailureReason, StartError, Topology};

mod restores;

mod snapshots;
#[cfg(test)]
mod tests;

pub use restores::restore_epoch;
pub use snapshots::PartSizes;

/// An answer awaited by whoever asked, matched by the token they gave.
pub type Token = u64;

/// What the engine is told. `E` is the store's error, carried back to whoever asked.
#[derive(Debug)]
pub enum Input<E> {
    /// Start a snapshot (the checks of the roles not in the engine yet — the restore
    /// fence, an empty roster — passed).
    Start {
        /// Whose answer ([`Answer::Started`]).
        token: Token,
        /// What to start.
        start: StartInput,
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
    /// A restore starts: its epoch is allocated and its snapshot verified (the runtime's
    /// checks passed). The snapshots in flight fail, the record is stored, and only then
    /// are `nodes` told to apply it.
    RestoreStart {
        /// Whose answer ([`Answer::RestoreStarted`]).
        token: Token,
        /// Its record (in progress, nobody applied yet).
        record: RestoreRecord,
        /// The nodes that must apply it.
        nodes: BTreeSet<NodeId>,
    },
    /// A node's application applied a restore.
    RestoreApplied {
        /// The node.
        node: NodeId,
        /// The restore (`restore-<epoch>`).
        restore_id: String,
    },
    /// A node could not apply the restore, or was lost.
    RestoreNodeFailed {
        /// The node.
        node: NodeId,
        /// The restore it named; `None`: whichever is under way (a lost node).
        restore_id: Option<String>,
        /// Why, for people.
        why: String,
    },
    /// A new process of a node registered without having applied the restore under way:
    /// if its previous process had applied it, the restore starts over.
    RestoreNodeRestarted {
        /// The node.
        node: NodeId,
    },
    /// A restore's timer ([`Timer::Restore`]) went off.
    RestoreTimedOut {
        /// The restore's epoch.
        epoch: u64,
    },
    /// At a term's start: the cluster's epoch and the restores a previous coordinator
    /// left (the runtime read them and stored the superseded ones as failed).
    RestoresLoaded {
        /// The epoch of the newest restore.
        epoch: u64,
        /// The newest restore, if it is in progress: resumed.
        active: Option<RestoreRecord>,
        /// The newest restore, if it failed: snapshots stay fenced.
        unfinished: Option<RestoreRecord>,
    },
    /// A daemon is in a later epoch than the store said (lost metadata?); the runtime
    /// stored the epoch counter.
    EpochRaised {
        /// The daemon's epoch.
        epoch: u64,
    },
    /// The runtime's periodic tick: ends the store refused are stored again.
    Tick,
}

/// What a start needs.
#[derive(Debug)]
pub struct StartInput {
    /// What the user asked.
    pub request: StartRequest,
    /// The topology it spans.
    pub topology: Topology,
    /// How long it may take.
    pub timeout: Duration,
    /// The user's labels.
    pub labels: BTreeMap<String, String>,
    /// The cluster's epoch now.
    pub epoch: u64,
    /// The leader's term.
    pub term: u64,
}

/// Which record the engine asks to have stored (named again in [`Input::Persisted`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persist {
    /// A snapshot's record.
    Snapshot(SnapshotWrite),
    /// The record of the restore of this epoch.
    Restore(u64),
}

/// Which of a snapshot's records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotWrite {
    /// Its record at its start.
    Started(SnapshotId),
    /// Its record at its end.
    End(SnapshotId),
}

/// A record to store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// A snapshot's (`/cairn/<cluster>/snapshots/<id>`).
    Snapshot(Box<SnapshotRecord>),
    /// A restore's (`/cairn/<cluster>/restores/<epoch>`).
    Restore(RestoreRecord),
}

/// A timer the runtime sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timer {
    /// A snapshot's timeout: [`Input::TimedOut`].
    Snapshot(SnapshotId),
    /// A restore's deadline: [`Input::RestoreTimedOut`].
    Restore(u64),
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
        record: Record,
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
    /// Tell the timer's input after `after`.
    SetTimer {
        /// Which.
        timer: Timer,
        /// When.
        after: Duration,
    },
    /// The node is now in `epoch` (its application applied the restore that made it).
    MemberEpoch {
        /// The node.
        node: NodeId,
        /// Its epoch.
        epoch: u64,
    },
    /// A restore's end is stored: tell it (automatic recovery, the fence's logs).
    RestoreEnded {
        /// The stored record.
        record: RestoreRecord,
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
        record: Box<SnapshotRecord>,
    },
}

/// An answer to a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer<E> {
    /// To [`Input::Start`]: the snapshot's id, once its record is stored.
    Started(Result<SnapshotId, Refusal<E>>),
    /// To [`Input::Abort`]: the stored record of the aborted snapshot.
    Aborted(Result<Box<SnapshotRecord>, Refusal<E>>),
    /// To [`Input::RestoreStart`]: the stored record of the restore.
    RestoreStarted(Result<Box<RestoreRecord>, Refusal<E>>),
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
    restores: restores::Restores,
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
    /// An engine that runs at most `max_in_flight` snapshots at once (at least one) and
    /// gives a restore `restore_timeout` to be applied by every node.
    pub fn new(max_in_flight: usize, restore_timeout: Duration) -> Self {
        Self {
            snapshots: snapshots::Snapshots::new(SnapshotTracker::new(max_in_flight.max(1))),
            restores: restores::Restores::new(restore_timeout),
            actions: Actions(VecDeque::new()),
        }
    }

    /// Takes `input`, which happened at `now` (milliseconds since the Unix epoch), and
    /// queues what follows from it.
    pub fn handle(&mut self, now: u64, input: Input<E>) {
        let out = &mut self.actions;
        let (snapshots, restores) = (&mut self.snapshots, &mut self.restores);
        match input {
            Input::Start { token, start } => snapshots.start(out, token, start),
            Input::IdTaken { result } => snapshots.id_taken(out, now, result),
            Input::Persisted { what, result } => match what {
                Persist::Snapshot(what) => snapshots.stored(out, what, result),
                Persist::Restore(epoch) => restores.stored(out, epoch, result),
            },
            Input::Report { node, id, report } => snapshots.report(out, now, &node, id, report),
            Input::PartStored {
                part,
                sizes,
                epoch,
                applied_restore_id,
            } => snapshots.part_stored(out, now, part, &sizes, epoch, applied_restore_id),
            Input::StorageFailed { id, node, why } => {
                let nodes = vec![node];
                snapshots.fail(out, now, id, FailureReason::Storage { nodes, why });
            }
            Input::TimedOut { id } => snapshots.timed_out(out, now, id),
            Input::Abort { token, id, reason } => snapshots.abort(out, now, token, id, reason),
            Input::FailAll { reason } => snapshots.fail_all(out, now, &reason),
            Input::NodeLost { node } => snapshots.node_lost(out, now, &node),
            Input::IdSeen { highest } => snapshots.id_seen(highest),
            Input::RestoreStart {
                token,
                record,
                nodes,
            } => {
                // The fence: a snapshot planned in the old epoch can no longer be a cut.
                snapshots.fail_all(out, now, &FailureReason::Restore);
                restores.start(out, token, record, nodes);
            }
            Input::RestoreApplied { node, restore_id } => {
                restores.applied(out, now, &node, &restore_id);
            }
            Input::RestoreNodeFailed {
                node,
                restore_id,
                why,
            } => restores.node_failed(out, now, &node, restore_id.as_deref(), &why),
            Input::RestoreNodeRestarted { node } => restores.node_restarted(out, now, &node),
            Input::RestoreTimedOut { epoch } => restores.timed_out(out, now, epoch),
            Input::RestoresLoaded {
                epoch,
                active,
                unfinished,
            } => restores.loaded(out, epoch, active, unfinished),
            Input::EpochRaised { epoch } => restores.epoch_raised(epoch),
            Input::Tick => {
                snapshots.tick(out);
                restores.tick(out, now);
            }
        }
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

    /// The cluster's epoch.
    pub fn epoch(&self) -> u64 {
        self.restores.epoch()
    }

    /// The restore under way (its record as it stands: an end not yet stored is still
    /// the restore under way).
    pub fn active_restore(&self) -> Option<&RestoreRecord> {
        self.restores.active()
    }

    /// The nodes that must apply the restore under way.
    pub fn restore_nodes(&self) -> Option<&BTreeSet<NodeId>> {
        self.restores.active_nodes()
    }

    /// The newest restore, if it failed: until a later one is applied by every node, no
    /// snapshot starts.
    pub fn unfinished_restore(&self) -> Option<&RestoreRecord> {
        self.restores.unfinished()
    }

    /// The restore that keeps snapshot `id` from being deleted, if any.
    pub fn restore_holding(&self, id: SnapshotId) -> Option<&RestoreRecord> {
        self.active_restore()
            .into_iter()
            .chain(self.unfinished_restore())
            .find(|r| r.snapshot_id == id.0)
    }
}
