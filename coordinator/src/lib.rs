//! `cairn-coordinator`: turns the node daemons into a product. It keeps the members'
//! sessions, starts snapshots and follows them with a [`cairn_core::SnapshotTracker`],
//! stores every part's manifest and recorded messages in the blob store (`cairn_blob`: a
//! directory or S3) — the state's chunks come cut by the daemons, only the new ones sent or
//! written by them — and the metadata as JSON in etcd (or an embedded file store), verifies
//! each cut, and answers users.
//!
//! # Layout
//!
//! - [`config`]: the configuration, [`CoordinatorConfig`].
//! - `leader`: the election, what a replica serves while it follows or leads, and the
//!   terms (each recovers the task from the store, runs it, and ends).
//! - `task`: the one task that owns membership, the tracker, restores and the schedule;
//!   it never awaits the blob store (a restore's verification and garbage collection run
//!   on tasks of their own and come back as messages).
//! - `parts`: a part's pipelines — upload, read back, stream, restore, verify.
//! - `api`: the `cairn.v1.Coordinator` gRPC service.
//! - [`policy`]: the snapshot policy's stored and wire forms.
//! - [`store`]: the metadata store (etcd or a file) and its typed access.
//! - [`error`]: the coordinator's [`Error`] and its gRPC codes.
//! - `limits`: the bounds on what requests carry (labels, reasons, timeouts).

#![forbid(unsafe_code)]

mod api;
mod budget;
pub mod config;
mod console;
pub mod error;
mod leader;
mod limits;
mod metrics;
mod parts;
pub mod policy;
pub mod store;
mod task;

/// The future of a tower middleware's `call` (the coordinator's layers: the response budget,
/// the leader hint, forwarding to the leader).
type BoxFuture<T, E> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, E>> + Send>>;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use cairn_rpc::v1 as pb;
use tokio::net::TcpListener;
use tokio::task::{JoinError, JoinHandle};
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

pub use config::CoordinatorConfig;
pub use error::Error;

use cairn_blob::BlobStore;
use leader::election::{Elector, Leadership};
use leader::replica::{HintLayer, Replica};
use leader::{Terms, watch_leader};
use store::{AnyKv, EtcdKv, FileKv, Keys};

/// The health service name that is SERVING only on the leader (for a load balancer or a
/// Kubernetes readiness probe that routes writes to it).
pub const LEADER_HEALTH: &str = "cairn.v1.Leader";

/// Why the coordinator could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The metadata store is unusable at start.
    #[error(transparent)]
    Store(#[from] store::StoreError),
    /// The blob directory is unusable.
    #[error("blob store {path}: {error}")]
    Blob {
        /// The directory.
        path: String,
        /// Why.
        error: std::io::Error,
    },
    /// Recovery after a restart (or on winning a term) failed.
    #[error("recovery: {0}")]
    Recover(#[from] Error),
    /// The address this replica would advertise is not one the others accept.
    #[error(
        "the advertised address {address} {why}: give --advertise HOST:PORT (the address \
         the daemons and the other replicas reach this one at)"
    )]
    Advertise {
        /// The address.
        address: String,
        /// What is wrong with it.
        why: String,
    },
    /// The server failed.
    #[error("server: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// Reflection could not be built.
    #[error("reflection: {0}")]
    Reflection(String),
    /// The coordinator's task ended (a panic, or a return) while the server was meant to
    /// run: nothing could be answered any more.
    #[error("the coordinator's task ended unexpectedly: {0}")]
    TaskEnded(String),
}

/// Runs the coordinator on `listener` until `shutdown`; serves Prometheus metrics on
/// `metrics_listener` if given.
///
/// With the embedded store this coordinator is the only one: it recovers, then leads (term
/// 0) until `shutdown`. With etcd it is one replica of several: it serves at once (reads,
/// and redirects to the leader) and campaigns; each term it wins runs a fresh task over
/// the fenced store until the term ends, and then it campaigns again.
pub async fn run(
    config: CoordinatorConfig,
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let keys = Keys::new(&config.cluster);
    let stop = CancellationToken::new();
    let local = listener.local_addr().ok();
    let advertise = config.advertise_address(local);
    if !config.etcd.is_empty() {
        config::check_advertise(&advertise).map_err(|why| RunError::Advertise {
            address: advertise.clone(),
            why,
        })?;
    }
    let (kv, etcd) = if config.etcd.is_empty() {
        let path = config.data_dir.join("metadata.json");
        tracing::info!(path = %path.display(), "embedded metadata store");
        let kv = AnyKv::File(Box::new(FileKv::open(&path, &keys.members()).await?));
        (Arc::new(kv), None)
    } else {
        tracing::info!(endpoints = ?config.etcd, "etcd metadata store");
        let etcd = EtcdKv::connect(&config.etcd).await?;
        (Arc::new(AnyKv::Etcd(Box::new(etcd.clone()))), Some(etcd))
    };
    let elector = etcd.as_ref().map(|etcd| {
        Elector::new(
            etcd.election_client(),
            keys.leader(),
            advertise.clone(),
            config.leader_lease_ttl,
        )
    });
    let default_dir = config.data_dir.join("blobs");
    let blobs = BlobStore::open(&config.blob, Some(&default_dir), true)
        .await
        .map_err(|error| RunError::Blob {
            path: config.blob.blob_store.as_ref().map_or_else(
                || format!("file://{}", default_dir.display()),
                |l| l.to_string(),
            ),
            error,
        })?;
    tracing::info!(
        blob_store = blobs.location(),
        chunks = blobs.indexed(),
        "blob store open"
    );
    let metrics = metrics::CoordinatorMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    cairn_rpc::server::metrics::register_process(&mut registry, "cairn-coordinator");
    metrics.register(&mut registry);
    config.auth.register(&mut registry);
    let tls_metrics = cairn_rpc::server::tls::TlsMetrics::default();
    tls_metrics.register(&mut registry);
    if let Some(tls) = &config.tls {
        cairn_rpc::server::tls::watch(tls, &tls_metrics, stop.clone());
    }
    let (health, health_service) = tonic_health::server::health_reporter();
    config.auth.start(
        "the coordinator's API",
        config.tls.is_some(),
        stop.clone(),
        health.clone(),
    );
    health
        .set_service_status(LEADER_HEALTH, ServingStatus::NotServing)
        .await;
    if !config.etcd.is_empty() {
        // Only the leader judges freshness; a replica that does not lead does not know.
        health
            .set_service_status(policy::FRESHNESS_SERVICE, ServingStatus::Unknown)
            .await;
    }
    let replica = Arc::new(Replica::new(advertise.clone()));
    let terms = Terms {
        config: config.clone(),
        keys: keys.clone(),
        kv: kv.clone(),
        etcd,
        elector: elector.clone(),
        blobs: blobs.clone(),
        metrics,
        health: health.clone(),
        replica: replica.clone(),
    };
    // The embedded store's coordinator recovers before it serves (a store it cannot read
    // is an error at start); a replica on etcd recovers when it wins a term.
    let first = match &terms.elector {
        None => Some(terms.start_term(Leadership::forever(), None).await?),
        Some(_) => None,
    };
    if terms.elector.is_none() {
        tokio::spawn(watch_store_files(kv.clone(), health.clone(), stop.clone()));
    }
    if let Some(elector) = &elector {
        tokio::spawn(watch_leader(
            elector.clone(),
            replica.clone(),
            terms.metrics.clone(),
            stop.clone(),
        ));
    }
    let mut state_task = Some(tokio::spawn(terms.lead(first, shutdown.clone())));

    let service = Arc::new(api::CoordinatorService {
        replica: replica.clone(),
        meta: store::Metadata::new(kv, keys),
        blobs,
        default_timeout: config.default_timeout,
        sessions: AtomicU64::new(0),
        elector,
        flags_policy: config.policy.clone(),
        max_in_flight: config.max_concurrent.max(1),
        follows: Arc::new(tokio::sync::Semaphore::new(api::MAX_FOLLOWS)),
        budget: budget::ResponseBudget::new(config.response_memory_mib.saturating_mul(1 << 20)),
        uploading: parts::Uploading::default(),
    });
    if let Some(listener) = metrics_listener {
        // The console and its API beside /metrics, calling the gRPC methods they mirror.
        // Logins sign their sessions under a key derived from the TLS private key, which
        // every replica shares: a session opened on one is good on the others.
        let session_secret = config.tls.as_ref().and_then(|tls| {
            let (_, identity) = tls.paths();
            let (_, key) = identity?;
            std::fs::read(key)
                .inspect_err(|e| {
                    tracing::warn!(
                        "the console takes no logins: --tls-key {} cannot be read: {e}",
                        key.display()
                    );
                })
                .ok()
        });
        let console = console::router(
            service.clone(),
            config.auth.clone(),
            config.cluster.clone(),
            session_secret,
        );
        tokio::spawn(cairn_rpc::server::metrics::serve(
            listener,
            Arc::new(registry),
            stop.clone(),
            config.tls.clone().map(|tls| (tls, tls_metrics.clone())),
            Some(console),
            (config.auth.clone(), config.cluster.clone()),
        ));
    }
    health
        .set_serving::<pb::coordinator_server::CoordinatorServer<api::CoordinatorService>>()
        .await;
    let addr = local.map_or_else(|| "unknown".to_owned(), |a| a.to_string());
    tracing::info!(%addr, %advertise, cluster = %config.cluster, "coordinator serving");
    // The server stops on `shutdown`, or when the coordinator's task ends by itself.
    let stop_server = shutdown.child_token();
    // Windows of a few MiB: parts stream in pieces of up to about a MiB (h2's default 64 KiB
    // window would make each wait for window updates), and what a connection can leave
    // unread stays small. Uploads carry recorded messages up to the largest payload a
    // daemon allows; every other call is a small control message (cairn_rpc::limits).
    // A daemon's connection carries its session, its uploads and a fetch; cairnctl's one call.
    const COORDINATOR_STREAMS: u32 = 64;
    // A piece holds recorded messages up to 1 MiB plus the one that crossed it.
    const UPLOAD_MESSAGE: usize =
        cairn_rpc::limits::data_message(cairn_rpc::limits::MAX_PAYLOAD_CEILING);
    let server = cairn_rpc::limits::server(COORDINATOR_STREAMS)
        .initial_stream_window_size(4 << 20)
        .initial_connection_window_size(16 << 20)
        // A follower names the leader on every answer (`cairn-leader`).
        .layer(HintLayer(replica.clone()))
        // A response's memory reservation is held until its body has been sent.
        .layer(budget::HoldLayer)
        // Bearer tokens and roles (`--auth-tokens`), before a byte of a body is read.
        .layer(config.auth.layer(&config.cluster, config.tls.as_ref()))
        .layer(
            cairn_rpc::limits::MessageLimits::new(cairn_rpc::limits::CONTROL_MESSAGE)
                .rpc("/cairn.v1.Coordinator/UploadSnapshotPart", UPLOAD_MESSAGE),
        )
        // A follower forwards the clients' calls to the leader, on their behalf (after
        // the auth layer: the caller is known).
        .layer(leader::forward::ForwardLayer::new(
            replica,
            config.tls.clone(),
        ))
        .add_service(health_service)
        .add_service(
            cairn_rpc::reflection::v1(cairn_rpc::reflection::COORDINATOR)
                .map_err(|e| RunError::Reflection(e.to_string()))?,
        )
        .add_service(
            cairn_rpc::reflection::v1alpha(cairn_rpc::reflection::COORDINATOR)
                .map_err(|e| RunError::Reflection(e.to_string()))?,
        )
        .add_service(
            pb::coordinator_server::CoordinatorServer::from_arc(service)
                .max_decoding_message_size(UPLOAD_MESSAGE),
        );
    // With TLS, the handshakes run in cairn-rpc's accept loop (mutual TLS: a client without
    // a certificate of the CA is refused there), with the certificate in force.
    let server = cairn_rpc::server::tls::serve(
        server,
        listener,
        config.tls.clone(),
        tls_metrics,
        stop_server.clone(),
    );
    let result = serve_beside_task(
        server,
        &mut state_task,
        &stop_server,
        &shutdown,
        &health,
        config.grace_period,
    )
    .await;
    stop.cancel();
    if let Some(task) = state_task {
        let _ = tokio::time::timeout(config.grace_period, task).await;
    }
    tracing::info!("coordinator stopped");
    result
}

/// Runs `server` while the coordinator's task (`task`) runs. Should the task end while the
/// server is meant to run (it panicked, or returned before `shutdown`), no request could be
/// answered any more: health turns NOT_SERVING (the Coordinator service and the server as
/// a whole, ""), the cause is logged at error level, the server is stopped through
/// `stop_server` (given `grace` to finish) and [`RunError::TaskEnded`] returned, so the
/// process exits non-zero and its supervisor restarts it. `task` is `None` once it ended.
async fn serve_beside_task<S>(
    server: S,
    task: &mut Option<JoinHandle<()>>,
    stop_server: &CancellationToken,
    shutdown: &CancellationToken,
    health: &HealthReporter,
    grace: Duration,
) -> Result<(), RunError>
where
    S: Future<Output = Result<(), tonic::transport::Error>>,
{
    let mut server = std::pin::pin!(server);
    let Some(handle) = task.as_mut() else {
        return Ok(server.await?);
    };
    let ended = tokio::select! {
        result = &mut server => return Ok(result?),
        ended = handle => ended,
    };
    *task = None;
    if shutdown.is_cancelled() {
        // The task ended for the shutdown: the server is finishing too.
        return Ok(server.await?);
    }
    let why = task_end(ended);
    health
        .set_not_serving::<pb::coordinator_server::CoordinatorServer<api::CoordinatorService>>()
        .await;
    health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    tracing::error!(
        "the coordinator's task ended unexpectedly ({why}); health is NOT_SERVING and the \
         coordinator exits so that its supervisor restarts it"
    );
    stop_server.cancel();
    // Long-lived streams (a health watch) may hold a graceful shutdown: bounded.
    if tokio::time::timeout(grace, server).await.is_err() {
        tracing::warn!("the server did not stop within {grace:?}; leaving it");
    }
    Err(RunError::TaskEnded(why))
}

/// How the coordinator's task ended, in words.
fn task_end(ended: Result<(), JoinError>) -> String {
    match ended {
        Ok(()) => "it returned".into(),
        Err(e) if e.is_panic() => {
            let payload = e.into_panic();
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-text payload".into());
            format!("it panicked: {message}")
        }
        Err(e) => format!("it was cancelled: {e}"),
    }
}

/// Watches the metadata store's own files: if they disappear or are replaced while the
/// coordinator runs (everything it writes would be lost at the next start), it logs an
/// error and turns its health NOT_SERVING, so that a supervisor or an operator sees it.
async fn watch_store_files(
    kv: Arc<AnyKv>,
    health: tonic_health::server::HealthReporter,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Err(e) = kv.check_files() {
            tracing::error!(
                "{e}: the metadata store's files are gone; this coordinator is NOT_SERVING \
                 and must be restarted (snapshot ids stay above those the daemons saw)"
            );
            health
                .set_not_serving::<pb::coordinator_server::CoordinatorServer<api::CoordinatorService>>()
                .await;
            health
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_server::Health;
    use tonic_health::server::HealthService;

    const COORDINATOR: &str = "cairn.v1.Coordinator";

    async fn status(health: &HealthReporter, service: &str) -> i32 {
        HealthService::from_health_reporter(health.clone())
            .check(tonic::Request::new(HealthCheckRequest {
                service: service.into(),
            }))
            .await
            .expect("registered")
            .into_inner()
            .status
    }

    /// A server that runs until told to stop.
    fn fake_server(
        stop: &CancellationToken,
    ) -> impl Future<Output = Result<(), tonic::transport::Error>> + use<> {
        let stop = stop.clone();
        async move {
            stop.cancelled().await;
            Ok(())
        }
    }

    async fn serving() -> HealthReporter {
        let (health, _service) = tonic_health::server::health_reporter();
        health
            .set_serving::<pb::coordinator_server::CoordinatorServer<api::CoordinatorService>>()
            .await;
        health
    }

    #[tokio::test]
    async fn a_task_that_panics_turns_health_not_serving_and_stops_the_server() {
        let health = serving().await;
        assert_eq!(
            status(&health, COORDINATOR).await,
            ServingStatus::Serving as i32
        );
        let shutdown = CancellationToken::new();
        let stop_server = shutdown.child_token();
        let mut task = Some(tokio::spawn(async {
            tokio::task::yield_now().await;
            panic!("remainder by zero");
        }));
        let result = serve_beside_task(
            fake_server(&stop_server),
            &mut task,
            &stop_server,
            &shutdown,
            &health,
            Duration::from_secs(5),
        )
        .await;
        let e = result.unwrap_err().to_string();
        assert!(e.contains("panicked: remainder by zero"), "{e}");
        assert!(task.is_none() && stop_server.is_cancelled());
        assert!(!shutdown.is_cancelled());
        for service in [COORDINATOR, ""] {
            assert_eq!(
                status(&health, service).await,
                ServingStatus::NotServing as i32,
                "{service:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_task_that_returns_early_is_an_error_too() {
        let health = serving().await;
        let shutdown = CancellationToken::new();
        let stop_server = shutdown.child_token();
        let mut task = Some(tokio::spawn(async {}));
        let result = serve_beside_task(
            fake_server(&stop_server),
            &mut task,
            &stop_server,
            &shutdown,
            &health,
            Duration::from_secs(5),
        )
        .await;
        assert!(matches!(result, Err(RunError::TaskEnded(why)) if why.contains("returned")));
    }

    #[tokio::test]
    async fn a_server_that_never_stops_is_left_after_the_grace() {
        let health = serving().await;
        let shutdown = CancellationToken::new();
        let stop_server = shutdown.child_token();
        let mut task = Some(tokio::spawn(async {}));
        let result = serve_beside_task(
            std::future::pending(),
            &mut task,
            &stop_server,
            &shutdown,
            &health,
            Duration::from_millis(10),
        )
        .await;
        assert!(matches!(result, Err(RunError::TaskEnded(_))));
    }

    #[tokio::test]
    async fn on_shutdown_the_task_ending_first_is_no_error() {
        let health = serving().await;
        let shutdown = CancellationToken::new();
        let stop_server = shutdown.child_token();
        let ended = shutdown.clone();
        let mut task = Some(tokio::spawn(async move { ended.cancelled().await }));
        shutdown.cancel();
        let result = serve_beside_task(
            fake_server(&stop_server),
            &mut task,
            &stop_server,
            &shutdown,
            &health,
            Duration::from_secs(5),
        )
        .await;
        assert!(result.is_ok(), "{result:?}");
        assert_eq!(
            status(&health, COORDINATOR).await,
            ServingStatus::Serving as i32
        );
    }
}
