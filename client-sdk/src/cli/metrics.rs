//! The `/metrics` endpoint both daemons serve: a Prometheus registry as text over HTTP,
//! beside whatever other routes a daemon adds (the coordinator's console and API).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::connect_info::Connected;
use axum::response::IntoResponse;
use axum::serve::IncomingStream;
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use super::tls::TlsMetrics;
use crate::tls::Tls;

/// How an HTTP client is connected: what a handler of the routes given to [`serve`] takes
/// as `ConnectInfo<ClientCert>` to check a role (`Auth::check`'s `cert`).
#[derive(Debug, Clone)]
pub enum ClientCert {
    /// A plaintext connection.
    Plain,
    /// A TLS connection and the leaf certificate (DER) its client presented — empty, a
    /// certificate naming nobody, if it presented none (the servers require one).
    Tls(Arc<[u8]>),
}

impl ClientCert {
    /// The certificate to check, `None` on plaintext.
    pub fn der(&self) -> Option<&[u8]> {
        match self {
            ClientCert::Plain => None,
            ClientCert::Tls(der) => Some(der),
        }
    }
}

impl Connected<IncomingStream<'_, TcpListener>> for ClientCert {
    fn connect_info(_: IncomingStream<'_, TcpListener>) -> Self {
        ClientCert::Plain
    }
}

impl Connected<IncomingStream<'_, TlsListener>> for ClientCert {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Self {
        let (_, connection) = stream.io().get_ref();
        let first = connection.peer_certificates().and_then(|c| c.first());
        ClientCert::Tls(first.map_or_else(|| Arc::from(&[][..]), |c| Arc::from(c.as_ref())))
    }
}

/// Serves `registry` as Prometheus text at `GET /metrics`, and `routes` beside it, until
/// `shutdown`; with `tls` (the daemon's `--tls-*`), over mutual TLS like its gRPC ports (a
/// scraper presents a certificate of the CA: Prometheus' `tls_config`
/// `cert_file`/`key_file`), refusals counted in the same metrics.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
    tls: Option<(Tls, TlsMetrics)>,
    routes: Option<axum::Router>,
) -> std::io::Result<()> {
    let app = routes.unwrap_or_default().route(
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
            let app = app.into_make_service_with_connect_info::<ClientCert>();
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        }
        Some((tls, metrics)) => {
            let local = listener.local_addr()?;
            let incoming = super::tls::incoming(listener, tls, metrics, shutdown.clone());
            let app = app.into_make_service_with_connect_info::<ClientCert>();
            axum::serve(TlsListener { incoming, local }, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        }
    }
}

/// The connections of [`super::tls::incoming`] as an axum listener.
pub struct TlsListener {
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
