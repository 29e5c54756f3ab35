//! The node loop: one task that owns the [`SnapshotEngine`], the application's inbox and
//! every outgoing queue, so that the position of a marker or a record request among the
//! messages is decided in one place, without locks.

mod app;
mod channels;
mod events;
mod flow;
mod messages;
mod recording;
mod restore;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use cairn_core::{ChannelId, Command, Event, FailureReason, Plan, SnapshotEngine, SnapshotId};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::shared::{Shared, StateChunk, Wiring};
use channels::{Incoming, OutItem, Outgoing};
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
    /// The newest snapshot ids this node has met, so an initiation cannot reuse one.
    seen: BTreeSet<SnapshotId>,
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
            seen: BTreeSet::new(),
            pending: VecDeque::new(),
            depth: 0,
            deferred: VecDeque::new(),
            epoch,
            restore_pending: None,
            events,
            shared,
        };
        this.take_up_channels(&wiring);
        this
    }

    /// Adds the wiring's channels this loop does not have yet.
    fn take_up_channels(&mut self, wiring: &Wiring) {
        let me = &self.shared.node_id;
        for channel in wiring.topology.incoming(me) {
            let handles = wiring.channels[&channel].clone();
            self.incoming
                .entry(channel)
                .or_insert_with(|| Incoming::new(handles));
        }
        for channel in wiring.topology.outgoing(me) {
            let handles = wiring.channels[&channel].clone();
            self.outgoing
                .entry(channel)
                .or_insert_with(|| Outgoing::new(handles));
        }
    }

    /// Drops the channels the wiring no longer has (their peer was removed): what is queued
    /// for it and what it sent that was not taken in yet are dropped and counted; messages of
    /// it already in the inbox are still delivered (they were received).
    fn drop_channels(&mut self, wiring: &Wiring) {
        let mut dropped = 0u64;
        let gone: Vec<ChannelId> = self
            .outgoing
            .keys()
            .filter(|c| !wiring.channels.contains_key(*c))
            .cloned()
            .collect();
        for channel in gone {
            let out = self.outgoing.remove(&channel).expect("listed");
            // A send waiting for room on it wakes and drops its message (counted there).
            out.handles.credits.close();
            let queued = out
                .queue
                .iter()
                .filter(|i| matches!(i, OutItem::Data { .. }))
                .count() as u64;
            tracing::warn!(%channel, queued, "channel removed: messages queued for its peer dropped");
            dropped += queued;
        }
        let gone: Vec<ChannelId> = self
            .incoming
            .keys()
            .filter(|c| !wiring.channels.contains_key(*c))
            .cloned()
            .collect();
        for channel in gone {
            let incoming = self.incoming.remove(&channel).expect("listed");
            // The peer stream's reader, if it waits for room, ends.
            incoming.handles.credits.close();
            let held = incoming
                .held
                .iter()
                .filter(|i| matches!(i, InItem::Data(_)))
                .count() as u64;
            tracing::warn!(%channel, held, "channel removed: messages of its peer not taken in dropped");
            dropped += held;
        }
        self.shared.metrics.removed_peer_messages.inc_by(dropped);
    }

    /// The membership changed: the new channels are taken up, those of removed members
    /// dropped, the wiring published, and snapshots in flight fail (they were planned over
    /// the old topology).
    fn rewire(&mut self, wiring: Arc<Wiring>, what: String) {
        tracing::info!(%what, channels = wiring.channels.len(), "membership changed");
        self.take_up_channels(&wiring);
        self.drop_channels(&wiring);
        *self.shared.wiring.write().expect("wiring lock") = wiring.clone();
        self.peers_changed = self.app.is_some();
        self.feed(Event::TopologyChanged {
            topology: wiring.topology.clone(),
            what,
        });
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
        (ready || self.peers_changed).then(|| app.tx.clone())
    }

    fn on_message(&mut self, msg: LoopMsg) {
        match msg {
            LoopMsg::InboundOpened {
                channel,
                incarnation,
                reply,
            } => {
                let received = self.on_inbound_opened(&channel, incarnation);
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
                max,
                reply,
            } => {
                if let Some(out) = self.outgoing.get_mut(&channel) {
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
            LoopMsg::CancelPull { channel } => {
                if let Some(out) = self.outgoing.get_mut(&channel) {
                    out.pending_pull = None;
                }
            }
            LoopMsg::Credit {
                channel,
                epoch,
                limit,
            } => self.on_credit(&channel, epoch, limit),
            LoopMsg::OutboundReset {
                channel,
                epoch,
                requeue,
                lost_markers,
            } => self.on_outbound_reset(channel, epoch, requeue, lost_markers),
            LoopMsg::AppAttach {
                session,
                packed,
                flow_key,
                tx,
                records,
                reply,
            } => {
                let _ = reply.send(self.attach_app(session, packed, flow_key, tx, records));
            }
            LoopMsg::AppSend { session, sends } => self.on_app_send(session, sends),
            LoopMsg::AppState {
                session,
                id,
                chunk,
                last,
            } => self.on_app_state(session, id, chunk, last),
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
                let result = if self.seen.contains(&id) || id.0 == 0 {
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

    /// Remembers a snapshot id as used (the newest 4,096), so an initiation cannot reuse it.
    fn remember(&mut self, id: SnapshotId) {
        self.seen.insert(id);
        while self.seen.len() > 4096 {
            self.seen.pop_first();
        }
    }

    /// Feeds one event, then every event its commands cause, executing commands in order.
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

    /// Feeds `event` once every command being executed has run (at once if none is).
    fn after_commands(&mut self, event: Event) {
        if self.depth > 0 {
            self.deferred.push_back(event);
        } else {
            self.feed(event);
        }
    }

    fn execute(&mut self, command: Command) {
        match command {
            Command::EnqueueRecordState { id, front } => {
                self.recordings.started(id);
                if self.app.is_none() {
                    tracing::warn!(snapshot = %id, "no application attached: snapshot fails here");
                    let reason = FailureReason::NoApplication(self.shared.node_id.clone());
                    self.pending
                        .push_back(Event::SnapshotAborted { id, reason });
                } else if front {
                    self.inbox.push_front(InboxItem::Record(id));
                } else {
                    self.inbox.push_back(InboxItem::Record(id));
                }
            }
            Command::SendMarker {
                channel,
                plan,
                front,
            } => {
                self.shared.metrics.marker("sent");
                self.remember(plan.id);
                let out = self.outgoing.get_mut(&channel).expect("outgoing channel");
                if front {
                    out.queue.push_front(OutItem::Marker(plan));
                } else {
                    out.queue.push_back(OutItem::Marker(plan));
                }
                self.serve_pull(&channel);
            }
            Command::RecordChannelMessages {
                id,
                channel,
                indices,
            } => {
                let mut messages = self.copy_messages(&channel, indices.clone());
                if crate::mutants::is(crate::mutants::Mutant::RecordOneTooFew) {
                    messages.pop();
                }
                self.shared
                    .metrics
                    .recorded_messages
                    .inc_by(messages.len() as u64);
                debug_assert!(
                    messages.len() as u64 == indices.end - indices.start
                        || crate::mutants::is(crate::mutants::Mutant::RecordOneTooFew)
                );
                self.recordings.record_messages(id, channel, messages);
            }
            Command::BlockChannel { channel } => {
                if let Some(incoming) = self.incoming.get_mut(&channel) {
                    incoming.blocked = true;
                }
            }
            Command::UnblockChannel { channel } => self.unblock(channel),
            Command::OvertakeMarker { id, channel } => {
                let out = self.outgoing.get_mut(&channel).expect("outgoing channel");
                if let Some(at) = out
                    .queue
                    .iter()
                    .position(|item| matches!(item, OutItem::Marker(plan) if plan.id == id))
                {
                    if let Some(OutItem::Marker(mut plan)) = out.queue.remove(at) {
                        plan.timed_out = true;
                        out.queue.push_front(OutItem::Marker(plan));
                    }
                    tracing::debug!(snapshot = %id, %channel, overtaken = at, "alignment timeout: the marker overtakes the queue");
                }
                self.serve_pull(&channel);
            }
            Command::ScheduleAlignmentTimeout {
                id,
                after,
                since_ms,
            } => {
                // Counted from the snapshot's start where known (a clock behind or far
                // ahead of the starter's only shortens or lengthens it, up to `after`).
                let elapsed = now_ms().saturating_sub(since_ms);
                let after = if since_ms == 0 {
                    after
                } else {
                    after.saturating_sub(std::time::Duration::from_millis(elapsed))
                };
                let tx = self.self_tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let _ = tx.send(LoopMsg::AlignmentTimedOut { id }).await;
                });
            }
            Command::ReportLocalDone { report } => {
                tracing::debug!(snapshot = %report.id, "local part complete");
                self.shared.metrics.outcome("completed");
                self.recordings.report(report);
            }
            Command::Abort { id, reason } => {
                tracing::warn!(snapshot = %id, %reason, "snapshot failed on this node");
                self.shared.metrics.outcome("failed");
                self.awaiting_state.remove(&id);
                self.recordings.fail(id, reason);
            }
        }
    }

    /// Copies the payloads of `indices` on `channel`: from the inbox for an incoming
    /// channel, from the outgoing queue for an outgoing one (the engine promises they are
    /// there). Searched from the back, where the newest messages are.
    fn copy_messages(
        &self,
        channel: &ChannelId,
        indices: std::ops::Range<u64>,
    ) -> Vec<(u64, Bytes)> {
        let mut found: Vec<(u64, Bytes)> =
            Vec::with_capacity((indices.end - indices.start) as usize);
        if let Some(incoming) = self.incoming.get(channel) {
            let generation = incoming.generation;
            for item in self.inbox.iter().rev() {
                if let InboxItem::Deliver {
                    channel: c,
                    generation: g,
                    index,
                    payload,
                    ..
                } = item
                    && c == channel
                    && *g == generation
                {
                    if *index < indices.start {
                        break;
                    }
                    if indices.contains(index) {
                        found.push((*index, payload.clone()));
                    }
                }
            }
        } else if let Some(out) = self.outgoing.get(channel) {
            for item in out.queue.iter().rev() {
                if let OutItem::Data { index, payload } = item {
                    if *index < indices.start {
                        break;
                    }
                    if indices.contains(index) {
                        found.push((*index, payload.clone()));
                    }
                }
            }
        }
        found.reverse();
        found
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
