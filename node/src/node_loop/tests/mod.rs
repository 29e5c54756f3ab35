//! The node loop driven through its channels, without sockets or processes: the tests play
//! the peer service (inbound frames), the sending tasks (pulls), the application session
//! (attach, sends, recorded state) and the coordinator link (plans, aborts, restores,
//! rewiring), and read what the loop emits: events for the link, answered pulls and what
//! it hands the application.
//!
//! - `snapshots`: start, part ready, failure, abort.
//! - `fencing`: restore fencing and membership change.
//! - `outcomes`: snapshots' ends relayed to the application.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use cairn_core::{ChannelId, NodeId, Plan, SnapshotId, SnapshotMode, Topology};
use cairn_proto::v1 as pb;
use pb::node_to_app::Kind;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::{InItem, LoopMsg, NodeEvent, NodeLoop, OutFrame, Pulled, RecordsDue, RestoreData};
use crate::error::Error;
use crate::part::Part;
use crate::shared::{ChannelHandles, Shared, StateChunk, Wiring};

mod fencing;
mod outcomes;
mod snapshots;
mod window;

/// Messages each channel may hold in the daemon.
const BUFFER: usize = 16;
/// The incarnation of peer b's daemon.
const B: u64 = 7;

fn ch(from: &str, to: &str) -> ChannelId {
    ChannelId::new(from, to)
}

/// Node `a`'s wiring in a full mesh of `nodes`, keeping the handles `old` has.
fn wiring(nodes: &[&str], old: Option<&Wiring>) -> Wiring {
    let me = NodeId::new("a");
    let topology = Topology::full_mesh(nodes.iter().map(|n| NodeId::new(*n)));
    let channels = topology
        .incoming(&me)
        .chain(topology.outgoing(&me))
        .map(|c| {
            let handles = old
                .and_then(|w| w.channels.get(&c).cloned())
                .unwrap_or_else(|| Arc::new(ChannelHandles::new(BUFFER)));
            (c, handles)
        })
        .collect();
    Wiring {
        addresses: nodes
            .iter()
            .map(|n| (NodeId::new(*n), format!("{n}:1")))
            .collect(),
        topology,
        channels,
        incarnations: BTreeMap::new(),
        removed: Default::default(),
        down: Default::default(),
    }
}

/// Node `a`'s loop, running, and the ends of its channels.
struct Node {
    tx: mpsc::Sender<LoopMsg>,
    /// What the loop tells the coordinator link (none without a coordinator).
    events: Option<mpsc::UnboundedReceiver<NodeEvent>>,
    shared: Arc<Shared>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// The application's end of a session.
struct App {
    session: u64,
    rx: mpsc::Receiver<Result<pb::NodeToApp, Status>>,
}

impl Node {
    /// Node `a` of the full mesh `nodes`; with a coordinator link if `coordinated`.
    fn start(nodes: &[&str], coordinated: bool) -> Self {
        let shared = Arc::new(Shared {
            metrics: Default::default(),
            node_id: NodeId::new("a"),
            cluster: "test".into(),
            incarnation: 1,
            max_payload: 1 << 20,
            channel_buffer: BUFFER,
            queue_target: None,
            wiring: RwLock::new(Arc::new(wiring(nodes, None))),
            fault_injection: false,
            upload_room: Arc::new(tokio::sync::Semaphore::new(crate::shared::UPLOAD_ROOM)),
            tls: None,
            epoch: tokio::sync::watch::Sender::new(0),
            highest_term: Default::default(),
            registered: std::sync::atomic::AtomicBool::new(true),
        });
        let (tx, rx) = mpsc::channel(64);
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let node_loop = NodeLoop::new(
            shared.clone(),
            rx,
            tx.clone(),
            8,
            coordinated.then_some(events_tx),
        );
        let stop = CancellationToken::new();
        let task = tokio::spawn(node_loop.run(stop.clone()));
        Self {
            tx,
            events: coordinated.then_some(events_rx),
            shared,
            stop,
            task,
        }
    }

    async fn send(&self, msg: LoopMsg) {
        self.tx.send(msg).await.expect("loop running");
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> LoopMsg) -> T {
        let (reply, answer) = oneshot::channel();
        self.send(make(reply)).await;
        answer.await.expect("the loop answers")
    }

    /// The loop's status. The loop takes messages in order, so this is also a barrier:
    /// everything sent before has been handled.
    async fn status(&self) -> pb::NodeStatus {
        self.ask(|reply| LoopMsg::Status { reply }).await
    }

    /// Attaches an application whose stream holds `room` messages.
    async fn attach(&self, session: u64, room: usize) -> App {
        self.attach_following(session, room, None).await
    }

    /// As `attach`, following the snapshots' ends above `outcomes_after`.
    async fn attach_following(
        &self,
        session: u64,
        room: usize,
        outcomes_after: Option<u64>,
    ) -> App {
        let (tx, rx) = mpsc::channel(room);
        let records = Arc::new(RecordsDue::default());
        self.ask(|reply| LoopMsg::AppAttach {
            session,
            packed: false,
            flow_key: 1,
            acknowledges: true,
            outcomes_after,
            tx,
            records,
            reply,
        })
        .await
        .expect("attached");
        App { session, rx }
    }

    fn handles(&self, channel: &ChannelId) -> Arc<ChannelHandles> {
        self.shared.channel(channel).expect("a channel of a")
    }

    /// Takes `n` credits of a channel, as the peer service or the session does.
    fn take_credits(&self, channel: &ChannelId, n: u32) {
        self.handles(channel)
            .credits
            .try_acquire_many(n)
            .expect("credits")
            .forget();
    }

    fn credits(&self, channel: &ChannelId) -> usize {
        self.handles(channel).credits.available_permits()
    }

    /// Peer b (re)opens its channel to a.
    async fn opened(&self, incarnation: u64) -> u64 {
        let epoch = *self.shared.epoch.borrow();
        self.opened_in(epoch, incarnation)
            .await
            .expect("opened in the node's epoch")
    }

    /// b opens its channel to a with a handshake checked in `epoch`.
    async fn opened_in(&self, epoch: u64, incarnation: u64) -> Option<u64> {
        self.ask(|reply| LoopMsg::InboundOpened {
            channel: ch("b", "a"),
            incarnation,
            epoch,
            reply,
        })
        .await
    }

    /// Frames from peer b, numbered from `first_seq`; whether the loop kept them.
    async fn frames(&self, epoch: u64, first_seq: u64, items: Vec<InItem>) -> bool {
        let data = items
            .iter()
            .filter(|i| matches!(i, InItem::Data(_)))
            .count();
        self.take_credits(&ch("b", "a"), data as u32);
        self.ask(|kept| LoopMsg::InboundFrames {
            channel: ch("b", "a"),
            incarnation: B,
            epoch,
            first_seq,
            items,
            kept,
        })
        .await
    }

    /// A pull of the sending task of `channel`; answered once the queue has something.
    async fn pull(&self, channel: ChannelId) -> oneshot::Receiver<Pulled> {
        let (reply, pulled) = oneshot::channel();
        self.send(LoopMsg::Pull {
            link: self.shared.channel(&channel).unwrap_or_else(|| {
                // A late pull of a removed channel's task: handles of its own.
                Arc::new(ChannelHandles::new(BUFFER))
            }),
            channel,
            max: 64,
            reply,
        })
        .await;
        pulled
    }

    /// The application sends `payload` to b (holding a credit, as the session does).
    async fn app_send(&self, app: &App, payload: &'static str) {
        self.take_credits(&ch("a", "b"), 1);
        self.send(LoopMsg::AppSend {
            session: app.session,
            sends: vec![(ch("a", "b"), Bytes::from_static(payload.as_bytes()))],
        })
        .await;
    }

    /// The application's recorded state for `id`, in one piece.
    async fn app_state(&self, app: &App, id: u64, state: &'static str) {
        let room = self
            .shared
            .upload_room
            .clone()
            .try_acquire_many_owned(state.len().max(1) as u32)
            .expect("upload room");
        let chunk = StateChunk {
            bytes: Bytes::from_static(state.as_bytes()),
            room,
        };
        self.send(LoopMsg::AppState {
            session: app.session,
            id: SnapshotId(id),
            chunk,
            last: true,
            consumed: None,
        })
        .await;
    }

    /// The events told so far (after a barrier).
    async fn events(&mut self) -> Vec<NodeEvent> {
        self.status().await;
        let events = self.events.as_mut().expect("a coordinated node");
        std::iter::from_fn(|| events.try_recv().ok()).collect()
    }

    async fn part(&self, id: u64) -> Result<Part, Error> {
        let id = SnapshotId(id);
        self.ask(|reply| LoopMsg::GetPart { id, reply }).await
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.expect("the loop ends cleanly");
    }
}

impl App {
    /// The next thing the loop hands the application.
    async fn next(&mut self) -> Kind {
        let message = tokio::time::timeout(Duration::from_secs(5), self.rx.recv())
            .await
            .expect("the loop hands the application something")
            .expect("stream open")
            .expect("not an error");
        message.kind.expect("a kind")
    }

    /// Nothing more is handed over (after a barrier).
    fn nothing_more(&mut self) {
        if let Ok(message) = self.rx.try_recv() {
            panic!("unexpected {message:?}");
        }
    }

    /// The payloads of the next delivery.
    async fn delivered(&mut self) -> Vec<Bytes> {
        match self.next().await {
            Kind::Deliver(batch) => batch.messages.into_iter().map(|m| m.payload).collect(),
            other => panic!("expected a delivery, got {other:?}"),
        }
    }
}

fn plan(id: u64) -> Plan {
    Plan::new(id, SnapshotMode::ChandyLamport, "a")
}

fn data(payload: &'static str) -> InItem {
    InItem::Data(Bytes::from_static(payload.as_bytes()))
}

fn bytes(payloads: &[&'static str]) -> Vec<Bytes> {
    payloads
        .iter()
        .map(|p| Bytes::from_static(p.as_bytes()))
        .collect()
}

/// Whether a pull was answered, and with what (after a barrier).
fn answered(pulled: &mut oneshot::Receiver<Pulled>) -> Option<Pulled> {
    pulled.try_recv().ok()
}

fn is_marker(frame: &OutFrame, id: u64) -> bool {
    matches!(frame, OutFrame::Marker(p) if p.id == SnapshotId(id))
}
