//! The snapshot schedule's policy and status.
//!
//! The domain-to-wire half, and `SetPolicy`'s update: the fields its update list names
//! (or, naming none, those set), taken from the request onto the policy in force
//! ([`policy_update_from_pb`], applied by [`PolicyUpdate::apply`]). `source` (flags or the API) is the coordinator's to fill in.

use std::time::Duration;

use cairn_core::schedule::{
    Policy, PolicyError, PolicyField, PolicyUpdate, Status, saturating_millis,
};

use super::mode_from_pb;
use crate::v1 as pb;

fn from_ms(v: u64) -> Option<Duration> {
    (v != 0).then(|| Duration::from_millis(v))
}

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

/// The fields `SetPolicy` may change.
const WRITABLE: &[&str] = &[
    "interval_ms",
    "mode",
    "timeout_ms",
    "alignment_timeout_ms",
    "min_pause_ms",
    "jitter_ms",
    "max_concurrent",
    "tolerated_failures",
    "freshness_threshold_ms",
];

/// The fields only the coordinator sets.
const READ_ONLY: &[&str] = &[
    "consecutive_failures",
    "skipped",
    "newest_completed_age_ms",
    "failing",
    "last_failure",
    "started",
    "source",
    "next_due_in_ms",
    "stale",
    "has_completed",
];

/// The fields of `wire` a `SetPolicy` without an update list changes: those not zero.
fn set_fields(wire: &pb::Policy) -> Vec<String> {
    let set = [
        ("interval_ms", wire.interval_ms != 0),
        ("mode", wire.mode != 0),
        ("timeout_ms", wire.timeout_ms != 0),
        ("alignment_timeout_ms", wire.alignment_timeout_ms != 0),
        ("min_pause_ms", wire.min_pause_ms != 0),
        ("jitter_ms", wire.jitter_ms != 0),
        ("max_concurrent", wire.max_concurrent != 0),
        ("tolerated_failures", wire.tolerated_failures != 0),
        ("freshness_threshold_ms", wire.freshness_threshold_ms != 0),
    ];
    set.iter()
        .filter(|(_, on)| *on)
        .map(|(name, _)| (*name).to_owned())
        .collect()
}

/// `SetPolicy`'s change: the fields `update` names (or, if it names none, the fields of
/// `wire` that are not zero), taken from `wire`. A name that is not a writable field, or no
/// field at all, is refused, saying which fields may be named.
pub fn policy_update_from_pb(wire: &pb::Policy, update: &[String]) -> Result<PolicyUpdate, String> {
    let names = if update.is_empty() {
        set_fields(wire)
    } else {
        update.to_vec()
    };
    if names.is_empty() {
        return Err("nothing to change: set a field of `policy` or name fields in `update`".into());
    }
    let mut change = PolicyUpdate::default();
    for name in &names {
        match name.as_str() {
            "interval_ms" => change.interval = Some(Duration::from_millis(wire.interval_ms)),
            "mode" => {
                change.mode =
                    Some(mode_from_pb(wire.mode, None).map_err(|e| format!("mode: {e}"))?);
            }
            "timeout_ms" => change.timeout = Some(Duration::from_millis(wire.timeout_ms)),
            "alignment_timeout_ms" => {
                change.alignment_timeout = Some(from_ms(wire.alignment_timeout_ms));
            }
            "min_pause_ms" => change.min_pause = Some(Duration::from_millis(wire.min_pause_ms)),
            "jitter_ms" => change.jitter = Some(Duration::from_millis(wire.jitter_ms)),
            "max_concurrent" => change.max_concurrent = Some(wire.max_concurrent),
            "tolerated_failures" => change.tolerated_failures = Some(wire.tolerated_failures),
            "freshness_threshold_ms" => {
                change.freshness_threshold = Some(from_ms(wire.freshness_threshold_ms));
            }
            other if READ_ONLY.contains(&other) => {
                return Err(format!(
                    "`{other}` is read-only; the fields SetPolicy changes are: {}",
                    WRITABLE.join(", ")
                ));
            }
            other => {
                return Err(format!(
                    "unknown policy field `{other}`; the fields SetPolicy changes are: {}",
                    WRITABLE.join(", ")
                ));
            }
        }
    }
    Ok(change)
}

/// `current` with `SetPolicy`'s change ([`policy_update_from_pb`]) applied and checked; a
/// failed check in wire terms ([`policy_error`]).
pub fn apply_policy_update(
    current: &Policy,
    wire: &pb::Policy,
    update: &[String],
) -> Result<Policy, String> {
    policy_update_from_pb(wire, update)?
        .apply(current)
        .map_err(|e| policy_error(&e))
}
