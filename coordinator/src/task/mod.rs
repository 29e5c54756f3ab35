//! The coordinator's one task: the runtime of the coordinator's engine
//! ([`cairn_core::coordinator::CoordinatorEngine`]). Requests come in as [`Msg`]s, in
//! order; the engine decides, and `drive.rs` carries out what it decided — every change is
//! written to the metadata store before anyone is told.

use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::time::Duration;

use cairn_core::control::NodeCommand;
use cairn_core::coordinator::{Config, CoordinatorEngine, Input, Now};
use cairn_core::lifecycle::SnapshotOutcome;
use cairn_core::schedule::Policy;
use cairn_core::{FailureReason, NodeId, SnapshotId, SnapshotMode, Topology};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Status;
use tonic_health::server::HealthReporter;

use crate::error::Error;
use crate::store::Metadata;
use crate::store::SnapshotStatus;
use cairn_blob::BlobStore;
use cairn_proto::stored::convert::now_ms;

mod drive;
mod membership;
mod msg;
mod recovery;
mod restore;
mod retention;
mod schedule;
mod snapshots;
#[cfg(test)]
mod tests;

pub(crate) use msg::{MAX_HEARTBEAT_CHANNELS, Msg, NodeTx, PartSizes, ToNode, WatchTx};

/// Settings the task needs.
pub(crate) struct Settings {
    pub cluster: String,
    pub retention: usize,
    /// How old an unreferenced chunk must be to be collected.
    pub gc_grace: Duration,
    /// Remove a node down this long (`--remove-after`).
    pub remove_after: Option<Duration>,
    /// A fixed topology (`--topology`); `None`: a full mesh of the roster.
    pub topology: Option<Topology>,
    /// The snapshot policy of the flags (a stored one set through the API wins).
    pub policy: Policy,
    /// Restore the newest completed snapshot when a member's daemon restarts.
    pub auto_restore: bool,
    /// How long a restore may take.
    pub restore_timeout: Duration,
    /// The term this task leads (the embedded store's: term 0, for good).
    pub leadership: std::sync::Arc<crate::leader::election::Leadership>,
}

pub(crate) struct State {
    /// The term this task leads: every command carries it, and nothing is sent or written
    /// once it ended.
    leadership: std::sync::Arc<crate::leader::election::Leadership>,
    metrics: crate::metrics::CoordinatorMetrics,
    settings: Settings,
    /// The metadata store, typed.
    meta: Metadata,
    blobs: BlobStore,
    /// What is decided about snapshots, restores and membership, sans-IO (the tracker, the
    /// records in flight, the id floor; the epoch and the restores; the roster, the members
    /// and the removed nodes). This task carries out its actions (`drive.rs`).
    engine: CoordinatorEngine<Error>,
    /// Each member's session: the stream its commands go to, and the session's number.
    sessions: BTreeMap<NodeId, (u64, NodeTx)>,
    /// The sessions of nodes leaving, until they are told whether they left.
    leaving: BTreeMap<NodeId, (u64, NodeTx)>,
    /// The sessions of registrations under way, by token, until the engine admits them.
    registering: BTreeMap<u64, (u64, NodeTx)>,
    /// The zero of the engine's monotonic milliseconds.
    started: Instant,
    /// The token of the next request given to the engine.
    next_token: u64,
    /// Each snapshot in flight's `tracing` span (`snapshot{snapshot=ID mode=…}`): the
    /// coordinator's part of the snapshot's trace, its steps logged inside.
    spans: BTreeMap<SnapshotId, tracing::Span>,
    watchers: BTreeMap<SnapshotId, Vec<WatchTx>>,
    self_tx: mpsc::Sender<Msg>,
    health: HealthReporter,
    /// What the freshness health service says now; `None` before it is first set.
    stale: Option<bool>,
    /// Whether the schedule was reported failing.
    failing: bool,
    /// The users' deletions waiting for their answer, by token (it comes after the garbage
    /// collection that follows them, in a later drive).
    delete_replies: BTreeMap<u64, retention::DeleteReply>,
    /// The users' restores waiting for their answer, by token (it comes in a later drive).
    restore_replies: BTreeMap<u64, restore::RestoreReply>,
}

impl State {
    pub(crate) fn new(
        metrics: crate::metrics::CoordinatorMetrics,
        settings: Settings,
        meta: Metadata,
        blobs: BlobStore,
        max_in_flight: usize,
        self_tx: mpsc::Sender<Msg>,
        health: HealthReporter,
    ) -> Self {
        let seed = std::collections::hash_map::RandomState::new().hash_one(now_ms());
        Self {
            health,
            stale: None,
            failing: false,
            delete_replies: BTreeMap::new(),
            restore_replies: BTreeMap::new(),
            leadership: settings.leadership.clone(),
            metrics,
            engine: CoordinatorEngine::new(Config {
                cluster: settings.cluster.clone(),
                max_in_flight,
                restore_timeout: settings.restore_timeout,
                remove_after: settings.remove_after,
                auto_restore: settings.auto_restore,
                retention: settings.retention,
                policy: settings.policy.clone(),
                seed,
                term: settings.leadership.term(),
                topology: settings.topology.clone(),
            }),
            sessions: BTreeMap::new(),
            leaving: BTreeMap::new(),
            registering: BTreeMap::new(),
            started: Instant::now(),
            settings,
            meta,
            blobs,
            next_token: 0,
            spans: BTreeMap::new(),
            watchers: BTreeMap::new(),
            self_tx,
        }
    }

    /// Marks every snapshot a previous coordinator (or leader) left in flight as failed.
    pub(crate) async fn recover(&mut self) -> Result<(), Error> {
        let term = self.leadership.term();
        let left = if term > 0 {
            FailureReason::CoordinatorFailover(format!(
                "the coordinator that led it is gone; the leader of term {term} failed it when \
                 it took over"
            ))
        } else {
            FailureReason::CoordinatorRestarted
        };
        let roster = self.meta.roster().await?;
        let removed: BTreeMap<NodeId, u64> = self
            .meta
            .removed()
            .await?
            .into_iter()
            .map(|r| (NodeId::new(r.node), r.incarnation))
            .collect();
        self.drive(Input::MembersLoaded {
            roster,
            removed: removed.clone(),
        })
        .await;
        let on_roster: Vec<NodeId> = self.engine.roster_nodes().cloned().collect();
        for node in removed.keys().filter(|n| on_roster.contains(n)) {
            // A removal that did not finish, or a return not yet recorded: on the roster.
            self.meta.delete_removed(node.as_str()).await?;
        }
        tracing::info!(
            nodes = on_roster.len(),
            removed = self.engine.membership().removed.len(),
            "roster loaded"
        );
        self.load_policy().await?;
        self.recover_restores().await?;
        let mut newest_completed = None;
        let mut requests = Vec::new();
        let mut outcomes = Vec::new();
        for mut record in self.meta.snapshots().await? {
            if !record.request_id.is_empty() {
                requests.push((SnapshotId(record.id), record.request_id.clone()));
            }
            if record.status == SnapshotStatus::Completed {
                newest_completed = newest_completed.max(Some(record.finished_at_ms));
            }
            if record.status == SnapshotStatus::InProgress {
                record.status = SnapshotStatus::Failed;
                record.failure = Some((&left).into());
                record.finished_at_ms = now_ms();
                record.push_ended();
                tracing::warn!(snapshot = record.id, "snapshot failed: {left}");
                self.put_record(&record).await?;
            }
            let id = SnapshotId(record.id);
            outcomes.push(match &record.failure {
                None if record.status == SnapshotStatus::Completed => {
                    SnapshotOutcome::completed(id)
                }
                None => SnapshotOutcome::aborted(id, &format!("{:?}", record.status)),
                Some(failure) => SnapshotOutcome::aborted(id, &failure.message),
            });
        }
        self.drive(Input::StartsLoaded { requests }).await;
        // Every record has ended by now: what they say is told already (a daemon that
        // missed an end hears it when it catches up).
        self.drive(Input::OutcomesLoaded { outcomes }).await;
        if let Some(at) = newest_completed {
            let age = Duration::from_millis(now_ms().saturating_sub(at));
            self.drive(Input::NewestCompleted { age }).await;
        }
        self.refresh().await;
        Ok(())
    }

    /// Serves requests until `shutdown` or the end of its term; then fails what is in
    /// flight (stored only while the term holds: a deposed leader writes nothing) and
    /// closes every node session and watch stream, so the server can finish its graceful
    /// shutdown and the daemons go to the next leader.
    pub(crate) async fn run(
        mut self,
        mut rx: mpsc::Receiver<Msg>,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        let leadership = self.leadership.clone();
        let mut refresh = tokio::time::interval(Duration::from_millis(250));
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            // A due time beyond what the clock can hold is never (no overflow panic).
            let due = self
                .engine
                .next_due()
                .and_then(|ms| self.started.checked_add(Duration::from_millis(ms)));
            tokio::select! {
                _ = shutdown.cancelled() => break,
                () = leadership.ended() => break,
                msg = rx.recv() => match msg {
                    Some(msg) => self.handle(msg).await,
                    None => break,
                },
                () = sleep_until(due) => self.scheduled().await,
                _ = refresh.tick() => {
                    if self.leadership.valid() {
                        self.drive(Input::Tick).await;
                    }
                    self.refresh().await;
                }
            }
        }
        let deposed = !self.leadership.valid();
        let reason = if deposed {
            FailureReason::CoordinatorFailover(format!(
                "term {} ended: {}",
                self.leadership.term(),
                self.leadership.why()
            ))
        } else {
            FailureReason::Aborted("coordinator shut down".into())
        };
        self.drive(Input::FailAll { reason }).await;
        if deposed {
            let gone = Status::unavailable(format!(
                "coordinator term {} ended ({}): reconnect to the leader",
                self.leadership.term(),
                self.leadership.why()
            ));
            for (_, tx) in self.sessions.values() {
                let _ = tx.try_send(Err(gone.clone()));
            }
        }
        self.sessions.clear();
        self.leaving.clear();
        // Work off the task that has not come back is answered for what it is: a restore
        // still being verified fenced nothing and stored nothing; a deletion waiting for its
        // garbage collection is stored (the chunks go at a later collection).
        for (_, reply) in std::mem::take(&mut self.restore_replies) {
            let _ = reply.send(Err(Error::ShuttingDown));
        }
        for (_, reply) in std::mem::take(&mut self.delete_replies) {
            let _ = reply.send(Ok(0));
        }
        // Whoever still watches a snapshot was told no end: the store has none from this
        // term (or this term could not store it), and the next leader decides.
        for (id, watchers) in std::mem::take(&mut self.watchers) {
            let status = Status::unavailable(format!(
                "coordinator term {} ended before snapshot {id} ended in the store: its \
                 outcome is decided by the next leader; see GetSnapshot {id}",
                self.leadership.term()
            ));
            for watcher in watchers {
                let _ = watcher.try_send(Err(status.clone()));
            }
        }
    }

    async fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Register {
                registration,
                session,
                tx,
                reply,
            } => {
                let result = self.register(registration, session, tx).await;
                let _ = reply.send(result);
            }
            Msg::SessionEnded { node, session } => {
                self.drive(Input::SessionEnded { node, session }).await;
            }
            Msg::NodeEvent { node, id, report } => self.node_event(node, id, report).await,
            Msg::Heartbeat {
                node,
                application_attached,
                channels,
            } => {
                let input = Input::Heartbeat {
                    node,
                    application_attached,
                    channels,
                };
                self.drive(input).await;
            }
            Msg::CheckUpload { id, node, reply } => {
                let ok = self
                    .engine
                    .check_upload(id, &node)
                    .map_err(|refusal| self.refused(refusal));
                let _ = reply.send(ok);
            }
            Msg::PartStored {
                part,
                sizes,
                epoch,
                applied_restore_id,
            } => {
                let input = Input::PartStored {
                    part,
                    sizes,
                    epoch,
                    applied_restore_id,
                };
                self.drive(input).await;
            }
            Msg::Start {
                request,
                timeout,
                labels,
                request_id,
                reply,
            } => {
                let result = self.start(request, timeout, labels, request_id).await;
                let _ = reply.send(result);
            }
            Msg::Abort { id, reason, reply } => {
                let result = self.abort(id, reason).await;
                let _ = reply.send(result);
            }
            Msg::Delete { id, reply } => self.delete(id, reply).await,
            Msg::Collected { result } => {
                self.drive(Input::Collected { result }).await;
            }
            Msg::StorageFailed { id, node, why } => {
                self.drive(Input::StorageFailed { id, node, why }).await;
            }
            Msg::TimedOut { id } => {
                self.drive(Input::TimedOut { id }).await;
            }
            Msg::Watch { id, tx, reply } => {
                let result = self.watch(id, tx).await;
                let _ = reply.send(result);
            }
            Msg::ListNodes { reply } => {
                let _ = reply.send(self.engine.membership());
            }
            Msg::RemoveNode { node, reply } => {
                let result = self.remove_node(node).await;
                let _ = reply.send(result);
            }
            Msg::OutcomesAfter { node, after } => {
                self.drive(Input::OutcomesAfter { node, after }).await;
            }
            Msg::Leave { node } => {
                self.drive(Input::Leave { node }).await;
            }
            Msg::Live { id, reply } => {
                let _ = reply.send(self.engine.live_record(id));
            }
            Msg::GetPolicy { reply } => {
                let _ = reply.send(self.policy_view());
            }
            Msg::Restore {
                snapshot_id,
                if_epoch,
                reply,
            } => self.restore(snapshot_id, if_epoch, reply).await,
            Msg::Verified { chosen, skipped } => self.verified(chosen, skipped).await,
            Msg::RestoreApplied { node, restore_id } => {
                tracing::info!(restore = %restore_id, %node, "node applied the restored state");
                self.drive(Input::RestoreApplied { node, restore_id }).await;
            }
            Msg::RestoreFailed {
                node,
                restore_id,
                message,
            } => {
                let input = Input::RestoreFailed {
                    node,
                    restore_id,
                    why: message,
                };
                self.drive(input).await;
            }
            Msg::RestoreTimedOut { epoch } => {
                self.drive(Input::RestoreTimedOut { epoch }).await;
            }
            Msg::SetPolicy { change, reply } => {
                let result = self.set_policy(change).await;
                let _ = reply.send(result);
            }
        }
    }

    /// Milliseconds on the engine's monotonic clock, with the wall clock's.
    fn now(&self) -> Now {
        Now {
            wall_ms: now_ms(),
            mono_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// Sends `command` to every member's session but `except`'s.
    fn broadcast(&self, command: &NodeCommand, except: Option<&NodeId>) {
        for (node, (_, tx)) in &self.sessions {
            if Some(node) != except {
                self.command(tx, command.clone());
            }
        }
    }

    /// Sends `command` to one node, carrying this term; nothing once the term ended (a
    /// deposed leader commands nobody). Returns whether it was queued.
    fn command(&self, tx: &NodeTx, command: NodeCommand) -> bool {
        if !self.leadership.valid() {
            return false;
        }
        tx.try_send(Ok(ToNode {
            term: self.leadership.term(),
            command,
        }))
        .is_ok()
    }
}

/// Sleeps until `deadline`; forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The mode of a start request from the wire.
pub(crate) fn mode_of(value: i32) -> Result<SnapshotMode, Error> {
    cairn_proto::convert::mode_from_pb(value, Some(SnapshotMode::ChandyLamport))
        .map_err(|e| Error::InvalidArgument(e.to_string()))
}
