//! The `/metrics` endpoint both daemons serve: a Prometheus registry as text over HTTP.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::response::IntoResponse;
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use super::tls::TlsMetrics;
use crate::tls::Tls;

/// Serves `registry` as Prometheus text at `GET /metrics` until `shutdown`; with `tls`
/// (the daemon's `--tls-*`), over mutual TLS like its gRPC ports (a scraper presents a
/// certificate of the CA: Prometheus' `tls_config` `cert_file`/`key_file`), refusals
/// counted in the same metrics.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
    tls: Option<(Tls, TlsMetrics)>,
) -> std::io::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let mut body = String::new();
                match prometheus_client::encoding::text::encode(&mut body, &registry) {
                    Ok(()) => (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        body,
                    )
                        .into_response(),
                    Err(e) => (
                        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                        format!("encoding failed: {e}"),
                    )
                        .into_response(),
                }
            }
        }),
    );
    match tls {
        None => {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        }
        Some((tls, metrics)) => {
            let local = listener.local_addr()?;
            let incoming = super::tls::incoming(listener, tls, metrics, shutdown.clone());
            axum::serve(TlsListener { incoming, local }, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        }
    }
}

/// The connections of [`super::tls::incoming`] as an axum listener.
struct TlsListener {
    incoming: ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>>,
    local: SocketAddr,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.incoming.next().await {
                Some(Ok(stream)) => {
                    let Ok(peer) = stream.get_ref().0.peer_addr() else {
                        continue;
                    };
                    return (stream, peer);
                }
                Some(Err(_)) => continue,
                // The accept loop stopped (shutdown): no more connections.
                None => std::future::pending().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
