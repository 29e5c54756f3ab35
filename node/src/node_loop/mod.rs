//! The node loop: one task that owns the [`SnapshotEngine`], the application's inbox and
//! every outgoing queue, so that the position of a marker or a record request among the
//! messages is decided in one place, without locks.

mod app;
mod channels;
mod commands;
mod ends;
mod events;
pub(crate) mod flow;
mod handed;
mod messages;
mod recording;
mod restore;
mod rewire;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use cairn_core::lifecycle::Relay;
use cairn_core::{ChannelId, Command, Event, FailureReason, Plan, SnapshotEngine, SnapshotId};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::shared::{Shared, StateChunk, Wiring};
use ends::{Incoming, OutItem, Outgoing};
use events::Events;
pub(crate) use events::NodeEvent;
pub(crate) use messages::{
    AppTx, HoldFault, InItem, LoopMsg, OutFrame, Pulled, RecordsDue, RestoreData, RestoreFeed,
};
use recording::Recordings;

/// Most messages handed to the application in one `DeliverBatch`.
const DELIVER_BATCH: usize = 256;
/// Most payload bytes in one `DeliverBatch`: well under the application's HTTP/2 window.
const DELIVER_BATCH_BYTES: usize = 256 << 10;

enum InboxItem {
    Deliver {
        channel: ChannelId,
        generation: u64,
        index: u64,
        payload: Bytes,
        /// Holds a credit of its channel (a replayed message does not).
        credited: bool,
    },
    Record(SnapshotId),
    /// A restored state, handed over piece by piece as its pieces come; always ahead of the
    /// replayed messages.
    Restore {
        restore_id: String,
        snapshot_id: u64,
        epoch: u64,
        feed: RestoreFeed,
    },
    /// The application was handed part of a restored state that broke off: it drops it.
    RestoreAborted {
        restore_id: String,
        reason: String,
    },
}

struct App {
    session: u64,
    /// Deliveries as runs.
    packed: bool,
    tx: AppTx,
    /// Messages handed over and not consumed yet, and how many may be.
    window: flow::DeliveryWindow,
    /// Record requests handed to the application and not answered yet (shared with its
    /// session reader, which reads ahead of blocked sends while there are any).
    records: Arc<RecordsDue>,
    /// Messages handed over that a cut at an early request may still fall before.
    handed: handed::Handed,
    /// It attached with `acknowledges_deliveries` and its `Consumed` stream has not opened
    /// (nor failed) yet: what it is handed meanwhile is kept all the same (up to
    /// [`flow::APP_MAX`] messages), since a cut at an early request may fall before it.
    window_pending: bool,
}

/// The loop's state. See the module docs.
pub(crate) struct NodeLoop {
    shared: Arc<Shared>,
    engine: SnapshotEngine,
    rx: mpsc::Receiver<LoopMsg>,
    self_tx: mpsc::Sender<LoopMsg>,
    inbox: VecDeque<InboxItem>,
    incoming: BTreeMap<ChannelId, Incoming>,
    outgoing: BTreeMap<ChannelId, Outgoing>,
    app: Option<App>,
    /// The application has not been told its new peers yet.
    peers_changed: bool,
    /// Snapshots whose record request the application has, and whose state is not complete.
    awaiting_state: BTreeSet<SnapshotId>,
    recordings: Recordings,
    /// The newest snapshot ids this node has met, so an initiation cannot reuse one, and
    /// when it first met each (its first marker or its initiation: the start of its
    /// alignment, and what its report of the state measures from).
    seen: BTreeMap<SnapshotId, Instant>,
    pending: VecDeque<Event>,
    /// How deep `feed` calls are nested (commands feed events too).
    depth: u32,
    /// Events held until the outermost `feed` has executed its commands.
    deferred: VecDeque<Event>,
    /// The epoch this loop is in (published in `Shared::epoch`).
    epoch: u64,
    /// A restore whose state the application has not applied yet: until it has, what it
    /// sends was decided on its old state and is dropped.
    restore_pending: Option<RestorePending>,
    /// Where the coordinator link hears of restores applied or failed.
    events: Events,
    /// The snapshots' ends due to the application (`cairn_core::lifecycle`).
    outcomes: Relay,
}

/// A restore handed to the application and not yet applied.
struct RestorePending {
    restore_id: String,
    /// The application session that was handed the state, once it was.
    session: Option<u64>,
    /// The fetch feeding its state.
    fetch: u64,
    /// Its state broke off (and the coordinator was told): nothing is delivered until a
    /// later restore, since the application runs on a state of no epoch of this one.
    aborted: bool,
}

impl NodeLoop {
    pub(crate) fn new(
        shared: Arc<Shared>,
        rx: mpsc::Receiver<LoopMsg>,
        self_tx: mpsc::Sender<LoopMsg>,
        keep_parts: usize,
        events: Option<mpsc::UnboundedSender<NodeEvent>>,
    ) -> Self {
        let wiring = shared.wiring();
        let engine = SnapshotEngine::new(shared.node_id.clone(), wiring.topology.clone());
        let epoch = *shared.epoch.borrow();
        let events = Events::new(events);
        let mut this = Self {
            engine,
            rx,
            self_tx,
            inbox: VecDeque::new(),
            incoming: BTreeMap::new(),
            outgoing: BTreeMap::new(),
            app: None,
            peers_changed: false,
            awaiting_state: BTreeSet::new(),
            recordings: Recordings::new(keep_parts, events.clone()),
            seen: BTreeMap::new(),
            pending: VecDeque::new(),
            depth: 0,
            deferred: VecDeque::new(),
            epoch,
            restore_pending: None,
            events,
            shared,
            outcomes: Relay::default(),
        };
        this.take_up_channels(&wiring);
        this
    }

    /// Runs until `shutdown`; then fails every snapshot in flight here with that reason.
    pub(crate) async fn run(mut self, shutdown: CancellationToken) {
        loop {
            let deliver = self.deliverable().map(|tx| tx.reserve_owned());
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                permit = async { deliver.expect("guarded").await }, if deliver.is_some() => {
                    match permit {
                        Ok(permit) => self.deliver(permit),
                        Err(_) => self.detach_app(None),
                    }
                }
                msg = self.rx.recv() => match msg {
                    Some(msg) => self.on_message(msg),
                    None => break,
                },
            }
        }
        let in_flight: Vec<SnapshotId> = self.engine.in_flight().collect();
        for id in in_flight {
            let reason = FailureReason::Shutdown(self.shared.node_id.clone());
            tracing::warn!(snapshot = %id, "aborting snapshot: node shutting down");
            self.feed(Event::SnapshotAborted { id, reason });
        }
    }

    /// The application's stream, if there is something to hand it.
    fn deliverable(&mut self) -> Option<AppTx> {
        let aborted = self.restore_pending.as_ref().is_some_and(|p| p.aborted);
        let app = self.app.as_mut()?;
        let ready = match self.inbox.front() {
            None => false,
            // The restored state's next piece has not come yet: everything waits behind it.
            Some(InboxItem::Restore { feed, .. }) => feed.ready(),
            Some(InboxItem::RestoreAborted { .. }) => true,
            // Messages wait while the delivery window is full.
            Some(InboxItem::Deliver { .. }) if !aborted => match app.window.room() {
                Some((0, _)) => {
                    app.window.full_with_backlog();
                    false
                }
                _ => true,
            },
            Some(_) => !aborted,
        };
        (ready || self.peers_changed || self.outcomes.has_due()).then(|| app.tx.clone())
    }

    fn on_message(&mut self, msg: LoopMsg) {
        match msg {
            LoopMsg::InboundOpened {
                channel,
                incarnation,
                epoch,
                reply,
            } => {
                let received = self.on_inbound_opened(&channel, incarnation, epoch);
                let _ = reply.send(received);
            }
            LoopMsg::InboundFrames {
                channel,
                incarnation,
                epoch,
                first_seq,
                items,
                kept,
            } => {
                let _ = kept.send(self.on_inbound_frames(
                    channel,
                    incarnation,
                    epoch,
                    first_seq,
                    items,
                ));
            }
            LoopMsg::Pull {
                channel,
                link,
                max,
                reply,
            } => {
                if self.is_current(&channel, &link)
                    && let Some(out) = self.outgoing.get_mut(&channel)
                {
                    out.pending_pull = Some((max, reply));
                    self.serve_pull(&channel);
                }
            }
            LoopMsg::Fault {
                channel,
                fault,
                reply,
            } => {
                let _ = reply.send(self.fault(&channel, fault));
            }
            LoopMsg::CancelPull { channel, link } => {
                if self.is_current(&channel, &link)
                    && let Some(out) = self.outgoing.get_mut(&channel)
                {
                    out.pending_pull = None;
                }
            }
            LoopMsg::Credit {
                channel,
                link,
                epoch,
                limit,
            } => {
                if self.is_current(&channel, &link) {
                    self.on_credit(&channel, epoch, limit);
                }
            }
            LoopMsg::OutboundReset {
                channel,
                link,
                epoch,
                requeue,
                lost_markers,
            } => self.on_outbound_reset(channel, &link, epoch, requeue, lost_markers),
            LoopMsg::AppAttach {
                session,
                packed,
                flow_key,
                acknowledges,
                outcomes_after,
                tx,
                records,
                reply,
            } => {
                let attach = (session, packed, flow_key, acknowledges);
                let attached = self.attach_app(attach, tx, records);
                if attached.is_ok() {
                    let ask = self.outcomes.attach(outcomes_after);
                    self.ask_outcomes(ask);
                }
                let _ = reply.send(attached);
            }
            LoopMsg::AppSend { session, sends } => self.on_app_send(session, sends),
            LoopMsg::AppState {
                session,
                id,
                chunk,
                last,
                consumed,
            } => self.on_app_state(session, id, chunk, last, consumed),
            LoopMsg::AppDetached { session } => self.detach_app(Some(session)),
            LoopMsg::AppWindow { session, on } => self.app_window(session, on),
            LoopMsg::AppConsumed {
                session,
                messages,
                bytes,
            } => self.on_app_consumed(session, messages, bytes),
            LoopMsg::AppRestoreApplied {
                session,
                restore_id,
            } => self.on_restore_applied(session, restore_id),
            LoopMsg::Restore(data) => self.restore(*data),
            LoopMsg::RestorePiece { fetch, piece } => self.restore_piece(fetch, piece),
            LoopMsg::RestoreEnd { fetch } => self.restore_end(fetch),
            LoopMsg::RestoreAborted { fetch, reason } => self.restore_aborted(fetch, reason),
            LoopMsg::AdoptEpoch { epoch } => self.adopt_epoch(epoch),
            LoopMsg::Initiate {
                id,
                mode,
                alignment_timeout,
                reply,
            } => {
                let result = if self.seen.contains_key(&id) || id.0 == 0 {
                    Err(Error::DuplicateSnapshot(id))
                } else {
                    let plan = Plan {
                        id,
                        mode,
                        initiators: BTreeSet::from([self.shared.node_id.clone()]),
                        alignment_timeout,
                        timed_out: false,
                        started_at_ms: now_ms(),
                    };
                    self.remember(id);
                    self.feed(Event::SnapshotInitiated { plan: plan.clone() });
                    Ok(plan)
                };
                let _ = reply.send(result);
            }
            LoopMsg::GetPart { id, reply } => {
                let _ = reply.send(self.recordings.part(id));
            }
            LoopMsg::Status { reply } => {
                let _ = reply.send(self.status());
            }
            LoopMsg::AlignmentTimedOut { id } => self.feed(Event::AlignmentTimedOut { id }),
            LoopMsg::InitiatePlan { plan } => {
                if plan.initiators.contains(&self.shared.node_id) {
                    self.remember(plan.id);
                    self.feed(Event::SnapshotInitiated { plan });
                }
            }
            LoopMsg::Abort { id, reason } => {
                self.remember(id);
                self.feed(Event::SnapshotAborted { id, reason });
            }
            LoopMsg::Registered => {
                let ask = self.outcomes.registered();
                self.ask_outcomes(ask);
            }
            LoopMsg::Outcomes(outcomes) => {
                let ask = self.outcomes.heard(outcomes);
                self.ask_outcomes(ask);
            }
            LoopMsg::Rewire {
                wiring,
                what,
                reply,
            } => {
                self.rewire(wiring, what);
                let _ = reply.send(());
            }
        }
    }

    /// Asks the coordinator for the snapshots' ends above `after`, if asked to.
    fn ask_outcomes(&self, after: Option<u64>) {
        if let Some(after) = after {
            self.events.tell(NodeEvent::OutcomesAfter(after));
        }
    }

    /// Remembers a snapshot id as used (the newest 4,096), so an initiation cannot reuse it.
    fn remember(&mut self, id: SnapshotId) {
        self.seen.entry(id).or_insert_with(Instant::now);
        while self.seen.len() > 4096 {
            self.seen.pop_first();
        }
    }

    /// Feeds the engine and executes its commands, in order. An event raised while
    /// commands execute is handled at once (a marker taken in by `UnblockChannel` must block
    /// its channel before the next frame is taken), except a marker's transmission, which
    /// could complete a part while commands that record into it have not run yet: those
    /// wait for the outermost feed ([`Self::after_commands`]).
    fn feed(&mut self, event: Event) {
        self.pending.push_back(event);
        self.depth += 1;
        loop {
            while let Some(event) = self.pending.pop_front() {
                self.engine.handle(event);
                let commands: Vec<Command> = self.engine.drain_commands().collect();
                for command in commands {
                    self.execute(command);
                }
            }
            if self.depth > 1 || self.deferred.is_empty() {
                break;
            }
            self.pending.extend(self.deferred.drain(..));
        }
        self.depth -= 1;
    }
}

#[cfg(test)]
mod tests;

/// Milliseconds since the Unix epoch by this machine's clock.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
