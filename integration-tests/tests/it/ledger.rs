//! Exactly-once output on a real PostgreSQL (started by the tests, `postgresql` package):
//! the SDK's PostgreSQL sink across a server crash between pre-commit and commit, and the
//! bank's ledger (`cairn-bank --ledger`) under load while a bank, a daemon, the coordinator
//! and PostgreSQL are killed (-9), with automatic recovery, and an older snapshot is restored
//! by hand: afterwards the ledger holds
//! every transfer of the surviving history exactly once, checked by transfer id against
//! the banks' own records, and agrees with the balances.

use std::collections::BTreeMap;
use std::time::Duration;

use cairn_cli::bank::BankState;
use cairn_integration_tests::coordinated::{CoordinatedCluster, Store};
use cairn_integration_tests::postgres::PgServer;
use cairn_integration_tests::processes::{eventually, signal_pid};
use cairn_integration_tests::restore::{restore, wait_newest_restore, wait_restore};
use cairn_proto::bank::v1 as bank;
use cairn_proto::v1 as pb;
use cairn_sdk::sink::postgres::{Postgres, PostgresError};
use cairn_sdk::sink::{Cut, SinkError, SinkState, Transactional as _, TwoPhaseCommitSink};
use cairn_sdk::tokio_postgres::Client;

const TIMEOUT: Duration = Duration::from_secs(5);

async fn effects(client: &Client) -> Vec<i32> {
    client
        .query("SELECT v FROM effects ORDER BY v", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn prepared(client: &Client) -> Vec<String> {
    client
        .query("SELECT gid FROM pg_prepared_xacts ORDER BY gid", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn insert(v: i32) -> (&'static str, Vec<cairn_sdk::sink::postgres::Param>) {
    ("INSERT INTO effects VALUES ($1)", vec![Box::new(v)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_sink_settles_prepared_transactions_across_a_server_crash() {
    let mut pg = PgServer::start().await.unwrap();
    pg.client()
        .await
        .unwrap()
        .batch_execute("CREATE TABLE effects (v int)")
        .await
        .unwrap();
    let url = pg.url();
    let connect = |node: &'static str| Postgres::connect(&url, "c-1", node, TIMEOUT);
    let mut sink = TwoPhaseCommitSink::start(connect("n1").await.unwrap())
        .await
        .unwrap();
    // Another node of the cluster whose name extends this one's.
    let mut other = TwoPhaseCommitSink::start(connect("n1-0").await.unwrap())
        .await
        .unwrap();
    assert_eq!(sink.system().prefix(), "cairn-c%2D1-n1-");

    let (sql, params) = insert(1);
    sink.system().write(sql, params);
    assert_eq!(
        sink.cut(1).await.unwrap(),
        Cut::PreCommitted(SinkState::new(vec![1]).unwrap())
    );
    let (sql, params) = insert(100);
    other.system().write(sql, params);
    assert!(!other.cut(1).await.unwrap().carried());
    let client = pg.client().await.unwrap();
    assert_eq!(
        prepared(&client).await,
        vec!["cairn-c%2D1-n1%2D0-1", "cairn-c%2D1-n1-1"]
    );
    assert!(
        effects(&client).await.is_empty(),
        "pre-committed, not visible"
    );

    // The server crashes between the pre-commit and the commit; a cut while it is down
    // fails and keeps its effect for the next.
    pg.kill();
    let (sql, params) = insert(2);
    sink.system().write(sql, params);
    assert!(matches!(sink.cut(2).await, Err(SinkError::System(_))));
    pg.start_again().await.unwrap();
    let client = pg.client().await.unwrap();
    assert_eq!(
        prepared(&client).await.len(),
        2,
        "prepared transactions survive a crash"
    );
    // An idle sink pre-commits nothing: the cut carries its empty transaction.
    assert!(other.cut(2).await.unwrap().carried());
    assert_eq!(prepared(&client).await.len(), 2);
    sink.completed(1).await.unwrap();
    assert_eq!(effects(&client).await, vec![1]);
    assert_eq!(
        sink.system().pre_committed().await.unwrap(),
        Vec::<u64>::new()
    );
    // Committing again is Ok: the marker row says it was committed.
    sink.system().commit(1).await.unwrap();

    // The effect of the failed cut goes with the next one.
    assert_eq!(sink.cut(3).await.unwrap().state().pending, vec![3]);
    assert_eq!(sink.system().pre_committed().await.unwrap(), vec![3]);
    // A restore of snapshot 1 (its state named 1 pending): 1 is committed already, 3 is
    // rolled back, the other node's transaction is left alone.
    sink.restored(1, &SinkState::new(vec![1]).unwrap())
        .await
        .unwrap();
    assert_eq!(effects(&client).await, vec![1]);
    assert_eq!(prepared(&client).await, vec!["cairn-c%2D1-n1%2D0-1"]);
    // Committing what was rolled back is an error naming it: its effects are lost.
    match sink.system().commit(3).await {
        Err(PostgresError::RolledBack(gid)) => assert_eq!(gid, "cairn-c%2D1-n1-3"),
        other => panic!("{other:?}"),
    }
    // A statement reads the snapshot it is pre-committed under.
    sink.system().write(
        "INSERT INTO effects VALUES (current_setting('cairn.snapshot_id')::int)",
        Vec::new(),
    );
    assert!(!sink.cut(7).await.unwrap().carried());
    sink.completed(7).await.unwrap();
    other.completed(1).await.unwrap();
    assert_eq!(effects(&client).await, vec![1, 7, 100]);
    assert!(prepared(&client).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_prepared_transactions_is_refused_with_the_setting_to_change() {
    let pg = PgServer::start_with(&["max_prepared_transactions=0"])
        .await
        .unwrap();
    let e = Postgres::connect(&pg.url(), "c", "n1", TIMEOUT)
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("max_prepared_transactions = 0"),
        "{e}"
    );
    let e = Postgres::connect("postgres://[nonsense", "c", "n1", TIMEOUT)
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("not a PostgreSQL connection string"),
        "{e}"
    );
}

/// Each bank's state (`GetBalance.state_json`), by node.
async fn states(cluster: &CoordinatedCluster) -> anyhow::Result<BTreeMap<String, BankState>> {
    let mut out = BTreeMap::new();
    for i in 0..cluster.nodes.len() {
        let b = cluster
            .bank(i)
            .await?
            .get_balance(bank::GetBalanceRequest {})
            .await?
            .into_inner();
        out.insert(b.node_id, serde_json::from_str(&b.state_json)?);
    }
    Ok(out)
}

/// A ledger row: (from, to, line, id) and the amount.
type Ledger = BTreeMap<(String, String, u64, u64), u64>;

async fn ledger(client: &Client) -> anyhow::Result<Ledger> {
    let rows = client
        .query(
            "SELECT from_node, to_node, line::text, id::text, amount::text FROM ledger",
            &[],
        )
        .await?;
    let mut out = Ledger::new();
    for r in rows {
        let key = (
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, String>(2).parse()?,
            r.get::<_, String>(3).parse()?,
        );
        anyhow::ensure!(
            out.insert(key.clone(), r.get::<_, String>(4).parse()?)
                .is_none(),
            "transfer {key:?} twice in the ledger"
        );
    }
    Ok(out)
}

/// Waits for an automatic recovery newer than `before`, and checks it succeeded.
async fn recovered(cluster: &CoordinatedCluster, before: Option<String>) -> pb::RestoreOperation {
    let op = eventually("automatic recovery", Duration::from_secs(90), || async {
        let op = wait_newest_restore(cluster).await;
        anyhow::ensure!(Some(&op.restore_id) != before.as_ref(), "not yet");
        Ok(op)
    })
    .await
    .unwrap();
    assert!(op.done, "{:?}", op.failure);
    op
}

async fn newest_restore_id(cluster: &CoordinatedCluster) -> Option<String> {
    cairn_integration_tests::restore::newest_restore(cluster)
        .await
        .unwrap()
        .map(|op| op.restore_id)
}

fn snapshot_id(s: &pb::Snapshot) -> u64 {
    s.plan.as_ref().map_or(0, |p| p.snapshot_id)
}

/// Waits for a snapshot that starts after now to complete (the schedule takes them).
async fn a_completion(cluster: &CoordinatedCluster) -> u64 {
    next_end(cluster, pb::SnapshotStatus::Completed).await
}

/// Waits for a snapshot that starts after now to end with `status`.
async fn next_end(cluster: &CoordinatedCluster, status: pb::SnapshotStatus) -> u64 {
    let after = cluster
        .client()
        .await
        .unwrap()
        .list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .snapshots
        .iter()
        .map(snapshot_id)
        .max()
        .unwrap_or(0);
    eventually(
        "a scheduled snapshot ends so",
        Duration::from_secs(90),
        || async {
            let list = cluster
                .client()
                .await?
                .list_snapshots(pb::ListSnapshotsRequest::default())
                .await?
                .into_inner();
            let ended = list
                .snapshots
                .iter()
                .filter(|s| snapshot_id(s) > after && s.status == status as i32)
                .max_by_key(|s| snapshot_id(s))
                .ok_or_else(|| anyhow::anyhow!("none yet after {after}"))?;
            eprintln!(
                "snapshot {} {status:?} {:?}",
                snapshot_id(ended),
                ended.failure
            );
            Ok(snapshot_id(ended))
        },
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_holds_each_transfer_of_the_restored_history_once_through_kills() {
    // Room for two prepared transactions, for three banks: at most cuts, one bank finds the
    // server full and carries its transfers in its state, through the kills and restores.
    let mut pg = PgServer::start_with(&["max_prepared_transactions=2"])
        .await
        .unwrap();
    let env = vec![("CAIRN_LEDGER".to_owned(), pg.url())];
    let mut cluster = CoordinatedCluster::start_env(
        3,
        Store::Embedded,
        &[],
        &[
            "--auto-restore",
            "--schedule-interval",
            "250ms",
            "--schedule-mode",
            "unaligned",
            "--schedule-timeout",
            "3s",
        ],
        &[],
        &env,
    )
    .await
    .unwrap();
    let client = pg.client().await.unwrap();
    let workload = 100.0;
    a_completion(&cluster).await;

    // 1. A bank killed between a pre-commit and its commit, then its node restarted (as a
    // pod is): automatic recovery. A bank is stopped (SIGSTOP) as soon as one of its
    // transactions is seen prepared, and killed if it still is (else it goes on and the
    // next is caught). Whichever bank it is: with two slots for three, one may go long
    // without one.
    let (victim, caught) = eventually(
        "a bank stopped holding a prepared transaction",
        Duration::from_secs(60),
        || async {
            for (i, node) in ["n1", "n2", "n3"].into_iter().enumerate() {
                let of_node =
                    format!("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'cairn-%-{node}-%'");
                if client.query(&of_node, &[]).await?.is_empty() {
                    continue;
                }
                let bank = cluster.bank_process(i).unwrap().pid();
                signal_pid(bank, "-STOP");
                let held = client.query(&of_node, &[]).await?;
                if held.is_empty() {
                    signal_pid(bank, "-CONT");
                    continue;
                }
                let gids: Vec<String> = held.iter().map(|r| r.get(0)).collect();
                return Ok((i, gids));
            }
            anyhow::bail!("none prepared, or each committed before its bank stopped")
        },
    )
    .await
    .unwrap();
    let before = newest_restore_id(&cluster).await;
    cluster.kill_bank(victim);
    cluster.kill_node(victim);
    cluster.bank_workload = 0.0;
    cluster.start_node(victim).unwrap();
    recovered(&cluster, before).await;
    let still = client
        .query("SELECT gid FROM pg_prepared_xacts", &[])
        .await
        .unwrap();
    for gid in &caught {
        assert!(
            !still.iter().any(|r| &r.get::<_, String>(0) == gid),
            "{gid}, prepared when its bank died, is settled by the recovery"
        );
    }
    cluster.set_workload(workload).await.unwrap();
    a_completion(&cluster).await;

    // 2. A daemon killed alone: its bank's session ends and the bank exits; both restart.
    let before = newest_restore_id(&cluster).await;
    if let Some(pid) = cluster.node_pid(1) {
        signal_pid(pid, "-KILL");
    }
    cluster.kill_node(1);
    cluster.start_node(1).unwrap();
    recovered(&cluster, before).await;
    cluster.set_workload(workload).await.unwrap();
    let older = a_completion(&cluster).await;

    // 3. PostgreSQL killed under load: cuts and commits fail while it is down, then the
    // pending transactions commit at the next completion.
    pg.kill();
    next_end(&cluster, pb::SnapshotStatus::Failed).await;
    pg.start_again().await.unwrap();
    let client = pg.client().await.unwrap();
    a_completion(&cluster).await;

    // 4. The coordinator killed and restarted.
    cluster.kill_coordinator();
    cluster.start_coordinator().unwrap();
    cluster.wait_registered(3).await.unwrap();
    a_completion(&cluster).await;

    // 5. An operator restores an older snapshot: the ledger forgets the transfers after it
    // (committed since), which the restored history applies again.
    let op = restore(&cluster, older).await.unwrap();
    let op = wait_restore(&cluster, &op.restore_id).await;
    assert!(op.done, "{:?}", op.failure);
    a_completion(&cluster).await;

    // Quiesce: no transfer in flight, then a completion commits every pending transaction.
    cluster.set_workload(0.0).await.unwrap();
    let states = eventually(
        "every transfer delivered",
        Duration::from_secs(60),
        || async {
            let states = states(&cluster).await?;
            for (from, s) in &states {
                for (to, sent) in &s.sent {
                    let got = states[to].received.get(from).map(|r| (r.line, r.id));
                    anyhow::ensure!(
                        got == Some((s.line, *sent)),
                        "{from}→{to}: sent {sent}, got {got:?}"
                    );
                }
            }
            Ok(states)
        },
    )
    .await
    .unwrap();
    // Exactly the transfers each bank received, each once (the key refuses a second).
    let mut expected = Ledger::new();
    for (to, s) in &states {
        for (from, r) in &s.received {
            for id in 1..=r.id {
                expected.insert((from.clone(), to.clone(), r.line, id), 0);
            }
        }
    }
    let keys = |l: &Ledger| l.keys().cloned().collect::<Vec<_>>();
    let last = a_completion(&cluster).await;
    let ledger = eventually("the ledger committed", Duration::from_secs(60), || async {
        let ledger = ledger(&client).await?;
        // Carried transfers are pre-committed at a later cut that finds room.
        anyhow::ensure!(
            ledger.len() >= expected.len(),
            "{} of {} transfers committed",
            ledger.len(),
            expected.len()
        );
        // The schedule goes on: only later snapshots' transactions may be prepared.
        let prepared: Vec<String> = client
            .query("SELECT gid FROM pg_prepared_xacts", &[])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let old = prepared.iter().filter(|gid| {
            gid.rsplit('-').next().and_then(|id| id.parse::<u64>().ok()) <= Some(last)
        });
        anyhow::ensure!(
            old.count() == 0,
            "still prepared after {last} completed: {prepared:?}"
        );
        Ok(ledger)
    })
    .await
    .unwrap();

    assert_eq!(
        keys(&ledger),
        keys(&expected),
        "the ledger is the restored history"
    );
    assert!(ledger.len() > 100, "under load: {} transfers", ledger.len());
    // And it agrees with the balances: each bank holds what it started with, plus what
    // the ledger says it received, less what it says it sent.
    let mut money = 0;
    for (node, s) in &states {
        let credits: u64 = ledger
            .iter()
            .filter(|(k, _)| &k.1 == node)
            .map(|(_, a)| a)
            .sum();
        let debits: u64 = ledger
            .iter()
            .filter(|(k, _)| &k.0 == node)
            .map(|(_, a)| a)
            .sum();
        assert_eq!(
            cluster.initial_balance + credits - debits,
            s.balance,
            "{node}: the ledger and the balance"
        );
        money += s.balance;
    }
    assert_eq!(money, cluster.total());
    let full = pg
        .logged()
        .matches("maximum number of prepared transactions reached")
        .count();
    assert!(
        full > 0,
        "no cut found the server full: the carrying path went untested"
    );
    eprintln!("ledger: {full} pre-commits refused for room, carried in the banks' states");
    eprintln!(
        "ledger: {} transfers exactly once; caught prepared at the kill: {caught:?}; last completed {last}",
        ledger.len()
    );
}
