//! The engine's vocabulary: what it is told ([`Input`], with the time, [`Now`]), what it
//! asks the runtime to do ([`Action`]: writes, commands, timers, answers), and why it
//! refuses ([`Refusal`]).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::control::{ChannelStatus, Membership, NodeCommand, NodeReport, Registration};
use crate::record::{MemberRecord, RemovedRecord, RestoreRecord, RosterRecord, SnapshotRecord};
use crate::schedule::{Failing, Policy, PolicyChange, PolicyError, PolicySource, PolicyView, Skip};
use crate::tracker::StartRequest;
use crate::types::{NodeId, Plan, SnapshotId};
use crate::verifier::NodePart;
use crate::{FailureReason, StartError, Topology};

use super::PartSizes;

/// An answer awaited by whoever asked, matched by the token they gave.
pub type Token = u64;

/// When an input happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Milliseconds since the Unix epoch: what records say.
    pub wall_ms: u64,
    /// Milliseconds on a monotonic clock: what silences and delays are measured on.
    pub mono_ms: u64,
}

/// What the engine is set up with.
#[derive(Debug, Clone)]
pub struct Config {
    /// The cluster's name: a daemon of another is refused.
    pub cluster: String,
    /// The most snapshots in flight at once (at least one).
    pub max_in_flight: usize,
    /// How long a restore may take to be applied by every node.
    pub restore_timeout: Duration,
    /// Remove a node down this long (`--remove-after`).
    pub remove_after: Option<Duration>,
    /// Restore the newest completed snapshot that verifies when a member's daemon restarts
    /// or a restore fails (`--auto-restore`).
    pub auto_restore: bool,
    /// Keep only the newest this many completed snapshots (`--retention`; 0: all).
    pub retention: usize,
    /// The flags' snapshot policy (the stored one is adopted with [`Input::AdoptPolicy`]).
    pub policy: Policy,
    /// The seed of the schedule's jitter.
    pub seed: u64,
    /// The leader's term: scheduled snapshots carry it.
    pub term: u64,
    /// A fixed topology (`--topology`); `None`: a full mesh of the roster.
    pub topology: Option<Topology>,
}

/// What the engine is told. `E` is the store's error, carried back to whoever asked.
#[derive(Debug)]
pub enum Input<E> {
    /// At a term's start: the stored roster and removed nodes (the runtime deleted the
    /// removals a node came back from).
    MembersLoaded {
        /// The roster's records.
        roster: Vec<RosterRecord>,
        /// The nodes removed and not back, with the incarnation that may not return.
        removed: BTreeMap<NodeId, u64>,
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
        /// The snapshot the newest restore restored: the history the cluster is on goes
        /// back to it (automatic recovery never leaves that history).
        restored: Option<SnapshotId>,
    },
    /// A daemon registers on a new session.
    Register {
        /// Whose answer ([`Answer::Registered`]); [`Action::Admit`] names it too.
        token: Token,
        /// What it says of itself.
        registration: Registration,
        /// Its session.
        session: u64,
    },
    /// A node's session ended.
    SessionEnded {
        /// The node.
        node: NodeId,
        /// The session (an older one of a node that registered again changes nothing).
        session: u64,
    },
    /// A node's heartbeat.
    Heartbeat {
        /// The node.
        node: NodeId,
        /// Whether its application is attached.
        application_attached: bool,
        /// Its channels' status (checked to be its own and bounded).
        channels: Vec<ChannelStatus>,
    },
    /// A user removes a node that is down.
    RemoveNode {
        /// Whose answer ([`Answer::Removed`]).
        token: Token,
        /// The node.
        node: NodeId,
    },
    /// A node's daemon leaves for good (`--leave-on-shutdown`); it hears
    /// [`NodeCommand::Left`].
    Leave {
        /// The node.
        node: NodeId,
    },
    /// Start a snapshot of the topology the members span.
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
        /// Which write.
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
    /// A snapshot's timer ([`Timer::Snapshot`]) went off.
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
    /// Every snapshot in flight fails for `reason` (the term ended).
    FailAll {
        /// Why.
        reason: FailureReason,
    },
    /// A user asks to restore a snapshot.
    Restore {
        /// Whose answer ([`Answer::RestoreStarted`]).
        token: Token,
        /// The snapshot.
        snapshot: SnapshotId,
        /// Its record, as the runtime read it (`None`: there is none).
        record: Option<SnapshotRecord>,
        /// Refused unless the cluster is in this epoch (`RestoreSnapshotRequest.if_epoch`).
        if_epoch: Option<u64>,
    },
    /// The verification of [`Action::Verify`] came back.
    Verified {
        /// The first candidate whose every chunk verified.
        chosen: Option<SnapshotId>,
        /// Its record, read again when the verification came back (members, the roster and
        /// the snapshot may have changed meanwhile).
        record: Option<SnapshotRecord>,
        /// The candidates that did not verify, with why.
        skipped: Vec<(SnapshotId, E)>,
    },
    /// The epoch counter answered [`Action::AllocateEpoch`].
    EpochAllocated {
        /// The epoch allocated.
        result: Result<u64, E>,
    },
    /// The store answered [`Action::List`].
    Listed {
        /// What for.
        purpose: Listing,
        /// Every snapshot record.
        result: Result<Vec<SnapshotRecord>, E>,
    },
    /// A user deletes a snapshot.
    Delete {
        /// Whose answer ([`Answer::Deleted`]).
        token: Token,
        /// The snapshot.
        snapshot: SnapshotId,
        /// Whether the runtime found its record.
        exists: bool,
    },
    /// The garbage collection of [`Action::CollectGarbage`] came back: the bytes it freed.
    Collected {
        /// The bytes freed.
        result: Result<u64, E>,
    },
    /// A node's application applied a restore.
    RestoreApplied {
        /// The node.
        node: NodeId,
        /// The restore (`restore-<epoch>`).
        restore_id: String,
    },
    /// A node could not apply a restore.
    RestoreFailed {
        /// The node.
        node: NodeId,
        /// The restore it named.
        restore_id: String,
        /// Why, for people.
        why: String,
    },
    /// A restore's timer ([`Timer::Restore`]) went off.
    RestoreTimedOut {
        /// The restore's epoch.
        epoch: u64,
    },
    /// The schedule's timer ([`CoordinatorEngine::next_due`](super::CoordinatorEngine::next_due)) went off.
    Due,
    /// The runtime worded [`Action::ScheduleRefused`]'s refusal: `busy` if it was for want
    /// of room (a skip), else a failure.
    ScheduleRefused {
        /// For want of room.
        busy: bool,
        /// Why, as users read it.
        why: String,
    },
    /// `SetPolicy`.
    SetPolicy {
        /// Whose answer ([`Answer::Policy`]).
        token: Token,
        /// The change.
        change: PolicyChange,
    },
    /// At a term's start: follow `policy` (the stored one if valid, else the flags'), once
    /// stored with its source.
    AdoptPolicy {
        /// Whose answer ([`Answer::Policy`]).
        token: Token,
        /// The policy.
        policy: Policy,
        /// Where it came from.
        source: PolicySource,
    },
    /// At a term's start: the request ids of the stored snapshots' starts, so that a
    /// start retried after a leader change answers the snapshot it started.
    StartsLoaded {
        /// Each stored snapshot with a request id, and that id.
        requests: Vec<(SnapshotId, String)>,
    },
    /// At a term's start: how every stored snapshot ended (each record has ended by
    /// then), told already as far as the applications go.
    OutcomesLoaded {
        /// The outcomes.
        outcomes: Vec<crate::lifecycle::SnapshotOutcome>,
    },
    /// A node's daemon asks for the outcomes told above `after` (its application attached
    /// naming `after`, or it registered again): answered on its session.
    OutcomesAfter {
        /// The node.
        node: NodeId,
        /// The highest id its application heard of.
        after: u64,
    },
    /// At a term's start: how old the newest completed snapshot is (freshness).
    NewestCompleted {
        /// Its age.
        age: Duration,
    },
    /// The runtime's periodic tick (every 250 ms): ends the store refused are stored
    /// again, silent members dropped, nodes down too long removed.
    Tick,
}

/// What a start needs.
#[derive(Debug)]
pub struct StartInput {
    /// What the user asked.
    pub request: StartRequest,
    /// How long it may take.
    pub timeout: Duration,
    /// The user's labels.
    pub labels: BTreeMap<String, String>,
    /// The leader's term.
    pub term: u64,
    /// The client's request id (empty for none): a start with the request id of a
    /// snapshot the engine knows answers that snapshot and starts nothing.
    pub request_id: String,
}

/// Which write the engine asks for (named again in [`Input::Persisted`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Persist {
    /// A snapshot's record.
    Snapshot(SnapshotWrite),
    /// The record of the restore of this epoch, as it was written (its status then: an
    /// acknowledgement is of what was written, not of what the record holds by now).
    Restore(u64, crate::record::RestoreStatus),
    /// A registration's records.
    Register(Token),
    /// A node's removal.
    Removal(NodeId),
    /// A user's deletion of a snapshot.
    Delete(Token, SnapshotId),
    /// Retention's deletions.
    Retention(Vec<SnapshotId>),
    /// A policy (the request's token).
    Policy(Token),
    /// A member's record deleted (its failure is only logged).
    DeleteMember(NodeId),
}

/// Which of a snapshot's records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotWrite {
    /// Its record at its start.
    Started(SnapshotId),
    /// Its record at its end.
    End(SnapshotId),
}

/// A write to the metadata store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// A snapshot's record (`/cairn/<cluster>/snapshots/<id>`).
    Snapshot(Box<SnapshotRecord>),
    /// A restore's record (`…/restores/<epoch>`).
    Restore(RestoreRecord),
    /// A node's roster record.
    Roster(RosterRecord),
    /// A member's record.
    Member(MemberRecord),
    /// A member's record deleted.
    DeleteMember(NodeId),
    /// A removed node's record deleted (it came back).
    DeleteRemoved(NodeId),
    /// A node removed: its removal recorded and its roster and member records deleted.
    Remove(RemovedRecord),
    /// The epoch counter raised to this epoch.
    EpochCounter(u64),
    /// A snapshot deleted: its parts, then its record.
    DeleteSnapshot(SnapshotId),
    /// The snapshot policy, with where it came from.
    Policy {
        /// The policy.
        policy: Policy,
        /// Its source.
        source: PolicySource,
    },
    /// Writes done in order, stopping at the first that fails.
    Batch(Vec<Write>),
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
    /// Write to the store; answer with [`Input::Persisted`] before taking the next action.
    Persist {
        /// Which write.
        what: Persist,
        /// The write.
        write: Write,
        /// The how-manyth time this write is tried (1 the first).
        attempt: u64,
    },
    /// The session that registered with `token` is now `node`'s: commands to `node` go to
    /// it (a session it had before ends).
    Admit {
        /// The node.
        node: NodeId,
        /// The registration's token.
        token: Token,
    },
    /// End `node`'s session (it is no longer a member).
    Dismiss {
        /// The node.
        node: NodeId,
    },
    /// `node` leaves: its session no longer hears what members hear, but stays open for
    /// its [`Action::Left`] (then [`Action::Dismiss`]).
    Detach {
        /// The node.
        node: NodeId,
    },
    /// Send `command` to `node` (if it has a session).
    Send {
        /// The node.
        node: NodeId,
        /// The command.
        command: NodeCommand,
    },
    /// Send `command` to every node with a session, but `except`.
    Broadcast {
        /// The command.
        command: NodeCommand,
        /// A node left out (it was told first, otherwise).
        except: Option<NodeId>,
    },
    /// Verify every chunk of `candidates`, in order, until one verifies, off the loop;
    /// answer with [`Input::Verified`].
    Verify {
        /// The snapshots, in order.
        candidates: Vec<SnapshotRecord>,
    },
    /// Allocate the next epoch; answer with [`Input::EpochAllocated`].
    AllocateEpoch,
    /// List the snapshot records; answer with [`Input::Listed`].
    List {
        /// What for.
        purpose: Listing,
    },
    /// Collect the chunks no stored part refers to, off the loop; answer with
    /// [`Input::Collected`].
    CollectGarbage,
    /// A scheduled start was refused: word the refusal and answer with
    /// [`Input::ScheduleRefused`] before the next action.
    ScheduleRefused {
        /// Why.
        refusal: Refusal<E>,
    },
    /// Automatic recovery could not restore: log it (it is tried again after a pause).
    RecoveryFailed {
        /// Who asked, as the restore record would say.
        requested_by: String,
        /// Why; `None`: no candidate verified.
        refusal: Option<Refusal<E>>,
    },
    /// Tell the timer's input after `after`.
    SetTimer {
        /// Which.
        timer: Timer,
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
    /// [`CoordinatorEngine::live_record`](super::CoordinatorEngine::live_record).
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
    /// A restore's end is stored: tell it (automatic recovery).
    RestoreEnded {
        /// The stored record.
        record: RestoreRecord,
    },
    /// Tell a leaving node whether it was removed ([`NodeCommand::Left`]): `None` if it
    /// was, else why not (it stays on the roster).
    Left {
        /// The node.
        node: NodeId,
        /// Why it was not removed.
        refusal: Option<Refusal<E>>,
    },
    /// Something for the log (and, for a restart, for automatic recovery).
    Note(Note),
}

/// What happened to the membership, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// A start repeated a request id: it was answered with the snapshot it started.
    StartRepeated {
        /// The snapshot.
        snapshot: SnapshotId,
        /// The request id.
        request_id: String,
    },
    /// A node joined or moved (the change in words).
    Changed {
        /// The node.
        node: NodeId,
        /// What changed.
        change: String,
    },
    /// A node's daemon restarted (a new incarnation): automatic recovery is due.
    Restarted {
        /// The node.
        node: NodeId,
    },
    /// A node registered, in `epoch`.
    Registered {
        /// The node.
        node: NodeId,
        /// Its address.
        address: String,
        /// The epoch it is to be in.
        epoch: u64,
    },
    /// A node missed a restore: it stays in its epoch, and snapshots are fenced.
    MissedRestore {
        /// The node.
        node: NodeId,
        /// Its epoch.
        node_epoch: u64,
        /// The cluster's.
        epoch: u64,
    },
    /// A node that had not applied the restore under way is sent it again.
    RestoreResent {
        /// The node.
        node: NodeId,
        /// The restore.
        restore_id: String,
    },
    /// A member is gone.
    Gone {
        /// The node.
        node: NodeId,
        /// Why.
        why: String,
    },
    /// A node leaves the cluster.
    Leaving {
        /// The node.
        node: NodeId,
    },
    /// A node was removed (`long_gone`: by `--remove-after`, that long).
    Removed {
        /// The node.
        node: NodeId,
        /// `--remove-after`, if it removed the node.
        long_gone: Option<Duration>,
    },
    /// A restore started (its record stored, the nodes told).
    RestoreStarted {
        /// The restore.
        restore_id: String,
        /// Its snapshot.
        snapshot: SnapshotId,
        /// The epoch it fenced the cluster with.
        epoch: u64,
        /// Who asked.
        requested_by: String,
    },
    /// What automatic recovery did or could not do, in words (error level).
    Recovery(String),
    /// A user deleted a snapshot.
    Deleted {
        /// The snapshot.
        snapshot: SnapshotId,
    },
    /// Retention deleted a snapshot.
    RetentionDeleted {
        /// The snapshot.
        snapshot: SnapshotId,
    },
    /// Retention kept a snapshot a restore refers to.
    KeptForRestore {
        /// The snapshot.
        snapshot: SnapshotId,
        /// The restore.
        restore: String,
    },
    /// Retention could not list or delete (why; it tries again after the next completed
    /// snapshot).
    Retention(String),
    /// A garbage collection failed (why); the chunks are kept.
    CollectionFailed(String),
    /// A due snapshot was skipped (counted).
    Skipped(Skip),
    /// A scheduled snapshot could not start (why).
    ScheduleFailed(String),
    /// Scheduled snapshots failed more often in a row than tolerated (an alarm).
    Failing(Failing),
    /// The policy in force now.
    PolicyAdopted {
        /// The policy.
        policy: Policy,
        /// Where it came from.
        source: PolicySource,
    },
    /// A node on the stored roster that the `--topology` file does not name: left out.
    LeftOutOfTopology {
        /// The node.
        node: NodeId,
    },
}

/// An answer to a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer<E> {
    /// To [`Input::Register`]: the membership, once the node's records are stored.
    Registered(Result<Membership, Refusal<E>>),
    /// To [`Input::RemoveNode`]: the membership without the node, once stored.
    Removed(Result<Membership, Refusal<E>>),
    /// To [`Input::Start`]: the snapshot's id, once its record is stored.
    Started(Result<SnapshotId, Refusal<E>>),
    /// To [`Input::Abort`]: the stored record of the aborted snapshot.
    Aborted(Result<Box<SnapshotRecord>, Refusal<E>>),
    /// To [`Input::SetPolicy`] and [`Input::AdoptPolicy`]: the policy in force, once stored.
    Policy(Result<PolicyView, Refusal<E>>),
    /// To [`Input::Delete`]: the bytes the garbage collection after it freed.
    Deleted(Result<u64, Refusal<E>>),
    /// To [`Input::Restore`]: the stored record of the restore.
    RestoreStarted(Result<Box<RestoreRecord>, Refusal<E>>),
}

/// Why the engine refused or could not do what was asked.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal<E> {
    /// The tracker refused the start.
    Start(StartError),
    /// The store failed (or its answer was lost: `E` says which).
    Store(E),
    /// A request that cannot be (its words say why).
    Invalid(String),
    /// A policy that cannot be used (the field and why).
    Policy(PolicyError),
    /// The snapshot is not in flight (it ended, or never was: the store knows which).
    NotInFlight(SnapshotId),
    /// The snapshot ended and its end is not stored yet: nothing can change it now.
    EndNotStored(SnapshotId),
    /// The abort ended the snapshot but its record is not stored yet (tried again at each
    /// tick while the term lasts).
    AbortNotStored(SnapshotId),
    /// The node is not a participant of the snapshot.
    NotAParticipant(SnapshotId, NodeId),
    /// Snapshots may not start now (a restore; why, in words).
    Fenced(String),
    /// A node of the topology is not connected (which, in words).
    NodesNotConnected(String),
    /// No node has registered.
    NoMembers,
    /// A daemon of another cluster.
    ClusterMismatch {
        /// This coordinator's cluster.
        ours: String,
        /// The daemon's.
        theirs: String,
    },
    /// The node id is held by another connected daemon (in words).
    NodeIdHeld(String),
    /// The node is not in the `--topology` file (in words).
    NotInTopology(String),
    /// The process was removed and may not come back as it is.
    RemovedNode(NodeId),
    /// The node is not on the roster.
    NotAMember(NodeId),
    /// The node to remove is connected.
    StillConnected {
        /// The node.
        node: NodeId,
        /// Its address.
        address: String,
    },
    /// No such snapshot.
    NotFound(SnapshotId),
    /// The snapshot is in flight, or its end is not stored yet.
    StillInProgress(SnapshotId),
    /// A restore refers to the snapshot.
    HeldByRestore {
        /// The snapshot.
        id: SnapshotId,
        /// The restore.
        restore: String,
        /// Where it is.
        status: crate::record::RestoreStatus,
    },
    /// A restore's record was not stored (or its answer was lost: `cause` says which).
    RestoreNotStored {
        /// The restore.
        restore: String,
        /// Its snapshot.
        snapshot: SnapshotId,
        /// The store's error.
        cause: E,
    },
    /// The snapshot did not complete.
    NotCompleted {
        /// The snapshot.
        id: SnapshotId,
        /// How it stands.
        status: crate::record::SnapshotStatus,
    },
    /// Nodes joined after the snapshot a restore would bring back.
    JoinedSince {
        /// The snapshot.
        snapshot: SnapshotId,
        /// The nodes.
        nodes: Vec<String>,
    },
    /// A restore is under way.
    RestoreInProgress {
        /// The restore.
        restore: String,
        /// Its snapshot.
        snapshot: SnapshotId,
    },
    /// A conditional restore's epoch is not the cluster's: another restore came in between.
    EpochMoved {
        /// The epoch the request named.
        expected: u64,
        /// The cluster's.
        current: u64,
    },
}

/// What the snapshot records are listed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listing {
    /// Automatic recovery's candidates.
    Recovery,
    /// Retention's excess.
    Retention,
}
