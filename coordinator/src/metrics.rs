//! The coordinator's Prometheus metrics (served by `cairn_rpc::server::metrics::serve`).

use crate::store::{SnapshotRecord, SnapshotStatus};
use cairn_core::FailureKind;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// A snapshot's final status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StatusLabel {
    /// completed, failed or aborted.
    pub status: String,
}

/// Why a snapshot failed: its kind's word, in lower case.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindLabel {
    /// timeout, node_lost, channel_reset, …
    pub kind: String,
}

/// How a restore ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabel {
    /// done or failed.
    pub outcome: String,
}

/// The coordinator's metrics.
#[derive(Clone, Debug)]
pub(crate) struct CoordinatorMetrics {
    pub snapshots: Family<StatusLabel, Counter>,
    pub duration: Histogram,
    pub bytes_new: Counter,
    pub bytes_reused: Counter,
    pub recorded_messages: Counter,
    pub in_flight: Gauge,
    pub members: Gauge,
    pub schedule_skipped: Counter,
    pub schedule_consecutive_failures: Gauge,
    pub schedule_failing: Gauge,
    pub snapshot_stale: Gauge,
    pub newest_completed_age: Gauge<f64, AtomicU64>,
    /// 1 while this replica leads a term.
    pub is_leader: Gauge,
    /// The leader's term as this replica knows it (its own while it leads).
    pub term: Gauge,
    /// Changes of leader (address or term) this replica has seen.
    pub leader_changes: Counter,
    /// Restores that ended while this replica led, by outcome.
    pub restores: Family<OutcomeLabel, Counter>,
    /// Snapshots that failed or were aborted, by the kind of their reason.
    pub failures: Family<KindLabel, Counter>,
}

impl Default for CoordinatorMetrics {
    fn default() -> Self {
        Self {
            snapshots: Family::default(),
            // 1 ms to about 65 s.
            duration: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            bytes_new: Counter::default(),
            bytes_reused: Counter::default(),
            recorded_messages: Counter::default(),
            in_flight: Gauge::default(),
            members: Gauge::default(),
            schedule_skipped: Counter::default(),
            schedule_consecutive_failures: Gauge::default(),
            schedule_failing: Gauge::default(),
            snapshot_stale: Gauge::default(),
            newest_completed_age: Gauge::default(),
            is_leader: Gauge::default(),
            term: Gauge::default(),
            leader_changes: Counter::default(),
            restores: Family::default(),
            failures: Family::default(),
        }
    }
}

impl CoordinatorMetrics {
    /// Counts a snapshot's stored end: its status, a failure's kind, and for a completed one
    /// its duration, bytes and recorded messages.
    pub(crate) fn snapshot_ended(&self, record: &SnapshotRecord) {
        let status = record.status.name().to_lowercase();
        self.snapshots.get_or_create(&StatusLabel { status }).inc();
        if let Some(failure) = &record.failure {
            // A kind this build does not know (a newer replica's record) counts as other.
            let kind = FailureKind::of_word(&failure.kind)
                .map_or("other", FailureKind::word)
                .to_lowercase();
            self.failures.get_or_create(&KindLabel { kind }).inc();
        }
        if record.status == SnapshotStatus::Completed {
            let seconds =
                record.finished_at_ms.saturating_sub(record.started_at_ms) as f64 / 1000.0;
            self.duration.observe(seconds);
            self.bytes_new.inc_by(record.bytes_new);
            self.bytes_reused.inc_by(record.bytes_reused);
            let recorded = record.verdict.as_ref().map_or(0, |v| v.recorded_messages);
            self.recorded_messages.inc_by(recorded);
        }
    }

    /// Registers every metric in `registry`, each labelled series at 0 from the first scrape
    /// (so that `increase()` and alerts see the first end, and dashboards name every kind).
    pub(crate) fn register(&self, registry: &mut Registry) {
        for status in [
            SnapshotStatus::Completed,
            SnapshotStatus::Failed,
            SnapshotStatus::Aborted,
        ] {
            let status = status.name().to_lowercase();
            let _ = self.snapshots.get_or_create(&StatusLabel { status });
        }
        for outcome in ["done", "failed"] {
            let outcome = outcome.to_owned();
            let _ = self.restores.get_or_create(&OutcomeLabel { outcome });
        }
        let kinds = FailureKind::ALL.map(|k| k.word().to_lowercase());
        for kind in kinds.into_iter().chain(["other".to_owned()]) {
            let _ = self.failures.get_or_create(&KindLabel { kind });
        }
        registry.register(
            "cairn_snapshots",
            "Snapshots that ended, by status",
            self.snapshots.clone(),
        );
        registry.register(
            "cairn_snapshot_duration_seconds",
            "From start to completed and verified",
            self.duration.clone(),
        );
        registry.register(
            "cairn_snapshot_new_bytes",
            "Bytes stored that no earlier snapshot had stored",
            self.bytes_new.clone(),
        );
        registry.register(
            "cairn_snapshot_reused_bytes",
            "Bytes shared with earlier snapshots",
            self.bytes_reused.clone(),
        );
        registry.register(
            "cairn_recorded_channel_messages",
            "Messages recorded as channel state in completed snapshots",
            self.recorded_messages.clone(),
        );
        registry.register(
            "cairn_snapshots_in_flight",
            "Snapshots in progress",
            self.in_flight.clone(),
        );
        registry.register(
            "cairn_members",
            "Registered node daemons",
            self.members.clone(),
        );
        registry.register(
            "cairn_scheduled_snapshots_skipped",
            "Due scheduled snapshots skipped (one still ran, the minimum pause held, no room)",
            self.schedule_skipped.clone(),
        );
        registry.register(
            "cairn_schedule_consecutive_failures",
            "Scheduled snapshots that failed in a row",
            self.schedule_consecutive_failures.clone(),
        );
        registry.register(
            "cairn_schedule_failing",
            "1 while more scheduled snapshots failed in a row than the policy tolerates",
            self.schedule_failing.clone(),
        );
        registry.register(
            "cairn_snapshot_stale",
            "1 while no snapshot completed within the freshness threshold",
            self.snapshot_stale.clone(),
        );
        registry.register(
            "cairn_coordinator_is_leader",
            "1 while this coordinator replica leads a term",
            self.is_leader.clone(),
        );
        registry.register(
            "cairn_coordinator_term",
            "The leader's term as this replica knows it (0: the embedded store, or none known)",
            self.term.clone(),
        );
        registry.register(
            "cairn_leader_changes",
            "Changes of the leading coordinator (address or term) this replica has seen",
            self.leader_changes.clone(),
        );
        registry.register(
            "cairn_snapshot_failures",
            "Snapshots that failed or were aborted, by the kind of their reason (timeout, \
             node_lost, channel_reset, storage, …)",
            self.failures.clone(),
        );
        registry.register(
            "cairn_restores",
            "Restores that ended while this replica led, by outcome (done, failed: nodes may \
             hold different states and snapshots are fenced until a restore is done)",
            self.restores.clone(),
        );
        registry.register(
            "cairn_newest_completed_snapshot_age_seconds",
            "Age of the newest completed snapshot; -1 if none completed",
            self.newest_completed_age.clone(),
        );
    }
}
