//! What every cairn binary does the same way at start: parse its flags (a bad one exits
//! with code 64), set up logging, bind its listeners with a message naming the flag, and
//! turn SIGTERM/SIGINT into a cancellation; the `/metrics` endpoint of the two
//! daemons ([`metrics`]); their bearer tokens and roles ([`auth`]); and their TLS flags
//! ([`tls`]).
//!
//! The server runtime of cairn's daemons, behind this crate's `server` feature: the node
//! and the coordinator enable it, as does `cairn-cli` (`cairnctl`, `cairn-bank`); the SDK
//! an application links does not, and so links neither clap, tracing-subscriber, humantime nor
//! prometheus-client.

use std::net::SocketAddr;
use std::process::ExitCode;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod auth;
pub mod identity;
pub mod metrics;
pub mod tls;

/// The exit code of a bad configuration (sysexits' EX_USAGE).
pub const EX_USAGE: u8 = 64;

/// Parses the command line; `--help` and `--version` exit 0, a bad flag exits 64, each
/// after printing what clap says.
/// Also installs the process's TLS crypto provider (rustls' ring), before any TLS use.
pub fn parse_or_exit<T: clap::Parser>() -> Result<T, ExitCode> {
    crate::tls::install_crypto_provider();
    T::try_parse().map_err(|e| {
        let _ = e.print();
        if e.use_stderr() {
            ExitCode::from(EX_USAGE)
        } else {
            ExitCode::SUCCESS
        }
    })
}

/// A usage error: prints it and returns exit code 64.
pub fn usage_error(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(EX_USAGE)
}

/// Standard error that never fails: a log line that cannot be written (the reader of a pipe
/// went away, a full disk) is dropped. tracing-subscriber reports a failed write with
/// `eprintln!`, which panics when stderr itself is broken — in whatever task was logging,
/// such as the one that turns SIGTERM into a shutdown — so a daemon whose log collector died
/// would crash or ignore SIGTERM.
struct LossyStderr;

impl std::io::Write for LossyStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

/// Logs to stderr through `tracing`, filtered by `filter` (EnvFilter syntax; a bad one falls
/// back to `info`), with colours only on a terminal — or as JSON lines when `json`, one
/// object per event with `timestamp`, `level`, `target`, `message` and the event's fields
/// at the top (not nested under `fields`: what log shippers index), and the innermost span
/// as `span` (`{"name":"snapshot","snapshot":7}`: how a snapshot's lines are followed).
pub fn init_logging(filter: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| LossyStderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if json {
        builder
            .with_ansi(false)
            .json()
            .flatten_event(true)
            .with_span_list(false)
            .init();
    } else {
        builder.init();
    }
}

/// Binds `addr`, or explains which flag named an address that cannot be used.
pub async fn bind(addr: SocketAddr, flag: &str) -> Result<TcpListener, ExitCode> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| usage_error(format!("cannot listen on {addr} ({flag}): {e}")))
}

/// As [`bind`], for an optional address.
pub async fn bind_optional(
    addr: Option<SocketAddr>,
    flag: &str,
) -> Result<Option<TcpListener>, ExitCode> {
    match addr {
        Some(addr) => bind(addr, flag).await.map(Some),
        None => Ok(None),
    }
}

/// A token cancelled by the first SIGTERM or SIGINT.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                    _ = int.recv() => tracing::info!("SIGINT: shutting down"),
                }
                cancel.cancel();
            }
            _ => tracing::error!("cannot install signal handlers"),
        }
    });
    token
}

/// Calls `reload(false)` every second and `reload(true)` on each SIGHUP, until `stop`: how
/// the daemons re-read the files they were given (`what` names them in the log, e.g.
/// `--auth-tokens`). `reload` compares what it reads with what is in force itself.
pub fn watch_files(
    what: &'static str,
    reload: impl Fn(bool) + Clone + Send + Sync + 'static,
    stop: CancellationToken,
) {
    let poll = reload.clone();
    let poll_stop = stop.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is immediate: the files were just read.
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
            tracing::warn!("cannot install a SIGHUP handler; {what} is still polled");
            return;
        };
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                got = hup.recv() => {
                    if got.is_none() {
                        return;
                    }
                    tracing::info!("SIGHUP: reloading {what}");
                    reload(true);
                }
            }
        }
    });
}
