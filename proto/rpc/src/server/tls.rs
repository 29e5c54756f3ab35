//! The TLS flags every daemon takes (`--tls-cert`, `--tls-key`, `--tls-ca`, the optional
//! `--tls-crl`, and their `CAIRN_TLS_*` variables), read into a [`Tls`] at start (the warning
//! a daemon logs without them is [`Auth::start`](super::auth::Auth::start)'s). The configurations themselves are
//! built in [`crate::tls`].
//!
//! A daemon's TLS port: [`incoming`] accepts TCP connections itself and runs each rustls
//! handshake in its own task (bounded by [`HANDSHAKE_TIMEOUT`]) with the server
//! configuration in force at that moment, and hands tonic the
//! `tokio_rustls::server::TlsStream`s (so `Request::peer_certs` works). At most
//! [`MAX_HANDSHAKES`] handshakes are in flight on a port, at most [`MAX_HANDSHAKES_PER_IP`]
//! from one client address: a connection beyond either is closed at once (reason `busy`),
//! so that idle unauthenticated connections cannot use up the file descriptors. [`watch`]
//! reloads the files when they change and on SIGHUP. A refused handshake is logged once per
//! (client address, reason), at most [`REFUSAL_LINES_PER_SECOND`] lines a second, and
//! every one is counted in `cairn_tls_handshake_refused_total{reason}`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::tls::{HANDSHAKE_TIMEOUT, Reload, Tls, certificate_problem};

/// `--tls-cert`, `--tls-key`, `--tls-ca`: all three or none; `--tls-crl` with them.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "TLS")]
pub struct TlsArgs {
    /// This process's certificate (PEM; leaf first). Daemons: with --tls-key and --tls-ca,
    /// every port serves mutual TLS (client certificates required: the coordinator's, a
    /// daemon's peer port, its application port — where the application must present this
    /// node's certificate — and /metrics) and a daemon's links to the coordinator and to
    /// peers use it. cairn-bank: its node's certificate. cairnctl: the client certificate to present
    /// (with --tls-key; --tls-ca alone only checks the server's). `cairnctl certs init`
    /// writes a development CA and certificates. Daemons re-read the three files when they
    /// change (checked every second) and on SIGHUP: a good new pair serves new connections,
    /// those up stay up; a bad one is logged and the old kept. A daemon's own certificate
    /// must be valid now and signed by --tls-ca.
    #[arg(long, global = true, env = "CAIRN_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, global = true, env = "CAIRN_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The CA (PEM) that peers', the coordinator's and clients' certificates must chain to.
    #[arg(long, global = true, env = "CAIRN_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Certificate revocation lists (PEM, one or more X509 CRL blocks, e.g. of `openssl ca
    /// -gencrl`) of the --tls-ca CA. Daemons (with the three other flags): their ports
    /// refuse a client certificate a CRL revokes (reason `revoked`); the file is re-read with
    /// the others (a bad new one is logged and the old kept), so a revocation applies to new
    /// connections within a second; connections that are up stay up. A CRL past its next
    /// update still applies; certificates of issuers no CRL speaks for are let through.
    /// Clients do not check servers' certificates against it (cairnctl ignores it).
    #[arg(long, global = true, env = "CAIRN_TLS_CRL")]
    pub tls_crl: Option<PathBuf>,
}

impl TlsArgs {
    /// A daemon's TLS: `None` without any flag; all three (and --tls-crl if given) read
    /// and checked with all three; otherwise an error naming the missing flag (or the flag
    /// and file at fault).
    pub fn load_daemon(&self) -> Result<Option<Tls>, String> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) if self.tls_crl.is_some() => {
                Err("--tls-crl needs --tls-cert, --tls-key and --tls-ca".into())
            }
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => {
                Tls::for_daemon_with_crl(ca, cert, key, self.tls_crl.as_deref())
                    .map(Some)
                    .map_err(|e| e.to_string())
            }
            _ => Err(format!(
                "TLS needs --tls-cert, --tls-key and --tls-ca together; {} missing",
                self.missing().join(", ")
            )),
        }
    }

    /// A client's TLS (cairnctl): `None` without any flag; with --tls-ca, the CA and, if
    /// given, the identity of --tls-cert and --tls-key (both or neither). --tls-crl is not
    /// read: a client does not check the server's certificate against CRLs.
    pub fn load_client(&self) -> Result<Option<Tls>, String> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => Ok(None),
            (None, None, Some(ca)) => Tls::from_files(ca, None)
                .map(Some)
                .map_err(|e| e.to_string()),
            (Some(cert), Some(key), Some(ca)) => Tls::from_files(ca, Some((cert, key)))
                .map(Some)
                .map_err(|e| e.to_string()),
            (_, _, None) => Err("--tls-cert and --tls-key need --tls-ca".into()),
            _ => Err(format!(
                "a client certificate needs --tls-cert and --tls-key together; {} missing",
                self.missing().join(", ")
            )),
        }
    }

    fn missing(&self) -> Vec<&'static str> {
        [
            ("--tls-cert", self.tls_cert.is_none()),
            ("--tls-key", self.tls_key.is_none()),
            ("--tls-ca", self.tls_ca.is_none()),
        ]
        .into_iter()
        .filter(|(_, missing)| *missing)
        .map(|(flag, _)| flag)
        .collect()
    }
}

/// The most TLS handshakes in flight on one port; a connection beyond is closed at once
/// and counted as refused (`busy`).
pub const MAX_HANDSHAKES: usize = 256;

/// The most TLS handshakes in flight on one port from one client IP address; a connection
/// beyond is closed at once and counted as refused (`busy`).
pub const MAX_HANDSHAKES_PER_IP: usize = 16;

/// The most refusal lines logged in a second (every refusal is counted all the same).
pub const REFUSAL_LINES_PER_SECOND: u32 = 10;

/// How often, at most, a failing `accept` is logged.
const ACCEPT_ERROR_LOG_EVERY: Duration = Duration::from_secs(5);

/// `cairn_tls_handshake_refused_total{reason}`, `cairn_tls_handshakes_in_flight` and
/// `cairn_tls_reloads_total`.
#[derive(Debug, Clone, Default)]
pub struct TlsMetrics {
    refused: Family<Vec<(String, String)>, Counter>,
    in_flight: Gauge,
    reloads: Counter,
}

impl TlsMetrics {
    /// Registers both (also without TLS: they stay at zero).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "cairn_tls_handshake_refused",
            "TLS handshakes refused, by reason (expired, not_yet_valid, unknown_issuer, \
             revoked, no_certificate, plaintext, timeout, busy, ...)",
            self.refused.clone(),
        );
        registry.register(
            "cairn_tls_handshakes_in_flight",
            "TLS handshakes in progress on this process's ports",
            self.in_flight.clone(),
        );
        registry.register(
            "cairn_tls_reloads",
            "Times new --tls-cert/--tls-key/--tls-ca/--tls-crl files went in force",
            self.reloads.clone(),
        );
    }

    fn refused(&self, reason: &str) {
        self.refused
            .get_or_create(&vec![("reason".to_owned(), reason.to_owned())])
            .inc();
    }
}

/// Reloads `tls`'s files when they change (checked every second) and on SIGHUP, until
/// `stop`; counts each reload that put new files in force.
pub fn watch(tls: &Tls, metrics: &TlsMetrics, stop: CancellationToken) {
    let reload = {
        let tls = tls.clone();
        let metrics = metrics.clone();
        move |force: bool| {
            if tls.reload(force) == Reload::Reloaded {
                metrics.reloads.inc();
            }
        }
    };
    super::watch_files("the --tls-* files", reload, stop);
}

/// Why a handshake failed: a metric label, and words.
#[derive(Debug)]
struct Refusal {
    reason: &'static str,
    words: String,
}

impl Refusal {
    fn new(reason: &'static str, words: impl Into<String>) -> Self {
        Self {
            reason,
            words: words.into(),
        }
    }

    /// From the error of tokio-rustls' `accept`.
    fn of(error: &std::io::Error) -> Self {
        let rustls_error = error
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>());
        match rustls_error {
            Some(rustls::Error::InvalidCertificate(e)) => {
                let (reason, words) = certificate_problem(e);
                Self::new(reason, format!("the client's certificate {words}"))
            }
            Some(rustls::Error::InvalidCertRevocationList(e)) => Self::new(
                "bad_crl",
                format!(
                    "a --tls-crl CRL could not be used to check the client's certificate: {e:?}"
                ),
            ),
            Some(rustls::Error::NoCertificatesPresented) => {
                Self::new("no_certificate", "the client presented no certificate")
            }
            Some(rustls::Error::AlertReceived(alert)) => Self::new(
                "client_refused",
                format!("the client refused this server's certificate ({alert:?})"),
            ),
            Some(other) => Self::new("handshake", format!("TLS handshake failed: {other}")),
            None => Self::new("closed", format!("the connection failed: {error}")),
        }
    }
}

/// The (client address, reason) pairs logged, at most [`LOGGED`] (the oldest is
/// forgotten first), and the rate limit of the lines: at most
/// [`REFUSAL_LINES_PER_SECOND`] a second.
#[derive(Default)]
struct Logged {
    pairs: HashSet<(IpAddr, &'static str)>,
    order: VecDeque<(IpAddr, &'static str)>,
    /// When the current second began, and the lines logged in it.
    window: Option<(Instant, u32)>,
    /// Lines not logged because of the rate limit since the last one logged.
    suppressed: u64,
}

const LOGGED: usize = 1024;

/// Whether to log a refusal.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Yes; `suppressed` lines were left out (rate limit) since the last one.
    Log { suppressed: u64 },
    /// No: this (client address, reason) was logged already.
    Known,
    /// No: too many lines this second (the pair is not remembered, to be logged later).
    Suppressed,
}

impl Logged {
    /// Whether to log a refusal of this pair at `now` (and remembers it if so).
    fn first(&mut self, ip: IpAddr, reason: &'static str, now: Instant) -> Verdict {
        if self.pairs.contains(&(ip, reason)) {
            return Verdict::Known;
        }
        let lines = match &mut self.window {
            Some((start, lines))
                if now.saturating_duration_since(*start) < Duration::from_secs(1) =>
            {
                lines
            }
            window => &mut window.insert((now, 0)).1,
        };
        if *lines >= REFUSAL_LINES_PER_SECOND {
            self.suppressed += 1;
            return Verdict::Suppressed;
        }
        *lines += 1;
        if self.order.len() == LOGGED
            && let Some(oldest) = self.order.pop_front()
        {
            self.pairs.remove(&oldest);
        }
        self.order.push_back((ip, reason));
        self.pairs.insert((ip, reason));
        Verdict::Log {
            suppressed: std::mem::take(&mut self.suppressed),
        }
    }
}

/// Admission to a handshake: at most [`MAX_HANDSHAKES`] in flight on a port, at most
/// [`MAX_HANDSHAKES_PER_IP`] from one client address.
struct Gate {
    total: Arc<Semaphore>,
    total_max: usize,
    per_ip: Arc<Mutex<HashMap<IpAddr, usize>>>,
    per_ip_max: usize,
    in_flight: Gauge,
}

/// A handshake in flight: its place in the [`Gate`], given back when dropped.
struct Pass {
    _permit: OwnedSemaphorePermit,
    ip: IpAddr,
    per_ip: Arc<Mutex<HashMap<IpAddr, usize>>>,
    in_flight: Gauge,
}

impl Gate {
    fn new(total: usize, per_ip_max: usize, in_flight: Gauge) -> Self {
        Self {
            total: Arc::new(Semaphore::new(total)),
            total_max: total,
            per_ip: Arc::default(),
            per_ip_max,
            in_flight,
        }
    }

    /// A place for a handshake from `ip`, or the `busy` refusal saying which bound is hit.
    /// IPv6 clients are counted by their /64 (one host often holds a whole /64).
    fn enter(&self, ip: IpAddr) -> Result<Pass, Refusal> {
        let ip = client_key(ip);
        let Ok(permit) = self.total.clone().try_acquire_owned() else {
            return Err(Refusal::new(
                "busy",
                format!(
                    "{} TLS handshakes were in flight on this port, the most there may be; \
                     closed at once",
                    self.total_max
                ),
            ));
        };
        {
            let mut per_ip = self.per_ip.lock().unwrap_or_else(|e| e.into_inner());
            let count = per_ip.entry(ip).or_insert(0);
            if *count >= self.per_ip_max {
                return Err(Refusal::new(
                    "busy",
                    format!(
                        "{} TLS handshakes from this address were in flight, the most there \
                         may be; closed at once",
                        self.per_ip_max
                    ),
                ));
            }
            *count += 1;
        }
        self.in_flight.inc();
        Ok(Pass {
            _permit: permit,
            ip,
            per_ip: self.per_ip.clone(),
            in_flight: self.in_flight.clone(),
        })
    }
}

/// The address a client's handshakes are counted under: an IPv4 address (also when
/// IPv4-mapped), or an IPv6 address's /64.
fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        },
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        self.in_flight.dec();
        let mut per_ip = self.per_ip.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = per_ip.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                per_ip.remove(&self.ip);
            }
        }
    }
}

/// An error a gRPC server's service may answer with (tonic's `BoxError`).
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Serves `router` on `listener` until `stop` is cancelled: with `tls`, mutual TLS through
/// [`incoming`]'s accept loop (the configuration in force, handshakes bounded and their
/// refusals counted in `metrics`); without, plain TCP. TCP_NODELAY is on either way. The
/// one way the daemons' and the bank's gRPC ports serve.
pub async fn serve<L, ResBody>(
    router: tonic::transport::server::Router<L>,
    listener: TcpListener,
    tls: Option<Tls>,
    metrics: TlsMetrics,
    stop: CancellationToken,
) -> Result<(), tonic::transport::Error>
where
    L: tower_layer::Layer<tonic::service::Routes>,
    L::Service: tower_service::Service<http::Request<tonic::body::Body>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    <L::Service as tower_service::Service<http::Request<tonic::body::Body>>>::Future: Send,
    <L::Service as tower_service::Service<http::Request<tonic::body::Body>>>::Error:
        Into<BoxError> + Send,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    match tls {
        Some(tls) => {
            let connections = incoming(listener, tls, metrics, stop.clone());
            router
                .serve_with_incoming_shutdown(connections, stop.cancelled_owned())
                .await
        }
        None => {
            let connections =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            router
                .serve_with_incoming_shutdown(connections, stop.cancelled_owned())
                .await
        }
    }
}

/// Accepts TCP connections on `listener` until `stop` and runs each TLS handshake in its
/// own task, with the server configuration of `tls` in force when the connection came
/// (a reload applies to new connections; those up keep their session). TCP_NODELAY is on.
/// At most [`MAX_HANDSHAKES`] handshakes are in flight, at most [`MAX_HANDSHAKES_PER_IP`]
/// from one client address, each for at most [`HANDSHAKE_TIMEOUT`]: a connection beyond
/// is closed at once and refused as `busy`. The stream yields the connections whose
/// handshake succeeded, for tonic's `serve_with_incoming_shutdown`; a refused one is
/// counted in `metrics` and logged at warn level once per (client address, reason), at
/// most [`REFUSAL_LINES_PER_SECOND`] lines a second.
pub fn incoming(
    listener: TcpListener,
    tls: Tls,
    metrics: TlsMetrics,
    stop: CancellationToken,
) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
    incoming_for(listener, tls, metrics, stop, Clients::Certified)
}

/// Whom a TLS port's handshake admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clients {
    /// Clients with a certificate of the CA (mutual TLS): every gRPC port.
    Certified,
    /// Browsers too: a certificate is checked if presented, not required
    /// ([`Tls::browser_server_config`]): the coordinator's console.
    Browsers,
}

/// [`incoming`], admitting `clients`.
pub fn incoming_for(
    listener: TcpListener,
    tls: Tls,
    metrics: TlsMetrics,
    stop: CancellationToken,
    clients: Clients,
) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let logged = Arc::new(Mutex::new(Logged::default()));
    let gate = Gate::new(
        MAX_HANDSHAKES,
        MAX_HANDSHAKES_PER_IP,
        metrics.in_flight.clone(),
    );
    tokio::spawn(async move {
        // When a failing accept was last logged, and the failures since.
        let mut accept_logged: Option<Instant> = None;
        let mut accept_errors = 0u64;
        loop {
            let (stream, peer) = tokio::select! {
                _ = stop.cancelled() => return,
                _ = tx.closed() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors, most likely: let some close.
                        accept_errors += 1;
                        if accept_logged.is_none_or(|at| at.elapsed() >= ACCEPT_ERROR_LOG_EVERY) {
                            tracing::warn!(
                                "accept: {e} ({accept_errors} failed accept(s) since the last \
                                 line; logged at most every {ACCEPT_ERROR_LOG_EVERY:?})"
                            );
                            accept_logged = Some(Instant::now());
                            accept_errors = 0;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let pass = match gate.enter(peer.ip()) {
                Ok(pass) => pass,
                Err(busy) => {
                    drop(stream);
                    refused(&metrics, &logged, peer, busy);
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let config = match clients {
                Clients::Certified => tls.server_config(),
                Clients::Browsers => tls.browser_server_config(),
            };
            let Some(config) = config else {
                return;
            };
            let tx = tx.clone();
            let metrics = metrics.clone();
            let logged = logged.clone();
            tokio::spawn(async move {
                // `pass` is held until the handshake is over (and a refused one's linger).
                let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(stream, config));
                let (refusal, stream) = match handshake.await {
                    Ok(Ok(stream)) => {
                        drop(pass);
                        let _ = tx.send(Ok(stream)).await;
                        return;
                    }
                    Ok(Err(refused)) => refused,
                    Err(_) => (
                        Refusal::new(
                            "timeout",
                            format!("no TLS handshake within {HANDSHAKE_TIMEOUT:?}"),
                        ),
                        None,
                    ),
                };
                refused(&metrics, &logged, peer, refusal);
                if let Some(stream) = stream {
                    linger(stream).await;
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// The handshake; a refusal comes with the connection when rustls' alert is to be
/// delivered.
async fn handshake(
    stream: TcpStream,
    config: Arc<rustls::ServerConfig>,
) -> Result<TlsStream<TcpStream>, (Refusal, Option<TcpStream>)> {
    // A TLS connection starts with a handshake record (content type 22).
    let mut first = [0u8; 1];
    match stream.peek(&mut first).await {
        Ok(0) => {
            return Err((
                Refusal::new("closed", "closed before a TLS handshake"),
                None,
            ));
        }
        Ok(_) if first[0] != 22 => {
            return Err((
                Refusal::new("plaintext", "the client spoke plaintext (not TLS)"),
                None,
            ));
        }
        Ok(_) => {}
        Err(e) => {
            return Err((
                Refusal::new("closed", format!("the connection failed: {e}")),
                None,
            ));
        }
    }
    tokio_rustls::TlsAcceptor::from(config)
        .accept(stream)
        .into_fallible()
        .await
        .map_err(|(e, stream)| (Refusal::of(&e), Some(stream)))
}

/// Closes a refused connection so that the client reads rustls' alert (which says why)
/// rather than a reset: no more writes, and what the client sent after its part of the
/// handshake read and dropped, for a moment at most.
async fn linger(mut stream: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = stream.shutdown().await;
    let drain = async {
        let mut buffer = [0u8; 4096];
        while let Ok(n) = stream.read(&mut buffer).await {
            if n == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

fn refused(metrics: &TlsMetrics, logged: &Mutex<Logged>, peer: SocketAddr, refusal: Refusal) {
    metrics.refused(refusal.reason);
    // A connection closed without a word (a TCP health probe, a port scan) is only counted.
    let verdict = if refusal.reason == "closed" {
        Verdict::Known
    } else {
        logged.lock().unwrap_or_else(|e| e.into_inner()).first(
            peer.ip(),
            refusal.reason,
            Instant::now(),
        )
    };
    match verdict {
        Verdict::Log { suppressed } => {
            if suppressed > 0 {
                tracing::warn!(
                    "{suppressed} refused TLS connection(s) not logged (at most \
                     {REFUSAL_LINES_PER_SECOND} lines a second); \
                     cairn_tls_handshake_refused_total counts them all"
                );
            }
            tracing::warn!(
                client = %peer.ip(),
                reason = refusal.reason,
                "refused a TLS connection from {}: {} (logged once per client address and reason)",
                peer.ip(),
                refusal.words
            );
        }
        Verdict::Known | Verdict::Suppressed => {
            tracing::debug!(client = %peer, reason = refusal.reason, "refused a TLS connection: {}", refusal.words);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: Verdict = Verdict::Log { suppressed: 0 };

    #[test]
    fn logged_once_per_address_and_reason_in_bounded_memory() {
        let mut logged = Logged::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let mut now = Instant::now();
        assert_eq!(logged.first(a, "expired", now), LOG);
        assert_eq!(logged.first(a, "expired", now), Verdict::Known);
        assert_eq!(logged.first(a, "plaintext", now), LOG);
        for i in 0..LOGGED as u32 {
            // A second apart: no rate limit.
            now += Duration::from_secs(1);
            assert_eq!(
                logged.first(IpAddr::from(i.to_be_bytes()), "expired", now),
                LOG
            );
        }
        assert_eq!(logged.pairs.len(), LOGGED);
        assert_eq!(logged.order.len(), LOGGED);
        // Forgotten: logged again.
        now += Duration::from_secs(1);
        assert_eq!(logged.first(a, "expired", now), LOG);
    }

    #[test]
    fn at_most_ten_refusal_lines_a_second() {
        let mut logged = Logged::default();
        let start = Instant::now();
        let ip = |i: u32| IpAddr::from(i.to_be_bytes());
        for i in 0..REFUSAL_LINES_PER_SECOND {
            assert_eq!(logged.first(ip(i), "busy", start), LOG);
        }
        let later = start + Duration::from_millis(900);
        for i in 100..150 {
            assert_eq!(logged.first(ip(i), "busy", later), Verdict::Suppressed);
        }
        // Not remembered when suppressed: the next second logs them, saying how many
        // lines were left out.
        let next = start + Duration::from_secs(1);
        assert_eq!(
            logged.first(ip(100), "busy", next),
            Verdict::Log { suppressed: 50 }
        );
        assert_eq!(logged.first(ip(101), "busy", next), LOG);
        assert_eq!(logged.first(ip(100), "busy", next), Verdict::Known);
    }

    #[test]
    fn handshakes_in_flight_are_bounded_per_port_and_per_address() {
        let in_flight = Gauge::default();
        let gate = Gate::new(4, 2, in_flight.clone());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let c: IpAddr = "10.0.0.3".parse().unwrap();
        let a1 = gate.enter(a).unwrap();
        let a2 = gate.enter(a).unwrap();
        let refusal = gate.enter(a).err().unwrap();
        assert_eq!(refusal.reason, "busy");
        assert!(
            refusal.words.contains("2 TLS handshakes from this address"),
            "{}",
            refusal.words
        );
        let _b1 = gate.enter(b).unwrap();
        let _b2 = gate.enter(b).unwrap();
        assert_eq!(in_flight.get(), 4);
        // The port is full: c is refused too.
        let refusal = gate.enter(c).err().unwrap();
        assert_eq!(refusal.reason, "busy");
        assert!(
            refusal
                .words
                .contains("4 TLS handshakes were in flight on this port"),
            "{}",
            refusal.words
        );
        // A refusal took no place.
        assert_eq!(in_flight.get(), 4);
        drop(a1);
        let _c1 = gate.enter(c).unwrap();
        assert!(gate.enter(a).is_err(), "the port is full again");
        drop(a2);
        let _a3 = gate.enter(a).unwrap();
        assert_eq!(in_flight.get(), 4);
        // An address with nothing in flight is forgotten.
        drop(_a3);
        assert!(!gate.per_ip.lock().unwrap().contains_key(&a));
        assert_eq!(in_flight.get(), 3);
    }

    #[test]
    fn ipv6_clients_are_counted_by_their_slash_64() {
        let gate = Gate::new(8, 2, Gauge::default());
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let _one = gate.enter(ip("2001:db8:1:2::1")).unwrap();
        let _two = gate.enter(ip("2001:db8:1:2:ffff::9")).unwrap();
        assert!(gate.enter(ip("2001:db8:1:2::3")).is_err(), "same /64");
        assert!(gate.enter(ip("2001:db8:1:3::1")).is_ok(), "another /64");
        assert_eq!(client_key(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
    }

    #[test]
    fn all_three_or_none() {
        assert!(TlsArgs::default().load_daemon().unwrap().is_none());
        let args = TlsArgs {
            tls_cert: Some("c.pem".into()),
            ..Default::default()
        };
        let e = args.load_daemon().unwrap_err();
        assert!(e.contains("--tls-key, --tls-ca missing"), "{e}");
        let args = TlsArgs {
            tls_crl: Some("crl.pem".into()),
            ..Default::default()
        };
        let e = args.load_daemon().unwrap_err();
        assert_eq!(e, "--tls-crl needs --tls-cert, --tls-key and --tls-ca");
    }
}
