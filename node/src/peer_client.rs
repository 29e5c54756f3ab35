//! The sending end of one peer channel: a task that keeps a stream open to the peer,
//! pulls frames from the node loop, numbers them, keeps them until acknowledged, and after
//! a broken connection reconnects (exponential backoff with jitter) and resends what the
//! peer does not have. A peer that comes back with a new incarnation lost everything
//! unacknowledged: the node loop resets the channel and queues it again.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use cairn_core::ChannelId;
use cairn_rpc::v1 as pb;
use rand::Rng;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::node_loop::{LoopMsg, OutFrame, Pulled};
use crate::shared::{ChannelHandles, Shared};
mod batches;
use batches::batches;

/// Most frames asked of the node loop at once.
const PULL_MAX: usize = 1024;

/// Settings of the sending side.
#[derive(Debug, Clone)]
pub(crate) struct LinkConfig {
    pub reconnect_initial: Duration,
    pub reconnect_max: Duration,
    /// Most unacknowledged frames.
    pub window: usize,
}

pub(crate) struct Link {
    pub shared: Arc<Shared>,
    pub loop_tx: mpsc::Sender<LoopMsg>,
    pub channel: ChannelId,
    pub config: LinkConfig,
    pub handles: Arc<ChannelHandles>,
}

struct State {
    next_seq: u64,
    unacked: VecDeque<(u64, OutFrame)>,
    peer_incarnation: Option<u64>,
    pull: Option<oneshot::Receiver<Pulled>>,
    /// The epoch of the frames held and of the stream.
    epoch: u64,
}

enum Ended {
    Shutdown,
    /// The connection failed or broke; the reason is logged.
    Broken(String),
    /// The peer is in another epoch (one of the two has not restored yet): try again soon.
    OtherEpoch(String),
    /// This node entered a new epoch: reconnect in it at once.
    NewEpoch,
}

impl Link {
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        let mut state = State {
            next_seq: 1,
            unacked: VecDeque::new(),
            peer_incarnation: None,
            pull: None,
            epoch: *self.shared.epoch.borrow(),
        };
        let mut delay = self.config.reconnect_initial;
        loop {
            match self.session(&mut state, &shutdown).await {
                Ended::Shutdown => {
                    self.removed(&mut state);
                    return;
                }
                Ended::Broken(why) => {
                    tracing::debug!(channel = %self.channel, %why, "channel down; reconnecting");
                }
                Ended::NewEpoch => {
                    self.handles.stats.connected.store(false, Relaxed);
                    delay = self.config.reconnect_initial;
                    continue;
                }
                Ended::OtherEpoch(why) => {
                    tracing::debug!(channel = %self.channel, %why, "waiting for the peer's epoch");
                    self.handles.stats.connected.store(false, Relaxed);
                    delay = self.config.reconnect_initial;
                }
            }
            if self.handles.stats.connected.swap(false, Relaxed) {
                delay = self.config.reconnect_initial;
            }
            let jitter = rand::rng().random_range(0.5..1.5);
            tokio::select! {
                _ = shutdown.cancelled() => {
                    self.removed(&mut state);
                    return;
                }
                _ = tokio::time::sleep(delay.mul_f64(jitter)) => {}
            }
            delay = (delay * 2).min(self.config.reconnect_max);
        }
    }

    /// The task stopped: if because its peer was removed, what the peer never acknowledged
    /// is dropped, and counted.
    fn removed(&self, state: &mut State) {
        if self.shared.channel(&self.channel).is_some() {
            return; // the daemon is stopping
        }
        // Frames a pull made before the stream broke wait in its answer.
        let pulled = state
            .pull
            .take()
            .and_then(|mut pull| pull.try_recv().ok())
            .map_or(0, |p| {
                p.frames
                    .iter()
                    .filter(|f| matches!(f, OutFrame::Data(_)))
                    .count()
            });
        let unacked = (state
            .unacked
            .iter()
            .filter(|(_, f)| matches!(f, OutFrame::Data(_)))
            .count()
            + pulled) as u64;
        self.shared.metrics.removed_peer_messages.inc_by(unacked);
        tracing::warn!(channel = %self.channel, unacked, "peer removed: messages it never acknowledged dropped");
    }

    /// Connects to the peer at its current address (it may have moved since the last try).
    async fn connect(&self) -> Result<Channel, String> {
        let address = self
            .shared
            .wiring()
            .addresses
            .get(&self.channel.to)
            .cloned()
            .ok_or_else(|| format!("no address for node {}", self.channel.to))?;
        // The peer's certificate must name the node dialed (SAN DNS:<node-id>), wherever its
        // address points: another node's certificate is refused.
        cairn_rpc::tls::endpoint_for(&address, self.channel.to.as_str(), self.shared.tls.as_ref())
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(32 << 20)
            .max_frame_size(cairn_rpc::limits::MAX_FRAME)
            .connect()
            .await
            .map_err(|e| format!("connect to {address}: {e}"))
    }

    /// Drops every frame held for the old epoch (its credits go back) and starts numbering
    /// again for `epoch`. A pull still waiting stays: its answer says its own epoch.
    fn enter_epoch(&self, state: &mut State, epoch: u64) {
        let data = state
            .unacked
            .drain(..)
            .filter(|(_, f)| matches!(f, OutFrame::Data(_)))
            .count();
        self.handles.release(data);
        state.next_seq = 1;
        state.epoch = epoch;
        // The channel starts over in the new epoch: the first peer met in it is not a
        // restart of the one before (that would reset the channel's counters again).
        state.peer_incarnation = None;
        self.handles.stats.unacked.store(0, Relaxed);
        tracing::debug!(channel = %self.channel, epoch, dropped = data, "new epoch");
    }

    /// One connection's life: handshake, resend, then send and acknowledge until it breaks.
    async fn session(&self, state: &mut State, shutdown: &CancellationToken) -> Ended {
        let mut epochs = self.shared.epoch.subscribe();
        let now = *epochs.borrow_and_update();
        if now > state.epoch {
            self.enter_epoch(state, now);
        }
        let channel = tokio::select! {
            _ = shutdown.cancelled() => return Ended::Shutdown,
            c = self.connect() => match c {
                Ok(c) => c,
                Err(e) => return Ended::Broken(e),
            },
        };
        let (tx, rx) = mpsc::channel::<pb::PeerFrame>(8);
        let handshake = pb::PeerFrame {
            kind: Some(pb::peer_frame::Kind::Handshake(pb::Handshake {
                cluster: self.shared.cluster.clone(),
                from: self.channel.from.to_string(),
                to: self.channel.to.to_string(),
                incarnation: self.shared.incarnation,
                epoch: state.epoch,
            })),
        };
        let _ = tx.send(handshake).await;
        let mut client = pb::peer_client::PeerClient::new(channel)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        let mut acks = match client.channel(ReceiverStream::new(rx)).await {
            Ok(response) => response.into_inner(),
            Err(status) => return self.refused(status),
        };
        let accepted = match acks.message().await {
            Ok(Some(pb::PeerAck {
                kind: Some(pb::peer_ack::Kind::Accepted(a)),
            })) => a,
            Ok(_) => return Ended::Broken("peer did not accept the handshake".into()),
            Err(status) => return self.refused(status),
        };
        // The node may have entered a newer epoch while the handshake was on its way: the
        // channel starts over there, and what this session would reset is of the old one.
        let now = *epochs.borrow_and_update();
        if now > state.epoch {
            self.enter_epoch(state, now);
            return Ended::NewEpoch;
        }
        let reconnect = state.peer_incarnation.is_some();
        if state
            .peer_incarnation
            .is_some_and(|i| i != accepted.incarnation)
        {
            tracing::warn!(channel = %self.channel, "peer restarted: resetting channel");
            let mut frames: Vec<OutFrame> = state.unacked.drain(..).map(|(_, f)| f).collect();
            // Frames the loop already handed over count as transmitted before the reset:
            // withdraw the pull, and take whatever it was answered with.
            if let Some(pull) = state.pull.take() {
                let cancel = LoopMsg::CancelPull {
                    channel: self.channel.clone(),
                    link: self.handles.clone(),
                };
                if self.loop_tx.send(cancel).await.is_err() {
                    return Ended::Shutdown;
                }
                if let Ok(pulled) = pull.await {
                    if pulled.epoch > state.epoch {
                        // The node moved on meanwhile: the old epoch's frames are void,
                        // the pulled ones count in the new epoch and are sent there.
                        self.give_back(&frames);
                        self.enter_epoch(state, pulled.epoch);
                        self.hold(state, pulled.frames);
                        return Ended::NewEpoch;
                    }
                    if pulled.epoch == state.epoch {
                        frames.extend(pulled.frames);
                    } else {
                        self.give_back(&pulled.frames);
                    }
                }
            }
            let mut requeue: Vec<Bytes> = Vec::new();
            let mut lost_markers = Vec::new();
            for frame in frames {
                match frame {
                    OutFrame::Data(p) => requeue.push(p),
                    OutFrame::Marker(plan) => lost_markers.push(plan.id),
                }
            }
            state.next_seq = 1;
            self.handles.stats.unacked.store(0, Relaxed);
            if self
                .loop_tx
                .send(LoopMsg::OutboundReset {
                    channel: self.channel.clone(),
                    link: self.handles.clone(),
                    epoch: state.epoch,
                    requeue,
                    lost_markers,
                })
                .await
                .is_err()
            {
                return Ended::Shutdown;
            }
        } else {
            self.acknowledge(state, accepted.acked_seq);
        }
        if state.peer_incarnation.is_some() {
            self.handles.stats.reconnects.fetch_add(1, Relaxed);
            self.shared.metrics.reconnects.inc();
        }
        state.peer_incarnation = Some(accepted.incarnation);
        // Credit-based flow control (a peer that grants none bounds nothing: the window of
        // unacknowledged frames does). Sent after any reset above: the loop starts the
        // channel's credits over there.
        let credited = accepted.credit_limit > 0;
        let mut credit = accepted.credit_limit;
        if !self
            .grant(state, if credited { credit } else { u64::MAX })
            .await
        {
            return Ended::Shutdown;
        }
        self.handles.stats.connected.store(true, Relaxed);
        // Resend what the peer does not have, in order.
        // The mutant drops the first data frame after a reconnect: one to resend, or else
        // the next one pulled.
        let mut mutant_drop =
            reconnect && crate::mutants::is(crate::mutants::Mutant::DropFrameOnReconnect);
        if mutant_drop
            && let Some(at) = state
                .unacked
                .iter()
                .position(|(_, f)| matches!(f, OutFrame::Data(_)))
        {
            state.unacked.remove(at);
            mutant_drop = false;
        }
        let resend: Vec<(u64, OutFrame)> = state.unacked.iter().cloned().collect();
        for batch in batches(resend, state.epoch) {
            if tx.send(batch).await.is_err() {
                return Ended::Broken("stream closed while resending".into());
            }
        }
        loop {
            // With credits a pull is always waiting (the loop answers within them, and a
            // marker at once); without, only while the window has room.
            if state.pull.is_none() && (credited || state.unacked.len() < self.config.window) {
                let (reply, rx) = oneshot::channel();
                let max = if credited {
                    PULL_MAX
                } else {
                    PULL_MAX.min(self.config.window - state.unacked.len())
                };
                let pull = LoopMsg::Pull {
                    channel: self.channel.clone(),
                    link: self.handles.clone(),
                    max,
                    reply,
                };
                if self.loop_tx.send(pull).await.is_err() {
                    return Ended::Shutdown;
                }
                state.pull = Some(rx);
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ended::Shutdown,
                _ = self.handles.faults.cut.notified() => return Ended::Broken("cut by fault injection".into()),
                changed = epochs.changed() => {
                    if changed.is_err() {
                        return Ended::Shutdown;
                    }
                    let epoch = *epochs.borrow_and_update();
                    if epoch > state.epoch {
                        self.enter_epoch(state, epoch);
                        return Ended::NewEpoch;
                    }
                }
                ack = acks.message() => match ack {
                    Ok(Some(pb::PeerAck { kind: Some(pb::peer_ack::Kind::Ack(ack)) })) => {
                        self.acknowledge(state, ack.seq);
                        if credited && ack.credit_limit > credit {
                            credit = ack.credit_limit;
                            if !self.grant(state, credit).await {
                                return Ended::Shutdown;
                            }
                        }
                    }
                    Ok(Some(_)) => return Ended::Broken("unexpected message from peer".into()),
                    Ok(None) => return Ended::Broken("peer closed the stream".into()),
                    Err(status) => return self.refused(status),
                },
                frames = async { state.pull.as_mut().expect("guarded").await }, if state.pull.is_some() => {
                    state.pull = None;
                    let Ok(Pulled { epoch, frames }) = frames else { return Ended::Shutdown };
                    if epoch < state.epoch {
                        // Pulled before the node left that epoch: void.
                        self.give_back(&frames);
                        continue;
                    }
                    let newer = epoch > state.epoch;
                    if newer {
                        self.enter_epoch(state, epoch);
                    }
                    let mut numbered = Vec::with_capacity(frames.len());
                    for frame in frames {
                        if mutant_drop && matches!(frame, OutFrame::Data(_)) {
                            mutant_drop = false;
                            continue;
                        }
                        numbered.push((state.next_seq, frame.clone()));
                        state.unacked.push_back((state.next_seq, frame));
                        state.next_seq += 1;
                    }
                    self.handles.stats.unacked.store(state.unacked.len() as u64, Relaxed);
                    if newer {
                        // Held, and sent once the stream is reopened in the new epoch.
                        return Ended::NewEpoch;
                    }
                    let delay = self.handles.faults.delay_ms.load(Relaxed);
                    if delay > 0 {
                        // Fault injection: every batch waits (frames keep their order).
                        tokio::time::sleep(Duration::from_millis(delay)).await;
                    }
                    for batch in batches(numbered, state.epoch) {
                        if tx.send(batch).await.is_err() {
                            return Ended::Broken("stream closed".into());
                        }
                    }
                }
            }
        }
    }

    /// Tells the loop how far the peer's credits reach. False: the loop is gone.
    async fn grant(&self, state: &State, limit: u64) -> bool {
        let credit = LoopMsg::Credit {
            channel: self.channel.clone(),
            link: self.handles.clone(),
            epoch: state.epoch,
            limit,
        };
        self.loop_tx.send(credit).await.is_ok()
    }

    /// Numbers frames pulled for a new epoch and keeps them until the stream reopens in it.
    fn hold(&self, state: &mut State, frames: Vec<OutFrame>) {
        for frame in frames {
            state.unacked.push_back((state.next_seq, frame));
            state.next_seq += 1;
        }
        self.handles
            .stats
            .unacked
            .store(state.unacked.len() as u64, Relaxed);
    }

    /// Returns the credits of frames that will never be sent.
    fn give_back(&self, frames: &[OutFrame]) {
        let data = frames
            .iter()
            .filter(|f| matches!(f, OutFrame::Data(_)))
            .count();
        self.handles.release(data);
    }

    fn refused(&self, status: tonic::Status) -> Ended {
        use tonic::Code;
        if status.code() == Code::Aborted {
            return Ended::OtherEpoch(status.message().to_owned());
        }
        if matches!(
            status.code(),
            Code::FailedPrecondition | Code::NotFound | Code::InvalidArgument
        ) {
            tracing::error!(channel = %self.channel, "peer refused the channel: {}", status.message());
        }
        Ended::Broken(status.to_string())
    }

    /// Forgets frames up to `seq` and returns their credits.
    fn acknowledge(&self, state: &mut State, seq: u64) {
        let mut data = 0;
        while state.unacked.front().is_some_and(|(s, _)| *s <= seq) {
            if let Some((_, OutFrame::Data(_))) = state.unacked.pop_front() {
                data += 1;
            }
        }
        if data > 0 {
            self.handles.release(data);
        }
        self.handles
            .stats
            .unacked
            .store(state.unacked.len() as u64, Relaxed);
    }
}
