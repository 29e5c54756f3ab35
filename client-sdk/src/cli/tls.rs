//! The TLS flags every daemon takes (`--tls-cert`, `--tls-key`, `--tls-ca` and their
//! `CAIRN_TLS_*` variables), read into a [`Tls`] at start (the warning
//! a daemon logs without them is [`Auth::start`](super::auth::Auth::start)'s). The configurations themselves are
//! built in [`crate::tls`].
//!
//! A daemon's TLS port: [`incoming`] accepts TCP connections itself and runs each rustls
//! handshake in its own task (bounded by [`HANDSHAKE_TIMEOUT`]) with the server
//! configuration in force at that moment, and hands tonic the
//! `tokio_rustls::server::TlsStream`s (so `Request::peer_certs` works). [`watch`] reloads
//! the files when they change and on SIGHUP. A refused handshake is logged once per
//! (client address, reason) and counted in `cairn_tls_handshake_refused_total{reason}`.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::tls::{HANDSHAKE_TIMEOUT, Reload, Tls, certificate_problem};

/// `--tls-cert`, `--tls-key`, `--tls-ca`: all three or none.
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
}

impl TlsArgs {
    /// A daemon's TLS: `None` without any flag; all three read and checked with all
    /// three; otherwise an error naming the missing flag (or the flag and file at fault).
    pub fn load_daemon(&self) -> Result<Option<Tls>, String> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Tls::for_daemon(ca, cert, key)
                .map(Some)
                .map_err(|e| e.to_string()),
            _ => Err(format!(
                "TLS needs --tls-cert, --tls-key and --tls-ca together; {} missing",
                self.missing().join(", ")
            )),
        }
    }

    /// A client's TLS (cairnctl): `None` without any flag; with --tls-ca, the CA and, if
    /// given, the identity of --tls-cert and --tls-key (both or neither).
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

/// `cairn_tls_handshake_refused_total{reason}` and `cairn_tls_reloads_total`.
#[derive(Debug, Clone, Default)]
pub struct TlsMetrics {
    refused: Family<Vec<(String, String)>, Counter>,
    reloads: Counter,
}

impl TlsMetrics {
    /// Registers both (also without TLS: they stay at zero).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "cairn_tls_handshake_refused",
            "TLS handshakes refused, by reason (expired, not_yet_valid, unknown_issuer, \
             no_certificate, plaintext, timeout, ...)",
            self.refused.clone(),
        );
        registry.register(
            "cairn_tls_reloads",
            "Times new --tls-cert/--tls-key/--tls-ca files went in force",
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
    let poll = reload.clone();
    let poll_stop = stop.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = poll_stop.cancelled() => return,
                _ = tick.tick() => poll(false),
            }
        }
    });
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            tracing::warn!("cannot install a SIGHUP handler; the TLS files are still polled");
            return;
        };
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                got = hup.recv() => {
                    if got.is_none() {
                        return;
                    }
                    tracing::info!("SIGHUP: reloading --tls-cert, --tls-key and --tls-ca");
                    reload(true);
                }
            }
        }
    });
}

/// Why a handshake failed: a metric label, and words.
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

/// The (client address, reason) pairs logged, at most [`LOGGED`]: the oldest is
/// forgotten first.
#[derive(Default)]
struct Logged(VecDeque<(IpAddr, &'static str)>);

const LOGGED: usize = 1024;

impl Logged {
    /// Whether this pair is new (and remembers it).
    fn first(&mut self, ip: IpAddr, reason: &'static str) -> bool {
        if self.0.contains(&(ip, reason)) {
            return false;
        }
        if self.0.len() == LOGGED {
            self.0.pop_front();
        }
        self.0.push_back((ip, reason));
        true
    }
}

/// Accepts TCP connections on `listener` until `stop` and runs each TLS handshake in its
/// own task, with the server configuration of `tls` in force when the connection came
/// (a reload applies to new connections; those up keep their session). TCP_NODELAY is on.
/// The stream yields the connections whose handshake succeeded, for tonic's
/// `serve_with_incoming_shutdown`; a refused one is counted in `metrics` and logged at
/// warn level once per (client address, reason).
pub fn incoming(
    listener: TcpListener,
    tls: Tls,
    metrics: TlsMetrics,
    stop: CancellationToken,
) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let logged = Arc::new(Mutex::new(Logged::default()));
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                _ = stop.cancelled() => return,
                _ = tx.closed() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors, most likely: let some close.
                        tracing::warn!("accept: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = stream.set_nodelay(true);
            let Some(config) = tls.server_config() else {
                return;
            };
            let tx = tx.clone();
            let metrics = metrics.clone();
            let logged = logged.clone();
            tokio::spawn(async move {
                let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(stream, config));
                let (refusal, stream) = match handshake.await {
                    Ok(Ok(stream)) => {
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
    let quiet = refusal.reason == "closed";
    let first = logged
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .first(peer.ip(), refusal.reason);
    if first && !quiet {
        tracing::warn!(
            client = %peer.ip(),
            reason = refusal.reason,
            "refused a TLS connection from {}: {} (logged once per client address and reason)",
            peer.ip(),
            refusal.words
        );
    } else {
        tracing::debug!(client = %peer, reason = refusal.reason, "refused a TLS connection: {}", refusal.words);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logged_once_per_address_and_reason_in_bounded_memory() {
        let mut logged = Logged::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        assert!(logged.first(a, "expired"));
        assert!(!logged.first(a, "expired"));
        assert!(logged.first(a, "plaintext"));
        for i in 0..LOGGED as u32 {
            logged.first(IpAddr::from(i.to_be_bytes()), "expired");
        }
        assert_eq!(logged.0.len(), LOGGED);
        // Forgotten: logged again.
        assert!(logged.first(a, "expired"));
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
    }
}
