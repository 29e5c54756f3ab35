//! A 100 MiB local state goes from the application through its daemon to the coordinator
//! without either holding it whole: the daemon streams each piece on as it arrives (with a
//! few MiB of upload room), and the coordinator chunks it into the blob store as it reads.
//! Checked by the peak resident memory (`VmHWM`) of both processes.

use std::time::Duration;

use bytes::Bytes;
use cairn_integration_tests::coordinated::{CoordinatedCluster, Store};
use cairn_proto::v1 as pb;
use cairn_sdk::{AppEvent, AppSession};

const STATE: usize = 100 << 20;
/// Far below the state: a process that held the state whole would pass it.
const PEAK_LIMIT: u64 = 80 << 20;

/// Peak resident set of a process, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM in /proc/<pid>/status");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    kib << 10
}

/// Incompressible, undeduplicated bytes (xorshift).
fn noise(len: usize) -> Bytes {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out.into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mib_state_streams_through_the_daemon_and_the_coordinator() {
    let cluster = CoordinatedCluster::start(2, Store::Embedded, &[1], &[])
        .await
        .unwrap();
    let address = cluster.nodes[1].app.clone();
    let state = noise(STATE);
    let app = tokio::spawn(async move {
        let mut session = AppSession::connect(&address, "big-state").await.unwrap();
        let sender = session.sender();
        while let Ok(Some(event)) = session.next_event().await {
            if let AppEvent::RecordState { snapshot_id } = event {
                sender.state_recorded(snapshot_id, state.clone()).unwrap();
            }
        }
    });
    cluster.wait_ready(1).await.unwrap();
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            timeout_ms: 120_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let snapshot = cluster.wait_with(id, false).await.unwrap();
    assert_eq!(
        snapshot.status,
        pb::SnapshotStatus::Completed as i32,
        "{:?}",
        snapshot.failure
    );
    assert!(snapshot.verdict.is_some_and(|v| v.consistent));
    let part = snapshot.nodes.iter().find(|n| n.node_id == "n2").unwrap();
    assert_eq!(part.local_state_bytes, STATE as u64);
    assert!(
        snapshot.bytes_new >= STATE as u64,
        "bytes_new {}",
        snapshot.bytes_new
    );

    let node = peak_rss(cluster.node_pid(1).unwrap());
    let coordinator = peak_rss(cluster.coordinator_pid().unwrap());
    println!(
        "peak resident memory: daemon {} MiB, coordinator {} MiB",
        node >> 20,
        coordinator >> 20
    );
    assert!(node < PEAK_LIMIT, "the daemon peaked at {} MiB", node >> 20);
    assert!(
        coordinator < PEAK_LIMIT,
        "the coordinator peaked at {} MiB",
        coordinator >> 20
    );
    app.abort();
    tokio::time::timeout(Duration::from_secs(5), async {
        let _ = app.await;
    })
    .await
    .unwrap();
}
