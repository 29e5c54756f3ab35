//! `cairn-nemesis`: a seeded, bounded Jepsen-style run against a real cluster, judged by
//! an independent checker. See `cairn-nemesis --help` and `docs/robustness.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cairn_integration_tests::coordinated::{CoordinatedCluster, Store, channel_fault};
use cairn_integration_tests::etcd::Etcd;
use cairn_integration_tests::nemesis::check::{Verdict, check};
use cairn_integration_tests::nemesis::history::{
    self, BankView, ChannelView, Entry, LedgerIsland, NodeView, SnapshotView, Writer,
};
use cairn_integration_tests::nemesis::lineage::Lineage;
use cairn_integration_tests::netns::{self, Net, NetFault};
use cairn_integration_tests::postgres::PgServer;
use cairn_integration_tests::processes::{eventually, signal_pid};
use cairn_integration_tests::proxy::{Loss, LossyProxy};
use cairn_integration_tests::restore::newest_restore;
use cairn_rpc::v1 as pb;
use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::{Instant, timeout};
use tonic::transport::Channel;

mod faults;
mod run;
mod workload;

use faults::Open;
use run::{report, run};
use workload::*;

/// A seeded fault run against a real cluster, judged by an independent checker.
///
/// Starts etcd, coordinator replicas on it (automatic recovery on) and four node daemons
/// with banks moving money at 200 transfers a second each, and takes snapshots in all
/// three modes every 150–250 ms while a seeded nemesis injects, at random and overlapping:
/// kill -9 and restart of a node (daemon and bank), of a bank alone (then restored, as an
/// operator would), of the leading coordinator (also in the middle of a restore) and of
/// etcd (and of PostgreSQL, with --ledger); SIGSTOP/SIGCONT of a daemon, a bank, the leader and etcd, shorter and longer than
/// the timeouts (the leader's lease is 5 s); channel cuts, holds and delays through the
/// daemons' fault injection; restores; with --netns, the network's faults between hosts
/// (partitions, a node cut off, a node's control stream cut, packet loss, a slow link). Every operation, fault, poll of the banks and every
/// ended snapshot with its data goes to a history of JSON lines; when the time is up the
/// faults heal, the workload stops, a closing restore is checked, and the checker judges
/// the history (it never calls cairn's own verifier). Exits 1 naming every violation.
///
/// Needs the binaries (`cargo build --bins`) and etcd (`apt-get install etcd-server`).
#[derive(Debug, Parser)]
#[command(version, max_term_width = 100)]
struct Args {
    /// The seed: the same seed draws the same faults, targets and durations in the same
    /// order (the moments shift with the machine's speed).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds of faults (default 600; with --quick 90). Setting up, settling and the
    /// checks take about a minute more.
    #[arg(long)]
    seconds: Option<u64>,
    /// The short run `scripts/test.sh` makes: 90 s of faults.
    #[arg(long)]
    quick: bool,
    /// Where to write the history (JSON lines, one per operation, fault, poll and snapshot).
    #[arg(long, default_value = "nemesis-history.jsonl")]
    history: PathBuf,
    /// Where to write the checker's verdict and the run's numbers as JSON.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Judge the history at this path instead of running (no cluster is started).
    #[arg(long, value_name = "HISTORY")]
    check: Option<PathBuf>,
    /// Coordinator replicas on the one etcd (1 to 3).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=3))]
    replicas: u16,
    /// The longest a fault's end may precede the start of a snapshot that completes, in
    /// seconds.
    #[arg(long, default_value_t = 45.0)]
    recovery_bound: f64,
    /// Plants a mutant in the daemons (`record-one-too-few`, `drop-frame-on-reconnect`):
    /// they must be a build with `--features mutants`, named by CAIRN_BINARY_CAIRN_NODE
    /// (`scripts/nemesis-mutants.sh` does both). The checker must then fail the run.
    #[arg(long)]
    mutant: Option<String>,
    /// Runs each node (daemon and bank) on a host of its own — a network namespace on a
    /// bridge, the coordinators and etcd on the bridge's side — and adds the network's
    /// faults: two nodes partitioned from each other, a node cut off from everyone, a
    /// node's control stream cut (its channels up), packet loss at a node, a slow link
    /// (iptables and tc inside the hosts). Needs root and
    /// util-linux, iproute2 and iptables; the run first re-runs itself under `unshare
    /// --net`, so nothing of the machine's own network is touched and it all goes with it.
    #[arg(long)]
    netns: bool,
    /// Leaves out the faults between the coordinators and etcd (by default a proxy sits
    /// there and, now and then, loses the answer to a record's write — etcd applied it —,
    /// loses the request, or delivers it late, each held past the client's 5 s timeout).
    #[arg(long)]
    no_etcd_faults: bool,
    /// The banks write their ledger to a PostgreSQL the run starts (`cairn-bank --ledger`;
    /// needs `apt-get install postgresql`), PostgreSQL is killed now and then too, and the
    /// checker holds the ledger to the closing restore: each transfer the restored states
    /// received, once, none else, nothing left prepared (docs/robustness.md, "The ledger").
    #[arg(long)]
    ledger: bool,
}

/// A COMPLETED snapshot, as the nemesis picks one to restore.
#[derive(Debug, Clone, Copy)]
struct Completed {
    /// The epoch it was taken in.
    epoch: u64,
    /// Every state is of its bank's original line (restoring it never brings back a
    /// bank started afresh, whose money would change for good).
    clean: bool,
    /// A transfer was in flight in it (delivered after a restore of it).
    held: bool,
}

const NODES: usize = 4;
/// The longest any one call of the nemesis may take.
const CALL_LIMIT: Duration = Duration::from_secs(3);
/// At most this many durative faults (pauses, holds, delays, etcd down) at once.
const MAX_OPEN: usize = 2;

/// What the nemesis and its snapshot task share.
struct Shared {
    history: Writer,
    /// The newest id the coordinator handed out.
    last_id: u64,
    /// Snapshots started after the faults stopped (`None` before).
    after_quiet: Option<BTreeSet<u64>>,
    /// Snapshot starts refused or timed out, by why.
    refused: BTreeMap<String, u64>,
    /// The snapshot task is to stop.
    stop: bool,
}

impl Shared {
    fn push(&mut self, entry: &Entry) {
        if let Err(e) = self.history.push(entry) {
            eprintln!("cannot write the history: {e}");
        }
    }
}

type SharedRef = Arc<Mutex<Shared>>;

fn lock(shared: &SharedRef) -> std::sync::MutexGuard<'_, Shared> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

struct Nemesis {
    cluster: CoordinatedCluster,
    /// The hosts, with --netns (dropped after the cluster: its holders go last).
    net: Option<Net>,
    etcd: Etcd,
    rng: StdRng,
    shared: SharedRef,
    client: Option<pb::coordinator_client::CoordinatorClient<Channel>>,
    open: Vec<Open>,
    /// Snapshots whose ended record is in the history.
    recorded: BTreeSet<u64>,
    faults: BTreeMap<String, u64>,
    /// A bank started afresh: until this deadline, no other fault; a restore of a snapshot
    /// of the original lines (requested once: the flag) until every bank is back on its.
    bank_recovery: Option<(Instant, bool)>,
    /// Replicas seen leading, with their terms.
    leaders_seen: BTreeSet<(usize, u64)>,
    /// Each bank's line when the run began.
    original: BTreeMap<String, u64>,
    /// The COMPLETED snapshots seen, by id.
    completed: BTreeMap<u64, Completed>,
    /// A mutant is planted: the settling waits are short (a broken build may never
    /// recover, and the checker needs no more than the record of it).
    mutant: bool,
    /// Whether a snapshot started after the faults stopped completed.
    recovered: bool,
    /// What the harness itself failed to do (a network fault it could not heal): the run
    /// fails without a verdict.
    harness_errors: Vec<String>,
    /// The proxy between the coordinators and etcd (none with --no-etcd-faults).
    etcd_proxy: Option<LossyProxy>,
    /// The banks' ledger (`cairn-bank --ledger`), with --ledger.
    pg: Option<PgServer>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let seconds = args.seconds.unwrap_or(if args.quick { 90 } else { 600 });
    let verdict = if let Some(path) = &args.check {
        match history::read(path) {
            Ok(entries) => check(&entries, args.recovery_bound),
            Err(e) => {
                eprintln!("cairn-nemesis: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        // Before any thread: the run goes on in a network namespace of its own.
        if args.netns
            && let Err(e) = netns::reexec_in_own_namespace()
        {
            eprintln!("cairn-nemesis --netns: {e:#}");
            return ExitCode::FAILURE;
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        // Interrupted (Ctrl-C, SIGTERM), the run is dropped: every process it started is
        // killed by its guard.
        let result = runtime.block_on(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("a SIGTERM handler");
            tokio::select! {
                result = run(&args, seconds) => result,
                _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
                _ = term.recv() => Err(anyhow::anyhow!("terminated")),
            }
        });
        match result {
            Ok(verdict) => verdict,
            Err(e) => {
                eprintln!("cairn-nemesis could not finish the run: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    };
    report(&verdict);
    if let Some(out) = &args.out {
        let json = serde_json::to_vec_pretty(&verdict).unwrap_or_default();
        if let Err(e) = std::fs::write(out, json) {
            eprintln!("cannot write {}: {e}", out.display());
        }
    }
    if verdict.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
