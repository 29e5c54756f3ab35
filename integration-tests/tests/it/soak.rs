//! Five daemons and five banks under continuous transfers: 100 snapshots across every
//! mode, several overlapping, while connections are cut again and again — every one must
//! complete, verify, and account for all the money. Then a daemon killed with SIGKILL in the
//! middle of a snapshot: that snapshot fails naming it, and once it is back later snapshots
//! complete.

use cairn_integration_tests::coordinated::{CoordinatedCluster, Store, assert_completed};
use cairn_rpc::v1 as pb;
use tonic::Code;

const SNAPSHOTS: usize = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_overlapping_snapshots_under_cuts_all_verify_and_the_money_adds_up() {
    let mut cluster = CoordinatedCluster::start_with(
        5,
        Store::Embedded,
        &[],
        &["--max-concurrent", "3"],
        &["--fault-injection"],
    )
    .await
    .unwrap();
    let total = cluster.total();
    let modes = [
        pb::SnapshotMode::ChandyLamport,
        pb::SnapshotMode::Unaligned,
        pb::SnapshotMode::Aligned,
    ];
    let mut client = cluster.client().await.unwrap();
    let mut admins = Vec::new();
    for node in &cluster.nodes {
        admins.push(
            pb::node_admin_client::NodeAdminClient::connect(format!("http://{}", node.peer))
                .await
                .unwrap(),
        );
    }
    let mut in_flight: Vec<u64> = Vec::new();
    let mut started = 0;
    let mut cuts = 0;
    let mut overlapped = 0;
    while started < SNAPSHOTS || !in_flight.is_empty() {
        if started < SNAPSHOTS && in_flight.len() < 3 {
            let request = pb::StartSnapshotRequest {
                mode: modes[started % 3] as i32,
                timeout_ms: 30_000,
                ..Default::default()
            };
            match client.start_snapshot(request).await {
                Ok(r) => {
                    if !in_flight.is_empty() {
                        overlapped += 1;
                    }
                    in_flight.push(r.into_inner().snapshot_id);
                    started += 1;
                    // Break a connection now and then while snapshots are in flight.
                    if started % 7 == 0 {
                        let from = started % 5;
                        let to = (from + 1 + started % 4) % 5;
                        let request = pb::InjectFaultRequest {
                            channel: Some(pb::ChannelRef {
                                from: cluster.nodes[from].id.clone(),
                                to: cluster.nodes[to].id.clone(),
                            }),
                            fault: Some(pb::inject_fault_request::Fault::Cut(pb::Cut {})),
                        };
                        admins[from].inject_fault(request).await.unwrap();
                        cuts += 1;
                    }
                    continue;
                }
                // An aligned snapshot waits for the one in flight; anything else is a failure.
                Err(s) if s.code() == Code::ResourceExhausted => {}
                Err(s) => panic!("start: {s}"),
            }
        }
        let id = in_flight.remove(0);
        assert_completed(&cluster.wait(id).await.unwrap(), total);
    }
    assert!(
        overlapped >= 20,
        "only {overlapped} snapshots overlapped another"
    );
    assert!(cuts >= 10, "only {cuts} connections were cut");

    // kill -9 of a daemon during a snapshot; holding n1->n5 at n5 keeps that snapshot in
    // flight until the kill.
    let hold = pb::InjectFaultRequest {
        channel: Some(pb::ChannelRef {
            from: "n1".into(),
            to: "n5".into(),
        }),
        fault: Some(pb::inject_fault_request::Fault::Hold(pb::Hold {})),
    };
    admins[4].inject_fault(hold).await.unwrap();
    let id = client
        .start_snapshot(pb::StartSnapshotRequest {
            mode: pb::SnapshotMode::ChandyLamport as i32,
            timeout_ms: 30_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot_id;
    cluster.wait_recorded(id, 4).await.unwrap();
    cluster.kill_node(4);
    let snapshot = cluster.wait(id).await.unwrap();
    assert_eq!(snapshot.status, pb::SnapshotStatus::Failed as i32);
    let failure = snapshot.failure.unwrap();
    assert!(
        failure.message.contains("n5"),
        "the failure does not name n5: {}",
        failure.message
    );
    // While n5 is down, a snapshot cannot start: its peers name it.
    let err = client
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("n5"), "{}", err.message());
    cluster.start_node(4).unwrap();
    cluster.wait_registered(5).await.unwrap();
    cluster.wait_ready(4).await.unwrap();
    cluster.complete_after_restart("n5", 10).await.unwrap();
}
