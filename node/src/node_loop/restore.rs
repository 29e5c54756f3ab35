//! The node loop's side of a restore: entering a new epoch (everything of the old one is
//! dropped), handing the application its recorded state as its pieces come, and replaying
//! the recorded messages of its incoming channels ahead of any new traffic.
//!
//! The whole transition happens in one message of the loop, so nothing of the old epoch
//! can slip in between: the inbox, the held and queued frames and the snapshots in flight
//! go; every channel starts over (sequence numbers from 1, data indices from the replayed
//! count); the engine starts fresh, told that the replayed messages were sent, transmitted
//! and received before the epoch began, so both ends of a channel count them alike. The
//! epoch is published last: from then on the peer service accepts streams of the new
//! epoch only, and the sending tasks drop what they held and reconnect in it.
//!
//! The state is not part of that step: its pieces follow (`restore_piece`, `restore_end`)
//! and wait in the inbox's restore item, which nothing overtakes, until the application takes
//! them. If they break off (`restore_aborted`), the application drops what it was handed and
//! this node delivers nothing until a later restore: its application's state belongs to no
//! epoch of this one.

use bytes::Bytes;
use cairn_core::{ChannelId, Event, FailureReason, SnapshotEngine};

use super::events::NodeEvent;
use super::{InboxItem, NodeLoop, OutItem, RestoreData, RestorePending};

impl NodeLoop {
    /// Drops everything of the current epoch and enters `epoch`.
    fn enter_epoch(&mut self, epoch: u64) {
        let in_flight: Vec<_> = self.engine.in_flight().collect();
        for id in in_flight {
            self.feed(Event::SnapshotAborted {
                id,
                reason: FailureReason::Restore,
            });
        }
        let topology = self.shared.wiring().topology.clone();
        self.engine = SnapshotEngine::new(self.shared.node_id.clone(), topology);
        self.awaiting_state.clear();
        if let Some(app) = self.app.as_mut() {
            // Kept messages count on the old epoch's channels: no cut of the new one falls
            // before them.
            app.handed = super::handed::Handed::starting_at(app.window.counts().0);
        }
        let mut dropped = 0u64;
        for item in self.inbox.drain(..) {
            if let InboxItem::Deliver {
                channel,
                credited: true,
                ..
            } = item
            {
                dropped += 1;
                if let Some(incoming) = self.incoming.get(&channel) {
                    incoming.handles.credits.add_permits(1);
                }
            }
        }
        for incoming in self.incoming.values_mut() {
            let held = incoming
                .held
                .drain(..)
                .filter(|i| matches!(i, super::InItem::Data(_)))
                .count();
            incoming.handles.credits.add_permits(held);
            dropped += held as u64;
            incoming.received_seq = 0;
            incoming.generation += 1;
            incoming.next_index = 0;
            incoming.delivered_next = 0;
            incoming.blocked = false;
            // Whoever opens the channel first in the new epoch is not a restart of the
            // sender met before it (that would reset the replayed count).
            incoming.incarnation = 0;
        }
        for out in self.outgoing.values_mut() {
            let queued = out
                .queue
                .drain(..)
                .filter(|i| matches!(i, OutItem::Data { .. }))
                .count();
            out.handles.release(queued);
            dropped += queued as u64;
            out.next_index = 0;
            if out.credited {
                // The peer grants its credits afresh in the new epoch's handshake.
                out.credit_limit = 0;
            }
            if let Some(debloat) = out.debloat.as_mut() {
                debloat.restart();
            }
        }
        let channels: Vec<ChannelId> = self.incoming.keys().cloned().collect();
        for channel in &channels {
            self.regrant(channel, true);
        }
        self.shared.metrics.app_queue_depth.set(0);
        tracing::info!(
            from = self.epoch,
            to = epoch,
            dropped,
            "entered a new epoch: messages of the old one dropped"
        );
        self.epoch = epoch;
        self.shared.epoch.send_replace(epoch);
    }

    /// Restores a snapshot: see the module docs.
    pub(super) fn restore(&mut self, data: RestoreData) {
        if data.epoch <= self.epoch {
            tracing::warn!(
                restore = %data.restore_id,
                epoch = data.epoch,
                current = self.epoch,
                "a restore of an epoch already passed: ignored"
            );
            if data.epoch < self.epoch {
                // Say so now rather than let the coordinator wait out its deadline.
                self.tell(NodeEvent::RestoreFailed {
                    restore_id: data.restore_id,
                    message: format!(
                        "this node is already in epoch {}, after this restore's {}",
                        self.epoch, data.epoch
                    ),
                });
            }
            return;
        }
        if let Some(pending) = self.restore_pending.take()
            && !pending.aborted
        {
            self.tell(NodeEvent::RestoreFailed {
                restore_id: pending.restore_id,
                message: format!("superseded by restore {}", data.restore_id),
            });
        }
        self.enter_epoch(data.epoch);
        let fetch = data.feed.fetch;
        self.inbox.push_back(InboxItem::Restore {
            restore_id: data.restore_id.clone(),
            snapshot_id: data.snapshot_id,
            epoch: data.epoch,
            feed: data.feed,
        });
        let mut replayed = 0u64;
        for (channel, messages) in data.incoming {
            let Some(incoming) = self.incoming.get_mut(&channel) else {
                tracing::warn!(%channel, "recorded messages of a channel this node lacks: dropped");
                continue;
            };
            let count = messages.len() as u64;
            for payload in messages {
                self.inbox.push_back(InboxItem::Deliver {
                    channel: channel.clone(),
                    generation: incoming.generation,
                    index: incoming.next_index,
                    payload,
                    credited: false,
                });
                incoming.next_index += 1;
            }
            replayed += count;
            if count > 0 {
                self.feed(Event::DataReceived { channel, count });
            }
        }
        for (channel, count) in data.outgoing {
            let Some(out) = self.outgoing.get_mut(&channel) else {
                continue;
            };
            out.next_index = count;
            if count > 0 {
                self.feed(Event::DataQueued {
                    channel: channel.clone(),
                    count,
                });
                self.feed(Event::DataTransmitted { channel, count });
            }
        }
        self.shared
            .metrics
            .app_queue_depth
            .set(self.inbox.len() as i64);
        tracing::info!(
            restore = %data.restore_id,
            snapshot = data.snapshot_id,
            epoch = data.epoch,
            replayed,
            "restoring: the application gets its recorded state, then the replayed messages"
        );
        self.restore_pending = Some(RestorePending {
            restore_id: data.restore_id,
            session: None,
            fetch,
            aborted: false,
        });
    }

    /// The feed of fetch `fetch`, while its state is still on its way to the application.
    fn feed_of(&mut self, fetch: u64) -> Option<&mut super::RestoreFeed> {
        self.inbox.iter_mut().find_map(|item| match item {
            InboxItem::Restore { feed, .. } if feed.fetch == fetch => Some(feed),
            _ => None,
        })
    }

    /// The next piece of a restore's state.
    pub(super) fn restore_piece(&mut self, fetch: u64, piece: Bytes) {
        // None: the restore was dropped since (its fetch stops at its next piece), or this
        // fetch was not the one the loop took.
        if let Some(feed) = self.feed_of(fetch) {
            feed.push(piece);
        }
    }

    /// A restore's state is whole.
    pub(super) fn restore_end(&mut self, fetch: u64) {
        if let Some(feed) = self.feed_of(fetch) {
            feed.end();
        }
    }

    /// A restore's state broke off after this node entered its epoch (the fetch has told
    /// the coordinator). The application drops what it was handed of it, and nothing more is
    /// delivered until a later restore.
    pub(super) fn restore_aborted(&mut self, fetch: u64, reason: String) {
        let Some(pending) = &mut self.restore_pending else {
            return;
        };
        if pending.fetch != fetch || pending.aborted {
            return;
        }
        let restore_id = pending.restore_id.clone();
        pending.aborted = true;
        let handed = pending.session.is_some();
        self.inbox
            .retain(|item| !matches!(item, InboxItem::Restore { .. }));
        tracing::error!(
            restore = %restore_id,
            "restore aborted: {reason}; this node delivers nothing until the next restore"
        );
        if handed {
            self.inbox
                .push_front(InboxItem::RestoreAborted { restore_id, reason });
        }
    }

    /// The coordinator names, at registration, an epoch this node may enter as it is (it
    /// does so only for a daemon new to the cluster: one behind a restore is sent the
    /// restore instead, and enters its epoch only with its state). Never a lower epoch: its
    /// fence would let frames of a past epoch in again (the coordinator's epochs only grow;
    /// a lower one comes from a stale answer).
    pub(super) fn adopt_epoch(&mut self, epoch: u64) {
        if epoch == self.epoch {
            return;
        }
        if epoch < self.epoch {
            tracing::warn!(
                at = self.epoch,
                offered = epoch,
                "the coordinator named a past epoch to enter: ignored"
            );
            return;
        }
        tracing::info!(
            from = self.epoch,
            to = epoch,
            "entering the cluster's epoch as a new member"
        );
        self.enter_epoch(epoch);
    }

    /// The restored state (or its first piece) went to this application session.
    pub(super) fn restore_handed(&mut self, session: u64) {
        if let Some(pending) = &mut self.restore_pending {
            pending.session = Some(session);
        }
    }

    /// The application applied the restored state.
    pub(super) fn on_restore_applied(&mut self, session: u64, restore_id: String) {
        match &self.restore_pending {
            Some(p) if p.restore_id == restore_id && p.session == Some(session) && !p.aborted => {}
            _ => {
                tracing::debug!(restore = %restore_id, "RestoreApplied for no pending restore: ignored");
                return;
            }
        }
        self.restore_pending = None;
        tracing::info!(restore = %restore_id, "the application applied the restored state");
        self.tell(NodeEvent::RestoreApplied { restore_id });
    }

    /// The application left before applying a restored state it was handed: the restore
    /// fails here (its state is gone with that session).
    pub(super) fn restore_abandoned(&mut self, session: u64) {
        if let Some(p) = &mut self.restore_pending
            && p.session == Some(session)
            && !p.aborted
        {
            // As a restore broken off: the next application gets nothing until a later
            // restore, since this node is in an epoch whose state it never applied.
            let restore_id = p.restore_id.clone();
            p.aborted = true;
            self.inbox
                .retain(|item| !matches!(item, InboxItem::Restore { .. }));
            tracing::error!(restore = %restore_id, "the application detached before applying the restored state");
            self.tell(NodeEvent::RestoreFailed {
                restore_id,
                message: "the application detached before applying the restored state".into(),
            });
        }
    }

    /// Whether the application's sends are void: it has not applied a restore it must.
    pub(super) fn sends_void(&self) -> bool {
        self.restore_pending.is_some()
    }

    fn tell(&self, event: NodeEvent) {
        self.events.tell(event);
    }
}
