//! Membership owned by the coordinator: daemons start with only `--coordinator`, learn
//! their members and channels from it, and are wired in as members join; a join fails the
//! snapshots in flight (they were planned without the newcomer); a member that is down
//! stays in the topology and blocks new snapshots by name; `--topology` fixes the channels
//! and refuses nodes it does not name.

use std::time::Duration;

use cairn_integration_tests::coordinated::{
    CoordinatedCluster, Store, assert_completed, channel_fault,
};
use cairn_integration_tests::processes::{ChildGuard, binary, eventually, free_port};
use cairn_proto::v1 as pb;
use tonic::Code;

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
