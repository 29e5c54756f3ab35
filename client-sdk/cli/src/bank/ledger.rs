//! The bank's ledger (`cairn-bank --ledger postgres://…`): each transfer the bank applies
//! is written to PostgreSQL's `ledger` table exactly once, in the history that survives
//! crashes and restores, through the SDK's two-phase-commit sink.
//!
//! Rows are kept here as transfers are applied and handed to the sink at each cut, as one
//! statement: the cut's transaction holds every transfer applied since the last cut whose
//! pre-commit succeeded, and a row carries the snapshot whose transaction committed it.

use std::time::Duration;

use cairn_sdk::sink::postgres::{Param, Postgres, PostgresError};
use cairn_sdk::sink::{SinkError, SinkState, Transactional as _, TwoPhaseCommitSink};

use super::TransferPayload;

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

/// A transfer applied and not yet handed to the sink.
#[derive(Debug, Clone)]
struct Row {
    from: String,
    line: u64,
    id: u64,
    amount: u64,
}

/// The ledger of one bank.
#[derive(Debug)]
pub struct Ledger {
    node: String,
    sink: TwoPhaseCommitSink<Postgres>,
    rows: Vec<Row>,
}

/// What a ledger operation fails with.
pub type LedgerError = SinkError<PostgresError>;

impl Ledger {
    /// Connects to `url` for `node` of `cluster`, creates the `ledger` table if it is not
    /// there, and starts the sink.
    pub async fn open(
        url: &str,
        cluster: &str,
        node: &str,
        timeout: Duration,
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
            sink: TwoPhaseCommitSink::start(system).await?,
            rows: Vec::new(),
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
    /// (with those of a cut whose pre-commit failed). The pending transactions, to record in
    /// the state.
    pub async fn cut(&mut self, snapshot_id: u64) -> Result<SinkState, LedgerError> {
        if !self.rows.is_empty() {
            let rows = std::mem::take(&mut self.rows);
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
        }
        self.sink.pre_commit(snapshot_id).await
    }

    /// Snapshot `snapshot_id` completed: commits the pending transactions up to it.
    pub async fn completed(&mut self, snapshot_id: u64) -> Result<(), LedgerError> {
        self.sink.completed(snapshot_id).await
    }

    /// A restore of `snapshot_id`, whose state names `pending`: commits those, rolls back
    /// every other transaction of this node, deletes this node's rows committed with a
    /// later snapshot (a restore of a snapshot older than the newest completed: the
    /// restored history applies those transfers again), and drops the rows applied since
    /// the last cut (the restored history replays them). Each step is idempotent: a restore
    /// cut short is simply done again.
    pub async fn restored(
        &mut self,
        snapshot_id: u64,
        pending: &SinkState,
    ) -> Result<(), LedgerError> {
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
        self.rows.clear();
        Ok(())
    }

    /// The pending transactions.
    pub fn pending(&self) -> Vec<u64> {
        self.sink.pending()
    }
}
