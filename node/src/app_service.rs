//! `cairn.v1.App/Session`: the application's one stream to its daemon. Sends take a
//! credit of their outgoing channel, so a slow peer slows the application instead of
//! growing memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use cairn_core::{ChannelId, SnapshotId};
use cairn_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::convert::InvalidInput;
use crate::error::Error;
use crate::node_loop::{LoopMsg, Shared, StateChunk};

/// The `App` service.
pub(crate) struct AppService {
    pub shared: Arc<Shared>,
    pub loop_tx: mpsc::Sender<LoopMsg>,
    pub shutdown: CancellationToken,
    pub sessions: AtomicU64,
}

#[tonic::async_trait]
impl pb::app_server::App for AppService {
    type SessionStream = ReceiverStream<Result<pb::NodeToApp, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<pb::AppToNode>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = request.into_inner();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| invalid("the session ended before its Attach"))?;
        let Some(pb::app_to_node::Kind::Attach(attach)) = first.kind else {
            return Err(invalid("the first message of a session must be Attach").into());
        };
        let session = self.sessions.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, rx) = mpsc::channel(16);
        let (reply, attached) = oneshot::channel();
        self.loop_tx
            .send(LoopMsg::AppAttach {
                session,
                tx: tx.clone(),
                reply,
            })
            .await
            .map_err(|_| Error::ShuttingDown)?;
        attached.await.map_err(|_| Error::ShuttingDown)??;
        tracing::info!(session, application = %attach.application, "session opened");
        let reader = SessionReader {
            shared: self.shared.clone(),
            loop_tx: self.loop_tx.clone(),
            session,
        };
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            let result = reader.run(inbound, shutdown).await;
            if let Err(status) = result {
                tracing::warn!(session, "closing application session: {}", status.message());
                let _ = tx.send(Err(status)).await;
            }
            let _ = reader.loop_tx.send(LoopMsg::AppDetached { session }).await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

fn invalid(what: &str) -> Error {
    Error::InvalidInput(InvalidInput(what.to_owned()))
}

struct SessionReader {
    shared: Arc<Shared>,
    loop_tx: mpsc::Sender<LoopMsg>,
    session: u64,
}

impl SessionReader {
    async fn run(
        &self,
        mut inbound: Streaming<pb::AppToNode>,
        shutdown: CancellationToken,
    ) -> Result<(), Status> {
        use pb::app_to_node::Kind;
        loop {
            let message = tokio::select! {
                _ = shutdown.cancelled() => return Err(Error::ShuttingDown.into()),
                m = inbound.message() => m,
            };
            let kind = match message {
                Ok(Some(pb::AppToNode { kind: Some(kind) })) => kind,
                Ok(Some(_)) => return Err(invalid("empty message").into()),
                Ok(None) => return Ok(()),
                Err(status) => {
                    tracing::debug!(session = self.session, %status, "session stream broke");
                    return Ok(());
                }
            };
            match kind {
                Kind::Send(batch) => self.send(batch).await?,
                Kind::StateRecorded(state) => {
                    if state.snapshot_id == 0 {
                        return Err(invalid("StateRecorded for snapshot 0").into());
                    }
                    // Wait for upload room: a large state flows on to the coordinator as
                    // it arrives instead of piling up here.
                    let want = state.chunk.len().clamp(1, crate::UPLOAD_ROOM) as u32;
                    let room = self
                        .shared
                        .upload_room
                        .clone()
                        .acquire_many_owned(want)
                        .await
                        .map_err(|_| Error::ShuttingDown)?;
                    let chunk = StateChunk {
                        bytes: state.chunk,
                        room,
                    };
                    self.to_loop(LoopMsg::AppState {
                        session: self.session,
                        id: SnapshotId(state.snapshot_id),
                        chunk,
                        last: state.last,
                    })
                    .await?;
                }
                Kind::RestoreApplied(applied) => {
                    self.to_loop(LoopMsg::AppRestoreApplied {
                        session: self.session,
                        restore_id: applied.restore_id,
                    })
                    .await?;
                }
                Kind::Attach(_) => return Err(invalid("Attach sent twice").into()),
            }
        }
    }

    async fn to_loop(&self, msg: LoopMsg) -> Result<(), Status> {
        self.loop_tx
            .send(msg)
            .await
            .map_err(|_| Error::ShuttingDown.into())
    }

    /// Checks every message, then forwards them in order, taking one credit each; when a
    /// channel is full what is ready goes first and the session waits (backpressure).
    async fn send(&self, batch: pb::SendBatch) -> Result<(), Status> {
        let me = &self.shared.node_id;
        let wiring = self.shared.wiring();
        let mut checked = Vec::with_capacity(batch.messages.len());
        for message in batch.messages {
            let channel = ChannelId::new(me.clone(), message.to.as_str());
            if !wiring.channels.contains_key(&channel) {
                return Err(Error::Unknown(format!(
                    "node {me} has no channel to `{}`",
                    message.to
                ))
                .into());
            }
            if message.payload.len() > self.shared.max_payload {
                return Err(Error::PayloadTooLarge {
                    size: message.payload.len(),
                    limit: self.shared.max_payload,
                }
                .into());
            }
            checked.push((channel, message.payload));
        }
        let mut ready: Vec<(ChannelId, Bytes)> = Vec::with_capacity(checked.len());
        for (channel, payload) in checked {
            let credits = &wiring.channels[&channel].credits;
            match credits.try_acquire() {
                Ok(permit) => permit.forget(),
                Err(_) => {
                    if !ready.is_empty() {
                        let sends = std::mem::take(&mut ready);
                        self.to_loop(LoopMsg::AppSend {
                            session: self.session,
                            sends,
                        })
                        .await?;
                    }
                    credits
                        .acquire()
                        .await
                        .map_err(|_| Status::from(Error::ShuttingDown))?
                        .forget();
                }
            }
            ready.push((channel, payload));
        }
        if !ready.is_empty() {
            self.to_loop(LoopMsg::AppSend {
                session: self.session,
                sends: ready,
            })
            .await?;
        }
        Ok(())
    }
}
