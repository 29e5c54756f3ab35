//! `cairnctl policy` and `cairnctl status`: the snapshot schedule and the cluster at a glance.

use std::process::ExitCode;
use std::time::Duration;

use cairn_proto::v1 as pb;
use cairn_sdk::CoordinatorClient;
use clap::Subcommand;

use super::{Mode, Output, mode_word, status_word, table};

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
    let mut client = CoordinatorClient::connect(coordinator).await?;
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
        Output::Json => println!("{}", serde_json::to_string_pretty(&policy_json(&policy))?),
        Output::Table => table(
            &["POLICY", "VALUE"],
            policy_rows(&policy)
                .into_iter()
                .map(|(k, v)| vec![k.to_owned(), v]),
        ),
    }
    Ok(ExitCode::SUCCESS)
}

fn human(ms: u64) -> String {
    humantime::format_duration(Duration::from_millis(ms)).to_string()
}

fn human_or(ms: u64, none: &str) -> String {
    if ms == 0 { none.into() } else { human(ms) }
}

fn policy_mode(p: &pb::Policy) -> &'static str {
    match pb::SnapshotMode::try_from(p.mode).unwrap_or(pb::SnapshotMode::Unspecified) {
        pb::SnapshotMode::Unaligned => "UNALIGNED",
        pb::SnapshotMode::Aligned => "ALIGNED",
        _ => "CHANDY_LAMPORT",
    }
}

fn age(p: &pb::Policy) -> String {
    if p.has_completed {
        format!("{} ago", human(p.newest_completed_age_ms))
    } else {
        "none completed".into()
    }
}

fn freshness(p: &pb::Policy) -> String {
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

fn policy_json(p: &pb::Policy) -> serde_json::Value {
    serde_json::json!({
        "interval_ms": p.interval_ms,
        "mode": policy_mode(p),
        "timeout_ms": p.timeout_ms,
        "alignment_timeout_ms": p.alignment_timeout_ms,
        "min_pause_ms": p.min_pause_ms,
        "jitter_ms": p.jitter_ms,
        "max_concurrent": p.max_concurrent,
        "tolerated_failures": p.tolerated_failures,
        "freshness_threshold_ms": p.freshness_threshold_ms,
        "source": p.source,
        "started": p.started,
        "skipped": p.skipped,
        "consecutive_failures": p.consecutive_failures,
        "failing": p.failing,
        "last_failure": p.last_failure,
        "next_due_in_ms": p.next_due_in_ms,
        "newest_completed_age_ms": p.has_completed.then_some(p.newest_completed_age_ms),
        "stale": p.stale,
    })
}

/// `cairnctl status`: members, snapshots in flight, the newest completed one, the schedule
/// and freshness.
pub(crate) async fn status(coordinator: &str, output: Output) -> anyhow::Result<ExitCode> {
    let mut client = CoordinatorClient::connect(coordinator).await?;
    let nodes = client
        .raw()
        .list_nodes(pb::ListNodesRequest {})
        .await?
        .into_inner();
    let list = |status: pb::SnapshotStatus, page_size| pb::ListSnapshotsRequest {
        status: status as i32,
        page_size,
        page_token: String::new(),
    };
    let running = client
        .raw()
        .list_snapshots(list(pb::SnapshotStatus::InProgress, 1000))
        .await?
        .into_inner()
        .snapshots;
    let newest = client
        .raw()
        .list_snapshots(list(pb::SnapshotStatus::Completed, 1))
        .await?
        .into_inner()
        .snapshots
        .into_iter()
        .next();
    let policy = client
        .raw()
        .get_policy(pb::GetPolicyRequest {})
        .await?
        .into_inner();
    let last_restore = client
        .raw()
        .list_restores(pb::ListRestoresRequest { limit: 1 })
        .await?
        .into_inner()
        .restores
        .into_iter()
        .next();
    let restore_text = last_restore.as_ref().map(|r| {
        let state = if r.done {
            "DONE".to_owned()
        } else if let Some(f) = &r.failure {
            format!("FAILED: {}", f.message)
        } else {
            format!(
                "IN_PROGRESS ({}/{} applied)",
                r.applied.len(),
                r.nodes.len()
            )
        };
        format!(
            "{} of snapshot {} (epoch {}, by {}): {state}",
            r.restore_id, r.snapshot_id, r.epoch, r.requested_by
        )
    });
    let connected = nodes.nodes.iter().filter(|n| n.connected).count();
    let down: Vec<&str> = nodes
        .nodes
        .iter()
        .filter(|n| !n.connected)
        .map(|n| n.node_id.as_str())
        .collect();
    let id = |s: &pb::Snapshot| s.plan.as_ref().map_or(0, |p| p.snapshot_id);
    if output == Output::Json {
        let json = serde_json::json!({
            "coordinator": coordinator,
            "nodes": nodes.nodes.len(),
            "connected": connected,
            "not_connected": down,
            "in_progress": running.iter().map(id).collect::<Vec<_>>(),
            "newest_completed": newest.as_ref().map(|s| serde_json::json!({
                "id": id(s), "mode": mode_word(s), "status": status_word(s.status),
                "finished_at_ms": s.finished_at_ms,
                "duration_ms": s.finished_at_ms.saturating_sub(s.started_at_ms),
            })),
            "policy": policy_json(&policy),
            "last_restore": restore_text,
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(ExitCode::SUCCESS);
    }
    let mut rows = vec![
        ("coordinator", coordinator.to_owned()),
        (
            "nodes",
            if down.is_empty() {
                format!("{connected}/{} connected", nodes.nodes.len())
            } else {
                format!(
                    "{connected}/{} connected; not connected: {}",
                    nodes.nodes.len(),
                    down.join(", ")
                )
            },
        ),
        (
            "in progress",
            if running.is_empty() {
                "none".into()
            } else {
                running
                    .iter()
                    .map(|s| id(s).to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        ),
        (
            "newest completed",
            match &newest {
                None => "none".into(),
                Some(s) => format!(
                    "#{} {}, took {} ms, {}",
                    id(s),
                    mode_word(s),
                    s.finished_at_ms.saturating_sub(s.started_at_ms),
                    age(&policy)
                ),
            },
        ),
    ];
    let schedule = if policy.interval_ms == 0 {
        "off".to_owned()
    } else {
        format!(
            "every {}{}, {}; {} started, {} skipped, {} failed in a row{}",
            human(policy.interval_ms),
            if policy.jitter_ms > 0 {
                format!(" (+ up to {})", human(policy.jitter_ms))
            } else {
                String::new()
            },
            policy_mode(&policy),
            policy.started,
            policy.skipped,
            policy.consecutive_failures,
            if policy.failing { " (FAILING)" } else { "" }
        )
    };
    rows.push(("schedule", schedule));
    rows.push((
        "last restore",
        restore_text.unwrap_or_else(|| "none".into()),
    ));
    rows.push(("freshness", freshness(&policy)));
    table(
        &["CLUSTER", ""],
        rows.into_iter().map(|(k, v)| vec![k.to_owned(), v]),
    );
    Ok(ExitCode::SUCCESS)
}
