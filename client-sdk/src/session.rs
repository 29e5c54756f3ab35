//! The application's session with its local node daemon.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use bytes::{Bytes, BytesMut};
use cairn_rpc::v1 as pb;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::error::Error;

mod early;
mod event;
mod sender;
mod staging;
mod writer;

use early::{ANSWERED_MEMORY, Copies, EarlyRecords};
pub use event::{AppEvent, AttachOptions};
use sender::Circulation;
pub use sender::{AppSender, SendPermit};
use staging::RestoreStaging;
use writer::{Written, close, confirm, write_loop};

/// Largest piece of a recorded state sent in one message.
const STATE_CHUNK: usize = 256 << 10;
/// Most messages coalesced into one `SendBatch`.
const SEND_BATCH: usize = 256;
/// Most payload bytes coalesced into one `SendBatch`: well under the daemon's HTTP/2
/// window, so a batch never waits for a window update in the middle.
const SEND_BATCH_BYTES: usize = 256 << 10;
/// Most messages a session may have on its way to the daemon and not taken by it yet: few
/// enough that a recorded state sent behind them is not held up, whatever their size
/// (the daemon's 1 MiB HTTP/2 window bounds their bytes). The daemon advises fewer
/// (`Taken.window`) while a slow peer holds it back.
const SEND_ROOM: usize = 8192;
/// How long `connect` waits for the daemon to open the `App/Consumed` stream.
const CONSUMED_OPEN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Consumed messages after which the session acknowledges them even with more buffered
/// (it always does before it waits for more).
const ACK_EVERY: u64 = 256;

enum Outgoing {
    Send(String, Bytes),
    /// A recorded state, with the messages consumed at its cut.
    State(u64, Option<u64>, Bytes),
    RestoreApplied(String),
}

/// An open session: receive events with [`AppSession::next_event`], send with
/// [`AppSession::sender`].
pub struct AppSession {
    sender: AppSender,
    inbound: Streaming<pb::NodeToApp>,
    buffered: VecDeque<AppEvent>,
    attached: pb::Attached,
    /// The pieces of the restored state coming.
    staging: RestoreStaging,
    /// Messages (and bytes) the application has taken, and the count the daemon was last
    /// told (on the `App/Consumed` stream, apart from the sends).
    consumed: (u64, u64),
    acknowledged: u64,
    acks: watch::Sender<(u64, u64)>,
    /// Early copies of record requests, from the `App/Consumed` stream.
    early: Arc<EarlyRecords>,
    /// Which copies were answered.
    copies: Copies,
    /// A record request was handed out: the next call lets the writer run first.
    recorded: bool,
    /// The highest snapshot id whose end was handed out (or named at attach).
    outcomes_heard: u64,
}

impl AppSession {
    /// Connects to the daemon's application port (`host:port`) and attaches.
    pub async fn connect(address: &str, application: &str) -> Result<Self, Error> {
        Self::connect_with(address, application, None).await
    }

    /// As [`AppSession::connect`], over mutual TLS with `tls` when the daemon serves its
    /// application port with TLS (it does when it has `--tls-*` flags): the application
    /// presents its node's certificate (`cairn://CLUSTER/node/ID`; the daemon refuses any
    /// other), and checks the daemon's against the CA for the host it dials.
    pub async fn connect_with(
        address: &str,
        application: &str,
        tls: Option<&crate::tls::Tls>,
    ) -> Result<Self, Error> {
        Self::attach(address, application, tls, AttachOptions::default()).await
    }

    /// As [`AppSession::connect_with`], with `options` (following the snapshots' ends).
    pub async fn attach(
        address: &str,
        application: &str,
        tls: Option<&crate::tls::Tls>,
        options: AttachOptions,
    ) -> Result<Self, Error> {
        let connect_error = |reason: String| Error::Connect {
            address: address.to_owned(),
            reason,
        };
        let channel = crate::tls::endpoint(address, tls)
            .map_err(|e| connect_error(crate::error::with_causes(&e)))?
            .tcp_nodelay(true)
            // What waits for the application is bounded by the daemon's delivery window
            // (about 50 ms of the application's work, at most 8 MiB), not by HTTP/2.
            .initial_stream_window_size(8 << 20)
            .initial_connection_window_size(16 << 20)
            .max_frame_size(cairn_rpc::limits::MAX_FRAME)
            .connect()
            .await
            .map_err(|e| connect_error(crate::error::with_causes(&e)))?;
        let mut client =
            pb::app_client::AppClient::new(channel).max_decoding_message_size(64 << 20);
        let (wire_tx, wire_rx) = mpsc::channel::<pb::AppToNode>(16);
        let attach = pb::AppToNode {
            kind: Some(pb::app_to_node::Kind::Attach(pb::Attach {
                application: application.to_owned(),
                packed_deliveries: true,
                acknowledges_deliveries: true,
                snapshot_outcomes_after: options.snapshot_outcomes_after,
            })),
        };
        wire_tx
            .send(attach)
            .await
            .map_err(|_| Error::SessionClosed)?;
        let mut inbound = client
            .session(ReceiverStream::new(wire_rx))
            .await?
            .into_inner();
        let attached = match inbound.message().await? {
            Some(pb::NodeToApp {
                kind: Some(pb::node_to_app::Kind::Attached(a)),
            }) => a,
            Some(_) => return Err(Error::Protocol("expected Attached first".into())),
            None => return Err(Error::SessionClosed),
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let room = Arc::new(Semaphore::new(SEND_ROOM));
        // Flow control travels on its own stream (`App/Consumed`), so that it never waits
        // behind the session's traffic: what the application consumed goes to the daemon,
        // and the sends the daemon took off the session come back as room. A daemon that
        // names no session has no such stream: room comes back as sends are written.
        let session = attached.session;
        let flow_key = attached.flow_key;
        let written = Arc::new(AtomicU64::new(0));
        let on_write = Arc::new(AtomicBool::new(session == 0));
        let confirm_on_write = Arc::new(AtomicBool::new(session == 0));
        let (confirmed_tx, confirmed) = watch::channel((0u64, false));
        let confirmed_tx = Arc::new(confirmed_tx);
        tokio::spawn(write_loop(
            rx,
            wire_tx,
            Written {
                room: room.clone(),
                on_write: on_write.clone(),
                written: written.clone(),
                confirm_on_write: confirm_on_write.clone(),
                confirmed: confirmed_tx.clone(),
            },
        ));
        let (acks, mut latest) = watch::channel((0u64, 0u64));
        let early = Arc::new(EarlyRecords::default());
        if session != 0 {
            let (ack_tx, ack_rx) = mpsc::channel::<pb::Consumption>(1);
            tokio::spawn(async move {
                // The first message names the session; then only the latest count matters.
                let mut counts = (0, 0);
                loop {
                    let (messages, bytes) = counts;
                    let consumption = pb::Consumption {
                        session,
                        messages,
                        bytes,
                        flow_key,
                    };
                    if ack_tx.send(consumption).await.is_err() || latest.changed().await.is_err() {
                        return;
                    }
                    counts = *latest.borrow_and_update();
                }
            });
            // Opened before `connect` returns: the daemon's window is in force (or known
            // to be off) before the application sends or reads anything. A daemon that
            // does not answer in time is left without it (dropping the call ends the
            // stream there, which turns its window off).
            let opened = match tokio::time::timeout(
                CONSUMED_OPEN_TIMEOUT,
                client.clone().consumed(ReceiverStream::new(ack_rx)),
            )
            .await
            {
                Ok(opened) => opened,
                Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                    "no answer within {CONSUMED_OPEN_TIMEOUT:?}"
                ))),
            };
            if let Err(status) = &opened {
                // The daemon then keeps no delivery window for the session; sends are
                // paced, and confirmed, as they are written.
                confirm_on_write.store(true, Ordering::Release);
                tracing::warn!(
                    code = ?status.code(),
                    "the daemon refused the flow-control stream (App/Consumed): {}; \
                     going on without windows",
                    status.message()
                );
            }
            let room = room.clone();
            let early = early.clone();
            tokio::spawn(async move {
                let mut released = 0u64;
                let mut circulation = Circulation::default();
                let reported = opened.is_ok();
                if let Ok(response) = opened {
                    let mut taken = response.into_inner();
                    while let Ok(Some(pb::Taken {
                        messages,
                        record_state,
                        window,
                    })) = taken.message().await
                    {
                        if !record_state.is_empty() {
                            early.arrived(record_state, false);
                        }
                        // Never more than was written (a confused daemon cannot inflate
                        // it).
                        let messages = messages.min(written.load(Ordering::Acquire));
                        let returned = messages.saturating_sub(released);
                        let give = circulation.taken(returned, window);
                        if give > 0 {
                            room.add_permits(give as usize);
                        }
                        if returned > 0 {
                            released = messages;
                            confirm(&confirmed_tx, released);
                        }
                    }
                }
                // Without the daemon's counts, room comes back as sends are written (no
                // send window), rather than never: what is written already goes back now,
                // and a window the daemon had shrunk opens to the SDK's own.
                on_write.store(true, Ordering::Release);
                let written = written.load(Ordering::Acquire);
                let give = circulation.taken(written.saturating_sub(released), None);
                if give > 0 {
                    room.add_permits(give as usize);
                }
                if reported {
                    // What the daemon did not report taking is not confirmed now.
                    close(&confirmed_tx);
                }
                early.arrived(Vec::new(), true);
            });
        }
        Ok(Self {
            sender: AppSender {
                tx,
                room,
                peers: Arc::new(RwLock::new(attached.peers.iter().cloned().collect())),
                restore: Arc::default(),
                sends: Arc::default(),
                confirmed,
                cuts: Arc::default(),
            },
            inbound,
            buffered: VecDeque::new(),
            attached,
            staging: RestoreStaging::default(),
            consumed: (0, 0),
            acknowledged: 0,
            acks,
            early,
            copies: Copies::default(),
            recorded: false,
            outcomes_heard: options.snapshot_outcomes_after.unwrap_or(0),
        })
    }

    /// The application takes its cut for `snapshot_id` here: after the messages it has
    /// consumed so far, which the answer names.
    fn cut(&mut self, snapshot_id: u64) -> AppEvent {
        let mut cuts = self.sender.cuts.lock().expect("never poisoned");
        cuts.insert(snapshot_id, self.consumed.0);
        while cuts.len() > ANSWERED_MEMORY {
            cuts.pop_first();
        }
        self.recorded = true;
        AppEvent::RecordState { snapshot_id }
    }

    /// An early copy of a record request not answered yet, if one came.
    fn early_request(&mut self) -> Option<u64> {
        let mut due = self.early.due.lock().expect("never poisoned");
        self.copies.take_early(&mut due)
    }

    /// Tells the daemon what the application has taken (it keeps at most a window of
    /// messages handed over and not taken).
    fn acknowledge(&mut self) {
        if self.consumed.0 != self.acknowledged {
            self.acknowledged = self.consumed.0;
            let _ = self.acks.send(self.consumed);
        }
    }

    /// From now on, hand restored states over as [`AppEvent::RestorePiece`]s as they come
    /// from the daemon (pieces of up to 128 KiB) rather than as one [`AppEvent::Restore`]:
    /// for states too large to hold twice. The daemon streams them from the blob store
    /// either way; this only decides whether the SDK gathers them first.
    pub fn restore_in_pieces(&mut self, on: bool) {
        self.staging.in_pieces = on;
    }

    /// A sender for this session.
    pub fn sender(&self) -> AppSender {
        self.sender.clone()
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.attached.node_id
    }

    /// The cluster's name.
    pub fn cluster(&self) -> &str {
        &self.attached.cluster
    }

    /// The highest snapshot id whose end this session handed out (or the id it attached
    /// following from): what to name in [`AttachOptions::snapshot_outcomes_after`] when
    /// attaching again, once the application has acted on every end handed out.
    pub fn outcomes_heard(&self) -> u64 {
        self.outcomes_heard
    }

    /// The next event; `None` when the daemon closed the session.
    pub async fn next_event(&mut self) -> Result<Option<AppEvent>, Error> {
        use pb::node_to_app::Kind;
        let unacknowledged = self.sender.restore.lock().expect("never poisoned").clone();
        if let Some(restore_id) = unacknowledged {
            self.sender.restore_applied(&restore_id)?;
        }
        if std::mem::take(&mut self.recorded) {
            // The state the application just recorded waits for the session's writer,
            // which its recording woke on this thread: an application busy with buffered
            // messages never yields (they come without waiting), and would hold the state
            // back behind all of them. Once per record request.
            tokio::task::yield_now().await;
        }
        loop {
            // A record request that overtook the deliveries: the cut is here, between two
            // messages.
            if let Some(id) = self.early_request() {
                return Ok(Some(self.cut(id)));
            }
            if let Some(event) = self.buffered.pop_front() {
                if let AppEvent::Restore { restore_id, .. }
                | AppEvent::RestorePiece {
                    restore_id,
                    last: true,
                    ..
                } = &event
                {
                    // Handed over whole: acknowledged when the application next asks for
                    // an event, if it did not itself (not before: a restore superseded
                    // mid-way leaves an abort ahead of the next one in `buffered`).
                    *self.sender.restore.lock().expect("never poisoned") = Some(restore_id.clone());
                }
                if let AppEvent::Message { payload, .. } = &event {
                    self.consumed.0 += 1;
                    self.consumed.1 += payload.len() as u64;
                    if self.consumed.0 - self.acknowledged >= ACK_EVERY {
                        self.acknowledge();
                    }
                }
                return Ok(Some(event));
            }
            // Everything taken: say so before waiting for more.
            self.acknowledge();
            let message = tokio::select! {
                // Cancel-safe: the stream keeps what it has read of a message.
                message = self.inbound.message() => message?,
                () = self.early.wake.notified() => continue,
            };
            let Some(message) = message else {
                return Ok(None);
            };
            match message.kind {
                Some(Kind::Deliver(batch)) => {
                    self.buffered
                        .extend(batch.messages.into_iter().map(|m| AppEvent::Message {
                            from: m.from,
                            payload: m.payload,
                        }));
                    for run in batch.runs {
                        let mut at = 0usize;
                        for len in run.lengths {
                            let end = at + len as usize;
                            if end > run.payloads.len() {
                                return Err(Error::Protocol(
                                    "a delivered run is shorter than its lengths".into(),
                                ));
                            }
                            self.buffered.push_back(AppEvent::Message {
                                from: run.from.clone(),
                                payload: run.payloads.slice(at..end),
                            });
                            at = end;
                        }
                    }
                }
                Some(Kind::RecordState(r)) => {
                    // Answered at its early copy already: the cut was there.
                    if !self.copies.in_band(r.snapshot_id, r.early_copy) {
                        continue;
                    }
                    return Ok(Some(self.cut(r.snapshot_id)));
                }
                Some(Kind::Restore(r)) => self.staging.piece(r, &mut self.buffered),
                Some(Kind::RestoreAborted(a)) => self.staging.aborted(a, &mut self.buffered),
                Some(Kind::SnapshotCompleted(c)) => {
                    // Never backwards: a confused daemon cannot make an end heard twice in
                    // one session.
                    if c.snapshot_id > self.outcomes_heard {
                        self.outcomes_heard = c.snapshot_id;
                        return Ok(Some(AppEvent::SnapshotCompleted {
                            snapshot_id: c.snapshot_id,
                        }));
                    }
                }
                Some(Kind::SnapshotAborted(a)) => {
                    if a.snapshot_id > self.outcomes_heard {
                        self.outcomes_heard = a.snapshot_id;
                        return Ok(Some(AppEvent::SnapshotAborted {
                            snapshot_id: a.snapshot_id,
                            reason: a.reason,
                        }));
                    }
                }
                Some(Kind::Peers(p)) => {
                    *self.sender.peers.write().expect("never poisoned") =
                        p.peers.into_iter().collect();
                }
                Some(Kind::Attached(_)) | None => {
                    return Err(Error::Protocol("unexpected message from the daemon".into()));
                }
            }
        }
    }
}
