//! The daemon's session with the coordinator (when started with `--coordinator`): it
//! registers, takes snapshot commands (initiate, abort, membership, restore), reports
//! progress and failures, and uploads each completed part in chunks (`upload`). A restore's
//! share is fetched aside (`restore_fetch`). After a broken session it registers again.
//!
//! With several coordinator replicas, `coordinators` chooses the next one to try (in turn,
//! or the leader a replica named in `cairn-leader`), and `term` refuses a deposed leader:
//! every message carries its leader's term, and one lower than the highest seen ends the
//! session. HTTP/2 keep-alive pings find a dead or stopped coordinator within seconds.

mod coordinators;
mod error;
mod restore_fetch;
mod term;
mod upload;

use std::sync::Arc;
use std::time::Duration;

use cairn_core::{FailureReason, SnapshotId};
use cairn_rpc::v1 as pb;
use rand::Rng;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::node_loop::{LoopMsg, NodeEvent};
use crate::shared::Shared;
use crate::wiring::Wirer;
pub(crate) use coordinators::Coordinators;
use coordinators::Redirect;
pub(crate) use error::LinkError;
use restore_fetch::fetch_and_restore;
use term::TermCheck;
use upload::UploadItem;

/// How often the node tells the coordinator it is alive, and whether its application is.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// How long a connection may be quiet before it is pinged (HTTP/2 PING), a session open or
/// not.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// A ping not answered within this closes the connection: a dead or stopped (SIGSTOP)
/// coordinator ends the session in about 4 s, and the link tries the next one.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest wait from dialling a coordinator to its answer to `Register` (a TLS handshake
/// with a stopped process is not covered by the connect timeout or by the pings).
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// The name of a coordinator's message, as the stale-term refusal counts it.
fn what(kind: &pb::coordinator_to_node::Kind) -> &'static str {
    use pb::coordinator_to_node::Kind;
    match kind {
        Kind::Registered(_) => "registered",
        Kind::Initiate(_) => "initiate",
        Kind::Abort(_) => "abort",
        Kind::Membership(_) => "membership",
        Kind::Restore(_) => "restore",
        Kind::Left(_) => "left",
        Kind::Outcomes(_) => "outcomes",
    }
}

pub(crate) struct CoordinatorLink {
    pub shared: Arc<Shared>,
    pub loop_tx: mpsc::Sender<LoopMsg>,
    /// The coordinator replicas and which to try next.
    pub coordinators: Coordinators,
    pub advertise: String,
    pub events: mpsc::UnboundedReceiver<NodeEvent>,
    /// Wires the node to the members the coordinator names.
    pub wirer: Wirer,
    /// The blob store this daemon writes new chunks to itself (`--blob-store`); `None`:
    /// they travel in the upload to the coordinator.
    pub blobs: Option<cairn_blob::BlobStore>,
    /// Uploads under way, by snapshot.
    pub uploads: std::collections::BTreeMap<u64, mpsc::UnboundedSender<UploadItem>>,
    /// The highest snapshot id this daemon has seen (told at registration, so that a
    /// coordinator that lost its metadata never reuses an id).
    pub highest_snapshot: u64,
    /// The last restore the application applied ("" if none).
    pub applied_restore: String,
    /// Shutdown asks to leave the cluster here, and is answered once the coordinator has.
    pub leave: mpsc::Receiver<oneshot::Sender<Result<(), String>>>,
    /// A `Leave` sent, waiting for the coordinator's answer (dropped with its session).
    pub leaving: Option<oneshot::Sender<Result<(), String>>>,
}

impl CoordinatorLink {
    pub(crate) async fn run(mut self, shutdown: CancellationToken) {
        loop {
            let address = self.coordinators.next_address();
            let why = match self.session(&address, &shutdown).await {
                Ok(()) => return,
                Err(why) => why,
            };
            self.leaving = None;
            self.shared
                .registered
                .store(false, std::sync::atomic::Ordering::Release);
            // A live replica saying UNAVAILABLE is an election or a redirect: keep asking at
            // a short pace. Any other refusal (a held id, a wrong cluster) backs off.
            if let LinkError::Refused(status) | LinkError::Stream(status) = &why
                && status.code() == tonic::Code::Unavailable
            {
                self.coordinators.answered();
            }
            let redirect = why
                .leader_hint()
                .map(|hint| (self.coordinators.redirected_to(&hint), hint));
            match (&why, redirect) {
                (LinkError::StaleTerm { .. }, _) => {
                    tracing::error!(coordinator = %address, "{why}")
                }
                (_, Some((Redirect::Taken, leader))) => tracing::info!(
                    coordinator = %address,
                    %leader,
                    "coordinator session: {why}; trying the leader it names"
                ),
                (_, Some((Redirect::Invalid(bad), hint))) => tracing::warn!(
                    coordinator = %address,
                    "coordinator session: {why}; retrying, ignoring the leader it names, {:?}: {bad}",
                    hint.chars().take(64).collect::<String>()
                ),
                (_, Some((Redirect::TooMany, leader))) => tracing::warn!(
                    coordinator = %address,
                    %leader,
                    "coordinator session: {why}; {} redirects without registering: trying the \
                     coordinators in turn",
                    coordinators::MAX_REDIRECTS
                ),
                (_, None) => {
                    tracing::warn!(coordinator = %address, "coordinator session: {why}; retrying")
                }
            }
            let jitter = rand::rng().random_range(0.5..1.5);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.coordinators.pause().mul_f64(jitter)) => {}
            }
        }
    }

    async fn connect(&self, address: &str) -> Result<Channel, LinkError> {
        // The coordinator's certificate must name DNS:coordinator (as a peer's names its
        // node id), whatever address it is dialled at: a node's certificate, which also
        // names loopback, cannot answer as the coordinator. So a leader hint, which need
        // not be one of --coordinator's addresses, cannot lead to an impostor either.
        cairn_rpc::tls::endpoint_for(address, "coordinator", self.shared.tls.as_ref())
            .map_err(LinkError::Address)?
            .connect_timeout(Duration::from_secs(3))
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(32 << 20)
            .connect()
            .await
            .map_err(LinkError::Connect)
    }

    /// Checks a message's leadership `term` (`what` it is, from the coordinator at
    /// `address`) against the highest seen, and raises that if it is higher. `Err` for a
    /// lower term: counted, and nothing of the message is to be acted on.
    fn check_term(&self, what: &'static str, term: u64, address: &str) -> Result<(), LinkError> {
        match term::observe(&self.shared.highest_term, term) {
            TermCheck::Same => Ok(()),
            TermCheck::Raised { from } => {
                let gauge = i64::try_from(term).unwrap_or(i64::MAX);
                self.shared.metrics.coordinator_term.set(gauge);
                tracing::debug!(coordinator = %address, term, from, "coordinator term raised");
                Ok(())
            }
            TermCheck::Stale { highest } => {
                self.shared.metrics.stale_term_refused(what);
                Err(LinkError::StaleTerm {
                    what,
                    term,
                    highest,
                    address: address.to_owned(),
                })
            }
        }
    }

    /// One session with the coordinator at `address`; `Ok` only on shutdown.
    async fn session(
        &mut self,
        address: &str,
        shutdown: &CancellationToken,
    ) -> Result<(), LinkError> {
        use pb::coordinator_to_node::Kind;
        let (tx, rx) = mpsc::channel(64);
        let register = pb::Register {
            cluster: self.shared.cluster.clone(),
            node_id: self.shared.node_id.to_string(),
            address: self.advertise.clone(),
            incarnation: self.shared.incarnation,
            epoch: *self.shared.epoch.borrow(),
            applied_restore_id: self.applied_restore.clone(),
            highest_snapshot_id: self.highest_snapshot,
        };
        let first = pb::NodeToCoordinator {
            kind: Some(pb::node_to_coordinator::Kind::Register(register)),
        };
        tx.send(first).await.map_err(|_| LinkError::SessionClosed)?;
        let open = async {
            let channel = self.connect(address).await?;
            let mut client = pb::coordinator_client::CoordinatorClient::new(channel)
                .max_encoding_message_size(64 << 20)
                .max_decoding_message_size(64 << 20);
            let mut commands = client
                .node_session(ReceiverStream::new(rx))
                .await
                .map_err(LinkError::Refused)?
                .into_inner();
            let answer = commands.message().await.map_err(LinkError::Refused)?;
            Ok::<_, LinkError>((client, commands, answer))
        };
        let (client, mut commands, answer) = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            opened = tokio::time::timeout(REGISTER_TIMEOUT, open) => {
                opened.map_err(|_| LinkError::RegisterTimeout)??
            }
        };
        match answer {
            Some(pb::CoordinatorToNode {
                kind: Some(Kind::Registered(m)),
                term,
            }) => {
                self.check_term("registered", term, address)?;
                tracing::info!(
                    coordinator = %address,
                    term,
                    members = m.nodes.len(),
                    epoch = m.epoch,
                    "registered with the coordinator"
                );
                self.shared.metrics.coordinator_sessions.inc();
                // The coordinator names the epoch this node is to be in: the cluster's for a
                // new daemon, its own while it still has a restore to apply.
                if m.epoch != *self.shared.epoch.borrow() {
                    let adopt = LoopMsg::AdoptEpoch { epoch: m.epoch };
                    self.loop_tx
                        .send(adopt)
                        .await
                        .map_err(|_| LinkError::NodeStopping)?;
                }
                // A membership this daemon cannot follow ends the session: the coordinator
                // sees it go, and the daemon tries again later.
                self.wirer.apply(&m).await?;
                self.coordinators.registered(address);
                self.shared
                    .registered
                    .store(true, std::sync::atomic::Ordering::Release);
                // Outcomes pushed to an earlier session may be lost: the application's are
                // caught up from this coordinator.
                self.loop_tx
                    .send(LoopMsg::Registered)
                    .await
                    .map_err(|_| LinkError::NodeStopping)?;
            }
            other => return Err(LinkError::NotRegistered(Box::new(other))),
        }
        let mut heartbeat = tokio::time::interval(HEARTBEAT);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = heartbeat.tick() => {
                    let (reply, status) = tokio::sync::oneshot::channel();
                    if self.loop_tx.send(LoopMsg::Status { reply }).await.is_err() {
                        return Ok(());
                    }
                    let Ok(status) = status.await else { return Ok(()) };
                    let beat = pb::NodeToCoordinator {
                        kind: Some(pb::node_to_coordinator::Kind::Heartbeat(pb::Heartbeat {
                            application_attached: status.application_attached,
                            channels: status.channels,
                        })),
                    };
                    tx.send(beat).await.map_err(|_| LinkError::SessionClosed)?;
                }
                command = commands.message() => match command {
                    Ok(Some(pb::CoordinatorToNode { kind: Some(kind), term })) => {
                        // A deposed leader's message is refused whole: nothing of it is done.
                        self.check_term(what(&kind), term, address)?;
                        self.command(kind, &tx, &client).await?;
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => return Err(LinkError::ClosedByCoordinator),
                    Err(s) => return Err(LinkError::Stream(s)),
                },
                event = self.events.recv() => match event {
                    Some(event) => self.report(event, &tx, &client).await?,
                    None => return Ok(()),
                },
                Some(reply) = self.leave.recv() => {
                    let leave = pb::NodeToCoordinator {
                        kind: Some(pb::node_to_coordinator::Kind::Leave(pb::Leave {})),
                    };
                    tx.send(leave).await.map_err(|_| LinkError::SessionClosed)?;
                    self.leaving = Some(reply);
                }
            }
        }
    }

    async fn command(
        &mut self,
        kind: pb::coordinator_to_node::Kind,
        session: &mpsc::Sender<pb::NodeToCoordinator>,
        client: &pb::coordinator_client::CoordinatorClient<Channel>,
    ) -> Result<(), LinkError> {
        use pb::coordinator_to_node::Kind;
        match kind {
            Kind::Initiate(plan) => match cairn_core::Plan::try_from(&plan) {
                Ok(plan) => {
                    self.highest_snapshot = self.highest_snapshot.max(plan.id.0);
                    let _ = self.loop_tx.send(LoopMsg::InitiatePlan { plan }).await;
                }
                Err(e) => tracing::error!("coordinator sent a bad plan: {e}"),
            },
            Kind::Abort(abort) => {
                let reason = FailureReason::Aborted(abort.reason);
                let id = SnapshotId(abort.snapshot_id);
                let _ = self.loop_tx.send(LoopMsg::Abort { id, reason }).await;
            }
            Kind::Membership(m) => {
                tracing::debug!(members = m.nodes.len(), "membership update");
                self.wirer.apply(&m).await?;
            }
            Kind::Registered(_) => {}
            Kind::Outcomes(outcomes) => {
                match cairn_core::lifecycle::Outcomes::try_from(&outcomes) {
                    Ok(outcomes) => {
                        let _ = self.loop_tx.send(LoopMsg::Outcomes(outcomes)).await;
                    }
                    // Not taken: the application hears nothing of it, and a later push shows
                    // the gap, which is asked for again.
                    Err(e) => tracing::error!(
                        "coordinator sent snapshot outcomes that cannot be taken: {e}"
                    ),
                }
            }
            Kind::Left(answer) => {
                if let Some(reply) = self.leaving.take() {
                    let _ = reply.send(if answer.error.is_empty() {
                        Ok(())
                    } else {
                        Err(answer.error)
                    });
                }
            }
            Kind::Restore(restore) => {
                tracing::info!(
                    restore = %restore.restore_id,
                    snapshot = restore.snapshot_id,
                    epoch = restore.epoch,
                    "restore requested: fetching this node's share"
                );
                // Fetched aside, so the session keeps serving; the loop enters the new
                // epoch once the recorded messages and counts are here, in one step, and
                // the state streams on to the application after.
                tokio::spawn(fetch_and_restore(
                    client.clone(),
                    restore,
                    self.shared.node_id.to_string(),
                    self.loop_tx.clone(),
                    session.clone(),
                ));
            }
        }
        Ok(())
    }

    async fn report(
        &mut self,
        event: NodeEvent,
        tx: &mpsc::Sender<pb::NodeToCoordinator>,
        client: &pb::coordinator_client::CoordinatorClient<Channel>,
    ) -> Result<(), LinkError> {
        use pb::node_snapshot_event::Kind;
        if let Some(id) = event.snapshot() {
            self.highest_snapshot = self.highest_snapshot.max(id.0);
        }
        let (id, kind) = match event {
            NodeEvent::RestoreApplied { restore_id } => {
                self.applied_restore.clone_from(&restore_id);
                let applied = pb::node_to_coordinator::Kind::RestoreApplied(pb::RestoreApplied {
                    restore_id,
                });
                let message = pb::NodeToCoordinator {
                    kind: Some(applied),
                };
                return tx.send(message).await.map_err(|_| LinkError::SessionClosed);
            }
            NodeEvent::OutcomesAfter(after) => {
                let ask = pb::node_to_coordinator::Kind::OutcomesAfter(pb::OutcomesAfter { after });
                let message = pb::NodeToCoordinator { kind: Some(ask) };
                return tx.send(message).await.map_err(|_| LinkError::SessionClosed);
            }
            NodeEvent::RestoreFailed {
                restore_id,
                message,
            } => {
                return tx
                    .send(restore_failed(restore_id, message))
                    .await
                    .map_err(|_| LinkError::SessionClosed);
            }
            NodeEvent::StateRecorded { id, times } => (
                id,
                Kind::StateRecorded(pb::NodeStateRecorded {
                    recording_for_ms: times.recording_for_ms,
                    aligned_ms: times.aligned_ms,
                    held_messages: times.held_messages,
                }),
            ),
            NodeEvent::Failed(id, reason) => {
                // Dropping its items ends the upload without a cut: the coordinator keeps
                // nothing of it.
                self.uploads.remove(&id.0);
                (id, Kind::Failed((&reason).into()))
            }
            NodeEvent::StateChunk { id, chunk } => {
                let _ = self.upload(id.0, tx, client).send(UploadItem::State(chunk));
                return Ok(());
            }
            NodeEvent::Recorded {
                id,
                channel,
                messages,
            } => {
                let run = UploadItem::Recorded(channel, messages);
                let _ = self.upload(id.0, tx, client).send(run);
                return Ok(());
            }
            NodeEvent::PartReady(part) => {
                let id = part.report.id.0;
                let _ = self.upload(id, tx, client).send(UploadItem::Finish(part));
                self.uploads.remove(&id);
                return Ok(());
            }
        };
        let event = pb::NodeToCoordinator {
            kind: Some(pb::node_to_coordinator::Kind::Snapshot(
                pb::NodeSnapshotEvent {
                    snapshot_id: id.0,
                    kind: Some(kind),
                },
            )),
        };
        tx.send(event).await.map_err(|_| LinkError::SessionClosed)
    }
}

fn restore_failed(restore_id: String, message: String) -> pb::NodeToCoordinator {
    pb::NodeToCoordinator {
        kind: Some(pb::node_to_coordinator::Kind::RestoreFailed(
            pb::NodeRestoreFailed {
                restore_id,
                message,
            },
        )),
    }
}
