//! `cairn-coordinator`. See `cairn-coordinator --help`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use cairn_coordinator::CoordinatorConfig;
use clap::Parser;
use tokio_util::sync::CancellationToken;

/// The cairn coordinator: node daemons register with it; it starts snapshots, collects
/// and verifies them, stores their bytes as deduplicated chunks and their metadata in
/// etcd (or, without --etcd, in an embedded file store), and serves cairn.v1.Coordinator.
///
/// Every flag can also be set by the environment variable shown.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to serve on.
    #[arg(long, env = "CAIRN_LISTEN", default_value = "0.0.0.0:7000")]
    listen: SocketAddr,
    /// The cluster's name.
    #[arg(long, env = "CAIRN_CLUSTER", default_value = "cairn")]
    cluster: String,
    /// etcd endpoints (http://host:2379), comma-separated. None: the embedded store.
    #[arg(long, env = "CAIRN_ETCD", value_delimiter = ',')]
    etcd: Vec<String>,
    /// Directory for the blob store (and the embedded metadata store).
    #[arg(long, env = "CAIRN_DATA_DIR", default_value = "cairn-data")]
    data_dir: PathBuf,
    /// Timeout of a snapshot that names none (e.g. 30s).
    #[arg(long, env = "CAIRN_SNAPSHOT_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    snapshot_timeout: Duration,
    /// Most snapshots in flight at once.
    #[arg(long, env = "CAIRN_MAX_CONCURRENT", default_value_t = 4)]
    max_concurrent: usize,
    /// Completed snapshots to keep (older ones and their unshared chunks are deleted); 0 keeps all.
    #[arg(long, env = "CAIRN_RETENTION", default_value_t = 0)]
    retention: usize,
    /// Address of the Prometheus /metrics endpoint; none: no endpoint.
    #[arg(long, env = "CAIRN_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "CAIRN_LOG", default_value = "info")]
    log: String,
    /// Log format: human or json.
    #[arg(long, env = "CAIRN_LOG_FORMAT", default_value = "human", value_parser = ["human", "json"])]
    log_format: String,
}

const EX_USAGE: u8 = 64;

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if e.use_stderr() => {
            let _ = e.print();
            return ExitCode::from(EX_USAGE);
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    if args.max_concurrent == 0 {
        eprintln!("error: --max-concurrent must be at least 1");
        return ExitCode::from(EX_USAGE);
    }
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if args.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
    let Ok(runtime) = tokio::runtime::Runtime::new() else {
        eprintln!("error: cannot start the runtime");
        return ExitCode::FAILURE;
    };
    runtime.block_on(async {
        let listener = match tokio::net::TcpListener::bind(args.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("error: cannot listen on {} (--listen): {e}", args.listen);
                return ExitCode::from(EX_USAGE);
            }
        };
        let shutdown = CancellationToken::new();
        let signal = shutdown.clone();
        tokio::spawn(async move {
            use tokio::signal::unix::{SignalKind, signal as unix_signal};
            if let (Ok(mut term), Ok(mut int)) = (
                unix_signal(SignalKind::terminate()),
                unix_signal(SignalKind::interrupt()),
            ) {
                tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
                signal.cancel();
            }
        });
        let mut config = CoordinatorConfig::new(args.cluster, args.data_dir);
        config.etcd = args.etcd;
        config.default_timeout = args.snapshot_timeout;
        config.max_concurrent = args.max_concurrent;
        config.retention = args.retention;
        let metrics = match args.metrics_listen {
            None => None,
            Some(addr) => match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => Some(l),
                Err(e) => {
                    eprintln!("error: cannot listen on {addr} (--metrics-listen): {e}");
                    return ExitCode::from(EX_USAGE);
                }
            },
        };
        match cairn_coordinator::run(config, listener, metrics, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!("{e}");
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        }
    })
}
