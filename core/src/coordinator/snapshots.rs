//! The engine's snapshot role: a snapshot's start (the id above every id a daemon saw, the
//! record stored before the initiators hear of it), its progress, and its end (stored —
//! again at every tick while the store refuses it — and only then told).

use std::collections::BTreeMap;
use std::time::Duration;

use super::{
    Action, Actions, Answer, Note, Persist, Refusal, SnapshotWrite, StartInput, Timer, Token, Write,
};
use crate::control::{NodeCommand, NodeReport, StateTimes};
use crate::lifecycle::{Outcomes, SnapshotOutcome, Told};
use crate::record::{
    EventKind, EventRecord, SnapshotRecord, SnapshotStatus, VerdictRecord, event_detail,
};
use crate::schedule::Schedule;
use crate::tracker::{self, Progress, SnapshotTracker, Update};
use crate::types::{NodeId, SnapshotId};
use crate::verifier::NodePart;
use crate::{FailureReason, Topology};

/// What a stored part weighs, for the snapshot's record and its event.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PartSizes {
    /// Bytes it stored anew.
    pub bytes_new: u64,
    /// Bytes it shares with earlier snapshots.
    pub bytes_reused: u64,
    /// Bytes of the node's local state.
    pub local_state_bytes: u64,
    /// Messages the node recorded.
    pub recorded_messages: u64,
}

/// Who asked for a start, and so who hears of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StartBy {
    /// A user's `StartSnapshot`, answered with this token.
    User(Token),
    /// The schedule: [`Schedule::started`], or [`Action::ScheduleRefused`].
    Schedule,
}

/// A start under way.
enum Starting {
    /// Waiting for its id.
    Id {
        by: StartBy,
        start: StartInput,
        topology: Topology,
        epoch: u64,
    },
    /// Planned, waiting for its record to be stored.
    Record {
        by: StartBy,
        timeout: Duration,
        plan: crate::Plan,
        record: Box<SnapshotRecord>,
    },
}

/// A snapshot's end, waiting for the store.
struct Unstored {
    record: SnapshotRecord,
    failed: Option<FailureReason>,
    /// Stores tried so far.
    tries: u64,
}

pub(super) struct Snapshots {
    tracker: SnapshotTracker,
    /// Each snapshot in flight's record (its progress is the tracker's).
    inflight: BTreeMap<SnapshotId, SnapshotRecord>,
    /// Snapshots that ended but whose end the store has not acknowledged: told to nobody,
    /// stored again every tick.
    unstored: BTreeMap<SnapshotId, Unstored>,
    /// The start under way (one at a time: the runtime answers each step before the next
    /// input).
    starting: Option<Starting>,
    /// Aborts waiting for their snapshot's end to be stored.
    aborting: BTreeMap<SnapshotId, Token>,
    /// The highest snapshot id any daemon reported: no id at or below it is handed out.
    id_floor: u64,
    /// The schedule: scheduled starts, and every end fed back to it (on the engine's
    /// monotonic clock).
    pub(super) schedule: Schedule,
    /// The request ids of the starts this engine knows: loaded at the term's start from
    /// the stored records, and each start stored since.
    requests: Requests,
    /// The ends told to the members' applications, in id order (`crate::lifecycle`).
    told: Told,
}

/// The request ids of the newest [`MAX_REQUESTS`] snapshots started with one.
#[derive(Default)]
struct Requests {
    by_request: BTreeMap<String, SnapshotId>,
    by_snapshot: BTreeMap<SnapshotId, String>,
}

/// How many request ids are remembered (the newest snapshots'): far more than a client
/// retries across, in memory bounded by the ids' 128 bytes.
pub const MAX_REQUESTS: usize = 4096;

impl Requests {
    fn insert(&mut self, id: SnapshotId, request_id: String) {
        if request_id.is_empty() || self.by_request.contains_key(&request_id) {
            return;
        }
        self.by_request.insert(request_id.clone(), id);
        if let Some(old) = self.by_snapshot.insert(id, request_id) {
            self.by_request.remove(&old);
        }
        while self.by_snapshot.len() > MAX_REQUESTS {
            if let Some((_, oldest)) = self.by_snapshot.pop_first() {
                self.by_request.remove(&oldest);
            }
        }
    }

    fn remove(&mut self, id: SnapshotId) {
        if let Some(request_id) = self.by_snapshot.remove(&id) {
            self.by_request.remove(&request_id);
        }
    }
}

impl Snapshots {
    pub(super) fn new(tracker: SnapshotTracker, schedule: Schedule) -> Self {
        Self {
            schedule,
            tracker,
            inflight: BTreeMap::new(),
            unstored: BTreeMap::new(),
            starting: None,
            aborting: BTreeMap::new(),
            id_floor: 0,
            requests: Requests::default(),
            told: Told::default(),
        }
    }

    /// At a term's start: the ends earlier terms stored, as told (a daemon that missed one
    /// hears it when it catches up).
    pub(super) fn outcomes_loaded(&mut self, outcomes: Vec<SnapshotOutcome>) {
        self.told.loaded(outcomes);
    }

    /// A daemon's catch-up: the outcomes told above `after`.
    pub(super) fn outcomes_after(&self, after: u64) -> Outcomes {
        self.told.after(after)
    }

    /// The lowest snapshot id still open: in flight, or its end not stored.
    fn lowest_open(&self) -> Option<SnapshotId> {
        let inflight = self.inflight.keys().next().copied();
        let unstored = self.unstored.keys().next().copied();
        match (inflight, unstored) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The snapshot started with `request_id`, if this engine knows one (never for an
    /// empty request id).
    pub(super) fn requested(&self, request_id: &str) -> Option<SnapshotId> {
        if request_id.is_empty() {
            return None;
        }
        self.requests.by_request.get(request_id).copied()
    }

    /// Snapshot `id` was started with `request_id` (a stored record's, at a term's start).
    pub(super) fn remember_request(&mut self, id: SnapshotId, request_id: String) {
        self.requests.insert(id, request_id);
    }

    /// Snapshot `id`'s record is deleted: its request id names nothing any more.
    pub(super) fn forget_request(&mut self, id: SnapshotId) {
        self.requests.remove(id);
    }

    pub(super) fn tracker(&self) -> &SnapshotTracker {
        &self.tracker
    }

    pub(super) fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    pub(super) fn unstored(&self) -> usize {
        self.unstored.len()
    }

    pub(super) fn id_floor(&self) -> u64 {
        self.id_floor
    }

    pub(super) fn is_open(&self, id: SnapshotId) -> bool {
        self.inflight.contains_key(&id) || self.unstored.contains_key(&id)
    }

    pub(super) fn check_upload<E>(&self, id: SnapshotId, node: &NodeId) -> Result<(), Refusal<E>> {
        match self.inflight.get(&id) {
            None => Err(Refusal::NotInFlight(id)),
            Some(r) if !r.nodes.iter().any(|n| n == node.as_str()) => {
                Err(Refusal::NotAParticipant(id, node.clone()))
            }
            Some(_) => Ok(()),
        }
    }

    pub(super) fn live_record(&self, id: SnapshotId) -> Option<SnapshotRecord> {
        let mut record = self.inflight.get(&id)?.clone();
        if let Some(progress) = self.tracker.progress(id) {
            with_progress(&mut record, &progress);
        }
        Some(record)
    }

    /// A start: every check before an id is spent, then the id is taken.
    pub(super) fn start<E>(
        &mut self,
        out: &mut Actions<E>,
        by: StartBy,
        start: StartInput,
        topology: Topology,
        epoch: u64,
    ) {
        if let Err(e) = self.tracker.check(&start.request, &topology) {
            return self.answer_start(out, by, Err(Refusal::Start(e)));
        }
        self.starting = Some(Starting::Id {
            by,
            start,
            topology,
            epoch,
        });
        out.push(Action::TakeId);
    }

    /// The store answered for a snapshot's record; whether that stored a completed
    /// snapshot's end.
    pub(super) fn stored<E: std::fmt::Display>(
        &mut self,
        out: &mut Actions<E>,
        mono_ms: u64,
        what: SnapshotWrite,
        result: Result<(), E>,
    ) -> bool {
        match what {
            SnapshotWrite::Started(id) => {
                self.start_stored(out, id, result);
                false
            }
            SnapshotWrite::End(id) => self.end_stored(out, mono_ms, id, result),
        }
    }

    /// A node reported on snapshot `id`.
    pub(super) fn report<E>(
        &mut self,
        out: &mut Actions<E>,
        now: u64,
        node: &NodeId,
        id: SnapshotId,
        report: NodeReport,
    ) {
        match report {
            NodeReport::StateRecorded(times) => {
                let update = self.tracker.state_recorded(id, node);
                if !matches!(update, Update::Ignored) {
                    let event = self.state_recorded_event(id, node, now, times);
                    self.push_step(out, id, event);
                }
                self.settle(out, now, id, update);
            }
            NodeReport::Failed(reason) => {
                let detail = event_detail(&reason.to_string());
                let update = self.tracker.fail(id, reason);
                // Only a failure that counted (the first of a participant ends it).
                if !matches!(update, Update::Ignored) {
                    self.step(out, id, node, now, EventKind::NodeFailed, detail);
                }
                self.settle(out, now, id, update);
            }
        }
    }

    /// A node's part is stored: it counts unless it was recorded in another epoch than
    /// the snapshot's.
    pub(super) fn part_stored<E>(
        &mut self,
        out: &mut Actions<E>,
        now: u64,
        part: NodePart,
        sizes: &PartSizes,
        epoch: u64,
        applied_restore_id: String,
    ) {
        let id = part.report.id;
        if let Some(expected) = self.inflight.get(&id).map(|r| r.epoch)
            && epoch != expected
        {
            let applied = if applied_restore_id.is_empty() {
                "no restore".to_owned()
            } else {
                applied_restore_id
            };
            let node = &part.report.node;
            let reason = FailureReason::MixedEpochs {
                nodes: vec![node.clone()],
                detail: format!(
                    "snapshot {id} started in epoch {expected}, node {node} recorded its part \
                     in epoch {epoch} (after {applied})"
                ),
            };
            let update = self.tracker.fail(id, reason);
            return self.settle(out, now, id, update);
        }
        let reporter = part.report.node.clone();
        let update = self.tracker.part_reported(part);
        if !matches!(update, Update::Ignored) {
            self.count_part(out, now, id, &reporter, sizes);
        }
        self.settle(out, now, id, update);
    }

    /// Snapshot `id` fails for `reason` (if it is in flight).
    pub(super) fn fail<E>(
        &mut self,
        out: &mut Actions<E>,
        now: u64,
        id: SnapshotId,
        reason: FailureReason,
    ) {
        let update = self.tracker.fail(id, reason);
        self.settle(out, now, id, update);
    }

    /// Snapshot `id`'s timer went off.
    pub(super) fn timed_out<E>(&mut self, out: &mut Actions<E>, now: u64, id: SnapshotId) {
        let update = self.tracker.timed_out(id);
        self.settle(out, now, id, update);
    }

    /// Every snapshot in flight fails for `reason`.
    pub(super) fn fail_all<E>(&mut self, out: &mut Actions<E>, now: u64, reason: &FailureReason) {
        let ids: Vec<SnapshotId> = self.inflight.keys().copied().collect();
        for id in ids {
            self.fail(out, now, id, reason.clone());
        }
    }

    /// `node` was lost: the snapshots it takes part in fail.
    pub(super) fn node_lost<E>(&mut self, out: &mut Actions<E>, now: u64, node: &NodeId) {
        for (id, update) in self.tracker.node_lost(node) {
            self.settle(out, now, id, update);
        }
    }

    /// A daemon saw ids up to `highest`.
    pub(super) fn id_seen(&mut self, highest: u64) {
        self.id_floor = self.id_floor.max(highest);
    }

    /// The tick: every end the store refused is stored again.
    pub(super) fn tick<E>(&mut self, out: &mut Actions<E>) {
        let ids: Vec<SnapshotId> = self.unstored.keys().copied().collect();
        for id in ids {
            self.store_end(out, id);
        }
    }

    /// The id counter answered: an id above every id a daemon saw is planned and its
    /// record stored.
    pub(super) fn id_taken<E: std::fmt::Display>(
        &mut self,
        out: &mut Actions<E>,
        now: u64,
        result: Result<SnapshotId, E>,
    ) {
        let Some(Starting::Id {
            by,
            start,
            topology,
            epoch,
        }) = self.starting.take()
        else {
            return;
        };
        let id = match result {
            Err(e) => return self.answer_start(out, by, Err(Refusal::Store(e))),
            Ok(id) if id.0 > self.id_floor => id,
            Ok(_) => {
                // The counter is behind ids the daemons saw (lost metadata?): continue
                // above them, the counter stored there first. Its answer comes back as
                // `IdTaken(Ok(above))`, above the floor.
                let above = SnapshotId(self.id_floor.saturating_add(1));
                self.starting = Some(Starting::Id {
                    by,
                    start,
                    topology,
                    epoch,
                });
                return out.push(Action::SetIdCounter {
                    id: above,
                    floor: self.id_floor,
                });
            }
        };
        let StartInput {
            request,
            timeout,
            labels,
            term,
            request_id,
        } = start;
        let mut plan = match self.tracker.start(id, request, &topology) {
            Ok(plan) => plan,
            Err(e) => return self.answer_start(out, by, Err(Refusal::Start(e))),
        };
        // Nodes count an alignment timeout from here.
        plan.started_at_ms = now;
        let record = SnapshotRecord {
            id: id.0,
            mode: plan.mode.to_string(),
            initiators: plan.initiators.iter().map(ToString::to_string).collect(),
            alignment_timeout_ms: plan
                .alignment_timeout
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            status: SnapshotStatus::InProgress,
            failure: None,
            verdict: None,
            started_at_ms: now,
            finished_at_ms: 0,
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            labels,
            nodes: topology.nodes().iter().map(ToString::to_string).collect(),
            channels: topology
                .channels()
                .iter()
                .map(ToString::to_string)
                .collect(),
            recorded: Vec::new(),
            reported: Vec::new(),
            bytes_new: 0,
            bytes_reused: 0,
            epoch,
            term,
            events: vec![EventRecord::new(now, EventKind::Started)],
            request_id,
        };
        out.push(Action::Persist {
            what: Persist::Snapshot(SnapshotWrite::Started(id)),
            write: Write::Snapshot(Box::new(record.clone())),
            attempt: 1,
        });
        self.starting = Some(Starting::Record {
            by,
            timeout,
            plan,
            record: Box::new(record),
        });
    }

    /// A started snapshot's record is stored (or not): only now do the initiators hear
    /// of it and the user get its id.
    fn start_stored<E: std::fmt::Display>(
        &mut self,
        out: &mut Actions<E>,
        id: SnapshotId,
        result: Result<(), E>,
    ) {
        let Some(Starting::Record {
            by,
            timeout,
            plan,
            record,
        }) = self
            .starting
            .take_if(|s| matches!(s, Starting::Record { plan, .. } if plan.id == id))
        else {
            return;
        };
        if let Err(e) = result {
            let why = e.to_string();
            let update = self.tracker.fail(
                id,
                FailureReason::Storage {
                    nodes: Vec::new(),
                    why,
                },
            );
            // Nobody heard of it: it ends here, told to nobody and stored nowhere.
            debug_assert!(matches!(update, Update::Finished(..)), "{update:?}");
            return self.answer_start(out, by, Err(Refusal::Store(e)));
        }
        self.requests.insert(id, record.request_id.clone());
        self.inflight.insert(id, *record);
        for initiator in &plan.initiators {
            out.push(Action::Send {
                node: initiator.clone(),
                command: NodeCommand::Initiate(plan.clone()),
            });
        }
        out.push(Action::SetTimer {
            timer: Timer::Snapshot(id),
            after: timeout,
        });
        out.push(Action::Started { plan });
        self.answer_start(out, by, Ok(id));
    }

    /// Answers whoever asked for a start: a user, or the schedule (a refusal goes to the
    /// runtime, which words it: [`Action::ScheduleRefused`]).
    fn answer_start<E>(
        &mut self,
        out: &mut Actions<E>,
        by: StartBy,
        result: Result<SnapshotId, Refusal<E>>,
    ) {
        match (by, result) {
            (StartBy::User(token), result) => out.push(Action::Reply {
                token,
                answer: Answer::Started(result),
            }),
            (StartBy::Schedule, Ok(id)) => self.schedule.started(id),
            (StartBy::Schedule, Err(refusal)) => out.push(Action::ScheduleRefused { refusal }),
        }
    }

    pub(super) fn abort<E>(
        &mut self,
        out: &mut Actions<E>,
        now: u64,
        token: Token,
        id: SnapshotId,
        reason: String,
    ) {
        if self.unstored.contains_key(&id) {
            return out.push(reply_aborted(token, Err(Refusal::EndNotStored(id))));
        }
        if !self.inflight.contains_key(&id) {
            return out.push(reply_aborted(token, Err(Refusal::NotInFlight(id))));
        }
        let reason = if reason.is_empty() {
            "aborted by a user".to_owned()
        } else {
            reason
        };
        let update = self.tracker.fail(id, FailureReason::Aborted(reason));
        if matches!(update, Update::Ignored) {
            return out.push(reply_aborted(token, Err(Refusal::NotInFlight(id))));
        }
        // Answered when the end's store answers.
        self.aborting.insert(id, token);
        self.settle(out, now, id, update);
    }

    /// Applies a tracker update: progress is published; an end is stored, and told once
    /// stored.
    fn settle<E>(&mut self, out: &mut Actions<E>, now: u64, id: SnapshotId, update: Update) {
        let (outcome, progress) = match update {
            Update::Ignored => return,
            Update::Progress => return out.push(Action::Progress { id }),
            Update::Finished(outcome, progress) => (outcome, progress),
        };
        let Some(mut record) = self.inflight.remove(&id) else {
            return;
        };
        with_progress(&mut record, &progress);
        record.finished_at_ms = now;
        match &outcome {
            tracker::Outcome::Completed(consistent) => {
                record.status = SnapshotStatus::Completed;
                record.verdict = Some(VerdictRecord {
                    consistent: true,
                    violation: String::new(),
                    recorded_messages: consistent.recorded_messages,
                });
            }
            tracker::Outcome::Failed(reason) => {
                record.status = if matches!(reason, FailureReason::Aborted(_)) {
                    SnapshotStatus::Aborted
                } else {
                    SnapshotStatus::Failed
                };
                if let Some(violation) = outcome.violation() {
                    record.verdict = Some(VerdictRecord {
                        consistent: false,
                        violation: violation.to_string(),
                        recorded_messages: 0,
                    });
                }
                record.failure = Some(reason.into());
            }
        }
        if let Some(verdict) = &record.verdict {
            record.events.push(EventRecord {
                recorded_messages: verdict.recorded_messages,
                detail: event_detail(&verdict.violation),
                ..EventRecord::new(record.finished_at_ms, EventKind::Verified)
            });
        }
        record.push_ended();
        let failed = match outcome {
            tracker::Outcome::Failed(reason) => Some(reason),
            tracker::Outcome::Completed(_) => None,
        };
        self.unstored.insert(
            id,
            Unstored {
                record,
                failed,
                tries: 0,
            },
        );
        self.store_end(out, id);
    }

    /// Asks for the end of snapshot `id` (waiting in `unstored`) to be stored.
    fn store_end<E>(&mut self, out: &mut Actions<E>, id: SnapshotId) {
        if let Some(unstored) = self.unstored.get_mut(&id) {
            unstored.tries = unstored.tries.saturating_add(1);
            out.push(Action::Persist {
                what: Persist::Snapshot(SnapshotWrite::End(id)),
                write: Write::Snapshot(Box::new(unstored.record.clone())),
                attempt: unstored.tries,
            });
        }
    }

    /// The store answered for the end of snapshot `id`: stored, it is told — to the nodes
    /// (drop a failed one), to whoever aborted it, and to the runtime ([`Action::Ended`]);
    /// not stored, it stays waiting, told to nobody.
    fn end_stored<E>(
        &mut self,
        out: &mut Actions<E>,
        mono_ms: u64,
        id: SnapshotId,
        result: Result<(), E>,
    ) -> bool {
        if result.is_err() {
            if let Some(token) = self.aborting.remove(&id) {
                out.push(reply_aborted(token, Err(Refusal::AbortNotStored(id))));
            }
            return false;
        }
        let Some(Unstored { record, failed, .. }) = self.unstored.remove(&id) else {
            return false;
        };
        let completed = record.status == SnapshotStatus::Completed;
        if let Some(reason) = &failed {
            out.push(Action::Broadcast {
                command: NodeCommand::Abort {
                    snapshot: id,
                    reason: reason.to_string(),
                },
                except: None,
            });
        }
        if let Some(token) = self.aborting.remove(&id) {
            out.push(reply_aborted(token, Ok(Box::new(record.clone()))));
        }
        let outcome = match &record.failure {
            None => Ok(()),
            Some(failure) => Err(failure.message.clone()),
        };
        // Stored: the members' applications hear it, in id order (after every lower id).
        let told = match &outcome {
            Ok(()) => SnapshotOutcome::completed(id),
            Err(why) => SnapshotOutcome::aborted(id, why),
        };
        if let Some(push) = self.told.stored(told, self.lowest_open()) {
            out.push(Action::Broadcast {
                command: NodeCommand::Outcomes(push),
                except: None,
            });
        }
        out.push(Action::Ended {
            record: Box::new(record),
        });
        // The schedule hears every end (a manual snapshot's counts for freshness).
        if let Some(failing) = self.schedule.finished(id, mono_ms, outcome) {
            out.push(Action::Note(Note::Failing(failing)));
        }
        completed
    }

    /// Adds a node's step to the timeline of snapshot `id`, if it is in flight: once per
    /// node and kind (a repeated report adds nothing, so a timeline holds at most two
    /// events per node and four more).
    fn step<E>(
        &mut self,
        out: &mut Actions<E>,
        id: SnapshotId,
        node: &NodeId,
        now: u64,
        kind: EventKind,
        detail: String,
    ) {
        let event = EventRecord {
            node: node.to_string(),
            detail,
            ..EventRecord::new(now, kind)
        };
        self.push_step(out, id, event);
    }

    /// Adds `event`, a node's step, to the timeline of snapshot `id` unless that node's
    /// step of that kind is there already (see [`Self::step`]).
    fn push_step<E>(&mut self, out: &mut Actions<E>, id: SnapshotId, event: EventRecord) {
        let Some(record) = self.inflight.get_mut(&id) else {
            return;
        };
        if record
            .events
            .iter()
            .any(|e| e.kind == event.kind && e.node == event.node)
        {
            return;
        }
        record.events.push(event.clone());
        out.push(Action::Step { id, event });
    }

    /// Node `node`'s STATE_RECORDED event at `now`, with its own account of how long it
    /// took (`times`): the marker's start delay is the time from the start to the report
    /// less the node's time since its first sight of the snapshot (so the two clocks need
    /// not agree); alignment and held messages only in ALIGNED mode.
    fn state_recorded_event(
        &self,
        id: SnapshotId,
        node: &NodeId,
        now: u64,
        times: StateTimes,
    ) -> EventRecord {
        let mut event = EventRecord {
            node: node.to_string(),
            ..EventRecord::new(now, EventKind::StateRecorded)
        };
        if let Some(record) = self.inflight.get(&id) {
            let since_start = now.saturating_sub(record.started_at_ms);
            event.start_delay_ms = times
                .recording_for_ms
                .map(|took| since_start.saturating_sub(took));
            if record.mode == "ALIGNED" {
                event.alignment_ms = times.aligned_ms.map(|ms| ms.min(since_start));
                event.held_messages = times.held_messages;
            }
        }
        event
    }

    /// Node `node`'s part of snapshot `id` is stored (the tracker took it): its sizes count
    /// in the record and its event says them. A part stored again (a daemon that uploaded
    /// twice) replaces the first: its sizes and event, as the tracker replaces the part.
    fn count_part<E>(
        &mut self,
        out: &mut Actions<E>,
        now: u64,
        id: SnapshotId,
        node: &NodeId,
        sizes: &PartSizes,
    ) {
        let Some(record) = self.inflight.get_mut(&id) else {
            return;
        };
        let node = node.to_string();
        if let Some(at) = record
            .events
            .iter()
            .position(|e| e.kind == EventKind::PartStored && e.node == node)
        {
            let earlier = record.events.remove(at);
            record.bytes_new = record.bytes_new.saturating_sub(earlier.bytes_new);
            record.bytes_reused = record.bytes_reused.saturating_sub(earlier.bytes_reused);
        }
        record.bytes_new = record.bytes_new.saturating_add(sizes.bytes_new);
        record.bytes_reused = record.bytes_reused.saturating_add(sizes.bytes_reused);
        let event = EventRecord {
            node,
            local_state_bytes: sizes.local_state_bytes,
            recorded_messages: sizes.recorded_messages,
            bytes_new: sizes.bytes_new,
            bytes_reused: sizes.bytes_reused,
            ..EventRecord::new(now, EventKind::PartStored)
        };
        record.events.push(event.clone());
        out.push(Action::Step { id, event });
    }
}

/// Who recorded and who reported, as the tracker — the one place that follows progress —
/// says.
fn with_progress(record: &mut SnapshotRecord, progress: &Progress) {
    record.recorded = progress.recorded.iter().map(ToString::to_string).collect();
    record.reported = progress.reported.iter().map(ToString::to_string).collect();
}

fn reply_aborted<E>(token: Token, result: Result<Box<SnapshotRecord>, Refusal<E>>) -> Action<E> {
    Action::Reply {
        token,
        answer: Answer::Aborted(result),
    }
}
