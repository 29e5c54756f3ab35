//! Inputs are bounded (issue 13, finding 6 and parts of 8 and 9), against a real
//! coordinator process: out-of-range `SetPolicy` values, schedule flags, `StartSnapshot`
//! timeouts and labels and `AbortSnapshot` reasons are refused with INVALID_ARGUMENT (or a
//! usage error) naming the field, and the coordinator stays healthy and answering; a stored
//! policy that fails validation at start is logged and replaced by the flags' policy
//! instead of crashing every start.

use std::collections::HashMap;
use std::time::Duration;

use cairn_integration_tests::coordinated::{CoordinatedCluster, Store};
use cairn_integration_tests::processes::{binary, eventually, free_port};
use cairn_proto::v1 as pb;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

async fn health(cluster: &CoordinatedCluster, service: &str) -> anyhow::Result<i32> {
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.coordinator))?
            .connect()
            .await?;
    let mut client = HealthClient::new(channel);
    Ok(client
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await?
        .into_inner()
        .status)
}

/// The coordinator answers: health SERVING (overall and for the Coordinator service),
/// GetPolicy, ListNodes and ListSnapshots work.
async fn assert_answering(cluster: &CoordinatedCluster, nodes: usize) {
    for service in ["", "cairn.v1.Coordinator"] {
        assert_eq!(
            health(cluster, service).await.unwrap(),
            ServingStatus::Serving as i32,
            "health of {service:?}"
        );
    }
    let mut client = cluster.client().await.unwrap();
    client.get_policy(pb::GetPolicyRequest {}).await.unwrap();
    let listed = client
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.nodes.len(), nodes);
    client
        .list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap();
}

fn set(policy: pb::Policy, update: &[&str]) -> pb::SetPolicyRequest {
    pb::SetPolicyRequest {
        policy: Some(policy),
        update: update.iter().map(|s| (*s).to_owned()).collect(),
        reset_to_flags: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_policies_are_refused_naming_the_field_and_the_coordinator_stays_up() {
    let cluster = CoordinatedCluster::start(1, Store::Embedded, &[0], &[])
        .await
        .unwrap();
    let mut client = cluster.client().await.unwrap();
    let cases = [
        // Once a panic of the coordinator's task (jitter overflow, remainder by zero).
        (
            set(
                pb::Policy {
                    interval_ms: 10,
                    jitter_ms: u64::MAX,
                    ..Default::default()
                },
                &[],
            ),
            "interval_ms",
        ),
        (
            set(
                pb::Policy {
                    interval_ms: 1000,
                    jitter_ms: u64::MAX,
                    ..Default::default()
                },
                &[],
            ),
            "jitter_ms",
        ),
        // Once a spin: hundreds of snapshots and ~30 MB/s of logs.
        (
            set(
                pb::Policy {
                    interval_ms: u64::MAX,
                    ..Default::default()
                },
                &[],
            ),
            "interval_ms",
        ),
        (
            set(
                pb::Policy {
                    interval_ms: 1000,
                    jitter_ms: 1001,
                    ..Default::default()
                },
                &[],
            ),
            "jitter_ms",
        ),
        (
            set(
                pb::Policy {
                    timeout_ms: u64::MAX,
                    ..Default::default()
                },
                &[],
            ),
            "timeout_ms",
        ),
        (
            set(
                pb::Policy {
                    min_pause_ms: u64::MAX,
                    ..Default::default()
                },
                &[],
            ),
            "min_pause_ms",
        ),
        (
            set(
                pb::Policy {
                    freshness_threshold_ms: u64::MAX,
                    ..Default::default()
                },
                &[],
            ),
            "freshness_threshold_ms",
        ),
        (
            set(
                pb::Policy {
                    mode: pb::SnapshotMode::Aligned as i32,
                    alignment_timeout_ms: u64::MAX,
                    ..Default::default()
                },
                &[],
            ),
            "alignment_timeout_ms",
        ),
        (
            set(
                pb::Policy {
                    tolerated_failures: u32::MAX,
                    ..Default::default()
                },
                &[],
            ),
            "tolerated_failures",
        ),
    ];
    for (request, field) in cases {
        let refused = client.set_policy(request.clone()).await.unwrap_err();
        assert_eq!(
            refused.code(),
            Code::InvalidArgument,
            "{request:?}: {refused:?}"
        );
        assert!(
            refused.message().contains(field),
            "{field} not named: {refused:?}"
        );
        assert_answering(&cluster, 1).await;
    }
    // The policy in force is unchanged, and a valid change still goes through.
    let now = client
        .get_policy(pb::GetPolicyRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!((now.interval_ms, now.source.as_str()), (0, "flags"));
    let set_ok = client
        .set_policy(set(
            pb::Policy {
                interval_ms: 3_600_000,
                jitter_ms: 3_600_000,
                ..Default::default()
            },
            &[],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (set_ok.interval_ms, set_ok.jitter_ms),
        (3_600_000, 3_600_000)
    );
    assert_answering(&cluster, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_policy_that_fails_validation_gives_way_to_the_flags_at_start() {
    let mut cluster = CoordinatedCluster::start(
        1,
        Store::Embedded,
        &[0],
        &["--schedule-interval", "1h", "--schedule-jitter", "1m"],
    )
    .await
    .unwrap();
    let mut client = cluster.client().await.unwrap();
    client
        .set_policy(set(
            pb::Policy {
                interval_ms: 500_000,
                ..Default::default()
            },
            &[],
        ))
        .await
        .unwrap();
    cluster.kill_coordinator();

    // Rewrite the stored policy as the one that once crashed every start: the embedded
    // store replays its log over its base at start, so a changed copy of the policy's last
    // change, appended, is what the coordinator reads.
    let data = cluster.logs().join("data");
    let log_path = data.join("metadata.log");
    let log = std::fs::read_to_string(&log_path).unwrap();
    let mut change: serde_json::Value = log
        .lines()
        .rev()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find(|c| c["key"].as_str().is_some_and(|k| k.ends_with("/policy")))
        .unwrap_or_else(|| panic!("no policy change in {}: {log}", log_path.display()));
    let mut record: serde_json::Value =
        serde_json::from_str(change["value"].as_str().unwrap()).unwrap();
    assert_eq!(record["source"], "api", "{record}");
    record["interval_ms"] = 10.into();
    record["jitter_ms"] = u64::MAX.into();
    change["value"] = record.to_string().into();
    let mut appended = log;
    if !appended.ends_with('\n') {
        appended.push('\n');
    }
    appended.push_str(&format!("{change}\n"));
    std::fs::write(&log_path, appended).unwrap();

    cluster.start_coordinator().unwrap();
    let policy = eventually(
        "the coordinator answers",
        Duration::from_secs(30),
        || async {
            Ok(cluster
                .client()
                .await?
                .get_policy(pb::GetPolicyRequest {})
                .await?
                .into_inner())
        },
    )
    .await
    .unwrap();
    assert_eq!(
        (policy.interval_ms, policy.jitter_ms, policy.source.as_str()),
        (3_600_000, 60_000, "flags"),
        "{policy:?}"
    );
    cluster.wait_registered(1).await.unwrap();
    assert_answering(&cluster, 1).await;
    let log = cluster.log_of("coordinator");
    let line = log
        .lines()
        .find(|l| l.contains("stored snapshot policy is invalid"))
        .unwrap_or_else(|| panic!("no error logged: {log}"));
    assert!(
        line.contains("ERROR") && line.contains("policy.interval_ms"),
        "{line}"
    );

    // The flags' policy was stored in its place: the next start is clean too.
    cluster.kill_coordinator();
    cluster.start_coordinator().unwrap();
    cluster.wait_registered(1).await.unwrap();
    assert_answering(&cluster, 1).await;
    let after = cluster
        .client()
        .await
        .unwrap()
        .get_policy(pb::GetPolicyRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (after.interval_ms, after.source.as_str()),
        (3_600_000, "flags")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_schedule_flags_are_a_usage_error_naming_the_flag() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["--schedule-interval", "1s", "--schedule-jitter", "2s"],
            "--schedule-jitter",
        ),
        (&["--schedule-interval", "10ms"], "--schedule-interval"),
        (&["--schedule-interval", "31days"], "--schedule-interval"),
        (&["--snapshot-timeout", "25h"], "--snapshot-timeout"),
        (&["--max-concurrent", "100000"], "--max-concurrent"),
    ];
    for (args, flag) in cases {
        let dir = std::env::temp_dir().join(format!(
            "cairn-limits-flags-{}-{}",
            std::process::id(),
            free_port()
        ));
        let mut child = tokio::process::Command::new(binary("cairn-coordinator").unwrap())
            .args(["--listen", &format!("127.0.0.1:{}", free_port())])
            .arg("--data-dir")
            .arg(&dir)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .unwrap_or_else(|_| panic!("{args:?}: the coordinator started instead of refusing"))
            .unwrap();
        let mut text = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut text)
            .await
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(status.code(), Some(64), "{args:?}: {text}");
        assert!(text.contains(flag), "{args:?}: {flag} not named: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_labels_reasons_and_misplaced_timeouts_are_refused_and_listing_works() {
    let cluster = CoordinatedCluster::start(2, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let mut client = cluster.client().await.unwrap();
    let start = |labels: HashMap<String, String>| pb::StartSnapshotRequest {
        labels,
        ..Default::default()
    };
    let one = |k: &str, v: &str| HashMap::from([(k.to_owned(), v.to_owned())]);
    let many: HashMap<String, String> = (0..65).map(|i| (format!("k{i}"), "v".into())).collect();
    let cases = [
        (start(one("big", &"x".repeat(4096))), "labels[\"big\"]"),
        (start(one(&"k".repeat(300), "v")), "labels[\"kkkk"),
        (start(one("bad key", "v")), "labels[\"bad key\"]"),
        (start(many), "65 labels"),
        (
            pb::StartSnapshotRequest {
                mode: pb::SnapshotMode::ChandyLamport as i32,
                alignment_timeout_ms: 100,
                ..Default::default()
            },
            "alignment_timeout_ms",
        ),
        (
            pb::StartSnapshotRequest {
                mode: pb::SnapshotMode::Aligned as i32,
                alignment_timeout_ms: u64::MAX,
                ..Default::default()
            },
            "alignment_timeout_ms",
        ),
        (
            pb::StartSnapshotRequest {
                timeout_ms: u64::MAX,
                ..Default::default()
            },
            "timeout_ms",
        ),
    ];
    for (request, named) in cases {
        let refused = client.start_snapshot(request).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains(named), "{named}: {refused:?}");
        assert!(refused.message().len() < 1024, "the input is not echoed");
    }
    // 5 MiB: refused before it is stored, by the label check or, should the request's
    // size be bounded below it, by the decoding limit.
    let refused = client
        .start_snapshot(start(one("huge", &"x".repeat(5 << 20))))
        .await
        .unwrap_err();
    assert!(
        matches!(
            refused.code(),
            Code::InvalidArgument | Code::OutOfRange | Code::ResourceExhausted
        ),
        "{refused:?}"
    );

    // Nothing refused consumed an id or was stored; valid labels still go through.
    let id = client
        .start_snapshot(start(HashMap::from([
            ("app.kubernetes.io/name".to_owned(), "bank".to_owned()),
            ("reason".to_owned(), "test".to_owned()),
        ])))
        .await
        .unwrap()
        .into_inner()
        .snapshot_id;
    assert_eq!(id, 1, "a refused start consumed a snapshot id");
    let done = cluster.wait_with(id, false).await.unwrap();
    assert_eq!(done.labels.len(), 2, "{:?}", done.labels);
    let refused = client
        .abort_snapshot(pb::AbortSnapshotRequest {
            snapshot_id: id,
            reason: "r".repeat(2048),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("reason"), "{refused:?}");
    let listed = client
        .list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .snapshots;
    assert_eq!(listed.len(), 1, "only the valid snapshot is stored");
    let (ok, out, err) = {
        let out = std::process::Command::new(binary("cairnctl").unwrap())
            .args(["--coordinator", &cluster.coordinator, "snapshot", "list"])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert!(ok, "{err}");
    assert!(out.contains(&id.to_string()), "{out}");
    assert_answering(&cluster, 2).await;
}
