//! The bank's ledger (`cairn-bank --ledger postgres://…`): each transfer the bank applies
//! is written to PostgreSQL's `ledger` table exactly once, in the history that survives
//! crashes and restores, through the SDK's two-phase-commit sink.
//!
//! Rows are kept here as transfers are applied and handed to the sink at each cut, as one
//! statement: the cut's transaction holds every transfer applied since the last cut whose
//! pre-commit succeeded, and a row carries the snapshot whose transaction committed it.
//! A cut that carries its transaction (the sink holds its most pending, or PostgreSQL is
//! out of prepared transactions) records those rows in the bank's state instead
//! (`ledger_open`), and a restore of that snapshot writes them again.

use std::time::Duration;

use cairn_sdk::session::AppSession;
use cairn_sdk::sink::postgres::{Param, Postgres, PostgresError};
use cairn_sdk::sink::{Cut, SinkError, SinkState, Transactional as _, TwoPhaseCommitSink};
use serde::{Deserialize, Serialize};

use super::{BankState, TransferPayload};

/// The ledger table (one database per cluster). A transfer is named by its sender, its
/// receiver, the sender's line and its id in that line; the key refuses a second copy.
const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS ledger (
    from_node text NOT NULL,
    to_node text NOT NULL,
    line numeric(20) NOT NULL,
    id numeric(20) NOT NULL,
    amount numeric(20) NOT NULL,
    snapshot_id numeric(20) NOT NULL,
    PRIMARY KEY (from_node, to_node, line, id)
)";

/// The rows of one cut, as arrays (one statement whatever their number). The snapshot is
/// the one whose transaction commits them, set by the sink in that transaction.
const INSERT: &str = "INSERT INTO ledger (from_node, to_node, line, id, amount, snapshot_id)
    SELECT f, $1, l::numeric, i::numeric, a::numeric,
           current_setting('cairn.snapshot_id')::numeric
    FROM unnest($2::text[], $3::text[], $4::text[], $5::text[]) AS r(f, l, i, a)";

/// A node's rows committed with a snapshot after the one restored.
const DELETE_AFTER: &str =
    "DELETE FROM ledger WHERE to_node = $1 AND snapshot_id > $2::text::numeric";

/// A transfer applied and not yet pre-committed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Row {
    /// The sender.
    pub from: String,
    /// The sender's line.
    pub line: u64,
    /// The transfer's id in the line.
    pub id: u64,
    /// The amount credited.
    pub amount: u64,
}

/// The ledger of one bank.
#[derive(Debug)]
pub struct Ledger {
    node: String,
    sink: TwoPhaseCommitSink<Postgres>,
    /// Every transfer applied since the last cut that pre-committed, in order…
    rows: Vec<Row>,
    /// …of which the first this many are written into the sink's open transaction.
    written: usize,
}

/// What a cut gives the bank's state: the sink's pending transactions, and the rows it
/// carried past the cut (empty if it pre-committed them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerCut {
    /// The sink's state.
    pub pending: Vec<u64>,
    /// The transfers applied since the last cut that pre-committed, when this one carried.
    pub open: Vec<Row>,
}

/// What a ledger operation fails with.
pub type LedgerError = SinkError<PostgresError>;

impl Ledger {
    /// Connects to `url` for `node` of `cluster`, creates the `ledger` table if it is not
    /// there, and starts the sink, which keeps at most `max_pending` transactions pending.
    pub async fn open(
        url: &str,
        cluster: &str,
        node: &str,
        timeout: Duration,
        max_pending: usize,
    ) -> Result<Self, LedgerError> {
        let mut system = Postgres::connect(url, cluster, node, timeout)
            .await
            .map_err(SinkError::System)?;
        system
            .create_table("ledger", SCHEMA)
            .await
            .map_err(SinkError::System)?;
        let left = system.pre_committed().await.map_err(SinkError::System)?;
        if !left.is_empty() {
            tracing::info!(
                snapshots = ?left,
                "ledger transactions an earlier process of this node pre-committed: the next \
                 restore commits those its state names and rolls back the rest"
            );
        }
        Ok(Self {
            node: node.to_owned(),
            sink: TwoPhaseCommitSink::start(system)
                .await?
                .with_max_pending(max_pending),
            rows: Vec::new(),
            written: 0,
        })
    }

    /// A transfer from `from` was applied (credited).
    pub fn applied(&mut self, from: &str, transfer: &TransferPayload) {
        self.rows.push(Row {
            from: from.to_owned(),
            line: transfer.line,
            id: transfer.id,
            amount: transfer.amount,
        });
    }

    /// At the cut of `snapshot_id`: pre-commits every transfer applied since the last cut
    /// that pre-committed, or carries them. What to record in the state.
    pub async fn cut(&mut self, snapshot_id: u64) -> Result<LedgerCut, LedgerError> {
        if self.written < self.rows.len() {
            let rows = &self.rows[self.written..];
            let column = |f: fn(&Row) -> String| rows.iter().map(f).collect::<Vec<_>>();
            let params: Vec<Param> = vec![
                Box::new(self.node.clone()),
                Box::new(column(|r| r.from.clone())),
                Box::new(column(|r| r.line.to_string())),
                Box::new(column(|r| r.id.to_string())),
                Box::new(column(|r| r.amount.to_string())),
            ];
            // Kept by the system until a pre-commit takes it.
            self.sink.system().write(INSERT, params);
            self.written = self.rows.len();
        }
        Ok(match self.sink.cut(snapshot_id).await? {
            Cut::PreCommitted(state) => {
                self.rows.clear();
                self.written = 0;
                LedgerCut {
                    pending: state.pending,
                    open: Vec::new(),
                }
            }
            Cut::Carried(state) => {
                tracing::debug!(
                    snapshot_id,
                    pending = ?state.pending,
                    rows = self.rows.len(),
                    "ledger transaction carried past the cut"
                );
                LedgerCut {
                    pending: state.pending,
                    open: self.rows.clone(),
                }
            }
        })
    }

    /// Snapshot `snapshot_id` completed: commits the pending transactions up to it.
    pub async fn completed(&mut self, snapshot_id: u64) -> Result<(), LedgerError> {
        self.sink.completed(snapshot_id).await
    }

    /// A restore of `snapshot_id`, whose state names `pending`: commits those, rolls back
    /// every other transaction of this node, deletes this node's rows committed with a
    /// later snapshot (a restore of a snapshot older than the newest completed: the
    /// restored history applies those transfers again), and drops the rows applied since
    /// the last cut (the restored history replays them), keeping instead those the restored
    /// cut carried (`open`), for the next cut to pre-commit. Each step is idempotent: a
    /// restore cut short is simply done again.
    pub async fn restored(
        &mut self,
        snapshot_id: u64,
        pending: &SinkState,
        open: &[Row],
    ) -> Result<(), LedgerError> {
        // The sink's open transaction is dropped with the rest of the discarded history.
        self.written = 0;
        self.sink.restored(snapshot_id, pending).await?;
        let removed = self
            .sink
            .system()
            .execute_now(DELETE_AFTER, &[&self.node, &snapshot_id.to_string()])
            .await
            .map_err(SinkError::System)?;
        if removed > 0 {
            tracing::info!(
                snapshot_id,
                removed,
                "ledger rows of transfers after the restored snapshot deleted"
            );
        }
        self.rows = open.to_vec();
        Ok(())
    }

    /// The pending transactions.
    pub fn pending(&self) -> Vec<u64> {
        self.sink.pending()
    }
}

/// Opens the ledger, trying until `timeout` while PostgreSQL does not answer (a
/// connection string or a server setting that is wrong fails at once).
pub(super) async fn open_ledger(
    url: &str,
    session: &AppSession,
    timeout: Duration,
    max_pending: usize,
) -> anyhow::Result<Ledger> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut delay = Duration::from_millis(100);
    loop {
        let op_timeout = cairn_sdk::sink::postgres::DEFAULT_TIMEOUT;
        match Ledger::open(
            url,
            session.cluster(),
            session.node_id(),
            op_timeout,
            max_pending,
        )
        .await
        {
            Ok(ledger) => return Ok(ledger),
            Err(SinkError::System(e))
                if e.is_unavailable() && tokio::time::Instant::now() + delay < deadline =>
            {
                tracing::info!("ledger database not ready ({e}); retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            Err(e) => return Err(anyhow::anyhow!("--ledger: {e}")),
        }
    }
}

/// Settles the ledger for a restore of `snapshot_id` with `restored`, trying for up to a
/// minute while PostgreSQL is away (the restore waits: the state is not applied before).
pub(super) async fn restore_ledger(
    ledger: &mut Ledger,
    snapshot_id: u64,
    restored: &BankState,
) -> anyhow::Result<()> {
    let pending = SinkState::new(restored.ledger_pending.clone())
        .map_err(|e| anyhow::anyhow!("the restored state's ledger_pending: {e}"))?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut delay = Duration::from_millis(100);
    loop {
        match ledger
            .restored(snapshot_id, &pending, &restored.ledger_open)
            .await
        {
            Ok(()) => return Ok(()),
            Err(e) if tokio::time::Instant::now() + delay < deadline => {
                tracing::warn!(snapshot_id, "ledger recovery failed, trying again: {e}");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e.into()),
        }
    }
}
