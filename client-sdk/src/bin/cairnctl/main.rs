//! `cairnctl`: the command line of cairn. See `cairnctl --help`.

mod policy;
mod restore;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use cairn_proto::v1 as pb;
use cairn_sdk::bank::{BankState, TransferPayload};
use cairn_sdk::local_cluster::{ClusterSpec, LocalCluster};
use cairn_sdk::{CoordinatorClient, cli};
use clap::{Parser, Subcommand, ValueEnum};

/// Drive a cairn cluster: start, watch, inspect and delete snapshots, list nodes, show and
/// change the snapshot schedule, run a local cluster, or run the whole demo.
///
/// Every flag can also be set by the environment variable shown.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    /// The coordinator's address [default: 127.0.0.1:7000]. For `cluster up` and `demo`,
    /// the address the coordinator they start listens on [default: a free loopback port].
    #[arg(long, global = true, env = "CAIRN_COORDINATOR")]
    coordinator: Option<String>,
    /// Output format.
    #[arg(long, short, global = true, env = "CAIRN_OUTPUT", value_enum, default_value_t = Output::Table)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start, inspect, watch, abort or delete snapshots.
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// List the registered node daemons.
    Nodes,
    /// Show or change the snapshot schedule (interval, mode, pause, jitter, tolerated
    /// failures, freshness threshold).
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
    /// The cluster at a glance: members, snapshots in progress, the newest completed one
    /// and its age, the schedule and freshness.
    Status,
    /// Show restore operations (start one with `cairnctl snapshot restore ID`).
    #[command(subcommand)]
    Restore(restore::RestoreCommand),
    /// Ask any cairn server (coordinator, node daemon, bank) for its gRPC health; exits 0
    /// only when it answers SERVING. For container healthchecks and probes.
    Health {
        /// The server's address (HOST:PORT).
        address: String,
        /// The service to ask about; empty: the server as a whole.
        #[arg(long, default_value = "")]
        service: String,
        /// How long to wait for an answer.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
    /// Run a local cluster (a coordinator, N node daemons, N bank apps) on loopback.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// The whole story: a local cluster on the embedded store, a bank workload, one snapshot
    /// in each mode while transfers run, and a table of results. Exits 0 only if every
    /// snapshot verified and the money adds up.
    Demo {
        /// Nodes in the cluster.
        #[arg(long, env = "CAIRN_NODES", default_value_t = 3)]
        nodes: usize,
        /// Random transfers per second per bank.
        #[arg(long, env = "CAIRN_WORKLOAD", default_value_t = 200.0)]
        workload: f64,
        /// Directory for the cluster's data and logs (default: a temporary one, removed after).
        #[arg(long, env = "CAIRN_DIR")]
        dir: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
enum SnapshotCommand {
    /// Start a snapshot and print its id.
    Start {
        /// The mode.
        #[arg(long, env = "CAIRN_MODE", value_enum, default_value_t = Mode::ChandyLamport)]
        mode: Mode,
        /// An initiator (repeatable); default: the coordinator chooses one.
        #[arg(long, env = "CAIRN_INITIATORS", value_delimiter = ',')]
        initiator: Vec<String>,
        /// Timeout (e.g. 30s); default: the coordinator's.
        #[arg(long, env = "CAIRN_SNAPSHOT_TIMEOUT", value_parser = humantime::parse_duration)]
        timeout: Option<Duration>,
        /// Aligned mode: switch to unaligned after this long aligning (e.g. 100ms).
        #[arg(long, env = "CAIRN_ALIGNMENT_TIMEOUT", value_parser = humantime::parse_duration)]
        alignment_timeout: Option<Duration>,
        /// A label KEY=VALUE (repeatable).
        #[arg(long, env = "CAIRN_LABELS", value_delimiter = ',')]
        label: Vec<String>,
        /// Wait until it ends and print it.
        #[arg(long, env = "CAIRN_WAIT")]
        wait: bool,
    },
    /// Show one snapshot.
    Get {
        /// Its id.
        id: u64,
        /// Include each node's state and the recorded messages.
        #[arg(long, env = "CAIRN_DATA")]
        data: bool,
    },
    /// List snapshots, newest first.
    List {
        /// Only this status.
        #[arg(long, env = "CAIRN_STATUS", value_enum)]
        status: Option<Status>,
        /// At most this many.
        #[arg(long, env = "CAIRN_LIMIT", default_value_t = 50)]
        limit: u32,
    },
    /// Follow a snapshot's progress until it ends.
    Watch {
        /// Its id.
        id: u64,
    },
    /// Abort a snapshot in progress.
    Abort {
        /// Its id.
        id: u64,
        /// Why.
        #[arg(long, env = "CAIRN_REASON", default_value = "aborted with cairnctl")]
        reason: String,
    },
    /// Delete a finished snapshot and the chunks only it used.
    Delete {
        /// Its id.
        id: u64,
    },
    /// Read every chunk of a COMPLETED snapshot and check it against its SHA-256 name.
    /// Exit 0 if all match; exit 1 naming the first missing or corrupt chunk and its node.
    Verify {
        /// Its id.
        id: u64,
    },
    /// Roll the whole cluster back to a COMPLETED snapshot: every node's application gets
    /// its recorded state, and the recorded in-flight messages are delivered again ahead
    /// of any new traffic. Waits until every node applied its state (exit 0) or the
    /// restore failed (exit 1).
    Restore {
        /// The snapshot.
        id: u64,
        /// Print the operation and return at once.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait.
        #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Start the processes, write their addresses to a JSON file, and stay in the
    /// foreground until interrupted (Ctrl-C), then stop them all.
    Up {
        /// Nodes (and bank apps).
        #[arg(long, env = "CAIRN_NODES", default_value_t = 3)]
        nodes: usize,
        /// etcd endpoint(s) for the coordinator (default: the embedded store).
        #[arg(long, env = "CAIRN_ETCD", value_delimiter = ',')]
        etcd: Vec<String>,
        /// Data directory (metadata, blobs, logs).
        #[arg(long, env = "CAIRN_DIR", default_value = "cairn-cluster")]
        dir: PathBuf,
        /// Where to write the addresses.
        #[arg(long, env = "CAIRN_ADDRESSES", default_value = "cairn-cluster.json")]
        addresses: PathBuf,
        /// Random transfers per second per bank.
        #[arg(long, env = "CAIRN_WORKLOAD", default_value_t = 0.0)]
        workload: f64,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Mode {
    ChandyLamport,
    Unaligned,
    Aligned,
}

impl Mode {
    fn pb(self) -> pb::SnapshotMode {
        match self {
            Self::ChandyLamport => pb::SnapshotMode::ChandyLamport,
            Self::Unaligned => pb::SnapshotMode::Unaligned,
            Self::Aligned => pb::SnapshotMode::Aligned,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Status {
    InProgress,
    Completed,
    Failed,
    Aborted,
}

fn main() -> ExitCode {
    let cli: Cli = match cli::parse_or_exit() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    cli::init_logging(
        &std::env::var("CAIRN_LOG").unwrap_or_else(|_| "warn".into()),
        false,
    );
    let Ok(runtime) = tokio::runtime::Runtime::new() else {
        eprintln!("error: cannot start the runtime");
        return ExitCode::FAILURE;
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            // A refusal from a server reads as its reason and its gRPC code.
            match e.downcast_ref::<tonic::Status>() {
                Some(status) => eprintln!("error: {} ({:?})", status.message(), status.code()),
                None => eprintln!("error: {e:#}"),
            }
            ExitCode::FAILURE
        }
    }
}

/// The coordinator the commands that talk to one use.
const DEFAULT_COORDINATOR: &str = "127.0.0.1:7000";

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    // `cluster up` and `demo` start a coordinator: given, it listens there.
    let listen = cli.coordinator.clone();
    let coordinator = cli.coordinator.as_deref().unwrap_or(DEFAULT_COORDINATOR);
    match cli.command {
        Command::Snapshot(command) => snapshot(coordinator, cli.output, command).await,
        Command::Policy(command) => policy::policy(coordinator, cli.output, command).await,
        Command::Status => policy::status(coordinator, cli.output).await,
        Command::Restore(command) => restore::restore(coordinator, cli.output, command).await,
        Command::Health {
            address,
            service,
            timeout,
        } => health(&address, &service, timeout).await,
        Command::Nodes => {
            let mut client = CoordinatorClient::connect(coordinator).await?;
            let nodes = client
                .raw()
                .list_nodes(pb::ListNodesRequest {})
                .await?
                .into_inner();
            if cli.output == Output::Json {
                let rows: Vec<_> = nodes
                    .nodes
                    .iter()
                    .map(|n| serde_json::json!({"node_id": n.node_id, "address": n.address, "incarnation": n.incarnation, "connected": n.connected, "application_attached": n.application_attached, "last_seen_ms": n.last_seen_ms}))
                    .collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                table(
                    &["NODE", "ADDRESS", "CONNECTED", "INCARNATION", "APPLICATION"],
                    nodes.nodes.iter().map(|n| {
                        vec![
                            n.node_id.clone(),
                            n.address.clone(),
                            if n.connected { "yes" } else { "no" }.into(),
                            n.incarnation.to_string(),
                            if n.application_attached {
                                "attached".into()
                            } else {
                                "none".into()
                            },
                        ]
                    }),
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Cluster(ClusterCommand::Up {
            nodes,
            etcd,
            dir,
            addresses,
            workload,
        }) => cluster_up(nodes, etcd, listen, dir, addresses, workload).await,
        Command::Demo {
            nodes,
            workload,
            dir,
        } => demo(nodes, workload, listen, dir).await,
    }
}

fn bin_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    Ok(exe
        .parent()
        .ok_or_else(|| anyhow::anyhow!("cannot locate cairnctl's directory"))?
        .to_owned())
}

async fn cluster_up(
    nodes: usize,
    etcd: Vec<String>,
    coordinator: Option<String>,
    dir: PathBuf,
    addresses: PathBuf,
    workload: f64,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(nodes >= 1, "--nodes must be at least 1");
    let spec = ClusterSpec {
        nodes,
        etcd,
        coordinator,
        data_dir: dir,
        workload,
        initial_balance: 1000,
        bin_dir: bin_dir()?,
    };
    let mut cluster = LocalCluster::start(&spec).await?;
    if let Err(e) = cluster.wait_ready(Duration::from_secs(30)).await {
        cluster.stop(Duration::from_secs(5)).await;
        return Err(e);
    }
    std::fs::write(&addresses, serde_json::to_vec_pretty(&cluster.addresses)?)?;
    eprintln!(
        "cluster up: coordinator {}, {} nodes; addresses in {}; logs in {}. Ctrl-C stops it.",
        cluster.addresses.coordinator,
        nodes,
        addresses.display(),
        spec.data_dir.join("logs").display()
    );
    let mut ticker = tokio::time::interval(Duration::from_millis(500));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let code = loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break ExitCode::SUCCESS,
            _ = term.recv() => break ExitCode::SUCCESS,
            _ = ticker.tick() => {
                let exited = cluster.exited();
                if !exited.is_empty() {
                    eprintln!("error: {}", exited.join("; "));
                    break ExitCode::FAILURE;
                }
            }
        }
    };
    cluster.stop(Duration::from_secs(5)).await;
    Ok(code)
}

fn status_word(status: i32) -> &'static str {
    match pb::SnapshotStatus::try_from(status).unwrap_or(pb::SnapshotStatus::Unspecified) {
        pb::SnapshotStatus::InProgress => "IN_PROGRESS",
        pb::SnapshotStatus::Completed => "COMPLETED",
        pb::SnapshotStatus::Failed => "FAILED",
        pb::SnapshotStatus::Aborted => "ABORTED",
        pb::SnapshotStatus::Unspecified => "?",
    }
}

fn mode_word(snapshot: &pb::Snapshot) -> &'static str {
    let mode = snapshot.plan.as_ref().map_or(0, |p| p.mode);
    match pb::SnapshotMode::try_from(mode).unwrap_or(pb::SnapshotMode::Unspecified) {
        pb::SnapshotMode::Unaligned => "UNALIGNED",
        pb::SnapshotMode::Aligned => "ALIGNED",
        _ => "CHANDY_LAMPORT",
    }
}

fn snapshot_json(s: &pb::Snapshot) -> serde_json::Value {
    serde_json::json!({
        "id": s.plan.as_ref().map_or(0, |p| p.snapshot_id),
        "mode": mode_word(s),
        "initiators": s.plan.as_ref().map(|p| p.initiators.clone()).unwrap_or_default(),
        "status": status_word(s.status),
        "failure": s.failure.as_ref().map(|f| f.message.clone()),
        "verdict": s.verdict.as_ref().map(|v| serde_json::json!({"consistent": v.consistent, "violation": v.violation, "recorded_messages": v.recorded_messages})),
        "started_at_ms": s.started_at_ms,
        "finished_at_ms": s.finished_at_ms,
        "duration_ms": s.finished_at_ms.saturating_sub(s.started_at_ms),
        "nodes": s.nodes.iter().map(|n| serde_json::json!({
            "node_id": n.node_id, "recorded": n.recorded, "reported": n.reported,
            "local_state_bytes": n.local_state_bytes,
            "recorded_messages": n.channel_states.iter().map(|c| c.messages.len()).sum::<usize>(),
        })).collect::<Vec<_>>(),
        "bytes_new": s.bytes_new,
        "bytes_reused": s.bytes_reused,
        "labels": s.labels,
    })
}

fn snapshot_row(s: &pb::Snapshot) -> Vec<String> {
    let done = s.finished_at_ms > 0;
    vec![
        s.plan.as_ref().map_or(0, |p| p.snapshot_id).to_string(),
        mode_word(s).to_owned(),
        status_word(s.status).to_owned(),
        if done {
            format!("{} ms", s.finished_at_ms.saturating_sub(s.started_at_ms))
        } else {
            "-".into()
        },
        s.nodes.len().to_string(),
        s.verdict
            .as_ref()
            .map_or("-".into(), |v| v.recorded_messages.to_string()),
        s.failure
            .as_ref()
            .map(|f| f.message.clone())
            .or_else(|| {
                s.verdict.as_ref().map(|v| {
                    if v.consistent {
                        "consistent".into()
                    } else {
                        v.violation.clone()
                    }
                })
            })
            .unwrap_or_default(),
    ]
}

const SNAPSHOT_HEADER: [&str; 7] = [
    "ID",
    "MODE",
    "STATUS",
    "DURATION",
    "NODES",
    "IN-FLIGHT",
    "VERDICT",
];

async fn snapshot(
    coordinator: &str,
    output: Output,
    command: SnapshotCommand,
) -> anyhow::Result<ExitCode> {
    let mut client = CoordinatorClient::connect(coordinator).await?;
    match command {
        SnapshotCommand::Start {
            mode,
            initiator,
            timeout,
            alignment_timeout,
            label,
            wait,
        } => {
            let labels = label
                .iter()
                .map(|l| {
                    l.split_once('=')
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .ok_or_else(|| anyhow::anyhow!("label `{l}` is not KEY=VALUE"))
                })
                .collect::<anyhow::Result<_>>()?;
            let id = client
                .start_snapshot(pb::StartSnapshotRequest {
                    mode: mode.pb() as i32,
                    initiators: initiator,
                    timeout_ms: timeout.map_or(0, |d| d.as_millis() as u64),
                    alignment_timeout_ms: alignment_timeout.map_or(0, |d| d.as_millis() as u64),
                    labels,
                })
                .await?;
            if !wait {
                match output {
                    Output::Json => println!("{}", serde_json::json!({ "snapshot_id": id })),
                    Output::Table => println!("{id}"),
                }
                return Ok(ExitCode::SUCCESS);
            }
            let snapshot = wait_for(&mut client, id, false).await?;
            print_snapshot(&snapshot, output)?;
            Ok(if snapshot.status == pb::SnapshotStatus::Completed as i32 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        SnapshotCommand::Get { id, data } => {
            let snapshot = client.get_snapshot(id, data).await?;
            print_snapshot(&snapshot, output)?;
            if data && output == Output::Table {
                for node in &snapshot.nodes {
                    println!(
                        "\n{}: local state {}",
                        node.node_id,
                        String::from_utf8_lossy(&node.local_state)
                    );
                    for state in &node.channel_states {
                        let channel = state
                            .channel
                            .as_ref()
                            .map(|c| format!("{}->{}", c.from, c.to))
                            .unwrap_or_default();
                        println!("  {channel}: {} recorded messages", state.messages.len());
                    }
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        SnapshotCommand::List { status, limit } => {
            let status = match status {
                None => pb::SnapshotStatus::Unspecified,
                Some(Status::InProgress) => pb::SnapshotStatus::InProgress,
                Some(Status::Completed) => pb::SnapshotStatus::Completed,
                Some(Status::Failed) => pb::SnapshotStatus::Failed,
                Some(Status::Aborted) => pb::SnapshotStatus::Aborted,
            };
            let list = client
                .raw()
                .list_snapshots(pb::ListSnapshotsRequest {
                    status: status as i32,
                    page_size: limit,
                    page_token: String::new(),
                })
                .await?
                .into_inner();
            match output {
                Output::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &list.snapshots.iter().map(snapshot_json).collect::<Vec<_>>()
                    )?
                ),
                Output::Table => table(&SNAPSHOT_HEADER, list.snapshots.iter().map(snapshot_row)),
            }
            Ok(ExitCode::SUCCESS)
        }
        SnapshotCommand::Watch { id } => {
            let mut stream = client
                .raw()
                .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: id })
                .await?
                .into_inner();
            let start = Instant::now();
            let mut last = pb::SnapshotStatus::Unspecified as i32;
            while let Some(progress) = stream.message().await? {
                last = progress.status;
                match output {
                    Output::Json => println!(
                        "{}",
                        serde_json::json!({"snapshot_id": id, "status": status_word(progress.status), "recorded": progress.recorded, "reported": progress.reported,
                            "failure": progress.failure.as_ref().map(|f| f.message.clone())})
                    ),
                    Output::Table => println!(
                        "{:>7.1}s  {:<11} recorded [{}]  stored [{}]{}",
                        start.elapsed().as_secs_f64(),
                        status_word(progress.status),
                        progress.recorded.join(" "),
                        progress.reported.join(" "),
                        progress
                            .failure
                            .as_ref()
                            .map(|f| format!("  {}", f.message))
                            .unwrap_or_default()
                    ),
                }
            }
            Ok(if last == pb::SnapshotStatus::Completed as i32 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        SnapshotCommand::Abort { id, reason } => {
            let snapshot = client
                .raw()
                .abort_snapshot(pb::AbortSnapshotRequest {
                    snapshot_id: id,
                    reason,
                })
                .await?
                .into_inner();
            print_snapshot(&snapshot, output)?;
            Ok(ExitCode::SUCCESS)
        }
        SnapshotCommand::Restore {
            id,
            no_wait,
            timeout,
        } => restore::restore_snapshot(&mut client, output, id, !no_wait, timeout).await,
        SnapshotCommand::Verify { id } => {
            let response = client
                .raw()
                .verify_snapshot(pb::VerifySnapshotRequest { snapshot_id: id })
                .await?
                .into_inner();
            match output {
                Output::Json => println!(
                    "{}",
                    serde_json::json!({"snapshot_id": id, "verified": true, "chunks": response.chunks, "bytes": response.bytes})
                ),
                Output::Table => println!(
                    "snapshot {id} verifies: {} chunks, {} bytes, each matching its SHA-256",
                    response.chunks, response.bytes
                ),
            }
            Ok(ExitCode::SUCCESS)
        }
        SnapshotCommand::Delete { id } => {
            let response = client
                .raw()
                .delete_snapshot(pb::DeleteSnapshotRequest { snapshot_id: id })
                .await?
                .into_inner();
            match output {
                Output::Json => println!(
                    "{}",
                    serde_json::json!({"snapshot_id": id, "bytes_freed": response.bytes_freed})
                ),
                Output::Table => println!(
                    "deleted snapshot {id}; {} bytes of chunks freed",
                    response.bytes_freed
                ),
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print_snapshot(snapshot: &pb::Snapshot, output: Output) -> anyhow::Result<()> {
    match output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&snapshot_json(snapshot))?
        ),
        Output::Table => table(&SNAPSHOT_HEADER, [snapshot_row(snapshot)]),
    }
    Ok(())
}

/// Follows a snapshot until it ends, then reads it (with its data if asked).
async fn wait_for(
    client: &mut CoordinatorClient,
    id: u64,
    data: bool,
) -> anyhow::Result<pb::Snapshot> {
    let mut stream = client
        .raw()
        .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: id })
        .await?
        .into_inner();
    while let Some(progress) = stream.message().await? {
        if progress.status != pb::SnapshotStatus::InProgress as i32 {
            break;
        }
    }
    Ok(client.get_snapshot(id, data).await?)
}

fn table(header: &[&str], rows: impl IntoIterator<Item = Vec<String>>) {
    let rows: Vec<Vec<String>> = rows.into_iter().collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.iter().map(|h| (*h).to_owned()).collect());
    for row in rows {
        line(row);
    }
}

/// Money in a snapshot of banks: recorded balances plus recorded transfers in flight.
fn money(snapshot: &pb::Snapshot) -> anyhow::Result<(u64, u64)> {
    let mut balances = 0;
    let mut in_flight = 0;
    for node in &snapshot.nodes {
        let state: BankState = serde_json::from_slice(&node.local_state).map_err(|e| {
            anyhow::anyhow!("{}: local state is not a bank state: {e}", node.node_id)
        })?;
        balances += state.balance;
        for channel in &node.channel_states {
            for message in &channel.messages {
                in_flight += TransferPayload::decode(&message.payload)?.amount;
            }
        }
    }
    Ok((balances, in_flight))
}

async fn demo(
    nodes: usize,
    workload: f64,
    coordinator: Option<String>,
    dir: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(nodes >= 2, "the demo needs at least 2 nodes");
    let temporary = dir.is_none();
    let data_dir = dir
        .unwrap_or_else(|| std::env::temp_dir().join(format!("cairn-demo-{}", std::process::id())));
    let initial_balance = 1000;
    let spec = ClusterSpec {
        nodes,
        etcd: Vec::new(),
        coordinator,
        data_dir: data_dir.clone(),
        workload,
        initial_balance,
        bin_dir: bin_dir()?,
    };
    println!(
        "starting a local cluster: 1 coordinator (embedded store), {nodes} node daemons, {nodes} banks at {workload} transfers/s each"
    );
    let cluster = LocalCluster::start(&spec).await?;
    let result = demo_story(&cluster, initial_balance * nodes as u64).await;
    cluster.stop(Duration::from_secs(5)).await;
    if temporary && result.is_ok() {
        let _ = std::fs::remove_dir_all(&data_dir);
    } else {
        println!("data and logs kept in {}", data_dir.display());
    }
    result
}

async fn demo_story(cluster: &LocalCluster, total: u64) -> anyhow::Result<ExitCode> {
    let address = &cluster.addresses.coordinator;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut client = loop {
        match CoordinatorClient::connect(address).await {
            Ok(c) => break c,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("coordinator not up yet: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    cluster.wait_ready(Duration::from_secs(30)).await?;
    // Let the workload run for a moment so that messages are in flight.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut rows = Vec::new();
    let mut all_good = true;
    for mode in [Mode::ChandyLamport, Mode::Unaligned, Mode::Aligned] {
        let id = client
            .start_snapshot(pb::StartSnapshotRequest {
                mode: mode.pb() as i32,
                timeout_ms: 20_000,
                ..Default::default()
            })
            .await?;
        let snapshot = wait_for(&mut client, id, true).await?;
        let completed = snapshot.status == pb::SnapshotStatus::Completed as i32;
        let (adds_up, money_text) = match money(&snapshot) {
            Ok((balances, in_flight)) if completed => {
                let ok = balances + in_flight == total;
                (
                    ok,
                    format!(
                        "{balances} + {in_flight} = {} of {total}",
                        balances + in_flight
                    ),
                )
            }
            Ok(_) => (false, "-".into()),
            Err(e) => (false, e.to_string()),
        };
        all_good &= completed && adds_up;
        let row = snapshot_row(&snapshot);
        rows.push(vec![
            row[0].clone(),
            row[1].clone(),
            row[3].clone(),
            row[4].clone(),
            row[5].clone(),
            format!("{} ({money_text})", if adds_up { "yes" } else { "NO" }),
            row[6].clone(),
        ]);
    }
    println!();
    table(
        &[
            "ID",
            "MODE",
            "DURATION",
            "NODES",
            "IN-FLIGHT",
            "MONEY ADDS UP",
            "VERDICT",
        ],
        rows,
    );
    println!();
    if all_good {
        println!("every snapshot completed, verified as a consistent cut, and the money adds up.");
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "FAILED: a snapshot did not complete, or its money does not add up (logs in {}).",
            cluster.addresses.data_dir.join("logs").display()
        );
        Ok(ExitCode::FAILURE)
    }
}

/// `cairnctl health`: SERVING → 0; anything else, or no answer, → 1 with the reason.
async fn health(address: &str, service: &str, timeout: Duration) -> anyhow::Result<ExitCode> {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let ask = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
            .connect()
            .await?;
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await?
            .into_inner();
        anyhow::Ok(answer.status())
    };
    match tokio::time::timeout(timeout, ask).await {
        Ok(Ok(ServingStatus::Serving)) => {
            println!("SERVING");
            Ok(ExitCode::SUCCESS)
        }
        Ok(Ok(status)) => {
            println!("{}", status.as_str_name());
            Ok(ExitCode::FAILURE)
        }
        Ok(Err(e)) => {
            eprintln!("error: {address}: {e:#}");
            Ok(ExitCode::FAILURE)
        }
        Err(_) => {
            eprintln!("error: {address}: no answer within {timeout:?}");
            Ok(ExitCode::FAILURE)
        }
    }
}
