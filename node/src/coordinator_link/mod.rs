//! The daemon's session with the coordinator (when started with `--coordinator`): it
//! registers, takes snapshot commands (initiate, abort, membership, restore), reports
//! progress and failures, and uploads each completed part in chunks (`upload`). A restore's
//! share is fetched aside (`restore_fetch`). After a broken session it registers again.

mod restore_fetch;
mod upload;

use std::sync::Arc;
use std::time::Duration;

use cairn_core::{FailureReason, SnapshotId};
use cairn_proto::convert::ConvertError;
use cairn_proto::v1 as pb;
use rand::Rng;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::node_loop::{LoopMsg, NodeEvent};
use crate::shared::Shared;
use crate::wiring::{MembershipError, Wirer};
use restore_fetch::fetch_and_restore;
use upload::UploadItem;

/// How often the node tells the coordinator it is alive, and whether its application is.
const HEARTBEAT: Duration = Duration::from_secs(2);

/// Why a session with the coordinator ended, or a part's upload or a restore's fetch
/// failed. The texts are what the daemon logs (the session's as
/// "coordinator session: {why}; retrying").
#[derive(Debug, thiserror::Error)]
pub(crate) enum LinkError {
    /// The coordinator's address is not a valid endpoint.
    #[error("{0}")]
    Address(tonic::transport::Error),
    /// The coordinator could not be reached.
    #[error("cannot connect: {}", cairn_sdk::error::with_causes(.0))]
    Connect(tonic::transport::Error),
    /// The coordinator refused the session (a node id held by a connected daemon, a node
    /// not in its topology, ...): its message.
    #[error("refused: {}", .0.message())]
    Refused(tonic::Status),
    /// The coordinator's first answer was not `Registered`.
    #[error("expected Registered, got {0:?}")]
    NotRegistered(Box<Option<pb::CoordinatorToNode>>),
    /// The coordinator ended the session.
    #[error("the coordinator closed the session")]
    ClosedByCoordinator,
    /// The session's stream failed: its status message.
    #[error("{}", .0.message())]
    Stream(tonic::Status),
    /// This daemon's half of the session is gone.
    #[error("session closed")]
    SessionClosed,
    /// The node loop has stopped.
    #[error("node stopping")]
    NodeStopping,
    /// A membership this daemon cannot follow.
    #[error(transparent)]
    Membership(#[from] MembershipError),
    /// Fetching a restore's share failed: the coordinator's message.
    #[error("{}", .0.message())]
    Fetch(tonic::Status),
    /// A piece of a restore's share names no valid channel.
    #[error("{0}")]
    BadPiece(#[from] ConvertError),
    /// A restore's share ended early.
    #[error("the coordinator's stream ended before the replay counts")]
    NoReplayCounts,
    /// The coordinator refused or failed a part's upload: its message.
    #[error("{}", .0.message())]
    UploadRefused(tonic::Status),
    /// The upload's call ended abnormally.
    #[error("{0}")]
    UploadTask(tokio::task::JoinError),
}

pub(crate) struct CoordinatorLink {
    pub shared: Arc<Shared>,
    pub loop_tx: mpsc::Sender<LoopMsg>,
    pub address: String,
    pub advertise: String,
    pub events: mpsc::UnboundedReceiver<NodeEvent>,
    /// Wires the node to the members the coordinator names.
    pub wirer: Wirer,
    /// Uploads under way, by snapshot.
    pub uploads: std::collections::BTreeMap<u64, mpsc::UnboundedSender<UploadItem>>,
    /// The highest snapshot id this daemon has seen (told at registration, so that a
    /// coordinator that lost its metadata never reuses an id).
    pub highest_snapshot: u64,
    /// The last restore the application applied ("" if none).
    pub applied_restore: String,
}

impl CoordinatorLink {
    pub(crate) async fn run(mut self, shutdown: CancellationToken) {
        let mut delay = Duration::from_millis(100);
        loop {
            match self.session(&shutdown).await {
                Ok(()) => return,
                Err(why) => {
                    tracing::warn!(coordinator = %self.address, "coordinator session: {why}; retrying")
                }
            }
            let jitter = rand::rng().random_range(0.5..1.5);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay.mul_f64(jitter)) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }

    async fn connect(&self) -> Result<Channel, LinkError> {
        // The coordinator's certificate must name DNS:coordinator (as a peer's names its
        // node id), whatever address it is dialled at: a node's certificate, which also
        // names loopback, cannot answer as the coordinator.
        cairn_sdk::tls::endpoint_for(&self.address, "coordinator", self.shared.tls.as_ref())
            .map_err(LinkError::Address)?
            .connect_timeout(Duration::from_secs(3))
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(32 << 20)
            .connect()
            .await
            .map_err(LinkError::Connect)
    }

    /// One session; `Ok` only on shutdown.
    async fn session(&mut self, shutdown: &CancellationToken) -> Result<(), LinkError> {
        use pb::coordinator_to_node::Kind;
        let channel = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            c = self.connect() => c?,
        };
        let mut client = pb::coordinator_client::CoordinatorClient::new(channel)
            .max_encoding_message_size(64 << 20)
            .max_decoding_message_size(64 << 20);
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
        let mut commands = client
            .node_session(ReceiverStream::new(rx))
            .await
            .map_err(LinkError::Refused)?
            .into_inner();
        match commands.message().await {
            Ok(Some(pb::CoordinatorToNode {
                kind: Some(Kind::Registered(m)),
            })) => {
                tracing::info!(
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
            }
            Ok(other) => return Err(LinkError::NotRegistered(Box::new(other))),
            Err(s) => return Err(LinkError::Refused(s)),
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
                        })),
                    };
                    tx.send(beat).await.map_err(|_| LinkError::SessionClosed)?;
                }
                command = commands.message() => match command {
                    Ok(Some(pb::CoordinatorToNode { kind: Some(kind) })) => self.command(kind, &tx, &client).await?,
                    Ok(Some(_)) => {}
                    Ok(None) => return Err(LinkError::ClosedByCoordinator),
                    Err(s) => return Err(LinkError::Stream(s)),
                },
                event = self.events.recv() => match event {
                    Some(event) => self.report(event, &tx, &client).await?,
                    None => return Ok(()),
                },
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
            Kind::Restore(restore) => {
                tracing::info!(
                    restore = %restore.restore_id,
                    snapshot = restore.snapshot_id,
                    epoch = restore.epoch,
                    "restore requested: fetching this node's share"
                );
                // Fetched aside, so the session keeps serving; the loop enters the new
                // epoch only once everything is here, in one step.
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
            NodeEvent::RestoreFailed {
                restore_id,
                message,
            } => {
                return tx
                    .send(restore_failed(restore_id, message))
                    .await
                    .map_err(|_| LinkError::SessionClosed);
            }
            NodeEvent::StateRecorded(id) => (id, Kind::StateRecorded(pb::Empty {})),
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
