//! In-process daemons: the peer channel survives cut connections, pushes back on a fast
//! sender, and refuses bad input with a clear status while serving everyone else.

use std::time::Duration;

use bytes::Bytes;
use cairn_core::NodeId;
use cairn_integration_tests::local::{LocalCluster, bind};
use cairn_integration_tests::proxy::CuttingProxy;
use cairn_rpc::v1 as pb;
use cairn_sdk::{AppEvent, AppSession};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

/// Receives `n` messages at `session`, checking each is the next number; `pause` slows
/// the application down after every ten messages.
async fn receive_numbers(
    mut session: AppSession,
    n: u64,
    pause: Option<Duration>,
) -> anyhow::Result<u64> {
    let mut next = 0u64;
    while next < n {
        match session.next_event().await? {
            Some(AppEvent::Message { payload, .. }) => {
                let got = u64::from_be_bytes(payload.as_ref().try_into()?);
                anyhow::ensure!(got == next, "expected message {next}, got {got}");
                next += 1;
                if let (Some(pause), true) = (pause, next.is_multiple_of(10)) {
                    tokio::time::sleep(pause).await;
                }
            }
            Some(other) => anyhow::bail!("unexpected event {other:?}"),
            None => anyhow::bail!("session ended after {next} messages"),
        }
    }
    Ok(next)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_arrives_once_and_in_order_while_connections_are_cut_again_and_again() {
    const N: u64 = 30_000;
    let bound = bind(&["a", "b"]).await.unwrap();
    let b_peer = bound.addresses[&NodeId::from("b")].0;
    let proxy = CuttingProxy::start(b_peer).await.unwrap();
    let proxy_addr = proxy.addr.to_string();
    let cluster = bound.start(|id, config| {
        if id.as_str() == "a" {
            config.peers.insert("b".into(), proxy_addr.clone());
            config.reconnect_initial = Duration::from_millis(5);
            config.reconnect_max = Duration::from_millis(50);
        }
    });
    let a = AppSession::connect(&cluster.nodes[&NodeId::from("a")].app.to_string(), "sender")
        .await
        .unwrap();
    let b = AppSession::connect(
        &cluster.nodes[&NodeId::from("b")].app.to_string(),
        "receiver",
    )
    .await
    .unwrap();
    let receiver = tokio::spawn(receive_numbers(b, N, None));
    let sender = a.sender();
    // The sender sends in four quarters and starts quarter k only after k cuts: on a fast
    // machine the whole transfer could otherwise end between two cuts.
    let (cut_tx, mut cut_rx) = tokio::sync::watch::channel(0usize);
    let sending = tokio::spawn(async move {
        for i in 0..N {
            let quarter = (i / (N / 4)) as usize;
            if i % (N / 4) == 0 && quarter > 0 {
                cut_rx.wait_for(|cuts| *cuts >= quarter).await?;
            }
            sender
                .send("b", Bytes::copy_from_slice(&i.to_be_bytes()))
                .await?;
        }
        anyhow::Ok(())
    });
    let mut cuts = 0;
    while !receiver.is_finished() {
        tokio::time::sleep(Duration::from_millis(15)).await;
        cuts += proxy.cut();
        cut_tx.send_replace(cuts);
    }
    sending.await.unwrap().unwrap();
    assert_eq!(receiver.await.unwrap().unwrap(), N);
    assert!(
        cuts >= 3,
        "only {cuts} connections were cut: the test did not test reconnection"
    );
    let status = cluster.status("a").await.unwrap();
    let reconnects: u64 = status.channels.iter().map(|c| c.reconnects).sum();
    // A cut may hit a connection still in its handshake; at least one must have been a
    // live channel that came back.
    assert!(reconnects >= 1, "a never reconnected after {cuts} cuts");
    cluster.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_slows_the_sender_and_memory_stays_bounded() {
    const N: u64 = 40_000;
    const BUFFER: usize = 256;
    let cluster = bind(&["a", "b"])
        .await
        .unwrap()
        .start(|_, config| config.channel_buffer = BUFFER);
    let a = AppSession::connect(&cluster.nodes[&NodeId::from("a")].app.to_string(), "fast")
        .await
        .unwrap();
    let b = AppSession::connect(&cluster.nodes[&NodeId::from("b")].app.to_string(), "slow")
        .await
        .unwrap();
    let (progress_tx, mut progress) = mpsc::unbounded_channel::<u64>();
    let receiver = tokio::spawn(async move {
        // Receive slowly: about 10 messages per millisecond.
        let mut session = b;
        let mut next = 0u64;
        while next < N {
            let Some(AppEvent::Message { payload, .. }) = session.next_event().await? else {
                anyhow::bail!("session ended");
            };
            anyhow::ensure!(
                u64::from_be_bytes(payload[..8].try_into()?) == next,
                "out of order at {next}"
            );
            next += 1;
            if next.is_multiple_of(10) {
                let _ = progress_tx.send(next);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        anyhow::Ok(next)
    });
    let sender = a.sender();
    let mut peak_out = 0;
    let mut peak_inbox = 0;
    let mut received = 0;
    for i in 0..N {
        let mut payload = vec![0u8; 128];
        payload[..8].copy_from_slice(&i.to_be_bytes());
        sender.send("b", Bytes::from(payload)).await.unwrap();
        if i.is_multiple_of(2000) {
            let a_status = cluster.status("a").await.unwrap();
            let b_status = cluster.status("b").await.unwrap();
            peak_out = peak_out.max(
                a_status
                    .channels
                    .iter()
                    .map(|c| c.unacked_frames)
                    .max()
                    .unwrap_or(0),
            );
            peak_inbox = peak_inbox.max(b_status.inbox_depth);
        }
    }
    while let Ok(n) = progress.try_recv() {
        received = n;
    }
    // The sender finished: it can only have been this far ahead of the receiver if the
    // daemons pushed back, so it was slowed to the receiver's pace.
    assert!(
        received >= N / 2,
        "the sender finished when the receiver had only {received} of {N}: nothing pushed back"
    );
    assert!(
        peak_out <= BUFFER as u64,
        "a held {peak_out} frames for b, more than its buffer of {BUFFER}"
    );
    assert!(
        peak_inbox <= BUFFER as u64,
        "b's inbox held {peak_inbox}, more than its buffer of {BUFFER}"
    );
    assert_eq!(
        receiver.await.unwrap().unwrap(),
        N,
        "nothing may be dropped"
    );
    cluster.stop().await.unwrap();
}

/// Opens a raw peer stream to `node` and sends `frames`; returns the status that ends it.
async fn peer_stream_status(
    cluster: &LocalCluster,
    node: &str,
    frames: Vec<pb::PeerFrame>,
) -> Code {
    let addr = cluster.nodes[&NodeId::from(node)].peer;
    let mut client = pb::peer_client::PeerClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel(16);
    for frame in frames {
        tx.send(frame).await.unwrap();
    }
    let mut acks = match client.channel(ReceiverStream::new(rx)).await {
        Ok(response) => response.into_inner(),
        Err(status) => return status.code(),
    };
    loop {
        match tokio::time::timeout(Duration::from_secs(5), acks.message()).await {
            Ok(Ok(Some(_))) => continue,
            Ok(Ok(None)) => return Code::Ok,
            Ok(Err(status)) => return status.code(),
            Err(_) => return Code::DeadlineExceeded,
        }
    }
}

fn handshake(cluster: &str, from: &str, to: &str) -> pb::PeerFrame {
    pb::PeerFrame {
        kind: Some(pb::peer_frame::Kind::Handshake(pb::Handshake {
            cluster: cluster.into(),
            from: from.into(),
            to: to.into(),
            incarnation: 7,
            epoch: 0,
        })),
    }
}

fn batch(first_seq: u64, frames: Vec<pb::frame::Kind>) -> pb::PeerFrame {
    pb::PeerFrame {
        kind: Some(pb::peer_frame::Kind::Batch(pb::FrameBatch {
            first_seq,
            frames: frames
                .into_iter()
                .map(|k| pb::Frame { kind: Some(k) })
                .collect(),
            epoch: 0,
        })),
    }
}

fn data(payloads: &[&[u8]]) -> pb::frame::Kind {
    pb::frame::Kind::Data(pb::DataRun {
        payloads: Bytes::from(payloads.concat()),
        lengths: payloads.iter().map(|p| p.len() as u32).collect(),
    })
}

fn marker(mode: i32) -> pb::frame::Kind {
    pb::frame::Kind::Marker(pb::Marker {
        plan: Some(pb::SnapshotPlan {
            snapshot_id: 1,
            mode,
            initiators: vec!["a".into()],
            alignment_timeout_ms: 0,
            epoch: 0,
            alignment_timed_out: false,
            started_at_ms: 0,
        }),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_status_and_closes_only_its_own_stream() {
    // Node b alone; the test plays peer a with raw frames.
    let bound = bind(&["a", "b"]).await.unwrap();
    let mut cluster = bound.start(|_, config| config.max_payload = 1024);
    drop(cluster.nodes.remove(&NodeId::from("a")));
    let b_app = cluster.nodes[&NodeId::from("b")].app.to_string();
    let mut b = AppSession::connect(&b_app, "bank").await.unwrap();

    let cases: Vec<(&str, Vec<pb::PeerFrame>, Code)> = vec![
        (
            "wrong cluster",
            vec![handshake("other", "a", "b")],
            Code::FailedPrecondition,
        ),
        (
            "unknown node",
            vec![handshake("test", "zz", "b")],
            Code::NotFound,
        ),
        (
            "wrong receiver",
            vec![handshake("test", "a", "c")],
            Code::NotFound,
        ),
        (
            "no handshake",
            vec![batch(1, vec![data(&[b"x"])])],
            Code::InvalidArgument,
        ),
        (
            "malformed data run",
            vec![
                handshake("test", "a", "b"),
                batch(
                    1,
                    vec![pb::frame::Kind::Data(pb::DataRun {
                        payloads: Bytes::from_static(b"abc"),
                        lengths: vec![2, 5],
                    })],
                ),
            ],
            Code::InvalidArgument,
        ),
        (
            "frame out of sequence",
            vec![handshake("test", "a", "b"), batch(5, vec![data(&[b"x"])])],
            Code::OutOfRange,
        ),
        (
            "oversize payload",
            vec![
                handshake("test", "a", "b"),
                batch(1, vec![data(&[&[0u8; 2048]])]),
            ],
            Code::ResourceExhausted,
        ),
        (
            "marker in an unknown mode",
            vec![handshake("test", "a", "b"), batch(1, vec![marker(99)])],
            Code::InvalidArgument,
        ),
        (
            // 1 MiB of one-byte lengths of empty payloads: a million messages in one
            // batch, refused before any is built.
            "a batch of more frames than a peer can have unacknowledged",
            vec![
                handshake("test", "a", "b"),
                batch(
                    1,
                    vec![pb::frame::Kind::Data(pb::DataRun {
                        payloads: Bytes::new(),
                        lengths: vec![0; 1 << 20],
                    })],
                ),
            ],
            Code::InvalidArgument,
        ),
    ];
    for (what, frames, expected) in cases {
        let code = peer_stream_status(&cluster, "b", frames).await;
        assert_eq!(code, expected, "{what}");
    }

    // A second application session is refused; the first one keeps working.
    let second = AppSession::connect(&b_app, "intruder").await;
    match second {
        Err(cairn_sdk::Error::Rpc(status)) => assert_eq!(status.code(), Code::FailedPrecondition),
        Err(other) => panic!("second session: unexpected error {other}"),
        Ok(_) => panic!("a second application session was accepted"),
    }

    // b still serves a well-behaved peer, and its application gets the message.
    let addr = cluster.nodes[&NodeId::from("b")].peer;
    let mut client = pb::peer_client::PeerClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel(4);
    tx.send(handshake("test", "a", "b")).await.unwrap();
    let mut acks = client
        .channel(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let Some(pb::PeerAck {
        kind: Some(pb::peer_ack::Kind::Accepted(_)),
    }) = acks.message().await.unwrap()
    else {
        panic!("handshake not accepted")
    };
    tx.send(batch(1, vec![data(&[b"hello"])])).await.unwrap();
    let Some(pb::PeerAck {
        kind: Some(pb::peer_ack::Kind::Ack(ack)),
    }) = acks.message().await.unwrap()
    else {
        panic!("no ack")
    };
    assert_eq!(ack.seq, 1);
    match b.next_event().await.unwrap() {
        Some(AppEvent::Message { from, payload }) => {
            assert_eq!((from.as_str(), payload.as_ref()), ("a", b"hello".as_ref()));
        }
        other => panic!("unexpected {other:?}"),
    }

    // Sending to a node that is not a peer is refused before it reaches the daemon.
    assert!(matches!(
        b.sender().send("zz", Bytes::from_static(b"x")).await,
        Err(cairn_sdk::Error::UnknownPeer(_))
    ));
    drop(acks);
    cluster.stop().await.unwrap();
}

/// Answers every record request with a fixed state, ignoring messages.
async fn answer_snapshots(mut session: AppSession) {
    let sender = session.sender();
    while let Ok(Some(event)) = session.next_event().await {
        if let AppEvent::RecordState { snapshot_id } = event {
            let _ = sender.state_recorded(snapshot_id, Bytes::from_static(b"state"));
        }
    }
}

async fn initiate(cluster: &LocalCluster, node: &str, id: u64) {
    initiate_in(cluster, node, id, pb::SnapshotMode::ChandyLamport).await;
}

async fn initiate_in(cluster: &LocalCluster, node: &str, id: u64, mode: pb::SnapshotMode) {
    cluster
        .admin(node)
        .await
        .unwrap()
        .initiate_snapshot(pb::InitiateSnapshotRequest {
            snapshot_id: id,
            mode: mode as i32,
            alignment_timeout_ms: 0,
        })
        .await
        .unwrap();
}

/// A raw session's next in-band record request (other messages are skipped).
async fn next_record_request(session: &mut tonic::Streaming<pb::NodeToApp>) -> pb::RecordState {
    loop {
        match session
            .message()
            .await
            .unwrap()
            .expect("the session stays open")
            .kind
        {
            Some(pb::node_to_app::Kind::RecordState(r)) => return r,
            Some(_) => {}
            None => panic!("an empty message"),
        }
    }
}

/// A raw session answers `snapshot_id` with one chunk, naming its cut by `consumed`.
async fn answer_raw(to_node: &mpsc::Sender<pb::AppToNode>, snapshot_id: u64, consumed: u64) {
    let state = pb::app_to_node::Kind::StateRecorded(pb::StateRecorded {
        snapshot_id,
        chunk: Bytes::from_static(b"state"),
        last: true,
        consumed: Some(consumed),
    });
    to_node
        .send(pb::AppToNode { kind: Some(state) })
        .await
        .unwrap();
}

/// Waits until node `node`'s part of snapshot `id` is settled; returns the status code
/// and message (OK when the part is complete).
async fn part_outcome(cluster: &LocalCluster, node: &str, id: u64) -> (Code, String) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut admin = cluster.admin(node).await.unwrap();
        match admin
            .get_local_snapshot(pb::GetLocalSnapshotRequest { snapshot_id: id })
            .await
        {
            Ok(_) => return (Code::Ok, String::new()),
            Err(s) if s.code() == Code::NotFound && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(s) => return (s.code(), s.message().to_owned()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_reaching_a_node_without_an_application_fails_there_with_that_reason() {
    let cluster = bind(&["a", "b"]).await.unwrap().start(|_, _| {});
    let a = AppSession::connect(&cluster.nodes[&NodeId::from("a")].app.to_string(), "app")
        .await
        .unwrap();
    tokio::spawn(answer_snapshots(a));
    initiate(&cluster, "a", 1).await;
    let (code, message) = part_outcome(&cluster, "b", 1).await;
    assert_eq!(code, Code::FailedPrecondition, "{message}");
    assert!(
        message.contains("node b has no application attached"),
        "{message}"
    );
    cluster.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_restart_resets_the_channel_and_fails_the_snapshot_in_flight_naming_it() {
    let mut cluster = bind(&["a", "b"]).await.unwrap().start(|_, config| {
        config.reconnect_initial = Duration::from_millis(5);
        config.reconnect_max = Duration::from_millis(50);
    });
    let a = AppSession::connect(&cluster.nodes[&NodeId::from("a")].app.to_string(), "app")
        .await
        .unwrap();
    tokio::spawn(answer_snapshots(a));
    // b's application never answers: the snapshot stays in flight at a and b.
    let silent = AppSession::connect(&cluster.nodes[&NodeId::from("b")].app.to_string(), "silent")
        .await
        .unwrap();
    initiate(&cluster, "a", 1).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cluster
        .status("b")
        .await
        .unwrap()
        .snapshots_in_flight
        .contains(&1)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "snapshot 1 never reached b"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(silent);
    cluster.restart("b").await.unwrap();
    let (code, message) = part_outcome(&cluster, "a", 1).await;
    assert_eq!(code, Code::FailedPrecondition, "{message}");
    assert!(
        message.contains("channel a->b was reset") || message.contains("channel b->a was reset"),
        "{message}"
    );
    cluster.stop().await.unwrap();
}

/// A stalled application behind a full channel: the record request of an overtaking
/// snapshot waits behind nothing — not the inbox, nor frames stuck in the peer stream, nor
/// the delivery window already handed to the application (its early copy overtakes that,
/// and the messages handed over and not consumed are recorded) — the overtaken backlog is
/// recorded in order, and every message still arrives once and in order.
/// `alignment_timeout_ms` > 0: an aligned snapshot whose marker, queued behind the backlog
/// at the sender, overtakes it once the timeout passes there.
async fn record_request_waits_behind_nothing(mode: pb::SnapshotMode, alignment_ms: u64) {
    const N: u64 = 20_000;
    const BUFFER: usize = 4_096;
    // The daemon's delivery window before it has measured the application's pace
    // (`node_loop::flow::APP_INITIAL`).
    const INITIAL_WINDOW: u64 = 1_024;
    let cluster = bind(&["a", "b"])
        .await
        .unwrap()
        .start(|_, config| config.channel_buffer = BUFFER);
    let a = AppSession::connect(&cluster.nodes[&NodeId::from("a")].app.to_string(), "sender")
        .await
        .unwrap();
    let mut b = AppSession::connect(
        &cluster.nodes[&NodeId::from("b")].app.to_string(),
        "stalled",
    )
    .await
    .unwrap();
    let sender = a.sender();
    tokio::spawn(answer_snapshots(a));
    let flood = tokio::spawn(async move {
        for i in 0..N {
            sender
                .send("b", Bytes::copy_from_slice(&i.to_be_bytes()))
                .await?;
        }
        anyhow::Ok(())
    });
    // b's application reads nothing: the window goes to it, then b's inbox fills to the
    // credits granted (its buffer: no pace measured yet), and a's sends back up.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let inbox = loop {
        let inbox = cluster.status("b").await.unwrap().inbox_depth;
        assert!(
            inbox <= BUFFER as u64,
            "b's inbox holds {inbox}, over its buffer"
        );
        if inbox == BUFFER as u64 {
            break inbox;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "b's inbox never filled (at {inbox})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    cluster
        .admin("a")
        .await
        .unwrap()
        .initiate_snapshot(pb::InitiateSnapshotRequest {
            snapshot_id: 1,
            mode: mode as i32,
            alignment_timeout_ms: alignment_ms,
        })
        .await
        .unwrap();
    // The marker reaches b while its application still reads nothing: it overtook a's
    // queue (at once when unaligned, once the timeout passed at a when aligned), and b's
    // inbox, which can only drain through the application.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !cluster
        .status("b")
        .await
        .unwrap()
        .snapshots_in_flight
        .contains(&1)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the marker never reached b past the backlog"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Now b's application reads: the record request's early copy went out when the marker
    // came, on the session's other stream; the window the daemon had handed over (all of
    // it: the application read nothing) is behind it. The application is a slow one, 1 ms
    // of work a message until it records: the early copy is a message on another stream,
    // which comes while the window is worked through, never ahead of a reader that takes
    // the whole window in microseconds (CI saw that once).
    let mut next = 0u64;
    let mut before_record = None;
    while next < N {
        match b.next_event().await.unwrap() {
            Some(AppEvent::Message { payload, .. }) => {
                let got = u64::from_be_bytes(payload.as_ref().try_into().unwrap());
                assert_eq!(got, next, "out of order");
                next += 1;
                if before_record.is_none() {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            Some(AppEvent::RecordState { snapshot_id: 1 }) => {
                before_record = Some(next);
                b.sender()
                    .state_recorded(1, Bytes::from(next.to_be_bytes().to_vec()))
                    .unwrap();
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let before_record = before_record.expect("b was asked to record its state");
    assert!(
        before_record < INITIAL_WINDOW,
        "b's application consumed {before_record} messages before its record request: the \
         whole delivery window ({INITIAL_WINDOW}) it had been handed, which the request's \
         early copy should have overtaken"
    );
    flood.await.unwrap().unwrap();
    let (code, message) = part_outcome(&cluster, "b", 1).await;
    assert_eq!(code, Code::Ok, "{message}");
    let part = cluster
        .admin("b")
        .await
        .unwrap()
        .get_local_snapshot(pb::GetLocalSnapshotRequest { snapshot_id: 1 })
        .await
        .unwrap()
        .into_inner();
    let recorded: Vec<u64> = part
        .channel_states
        .iter()
        .flat_map(|c| &c.messages)
        .map(|m| u64::from_be_bytes(m.payload.as_ref().try_into().unwrap()))
        .collect();
    assert!(
        recorded.len() as u64 >= inbox + INITIAL_WINDOW - before_record,
        "b recorded {} messages; its inbox of {inbox} and the {} handed over and not \
         consumed were overtaken",
        recorded.len(),
        INITIAL_WINDOW - before_record
    );
    // In flight at the cut, in order: from the first the application had not consumed.
    let expected: Vec<u64> = (before_record..before_record + recorded.len() as u64).collect();
    assert!(
        recorded == expected,
        "b recorded {:?}…, not from {before_record} in order",
        &recorded[..recorded.len().min(8)]
    );
    cluster.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unaligned_record_request_overtakes_the_delivery_window() {
    record_request_waits_behind_nothing(pb::SnapshotMode::Unaligned, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aligned_marker_overtakes_the_senders_queue_once_its_timeout_passes() {
    record_request_waits_behind_nothing(pb::SnapshotMode::Aligned, 100).await;
}

/// The early copy of an overtaking record request reaches the application on its
/// `Consumed` stream, and the in-band copy says so; an application that names a cut it
/// cannot have taken (more messages consumed than it was handed before the request) fails
/// the snapshot there, naming the node, and the daemon goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_the_application_cannot_have_taken_fails_the_snapshot_naming_the_node() {
    let cluster = bind(&["a", "b"]).await.unwrap().start(|_, _| {});
    let a = AppSession::connect(&cluster.nodes[&NodeId::from("a")].app.to_string(), "app")
        .await
        .unwrap();
    tokio::spawn(answer_snapshots(a));
    let channel = tonic::transport::Endpoint::from_shared(format!(
        "http://{}",
        cluster.nodes[&NodeId::from("b")].app
    ))
    .unwrap()
    .connect()
    .await
    .unwrap();
    let mut client = pb::app_client::AppClient::new(channel);
    let (to_node, from_app) = mpsc::channel(4);
    let attach = pb::app_to_node::Kind::Attach(pb::Attach {
        application: "hostile".into(),
        packed_deliveries: true,
        acknowledges_deliveries: true,
        snapshot_outcomes_after: None,
    });
    to_node
        .send(pb::AppToNode { kind: Some(attach) })
        .await
        .unwrap();
    let mut session = client
        .session(ReceiverStream::new(from_app))
        .await
        .unwrap()
        .into_inner();
    let Some(pb::node_to_app::Kind::Attached(attached)) =
        session.message().await.unwrap().unwrap().kind
    else {
        panic!("expected Attached first");
    };
    let first = pb::Consumption {
        session: attached.session,
        messages: 0,
        bytes: 0,
        flow_key: attached.flow_key,
    };
    let (acks, acks_rx) = mpsc::channel(4);
    acks.send(first).await.unwrap();
    let mut taken = client
        .consumed(ReceiverStream::new(acks_rx))
        .await
        .unwrap()
        .into_inner();
    initiate_in(&cluster, "a", 1, pb::SnapshotMode::Unaligned).await;
    // The early copy, on the flow-control stream.
    let early = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let t = taken
                .message()
                .await
                .unwrap()
                .expect("the stream stays open");
            if !t.record_state.is_empty() {
                return t.record_state;
            }
        }
    })
    .await
    .expect("no early copy of the record request within 10 s");
    assert_eq!(early, vec![1]);
    // The in-band copy says an early one went ahead.
    let in_band = next_record_request(&mut session).await;
    assert_eq!((in_band.snapshot_id, in_band.early_copy), (1, true));
    // Nothing was handed over before it: a cut after 5 consumed cannot be.
    answer_raw(&to_node, 1, 5).await;
    let (code, message) = part_outcome(&cluster, "b", 1).await;
    assert_ne!(code, Code::Ok, "{message}");
    assert!(
        message.contains(
            "bad cut at node b: the application cut its state after 5 messages consumed, \
             but was asked after 0 handed over"
        ),
        "{message}"
    );
    // The daemon goes on: the session is open and a next snapshot completes.
    initiate_in(&cluster, "a", 2, pb::SnapshotMode::Unaligned).await;
    assert_eq!(next_record_request(&mut session).await.snapshot_id, 2);
    answer_raw(&to_node, 2, 0).await;
    let (code, message) = part_outcome(&cluster, "b", 2).await;
    assert_eq!(code, Code::Ok, "{message}");
    drop((to_node, acks));
    cluster.stop().await.unwrap();
}

/// Only the application holding a session may open its `Consumed` stream: another client
/// naming the session (ids are sequential) without the session's `flow_key` is refused, and
/// the session's own window goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_consumed_stream_needs_its_flow_key() {
    let cluster = bind(&["a", "b"]).await.unwrap().start(|_, _| {});
    let app = cluster.nodes[&NodeId::from("a")].app.to_string();
    let _session = AppSession::connect(&app, "real").await.unwrap();
    let guess = |session: u64, flow_key: u64| {
        let app = app.clone();
        async move {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{app}"))
                .unwrap()
                .connect()
                .await
                .unwrap();
            let first = pb::Consumption {
                session,
                messages: u64::MAX,
                bytes: u64::MAX,
                flow_key,
            };
            pb::app_client::AppClient::new(channel)
                .consumed(tokio_stream::iter([first]))
                .await
                .map(drop)
        }
    };
    for key in [0, 1, 12_345] {
        let refused = guess(1, key).await.expect_err("a guessed key");
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused}");
        assert!(refused.message().contains("flow_key"), "{refused}");
    }
    let unknown = guess(2, 1).await.expect_err("no session 2");
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown}");
    let window = cluster
        .status("a")
        .await
        .unwrap()
        .delivery_window
        .expect("attached");
    assert!(
        window.acknowledges,
        "the real session keeps its window: {window:?}"
    );
    assert_eq!(
        window.consumed, 0,
        "nothing acknowledged in its name: {window:?}"
    );
    cluster.stop().await.unwrap();
}

/// A stalled application never pays back what its peer read ahead of a full channel while
/// states were due: snapshot after snapshot the sender's queue to it grows to its buffer
/// plus the debt bound (65,536) and no further — each state lets a send window in on debt
/// until then — and past it a state due waits behind the sends (its part does not
/// complete while the peer stalls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_against_a_stalled_peer_grow_the_senders_queue_only_to_its_bound() {
    const BUFFER: u64 = 1_024;
    const DEBT_MAX: u64 = 1 << 16;
    let cluster = bind(&["a", "b"])
        .await
        .unwrap()
        .start(|_, config| config.channel_buffer = BUFFER as usize);
    let a = AppSession::connect(&cluster.nodes[&NodeId::from("a")].app.to_string(), "sender")
        .await
        .unwrap();
    // b's application attaches and reads nothing, ever.
    let _b = AppSession::connect(
        &cluster.nodes[&NodeId::from("b")].app.to_string(),
        "stalled",
    )
    .await
    .unwrap();
    let sender = a.sender();
    tokio::spawn(answer_snapshots(a));
    let flood = tokio::spawn(async move {
        loop {
            sender.send("b", Bytes::from_static(b"12345678")).await?;
        }
        #[allow(unreachable_code)]
        anyhow::Ok(())
    });
    let a_b = Some(pb::ChannelRef {
        from: "a".into(),
        to: "b".into(),
    });
    // Each state lets in at least the window's floor (256 sends): the window shrinks to
    // it while b holds a back, at a pace set by how fast the snapshots come.
    const SEND_FLOOR: u64 = 256;
    const MOST: u64 = DEBT_MAX / SEND_FLOOR + 8;
    let mut queued: u64 = 0;
    let mut id = 0;
    loop {
        id += 1;
        assert!(
            id <= MOST,
            "{MOST} snapshots and the read-ahead never reached its bound ({queued} queued)"
        );
        let before = queued;
        cluster
            .admin("a")
            .await
            .unwrap()
            .initiate_snapshot(pb::InitiateSnapshotRequest {
                snapshot_id: id,
                mode: pb::SnapshotMode::Unaligned as i32,
                alignment_timeout_ms: 0,
            })
            .await
            .unwrap();
        // a's part completes once its state is read, past what was read ahead.
        let (code, message) = part_outcome(&cluster, "a", id).await;
        let status = cluster.status("a").await.unwrap();
        let end = status.channels.iter().find(|c| c.channel == a_b).unwrap();
        queued = end.queued;
        assert!(
            queued <= BUFFER + DEBT_MAX,
            "after snapshot {id} a's queue to b holds {queued}, over its buffer ({BUFFER}) \
             plus the debt bound ({DEBT_MAX})"
        );
        match code {
            // Once the channel is full, a state gets through only past sends taken on debt.
            Code::Ok => assert!(
                queued > before || before < BUFFER,
                "snapshot {id}'s state got through and let no send in on debt \
                 ({queued} queued, {before} before it)"
            ),
            // The state waits behind sends the channel may no longer owe.
            Code::NotFound => break,
            other => panic!("a's part of snapshot {id}: {other:?} {message}"),
        }
    }
    assert!(
        queued >= DEBT_MAX,
        "the state stopped getting through with only {queued} queued (snapshot {id})"
    );
    assert!(
        id > 2,
        "several states got through on debt before the bound"
    );
    eprintln!("the state waited behind the bound at snapshot {id} ({queued} queued)");
    flood.abort();
    cluster.stop().await.unwrap();
}

/// A peer that holds a sender back shrinks the sender's application's send window to a
/// few hundred sends (about 20 ms of what its daemon takes, at least 256): that is what a
/// state it records waits behind, and what an unaligned snapshot records of them, where
/// the SDK's full window would be 8,192.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_peer_shrinks_the_senders_window_and_what_its_state_waits_behind() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    const BUFFER: u64 = 512;
    // What may be on its way: the window's floor, and one batch of slack in the reading.
    const OUT_MAX: u64 = 512;
    let cluster = bind(&["a", "b"])
        .await
        .unwrap()
        .start(|_, config| config.channel_buffer = BUFFER as usize);
    let a = AppSession::connect(&cluster.nodes[&NodeId::from("a")].app.to_string(), "sender")
        .await
        .unwrap();
    let mut b = AppSession::connect(&cluster.nodes[&NodeId::from("b")].app.to_string(), "slow")
        .await
        .unwrap();
    // b consumes about 10 messages a millisecond.
    let slow = tokio::spawn(async move {
        let mut n = 0u64;
        while let Ok(Some(event)) = b.next_event().await {
            if let AppEvent::Message { .. } = event {
                n += 1;
                if n.is_multiple_of(10) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    });
    let sender = a.sender();
    tokio::spawn(answer_snapshots(a));
    let sent = Arc::new(AtomicU64::new(0));
    let counted = sent.clone();
    let flood = tokio::spawn(async move {
        loop {
            sender.send("b", Bytes::from_static(b"12345678")).await?;
            counted.fetch_add(1, Relaxed);
        }
        #[allow(unreachable_code)]
        anyhow::Ok(())
    });
    let a_b = Some(pb::ChannelRef {
        from: "a".into(),
        to: "b".into(),
    });
    // Sends on their way: counted by the application, less those a's daemon took (read
    // first, so the difference can only overstate them).
    let mut small = 0;
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while small < 5 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sends on their way to a's daemon never stayed at or under {OUT_MAX} \
             (readings: {seen:?})"
        );
        let status = cluster.status("a").await.unwrap();
        let taken = status
            .channels
            .iter()
            .find(|c| c.channel == a_b)
            .unwrap()
            .data_messages;
        let out = sent.load(Relaxed).saturating_sub(taken);
        seen.push(out);
        small = if out <= OUT_MAX && taken > 0 {
            small + 1
        } else {
            0
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // An unaligned snapshot now records a's queue and what it reads ahead to reach the
    // state: about the buffer and the window, not the buffer and 8,192.
    initiate_in(&cluster, "a", 1, pb::SnapshotMode::Unaligned).await;
    assert_eq!(part_outcome(&cluster, "a", 1).await.0, Code::Ok);
    let part = cluster
        .admin("a")
        .await
        .unwrap()
        .get_local_snapshot(pb::GetLocalSnapshotRequest { snapshot_id: 1 })
        .await
        .unwrap()
        .into_inner();
    let recorded: usize = part
        .channel_states
        .iter()
        .filter(|c| c.channel == a_b)
        .map(|c| c.messages.len())
        .sum();
    println!("a recorded {recorded} messages of a -> b; readings {seen:?}");
    assert!(
        recorded as u64 <= BUFFER + 2 * OUT_MAX,
        "a recorded {recorded} messages of a -> b, more than its buffer ({BUFFER}) and \
         twice the sends that may be on their way ({OUT_MAX})"
    );
    flood.abort();
    slow.abort();
    cluster.stop().await.unwrap();
}
