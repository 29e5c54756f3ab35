//! Membership owned by the coordinator: daemons start with only `--coordinator`, learn
//! their members and channels from it, and are wired in as members join; a join fails the
//! snapshots in flight (they were planned without the newcomer); a member that is down
//! stays in the topology and blocks new snapshots by name; `--topology` fixes the channels
//! and refuses nodes it does not name.

use std::time::Duration;

use cairn_integration_tests::coordinated::{
    CoordinatedCluster, Store, assert_completed, channel_fault, health_of,
};
use cairn_integration_tests::processes::{ChildGuard, binary, eventually, free_port};
use cairn_proto::v1 as pb;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus as Serving;

async fn nodes(cluster: &CoordinatedCluster) -> pb::ListNodesResponse {
    let mut client = cluster.client().await.unwrap();
    client
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_member_is_wired_in_and_fails_only_the_snapshot_in_flight() {
    use pb::inject_fault_request::Fault;
    let mut cluster =
        CoordinatedCluster::start_with(2, Store::Embedded, &[], &[], &["--fault-injection"])
            .await
            .unwrap();
    let first = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    let first = cluster.wait(first).await.unwrap();
    assert_completed(&first, cluster.total());
    assert_eq!(first.channels.len(), 2);

    // n1->n2 held at n2: a snapshot cannot complete while it is held.
    let mut n2 = cluster.admin(1).await.unwrap();
    n2.inject_fault(channel_fault("n1", "n2", Fault::Hold(pb::Hold {})))
        .await
        .unwrap();
    let held = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            initiators: vec!["n1".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    cluster.wait_recorded(held, 1).await.unwrap();

    // n3 joins: the coordinator hands it n1 and n2, and tells them of it.
    let n3 = cluster.add_node(true, &["--fault-injection"]).unwrap();
    cluster.wait_registered(3).await.unwrap();
    for i in 0..3 {
        cluster.wait_ready(i).await.unwrap();
    }
    let failed = cluster.wait(held).await.unwrap();
    assert_eq!(failed.status, pb::SnapshotStatus::Failed as i32);
    let failure = failed.failure.unwrap();
    assert_eq!(
        failure.kind,
        pb::failure_reason::Kind::MembershipChanged as i32,
        "{failure:?}"
    );
    assert!(failure.message.contains("n3 joined"), "{}", failure.message);
    n2.inject_fault(channel_fault("n1", "n2", Fault::Resume(pb::Resume {})))
        .await
        .unwrap();

    // Snapshots now span all three, and the money of three banks adds up.
    for mode in [
        pb::SnapshotMode::ChandyLamport,
        pb::SnapshotMode::Unaligned,
        pb::SnapshotMode::Aligned,
    ] {
        let id = cluster
            .start_snapshot(pb::StartSnapshotRequest {
                mode: mode as i32,
                ..Default::default()
            })
            .await
            .unwrap();
        let snapshot = cluster.wait(id).await.unwrap();
        assert_completed(&snapshot, cluster.total());
        assert_eq!(snapshot.nodes.len(), 3);
        assert_eq!(snapshot.channels.len(), 6);
    }

    // A member that is down stays a member: new snapshots are refused naming it.
    cluster.kill_node(n3);
    eventually(
        "n3 shows as disconnected",
        Duration::from_secs(10),
        || async {
            let listed = nodes(&cluster).await;
            let n3 = listed.nodes.iter().find(|n| n.node_id == "n3");
            anyhow::ensure!(n3.is_some_and(|n| !n.connected), "{listed:?}");
            anyhow::ensure!(listed.channels.len() == 6, "{listed:?}");
            Ok(())
        },
    )
    .await
    .unwrap();
    let err = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("n3"), "{}", err.message());
    cluster.start_node(n3).unwrap();
    cluster.wait_registered(3).await.unwrap();
    cluster.wait_ready(n3).await.unwrap();
    cluster.complete_after_restart("n3", 10).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topology_file_fixes_the_channels_and_refuses_nodes_it_does_not_name() {
    let dir = std::env::temp_dir().join(format!("cairn-topology-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ring.txt");
    std::fs::write(&file, "# a ring of three\nn1>n2\nn2>n3\nn3>n1\n").unwrap();
    let file_arg = file.display().to_string();
    let cluster = CoordinatedCluster::start(3, Store::Embedded, &[], &["--topology", &file_arg])
        .await
        .unwrap();
    let listed = nodes(&cluster).await;
    let channels: Vec<String> = listed
        .channels
        .iter()
        .map(|c| format!("{}>{}", c.from, c.to))
        .collect();
    assert_eq!(channels, ["n1>n2", "n2>n3", "n3>n1"]);
    for mode in [pb::SnapshotMode::ChandyLamport, pb::SnapshotMode::Aligned] {
        let id = cluster
            .start_snapshot(pb::StartSnapshotRequest {
                mode: mode as i32,
                ..Default::default()
            })
            .await
            .unwrap();
        let snapshot = cluster.wait(id).await.unwrap();
        assert_completed(&snapshot, cluster.total());
        assert_eq!(snapshot.channels.len(), 3);
    }

    // A node the file does not name is refused, and says why.
    let log = dir.join("n9.log");
    let mut command = std::process::Command::new(binary("cairn-node").unwrap());
    command.args([
        "--node-id",
        "n9",
        "--peer-listen",
        &format!("127.0.0.1:{}", free_port()),
        "--app-listen",
        &format!("127.0.0.1:{}", free_port()),
        "--coordinator",
        &cluster.coordinator,
    ]);
    let _n9 = ChildGuard::spawn("cairn-node n9", command, &log).unwrap();
    eventually("n9 is refused", Duration::from_secs(10), || async {
        let text = std::fs::read_to_string(&log)?;
        anyhow::ensure!(
            text.contains("node n9 is not in this coordinator's --topology file"),
            "{text}"
        );
        Ok(())
    })
    .await
    .unwrap();
    assert!(
        nodes(&cluster)
            .await
            .nodes
            .iter()
            .all(|n| n.node_id != "n9")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_daemon_with_a_coordinator_refuses_peer_flags_and_needs_an_address() {
    let run = |args: &[&str]| {
        let output = std::process::Command::new(binary("cairn-node").unwrap())
            .args(args)
            .output()
            .unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (code, err) = run(&[
        "--node-id",
        "n1",
        "--coordinator",
        "127.0.0.1:1",
        "--peer",
        "n1=127.0.0.1:2",
    ]);
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("--peer and --channel are for a daemon without --coordinator"),
        "{err}"
    );
    let (code, err) = run(&["--node-id", "n1", "--coordinator", "127.0.0.1:1"]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("needs --advertise"), "{err}");
    let (code, err) = run(&["--node-id", "n1"]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("give --coordinator"), "{err}");
}

/// The banks at `live` once every transfer among them has landed: their balances by node.
async fn settled(
    cluster: &CoordinatedCluster,
    live: &[usize],
    total: u64,
) -> std::collections::BTreeMap<String, u64> {
    use cairn_proto::bank::v1 as bank;
    eventually("every transfer landed", Duration::from_secs(30), || async {
        let mut balances = std::collections::BTreeMap::new();
        for &i in live {
            let b = cluster
                .bank(i)
                .await?
                .get_balance(bank::GetBalanceRequest {})
                .await?
                .into_inner();
            balances.insert(b.node_id, b.balance);
        }
        let sum: u64 = balances.values().sum();
        anyhow::ensure!(sum == total, "the banks hold {sum} of {total}");
        Ok(balances)
    })
    .await
    .unwrap()
}

/// The first completed snapshot that spans exactly `nodes` and started at or after
/// `since_ms`, with its data.
async fn spanning(cluster: &CoordinatedCluster, nodes: &[&str], since_ms: u64) -> pb::Snapshot {
    let id = eventually(
        &format!("a snapshot of {nodes:?}"),
        Duration::from_secs(30),
        || async {
            let mut client = cluster.client().await?;
            let snapshots = client
                .list_snapshots(pb::ListSnapshotsRequest {
                    status: pb::SnapshotStatus::Completed as i32,
                    ..Default::default()
                })
                .await?
                .into_inner()
                .snapshots;
            snapshots
                .iter()
                .rev()
                .find(|s| {
                    let mut of: Vec<&str> = s.nodes.iter().map(|n| n.node_id.as_str()).collect();
                    of.sort_unstable();
                    s.started_at_ms >= since_ms && of == nodes
                })
                .and_then(|s| s.plan.as_ref().map(|p| p.snapshot_id))
                .ok_or_else(|| anyhow::anyhow!("none yet"))
        },
    )
    .await
    .unwrap();
    cluster.wait(id).await.unwrap()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Nodes leave as well as join, under a bank workload with a snapshot every 200 ms: a
/// member that is down is removed (not while connected), snapshots resume without it within
/// 2 s, the money adds up among the rest once what it held and what was queued for it
/// (dropped, and counted) are taken out; a restore of a snapshot naming it is refused by
/// name; a new node joins; two nodes are removed at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_are_removed_and_added_under_load_and_snapshots_go_on() {
    use cairn_proto::bank::v1 as bank;
    let mut cluster =
        CoordinatedCluster::start(5, Store::Embedded, &[], &["--schedule-interval", "200ms"])
            .await
            .unwrap();
    let mut total = cluster.total();
    let before = spanning(&cluster, &["n1", "n2", "n3", "n4", "n5"], 0).await;
    assert_completed(&before, total);
    let mut client = cluster.client().await.unwrap();
    let remove = |node: &str| pb::RemoveNodeRequest {
        node_id: node.into(),
    };

    // Refused: a connected node, a node that is not a member.
    let err = client.remove_node(remove("n5")).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("n5 is connected"), "{err:?}");
    let err = client.remove_node(remove("n9")).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");

    // n5 goes down for good with a transfer of 7 queued for it at n1.
    cluster.set_workload(0.0).await.unwrap();
    cluster.bank_workload = 0.0;
    let held = settled(&cluster, &[0, 1, 2, 3, 4], total).await["n5"];
    cluster.kill_node(4);
    cluster
        .bank(0)
        .await
        .unwrap()
        .transfer(bank::TransferRequest {
            to: "n5".into(),
            amount: 7,
            ..Default::default()
        })
        .await
        .unwrap();
    down(&cluster, "n5").await;
    let removed_at = now_ms();
    let nodes = client.remove_node(remove("n5")).await.unwrap().into_inner();
    let ids: Vec<&str> = nodes.nodes.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(ids, ["n1", "n2", "n3", "n4"]);
    total -= held + 7;
    let after = spanning(&cluster, &["n1", "n2", "n3", "n4"], removed_at).await;
    let resumed = after.started_at_ms.saturating_sub(removed_at);
    println!("snapshots resumed without n5 {resumed} ms after its removal");
    assert!(resumed <= 2_000, "resumed after {resumed} ms");
    assert_completed(&after, total);
    let text = cluster.scrape(&cluster.nodes[0].metrics).await.unwrap();
    assert_eq!(
        metric(&text),
        1.0,
        "n1 dropped and counted the transfer queued for n5: {}\n{}",
        text.lines()
            .filter(|l| l.contains("removed"))
            .collect::<Vec<_>>()
            .join("\n"),
        cluster.log_of("n1")
    );

    // Restoring a snapshot that names n5 is refused by name.
    let id = before.plan.as_ref().unwrap().snapshot_id;
    let err = client
        .restore_snapshot(pb::RestoreSnapshotRequest {
            snapshot_id: id,
            if_epoch: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("n5"), "{err:?}");

    // Under load again, n6 joins.
    cluster.set_workload(200.0).await.unwrap();
    cluster.bank_workload = 200.0;
    let joined_at = now_ms();
    cluster.add_node(true, &[]).unwrap(); // n6
    total += cluster.initial_balance;
    let grown = spanning(&cluster, &["n1", "n2", "n3", "n4", "n6"], joined_at).await;
    assert_completed(&grown, total);

    // n4 and n6 removed at once.
    cluster.set_workload(0.0).await.unwrap();
    cluster.bank_workload = 0.0;
    let held = settled(&cluster, &[0, 1, 2, 3, 5], total).await;
    cluster.kill_node(3);
    cluster.kill_node(5);
    down(&cluster, "n4").await;
    down(&cluster, "n6").await;
    let removed_at = now_ms();
    client.remove_node(remove("n4")).await.unwrap();
    client.remove_node(remove("n6")).await.unwrap();
    total -= held["n4"] + held["n6"];
    let shrunk = spanning(&cluster, &["n1", "n2", "n3"], removed_at).await;
    assert_completed(&shrunk, total);

    // A removed node that comes back registers as a new member (its bank starts afresh).
    let back_at = now_ms();
    cluster.start_node(3).unwrap();
    total += cluster.initial_balance;
    let rejoined = spanning(&cluster, &["n1", "n2", "n3", "n4"], back_at).await;
    assert_completed(&rejoined, total);
    let log = cluster.log_of("coordinator");
    assert_eq!(
        log.matches("node n4 joined").count(),
        2,
        "joined again, as new"
    );
}

/// `cairn_node_removed_peer_messages_total` in a daemon's metrics.
fn metric(text: &str) -> f64 {
    cairn_integration_tests::tls_support::metric(
        text,
        "cairn_node_removed_peer_messages_total",
        None,
    )
}

/// Waits until the coordinator reports `node` not connected.
async fn down(cluster: &CoordinatedCluster, node: &str) {
    eventually(&format!("{node} down"), Duration::from_secs(20), || async {
        let listed = nodes(cluster).await;
        anyhow::ensure!(
            listed
                .nodes
                .iter()
                .any(|n| n.node_id == node && !n.connected),
            "{listed:?}"
        );
        Ok(())
    })
    .await
    .unwrap();
}

/// Waits until node 0's readiness (`cairn.v1.Wired`, the Kubernetes probe's) is `serving`.
async fn wired(cluster: &CoordinatedCluster, serving: bool) {
    let address = cluster.nodes[0].peer.clone();
    let want = if serving {
        Serving::Serving
    } else {
        Serving::NotServing
    } as i32;
    eventually(
        if serving { "n1 ready" } else { "n1 not ready" },
        Duration::from_secs(20),
        || async {
            let status = health_of(&address, "cairn.v1.Wired", None).await?;
            anyhow::ensure!(status == want, "status {status}");
            Ok(())
        },
    )
    .await
    .unwrap();
}

/// A daemon stopped (SIGTERM) with `--leave-on-shutdown` drains and leaves: the coordinator
/// removes it and snapshots go on without it. One stopped without it — a restart, a rolling
/// update — stays a member: snapshots are refused naming it until it is back, and then
/// complete over every node again. Readiness: registered, and connected to every peer the
/// coordinator does not report down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leave_on_shutdown_removes_the_node_and_a_plain_stop_keeps_it() {
    let mut cluster =
        CoordinatedCluster::start(2, Store::Embedded, &[], &["--schedule-interval", "200ms"])
            .await
            .unwrap();
    let leaving = cluster.add_node(true, &["--leave-on-shutdown"]).unwrap(); // n3
    cluster.wait_registered(3).await.unwrap();
    spanning(&cluster, &["n1", "n2", "n3"], 0).await;
    wired(&cluster, true).await;

    // A plain stop: n2 stays a member; snapshots are refused naming it. n1 stays ready (a
    // peer reported down is not waited for).
    let status = cluster.stop_node(1).unwrap();
    assert!(status.success(), "n2 exited with {status:?}");
    down(&cluster, "n2").await;
    let err = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("n2"), "{err}");
    wired(&cluster, true).await;
    let back = now_ms();
    cluster.start_node(1).unwrap();
    spanning(&cluster, &["n1", "n2", "n3"], back).await;

    // Without its coordinator a daemon is not ready; with it back, it is.
    cluster.kill_coordinator();
    wired(&cluster, false).await;
    cluster.start_coordinator().unwrap();
    cluster.wait_registered(3).await.unwrap();
    wired(&cluster, true).await;

    // With --leave-on-shutdown: n3 drains, leaves, and snapshots go on without it.
    let left_at = now_ms();
    let status = cluster.stop_node(leaving).unwrap();
    assert!(status.success(), "n3 exited with {status:?}");
    let log = cluster.log_of("n3");
    assert!(log.contains("left the cluster"), "{log}");
    let listed = nodes(&cluster).await;
    let ids: Vec<&str> = listed.nodes.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(ids, ["n1", "n2"]);
    spanning(&cluster, &["n1", "n2"], left_at).await;
}

/// `--remove-after`: a daemon silent (SIGSTOP) past the member silence and then the bound is
/// removed, no sooner; when it wakes, that same process may not register again (its peers
/// dropped their channels to it): refused by name, while snapshots go on without it. A new
/// process for the id (a restart) joins as a new member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_down_past_remove_after_is_removed_and_may_not_return_as_it_was() {
    let mut cluster = CoordinatedCluster::start(
        3,
        Store::Embedded,
        &[],
        &["--schedule-interval", "200ms", "--remove-after", "10s"],
    )
    .await
    .unwrap();
    spanning(&cluster, &["n1", "n2", "n3"], 0).await;
    let pid = cluster.node_pid(2).unwrap();
    let stopped = now_ms();
    cairn_integration_tests::processes::signal_pid(pid, "-STOP");
    let removed = eventually("n3 removed", Duration::from_secs(60), || async {
        let listed = nodes(&cluster).await;
        anyhow::ensure!(
            listed.nodes.iter().all(|n| n.node_id != "n3"),
            "still {:?}",
            listed.nodes.iter().map(|n| &n.node_id).collect::<Vec<_>>()
        );
        Ok(now_ms())
    })
    .await;
    cairn_integration_tests::processes::signal_pid(pid, "-CONT");
    let removed = removed.unwrap();
    assert!(
        removed - stopped >= 10_000,
        "removed {} ms after it went silent",
        removed - stopped
    );
    spanning(&cluster, &["n1", "n2"], removed).await;
    eventually(
        "n3's daemon refused as removed",
        Duration::from_secs(30),
        || async {
            let log = cluster.log_of("n3");
            anyhow::ensure!(
                log.contains("node n3 was removed from the cluster while this daemon ran"),
                "not yet"
            );
            Ok(())
        },
    )
    .await
    .unwrap();
    assert!(
        nodes(&cluster)
            .await
            .nodes
            .iter()
            .all(|n| n.node_id != "n3")
    );
    // A restart: a new process joins as a new member.
    cluster.kill_node(2);
    let back = now_ms();
    cluster.start_node(2).unwrap();
    spanning(&cluster, &["n1", "n2", "n3"], back).await;
}

/// An application whose sends to a dead peer filled that channel is blocked in its session
/// (everything it sends waits behind the send that found no room); removing the peer frees
/// it: the waiting and queued messages for the removed peer are dropped and counted, and what
/// it sent to the others arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_peer_frees_an_application_blocked_on_its_full_channel() {
    use cairn_proto::bank::v1 as bank;
    let mut cluster =
        CoordinatedCluster::start_with(3, Store::Embedded, &[], &[], &["--channel-buffer", "4"])
            .await
            .unwrap();
    cluster.set_workload(0.0).await.unwrap();
    cluster.bank_workload = 0.0;
    let total = cluster.total();
    let start = settled(&cluster, &[0, 1, 2], total).await;
    let (held, n2) = (start["n3"], start["n2"]);
    cluster.kill_node(2);
    down(&cluster, "n3").await;
    let mut n1 = cluster.bank(0).await.unwrap();
    let transfer = |to: &str| bank::TransferRequest {
        to: to.into(),
        amount: 1,
        ..Default::default()
    };
    // Four fill the channel to n3, the fifth waits for room; the one to n2 waits behind it.
    for _ in 0..5 {
        n1.transfer(transfer("n3")).await.unwrap();
    }
    n1.transfer(transfer("n2")).await.unwrap();
    // n1 paid six; n2 got nothing yet.
    let before = settled(&cluster, &[0, 1], total - held - 6).await;
    assert_eq!(before["n2"], n2, "n2 got nothing yet: n1 is blocked");

    let mut client = cluster.client().await.unwrap();
    client
        .remove_node(pb::RemoveNodeRequest {
            node_id: "n3".into(),
        })
        .await
        .unwrap();
    let after = settled(&cluster, &[0, 1], total - held - 5).await;
    assert_eq!(after["n2"], n2 + 1, "the transfer to n2 arrived");
    let text = cluster.scrape(&cluster.nodes[0].metrics).await.unwrap();
    assert_eq!(metric(&text), 5.0, "the five to n3 dropped and counted");
}
