//! `cairn-coordinator`: turns the node daemons into a product. It keeps the members'
//! sessions, starts snapshots and follows them with a [`cairn_core::SnapshotTracker`],
//! stores every part's bytes as content-defined chunks in a blob store and the metadata
//! as JSON in etcd (or an embedded file store), verifies each cut, and answers users.
//!
//! # Layout
//!
//! - [`config`]: the configuration, [`CoordinatorConfig`].
//! - `state`: the one task that owns membership, the tracker and the schedule.
//! - [`policy`]: the snapshot policy's stored and wire forms.
//! - `service`: the `cairn.v1.Coordinator` gRPC service.
//! - [`store`]: the metadata store (etcd or a file) and its JSON records.
//! - [`blob`]: the content-addressed chunk store.
//! - [`error`]: the coordinator's [`Error`] and its gRPC codes.
//! - `limits`: the bounds on what requests carry (labels, reasons, timeouts).

#![forbid(unsafe_code)]

pub mod blob;
pub mod config;
pub mod error;
mod limits;
mod metrics;
mod parts;
pub mod policy;
mod records_conv;
mod roster;
mod service;
mod state;
pub mod store;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use cairn_proto::v1 as pb;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::{JoinError, JoinHandle};
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

pub use config::CoordinatorConfig;
pub use error::Error;

use blob::BlobStore;
use store::{AnyKv, EtcdKv, FileKv, Keys};

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
    /// Recovery after a restart failed.
    #[error("recovery: {0}")]
    Recover(#[from] Error),
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
pub async fn run(
    config: CoordinatorConfig,
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let keys = Keys::new(&config.cluster);
    let stop = CancellationToken::new();
    let kv = Arc::new(if config.etcd.is_empty() {
        let path = config.data_dir.join("metadata.json");
        tracing::info!(path = %path.display(), "embedded metadata store");
        AnyKv::File(Box::new(FileKv::open(&path, &keys.members()).await?))
    } else {
        tracing::info!(endpoints = ?config.etcd, "etcd metadata store");
        AnyKv::Etcd(Box::new(EtcdKv::connect(&config.etcd, stop.clone()).await?))
    });
    let blob_dir = config
        .blob_dir
        .clone()
        .unwrap_or_else(|| config.data_dir.join("blobs"));
    let blobs = BlobStore::open(&blob_dir)
        .await
        .map_err(|error| RunError::Blob {
            path: blob_dir.display().to_string(),
            error,
        })?;
    let metrics = metrics::CoordinatorMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    config.auth.register(&mut registry);
    let tls_metrics = cairn_sdk::cli::tls::TlsMetrics::default();
    tls_metrics.register(&mut registry);
    if let Some(tls) = &config.tls {
        cairn_sdk::cli::tls::watch(tls, &tls_metrics, stop.clone());
    }
    config
        .auth
        .start("the coordinator's API", config.tls.is_some(), stop.clone());
    if let Some(listener) = metrics_listener {
        tokio::spawn(cairn_sdk::cli::metrics::serve(
            listener,
            Arc::new(registry),
            stop.clone(),
            config.tls.clone().map(|tls| (tls, tls_metrics.clone())),
        ));
    }
    let (health, health_service) = tonic_health::server::health_reporter();
    let (tx, rx) = mpsc::channel(1024);
    let mut state = state::State::new(
        metrics,
        state::Settings {
            cluster: config.cluster.clone(),
            retention: config.retention,
            topology: config.topology.clone(),
            policy: config.policy.clone(),
            auto_restore: config.auto_restore,
            restore_timeout: config.restore_timeout,
        },
        store::Metadata::new(kv.clone(), keys.clone()),
        blobs.clone(),
        config.max_concurrent,
        tx.clone(),
        health.clone(),
    );
    state.recover().await?;
    tokio::spawn(watch_store_files(kv.clone(), health.clone(), stop.clone()));
    let mut state_task = Some(tokio::spawn(state.run(rx, shutdown.clone())));

    let service = service::CoordinatorService {
        tx: tx.clone(),
        meta: store::Metadata::new(kv, keys),
        blobs,
        default_timeout: config.default_timeout,
        sessions: AtomicU64::new(0),
    };
    drop(tx);
    health
        .set_serving::<pb::coordinator_server::CoordinatorServer<service::CoordinatorService>>()
        .await;
    let addr = listener.local_addr().ok();
    tracing::info!(?addr, cluster = %config.cluster, "coordinator serving");
    // The server stops on `shutdown`, or when the coordinator's task ends by itself.
    let stop_server = shutdown.child_token();
    // Windows of a few MiB: parts stream in pieces of up to about a MiB (h2's default 64 KiB
    // window would make each wait for window updates), and what a connection can leave
    // unread stays small. Uploads carry recorded messages up to the largest payload a
    // daemon allows; every other call is a small control message (cairn_proto::limits).
    // A daemon's connection carries its session, its uploads and a fetch; cairnctl's one call.
    const COORDINATOR_STREAMS: u32 = 64;
    // A piece holds recorded messages up to 1 MiB plus the one that crossed it.
    const UPLOAD_MESSAGE: usize =
        cairn_proto::limits::data_message(cairn_proto::limits::MAX_PAYLOAD_CEILING);
    let server = cairn_proto::limits::server(COORDINATOR_STREAMS)
        .initial_stream_window_size(4 << 20)
        .initial_connection_window_size(16 << 20)
        // Bearer tokens and roles (`--auth-tokens`), before a byte of a body is read.
        .layer(config.auth.layer(&config.cluster))
        .layer(
            cairn_proto::limits::MessageLimits::new(cairn_proto::limits::CONTROL_MESSAGE)
                .rpc("/cairn.v1.Coordinator/UploadSnapshotPart", UPLOAD_MESSAGE),
        )
        .add_service(health_service)
        .add_service(
            cairn_proto::reflection::v1(cairn_proto::reflection::COORDINATOR)
                .map_err(|e| RunError::Reflection(e.to_string()))?,
        )
        .add_service(
            cairn_proto::reflection::v1alpha(cairn_proto::reflection::COORDINATOR)
                .map_err(|e| RunError::Reflection(e.to_string()))?,
        )
        .add_service(
            pb::coordinator_server::CoordinatorServer::new(service)
                .max_decoding_message_size(UPLOAD_MESSAGE),
        );
    // With TLS, the handshakes run in cairn_sdk's accept loop (mutual TLS: a client without
    // a certificate of the CA is refused there), with the certificate in force.
    let (tls, stop_serving) = (config.tls.clone(), stop_server.clone());
    let server = async move {
        match tls {
            Some(tls) => {
                server
                    .serve_with_incoming_shutdown(
                        cairn_sdk::cli::tls::incoming(
                            listener,
                            tls,
                            tls_metrics,
                            stop_serving.clone(),
                        ),
                        stop_serving.cancelled_owned(),
                    )
                    .await
            }
            None => {
                server
                    .serve_with_incoming_shutdown(
                        tonic::transport::server::TcpIncoming::from(listener)
                            .with_nodelay(Some(true)),
                        stop_serving.cancelled_owned(),
                    )
                    .await
            }
        }
    };
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
        .set_not_serving::<pb::coordinator_server::CoordinatorServer<service::CoordinatorService>>()
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
                .set_not_serving::<pb::coordinator_server::CoordinatorServer<service::CoordinatorService>>()
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
            .set_serving::<pb::coordinator_server::CoordinatorServer<service::CoordinatorService>>()
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
