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

#![forbid(unsafe_code)]

pub mod blob;
pub mod config;
pub mod error;
mod metrics;
pub mod policy;
mod records_conv;
mod service;
mod state;
pub mod store;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use cairn_proto::v1 as pb;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

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
    let blob_dir = config.data_dir.join("blobs");
    let blobs = BlobStore::open(&blob_dir)
        .await
        .map_err(|error| RunError::Blob {
            path: blob_dir.display().to_string(),
            error,
        })?;
    let metrics = metrics::CoordinatorMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    if let Some(listener) = metrics_listener {
        tokio::spawn(cairn_node::metrics::serve(
            listener,
            Arc::new(registry),
            stop.clone(),
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
        kv.clone(),
        blobs.clone(),
        config.max_concurrent,
        tx.clone(),
        health.clone(),
    );
    state.recover().await?;
    let state_task = tokio::spawn(state.run(rx, shutdown.clone()));

    let service = service::CoordinatorService {
        tx: tx.clone(),
        kv,
        blobs,
        keys,
        default_timeout: config.default_timeout,
        sessions: AtomicU64::new(0),
    };
    drop(tx);
    health
        .set_serving::<pb::coordinator_server::CoordinatorServer<service::CoordinatorService>>()
        .await;
    let addr = listener.local_addr().ok();
    tracing::info!(?addr, cluster = %config.cluster, "coordinator serving");
    // Large windows: parts stream in (and restores out) in pieces of up to a few hundred
    // KiB; h2's default 64 KiB window would make each piece wait for window updates.
    let result = tonic::transport::Server::builder()
        .initial_stream_window_size(16 << 20)
        .initial_connection_window_size(32 << 20)
        .add_service(health_service)
        .add_service(
            cairn_proto::reflection::v1().map_err(|e| RunError::Reflection(e.to_string()))?,
        )
        .add_service(
            cairn_proto::reflection::v1alpha().map_err(|e| RunError::Reflection(e.to_string()))?,
        )
        .add_service(
            pb::coordinator_server::CoordinatorServer::new(service)
                .max_decoding_message_size(64 << 20),
        )
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown.cancelled_owned(),
        )
        .await;
    stop.cancel();
    let _ = tokio::time::timeout(config.grace_period, state_task).await;
    tracing::info!("coordinator stopped");
    Ok(result?)
}
