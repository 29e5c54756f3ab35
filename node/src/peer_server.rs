//! The receiving end of the peer channels: `cairn.v1.Peer/Channel`. Each stream is one
//! directed channel; this side checks the handshake and every frame, takes credits for
//! the messages it forwards to the node loop (so a full buffer stops the reading, and
//! HTTP/2 flow control pushes back on the sender), and acknowledges cumulatively.

use std::sync::Arc;

use cairn_core::ChannelId;
use cairn_proto::runs;
use cairn_rpc::server::identity::{self, check_node};
use cairn_rpc::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::error::Error;

/// Markers a batch may hold beyond its data frames (one per snapshot under way, at most).
const MARKER_SLACK: usize = 1024;
use crate::node_loop::{InItem, LoopMsg};
use crate::shared::{ChannelHandles, Shared};

/// The `Peer` service.
pub(crate) struct PeerService {
    pub shared: Arc<Shared>,
    pub loop_tx: mpsc::Sender<LoopMsg>,
    pub shutdown: CancellationToken,
}

#[tonic::async_trait]
impl pb::peer_server::Peer for PeerService {
    type ChannelStream = ReceiverStream<Result<pb::PeerAck, Status>>;

    async fn channel(
        &self,
        request: Request<Streaming<pb::PeerFrame>>,
    ) -> Result<Response<Self::ChannelStream>, Status> {
        let peer = identity::Peer::of(&request);
        let mut frames = request.into_inner();
        let first = frames
            .message()
            .await?
            .ok_or_else(|| invalid("the stream ended before its handshake"))?;
        let Some(pb::peer_frame::Kind::Handshake(handshake)) = first.kind else {
            return Err(invalid("the first frame of a channel must be a handshake").into());
        };
        // With TLS, only node `from` may open a channel from it (the cluster of its
        // certificate was checked by the auth layer; the handshake's below).
        check_node(
            peer.as_ref(),
            &handshake.from,
            &format!("open a channel to {}", self.shared.node_id),
        )?;
        let (channel, handles) = self.check_handshake(&handshake)?;
        let (reply, opened) = oneshot::channel();
        self.loop_tx
            .send(LoopMsg::InboundOpened {
                channel: channel.clone(),
                incarnation: handshake.incarnation,
                epoch: handshake.epoch,
                reply,
            })
            .await
            .map_err(|_| Error::ShuttingDown)?;
        // The loop may have entered a new epoch since the check: refused as then.
        let acked = opened
            .await
            .map_err(|_| Error::ShuttingDown)?
            .ok_or_else(|| Error::EpochMismatch {
                channel: channel.clone(),
                ours: *self.shared.epoch.borrow(),
                theirs: handshake.epoch,
            })?;
        tracing::debug!(%channel, incarnation = handshake.incarnation, acked, "channel opened");
        let (tx, rx) = mpsc::channel(64);
        // Read after the loop took the stream in: a reset there restarted the credits.
        let mut grants = handles.grant.subscribe();
        let granted = *grants.borrow_and_update();
        let accepted = pb::PeerAck {
            kind: Some(pb::peer_ack::Kind::Accepted(pb::HandshakeAccepted {
                incarnation: self.shared.incarnation,
                acked_seq: acked,
                credit_limit: granted,
            })),
        };
        tx.send(Ok(accepted))
            .await
            .map_err(|_| Error::ShuttingDown)?;
        let reader = Reader {
            shared: self.shared.clone(),
            loop_tx: self.loop_tx.clone(),
            channel,
            handles,
            incarnation: handshake.incarnation,
            epoch: handshake.epoch,
            expected: acked + 1,
            granted,
            grants,
        };
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            if let Err(status) = reader.run(frames, &tx, shutdown).await {
                tracing::warn!("closing channel stream: {}", status.message());
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

fn invalid(what: &str) -> Error {
    Error::Malformed(what.to_owned())
}

impl PeerService {
    fn check_handshake(
        &self,
        handshake: &pb::Handshake,
    ) -> Result<(ChannelId, Arc<ChannelHandles>), Error> {
        if handshake.cluster != self.shared.cluster {
            return Err(Error::WrongCluster {
                ours: self.shared.cluster.clone(),
                theirs: handshake.cluster.clone(),
            });
        }
        if handshake.to != self.shared.node_id.as_str() {
            return Err(Error::Unknown(format!(
                "this is node {}, not {}",
                self.shared.node_id, handshake.to
            )));
        }
        let channel = ChannelId::new(handshake.from.as_str(), handshake.to.as_str());
        let Some(handles) = self.shared.channel(&channel) else {
            return Err(Error::Unknown(format!(
                "no channel {channel} in the topology (is {} a member?)",
                handshake.from
            )));
        };
        if handshake.incarnation == 0 {
            return Err(invalid("handshake incarnation must not be 0"));
        }
        let admitted = self
            .shared
            .wiring()
            .incarnations
            .get(&channel.from)
            .copied();
        if let Some(admitted) = admitted
            && admitted != handshake.incarnation
        {
            return Err(Error::NotAdmitted {
                node: channel.from.clone(),
                channel,
                claimed: handshake.incarnation,
                admitted,
            });
        }
        let ours = *self.shared.epoch.borrow();
        if handshake.epoch != ours {
            return Err(Error::EpochMismatch {
                channel,
                ours,
                theirs: handshake.epoch,
            });
        }
        Ok((channel, handles))
    }
}

struct Reader {
    shared: Arc<Shared>,
    loop_tx: mpsc::Sender<LoopMsg>,
    channel: ChannelId,
    handles: Arc<ChannelHandles>,
    incarnation: u64,
    epoch: u64,
    /// The next sequence number this stream has not forwarded yet.
    expected: u64,
    /// The credit limit last sent on this stream.
    granted: u64,
    /// The channel's grant, as the node loop raises it.
    grants: tokio::sync::watch::Receiver<u64>,
}

impl Reader {
    async fn run(
        mut self,
        mut frames: Streaming<pb::PeerFrame>,
        tx: &mpsc::Sender<Result<pb::PeerAck, Status>>,
        shutdown: CancellationToken,
    ) -> Result<(), Status> {
        loop {
            let cut = &self.handles.faults.cut;
            let frame = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = cut.notified() => return Err(Status::unavailable(format!("{}: cut by fault injection", self.channel))),
                // Messages were delivered: the sender may send more (credits).
                changed = self.grants.changed() => {
                    if changed.is_err() {
                        return Ok(()); // the channel is gone
                    }
                    if !self.ack(tx).await {
                        return Ok(());
                    }
                    continue;
                }
                frame = frames.message() => frame,
            };
            let batch = match frame {
                Ok(Some(pb::PeerFrame {
                    kind: Some(pb::peer_frame::Kind::Batch(batch)),
                })) => batch,
                Ok(Some(_)) => {
                    return Err(self.fail(invalid("expected a frame batch after the handshake")));
                }
                Ok(None) => return Ok(()),
                // A frame over the limit (or one that stalled): the sender learns why.
                Err(status) if status.code() == tonic::Code::ResourceExhausted => {
                    return Err(Status::resource_exhausted(format!(
                        "{}: {}",
                        self.channel,
                        status.message()
                    )));
                }
                Err(status) => {
                    tracing::debug!(channel = %self.channel, %status, "channel stream broke");
                    return Ok(());
                }
            };
            if batch.first_seq == 0 || batch.first_seq > self.expected {
                return Err(self.fail(Error::OutOfSequence {
                    channel: self.channel.clone(),
                    expected: self.expected,
                    got: batch.first_seq,
                }));
            }
            let items = self.decode(&batch).map_err(|e| self.fail(e))?;
            if items.is_empty() {
                continue;
            }
            // Frames before `expected` were forwarded already (a resend after reconnect).
            let skip = (self.expected - batch.first_seq) as usize;
            let fresh: Vec<InItem> = items.into_iter().skip(skip).collect();
            self.forward(fresh).await?;
            if !self.ack(tx).await {
                return Ok(());
            }
        }
    }

    /// Acknowledges every frame forwarded and passes on the current credit limit (never
    /// lower than one sent before on this stream). False: the stream is gone.
    async fn ack(&mut self, tx: &mpsc::Sender<Result<pb::PeerAck, Status>>) -> bool {
        self.granted = self.granted.max(*self.grants.borrow_and_update());
        let ack = pb::PeerAck {
            kind: Some(pb::peer_ack::Kind::Ack(pb::Ack {
                seq: self.expected - 1,
                credit_limit: self.granted,
            })),
        };
        tx.send(Ok(ack)).await.is_ok()
    }

    fn fail(&self, error: Error) -> Status {
        let status: Status = error.into();
        Status::new(
            status.code(),
            format!("{}: {}", self.channel, status.message()),
        )
    }

    fn decode(&self, batch: &pb::FrameBatch) -> Result<Vec<InItem>, Error> {
        // Counted before anything is built: a 4 MiB batch of empty payloads would otherwise
        // become millions of items. A peer sends at most its unacknowledged frames in one
        // batch: its window, or the credits this daemon granted (its channel buffer), and a
        // few markers.
        let limit = self.shared.channel_buffer.max(crate::LINK_WINDOW) + MARKER_SLACK;
        let frames = batch
            .frames
            .iter()
            .fold(0usize, |n, frame| match &frame.kind {
                Some(pb::frame::Kind::Data(run)) => n.saturating_add(run.lengths.len()),
                _ => n.saturating_add(1),
            });
        if frames > limit {
            return Err(invalid(&format!(
                "a batch of {frames} frames: a peer sends at most {limit} at once"
            )));
        }
        let mut items = Vec::with_capacity(frames);
        for frame in &batch.frames {
            match &frame.kind {
                Some(pb::frame::Kind::Data(run)) => {
                    let payloads =
                        runs::split(&run.payloads, &run.lengths, self.shared.max_payload).map_err(
                            |e| match e {
                                runs::RunError::TooLarge { size, limit } => {
                                    Error::PayloadTooLarge { size, limit }
                                }
                                e => invalid(&format!("data run: {e}")),
                            },
                        )?;
                    items.extend(payloads.map(InItem::Data));
                }
                Some(pb::frame::Kind::Marker(marker)) => {
                    let plan = marker
                        .plan
                        .as_ref()
                        .ok_or_else(|| invalid("marker without a plan"))?;
                    items.push(InItem::Marker(cairn_core::Plan::try_from(plan)?));
                }
                None => return Err(invalid("frame with neither data nor marker")),
            }
        }
        Ok(items)
    }

    /// Forwards items in order, taking one credit per message. When the channel's buffer
    /// is full, what is ready goes first, then the reader waits for credits — and stops
    /// reading the stream meanwhile.
    async fn forward(&mut self, items: Vec<InItem>) -> Result<(), Status> {
        let handles = self.handles.clone();
        let credits = &handles.credits;
        let mut ready = Vec::with_capacity(items.len());
        for item in items {
            if let InItem::Data(_) = item {
                match credits.try_acquire() {
                    Ok(permit) => permit.forget(),
                    Err(_) => {
                        self.send(std::mem::take(&mut ready)).await?;
                        credits
                            .acquire()
                            .await
                            .map_err(|_| Status::from(Error::ShuttingDown))?
                            .forget();
                    }
                }
            }
            ready.push(item);
        }
        self.send(ready).await
    }

    async fn send(&mut self, items: Vec<InItem>) -> Result<(), Status> {
        if items.is_empty() {
            return Ok(());
        }
        let n = items.len() as u64;
        let (kept, answer) = oneshot::channel();
        self.loop_tx
            .send(LoopMsg::InboundFrames {
                channel: self.channel.clone(),
                incarnation: self.incarnation,
                epoch: self.epoch,
                first_seq: self.expected,
                items,
                kept,
            })
            .await
            .map_err(|_| Status::from(Error::ShuttingDown))?;
        // Acknowledged only once the loop has kept them: never a frame it dropped.
        if !answer
            .await
            .map_err(|_| Status::from(Error::ShuttingDown))?
        {
            return Err(Status::aborted(format!(
                "{}: this stream (incarnation {}, epoch {}) was replaced by another \
                 incarnation or epoch, or its sender was removed from the cluster; its frames \
                 were not kept and are not acknowledged",
                self.channel, self.incarnation, self.epoch
            )));
        }
        self.expected += n;
        Ok(())
    }
}
