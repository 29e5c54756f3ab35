//! `cairn.v1.App/Session`: the application's one stream to its daemon. Sends take a
//! credit of their outgoing channel, so a slow peer slows the application instead of
//! growing memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use cairn_core::{ChannelId, SnapshotId};
use cairn_rpc::server::identity::{Peer, check_node};
use cairn_rpc::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::error::Error;
use crate::node_loop::{LoopMsg, RecordsDue};
use crate::shared::{ChannelHandles, Shared, StateChunk, UPLOAD_ROOM};

/// The `App` service.
pub(crate) struct AppService {
    pub shared: Arc<Shared>,
    pub loop_tx: mpsc::Sender<LoopMsg>,
    pub shutdown: CancellationToken,
    pub sessions: AtomicU64,
    /// The sessions attaching or attached, and what their flow-control streams tell the
    /// application (a refused attach removes its own entry only).
    pub sessions_taken: Arc<std::sync::Mutex<std::collections::BTreeMap<u64, Arc<SendsTaken>>>>,
}

/// How many of the application's sends a session has taken off its stream, for the
/// session's `Consumed` stream to pass on (the application keeps a window of sends not
/// taken yet).
#[derive(Debug, Default)]
pub(crate) struct SendsTaken {
    messages: AtomicU64,
    changed: tokio::sync::Notify,
    /// The session ended.
    ended: CancellationToken,
    /// The session attached with `acknowledges_deliveries`: it may open its `Consumed`
    /// stream...
    acknowledges: bool,
    /// ...once...
    flow_opened: std::sync::atomic::AtomicBool,
    /// ...presenting this key (`Attached.flow_key`).
    flow_key: u64,
}

/// A session's entry in `sessions_taken`: removed, and the session marked ended, when this
/// drops.
struct Registered {
    sessions: Arc<std::sync::Mutex<std::collections::BTreeMap<u64, Arc<SendsTaken>>>>,
    session: u64,
    taken: Arc<SendsTaken>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.taken.ended.cancel();
        self.sessions
            .lock()
            .expect("never poisoned")
            .remove(&self.session);
    }
}

impl SendsTaken {
    fn took(&self, n: u64) {
        self.messages.fetch_add(n, Ordering::AcqRel);
        self.changed.notify_one();
    }
}

#[tonic::async_trait]
impl pb::app_server::App for AppService {
    type SessionStream = ReceiverStream<Result<pb::NodeToApp, Status>>;
    type ConsumedStream = ReceiverStream<Result<pb::Taken, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<pb::AppToNode>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        // With TLS, the application presents its node's certificate: it is part of the
        // node, and sends and receives as it.
        let peer = Peer::of(&request);
        check_node(
            peer.as_ref(),
            self.shared.node_id.as_str(),
            "attach an application",
        )?;
        let mut inbound = request.into_inner();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| invalid("the session ended before its Attach"))?;
        let Some(pb::app_to_node::Kind::Attach(attach)) = first.kind else {
            return Err(invalid("the first message of a session must be Attach").into());
        };
        let session = self.sessions.fetch_add(1, Ordering::Relaxed) + 1;
        let taken = Arc::new(SendsTaken {
            acknowledges: attach.acknowledges_deliveries,
            // Never 0 (what a client that knows no key sends).
            flow_key: rand::random::<u64>().max(1),
            ..SendsTaken::default()
        });
        // Registered before the loop answers `Attached`: the application opens its
        // `Consumed` stream as soon as it has that answer. Unregistered (and ended) when
        // this guard drops, however the session ends — a handler cancelled half-way too.
        self.sessions_taken
            .lock()
            .expect("never poisoned")
            .insert(session, taken.clone());
        let registered = Registered {
            sessions: self.sessions_taken.clone(),
            session,
            taken: taken.clone(),
        };
        // Few batches wait here: what is handed to the application can no longer be
        // overtaken by an unaligned snapshot's record request.
        let (tx, rx) = mpsc::channel(2);
        let (reply, attached) = oneshot::channel();
        let records = Arc::new(RecordsDue::default());
        let asked = self
            .loop_tx
            .send(LoopMsg::AppAttach {
                session,
                packed: attach.packed_deliveries,
                flow_key: taken.flow_key,
                tx: tx.clone(),
                records: records.clone(),
                reply,
            })
            .await;
        let answer = match asked {
            Ok(()) => attached.await.map_err(|_| Error::ShuttingDown),
            Err(_) => Err(Error::ShuttingDown),
        };
        if let Err(e) | Ok(Err(e)) = answer {
            return Err(e.into()); // `registered` drops: unregistered
        }
        tracing::info!(session, application = %attach.application, "session opened");
        let reader = SessionReader {
            shared: self.shared.clone(),
            loop_tx: self.loop_tx.clone(),
            session,
            records,
            read_ahead: AtomicU64::new(0),
            taken,
        };
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            let result = reader.run(inbound, shutdown).await;
            drop(registered);
            if let Err(status) = result {
                tracing::warn!(session, "closing application session: {}", status.message());
                let _ = tx.send(Err(status)).await;
            }
            let _ = reader.loop_tx.send(LoopMsg::AppDetached { session }).await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn consumed(
        &self,
        request: Request<Streaming<pb::Consumption>>,
    ) -> Result<Response<Self::ConsumedStream>, Status> {
        let peer = Peer::of(&request);
        check_node(
            peer.as_ref(),
            self.shared.node_id.as_str(),
            "acknowledge deliveries",
        )?;
        let mut inbound = request.into_inner();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| invalid("the Consumed stream ended before naming its session"))?;
        let session = first.session;
        let Some(taken) = self
            .sessions_taken
            .lock()
            .expect("never poisoned")
            .get(&session)
            .cloned()
        else {
            return Err(Status::not_found(format!(
                "no application session {session} on node {}",
                self.shared.node_id
            )));
        };
        // The key the daemon gave the session's application in `Attached`: only that
        // application may acknowledge in the session's name (ids are sequential).
        if first.flow_key != taken.flow_key {
            return Err(Status::permission_denied(format!(
                "the Consumed stream of application session {session} must present the \
                 session's flow_key (from its Attached)"
            )));
        }
        if !taken.acknowledges {
            return Err(Status::failed_precondition(format!(
                "application session {session} attached without acknowledges_deliveries: \
                 it has no Consumed stream"
            )));
        }
        if taken.flow_opened.swap(true, Ordering::AcqRel) {
            return Err(Status::already_exists(format!(
                "application session {session} already opened its Consumed stream"
            )));
        }
        // The window applies while this stream is open, and only then: counts that cannot
        // come never hold deliveries back. On before the answer, so that the application
        // knows it is in force when its stream opens.
        let on = LoopMsg::AppWindow { session, on: true };
        self.loop_tx
            .send(on)
            .await
            .map_err(|_| Status::from(Error::ShuttingDown))?;
        let (tx, rx) = mpsc::channel(4);
        let loop_tx = self.loop_tx.clone();
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            flow(first, session, inbound, taken, tx, &loop_tx, shutdown).await;
            let _ = loop_tx
                .send(LoopMsg::AppWindow { session, on: false })
                .await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A session's flow-control stream: consumed counts to the loop, taken counts back.
async fn flow(
    first: pb::Consumption,
    session: u64,
    mut inbound: Streaming<pb::Consumption>,
    taken: Arc<SendsTaken>,
    tx: mpsc::Sender<Result<pb::Taken, Status>>,
    loop_tx: &mpsc::Sender<LoopMsg>,
    shutdown: CancellationToken,
) {
    let mut consumption = Some(first);
    let mut told = 0;
    loop {
        if let Some(c) = consumption.take() {
            if c.session != session {
                let bad = invalid("a Consumed stream names one session");
                let _ = tx.send(Err(bad.into())).await;
                return;
            }
            let consumed = LoopMsg::AppConsumed {
                session,
                messages: c.messages,
                bytes: c.bytes,
            };
            if loop_tx.send(consumed).await.is_err() {
                return;
            }
        }
        let now = taken.messages.load(Ordering::Acquire);
        if now != told {
            told = now;
            // An application that stops reading its counts holds only this stream up,
            // never past its session's end or the daemon's shutdown.
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = taken.ended.cancelled() => return,
                sent = tx.send(Ok(pb::Taken { messages: now })) => if sent.is_err() { return },
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = taken.ended.cancelled() => return,
            _ = taken.changed.notified() => {}
            m = inbound.message() => match m {
                Ok(Some(c)) => consumption = Some(c),
                Ok(None) | Err(_) => return,
            },
        }
    }
}

fn invalid(what: &str) -> Error {
    Error::Malformed(what.to_owned())
}

/// Most messages a session reads ahead of a full channel, without credits, while a recorded
/// state is due (so the state, and the cut, are not held up behind a slow peer).
const READ_AHEAD_MAX: u64 = 1 << 16;

struct SessionReader {
    /// Record requests handed to the application and not answered yet.
    records: Arc<RecordsDue>,
    /// Messages taken in without a credit since the last answer.
    read_ahead: AtomicU64,
    shared: Arc<Shared>,
    loop_tx: mpsc::Sender<LoopMsg>,
    session: u64,
    /// Sends taken off the stream, for the application's window.
    taken: Arc<SendsTaken>,
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
                Kind::Send(batch) => {
                    let n = batch.messages.len() as u64
                        + batch
                            .runs
                            .iter()
                            .map(|r| r.lengths.len() as u64)
                            .sum::<u64>();
                    self.send(batch).await?;
                    self.taken.took(n);
                }
                Kind::StateRecorded(state) => {
                    if state.snapshot_id == 0 {
                        return Err(invalid("StateRecorded for snapshot 0").into());
                    }
                    // Wait for upload room: a large state flows on to the coordinator as
                    // it arrives instead of piling up here.
                    let want = state.chunk.len().clamp(1, UPLOAD_ROOM) as u32;
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
                    let last = state.last;
                    self.to_loop(LoopMsg::AppState {
                        session: self.session,
                        id: SnapshotId(state.snapshot_id),
                        chunk,
                        last,
                    })
                    .await?;
                    if last {
                        let _ = self.records.pending.fetch_update(
                            Ordering::AcqRel,
                            Ordering::Acquire,
                            |n| Some(n.saturating_sub(1)),
                        );
                        if self.records.pending.load(Ordering::Acquire) == 0 {
                            self.read_ahead.store(0, Ordering::Relaxed);
                        }
                    }
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

    /// Whether a recorded state is due and the read-ahead has room.
    fn may_read_ahead(&self) -> bool {
        self.records.pending.load(Ordering::Acquire) > 0
            && self.read_ahead.load(Ordering::Relaxed) < READ_AHEAD_MAX
    }

    /// Takes a message in on credit: the channel's credits pay it back.
    fn on_credit(&self, handles: &ChannelHandles) {
        handles.debt.fetch_add(1, Ordering::AcqRel);
        self.read_ahead.fetch_add(1, Ordering::Relaxed);
    }

    async fn to_loop(&self, msg: LoopMsg) -> Result<(), Status> {
        self.loop_tx
            .send(msg)
            .await
            .map_err(|_| Error::ShuttingDown.into())
    }

    /// Checks every message, then forwards them in order, taking one credit each; when a
    /// channel is full what is ready goes first and the session waits (backpressure) —
    /// unless the application owes a recorded state: then the session reads ahead (up to
    /// `READ_AHEAD_MAX` messages), queueing what it reads on credit, so that the state
    /// behind these sends reaches the loop without waiting for a slow peer. The messages
    /// are queued all the same, before the state, and an unaligned snapshot records them.
    async fn send(&self, batch: pb::SendBatch) -> Result<(), Status> {
        let me = &self.shared.node_id;
        let wiring = self.shared.wiring();
        if !batch.messages.is_empty() && !batch.runs.is_empty() {
            return Err(invalid("a SendBatch carries messages or runs, not both").into());
        }
        // Every message as (destination, payload); a run's payloads are slices of its blob.
        let mut entries: Vec<(&str, Bytes)> = Vec::new();
        for message in &batch.messages {
            entries.push((message.to.as_str(), message.payload.clone()));
        }
        for run in &batch.runs {
            // Each payload's size is checked below, with the message's.
            let payloads = cairn_proto::runs::split(&run.payloads, &run.lengths, usize::MAX)
                .map_err(|e| invalid(&e.to_string()))?;
            entries.extend(payloads.map(|p| (run.to.as_str(), p)));
        }
        let mut checked = Vec::with_capacity(entries.len());
        // The channels this batch names, built once each (a batch names few peers).
        let mut named: Vec<ChannelId> = Vec::new();
        for (to, payload) in entries {
            let channel = match named.iter().find(|c| c.to.as_str() == to) {
                Some(c) => c.clone(),
                None => {
                    let c = ChannelId::new(me.clone(), to);
                    named.push(c.clone());
                    c
                }
            };
            if !wiring.channels.contains_key(&channel) {
                if wiring.removed.contains(&channel.to) {
                    // Sent before the application heard that the peer left.
                    tracing::warn!(%channel, "a send to a removed member: dropped");
                    self.shared.metrics.removed_peer_messages.inc();
                    continue;
                }
                return Err(Error::Unknown(format!(
                    "node {me} has no channel to `{to}`: it is not a member (or was removed)"
                ))
                .into());
            }
            if payload.len() > self.shared.max_payload {
                return Err(Error::PayloadTooLarge {
                    size: payload.len(),
                    limit: self.shared.max_payload,
                }
                .into());
            }
            checked.push((channel, payload));
        }
        let mut ready: Vec<(ChannelId, Bytes)> = Vec::with_capacity(checked.len());
        let mut removed = false;
        for (channel, payload) in checked {
            let handles = &wiring.channels[&channel];
            let credits = &handles.credits;
            match credits.try_acquire() {
                Ok(permit) => permit.forget(),
                Err(_) if self.may_read_ahead() => self.on_credit(handles),
                Err(_) => {
                    if !ready.is_empty() {
                        let sends = std::mem::take(&mut ready);
                        self.to_loop(LoopMsg::AppSend {
                            session: self.session,
                            sends,
                        })
                        .await?;
                    }
                    // Wait for a credit — or for a record request, which lets the session
                    // read ahead.
                    loop {
                        let woken = self.records.wake.notified();
                        if self.may_read_ahead() {
                            self.on_credit(handles);
                            break;
                        }
                        tokio::select! {
                            permit = credits.acquire() => {
                                match permit {
                                    Ok(permit) => permit.forget(),
                                    // Closed: the peer was removed while this send waited
                                    // for room (the loop dropped the channel).
                                    Err(_) if self.shared.wiring().removed.contains(&channel.to) => {
                                        tracing::warn!(%channel, "a send to a removed member: dropped");
                                        self.shared.metrics.removed_peer_messages.inc();
                                        removed = true;
                                    }
                                    Err(_) => return Err(Error::ShuttingDown.into()),
                                }
                                break;
                            }
                            _ = woken => {}
                        }
                    }
                }
            }
            if std::mem::take(&mut removed) {
                continue;
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
