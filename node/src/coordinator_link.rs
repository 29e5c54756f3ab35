//! The daemon's session with the coordinator (when started with `--coordinator`): it
//! registers, takes snapshot commands (initiate, abort), reports progress and failures,
//! and uploads each completed part in chunks. After a broken session it registers again.

use std::sync::Arc;
use std::time::Duration;

use cairn_core::{FailureReason, SnapshotId};
use cairn_proto::v1 as pb;
use rand::Rng;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use crate::node_loop::{LoopMsg, NodeEvent, RestoreData};
use crate::shared::{Shared, StateChunk};
use crate::wiring::Wirer;
use cairn_proto::convert::channel_from_pb;

/// How often the node tells the coordinator it is alive, and whether its application is.
const HEARTBEAT: Duration = Duration::from_secs(2);

/// Largest piece of a channel's recorded messages per upload message.
const UPLOAD_CHUNK: usize = 1 << 20;

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

    async fn connect(&self) -> Result<Channel, String> {
        Endpoint::from_shared(format!("http://{}", self.address))
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(3))
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(32 << 20)
            .connect()
            .await
            .map_err(|e| format!("cannot connect: {e}"))
    }

    /// One session; `Ok` only on shutdown.
    async fn session(&mut self, shutdown: &CancellationToken) -> Result<(), String> {
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
        tx.send(first).await.map_err(|_| "session closed")?;
        let mut commands = client
            .node_session(ReceiverStream::new(rx))
            .await
            .map_err(|s| format!("refused: {}", s.message()))?
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
                // The coordinator names the epoch this node is to be in: the cluster's for a
                // new daemon, its own while it still has a restore to apply.
                if m.epoch != *self.shared.epoch.borrow() {
                    let adopt = LoopMsg::AdoptEpoch { epoch: m.epoch };
                    self.loop_tx
                        .send(adopt)
                        .await
                        .map_err(|_| "node stopping")?;
                }
                // A membership this daemon cannot follow ends the session: the coordinator
                // sees it go, and the daemon tries again later.
                self.wirer.apply(&m).await?;
            }
            Ok(other) => return Err(format!("expected Registered, got {other:?}")),
            Err(s) => return Err(format!("refused: {}", s.message())),
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
                    tx.send(beat).await.map_err(|_| "session closed")?;
                }
                command = commands.message() => match command {
                    Ok(Some(pb::CoordinatorToNode { kind: Some(kind) })) => self.command(kind, &tx, &client).await?,
                    Ok(Some(_)) => {}
                    Ok(None) => return Err("the coordinator closed the session".into()),
                    Err(s) => return Err(s.message().to_owned()),
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
    ) -> Result<(), String> {
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
    ) -> Result<(), String> {
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
                return tx.send(message).await.map_err(|_| "session closed".into());
            }
            NodeEvent::RestoreFailed {
                restore_id,
                message,
            } => {
                return tx
                    .send(restore_failed(restore_id, message))
                    .await
                    .map_err(|_| "session closed".into());
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
                let id = part.snapshot_id;
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
        tx.send(event)
            .await
            .map_err(|_| "session closed".to_owned())
    }

    /// The upload of snapshot `id`'s part, started at its first piece.
    fn upload(
        &mut self,
        id: u64,
        session: &mpsc::Sender<pb::NodeToCoordinator>,
        client: &pb::coordinator_client::CoordinatorClient<Channel>,
    ) -> &mpsc::UnboundedSender<UploadItem> {
        self.uploads.entry(id).or_insert_with(|| {
            let (items, rx) = mpsc::unbounded_channel();
            let header = pb::UploadHeader {
                snapshot_id: id,
                node_id: self.shared.node_id.to_string(),
                incarnation: self.shared.incarnation,
                epoch: *self.shared.epoch.borrow(),
                applied_restore_id: self.applied_restore.clone(),
            };
            tokio::spawn(upload(client.clone(), header, rx, session.clone()));
            items
        })
    }
}

/// What goes into a part's upload, in order.
pub(crate) enum UploadItem {
    /// The next piece of the state.
    State(StateChunk),
    /// The part is complete: its channel states and cut close the upload.
    Finish(Box<pb::LocalSnapshot>),
}

/// Streams one part to the coordinator as its pieces come. The stream holds a few pieces at
/// most; each piece gives its upload room back once it is in the stream. If the items end
/// without `Finish`, the snapshot failed here and the upload is dropped quietly; if the
/// coordinator refuses or fails the upload, the snapshot is reported failed (storage).
async fn upload(
    mut client: pb::coordinator_client::CoordinatorClient<Channel>,
    header: pb::UploadHeader,
    mut items: mpsc::UnboundedReceiver<UploadItem>,
    session: mpsc::Sender<pb::NodeToCoordinator>,
) {
    use pb::upload_chunk::Kind;
    let (id, node) = (header.snapshot_id, header.node_id.clone());
    let (tx, rx) = mpsc::channel(4);
    let message = |kind| pb::UploadChunk { kind: Some(kind) };
    let _ = tx.send(message(Kind::Header(header))).await;
    let call =
        tokio::spawn(async move { client.upload_snapshot_part(ReceiverStream::new(rx)).await });
    let mut aborted = true;
    'items: while let Some(item) = items.recv().await {
        match item {
            UploadItem::State(StateChunk { bytes, room }) => {
                if tx.send(message(Kind::LocalState(bytes))).await.is_err() {
                    aborted = false; // the call ended: its result says why
                    break;
                }
                drop(room); // in the stream: room for the next piece
            }
            UploadItem::Finish(part) => {
                aborted = false;
                for piece in channel_pieces(part.channel_states) {
                    if tx.send(message(Kind::ChannelState(piece))).await.is_err() {
                        break 'items;
                    }
                }
                let cut = pb::UploadCut {
                    incoming: part.incoming,
                    outgoing: part.outgoing,
                };
                let _ = tx.send(message(Kind::Cut(cut))).await;
                break;
            }
        }
    }
    drop(tx);
    let result = call.await;
    if aborted {
        return;
    }
    let why = match result {
        Ok(Ok(r)) => {
            let r = r.into_inner();
            tracing::debug!(
                snapshot = id,
                new = r.bytes_new,
                reused = r.bytes_reused,
                "part uploaded"
            );
            return;
        }
        Ok(Err(s)) => s.message().to_owned(),
        Err(e) => e.to_string(),
    };
    tracing::warn!(snapshot = id, %node, "upload failed: {why}");
    // Tell the coordinator now rather than let the snapshot time out.
    let reason = pb::FailureReason::from(&FailureReason::Storage(format!(
        "upload of {node}'s part failed: {why}"
    )));
    let event = pb::NodeSnapshotEvent {
        snapshot_id: id,
        kind: Some(pb::node_snapshot_event::Kind::Failed(reason)),
    };
    let message = pb::NodeToCoordinator {
        kind: Some(pb::node_to_coordinator::Kind::Snapshot(event)),
    };
    let _ = session.send(message).await;
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

/// Fetches this node's share of a restore from the coordinator and hands it to the loop;
/// a failure is reported to the coordinator, which fails the restore naming this node.
async fn fetch_and_restore(
    mut client: pb::coordinator_client::CoordinatorClient<Channel>,
    restore: pb::NodeRestore,
    node: String,
    loop_tx: mpsc::Sender<LoopMsg>,
    session: mpsc::Sender<pb::NodeToCoordinator>,
) {
    let result = async {
        let request = pb::FetchRestorePartRequest {
            snapshot_id: restore.snapshot_id,
            node_id: node,
        };
        let mut pieces = client
            .fetch_restore_part(request)
            .await
            .map_err(|s| s.message().to_owned())?
            .into_inner();
        let mut data = RestoreData {
            restore_id: restore.restore_id.clone(),
            snapshot_id: restore.snapshot_id,
            epoch: restore.epoch,
            state: Vec::new(),
            incoming: Default::default(),
            outgoing: Default::default(),
        };
        let mut complete = false;
        while let Some(piece) = pieces.message().await.map_err(|s| s.message().to_owned())? {
            use pb::restore_piece::Kind;
            match piece.kind {
                Some(Kind::LocalState(bytes)) => data.state.push(bytes),
                Some(Kind::ChannelState(state)) => {
                    let channel =
                        channel_from_pb(state.channel.as_ref()).map_err(|e| e.to_string())?;
                    data.incoming
                        .entry(channel)
                        .or_default()
                        .extend(state.messages.into_iter().map(|m| m.payload));
                }
                Some(Kind::Counts(counts)) => {
                    for c in counts.outgoing {
                        let channel =
                            channel_from_pb(c.channel.as_ref()).map_err(|e| e.to_string())?;
                        data.outgoing.insert(channel, c.messages);
                    }
                    complete = true;
                }
                None => {}
            }
        }
        if !complete {
            return Err("the coordinator's stream ended before the replay counts".to_owned());
        }
        Ok::<_, String>(data)
    }
    .await;
    match result {
        Ok(data) => {
            let _ = loop_tx.send(LoopMsg::Restore(Box::new(data))).await;
        }
        Err(why) => {
            tracing::error!(restore = %restore.restore_id, "cannot fetch this node's share of the restore: {why}");
            let message = format!("cannot fetch the recorded state: {why}");
            let _ = session
                .send(restore_failed(restore.restore_id, message))
                .await;
        }
    }
}

/// Each channel's recorded messages in pieces of at most about `UPLOAD_CHUNK` bytes.
fn channel_pieces(states: Vec<pb::ChannelState>) -> Vec<pb::ChannelState> {
    let mut pieces = Vec::new();
    for state in states {
        let mut piece = pb::ChannelState {
            channel: state.channel.clone(),
            messages: Vec::new(),
        };
        let mut size = 0;
        for message in state.messages {
            size += message.payload.len() + 16;
            piece.messages.push(message);
            if size >= UPLOAD_CHUNK {
                let empty = pb::ChannelState {
                    channel: state.channel.clone(),
                    messages: Vec::new(),
                };
                pieces.push(std::mem::replace(&mut piece, empty));
                size = 0;
            }
        }
        if !piece.messages.is_empty() {
            pieces.push(piece);
        }
    }
    pieces
}
