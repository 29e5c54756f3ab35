//! The snapshot schedule's policy and status.
//!
//! Only the domain-to-wire half lives here: a `SetPolicy` applies the fields its update
//! list names to the policy in force, which is the coordinator's rule
//! (`cairn_coordinator::policy::apply`), and `source` (flags or the API) is the
//! coordinator's to fill in.

use std::time::Duration;

use cairn_core::schedule::{Policy, PolicyError, PolicyField, Status, saturating_millis};

use crate::v1 as pb;

fn opt_ms(d: Option<Duration>) -> u64 {
    d.map_or(0, saturating_millis)
}

/// A policy in force and the schedule's state, as `GetPolicy` answers (`source` empty).
impl From<(&Policy, &Status)> for pb::Policy {
    fn from((policy, status): (&Policy, &Status)) -> Self {
        Self {
            interval_ms: saturating_millis(policy.interval),
            mode: pb::SnapshotMode::from(policy.mode) as i32,
            timeout_ms: saturating_millis(policy.timeout),
            alignment_timeout_ms: opt_ms(policy.alignment_timeout),
            min_pause_ms: saturating_millis(policy.min_pause),
            jitter_ms: saturating_millis(policy.jitter),
            max_concurrent: policy.max_concurrent,
            tolerated_failures: policy.tolerated_failures,
            consecutive_failures: status.consecutive_failures,
            skipped: status.skipped,
            newest_completed_age_ms: opt_ms(status.newest_completed_age),
            freshness_threshold_ms: opt_ms(policy.freshness_threshold),
            failing: status.failing,
            last_failure: status.last_failure.clone().unwrap_or_default(),
            started: status.started,
            source: String::new(),
            next_due_in_ms: opt_ms(status.next_due_in),
            stale: status.stale,
            has_completed: status.newest_completed_age.is_some(),
        }
    }
}

/// The wire (and stored record's) name of a policy field.
pub fn policy_field(field: PolicyField) -> &'static str {
    match field {
        PolicyField::Interval => "interval_ms",
        PolicyField::Mode => "mode",
        PolicyField::Timeout => "timeout_ms",
        PolicyField::AlignmentTimeout => "alignment_timeout_ms",
        PolicyField::MinPause => "min_pause_ms",
        PolicyField::Jitter => "jitter_ms",
        PolicyField::MaxConcurrent => "max_concurrent",
        PolicyField::ToleratedFailures => "tolerated_failures",
        PolicyField::FreshnessThreshold => "freshness_threshold_ms",
    }
}

/// A failed `Policy::check` in wire terms: `policy.<field>: <why, with the limit>`.
pub fn policy_error(e: &PolicyError) -> String {
    format!("policy.{}: {}", policy_field(e.field), e.reason)
}
