//! `cairn-coordinator`. See `cairn-coordinator --help`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use cairn_coordinator::CoordinatorConfig;
use cairn_coordinator::config::EtcdFlags;
use cairn_core::SnapshotMode;
use cairn_core::schedule::{MAX_CONCURRENT, MAX_TIMEOUT, Policy, PolicyField};
use cairn_rpc::server as cli;
use clap::Parser;

/// The cairn coordinator: node daemons register with it; it starts snapshots, collects
/// and verifies them, stores their bytes as deduplicated chunks and their metadata in
/// etcd (or, without --etcd, in an embedded file store), and serves cairn.v1.Coordinator.
///
/// Every flag can also be set by the environment variable shown.
#[derive(Debug, Parser)]
#[command(name = "cairn-coordinator", version = cairn_rpc::version::VERSION)]
struct Args {
    /// Address to serve on.
    #[arg(long, env = "CAIRN_LISTEN", default_value = "0.0.0.0:7000")]
    listen: SocketAddr,
    /// The cluster's name.
    #[arg(long, env = "CAIRN_CLUSTER", default_value = "cairn")]
    cluster: String,
    /// etcd endpoints (http://host:2379, or https://host:2379 with --etcd-ca),
    /// comma-separated. None: the embedded store.
    #[arg(long, env = "CAIRN_ETCD", value_delimiter = ',')]
    etcd: Vec<String>,
    /// With --etcd: the address (HOST:PORT) daemons, clients and the other replicas reach
    /// this replica at. It is the value of this replica's election key, and followers name
    /// the leader by it (`cairn-leader`). Default: --listen, or <hostname>:<port> when
    /// --listen is on every interface (0.0.0.0).
    #[arg(long, env = "CAIRN_ADVERTISE")]
    advertise: Option<String>,
    /// With --etcd: the TTL of the etcd lease each replica campaigns and leads with (2s to
    /// 5m; kept alive every TTL/3). Several replicas against one etcd elect one leader; a
    /// follower takes over about one TTL after the leader dies, and a leader that cannot
    /// renew its lease stops acting by itself after TTL − TTL/5.
    #[arg(long, env = "CAIRN_LEADER_LEASE_TTL", default_value = "5s", value_parser = humantime::parse_duration)]
    leader_lease_ttl: Duration,
    /// Directory for the blob store (and the embedded metadata store).
    #[arg(long, env = "CAIRN_DATA_DIR", default_value = "cairn-data")]
    data_dir: PathBuf,
    /// Directory of the blob store when --blob-store names none (default: <data-dir>/blobs):
    /// the same as --blob-store file:///DIR. Every object is written to a temporary file,
    /// fsynced and renamed; a full disk fails the snapshot.
    #[arg(long, env = "CAIRN_BLOB_DIR", conflicts_with = "blob_store")]
    blob_dir: Option<PathBuf>,
    #[command(flatten)]
    blob: cairn_blob::BlobArgs,
    /// Chunks and manifests that no snapshot refers to are deleted only once they are this
    /// old: a daemon may have written them for a snapshot still uploading.
    #[arg(long, env = "CAIRN_GC_GRACE", default_value = "5m", value_parser = humantime::parse_duration)]
    gc_grace: Duration,
    /// Remove a node whose daemon has been down this long (e.g. 10m), as `cairnctl nodes
    /// remove` would: snapshots go on without it. Off by default: a removed node's state is
    /// in no later snapshot, so a node that is only slow to come back (a long restart, a
    /// partition) would lose its place. At least 10s.
    #[arg(long, env = "CAIRN_REMOVE_AFTER", value_parser = humantime::parse_duration)]
    remove_after: Option<Duration>,
    /// Timeout of a snapshot that names none (e.g. 30s).
    #[arg(long, env = "CAIRN_SNAPSHOT_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    snapshot_timeout: Duration,
    /// Most snapshots in flight at once.
    #[arg(long, env = "CAIRN_MAX_CONCURRENT", default_value_t = 4)]
    max_concurrent: usize,
    /// MiB that responses may hold in memory at once, on every replica: GetSnapshot's inline
    /// data (reserved twice its size) and DiffSnapshots (16 MiB each). A call past it is
    /// refused with RESOURCE_EXHAUSTED naming ReadSnapshotData, which streams the data
    /// (`cairnctl snapshot export`). 16 to 65536.
    #[arg(long, env = "CAIRN_RESPONSE_MEMORY_MIB", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(16..=65536))]
    response_memory_mib: u64,
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
    /// Automatic recovery: when a member's daemon comes back with a new incarnation (it
    /// crashed or was restarted), restore the newest completed snapshot on the whole cluster
    /// once every member is connected.
    #[arg(long, env = "CAIRN_AUTO_RESTORE")]
    auto_restore: bool,
    /// How long a restore may take before it fails naming the nodes that did not apply
    /// their state.
    #[arg(long, env = "CAIRN_RESTORE_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    restore_timeout: Duration,
    /// The bearer tokens people and tools must present (`authorization: Bearer <token>`):
    /// one `ROLE SHA256HEX [NAME]` a line, ROLE viewer, operator or admin; `#` comments.
    /// Reloaded when it changes and on SIGHUP. `cairnctl auth token` makes a token and its
    /// line. None: the API is open to anyone who can reach it.
    #[arg(long, env = "CAIRN_AUTH_TOKENS")]
    auth_tokens: Option<PathBuf>,
    #[command(flatten)]
    tls: cli::tls::TlsArgs,
    #[command(flatten)]
    etcd_access: EtcdAccess,
    #[command(flatten)]
    schedule: Schedule,
}

/// The help heading of [`EtcdAccess`]'s flags.
const ETCD_HEADING: &str = "etcd TLS and authentication";

/// TLS and authentication to etcd (all need --etcd).
#[derive(Debug, clap::Args)]
struct EtcdAccess {
    /// PEM file of the CA that signed etcd's server certificate (etcd's --trusted-ca-file
    /// CA, usually). Required with https:// endpoints, refused with http:// ones.
    #[arg(long, help_heading = ETCD_HEADING, env = "CAIRN_ETCD_CA")]
    etcd_ca: Option<PathBuf>,
    /// PEM file of the client certificate shown to etcd, for an etcd started with
    /// --client-cert-auth (it must be signed by etcd's --trusted-ca-file CA). With etcd
    /// auth enabled and no --etcd-user, etcd takes the user from its CN. Needs --etcd-key.
    #[arg(long, help_heading = ETCD_HEADING, env = "CAIRN_ETCD_CERT")]
    etcd_cert: Option<PathBuf>,
    /// PEM file of the private key of --etcd-cert.
    #[arg(long, help_heading = ETCD_HEADING, env = "CAIRN_ETCD_KEY")]
    etcd_key: Option<PathBuf>,
    /// etcd user to authenticate as (etcd auth enabled); needs a password from
    /// --etcd-password-file, CAIRN_ETCD_PASSWORD or --etcd-password.
    #[arg(long, help_heading = ETCD_HEADING, env = "CAIRN_ETCD_USER")]
    etcd_user: Option<String>,
    /// Password of --etcd-user. Prefer CAIRN_ETCD_PASSWORD or --etcd-password-file: a
    /// value on the command line shows in `ps`.
    #[arg(long, help_heading = ETCD_HEADING, env = "CAIRN_ETCD_PASSWORD", hide_env_values = true)]
    etcd_password: Option<String>,
    /// File holding the password of --etcd-user (one trailing newline is ignored), e.g. a
    /// mounted Secret.
    #[arg(long, help_heading = ETCD_HEADING, env = "CAIRN_ETCD_PASSWORD_FILE")]
    etcd_password_file: Option<PathBuf>,
}

/// The snapshot schedule. A policy changed at run time (SetPolicy, `cairnctl policy set`)
/// is stored and wins over these flags across restarts until `cairnctl policy reset`.
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "Snapshot schedule")]
struct Schedule {
    /// Take a snapshot this often (e.g. 30s); 0s: no schedule.
    #[arg(long, env = "CAIRN_SCHEDULE_INTERVAL", default_value = "0s", value_parser = humantime::parse_duration)]
    schedule_interval: Duration,
    /// The mode of scheduled snapshots.
    #[arg(long, env = "CAIRN_SCHEDULE_MODE", default_value = "chandy-lamport", value_parser = ["chandy-lamport", "unaligned", "aligned"])]
    schedule_mode: String,
    /// Timeout of scheduled snapshots; default: --snapshot-timeout.
    #[arg(long, env = "CAIRN_SCHEDULE_TIMEOUT", value_parser = humantime::parse_duration)]
    schedule_timeout: Option<Duration>,
    /// Aligned mode only: switch to unaligned after aligning this long (e.g. 100ms).
    #[arg(long, env = "CAIRN_SCHEDULE_ALIGNMENT_TIMEOUT", value_parser = humantime::parse_duration)]
    schedule_alignment_timeout: Option<Duration>,
    /// Least time from the end of one scheduled snapshot to the start of the next; a due
    /// snapshot within it is skipped. Above zero, scheduled snapshots never overlap.
    #[arg(long, env = "CAIRN_SCHEDULE_MIN_PAUSE", default_value = "0s", value_parser = humantime::parse_duration)]
    schedule_min_pause: Duration,
    /// Up to this much random time is added to each interval.
    #[arg(long, env = "CAIRN_SCHEDULE_JITTER", default_value = "0s", value_parser = humantime::parse_duration)]
    schedule_jitter: Duration,
    /// Most scheduled snapshots in flight at once (a due one is skipped, not queued).
    #[arg(long, env = "CAIRN_SCHEDULE_MAX_CONCURRENT", default_value_t = 1)]
    schedule_max_concurrent: u32,
    /// Consecutive failed scheduled snapshots tolerated before the schedule is reported
    /// failing (error log, cairn_schedule_failing metric, GetPolicy); it keeps trying.
    #[arg(long, env = "CAIRN_SCHEDULE_TOLERATED_FAILURES", default_value_t = 3)]
    schedule_tolerated_failures: u32,
    /// When no snapshot completed within this long (e.g. 2m), the health service
    /// cairn.v1.SnapshotFreshness answers NOT_SERVING. Default: no threshold.
    #[arg(long, env = "CAIRN_FRESHNESS_THRESHOLD", value_parser = humantime::parse_duration)]
    freshness_threshold: Option<Duration>,
}

/// The flag that sets a policy field.
fn schedule_flag(field: PolicyField) -> &'static str {
    match field {
        PolicyField::Interval => "--schedule-interval",
        PolicyField::Mode => "--schedule-mode",
        PolicyField::Timeout => "--schedule-timeout",
        PolicyField::AlignmentTimeout => "--schedule-alignment-timeout",
        PolicyField::MinPause => "--schedule-min-pause",
        PolicyField::Jitter => "--schedule-jitter",
        PolicyField::MaxConcurrent => "--schedule-max-concurrent",
        PolicyField::ToleratedFailures => "--schedule-tolerated-failures",
        PolicyField::FreshnessThreshold => "--freshness-threshold",
    }
}

/// A timeout flag is above zero and at most [`MAX_TIMEOUT`] (24 h).
fn check_timeout(value: Duration) -> Result<(), String> {
    if value.is_zero() {
        return Err("must be above zero".into());
    }
    if value > MAX_TIMEOUT {
        return Err(format!(
            "{} is above the most allowed, 24h",
            humantime::format_duration(value)
        ));
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Args = match cli::parse_or_exit() {
        Ok(args) => args,
        Err(code) => return code,
    };
    if !(1..=MAX_CONCURRENT as usize).contains(&args.max_concurrent) {
        return cli::usage_error(format!(
            "--max-concurrent {} is outside the allowed 1 to {MAX_CONCURRENT}",
            args.max_concurrent
        ));
    }
    for (flag, value) in [
        ("--snapshot-timeout", args.snapshot_timeout),
        ("--restore-timeout", args.restore_timeout),
    ] {
        if let Err(why) = check_timeout(value) {
            return cli::usage_error(format!("{flag}: {why}"));
        }
    }
    if !cairn_coordinator::config::LEADER_LEASE_TTL.contains(&args.leader_lease_ttl)
        || args.leader_lease_ttl.subsec_nanos() != 0
    {
        return cli::usage_error(format!(
            "--leader-lease-ttl {} must be whole seconds from 2s to 5m",
            humantime::format_duration(args.leader_lease_ttl)
        ));
    }
    if let Some(a) = &args.advertise
        && let Err(why) = cairn_coordinator::config::check_advertise(a)
    {
        return cli::usage_error(format!("--advertise {a}: {why}"));
    }
    let s = &args.schedule;
    let policy = Policy {
        interval: s.schedule_interval,
        mode: match s.schedule_mode.as_str() {
            "unaligned" => SnapshotMode::Unaligned,
            "aligned" => SnapshotMode::Aligned,
            _ => SnapshotMode::ChandyLamport,
        },
        timeout: s.schedule_timeout.unwrap_or(args.snapshot_timeout),
        alignment_timeout: s.schedule_alignment_timeout.filter(|d| !d.is_zero()),
        min_pause: s.schedule_min_pause,
        jitter: s.schedule_jitter,
        max_concurrent: s.schedule_max_concurrent,
        tolerated_failures: s.schedule_tolerated_failures,
        freshness_threshold: s.freshness_threshold,
    };
    if let Err(e) = policy.check() {
        return cli::usage_error(format!("{}: {}", schedule_flag(e.field), e.reason));
    }
    if policy.max_concurrent as usize > args.max_concurrent {
        return cli::usage_error(format!(
            "--schedule-max-concurrent {} is above --max-concurrent {}",
            policy.max_concurrent, args.max_concurrent
        ));
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
    let auth = match cli::auth::Auth::from_flag(args.auth_tokens.as_deref()) {
        Ok(auth) => auth,
        Err(e) => return cli::usage_error(e),
    };
    let a = args.etcd_access;
    let etcd = EtcdFlags {
        endpoints: args.etcd,
        ca: a.etcd_ca,
        cert: a.etcd_cert,
        key: a.etcd_key,
        user: a.etcd_user,
        password: a.etcd_password,
        password_file: a.etcd_password_file,
    };
    let etcd = match etcd.load() {
        Ok(etcd) => etcd,
        Err(e) => return cli::usage_error(e),
    };
    if args
        .remove_after
        .is_some_and(|d| d < Duration::from_secs(10))
    {
        return cli::usage_error(
            "--remove-after must be at least 10s (a daemon's restart takes a few seconds)",
        );
    }
    let tls = match args.tls.load_daemon() {
        Ok(tls) => tls,
        Err(e) => return cli::usage_error(e),
    };
    if let Err(e) = auth.require_tls(tls.is_some()) {
        return cli::usage_error(e);
    }
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
        config.etcd = etcd;
        config.blob = args.blob;
        if let Some(dir) = args.blob_dir {
            config.blob.blob_store = Some(cairn_blob::Location::Dir(dir));
        }
        config.gc_grace = args.gc_grace;
        config.remove_after = args.remove_after;
        config.default_timeout = args.snapshot_timeout;
        config.max_concurrent = args.max_concurrent;
        config.response_memory_mib = args.response_memory_mib;
        config.retention = args.retention;
        config.topology = topology;
        config.policy = policy;
        config.auto_restore = args.auto_restore;
        config.restore_timeout = args.restore_timeout;
        config.auth = auth;
        config.tls = tls;
        config.advertise = args.advertise;
        config.leader_lease_ttl = args.leader_lease_ttl;
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
