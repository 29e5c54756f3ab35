//! A snapshot's end in the coordinator's task: a tracker update settled, the end stored
//! (again at every tick while the store refuses it), and only then told — to the nodes,
//! retention, watchers, metrics, freshness and the schedule.

use std::sync::Arc;

use cairn_core::control::NodeCommand;
use cairn_core::{FailureReason, SnapshotId, tracker};

use super::State;
use crate::store::{EventKind, EventRecord, SnapshotRecord, SnapshotStatus, VerdictRecord};
use cairn_proto::stored::convert::{failure_record, now_ms};

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
pub(super) fn event_detail(text: &str) -> String {
    crate::limits::cut(text, MAX_EVENT_DETAIL)
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
pub(super) fn with_progress(record: &mut SnapshotRecord, progress: &tracker::Progress) {
    record.recorded = progress.recorded.iter().map(ToString::to_string).collect();
    record.reported = progress.reported.iter().map(ToString::to_string).collect();
}

impl State {
    /// Applies a tracker update: progress is published; an end is stored, published, and
    /// (if failed) sent to every node so that their engines drop the snapshot.
    pub(super) async fn settle(&mut self, id: SnapshotId, update: tracker::Update) {
        match update {
            tracker::Update::Ignored => {}
            // Progress is told to watchers only: a record is made for them if there are any.
            tracker::Update::Progress => {
                if self.watchers.contains_key(&id)
                    && let Some(record) = self.live_record(id)
                {
                    self.publish(&Arc::new(record));
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
            self.broadcast(&NodeCommand::Abort {
                snapshot: id,
                reason: reason.to_string(),
            });
        }
        if record.status == SnapshotStatus::Completed
            && let Err(e) = self.apply_retention().await
        {
            tracing::warn!("retention: {e}");
        }
        if let Some(watchers) = self.watchers.remove(&id) {
            let told = Arc::new(record.clone());
            for watcher in watchers {
                let _ = watcher.try_send(Ok(told.clone()));
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
    pub(super) fn publish(&mut self, record: &Arc<SnapshotRecord>) {
        debug_assert_eq!(record.status, SnapshotStatus::InProgress);
        if let Some(watchers) = self.watchers.get_mut(&SnapshotId(record.id)) {
            watchers.retain(|w| w.try_send(Ok(record.clone())).is_ok() || !w.is_closed());
        }
    }
}

#[cfg(test)]
mod tests {
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
}
