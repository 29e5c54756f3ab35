//! Fault injection through NodeAdmin: refused unless enabled; a held channel holds a
//! snapshot's marker back, and the snapshot completes once the channel is released, with
//! the held messages recorded in it; a cut connection resumes without loss; the held-channel
//! counters of `GetNodeStatus` move exactly, frame by frame.

use std::collections::BTreeMap;
use std::time::Duration;

use cairn_cli::bank::{self, BankConfig};
use cairn_core::{NodeId, Topology};
use cairn_integration_tests::coordinated::channel_fault;
use cairn_integration_tests::cut::check_bank_cut;
use cairn_integration_tests::local::{LocalCluster, bind};
use cairn_rpc::bank::v1 as bank_pb;
use cairn_rpc::v1 as pb;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::Code;

/// Starts a bank beside every node, making `rate` random transfers a second; returns
/// their addresses by node.
async fn start_banks(
    cluster: &LocalCluster,
    shutdown: &CancellationToken,
    rate: f64,
) -> BTreeMap<NodeId, String> {
    let mut addresses = BTreeMap::new();
    for (id, node) in &cluster.nodes {
        let config = BankConfig {
            node_address: node.app.to_string(),
            initial_balance: 1000,
            workload_rate: rate,
            max_amount: 10,
            connect_timeout: Duration::from_secs(10),
            tls: None,
            ledger: None,
            ledger_max_pending: cairn_sdk::sink::DEFAULT_MAX_PENDING,
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        addresses.insert(id.clone(), listener.local_addr().unwrap().to_string());
        tokio::spawn(bank::run(config, listener, shutdown.clone()));
    }
    for id in cluster.nodes.keys() {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !cluster
            .status(id.as_str())
            .await
            .unwrap()
            .application_attached
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "bank at {id} never attached"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    addresses
}

async fn part(
    cluster: &LocalCluster,
    node: &str,
    id: u64,
) -> Result<pb::LocalSnapshot, tonic::Status> {
    let mut admin = cluster.admin(node).await.unwrap();
    admin
        .get_local_snapshot(pb::GetLocalSnapshotRequest { snapshot_id: id })
        .await
        .map(|r| r.into_inner())
}

async fn wait_part(cluster: &LocalCluster, node: &str, id: u64) -> pb::LocalSnapshot {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match part(cluster, node, id).await {
            Ok(p) => return p,
            Err(s) if s.code() == Code::NotFound && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(s) => panic!("part of {node} in snapshot {id}: {s}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_injection_is_refused_unless_enabled() {
    let cluster = bind(&["a", "b"]).await.unwrap().start(|_, _| {});
    let mut admin = cluster.admin("b").await.unwrap();
    let err = admin
        .inject_fault(channel_fault(
            "a",
            "b",
            pb::inject_fault_request::Fault::Hold(pb::Hold {}),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err}");
    cluster.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_held_behind_a_held_channel_completes_its_snapshot_once_released() {
    use pb::inject_fault_request::Fault;
    let cluster = bind(&["a", "b", "c"])
        .await
        .unwrap()
        .start(|_, config| config.fault_injection = true);
    let shutdown = CancellationToken::new();
    let banks = start_banks(&cluster, &shutdown, 300.0).await;
    let mut b = cluster.admin("b").await.unwrap();

    // Faults only make sense at the right end of a channel.
    let err = b
        .inject_fault(channel_fault("b", "a", Fault::Hold(pb::Hold {})))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    let err = b
        .inject_fault(channel_fault(
            "a",
            "b",
            Fault::Delay(pb::Delay { millis: 5 }),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");

    b.inject_fault(channel_fault("a", "b", Fault::Hold(pb::Hold {})))
        .await
        .unwrap();
    let status = cluster.status("b").await.unwrap();
    let held = status.channels.iter().find(|c| {
        c.channel
            .as_ref()
            .is_some_and(|r| r.from == "a" && r.to == "b")
    });
    assert!(
        held.is_some_and(|c| c.held),
        "a->b is not reported held: {status:?}"
    );

    // A transfer a makes now precedes a's marker on a->b, and is held at b: it will be in
    // flight at the cut.
    let mut bank_a =
        bank_pb::bank_client::BankClient::connect(format!("http://{}", banks[&NodeId::from("a")]))
            .await
            .unwrap();
    bank_a
        .transfer(bank_pb::TransferRequest {
            to: "b".into(),
            amount: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut a = cluster.admin("a").await.unwrap();
    a.initiate_snapshot(pb::InitiateSnapshotRequest {
        snapshot_id: 1,
        mode: pb::SnapshotMode::ChandyLamport as i32,
        alignment_timeout_ms: 0,
    })
    .await
    .unwrap();
    // a and c finish; b cannot: a's marker is behind the held frames.
    wait_part(&cluster, "a", 1).await;
    wait_part(&cluster, "c", 1).await;
    assert_eq!(
        part(&cluster, "b", 1).await.unwrap_err().code(),
        Code::NotFound
    );
    // One frame through (a message: the marker follows the transfer), the rest still held.
    release(&mut b, 1).await;
    let status = cluster.status("b").await.unwrap();
    assert!(status.snapshots_in_flight.contains(&1), "{status:?}");

    b.inject_fault(channel_fault("a", "b", Fault::Resume(pb::Resume {})))
        .await
        .unwrap();
    let mut parts = BTreeMap::new();
    for node in ["a", "b", "c"] {
        parts.insert(NodeId::from(node), wait_part(&cluster, node, 1).await);
    }
    let cut = check_bank_cut(
        &Topology::full_mesh(["a", "b", "c"].map(NodeId::from)),
        &parts,
    )
    .unwrap();
    assert_eq!(
        cut.total(),
        3000,
        "balances {} + in flight {}",
        cut.balances,
        cut.in_flight
    );
    // The held messages were in flight at the cut: b recorded them on a->b.
    let held_recorded: usize = parts[&NodeId::from("b")]
        .channel_states
        .iter()
        .filter(|s| s.channel.as_ref().is_some_and(|r| r.from == "a"))
        .map(|s| s.messages.len())
        .sum();
    assert!(
        held_recorded > 0,
        "no held message was recorded as channel state of a->b"
    );

    // A cut connection comes back, and the next snapshot completes.
    a.inject_fault(channel_fault("a", "b", Fault::Cut(pb::Cut {})))
        .await
        .unwrap();
    a.inject_fault(channel_fault(
        "a",
        "c",
        Fault::Delay(pb::Delay { millis: 2 }),
    ))
    .await
    .unwrap();
    a.initiate_snapshot(pb::InitiateSnapshotRequest {
        snapshot_id: 2,
        mode: pb::SnapshotMode::Unaligned as i32,
        alignment_timeout_ms: 0,
    })
    .await
    .unwrap();
    let mut parts = BTreeMap::new();
    for node in ["a", "b", "c"] {
        parts.insert(NodeId::from(node), wait_part(&cluster, node, 2).await);
    }
    let cut = check_bank_cut(
        &Topology::full_mesh(["a", "b", "c"].map(NodeId::from)),
        &parts,
    )
    .unwrap();
    assert_eq!(cut.total(), 3000);
    shutdown.cancel();
    cluster.stop().await.unwrap();
}

/// Answers every record request; forwards the payloads delivered to `delivered`.
async fn app(
    mut session: cairn_sdk::AppSession,
    delivered: tokio::sync::mpsc::UnboundedSender<bytes::Bytes>,
) {
    let sender = session.sender();
    while let Ok(Some(event)) = session.next_event().await {
        match event {
            cairn_sdk::AppEvent::RecordState { snapshot_id } => {
                let _ = sender.state_recorded(snapshot_id, bytes::Bytes::from_static(b"s"));
            }
            cairn_sdk::AppEvent::Message { payload, .. } => {
                let _ = delivered.send(payload);
            }
            _ => {}
        }
    }
}

/// Channel `from -> to`'s entry in `node`'s status.
async fn channel_status(
    cluster: &LocalCluster,
    node: &str,
    from: &str,
    to: &str,
) -> pb::ChannelStatus {
    let status = cluster.status(node).await.unwrap();
    status
        .channels
        .into_iter()
        .find(|c| {
            c.channel
                .as_ref()
                .is_some_and(|r| r.from == from && r.to == to)
        })
        .unwrap_or_else(|| panic!("{node} has no channel {from}->{to}"))
}

/// Polls `node`'s status of channel `from -> to` (every 10 ms, up to 10 s) until `ready`
/// holds; returns that status. `what` names the awaited state in the failure.
async fn channel_until(
    cluster: &LocalCluster,
    (node, from, to): (&str, &str, &str),
    what: &str,
    ready: impl Fn(&pb::ChannelStatus) -> bool,
) -> pb::ChannelStatus {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = channel_status(cluster, node, from, to).await;
        if ready(&s) {
            return s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{from}->{to} at {node}: never {what}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A daemon's NodeAdmin client.
type NodeAdmin = pb::node_admin_client::NodeAdminClient<tonic::transport::Channel>;

/// Lets `frames` more frames of the held channel `a -> b` through at b.
async fn release(b: &mut NodeAdmin, frames: u64) {
    b.inject_fault(channel_fault(
        "a",
        "b",
        pb::inject_fault_request::Fault::Release(pb::Release { frames }),
    ))
    .await
    .unwrap();
}

/// The held-channel counters of `GetNodeStatus` move exactly with each frame: a fault hold
/// and an aligned snapshot's block are told apart, held frames are counted with the kind of
/// the next one, the release budget goes down frame by frame, markers are counted at both
/// ends — and `InjectFault` answers once the fault is in force (each status below is read
/// right after it, without waiting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_channel_counters_move_exactly_frame_by_frame() {
    use pb::inject_fault_request::Fault;
    let cluster = bind(&["a", "b", "c"])
        .await
        .unwrap()
        .start(|_, config| config.fault_injection = true);
    let (delivered_tx, mut delivered) = tokio::sync::mpsc::unbounded_channel();
    let mut senders = BTreeMap::new();
    for (id, node) in &cluster.nodes {
        let session = cairn_sdk::AppSession::connect(&node.app.to_string(), "counters")
            .await
            .unwrap();
        senders.insert(id.to_string(), session.sender());
        // Only b's deliveries matter here.
        let (tx, _) = tokio::sync::mpsc::unbounded_channel();
        let tx = if id.as_str() == "b" {
            delivered_tx.clone()
        } else {
            tx
        };
        tokio::spawn(app(session, tx));
    }
    let mut b = cluster.admin("b").await.unwrap();

    b.inject_fault(channel_fault("a", "b", Fault::Hold(pb::Hold {})))
        .await
        .unwrap();
    let s = channel_status(&cluster, "b", "a", "b").await;
    assert!(s.held && s.fault_held && !s.alignment_blocked, "{s:?}");
    assert_eq!((s.queued, s.release_budget, s.markers), (0, 0, 0), "{s:?}");
    assert_eq!(s.next_held, pb::FrameKind::None as i32);

    // Three messages, then a's marker of a Chandy–Lamport snapshot: four held frames.
    for m in ["m0", "m1", "m2"] {
        senders["a"]
            .send("b", bytes::Bytes::from_static(m.as_bytes()))
            .await
            .unwrap();
    }
    let s = channel_until(&cluster, ("b", "a", "b"), "holding 3 frames", |s| {
        s.queued == 3
    })
    .await;
    assert_eq!(s.next_held, pb::FrameKind::Data as i32);
    let mut a = cluster.admin("a").await.unwrap();
    a.initiate_snapshot(pb::InitiateSnapshotRequest {
        snapshot_id: 1,
        mode: pb::SnapshotMode::ChandyLamport as i32,
        alignment_timeout_ms: 0,
    })
    .await
    .unwrap();
    channel_until(&cluster, ("b", "a", "b"), "holding 4 frames", |s| {
        s.queued == 4
    })
    .await;
    assert_eq!(
        channel_status(&cluster, "a", "a", "b").await.markers,
        1,
        "a put its marker on the wire"
    );

    // Frame by frame.
    release(&mut b, 1).await;
    let s = channel_status(&cluster, "b", "a", "b").await;
    assert_eq!((s.queued, s.release_budget, s.markers), (3, 0, 0), "{s:?}");
    assert_eq!(s.next_held, pb::FrameKind::Data as i32);
    release(&mut b, 2).await;
    let s = channel_status(&cluster, "b", "a", "b").await;
    assert_eq!((s.queued, s.release_budget, s.markers), (1, 0, 0), "{s:?}");
    assert_eq!(s.next_held, pb::FrameKind::Marker as i32);
    for want in ["m0", "m1", "m2"] {
        let got = tokio::time::timeout(Duration::from_secs(10), delivered.recv())
            .await
            .expect("a released message is delivered")
            .unwrap();
        assert_eq!(got, want.as_bytes());
    }
    // b joined the snapshot by c's marker, but its part waits for a's, still held.
    assert_eq!(
        part(&cluster, "b", 1).await.unwrap_err().code(),
        Code::NotFound,
        "the marker is still held"
    );
    release(&mut b, 1).await;
    let s = channel_status(&cluster, "b", "a", "b").await;
    assert_eq!((s.queued, s.release_budget, s.markers), (0, 0, 1), "{s:?}");
    assert_eq!(s.next_held, pb::FrameKind::None as i32);
    // A budget with nothing held to spend it on stays.
    release(&mut b, 5).await;
    assert_eq!(
        channel_status(&cluster, "b", "a", "b").await.release_budget,
        5
    );
    b.inject_fault(channel_fault("a", "b", Fault::Resume(pb::Resume {})))
        .await
        .unwrap();
    let s = channel_status(&cluster, "b", "a", "b").await;
    assert!(!s.held && !s.fault_held && !s.alignment_blocked, "{s:?}");
    assert_eq!(s.release_budget, 0);
    wait_part(&cluster, "b", 1).await;

    // An aligned snapshot from a, with b->c held by a fault at c. From a, b->c and a->c are
    // the channels c aligns on (c->b is b's feedback channel: b records on a's marker): a's
    // marker blocks a->c — the engine's hold — until b's, held behind the fault, comes in.
    let mut c = cluster.admin("c").await.unwrap();
    c.inject_fault(channel_fault("b", "c", Fault::Hold(pb::Hold {})))
        .await
        .unwrap();
    a.initiate_snapshot(pb::InitiateSnapshotRequest {
        snapshot_id: 2,
        mode: pb::SnapshotMode::Aligned as i32,
        alignment_timeout_ms: 0,
    })
    .await
    .unwrap();
    let blocked = channel_until(&cluster, ("c", "a", "c"), "blocked for alignment", |s| {
        s.alignment_blocked
    })
    .await;
    assert!(blocked.held && !blocked.fault_held, "{blocked:?}");
    assert_eq!(blocked.markers, 2, "{blocked:?}");
    let held = channel_until(&cluster, ("c", "b", "c"), "holding b's marker next", |s| {
        s.next_held == pb::FrameKind::Marker as i32
    })
    .await;
    assert!(
        held.held && held.fault_held && !held.alignment_blocked,
        "{held:?}"
    );
    assert_eq!((held.queued, held.markers), (1, 1), "{held:?}");
    // `cairnctl nodes status` says the same, as JSON and as a table.
    let peer = cluster.nodes[&NodeId::from("c")].peer.to_string();
    let cairnctl = cairn_integration_tests::processes::cairnctl_ok;
    let json: serde_json::Value =
        serde_json::from_str(&cairnctl(&["-o", "json", "nodes", "status", &peer])).unwrap();
    // The protobuf JSON mapping (NodeStatus): uint64s as strings, false and 0 left out.
    assert_eq!(json["nodeId"], "c");
    assert!(
        json["snapshotsInFlight"]
            .as_array()
            .unwrap()
            .contains(&"2".into()),
        "{json}"
    );
    let row = |from: &str| {
        json["channels"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["channel"]["from"] == from && c["channel"]["to"] == "c")
            .cloned()
            .unwrap_or_else(|| panic!("no {from}->c in {json}"))
    };
    let (bc, ac) = (row("b"), row("a"));
    let flag = |c: &serde_json::Value, name: &str| c[name].as_bool().unwrap_or(false);
    assert_eq!(
        (
            flag(&bc, "faultHeld"),
            flag(&bc, "alignmentBlocked"),
            bc["nextHeld"].as_str(),
            bc["queued"].as_str(),
            bc["markers"].as_str()
        ),
        (true, false, Some("FRAME_KIND_MARKER"), Some("1"), Some("1")),
        "{bc}"
    );
    assert_eq!(
        (flag(&ac, "alignmentBlocked"), flag(&ac, "faultHeld")),
        (true, false),
        "{ac}"
    );
    let table = cairnctl(&["nodes", "status", &peer]);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("b->c") && l.contains("fault") && l.contains("marker")),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("a->c") && l.contains("alignment")),
        "{table}"
    );
    c.inject_fault(channel_fault("b", "c", Fault::Resume(pb::Resume {})))
        .await
        .unwrap();
    let (ac, bc) = (
        channel_status(&cluster, "c", "a", "c").await,
        channel_status(&cluster, "c", "b", "c").await,
    );
    assert!(
        !ac.held && !ac.alignment_blocked,
        "aligned once b's marker came: {ac:?}"
    );
    assert!(!bc.held && bc.queued == 0 && bc.markers == 2, "{bc:?}");
    wait_part(&cluster, "c", 2).await;
    cluster.stop().await.unwrap();
}

/// The bank's `Transfer` with `wait_queued` answers once its daemon has queued the message:
/// the sender's channel counts it in a status read right after, every time; and while the
/// daemon cannot take it (the channel held at b, a's buffer full) the call waits — until
/// the channel resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_that_waits_is_queued_at_the_daemon_when_it_answers() {
    use pb::inject_fault_request::Fault;
    let cluster = bind(&["a", "b"]).await.unwrap().start(|_, config| {
        config.fault_injection = true;
        config.channel_buffer = 2;
    });
    let shutdown = CancellationToken::new();
    let banks = start_banks(&cluster, &shutdown, 0.0).await;
    let bank_a =
        bank_pb::bank_client::BankClient::connect(format!("http://{}", banks[&NodeId::from("a")]))
            .await
            .unwrap();
    let mut b = cluster.admin("b").await.unwrap();
    b.inject_fault(channel_fault("a", "b", Fault::Hold(pb::Hold {})))
        .await
        .unwrap();
    let mut answered = 0u64;
    let mut blocked = loop {
        let mut client = bank_a.clone();
        let mut call = tokio::spawn(async move {
            client
                .transfer(bank_pb::TransferRequest {
                    to: "b".into(),
                    amount: 1,
                    wait_queued: true,
                })
                .await
        });
        // A transfer the daemon can take answers within milliseconds; one it cannot take
        // does not answer at all.
        match tokio::time::timeout(Duration::from_secs(2), &mut call).await {
            Ok(result) => {
                result.unwrap().unwrap();
                answered += 1;
                let queued = channel_status(&cluster, "a", "a", "b").await.data_messages;
                assert_eq!(
                    queued, answered,
                    "transfer {answered} answered before it was queued"
                );
            }
            Err(_) => break call,
        }
        assert!(
            answered < 50,
            "a's daemon took {answered} transfers with a->b held and a buffer of 2"
        );
    };
    assert!(answered >= 1, "not even the first transfer was taken");
    assert_eq!(
        channel_status(&cluster, "a", "a", "b").await.data_messages,
        answered,
        "the waiting transfer is not queued yet"
    );
    b.inject_fault(channel_fault("a", "b", Fault::Resume(pb::Resume {})))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), &mut blocked)
        .await
        .expect("the waiting transfer answers once the channel resumes")
        .unwrap()
        .unwrap();
    assert_eq!(
        channel_status(&cluster, "a", "a", "b").await.data_messages,
        answered + 1
    );
    shutdown.cancel();
    cluster.stop().await.unwrap();
}
