//! `cairn-node`: the daemon that runs beside every application process.
//!
//! It carries the application's messages to its peers over one long-lived gRPC stream per
//! directed channel (reliable and FIFO across reconnects), talks to its application over
//! one ordered session stream, and drives a [`cairn_core::SnapshotEngine`] so that
//! snapshots are taken without pausing the application.
//!
//! ```text
//!  application ──App/Session──▶ app_service ─┐                ┌─▶ peer_client (one per outgoing channel) ──Peer/Channel──▶
//!                                            ├─▶ node_loop ───┤
//!  peers ──Peer/Channel──▶ peer_server ──────┘  (engine, inbox,└─▶ the application's stream (deliveries, record requests)
//!                                               outgoing queues)
//! ```
//!
//! # Layout
//!
//! - [`config`]: [`NodeConfig`] and the parsers of its flags.
//! - `shared`: what every part reads without asking the loop (`Shared`, `Wiring`,
//!   `ChannelHandles`, `StateChunk`); it imports nothing of the daemon but its metrics.
//! - `node_loop`: the one task that owns the engine, the inbox and the outgoing queues; it
//!   owns the events it emits (`NodeEvent`) and records each snapshot's `part::Part`.
//! - `peer_server`, `peer_client`: the two ends of the peer channels.
//! - `app_service`: the application session.
//! - `admin`: `NodeAdmin` (status, snapshots by hand, local parts).
//! - `part`: a node's part of a snapshot in core types, and its wire form (built at the
//!   edges: `admin`, the link's upload); other conversions live in `cairn_proto::convert`.
//! - [`error`]: the daemon's [`Error`] and its gRPC codes.
//! - [`metrics`]: Prometheus metrics (served by `cairn_rpc::server::metrics`).
//! - `wiring`: the node's members and channels, and how they grow.
//! - `coordinator_link`: the session with the coordinator (`upload`, `restore_fetch`;
//!   `coordinators`: which replica to try next; `term`: the leadership-term rule).
//!
//! The modules import each other in one direction: `coordinator_link` → `wiring` →
//! `peer_client` → `node_loop` → `part`, `error`, `shared` → `metrics` (and `admin`,
//! `app_service`, `peer_server` → `node_loop`, `shared`, `error`); nothing in `node_loop`
//! imports the link or the wiring.

#![forbid(unsafe_code)]

mod admin;
mod app_service;
pub mod config;
mod coordinator_link;
pub mod error;
pub mod metrics;
pub mod mutants;
mod node_loop;
mod part;
mod peer_client;
mod peer_server;
mod shared;
mod wiring;

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cairn_rpc::v1 as pb;
use cairn_rpc::{limits, reflection};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::{ConfigError, NodeConfig};
pub use error::Error;

use node_loop::{LoopMsg, NodeLoop};
use shared::{Shared, UPLOAD_ROOM};

/// Streams one connection may have open at once on the peer port (a peer opens one per
/// channel it sends on; admin calls are short).
const PEER_PORT_STREAMS: u32 = 64;
/// Streams one connection may have open at once on the application port (one session).
const APP_PORT_STREAMS: u32 = 16;
/// Most unacknowledged frames per outgoing channel (fewer if the channel buffer is smaller).
const LINK_WINDOW: usize = 4096;
/// HTTP/2 stream window of the application session, in bytes.
const APP_STREAM_WINDOW: u32 = 1 << 20;

/// The sockets a daemon serves on, bound by the caller (so tests can bind port 0).
pub struct Listeners {
    /// Peers, `NodeAdmin`, health and reflection.
    pub peer: TcpListener,
    /// The application session, health and reflection.
    pub app: TcpListener,
    /// Prometheus `/metrics`, if wanted.
    pub metrics: Option<TcpListener>,
}

/// Why the daemon could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The configuration is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A server failed.
    #[error("server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// Reflection could not be built.
    #[error("reflection: {0}")]
    Reflection(String),
    /// The blob store of `--blob-store` cannot be reached.
    #[error("blob store: {0}")]
    BlobStore(std::io::Error),
}

/// Runs a node daemon until `shutdown` is cancelled, then stops accepting, aborts the
/// snapshots in flight (reason: shutdown), lets outgoing channels drain for at most the
/// grace period, and returns.
pub async fn run(
    config: NodeConfig,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let topology = config.topology()?;
    // Opened (and listed once) before anything serves: a wrong bucket or wrong credentials
    // stop the daemon at start, not at its first snapshot.
    let blobs = match &config.blob.blob_store {
        Some(_) => Some(
            cairn_blob::BlobStore::open(&config.blob, None, false)
                .await
                .map_err(RunError::BlobStore)?,
        ),
        None => None,
    };
    let me = config.node_id.clone();
    let incarnation = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64);
    let buffer = config.channel_buffer.max(1);
    let metrics = metrics::NodeMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    cairn_rpc::server::metrics::register_process(&mut registry, "cairn-node");
    metrics.register(&mut registry);
    config.auth.register(&mut registry);
    let tls_metrics = cairn_rpc::server::tls::TlsMetrics::default();
    tls_metrics.register(&mut registry);
    let first = wiring::wiring(&me, topology, config.peers.clone(), buffer, None);
    let shared = Arc::new(Shared {
        metrics,
        node_id: me.clone(),
        cluster: config.cluster.clone(),
        incarnation,
        max_payload: config.max_payload,
        channel_buffer: buffer,
        // At least a millisecond (the CLI refuses less): a zero target would pin every
        // held-back queue to the floor.
        queue_target: config
            .queue_target
            .map(|t| t.max(std::time::Duration::from_millis(1))),
        wiring: RwLock::new(Arc::new(first)),
        fault_injection: config.fault_injection,
        upload_room: Arc::new(tokio::sync::Semaphore::new(UPLOAD_ROOM)),
        tls: config.tls.clone(),
        epoch: tokio::sync::watch::Sender::new(0),
        highest_term: AtomicU64::new(0),
        registered: std::sync::atomic::AtomicBool::new(config.coordinators.is_empty()),
    });

    let stop = CancellationToken::new();
    let (loop_tx, loop_rx) = mpsc::channel(1024);
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let events = (!config.coordinators.is_empty()).then_some(events_tx);
    let node_loop = NodeLoop::new(
        shared.clone(),
        loop_rx,
        loop_tx.clone(),
        config.keep_parts,
        events,
    );
    let loop_task = tokio::spawn(node_loop.run(stop.clone()));
    let links = TaskTracker::new();
    let mut wirer = wiring::Wirer {
        shared: shared.clone(),
        loop_tx: loop_tx.clone(),
        link_config: peer_client::LinkConfig {
            reconnect_initial: config.reconnect_initial,
            reconnect_max: config.reconnect_max,
            // Frames in flight on one stream: enough to keep a fast channel busy, few enough
            // that an unaligned marker is not long stuck behind frames a slow receiver has
            // no room for yet.
            window: buffer.min(LINK_WINDOW),
        },
        stop: stop.clone(),
        tasks: links.clone(),
        linked: BTreeMap::new(),
    };
    let (leave_tx, leave_rx) = mpsc::channel(1);
    let link_task = if config.coordinators.is_empty() {
        wirer.link_all();
        None
    } else {
        let link = coordinator_link::CoordinatorLink {
            shared: shared.clone(),
            loop_tx: loop_tx.clone(),
            advertise: config.advertise.clone().unwrap_or_default(),
            coordinators: coordinator_link::Coordinators::new(config.coordinators.clone()),
            events: events_rx,
            wirer,
            blobs,
            uploads: std::collections::BTreeMap::new(),
            highest_snapshot: 0,
            applied_restore: String::new(),
            leave: leave_rx,
            leaving: None,
        };
        Some(tokio::spawn(link.run(stop.clone())))
    };

    let (health, health_service) = tonic_health::server::health_reporter();
    for name in HEALTH_SERVICES {
        health
            .set_service_status(name, tonic_health::ServingStatus::NotServing)
            .await;
    }
    // Frame batches and the application's messages: one payload up to --max-payload plus
    // room; everything else on these ports is a small control message.
    let data_limit = limits::data_message(config.max_payload);

    let peer_service = peer_server::PeerService {
        shared: shared.clone(),
        loop_tx: loop_tx.clone(),
        shutdown: stop.clone(),
    };
    let admin_service = admin::AdminService {
        loop_tx: loop_tx.clone(),
        shared: shared.clone(),
        coordinated: !config.coordinators.is_empty(),
    };
    let app_service = app_service::AppService {
        shared: shared.clone(),
        loop_tx: loop_tx.clone(),
        shutdown: stop.clone(),
        sessions: AtomicU64::new(0),
        sessions_taken: Default::default(),
    };
    if let Some(tls) = &config.tls {
        // New certificates go in force for new handshakes and for this daemon's new
        // connections to peers and the coordinator; channels that are up stay up.
        cairn_rpc::server::tls::watch(tls, &tls_metrics, stop.clone());
    }
    config.auth.start(
        "this daemon's NodeAdmin",
        config.tls.is_some(),
        stop.clone(),
        health.clone(),
    );
    let accepting = CancellationToken::new();
    // Peer streams use large windows (CALIBRATION.md); each connection carries one channel.
    let peer_server = limits::server(PEER_PORT_STREAMS)
        .initial_stream_window_size(16 << 20)
        .initial_connection_window_size(32 << 20)
        // NodeAdmin's bearer tokens and roles (`--auth-tokens`); Peer/Channel stays open.
        .layer(config.auth.layer(&config.cluster, config.tls.as_ref()))
        .layer(
            limits::MessageLimits::new(limits::CONTROL_MESSAGE)
                .rpc("/cairn.v1.Peer/Channel", data_limit),
        )
        .add_service(health_service.clone())
        .add_service(reflection::v1(reflection::PEER_PORT).map_err(reflection_error)?)
        .add_service(reflection::v1alpha(reflection::PEER_PORT).map_err(reflection_error)?)
        .add_service(
            pb::peer_server::PeerServer::new(peer_service).max_decoding_message_size(data_limit),
        )
        .add_service(pb::node_admin_server::NodeAdminServer::new(admin_service));
    // With TLS, the handshakes run in cairn-rpc's accept loop (mutual TLS: a client without
    // a certificate of the CA is refused there), with the certificate in force.
    let peer_server = cairn_rpc::server::tls::serve(
        peer_server,
        listeners.peer,
        config.tls.clone(),
        tls_metrics.clone(),
        stop.clone(),
    );
    // The application is beside the daemon: small windows keep what waits in HTTP/2
    // buffers small, so backpressure reaches a fast application quickly.
    let app_server = limits::server(APP_PORT_STREAMS)
        .initial_stream_window_size(APP_STREAM_WINDOW)
        .initial_connection_window_size(APP_STREAM_WINDOW * 4)
        // App/Session and App/Consumed are open to the layer; with TLS it records the
        // certificate's identity for their check that the application holds this node's.
        .layer(config.auth.layer(&config.cluster, config.tls.as_ref()))
        .layer(
            limits::MessageLimits::new(limits::CONTROL_MESSAGE)
                .rpc("/cairn.v1.App/Session", data_limit),
        )
        .add_service(health_service)
        .add_service(reflection::v1(reflection::APP_PORT).map_err(reflection_error)?)
        .add_service(reflection::v1alpha(reflection::APP_PORT).map_err(reflection_error)?)
        .add_service(
            pb::app_server::AppServer::new(app_service).max_decoding_message_size(data_limit),
        );
    // With TLS the application port is mutual TLS too (the application presents its
    // node's certificate).
    let app_server = cairn_rpc::server::tls::serve(
        app_server,
        listeners.app,
        config.tls.clone(),
        tls_metrics.clone(),
        accepting.clone(),
    );
    let peer_server = tokio::spawn(peer_server);
    let app_server = tokio::spawn(app_server);
    if let Some(listener) = listeners.metrics {
        tokio::spawn(cairn_rpc::server::metrics::serve(
            listener,
            Arc::new(registry),
            stop.clone(),
            config.tls.clone().map(|tls| (tls, tls_metrics.clone())),
            None,
            (config.auth.clone(), config.cluster.clone()),
        ));
    }

    for name in &HEALTH_SERVICES[..4] {
        health
            .set_service_status(name, tonic_health::ServingStatus::Serving)
            .await;
    }
    tracing::info!(node = %me, cluster = %config.cluster, incarnation, "node daemon serving");
    tokio::spawn(report_wired(shared.clone(), health.clone(), stop.clone()));

    shutdown.cancelled().await;
    tracing::info!("shutting down: no new application messages; draining outgoing channels");
    for name in HEALTH_SERVICES {
        health
            .set_service_status(name, tonic_health::ServingStatus::NotServing)
            .await;
    }
    accepting.cancel();
    drain(&loop_tx, config.grace_period).await;
    if config.leave_on_shutdown {
        leave(&leave_tx).await;
    }
    stop.cancel();
    let _ = loop_task.await;
    if let Some(task) = link_task {
        let _ = task.await;
    }
    links.close();
    links.wait().await;
    for server in [peer_server, app_server] {
        match tokio::time::timeout(Duration::from_secs(2), server).await {
            Ok(Ok(Err(e))) => tracing::warn!("server ended with an error: {e}"),
            Err(_) => tracing::warn!("server did not stop within 2s; leaving it"),
            _ => {}
        }
    }
    tracing::info!("node daemon stopped");
    Ok(())
}

fn reflection_error(e: impl std::fmt::Display) -> RunError {
    RunError::Reflection(e.to_string())
}

/// The health service that says the daemon is ready: registered with its coordinator (if it
/// has one) and connected to every peer it sends to that the coordinator has not reported
/// down. A Kubernetes readiness probe asks it.
pub const WIRED: &str = "cairn.v1.Wired";

/// Every health service a daemon reports (NOT_SERVING at start and at shutdown; all but
/// [`WIRED`] SERVING once it serves).
const HEALTH_SERVICES: [&str; 5] = [
    "",
    "cairn.v1.Peer",
    "cairn.v1.App",
    "cairn.v1.NodeAdmin",
    WIRED,
];

/// Keeps [`WIRED`] up to date (every 500 ms) until `stop`.
async fn report_wired(
    shared: Arc<Shared>,
    health: tonic_health::server::HealthReporter,
    stop: CancellationToken,
) {
    use std::sync::atomic::Ordering;
    let mut last = None;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let wiring = shared.wiring();
        let wired = shared.registered.load(Ordering::Acquire)
            && wiring.topology.outgoing(&shared.node_id).all(|c| {
                // A peer the coordinator says is down is not waited for: one crashed node
                // must not make every other pod NotReady (and wedge the PDB).
                wiring.down.contains(&c.to)
                    || wiring
                        .channels
                        .get(&c)
                        .is_some_and(|h| h.stats.connected.load(Ordering::Relaxed))
            });
        if last != Some(wired) {
            last = Some(wired);
            let status = if wired {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            health.set_service_status(WIRED, status).await;
        }
    }
}

/// How long a leaving daemon waits for the coordinator's answer.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Asks the coordinator to remove this node, and waits for its answer (bounded).
async fn leave(leave: &mpsc::Sender<oneshot::Sender<Result<(), String>>>) {
    let (reply, answer) = oneshot::channel();
    let asked = async {
        leave
            .send(reply)
            .await
            .map_err(|_| "the coordinator link has stopped".to_owned())?;
        answer
            .await
            .map_err(|_| "the session with the coordinator ended before it answered".to_owned())?
    };
    match tokio::time::timeout(LEAVE_TIMEOUT, asked).await {
        Ok(Ok(())) => tracing::info!("left the cluster: the coordinator removed this node"),
        Ok(Err(why)) => tracing::error!(
            "could not leave the cluster ({why}): this node stays a member; remove it with \
             `cairnctl nodes remove`"
        ),
        Err(_) => tracing::error!(
            "the coordinator did not answer Leave within {}s: this node may stay a member; \
             remove it with `cairnctl nodes remove`",
            LEAVE_TIMEOUT.as_secs()
        ),
    }
}

/// Waits until every outgoing channel is empty and acknowledged, or the grace period ends.
async fn drain(loop_tx: &mpsc::Sender<LoopMsg>, grace: Duration) {
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        let (reply, answer) = oneshot::channel();
        if loop_tx.send(LoopMsg::Status { reply }).await.is_err() {
            return;
        }
        let Ok(status) = answer.await else { return };
        let pending: u64 = status.channels.iter().map(|c| c.unacked_frames).sum();
        if pending == 0 {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(pending, "grace period over with frames unacknowledged");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
