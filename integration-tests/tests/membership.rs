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
        })
        .await
        .unwrap();
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
        .restore_snapshot(pb::RestoreSnapshotRequest { snapshot_id: id })
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

/// A daemon stopped (SIGTERM) with `--leave-on-shutdown` drains and leaves: the coordinator
/// removes it and snapshots go on without it. One stopped without it — a restart, a rolling
/// update — stays a member: snapshots are refused naming it until it is back, and then
/// complete over every node again. `--remove-after` removes a node down longer than that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leave_on_shutdown_removes_the_node_and_a_plain_stop_keeps_it() {
    let mut cluster = CoordinatedCluster::start(
        2,
        Store::Embedded,
        &[],
        &["--schedule-interval", "200ms", "--remove-after", "10s"],
    )
    .await
    .unwrap();
    let leaving = cluster.add_node(true, &["--leave-on-shutdown"]).unwrap(); // n3
    cluster.wait_registered(3).await.unwrap();
    spanning(&cluster, &["n1", "n2", "n3"], 0).await;
    // Readiness (`cairn.v1.Wired`, the Kubernetes probe's): registered and connected to
    // every peer it sends to.
    let n1 = cluster.nodes[0].peer.clone();
    let wired = |serving: bool| {
        let address = n1.clone();
        let want = if serving {
            Serving::Serving
        } else {
            Serving::NotServing
        } as i32;
        eventually(
            if serving { "n1 wired" } else { "n1 not wired" },
            Duration::from_secs(10),
            move || {
                let address = address.clone();
                async move {
                    let status = health_of(&address, "cairn.v1.Wired", None).await?;
                    anyhow::ensure!(status == want, "status {status}");
                    Ok(())
                }
            },
        )
    };
    wired(true).await.unwrap();

    // A plain stop: n2 stays a member; snapshots are refused naming it.
    let status = cluster.stop_node(1).unwrap();
    assert!(status.success(), "n2 exited with {status:?}");
    let err = eventually(
        "a start refused naming n2",
        Duration::from_secs(10),
        || async {
            match cluster
                .start_snapshot(pb::StartSnapshotRequest::default())
                .await
            {
                Ok(id) => anyhow::bail!("snapshot {id} started"),
                Err(e) => Ok(e),
            }
        },
    )
    .await
    .unwrap();
    assert!(err.to_string().contains("n2"), "{err}");
    let listed = nodes(&cluster).await;
    assert!(
        listed
            .nodes
            .iter()
            .any(|n| n.node_id == "n2" && !n.connected),
        "{listed:?}"
    );
    wired(false).await.unwrap();
    let back = now_ms();
    cluster.start_node(1).unwrap();
    spanning(&cluster, &["n1", "n2", "n3"], back).await;
    wired(true).await.unwrap();

    // With --leave-on-shutdown: n3 drains, leaves, and snapshots go on without it.
    let left_at = now_ms();
    let status = cluster.stop_node(leaving).unwrap();
    assert!(status.success(), "n3 exited with {status:?}");
    let log = cluster.log_of("n3");
    assert!(log.contains("left the cluster"), "{log}");
    let listed = nodes(&cluster).await;
    let ids: Vec<&str> = listed.nodes.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(ids, ["n1", "n2"]);
    let after = spanning(&cluster, &["n1", "n2"], left_at).await;
    assert_eq!(after.status, pb::SnapshotStatus::Completed as i32);

    // --remove-after: n2 killed stays a member for a while, then is removed.
    let killed = now_ms();
    cluster.kill_node(1);
    let removed = eventually("n2 removed after 10 s", Duration::from_secs(40), || async {
        let listed = nodes(&cluster).await;
        anyhow::ensure!(
            listed.nodes.iter().all(|n| n.node_id != "n2"),
            "still {:?}",
            listed.nodes.iter().map(|n| &n.node_id).collect::<Vec<_>>()
        );
        Ok(now_ms())
    })
    .await
    .unwrap();
    assert!(
        removed - killed >= 10_000,
        "removed {} ms after it went down",
        removed - killed
    );
    spanning(&cluster, &["n1"], removed).await;
}
