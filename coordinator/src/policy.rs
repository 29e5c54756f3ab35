//! The snapshot policy between its three forms: the domain's [`Policy`], the stored
//! [`PolicyRecord`] and the wire's `cairn.v1.Policy`; and `SetPolicy`'s field updates.

use std::time::Duration;

use cairn_core::schedule::{Policy, saturating_millis};
use cairn_proto::convert::{policy_error, policy_update_from_pb};
use cairn_proto::v1 as pb;

use crate::error::Error;
use crate::store::PolicyRecord;
use cairn_proto::stored::convert::{mode_name, now_ms};

/// The health service name whose status follows the freshness of the newest snapshot.
pub const FRESHNESS_SERVICE: &str = "cairn.v1.SnapshotFreshness";

/// What `SetPolicy` asks for.
pub use cairn_core::schedule::PolicyChange as Change;
/// Where the policy in force came from.
pub use cairn_core::schedule::PolicySource as Source;
/// The policy in force as `GetPolicy` and `SetPolicy` answer it.
pub use cairn_core::schedule::PolicyView as View;

fn ms(d: Duration) -> u64 {
    saturating_millis(d)
}

fn opt_ms(d: Option<Duration>) -> u64 {
    d.map_or(0, ms)
}

fn from_ms(v: u64) -> Option<Duration> {
    (v > 0).then(|| Duration::from_millis(v))
}

fn mode_from_name(name: &str) -> cairn_core::SnapshotMode {
    match name {
        "UNALIGNED" => cairn_core::SnapshotMode::Unaligned,
        "ALIGNED" => cairn_core::SnapshotMode::Aligned,
        _ => cairn_core::SnapshotMode::ChandyLamport,
    }
}

/// The record to store.
pub fn to_record(policy: &Policy, source: Source) -> PolicyRecord {
    PolicyRecord {
        interval_ms: ms(policy.interval),
        mode: mode_name(policy.mode),
        timeout_ms: ms(policy.timeout),
        alignment_timeout_ms: opt_ms(policy.alignment_timeout),
        min_pause_ms: ms(policy.min_pause),
        jitter_ms: ms(policy.jitter),
        max_concurrent: policy.max_concurrent,
        tolerated_failures: policy.tolerated_failures,
        freshness_threshold_ms: opt_ms(policy.freshness_threshold),
        source: source.name().into(),
        updated_at_ms: now_ms(),
    }
}

/// The policy a stored record holds, and where it came from.
pub fn from_record(record: &PolicyRecord) -> (Policy, Source) {
    let policy = Policy {
        interval: Duration::from_millis(record.interval_ms),
        mode: mode_from_name(&record.mode),
        timeout: Duration::from_millis(record.timeout_ms),
        alignment_timeout: from_ms(record.alignment_timeout_ms),
        min_pause: Duration::from_millis(record.min_pause_ms),
        jitter: Duration::from_millis(record.jitter_ms),
        max_concurrent: record.max_concurrent,
        tolerated_failures: record.tolerated_failures,
        freshness_threshold: from_ms(record.freshness_threshold_ms),
    };
    let source = if record.source == "api" {
        Source::Api
    } else {
        Source::Flags
    };
    (policy, source)
}

/// What the coordinator follows at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AtStart {
    /// The policy.
    pub policy: Policy,
    /// Where it came from.
    pub source: Source,
    /// Why a policy stored through `SetPolicy` was set aside for the flags', if it was.
    pub rejected: Option<String>,
}

/// The policy to follow at start: the stored one if it was set through `SetPolicy` and is
/// still valid (it passes [`Policy::check`] and fits the coordinator's `max_in_flight`),
/// else the flags'. `stored` is the stored value, if any, as bytes; nothing here panics,
/// whatever they hold.
pub fn at_start(flags: &Policy, stored: Option<&[u8]>, max_in_flight: usize) -> AtStart {
    let use_flags = |rejected: Option<String>| AtStart {
        policy: flags.clone(),
        source: Source::Flags,
        rejected,
    };
    let Some(bytes) = stored else {
        return use_flags(None);
    };
    let record = match serde_json::from_slice::<PolicyRecord>(bytes) {
        Ok(record) => record,
        Err(e) => return use_flags(Some(format!("unreadable: {e}"))),
    };
    let (policy, source) = from_record(&record);
    if source != Source::Api {
        return use_flags(None);
    }
    if let Err(e) = policy.check() {
        return use_flags(Some(policy_error(&e)));
    }
    if policy.max_concurrent as usize > max_in_flight {
        return use_flags(Some(format!(
            "policy.max_concurrent {} is above the coordinator's --max-concurrent {max_in_flight}",
            policy.max_concurrent
        )));
    }
    AtStart {
        policy,
        source,
        rejected: None,
    }
}

/// The wire form of the policy in force.
pub fn view_pb(view: &View) -> pb::Policy {
    pb::Policy {
        source: view.source.name().into(),
        ..(&view.policy, &view.status).into()
    }
}

/// What a `SetPolicy` request asks for: a reset takes nothing else; an update names at
/// least one writable field.
pub fn change_from_pb(request: pb::SetPolicyRequest) -> Result<Change, Error> {
    if request.reset_to_flags {
        if request.policy.is_some() || !request.update.is_empty() {
            return Err(Error::InvalidArgument(
                "reset_to_flags takes no policy and no update".into(),
            ));
        }
        return Ok(Change::ResetToFlags);
    }
    let wire = request.policy.unwrap_or_default();
    policy_update_from_pb(&wire, &request.update)
        .map(Change::Update)
        .map_err(Error::InvalidArgument)
}

/// A one-line account of a policy for logs.
pub fn describe(policy: &Policy) -> String {
    if !policy.enabled() {
        return "no schedule".into();
    }
    let mut text = format!(
        "every {:?} (+ up to {:?} jitter), {}, timeout {:?}, at most {} at once",
        policy.interval, policy.jitter, policy.mode, policy.timeout, policy.max_concurrent
    );
    if let Some(t) = policy.alignment_timeout {
        text.push_str(&format!(", alignment timeout {t:?}"));
    }
    if !policy.min_pause.is_zero() {
        text.push_str(&format!(", min pause {:?}", policy.min_pause));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `SetPolicy`'s path: the wire's update read, then applied.
    fn apply(current: &Policy, wire: &pb::Policy, update: &[String]) -> Result<Policy, Error> {
        let update = policy_update_from_pb(wire, update).map_err(Error::InvalidArgument)?;
        update
            .apply(current)
            .map_err(|e| Error::InvalidArgument(policy_error(&e)))
    }

    #[test]
    fn a_record_round_trips() {
        let policy = Policy {
            interval: Duration::from_secs(30),
            mode: cairn_core::SnapshotMode::Aligned,
            alignment_timeout: Some(Duration::from_millis(100)),
            freshness_threshold: Some(Duration::from_secs(120)),
            ..Policy::default()
        };
        let record = to_record(&policy, Source::Api);
        assert_eq!(from_record(&record), (policy, Source::Api));
    }

    #[test]
    fn updates_name_fields_or_take_the_set_ones() {
        let current = Policy {
            interval: Duration::from_secs(30),
            ..Policy::default()
        };
        let wire = pb::Policy {
            jitter_ms: 500,
            ..Default::default()
        };
        let next = apply(&current, &wire, &[]).unwrap();
        assert_eq!(
            (next.interval, next.jitter),
            (Duration::from_secs(30), Duration::from_millis(500))
        );
        // Naming a field sets it to zero: the schedule goes off.
        let off = apply(&current, &pb::Policy::default(), &["interval_ms".into()]).unwrap();
        assert!(!off.enabled());
        assert!(apply(&current, &pb::Policy::default(), &[]).is_err());
        let e = apply(&current, &wire, &["skipped".into()]).unwrap_err();
        assert!(e.to_string().contains("read-only"), "{e}");
        let e = apply(&current, &wire, &["intervl".into()]).unwrap_err();
        assert!(e.to_string().contains("interval_ms"), "{e}");
        let e = apply(
            &current,
            &pb::Policy {
                max_concurrent: 0,
                ..wire
            },
            &["max_concurrent".into()],
        );
        assert!(e.is_err());
    }

    #[test]
    fn out_of_range_values_are_refused_naming_the_wire_field() {
        let current = Policy::default();
        let refused = |wire: pb::Policy, update: &[&str]| {
            let update: Vec<String> = update.iter().map(|s| (*s).to_owned()).collect();
            apply(&current, &wire, &update).unwrap_err().to_string()
        };
        // The policy that once panicked the coordinator's task.
        let e = refused(
            pb::Policy {
                interval_ms: 10,
                jitter_ms: u64::MAX,
                ..Default::default()
            },
            &[],
        );
        assert!(
            e.contains("policy.interval_ms") && e.contains("100 ms"),
            "{e}"
        );
        let e = refused(
            pb::Policy {
                interval_ms: 1000,
                jitter_ms: u64::MAX,
                ..Default::default()
            },
            &[],
        );
        assert!(e.contains("policy.jitter_ms"), "{e}");
        let e = refused(
            pb::Policy {
                interval_ms: u64::MAX,
                ..Default::default()
            },
            &[],
        );
        assert!(
            e.contains("policy.interval_ms") && e.contains("30 days"),
            "{e}"
        );
        for (field, wire) in [
            (
                "timeout_ms",
                pb::Policy {
                    timeout_ms: u64::MAX,
                    ..Default::default()
                },
            ),
            (
                "min_pause_ms",
                pb::Policy {
                    min_pause_ms: u64::MAX,
                    ..Default::default()
                },
            ),
            (
                "freshness_threshold_ms",
                pb::Policy {
                    freshness_threshold_ms: u64::MAX,
                    ..Default::default()
                },
            ),
            (
                "max_concurrent",
                pb::Policy {
                    max_concurrent: u32::MAX,
                    ..Default::default()
                },
            ),
            (
                "tolerated_failures",
                pb::Policy {
                    tolerated_failures: u32::MAX,
                    ..Default::default()
                },
            ),
        ] {
            let e = refused(wire, &[field]);
            assert!(e.contains(&format!("policy.{field}")), "{field}: {e}");
        }
        let e = refused(
            pb::Policy {
                mode: pb::SnapshotMode::Aligned as i32,
                alignment_timeout_ms: u64::MAX,
                ..Default::default()
            },
            &[],
        );
        assert!(e.contains("policy.alignment_timeout_ms"), "{e}");
        // The limits themselves are accepted.
        let ok = apply(
            &current,
            &pb::Policy {
                interval_ms: 30 * 86_400_000,
                jitter_ms: 30 * 86_400_000,
                timeout_ms: 86_400_000,
                ..Default::default()
            },
            &[],
        );
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn at_start_a_stored_policy_that_fails_the_check_gives_way_to_the_flags() {
        let flags = Policy {
            interval: Duration::from_secs(1),
            ..Policy::default()
        };
        let api = Policy {
            interval: Duration::from_secs(5),
            ..Policy::default()
        };
        let bytes = |policy: &Policy, source| {
            serde_json::to_vec(&to_record(policy, source)).expect("plain record")
        };
        // Nothing stored, or stored from the flags: the flags.
        assert_eq!(at_start(&flags, None, 4).policy, flags);
        let from_flags = at_start(&flags, Some(&bytes(&api, Source::Flags)), 4);
        assert_eq!(
            (from_flags.policy, from_flags.rejected),
            (flags.clone(), None)
        );
        // Set through the API and valid: it wins.
        let chosen = at_start(&flags, Some(&bytes(&api, Source::Api)), 4);
        assert_eq!(
            chosen,
            AtStart {
                policy: api.clone(),
                source: Source::Api,
                rejected: None
            }
        );
        // The policies that once crashed the coordinator at every start.
        for bad in [
            Policy {
                interval: Duration::from_millis(10),
                jitter: Duration::from_millis(u64::MAX),
                ..Policy::default()
            },
            Policy {
                interval: Duration::from_millis(u64::MAX),
                ..Policy::default()
            },
            Policy {
                timeout: Duration::ZERO,
                ..api.clone()
            },
        ] {
            let chosen = at_start(&flags, Some(&bytes(&bad, Source::Api)), 4);
            assert_eq!((&chosen.policy, chosen.source), (&flags, Source::Flags));
            let why = chosen.rejected.unwrap();
            assert!(why.starts_with("policy."), "{why}");
        }
        // Above a lowered --max-concurrent.
        let wide = Policy {
            max_concurrent: 3,
            ..api.clone()
        };
        let chosen = at_start(&flags, Some(&bytes(&wide, Source::Api)), 2);
        assert!(chosen.rejected.unwrap().contains("--max-concurrent 2"));
        // Garbage, or a record of other types or out-of-range numbers.
        for junk in [
            &b"\xff\x00"[..],
            b"{}",
            b"[]",
            br#"{"interval_ms": -1}"#,
            br#"{"interval_ms": 1e30, "source": "api"}"#,
        ] {
            let chosen = at_start(&flags, Some(junk), 4);
            assert_eq!(chosen.policy, flags);
        }
    }

    #[test]
    fn extreme_values_round_trip_without_truncation() {
        let policy = Policy {
            interval: Duration::from_millis(u64::MAX),
            ..Policy::default()
        };
        assert_eq!(to_record(&policy, Source::Api).interval_ms, u64::MAX);
        let huge = Policy {
            interval: Duration::MAX,
            ..Policy::default()
        };
        assert_eq!(to_record(&huge, Source::Api).interval_ms, u64::MAX);
    }

    #[test]
    fn leaving_aligned_drops_the_alignment_timeout() {
        let current = Policy {
            mode: cairn_core::SnapshotMode::Aligned,
            alignment_timeout: Some(Duration::from_millis(100)),
            ..Policy::default()
        };
        let wire = pb::Policy {
            mode: pb::SnapshotMode::Unaligned as i32,
            ..Default::default()
        };
        let next = apply(&current, &wire, &[]).unwrap();
        assert_eq!(next.alignment_timeout, None);
        let both = pb::Policy {
            alignment_timeout_ms: 50,
            ..wire
        };
        assert!(
            apply(&current, &both, &[]).is_err(),
            "timeout without ALIGNED"
        );
    }
}
