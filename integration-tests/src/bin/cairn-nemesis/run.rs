//! A run: the cluster started, the nemesis and the workload for the time given, then the
//! cluster settled (every fault undone, the banks drained) and the history judged.

use super::*;

pub(super) async fn run(args: &Args, seconds: u64) -> anyhow::Result<Verdict> {
    let etcd = Etcd::start().await?;
    let mut env: Vec<(String, String)> = args
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
    // With --ledger, the banks' ledger, on the coordinators' side of the network (as etcd).
    let pg = if args.ledger {
        let pg = PgServer::start_on(placement.coordinator_ip(), &[]).await?;
        env.push(("CAIRN_LEDGER".to_owned(), pg.url()));
        Some(pg)
    } else {
        None
    };
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
        completed: BTreeMap::new(),
        mutant: args.mutant.is_some(),
        recovered: false,
        harness_errors: Vec::new(),
        etcd_proxy,
        pg,
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
pub(super) async fn settle(
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
    // The closing restore, of the history the cluster is on: the newest completed snapshot
    // of the original lines (the ledger is checked against it) holding transfers in flight
    // (those are delivered after it), else the best there is.
    nemesis.collect(1000).await?;
    let chosen = nemesis
        .choose(&[|c| c.clean && c.held, |c| c.clean, |c| c.held, |_| true])
        .await?;
    if let Some((snapshot, epoch)) = chosen {
        let mut client = nemesis.client().await?;
        let op = client
            .restore_snapshot(pb::RestoreSnapshotRequest {
                snapshot_id: snapshot,
                if_epoch: Some(epoch),
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
        // No cut since: the ledger holds what the restored states say was received.
        if let Some(pg) = &nemesis.pg {
            let (islands, prepared) = read_ledger(pg).await?;
            let at = nemesis.at();
            nemesis.push(Entry::Ledger {
                at,
                snapshot,
                islands,
                prepared,
            });
        }
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

/// The ledger's transfers as islands of consecutive ids per sender's line and receiver,
/// and the transactions left prepared.
async fn read_ledger(pg: &PgServer) -> anyhow::Result<(Vec<LedgerIsland>, Vec<String>)> {
    let client = pg.client().await?;
    let rows = client
        .query(
            "SELECT from_node, to_node, line::text, min(id)::text, max(id)::text FROM (
                SELECT from_node, to_node, line, id,
                       id - row_number() OVER (PARTITION BY from_node, to_node, line ORDER BY id)
                         AS island
                FROM ledger) t
             GROUP BY from_node, to_node, line, island ORDER BY 1, 2, 3, 4",
            &[],
        )
        .await?;
    let mut islands = Vec::with_capacity(rows.len());
    for r in rows {
        islands.push(LedgerIsland {
            from: r.try_get(0)?,
            to: r.try_get(1)?,
            line: r.try_get::<_, String>(2)?.parse()?,
            first: r.try_get::<_, String>(3)?.parse()?,
            last: r.try_get::<_, String>(4)?.parse()?,
        });
    }
    let prepared = client
        .query("SELECT gid FROM pg_prepared_xacts ORDER BY gid", &[])
        .await?
        .iter()
        .map(|r| r.try_get(0))
        .collect::<Result<_, _>>()?;
    Ok((islands, prepared))
}

pub(super) fn report(verdict: &Verdict) {
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
        "restores: {:?} ({} held to the history the cluster was on); terms: {:?}; transfers in \
         the final lines: {}; longest recovery {:.1} s",
        verdict.restores,
        verdict.restores_in_history_checked,
        verdict.terms,
        verdict.transfers_final,
        verdict.longest_recovery_s
    );
    match &verdict.ledger_unchecked {
        None => println!(
            "ledger: {} transfers checked id by id against the closing restore",
            verdict.ledger_transfers_checked
        ),
        Some(why) => println!("ledger: not checked ({why})"),
    }
    for v in &verdict.violations {
        eprintln!("VIOLATION: {v}");
    }
    if verdict.violations.is_empty() {
        println!("verdict: no violations");
    } else {
        println!("verdict: {} violations", verdict.violations.len());
    }
}
