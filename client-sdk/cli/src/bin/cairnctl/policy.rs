//! `cairnctl policy`: the snapshot schedule. Its words for durations and freshness are
//! also `cairnctl status`'s (see `health.rs`).

use std::process::ExitCode;
use std::time::Duration;

use cairn_proto::v1 as pb;
use clap::Subcommand;

use crate::output::{Output, print_json, table};
use crate::snapshot::Mode;

#[derive(Debug, Subcommand)]
pub(crate) enum PolicyCommand {
    /// Show the policy and the schedule's state (failures in a row, skips, freshness).
    Get,
    /// Change the policy; only the flags given change. The change is stored and outlives
    /// coordinator restarts (it wins over the coordinator's flags until `policy reset`).
    Set(PolicySet),
    /// Go back to the policy of the coordinator's flags and variables.
    Reset,
}

#[derive(Debug, clap::Args)]
pub(crate) struct PolicySet {
    /// Take a snapshot this often (e.g. 30s); 0s turns the schedule off.
    #[arg(long, value_parser = humantime::parse_duration)]
    interval: Option<Duration>,
    /// The mode of scheduled snapshots.
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Their timeout.
    #[arg(long, value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
    /// Aligned only: switch to unaligned after aligning this long; 0s: never.
    #[arg(long, value_parser = humantime::parse_duration)]
    alignment_timeout: Option<Duration>,
    /// Least time between the end of one scheduled snapshot and the start of the next.
    #[arg(long, value_parser = humantime::parse_duration)]
    min_pause: Option<Duration>,
    /// Up to this much random time added to each interval.
    #[arg(long, value_parser = humantime::parse_duration)]
    jitter: Option<Duration>,
    /// Most scheduled snapshots in flight at once.
    #[arg(long)]
    max_concurrent: Option<u32>,
    /// Consecutive failures tolerated before the schedule is reported failing.
    #[arg(long)]
    tolerated_failures: Option<u32>,
    /// Health service cairn.v1.SnapshotFreshness answers NOT_SERVING when no snapshot
    /// completed within this long; 0s: no threshold.
    #[arg(long, value_parser = humantime::parse_duration)]
    freshness_threshold: Option<Duration>,
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

impl PolicySet {
    /// The request: each flag given becomes a named field.
    fn request(&self) -> anyhow::Result<pb::SetPolicyRequest> {
        let mut policy = pb::Policy::default();
        let mut update = Vec::new();
        let mut set = |name: &str| update.push(name.to_owned());
        if let Some(d) = self.interval {
            policy.interval_ms = ms(d);
            set("interval_ms");
        }
        if let Some(m) = self.mode {
            policy.mode = m.pb() as i32;
            set("mode");
        }
        if let Some(d) = self.timeout {
            policy.timeout_ms = ms(d);
            set("timeout_ms");
        }
        if let Some(d) = self.alignment_timeout {
            policy.alignment_timeout_ms = ms(d);
            set("alignment_timeout_ms");
        }
        if let Some(d) = self.min_pause {
            policy.min_pause_ms = ms(d);
            set("min_pause_ms");
        }
        if let Some(d) = self.jitter {
            policy.jitter_ms = ms(d);
            set("jitter_ms");
        }
        if let Some(n) = self.max_concurrent {
            policy.max_concurrent = n;
            set("max_concurrent");
        }
        if let Some(n) = self.tolerated_failures {
            policy.tolerated_failures = n;
            set("tolerated_failures");
        }
        if let Some(d) = self.freshness_threshold {
            policy.freshness_threshold_ms = ms(d);
            set("freshness_threshold_ms");
        }
        anyhow::ensure!(
            !update.is_empty(),
            "nothing to change: give at least one of --interval, --mode, --timeout, \
             --alignment-timeout, --min-pause, --jitter, --max-concurrent, \
             --tolerated-failures, --freshness-threshold"
        );
        Ok(pb::SetPolicyRequest {
            policy: Some(policy),
            update,
            reset_to_flags: false,
        })
    }
}

pub(crate) async fn policy(
    coordinator: &str,
    output: Output,
    command: PolicyCommand,
) -> anyhow::Result<ExitCode> {
    let mut client = crate::connect(coordinator).await?;
    let policy = match command {
        PolicyCommand::Get => client.raw().get_policy(pb::GetPolicyRequest {}).await?,
        PolicyCommand::Set(set) => client.raw().set_policy(set.request()?).await?,
        PolicyCommand::Reset => {
            client
                .raw()
                .set_policy(pb::SetPolicyRequest {
                    reset_to_flags: true,
                    ..Default::default()
                })
                .await?
        }
    }
    .into_inner();
    match output {
        Output::Json => print_json(&policy)?,
        Output::Table => table(
            &["POLICY", "VALUE"],
            policy_rows(&policy)
                .into_iter()
                .map(|(k, v)| vec![k.to_owned(), v]),
        ),
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn human(ms: u64) -> String {
    humantime::format_duration(Duration::from_millis(ms)).to_string()
}

fn human_or(ms: u64, none: &str) -> String {
    if ms == 0 { none.into() } else { human(ms) }
}

pub(crate) fn policy_mode(p: &pb::Policy) -> &'static str {
    match pb::SnapshotMode::try_from(p.mode).unwrap_or(pb::SnapshotMode::Unspecified) {
        pb::SnapshotMode::Unaligned => "UNALIGNED",
        pb::SnapshotMode::Aligned => "ALIGNED",
        _ => "CHANDY_LAMPORT",
    }
}

pub(crate) fn age(p: &pb::Policy) -> String {
    if p.has_completed {
        format!("{} ago", human(p.newest_completed_age_ms))
    } else {
        "none completed".into()
    }
}

pub(crate) fn freshness(p: &pb::Policy) -> String {
    match (p.freshness_threshold_ms, p.stale) {
        (0, _) => "no threshold".into(),
        (t, true) => format!("STALE (nothing completed within {})", human(t)),
        (t, false) => format!("fresh (threshold {})", human(t)),
    }
}

fn policy_rows(p: &pb::Policy) -> Vec<(&'static str, String)> {
    vec![
        ("interval", human_or(p.interval_ms, "off")),
        ("mode", policy_mode(p).into()),
        ("timeout", human(p.timeout_ms)),
        (
            "alignment timeout",
            human_or(p.alignment_timeout_ms, "none"),
        ),
        ("min pause", human_or(p.min_pause_ms, "none")),
        ("jitter", human_or(p.jitter_ms, "none")),
        ("max concurrent", p.max_concurrent.to_string()),
        ("tolerated failures", p.tolerated_failures.to_string()),
        (
            "freshness threshold",
            human_or(p.freshness_threshold_ms, "none"),
        ),
        ("source", p.source.clone()),
        ("started", p.started.to_string()),
        ("skipped", p.skipped.to_string()),
        (
            "failures in a row",
            if p.failing {
                format!("{} (FAILING: more than tolerated)", p.consecutive_failures)
            } else {
                p.consecutive_failures.to_string()
            },
        ),
        ("last failure", p.last_failure.clone()),
        (
            "next due in",
            if p.interval_ms == 0 {
                "-".into()
            } else {
                human(p.next_due_in_ms)
            },
        ),
        ("newest completed", age(p)),
        ("freshness", freshness(p)),
    ]
}
