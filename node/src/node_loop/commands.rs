//! The engine's commands, executed in order: a record request into the inbox, a marker
//! out (or moved to the front of its queue), a copy of messages kept as channel state, a
//! channel held or released, a part reported as done.

use super::*;

impl NodeLoop {
    /// Feeds `event` once every command being executed has run (at once if none is).
    pub(super) fn after_commands(&mut self, event: Event) {
        if self.depth > 0 {
            self.deferred.push_back(event);
        } else {
            self.feed(event);
        }
    }

    pub(super) fn execute(&mut self, command: Command) {
        match command {
            Command::EnqueueRecordState { id, front } => {
                // What an aligned snapshot held back on this node until now.
                let held = self
                    .incoming
                    .values()
                    .filter(|c| c.blocked)
                    .flat_map(|c| &c.held)
                    .filter(|item| matches!(item, InItem::Data(_)))
                    .count() as u64;
                self.recordings
                    .started(id, self.seen.get(&id).copied(), held);
                if self.app.is_none() {
                    tracing::warn!(snapshot = %id, "no application attached: snapshot fails here");
                    let reason = FailureReason::NoApplication(self.shared.node_id.clone());
                    self.pending
                        .push_back(Event::SnapshotAborted { id, reason });
                } else if front {
                    self.inbox.push_front(InboxItem::Record(id));
                    self.ask_early(id);
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
                let outgoing = channel.from == self.shared.node_id;
                self.recordings
                    .record_messages(id, channel, messages, outgoing);
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
                if let Some(app) = self.app.as_mut() {
                    app.handed.forget(id);
                    app.handed.consumed(app.window.counts().1);
                    // Not answered now, or answered for nothing: no state is due for it.
                    app.records.settled(id);
                }
                self.recordings.fail(id, reason);
            }
        }
    }

    /// Copies the payloads of `indices` on `channel`: from the inbox for an incoming
    /// channel, from the outgoing queue for an outgoing one (the engine promises they are
    /// there). Searched from the back, where the newest messages are.
    pub(super) fn copy_messages(
        &self,
        channel: &ChannelId,
        indices: std::ops::Range<u64>,
    ) -> Vec<(u64, Bytes)> {
        let mut found: Vec<(u64, Bytes)> =
            Vec::with_capacity((indices.end - indices.start) as usize);
        if let Some(incoming) = self.incoming.get(channel) {
            let generation = incoming.generation;
            // Handed to the application before a cut it took at an early request (only
            // messages already handed over are looked for there).
            let handed = self
                .app
                .as_ref()
                .filter(|_| indices.start < incoming.delivered_next)
                .map(|app| app.handed.copy(channel, generation, &indices))
                .unwrap_or_default();
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
            found.extend(handed.into_iter().rev());
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
