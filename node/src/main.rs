//! `cairn-node`: the cairn node daemon. See `cairn-node --help`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use cairn_core::NodeId;
use cairn_node::config::{parse_channel, parse_peer};
use cairn_node::{Listeners, NodeConfig};
use cairn_rpc::server as cli;
use clap::{Parser, ValueEnum};

/// The cairn node daemon: runs beside one application process, carries its messages to
/// the other nodes over one gRPC stream per directed channel, and takes consistent
/// snapshots (Chandy–Lamport, aligned, unaligned) without pausing it.
///
/// Every flag can also be set by the environment variable shown.
#[derive(Debug, Parser)]
#[command(name = "cairn-node", version = cairn_rpc::version::VERSION, max_term_width = 100)]
struct Args {
    /// This node's id (stable: e.g. n1, or a StatefulSet pod name).
    #[arg(long, env = "CAIRN_NODE_ID")]
    node_id: String,
    /// The cluster's name; peers of another cluster are refused.
    #[arg(long, env = "CAIRN_CLUSTER", default_value = "cairn")]
    cluster: String,
    /// Without --coordinator: every member as ID=HOST:PORT (its peer address), this node
    /// included; comma-separated or repeated. With --coordinator: not allowed (the
    /// coordinator hands out the members and their addresses).
    #[arg(long = "peer", env = "CAIRN_PEERS", value_delimiter = ',')]
    peers: Vec<String>,
    /// Without --coordinator: directed channels as FROM>TO, comma-separated or repeated.
    /// Default: a full mesh of the members. With --coordinator: not allowed (the
    /// coordinator's topology applies).
    #[arg(long = "channel", env = "CAIRN_CHANNELS", value_delimiter = ',')]
    channels: Vec<String>,
    /// Address the peer service (peers, NodeAdmin, health, reflection) listens on.
    #[arg(long, env = "CAIRN_PEER_LISTEN", default_value = "0.0.0.0:7100")]
    peer_listen: SocketAddr,
    /// Address the application session listens on. Loopback by default: it is a sidecar
    /// port for the application beside this daemon.
    #[arg(long, env = "CAIRN_APP_LISTEN", default_value = "127.0.0.1:7200")]
    app_listen: SocketAddr,
    /// The coordinator's address (HOST:PORT), or its replicas' (comma-separated or
    /// repeated, at most 16: a:7000,b:7000,c:7000; or one Service name). The daemon
    /// registers with the leader and takes its members and channels from it. It tries the
    /// addresses in turn; a replica that is not the leader names it (`cairn-leader`), and
    /// the daemon goes there at once (at most 8 times in a row, then in turn with backoff).
    /// A coordinator that does not answer HTTP/2 pings within about 4 s is left for the
    /// next. A coordinator of a lower leadership term than one this daemon has seen is
    /// refused (a deposed leader). Without --coordinator the daemon runs alone with
    /// --peer, and snapshots are started through NodeAdmin/InitiateSnapshot.
    #[arg(long, env = "CAIRN_COORDINATOR", value_delimiter = ',')]
    coordinator: Vec<String>,
    /// With --coordinator: the address (HOST:PORT) peers reach this daemon's --peer-listen
    /// at, handed out by the coordinator. Default: --peer-listen, unless that is 0.0.0.0.
    #[arg(long, env = "CAIRN_ADVERTISE")]
    advertise: Option<String>,
    #[command(flatten)]
    blob: cairn_blob::BlobArgs,
    /// Messages each channel may hold in this daemon before the sender is pushed back: the
    /// most credits an incoming channel grants (fewer once the application's pace is
    /// measured: about 100 ms of its work) and the longest an outgoing queue grows.
    #[arg(long, env = "CAIRN_CHANNEL_BUFFER", default_value_t = 16_384)]
    channel_buffer: usize,
    /// Buffer debloating at the sender (off unless given; e.g. 100ms, 1ms-60s): while a
    /// peer drains a channel slower than this daemon fills it, the channel's outgoing queue
    /// (with what is on the wire unacknowledged) holds only this long of the peer's measured
    /// pace (at least 256 messages, at most --channel-buffer; keep it well above the round
    /// trip to peers); the rest of a backlog waits in the sending application. What an
    /// unaligned snapshot records then stays about the same whatever the buffer, and aligned
    /// markers wait behind less. A peer that keeps up is not bounded.
    #[arg(long, env = "CAIRN_QUEUE_TARGET", value_parser = humantime::parse_duration)]
    queue_target: Option<Duration>,
    /// Largest application payload, in bytes.
    #[arg(long, env = "CAIRN_MAX_PAYLOAD", default_value_t = 4 << 20)]
    max_payload: usize,
    /// Allow NodeAdmin/InjectFault (for tests; never in production).
    #[arg(long, env = "CAIRN_FAULT_INJECTION")]
    fault_injection: bool,
    /// How long shutdown may take to drain outgoing channels (e.g. 10s, 500ms).
    #[arg(long, env = "CAIRN_GRACE_PERIOD", default_value = "10s", value_parser = humantime::parse_duration)]
    grace_period: Duration,
    /// On SIGTERM/SIGINT, after draining the outgoing channels, leave the cluster: the
    /// coordinator removes this node (as `cairnctl nodes remove`), so later snapshots span
    /// the rest. For a scale-down; not for a restart or a rolling update, where the node is
    /// to come back (without it, a stopped node stays a member and snapshots wait for it).
    /// Needs --coordinator.
    #[arg(long, env = "CAIRN_LEAVE_ON_SHUTDOWN")]
    leave_on_shutdown: bool,
    /// Address of the Prometheus /metrics endpoint; none: no endpoint.
    #[arg(long, env = "CAIRN_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Log format.
    #[arg(long, env = "CAIRN_LOG_FORMAT", value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
    /// Log filter, in tracing's EnvFilter syntax (e.g. info, cairn_node=debug).
    #[arg(long, env = "CAIRN_LOG", default_value = "info")]
    log: String,
    /// The bearer tokens people and tools must present to NodeAdmin (`authorization:
    /// Bearer <token>`): one `ROLE SHA256HEX [NAME]` a line, ROLE viewer, operator or
    /// admin; `#` comments. Reloaded when it changes and on SIGHUP. `cairnctl auth token`
    /// makes a token and its line. None: NodeAdmin is open. Peer channels are not governed
    /// by tokens.
    #[arg(long, env = "CAIRN_AUTH_TOKENS")]
    auth_tokens: Option<std::path::PathBuf>,
    #[command(flatten)]
    tls: cli::tls::TlsArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

fn main() -> ExitCode {
    let args: Args = match cli::parse_or_exit() {
        Ok(args) => args,
        Err(code) => return code,
    };
    let mut config = match config(&args) {
        Ok(config) => config,
        Err(e) => return cli::usage_error(e),
    };
    config.auth = match cli::auth::Auth::from_flag(args.auth_tokens.as_deref()) {
        Ok(auth) => auth,
        Err(e) => return cli::usage_error(e),
    };
    config.tls = match args.tls.load_daemon() {
        Ok(tls) => tls,
        Err(e) => return cli::usage_error(e),
    };
    if let Err(e) = config.auth.require_tls(config.tls.is_some()) {
        return cli::usage_error(e);
    }
    cli::init_logging(&args.log, matches!(args.log_format, LogFormat::Json));
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let listeners = async {
            Ok::<_, ExitCode>(Listeners {
                peer: cli::bind(args.peer_listen, "--peer-listen").await?,
                app: cli::bind(args.app_listen, "--app-listen").await?,
                metrics: cli::bind_optional(args.metrics_listen, "--metrics-listen").await?,
            })
        };
        let listeners = match listeners.await {
            Ok(l) => l,
            Err(code) => return code,
        };
        let shutdown = cli::shutdown_on_signal();
        match cairn_node::run(config, listeners, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!("{e}");
                ExitCode::FAILURE
            }
        }
    })
}

fn config(args: &Args) -> Result<NodeConfig, cairn_node::ConfigError> {
    let mut peers = BTreeMap::new();
    for text in &args.peers {
        let (id, addr) = parse_peer(text)?;
        peers.insert(id, addr);
    }
    let mut config = NodeConfig::new(
        NodeId::new(args.node_id.clone()),
        args.cluster.clone(),
        peers,
    );
    if !args.channels.is_empty() {
        config.channels = Some(
            args.channels
                .iter()
                .map(|c| parse_channel(c))
                .collect::<Result<_, _>>()?,
        );
    }
    if args.channel_buffer == 0 {
        return Err(cairn_node::ConfigError::Invalid(
            "--channel-buffer must be at least 1".into(),
        ));
    }
    config.channel_buffer = args.channel_buffer;
    if let Some(target) = args.queue_target
        && !(Duration::from_millis(1)..=Duration::from_secs(60)).contains(&target)
    {
        return Err(cairn_node::ConfigError::Invalid(format!(
            "--queue-target must be between 1ms and 60s, not {}",
            humantime::format_duration(target)
        )));
    }
    config.queue_target = args.queue_target;
    config.max_payload = args.max_payload;
    config.fault_injection = args.fault_injection;
    config.grace_period = args.grace_period;
    config.coordinators = args
        .coordinator
        .iter()
        .map(|a| a.trim().to_owned())
        .collect();
    config.advertise = args.advertise.clone().or_else(|| {
        (!config.coordinators.is_empty() && !args.peer_listen.ip().is_unspecified())
            .then(|| args.peer_listen.to_string())
    });
    if args.blob.blob_store.is_some() && config.coordinators.is_empty() {
        return Err(cairn_node::ConfigError::Invalid(
            "--blob-store needs --coordinator (without one, parts stay in this daemon)".into(),
        ));
    }
    config.blob = args.blob.clone();
    if args.leave_on_shutdown && config.coordinators.is_empty() {
        return Err(cairn_node::ConfigError::Invalid(
            "--leave-on-shutdown needs --coordinator (a static daemon has no cluster to leave)"
                .into(),
        ));
    }
    config.leave_on_shutdown = args.leave_on_shutdown;
    config.topology()?;
    Ok(config)
}
