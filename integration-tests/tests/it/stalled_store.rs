//! A stalled blob store — the S3 server SIGSTOPped for 10 s — during a restore's
//! verification and during garbage collection. The coordinator's task runs neither (both
//! run on tasks of their own and come back as messages), so what goes through the task is
//! still answered within 100 ms: heartbeats (a heartbeat has no answer; it waits in the
//! task's queue as `ListNodes` does, whose round trip is measured, and every node's last
//! heartbeat keeps advancing), registrations (a second daemon claiming a node's id,
//! refused by the task), `ListSnapshots` and `StartSnapshot`. The restore and the deletion
//! wait for the store, and finish once it is back.

use std::time::{Duration, Instant};

use cairn_integration_tests::coordinated::{CoordinatedCluster, Store};
use cairn_integration_tests::processes::signal_pid;
use cairn_integration_tests::restore::{snapshot, wait_restore};
use cairn_integration_tests::s3::S3Server;
use cairn_rpc::v1 as pb;
use tonic::Code;

/// How long the store stays stopped in each phase.
const STALL: Duration = Duration::from_secs(10);
/// The longest a call through the coordinator's task may take while the store is stalled.
const BOUND: Duration = Duration::from_millis(100);
/// A daemon's heartbeat period (node/src/coordinator_link: `HEARTBEAT`).
const HEARTBEAT: Duration = Duration::from_secs(2);

/// SIGCONT on drop: the store is never left stopped, pass or fail.
struct Stopped(u32);

impl Stopped {
    fn new(pid: u32) -> Self {
        signal_pid(pid, "-STOP");
        Self(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal_pid(self.0, "-CONT");
    }
}

/// The slowest answer of each kind seen while probing, and the oldest heartbeat.
#[derive(Debug, Default)]
struct Worst {
    list_snapshots: Duration,
    list_nodes: Duration,
    registration: Duration,
    start_snapshot: Duration,
    heartbeat_age: Duration,
    rounds: usize,
}

/// Probes the coordinator every 200 ms for `STALL`: ListSnapshots, ListNodes (with every
/// connected node's heartbeat age), a registration, and (once) StartSnapshot.
async fn probe(cluster: &CoordinatedCluster) -> Worst {
    let mut client = cluster.client().await.unwrap();
    let mut worst = Worst::default();
    let end = Instant::now() + STALL;
    while Instant::now() < end {
        let at = Instant::now();
        client
            .list_snapshots(pb::ListSnapshotsRequest::default())
            .await
            .unwrap();
        worst.list_snapshots = worst.list_snapshots.max(at.elapsed());

        let at = Instant::now();
        let nodes = client
            .list_nodes(pb::ListNodesRequest::default())
            .await
            .unwrap()
            .into_inner();
        worst.list_nodes = worst.list_nodes.max(at.elapsed());
        let now_ms = cairn_proto::stored::convert::now_ms();
        for node in nodes.nodes.iter().filter(|n| n.connected) {
            let age = Duration::from_millis(now_ms.saturating_sub(node.last_seen_ms));
            worst.heartbeat_age = worst.heartbeat_age.max(age);
        }

        // A second daemon claiming n1's id: the task refuses it (n1's daemon is connected).
        let register = pb::NodeToCoordinator {
            kind: Some(pb::node_to_coordinator::Kind::Register(pb::Register {
                cluster: "cairn".into(),
                node_id: "n1".into(),
                incarnation: u64::MAX,
                address: "127.0.0.1:1".into(),
                ..Default::default()
            })),
        };
        let at = Instant::now();
        let refused = client
            .node_session(tokio_stream::iter([register]))
            .await
            .expect_err("a second daemon with n1's id is refused");
        worst.registration = worst.registration.max(at.elapsed());
        assert!(
            refused.message().contains("held by a connected daemon"),
            "{refused:?}"
        );

        if worst.rounds == 0 {
            let at = Instant::now();
            client
                .start_snapshot(pb::StartSnapshotRequest {
                    mode: pb::SnapshotMode::ChandyLamport as i32,
                    timeout_ms: 60_000,
                    ..Default::default()
                })
                .await
                .unwrap();
            worst.start_snapshot = at.elapsed();
        }
        worst.rounds += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    worst
}

fn assert_answered(phase: &str, worst: &Worst) {
    eprintln!("{phase}: {worst:?}");
    assert!(worst.rounds >= 20, "{phase}: only {} rounds", worst.rounds);
    for (what, took) in [
        ("ListSnapshots", worst.list_snapshots),
        (
            "ListNodes (the task's queue, where heartbeats wait)",
            worst.list_nodes,
        ),
        ("a registration", worst.registration),
        ("StartSnapshot", worst.start_snapshot),
    ] {
        assert!(
            took <= BOUND,
            "{phase}: {what} took {took:?} while the blob store was stalled (bound {BOUND:?})"
        );
    }
    assert!(
        worst.heartbeat_age <= HEARTBEAT + BOUND * 5,
        "{phase}: a node's last heartbeat was {:?} old: heartbeats waited",
        worst.heartbeat_age
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_blob_store_stalls_no_heartbeat_registration_list_or_start() {
    let s3 = S3Server::start().await.unwrap();
    let blob = [
        "--blob-store".to_owned(),
        s3.url("stalled"),
        "--s3-endpoint".to_owned(),
        s3.endpoint.clone(),
        "--s3-allow-http".to_owned(),
    ];
    let args: Vec<&str> = blob.iter().map(String::as_str).collect();
    let cluster = CoordinatedCluster::start_env(2, Store::Embedded, &[], &args, &[], &s3.env())
        .await
        .unwrap();
    let first = snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
    let second = snapshot(&cluster, pb::SnapshotMode::Unaligned).await;
    cluster.set_workload(0.0).await.unwrap();
    let pid = s3.pid().expect("the S3 server runs");

    // A restore whose verification reads every chunk from the stopped store.
    let stopped = Stopped::new(pid);
    let mut client = cluster.client().await.unwrap();
    let id = first.plan.as_ref().unwrap().snapshot_id;
    let restore = tokio::spawn(async move {
        client
            .restore_snapshot(pb::RestoreSnapshotRequest {
                snapshot_id: id,
                if_epoch: None,
            })
            .await
    });
    let worst = probe(&cluster).await;
    assert_answered("during a restore's verification", &worst);
    assert!(
        !restore.is_finished(),
        "the restore's verification should still wait for the stopped store"
    );
    drop(stopped);
    let op = restore
        .await
        .unwrap()
        .expect("the restore starts once the store is back");
    let op = wait_restore(&cluster, &op.into_inner().restore_id).await;
    assert!(op.done, "{:?}", op.failure);

    // A deletion whose garbage collection reads the manifests from the stopped store.
    let stopped = Stopped::new(pid);
    let mut client = cluster.client().await.unwrap();
    let id = second.plan.as_ref().unwrap().snapshot_id;
    let delete = tokio::spawn(async move {
        client
            .delete_snapshot(pb::DeleteSnapshotRequest { snapshot_id: id })
            .await
    });
    let worst = probe(&cluster).await;
    assert_answered("during garbage collection", &worst);
    assert!(
        !delete.is_finished(),
        "the deletion's garbage collection should still wait for the stopped store"
    );
    drop(stopped);
    let deleted = delete
        .await
        .unwrap()
        .expect("the deletion ends once the store is back");
    let gone = cluster
        .client()
        .await
        .unwrap()
        .get_snapshot(pb::GetSnapshotRequest {
            snapshot_id: id,
            ..Default::default()
        })
        .await
        .expect_err("the deleted snapshot is gone");
    assert_eq!(gone.code(), Code::NotFound, "{deleted:?}");
}
