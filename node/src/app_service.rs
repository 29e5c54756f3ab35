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
use crate::node_loop::flow::SendWindow;
use crate::node_loop::{LoopMsg, RecordsDue};
use crate::shared::{ChannelHandles, Shared, StateChunk, UPLOAD_ROOM};

mod reader;

use reader::SessionReader;

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
    /// The session's record requests (their early copies go out on the `Consumed` stream).
    records: Arc<RecordsDue>,
    /// The send window advised to the application (only the session's reader changes it).
    window: std::sync::Mutex<SendWindow>,
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
        self.window_mut().took(n, std::time::Instant::now());
        self.messages.fetch_add(n, Ordering::AcqRel);
        self.changed.notify_one();
    }

    /// The session waits for a peer's credit: the window shrinks to what it takes.
    fn held(&self) {
        self.window_mut().held();
    }

    fn window(&self) -> u64 {
        self.window_mut().size()
    }

    fn window_mut(&self) -> std::sync::MutexGuard<'_, SendWindow> {
        self.window.lock().expect("never poisoned")
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
        let records = Arc::new(RecordsDue::default());
        let taken = Arc::new(SendsTaken {
            records: records.clone(),
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
        let asked = self
            .loop_tx
            .send(LoopMsg::AppAttach {
                session,
                packed: attach.packed_deliveries,
                flow_key: taken.flow_key,
                acknowledges: attach.acknowledges_deliveries,
                outcomes_after: attach.snapshot_outcomes_after,
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
    let (mut told, mut told_window) = (0, None);
    let mut early = Vec::new();
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
        let window = Some(taken.window());
        early.append(&mut taken.records.early.lock().expect("never poisoned"));
        if now != told || window != told_window || !early.is_empty() {
            (told, told_window) = (now, window);
            let message = pb::Taken {
                messages: now,
                record_state: std::mem::take(&mut early),
                window,
            };
            // An application that stops reading its counts holds only this stream up,
            // never past its session's end or the daemon's shutdown.
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = taken.ended.cancelled() => return,
                sent = tx.send(Ok(message)) => if sent.is_err() { return },
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = taken.ended.cancelled() => return,
            _ = taken.changed.notified() => {}
            _ = taken.records.early_wake.notified() => {}
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
