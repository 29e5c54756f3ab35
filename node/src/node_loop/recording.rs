//! What this node recorded for each snapshot — the application's state and the channel
//! messages — until its part is complete, and the completed parts afterwards.
//!
//! With a coordinator, the state is not kept: each piece goes on to the coordinator link as
//! it arrives (streamed into the part's upload), and the parts kept here for
//! `GetLocalSnapshot` hold the counters and recorded messages without the state. Without
//! one, the state is kept with the part.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use cairn_core::control::StateTimes;
use cairn_core::{ChannelId, FailureReason, LocalReport, SnapshotId};

use super::events::{Events, NodeEvent};
use crate::error::Error;
use crate::part::Part;
use crate::shared::StateChunk;

struct Recording {
    /// Kept only without a coordinator.
    state: Vec<Bytes>,
    state_started: bool,
    state_done: bool,
    channels: BTreeMap<ChannelId, Vec<(u64, Bytes)>>,
    report: Option<LocalReport>,
    /// When this node first met the snapshot (a marker or its initiation), if known.
    began: Option<Instant>,
    /// From then until the application was asked for its state (an aligned snapshot's
    /// alignment), and the data messages held on blocked channels at that moment.
    asked_after: Option<Duration>,
    held_messages: u64,
    /// The snapshot's `tracing` span on this node (`snapshot{snapshot=ID}`): recording
    /// started, state recorded, channels recorded, part complete — the node's part of the
    /// snapshot's trace (its upload logs in a span of the same name).
    span: tracing::Span,
}

impl Recording {
    fn new(id: SnapshotId) -> Self {
        Recording {
            state: Vec::new(),
            state_started: false,
            state_done: false,
            channels: BTreeMap::new(),
            report: None,
            began: None,
            asked_after: None,
            held_messages: 0,
            span: tracing::info_span!(parent: None, "snapshot", snapshot = id.0),
        }
    }
}

/// Recordings in progress and the parts they became.
pub(super) struct Recordings {
    keep: usize,
    /// Where the coordinator link hears of state, parts and failures, if there is one.
    events: Events,
    active: BTreeMap<SnapshotId, Recording>,
    parts: BTreeMap<SnapshotId, Result<Part, FailureReason>>,
}

impl Recordings {
    pub(super) fn new(keep: usize, events: Events) -> Self {
        Self {
            keep: keep.max(1),
            events,
            active: BTreeMap::new(),
            parts: BTreeMap::new(),
        }
    }

    fn recording(&mut self, id: SnapshotId) -> &mut Recording {
        self.active.entry(id).or_insert_with(|| Recording::new(id))
    }

    /// The engine asked the application for its state (a first marker, or an initiation;
    /// an aligned snapshot once every marker came): the snapshot starts on this node, which
    /// first met it at `began`, holding `held_messages` data messages on its channels.
    pub(super) fn started(&mut self, id: SnapshotId, began: Option<Instant>, held_messages: u64) {
        let recording = self.recording(id);
        recording.began = began;
        recording.asked_after = began.map(|at| at.elapsed());
        recording.held_messages = held_messages;
        recording
            .span
            .in_scope(|| tracing::debug!("recording: the application is asked for its state"));
    }

    /// Adds messages recorded on `channel` (`outgoing`: one of this node's). With a
    /// coordinator, an outgoing channel's messages also go on to the part's upload at once:
    /// they are only ever appended (an early cut's handed messages, which go before the
    /// others, are incoming), so the upload streams them while the snapshot runs rather
    /// than after the part completes.
    pub(super) fn record_messages(
        &mut self,
        id: SnapshotId,
        channel: ChannelId,
        mut messages: Vec<(u64, Bytes)>,
        outgoing: bool,
    ) {
        let stream = outgoing && self.events.heard() && !messages.is_empty();
        let recording = self.recording(id);
        let recorded = recording.channels.entry(channel.clone()).or_default();
        if crate::mutants::is(crate::mutants::Mutant::RecordWrongMessage) {
            // The channel's second recorded message gets the first one's bytes, whether they
            // came in one batch (an overtaking marker) or one by one (a recording window).
            let first = recorded
                .first()
                .or(messages.first())
                .map(|(_, p)| p.clone());
            if let (Some(first), Some(second)) = (
                first,
                1usize
                    .checked_sub(recorded.len())
                    .and_then(|at| messages.get_mut(at)),
            ) {
                second.1 = first;
            }
        }
        // Messages the application was handed and had not consumed at an early cut come
        // after the recording began but precede everything recorded on the channel.
        match (recorded.first(), messages.last()) {
            (Some((first, _)), Some((last, _))) if last < first => {
                debug_assert!(!outgoing, "an outgoing channel's recording is appended to");
                recorded.splice(0..0, messages);
            }
            _ if stream => {
                recorded.extend(messages.iter().cloned());
                self.tell(NodeEvent::Recorded {
                    id,
                    channel,
                    messages,
                });
            }
            _ => recorded.extend(messages),
        }
    }

    /// Adds a chunk of the application's state; true for the first one.
    pub(super) fn state_chunk(&mut self, id: SnapshotId, chunk: StateChunk) -> bool {
        let heard = self.events.heard();
        let recording = self.recording(id);
        let first = !recording.state_started;
        recording.state_started = true;
        if first {
            recording
                .span
                .in_scope(|| tracing::debug!("state recorded by the application"));
        }
        if !heard {
            if !chunk.bytes.is_empty() {
                recording.state.push(chunk.bytes);
            }
        } else {
            if first {
                let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
                let times = StateTimes {
                    recording_for_ms: recording.began.map(|at| ms(at.elapsed())),
                    aligned_ms: recording.asked_after.map(ms),
                    held_messages: recording.began.map(|_| recording.held_messages),
                };
                self.tell(NodeEvent::StateRecorded { id, times });
            }
            self.tell(NodeEvent::StateChunk { id, chunk });
        }
        first
    }

    pub(super) fn state_done(&mut self, id: SnapshotId) {
        if let Some(recording) = self.active.get_mut(&id) {
            recording.state_done = true;
        }
        self.try_complete(id);
    }

    pub(super) fn report(&mut self, report: LocalReport) {
        let id = report.id;
        let recording = self.recording(id);
        let messages: usize = recording.channels.values().map(Vec::len).sum();
        recording.span.in_scope(|| {
            tracing::debug!(messages, "every channel's cut is known: channels recorded")
        });
        recording.report = Some(report);
        self.try_complete(id);
    }

    pub(super) fn fail(&mut self, id: SnapshotId, reason: FailureReason) {
        if let Some(recording) = self.active.remove(&id) {
            recording
                .span
                .in_scope(|| tracing::debug!(%reason, "recording dropped"));
        }
        // An abort the coordinator ordered needs no report back.
        if !matches!(reason, FailureReason::Aborted(_)) {
            self.tell(NodeEvent::Failed(id, reason.clone()));
        }
        self.store(id, Err(reason));
    }

    /// A snapshot this node finished whose marker never reached a peer: it cannot
    /// complete anywhere, so it fails here too (nothing happens for one already failed).
    pub(super) fn fail_completed(&mut self, id: SnapshotId, reason: FailureReason) {
        if matches!(self.parts.get(&id), Some(Ok(_))) {
            tracing::warn!(snapshot = %id, %reason, "a completed part's marker was lost");
            self.tell(NodeEvent::Failed(id, reason.clone()));
            self.store(id, Err(reason));
        }
    }

    fn tell(&self, event: NodeEvent) {
        self.events.tell(event);
    }

    pub(super) fn part(&self, id: SnapshotId) -> Result<Part, Error> {
        match self.parts.get(&id) {
            Some(Ok(part)) => Ok(part.clone()),
            Some(Err(reason)) => Err(Error::SnapshotFailed {
                id,
                reason: reason.clone(),
            }),
            None => Err(Error::NoSuchPart(id)),
        }
    }

    fn try_complete(&mut self, id: SnapshotId) {
        let ready = self
            .active
            .get(&id)
            .is_some_and(|r| r.state_done && r.report.is_some());
        if !ready {
            return;
        }
        let recording = self.active.remove(&id).expect("checked");
        let report = recording.report.expect("checked");
        let mut state = BytesMut::with_capacity(recording.state.iter().map(Bytes::len).sum());
        for chunk in &recording.state {
            state.extend_from_slice(chunk);
        }
        let part = Part {
            report,
            state: state.freeze(),
            channels: recording.channels,
        };
        recording
            .span
            .in_scope(|| tracing::info!("local snapshot part complete"));
        self.tell(NodeEvent::PartReady(Box::new(part.clone())));
        self.store(id, Ok(part));
    }

    fn store(&mut self, id: SnapshotId, part: Result<Part, FailureReason>) {
        self.parts.insert(id, part);
        while self.parts.len() > self.keep {
            self.parts.pop_first();
        }
    }
}
