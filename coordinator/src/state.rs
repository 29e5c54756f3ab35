//! The coordinator's one task that owns membership and the [`SnapshotTracker`]: every
//! change to a snapshot's lifecycle happens here, in order, and is written to the
//! metadata store before anyone is told.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

use cairn_core::schedule::{Due, Failing, Policy, Schedule};
use cairn_core::{
    FailureReason, NodeId, NodePart, SnapshotId, SnapshotMode, SnapshotTracker, StartError,
    StartRequest, Topology, tracker,
};
use cairn_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tonic::Status;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::blob::BlobStore;
use crate::error::Error;
use crate::policy;
use crate::records_conv::{failure_record, mode_name, now_ms, progress_pb};
use crate::store::{
    AnyKv, Keys, Kv, MemberRecord, RestoreRecord, RosterRecord, SnapshotRecord, VerdictRecord,
};

mod restore;
pub(crate) use restore::{restore_epoch, restore_pb};

/// The stream a node's session reads its commands from.
pub(crate) type NodeTx = mpsc::Sender<Result<pb::CoordinatorToNode, Status>>;
/// A watcher's stream.
pub(crate) type WatchTx = mpsc::Sender<Result<pb::SnapshotProgress, Status>>;

/// A request to the coordinator task.
pub(crate) enum Msg {
    Register {
        register: pb::Register,
        session: u64,
        tx: NodeTx,
        reply: oneshot::Sender<Result<pb::Membership, Error>>,
    },
    SessionEnded {
        node: NodeId,
        session: u64,
    },
    NodeEvent {
        node: NodeId,
        event: pb::NodeSnapshotEvent,
    },
    Heartbeat {
        node: NodeId,
        application_attached: bool,
    },
    CheckUpload {
        id: u64,
        node: NodeId,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    PartStored {
        part: NodePart,
        bytes_new: u64,
        bytes_reused: u64,
        /// The epoch the node recorded the part in.
        epoch: u64,
        /// The last restore the node's application applied.
        applied_restore_id: String,
    },
    /// Storing a part failed (`why` names the node and the cause).
    StorageFailed {
        id: u64,
        why: String,
    },
    Start {
        request: StartRequest,
        timeout: Duration,
        labels: BTreeMap<String, String>,
        reply: oneshot::Sender<Result<u64, Error>>,
    },
    Abort {
        id: u64,
        reason: String,
        reply: oneshot::Sender<Result<SnapshotRecord, Error>>,
    },
    Delete {
        id: u64,
        reply: oneshot::Sender<Result<u64, Error>>,
    },
    TimedOut {
        id: u64,
    },
    Watch {
        id: u64,
        tx: WatchTx,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    ListNodes {
        reply: oneshot::Sender<pb::ListNodesResponse>,
    },
    /// The record of a snapshot in flight, with its progress; `None` if it has ended.
    Live {
        id: u64,
        reply: oneshot::Sender<Option<SnapshotRecord>>,
    },
    GetPolicy {
        reply: oneshot::Sender<pb::Policy>,
    },
    Restore {
        snapshot_id: u64,
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
    SetPolicy {
        request: pb::SetPolicyRequest,
        reply: oneshot::Sender<Result<pb::Policy, Error>>,
    },
}

struct Member {
    record: MemberRecord,
    session: u64,
    tx: NodeTx,
    last_seen_ms: u64,
    /// When it was last heard from, on the monotonic clock.
    heard: Instant,
    application_attached: bool,
    /// The epoch the daemon is in, as far as the coordinator knows.
    epoch: u64,
}

/// What a registering node still has to do about a restore.
enum OnRegister {
    Nothing,
    /// It had applied the restore under way (its word was lost with a session).
    Applied(String),
    /// It has not: send it the restore.
    Restore(pb::NodeRestore),
}

/// Settings the task needs.
pub(crate) struct Settings {
    pub cluster: String,
    pub retention: usize,
    /// A fixed topology (`--topology`); `None`: a full mesh of the roster.
    pub topology: Option<Topology>,
    /// The snapshot policy of the flags (a stored one set through the API wins).
    pub policy: Policy,
    /// Restore the newest completed snapshot when a member's daemon restarts.
    pub auto_restore: bool,
    /// How long a restore may take.
    pub restore_timeout: Duration,
}

pub(crate) struct State {
    metrics: crate::metrics::CoordinatorMetrics,
    settings: Settings,
    kv: Arc<AnyKv>,
    blobs: BlobStore,
    keys: Keys,
    /// Every node of the cluster, connected or not (persisted).
    roster: BTreeMap<NodeId, RosterRecord>,
    /// The nodes with a session now.
    members: BTreeMap<NodeId, Member>,
    tracker: SnapshotTracker,
    inflight: BTreeMap<u64, SnapshotRecord>,
    watchers: BTreeMap<u64, Vec<WatchTx>>,
    self_tx: mpsc::Sender<Msg>,
    schedule: Schedule,
    policy_source: policy::Source,
    /// The zero of the schedule's monotonic milliseconds.
    clock: Instant,
    health: HealthReporter,
    /// What the freshness health service says now; `None` before it is first set.
    stale: Option<bool>,
    /// Whether the schedule was reported failing.
    failing: bool,
    /// The cluster's epoch (raised by every restore).
    epoch: u64,
    /// The restore under way.
    restore: Option<restore::ActiveRestore>,
    /// Automatic recovery waits for every member to connect; why it is due.
    pending_recovery: Option<String>,
    /// The newest restore that did not finish (FAILED): until a later one is applied by
    /// every node, the nodes may hold different states and no snapshot may start.
    unfinished_restore: Option<RestoreRecord>,
    /// The highest snapshot id any daemon reported: no id at or below it is handed out.
    id_floor: u64,
    /// When silent members were last looked for.
    last_silence_check: Instant,
    /// Automatic recovery is not tried again before this (after a failed attempt).
    pub(super) recovery_not_before: Instant,
}

/// A daemon that has not been heard from for this long is taken as gone (three
/// heartbeats), and a second daemon claiming a node id whose holder was heard from
/// within it is refused.
const MEMBER_SILENCE_MS: u64 = 6_000;

/// The largest snapshot id or epoch a daemon may report at registration (far above any a
/// real cluster reaches; keeps the counters' arithmetic clear of overflow).
const MAX_REPORTED: u64 = 1 << 48;

impl State {
    pub(crate) fn new(
        metrics: crate::metrics::CoordinatorMetrics,
        settings: Settings,
        kv: Arc<AnyKv>,
        blobs: BlobStore,
        max_in_flight: usize,
        self_tx: mpsc::Sender<Msg>,
        health: HealthReporter,
    ) -> Self {
        let seed = std::collections::hash_map::RandomState::new().hash_one(now_ms());
        Self {
            schedule: Schedule::new(settings.policy.clone(), 0, seed),
            policy_source: policy::Source::Flags,
            clock: Instant::now(),
            health,
            stale: None,
            failing: false,
            epoch: 0,
            restore: None,
            pending_recovery: None,
            unfinished_restore: None,
            id_floor: 0,
            last_silence_check: Instant::now(),
            recovery_not_before: Instant::now(),
            metrics,
            keys: Keys::new(&settings.cluster),
            settings,
            kv,
            blobs,
            roster: BTreeMap::new(),
            members: BTreeMap::new(),
            tracker: SnapshotTracker::new(max_in_flight.max(1)),
            inflight: BTreeMap::new(),
            watchers: BTreeMap::new(),
            self_tx,
        }
    }

    /// Marks every snapshot a previous coordinator left in flight as failed.
    pub(crate) async fn recover(&mut self) -> Result<(), Error> {
        for (key, value) in self.kv.list(&self.keys.roster()).await? {
            let Ok(record) = serde_json::from_slice::<RosterRecord>(&value) else {
                tracing::warn!(%key, "skipping an unreadable roster record");
                continue;
            };
            let node = NodeId::new(record.node.clone());
            if let Some(topology) = &self.settings.topology
                && !topology.contains(&node)
            {
                tracing::warn!(%node, "node on the roster but not in --topology: left out");
                continue;
            }
            self.roster.insert(node, record);
        }
        tracing::info!(nodes = self.roster.len(), "roster loaded");
        self.load_policy().await?;
        self.recover_restores().await?;
        let mut newest_completed = None;
        for (key, value) in self.kv.list(&self.keys.snapshots()).await? {
            let Ok(mut record) = serde_json::from_slice::<SnapshotRecord>(&value) else {
                tracing::warn!(%key, "skipping an unreadable snapshot record");
                continue;
            };
            if record.status == "COMPLETED" {
                newest_completed = newest_completed.max(Some(record.finished_at_ms));
            }
            if record.status == "IN_PROGRESS" {
                record.status = "FAILED".into();
                record.failure = Some(failure_record(&FailureReason::CoordinatorRestarted));
                record.finished_at_ms = now_ms();
                tracing::warn!(
                    snapshot = record.id,
                    "snapshot failed: coordinator restarted"
                );
                self.put_record(&record).await?;
            }
        }
        if let Some(at) = newest_completed {
            let age = Duration::from_millis(now_ms().saturating_sub(at));
            self.schedule.completed_before(self.clock_ms(), age);
        }
        self.refresh().await;
        Ok(())
    }

    /// Takes the stored policy if it was set through the API and is still valid, else the
    /// flags' (stored). A stored policy that fails [`Policy::check`] (or no longer fits
    /// `--max-concurrent`) is logged at error level with the reason and replaced by the
    /// flags', so it cannot make every start fail.
    async fn load_policy(&mut self) -> Result<(), Error> {
        let flags = self.settings.policy.clone();
        let stored = self.kv.get(&self.keys.policy()).await?;
        let chosen = policy::at_start(&flags, stored.as_deref(), self.tracker.max_in_flight());
        if let Some(why) = &chosen.rejected {
            tracing::error!(
                flags = %policy::describe(&flags),
                "the stored snapshot policy is invalid ({why}); it is replaced by the flags'"
            );
        } else if chosen.source == policy::Source::Api && chosen.policy != flags {
            tracing::warn!(
                stored = %policy::describe(&chosen.policy),
                flags = %policy::describe(&flags),
                "the policy set through SetPolicy overrides the flags' \
                 (`cairnctl policy reset` goes back to the flags)"
            );
        }
        self.adopt_policy(chosen.policy, chosen.source).await
    }

    /// Stores `policy` with its source, then follows it from now.
    async fn adopt_policy(&mut self, policy: Policy, source: policy::Source) -> Result<(), Error> {
        let record = policy::to_record(&policy, source);
        self.kv
            .put(
                &self.keys.policy(),
                serde_json::to_vec_pretty(&record).expect("plain record"),
            )
            .await?;
        tracing::info!(
            source = source.name(),
            "snapshot policy: {}",
            policy::describe(&policy)
        );
        let now = self.clock_ms();
        self.schedule.set_policy(policy, now);
        self.policy_source = source;
        Ok(())
    }

    /// Serves requests until `shutdown`; then fails what is in flight and closes every
    /// node session and watch stream, so the server can finish its graceful shutdown.
    pub(crate) async fn run(
        mut self,
        mut rx: mpsc::Receiver<Msg>,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        let mut refresh = tokio::time::interval(Duration::from_millis(250));
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            // A due time beyond what the clock can hold is never (no overflow panic).
            let due = self
                .schedule
                .next_due()
                .and_then(|ms| self.clock.checked_add(Duration::from_millis(ms)));
            tokio::select! {
                _ = shutdown.cancelled() => break,
                msg = rx.recv() => match msg {
                    Some(msg) => self.handle(msg).await,
                    None => break,
                },
                () = sleep_until(due) => self.scheduled().await,
                _ = refresh.tick() => {
                    self.drop_silent_members().await;
                    self.maybe_auto_restore().await;
                    self.refresh().await;
                }
            }
        }
        let ids: Vec<u64> = self.inflight.keys().copied().collect();
        for id in ids {
            let update = self.tracker.fail(
                SnapshotId(id),
                FailureReason::Aborted("coordinator shut down".into()),
            );
            self.settle(id, update).await;
        }
        self.members.clear();
        self.watchers.clear();
    }

    async fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Register {
                register,
                session,
                tx,
                reply,
            } => {
                let result = self.register(register, session, tx).await;
                let _ = reply.send(result);
            }
            Msg::SessionEnded { node, session } => self.session_ended(node, session).await,
            Msg::NodeEvent { node, event } => self.node_event(node, event).await,
            Msg::Heartbeat {
                node,
                application_attached,
            } => {
                if let Some(member) = self.members.get_mut(&node) {
                    member.last_seen_ms = now_ms();
                    member.heard = Instant::now();
                    member.application_attached = application_attached;
                }
            }
            Msg::CheckUpload { id, node, reply } => {
                let ok = match self.inflight.get(&id) {
                    None => Err(Error::FailedPrecondition(format!(
                        "snapshot {id} is not in progress"
                    ))),
                    Some(r) if !r.nodes.iter().any(|n| n == node.as_str()) => {
                        Err(Error::FailedPrecondition(format!(
                            "node {node} is not a participant of snapshot {id}"
                        )))
                    }
                    Some(_) => Ok(()),
                };
                let _ = reply.send(ok);
            }
            Msg::PartStored {
                part,
                bytes_new,
                bytes_reused,
                epoch,
                applied_restore_id,
            } => {
                let id = part.report.id.0;
                let node = part.report.node.to_string();
                if let Some(expected) = self.inflight.get(&id).map(|r| r.epoch)
                    && epoch != expected
                {
                    let applied = if applied_restore_id.is_empty() {
                        "no restore".to_owned()
                    } else {
                        applied_restore_id
                    };
                    let reason = FailureReason::MixedEpochs {
                        nodes: vec![part.report.node.clone()],
                        detail: format!(
                            "snapshot {id} started in epoch {expected}, node {node} recorded \
                             its part in epoch {epoch} (after {applied})"
                        ),
                    };
                    let update = self.tracker.fail(SnapshotId(id), reason);
                    self.settle(id, update).await;
                    return;
                }
                if let Some(record) = self.inflight.get_mut(&id) {
                    record.bytes_new += bytes_new;
                    record.bytes_reused += bytes_reused;
                    if !record.reported.contains(&node) {
                        record.reported.push(node.clone());
                    }
                    if !record.recorded.contains(&node) {
                        record.recorded.push(node);
                    }
                }
                let update = self.tracker.part_reported(part);
                self.settle(id, update).await;
            }
            Msg::Start {
                request,
                timeout,
                labels,
                reply,
            } => {
                let result = self.start(request, timeout, labels).await;
                let _ = reply.send(result);
            }
            Msg::Abort { id, reason, reply } => {
                let result = self.abort(id, reason).await;
                let _ = reply.send(result);
            }
            Msg::Delete { id, reply } => {
                let result = self.delete(id).await;
                let _ = reply.send(result);
            }
            Msg::StorageFailed { id, why } => {
                let update = self
                    .tracker
                    .fail(SnapshotId(id), FailureReason::Storage(why));
                self.settle(id, update).await;
            }
            Msg::TimedOut { id } => {
                let update = self.tracker.timed_out(SnapshotId(id));
                self.settle(id, update).await;
            }
            Msg::Watch { id, tx, reply } => {
                let result = self.watch(id, tx).await;
                let _ = reply.send(result);
            }
            Msg::ListNodes { reply } => {
                let _ = reply.send(self.list_nodes());
            }
            Msg::Live { id, reply } => {
                let _ = reply.send(self.inflight.get(&id).cloned());
            }
            Msg::GetPolicy { reply } => {
                let _ = reply.send(self.policy_pb());
            }
            Msg::Restore { snapshot_id, reply } => {
                let result = self.restore(snapshot_id, "user".into()).await;
                let _ = reply.send(result);
            }
            Msg::RestoreApplied { node, restore_id } => {
                self.restore_applied(&node, &restore_id).await;
            }
            Msg::RestoreFailed {
                node,
                restore_id,
                message,
            } => {
                self.restore_node_failed(&node, Some(&restore_id), &message)
                    .await;
            }
            Msg::RestoreTimedOut { epoch } => self.restore_timed_out(epoch).await,
            Msg::SetPolicy { request, reply } => {
                let result = self.set_policy(request).await;
                let _ = reply.send(result);
            }
        }
    }

    /// Milliseconds on the schedule's monotonic clock.
    fn clock_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    fn policy_pb(&self) -> pb::Policy {
        let status = self.schedule.status(self.clock_ms());
        policy::to_pb(self.schedule.policy(), self.policy_source, &status)
    }

    async fn set_policy(&mut self, request: pb::SetPolicyRequest) -> Result<pb::Policy, Error> {
        let (next, source) = if request.reset_to_flags {
            if request.policy.is_some() || !request.update.is_empty() {
                return Err(Error::InvalidArgument(
                    "reset_to_flags takes no policy and no update".into(),
                ));
            }
            (self.settings.policy.clone(), policy::Source::Flags)
        } else {
            let wire = request.policy.unwrap_or_default();
            let next = policy::apply(self.schedule.policy(), &wire, &request.update)?;
            (next, policy::Source::Api)
        };
        let limit = self.tracker.max_in_flight();
        if next.max_concurrent as usize > limit {
            return Err(Error::InvalidArgument(format!(
                "max_concurrent {} is above the coordinator's --max-concurrent {limit}",
                next.max_concurrent
            )));
        }
        self.adopt_policy(next, source).await?;
        self.refresh().await;
        Ok(self.policy_pb())
    }

    /// A scheduled snapshot is due: start it, or count the skip.
    async fn scheduled(&mut self) {
        let Some(due) = self.schedule.poll(self.clock_ms()) else {
            return;
        };
        match due {
            Due::Skip(skip) => self.skipped(&skip),
            Due::Start if self.fence().is_some() => {
                let why = self.fence().unwrap_or_default();
                if let Ok(skip) = self.schedule.refused(true, why) {
                    self.skipped(&skip);
                }
            }
            Due::Start => {
                let policy = self.schedule.policy().clone();
                let request = StartRequest {
                    mode: policy.mode,
                    initiators: BTreeSet::new(),
                    alignment_timeout: policy.alignment_timeout,
                };
                let labels = BTreeMap::from([("scheduled".to_owned(), "true".to_owned())]);
                match self.start(request, policy.timeout, labels).await {
                    Ok(id) => self.schedule.started(SnapshotId(id)),
                    Err(e) => {
                        let busy = matches!(e, Error::ResourceExhausted(_));
                        let why = format!("could not start: {e}");
                        match self.schedule.refused(busy, why.clone()) {
                            Ok(skip) => self.skipped(&skip),
                            Err(alarm) => {
                                tracing::warn!("scheduled snapshot {why}");
                                self.alarm(alarm);
                            }
                        }
                    }
                }
            }
        }
        self.refresh().await;
    }

    fn skipped(&self, skip: &cairn_core::schedule::Skip) {
        self.metrics.schedule_skipped.inc();
        tracing::info!("scheduled snapshot skipped: {skip}");
    }

    fn alarm(&self, alarm: Option<Failing>) {
        if let Some(f) = alarm {
            tracing::error!(
                consecutive = f.consecutive,
                tolerated = f.tolerated,
                "scheduled snapshots are failing: {} in a row, more than the {} tolerated; \
                 last: {}",
                f.consecutive,
                f.tolerated,
                f.last_failure
            );
        }
    }

    /// Brings the schedule's metrics and the freshness health service up to date.
    async fn refresh(&mut self) {
        let status = self.schedule.status(self.clock_ms());
        let m = &self.metrics;
        m.schedule_consecutive_failures
            .set(i64::from(status.consecutive_failures));
        m.schedule_failing.set(i64::from(status.failing));
        m.snapshot_stale.set(i64::from(status.stale));
        m.newest_completed_age.set(
            status
                .newest_completed_age
                .map_or(-1.0, |d| d.as_secs_f64()),
        );
        if self.failing && !status.failing {
            tracing::info!("scheduled snapshots are completing again");
        }
        self.failing = status.failing;
        if Some(status.stale) != self.stale {
            if self.stale == Some(true) {
                tracing::info!(
                    "a snapshot completed: {} is SERVING again",
                    policy::FRESHNESS_SERVICE
                );
            }
            self.stale = Some(status.stale);
            let threshold = self.schedule.policy().freshness_threshold;
            let serving = if status.stale {
                tracing::error!(
                    age = ?status.newest_completed_age,
                    ?threshold,
                    "no snapshot completed within the freshness threshold: {FRESHNESS} is NOT_SERVING",
                    FRESHNESS = policy::FRESHNESS_SERVICE
                );
                ServingStatus::NotServing
            } else {
                ServingStatus::Serving
            };
            self.health
                .set_service_status(policy::FRESHNESS_SERVICE, serving)
                .await;
        }
    }

    /// The topology snapshots span: `--topology` when given, else a full mesh of the
    /// roster. Every one of its nodes must be connected.
    fn topology(&self) -> Result<Topology, Error> {
        let topology = self.known_topology();
        let missing: Vec<&str> = topology
            .nodes()
            .iter()
            .filter(|n| !self.members.contains_key(*n))
            .map(NodeId::as_str)
            .collect();
        if !missing.is_empty() {
            let never: Vec<&str> = missing
                .iter()
                .copied()
                .filter(|n| !self.roster.contains_key(&NodeId::new(*n)))
                .collect();
            return Err(Error::FailedPrecondition(if never.is_empty() {
                format!(
                    "not connected to the coordinator: {} (a snapshot needs every node of the \
                     topology)",
                    missing.join(", ")
                )
            } else {
                format!(
                    "never registered: {} (named in --topology); not connected: {}",
                    never.join(", "),
                    missing.join(", ")
                )
            }));
        }
        Ok(topology)
    }

    /// The topology over the nodes whose address is known: the fixed one restricted to the
    /// roster, or a full mesh of the roster.
    fn known_topology(&self) -> Topology {
        let nodes = self.roster.keys().cloned();
        match &self.settings.topology {
            None => Topology::full_mesh(nodes),
            Some(fixed) => {
                let channels = fixed.channels().iter().filter(|c| {
                    self.roster.contains_key(&c.from) && self.roster.contains_key(&c.to)
                });
                let nodes: Vec<NodeId> = fixed
                    .nodes()
                    .iter()
                    .filter(|n| self.roster.contains_key(*n))
                    .cloned()
                    .collect();
                Topology::from_channels(nodes, channels.cloned())
                    .expect("a restriction of a topology")
            }
        }
    }

    /// What nodes are told: every known node with its address, and the channels among them.
    fn membership(&self) -> pb::Membership {
        let (nodes, channels) = self.list_nodes_parts();
        pb::Membership {
            nodes,
            channels,
            epoch: self.epoch,
        }
    }

    fn list_nodes_parts(&self) -> (Vec<pb::NodeInfo>, Vec<pb::ChannelRef>) {
        let nodes = self
            .roster
            .iter()
            .map(|(id, r)| {
                let live = self.members.get(id);
                pb::NodeInfo {
                    node_id: r.node.clone(),
                    address: r.address.clone(),
                    // The incarnation admitted last, connected or not: peers accept
                    // streams from this daemon only.
                    incarnation: live.map_or(r.incarnation, |m| m.record.incarnation),
                    application_attached: live.is_some_and(|m| m.application_attached),
                    last_seen_ms: live.map_or(0, |m| m.last_seen_ms),
                    connected: live.is_some(),
                }
            })
            .collect();
        let channels = self
            .known_topology()
            .channels()
            .iter()
            .map(pb::ChannelRef::from)
            .collect();
        (nodes, channels)
    }

    fn list_nodes(&self) -> pb::ListNodesResponse {
        let (nodes, channels) = self.list_nodes_parts();
        pb::ListNodesResponse { nodes, channels }
    }

    /// Puts a registering node on the roster, or moves it to its new address, and notes its
    /// incarnation. Returns what changed for the other nodes, if anything, and whether the
    /// node's daemon restarted since it last registered.
    async fn enroll(
        &mut self,
        node: &NodeId,
        address: &str,
        incarnation: u64,
    ) -> Result<(Option<String>, bool), Error> {
        let restarted = self
            .roster
            .get(node)
            .is_some_and(|r| r.incarnation != 0 && r.incarnation != incarnation);
        let change = match self.roster.get(node) {
            Some(r) if r.address == address && r.incarnation == incarnation => {
                return Ok((None, false));
            }
            Some(r) if r.address == address => None,
            Some(r) => Some(format!("node {node} moved from {} to {address}", r.address)),
            None => Some(format!("node {node} joined")),
        };
        let record = RosterRecord {
            node: node.to_string(),
            address: address.to_owned(),
            joined_at_ms: self
                .roster
                .get(node)
                .map_or_else(now_ms, |r| r.joined_at_ms),
            incarnation,
        };
        let value = serde_json::to_vec(&record).expect("plain record");
        self.kv
            .put(&self.keys.roster_node(node.as_str()), value)
            .await?;
        let joined = !self.roster.contains_key(node);
        self.roster.insert(node.clone(), record);
        let Some(change) = change else {
            return Ok((None, restarted));
        };
        if joined {
            // Snapshots in flight were planned without it.
            let ids: Vec<u64> = self.inflight.keys().copied().collect();
            for id in ids {
                let update = self.tracker.fail(
                    SnapshotId(id),
                    FailureReason::MembershipChanged(change.clone()),
                );
                self.settle(id, update).await;
            }
        }
        tracing::info!(%node, %address, "{change}");
        Ok((Some(change), restarted))
    }

    async fn register(
        &mut self,
        register: pb::Register,
        session: u64,
        tx: NodeTx,
    ) -> Result<pb::Membership, Error> {
        if register.cluster != self.settings.cluster {
            return Err(Error::FailedPrecondition(format!(
                "cluster mismatch: the coordinator serves `{}`, the node says `{}`",
                self.settings.cluster, register.cluster
            )));
        }
        if register.node_id.is_empty() || register.address.is_empty() {
            return Err(Error::InvalidArgument(
                "register needs node_id and address".into(),
            ));
        }
        let node = NodeId::new(register.node_id.clone());
        // One live process per node id: a second daemon claiming an id whose holder is
        // connected and heard from is refused (a restarted daemon's predecessor has gone
        // silent or its session has ended).
        // Its session ends, or the silence check drops it (`MEMBER_SILENCE_MS`), before
        // another process may take the id.
        if let Some(old) = self.members.get(&node)
            && old.record.incarnation != register.incarnation
        {
            let silent = old.heard.elapsed().as_millis();
            return Err(Error::FailedPrecondition(format!(
                "node id {node} is held by a connected daemon at {} (incarnation {}, heard \
                 from {silent} ms ago); this daemon (incarnation {}, at {}) is refused: is a \
                 second process running with --node-id {node}?",
                old.record.address, old.record.incarnation, register.incarnation, register.address
            )));
        }
        if register.highest_snapshot_id > MAX_REPORTED || register.epoch > MAX_REPORTED {
            return Err(Error::InvalidArgument(format!(
                "register: highest_snapshot_id {} or epoch {} is above {MAX_REPORTED}",
                register.highest_snapshot_id, register.epoch
            )));
        }
        if let Some(topology) = &self.settings.topology
            && !topology.contains(&node)
        {
            return Err(Error::FailedPrecondition(format!(
                "node {node} is not in this coordinator's --topology file"
            )));
        }
        // A daemon that saw higher ids or epochs than the store holds: the metadata was
        // lost or rolled back. Never hand out what the daemons already know.
        if register.highest_snapshot_id > self.id_floor {
            if register.highest_snapshot_id > self.id_floor.saturating_add(1_000_000) {
                tracing::error!(%node, reported = register.highest_snapshot_id, floor = self.id_floor, "a daemon reports a snapshot id far above any known: ids continue above it");
            }
            self.id_floor = register.highest_snapshot_id;
        }
        if register.epoch > self.epoch {
            tracing::error!(
                %node,
                node_epoch = register.epoch,
                epoch = self.epoch,
                "a daemon is in a later epoch than the metadata store says (lost metadata?): \
                 raising the cluster's epoch"
            );
            self.kv
                .put(&self.keys.epoch(), register.epoch.to_string().into_bytes())
                .await?;
            self.epoch = register.epoch;
        }
        // A new daemon process (no epoch of its own yet, an incarnation the roster does not
        // know) may enter the cluster's epoch as it is; one that has an epoch keeps it.
        let fresh = register.epoch == 0
            && register.applied_restore_id.is_empty()
            && self
                .roster
                .get(&node)
                .is_none_or(|r| r.incarnation != register.incarnation);
        let (_, restarted) = self
            .enroll(&node, &register.address, register.incarnation)
            .await?;
        if restarted && self.settings.auto_restore {
            tracing::warn!(%node, "node restarted: automatic recovery will restore the newest completed snapshot");
            self.pending_recovery = Some(format!("{node} restarted"));
        }
        if let Some(old) = self.members.get(&node)
            && old.record.incarnation != register.incarnation
        {
            tracing::warn!(%node, "node restarted: failing the snapshots in flight through it");
            for (id, outcome) in self.tracker.node_lost(&node) {
                self.settle(id.0, tracker::Update::Finished(outcome)).await;
            }
        }
        let (epoch, next) = self.epoch_on_register(&node, &register, fresh);
        let record = MemberRecord {
            node: register.node_id.clone(),
            address: register.address,
            incarnation: register.incarnation,
            registered_at_ms: now_ms(),
        };
        let value = serde_json::to_vec(&record).expect("plain record");
        self.kv
            .put_ephemeral(&self.keys.member(&record.node), value)
            .await?;
        tracing::info!(%node, address = %record.address, epoch, "node registered");
        self.members.insert(
            node.clone(),
            Member {
                record,
                session,
                tx: tx.clone(),
                last_seen_ms: now_ms(),
                heard: Instant::now(),
                application_attached: false,
                epoch,
            },
        );
        self.metrics.members.set(self.members.len() as i64);
        let membership = self.membership();
        // `Registered` goes first on the new session, before any command can. It carries
        // the epoch this node is to be in, which is the cluster's only if it may enter it.
        let registered = pb::coordinator_to_node::Kind::Registered(pb::Membership {
            epoch,
            ..membership.clone()
        });
        tx.try_send(Ok(pb::CoordinatorToNode {
            kind: Some(registered),
        }))
        .map_err(|_| Error::ShuttingDown)?;
        // Every member learns who holds each id now (peers admit streams from it only).
        for (id, member) in &self.members {
            if *id != node {
                let update = pb::coordinator_to_node::Kind::Membership(membership.clone());
                let _ = member
                    .tx
                    .try_send(Ok(pb::CoordinatorToNode { kind: Some(update) }));
            }
        }
        match next {
            OnRegister::Nothing => {}
            OnRegister::Applied(restore_id) => self.restore_applied(&node, &restore_id).await,
            OnRegister::Restore(command) => {
                tracing::info!(%node, restore = %command.restore_id, "the node has not applied the restore under way: sending it again");
                let _ = tx.try_send(Ok(pb::CoordinatorToNode {
                    kind: Some(pb::coordinator_to_node::Kind::Restore(command)),
                }));
            }
        }
        self.maybe_auto_restore().await;
        Ok(membership)
    }

    /// The epoch a registering node is to be in, and what it still has to do. A node
    /// never enters an epoch without that epoch's state: behind a restore under way, it
    /// keeps its epoch and is sent the restore; behind one that ended, it keeps its epoch
    /// and the cluster stays fenced ([`Self::fence`]) until a restore brings every node
    /// to one state. Only a new daemon enters the cluster's epoch as it is.
    fn epoch_on_register(
        &self,
        node: &NodeId,
        register: &pb::Register,
        fresh: bool,
    ) -> (u64, OnRegister) {
        if let Some(active) = &self.restore
            && active.progress.nodes().contains(node)
        {
            let restore = &active.record;
            if register.applied_restore_id == restore.id {
                return (restore.epoch, OnRegister::Applied(restore.id.clone()));
            }
            if register.epoch == restore.epoch {
                // In the epoch, its application about to apply: its word comes later.
                return (restore.epoch, OnRegister::Nothing);
            }
            let command = pb::NodeRestore {
                restore_id: restore.id.clone(),
                snapshot_id: restore.snapshot_id,
                epoch: restore.epoch,
            };
            return (register.epoch, OnRegister::Restore(command));
        }
        if register.epoch == self.epoch || fresh {
            return (self.epoch, OnRegister::Nothing);
        }
        tracing::error!(
            %node,
            node_epoch = register.epoch,
            epoch = self.epoch,
            "the node missed a restore: it stays in its epoch, and no snapshot starts until \
             a restore is applied by every node"
        );
        (register.epoch, OnRegister::Nothing)
    }

    async fn session_ended(&mut self, node: NodeId, session: u64) {
        if self.members.get(&node).map(|m| m.session) != Some(session) {
            return; // an older session of a node that has re-registered
        }
        self.member_gone(&node, "its session with the coordinator ended")
            .await;
    }

    /// A member is no longer connected: it leaves `members` (which ends its session's
    /// stream), its restore share and its snapshots in flight fail.
    async fn member_gone(&mut self, node: &NodeId, why: &str) {
        tracing::warn!(%node, "node disconnected: {why}");
        self.members.remove(node);
        self.restore_node_failed(node, None, why).await;
        self.metrics.members.set(self.members.len() as i64);
        if let Err(e) = self.kv.delete(&self.keys.member(node.as_str())).await {
            tracing::warn!("{e}");
        }
        for (id, outcome) in self.tracker.node_lost(node) {
            self.settle(id.0, tracker::Update::Finished(outcome)).await;
        }
    }

    /// Members not heard from for [`MEMBER_SILENCE_MS`] (a paused or partitioned daemon
    /// whose connection has not broken) are taken as disconnected.
    async fn drop_silent_members(&mut self) {
        // A tick that comes late means this task was busy (a long verification, say): the
        // heartbeats may be waiting in its queue, not missing. Judge at the next tick.
        let last = std::mem::replace(&mut self.last_silence_check, Instant::now());
        if last.elapsed() > Duration::from_secs(1) {
            return;
        }
        let silent: Vec<(NodeId, u64)> = self
            .members
            .iter()
            .map(|(n, m)| (n.clone(), m.heard.elapsed().as_millis() as u64))
            .filter(|(_, silent)| *silent >= MEMBER_SILENCE_MS)
            .collect();
        for (node, silent) in silent {
            self.member_gone(&node, &format!("no heartbeat for {silent} ms"))
                .await;
        }
    }

    async fn node_event(&mut self, node: NodeId, event: pb::NodeSnapshotEvent) {
        use pb::node_snapshot_event::Kind;
        if let Some(member) = self.members.get_mut(&node) {
            member.last_seen_ms = now_ms();
            member.heard = Instant::now();
        }
        let id = event.snapshot_id;
        match event.kind {
            Some(Kind::StateRecorded(_)) => {
                let update = self.tracker.state_recorded(SnapshotId(id), &node);
                if let (tracker::Update::Progress, Some(record)) =
                    (&update, self.inflight.get_mut(&id))
                {
                    if !record.recorded.contains(&node.to_string()) {
                        record.recorded.push(node.to_string());
                    }
                    let record = record.clone();
                    self.publish(&record).await;
                }
            }
            Some(Kind::Failed(reason)) => {
                let update = self
                    .tracker
                    .fail(SnapshotId(id), node_failure(&node, &reason));
                self.settle(id, update).await;
            }
            Some(Kind::PartUploaded(_)) | None => {}
        }
    }

    async fn start(
        &mut self,
        request: StartRequest,
        timeout: Duration,
        labels: BTreeMap<String, String>,
    ) -> Result<u64, Error> {
        if let Some(fence) = self.fence() {
            return Err(Error::FailedPrecondition(fence));
        }
        let topology = self.topology()?;
        if self.roster.is_empty() {
            return Err(Error::FailedPrecondition(
                "no node has registered with the coordinator".into(),
            ));
        }
        let refused = |e: StartError| match e {
            StartError::TooManyInFlight { .. } | StartError::AlignedInFlight(_) => {
                Error::ResourceExhausted(e.to_string())
            }
            StartError::Unreachable { .. }
            | StartError::UnknownInitiator(_)
            | StartError::DuplicateId(_) => Error::InvalidArgument(e.to_string()),
            StartError::NoMembers => Error::FailedPrecondition(e.to_string()),
        };
        // Every check before an id is spent.
        self.tracker.check(&request, &topology).map_err(refused)?;
        let id = self.next_snapshot_id().await?;
        let plan = self
            .tracker
            .start(SnapshotId(id), request, &topology)
            .map_err(refused)?;
        let record = SnapshotRecord {
            id,
            mode: mode_name(plan.mode),
            initiators: plan.initiators.iter().map(ToString::to_string).collect(),
            alignment_timeout_ms: plan.alignment_timeout.map_or(0, |d| d.as_millis() as u64),
            status: "IN_PROGRESS".into(),
            failure: None,
            verdict: None,
            started_at_ms: now_ms(),
            finished_at_ms: 0,
            timeout_ms: timeout.as_millis() as u64,
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
            epoch: self.epoch,
        };
        if let Err(e) = self.put_record(&record).await {
            self.tracker
                .fail(SnapshotId(id), FailureReason::Storage(e.to_string()));
            return Err(e);
        }
        self.inflight.insert(id, record);
        self.metrics.in_flight.set(self.inflight.len() as i64);
        let wire_plan = cairn_proto::convert::plan_to_pb(&plan, 0);
        for initiator in &plan.initiators {
            if let Some(member) = self.members.get(initiator) {
                let command = pb::CoordinatorToNode {
                    kind: Some(pb::coordinator_to_node::Kind::Initiate(wire_plan.clone())),
                };
                let _ = member.tx.try_send(Ok(command));
            }
        }
        let tx = self.self_tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            let _ = tx.send(Msg::TimedOut { id }).await;
        });
        tracing::info!(snapshot = id, mode = %plan.mode, "snapshot started");
        Ok(id)
    }

    /// The next snapshot id: one above the stored counter and above every id a daemon
    /// reported having seen (the counter may have been lost with the metadata).
    async fn next_snapshot_id(&mut self) -> Result<u64, Error> {
        let id = self
            .kv
            .fetch_increment(&self.keys.next_id())
            .await?
            .saturating_add(1);
        if id > self.id_floor {
            return Ok(id);
        }
        let id = self.id_floor.saturating_add(1);
        tracing::warn!(
            snapshot = id,
            daemons_saw = self.id_floor,
            "the stored snapshot id counter is behind ids the daemons have seen (lost \
             metadata?): continuing above them"
        );
        self.kv
            .put(&self.keys.next_id(), id.to_string().into_bytes())
            .await?;
        Ok(id)
    }

    /// Why snapshots may not start now, if they may not: a restore under way, or one that
    /// failed and left the nodes possibly in different states.
    pub(super) fn fence(&self) -> Option<String> {
        if let Some(active) = &self.restore {
            return Some(format!(
                "{} (of snapshot {}) is in progress; snapshots can start once every node \
                 has applied it",
                active.record.id, active.record.snapshot_id
            ));
        }
        if let Some(r) = &self.unfinished_restore {
            return Some(format!(
                "{} (of snapshot {}) did not finish ({}): the nodes may hold different \
                 states, so no snapshot starts until a restore is applied by every node \
                 (cairnctl snapshot restore ID)",
                r.id,
                r.snapshot_id,
                r.failure.as_deref().unwrap_or("failed")
            ));
        }
        let behind: Vec<String> = self
            .members
            .iter()
            .filter(|(_, m)| m.epoch != self.epoch)
            .map(|(n, m)| format!("{n} (epoch {})", m.epoch))
            .collect();
        (!behind.is_empty()).then(|| {
            format!(
                "nodes missed a restore and are not in the cluster's epoch {}: {}; no \
                 snapshot starts until a restore is applied by every node",
                self.epoch,
                behind.join(", ")
            )
        })
    }

    /// The restore that keeps snapshot `id` from being deleted, if any.
    fn restore_holding(&self, id: u64) -> Option<&RestoreRecord> {
        self.restore
            .as_ref()
            .map(|a| &a.record)
            .into_iter()
            .chain(self.unfinished_restore.as_ref())
            .find(|r| r.snapshot_id == id)
    }

    async fn abort(&mut self, id: u64, reason: String) -> Result<SnapshotRecord, Error> {
        if !self.inflight.contains_key(&id) {
            return match self.get_record(id).await? {
                Some(record) => Err(Error::FailedPrecondition(format!(
                    "snapshot {id} is already {}",
                    record.status
                ))),
                None => Err(Error::NotFound(id)),
            };
        }
        let reason = if reason.is_empty() {
            "aborted by a user".to_owned()
        } else {
            reason
        };
        let update = self
            .tracker
            .fail(SnapshotId(id), FailureReason::Aborted(reason));
        self.settle(id, update).await;
        self.get_record(id).await?.ok_or(Error::NotFound(id))
    }

    async fn delete(&mut self, id: u64) -> Result<u64, Error> {
        if self.inflight.contains_key(&id) {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {id} is in progress; abort it first"
            )));
        }
        if self.get_record(id).await?.is_none() {
            return Err(Error::NotFound(id));
        }
        if let Some(restore) = self.restore_holding(id) {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {id} is being restored by {} ({}); it can be deleted once a \
                 restore has finished",
                restore.id,
                restore.status.to_lowercase().replace('_', " ")
            )));
        }
        self.kv.delete_prefix(&self.keys.parts(id)).await?;
        self.kv.delete(&self.keys.snapshot(id)).await?;
        tracing::info!(snapshot = id, "snapshot deleted");
        self.collect_garbage().await
    }

    async fn watch(&mut self, id: u64, tx: WatchTx) -> Result<(), Error> {
        let record = match self.inflight.get(&id) {
            Some(r) => r.clone(),
            None => self.get_record(id).await?.ok_or(Error::NotFound(id))?,
        };
        let _ = tx.try_send(Ok(progress_pb(&record)));
        if record.status == "IN_PROGRESS" {
            self.watchers.entry(id).or_default().push(tx);
        }
        Ok(())
    }

    /// Applies a tracker update: progress is published; an end is stored, published, and
    /// (if failed) sent to every node so that their engines drop the snapshot.
    async fn settle(&mut self, id: u64, update: tracker::Update) {
        match update {
            tracker::Update::Ignored => {}
            tracker::Update::Progress => {
                if let Some(record) = self.inflight.get(&id).cloned() {
                    self.publish(&record).await;
                }
            }
            tracker::Update::Finished(outcome) => {
                let Some(mut record) = self.inflight.remove(&id) else {
                    return;
                };
                record.finished_at_ms = now_ms();
                self.metrics.in_flight.set(self.inflight.len() as i64);
                match &outcome {
                    tracker::Outcome::Completed(consistent) => {
                        record.status = "COMPLETED".into();
                        record.verdict = Some(VerdictRecord {
                            consistent: true,
                            violation: String::new(),
                            recorded_messages: consistent.recorded_messages,
                        });
                        tracing::info!(
                            snapshot = id,
                            ms = record.finished_at_ms - record.started_at_ms,
                            "snapshot completed and verified"
                        );
                    }
                    tracker::Outcome::Failed(reason) => {
                        record.status = if matches!(reason, FailureReason::Aborted(_)) {
                            "ABORTED"
                        } else {
                            "FAILED"
                        }
                        .into();
                        if let Some(violation) = outcome.violation() {
                            record.verdict = Some(VerdictRecord {
                                consistent: false,
                                violation: violation.to_string(),
                                recorded_messages: 0,
                            });
                        }
                        record.failure = Some(failure_record(reason));
                        tracing::warn!(snapshot = id, %reason, "snapshot did not complete");
                        let abort = pb::AbortSnapshotRequest {
                            snapshot_id: id,
                            reason: reason.to_string(),
                        };
                        self.broadcast(pb::coordinator_to_node::Kind::Abort(abort));
                    }
                }
                // Stored, then retention applied, then told: whoever sees it end sees the
                // store as it is after it.
                if let Err(e) = self.put_record(&record).await {
                    tracing::error!(snapshot = id, "cannot store the snapshot record: {e}");
                }
                if record.status == "COMPLETED"
                    && let Err(e) = self.apply_retention().await
                {
                    tracing::warn!("retention: {e}");
                }
                if let Some(watchers) = self.watchers.remove(&id) {
                    let progress = progress_pb(&record);
                    for watcher in watchers {
                        let _ = watcher.try_send(Ok(progress.clone()));
                    }
                }
                self.count_end(&record);
                let result = match &record.failure {
                    None => Ok(()),
                    Some(_) => Err(match &outcome {
                        tracker::Outcome::Failed(reason) => reason.to_string(),
                        tracker::Outcome::Completed(_) => record.status.clone(),
                    }),
                };
                let alarm = self
                    .schedule
                    .finished(SnapshotId(id), self.clock_ms(), result);
                self.alarm(alarm);
                self.refresh().await;
            }
        }
    }

    fn count_end(&self, record: &SnapshotRecord) {
        let status = record.status.to_lowercase();
        self.metrics
            .snapshots
            .get_or_create(&crate::metrics::StatusLabel { status })
            .inc();
        if record.status == "COMPLETED" {
            let seconds =
                record.finished_at_ms.saturating_sub(record.started_at_ms) as f64 / 1000.0;
            self.metrics.duration.observe(seconds);
            self.metrics.bytes_new.inc_by(record.bytes_new);
            self.metrics.bytes_reused.inc_by(record.bytes_reused);
            let recorded = record.verdict.as_ref().map_or(0, |v| v.recorded_messages);
            self.metrics.recorded_messages.inc_by(recorded);
        }
    }

    /// Tells the record's watchers; stores it once it has ended. Progress of a snapshot in
    /// flight lives in `inflight` only (a restarted coordinator fails such a snapshot
    /// anyway), which spares the store a synced write per node and step.
    async fn publish(&mut self, record: &SnapshotRecord) {
        if record.status != "IN_PROGRESS"
            && let Err(e) = self.put_record(record).await
        {
            tracing::error!(
                snapshot = record.id,
                "cannot store the snapshot record: {e}"
            );
        }
        if let Some(watchers) = self.watchers.get_mut(&record.id) {
            let progress = progress_pb(record);
            watchers.retain(|w| w.try_send(Ok(progress.clone())).is_ok() || !w.is_closed());
        }
    }

    fn broadcast(&self, kind: pb::coordinator_to_node::Kind) {
        for member in self.members.values() {
            let _ = member.tx.try_send(Ok(pb::CoordinatorToNode {
                kind: Some(kind.clone()),
            }));
        }
    }

    async fn put_record(&self, record: &SnapshotRecord) -> Result<(), Error> {
        let value = serde_json::to_vec_pretty(record).expect("plain record");
        Ok(self.kv.put(&self.keys.snapshot(record.id), value).await?)
    }

    async fn get_record(&self, id: u64) -> Result<Option<SnapshotRecord>, Error> {
        match self.kv.get(&self.keys.snapshot(id)).await? {
            Some(value) => Ok(serde_json::from_slice(&value).ok()),
            None => Ok(None),
        }
    }

    /// Keeps the newest `retention` completed snapshots; deletes older ones.
    async fn apply_retention(&mut self) -> Result<(), Error> {
        if self.settings.retention == 0 {
            return Ok(());
        }
        let mut completed: Vec<u64> = Vec::new();
        for (_, value) in self.kv.list(&self.keys.snapshots()).await? {
            if let Ok(record) = serde_json::from_slice::<SnapshotRecord>(&value)
                && record.status == "COMPLETED"
            {
                completed.push(record.id);
            }
        }
        completed.sort_unstable();
        let excess = completed.len().saturating_sub(self.settings.retention);
        for id in completed.into_iter().take(excess) {
            if let Some(restore) = self.restore_holding(id) {
                tracing::info!(snapshot = id, restore = %restore.id, "retention: kept while a restore refers to it");
                continue;
            }
            self.kv.delete_prefix(&self.keys.parts(id)).await?;
            self.kv.delete(&self.keys.snapshot(id)).await?;
            tracing::info!(snapshot = id, "retention: deleted");
        }
        if excess > 0 {
            self.collect_garbage().await?;
        }
        Ok(())
    }

    /// Removes chunks no stored part refers to. Skipped while snapshots are in flight:
    /// their parts may be uploading chunks not yet listed anywhere.
    async fn collect_garbage(&self) -> Result<u64, Error> {
        if !self.inflight.is_empty() {
            return Ok(0);
        }
        let mut referenced = BTreeSet::new();
        let parts_root = format!("/cairn/{}/parts/", self.settings.cluster);
        for (_, value) in self.kv.list(&parts_root).await? {
            if let Ok(part) = serde_json::from_slice::<crate::store::PartRecord>(&value) {
                referenced.extend(part.local_state.chunks);
                referenced.extend(part.channel_states.chunks);
            }
        }
        let freed = self
            .blobs
            .collect_garbage(&referenced)
            .await
            .map_err(|e| Error::Blob(e.to_string()))?;
        Ok(freed)
    }
}

/// Sleeps until `deadline`; forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The failure `node` reported. The wire's reason is taken exactly
/// (`cairn_proto::convert::failure`), except where the reporter is who it concerns: a
/// node lost, without an application or shutting down is the reporting node (whatever
/// the wire names), a reset without its channel is the reporter lost, and a reason
/// without a kind (or one this coordinator does not know, or cannot read) is an abort
/// naming the node.
fn node_failure(node: &NodeId, reason: &pb::FailureReason) -> FailureReason {
    use pb::failure_reason::Kind;
    let aborted = |why: String| FailureReason::Aborted(format!("on node {node}: {why}"));
    match Kind::try_from(reason.kind).unwrap_or(Kind::Unspecified) {
        Kind::ChannelReset if reason.channel.is_none() => FailureReason::NodeLost(node.clone()),
        Kind::NoApplication => FailureReason::NoApplication(node.clone()),
        Kind::Shutdown => FailureReason::Shutdown(node.clone()),
        Kind::NodeLost => FailureReason::NodeLost(node.clone()),
        Kind::Unspecified => aborted(reason.message.clone()),
        _ => FailureReason::try_from(reason)
            .unwrap_or_else(|e| aborted(format!("{} ({e})", reason.message))),
    }
}

/// The mode of a start request from the wire.
pub(crate) fn mode_of(value: i32) -> Result<SnapshotMode, Error> {
    cairn_proto::convert::mode_from_pb(value, Some(SnapshotMode::ChandyLamport))
        .map_err(|e| Error::InvalidArgument(e.to_string()))
}

#[cfg(test)]
mod tests {
    use cairn_core::ChannelId;

    use super::*;

    #[test]
    fn a_node_failure_is_exact_and_names_its_reporter() {
        let node = NodeId::from("n2");
        let wire = |reason: &FailureReason| pb::FailureReason::from(reason);
        // Taken exactly (Timeout and MixedEpochs once became aborts).
        for reason in [
            FailureReason::ChannelReset(ChannelId::new("n1", "n2")),
            FailureReason::Storage("upload of n2's part failed: no space".into()),
            FailureReason::MembershipChanged("node n3 joined".into()),
            FailureReason::Timeout {
                missing: vec!["n1".into()],
            },
            FailureReason::Restore,
            FailureReason::MixedEpochs {
                nodes: vec!["n2".into()],
                detail: "n2 is in epoch 2".into(),
            },
        ] {
            assert_eq!(node_failure(&node, &wire(&reason)), reason);
        }
        // The reporter is who these concern, whatever the wire names.
        for (sent, taken) in [
            (
                FailureReason::NoApplication("n9".into()),
                FailureReason::NoApplication(node.clone()),
            ),
            (
                FailureReason::Shutdown("n9".into()),
                FailureReason::Shutdown(node.clone()),
            ),
            (
                FailureReason::NodeLost("n9".into()),
                FailureReason::NodeLost(node.clone()),
            ),
        ] {
            assert_eq!(node_failure(&node, &wire(&sent)), taken);
        }
        let mut reset = wire(&FailureReason::ChannelReset(ChannelId::new("n1", "n2")));
        reset.channel = None;
        assert_eq!(
            node_failure(&node, &reset),
            FailureReason::NodeLost(node.clone())
        );
        let unknown = pb::FailureReason {
            kind: 99,
            message: "what".into(),
            ..Default::default()
        };
        assert_eq!(
            node_failure(&node, &unknown),
            FailureReason::Aborted("on node n2: what".into())
        );
    }
}
