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

mod process;

pub use process::register_process;

/// What `/metrics` answers with: Prometheus' classic text format, which Prometheus,
/// `promtool check metrics` and every scraper read, and which [`classic`] makes of the
/// registry's OpenMetrics text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The registry's OpenMetrics text (what `prometheus-client` writes) in Prometheus' classic
/// text format, so that the body is what its content type says: a counter's `HELP` and
/// `TYPE` name its samples (`cairn_snapshots_total`, where OpenMetrics says
/// `cairn_snapshots`), an info metric is a gauge named `…_info`, and OpenMetrics' own lines
/// (`# UNIT`, `# EOF`) go. Samples are the same in both.
pub fn classic(open_metrics: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(open_metrics.len());
    // A family's HELP comes before its TYPE, which says what to call it.
    let mut help: Option<&str> = None;
    for line in open_metrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest.split_once(' ').map_or("", |(_, text)| text));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.rsplit_once(' ').unwrap_or((rest, "unknown"));
            let (name, kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "gauge" | "histogram" | "summary" => (name.to_owned(), kind),
                _ => (name.to_owned(), "untyped"),
            };
            if let Some(text) = help.take() {
                let _ = writeln!(out, "# HELP {name} {text}");
            }
            let _ = writeln!(out, "# TYPE {name} {kind}");
            continue;
        }
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// How an HTTP client is connected: what a handler of the routes given to [`serve`] takes
/// as `ConnectInfo<ClientCert>` to check a role (`Auth::check`'s `cert`).
#[derive(Debug, Clone)]
pub enum ClientCert {
    /// A plaintext connection.
    Plain,
    /// A TLS connection and the certificate chain its client presented, leaf first —
    /// empty, a certificate naming nobody, if it presented none (only the console's port
    /// admits such a connection: a browser).
    Tls(Arc<[rustls::pki_types::CertificateDer<'static>]>),
}

impl ClientCert {
    /// The leaf certificate to check, `None` on plaintext.
    pub fn der(&self) -> Option<&[u8]> {
        match self {
            ClientCert::Plain => None,
            ClientCert::Tls(chain) => Some(chain.first().map_or(&[][..], |c| c.as_ref())),
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
        let chain = connection.peer_certificates().unwrap_or_default();
        ClientCert::Tls(chain.iter().map(|c| c.clone().into_owned()).collect())
    }
}

/// Serves `registry` as Prometheus' classic text ([`classic`]) at `GET /metrics`, and `routes` beside it, until
/// `shutdown`; with `tls` (the daemon's `--tls-*`), over mutual TLS like its gRPC ports (a
/// scraper presents a certificate of the CA: Prometheus' `tls_config`
/// `cert_file`/`key_file`), refusals counted in the same metrics.
///
/// `/metrics` needs the role `viewer` (`auth`'s table): a certificate with a role, or with
/// `--auth-tokens` a bearer token (Prometheus' `authorization: credentials_file`); a node's
/// certificate has no role. Open only on plaintext without tokens. On TLS every request's
/// certificate is checked again against the CA and CRLs in force, so a revocation reaches
/// connections already open.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
    tls: Option<(Tls, TlsMetrics)>,
    routes: Option<axum::Router>,
    auth: (super::auth::Auth, String),
) -> std::io::Result<()> {
    let scrape = axum::routing::get(move || {
        let registry = registry.clone();
        async move {
            let mut body = String::new();
            match prometheus_client::encoding::text::encode(&mut body, &registry) {
                Ok(()) => (
                    [(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)],
                    classic(&body),
                )
                    .into_response(),
                Err(e) => (
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    format!("encoding failed: {e}"),
                )
                    .into_response(),
            }
        }
    });
    let has_routes = routes.is_some();
    let gate = Gate {
        auth: auth.0,
        cluster: auth.1,
        tls: tls.as_ref().map(|(tls, _)| tls.clone()),
    };
    let app = routes.unwrap_or_default().route("/metrics", scrape).layer(
        axum::middleware::from_fn_with_state(Arc::new(gate), gate_request),
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
            // With routes (the coordinator's console) browsers may connect without a
            // certificate: their requests then need a token or the console's session.
            let clients = if has_routes {
                super::tls::Clients::Browsers
            } else {
                super::tls::Clients::Certified
            };
            let incoming =
                super::tls::incoming_for(listener, tls, metrics, shutdown.clone(), clients);
            let app = app.into_make_service_with_connect_info::<ClientCert>();
            axum::serve(TlsListener { incoming, local }, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        }
    }
}

/// What every HTTP request passes before its route: the certificate still good, and
/// `/metrics`' role.
struct Gate {
    auth: super::auth::Auth,
    cluster: String,
    tls: Option<Tls>,
}

async fn gate_request(
    axum::extract::State(gate): axum::extract::State<Arc<Gate>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::http::StatusCode;
    let cert = request
        .extensions()
        .get::<axum::extract::ConnectInfo<ClientCert>>()
        .map(|info| info.0.clone());
    let Some(cert) = cert else {
        // Fails closed: without the connection's kind no role can be checked.
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            "the connection's kind is unknown\n",
        )
            .into_response();
    };
    // A connection without a certificate (a browser on the console's port) has none to
    // check again: its requests authenticate otherwise, or are refused below.
    if let (Some(tls), ClientCert::Tls(chain)) = (&gate.tls, &cert)
        && !chain.is_empty()
        && let Err(why) = tls.check_client(chain)
    {
        return (
            StatusCode::UNAUTHORIZED,
            format!("this connection's client certificate is no longer accepted ({why})\n"),
        )
            .into_response();
    }
    if request.uri().path() == "/metrics"
        && let Err(status) =
            gate.auth
                .check("/metrics", request.headers(), cert.der(), &gate.cluster)
    {
        let code = match status.code() {
            tonic::Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            _ => StatusCode::FORBIDDEN,
        };
        return (code, format!("{}\n", status.message())).into_response();
    }
    next.run(request).await
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

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::Histogram;
    use prometheus_client::metrics::info::Info;
    use prometheus_client::registry::{Registry, Unit};

    use super::classic;

    #[test]
    fn the_registry_reads_as_classic_text_each_family_typed_by_its_samples_name() {
        let mut registry = Registry::default();
        let counter = Family::<Vec<(String, String)>, Counter>::default();
        counter
            .get_or_create(&vec![("status".into(), "completed".into())])
            .inc();
        registry.register("cairn_snapshots", "Snapshots ended", counter);
        registry.register("cairn_members", "Members", Gauge::<i64>::default());
        registry.register_with_unit(
            "cairn_snapshot_new",
            "Bytes stored anew",
            Unit::Bytes,
            Counter::<u64>::default(),
        );
        let histogram = Histogram::new([1.0]);
        histogram.observe(0.5);
        registry.register("cairn_snapshot_duration_seconds", "Duration", histogram);
        registry.register("cairn_build", "The build", Info::new(vec![("v", "1")]));
        let mut open_metrics = String::new();
        prometheus_client::encoding::text::encode(&mut open_metrics, &registry).unwrap();
        assert!(open_metrics.contains("# TYPE cairn_snapshots counter\n"));
        assert_eq!(
            classic(&open_metrics),
            "# HELP cairn_snapshots_total Snapshots ended.\n\
             # TYPE cairn_snapshots_total counter\n\
             cairn_snapshots_total{status=\"completed\"} 1\n\
             # HELP cairn_members Members.\n\
             # TYPE cairn_members gauge\n\
             cairn_members 0\n\
             # HELP cairn_snapshot_new_bytes_total Bytes stored anew.\n\
             # TYPE cairn_snapshot_new_bytes_total counter\n\
             cairn_snapshot_new_bytes_total 0\n\
             # HELP cairn_snapshot_duration_seconds Duration.\n\
             # TYPE cairn_snapshot_duration_seconds histogram\n\
             cairn_snapshot_duration_seconds_sum 0.5\n\
             cairn_snapshot_duration_seconds_count 1\n\
             cairn_snapshot_duration_seconds_bucket{le=\"1.0\"} 1\n\
             cairn_snapshot_duration_seconds_bucket{le=\"+Inf\"} 1\n\
             # HELP cairn_build_info The build.\n\
             # TYPE cairn_build_info gauge\n\
             cairn_build_info{v=\"1\"} 1\n"
        );
    }
}
