//! Integrity under faults and hostile input, each at the level where the fault happens:
//! a full disk under the blob store (a real tmpfs), chunk files corrupted behind the
//! coordinator's back, a second daemon claiming a node id in use and a forged peer
//! handshake, a paused (SIGSTOPped) daemon, the embedded store's files deleted while it
//! runs, and requests that must be refused before they spend a snapshot id.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use cairn_integration_tests::bench::filler;
use cairn_integration_tests::coordinated::{CoordinatedCluster, Store, assert_completed};
use cairn_integration_tests::processes::{ChildGuard, binary, eventually, free_port};
use cairn_integration_tests::restore::{assert_restored, snapshot, wait_newest_restore};
use cairn_rpc::v1 as pb;
use cairn_sdk::{AppEvent, AppSession};
use tonic::Code;

/// A test application that records `state` for every snapshot.
fn recording_app(mut session: AppSession, state: Bytes) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let sender = session.sender();
        while let Ok(Some(event)) = session.next_event().await {
            if let AppEvent::RecordState { snapshot_id } = event {
                let _ = sender.state_recorded(snapshot_id, state.clone());
            }
        }
    })
}

/// Every chunk file under a blob directory (temporary files left out).
fn chunk_files(dir: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    // Chunks are under `<first two hex digits>/`; manifests under `manifests/`.
    for sub in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if sub.file_name().len() != 2 {
            continue;
        }
        for file in std::fs::read_dir(sub.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            if !file.file_name().to_string_lossy().starts_with('.') {
                out.insert(file.path());
            }
        }
    }
    out
}

/// Flips the first byte of a chunk file (its size stays).
fn corrupt(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(path, bytes).unwrap();
}

/// A tmpfs mounted for the test, unmounted when dropped (pass or fail).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(size: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "cairn-tmpfs-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "this test mounts a small tmpfs to fill it up: run it as root (CI and \
             scripts/test.sh do)"
        );
        Self(dir)
    }

    fn resize(&self, size: &str) {
        let status = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(status.success());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A full disk fails the snapshot with KIND_STORAGE naming the node and the cause, leaves
/// no empty chunk behind, and once there is room again the same content is stored anew
/// (not "reused" from empty files) and reads back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_the_snapshot_and_stores_nothing_empty() {
    let disk = Tmpfs::mount("1m");
    let blob_dir = disk.0.display().to_string();
    let cluster = CoordinatedCluster::start(2, Store::Embedded, &[1], &["--blob-dir", &blob_dir])
        .await
        .unwrap();
    let state = filler(3 << 20, 7);
    let session = AppSession::connect(&cluster.nodes[1].app, "big")
        .await
        .unwrap();
    let app = recording_app(session, state.clone());
    cluster.wait_ready(1).await.unwrap();

    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    let failed = cluster.wait_with(id, false).await.unwrap();
    assert_eq!(
        failed.status,
        pb::SnapshotStatus::Failed as i32,
        "{failed:?}"
    );
    let failure = failed.failure.unwrap();
    assert_eq!(
        failure.kind,
        pb::failure_reason::Kind::Storage as i32,
        "{failure:?}"
    );
    assert!(
        failure.message.contains("n2") && failure.message.contains("space"),
        "names the node and the cause: {}",
        failure.message
    );
    for chunk in chunk_files(&disk.0) {
        let len = std::fs::metadata(&chunk).unwrap().len();
        assert!(len > 0, "an empty chunk was left: {}", chunk.display());
    }

    disk.resize("64m");
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    let done = cluster.wait(id).await.unwrap();
    assert_eq!(
        done.status,
        pb::SnapshotStatus::Completed as i32,
        "{:?}",
        done.failure
    );
    let part = done.nodes.iter().find(|n| n.node_id == "n2").unwrap();
    assert_eq!(part.local_state, state, "the state reads back whole");
    let verified = cluster
        .client()
        .await
        .unwrap()
        .verify_snapshot(pb::VerifySnapshotRequest { snapshot_id: id })
        .await
        .unwrap()
        .into_inner();
    assert!(verified.bytes >= state.len() as u64, "{verified:?}");
    app.abort();
}

/// Chunks are checked against their names on every read: a corrupted chunk makes
/// GetSnapshot and VerifySnapshot answer DATA_LOSS naming it, a restore of that snapshot
/// is refused with DATA_LOSS before anything is fenced, and a later snapshot of the same
/// bytes does not reuse the corrupt file. `cairnctl snapshot verify` says the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_chunk_is_data_loss_on_every_read_and_blocks_its_restore() {
    let cluster = CoordinatedCluster::start(2, Store::Embedded, &[1], &[])
        .await
        .unwrap();
    let state = filler(1 << 20, 11);
    let session = AppSession::connect(&cluster.nodes[1].app, "app")
        .await
        .unwrap();
    let app = recording_app(session, state.clone());
    cluster.wait_ready(1).await.unwrap();
    let first = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    assert_eq!(
        cluster.wait_with(first, false).await.unwrap().status,
        pb::SnapshotStatus::Completed as i32
    );
    let chunks = chunk_files(&cluster.data_dir().join("blobs"));
    assert!(!chunks.is_empty());
    for chunk in &chunks {
        corrupt(chunk);
    }
    let mut client = cluster.client().await.unwrap();
    let err = client
        .get_snapshot(pb::GetSnapshotRequest {
            snapshot_id: first,
            include_data: true,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    assert!(
        err.message().contains("chunk") && err.message().contains("corrupt"),
        "{err:?}"
    );
    let err = client
        .verify_snapshot(pb::VerifySnapshotRequest { snapshot_id: first })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    assert!(err.message().contains("node n"), "names the node: {err:?}");
    let cairnctl = Command::new(binary("cairnctl").unwrap())
        .args(["--coordinator", &cluster.coordinator, "snapshot", "verify"])
        .arg(first.to_string())
        .output()
        .unwrap();
    assert!(!cairnctl.status.success());
    let said = String::from_utf8_lossy(&cairnctl.stderr);
    assert!(said.contains("corrupt"), "cairnctl said: {said}");

    let err = client
        .restore_snapshot(pb::RestoreSnapshotRequest {
            snapshot_id: first,
            if_epoch: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    let restores = client
        .list_restores(pb::ListRestoresRequest::default())
        .await
        .unwrap()
        .into_inner()
        .restores;
    assert!(restores.is_empty(), "nothing was fenced: {restores:?}");

    // The same bytes again: the corrupt files are rewritten, not reused.
    let second = cluster
        .completed(pb::StartSnapshotRequest::default())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{e}\n{}\n{}",
                cluster.log_of("coordinator"),
                cluster.log_of("n2")
            )
        });
    assert!(
        second.bytes_new >= state.len() as u64,
        "{}",
        second.bytes_new
    );
    let part = second.nodes.iter().find(|n| n.node_id == "n2").unwrap();
    assert_eq!(part.local_state, state);
    app.abort();
}

/// Automatic recovery restores the newest snapshot that verifies, passing over a newer one
/// whose chunks are corrupt and saying so in the restore record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_recovery_passes_over_a_snapshot_that_does_not_verify() {
    let mut cluster = CoordinatedCluster::start(3, Store::Embedded, &[], &["--auto-restore"])
        .await
        .unwrap();
    let blobs = cluster.data_dir().join("blobs");
    let good = snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
    let before = chunk_files(&blobs);
    // A snapshot whose chunks are all new (the balances moved), then corrupted.
    let bad = eventually(
        "a snapshot with new chunks",
        Duration::from_secs(30),
        || async {
            let bad = snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
            let new: Vec<PathBuf> = chunk_files(&blobs).difference(&before).cloned().collect();
            anyhow::ensure!(!new.is_empty(), "no new chunk yet");
            Ok((bad, new))
        },
    )
    .await
    .unwrap();
    for chunk in &bad.1 {
        corrupt(chunk);
    }
    let bad_id = bad.0.plan.as_ref().unwrap().snapshot_id;
    cluster.set_workload(0.0).await.unwrap();
    cluster.kill_node(1);
    cluster.bank_workload = 0.0;
    cluster.start_node(1).unwrap();
    let op = wait_newest_restore(&cluster).await;
    assert!(op.done, "{:?}", op.failure);
    assert_eq!(op.snapshot_id, good.plan.as_ref().unwrap().snapshot_id);
    assert!(
        op.skipped
            .iter()
            .any(|s| s.contains(&format!("snapshot {bad_id}"))),
        "{:?}",
        op.skipped
    );
    assert_restored(&cluster, &good).await;
}

/// One live process per node id: a second daemon started with an id in use is refused by
/// the coordinator (naming the holder), a forged handshake claiming that id is refused by
/// the peers without resetting the channel, and not a unit of money is lost meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_node_id_and_a_forged_handshake_lose_no_message() {
    let cluster = CoordinatedCluster::start(3, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let before = snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
    let (impostor, log) = cluster.spawn_impostor(1).unwrap();
    let refused = eventually(
        "the impostor is refused",
        Duration::from_secs(30),
        || async {
            let text = std::fs::read_to_string(&log)?;
            anyhow::ensure!(text.contains("held by a connected daemon"), "{text}");
            Ok(text)
        },
    )
    .await
    .unwrap();
    assert!(
        refused.contains(&cluster.nodes[1].peer),
        "names the holder: {refused}"
    );

    // A forged stream claiming to be n2 towards n1, with a made-up incarnation.
    let mut peer =
        pb::peer_client::PeerClient::connect(format!("http://{}", cluster.nodes[0].peer))
            .await
            .unwrap();
    let handshake = pb::PeerFrame {
        kind: Some(pb::peer_frame::Kind::Handshake(pb::Handshake {
            cluster: "cairn".into(),
            from: "n2".into(),
            to: "n1".into(),
            incarnation: 42,
            epoch: 0,
        })),
    };
    let forged = peer
        .channel(tokio_stream::iter(vec![handshake]))
        .await
        .unwrap_err();
    assert_eq!(forged.code(), Code::Aborted, "{forged:?}");
    assert!(forged.message().contains("admitted"), "{forged:?}");

    // Transfers go on through it all; snapshots add up, and so does the live money.
    let moved = before.plan.as_ref().unwrap().snapshot_id;
    for mode in [pb::SnapshotMode::ChandyLamport, pb::SnapshotMode::Unaligned] {
        let s = snapshot(&cluster, mode).await;
        assert!(s.plan.as_ref().unwrap().snapshot_id > moved);
    }
    drop(impostor);
    snapshot(&cluster, pb::SnapshotMode::Aligned).await;
    cluster.set_workload(0.0).await.unwrap();
    eventually(
        "the live money adds up",
        Duration::from_secs(30),
        || async {
            let total: u64 = cairn_integration_tests::restore::balances(&cluster)
                .await?
                .values()
                .sum();
            anyhow::ensure!(total == cluster.total(), "live total {total}");
            Ok(())
        },
    )
    .await
    .unwrap();
}

/// A paused daemon (SIGSTOP) keeps its TCP connection, but it stops sending heartbeats: the
/// coordinator marks it disconnected within three heartbeat intervals, snapshots are
/// refused naming it, and once it resumes it registers again and snapshots complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_daemon_is_seen_disconnected_and_comes_back() {
    let cluster = CoordinatedCluster::start(2, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let pid = cluster.node_pid(1).unwrap().to_string();
    struct Continue(String);
    impl Drop for Continue {
        fn drop(&mut self) {
            let _ = Command::new("kill").args(["-CONT", &self.0]).status();
        }
    }
    assert!(
        Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let resume = Continue(pid);
    let paused_at = std::time::Instant::now();
    eventually(
        "n2 is seen disconnected",
        Duration::from_secs(20),
        || async {
            let nodes = cluster
                .client()
                .await?
                .list_nodes(pb::ListNodesRequest {})
                .await?
                .into_inner()
                .nodes;
            let n2 = nodes.iter().find(|n| n.node_id == "n2").unwrap();
            anyhow::ensure!(!n2.connected, "still connected");
            Ok(())
        },
    )
    .await
    .unwrap();
    // Three heartbeats of 2 s, plus the coordinator's 250 ms check and some slack.
    assert!(
        paused_at.elapsed() < Duration::from_secs(10),
        "{:?}",
        paused_at.elapsed()
    );
    let refused = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("n2"), "{refused:?}");
    drop(resume);
    cluster.wait_registered(2).await.unwrap();
    let id = eventually(
        "a snapshot after n2 resumed",
        Duration::from_secs(30),
        || async {
            let id = cluster
                .start_snapshot(pb::StartSnapshotRequest::default())
                .await?;
            let s = cluster.wait(id).await?;
            anyhow::ensure!(
                s.status == pb::SnapshotStatus::Completed as i32,
                "{:?}",
                s.failure
            );
            Ok(s)
        },
    )
    .await
    .unwrap();
    assert_completed(&id, cluster.total());
}

/// The embedded store's files deleted under a running coordinator: it notices (health
/// NOT_SERVING); restarted on the empty store, it never hands out an id the daemons have
/// seen. A second coordinator on the same directory is refused by the store's lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_metadata_never_reuses_a_snapshot_id_and_the_store_is_locked() {
    let mut cluster = CoordinatedCluster::start(2, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let mut last = 0;
    for _ in 0..3 {
        last = snapshot(&cluster, pb::SnapshotMode::ChandyLamport)
            .await
            .plan
            .unwrap()
            .snapshot_id;
    }

    // A second coordinator on the same data directory exits, naming the lock.
    let log = cluster.logs().join("second-coordinator.log");
    let mut command = Command::new(binary("cairn-coordinator").unwrap());
    command
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--data-dir")
        .arg(cluster.data_dir());
    let mut second = ChildGuard::spawn("second coordinator", command, &log).unwrap();
    let exited = eventually(
        "the second coordinator exits",
        Duration::from_secs(15),
        || {
            let running = second.running();
            async move {
                anyhow::ensure!(!running, "still running on a store in use");
                Ok(())
            }
        },
    )
    .await;
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(exited.is_ok(), "{said}");
    assert!(said.contains("in use by another coordinator"), "{said}");
    assert!(said.contains("need etcd (--etcd)"), "{said}");

    for file in ["metadata.json", "metadata.log", "metadata.lock"] {
        std::fs::remove_file(cluster.data_dir().join(file)).unwrap();
    }
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.coordinator))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let health = tonic_health::pb::health_client::HealthClient::new(channel);
    eventually("health NOT_SERVING", Duration::from_secs(10), || {
        let mut health = health.clone();
        async move {
            let status = health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                })
                .await?
                .into_inner()
                .status;
            anyhow::ensure!(
                status == tonic_health::pb::health_check_response::ServingStatus::NotServing as i32,
                "status {status}"
            );
            Ok(())
        }
    })
    .await
    .unwrap();

    cluster.kill_coordinator();
    cluster.start_coordinator().unwrap();
    cluster.wait_registered(2).await.unwrap();
    let next = eventually(
        "a snapshot on the new store",
        Duration::from_secs(30),
        || async {
            Ok(cluster
                .start_snapshot(pb::StartSnapshotRequest::default())
                .await?)
        },
    )
    .await
    .unwrap();
    assert!(next > last, "id {next} reused (daemons saw {last})");
    assert_completed(&cluster.wait(next).await.unwrap(), cluster.total());
}

/// A request refused for an unknown initiator spends no snapshot id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_start_spends_no_snapshot_id() {
    let cluster = CoordinatedCluster::start(2, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let first = snapshot(&cluster, pb::SnapshotMode::ChandyLamport)
        .await
        .plan
        .unwrap()
        .snapshot_id;
    for _ in 0..3 {
        let err = cluster
            .start_snapshot(pb::StartSnapshotRequest {
                initiators: vec!["nobody".into()],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("nobody"), "{err:?}");
    }
    let next = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    assert_eq!(next, first + 1);
}

/// A part recorded in another epoch than the snapshot's never completes it: a node (here a
/// test client speaking the daemon's protocol) that uploads its part from epoch 5 into a
/// snapshot of epoch 0 fails it with KIND_MIXED_EPOCHS naming the node; the same part from
/// epoch 0 completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_from_another_epoch_fails_the_snapshot_as_mixed_epochs() {
    use pb::coordinator_to_node::Kind as Command;
    use pb::upload_chunk::Kind as Piece;
    let cluster = CoordinatedCluster::start(0, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let mut client = cluster.client().await.unwrap();
    let (session_tx, mut commands) = fake_node(&mut client, "n1").await;
    for (epoch, mixed) in [(5u64, true), (0, false)] {
        let id = cluster
            .start_snapshot(pb::StartSnapshotRequest::default())
            .await
            .unwrap();
        let initiate = loop {
            match commands.message().await.unwrap().unwrap().kind {
                Some(Command::Initiate(plan)) => break plan,
                _ => continue,
            }
        };
        assert_eq!(initiate.snapshot_id, id);
        let upload = upload_of(
            id,
            epoch,
            [
                Piece::StateChunk(state_chunk(b"state", true)),
                Piece::Cut(pb::UploadCut::default()),
            ],
        );
        client
            .upload_snapshot_part(tokio_stream::iter(upload))
            .await
            .unwrap();
        let s = cluster.wait(id).await.unwrap();
        if mixed {
            assert_eq!(s.status, pb::SnapshotStatus::Failed as i32, "{s:?}");
            let failure = s.failure.unwrap();
            assert_eq!(
                failure.kind,
                pb::failure_reason::Kind::MixedEpochs as i32,
                "{failure:?}"
            );
            assert_eq!(failure.nodes, vec!["n1".to_owned()]);
            assert!(failure.message.contains("epoch 5"), "{}", failure.message);
        } else {
            assert_eq!(
                s.status,
                pb::SnapshotStatus::Completed as i32,
                "{:?}",
                s.failure
            );
        }
    }
    drop(session_tx);
}

/// Node n1's upload of its part of snapshot `id` recorded in `epoch`: the header, then
/// `pieces`.
fn upload_of(
    id: u64,
    epoch: u64,
    pieces: impl IntoIterator<Item = pb::upload_chunk::Kind>,
) -> Vec<pb::UploadChunk> {
    let header = pb::upload_chunk::Kind::Header(pb::UploadHeader {
        snapshot_id: id,
        node_id: "n1".into(),
        incarnation: 1,
        epoch,
        applied_restore_id: String::new(),
    });
    std::iter::once(header)
        .chain(pieces)
        .map(|kind| pb::UploadChunk { kind: Some(kind) })
        .collect()
}

/// A state chunk as a daemon sends it: its sha256 and size, with its bytes if `with_data`.
fn state_chunk(data: &[u8], with_data: bool) -> pb::StateChunk {
    let chunk = cairn_blob::Chunk::new(Bytes::copy_from_slice(data));
    pb::StateChunk {
        sha256: Bytes::copy_from_slice(&chunk.hash),
        size: data.len() as u32,
        data: if with_data { chunk.data } else { Bytes::new() },
    }
}

/// A node's upload naming chunks it does not have is refused and stores nothing: a chunk
/// whose bytes do not hash to its name, and a chunk sent without its bytes that the blob
/// store does not hold, are each INVALID_ARGUMENT naming the chunk; the snapshot then fails
/// rather than complete with a state nobody can read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_naming_chunks_it_does_not_have_is_refused() {
    use pb::upload_chunk::Kind as Piece;
    let cluster = CoordinatedCluster::start(0, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let mut client = cluster.client().await.unwrap();
    let (_session, _commands) = fake_node(&mut client, "n1").await;
    let mut lying = state_chunk(b"the bytes named", true);
    lying.data = Bytes::from_static(b"other bytes 123");
    let absent = state_chunk(b"never stored anywhere", false);
    let absent_name = hex_of(&absent.sha256);
    for (chunk, says) in [
        (lying, "hash to".to_owned()),
        (absent, format!("chunk {absent_name}")),
    ] {
        let id = cluster
            .start_snapshot(pb::StartSnapshotRequest::default())
            .await
            .unwrap();
        let upload = upload_of(
            id,
            0,
            [
                Piece::StateChunk(chunk),
                Piece::Cut(pb::UploadCut::default()),
            ],
        );
        let refused = client
            .upload_snapshot_part(tokio_stream::iter(upload))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("node n1's state") && refused.message().contains(&says),
            "{refused:?}"
        );
        client
            .abort_snapshot(pb::AbortSnapshotRequest {
                snapshot_id: id,
                reason: "test".into(),
            })
            .await
            .unwrap();
    }
}

/// Recorded messages uploaded as a run are checked before anything is stored: a run whose
/// lengths do not add up to its bytes, whose indices overflow, or that comes with messages
/// beside it is INVALID_ARGUMENT naming the node, the channel and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_run_that_does_not_add_up_is_refused() {
    use pb::upload_chunk::Kind as Piece;
    let cluster = CoordinatedCluster::start(0, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let mut client = cluster.client().await.unwrap();
    let (_session, _commands) = fake_node(&mut client, "n1").await;
    let run = |first_index, payloads: &'static [u8], lengths: Vec<u32>| pb::RecordedRun {
        first_index,
        payloads: Bytes::from_static(payloads),
        lengths,
    };
    let state = |run, messages| pb::ChannelState {
        channel: Some(pb::ChannelRef {
            from: "n2".into(),
            to: "n1".into(),
        }),
        messages,
        run: Some(run),
    };
    let one = vec![pb::RecordedMessage {
        index: 0,
        payload: Bytes::from_static(b"x"),
    }];
    let of_channel = "node n1's recorded messages of channel n2->n1: ";
    for (piece, says) in [
        (
            Piece::ChannelRun(state(run(0, b"abc", vec![1, 1]), vec![])),
            format!("{of_channel}a run's lengths add up to 2 bytes"),
        ),
        (
            Piece::ChannelRun(state(run(u64::MAX, b"ab", vec![1, 1]), vec![])),
            format!(
                "{of_channel}a run of 2 messages from index {} runs past",
                u64::MAX
            ),
        ),
        (
            Piece::ChannelRun(state(run(1, b"ab", vec![2]), one)),
            format!("{of_channel}a run upload holds one run and no messages"),
        ),
        (
            Piece::ChannelRun(state(run(0, b"", vec![0; 70_000]), vec![])),
            format!("{of_channel}a run of 70000 messages, above the 65537 a run may hold"),
        ),
        (
            Piece::ChannelState(state(run(0, b"a", vec![1]), vec![])),
            "node n1's recorded messages: a run comes as channel_run".to_owned(),
        ),
        (
            // A good run, but the cut that closes the upload does not name its channel.
            Piece::ChannelRun(state(run(0, b"ab", vec![1, 1]), vec![])),
            "node n1's part records messages of channel n2->n1, which its cut does not name"
                .to_owned(),
        ),
    ] {
        let id = cluster
            .start_snapshot(pb::StartSnapshotRequest::default())
            .await
            .unwrap();
        let upload = upload_of(id, 0, [piece, Piece::Cut(pb::UploadCut::default())]);
        let refused = client
            .upload_snapshot_part(tokio_stream::iter(upload))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains(&says), "{says}: {refused:?}");
        client
            .abort_snapshot(pb::AbortSnapshotRequest {
                snapshot_id: id,
                reason: "test".into(),
            })
            .await
            .unwrap();
    }
    // A part records at most 8,388,608 messages (their indices are kept for the verifier):
    // runs of empty payloads cost a byte a message, so the count, not the bytes, bounds them.
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    let per_run = 1u64 << 16;
    let runs = (0..129u64).map(|i| {
        Piece::ChannelRun(state(
            run(i * per_run, b"", vec![0; per_run as usize]),
            vec![],
        ))
    });
    let upload = upload_of(id, 0, runs.chain([Piece::Cut(pb::UploadCut::default())]));
    let refused = client
        .upload_snapshot_part(tokio_stream::iter(upload))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused
            .message()
            .contains("node n1's part records more than 8388608 messages in flight"),
        "{refused:?}"
    );
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A test client that registers as daemon `node` over `NodeSession`; its session's sender
/// (keep it to keep the session) and the coordinator's commands.
async fn fake_node(
    client: &mut pb::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
    node: &str,
) -> (
    tokio::sync::mpsc::Sender<pb::NodeToCoordinator>,
    tonic::Streaming<pb::CoordinatorToNode>,
) {
    let (session_tx, session_rx) = tokio::sync::mpsc::channel(8);
    session_tx
        .send(pb::NodeToCoordinator {
            kind: Some(pb::node_to_coordinator::Kind::Register(pb::Register {
                cluster: "cairn".into(),
                node_id: node.into(),
                address: "127.0.0.1:1".into(),
                incarnation: 1,
                ..Default::default()
            })),
        })
        .await
        .unwrap();
    let mut commands = client
        .node_session(tokio_stream::wrappers::ReceiverStream::new(session_rx))
        .await
        .unwrap()
        .into_inner();
    let registered = commands.message().await.unwrap().unwrap();
    assert!(matches!(
        registered.kind,
        Some(pb::coordinator_to_node::Kind::Registered(_))
    ));
    (session_tx, commands)
}

/// A message over the upload limit after a valid header is refused with the limit's own
/// RESOURCE_EXHAUSTED (the stream's status passed on), and the snapshot fails at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_message_over_the_limit_mid_stream_is_resource_exhausted() {
    use pb::upload_chunk::Kind as Piece;
    let cluster = CoordinatedCluster::start(0, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let mut client = cluster.client().await.unwrap();
    let (_session, _commands) = fake_node(&mut client, "n1").await;
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    let upload = upload_of(
        id,
        0,
        [Piece::StateChunk(state_chunk(&vec![7u8; 20 << 20], true))],
    );
    let refused = client
        .upload_snapshot_part(tokio_stream::iter(upload))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("UploadSnapshotPart") && refused.message().contains("limit"),
        "the server's limit, named: {refused:?}"
    );
}
