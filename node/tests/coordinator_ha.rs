//! The daemon's link to replicated coordinators, against fake coordinators in-process: a
//! follower's `cairn-leader` hint is followed, a deposed leader's messages are refused, and
//! a stopped coordinator is left within seconds (HTTP/2 keep-alive).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cairn_core::NodeId;
use cairn_node::{Listeners, NodeConfig};
use cairn_rpc::v1 as pb;
use pb::coordinator_server::{Coordinator, CoordinatorServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

type Commands = mpsc::Sender<Result<pb::CoordinatorToNode, Status>>;

/// What a fake coordinator saw.
enum Seen {
    /// It refused a session, naming the leader.
    Refused(&'static str),
    /// It opened one: the test speaks for it, and learns when the daemon ends it.
    Session {
        name: &'static str,
        commands: Commands,
        ended: tokio::sync::oneshot::Receiver<()>,
    },
}

/// A coordinator replica: a follower (refuses sessions, naming `leader`) or the leader.
struct Fake {
    name: &'static str,
    leader: Option<String>,
    seen: mpsc::UnboundedSender<Seen>,
}

fn unimplemented<T>() -> Result<T, Status> {
    Err(Status::unimplemented("not in this fake"))
}

#[tonic::async_trait]
impl Coordinator for Fake {
    async fn start_snapshot(
        &self,
        _: Request<pb::StartSnapshotRequest>,
    ) -> Result<Response<pb::StartSnapshotResponse>, Status> {
        unimplemented()
    }
    async fn get_snapshot(
        &self,
        _: Request<pb::GetSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        unimplemented()
    }
    async fn list_snapshots(
        &self,
        _: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        unimplemented()
    }
    type WatchSnapshotStream = ReceiverStream<Result<pb::SnapshotProgress, Status>>;
    async fn watch_snapshot(
        &self,
        _: Request<pb::WatchSnapshotRequest>,
    ) -> Result<Response<Self::WatchSnapshotStream>, Status> {
        unimplemented()
    }
    async fn abort_snapshot(
        &self,
        _: Request<pb::AbortSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        unimplemented()
    }
    async fn delete_snapshot(
        &self,
        _: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        unimplemented()
    }
    async fn verify_snapshot(
        &self,
        _: Request<pb::VerifySnapshotRequest>,
    ) -> Result<Response<pb::VerifySnapshotResponse>, Status> {
        unimplemented()
    }
    async fn diff_snapshots(
        &self,
        _: Request<pb::DiffSnapshotsRequest>,
    ) -> Result<Response<pb::SnapshotDiff>, Status> {
        unimplemented()
    }
    async fn restore_snapshot(
        &self,
        _: Request<pb::RestoreSnapshotRequest>,
    ) -> Result<Response<pb::RestoreOperation>, Status> {
        unimplemented()
    }
    async fn get_restore(
        &self,
        _: Request<pb::GetRestoreRequest>,
    ) -> Result<Response<pb::RestoreOperation>, Status> {
        unimplemented()
    }
    async fn list_restores(
        &self,
        _: Request<pb::ListRestoresRequest>,
    ) -> Result<Response<pb::ListRestoresResponse>, Status> {
        unimplemented()
    }
    async fn list_nodes(
        &self,
        _: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        unimplemented()
    }
    async fn remove_node(
        &self,
        _: Request<pb::RemoveNodeRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        unimplemented()
    }
    async fn get_policy(
        &self,
        _: Request<pb::GetPolicyRequest>,
    ) -> Result<Response<pb::Policy>, Status> {
        unimplemented()
    }
    async fn set_policy(
        &self,
        _: Request<pb::SetPolicyRequest>,
    ) -> Result<Response<pb::Policy>, Status> {
        unimplemented()
    }
    async fn get_leadership(
        &self,
        _: Request<pb::GetLeadershipRequest>,
    ) -> Result<Response<pb::Leadership>, Status> {
        unimplemented()
    }
    type NodeSessionStream = ReceiverStream<Result<pb::CoordinatorToNode, Status>>;
    async fn node_session(
        &self,
        request: Request<Streaming<pb::NodeToCoordinator>>,
    ) -> Result<Response<Self::NodeSessionStream>, Status> {
        if let Some(leader) = &self.leader {
            let _ = self.seen.send(Seen::Refused(self.name));
            let mut status = Status::unavailable("this coordinator is not the leader");
            let value = leader.parse().expect("an ASCII address");
            status.metadata_mut().insert("cairn-leader", value);
            return Err(status);
        }
        let mut from_node = request.into_inner();
        let (commands, rx) = mpsc::channel(16);
        let (end, ended) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            while let Ok(Some(_)) = from_node.message().await {}
            let _ = end.send(());
        });
        let session = Seen::Session {
            name: self.name,
            commands,
            ended,
        };
        let _ = self.seen.send(session);
        Ok(Response::new(ReceiverStream::new(rx)))
    }
    async fn upload_snapshot_part(
        &self,
        _: Request<Streaming<pb::UploadChunk>>,
    ) -> Result<Response<pb::UploadSnapshotPartResponse>, Status> {
        unimplemented()
    }
    async fn has_chunks(
        &self,
        _: Request<pb::HasChunksRequest>,
    ) -> Result<Response<pb::HasChunksResponse>, Status> {
        unimplemented()
    }
    type ReadSnapshotDataStream = ReceiverStream<Result<pb::SnapshotData, Status>>;
    async fn read_snapshot_data(
        &self,
        _: Request<pb::ReadSnapshotDataRequest>,
    ) -> Result<Response<Self::ReadSnapshotDataStream>, Status> {
        unimplemented()
    }
    type FetchRestorePartStream = ReceiverStream<Result<pb::RestorePiece, Status>>;
    async fn fetch_restore_part(
        &self,
        _: Request<pb::FetchRestorePartRequest>,
    ) -> Result<Response<Self::FetchRestorePartStream>, Status> {
        unimplemented()
    }
}

async fn listener() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    (listener, address)
}

/// Serves a fake coordinator on `listener`.
fn serve(
    listener: TcpListener,
    name: &'static str,
    leader: Option<String>,
    seen: &mpsc::UnboundedSender<Seen>,
) {
    let fake = Fake {
        name,
        leader,
        seen: seen.clone(),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(CoordinatorServer::new(fake))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
}

/// A TCP proxy to `to` that can be frozen: it then forwards nothing either way and keeps
/// the connections open, as a coordinator stopped with SIGSTOP would.
async fn freezable_proxy(to: SocketAddr) -> (SocketAddr, watch::Sender<bool>) {
    let (listener, address) = listener().await;
    let (freeze, frozen) = watch::channel(false);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(to).await else {
                continue;
            };
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            tokio::spawn(pipe(client_read, server_write, frozen.clone()));
            tokio::spawn(pipe(server_read, client_write, frozen.clone()));
        }
    });
    (address, freeze)
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: watch::Receiver<bool>,
) {
    let mut buffer = vec![0; 64 << 10];
    loop {
        let read = tokio::select! {
            _ = frozen.wait_for(|f| *f) => None,
            n = from.read(&mut buffer) => Some(n),
        };
        let n = match read {
            // Frozen: hold both halves open, forwarding nothing, until the test ends.
            None => return std::future::pending().await,
            Some(Ok(0) | Err(_)) => return,
            Some(Ok(n)) => n,
        };
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

struct Daemon {
    advertise: String,
    metrics: SocketAddr,
    stop: CancellationToken,
}

/// Starts daemon n1 with `--coordinator` `coordinators`.
async fn daemon(coordinators: Vec<String>) -> Daemon {
    let (peer, advertise) = listener().await;
    let (app, _) = listener().await;
    let (metrics_listener, metrics) = listener().await;
    let mut config = NodeConfig::with_coordinator(
        NodeId::new("n1"),
        "test",
        coordinators[0].clone(),
        advertise.to_string(),
    );
    config.coordinators = coordinators;
    let listeners = Listeners {
        peer,
        app,
        metrics: Some(metrics_listener),
    };
    let stop = CancellationToken::new();
    tokio::spawn(cairn_node::run(config, listeners, stop.clone()));
    Daemon {
        advertise: advertise.to_string(),
        metrics,
        stop,
    }
}

impl Daemon {
    /// `Registered` of term `term`: n1 alone, epoch 0.
    fn registered(&self, term: u64) -> pb::CoordinatorToNode {
        let n1 = pb::NodeInfo {
            node_id: "n1".into(),
            address: self.advertise.clone(),
            incarnation: 1,
            connected: true,
            ..Default::default()
        };
        let membership = pb::Membership {
            nodes: vec![n1],
            channels: Vec::new(),
            epoch: 0,
            removed: Vec::new(),
        };
        pb::CoordinatorToNode {
            kind: Some(pb::coordinator_to_node::Kind::Registered(membership)),
            term,
        }
    }

    /// The `/metrics` text.
    async fn metrics(&self) -> String {
        let mut stream = TcpStream::connect(self.metrics).await.unwrap();
        let request = "GET /metrics HTTP/1.1\r\nHost: n1\r\nConnection: close\r\n\r\n";
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).await.unwrap();
        text
    }
}

async fn next(seen: &mut mpsc::UnboundedReceiver<Seen>, within: Duration) -> Seen {
    tokio::time::timeout(within, seen.recv())
        .await
        .expect("the daemon did not come in time")
        .expect("the fakes are gone")
}

/// The next session, at `name`.
async fn session(
    seen: &mut mpsc::UnboundedReceiver<Seen>,
    name: &str,
    within: Duration,
) -> (Commands, tokio::sync::oneshot::Receiver<()>) {
    loop {
        match next(seen, within).await {
            Seen::Refused(_) => continue,
            Seen::Session {
                name: at,
                commands,
                ended,
            } => {
                assert_eq!(at, name, "a session at the wrong coordinator");
                return (commands, ended);
            }
        }
    }
}

async fn ends(ended: tokio::sync::oneshot::Receiver<()>) {
    tokio::time::timeout(Duration::from_secs(5), ended)
        .await
        .expect("the daemon kept the session")
        .expect("the session's reader is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_names_the_leader_and_a_deposed_leader_is_refused() {
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let (leader_listener, leader) = listener().await;
    let (follower_listener, follower) = listener().await;
    serve(leader_listener, "leader", None, &seen_tx);
    serve(
        follower_listener,
        "follower",
        Some(leader.to_string()),
        &seen_tx,
    );
    // The leader is not on the list: only the follower's hint leads there.
    let daemon = daemon(vec![follower.to_string()]).await;
    assert!(matches!(
        next(&mut seen, Duration::from_secs(5)).await,
        Seen::Refused("follower")
    ));
    let start = Instant::now();
    let (commands, ended) = session(&mut seen, "leader", Duration::from_secs(2)).await;
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "the hint was not followed at once"
    );
    commands.send(Ok(daemon.registered(5))).await.unwrap();
    // A command of a lower term (the deposed leader's) ends the session.
    let stale = pb::CoordinatorToNode {
        kind: Some(pb::coordinator_to_node::Kind::Abort(
            pb::AbortSnapshotRequest {
                snapshot_id: 1,
                reason: "stale".into(),
            },
        )),
        term: 3,
    };
    commands.send(Ok(stale)).await.unwrap();
    ends(ended).await;
    // Back through the follower; a Registered of a lower term is refused as well.
    let (commands, ended) = session(&mut seen, "leader", Duration::from_secs(5)).await;
    commands.send(Ok(daemon.registered(4))).await.unwrap();
    ends(ended).await;
    // The same term again is fine, and so is a higher one.
    let (commands, ended) = session(&mut seen, "leader", Duration::from_secs(5)).await;
    commands.send(Ok(daemon.registered(5))).await.unwrap();
    let Some(pb::coordinator_to_node::Kind::Registered(members)) = daemon.registered(6).kind else {
        unreachable!()
    };
    let membership = pb::CoordinatorToNode {
        kind: Some(pb::coordinator_to_node::Kind::Membership(members)),
        term: 6,
    };
    commands.send(Ok(membership)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let metrics = daemon.metrics().await;
    for line in [
        "cairn_node_stale_term_refused_total{what=\"abort\"} 1",
        "cairn_node_stale_term_refused_total{what=\"registered\"} 1",
        "cairn_node_coordinator_term 6",
        "cairn_node_coordinator_sessions_total 2",
    ] {
        assert!(metrics.contains(line), "no `{line}` in\n{metrics}");
    }
    let mut ended = ended;
    assert!(
        ended.try_recv().is_err(),
        "the session of the current term ended"
    );
    daemon.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_coordinator_is_left_within_seconds() {
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let (first_listener, first) = listener().await;
    let (second_listener, second) = listener().await;
    serve(first_listener, "first", None, &seen_tx);
    serve(second_listener, "second", None, &seen_tx);
    let (proxy, freeze) = freezable_proxy(first).await;
    let daemon = daemon(vec![proxy.to_string(), second.to_string()]).await;
    let (commands, _ended) = session(&mut seen, "first", Duration::from_secs(5)).await;
    commands.send(Ok(daemon.registered(1))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The first coordinator stops: its connection stays open and answers nothing.
    freeze.send(true).unwrap();
    let start = Instant::now();
    let (commands, _ended) = session(&mut seen, "second", Duration::from_secs(10)).await;
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(7),
        "the daemon left the stopped coordinator after {took:?}"
    );
    commands.send(Ok(daemon.registered(1))).await.unwrap();
    daemon.stop.cancel();
}
