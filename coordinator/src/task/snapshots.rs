//! A snapshot's life in the coordinator's task: the start (every check before an id is
//! spent), node events and parts, the end stored and told to watchers and nodes.

use std::collections::BTreeMap;
use std::time::Duration;

use cairn_core::{FailureReason, NodeId, SnapshotId, StartError, StartRequest, tracker};
use cairn_proto::v1 as pb;
use tokio::time::Instant;

use super::{Msg, PartSizes, State, WatchTx};
use crate::error::Error;
use crate::store::{EventKind, EventRecord, SnapshotRecord, SnapshotStatus, VerdictRecord};
use cairn_proto::stored::convert::{failure_record, mode_name, now_ms, progress_pb};

/// A snapshot's end, waiting for the store.
pub(super) struct Unstored {
    record: SnapshotRecord,
    failed: Option<FailureReason>,
    /// Stores tried so far (the error is logged at the first and then every
    /// [`LOG_EVERY`]th: a full disk must not fill up with this log).
    tries: u64,
}

/// An end that stays unstored is logged again every this many tries (every 10 s or so).
const LOG_EVERY: u64 = 40;

/// A snapshot's end the store acknowledged. Only [`State::store_and_tell`] makes one (its
/// fields are private to this module), and only [`State::tell_end`] takes one: nobody hears
/// of an outcome the store has not stored.
struct StoredEnd {
    record: SnapshotRecord,
    failed: Option<FailureReason>,
}

/// The most bytes of a reason an event keeps: a node's failure message may be far longer
/// (the record's `failure` keeps it whole), and a record must stay storable.
const MAX_EVENT_DETAIL: usize = 512;

/// `text` as an event keeps it: at most [`MAX_EVENT_DETAIL`] bytes, cut at a character.
fn event_detail(text: &str) -> String {
    if text.len() <= MAX_EVENT_DETAIL {
        return text.to_owned();
    }
    let mut end = MAX_EVENT_DETAIL;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Ends `record`'s timeline: its status and, if it did not complete, why.
pub(super) fn push_ended(record: &mut SnapshotRecord) {
    let detail = match &record.failure {
        None => record.status.to_string(),
        Some(f) => event_detail(&format!("{}: {}", record.status, f.message)),
    };
    record.events.push(EventRecord {
        detail,
        ..EventRecord::new(record.finished_at_ms, EventKind::Ended)
    });
}

/// Who recorded and who reported, as the tracker — the one place that follows progress —
/// says.
fn with_progress(record: &mut SnapshotRecord, progress: &tracker::Progress) {
    record.recorded = progress.recorded.iter().map(ToString::to_string).collect();
    record.reported = progress.reported.iter().map(ToString::to_string).collect();
}

/// The failure `node` reported. The wire's reason is taken exactly
/// (`cairn_proto::convert::failure`), except where the reporter is who it concerns: a
/// node lost, without an application or shutting down is the reporting node (whatever
/// the wire names), a reset without its channel is the reporter lost, and a reason
/// without a kind (or one this coordinator does not know, or cannot read) is an abort
/// naming the node.
fn node_failure(node: &NodeId, reason: &pb::FailureReason) -> FailureReason {
    use pb::failure_reason::Kind;
    let aborted = |why: String| FailureReason::Aborted(format!("on node {node}: {why}"));
    match Kind::try_from(reason.kind).unwrap_or(Kind::Unspecified) {
        Kind::ChannelReset if reason.channel.is_none() => FailureReason::NodeLost(node.clone()),
        Kind::NoApplication => FailureReason::NoApplication(node.clone()),
        Kind::Shutdown => FailureReason::Shutdown(node.clone()),
        Kind::NodeLost => FailureReason::NodeLost(node.clone()),
        // A daemon's own storage failure names the daemon, whatever it says.
        Kind::Storage => FailureReason::Storage {
            nodes: vec![node.clone()],
            why: reason
                .message
                .strip_prefix("storage failed: ")
                .unwrap_or(&reason.message)
                .to_owned(),
        },
        Kind::Unspecified => aborted(reason.message.clone()),
        _ => FailureReason::try_from(reason)
            .unwrap_or_else(|e| aborted(format!("{} ({e})", reason.message))),
    }
}

impl State {
    pub(super) async fn node_event(&mut self, node: NodeId, event: pb::NodeSnapshotEvent) {
        use pb::node_snapshot_event::Kind;
        if let Some(member) = self.members.get_mut(&node) {
            member.last_seen_ms = now_ms();
            member.heard = Instant::now();
        }
        let id = SnapshotId(event.snapshot_id);
        match event.kind {
            Some(Kind::StateRecorded(_)) => {
                let update = self.tracker.state_recorded(id, &node);
                if !matches!(update, tracker::Update::Ignored) {
                    self.event(id, &node, EventKind::StateRecorded, String::new());
                }
                self.settle(id, update).await;
            }
            Some(Kind::Failed(reason)) => {
                let reason = node_failure(&node, &reason);
                let detail = event_detail(&reason.to_string());
                let update = self.tracker.fail(id, reason);
                // Only a failure that counted (the first of a participant ends it).
                if !matches!(update, tracker::Update::Ignored) {
                    self.event(id, &node, EventKind::NodeFailed, detail);
                }
                self.settle(id, update).await;
            }
            Some(Kind::PartUploaded(_)) | None => {}
        }
    }

    pub(super) async fn start(
        &mut self,
        request: StartRequest,
        timeout: Duration,
        labels: BTreeMap<String, String>,
    ) -> Result<SnapshotId, Error> {
        if let Some(fence) = self.fence() {
            return Err(Error::Fenced(fence));
        }
        let topology = self.topology()?;
        if self.roster.is_empty() {
            return Err(Error::NoMembers);
        }
        let refused = |e: StartError| match e {
            StartError::TooManyInFlight { .. } | StartError::AlignedInFlight(_) => {
                Error::TooManyInFlight(e.to_string())
            }
            StartError::Unreachable { .. }
            | StartError::UnknownInitiator(_)
            | StartError::DuplicateId(_) => Error::InvalidArgument(e.to_string()),
            StartError::NoMembers => Error::NoMembers,
        };
        // Every check before an id is spent.
        self.tracker.check(&request, &topology).map_err(refused)?;
        let id = self.next_snapshot_id().await?;
        let mut plan = self
            .tracker
            .start(id, request, &topology)
            .map_err(refused)?;
        // Nodes count an alignment timeout from here.
        plan.started_at_ms = now_ms();
        let record = SnapshotRecord {
            id: id.0,
            mode: mode_name(plan.mode),
            initiators: plan.initiators.iter().map(ToString::to_string).collect(),
            alignment_timeout_ms: plan.alignment_timeout.map_or(0, |d| d.as_millis() as u64),
            status: SnapshotStatus::InProgress,
            failure: None,
            verdict: None,
            started_at_ms: plan.started_at_ms,
            finished_at_ms: 0,
            timeout_ms: timeout.as_millis() as u64,
            labels,
            nodes: topology.nodes().iter().map(ToString::to_string).collect(),
            channels: topology
                .channels()
                .iter()
                .map(ToString::to_string)
                .collect(),
            recorded: Vec::new(),
            reported: Vec::new(),
            bytes_new: 0,
            bytes_reused: 0,
            epoch: self.epoch,
            term: self.leadership.term(),
            events: vec![EventRecord::new(plan.started_at_ms, EventKind::Started)],
        };
        if let Err(e) = self.put_record(&record).await {
            self.tracker.fail(
                id,
                FailureReason::Storage {
                    nodes: Vec::new(),
                    why: e.to_string(),
                },
            );
            return Err(e);
        }
        self.inflight.insert(id, record);
        self.metrics.in_flight.set(self.inflight.len() as i64);
        let wire_plan = cairn_proto::convert::plan_to_pb(&plan, 0);
        for initiator in &plan.initiators {
            if let Some(member) = self.members.get(initiator) {
                let initiate = pb::coordinator_to_node::Kind::Initiate(wire_plan.clone());
                self.command(&member.tx, initiate);
            }
        }
        let tx = self.self_tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            let _ = tx.send(Msg::TimedOut { id }).await;
        });
        let span =
            tracing::info_span!(parent: None, "snapshot", snapshot = id.0, mode = %plan.mode);
        span.in_scope(|| tracing::info!(initiators = ?plan.initiators, "snapshot started"));
        self.spans.insert(id, span);
        Ok(id)
    }

    /// The next snapshot id: one above the stored counter and above every id a daemon
    /// reported having seen (the counter may have been lost with the metadata).
    pub(super) async fn next_snapshot_id(&mut self) -> Result<SnapshotId, Error> {
        let id = self.meta.take_snapshot_id().await?;
        if id.0 > self.id_floor {
            return Ok(id);
        }
        let id = SnapshotId(self.id_floor.saturating_add(1));
        tracing::warn!(
            snapshot = id.0,
            daemons_saw = self.id_floor,
            "the stored snapshot id counter is behind ids the daemons have seen (lost \
             metadata?): continuing above them"
        );
        self.meta.set_last_snapshot_id(id).await?;
        Ok(id)
    }

    pub(super) async fn abort(
        &mut self,
        id: SnapshotId,
        reason: String,
    ) -> Result<SnapshotRecord, Error> {
        if self.unstored.contains_key(&id) {
            return Err(Error::OutcomeUnknown {
                what: format!("snapshot {id}'s end"),
                see: format!("GetSnapshot {id}"),
                cause: "it ended and its end is not stored yet (tried again while this term \
                        lasts): an abort can no longer change it"
                    .into(),
            });
        }
        if !self.inflight.contains_key(&id) {
            return match self.get_record(id).await? {
                Some(record) => Err(Error::AlreadyEnded {
                    id,
                    status: record.status,
                }),
                None => Err(Error::SnapshotNotFound(id)),
            };
        }
        let reason = if reason.is_empty() {
            "aborted by a user".to_owned()
        } else {
            reason
        };
        let update = self.tracker.fail(id, FailureReason::Aborted(reason));
        self.settle(id, update).await;
        if self.unstored.contains_key(&id) {
            return Err(Error::OutcomeUnknown {
                what: format!("the abort of snapshot {id}"),
                see: format!("GetSnapshot {id}"),
                cause: "its record is not stored yet (tried again while this term lasts)".into(),
            });
        }
        self.get_record(id)
            .await?
            .ok_or(Error::SnapshotNotFound(id))
    }

    pub(super) async fn watch(&mut self, id: SnapshotId, tx: WatchTx) -> Result<(), Error> {
        let record = match self.live_record(id) {
            Some(r) => r,
            None => self
                .get_record(id)
                .await?
                .ok_or(Error::SnapshotNotFound(id))?,
        };
        let _ = tx.try_send(Ok(progress_pb(&record)));
        if record.status == SnapshotStatus::InProgress {
            self.watchers.entry(id).or_default().push(tx);
        }
        Ok(())
    }

    /// A snapshot in flight as it stands: its record with the tracker's progress.
    pub(super) fn live_record(&self, id: SnapshotId) -> Option<SnapshotRecord> {
        let mut record = self.inflight.get(&id)?.clone();
        if let Some(progress) = self.tracker.progress(id) {
            with_progress(&mut record, &progress);
        }
        Some(record)
    }

    /// Adds a node's event to the timeline of snapshot `id`, if it is in flight: once per
    /// node and kind (a repeated report adds nothing, so a timeline holds at most two events
    /// per node and four more).
    fn node_event_record(&mut self, id: SnapshotId, event: EventRecord) {
        let new = self.inflight.get(&id).is_some_and(|record| {
            !record
                .events
                .iter()
                .any(|e| e.kind == event.kind && e.node == event.node)
        });
        if new {
            self.trace(id, &event);
            if let Some(record) = self.inflight.get_mut(&id) {
                record.events.push(event);
            }
        }
    }

    /// Logs a step of snapshot `id` inside its span.
    fn trace(&self, id: SnapshotId, event: &EventRecord) {
        let Some(span) = self.spans.get(&id) else {
            return;
        };
        span.in_scope(|| match event.kind {
            EventKind::PartStored => tracing::debug!(
                node = %event.node,
                state_bytes = event.local_state_bytes,
                recorded_messages = event.recorded_messages,
                bytes_new = event.bytes_new,
                bytes_reused = event.bytes_reused,
                "part stored"
            ),
            EventKind::StateRecorded => tracing::debug!(node = %event.node, "state recorded"),
            _ => tracing::debug!(node = %event.node, detail = %event.detail, "{:?}", event.kind),
        });
    }

    /// Node `node`'s part of snapshot `id` is stored (the tracker took it): its sizes count
    /// in the record and its event says them. A part stored again (a daemon that uploaded
    /// twice) replaces the first: its sizes and event, as the tracker replaces the part.
    pub(super) fn part_stored(&mut self, id: SnapshotId, node: &NodeId, sizes: &PartSizes) {
        let Some(record) = self.inflight.get_mut(&id) else {
            return;
        };
        let node = node.to_string();
        if let Some(at) = record
            .events
            .iter()
            .position(|e| e.kind == EventKind::PartStored && e.node == node)
        {
            let earlier = record.events.remove(at);
            record.bytes_new = record.bytes_new.saturating_sub(earlier.bytes_new);
            record.bytes_reused = record.bytes_reused.saturating_sub(earlier.bytes_reused);
        }
        record.bytes_new = record.bytes_new.saturating_add(sizes.bytes_new);
        record.bytes_reused = record.bytes_reused.saturating_add(sizes.bytes_reused);
        let event = EventRecord {
            node,
            local_state_bytes: sizes.local_state_bytes,
            recorded_messages: sizes.recorded_messages,
            bytes_new: sizes.bytes_new,
            bytes_reused: sizes.bytes_reused,
            ..EventRecord::new(now_ms(), EventKind::PartStored)
        };
        self.trace(id, &event);
        if let Some(record) = self.inflight.get_mut(&id) {
            record.events.push(event);
        }
    }

    fn event(&mut self, id: SnapshotId, node: &NodeId, kind: EventKind, detail: String) {
        let event = EventRecord {
            node: node.to_string(),
            detail,
            ..EventRecord::new(now_ms(), kind)
        };
        self.node_event_record(id, event);
    }

    /// Applies a tracker update: progress is published; an end is stored, published, and
    /// (if failed) sent to every node so that their engines drop the snapshot.
    pub(super) async fn settle(&mut self, id: SnapshotId, update: tracker::Update) {
        match update {
            tracker::Update::Ignored => {}
            tracker::Update::Progress => {
                if let Some(record) = self.live_record(id) {
                    self.publish(&record);
                }
            }
            tracker::Update::Finished(outcome, progress) => {
                let Some(mut record) = self.inflight.remove(&id) else {
                    return;
                };
                with_progress(&mut record, &progress);
                record.finished_at_ms = now_ms();
                self.metrics.in_flight.set(self.inflight.len() as i64);
                let span = self.spans.remove(&id).unwrap_or_else(tracing::Span::none);
                match &outcome {
                    tracker::Outcome::Completed(consistent) => {
                        record.status = SnapshotStatus::Completed;
                        record.verdict = Some(VerdictRecord {
                            consistent: true,
                            violation: String::new(),
                            recorded_messages: consistent.recorded_messages,
                        });
                        let ms = record.finished_at_ms.saturating_sub(record.started_at_ms);
                        let recorded = consistent.recorded_messages;
                        span.in_scope(|| {
                            tracing::info!(ms, recorded, "snapshot completed and verified")
                        });
                    }
                    tracker::Outcome::Failed(reason) => {
                        record.status = if matches!(reason, FailureReason::Aborted(_)) {
                            SnapshotStatus::Aborted
                        } else {
                            SnapshotStatus::Failed
                        };
                        if let Some(violation) = outcome.violation() {
                            record.verdict = Some(VerdictRecord {
                                consistent: false,
                                violation: violation.to_string(),
                                recorded_messages: 0,
                            });
                        }
                        record.failure = Some(failure_record(reason));
                        span.in_scope(|| tracing::warn!(%reason, "snapshot did not complete"));
                    }
                }
                if let Some(verdict) = &record.verdict {
                    record.events.push(EventRecord {
                        recorded_messages: verdict.recorded_messages,
                        detail: event_detail(&verdict.violation),
                        ..EventRecord::new(record.finished_at_ms, EventKind::Verified)
                    });
                }
                push_ended(&mut record);
                let failed = match outcome {
                    tracker::Outcome::Failed(reason) => Some(reason),
                    tracker::Outcome::Completed(_) => None,
                };
                self.unstored.insert(
                    id,
                    Unstored {
                        record,
                        failed,
                        tries: 0,
                    },
                );
                self.store_and_tell(id).await;
            }
        }
    }

    /// Stores the end of snapshot `id` (waiting in `unstored`), then tells it. An end the
    /// store did not take stays in `unstored`, told to nobody, and is stored again at the
    /// next tick ([`Self::store_unstored`]); if the term ends first, the next leader's
    /// recovery decides from what the store holds.
    pub(super) async fn store_and_tell(&mut self, id: SnapshotId) {
        let Some(mut unstored) = self.unstored.remove(&id) else {
            return;
        };
        unstored.tries = unstored.tries.saturating_add(1);
        match self.meta.put_snapshot(&unstored.record).await {
            Ok(()) => {
                let stored = StoredEnd {
                    record: unstored.record,
                    failed: unstored.failed,
                };
                self.tell_end(stored).await;
            }
            Err(e) => {
                if unstored.tries % LOG_EVERY == 1 {
                    tracing::error!(
                        snapshot = id.0,
                        tries = unstored.tries,
                        "cannot store the end of the snapshot ({e}): nobody is told until it \
                         is stored (tried again every tick while this term lasts)"
                    );
                }
                self.unstored.insert(id, unstored);
            }
        }
    }

    /// Every end still unstored, stored again (each tick).
    pub(super) async fn store_unstored(&mut self) {
        let ids: Vec<SnapshotId> = self.unstored.keys().copied().collect();
        for id in ids {
            if !self.leadership.valid() {
                return;
            }
            self.store_and_tell(id).await;
        }
    }

    /// The one place a snapshot's end is told — to the nodes (drop a failed one), to
    /// retention, to watchers, metrics, freshness and the schedule — and it takes only an
    /// end the store acknowledged.
    async fn tell_end(&mut self, stored: StoredEnd) {
        let StoredEnd { record, failed } = stored;
        let id = SnapshotId(record.id);
        if let Some(reason) = &failed {
            let abort = pb::AbortSnapshotRequest {
                snapshot_id: id.0,
                reason: reason.to_string(),
            };
            self.broadcast(pb::coordinator_to_node::Kind::Abort(abort));
        }
        if record.status == SnapshotStatus::Completed
            && let Err(e) = self.apply_retention().await
        {
            tracing::warn!("retention: {e}");
        }
        if let Some(watchers) = self.watchers.remove(&id) {
            let progress = progress_pb(&record);
            for watcher in watchers {
                let _ = watcher.try_send(Ok(progress.clone()));
            }
        }
        self.count_end(&record);
        let result = match (&record.failure, &failed) {
            (None, _) => Ok(()),
            (Some(_), Some(reason)) => Err(reason.to_string()),
            (Some(_), None) => Err(record.status.to_string()),
        };
        let alarm = self.schedule.finished(id, self.clock_ms(), result);
        self.alarm(alarm);
        self.refresh().await;
    }

    pub(super) fn count_end(&self, record: &SnapshotRecord) {
        let status = record.status.name().to_lowercase();
        self.metrics
            .snapshots
            .get_or_create(&crate::metrics::StatusLabel { status })
            .inc();
        if record.status == SnapshotStatus::Completed {
            let seconds =
                record.finished_at_ms.saturating_sub(record.started_at_ms) as f64 / 1000.0;
            self.metrics.duration.observe(seconds);
            self.metrics.bytes_new.inc_by(record.bytes_new);
            self.metrics.bytes_reused.inc_by(record.bytes_reused);
            let recorded = record.verdict.as_ref().map_or(0, |v| v.recorded_messages);
            self.metrics.recorded_messages.inc_by(recorded);
        }
    }

    /// Tells the record's watchers of a snapshot's progress. Progress of a snapshot in
    /// flight lives in `inflight` only (a restarted coordinator fails such a snapshot
    /// anyway), which spares the store a synced write per node and step; its end is told by
    /// [`Self::tell_end`] only.
    pub(super) fn publish(&mut self, record: &SnapshotRecord) {
        debug_assert_eq!(record.status, SnapshotStatus::InProgress);
        if let Some(watchers) = self.watchers.get_mut(&SnapshotId(record.id)) {
            let progress = progress_pb(record);
            watchers.retain(|w| w.try_send(Ok(progress.clone())).is_ok() || !w.is_closed());
        }
    }

    pub(super) async fn put_record(&self, record: &SnapshotRecord) -> Result<(), Error> {
        self.meta.put_snapshot(record).await
    }

    pub(super) async fn get_record(&self, id: SnapshotId) -> Result<Option<SnapshotRecord>, Error> {
        self.meta.snapshot(id).await
    }
}

#[cfg(test)]
mod tests {
    use cairn_core::ChannelId;

    use super::*;

    #[test]
    fn an_event_keeps_a_bounded_reason_cut_at_a_character() {
        assert_eq!(event_detail("short"), "short");
        let long = "é".repeat(1000);
        let kept = event_detail(&long);
        assert!(
            kept.len() <= MAX_EVENT_DETAIL + '…'.len_utf8(),
            "{}",
            kept.len()
        );
        assert!(kept.ends_with('…') && long.starts_with(kept.trim_end_matches('…')));
    }

    #[test]
    fn a_node_failure_is_exact_and_names_its_reporter() {
        let node = NodeId::from("n2");
        let wire = |reason: &FailureReason| pb::FailureReason::from(reason);
        // Taken exactly (Timeout and MixedEpochs once became aborts).
        for reason in [
            FailureReason::ChannelReset(ChannelId::new("n1", "n2")),
            FailureReason::Storage {
                nodes: vec![NodeId::new("n2")],
                why: "upload of n2's part failed: no space".into(),
            },
            FailureReason::MembershipChanged("node n3 joined".into()),
            FailureReason::Timeout {
                missing: vec!["n1".into()],
            },
            FailureReason::Restore,
            FailureReason::MixedEpochs {
                nodes: vec!["n2".into()],
                detail: "n2 is in epoch 2".into(),
            },
        ] {
            assert_eq!(node_failure(&node, &wire(&reason)), reason);
        }
        // The reporter is who these concern, whatever the wire names.
        for (sent, taken) in [
            (
                FailureReason::NoApplication("n9".into()),
                FailureReason::NoApplication(node.clone()),
            ),
            (
                FailureReason::Shutdown("n9".into()),
                FailureReason::Shutdown(node.clone()),
            ),
            (
                FailureReason::NodeLost("n9".into()),
                FailureReason::NodeLost(node.clone()),
            ),
        ] {
            assert_eq!(node_failure(&node, &wire(&sent)), taken);
        }
        let mut reset = wire(&FailureReason::ChannelReset(ChannelId::new("n1", "n2")));
        reset.channel = None;
        assert_eq!(
            node_failure(&node, &reset),
            FailureReason::NodeLost(node.clone())
        );
        let unknown = pb::FailureReason {
            kind: 99,
            message: "what".into(),
            ..Default::default()
        };
        assert_eq!(
            node_failure(&node, &unknown),
            FailureReason::Aborted("on node n2: what".into())
        );
    }
}
