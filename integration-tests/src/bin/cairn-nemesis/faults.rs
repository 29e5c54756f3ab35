//! The nemesis's faults: what it may inject (each with its weight, and whether it needs
//! network namespaces or etcd's proxy), how a durative one is undone, and the injection
//! of each against the cluster's processes, channels, network and etcd.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    Cut,
    Hold,
    Delay,
    KillNode,
    KillBank,
    KillLeader,
    KillLeaderDuringRestore,
    KillEtcd,
    KillPostgres,
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

pub(super) const FAULTS: [(Fault, u32); 13] = [
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
pub(super) const NET_FAULTS: [(Fault, u32); 5] = [
    (Fault::NetPartition, 3),
    (Fault::NetIsolate, 1),
    (Fault::NetControl, 1),
    (Fault::NetLoss, 2),
    (Fault::NetThrottle, 1),
];

/// PostgreSQL's, drawn with --ledger (the seeded schedule without it is as before).
pub(super) const LEDGER_FAULTS: [(Fault, u32); 1] = [(Fault::KillPostgres, 1)];

/// The faults between the coordinators and etcd (a proxy in front of etcd), drawn unless
/// --no-etcd-faults.
pub(super) const ETCD_FAULTS: [(Fault, u32); 3] = [
    (Fault::EtcdLoseAnswer, 2),
    (Fault::EtcdLoseRequest, 2),
    (Fault::EtcdDelayRequest, 2),
];

/// What the etcd faults look for in a coordinator's request: a write of a record whose end
/// or start matters (only writes carry these bytes: reads name keys, not values).
pub(super) const ETCD_PATTERNS: [&[u8]; 4] = [
    b"\"status\": \"COMPLETED\"",
    b"\"status\": \"FAILED\"",
    b"\"status\": \"IN_PROGRESS\"",
    b"\"requested_by\"",
];

/// How a durative fault ends.
#[derive(Debug, Clone)]
pub(super) enum Undo {
    /// SIGCONT to this process.
    Resume(u32),
    /// The channel delivers freely again.
    Unhold(String, String),
    /// The channel's delay is removed.
    Undelay(String, String),
    /// etcd starts again.
    EtcdUp,
    /// PostgreSQL starts again (its crash recovery keeps what was prepared).
    PostgresUp,
    /// The network's rules are taken away.
    Net(Vec<NetFault>),
}

pub(super) struct Open {
    pub(super) at: Instant,
    pub(super) kind: &'static str,
    pub(super) target: String,
    pub(super) undo: Undo,
}

impl Nemesis {
    pub(super) fn push(&self, entry: Entry) {
        lock(&self.shared).push(&entry);
    }

    pub(super) fn at(&self) -> f64 {
        lock(&self.shared).history.at()
    }

    pub(super) fn fault_line(&mut self, kind: &str, target: &str, detail: String) {
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
    pub(super) async fn client(
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
    pub(super) async fn banks(&self) -> Vec<BankView> {
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
    pub(super) async fn poll(&mut self) -> bool {
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
    pub(super) async fn collect(&mut self, page_size: u32) -> anyhow::Result<()> {
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
                    let clean = view.nodes.len() == self.original.len()
                        && view.nodes.iter().all(|n| {
                            line_of(Some(&n.state)) == self.original.get(&n.node).copied()
                        });
                    let epoch = view.epoch.unwrap_or_default();
                    self.completed.insert(id, Completed { epoch, clean, held });
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

    pub(super) fn pick(&mut self) -> Fault {
        let net: &[(Fault, u32)] = if self.net.is_some() { &NET_FAULTS } else { &[] };
        let etcd: &[(Fault, u32)] = if self.etcd_proxy.is_some() {
            &ETCD_FAULTS
        } else {
            &[]
        };
        let ledger: &[(Fault, u32)] = if self.pg.is_some() {
            &LEDGER_FAULTS
        } else {
            &[]
        };
        let all = || FAULTS.iter().chain(net).chain(etcd).chain(ledger).copied();
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
    pub(super) fn pause_ms(&mut self, long_from: u64, long_to: u64) -> u64 {
        if self.rng.random_bool(0.5) {
            self.rng.random_range(200..1_500)
        } else {
            self.rng.random_range(long_from..long_to)
        }
    }

    pub(super) fn busy(&self, target: &str) -> bool {
        self.open.iter().any(|o| o.target == target)
    }

    pub(super) fn channel(&mut self) -> (usize, usize) {
        let to = self.rng.random_range(0..NODES);
        let from = (to + self.rng.random_range(1..NODES)) % NODES;
        (from, to)
    }

    pub(super) async fn inject(
        &mut self,
        from: usize,
        to: usize,
        fault: pb::inject_fault_request::Fault,
    ) {
        let request = channel_fault(&format!("n{}", from + 1), &format!("n{}", to + 1), fault);
        if let Ok(mut admin) = self.cluster.admin(to).await {
            let _ = admin.inject_fault(request).await;
        }
    }

    pub(super) fn open(&mut self, kind: &'static str, target: String, ms: u64, undo: Undo) {
        self.open.push(Open {
            at: Instant::now() + Duration::from_millis(ms),
            kind,
            target,
            undo,
        });
    }

    /// Ends the durative faults due by `now` (all of them with `None`).
    pub(super) async fn heal(&mut self, now: Option<Instant>) {
        let (due, keep): (Vec<Open>, Vec<Open>) = std::mem::take(&mut self.open)
            .into_iter()
            .partition(|o| now.is_none_or(|now| o.at <= now));
        self.open = keep;
        for o in due {
            self.undo(o).await;
        }
    }

    /// Ends the durative faults on `target` now.
    pub(super) async fn heal_target(&mut self, target: &str) {
        let (due, keep): (Vec<Open>, Vec<Open>) = std::mem::take(&mut self.open)
            .into_iter()
            .partition(|o| o.target == target);
        self.open = keep;
        for o in due {
            self.undo(o).await;
        }
    }

    pub(super) async fn undo(&mut self, o: Open) {
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
            Undo::PostgresUp => {
                if let Some(pg) = self.pg.as_mut()
                    && let Err(e) = pg.start_again().await
                {
                    let what = format!("PostgreSQL does not start again: {e:#}");
                    eprintln!("{what}");
                    self.harness_errors.push(what);
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

    /// The snapshot to restore and the epoch it was chosen in: of the history the cluster
    /// is on (read from the restores now, and the snapshots' epochs), the newest completed
    /// one the first of `wants` that any fits accepts. Restored on the condition that the
    /// cluster is still in that epoch, it never brings back a history a restore discarded
    /// (whose ledger rows that restore deleted), even when automatic recovery comes in
    /// between.
    pub(super) async fn choose(
        &mut self,
        wants: &[fn(&Completed) -> bool],
    ) -> anyhow::Result<Option<(u64, u64)>> {
        let mut client = self.client().await?;
        let restores = client
            .list_restores(pb::ListRestoresRequest { limit: 10_000 })
            .await?
            .into_inner()
            .restores;
        let restored: BTreeMap<u64, u64> =
            restores.iter().map(|r| (r.epoch, r.snapshot_id)).collect();
        let epochs: BTreeMap<u64, u64> = self
            .completed
            .iter()
            .map(|(&id, c)| (id, c.epoch))
            .collect();
        let epoch = restored
            .keys()
            .chain(epochs.values())
            .copied()
            .max()
            .unwrap_or(0);
        let lineage = Lineage::of(epoch, &restored, &epochs);
        Ok(wants.iter().find_map(|fits| {
            self.completed
                .iter()
                .rev()
                .find(|(id, c)| lineage.contains(**id, c.epoch) && fits(c))
                .map(|(&id, _)| (id, epoch))
        }))
    }

    /// Restores the newest completed snapshot of the history the cluster is on whose every
    /// state is of its bank's original line (never one holding a bank started afresh: the
    /// money would change for good); the snapshot and the restore's id.
    pub(super) async fn restore(&mut self) -> Option<(u64, String)> {
        let (id, epoch) = match self.choose(&[|c| c.clean]).await {
            Ok(chosen) => chosen?,
            Err(_) => {
                self.client = None;
                return None;
            }
        };
        let mut client = self.client().await.ok()?;
        let sent_ms = now_ms();
        match client
            .restore_snapshot(pb::RestoreSnapshotRequest {
                snapshot_id: id,
                if_epoch: Some(epoch),
            })
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

    pub(super) async fn kill_leader(&mut self) -> Option<usize> {
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
    pub(super) fn net_fault(&mut self, fault: Fault, node: usize) {
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

    pub(super) async fn fault(&mut self) {
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
            Fault::KillPostgres if !open && !self.busy("postgres") => {
                let Some(pg) = self.pg.as_mut() else {
                    return;
                };
                let ms = self.rng.random_range(1_000..6_000);
                pg.kill();
                self.fault_line("kill-postgres", "postgres", format!("down {ms} ms"));
                self.open("kill-postgres", "postgres".into(), ms, Undo::PostgresUp);
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
    pub(super) async fn recover_bank(&mut self) {
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
