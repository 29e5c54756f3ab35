//! The loop's channels follow the wiring: taken up when the membership adds them, dropped
//! (with what they held) when it takes them away.

use super::*;

impl NodeLoop {
    /// Adds the wiring's channels this loop does not have yet.
    pub(super) fn take_up_channels(&mut self, wiring: &Wiring) {
        let me = &self.shared.node_id;
        for channel in wiring.topology.incoming(me) {
            let handles = wiring.channels[&channel].clone();
            self.incoming
                .entry(channel)
                .or_insert_with(|| Incoming::new(handles));
        }
        let queue_target = self.shared.queue_target;
        for channel in wiring.topology.outgoing(me) {
            let handles = wiring.channels[&channel].clone();
            self.outgoing
                .entry(channel)
                .or_insert_with(|| Outgoing::new(handles, queue_target));
        }
    }

    /// Drops the channels the wiring no longer has (their peer was removed): what is queued
    /// for it and what it sent that was not taken in yet are dropped and counted; messages of
    /// it already in the inbox are still delivered (they were received).
    pub(super) fn drop_channels(&mut self, wiring: &Wiring) {
        let mut dropped = 0u64;
        let gone: Vec<ChannelId> = self
            .outgoing
            .keys()
            .filter(|c| !wiring.channels.contains_key(*c))
            .cloned()
            .collect();
        for channel in gone {
            let out = self.outgoing.remove(&channel).expect("listed");
            self.shared
                .metrics
                .channel_queued
                .remove(&crate::metrics::PeerLabel {
                    to: channel.to.to_string(),
                });
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
    pub(super) fn rewire(&mut self, wiring: Arc<Wiring>, what: String) {
        tracing::info!(%what, channels = wiring.channels.len(), "membership changed");
        self.take_up_channels(&wiring);
        self.drop_channels(&wiring);
        *self.shared.wiring.write().expect("wiring lock") = wiring.clone();
        self.peers_changed = self.app.is_some();
        if let Some(app) = self.app.as_mut() {
            // A channel taken up again counts from generation 0 anew: no kept message of
            // its old instance may be taken for one of the new (no cut falls before the
            // snapshots in flight, which fail below).
            app.handed = super::handed::Handed::starting_at(app.window.counts().0);
        }
        self.feed(Event::TopologyChanged {
            topology: wiring.topology.clone(),
            what,
        });
    }
}
