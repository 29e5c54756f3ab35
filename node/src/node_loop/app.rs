//! The node loop's side of the application session: attaching, the application's sends
//! and recorded states, and handing it the inbox in order.

use std::collections::BTreeMap;

use bytes::Bytes;
use cairn_core::{ChannelId, Event, FailureReason, SnapshotId};
use cairn_proto::v1 as pb;
use tokio::sync::mpsc::OwnedPermit;
use tonic::Status;

use super::{
    App, AppTx, DELIVER_BATCH, DELIVER_BATCH_BYTES, InboxItem, NodeLoop, OutItem, StateChunk,
};
use crate::error::Error;

impl NodeLoop {
    /// Attaches an application. The loop itself puts `Attached` first on the session's
    /// stream, so that no delivery can precede it.
    /// `attach`: the session, whether it takes deliveries as runs, its flow key, and whether
    /// it acknowledges deliveries.
    pub(super) fn attach_app(
        &mut self,
        attach: (u64, bool, u64, bool),
        tx: AppTx,
        records: std::sync::Arc<super::RecordsDue>,
    ) -> Result<(), Error> {
        let (session, packed, flow_key, acknowledges) = attach;
        if self.app.is_some() {
            return Err(Error::AlreadyAttached(self.shared.node_id.clone()));
        }
        let attached = pb::Attached {
            node_id: self.shared.node_id.to_string(),
            cluster: self.shared.cluster.clone(),
            peers: self.outgoing.keys().map(|c| c.to.to_string()).collect(),
            incarnation: self.shared.incarnation,
            session,
            flow_key,
        };
        let hello = pb::NodeToApp {
            kind: Some(pb::node_to_app::Kind::Attached(attached)),
        };
        tx.try_send(Ok(hello)).map_err(|_| Error::ShuttingDown)?;
        tracing::info!(session, "application attached");
        self.app = Some(App {
            session,
            packed,
            tx,
            // No window until the application's `Consumed` stream opens.
            window: super::flow::DeliveryWindow::new(false),
            records,
            handed: super::handed::Handed::default(),
            window_pending: acknowledges,
        });
        self.peers_changed = false;
        Ok(())
    }

    /// The application left (or its stream broke). Snapshots waiting for its state fail:
    /// the state they need is gone.
    pub(super) fn detach_app(&mut self, session: Option<u64>) {
        match (&self.app, session) {
            (Some(app), Some(s)) if app.session != s => return,
            (None, _) => return,
            _ => {}
        }
        tracing::info!("application detached");
        self.outcomes.detach();
        if let Some(app) = self.app.take() {
            self.restore_abandoned(app.session);
        }
        let mut waiting: Vec<SnapshotId> = std::mem::take(&mut self.awaiting_state)
            .into_iter()
            .collect();
        self.inbox.retain(|item| match item {
            InboxItem::Record(id) => {
                waiting.push(*id);
                false
            }
            InboxItem::Deliver { .. }
            | InboxItem::Restore { .. }
            | InboxItem::RestoreAborted { .. } => true,
        });
        for id in waiting {
            let reason = FailureReason::NoApplication(self.shared.node_id.clone());
            self.feed(Event::SnapshotAborted { id, reason });
        }
    }

    pub(super) fn on_app_send(&mut self, session: u64, sends: Vec<(ChannelId, Bytes)>) {
        if self.app.as_ref().map(|a| a.session) != Some(session) || self.sends_void() {
            // A session already replaced, or an application that has not applied the
            // restored state yet (it sent these from its old one): never queued.
            for (channel, _) in &sends {
                if let Some(out) = self.outgoing.get(channel) {
                    out.handles.release(1);
                }
            }
            return;
        }
        let mut counts: BTreeMap<ChannelId, u64> = BTreeMap::new();
        for (channel, payload) in sends {
            let Some(out) = self.outgoing.get_mut(&channel) else {
                // The peer was removed after the session checked the send.
                tracing::warn!(%channel, "a send to a removed peer: dropped");
                self.shared.metrics.removed_peer_messages.inc();
                continue;
            };
            out.queue.push_back(OutItem::Data {
                index: out.next_index,
                payload,
            });
            out.next_index += 1;
            out.data_messages += 1;
            *counts.entry(channel).or_default() += 1;
        }
        let sent: u64 = counts.values().sum();
        self.shared.metrics.messages("sent", sent);
        for (channel, count) in counts {
            self.feed(Event::DataQueued {
                channel: channel.clone(),
                count,
            });
            self.serve_pull(&channel);
        }
    }

    /// The session's `Consumed` stream opened or ended: the delivery window applies from
    /// now on, or no more (the counts so far stay; the application's are cumulative).
    pub(super) fn app_window(&mut self, session: u64, on: bool) {
        let Some(app) = self.app.as_mut().filter(|a| a.session == session) else {
            return; // a session already replaced
        };
        if on {
            tracing::debug!(
                session,
                "the application acknowledges deliveries: a delivery window applies"
            );
        } else {
            tracing::warn!(
                session,
                "the application's flow-control stream ended: no delivery window from now on"
            );
        }
        app.window.acknowledged(on);
        app.window_pending = false;
        if !on {
            // No counts come any more to let kept messages go: none is kept from here.
            app.handed = super::handed::Handed::starting_at(app.window.counts().0);
        }
        let channels: Vec<ChannelId> = self.incoming.keys().cloned().collect();
        for channel in &channels {
            self.regrant(channel, false);
        }
    }

    /// The application consumed deliveries: the window moves on, and its size (and the
    /// incoming channels' credits) follow the application's measured pace.
    pub(super) fn on_app_consumed(&mut self, session: u64, messages: u64, bytes: u64) {
        let Some(app) = self.app.as_mut().filter(|a| a.session == session) else {
            return; // a session already replaced
        };
        let before = app.window.peer_room(u64::MAX, 1);
        app.window
            .consumed(messages, bytes, std::time::Instant::now());
        app.handed.consumed(app.window.counts().1);
        if app.window.peer_room(u64::MAX, 1) != before {
            let channels: Vec<ChannelId> = self.incoming.keys().cloned().collect();
            for channel in &channels {
                self.regrant(channel, false);
            }
        }
    }

    /// A chunk of recorded state. The first chunk is the cut: the engine learns of it
    /// then, with the messages handed over and not consumed at it if the application cut
    /// at the request's early copy. The part completes once the last chunk is in.
    pub(super) fn on_app_state(
        &mut self,
        session: u64,
        id: SnapshotId,
        chunk: StateChunk,
        last: bool,
        consumed: Option<u64>,
    ) {
        if self.app.as_ref().map(|a| a.session) != Some(session)
            || !self.awaiting_state.contains(&id)
        {
            tracing::debug!(snapshot = %id, "state for a snapshot not awaiting one: ignored");
            return;
        }
        if self.recordings.state_chunk(id, chunk) {
            let incoming = &self.incoming;
            let app = self.app.as_mut().expect("the session's");
            let cut = app
                .handed
                .cut(id, consumed, |c| incoming.get(c).map(|i| i.generation));
            match cut {
                Ok(unconsumed) => {
                    let early: u64 = unconsumed.iter().map(|(_, n)| n).sum();
                    if early > 0 {
                        self.shared.metrics.early_cut_messages.inc_by(early);
                        tracing::debug!(snapshot = %id, unconsumed = early, "the application cut at the early request");
                    }
                    self.feed(Event::StateRecorded { id, unconsumed });
                }
                Err(why) => {
                    let reason = FailureReason::BadCut {
                        node: self.shared.node_id.clone(),
                        why,
                    };
                    self.feed(Event::SnapshotAborted { id, reason });
                }
            }
            if let Some(app) = self.app.as_mut() {
                app.handed.consumed(app.window.counts().1);
            }
        }
        if last {
            self.awaiting_state.remove(&id);
            self.recordings.state_done(id);
        }
    }

    /// Hands the application the front of the inbox: a record request alone, or a batch
    /// of messages up to the next record request.
    pub(super) fn deliver(&mut self, permit: OwnedPermit<Result<pb::NodeToApp, Status>>) {
        use pb::node_to_app::Kind;
        if self.peers_changed {
            self.peers_changed = false;
            let peers = self.outgoing.keys().map(|c| c.to.to_string()).collect();
            let kind = Kind::Peers(pb::Peers { peers });
            permit.send(Ok(pb::NodeToApp { kind: Some(kind) }));
            return;
        }
        // A snapshot's end, stored by the coordinator: ahead of deliveries, which it
        // concerns no more than the timing of its telling.
        if let (Some(outcome), ask) = self.outcomes.next_due() {
            let id = outcome.snapshot.0;
            let kind = match outcome.failure {
                None => Kind::SnapshotCompleted(pb::SnapshotCompleted { snapshot_id: id }),
                Some(reason) => Kind::SnapshotAborted(pb::SnapshotAborted {
                    snapshot_id: id,
                    reason,
                }),
            };
            permit.send(Ok(pb::NodeToApp { kind: Some(kind) }));
            self.ask_outcomes(ask);
            return;
        }
        if let Some(InboxItem::Restore {
            restore_id,
            snapshot_id,
            epoch,
            feed,
        }) = self.inbox.front_mut()
        {
            // Only called with a piece ready (see `deliverable`).
            let (chunk, last) = feed.next();
            let restore = pb::Restore {
                restore_id: restore_id.clone(),
                snapshot_id: *snapshot_id,
                epoch: *epoch,
                chunk,
                last,
            };
            permit.send(Ok(pb::NodeToApp {
                kind: Some(Kind::Restore(restore)),
            }));
            if last {
                self.inbox.pop_front();
            }
            if let Some(session) = self.app.as_ref().map(|a| a.session) {
                self.restore_handed(session);
            }
            return;
        }
        if let Some(InboxItem::RestoreAborted { .. }) = self.inbox.front() {
            let Some(InboxItem::RestoreAborted { restore_id, reason }) = self.inbox.pop_front()
            else {
                unreachable!()
            };
            let aborted = pb::RestoreAborted { restore_id, reason };
            permit.send(Ok(pb::NodeToApp {
                kind: Some(Kind::RestoreAborted(aborted)),
            }));
            return;
        }
        if let Some(InboxItem::Record(id)) = self.inbox.front() {
            let id = *id;
            self.inbox.pop_front();
            let early_copy = self.app.as_mut().is_some_and(|app| {
                let handed = app.window.counts().0;
                app.handed.asked_in_band(id, handed)
            });
            if !self.engine.in_flight().any(|x| x == id) {
                // Aborted while the request waited in the inbox: the application need not
                // record anything for it.
                if let Some(app) = self.app.as_mut() {
                    app.handed.forget(id);
                }
                return;
            }
            // Asked already by the early copy (and perhaps answered).
            if !early_copy {
                self.asked_for_state(id);
            }
            let kind = Kind::RecordState(pb::RecordState {
                snapshot_id: id.0,
                early_copy,
            });
            permit.send(Ok(pb::NodeToApp { kind: Some(kind) }));
            return;
        }
        let packed = self.app.as_ref().is_some_and(|a| a.packed);
        // Within the delivery window (only called with room in it; see `deliverable`).
        let (most, most_bytes) = self.app.as_ref().and_then(|a| a.window.room()).map_or(
            (DELIVER_BATCH, DELIVER_BATCH_BYTES),
            |(m, b)| {
                (
                    DELIVER_BATCH.min(m as usize).max(1),
                    DELIVER_BATCH_BYTES.min(b as usize),
                )
            },
        );
        let mut messages = Vec::new();
        let mut runs = cairn_proto::runs::RunBuilder::default();
        let mut count = 0usize;
        let mut counts: BTreeMap<ChannelId, u64> = BTreeMap::new();
        let mut bytes = 0;
        while count < most && (count == 0 || bytes < most_bytes) {
            match self.inbox.front() {
                Some(InboxItem::Deliver { .. }) => {}
                _ => break,
            }
            let Some(InboxItem::Deliver {
                channel,
                generation,
                index,
                payload,
                credited,
            }) = self.inbox.pop_front()
            else {
                unreachable!()
            };
            // A channel removed since is not counted (nor credited) any more.
            if let Some(incoming) = self.incoming.get_mut(&channel) {
                if credited {
                    incoming.handles.credits.add_permits(1);
                }
                if incoming.generation == generation {
                    *counts.entry(channel.clone()).or_default() += 1;
                    incoming.delivered_next = index + 1;
                }
            }
            bytes += payload.len();
            count += 1;
            if !packed {
                if let Some(app) = self.app.as_mut() {
                    let at = app.window.counts().0 + count as u64 - 1;
                    let keep = app.keeps_handed();
                    app.handed
                        .push(at, keep, &channel, generation, index, &payload);
                }
                messages.push(pb::Deliver {
                    from: channel.from.to_string(),
                    payload,
                });
                continue;
            }
            if let Some(app) = self.app.as_mut() {
                let at = app.window.counts().0 + count as u64 - 1;
                let keep = app.keeps_handed();
                app.handed
                    .push(at, keep, &channel, generation, index, &payload);
            }
            // Consecutive messages from one node share a run: one blob plus lengths.
            runs.push(channel.from, payload);
        }
        let runs = runs
            .finish()
            .map(|(from, payloads, lengths)| pb::DeliverRun {
                from: from.to_string(),
                payloads,
                lengths,
            })
            .collect();
        permit.send(Ok(pb::NodeToApp {
            kind: Some(Kind::Deliver(pb::DeliverBatch { messages, runs })),
        }));
        self.shared
            .metrics
            .app_queue_depth
            .set(self.inbox.len() as i64);
        if let Some(app) = self.app.as_mut() {
            app.window.handed(count as u64, bytes as u64);
        }
        for (channel, count) in counts {
            self.regrant(&channel, false);
            self.feed(Event::DataDelivered { channel, count });
        }
    }
}

impl NodeLoop {
    /// The application is asked for `id`'s state: it is awaited, and its session reads
    /// ahead of blocked sends until it comes.
    fn asked_for_state(&mut self, id: SnapshotId) {
        self.awaiting_state.insert(id);
        if let Some(app) = &self.app {
            app.records.asked(id);
        }
    }

    /// A record request that overtook the inbox also goes ahead of what the application
    /// was handed: on its `App/Consumed` stream, when it has one and runs on a state of
    /// this epoch (module `handed`).
    pub(super) fn ask_early(&mut self, id: SnapshotId) {
        if self.restore_pending.is_some() {
            return;
        }
        let Some(app) = self.app.as_mut().filter(|a| a.window.acknowledges()) else {
            return;
        };
        let (handed, consumed) = app.window.counts();
        app.handed.asked_early(id, handed, consumed);
        app.records.send_early(id);
        self.asked_for_state(id);
    }
}

impl App {
    /// Whether a message handed over now is kept for a cut at an early request: while the
    /// delivery window applies, and while the application's `Consumed` stream is still to
    /// open (it attached acknowledging deliveries; the daemon hands the inbox over in the
    /// meantime), up to the largest window ([`super::flow::APP_MAX`] messages,
    /// [`super::flow::APP_MAX_BYTES`] bytes): an application that never opens the stream
    /// holds no more than that here.
    fn keeps_handed(&self) -> bool {
        if self.window.acknowledges() {
            return true;
        }
        if !self.window_pending {
            return false;
        }
        let (messages, bytes) = self.handed.size();
        messages < super::flow::APP_MAX && bytes < super::flow::APP_MAX_BYTES
    }
}
