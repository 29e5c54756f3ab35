//! The coordinator with real processes, the same suite on the embedded store and on a real
//! etcd the test starts itself: lifecycle in every mode, overlapping snapshots, the
//! concurrency limit, timeouts, a node killed mid-snapshot, a coordinator restart, and an
//! etcd outage.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cairn_cli::bank::{BankState, TransferPayload};
use cairn_integration_tests::coordinated::{CoordinatedCluster, Store, assert_completed, scrape};
use cairn_integration_tests::etcd::Etcd;
use cairn_rpc::v1 as pb;
use cairn_sdk::{AppEvent, AppSession};
use pb::failure_reason::Kind;
use tokio::task::JoinHandle;
use tonic::Code;

fn start(mode: pb::SnapshotMode, timeout_ms: u64) -> pb::StartSnapshotRequest {
    pb::StartSnapshotRequest {
        mode: mode as i32,
        timeout_ms,
        ..Default::default()
    }
}

const MODES: [pb::SnapshotMode; 3] = [
    pb::SnapshotMode::ChandyLamport,
    pb::SnapshotMode::Unaligned,
    pb::SnapshotMode::Aligned,
];

/// An application for a node without a bank: it keeps the money it receives and answers
/// record requests only while `answer` is set, so a test can hold a snapshot in flight.
fn controlled_app(address: String, answer: Arc<AtomicBool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut session = loop {
            match AppSession::connect(&address, "controlled").await {
                Ok(s) => break s,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        let sender = session.sender();
        let mut balance = 0u64;
        while let Ok(Some(event)) = session.next_event().await {
            match event {
                AppEvent::Message { payload, .. } => {
                    balance += TransferPayload::decode(&payload).map_or(0, |t| t.amount);
                }
                AppEvent::RecordState { snapshot_id } => {
                    while !answer.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let state = serde_json::to_vec(&BankState {
                        balance,
                        ..Default::default()
                    })
                    .unwrap();
                    let _ = sender.state_recorded(snapshot_id, state.into());
                }
                AppEvent::Restore { .. }
                | AppEvent::RestorePiece { .. }
                | AppEvent::RestoreAborted { .. }
                | AppEvent::SnapshotCompleted { .. }
                | AppEvent::SnapshotAborted { .. } => {}
            }
        }
    })
}

async fn etcd() -> (Etcd, Store) {
    let etcd = Etcd::start().await.expect("etcd starts");
    let store = Store::Etcd(etcd.endpoint.clone());
    (etcd, store)
}

async fn lifecycle(store: Store) -> CoordinatedCluster {
    let cluster = CoordinatedCluster::start(3, store, &[], &["--max-concurrent", "4"])
        .await
        .unwrap();
    for mode in MODES {
        let id = cluster.start_snapshot(start(mode, 20_000)).await.unwrap();
        assert_completed(&cluster.wait(id).await.unwrap(), cluster.total());
    }
    // Overlapping: all three modes at once.
    let mut ids = Vec::new();
    for mode in MODES {
        ids.push(cluster.start_snapshot(start(mode, 20_000)).await.unwrap());
    }
    for id in ids {
        assert_completed(&cluster.wait(id).await.unwrap(), cluster.total());
    }
    let mut client = cluster.client().await.unwrap();
    let list = client
        .list_snapshots(pb::ListSnapshotsRequest {
            status: pb::SnapshotStatus::Completed as i32,
            page_size: 4,
            page_token: String::new(),
            mode: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.snapshots.len(), 4);
    assert_eq!(
        list.snapshots[0].plan.as_ref().unwrap().snapshot_id,
        6,
        "newest first"
    );
    assert!(!list.next_page_token.is_empty());
    let err = client
        .get_snapshot(pb::GetSnapshotRequest {
            snapshot_id: 999,
            include_data: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    client
        .delete_snapshot(pb::DeleteSnapshotRequest { snapshot_id: 1 })
        .await
        .unwrap();
    // The chunks the other snapshots share survived the collection.
    let kept = client
        .get_snapshot(pb::GetSnapshotRequest {
            snapshot_id: 2,
            include_data: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_completed(&kept, cluster.total());
    assert_eq!(
        client
            .get_snapshot(pb::GetSnapshotRequest {
                snapshot_id: 1,
                include_data: false
            })
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_store_lifecycle_in_every_mode_and_overlapping() {
    let cluster = lifecycle(Store::Embedded).await;
    // Prometheus metrics count what happened.
    let coordinator = scrape(&cluster.coordinator_metrics).await.unwrap();
    assert!(
        coordinator.contains("cairn_snapshots_total{status=\"completed\"} 6"),
        "{coordinator}"
    );
    assert!(
        coordinator.contains("cairn_snapshot_duration_seconds_count 6"),
        "{coordinator}"
    );
    assert!(coordinator.contains("cairn_members 3"), "{coordinator}");
    let node = scrape(&cluster.nodes[0].metrics).await.unwrap();
    assert!(
        node.contains("cairn_node_snapshots_total{outcome=\"completed\"} 6"),
        "{node}"
    );
    assert!(
        node.contains("cairn_node_markers_total{direction=\"sent\"}"),
        "{node}"
    );
    assert!(
        node.contains("cairn_node_messages_total{direction=\"received\"}"),
        "{node}"
    );
    assert!(node.contains("cairn_node_app_queue_depth"), "{node}");
    assert!(
        node.contains("cairn_node_channel_reconnects_total"),
        "{node}"
    );
    // Heartbeats tell the coordinator each node's application is attached.
    let mut client = cluster.client().await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let nodes = client
            .list_nodes(pb::ListNodesRequest {})
            .await
            .unwrap()
            .into_inner()
            .nodes;
        if nodes.len() == 3 && nodes.iter().all(|n| n.application_attached) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "ListNodes never showed every application attached: {nodes:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // One id space: a coordinated daemon refuses snapshots started by hand (their ids could
    // collide with the coordinator's), and the coordinator's next one is unaffected.
    let err = cluster
        .admin(0)
        .await
        .unwrap()
        .initiate_snapshot(pb::InitiateSnapshotRequest {
            snapshot_id: 1_000,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("StartSnapshot"), "{err:?}");
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    assert_completed(&cluster.wait(id).await.unwrap(), cluster.total());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_lifecycle_in_every_mode_and_overlapping_readable_with_etcdctl() {
    let (etcd, store) = etcd().await;
    let _cluster = lifecycle(store).await;
    let dump = etcd.get_prefix("/cairn/").await.unwrap();
    assert!(
        dump.contains("/cairn/cairn/snapshots/00000000000000000006"),
        "{dump}"
    );
    assert!(dump.contains("\"status\": \"COMPLETED\""), "{dump}");
    assert!(dump.contains("/cairn/cairn/members/n1"), "{dump}");
    assert!(
        dump.contains("/cairn/cairn/parts/00000000000000000006/n2"),
        "{dump}"
    );
}

async fn failures(store: Store) {
    let mut cluster = CoordinatedCluster::start(3, store, &[2], &["--max-concurrent", "1"])
        .await
        .unwrap();
    let answer = Arc::new(AtomicBool::new(false));
    let app = controlled_app(cluster.nodes[2].app.clone(), answer.clone());
    cluster.wait_ready(2).await.unwrap();

    // n3 holds the snapshot: the limit refuses a second one, and the timeout names n3.
    let held = cluster
        .start_snapshot(start(pb::SnapshotMode::ChandyLamport, 1500))
        .await
        .unwrap();
    let refused = cluster
        .start_snapshot(start(pb::SnapshotMode::Unaligned, 1500))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused}");
    let timed_out = cluster.wait(held).await.unwrap();
    assert_eq!(timed_out.status, pb::SnapshotStatus::Failed as i32);
    let failure = timed_out.failure.unwrap();
    assert_eq!(
        failure.kind,
        pb::failure_reason::Kind::Timeout as i32,
        "{failure:?}"
    );
    assert!(failure.message.contains("n3"), "{}", failure.message);

    // A node killed mid-snapshot: the snapshot fails naming it.
    let id = cluster
        .start_snapshot(start(pb::SnapshotMode::ChandyLamport, 30_000))
        .await
        .unwrap();
    cluster.wait_recorded(id, 2).await.unwrap();
    cluster.kill_node(2);
    app.abort();
    let lost = cluster.wait(id).await.unwrap();
    assert_eq!(lost.status, pb::SnapshotStatus::Failed as i32);
    let failure = lost.failure.unwrap();
    assert!(failure.message.contains("n3"), "{}", failure.message);

    // Back again, later snapshots complete.
    cluster.start_node(2).unwrap();
    answer.store(true, Ordering::Relaxed);
    let _app = controlled_app(cluster.nodes[2].app.clone(), answer.clone());
    cluster.wait_registered(3).await.unwrap();
    cluster.wait_ready(2).await.unwrap();
    // A snapshot started before every peer has reconnected to n3's new incarnation fails
    // naming the reset channel; once the channels are back, snapshots complete.
    cluster.complete_after_restart("n3", 5).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_store_limit_timeout_and_killed_node() {
    failures(Store::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_limit_timeout_and_killed_node() {
    let (_etcd, store) = etcd().await;
    failures(store).await;
}

/// Which store a test runs on (what a restart looks like differs).
enum StoreKind {
    Embedded,
    Etcd,
}

async fn coordinator_restart(store: Store) {
    let store_kind = match store {
        Store::Embedded => StoreKind::Embedded,
        Store::Etcd(_) => StoreKind::Etcd,
    };
    let mut cluster = CoordinatedCluster::start(3, store, &[2], &[])
        .await
        .unwrap();
    let answer = Arc::new(AtomicBool::new(true));
    let _app = controlled_app(cluster.nodes[2].app.clone(), answer.clone());
    cluster.wait_ready(2).await.unwrap();
    let completed = cluster
        .start_snapshot(start(pb::SnapshotMode::Aligned, 20_000))
        .await
        .unwrap();
    let snapshot = cluster.wait(completed).await.unwrap();
    assert_eq!(
        snapshot.status,
        pb::SnapshotStatus::Completed as i32,
        "{:?}",
        snapshot.failure
    );

    answer.store(false, Ordering::Relaxed);
    let in_flight = cluster
        .start_snapshot(start(pb::SnapshotMode::ChandyLamport, 60_000))
        .await
        .unwrap();
    cluster.kill_coordinator();
    cluster.start_coordinator().unwrap();
    cluster.wait_registered(3).await.unwrap();
    let mut client = cluster.client().await.unwrap();
    let failed = client
        .get_snapshot(pb::GetSnapshotRequest {
            snapshot_id: in_flight,
            include_data: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(failed.status, pb::SnapshotStatus::Failed as i32);
    // On etcd the restarted coordinator is a new leader (a new term): a failover.
    let (kind, words) = match store_kind {
        StoreKind::Embedded => (Kind::CoordinatorRestarted, "coordinator restarted"),
        StoreKind::Etcd => (Kind::CoordinatorFailover, "coordinator failover"),
    };
    let failure = failed.failure.as_ref().unwrap();
    assert_eq!(failure.kind, kind as i32, "{failure:?}");
    assert!(failure.message.contains(words), "{failure:?}");
    let kept = client
        .get_snapshot(pb::GetSnapshotRequest {
            snapshot_id: completed,
            include_data: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(kept.status, pb::SnapshotStatus::Completed as i32);

    answer.store(true, Ordering::Relaxed);
    let next = cluster
        .start_snapshot(start(pb::SnapshotMode::Unaligned, 20_000))
        .await
        .unwrap();
    assert!(next > in_flight, "ids only grow: {next} after {in_flight}");
    let done = cluster.wait(next).await.unwrap();
    assert_eq!(
        done.status,
        pb::SnapshotStatus::Completed as i32,
        "{:?}",
        done.failure
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_store_coordinator_restart_fails_in_flight_and_keeps_completed() {
    coordinator_restart(Store::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_coordinator_restart_fails_in_flight_and_keeps_completed() {
    let (_etcd, store) = etcd().await;
    coordinator_restart(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_outage_answers_unavailable_and_the_coordinator_recovers_by_itself() {
    let (mut etcd, store) = etcd().await;
    let cluster = CoordinatedCluster::start(3, store, &[], &[]).await.unwrap();
    etcd.stop();
    // The coordinator itself answers (the harness's client would look for the leader in
    // etcd first).
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.coordinator))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let err = pb::coordinator_client::CoordinatorClient::new(channel)
        .start_snapshot(start(pb::SnapshotMode::ChandyLamport, 20_000))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.message().contains("etcd"), "{}", err.message());
    etcd.resume().await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let id = loop {
        match cluster
            .start_snapshot(start(pb::SnapshotMode::ChandyLamport, 20_000))
            .await
        {
            Ok(id) => break id,
            Err(e) if e.code() == Code::Unavailable && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("after etcd came back: {e}"),
        }
    };
    assert_completed(&cluster.wait(id).await.unwrap(), cluster.total());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_keeps_the_newest_completed_snapshots_and_their_chunks() {
    let cluster = CoordinatedCluster::start(3, Store::Embedded, &[], &["--retention", "2"])
        .await
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..4 {
        let id = cluster
            .start_snapshot(start(pb::SnapshotMode::ChandyLamport, 20_000))
            .await
            .unwrap();
        assert_completed(&cluster.wait(id).await.unwrap(), cluster.total());
        ids.push(id);
    }
    let mut client = cluster.client().await.unwrap();
    // Retention runs after the end is stored, which is when the watcher hears of it: the
    // deletion may still be on its way when the list is first read.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let kept = loop {
        let list = client
            .list_snapshots(pb::ListSnapshotsRequest {
                status: pb::SnapshotStatus::Completed as i32,
                page_size: 0,
                page_token: String::new(),
                mode: 0,
            })
            .await
            .unwrap()
            .into_inner();
        let kept: Vec<u64> = list
            .snapshots
            .iter()
            .map(|s| s.plan.as_ref().unwrap().snapshot_id)
            .collect();
        if kept.len() <= 2 || tokio::time::Instant::now() >= deadline {
            break kept;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(kept, vec![ids[3], ids[2]]);
    for gone in &ids[..2] {
        let err = client
            .get_snapshot(pb::GetSnapshotRequest {
                snapshot_id: *gone,
                include_data: true,
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
    }
    // The kept snapshots' chunks survived the collection: their data reads back whole.
    for id in &ids[2..] {
        let snapshot = client
            .get_snapshot(pb::GetSnapshotRequest {
                snapshot_id: *id,
                include_data: true,
            })
            .await
            .unwrap()
            .into_inner();
        assert_completed(&snapshot, cluster.total());
    }
}

/// An unaligned marker overtakes a sender's queue, and the messages it overtakes go to the
/// coordinator at once, while the snapshot runs: the coordinator receives them before the
/// sender's application has recorded its state (it is held here until they arrive), and the
/// snapshot then completes and verifies with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unaligned_senders_overtaken_queue_is_uploaded_before_its_state() {
    use bytes::Bytes;
    let cluster = CoordinatedCluster::start_with(
        2,
        Store::Embedded,
        &[0, 1],
        &[],
        &["--channel-buffer", "1000"],
    )
    .await
    .unwrap();
    // n1 floods n2 and answers record requests only once `answer` is set.
    let answer = Arc::new(AtomicBool::new(false));
    let mut n1 = AppSession::connect(&cluster.nodes[0].app, "flood")
        .await
        .unwrap();
    let flood = flood_n2(&n1);
    let held = answer.clone();
    let n1_app = tokio::spawn(async move {
        let sender = n1.sender();
        while let Ok(Some(event)) = n1.next_event().await {
            if let AppEvent::RecordState { snapshot_id } = event {
                while !held.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let _ = sender.state_recorded(snapshot_id, Bytes::from_static(b"n1"));
            }
        }
    });
    // n2 takes a message every 10 ms: n1's queue to it fills.
    let n2_app = paced_n2(&cluster, || Duration::from_millis(10)).await;
    // The queue is full once n1's daemon has taken its buffer and more beyond what n2 took.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let queued = queued_to_n2(&cluster).await;
        if queued >= 900 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "n1's queue to n2 never filled ({queued} queued)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            mode: pb::SnapshotMode::Unaligned as i32,
            timeout_ms: 30_000,
            initiators: vec!["n1".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    // Watched until n1's part has bytes at the coordinator while its state is held.
    let mut client = cluster.client().await.unwrap();
    let mut watch = client
        .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: id })
        .await
        .unwrap()
        .into_inner();
    let uploading = tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(p) = watch.message().await.unwrap() {
            let n1 = p.node_progress.iter().find(|n| n.node_id == "n1").unwrap();
            assert!(!n1.recorded, "n1's state is held: it cannot be recorded");
            if n1.bytes_uploading > 0 {
                return n1.bytes_uploading;
            }
        }
        panic!("the watch ended while n1's state was held");
    })
    .await
    .expect("n1's overtaken messages never reached the coordinator while its state was held");
    // 8-byte payloads: at least the queue's.
    assert!(uploading >= 8 * 900, "only {uploading} bytes uploaded");
    answer.store(true, Ordering::Relaxed);
    let done = cluster.wait(id).await.unwrap();
    assert_eq!(
        done.status,
        pb::SnapshotStatus::Completed as i32,
        "{:?}",
        done.failure
    );
    let recorded = done.verdict.as_ref().map_or(0, |v| v.recorded_messages);
    assert!(recorded >= 900, "only {recorded} messages recorded");
    flood.abort();
    n1_app.abort();
    n2_app.abort();
}

/// Buffer debloating (`--queue-target`): behind a slow receiver, the sender's queue holds
/// about the target's worth of the receiver's pace (here the floor, 256 messages), not its
/// `--channel-buffer` (5,000; without the flag the same queue fills to it, as in the test
/// above); the rest of the flood waits in the sending application. Snapshots still complete
/// with the bound in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debloated_queue_holds_its_peers_pace_not_its_buffer() {
    use bytes::Bytes;
    use std::sync::atomic::AtomicU64;
    const BUFFER: u64 = 5_000;
    let cluster = CoordinatedCluster::start_with(
        2,
        Store::Embedded,
        &[0, 1],
        &[],
        &["--channel-buffer", "5000", "--queue-target", "50ms"],
    )
    .await
    .unwrap();
    let mut n1 = AppSession::connect(&cluster.nodes[0].app, "flood")
        .await
        .unwrap();
    let flood = flood_n2(&n1);
    let n1_app = tokio::spawn(async move {
        let sender = n1.sender();
        while let Ok(Some(event)) = n1.next_event().await {
            if let AppEvent::RecordState { snapshot_id } = event {
                let _ = sender.state_recorded(snapshot_id, Bytes::from_static(b"n1"));
            }
        }
    });
    // n2 takes about 4,000 messages a second (a millisecond's pause every four).
    let received = Arc::new(AtomicU64::new(0));
    let counted = received.clone();
    let n2_app = paced_n2(&cluster, move || {
        if counted.fetch_add(1, Ordering::Relaxed) % 4 == 3 {
            Duration::from_millis(1)
        } else {
            Duration::ZERO
        }
    })
    .await;
    // Once n2 has worked through what its first credits let in, n1's queue to it stays
    // within the bound (a little over while credits of a larger bound come back): twenty
    // readings in a row.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let (mut within, mut highest) = (0, 0);
    while within < 20 {
        let now = queued_to_n2(&cluster).await;
        if received.load(Ordering::Relaxed) >= 2 * BUFFER && now > 0 {
            highest = highest.max(now);
            within = if now <= 300 { within + 1 } else { 0 };
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "n1's queue to n2 did not settle within its bound: {now} queued now, {highest} \
             at most since n2 took {} messages",
            2 * BUFFER
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            mode: pb::SnapshotMode::Unaligned as i32,
            timeout_ms: 30_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let done = cluster.wait(id).await.unwrap();
    assert_eq!(
        done.status,
        pb::SnapshotStatus::Completed as i32,
        "{:?}",
        done.failure
    );
    flood.abort();
    n1_app.abort();
    n2_app.abort();
}

/// n1's application floods n2 with 8-byte messages until aborted.
fn flood_n2(n1: &AppSession) -> JoinHandle<()> {
    let sender = n1.sender();
    tokio::spawn(async move {
        while sender
            .send("n2", bytes::Bytes::from_static(b"12345678"))
            .await
            .is_ok()
        {}
    })
}

/// The messages n1's daemon holds queued for n2 now.
async fn queued_to_n2(cluster: &CoordinatedCluster) -> u64 {
    let mut admin = cluster.admin(0).await.unwrap();
    let status = admin
        .get_node_status(pb::GetNodeStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    status
        .channels
        .iter()
        .find(|c| c.channel.as_ref().is_some_and(|c| c.to == "n2"))
        .map_or(0, |c| c.queued)
}

/// n2's application: answers record requests at once, and pauses `pause()` after each
/// message it takes.
async fn paced_n2(
    cluster: &CoordinatedCluster,
    mut pause: impl FnMut() -> Duration + Send + 'static,
) -> JoinHandle<()> {
    let mut n2 = AppSession::connect(&cluster.nodes[1].app, "slow")
        .await
        .unwrap();
    tokio::spawn(async move {
        let sender = n2.sender();
        while let Ok(Some(event)) = n2.next_event().await {
            match event {
                AppEvent::RecordState { snapshot_id } => {
                    let _ = sender.state_recorded(snapshot_id, bytes::Bytes::from_static(b"n2"));
                }
                _ => {
                    let pause = pause();
                    if !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                    }
                }
            }
        }
    })
}
