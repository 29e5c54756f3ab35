//! Object storage: the blob store on a real S3 server (SeaweedFS, signed requests,
//! conditional puts), the daemons sending only new chunks through the coordinator or writing
//! them to the bucket themselves; corruption detected and survived; S3 going away failing a
//! snapshot by name; wrong credentials refused at start; retention racing snapshots and a
//! restore on both back ends.

use std::collections::BTreeSet;
use std::time::Duration;

use cairn_integration_tests::coordinated::{CoordinatedCluster, Store};
use cairn_integration_tests::processes::{binary, eventually, free_port};
use cairn_integration_tests::restore::{
    assert_restored, moved_on, restore, snapshot, wait_newest_restore, wait_restore,
};
use cairn_integration_tests::s3::S3Server;
use cairn_integration_tests::tls_support::metric;
use cairn_proto::v1 as pb;
use tonic::Code;

const MODES: [pb::SnapshotMode; 3] = [
    pb::SnapshotMode::ChandyLamport,
    pb::SnapshotMode::Unaligned,
    pb::SnapshotMode::Aligned,
];

/// The flags that put a process's blob store at `prefix` of the server's bucket.
fn s3_args(s3: &S3Server, prefix: &str) -> Vec<String> {
    vec![
        "--blob-store".into(),
        s3.url(prefix),
        "--s3-endpoint".into(),
        s3.endpoint.clone(),
        "--s3-allow-http".into(),
    ]
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// A cluster of `n` banks whose coordinator keeps its blobs at `prefix` on `s3`; with
/// `direct`, the daemons write their new chunks there themselves.
async fn cluster_on_s3(
    s3: &S3Server,
    prefix: &str,
    n: usize,
    direct: bool,
    coordinator_args: &[&str],
) -> CoordinatedCluster {
    let blob = s3_args(s3, prefix);
    let mut c = strs(&blob);
    c.extend_from_slice(coordinator_args);
    let node_args = if direct { strs(&blob) } else { Vec::new() };
    CoordinatedCluster::start_env(n, Store::Embedded, &[], &c, &node_args, &s3.env())
        .await
        .unwrap()
}

/// The object keys under `<prefix>/<dir>/`.
async fn objects(s3: &S3Server, prefix: &str, dir: &str) -> BTreeSet<String> {
    s3.list(&format!("{prefix}/{dir}/"))
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// Snapshots in every mode and a restore on S3, with the daemons' chunks going through the
/// coordinator and, in a second cluster, straight to the bucket: money conserved, every
/// snapshot verifies, the objects are in the bucket (nothing in the local directory), and
/// each daemon's metrics say where its bytes went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_and_a_restore_on_s3_through_the_coordinator_and_direct() {
    let s3 = S3Server::start().await.unwrap();
    for direct in [false, true] {
        let prefix = if direct { "direct" } else { "through" };
        let cluster = cluster_on_s3(&s3, prefix, 3, direct, &[]).await;
        let mut taken = Vec::new();
        for mode in MODES {
            taken.push(snapshot(&cluster, mode).await);
        }
        let mut client = cluster.client().await.unwrap();
        for t in &taken {
            let id = t.plan.as_ref().unwrap().snapshot_id;
            let verified = client
                .verify_snapshot(pb::VerifySnapshotRequest { snapshot_id: id })
                .await
                .unwrap()
                .into_inner();
            assert!(verified.chunks > 0, "{prefix}: {verified:?}");
        }
        assert!(!objects(&s3, prefix, "chunks").await.is_empty(), "{prefix}");
        assert!(
            objects(&s3, prefix, "manifests").await.len() >= 3,
            "{prefix}: a manifest per distinct part"
        );
        assert!(
            !cluster.data_dir().join("blobs").exists(),
            "{prefix}: nothing in the local directory"
        );
        for node in &cluster.nodes {
            let text = cluster.scrape(&node.metrics).await.unwrap();
            let name = "cairn_node_state_upload_bytes_total";
            let to_store = metric(&text, name, Some("to=\"store\""));
            let to_coordinator = metric(&text, name, Some("to=\"coordinator\""));
            if direct {
                assert!(
                    to_store > 0.0 && to_coordinator == 0.0,
                    "{}: {to_store} to the store, {to_coordinator} to the coordinator",
                    node.id
                );
            } else {
                assert!(
                    to_coordinator > 0.0 && to_store == 0.0,
                    "{}: {to_store} to the store, {to_coordinator} to the coordinator",
                    node.id
                );
            }
        }
        // Exported file by file, streamed, matching what GetSnapshot returned; a second
        // export into the same directory is refused and changes nothing.
        let unaligned = &taken[1];
        let id = unaligned.plan.as_ref().unwrap().snapshot_id;
        let out =
            std::env::temp_dir().join(format!("cairn-export-{}-{prefix}", std::process::id()));
        let export = || {
            std::process::Command::new(binary("cairnctl").unwrap())
                .args(["--coordinator", &cluster.coordinator, "snapshot", "export"])
                .arg(id.to_string())
                .arg(&out)
                .output()
                .unwrap()
        };
        let done = export();
        assert!(
            done.status.success(),
            "{}",
            String::from_utf8_lossy(&done.stderr)
        );
        for node in &unaligned.nodes {
            let dir = out.join(&node.node_id);
            assert_eq!(
                std::fs::read(dir.join("state")).unwrap(),
                node.local_state.to_vec()
            );
            let channels = std::fs::read(dir.join("channels.pb")).unwrap();
            let mut buf = &channels[..];
            let mut messages = 0;
            while !buf.is_empty() {
                let state = <pb::ChannelState as prost::Message>::decode_length_delimited(&mut buf)
                    .unwrap();
                messages += state.messages.len();
            }
            let recorded: usize = node.channel_states.iter().map(|c| c.messages.len()).sum();
            assert_eq!(messages, recorded, "{prefix}: {}", node.node_id);
        }
        let again = export();
        assert!(!again.status.success());
        assert!(String::from_utf8_lossy(&again.stderr).contains("exists"));
        std::fs::remove_dir_all(&out).unwrap();

        let first = &taken[0];
        moved_on(&cluster, first).await;
        cluster.set_workload(0.0).await.unwrap();
        let id = first.plan.as_ref().unwrap().snapshot_id;
        let op = restore(&cluster, id).await.unwrap();
        let op = wait_restore(&cluster, &op.restore_id).await;
        assert!(op.done, "{prefix}: {:?}", op.failure);
        assert_restored(&cluster, first).await;
    }
}

/// A corrupted and a deleted chunk on S3: verify names them (DATA_LOSS), a restore of their
/// snapshot is refused before anything is fenced, and automatic recovery restores the
/// newest snapshot that verifies, saying which it passed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_and_a_missing_chunk_on_s3_are_named_and_recovery_falls_back() {
    let s3 = S3Server::start().await.unwrap();
    let prefix = "damaged";
    let mut cluster = cluster_on_s3(&s3, prefix, 3, true, &["--auto-restore"]).await;
    let good = snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
    let before = objects(&s3, prefix, "chunks").await;
    // A snapshot with chunks of its own (the balances moved).
    let (bad, new) = eventually(
        "a snapshot with new chunks",
        Duration::from_secs(30),
        || async {
            let bad = snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
            let new: Vec<String> = objects(&s3, prefix, "chunks")
                .await
                .difference(&before)
                .cloned()
                .collect();
            anyhow::ensure!(new.len() >= 2, "{} new chunks", new.len());
            Ok((bad, new))
        },
    )
    .await
    .unwrap();
    let bad_id = bad.plan.as_ref().unwrap().snapshot_id;
    let name = |key: &str| key.rsplit('/').next().unwrap().to_owned();
    s3.put(&new[0], b"not the bytes this chunk is named for")
        .await
        .unwrap();
    s3.delete(&new[1]).await.unwrap();
    let mut client = cluster.client().await.unwrap();
    let err = client
        .verify_snapshot(pb::VerifySnapshotRequest {
            snapshot_id: bad_id,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    let said = err.message();
    assert!(
        (said.contains(&name(&new[0])) && said.contains("corrupt"))
            || (said.contains(&name(&new[1])) && said.contains("missing")),
        "names a damaged chunk: {said}"
    );
    let err = restore(&cluster, bad_id).await.unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    // Automatic recovery: a daemon comes back; the newest snapshot that verifies is `good`
    // (or one between them that does not share the damaged chunks).
    cluster.set_workload(0.0).await.unwrap();
    cluster.kill_node(1);
    cluster.bank_workload = 0.0;
    cluster.start_node(1).unwrap();
    let op = wait_newest_restore(&cluster).await;
    assert!(op.done, "{:?}", op.failure);
    assert!(
        op.skipped
            .iter()
            .any(|s| s.contains(&format!("snapshot {bad_id}"))),
        "{:?}",
        op.skipped
    );
    assert!(op.snapshot_id < bad_id);
    if op.snapshot_id == good.plan.as_ref().unwrap().snapshot_id {
        assert_restored(&cluster, &good).await;
    }
}

/// S3 going away: the snapshot in progress fails with KIND_STORAGE naming the node and the
/// error (no part of it stored), and once S3 is back the next snapshot completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_unavailable_fails_the_snapshot_by_name_and_the_next_completes() {
    let mut s3 = S3Server::start().await.unwrap();
    for direct in [false, true] {
        let prefix = if direct { "outage-direct" } else { "outage" };
        let cluster = cluster_on_s3(&s3, prefix, 2, direct, &[]).await;
        snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
        s3.stop();
        let id = cluster
            .start_snapshot(pb::StartSnapshotRequest::default())
            .await
            .unwrap();
        let failed = cluster.wait_with(id, false).await.unwrap();
        assert_eq!(failed.status, pb::SnapshotStatus::Failed as i32, "{prefix}");
        let failure = failed.failure.unwrap();
        assert_eq!(
            failure.kind,
            pb::failure_reason::Kind::Storage as i32,
            "{prefix}: {failure:?}"
        );
        assert!(!failure.nodes.is_empty(), "{prefix}: {failure:?}");
        assert!(
            failure.message.contains(&failure.nodes[0]),
            "{prefix}: names the node: {failure:?}"
        );
        assert!(
            failed.nodes.iter().all(|n| !n.reported),
            "{prefix}: nothing of it stored: {:?}",
            failed.nodes
        );
        s3.start_again().await.unwrap();
        snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
    }
}

/// Wrong credentials or a missing bucket stop the coordinator and a daemon at start with an
/// error that says so, within the request timeouts — never a hang, never a first snapshot
/// that fails late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_s3_credentials_or_bucket_are_a_clear_error_at_start() {
    let s3 = S3Server::start().await.unwrap();
    let mut wrong_secret = s3.env();
    for (key, value) in &mut wrong_secret {
        if key == "AWS_SECRET_ACCESS_KEY" {
            *value = "not-the-secret".into();
        }
    }
    let bad_bucket = {
        let mut args = s3_args(&s3, "x");
        args[1] = "s3://no-such-bucket-here/x".into();
        args
    };
    let cases = [
        (
            "wrong secret",
            s3_args(&s3, "x"),
            wrong_secret,
            "SignatureDoesNotMatch",
        ),
        ("no bucket", bad_bucket, s3.env(), "NoSuchBucket"),
    ];
    let dir = std::env::temp_dir().join(format!("cairn-s3-start-{}", std::process::id()));
    for (case, blob, env, says) in cases {
        for bin in ["cairn-coordinator", "cairn-node"] {
            let mut command = tokio::process::Command::new(binary(bin).unwrap());
            command
                .args(&blob)
                .envs(env.iter().cloned())
                .kill_on_drop(true);
            if bin == "cairn-coordinator" {
                command
                    .args(["--listen", &format!("127.0.0.1:{}", free_port())])
                    .arg("--data-dir")
                    .arg(&dir);
            } else {
                command.args([
                    "--node-id",
                    "n1",
                    "--coordinator",
                    &format!("127.0.0.1:{}", free_port()),
                    "--peer-listen",
                    &format!("127.0.0.1:{}", free_port()),
                    "--app-listen",
                    &format!("127.0.0.1:{}", free_port()),
                ]);
            }
            let output = tokio::time::timeout(Duration::from_secs(60), command.output())
                .await
                .unwrap_or_else(|_| panic!("{bin} with {case}: still running after 60 s"))
                .unwrap();
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(!output.status.success(), "{bin} with {case}: {stderr}");
            assert!(
                stderr.contains("blob store") && stderr.contains(says),
                "{bin} with {case}: {stderr}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Retention racing snapshots every 100 ms and a restore (what Arroyo's bug #802 was: a
/// restore failing because retention deleted files a restorable checkpoint needed): the
/// restore completes with the right balances, and afterwards every retained snapshot
/// verifies — on S3 (daemons writing directly) and on the local directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_racing_snapshots_and_a_restore_keeps_every_retained_snapshot_whole() {
    let s3 = S3Server::start().await.unwrap();
    let race = [
        "--retention",
        "2",
        "--gc-grace",
        "0s",
        "--schedule-interval",
        "100ms",
        "--schedule-mode",
        "unaligned",
    ];
    for on_s3 in [true, false] {
        let cluster = if on_s3 {
            cluster_on_s3(&s3, "race", 3, true, &race).await
        } else {
            CoordinatedCluster::start(3, Store::Embedded, &[], &race)
                .await
                .unwrap()
        };
        let at = if on_s3 { "s3" } else { "dir" };
        // Restore the newest completed snapshot of the schedule's while the schedule and
        // retention go on around it (retention may delete it first: then the next one).
        let mut client = cluster.client().await.unwrap();
        cluster.set_workload(0.0).await.unwrap();
        let (id, op) = eventually("a restore accepted", Duration::from_secs(30), || {
            let mut client = client.clone();
            let cluster = &cluster;
            async move {
                let newest = client
                    .list_snapshots(pb::ListSnapshotsRequest {
                        status: pb::SnapshotStatus::Completed as i32,
                        ..Default::default()
                    })
                    .await?
                    .into_inner()
                    .snapshots
                    .into_iter()
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("none completed yet"))?;
                let id = newest.plan.as_ref().map_or(0, |p| p.snapshot_id);
                let op = restore(cluster, id).await?;
                Ok((id, op))
            }
        })
        .await
        .unwrap();
        // Held by the restore: retention does not delete it.
        let target = cluster.wait(id).await.unwrap();
        let op = wait_restore(&cluster, &op.restore_id).await;
        assert!(op.done, "{at}: {:?}", op.failure);
        assert_restored(&cluster, &target).await;
        // More rounds of snapshots and retention after the restore.
        eventually(
            "ten more scheduled snapshots",
            Duration::from_secs(60),
            || {
                let mut client = client.clone();
                async move {
                    let newest = client
                        .list_snapshots(pb::ListSnapshotsRequest::default())
                        .await?
                        .into_inner()
                        .snapshots
                        .first()
                        .and_then(|s| s.plan.as_ref().map(|p| p.snapshot_id))
                        .unwrap_or(0);
                    anyhow::ensure!(newest >= id + 10, "at snapshot {newest}");
                    Ok(())
                }
            },
        )
        .await
        .unwrap();
        client
            .set_policy(pb::SetPolicyRequest {
                policy: Some(pb::Policy::default()),
                update: vec!["interval_ms".into()],
                reset_to_flags: false,
            })
            .await
            .unwrap();
        // Quiet: the last scheduled snapshot ended (and retention ran after it).
        eventually("no snapshot in flight", Duration::from_secs(30), || {
            let mut client = client.clone();
            async move {
                let running = client
                    .list_snapshots(pb::ListSnapshotsRequest {
                        status: pb::SnapshotStatus::InProgress as i32,
                        ..Default::default()
                    })
                    .await?
                    .into_inner()
                    .snapshots;
                anyhow::ensure!(running.is_empty(), "{} in flight", running.len());
                Ok(())
            }
        })
        .await
        .unwrap();
        // The last completion stores its record before retention deletes the oldest, so
        // for a moment three are listed: wait for retention to have run.
        let completed = eventually("retention applied", Duration::from_secs(30), || {
            let mut client = client.clone();
            async move {
                let completed: Vec<u64> = client
                    .list_snapshots(pb::ListSnapshotsRequest {
                        status: pb::SnapshotStatus::Completed as i32,
                        ..Default::default()
                    })
                    .await?
                    .into_inner()
                    .snapshots
                    .iter()
                    .filter_map(|s| s.plan.as_ref().map(|p| p.snapshot_id))
                    .collect();
                anyhow::ensure!(
                    (1..=2).contains(&completed.len()),
                    "retention keeps 2 (the restore ended, so it holds none): {completed:?}"
                );
                Ok(completed)
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{at}: {e:?}"));
        for snapshot_id in completed {
            client
                .verify_snapshot(pb::VerifySnapshotRequest { snapshot_id })
                .await
                .unwrap_or_else(|e| panic!("{at}: snapshot {snapshot_id}: {e:?}"));
        }
    }
}

/// A restore's state streams from S3 through the coordinator and the daemon to the
/// application in pieces; when S3 goes away mid-stream, the application is told to drop what
/// it was handed, the restore fails naming the node, and once S3 is back the next restore
/// hands over the whole state, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_broken_off_mid_stream_is_aborted_at_the_application_and_the_next_completes() {
    use cairn_sdk::{AppEvent, AppSession};
    use rand::Rng;
    // Far more than the pieces the daemon's loop and the streams between hold (8 pieces, and
    // the 16 MiB HTTP/2 window of its connection to the coordinator): the fetch stalls until
    // the application takes pieces.
    const STATE: usize = 64 << 20;
    let mut s3 = S3Server::start().await.unwrap();
    let blob = s3_args(&s3, "midway");
    let mut cluster =
        CoordinatedCluster::start_env(2, Store::Embedded, &[1], &strs(&blob), &[], &s3.env())
            .await
            .unwrap();
    cluster.set_workload(0.0).await.unwrap();
    cluster.bank_workload = 0.0;
    let mut state = vec![0u8; STATE];
    rand::rng().fill(&mut state[..]);
    let state = bytes::Bytes::from(state);

    // The application records the state, then leaves.
    let address = cluster.nodes[1].app.clone();
    let mut session = AppSession::connect(&address, "midway").await.unwrap();
    let sender = session.sender();
    let recorded = state.clone();
    let app = tokio::spawn(async move {
        while let Ok(Some(event)) = session.next_event().await {
            if let AppEvent::RecordState { snapshot_id } = event {
                sender
                    .state_recorded(snapshot_id, recorded.clone())
                    .unwrap();
            }
        }
    });
    cluster.wait_ready(1).await.unwrap();
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    let taken = cluster.wait_with(id, false).await.unwrap();
    assert_eq!(
        taken.status,
        pb::SnapshotStatus::Completed as i32,
        "{taken:?}"
    );
    app.abort();
    let _ = app.await;

    // Restored with no application to take the pieces: n2 enters the epoch and its fetch
    // stalls; S3 goes away; an application comes and takes what there is.
    async fn epoch(cluster: &CoordinatedCluster) -> anyhow::Result<u64> {
        let status = cluster
            .admin(1)
            .await?
            .get_node_status(pb::GetNodeStatusRequest::default())
            .await?
            .into_inner();
        Ok(status.epoch)
    }
    let before = epoch(&cluster).await.unwrap();
    let op = restore(&cluster, id).await.unwrap();
    eventually(
        "n2 entered the restore's epoch",
        Duration::from_secs(30),
        || async {
            let now = epoch(&cluster).await?;
            anyhow::ensure!(now > before, "still in epoch {now}");
            Ok(())
        },
    )
    .await
    .unwrap();
    s3.stop();
    let mut session = AppSession::connect(&address, "midway").await.unwrap();
    session.restore_in_pieces(true);
    let mut handed = 0usize;
    let aborted = loop {
        match session.next_event().await.unwrap().unwrap() {
            AppEvent::RestorePiece { piece, last, .. } => {
                assert!(!last, "the whole state came with S3 away");
                assert_eq!(&state[handed..handed + piece.len()], &piece[..]);
                handed += piece.len();
            }
            AppEvent::RestoreAborted { restore_id, reason } => break (restore_id, reason),
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(aborted.0, op.restore_id);
    assert!(handed > 0 && handed < STATE, "{handed} bytes handed over");
    let failed = wait_restore(&cluster, &op.restore_id).await;
    assert!(!failed.done);
    let failure = failed.failure.unwrap();
    assert!(
        failure.message.contains("n2") && failure.message.contains("stream broke"),
        "names the node and why: {failure:?} (the application was told: {})",
        aborted.1
    );

    // S3 back: the next restore hands over all of it.
    s3.start_again().await.unwrap();
    let op = restore(&cluster, id).await.unwrap();
    let sender = session.sender();
    let mut handed = 0usize;
    loop {
        match session.next_event().await.unwrap().unwrap() {
            AppEvent::RestorePiece {
                piece,
                last,
                restore_id,
                ..
            } => {
                assert_eq!(restore_id, op.restore_id);
                assert_eq!(&state[handed..handed + piece.len()], &piece[..]);
                handed += piece.len();
                if last {
                    sender.restore_applied(&restore_id).unwrap();
                    break;
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(handed, STATE);
    let done = wait_restore(&cluster, &op.restore_id).await;
    assert!(done.done, "{:?}", done.failure);
}
