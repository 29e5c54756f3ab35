//! Scheduled snapshots under a bank workload: the rate within the jitter, no overlap beyond
//! the limit, the minimum pause after a slow (held) snapshot with due ones skipped rather
//! than queued, failures counted and reset by a success, the freshness health service
//! flipping both ways, and a policy set at run time surviving a coordinator restart (etcd).

use std::time::Duration;

use cairn_integration_tests::coordinated::{
    CoordinatedCluster, Store, assert_completed, channel_fault, scrape,
};
use cairn_integration_tests::etcd::Etcd;
use cairn_integration_tests::processes::{binary, eventually};
use cairn_proto::v1 as pb;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const FRESHNESS: &str = "cairn.v1.SnapshotFreshness";

async fn policy(cluster: &CoordinatedCluster) -> anyhow::Result<pb::Policy> {
    Ok(cluster
        .client()
        .await?
        .get_policy(pb::GetPolicyRequest {})
        .await?
        .into_inner())
}

/// Every scheduled snapshot, oldest first.
async fn scheduled(cluster: &CoordinatedCluster) -> Vec<pb::Snapshot> {
    let mut snapshots = cluster
        .client()
        .await
        .unwrap()
        .list_snapshots(pb::ListSnapshotsRequest {
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshots;
    snapshots.retain(|s| s.labels.get("scheduled").map(String::as_str) == Some("true"));
    snapshots.reverse();
    snapshots
}

fn id(s: &pb::Snapshot) -> u64 {
    s.plan.as_ref().map_or(0, |p| p.snapshot_id)
}

/// Waits until `n` scheduled snapshots have ended; returns every scheduled one.
async fn wait_ended(cluster: &CoordinatedCluster, n: usize) -> Vec<pb::Snapshot> {
    eventually(
        &format!("{n} scheduled snapshots end"),
        Duration::from_secs(60),
        || async {
            let all = scheduled(cluster).await;
            let ended = all.iter().filter(|s| s.finished_at_ms > 0).count();
            anyhow::ensure!(ended >= n, "{ended} ended");
            Ok(all)
        },
    )
    .await
    .unwrap()
}

/// The freshness health stream, at its first answer.
async fn freshness(
    cluster: &CoordinatedCluster,
) -> tonic::Streaming<tonic_health::pb::HealthCheckResponse> {
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.coordinator))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let mut client = HealthClient::new(channel);
    client
        .watch(tonic_health::pb::HealthCheckRequest {
            service: FRESHNESS.into(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// Reads the health stream until it says `want`.
async fn health_becomes(
    stream: &mut tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
    want: ServingStatus,
    within: Duration,
) {
    tokio::time::timeout(within, async {
        while let Some(answer) = stream.message().await.unwrap() {
            if answer.status == want as i32 {
                return;
            }
        }
        panic!("the health stream ended");
    })
    .await
    .unwrap_or_else(|_| panic!("{FRESHNESS} did not become {want:?} within {within:?}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_snapshots_keep_the_rate_within_the_jitter_beside_manual_ones() {
    let cluster = CoordinatedCluster::start(
        3,
        Store::Embedded,
        &[],
        &["--schedule-interval", "300ms", "--schedule-jitter", "100ms"],
    )
    .await
    .unwrap();
    // A manual snapshot alongside the schedule.
    let manual = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    let manual = cluster.wait(manual).await.unwrap();
    assert_completed(&manual, cluster.total());
    assert!(!manual.labels.contains_key("scheduled"));

    let all = wait_ended(&cluster, 8).await;
    let ended: Vec<&pb::Snapshot> = all.iter().filter(|s| s.finished_at_ms > 0).collect();
    for s in &ended {
        let full = cluster.wait(id(s)).await.unwrap();
        assert_completed(&full, cluster.total());
    }
    let state = policy(&cluster).await.unwrap();
    assert_eq!(state.interval_ms, 300);
    assert_eq!(state.source, "flags");
    assert!(state.started >= 8, "{state:?}");
    assert!(state.has_completed && !state.failing, "{state:?}");
    // Due times are interval + jitter apart and do not drift; a start lags its due time by
    // the store's latency, so gaps are allowed that much slack either way (a skipped due
    // time makes a gap of two).
    let slack = 100;
    let allowed_gap = (1 + state.skipped) * 400 + 2 * slack;
    for pair in ended.windows(2) {
        let gap = pair[1].started_at_ms - pair[0].started_at_ms;
        assert!(
            (300 - slack..=allowed_gap).contains(&gap),
            "snapshots {} and {} started {gap} ms apart (interval 300 ms, jitter 100 ms, \
             {} skipped)",
            id(pair[0]),
            id(pair[1]),
            state.skipped
        );
        // One at a time (--schedule-max-concurrent 1).
        assert!(pair[1].started_at_ms >= pair[0].finished_at_ms, "overlap");
    }
    let metrics = scrape(&cluster.coordinator_metrics).await.unwrap();
    assert!(
        metrics.contains("cairn_newest_completed_snapshot_age_seconds"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_snapshot_makes_due_ones_skip_and_the_pause_holds_after_it() {
    use pb::inject_fault_request::Fault;
    let cluster = CoordinatedCluster::start_with(
        2,
        Store::Embedded,
        &[],
        &[
            "--schedule-interval",
            "100ms",
            "--schedule-min-pause",
            "400ms",
            "--schedule-max-concurrent",
            "2",
            "--schedule-timeout",
            "60s",
        ],
        &["--fault-injection"],
    )
    .await
    .unwrap();
    wait_ended(&cluster, 1).await;
    // Hold n1->n2 at n2: the next scheduled snapshot cannot complete.
    let mut n2 = cluster.admin(1).await.unwrap();
    n2.inject_fault(channel_fault("n1", "n2", Fault::Hold(pb::Hold {})))
        .await
        .unwrap();
    let held_from = now_ms();
    // A snapshot started after the hold cannot complete while it lasts.
    let held_id = eventually("a held snapshot", Duration::from_secs(30), || async {
        let all = scheduled(&cluster).await;
        let held = all
            .iter()
            .find(|s| s.finished_at_ms == 0 && s.started_at_ms >= held_from);
        held.map(id)
            .ok_or_else(|| anyhow::anyhow!("none started since the hold"))
    })
    .await
    .unwrap();
    // Ten due times pass while it is held: each is skipped, none queued.
    let before = policy(&cluster).await.unwrap().skipped;
    eventually(
        "due snapshots are skipped",
        Duration::from_secs(30),
        || async {
            let state = policy(&cluster).await?;
            anyhow::ensure!(state.skipped >= before + 10, "{} skipped", state.skipped);
            Ok(())
        },
    )
    .await
    .unwrap();
    let unfinished: Vec<u64> = scheduled(&cluster)
        .await
        .iter()
        .filter(|s| s.finished_at_ms == 0)
        .map(id)
        .collect();
    assert_eq!(
        unfinished,
        [held_id],
        "one held snapshot, nothing queued or overlapping"
    );
    let resumed_from = now_ms();
    n2.inject_fault(channel_fault("n1", "n2", Fault::Resume(pb::Resume {})))
        .await
        .unwrap();
    let all = eventually(
        "two more after the held one",
        Duration::from_secs(30),
        || async {
            let all = scheduled(&cluster).await;
            let after = all
                .iter()
                .filter(|s| id(s) > held_id && s.finished_at_ms > 0)
                .count();
            anyhow::ensure!(after >= 2, "{after} ended after the held one");
            Ok(all)
        },
    )
    .await
    .unwrap();
    let held = all.iter().find(|s| id(s) == held_id).unwrap();
    assert_completed(&cluster.wait(held_id).await.unwrap(), cluster.total());
    // It ended only once the hold was lifted (ten skipped due times say how long it was
    // held, not that it lasted 1 s: the first may come just after `before` was read).
    assert!(
        held.finished_at_ms >= resumed_from,
        "the held snapshot ended at {} ms, before the hold was lifted at {resumed_from} ms",
        held.finished_at_ms
    );
    for pair in all.windows(2).filter(|p| p[1].finished_at_ms > 0) {
        let pause = pair[1].started_at_ms as i64 - pair[0].finished_at_ms as i64;
        assert!(
            pause >= 395,
            "snapshot {} started {pause} ms after {} ended (min pause 400 ms)",
            id(&pair[1]),
            id(&pair[0])
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_reset_by_a_success_and_freshness_flips_both_ways() {
    use pb::inject_fault_request::Fault;
    let cluster = CoordinatedCluster::start_with(
        2,
        Store::Embedded,
        &[],
        &[
            "--schedule-interval",
            "200ms",
            "--schedule-timeout",
            "300ms",
            "--schedule-tolerated-failures",
            "2",
            "--freshness-threshold",
            "2s",
        ],
        &["--fault-injection"],
    )
    .await
    .unwrap();
    let mut health = freshness(&cluster).await;
    health_becomes(&mut health, ServingStatus::Serving, Duration::from_secs(30)).await;
    wait_ended(&cluster, 1).await;

    let mut n2 = cluster.admin(1).await.unwrap();
    n2.inject_fault(channel_fault("n1", "n2", Fault::Hold(pb::Hold {})))
        .await
        .unwrap();
    let failing = eventually("the schedule fails", Duration::from_secs(30), || async {
        let state = policy(&cluster).await?;
        anyhow::ensure!(
            state.failing,
            "{} failures in a row",
            state.consecutive_failures
        );
        Ok(state)
    })
    .await
    .unwrap();
    assert!(failing.consecutive_failures > 2, "{failing:?}");
    assert!(
        failing.last_failure.contains("timed out") || failing.last_failure.contains("timeout"),
        "{}",
        failing.last_failure
    );
    let metrics = scrape(&cluster.coordinator_metrics).await.unwrap();
    assert!(metrics.contains("cairn_schedule_failing 1"), "{metrics}");
    let log = cluster.log_of("coordinator");
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("scheduled snapshots are failing")),
        "no error-level line in the coordinator's log:\n{log}"
    );
    // Nothing completes: the newest completed snapshot grows older than 2 s.
    health_becomes(
        &mut health,
        ServingStatus::NotServing,
        Duration::from_secs(30),
    )
    .await;
    assert!(policy(&cluster).await.unwrap().stale);
    // The schedule keeps trying; once the channel flows, a success resets the count.
    n2.inject_fault(channel_fault("n1", "n2", Fault::Resume(pb::Resume {})))
        .await
        .unwrap();
    health_becomes(&mut health, ServingStatus::Serving, Duration::from_secs(30)).await;
    let healthy = eventually("the schedule recovers", Duration::from_secs(30), || async {
        let state = policy(&cluster).await?;
        anyhow::ensure!(
            state.consecutive_failures == 0 && !state.failing && !state.stale,
            "{state:?}"
        );
        Ok(state)
    })
    .await
    .unwrap();
    assert!(healthy.last_failure.is_empty());
    let metrics = scrape(&cluster.coordinator_metrics).await.unwrap();
    assert!(metrics.contains("cairn_schedule_failing 0"), "{metrics}");
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn cairnctl(cluster: &CoordinatedCluster, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(binary("cairnctl").unwrap())
        .args(["--coordinator", &cluster.coordinator])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_set_at_run_time_survives_a_coordinator_restart() {
    let etcd = Etcd::start().await.expect("etcd starts");
    let mut cluster = CoordinatedCluster::start(
        2,
        Store::Etcd(etcd.endpoint.clone()),
        &[],
        &["--max-concurrent", "2"],
    )
    .await
    .unwrap();
    let off = policy(&cluster).await.unwrap();
    assert_eq!((off.interval_ms, off.source.as_str()), (0, "flags"));

    // Bad changes are refused with the reason.
    let mut client = cluster.client().await.unwrap();
    let refused = client
        .set_policy(pb::SetPolicyRequest {
            policy: Some(pb::Policy::default()),
            update: vec!["intervall_ms".into()],
            reset_to_flags: false,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("interval_ms"), "{refused:?}");
    let (ok, _, err) = cairnctl(&cluster, &["policy", "set", "--max-concurrent", "3"]);
    assert!(!ok && err.contains("--max-concurrent 2"), "{err}");
    let (ok, _, err) = cairnctl(&cluster, &["policy", "set", "--alignment-timeout", "1s"]);
    assert!(!ok && err.contains("ALIGNED"), "{err}");

    // Set through cairnctl; read back through the API.
    let (ok, out, err) = cairnctl(
        &cluster,
        &[
            "policy",
            "set",
            "--interval",
            "250ms",
            "--mode",
            "aligned",
            "--alignment-timeout",
            "100ms",
            "--jitter",
            "20ms",
            "--freshness-threshold",
            "10m",
        ],
    );
    assert!(ok, "{err}");
    assert!(out.contains("250ms") && out.contains("ALIGNED"), "{out}");
    let set = policy(&cluster).await.unwrap();
    assert_eq!(
        (
            set.interval_ms,
            set.mode,
            set.alignment_timeout_ms,
            set.jitter_ms,
            set.freshness_threshold_ms,
            set.source.as_str()
        ),
        (
            250,
            pb::SnapshotMode::Aligned as i32,
            100,
            20,
            600_000,
            "api"
        )
    );
    let stored = etcd.get_prefix("/cairn/cairn/policy").await.unwrap();
    assert!(stored.contains("\"interval_ms\": 250"), "{stored}");

    cluster.kill_coordinator();
    cluster.start_coordinator().unwrap();
    cluster.wait_registered(2).await.unwrap();
    let after = policy(&cluster).await.unwrap();
    assert_eq!(
        (
            after.interval_ms,
            after.mode,
            after.alignment_timeout_ms,
            after.source.as_str()
        ),
        (250, pb::SnapshotMode::Aligned as i32, 100, "api"),
        "{after:?}"
    );
    // The restarted coordinator takes ALIGNED snapshots on schedule.
    let aligned = eventually(
        "a scheduled snapshot after the restart",
        Duration::from_secs(30),
        || async {
            let mut client = cluster.client().await?;
            let done = client
                .list_snapshots(pb::ListSnapshotsRequest {
                    status: pb::SnapshotStatus::Completed as i32,
                    page_size: 1,
                    ..Default::default()
                })
                .await?
                .into_inner()
                .snapshots;
            let s = done
                .into_iter()
                .find(|s| s.labels.contains_key("scheduled"));
            s.ok_or_else(|| anyhow::anyhow!("none yet"))
        },
    )
    .await
    .unwrap();
    assert_eq!(
        aligned.plan.as_ref().unwrap().mode,
        pb::SnapshotMode::Aligned as i32
    );
    let (ok, out, err) = cairnctl(&cluster, &["status"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("2/2 connected") && out.contains("every 250ms"),
        "{out}"
    );
    let (ok, out, err) = cairnctl(&cluster, &["-o", "json", "status"]);
    assert!(ok, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    // The protobuf JSON mapping: the snapshot as GetSnapshot answers it, a uint64 a string.
    let newest = json["newestCompleted"]["plan"]["snapshotId"].as_str();
    assert!(
        newest
            .and_then(|id| id.parse::<u64>().ok())
            .is_some_and(|id| id > 0),
        "{json}"
    );

    // Back to the flags: no schedule.
    let (ok, out, err) = cairnctl(&cluster, &["-o", "json", "policy", "reset"]);
    assert!(ok, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    // An interval of 0 is a default, which the mapping leaves out.
    assert_eq!(
        (json.get("intervalMs"), json["source"].as_str()),
        (None, Some("flags")),
        "{json}"
    );
}
