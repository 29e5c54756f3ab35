//! The runtime of the coordinator's engine: each input is handed to
//! [`CoordinatorEngine`](cairn_core::coordinator::CoordinatorEngine) and each action it
//! queues is carried out here, in order — ids taken, epochs allocated, records listed and
//! stored (their answers fed back before the next action), work spawned off the task
//! (verification, garbage collection), commands sent to the members' sessions, timers set,
//! answers sent, watchers, metrics and freshness told, the engine's notes logged. The
//! engine queues the telling of an outcome only once the store acknowledged it, so nothing
//! here can tell an unstored one.

use std::sync::Arc;

use cairn_core::control::NodeCommand;
use cairn_core::coordinator::{
    AUTO_RESTORE_CANDIDATES, Action, Answer, Input, Note, Persist, Refusal, SnapshotWrite, Timer,
    Token, Write,
};
use cairn_core::{SnapshotId, StartError};

use super::{Msg, State};
use crate::error::Error;
use crate::store::{EventKind, EventRecord, SnapshotRecord, SnapshotStatus};

/// An end that stays unstored is logged again every this many tries (every 10 s or so):
/// a full disk must not fill up with this log.
const LOG_EVERY: u64 = 40;

impl State {
    /// Hands `input` to the engine and carries out every action that follows; returns the
    /// answers to requests, by token.
    pub(super) async fn drive(&mut self, input: Input<Error>) -> Vec<(Token, Answer<Error>)> {
        self.engine.handle(self.now(), input);
        let mut answers = Vec::new();
        while let Some(action) = self.engine.next_action() {
            match self.execute(action).await {
                // A user's restore is answered in a later drive than the one it began in.
                Some((token, Answer::RestoreStarted(result))) => {
                    self.answer_restore(token, result);
                }
                // So is a deletion: after the garbage collection that follows it.
                Some((token, Answer::Deleted(result))) => self.answer_delete(token, result),
                Some(answer) => answers.push(answer),
                None => {}
            }
        }
        self.metrics.in_flight.set(self.engine.in_flight() as i64);
        self.metrics.members.set(self.engine.members().len() as i64);
        answers
    }

    /// A token for a request to the engine.
    pub(super) fn token(&mut self) -> Token {
        self.next_token = self.next_token.wrapping_add(1);
        self.next_token
    }

    async fn execute(&mut self, action: Action<Error>) -> Option<(Token, Answer<Error>)> {
        match action {
            Action::TakeId => {
                let result = self.meta.take_snapshot_id().await;
                self.engine.handle(self.now(), Input::IdTaken { result });
            }
            Action::SetIdCounter { id, floor } => {
                tracing::warn!(
                    snapshot = id.0,
                    daemons_saw = floor,
                    "the stored snapshot id counter is behind ids the daemons have seen (lost \
                     metadata?): continuing above them"
                );
                let result = self.meta.set_last_snapshot_id(id).await.map(|()| id);
                self.engine.handle(self.now(), Input::IdTaken { result });
            }
            Action::Persist {
                what,
                write,
                attempt,
            } => {
                let result = self.store(write).await;
                if let Err(e) = &result
                    && attempt % LOG_EVERY == 1
                {
                    match &what {
                        Persist::Snapshot(SnapshotWrite::End(id)) => tracing::error!(
                            snapshot = id.0,
                            tries = attempt,
                            "cannot store the end of the snapshot ({e}): nobody is told until \
                             it is stored (tried again every tick while this term lasts)"
                        ),
                        Persist::Restore(epoch, _) => tracing::error!(
                            epoch,
                            tries = attempt,
                            "cannot store the restore record ({e}); an end is tried again every \
                             tick (the restore stays the one under way until it is stored)"
                        ),
                        Persist::DeleteMember(node) => {
                            tracing::warn!(%node, "cannot delete the member record: {e}");
                        }
                        // A failure of these is their requester's answer.
                        // A failure of these is their requester's answer, or noted.
                        Persist::Snapshot(SnapshotWrite::Started(_))
                        | Persist::Register(_)
                        | Persist::Removal(_)
                        | Persist::Delete(..)
                        | Persist::Retention(_)
                        | Persist::Policy(_) => {}
                    }
                }
                self.engine
                    .handle(self.now(), Input::Persisted { what, result });
            }
            Action::Admit { node, token } => {
                if let Some(session) = self.registering.remove(&token) {
                    // A session the node had before ends with this one's admission.
                    self.sessions.insert(node, session);
                }
            }
            Action::Dismiss { node } => {
                self.sessions.remove(&node);
                self.leaving.remove(&node);
            }
            Action::Detach { node } => {
                if let Some(session) = self.sessions.remove(&node) {
                    self.leaving.insert(node, session);
                }
            }
            Action::Send { node, command } => {
                if let Some((_, tx)) = self.sessions.get(&node) {
                    self.command(tx, command);
                }
            }
            Action::Broadcast { command, except } => self.broadcast(&command, except.as_ref()),
            Action::Left { node, refusal } => {
                let answer = refusal.map(|refusal| self.refused(refusal).to_string());
                if let Some(why) = &answer {
                    tracing::warn!(%node, "node asked to leave and stays on the roster: {why}");
                }
                if let Some((_, tx)) = self.leaving.get(&node).or(self.sessions.get(&node)) {
                    self.command(tx, NodeCommand::Left(answer));
                }
            }
            Action::Note(note) => self.note(note),
            Action::SetTimer { timer, after } => {
                let tx = self.self_tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let msg = match timer {
                        Timer::Snapshot(id) => Msg::TimedOut { id },
                        Timer::Restore(epoch) => Msg::RestoreTimedOut { epoch },
                    };
                    let _ = tx.send(msg).await;
                });
            }
            Action::RestoreEnded { record } => self.restore_ended(&record),
            Action::Verify { candidates } => self.verify_off_task(candidates),
            Action::ScheduleRefused { refusal } => {
                let e = self.refused(refusal);
                let busy = matches!(e, Error::TooManyInFlight(_));
                let why = format!("could not start: {e}");
                self.engine
                    .handle(self.now(), Input::ScheduleRefused { busy, why });
            }
            Action::AllocateEpoch => {
                let result = self.meta.allocate_epoch().await;
                self.engine
                    .handle(self.now(), Input::EpochAllocated { result });
            }
            Action::List { purpose } => {
                let result = self.meta.snapshots().await;
                self.engine
                    .handle(self.now(), Input::Listed { purpose, result });
            }
            Action::CollectGarbage => self.collect_off_task(),
            Action::RecoveryFailed {
                requested_by,
                refusal,
            } => match refusal {
                Some(refusal) => {
                    let e = self.refused(refusal);
                    tracing::error!("{requested_by} could not restore: {e}");
                }
                None => tracing::error!(
                    "{requested_by}: no completed snapshot that verifies (of the newest \
                     {AUTO_RESTORE_CANDIDATES}); the cluster runs on as it is"
                ),
            },
            Action::Reply { token, answer } => return Some((token, answer)),
            Action::Started { plan } => {
                let span = tracing::info_span!(
                    parent: None, "snapshot", snapshot = plan.id.0, mode = %plan.mode
                );
                span.in_scope(|| tracing::info!(initiators = ?plan.initiators, "snapshot started"));
                self.spans.insert(plan.id, span);
            }
            Action::Progress { id } => {
                // A record is made for watchers only if there are any.
                if self.watchers.contains_key(&id)
                    && let Some(record) = self.engine.live_record(id)
                {
                    self.publish(&Arc::new(record));
                }
            }
            Action::Step { id, event } => self.trace(id, &event),
            Action::Ended { record } => self.tell_end(*record).await,
        }
        None
    }

    /// A refusal of the engine as the API says it. A snapshot not in flight is one the
    /// store says ended, or never was, for whoever asks to change it
    /// ([`Self::not_in_flight`]); here it is just that.
    pub(super) fn refused(&self, refusal: Refusal<Error>) -> Error {
        match refusal {
            Refusal::Start(e) => match e {
                StartError::TooManyInFlight { .. } | StartError::AlignedInFlight(_) => {
                    Error::TooManyInFlight(e.to_string())
                }
                StartError::Unreachable { .. }
                | StartError::UnknownInitiator(_)
                | StartError::DuplicateId(_) => Error::InvalidArgument(e.to_string()),
                StartError::NoMembers => Error::NoMembers,
            },
            Refusal::Store(e) => e,
            Refusal::Invalid(why) => Error::InvalidArgument(why),
            Refusal::Policy(e) => Error::InvalidArgument(cairn_proto::convert::policy_error(&e)),
            Refusal::Fenced(why) => Error::Fenced(why),
            Refusal::NodesNotConnected(why) => Error::NodesNotConnected(why),
            Refusal::NoMembers => Error::NoMembers,
            Refusal::ClusterMismatch { ours, theirs } => Error::ClusterMismatch { ours, theirs },
            Refusal::NodeIdHeld(why) => Error::NodeIdHeld(why),
            Refusal::NotInTopology(why) => Error::NotInTopology(why),
            Refusal::RemovedNode(node) => Error::Removed(node.to_string()),
            Refusal::NotAMember(node) => Error::NotAMember(node.to_string()),
            Refusal::StillConnected { node, address } => Error::StillConnected {
                node: node.to_string(),
                address,
            },
            Refusal::RestoreInProgress { restore, snapshot } => {
                Error::RestoreInProgress { restore, snapshot }
            }
            Refusal::EpochMoved { expected, current } => Error::EpochMoved { expected, current },
            Refusal::NotFound(id) => Error::SnapshotNotFound(id),
            Refusal::StillInProgress(id) => Error::StillInProgress(id),
            Refusal::HeldByRestore {
                id,
                restore,
                status,
            } => Error::HeldByRestore {
                id,
                restore,
                status,
            },
            Refusal::NotCompleted { id, status } => Error::NotCompleted {
                id,
                status,
                only: "can be restored",
            },
            Refusal::JoinedSince { snapshot, nodes } => Error::JoinedSince { snapshot, nodes },
            Refusal::RestoreNotStored { cause, .. } => cause,
            Refusal::NotInFlight(id) => Error::NotInProgress(id),
            Refusal::EndNotStored(id) => Error::OutcomeUnknown {
                what: format!("snapshot {id}'s end"),
                see: format!("GetSnapshot {id}"),
                cause: "it ended and its end is not stored yet (tried again while this term \
                        lasts): an abort can no longer change it"
                    .into(),
            },
            Refusal::AbortNotStored(id) => Error::OutcomeUnknown {
                what: format!("the abort of snapshot {id}"),
                see: format!("GetSnapshot {id}"),
                cause: "its record is not stored yet (tried again while this term lasts)".into(),
            },
            Refusal::NotAParticipant(id, node) => Error::NotAParticipant {
                id,
                node: node.to_string(),
            },
        }
    }

    /// Carries out a write: a batch in order, stopping at the first that fails.
    async fn store(&self, write: Write) -> Result<(), Error> {
        let writes = match write {
            Write::Batch(writes) => writes,
            write => vec![write],
        };
        for write in writes {
            match write {
                Write::Snapshot(record) => self.meta.put_snapshot(&record).await?,
                Write::Restore(record) => self.meta.put_restore(&record).await?,
                Write::Roster(record) => self.meta.put_roster(&record).await?,
                Write::Member(record) => self.meta.put_member(&record).await?,
                Write::DeleteMember(node) => self.meta.delete_member(node.as_str()).await?,
                Write::DeleteRemoved(node) => self.meta.delete_removed(node.as_str()).await?,
                Write::Remove(record) => self.meta.remove_node(&record).await?,
                Write::EpochCounter(epoch) => self.meta.set_epoch_counter(epoch).await?,
                Write::DeleteSnapshot(id) => self.meta.delete_snapshot(id).await?,
                Write::Policy { policy, source } => {
                    let record = crate::policy::to_record(&policy, source);
                    self.meta.put_policy(&record).await?;
                }
                Write::Batch(_) => {
                    return Err(Error::InvalidArgument(
                        "a batch of writes inside a batch (a bug in the coordinator)".into(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Logs what the engine noted (and a restart makes automatic recovery due).
    fn note(&mut self, note: Note) {
        match note {
            Note::Changed { node, change } => tracing::info!(%node, "{change}"),
            Note::StartRepeated {
                snapshot,
                request_id,
            } => tracing::info!(
                snapshot = snapshot.0,
                request_id,
                "a start repeated the request id of snapshot {snapshot}: answered with it"
            ),
            Note::Restarted { node } => {
                if self.settings.auto_restore {
                    tracing::warn!(%node, "node restarted: automatic recovery will restore the newest completed snapshot");
                } else {
                    tracing::warn!(%node, "node restarted (a new incarnation)");
                }
            }
            Note::Registered {
                node,
                address,
                epoch,
            } => tracing::info!(%node, %address, epoch, "node registered"),
            Note::MissedRestore {
                node,
                node_epoch,
                epoch,
            } => tracing::error!(
                %node,
                node_epoch,
                epoch,
                "the node missed a restore: it stays in its epoch, and no snapshot starts until \
                 a restore is applied by every node"
            ),
            Note::RestoreResent { node, restore_id } => tracing::info!(
                %node,
                restore = %restore_id,
                "the node has not applied the restore under way: sending it again"
            ),
            Note::Gone { node, why } => tracing::warn!(%node, "node disconnected: {why}"),
            Note::Leaving { node } => tracing::info!(%node, "node leaving the cluster"),
            Note::Removed { node, long_gone } => match long_gone {
                Some(after) => tracing::warn!(
                    %node,
                    "removed: down for more than --remove-after ({})",
                    humantime::format_duration(after)
                ),
                None => tracing::warn!(%node, "node removed from the cluster"),
            },
            Note::RestoreStarted {
                restore_id,
                snapshot,
                epoch,
                requested_by,
            } => tracing::warn!(
                restore = %restore_id,
                snapshot = snapshot.0,
                epoch,
                by = %requested_by,
                "restore started: the cluster is fenced with a new epoch"
            ),
            Note::Recovery(what) => tracing::error!("{what}"),
            Note::Deleted { snapshot } => tracing::info!(snapshot = snapshot.0, "snapshot deleted"),
            Note::RetentionDeleted { snapshot } => {
                tracing::info!(snapshot = snapshot.0, "retention: deleted");
            }
            Note::KeptForRestore { snapshot, restore } => tracing::info!(
                snapshot = snapshot.0,
                %restore,
                "retention: kept while a restore refers to it"
            ),
            Note::Retention(why) => tracing::warn!("retention: {why}"),
            Note::Skipped(skip) => {
                self.metrics.schedule_skipped.inc();
                tracing::info!("scheduled snapshot skipped: {skip}");
            }
            Note::ScheduleFailed(why) => tracing::warn!("scheduled snapshot {why}"),
            Note::Failing(f) => tracing::error!(
                consecutive = f.consecutive,
                tolerated = f.tolerated,
                "scheduled snapshots are failing: {} in a row, more than the {} tolerated; \
                 last: {}",
                f.consecutive,
                f.tolerated,
                f.last_failure
            ),
            Note::PolicyAdopted { policy, source } => tracing::info!(
                source = source.name(),
                "snapshot policy: {}",
                crate::policy::describe(&policy)
            ),
            Note::CollectionFailed(why) => {
                tracing::warn!("garbage collection failed; the chunks are kept: {why}");
            }
            Note::LeftOutOfTopology { node } => {
                tracing::warn!(%node, "node on the roster but not in --topology: left out");
            }
        }
    }

    /// Why snapshot `id`, not in flight, cannot be changed: it ended (the store has its
    /// record) or it never was.
    pub(super) async fn not_in_flight(&self, id: SnapshotId) -> Error {
        match self.get_record(id).await {
            Ok(Some(record)) => Error::AlreadyEnded {
                id,
                status: record.status,
            },
            Ok(None) => Error::SnapshotNotFound(id),
            Err(e) => e,
        }
    }

    /// The one place a snapshot's end is told to watchers, metrics and freshness; the engine
    /// asks for it only once the store acknowledged the end (the nodes were told to drop a
    /// failed one, and the schedule and retention heard of it, in the engine).
    async fn tell_end(&mut self, record: SnapshotRecord) {
        let id = SnapshotId(record.id);
        let span = self.spans.remove(&id).unwrap_or_else(tracing::Span::none);
        span.in_scope(|| match (&record.failure, &record.verdict) {
            (None, verdict) => tracing::info!(
                ms = record.finished_at_ms.saturating_sub(record.started_at_ms),
                recorded = verdict.as_ref().map_or(0, |v| v.recorded_messages),
                "snapshot completed and verified"
            ),
            (Some(failure), _) => {
                tracing::warn!(reason = %failure.message, "snapshot did not complete");
            }
        });
        if let Some(watchers) = self.watchers.remove(&id) {
            let told = Arc::new(record.clone());
            for watcher in watchers {
                let _ = watcher.try_send(Ok(told.clone()));
            }
        }
        self.metrics.snapshot_ended(&record);
        self.refresh().await;
    }

    /// Tells the record's watchers of a snapshot's progress. Progress of a snapshot in
    /// flight lives in the engine only (a restarted coordinator fails such a snapshot
    /// anyway), which spares the store a synced write per node and step; its end is told by
    /// [`Self::tell_end`] only.
    pub(super) fn publish(&mut self, record: &Arc<SnapshotRecord>) {
        debug_assert_eq!(record.status, SnapshotStatus::InProgress);
        if let Some(watchers) = self.watchers.get_mut(&SnapshotId(record.id)) {
            watchers.retain(|w| w.try_send(Ok(record.clone())).is_ok() || !w.is_closed());
        }
    }

    /// Logs a step of snapshot `id` inside its span.
    fn trace(&self, id: SnapshotId, event: &EventRecord) {
        let Some(span) = self.spans.get(&id) else {
            return;
        };
        span.in_scope(|| match event.kind {
            EventKind::PartStored => tracing::debug!(
                node = %event.node,
                state_bytes = event.local_state_bytes,
                recorded_messages = event.recorded_messages,
                bytes_new = event.bytes_new,
                bytes_reused = event.bytes_reused,
                "part stored"
            ),
            EventKind::StateRecorded => tracing::debug!(node = %event.node, "state recorded"),
            _ => tracing::debug!(node = %event.node, detail = %event.detail, "{:?}", event.kind),
        });
    }
}
