//! A snapshot's life in the coordinator's task: the start (every check before an id is
//! spent), node events and parts; its end is `ends.rs`'s.

use std::collections::BTreeMap;
use std::time::Duration;

use cairn_core::control::{NodeCommand, NodeReport};
use cairn_core::{FailureReason, NodeId, SnapshotId, StartError, StartRequest, tracker};
use tokio::time::Instant;

use super::ends::{event_detail, with_progress};
use super::{Msg, PartSizes, State, WatchTx};
use crate::error::Error;
use crate::store::{EventKind, EventRecord, SnapshotRecord, SnapshotStatus};
use cairn_proto::stored::convert::{mode_name, now_ms};

impl State {
    pub(super) async fn node_event(&mut self, node: NodeId, id: SnapshotId, report: NodeReport) {
        if let Some(member) = self.members.get_mut(&node) {
            member.last_seen_ms = now_ms();
            member.heard = Instant::now();
        }
        match report {
            NodeReport::StateRecorded => {
                let update = self.tracker.state_recorded(id, &node);
                if !matches!(update, tracker::Update::Ignored) {
                    self.event(id, &node, EventKind::StateRecorded, String::new());
                }
                self.settle(id, update).await;
            }
            NodeReport::Failed(reason) => {
                let detail = event_detail(&reason.to_string());
                let update = self.tracker.fail(id, reason);
                // Only a failure that counted (the first of a participant ends it).
                if !matches!(update, tracker::Update::Ignored) {
                    self.event(id, &node, EventKind::NodeFailed, detail);
                }
                self.settle(id, update).await;
            }
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
        for initiator in &plan.initiators {
            if let Some(member) = self.members.get(initiator) {
                self.command(&member.tx, NodeCommand::Initiate(plan.clone()));
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
        let in_progress = record.status == SnapshotStatus::InProgress;
        let _ = tx.try_send(Ok(std::sync::Arc::new(record)));
        if in_progress {
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

    pub(super) async fn put_record(&self, record: &SnapshotRecord) -> Result<(), Error> {
        self.meta.put_snapshot(record).await
    }

    pub(super) async fn get_record(&self, id: SnapshotId) -> Result<Option<SnapshotRecord>, Error> {
        self.meta.snapshot(id).await
    }
}
