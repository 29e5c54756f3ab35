//! The pieces `cairn-bench` is made of: an application that lives inside the bench process
//! (one per node daemon, attached through the SDK), clusters of real daemons around it, the
//! baselines (raw TCP, a plain tonic stream, a stop-the-world coordinator), and the
//! statistics and report.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cairn_rpc::v1 as pb;
use cairn_sdk::{AppEvent, AppSession};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::coordinated::{CoordinatedCluster, Store};

/// How a bench application sends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// Nothing.
    Idle,
    /// About this many messages per second (one per tick).
    Rate(f64),
    /// As fast as backpressure allows.
    Flood,
}

/// What every bench application shares with the bench, changeable while it runs.
pub struct AppControl {
    /// The state handed over at each snapshot.
    pub state: std::sync::Mutex<Bytes>,
    /// The payload of each message.
    pub payload: std::sync::Mutex<Bytes>,
    /// How it sends.
    pub load: std::sync::Mutex<Load>,
    /// Time spent on each received message (a slow application).
    pub delay: std::sync::Mutex<Duration>,
    /// Stop-the-world baseline: sending is stopped while set.
    pub paused: AtomicBool,
    /// Woken when `load` or `paused` changes.
    pub changed: Notify,
    /// Messages sent.
    pub sent: AtomicU64,
    /// Messages received.
    pub received: AtomicU64,
    /// Longest time spent answering a record request, in µs.
    pub record_max_us: AtomicU64,
    /// Every time spent answering a record request, in µs.
    pub record_us: std::sync::Mutex<Vec<f64>>,
    /// Longest stop-the-world pause this application saw, in µs.
    pub stw_max_us: AtomicU64,
}

impl AppControl {
    /// An idle application with a state of `state_size` bytes and 16-byte messages.
    pub fn new(state_size: usize) -> Arc<Self> {
        Arc::new(Self {
            state: std::sync::Mutex::new(filler(state_size, 1)),
            payload: std::sync::Mutex::new(Bytes::from_static(b"{\"amount\":1}    ")),
            load: std::sync::Mutex::new(Load::Idle),
            delay: std::sync::Mutex::new(Duration::ZERO),
            paused: AtomicBool::new(false),
            changed: Notify::new(),
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            record_max_us: AtomicU64::new(0),
            record_us: std::sync::Mutex::new(Vec::new()),
            stw_max_us: AtomicU64::new(0),
        })
    }

    /// Changes how it sends.
    pub fn set_load(&self, load: Load) {
        *self.load.lock().expect("never poisoned") = load;
        self.changed.notify_waiters();
    }
}

/// `size` bytes that compress badly and differ by `seed`.
pub fn filler(size: usize, seed: u64) -> Bytes {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(size);
    while out.len() < size {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(size);
    Bytes::from(out)
}

/// Runs one bench application on `session` until `stop`.
pub fn spawn_app(mut session: AppSession, ctl: Arc<AppControl>, stop: CancellationToken) {
    let sender = session.sender();
    let receiving = ctl.clone();
    let stop_rx = stop.clone();
    let record_sender = sender.clone();
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                _ = stop_rx.cancelled() => return,
                e = session.next_event() => e,
            };
            match event {
                Ok(Some(AppEvent::Message { .. })) => {
                    receiving.received.fetch_add(1, Relaxed);
                    let delay = *receiving.delay.lock().expect("never poisoned");
                    if delay >= Duration::from_millis(1) {
                        tokio::time::sleep(delay).await;
                    } else if !delay.is_zero() {
                        // Below the timer's resolution: spin.
                        let until = Instant::now() + delay;
                        while Instant::now() < until {
                            std::hint::spin_loop();
                        }
                    }
                }
                Ok(Some(AppEvent::RecordState { snapshot_id })) => {
                    let started = Instant::now();
                    let state = receiving.state.lock().expect("never poisoned").clone();
                    let _ = record_sender.state_recorded(snapshot_id, state);
                    let took = started.elapsed().as_secs_f64() * 1e6;
                    receiving.record_max_us.fetch_max(took as u64, Relaxed);
                    receiving
                        .record_us
                        .lock()
                        .expect("never poisoned")
                        .push(took);
                }
                Ok(Some(
                    AppEvent::Restore { .. }
                    | AppEvent::RestorePiece { .. }
                    | AppEvent::RestoreAborted { .. }
                    | AppEvent::SnapshotCompleted { .. }
                    | AppEvent::SnapshotAborted { .. },
                )) => {}
                Ok(None) | Err(_) => return,
            }
        }
    });
    tokio::spawn(async move {
        let mut next = 0usize;
        let mut tick = tokio::time::interval(Duration::from_millis(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            if stop.is_cancelled() {
                return;
            }
            let changed = ctl.changed.notified();
            let load = *ctl.load.lock().expect("never poisoned");
            let peers: Vec<String> = sender.peers().into_iter().collect();
            if load == Load::Idle || peers.is_empty() || ctl.paused.load(Relaxed) {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = changed => {}
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
                continue;
            }
            let burst = match load {
                Load::Rate(rate) => {
                    tick.tick().await;
                    ((rate / 1000.0).round() as usize).max(1)
                }
                _ => 256,
            };
            let payload = ctl.payload.lock().expect("never poisoned").clone();
            for _ in 0..burst {
                if ctl.paused.load(Relaxed) {
                    break;
                }
                let to = &peers[next % peers.len()];
                next += 1;
                if sender.send(to, payload.clone()).await.is_err() {
                    return;
                }
                ctl.sent.fetch_add(1, Relaxed);
            }
        }
    });
}

/// A cluster of daemon processes with a bench application on each.
pub struct BenchCluster {
    /// The processes.
    pub cluster: CoordinatedCluster,
    /// One control per node, in node order.
    pub apps: Vec<Arc<AppControl>>,
    stop: CancellationToken,
    /// The certificates' directory of a TLS cluster.
    certs: Option<std::path::PathBuf>,
}

impl BenchCluster {
    /// Starts a coordinator and `n` daemons (with `coordinator_args`/`node_args`), attaches a
    /// bench application with a state of `state_size` bytes to each, and waits until every
    /// daemon is wired with its application attached.
    pub async fn start(
        n: usize,
        store: &Store,
        coordinator_args: &[&str],
        node_args: &[&str],
        state_size: usize,
    ) -> anyhow::Result<Self> {
        Self::start_tls(n, store, coordinator_args, node_args, state_size, false).await
    }

    /// As [`Self::start`]; with `tls`, every daemon's links and the bench's calls to the
    /// coordinator use mutual TLS (certificates of `cairnctl certs init`, removed with the
    /// cluster); each application presents its node's certificate.
    pub async fn start_tls(
        n: usize,
        store: &Store,
        coordinator_args: &[&str],
        node_args: &[&str],
        state_size: usize,
        tls: bool,
    ) -> anyhow::Result<Self> {
        Self::start_env(n, store, coordinator_args, node_args, state_size, tls, &[]).await
    }

    /// As [`Self::start_tls`], with `env` set on the coordinator and every daemon (the blob
    /// store's credentials).
    pub async fn start_env(
        n: usize,
        store: &Store,
        coordinator_args: &[&str],
        node_args: &[&str],
        state_size: usize,
        tls: bool,
        env: &[(String, String)],
    ) -> anyhow::Result<Self> {
        let cluster_name = format!("bench-{}", crate::processes::free_port());
        let mut c_args = vec!["--cluster", cluster_name.as_str(), "--max-concurrent", "8"];
        c_args.extend_from_slice(coordinator_args);
        let mut n_args = vec!["--cluster", cluster_name.as_str()];
        n_args.extend_from_slice(node_args);
        let all: Vec<usize> = (0..n).collect();
        let certs = if tls {
            let dir = std::env::temp_dir().join(format!("cairn-{cluster_name}-certs"));
            crate::coordinated::certs_init_for(
                &dir,
                &cluster_name,
                n,
                &[crate::coordinated::TLS_TEST_USER_SPEC],
            )?;
            Some(dir)
        } else {
            None
        };
        let cluster = CoordinatedCluster::start_replicas(
            1,
            n,
            store.clone(),
            &all,
            &c_args,
            &n_args,
            certs.as_deref(),
            env,
        )
        .await;
        let cluster = match cluster {
            // A trace of where a snapshot's time goes reads the processes' logs, kept with
            // `CAIRN_BENCH_KEEP_LOGS=1` (and filtered with `CAIRN_LOG`, which they inherit).
            Ok(mut cluster) => {
                if std::env::var_os("CAIRN_BENCH_KEEP_LOGS").is_some() {
                    cluster.keep_logs();
                }
                cluster
            }
            Err(e) => {
                if let Some(dir) = &certs {
                    let _ = std::fs::remove_dir_all(dir);
                }
                return Err(e);
            }
        };
        let stop = CancellationToken::new();
        let mut apps = Vec::new();
        for node in &cluster.nodes {
            // With TLS the application presents its node's certificate.
            let node_tls = match &certs {
                None => None,
                Some(dir) => Some(cairn_sdk::tls::Tls::from_files(
                    &dir.join("ca.pem"),
                    Some((
                        &dir.join(format!("{}.pem", node.id)),
                        &dir.join(format!("{}-key.pem", node.id)),
                    )),
                )?),
            };
            let session =
                AppSession::connect_with(&node.app, "cairn-bench", node_tls.as_ref()).await?;
            let ctl = AppControl::new(state_size);
            spawn_app(session, ctl.clone(), stop.clone());
            apps.push(ctl);
        }
        for i in 0..n {
            cluster.wait_ready(i).await?;
        }
        Ok(Self {
            cluster,
            apps,
            stop,
            certs,
        })
    }

    /// Sets every application's load.
    pub fn set_load(&self, load: Load) {
        for app in &self.apps {
            app.set_load(load);
        }
    }

    /// Messages received by every application so far.
    pub fn received(&self) -> u64 {
        self.apps.iter().map(|a| a.received.load(Relaxed)).sum()
    }

    /// Messages sent by every application so far.
    pub fn sent(&self) -> u64 {
        self.apps.iter().map(|a| a.sent.load(Relaxed)).sum()
    }

    /// Takes one snapshot and follows it to its end: (milliseconds from StartSnapshot to
    /// the end as the client sees it, the snapshot).
    pub async fn snapshot(
        &self,
        request: pb::StartSnapshotRequest,
    ) -> anyhow::Result<(f64, pb::Snapshot)> {
        let mut client = self.cluster.client().await?;
        let started = Instant::now();
        let id = client
            .start_snapshot(request)
            .await?
            .into_inner()
            .snapshot_id;
        let mut stream = client
            .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: id })
            .await?
            .into_inner();
        while let Some(p) = stream.message().await? {
            if p.status != pb::SnapshotStatus::InProgress as i32 {
                break;
            }
        }
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        let snapshot = client
            .get_snapshot(pb::GetSnapshotRequest {
                snapshot_id: id,
                include_data: false,
            })
            .await?
            .into_inner();
        Ok((ms, snapshot))
    }

    /// Stop-the-world, the naive way: stop every application's sending, wait until every
    /// message sent has been received (the channels are empty), read the states, resume.
    /// Returns how long the applications were stopped.
    pub async fn stop_the_world(&self) -> Duration {
        let started = Instant::now();
        for app in &self.apps {
            app.paused.store(true, Relaxed);
        }
        while self.received() < self.sent() {
            tokio::task::yield_now().await;
        }
        let states: usize = self
            .apps
            .iter()
            .map(|a| a.state.lock().expect("never poisoned").len())
            .sum();
        std::hint::black_box(states);
        for app in &self.apps {
            app.paused.store(false, Relaxed);
            app.changed.notify_waiters();
        }
        let paused = started.elapsed();
        for app in &self.apps {
            app.stw_max_us.fetch_max(paused.as_micros() as u64, Relaxed);
        }
        paused
    }
}

impl Drop for BenchCluster {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(dir) = &self.certs {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The `q` quantile (0..=1) of `values`, by nearest rank.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Raw TCP baseline: one connection on loopback inside this process, `[u32 length][payload]`
/// frames through buffered writes; messages per second over `duration`.
pub async fn raw_tcp(payload: usize, duration: Duration) -> anyhow::Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let received = Arc::new(AtomicU64::new(0));
    let counter = received.clone();
    let server = tokio::spawn(async move {
        let (socket, _) = listener.accept().await?;
        let mut reader = BufReader::with_capacity(1 << 20, socket);
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let len = match reader.read_u32_le().await {
                Ok(l) => l as usize,
                Err(_) => return anyhow::Ok(()),
            };
            reader.read_exact(&mut buf[..len]).await?;
            counter.fetch_add(1, Relaxed);
        }
    });
    let socket = tokio::net::TcpStream::connect(addr).await?;
    socket.set_nodelay(true)?;
    let mut writer = BufWriter::with_capacity(1 << 20, socket);
    let message = vec![7u8; payload];
    let deadline = Instant::now() + duration;
    let start_count = received.load(Relaxed);
    let started = Instant::now();
    while Instant::now() < deadline {
        for _ in 0..1024 {
            writer.write_u32_le(payload as u32).await?;
            writer.write_all(&message).await?;
        }
    }
    let count = received.load(Relaxed) - start_count;
    let rate = count as f64 / started.elapsed().as_secs_f64();
    drop(writer);
    let _ = server.await;
    Ok(rate)
}

/// Plain tonic baseline: one bidirectional stream on loopback inside this process, one
/// message per stream item (the `cairn.v1.Peer` service with a counting server); messages
/// per second over `duration`.
pub async fn plain_tonic(payload: usize, duration: Duration) -> anyhow::Result<f64> {
    tonic_chain(payload, 1, duration, 0).await
}

/// The three-hop baseline: the shape of cairn's path (application → daemon → daemon →
/// application) with nothing of cairn in it — tonic streams on loopback inside this
/// process, the frames of [`plain_tonic`] relayed by two servers that each decode a frame
/// and send it on (through a bounded queue, as a daemon hands them between tasks) on a
/// stream of their own to the next, `per_item` messages in each item (each its own run, as
/// cairn carries a message of 1 KiB or more); messages per second over `duration`. What
/// three tonic hops can carry on this machine, beside what one can.
pub async fn relay_tonic(
    payload: usize,
    per_item: usize,
    duration: Duration,
) -> anyhow::Result<f64> {
    tonic_chain(payload, per_item, duration, 2).await
}

/// `relays` relaying servers between a sending client and a counting server.
async fn tonic_chain(
    payload: usize,
    per_item: usize,
    duration: Duration,
    relays: usize,
) -> anyhow::Result<f64> {
    let received = Arc::new(AtomicU64::new(0));
    let shutdown = CancellationToken::new();
    let mut servers = Vec::new();
    let (mut addr, server) = serve_peer(CountingPeer(received.clone()), &shutdown).await?;
    servers.push(server);
    for _ in 0..relays {
        let next = addr;
        let (relay_addr, server) = serve_peer(RelayPeer { next }, &shutdown).await?;
        servers.push(server);
        addr = relay_addr;
    }
    let mut client = pb::peer_client::PeerClient::new(peer_channel(addr).await?);
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::PeerFrame>(1024);
    let call = tokio::spawn(async move {
        let _ = client
            .channel(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await;
    });
    let message = Bytes::from(vec![7u8; payload]);
    let frame = pb::PeerFrame {
        kind: Some(pb::peer_frame::Kind::Batch(pb::FrameBatch {
            first_seq: 1,
            frames: vec![
                pb::Frame {
                    kind: Some(pb::frame::Kind::Data(pb::DataRun {
                        payloads: message,
                        lengths: vec![payload as u32],
                    })),
                };
                per_item
            ],
            epoch: 0,
        })),
    };
    // Past the start (HTTP/2 windows opening), as cairn's line is measured.
    let warm = Instant::now() + Duration::from_millis(300);
    while Instant::now() < warm {
        if tx.send(frame.clone()).await.is_err() {
            break;
        }
    }
    let before = received.load(Relaxed);
    let started = Instant::now();
    let deadline = started + duration;
    while Instant::now() < deadline {
        if tx.send(frame.clone()).await.is_err() {
            break;
        }
    }
    let count = received.load(Relaxed) - before;
    let rate = count as f64 / started.elapsed().as_secs_f64();
    drop(tx);
    let _ = call.await;
    shutdown.cancel();
    for server in servers {
        let _ = server.await;
    }
    anyhow::ensure!(count > 0, "the tonic baseline carried nothing");
    Ok(rate)
}

/// Serves `peer` on a free loopback port with the windows cairn's streams use, until
/// `shutdown`.
async fn serve_peer<P: pb::peer_server::Peer>(
    peer: P,
    shutdown: &CancellationToken,
) -> anyhow::Result<(
    std::net::SocketAddr,
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = shutdown.clone();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(32 << 20)
            .add_service(pb::peer_server::PeerServer::new(peer))
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                stop.cancelled_owned(),
            ),
    );
    Ok((addr, server))
}

/// A channel to `addr` with the windows of [`serve_peer`].
async fn peer_channel(addr: std::net::SocketAddr) -> anyhow::Result<tonic::transport::Channel> {
    Ok(
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(32 << 20)
            .tcp_nodelay(true)
            .connect()
            .await?,
    )
}

/// The answer stream of a `Peer/Channel` call of the baselines (never written: they ack
/// nothing).
type PeerAcks = tokio_stream::wrappers::ReceiverStream<Result<pb::PeerAck, tonic::Status>>;

/// Answers a `Peer/Channel` call of the baselines: `each` takes every frame, until it says
/// no more or the stream ends; the answer stream ends then.
fn take_frames<F, Fut>(
    request: tonic::Request<tonic::Streaming<pb::PeerFrame>>,
    mut each: F,
) -> tonic::Response<PeerAcks>
where
    F: FnMut(pb::PeerFrame) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let mut frames = request.into_inner();
    let (done, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        while let Ok(Some(frame)) = frames.message().await {
            if !each(frame).await {
                break;
            }
        }
        drop(done);
    });
    tonic::Response::new(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// A hop of [`relay_tonic`]: each stream it serves is sent on, frame by frame, on a stream
/// of its own to `next`.
struct RelayPeer {
    next: std::net::SocketAddr,
}

#[tonic::async_trait]
impl pb::peer_server::Peer for RelayPeer {
    type ChannelStream = PeerAcks;

    async fn channel(
        &self,
        request: tonic::Request<tonic::Streaming<pb::PeerFrame>>,
    ) -> Result<tonic::Response<Self::ChannelStream>, tonic::Status> {
        let channel = peer_channel(self.next)
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let mut client = pb::peer_client::PeerClient::new(channel);
        let (forward, queued) = tokio::sync::mpsc::channel::<pb::PeerFrame>(1024);
        tokio::spawn(async move {
            let _ = client
                .channel(tokio_stream::wrappers::ReceiverStream::new(queued))
                .await;
        });
        Ok(take_frames(request, move |frame| {
            let forward = forward.clone();
            async move { forward.send(frame).await.is_ok() }
        }))
    }
}

/// The end of the baselines: counts the messages it receives.
struct CountingPeer(Arc<AtomicU64>);

#[tonic::async_trait]
impl pb::peer_server::Peer for CountingPeer {
    type ChannelStream = PeerAcks;

    async fn channel(
        &self,
        request: tonic::Request<tonic::Streaming<pb::PeerFrame>>,
    ) -> Result<tonic::Response<Self::ChannelStream>, tonic::Status> {
        let counter = self.0.clone();
        Ok(take_frames(request, move |frame| {
            if let Some(pb::peer_frame::Kind::Batch(b)) = frame.kind {
                let n: usize = b
                    .frames
                    .iter()
                    .map(|f| match &f.kind {
                        Some(pb::frame::Kind::Data(d)) => d.lengths.len(),
                        _ => 0,
                    })
                    .sum();
                counter.fetch_add(n as u64, Relaxed);
            }
            std::future::ready(true)
        }))
    }
}

/// Peak resident set (`VmHWM`) of process `pid`, in bytes.
pub fn peak_rss(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM in /proc/{pid}/status"))?;
    Ok(kib << 10)
}

/// CPU time (user + system) process `pid` has used so far.
pub fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| anyhow::anyhow!("bad /proc/{pid}/stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5), 12 and 13 after the command.
    let ticks: u64 = fields
        .get(11..13)
        .ok_or_else(|| anyhow::anyhow!("short /proc/{pid}/stat"))?
        .iter()
        .map(|f| f.parse::<u64>().unwrap_or(0))
        .sum();
    // The kernel's USER_HZ is 100 on every Linux this runs on.
    Ok(Duration::from_millis(ticks * 10))
}
