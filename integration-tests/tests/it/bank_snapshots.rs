//! Real `cairn-node` and `cairn-bank` processes on static configuration: snapshots in
//! every mode while transfers run, each verified and its money counted.

use std::time::Duration;

use cairn_core::SnapshotMode;
use cairn_integration_tests::bank_cluster::BankCluster;
use cairn_integration_tests::cut::check_bank_cut;

async fn snapshots_add_up(n: usize) {
    let cluster = BankCluster::start(n, 300.0, &[])
        .await
        .expect("cluster starts");
    let mut id = 1;
    let mut recorded = 0;
    for mode in [
        SnapshotMode::ChandyLamport,
        SnapshotMode::Unaligned,
        SnapshotMode::Aligned,
    ] {
        for initiator in [0, n - 1] {
            let parts = cluster
                .snapshot(id, mode, initiator, Duration::from_secs(20))
                .await
                .unwrap_or_else(|e| panic!("snapshot {id} ({mode}): {e:#}"));
            let cut = check_bank_cut(&cluster.topology, &parts)
                .unwrap_or_else(|e| panic!("snapshot {id} ({mode}): {e:#}"));
            assert_eq!(
                cut.total(),
                cluster.total(),
                "snapshot {id} ({mode}): balances {} + in flight {} != {}",
                cut.balances,
                cut.in_flight,
                cluster.total()
            );
            recorded += cut.messages;
            id += 1;
        }
    }
    assert!(
        recorded > 0,
        "no snapshot recorded a message in flight: channel states untested"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_banks_snapshot_in_every_mode_and_the_money_adds_up() {
    snapshots_add_up(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_banks_snapshot_in_every_mode_and_the_money_adds_up() {
    snapshots_add_up(5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_daemon_cleanly_within_its_grace_period() {
    let mut cluster = BankCluster::start(2, 100.0, &[])
        .await
        .expect("cluster starts");
    // The daemons run with a 1 s grace period.
    let status = cluster.members[0]
        .node_process()
        .terminate(Duration::from_secs(5))
        .expect("the daemon did not exit within 5 s of SIGTERM");
    assert!(
        status.success(),
        "the daemon exited with {status} on SIGTERM"
    );
}
