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
    self, BankView, ChannelView, Entry, NodeView, SnapshotView, Writer,
};
use cairn_integration_tests::netns::{self, Net, NetFault};
use cairn_integration_tests::processes::{eventually, signal_pid};
use cairn_integration_tests::proxy::{Loss, LossyProxy};
use cairn_integration_tests::restore::newest_restore;
use cairn_rpc::v1 as pb;
use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::{Instant, timeout};
use tonic::transport::Channel;

/// A seeded fault run against a real cluster, judged by an independent checker.
///
/// Starts etcd, coordinator replicas on it (automatic recovery on) and four node daemons
/// with banks moving money at 200 transfers a second each, and takes snapshots in all
/// three modes every 150–250 ms while a seeded nemesis injects, at random and overlapping:
/// kill -9 and restart of a node (daemon and bank), of a bank alone (then restored, as an
/// operator would), of the leading coordinator (also in the middle of a restore) and of
/// etcd; SIGSTOP/SIGCONT of a daemon, a bank, the leader and etcd, shorter and longer than
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
}

const NODES: usize = 4;
/// The longest any one call of the nemesis may take.
const CALL_LIMIT: Duration = Duration::from_secs(3);
/// At most this many durative faults (pauses, holds, delays, etcd down) at once.
const MAX_OPEN: usize = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Cut,
    Hold,
    Delay,
    KillNode,
    KillBank,
    KillLeader,
    KillLeaderDuringRestore,
    KillEtcd,
    PauseDaemon,
    PauseBank,
    PauseLeader,
    PauseEtcd,
    Restore,
    NetPartition,
    NetIsolate,
    NetControl,
    NetLoss,
    NetThrottle,
    EtcdLoseAnswer,
    EtcdLoseRequest,
    EtcdDelayRequest,
}

const FAULTS: [(Fault, u32); 13] = [
    (Fault::Cut, 4),
    (Fault::Hold, 2),
    (Fault::Delay, 2),
    (Fault::KillNode, 3),
    (Fault::KillBank, 1),
    (Fault::KillLeader, 2),
    (Fault::KillLeaderDuringRestore, 1),
    (Fault::KillEtcd, 1),
    (Fault::PauseDaemon, 2),
    (Fault::PauseBank, 1),
    (Fault::PauseLeader, 2),
    (Fault::PauseEtcd, 1),
    (Fault::Restore, 1),
];

/// The network's faults, drawn too with --netns.
const NET_FAULTS: [(Fault, u32); 5] = [
    (Fault::NetPartition, 3),
    (Fault::NetIsolate, 1),
    (Fault::NetControl, 1),
    (Fault::NetLoss, 2),
    (Fault::NetThrottle, 1),
];

/// The faults between the coordinators and etcd (a proxy in front of etcd), drawn unless
/// --no-etcd-faults.
const ETCD_FAULTS: [(Fault, u32); 3] = [
    (Fault::EtcdLoseAnswer, 2),
    (Fault::EtcdLoseRequest, 2),
    (Fault::EtcdDelayRequest, 2),
];

/// What the etcd faults look for in a coordinator's request: a write of a record whose end
/// or start matters (only writes carry these bytes: reads name keys, not values).
const ETCD_PATTERNS: [&[u8]; 4] = [
    b"\"status\": \"COMPLETED\"",
    b"\"status\": \"FAILED\"",
    b"\"status\": \"IN_PROGRESS\"",
    b"\"requested_by\"",
];

/// How a durative fault ends.
#[derive(Debug, Clone)]
enum Undo {
    /// SIGCONT to this process.
    Resume(u32),
    /// The channel delivers freely again.
    Unhold(String, String),
    /// The channel's delay is removed.
    Undelay(String, String),
    /// etcd starts again.
    EtcdUp,
    /// The network's rules are taken away.
    Net(Vec<NetFault>),
}

struct Open {
    at: Instant,
    kind: &'static str,
    target: String,
    undo: Undo,
}

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
    /// The newest COMPLETED snapshot whose every state is of its bank's original line.
    newest_clean: u64,
    /// A mutant is planted: the settling waits are short (a broken build may never
    /// recover, and the checker needs no more than the record of it).
    mutant: bool,
    /// Whether a snapshot started after the faults stopped completed.
    recovered: bool,
    /// What the harness itself failed to do (a network fault it could not heal): the run
    /// fails without a verdict.
    harness_errors: Vec<String>,
    /// The newest COMPLETED snapshot, and the newest holding a transfer in flight.
    newest_completed: (u64, u64),
    /// The proxy between the coordinators and etcd (none with --no-etcd-faults).
    etcd_proxy: Option<LossyProxy>,
}

/// Milliseconds since the epoch, by this machine's clock (the coordinators' too).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Watches snapshot `id` at `client`'s replica and writes the end it is told, if it is
/// told one (a term that ends first closes the stream with an error: nothing told).
async fn watch_told(
    shared: SharedRef,
    mut client: pb::coordinator_client::CoordinatorClient<Channel>,
    id: u64,
) {
    let watched = async {
        let mut stream = client
            .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: id })
            .await?
            .into_inner();
        while let Some(progress) = stream.message().await? {
            if progress.status != pb::SnapshotStatus::InProgress as i32 {
                return anyhow::Ok(Some(status_name(progress.status)));
            }
        }
        Ok(None)
    };
    // Past the snapshot's own 10 s timeout and a lost answer's settling.
    if let Ok(Ok(Some(status))) = timeout(Duration::from_secs(60), watched).await {
        let mut shared = lock(&shared);
        let at = shared.history.at();
        shared.push(&Entry::Told { at, id, status });
    }
}

fn status_name(status: i32) -> String {
    pb::SnapshotStatus::try_from(status).map_or_else(
        |_| format!("STATUS_{status}"),
        |s| {
            s.as_str_name()
                .trim_start_matches("SNAPSHOT_STATUS_")
                .to_owned()
        },
    )
}

fn mode_name(mode: i32) -> String {
    pb::SnapshotMode::try_from(mode).map_or_else(
        |_| format!("MODE_{mode}"),
        |m| {
            m.as_str_name()
                .trim_start_matches("SNAPSHOT_MODE_")
                .to_owned()
        },
    )
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The history's view of a snapshot (its data, if it has any).
fn view(s: &pb::Snapshot) -> SnapshotView {
    let plan = s.plan.clone().unwrap_or_default();
    let (failure_kind, failure) = s
        .failure
        .as_ref()
        .map_or((String::new(), String::new()), |f| {
            (
                pb::failure_reason::Kind::try_from(f.kind).map_or_else(
                    |_| format!("KIND_{}", f.kind),
                    |k| k.as_str_name().to_owned(),
                ),
                f.message.clone(),
            )
        });
    SnapshotView {
        id: plan.snapshot_id,
        term: s.term,
        mode: mode_name(plan.mode),
        status: status_name(s.status),
        failure_kind,
        failure,
        started_at_ms: s.started_at_ms,
        finished_at_ms: s.finished_at_ms,
        channels: s
            .channels
            .iter()
            .map(|c| format!("{}->{}", c.from, c.to))
            .collect(),
        nodes: s
            .nodes
            .iter()
            .map(|n| NodeView {
                node: n.node_id.clone(),
                state: text(&n.local_state),
                channels: n
                    .channel_states
                    .iter()
                    .map(|c| {
                        let channel = c.channel.clone().unwrap_or_default();
                        ChannelView {
                            from: channel.from,
                            to: channel.to,
                            messages: c.messages.iter().map(|m| text(&m.payload)).collect(),
                        }
                    })
                    .collect(),
            })
            .collect(),
    }
}

impl Nemesis {
    fn push(&self, entry: Entry) {
        lock(&self.shared).push(&entry);
    }

    fn at(&self) -> f64 {
        lock(&self.shared).history.at()
    }

    fn fault_line(&mut self, kind: &str, target: &str, detail: String) {
        let at = self.at();
        println!("[{at:7.2}s] {kind} {target} {detail}");
        *self.faults.entry(kind.to_owned()).or_default() += 1;
        self.push(Entry::Fault {
            at,
            kind: kind.to_owned(),
            target: target.to_owned(),
            detail,
        });
    }

    /// A client of the leading replica, kept while it works.
    async fn client(
        &mut self,
    ) -> anyhow::Result<pb::coordinator_client::CoordinatorClient<Channel>> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let c = self.cluster.client().await?;
        self.client = Some(c.clone());
        Ok(c)
    }

    /// The banks, as `GetBalance` answers (2 s each at most).
    async fn banks(&self) -> Vec<BankView> {
        let mut out = Vec::new();
        for i in 0..NODES {
            let answer = timeout(Duration::from_secs(2), async {
                let mut bank = self.cluster.bank(i).await?;
                anyhow::Ok(
                    bank.get_balance(cairn_rpc::bank::v1::GetBalanceRequest {})
                        .await?
                        .into_inner(),
                )
            })
            .await;
            out.push(match answer {
                Ok(Ok(b)) => BankView {
                    node: format!("n{}", i + 1),
                    state: Some(b.state_json),
                    duplicates: b.duplicate_transfers,
                    skipped: b.skipped_transfers,
                    rejected: b.rejected_transfers,
                },
                _ => BankView {
                    node: format!("n{}", i + 1),
                    state: None,
                    duplicates: 0,
                    skipped: 0,
                    rejected: 0,
                },
            });
        }
        out
    }

    /// Polls the banks and asks every replica whether it leads; whether every bank is of
    /// its original line.
    async fn poll(&mut self) -> bool {
        let banks = self.banks().await;
        let original = banks.iter().all(|b| {
            line_of(b.state.as_deref()).is_some_and(|l| self.original.get(&b.node) == Some(&l))
        });
        let at = self.at();
        self.push(Entry::Banks { at, banks });
        if let Ok(claims) = timeout(CALL_LIMIT, self.cluster.leader_claims()).await {
            for (replica, term) in claims {
                if self.leaders_seen.insert((replica, term)) {
                    let at = self.at();
                    self.push(Entry::Leader {
                        at,
                        replica: replica + 1,
                        term,
                    });
                }
            }
        }
        original
    }

    /// Writes the snapshots that ended since the last call, with their data.
    async fn collect(&mut self, page_size: u32) -> anyhow::Result<()> {
        let mut client = self.client().await?;
        let mut page_token = String::new();
        loop {
            let page = client
                .list_snapshots(pb::ListSnapshotsRequest {
                    status: 0,
                    page_size,
                    page_token,
                    mode: 0,
                })
                .await?
                .into_inner();
            for s in &page.snapshots {
                let id = s.plan.as_ref().map_or(0, |p| p.snapshot_id);
                if self.recorded.contains(&id) || s.status == pb::SnapshotStatus::InProgress as i32
                {
                    continue;
                }
                let full = if s.status == pb::SnapshotStatus::Completed as i32 {
                    client
                        .get_snapshot(pb::GetSnapshotRequest {
                            snapshot_id: id,
                            include_data: true,
                        })
                        .await?
                        .into_inner()
                } else {
                    s.clone()
                };
                self.recorded.insert(id);
                let view = view(&full);
                if view.status == "COMPLETED" {
                    let held = view
                        .nodes
                        .iter()
                        .any(|n| n.channels.iter().any(|c| !c.messages.is_empty()));
                    self.newest_completed.0 = self.newest_completed.0.max(id);
                    let clean = view.nodes.len() == self.original.len()
                        && view.nodes.iter().all(|n| {
                            line_of(Some(&n.state)) == self.original.get(&n.node).copied()
                        });
                    if clean {
                        self.newest_clean = self.newest_clean.max(id);
                    }
                    if held {
                        self.newest_completed.1 = self.newest_completed.1.max(id);
                    }
                    if lock(&self.shared)
                        .after_quiet
                        .as_ref()
                        .is_some_and(|ids| ids.contains(&id))
                    {
                        self.recovered = true;
                    }
                }
                self.push(Entry::Snapshot(view));
            }
            // One page while running (the newest); every page at the end.
            if page.next_page_token.is_empty() || page_size < 1000 {
                return Ok(());
            }
            page_token = page.next_page_token;
        }
    }

    fn pick(&mut self) -> Fault {
        let net: &[(Fault, u32)] = if self.net.is_some() { &NET_FAULTS } else { &[] };
        let etcd: &[(Fault, u32)] = if self.etcd_proxy.is_some() {
            &ETCD_FAULTS
        } else {
            &[]
        };
        let all = || FAULTS.iter().chain(net).chain(etcd).copied();
        let total: u32 = all().map(|(_, w)| w).sum();
        let mut at = self.rng.random_range(0..total);
        for (fault, weight) in all() {
            if at < weight {
                return fault;
            }
            at -= weight;
        }
        Fault::Cut
    }

    /// A pause's length: shorter than the timeouts, or longer.
    fn pause_ms(&mut self, long_from: u64, long_to: u64) -> u64 {
        if self.rng.random_bool(0.5) {
            self.rng.random_range(200..1_500)
        } else {
            self.rng.random_range(long_from..long_to)
        }
    }

    fn busy(&self, target: &str) -> bool {
        self.open.iter().any(|o| o.target == target)
    }

    fn channel(&mut self) -> (usize, usize) {
        let to = self.rng.random_range(0..NODES);
        let from = (to + self.rng.random_range(1..NODES)) % NODES;
        (from, to)
    }

    async fn inject(&mut self, from: usize, to: usize, fault: pb::inject_fault_request::Fault) {
        let request = channel_fault(&format!("n{}", from + 1), &format!("n{}", to + 1), fault);
        if let Ok(mut admin) = self.cluster.admin(to).await {
            let _ = admin.inject_fault(request).await;
        }
    }

    fn open(&mut self, kind: &'static str, target: String, ms: u64, undo: Undo) {
        self.open.push(Open {
            at: Instant::now() + Duration::from_millis(ms),
            kind,
            target,
            undo,
        });
    }

    /// Ends the durative faults due by `now` (all of them with `None`).
    async fn heal(&mut self, now: Option<Instant>) {
        let (due, keep): (Vec<Open>, Vec<Open>) = std::mem::take(&mut self.open)
            .into_iter()
            .partition(|o| now.is_none_or(|now| o.at <= now));
        self.open = keep;
        for o in due {
            self.undo(o).await;
        }
    }

    /// Ends the durative faults on `target` now.
    async fn heal_target(&mut self, target: &str) {
        let (due, keep): (Vec<Open>, Vec<Open>) = std::mem::take(&mut self.open)
            .into_iter()
            .partition(|o| o.target == target);
        self.open = keep;
        for o in due {
            self.undo(o).await;
        }
    }

    async fn undo(&mut self, o: Open) {
        match &o.undo {
            Undo::Resume(pid) => signal_pid(*pid, "-CONT"),
            Undo::Unhold(from, to) => {
                let (from, to) = (node_index(from), node_index(to));
                let resume = pb::inject_fault_request::Fault::Resume(pb::Resume {});
                let _ = timeout(CALL_LIMIT, self.inject(from, to, resume)).await;
            }
            Undo::Undelay(from, to) => {
                let (from, to) = (node_index(from), node_index(to));
                let undelay = pb::inject_fault_request::Fault::Delay(pb::Delay { millis: 0 });
                let _ = timeout(CALL_LIMIT, self.inject(from, to, undelay)).await;
            }
            Undo::EtcdUp => {
                if let Err(e) = self.etcd.resume().await {
                    eprintln!("etcd does not start again: {e:#}");
                }
            }
            Undo::Net(faults) => {
                for f in faults {
                    // A rule left in force would be blamed on cairn: retried, then the run
                    // fails as the harness's.
                    let mut tries = 0;
                    while let Err(e) = f.heal() {
                        tries += 1;
                        if tries == 3 {
                            let what = format!("cannot heal {} {}: {e:#}", o.kind, o.target);
                            eprintln!("{what}");
                            self.harness_errors.push(what);
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
        let at = self.at();
        println!("[{at:7.2}s] healed {} {}", o.kind, o.target);
        self.push(Entry::Heal {
            at,
            kind: o.kind.to_owned(),
            target: o.target,
        });
    }

    /// Restores the newest completed snapshot whose every state is of its bank's original
    /// line (never one holding a bank started afresh: the money would change for good); the
    /// snapshot and the restore's id.
    async fn restore(&mut self) -> Option<(u64, String)> {
        let id = self.newest_clean;
        if id == 0 {
            return None;
        }
        let mut client = self.client().await.ok()?;
        let sent_ms = now_ms();
        match client
            .restore_snapshot(pb::RestoreSnapshotRequest { snapshot_id: id })
            .await
        {
            Ok(op) => {
                let restore_id = op.into_inner().restore_id;
                let at = self.at();
                self.push(Entry::RestoreRequested {
                    at,
                    snapshot: id,
                    restore_id: restore_id.clone(),
                });
                Some((id, restore_id))
            }
            Err(status) => {
                let at = self.at();
                self.push(Entry::RestoreRefused {
                    at,
                    snapshot: id,
                    sent_ms,
                    answered_ms: now_ms(),
                    code: format!("{:?}", status.code()),
                    message: status.message().to_owned(),
                });
                self.client = None;
                None
            }
        }
    }

    async fn kill_leader(&mut self) -> Option<usize> {
        let (r, term) = self.cluster.leader().await.ok()?;
        let target = format!("coordinator{}", r + 1);
        self.heal_target(&target).await;
        self.cluster.kill_replica(r);
        if let Err(e) = self.cluster.start_replica(r) {
            eprintln!("cannot restart {target}: {e:#}");
        }
        self.client = None;
        self.fault_line("kill-leader", &target, format!("term {term}"));
        Some(r)
    }

    /// A fault of the network at `node` (with a peer, for a partition), for 1 to 8 s.
    fn net_fault(&mut self, fault: Fault, node: usize) {
        let ms = self.rng.random_range(1_000..8_000);
        let (from, to) = self.channel();
        let (a, b) = (from.min(to), from.max(to));
        let percent = self.rng.random_range(5..40);
        let kbit = self.rng.random_range(64..512);
        let n = format!("n{}", node + 1);
        let (kind, target, detail) = match fault {
            Fault::NetPartition => (
                "net-partition",
                format!("n{}|n{}", a + 1, b + 1),
                format!("{ms} ms"),
            ),
            Fault::NetIsolate => (
                "net-isolate",
                format!("{n}/net"),
                format!("from everyone for {ms} ms"),
            ),
            Fault::NetControl => (
                "net-control",
                format!("{n}/control"),
                format!("from the coordinators for {ms} ms"),
            ),
            Fault::NetLoss => (
                "net-loss",
                format!("{n}/loss"),
                format!("{percent}% of the packets it receives for {ms} ms"),
            ),
            _ => (
                "net-throttle",
                format!("{n}/link"),
                format!("{kbit} kbit/s out for {ms} ms"),
            ),
        };
        let Some(net) = &self.net else { return };
        if self.busy(&target) {
            return;
        }
        let made = match fault {
            Fault::NetPartition => net.partition(a, b),
            Fault::NetIsolate => net.isolate(node).map(|f| vec![f]),
            Fault::NetControl => net.cut_control(node).map(|f| vec![f]),
            Fault::NetLoss => net.loss(node, percent).map(|f| vec![f]),
            _ => net.throttle(node, kbit).map(|f| vec![f]),
        };
        match made {
            Ok(faults) => {
                self.fault_line(kind, &target, detail);
                self.open(kind, target, ms, Undo::Net(faults));
            }
            Err(e) => eprintln!("cannot make {kind} {target}: {e:#}"),
        }
    }

    async fn fault(&mut self) {
        let fault = self.pick();
        let node = self.rng.random_range(0..NODES);
        let n = format!("n{}", node + 1);
        let open = self.open.len() >= MAX_OPEN;
        match fault {
            Fault::Cut => {
                let (from, to) = self.channel();
                self.inject(from, to, pb::inject_fault_request::Fault::Cut(pb::Cut {}))
                    .await;
                self.fault_line("cut", &format!("n{}->n{}", from + 1, to + 1), String::new());
            }
            Fault::Hold | Fault::Delay if !open => {
                let (from, to) = self.channel();
                let target = format!("n{}->n{}", from + 1, to + 1);
                if self.busy(&target) {
                    return;
                }
                let ms = self.rng.random_range(500..6_000);
                let (f, a, b) = (
                    format!("n{}", from + 1),
                    format!("n{}", to + 1),
                    target.clone(),
                );
                if fault == Fault::Hold {
                    self.inject(from, to, pb::inject_fault_request::Fault::Hold(pb::Hold {}))
                        .await;
                    self.fault_line("hold", &b, format!("{ms} ms"));
                    self.open("hold", target, ms, Undo::Unhold(f, a));
                } else {
                    let millis = self.rng.random_range(20..300);
                    let delay = pb::inject_fault_request::Fault::Delay(pb::Delay { millis });
                    self.inject(from, to, delay).await;
                    self.fault_line("delay", &b, format!("{millis} ms a frame for {ms} ms"));
                    self.open("delay", target, ms, Undo::Undelay(f, a));
                }
            }
            Fault::NetPartition
            | Fault::NetIsolate
            | Fault::NetControl
            | Fault::NetLoss
            | Fault::NetThrottle
                if !open =>
            {
                self.net_fault(fault, node);
            }
            // A bank started afresh is restored before anything else happens.
            _ if self.bank_recovery.is_some() => {}
            Fault::KillNode => {
                // What its bank counted since the last poll is not lost with it.
                let _ = timeout(Duration::from_secs(12), self.poll()).await;
                self.heal_target(&n).await;
                self.heal_target(&format!("{n}-bank")).await;
                self.cluster.kill_node(node);
                if let Err(e) = self.cluster.start_node(node) {
                    eprintln!("cannot restart {n}: {e:#}");
                }
                self.fault_line("kill-node", &n, "daemon and bank, restarted".into());
            }
            Fault::KillBank if self.open.is_empty() => {
                // A bank's state is gone with it: an operator restores a snapshot from
                // before the crash (the restarted bank starts with a fresh balance).
                let _ = timeout(Duration::from_secs(12), self.poll()).await;
                self.cluster.kill_bank(node);
                if let Err(e) = self.cluster.start_bank(node) {
                    eprintln!("cannot restart {n}'s bank: {e:#}");
                }
                self.fault_line(
                    "kill-bank",
                    &n,
                    "restarted afresh; a restore follows".into(),
                );
                self.bank_recovery = Some((Instant::now() + Duration::from_secs(60), false));
            }
            Fault::KillLeader => {
                self.kill_leader().await;
            }
            Fault::KillLeaderDuringRestore => {
                if let Some((id, restore_id)) = self.restore().await {
                    self.fault_line("restore", "cluster", format!("snapshot {id}: {restore_id}"));
                    let ms = self.rng.random_range(0..300);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    self.kill_leader().await;
                }
            }
            Fault::KillEtcd if !open && !self.busy("etcd") => {
                let ms = self.rng.random_range(1_000..6_000);
                self.etcd.stop();
                self.client = None;
                self.fault_line("kill-etcd", "etcd", format!("down {ms} ms"));
                self.open("kill-etcd", "etcd".into(), ms, Undo::EtcdUp);
            }
            Fault::PauseDaemon | Fault::PauseBank if !open => {
                let (kind, target, pid) = if fault == Fault::PauseDaemon {
                    ("pause-daemon", n.clone(), self.cluster.node_pid(node))
                } else {
                    (
                        "pause-bank",
                        format!("{n}-bank"),
                        self.cluster.bank_process(node).map(|p| p.pid()),
                    )
                };
                if let Some(pid) = pid
                    && !self.busy(&target)
                {
                    let ms = self.pause_ms(3_000, 12_000);
                    signal_pid(pid, "-STOP");
                    self.fault_line(kind, &target, format!("{ms} ms"));
                    self.open(kind, target, ms, Undo::Resume(pid));
                }
            }
            Fault::PauseLeader if !open => {
                if let Ok((r, term)) = self.cluster.leader().await
                    && let Some(pid) = self.cluster.replica_pid(r)
                {
                    let target = format!("coordinator{}", r + 1);
                    if self.busy(&target) {
                        return;
                    }
                    // The lease is 5 s: a long pause loses the leadership.
                    let ms = self.pause_ms(6_000, 12_000);
                    signal_pid(pid, "-STOP");
                    self.client = None;
                    self.fault_line("pause-leader", &target, format!("{ms} ms, term {term}"));
                    self.open("pause-leader", target, ms, Undo::Resume(pid));
                }
            }
            Fault::PauseEtcd if !open && !self.busy("etcd") => {
                if let Some(pid) = self.etcd.pid() {
                    let ms = self.pause_ms(3_000, 8_000);
                    signal_pid(pid, "-STOP");
                    self.fault_line("pause-etcd", "etcd", format!("{ms} ms"));
                    self.open("pause-etcd", "etcd".into(), ms, Undo::Resume(pid));
                }
            }
            Fault::Restore => {
                if let Some((id, restore_id)) = self.restore().await {
                    self.fault_line("restore", "cluster", format!("snapshot {id}: {restore_id}"));
                }
            }
            Fault::EtcdLoseAnswer | Fault::EtcdLoseRequest | Fault::EtcdDelayRequest => {
                let (kind, loss) = match fault {
                    Fault::EtcdLoseAnswer => ("etcd-lose-answer", Loss::Answer),
                    Fault::EtcdLoseRequest => ("etcd-lose-request", Loss::Request),
                    _ => ("etcd-delay-request", Loss::Delay),
                };
                let pattern = ETCD_PATTERNS[self.rng.random_range(0..ETCD_PATTERNS.len())];
                // Past the coordinator's 5 s request timeout.
                let ms = self.rng.random_range(5_500..8_000);
                if let Some(proxy) = &self.etcd_proxy {
                    proxy.arm(pattern, loss, Duration::from_millis(ms));
                    let what = String::from_utf8_lossy(pattern).into_owned();
                    self.fault_line(kind, "etcd", format!("the next write with {what}, {ms} ms"));
                    // A restore record's write comes only with a restore: ask for one, whose
                    // answer must then be the restore or "outcome unknown", never a failure.
                    if pattern == ETCD_PATTERNS[3]
                        && let Some((id, restore_id)) = self.restore().await
                    {
                        self.fault_line(
                            "restore",
                            "cluster",
                            format!("snapshot {id}: {restore_id}"),
                        );
                    }
                }
            }
            // Too many durative faults open, or a bank's recovery under way: none this time.
            _ => {}
        }
    }

    /// A bank started afresh: restore a snapshot of the original lines (once accepted, the
    /// polls see the banks back on them; past the deadline the checker will see the fresh
    /// line stay).
    async fn recover_bank(&mut self) {
        let Some((deadline, requested)) = self.bank_recovery else {
            return;
        };
        if Instant::now() > deadline {
            println!("a bank started afresh was not restored within 60 s");
            self.bank_recovery = None;
            return;
        }
        if !requested && self.restore().await.is_some() {
            self.bank_recovery = Some((deadline, true));
        }
    }
}

/// Starts a snapshot in a random mode every 150–250 ms, at whichever replica accepts it
/// (a follower refuses; the next is tried), each call bounded.
async fn snapshots(shared: SharedRef, replicas: String, seed: u64) {
    let shared_ref = shared.clone();
    let replicas: Vec<String> = replicas.split(',').map(str::to_owned).collect();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_5eed);
    let mut at = 0;
    let mut client: Option<pb::coordinator_client::CoordinatorClient<Channel>> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(rng.random_range(150..250))).await;
        if lock(&shared).stop {
            return;
        }
        let mode = match rng.random_range(0..3) {
            0 => pb::SnapshotMode::ChandyLamport,
            1 => pb::SnapshotMode::Unaligned,
            _ => pb::SnapshotMode::Aligned,
        };
        let request = pb::StartSnapshotRequest {
            mode: mode as i32,
            timeout_ms: 10_000,
            ..Default::default()
        };
        let started = timeout(CALL_LIMIT, async {
            let mut c = match client.take() {
                Some(c) => c,
                None => pb::coordinator_client::CoordinatorClient::new(
                    cairn_sdk::tls::endpoint(&replicas[at % replicas.len()], None)?
                        .connect_timeout(Duration::from_secs(1))
                        .connect()
                        .await?,
                ),
            };
            let id = c.start_snapshot(request).await?.into_inner().snapshot_id;
            client = Some(c);
            anyhow::Ok(id)
        })
        .await;
        let mut shared = lock(&shared);
        match started {
            Ok(Ok(id)) => {
                shared.last_id = shared.last_id.max(id);
                if let Some(ids) = &mut shared.after_quiet {
                    ids.insert(id);
                }
                let at = shared.history.at();
                shared.push(&Entry::SnapshotStarted {
                    at,
                    id,
                    mode: mode_name(mode as i32),
                });
                if let Some(c) = client.clone() {
                    tokio::spawn(watch_told(shared_ref.clone(), c, id));
                }
            }
            Ok(Err(e)) => {
                let code = e.downcast_ref::<tonic::Status>().map(tonic::Status::code);
                let why = code.map_or_else(|| "no connection".to_owned(), |c| format!("{c:?}"));
                *shared.refused.entry(why).or_default() += 1;
                // The leader at its limit (ResourceExhausted) or fenced by a restore
                // (FailedPrecondition) is still the leader: try it again.
                if !matches!(
                    code,
                    Some(tonic::Code::ResourceExhausted | tonic::Code::FailedPrecondition)
                ) {
                    client = None;
                    at += 1;
                }
            }
            Err(_) => {
                *shared.refused.entry("timed out".into()).or_default() += 1;
                client = None;
                at += 1;
            }
        }
    }
}

fn node_index(id: &str) -> usize {
    id.trim_start_matches('n')
        .parse::<usize>()
        .map_or(0, |n| n.saturating_sub(1))
}

/// The `line` of a bank's state JSON.
fn line_of(state: Option<&str>) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(state?).ok()?["line"].as_u64()
}

/// Every bank drained: each one's last received from each peer is that peer's last sent.
fn drained(banks: &[BankView]) -> bool {
    let states: BTreeMap<&str, serde_json::Value> = banks
        .iter()
        .filter_map(|b| {
            let s = serde_json::from_str(b.state.as_deref()?).ok()?;
            Some((b.node.as_str(), s))
        })
        .collect();
    if states.len() != banks.len() {
        return false;
    }
    states.iter().all(|(a, s)| {
        let line = &s["line"];
        s["sent"].as_object().is_none_or(|sent| {
            sent.iter().all(|(b, id)| {
                states.get(b.as_str()).is_some_and(|r| {
                    let got = &r["received"][*a];
                    got["id"] == *id && got["line"] == *line
                })
            })
        })
    })
}

async fn run(args: &Args, seconds: u64) -> anyhow::Result<Verdict> {
    let etcd = Etcd::start().await?;
    let env: Vec<(String, String)> = args
        .mutant
        .iter()
        .map(|m| ("CAIRN_MUTANT".to_owned(), m.clone()))
        .collect();
    let net = if args.netns {
        Some(Net::start(NODES)?)
    } else {
        None
    };
    let placement = net.as_ref().map(Net::placement).unwrap_or_default();
    // The coordinators reach etcd through a proxy that can lose or delay what passes
    // (the nemesis, its checks and the closing reads use etcd directly).
    let etcd_proxy = if args.no_etcd_faults {
        None
    } else {
        let target = etcd
            .endpoint
            .trim_start_matches("http://")
            .parse()
            .map_err(|e| anyhow::anyhow!("etcd's endpoint {}: {e}", etcd.endpoint))?;
        Some(LossyProxy::start(target).await?)
    };
    let coordinators_etcd = etcd_proxy
        .as_ref()
        .map_or_else(|| etcd.endpoint.clone(), |p| format!("http://{}", p.addr));
    let cluster = CoordinatedCluster::start_placed(
        placement,
        usize::from(args.replicas),
        NODES,
        Store::Etcd(coordinators_etcd),
        &[],
        &[
            "--auto-restore",
            "--restore-timeout",
            "20s",
            "--max-concurrent",
            "4",
        ],
        &["--fault-injection"],
        None,
        &env,
    )
    .await?;
    let total = cluster.total();
    let mut nemesis = Nemesis {
        cluster,
        net,
        etcd,
        rng: StdRng::seed_from_u64(args.seed),
        shared: Arc::new(Mutex::new(Shared {
            history: Writer::create(&args.history)?,
            last_id: 0,
            after_quiet: None,
            refused: BTreeMap::new(),
            stop: false,
        })),
        client: None,
        open: Vec::new(),
        recorded: BTreeSet::new(),
        faults: BTreeMap::new(),
        bank_recovery: None,
        leaders_seen: BTreeSet::new(),
        original: BTreeMap::new(),
        newest_clean: 0,
        mutant: args.mutant.is_some(),
        recovered: false,
        harness_errors: Vec::new(),
        newest_completed: (0, 0),
        etcd_proxy,
    };
    nemesis.push(Entry::Setup {
        seed: args.seed,
        nodes: (1..=NODES).map(|i| format!("n{i}")).collect(),
        replicas: usize::from(args.replicas),
        total,
        seconds,
    });
    // The banks' first lines, before any fault, and a first snapshot, so that automatic
    // recovery always has one to restore.
    let banks = eventually("every bank answers", Duration::from_secs(30), || async {
        let banks = nemesis.banks().await;
        anyhow::ensure!(banks.iter().all(|b| b.state.is_some()), "{banks:?}");
        Ok(banks)
    })
    .await?;
    for b in &banks {
        let line = line_of(b.state.as_deref())
            .ok_or_else(|| anyhow::anyhow!("bank {} has no line: {:?}", b.node, b.state))?;
        nemesis.original.insert(b.node.clone(), line);
    }
    let at = nemesis.at();
    nemesis.push(Entry::Banks { at, banks });
    eventually("a first snapshot", Duration::from_secs(30), || async {
        let id = nemesis
            .cluster
            .start_snapshot(pb::StartSnapshotRequest::default())
            .await?;
        let s = nemesis.cluster.wait_with(id, false).await?;
        anyhow::ensure!(
            s.status == pb::SnapshotStatus::Completed as i32,
            "{:?}",
            s.failure
        );
        Ok(())
    })
    .await?;
    println!(
        "cairn-nemesis: seed {}, {seconds} s of faults, {NODES} nodes, {} coordinator replicas, \
         total {total}{}; history in {}",
        args.seed,
        args.replicas,
        args.mutant
            .as_ref()
            .map_or(String::new(), |m| format!(", MUTANT {m}")),
        args.history.display()
    );
    let deadline = Instant::now() + Duration::from_secs(seconds);
    // Snapshots go on, in a task of their own, until the run's end.
    let snapshots = tokio::spawn(snapshots(
        nemesis.shared.clone(),
        nemesis.cluster.coordinator_list(),
        args.seed,
    ));
    let mut next_fault = Instant::now() + Duration::from_secs(2);
    let mut next_poll = Instant::now();
    while Instant::now() < deadline {
        let first_heal = nemesis.open.iter().map(|o| o.at).min();
        let wake = [
            Some(next_fault),
            Some(next_poll),
            first_heal,
            Some(deadline),
        ]
        .into_iter()
        .flatten()
        .min()
        .expect("some");
        tokio::time::sleep_until(wake).await;
        let now = Instant::now();
        nemesis.heal(Some(now)).await;
        if next_poll <= now {
            let original = timeout(Duration::from_secs(12), nemesis.poll()).await;
            if nemesis
                .bank_recovery
                .is_some_and(|(_, requested)| requested)
                && original.unwrap_or(false)
            {
                nemesis.bank_recovery = None;
            }
            let _ = timeout(Duration::from_secs(5), nemesis.collect(200)).await;
            let _ = timeout(CALL_LIMIT, nemesis.recover_bank()).await;
            next_poll = Instant::now() + Duration::from_secs(1);
        }
        if next_fault <= now && Instant::now() < deadline {
            if timeout(Duration::from_secs(10), nemesis.fault())
                .await
                .is_err()
            {
                println!("a fault's call timed out (a paused or restarting peer)");
            }
            next_fault =
                Instant::now() + Duration::from_millis(nemesis.rng.random_range(1_500..4_000));
        }
    }
    nemesis.heal(None).await;
    while nemesis.bank_recovery.is_some() {
        let _ = timeout(Duration::from_secs(5), nemesis.collect(200)).await;
        let _ = timeout(CALL_LIMIT, nemesis.recover_bank()).await;
        let original = timeout(Duration::from_secs(12), nemesis.poll()).await;
        if nemesis
            .bank_recovery
            .is_some_and(|(_, requested)| requested)
            && original.unwrap_or(false)
        {
            nemesis.bank_recovery = None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let at = nemesis.at();
    nemesis.push(Entry::Quiet { at });
    lock(&nemesis.shared).after_quiet = Some(BTreeSet::new());
    println!("[{at:7.2}s] faults stopped; settling");
    if let Some(proxy) = &nemesis.etcd_proxy {
        let armed: u64 = [
            "etcd-lose-answer",
            "etcd-lose-request",
            "etcd-delay-request",
        ]
        .iter()
        .filter_map(|k| nemesis.faults.get(*k))
        .sum();
        // A fault armed for a write that never came before the next one replaced it fires
        // not at all.
        println!(
            "etcd faults: {armed} armed, {} fired on a coordinator's write",
            proxy.fired()
        );
    }
    let settled = settle(&mut nemesis, snapshots).await.and_then(|()| {
        anyhow::ensure!(
            nemesis.harness_errors.is_empty(),
            "the harness failed: {}",
            nemesis.harness_errors.join("; ")
        );
        Ok(())
    });
    let verdict =
        settled.and_then(|()| Ok(check(&history::read(&args.history)?, args.recovery_bound)));
    // A run that found something keeps every process's log.
    if verdict.as_ref().map_or(true, |v| !v.violations.is_empty()) {
        nemesis.cluster.keep_logs();
        println!("logs kept in {}", nemesis.cluster.logs().display());
    }
    verdict
}

/// After the faults: every member back, restores over, a snapshot completes; the workload
/// stops and the channels drain; the closing restore; the full record.
async fn settle(
    nemesis: &mut Nemesis,
    snapshots: tokio::task::JoinHandle<()>,
) -> anyhow::Result<()> {
    nemesis.client = None;
    nemesis.cluster.wait_registered(NODES).await?;
    let settled = eventually("restores settle", Duration::from_secs(120), || async {
        if let Some(newest) = newest_restore(&nemesis.cluster).await? {
            anyhow::ensure!(
                newest.done || newest.failure.is_some(),
                "{} in progress",
                newest.restore_id
            );
        }
        Ok(())
    })
    .await;
    if let Err(e) = settled {
        println!("restores did not settle: {e}");
    }
    // Snapshots go on until one completes (the checker wants one after the last fault).
    let mutant = nemesis.mutant;
    let patience =
        move |normal: u64, short: u64| Duration::from_secs(if mutant { short } else { normal });
    let recovered = Instant::now() + patience(90, 20);
    while Instant::now() < recovered {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _ = timeout(Duration::from_secs(5), nemesis.collect(200)).await;
        if nemesis.recovered {
            break;
        }
    }
    // The snapshot task ends (a start under way is written first), so that the final list
    // holds every snapshot started.
    lock(&nemesis.shared).stop = true;
    if timeout(Duration::from_secs(10), snapshots).await.is_err() {
        anyhow::bail!("the snapshot task did not stop");
    }
    nemesis.cluster.set_workload(0.0).await?;
    let drained_banks = eventually("the channels drain", patience(60, 15), || async {
        let banks = nemesis.banks().await;
        anyhow::ensure!(drained(&banks), "not drained: {banks:?}");
        Ok(())
    })
    .await;
    if let Err(e) = drained_banks {
        println!("the channels did not drain: {e:#}");
    }
    nemesis.poll().await;

    // Every snapshot started has ended (each has a timeout), so the record is whole.
    let ended = eventually("every snapshot ends", Duration::from_secs(60), || async {
        let mut client = nemesis.cluster.client().await?;
        let running = client
            .list_snapshots(pb::ListSnapshotsRequest {
                status: pb::SnapshotStatus::InProgress as i32,
                page_size: 1,
                page_token: String::new(),
                mode: 0,
            })
            .await?
            .into_inner();
        anyhow::ensure!(running.snapshots.is_empty(), "some still in progress");
        Ok(())
    })
    .await;
    if let Err(e) = ended {
        println!("{e:#}");
    }
    // The closing restore: the newest completed snapshot holding transfers in flight
    // (those are delivered after it), else the newest.
    nemesis.collect(1000).await?;
    let chosen = match nemesis.newest_completed {
        (0, _) => None,
        (newest, 0) => Some(newest),
        (_, with_transfers) => Some(with_transfers),
    };
    if let Some(snapshot) = chosen {
        let mut client = nemesis.client().await?;
        let op = client
            .restore_snapshot(pb::RestoreSnapshotRequest {
                snapshot_id: snapshot,
            })
            .await?
            .into_inner();
        let at = nemesis.at();
        nemesis.push(Entry::RestoreRequested {
            at,
            snapshot,
            restore_id: op.restore_id.clone(),
        });
        eventually(
            "the closing restore ends",
            Duration::from_secs(60),
            || async {
                let newest = newest_restore(&nemesis.cluster)
                    .await?
                    .ok_or_else(|| anyhow::anyhow!("no restore"))?;
                anyhow::ensure!(
                    newest.restore_id == op.restore_id,
                    "another restore is newest"
                );
                anyhow::ensure!(newest.done, "not done: {:?}", newest.failure);
                Ok(())
            },
        )
        .await?;
        let _ = eventually("the restored channels drain", patience(30, 10), || async {
            let banks = nemesis.banks().await;
            anyhow::ensure!(drained(&banks), "not drained");
            Ok(())
        })
        .await;
        let banks = nemesis.banks().await;
        let at = nemesis.at();
        nemesis.push(Entry::FinalRestore {
            at,
            snapshot,
            banks,
        });
    }
    nemesis.collect(1000).await?;
    let mut client = nemesis.client().await?;
    let restores = client
        .list_restores(pb::ListRestoresRequest { limit: 10_000 })
        .await?
        .into_inner()
        .restores;
    for r in restores {
        nemesis.push(Entry::Restore {
            restore_id: r.restore_id,
            snapshot: r.snapshot_id,
            requested_by: r.requested_by,
            done: r.done,
            failure: r.failure.map(|f| f.message).unwrap_or_default(),
            started_at_ms: r.started_at_ms,
        });
    }
    let at = nemesis.at();
    let (faults, refused) = (
        nemesis.faults.clone(),
        lock(&nemesis.shared).refused.clone(),
    );
    nemesis.push(Entry::End {
        at,
        faults,
        refused,
    });
    Ok(())
}

fn report(verdict: &Verdict) {
    println!("\n== cairn-nemesis: the checker's report");
    println!("faults injected: {:?}", verdict.faults);
    println!(
        "snapshots: {} started ({:?} refused); by outcome {:?}",
        verdict.snapshots_started, verdict.starts_refused, verdict.snapshots
    );
    println!(
        "checked: {} COMPLETED snapshots ({} with their money counted), {} channels id by id \
         ({} in-flight transfers), {} channels across a bank's fresh start",
        verdict.completed_checked,
        verdict.money_checked,
        verdict.channels_checked,
        verdict.in_flight_checked,
        verdict.channels_across_restart
    );
    println!(
        "restores: {:?}; terms: {:?}; transfers in the final lines: {}; longest recovery {:.1} s",
        verdict.restores, verdict.terms, verdict.transfers_final, verdict.longest_recovery_s
    );
    for v in &verdict.violations {
        eprintln!("VIOLATION: {v}");
    }
    if verdict.violations.is_empty() {
        println!("verdict: no violations");
    } else {
        println!("verdict: {} violations", verdict.violations.len());
    }
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
