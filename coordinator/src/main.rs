//! `cairn-coordinator`. See `cairn-coordinator --help`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use cairn_coordinator::CoordinatorConfig;
use cairn_sdk::cli;
use clap::Parser;

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
    /// A file of directed channels, one FROM>TO per line (a ring, a DAG…); only the nodes it
    /// names may register. Default: a full mesh of every node that registers.
    #[arg(long, env = "CAIRN_TOPOLOGY")]
    topology: Option<PathBuf>,
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

fn main() -> ExitCode {
    let args: Args = match cli::parse_or_exit() {
        Ok(args) => args,
        Err(code) => return code,
    };
    if args.max_concurrent == 0 {
        return cli::usage_error("--max-concurrent must be at least 1");
    }
    let topology = match &args.topology {
        None => None,
        Some(path) => match std::fs::read_to_string(path) {
            Err(e) => return cli::usage_error(format!("--topology {}: {e}", path.display())),
            Ok(text) => match cairn_coordinator::config::parse_topology(&text) {
                Ok(t) => Some(t),
                Err(e) => return cli::usage_error(format!("--topology {}: {e}", path.display())),
            },
        },
    };
    cli::init_logging(&args.log, args.log_format == "json");
    let Ok(runtime) = tokio::runtime::Runtime::new() else {
        eprintln!("error: cannot start the runtime");
        return ExitCode::FAILURE;
    };
    runtime.block_on(async {
        let listener = match cli::bind(args.listen, "--listen").await {
            Ok(l) => l,
            Err(code) => return code,
        };
        let metrics = match cli::bind_optional(args.metrics_listen, "--metrics-listen").await {
            Ok(l) => l,
            Err(code) => return code,
        };
        let shutdown = cli::shutdown_on_signal();
        let mut config = CoordinatorConfig::new(args.cluster, args.data_dir);
        config.etcd = args.etcd;
        config.default_timeout = args.snapshot_timeout;
        config.max_concurrent = args.max_concurrent;
        config.retention = args.retention;
        config.topology = topology;
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
