//! `cairn-faults`: a seeded, bounded randomised fault run against a real cluster — four
//! daemons with banks transferring money, a coordinator on etcd with automatic recovery —
//! while snapshots start in random modes every 100–300 ms and a nemesis cuts channels,
//! kills (-9) and restarts daemons and the coordinator (also in the middle of restores),
//! pauses daemons (SIGSTOP) and restores snapshots. Afterwards it checks, from the
//! snapshots' data and not from their verdicts, that every COMPLETED snapshot holds all the
//! money, and that once the faults stop the live banks hold all of it too: nothing lost or
//! duplicated. Exits 1 naming every violation (and keeps the cluster's logs).
//!
//! Needs the binaries (`cargo build --bins`) and etcd (`apt-get install etcd-server`).

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use cairn_integration_tests::coordinated::{CoordinatedCluster, Store, bank_money, channel_fault};
use cairn_integration_tests::etcd::Etcd;
use cairn_integration_tests::processes::eventually;
use cairn_integration_tests::restore::{balances, newest_restore};
use cairn_proto::v1 as pb;
use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

/// A seeded randomised fault run (see the module docs).
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The seed: the same seed draws the same faults at the same moments.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How long the nemesis runs, in seconds (the checks take some more).
    #[arg(long, default_value_t = 150)]
    seconds: u64,
    /// Where to write the run's numbers as JSON.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

const NODES: usize = 4;

/// The longest any one call of the nemesis may take.
const CALL_LIMIT: Duration = Duration::from_secs(3);

#[derive(Debug, Clone, Copy)]
enum Fault {
    Cut,
    KillNode,
    KillCoordinator,
    Pause,
    Restore,
    KillDuringRestore,
}

const FAULTS: [(Fault, u32); 6] = [
    (Fault::Cut, 4),
    (Fault::KillNode, 3),
    (Fault::KillCoordinator, 2),
    (Fault::Pause, 2),
    (Fault::Restore, 2),
    (Fault::KillDuringRestore, 2),
];

fn pick(rng: &mut StdRng) -> Fault {
    let total: u32 = FAULTS.iter().map(|(_, w)| w).sum();
    let mut at = rng.random_range(0..total);
    for (fault, weight) in FAULTS {
        if at < weight {
            return fault;
        }
        at -= weight;
    }
    Fault::Cut
}

fn signal(pid: u32, sig: &str) {
    cairn_integration_tests::processes::signal_pid(pid, sig);
}

struct Run {
    cluster: CoordinatedCluster,
    rng: StdRng,
    /// What the nemesis did, in order, with the run's second.
    events: Vec<String>,
    counts: BTreeMap<String, u64>,
    started: Instant,
    paused: Option<(usize, u32, Instant)>,
}

impl Run {
    fn note(&mut self, what: String) {
        let at = self.started.elapsed().as_secs_f64();
        println!("[{at:7.2}s] {what}");
        self.events.push(format!("{at:.2}s {what}"));
    }

    fn count(&mut self, what: &str) {
        *self.counts.entry(what.to_owned()).or_default() += 1;
    }

    async fn start_snapshot(&mut self) {
        let mode = match self.rng.random_range(0..3) {
            0 => pb::SnapshotMode::ChandyLamport,
            1 => pb::SnapshotMode::Unaligned,
            _ => pb::SnapshotMode::Aligned,
        };
        let request = pb::StartSnapshotRequest {
            mode: mode as i32,
            timeout_ms: 10_000,
            ..Default::default()
        };
        match self.cluster.start_snapshot(request).await {
            Ok(_) => self.count("snapshots started"),
            Err(_) => self.count("snapshot starts refused"),
        }
    }

    async fn newest_completed(&self) -> Option<u64> {
        let mut client = self.cluster.client().await.ok()?;
        let list = client
            .list_snapshots(pb::ListSnapshotsRequest {
                status: pb::SnapshotStatus::Completed as i32,
                page_size: 10,
                page_token: String::new(),
                mode: 0,
            })
            .await
            .ok()?
            .into_inner();
        list.snapshots
            .first()
            .and_then(|s| s.plan.as_ref())
            .map(|p| p.snapshot_id)
    }

    async fn restore(&mut self) -> Option<String> {
        let id = self.newest_completed().await?;
        let mut client = self.cluster.client().await.ok()?;
        match client
            .restore_snapshot(pb::RestoreSnapshotRequest { snapshot_id: id })
            .await
        {
            Ok(op) => {
                let op = op.into_inner();
                self.note(format!("restore of snapshot {id}: {}", op.restore_id));
                Some(op.restore_id)
            }
            Err(e) => {
                self.note(format!("restore of snapshot {id} refused: {}", e.message()));
                None
            }
        }
    }

    fn resume_paused(&mut self) {
        if let Some((i, pid, _)) = self.paused.take() {
            signal(pid, "-CONT");
            self.note(format!("n{} resumed (SIGCONT)", i + 1));
        }
    }

    async fn fault(&mut self) {
        let fault = pick(&mut self.rng);
        self.count(&format!("fault {fault:?}"));
        let node = self.rng.random_range(0..NODES);
        match fault {
            Fault::Cut => {
                let to = self.rng.random_range(0..NODES);
                let from = (to + self.rng.random_range(1..NODES)) % NODES;
                let (from, to) = (format!("n{}", from + 1), to);
                let request = channel_fault(
                    &from,
                    &format!("n{}", to + 1),
                    pb::inject_fault_request::Fault::Cut(pb::Cut {}),
                );
                if let Ok(mut admin) = self.cluster.admin(to).await {
                    let _ = admin.inject_fault(request).await;
                }
                self.note(format!("cut channel {from}->n{}", to + 1));
            }
            Fault::KillNode => {
                if self.paused.is_some_and(|(p, _, _)| p == node) {
                    self.resume_paused();
                }
                self.cluster.kill_node(node);
                if let Err(e) = self.cluster.start_node(node) {
                    self.note(format!("cannot restart n{}: {e}", node + 1));
                }
                self.note(format!(
                    "killed -9 and restarted n{} (daemon and bank)",
                    node + 1
                ));
            }
            Fault::KillCoordinator => {
                self.cluster.kill_coordinator();
                let _ = self.cluster.start_coordinator();
                self.note("killed -9 and restarted the coordinator".into());
            }
            Fault::Pause => {
                if self.paused.is_none()
                    && let Some(pid) = self.cluster.node_pid(node)
                {
                    signal(pid, "-STOP");
                    let ms = self.rng.random_range(1_000..8_000);
                    self.paused = Some((node, pid, Instant::now() + Duration::from_millis(ms)));
                    self.note(format!("paused n{} (SIGSTOP) for {ms} ms", node + 1));
                }
            }
            Fault::Restore => {
                self.restore().await;
            }
            Fault::KillDuringRestore => {
                if self.restore().await.is_some() {
                    let ms = self.rng.random_range(0..300);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    self.cluster.kill_coordinator();
                    let _ = self.cluster.start_coordinator();
                    self.note(format!(
                        "killed -9 and restarted the coordinator {ms} ms into the restore"
                    ));
                }
            }
        }
    }
}

async fn list_all(cluster: &CoordinatedCluster) -> anyhow::Result<Vec<pb::Snapshot>> {
    let mut client = cluster.client().await?;
    let mut out = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_snapshots(pb::ListSnapshotsRequest {
                status: 0,
                page_size: 1000,
                page_token,
                mode: 0,
            })
            .await?
            .into_inner();
        out.extend(page.snapshots);
        if page.next_page_token.is_empty() {
            return Ok(out);
        }
        page_token = page.next_page_token;
    }
}

async fn run(args: &Args) -> anyhow::Result<(Vec<String>, serde_json::Value)> {
    let etcd = Etcd::start().await?;
    let cluster = CoordinatedCluster::start_with(
        NODES,
        Store::Etcd(etcd.endpoint.clone()),
        &[],
        &[
            "--auto-restore",
            "--restore-timeout",
            "20s",
            "--max-concurrent",
            "4",
        ],
        &["--fault-injection"],
    )
    .await?;
    let mut run = Run {
        cluster,
        rng: StdRng::seed_from_u64(args.seed),
        events: Vec::new(),
        counts: BTreeMap::new(),
        started: Instant::now(),
        paused: None,
    };
    let total = run.cluster.total();
    // A first snapshot, so that automatic recovery always has one to restore.
    eventually("a first snapshot", Duration::from_secs(30), || async {
        let id = run
            .cluster
            .start_snapshot(pb::StartSnapshotRequest::default())
            .await?;
        let s = run.cluster.wait_with(id, false).await?;
        anyhow::ensure!(
            s.status == pb::SnapshotStatus::Completed as i32,
            "{:?}",
            s.failure
        );
        Ok(())
    })
    .await?;
    run.note(format!(
        "seed {}, {} s of faults, {NODES} nodes, total {total}",
        args.seed, args.seconds
    ));
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let mut next_snapshot = Instant::now();
    let mut next_fault = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        let resume_at = run.paused.map(|(_, _, at)| at);
        let wake = [
            Some(next_snapshot),
            Some(next_fault),
            resume_at,
            Some(deadline),
        ]
        .into_iter()
        .flatten()
        .min()
        .expect("some");
        tokio::time::sleep_until(wake).await;
        let now = Instant::now();
        if resume_at.is_some_and(|at| at <= now) {
            run.resume_paused();
        }
        if next_snapshot <= now {
            // Every call is bounded: a paused daemon or a restarting coordinator must not
            // stall the nemesis (the pause's end is this loop's job).
            if tokio::time::timeout(CALL_LIMIT, run.start_snapshot())
                .await
                .is_err()
            {
                run.count("snapshot starts timed out");
            }
            next_snapshot = now + Duration::from_millis(run.rng.random_range(100..300));
        }
        if next_fault <= now && now < deadline {
            if tokio::time::timeout(CALL_LIMIT, run.fault()).await.is_err() {
                run.note("a fault's call timed out (a paused or restarting peer)".into());
            }
            next_fault = Instant::now() + Duration::from_millis(run.rng.random_range(2_000..5_000));
        }
    }
    run.resume_paused();
    run.note("faults stopped; waiting for the cluster to settle".into());

    let mut violations = Vec::new();
    // Every member back, any restore over (automatic recovery retries a failed one).
    run.cluster.wait_registered(NODES).await?;
    let settled = eventually("restores settle", Duration::from_secs(120), || async {
        if let Some(newest) = newest_restore(&run.cluster).await? {
            anyhow::ensure!(
                newest.done,
                "{} not done: {:?}",
                newest.restore_id,
                newest.failure
            );
        }
        // Not fenced: a snapshot starts and completes.
        let id = run
            .cluster
            .start_snapshot(pb::StartSnapshotRequest::default())
            .await?;
        let s = run.cluster.wait(id).await?;
        anyhow::ensure!(
            s.status == pb::SnapshotStatus::Completed as i32,
            "{:?}",
            s.failure
        );
        Ok(())
    })
    .await;
    if let Err(e) = &settled {
        violations.push(format!("the cluster did not settle after the faults: {e}"));
    }
    run.cluster.set_workload(0.0).await?;
    let live = eventually(
        "the live money adds up",
        Duration::from_secs(60),
        || async {
            let live: u64 = balances(&run.cluster).await?.values().sum();
            anyhow::ensure!(live == total, "the banks hold {live}, not {total}");
            Ok(live)
        },
    )
    .await;
    if let Err(e) = live {
        violations.push(format!("live money: {e}"));
    }

    // Every COMPLETED snapshot, read back with its data, holds all the money.
    let snapshots = list_all(&run.cluster).await?;
    let mut client = run.cluster.client().await?;
    let mut by_status: BTreeMap<String, u64> = BTreeMap::new();
    for s in &snapshots {
        let id = s.plan.as_ref().map_or(0, |p| p.snapshot_id);
        let status = pb::SnapshotStatus::try_from(s.status)
            .map_or("?".into(), |st| st.as_str_name().to_owned());
        let kind = s.failure.as_ref().map_or(String::new(), |f| {
            pb::failure_reason::Kind::try_from(f.kind)
                .map_or("?".into(), |k| format!(" {}", k.as_str_name()))
        });
        *by_status.entry(format!("{status}{kind}")).or_default() += 1;
        if s.status != pb::SnapshotStatus::Completed as i32 {
            continue;
        }
        let full = client
            .get_snapshot(pb::GetSnapshotRequest {
                snapshot_id: id,
                include_data: true,
            })
            .await;
        match full.map(|r| r.into_inner()) {
            Ok(full) => match bank_money(&full) {
                Ok(money) if money == total => {}
                Ok(money) => violations.push(format!(
                    "snapshot {id} is COMPLETED but holds {money}, not {total}"
                )),
                Err(e) => violations.push(format!("snapshot {id}: unreadable bank state: {e}")),
            },
            Err(e) => violations.push(format!("snapshot {id}: cannot read its data: {e}")),
        }
    }
    let restores = client
        .list_restores(pb::ListRestoresRequest { limit: 10_000 })
        .await?
        .into_inner()
        .restores;
    let mut restore_outcomes: BTreeMap<String, u64> = BTreeMap::new();
    for r in &restores {
        let how = if r.done {
            "done"
        } else if r.failure.is_some() {
            "failed"
        } else {
            "in progress"
        };
        let who = if r.requested_by == "user" {
            "user"
        } else {
            "automatic"
        };
        *restore_outcomes.entry(format!("{who} {how}")).or_default() += 1;
    }
    println!("restores: {restore_outcomes:?}");
    let completed = snapshots
        .iter()
        .filter(|s| s.status == pb::SnapshotStatus::Completed as i32)
        .count();
    println!("\nsnapshots by outcome: {by_status:?}");
    // Why the failed ones failed, each reason once with its count and first snapshot (the
    // node and channel names kept, so that a pattern shows).
    let mut reasons: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for s in &snapshots {
        if let Some(f) = &s.failure {
            let id = s.plan.as_ref().map_or(0, |p| p.snapshot_id);
            let entry = reasons.entry(f.message.clone()).or_insert((0, id));
            entry.0 += 1;
        }
    }
    for (reason, (count, first)) in &reasons {
        println!("  failed {count}× (first: snapshot {first}): {reason}");
    }
    println!("nemesis: {:?}", run.counts);
    if completed < 10 {
        violations.push(format!(
            "only {completed} snapshots completed: the run proves little"
        ));
    }
    if !violations.is_empty() {
        run.cluster.keep_logs();
    }
    let summary = serde_json::json!({
        "seed": args.seed,
        "seconds": args.seconds,
        "snapshots": by_status,
        "completed_checked": completed,
        "nemesis": run.counts,
        "restores": restore_outcomes,
        "violations": violations,
        "events": run.events,
    });
    Ok((violations, summary))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    // Interrupted (Ctrl-C, SIGTERM), the run is dropped: every process it started is
    // killed by its guard.
    let result = runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("a SIGTERM handler");
        tokio::select! {
            result = run(&args) => result,
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
            _ = term.recv() => Err(anyhow::anyhow!("terminated")),
        }
    });
    match result {
        Ok((violations, summary)) => {
            if let Some(out) = &args.out {
                let _ =
                    std::fs::write(out, serde_json::to_vec_pretty(&summary).unwrap_or_default());
            }
            for v in &violations {
                eprintln!("VIOLATION: {v}");
            }
            let checked = summary["completed_checked"].as_u64().unwrap_or(0);
            println!("faults: {checked} passed, {} failed", violations.len());
            if violations.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("cairn-faults could not run: {e:#}");
            ExitCode::FAILURE
        }
    }
}
