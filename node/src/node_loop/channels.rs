//! The node loop's side of the peer channels: frames coming in (in order, without
//! duplicates, held back while blocked) and frames going out (pulled by each channel's
//! sending task).

use bytes::Bytes;
use cairn_core::{ChannelId, Event};
use cairn_proto::v1 as pb;

use super::{HoldFault, InItem, InboxItem, NodeLoop, OutFrame, OutItem};

impl NodeLoop {
    /// A peer (re)opened a channel. A new incarnation of the peer means it restarted: the
    /// channel starts over, and the snapshots in flight here fail naming it.
    ///
    /// `None`: the handshake was checked in an epoch this node has left since; the stream
    /// is refused as any of another epoch (a reset here would undo the new epoch's start).
    pub(super) fn on_inbound_opened(
        &mut self,
        channel: &ChannelId,
        incarnation: u64,
        epoch: u64,
    ) -> Option<u64> {
        if epoch != self.epoch {
            return None;
        }
        let Some(incoming) = self.incoming.get_mut(channel) else {
            return Some(0);
        };
        if incoming.incarnation != 0 && incoming.incarnation != incarnation {
            tracing::warn!(%channel, old = incoming.incarnation, new = incarnation, "peer restarted: resetting channel");
            let held = incoming
                .held
                .drain(..)
                .filter(|i| matches!(i, InItem::Data(_)))
                .count();
            incoming.received_seq = 0;
            incoming.generation += 1;
            incoming.next_index = 0;
            incoming.delivered_next = 0;
            incoming.blocked = false;
            incoming.incarnation = incarnation;
            incoming.handles.credits.add_permits(held);
            self.regrant(channel, true);
            self.feed(Event::ChannelReset {
                channel: channel.clone(),
            });
        }
        let incoming = self.incoming.get_mut(channel).expect("checked");
        incoming.incarnation = incarnation;
        Some(incoming.received_seq)
    }

    pub(super) fn on_inbound_frames(
        &mut self,
        channel: ChannelId,
        incarnation: u64,
        epoch: u64,
        first_seq: u64,
        items: Vec<InItem>,
    ) -> bool {
        let Some(incoming) = self.incoming.get_mut(&channel) else {
            // Its peer was removed while the stream was open: the stream ends.
            return false;
        };
        let credits = incoming.handles.clone();
        let credits = &credits.credits;
        if incoming.incarnation != incarnation || epoch != self.epoch {
            // A stream of an incarnation already replaced, or of another epoch: its
            // frames are void.
            credits.add_permits(
                items
                    .iter()
                    .filter(|i| matches!(i, InItem::Data(_)))
                    .count(),
            );
            return false;
        }
        let mut fresh = Vec::with_capacity(items.len());
        for (i, item) in items.into_iter().enumerate() {
            let seq = first_seq + i as u64;
            if seq <= incoming.received_seq {
                if matches!(item, InItem::Data(_)) {
                    credits.add_permits(1); // a resent duplicate
                }
                continue;
            }
            incoming.received_seq = seq;
            fresh.push(item);
        }
        let incoming = self.incoming.get_mut(&channel).expect("present");
        incoming.held.extend(fresh);
        self.take_in(&channel);
        true
    }

    /// Moves frames from the channel's held queue into the inbox until it is empty or the
    /// channel is blocked. Data runs are reported to the engine as one event each.
    fn take_in(&mut self, channel: &ChannelId) {
        loop {
            let incoming = self.incoming.get_mut(channel).expect("present");
            let mut run = 0u64;
            while incoming.may_take() && matches!(incoming.held.front(), Some(InItem::Data(_))) {
                let Some(InItem::Data(payload)) = incoming.held.pop_front() else {
                    unreachable!()
                };
                incoming.took();
                self.inbox.push_back(InboxItem::Deliver {
                    channel: channel.clone(),
                    generation: incoming.generation,
                    index: incoming.next_index,
                    payload,
                    credited: true,
                });
                incoming.next_index += 1;
                incoming.data_messages += 1;
                run += 1;
            }
            let marker = match incoming.held.front() {
                Some(InItem::Marker(_)) if incoming.may_take() => {
                    incoming.took();
                    incoming.markers += 1;
                    match incoming.held.pop_front() {
                        Some(InItem::Marker(plan)) => Some(plan),
                        _ => unreachable!(),
                    }
                }
                _ => None,
            };
            if run > 0 {
                self.shared.metrics.messages("received", run);
                self.shared
                    .metrics
                    .app_queue_depth
                    .set(self.inbox.len() as i64);
                self.feed(Event::DataReceived {
                    channel: channel.clone(),
                    count: run,
                });
            }
            match marker {
                Some(plan) => {
                    self.shared.metrics.marker("received");
                    self.remember(plan.id);
                    self.feed(Event::MarkerReceived {
                        channel: channel.clone(),
                        plan,
                    });
                }
                None => return,
            }
        }
    }

    /// Fault injection on an incoming channel: hold its frames, let `n` through, resume.
    /// False if the loop has no such channel (its peer was removed meanwhile).
    pub(super) fn fault(&mut self, channel: &ChannelId, fault: HoldFault) -> bool {
        let Some(incoming) = self.incoming.get_mut(channel) else {
            return false;
        };
        match fault {
            HoldFault::Hold => {
                incoming.fault_hold = true;
                incoming.release = 0;
            }
            HoldFault::Release(n) => incoming.release = incoming.release.saturating_add(n),
            HoldFault::Resume => {
                incoming.fault_hold = false;
                incoming.release = 0;
            }
        }
        tracing::info!(%channel, ?fault, "fault injected");
        self.take_in(channel);
        true
    }

    pub(super) fn unblock(&mut self, channel: ChannelId) {
        if let Some(incoming) = self.incoming.get_mut(&channel) {
            incoming.blocked = false;
            self.take_in(&channel);
        }
    }

    /// Credits of an incoming channel: the sender may transmit data up to `delivered` plus
    /// the room the application's pace allows (`flow`). Within one life of the channel the
    /// limit only grows; a `reset` (new incarnation or epoch) starts it over.
    pub(super) fn regrant(&mut self, channel: &ChannelId, reset: bool) {
        let Some(incoming) = self.incoming.get(channel) else {
            return;
        };
        let handles = &incoming.handles;
        let channels = self.incoming.len();
        let room = self.app.as_ref().map_or(handles.buffer, |app| {
            app.window.peer_room(handles.buffer, channels)
        });
        let mut limit = incoming.delivered_next.saturating_add(room);
        if !reset {
            limit = limit.max(*handles.grant.borrow());
        }
        handles.set_grant(limit);
    }

    /// The sender's end of credit-based flow control: the peer granted data up to index
    /// `limit` (`u64::MAX`: a peer without credits).
    pub(super) fn on_credit(&mut self, channel: &ChannelId, epoch: u64, limit: u64) {
        if epoch != self.epoch {
            return; // granted in an epoch this node has left
        }
        if let Some(out) = self.outgoing.get_mut(channel) {
            if let Some(debloat) = out.debloat.as_mut() {
                if limit == u64::MAX {
                    // A peer without credits: nothing to measure, no bound.
                    debloat.unbounded();
                } else {
                    // Data was waiting for this credit: the newest queued is past the old
                    // limit.
                    let held = out.queue.iter().rev().find_map(|item| match item {
                        OutItem::Data { index, .. } => Some(*index >= out.credit_limit),
                        OutItem::Marker(_) => None,
                    });
                    debloat.granted(limit, held == Some(true), std::time::Instant::now());
                }
                let bound = debloat.bound(out.handles.buffer);
                if bound != out.handles.bound() {
                    out.handles.bound_to(bound);
                }
            }
            out.credit_limit = limit;
            out.credited = limit != u64::MAX;
            self.serve_pull(channel);
        }
    }

    /// Answers the channel's waiting pull, if any, with what its queue holds: markers
    /// always, data only within the peer's credits.
    /// Whether `link` is the handles of `channel` as wired now: an outgoing channel's task
    /// sends them with what it says, and one left over from before the channel was removed
    /// and added again (its shutdown not yet seen) must not take the new task's pull, grant
    /// its credits or reset it.
    pub(super) fn is_current(
        &self,
        channel: &ChannelId,
        link: &std::sync::Arc<crate::shared::ChannelHandles>,
    ) -> bool {
        self.outgoing
            .get(channel)
            .is_some_and(|out| std::sync::Arc::ptr_eq(&out.handles, link))
    }

    pub(super) fn serve_pull(&mut self, channel: &ChannelId) {
        let Some(out) = self.outgoing.get_mut(channel) else {
            return; // removed
        };
        if out.pending_pull.is_none() {
            return;
        }
        let limit = out.credit_limit;
        let sendable = |item: &OutItem| match item {
            OutItem::Data { index, .. } => *index < limit,
            OutItem::Marker(_) => true,
        };
        let max = out.pending_pull.as_ref().expect("checked").0;
        let n = out
            .queue
            .iter()
            .take(max)
            .take_while(|item| sendable(item))
            .count();
        if n == 0 {
            return;
        }
        let (_, reply) = out.pending_pull.take().expect("checked");
        let mut frames = Vec::with_capacity(n);
        let mut data = 0u64;
        let mut markers = Vec::new();
        for item in out.queue.drain(..n) {
            frames.push(match item {
                OutItem::Data { payload, .. } => {
                    data += 1;
                    OutFrame::Data(payload)
                }
                OutItem::Marker(plan) => {
                    markers.push(plan.id);
                    out.markers += 1;
                    OutFrame::Marker(plan)
                }
            });
        }
        if reply
            .send(super::Pulled {
                epoch: self.epoch,
                frames,
            })
            .is_err()
        {
            // The sending task is gone: the daemon is stopping.
            tracing::debug!(%channel, "pull answered after its task ended");
        }
        if data > 0 {
            self.feed(Event::DataTransmitted {
                channel: channel.clone(),
                count: data,
            });
        }
        for id in markers {
            self.after_commands(Event::MarkerTransmitted {
                channel: channel.clone(),
                id,
            });
        }
    }

    /// The peer restarted: what it never acknowledged goes out again, ahead of the queue,
    /// renumbered from 0; markers are dropped. Snapshots in flight here fail (the engine
    /// aborts them), and so do snapshots already complete here whose marker the peer never
    /// got: their cut on this channel is lost with the peer's old incarnation.
    pub(super) fn on_outbound_reset(
        &mut self,
        channel: ChannelId,
        link: &std::sync::Arc<crate::shared::ChannelHandles>,
        epoch: u64,
        requeue: Vec<Bytes>,
        lost_markers: Vec<cairn_core::SnapshotId>,
    ) {
        if !self.is_current(&channel, link) {
            // Its peer was removed (and maybe added again since: this is the old member's
            // task, not the new one's): what the task held, and handed back here, is
            // dropped, its credits given back to its own handles.
            link.release(requeue.len());
            tracing::warn!(%channel, dropped = requeue.len(), "peer removed: messages it never acknowledged dropped");
            self.shared
                .metrics
                .removed_peer_messages
                .inc_by(requeue.len() as u64);
            return;
        }
        if epoch != self.epoch {
            // A reset of an epoch this node has left (the sending task found the peer's
            // new incarnation before it saw the node move on). The new epoch started the
            // channel over already, and a restore set its count to the replayed messages:
            // resetting it again would number the next messages from 0 while the peer
            // counts from the replayed ones, and every later cut would disagree. What the
            // task handed back is of the old epoch: dropped like the rest of it. So are its
            // markers, failing nothing: their snapshots were settled with that epoch (one
            // may be the very snapshot just restored, its marker delivered and only the
            // acknowledgement lost).
            self.outgoing[&channel].handles.release(requeue.len());
            tracing::debug!(%channel, epoch, now = self.epoch, markers = lost_markers.len(), "a reset of a past epoch ignored");
            return;
        }
        self.feed(Event::ChannelReset {
            channel: channel.clone(),
        });
        let mut lost: std::collections::BTreeSet<cairn_core::SnapshotId> =
            lost_markers.into_iter().collect();
        for item in &self.outgoing[&channel].queue {
            if let OutItem::Marker(plan) = item {
                lost.insert(plan.id);
            }
        }
        for id in lost {
            let reason = cairn_core::FailureReason::ChannelReset(channel.clone());
            self.recordings.fail_completed(id, reason);
        }
        let out = self.outgoing.get_mut(&channel).expect("outgoing channel");
        let queued: Vec<Bytes> = out
            .queue
            .drain(..)
            .filter_map(|item| match item {
                OutItem::Data { payload, .. } => Some(payload),
                OutItem::Marker(_) => None,
            })
            .collect();
        out.next_index = 0;
        if out.credited {
            // The restarted peer grants its credits afresh (its handshake's answer).
            out.credit_limit = 0;
        }
        if let Some(debloat) = out.debloat.as_mut() {
            debloat.restart();
        }
        for payload in requeue.into_iter().chain(queued) {
            out.queue.push_back(OutItem::Data {
                index: out.next_index,
                payload,
            });
            out.next_index += 1;
        }
        let count = out.next_index;
        if count > 0 {
            self.feed(Event::DataQueued {
                channel: channel.clone(),
                count,
            });
        }
        self.serve_pull(&channel);
    }

    pub(super) fn status(&self) -> pb::NodeStatus {
        let mut channels = Vec::new();
        for (channel, incoming) in &self.incoming {
            channels.push(pb::ChannelStatus {
                channel: Some(channel.into()),
                connected: incoming.incarnation != 0,
                unacked_frames: 0,
                data_messages: incoming.data_messages,
                reconnects: 0,
                held: incoming.blocked || incoming.fault_hold,
                queued: incoming.held.len() as u64,
                credit_limit: *incoming.handles.grant.borrow(),
                next_index: incoming.delivered_next,
                markers: incoming.markers,
                alignment_blocked: incoming.blocked,
                fault_held: incoming.fault_hold,
                release_budget: if incoming.fault_hold {
                    incoming.release
                } else {
                    0
                },
                next_held: match incoming.held.front() {
                    None => pb::FrameKind::None,
                    Some(InItem::Data(_)) => pb::FrameKind::Data,
                    Some(InItem::Marker(_)) => pb::FrameKind::Marker,
                } as i32,
            });
        }
        // The backlog gauges (a removed peer's goes with its channel: `drop_channels`).
        let queued = &self.shared.metrics.channel_queued;
        for (channel, out) in &self.outgoing {
            let stats = &out.handles.stats;
            use std::sync::atomic::Ordering::Relaxed;
            queued
                .get_or_create(&crate::metrics::PeerLabel {
                    to: channel.to.to_string(),
                })
                .set(i64::try_from(out.queue.len()).unwrap_or(i64::MAX));
            channels.push(pb::ChannelStatus {
                channel: Some(channel.into()),
                connected: stats.connected.load(Relaxed),
                unacked_frames: stats.unacked.load(Relaxed) + out.queue.len() as u64,
                data_messages: out.data_messages,
                reconnects: stats.reconnects.load(Relaxed),
                held: false,
                queued: out.queue.len() as u64,
                credit_limit: out.credit_limit,
                next_index: out.next_index,
                markers: out.markers,
                ..Default::default()
            });
        }
        pb::NodeStatus {
            node_id: self.shared.node_id.to_string(),
            cluster: self.shared.cluster.clone(),
            incarnation: self.shared.incarnation,
            epoch: self.epoch,
            application_attached: self.app.is_some(),
            inbox_depth: self.inbox.len() as u64,
            channels,
            snapshots_in_flight: self.engine.in_flight().map(|id| id.0).collect(),
            delivery_window: self.app.as_ref().map(|app| pb::DeliveryWindowStatus {
                records_pending: app.records.count(),
                ..app.window.status()
            }),
        }
    }
}
