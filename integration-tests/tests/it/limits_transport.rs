//! Transport limits (issue 13, finding 8 and part of 9), against real processes: clients
//! that declare 64 MiB messages and stall do not grow a coordinator or a daemon (peak
//! resident memory, `VmHWM`), and each such stream is refused with RESOURCE_EXHAUSTED naming
//! the limit; a peer frame batch over the limit gets that status too; fault-injection delays
//! are bounded and undone by `delay 0` and `resume`; reflection lists only what each server
//! serves.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cairn_integration_tests::coordinated::channel_fault;
use cairn_integration_tests::processes::{ChildGuard, binary, eventually, free_port};
use cairn_rpc::v1 as pb;
use cairn_sdk::{AppEvent, AppSession};
use tonic::Code;

/// A temporary directory removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "cairn-limits-{name}-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("logs kept in {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

async fn channel(address: &str) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
        .connect()
        .await
}

async fn serving(address: &str) -> anyhow::Result<()> {
    eventually("the server serves", Duration::from_secs(30), || async {
        let mut client =
            tonic_health::pb::health_client::HealthClient::new(channel(address).await?);
        let status = client
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await?
            .into_inner()
            .status;
        anyhow::ensure!(status == 1, "health status {status}");
        Ok(())
    })
    .await
}

/// A coordinator on the embedded store, serving; its process and address.
async fn coordinator(dir: &Dir) -> (ChildGuard, String) {
    let address = format!("127.0.0.1:{}", free_port());
    let mut command = Command::new(binary("cairn-coordinator").unwrap());
    command.args(["--listen", &address, "--data-dir"]);
    command.arg(dir.0.join("coordinator"));
    let log = dir.0.join("coordinator.log");
    let process = ChildGuard::spawn("cairn-coordinator", command, &log).unwrap();
    serving(&address).await.unwrap();
    (process, address)
}

/// A daemon without a coordinator.
struct Daemon {
    process: ChildGuard,
    peer: String,
    app: String,
}

/// Daemons `ids` of one cluster without a coordinator (full mesh), each with `extra`
/// arguments; `absent` ids are members no process runs for.
async fn daemons(dir: &Dir, ids: &[&str], absent: &[&str], extra: &[&str]) -> Vec<Daemon> {
    let peers: Vec<(String, String)> = ids
        .iter()
        .chain(absent)
        .map(|id| (id.to_string(), format!("127.0.0.1:{}", free_port())))
        .collect();
    let list = peers
        .iter()
        .map(|(id, a)| format!("{id}={a}"))
        .collect::<Vec<_>>()
        .join(",");
    let mut out = Vec::new();
    for (id, peer) in peers.iter().take(ids.len()) {
        let app = format!("127.0.0.1:{}", free_port());
        let mut command = Command::new(binary("cairn-node").unwrap());
        command.args([
            "--node-id",
            id,
            "--peer",
            &list,
            "--peer-listen",
            peer,
            "--app-listen",
            &app,
        ]);
        command.args(extra);
        let log = dir.0.join(format!("{id}.log"));
        let process = ChildGuard::spawn("cairn-node", command, &log).unwrap();
        out.push(Daemon {
            process,
            peer: peer.clone(),
            app,
        });
    }
    for daemon in &out {
        serving(&daemon.peer).await.unwrap();
    }
    out
}

fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Bytes each stalled message declares.
const DECLARED: u32 = 64 << 20;
/// Bytes of it each stream sends before it stalls.
const SENT: usize = 8 << 20;
/// Streams per connection.
const STREAMS: usize = 8;
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

/// One stalled stream: kept open (never ended) while the test measures.
struct Stalled {
    _send: h2::SendStream<Bytes>,
    response: h2::client::ResponseFuture,
    sent: usize,
}

/// Sends a 64 MiB prefix and then up to `SENT` bytes, as flow control allows; stops early if
/// the server refuses the stream.
async fn feed(send: &mut h2::SendStream<Bytes>) -> usize {
    let mut prefix = vec![0u8];
    prefix.extend_from_slice(&DECLARED.to_be_bytes());
    if send.send_data(Bytes::from(prefix), false).is_err() {
        return 0;
    }
    let mut sent = 0;
    while sent < SENT {
        send.reserve_capacity(ZEROS.len().min(SENT - sent));
        match std::future::poll_fn(|cx| send.poll_capacity(cx)).await {
            Some(Ok(0)) => continue,
            Some(Ok(n)) => {
                let n = n.min(ZEROS.len()).min(SENT - sent);
                if send
                    .send_data(Bytes::from_static(&ZEROS[..n]), false)
                    .is_err()
                {
                    break;
                }
                sent += n;
            }
            _ => break, // refused or reset
        }
    }
    sent
}

/// One raw HTTP/2 connection to `address` with `STREAMS` calls of `path`, each declaring a
/// 64 MiB message and stalling after at most `SENT` bytes of it.
async fn stall(
    address: &str,
    path: &str,
) -> anyhow::Result<(h2::client::SendRequest<Bytes>, Vec<Stalled>)> {
    let tcp = tokio::net::TcpStream::connect(address).await?;
    let (client, connection) = h2::client::handshake(tcp).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut client = client.ready().await?;
    let mut feeding = tokio::task::JoinSet::new();
    for _ in 0..STREAMS {
        let request = http::Request::post(format!("http://{address}{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())?;
        client = client.ready().await?;
        let (response, mut send) = client.send_request(request, false)?;
        feeding.spawn(async move {
            let sent = tokio::time::timeout(Duration::from_secs(60), feed(&mut send))
                .await
                .unwrap_or(0);
            Stalled {
                _send: send,
                response,
                sent,
            }
        });
    }
    let streams = feeding.join_all().await;
    Ok((client, streams))
}

/// `grpc-message` decoded (percent-encoding).
fn grpc_message(headers: &http::HeaderMap) -> String {
    let raw = headers
        .get("grpc-message")
        .map(|v| v.to_str().unwrap_or_default().to_owned())
        .unwrap_or_default();
    let bytes = raw.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(b) = u8::from_str_radix(&raw[i + 1..i + 3], 16)
        {
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Every stalled stream was answered RESOURCE_EXHAUSTED naming the limit.
async fn assert_refused(streams: Vec<Stalled>, what: &str) {
    for stream in streams {
        let response = tokio::time::timeout(Duration::from_secs(10), stream.response)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{what}: a stream that declared 64 MiB (and sent {} bytes) is still waiting",
                    stream.sent
                )
            })
            .unwrap_or_else(|e| panic!("{what}: no answer: {e}"));
        let headers = response.headers();
        let code = headers
            .get("grpc-status")
            .map(|v| v.to_str().unwrap().to_owned());
        let message = grpc_message(headers);
        assert_eq!(
            code.as_deref(),
            Some("8"),
            "{what}: RESOURCE_EXHAUSTED expected: {message}"
        );
        assert!(
            message.contains("67108864 bytes") && message.contains("limit of"),
            "{what}: the status names the size and the limit: {message}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_declare_64_mib_and_stall_do_not_grow_the_coordinator_or_a_daemon() {
    let dir = Dir::new("stall");
    let (coordinator_process, coordinator) = coordinator(&dir).await;
    let nodes = daemons(&dir, &["n1"], &["n2"], &[]).await;
    let daemon = &nodes[0];
    let pids = [
        ("coordinator", coordinator_process.pid()),
        ("daemon", daemon.process.pid()),
    ];
    let before: Vec<u64> = pids.iter().map(|(_, p)| status_kib(*p, "VmRSS:")).collect();

    // Four connections to each server, eight streams each, 8 MiB sent of 64 MiB declared:
    // 256 MiB per server if it buffers what it is sent.
    let targets = [
        (coordinator.as_str(), "/cairn.v1.Coordinator/StartSnapshot"),
        (coordinator.as_str(), "/cairn.v1.Coordinator/StartSnapshot"),
        (
            coordinator.as_str(),
            "/cairn.v1.Coordinator/UploadSnapshotPart",
        ),
        (
            coordinator.as_str(),
            "/cairn.v1.Coordinator/UploadSnapshotPart",
        ),
        (daemon.peer.as_str(), "/cairn.v1.Peer/Channel"),
        (daemon.peer.as_str(), "/cairn.v1.Peer/Channel"),
        (daemon.peer.as_str(), "/cairn.v1.Peer/Channel"),
        (daemon.peer.as_str(), "/cairn.v1.NodeAdmin/InjectFault"),
    ];
    let mut connections = Vec::new();
    for (address, path) in targets {
        connections.push((path, stall(address, path).await.unwrap()));
    }

    // Both still answer ordinary calls meanwhile.
    let mut client =
        pb::coordinator_client::CoordinatorClient::connect(format!("http://{coordinator}"))
            .await
            .unwrap();
    client
        .list_nodes(pb::ListNodesRequest {})
        .await
        .expect("the coordinator answers");
    let mut admin =
        pb::node_admin_client::NodeAdminClient::connect(format!("http://{}", daemon.peer))
            .await
            .unwrap();
    admin
        .get_node_status(pb::GetNodeStatusRequest {})
        .await
        .expect("the daemon answers");

    let mut grown = Vec::new();
    for ((name, pid), before) in pids.iter().zip(&before) {
        let peak = status_kib(*pid, "VmHWM:");
        let growth_mib = peak.saturating_sub(*before) / 1024;
        eprintln!(
            "{name}: VmRSS {} MiB before, peak {} MiB with the stalled streams",
            before / 1024,
            peak / 1024
        );
        if growth_mib >= 100 {
            grown.push(format!("{name} grew by {growth_mib} MiB"));
        }
    }
    assert!(
        grown.is_empty(),
        "under stalled 64 MiB messages: {}",
        grown.join(", ")
    );
    for (path, (_client, streams)) in connections {
        assert_refused(streams, path).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_frame_batch_over_the_limit_gets_resource_exhausted_naming_it() {
    let dir = Dir::new("frame");
    // --max-payload 1 MiB: a batch may be 1 MiB + 2 MiB.
    let nodes = daemons(&dir, &["n1"], &["n2"], &["--max-payload", "1048576"]).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", nodes[0].peer))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = pb::peer_client::PeerClient::new(channel).max_encoding_message_size(64 << 20);
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::PeerFrame {
        kind: Some(pb::peer_frame::Kind::Handshake(pb::Handshake {
            cluster: "cairn".into(),
            from: "n2".into(),
            to: "n1".into(),
            incarnation: 1,
            epoch: 0,
        })),
    })
    .await
    .unwrap();
    let mut acks = client
        .channel(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("the handshake is accepted")
        .into_inner();
    let first = acks.message().await.unwrap().unwrap();
    assert!(
        matches!(first.kind, Some(pb::peer_ack::Kind::Accepted(_))),
        "{first:?}"
    );
    // Five messages of 1 MiB each: every one within --max-payload, the batch over the limit.
    let batch = pb::FrameBatch {
        first_seq: 1,
        frames: vec![pb::Frame {
            kind: Some(pb::frame::Kind::Data(pb::DataRun {
                payloads: Bytes::from(vec![7u8; 5 << 20]),
                lengths: vec![1 << 20; 5],
            })),
        }],
        epoch: 0,
    };
    tx.send(pb::PeerFrame {
        kind: Some(pb::peer_frame::Kind::Batch(batch)),
    })
    .await
    .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), acks.message())
        .await
        .expect("the daemon answers the batch");
    let status = match answer {
        Err(status) => status,
        Ok(other) => panic!("RESOURCE_EXHAUSTED expected, got {other:?}"),
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let limit = (1 << 20) + (2 << 20);
    assert!(
        status.message().contains("n2->n1")
            && status
                .message()
                .contains(&format!("limit of {limit} bytes")),
        "the status names the channel and the limit: {}",
        status.message()
    );
}

/// Sends one message `from` -> `to` and waits until `receiver` gets it; how long it took.
async fn round(sender: &AppSession, to: &str, receiver: &mut AppSession) -> Duration {
    let started = Instant::now();
    sender
        .sender()
        .send(to, Bytes::from_static(b"ping"))
        .await
        .unwrap();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(30), receiver.next_event())
            .await
            .expect("the message arrives")
            .unwrap()
            .expect("the session stays open");
        if let AppEvent::Message { .. } = event {
            return started.elapsed();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_delay_is_bounded_and_delay_0_or_resume_undo_it() {
    use pb::inject_fault_request::Fault;
    let dir = Dir::new("delay");
    let nodes = daemons(&dir, &["n1", "n2"], &[], &["--fault-injection"]).await;
    let a = AppSession::connect(&nodes[0].app, "test").await.unwrap();
    let mut b = AppSession::connect(&nodes[1].app, "test").await.unwrap();
    round(&a, "n2", &mut b).await;
    let mut admin =
        pb::node_admin_client::NodeAdminClient::connect(format!("http://{}", nodes[0].peer))
            .await
            .unwrap();
    let delay = |millis| channel_fault("n1", "n2", Fault::Delay(pb::Delay { millis }));

    for millis in [u64::MAX, 10_001] {
        let status = admin.inject_fault(delay(millis)).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains("at most 10000"),
            "the refusal names the bound: {}",
            status.message()
        );
    }
    // The bound itself is accepted; then undone before anything is sent.
    admin.inject_fault(delay(10_000)).await.unwrap();
    admin.inject_fault(delay(0)).await.unwrap();

    let undo: [(&str, pb::InjectFaultRequest); 2] = [
        (
            "resume",
            channel_fault("n1", "n2", Fault::Resume(pb::Resume {})),
        ),
        ("delay 0", delay(0)),
    ];
    for (name, request) in undo {
        admin.inject_fault(delay(1_000)).await.unwrap();
        let delayed = round(&a, "n2", &mut b).await;
        assert!(
            delayed >= Duration::from_millis(900),
            "a delay of 1 s holds a message ({delayed:?})"
        );
        admin.inject_fault(request).await.unwrap();
        let started = Instant::now();
        for _ in 0..5 {
            round(&a, "n2", &mut b).await;
        }
        let five = started.elapsed();
        assert!(
            five < Duration::from_millis(2_500),
            "after {name}, five messages in a row took {five:?} (1 s each if still delayed)"
        );
    }
}

/// The services a server lists through `grpc.reflection.v1`.
async fn listed(address: &str) -> BTreeSet<String> {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut client = ServerReflectionClient::new(channel(address).await.unwrap());
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    match answer.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("a list of services expected, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_on_each_server_lists_only_the_services_it_serves() {
    let dir = Dir::new("reflection");
    let (_coordinator_process, coordinator) = coordinator(&dir).await;
    let nodes = daemons(&dir, &["n1"], &[], &[]).await;
    let bank = format!("127.0.0.1:{}", free_port());
    let mut command = Command::new(binary("cairn-bank").unwrap());
    command.args(["--node", &nodes[0].app, "--listen", &bank]);
    let _bank_process = ChildGuard::spawn("cairn-bank", command, &dir.0.join("bank.log")).unwrap();
    serving(&bank).await.unwrap();

    let common = [
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    ];
    let expect = |own: &[&str]| -> BTreeSet<String> {
        common.iter().chain(own).map(|s| s.to_string()).collect()
    };
    assert_eq!(
        listed(&coordinator).await,
        expect(&["cairn.v1.Coordinator"])
    );
    assert_eq!(
        listed(&nodes[0].peer).await,
        expect(&["cairn.v1.Peer", "cairn.v1.NodeAdmin"])
    );
    assert_eq!(listed(&nodes[0].app).await, expect(&["cairn.v1.App"]));
    assert_eq!(listed(&bank).await, expect(&["cairn.bank.v1.Bank"]));
}
