//! A [`Transactional`] PostgreSQL: prepared transactions (two-phase commit), with
//! `tokio-postgres`. Built with the SDK's `postgres` feature.
//!
//! - The open transaction is kept here, as the statements written into it
//!   ([`Postgres::write`]), and sent at the cut: `BEGIN`, the statements, a marker row,
//!   `PREPARE TRANSACTION 'cairn-<cluster>-<node>-<snapshot>'`, in one go. A connection or
//!   a server lost between two cuts loses nothing, and a snapshot costs one batch of round
//!   trips whatever the effects since the last.
//! - `COMMIT PREPARED` and `ROLLBACK PREPARED` settle a pre-committed transaction from any
//!   connection, after any crash of this process or of the server (PostgreSQL keeps
//!   prepared transactions on disk).
//! - The marker row (`cairn_sink_commits`, one per snapshot and node, written in the
//!   prepared transaction) tells a transaction already committed (its marker is there) from
//!   one rolled back (not there) when `COMMIT PREPARED` finds nothing: the first is `Ok`,
//!   the second an error, as [`Transactional::commit`] asks.
//!
//! The server needs `max_prepared_transactions` above 0 (PostgreSQL's default is 0):
//! [`Postgres::connect`] refuses a server without it. A prepared transaction can be
//! settled only by the user who prepared it (or a superuser), in the same database.

use std::time::Duration;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Config, NoTls};

use super::Transactional;

/// PostgreSQL's longest transaction identifier (`PREPARE TRANSACTION`'s), in bytes.
const MAX_GID: usize = 199;

/// How long one operation (a connection, a pre-commit, a commit, …) may take by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// A parameter of a statement written into the open transaction.
pub type Param = Box<dyn ToSql + Send + Sync>;

/// What goes wrong with PostgreSQL.
#[derive(Debug, thiserror::Error)]
pub enum PostgresError {
    /// The connection string or the names do not make a usable sink.
    #[error("{0}")]
    Config(String),
    /// The server refused or failed, or the connection was lost (the operation's outcome
    /// may be unknown: the sink settles it).
    #[error("PostgreSQL: {}", db_words(.0))]
    Db(#[from] tokio_postgres::Error),
    /// The operation took longer than the timeout (its outcome is unknown).
    #[error("PostgreSQL did not answer {0} within {1:?}")]
    Timeout(&'static str, Duration),
    /// `COMMIT PREPARED` of a transaction rolled back: its effects are gone.
    #[error("transaction {0} was rolled back, not committed: its effects are lost")]
    RolledBack(String),
}

impl PostgresError {
    /// Whether the server could not be reached or did not answer (worth trying again), as
    /// opposed to refusing (a wrong password, a missing database or table, a setting).
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Db(e) => e.code().is_none(),
            Self::Timeout(..) => true,
            Self::Config(_) | Self::RolledBack(_) => false,
        }
    }
}

/// A statement of the open transaction.
struct Effect {
    sql: String,
    params: Vec<Param>,
}

/// PostgreSQL as a two-phase-commit sink's external system. See the module's
/// documentation.
pub struct Postgres {
    config: Config,
    client: Option<Client>,
    /// `cairn-<cluster>-<node>-`: every transaction identifier of this sink starts so.
    prefix: String,
    open: Vec<Effect>,
    timeout: Duration,
}

impl std::fmt::Debug for Postgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postgres")
            .field("prefix", &self.prefix)
            .field("open", &self.open.len())
            .field("connected", &self.client.is_some())
            .finish_non_exhaustive()
    }
}

/// A name as it goes into a transaction identifier: ASCII letters, digits, `.` and `_`
/// as they are, any other byte (`-`, the separator, among them) as `%XX`, so that two
/// (cluster, node) pairs never share a prefix and the identifier needs no quoting.
fn gid_part(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b == b'.' || b == b'_' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Postgres {
    /// Connects to the server at `url` (`postgres://user:password@host:port/database`, or
    /// libpq's `key=value` form; TLS is not offered: use `sslmode=disable` or a Unix
    /// socket), for the node `node` of cluster `cluster`, and creates the marker table if
    /// it is not there. Refuses a server whose `max_prepared_transactions` is 0.
    pub async fn connect(
        url: &str,
        cluster: &str,
        node: &str,
        timeout: Duration,
    ) -> Result<Self, PostgresError> {
        let mut config: Config = url.parse().map_err(|e| {
            // Not the string itself: it may hold a password.
            PostgresError::Config(format!("not a PostgreSQL connection string: {e}"))
        })?;
        config.connect_timeout(timeout);
        let prefix = format!("cairn-{}-{}-", gid_part(cluster), gid_part(node));
        if prefix.len() + 20 > MAX_GID {
            return Err(PostgresError::Config(format!(
                "the cluster and node names make transaction identifiers longer than \
                 PostgreSQL's {MAX_GID} bytes ({prefix}…)"
            )));
        }
        let mut sink = Self {
            config,
            client: None,
            prefix,
            open: Vec::new(),
            timeout,
        };
        let setting = sink
            .run("SHOW", async |client, _| {
                client
                    .query_one("SHOW max_prepared_transactions", &[])
                    .await
            })
            .await?;
        let max: String = setting.try_get(0)?;
        if max.trim() == "0" {
            return Err(PostgresError::Config(
                "the PostgreSQL server has max_prepared_transactions = 0: set it above 0 \
                 (e.g. 64, at least one per node writing through it) and restart the server"
                    .into(),
            ));
        }
        sink.create_table(
            "cairn_sink_commits",
            "CREATE TABLE IF NOT EXISTS cairn_sink_commits (gid text PRIMARY KEY)",
        )
        .await?;
        Ok(sink)
    }

    /// Runs `create` (`CREATE TABLE IF NOT EXISTS table …`) at once, outside the open
    /// transaction. Sinks starting together race to create it (PostgreSQL may refuse the
    /// loser): it is `Ok` if the table is there afterwards.
    pub async fn create_table(&mut self, table: &str, create: &str) -> Result<(), PostgresError> {
        let created = self
            .run("CREATE TABLE", async |client, _| {
                client.batch_execute(create).await
            })
            .await;
        if created.is_ok() {
            return Ok(());
        }
        let there = self
            .run("SELECT", async |client, _| {
                client
                    .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
                    .await
            })
            .await?;
        if there.try_get::<_, bool>(0)? {
            Ok(())
        } else {
            created
        }
    }

    /// The prefix of this sink's transaction identifiers.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Writes a statement into the open transaction: it runs at the next cut, in the
    /// transaction pre-committed under that cut's snapshot, with the statements written
    /// before it, in order. Nothing reaches the server before the cut; if that cut's
    /// pre-commit fails, the statement runs at the next one. In the transaction,
    /// `current_setting('cairn.snapshot_id')` is the id it is pre-committed under.
    pub fn write(&mut self, sql: impl Into<String>, params: Vec<Param>) {
        self.open.push(Effect {
            sql: sql.into(),
            params,
        });
    }

    /// Runs `sql` with `params` at once, outside the open transaction (its own
    /// transaction: e.g. removing effects committed above a restored snapshot); the rows
    /// it changed.
    pub async fn execute_now(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, PostgresError> {
        self.run("a statement", async |client, _| {
            client.execute(sql, params).await
        })
        .await
    }

    /// Statements written since the last pre-commit.
    pub fn written(&self) -> usize {
        self.open.len()
    }

    fn gid(&self, snapshot_id: u64) -> String {
        format!("{}{snapshot_id}", self.prefix)
    }

    /// The connection, made again if lost.
    async fn client(&mut self) -> Result<&Client, PostgresError> {
        if self.client.as_ref().is_none_or(Client::is_closed) {
            self.client = None;
            let (client, connection) =
                within(self.timeout, "a connection", self.config.connect(NoTls)).await?;
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!("PostgreSQL connection ended: {e}");
                }
            });
            // The server gives up when this side does: a statement cut short by the
            // timeout (its connection dropped) must not run on, holding its locks, in a
            // backend that never notices the client left — the next attempt would wait on
            // them, and every retry would leave one more such backend until no connection
            // is left. A session idle in a transaction is ended alike.
            // PostgreSQL takes at most i32::MAX ms (about 24 days).
            let ms = self.timeout.as_millis().clamp(1, 2_147_483_647);
            let limits = format!(
                "SET statement_timeout = {ms}; SET idle_in_transaction_session_timeout = {ms}"
            );
            within(
                self.timeout,
                "the session's limits",
                client.batch_execute(&limits),
            )
            .await?;
            self.client = Some(client);
        }
        Ok(self.client.as_ref().expect("set above"))
    }

    /// Runs `op` on the connection; on an error, the connection is dropped (a transaction
    /// left open on it goes with it), and the next operation connects again.
    async fn run<R>(
        &mut self,
        op: &'static str,
        f: impl AsyncFnOnce(&Client, &[Effect]) -> Result<R, tokio_postgres::Error>,
    ) -> Result<R, PostgresError> {
        let timeout = self.timeout;
        self.client().await?;
        let client = self.client.as_ref().expect("connected above");
        let result = within(timeout, op, f(client, &self.open)).await;
        if result.is_err() {
            self.client = None;
        }
        result
    }

    /// Runs `sql` with the identifier of `snapshot_id`'s transaction, which needs quoting
    /// as a literal (PostgreSQL takes no parameter there); `gid_part` leaves no quote in it.
    async fn settle(&mut self, op: &'static str, snapshot_id: u64) -> Result<bool, PostgresError> {
        let statement = format!("{op} '{}'", self.gid(snapshot_id));
        let result = self
            .run(op, async |client, _| client.batch_execute(&statement).await)
            .await;
        match result {
            Ok(()) => Ok(true),
            Err(PostgresError::Db(e)) if e.code() == Some(&SqlState::UNDEFINED_OBJECT) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// What the server said (its message and SQLSTATE: tokio-postgres's own words are only
/// "db error"), or the client's error with its cause.
fn db_words(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!(
            "{}: {} (SQLSTATE {}){}",
            db.severity(),
            db.message(),
            db.code().code(),
            db.detail().map(|d| format!(": {d}")).unwrap_or_default()
        ),
        None => match std::error::Error::source(e) {
            Some(cause) => format!("{e}: {cause}"),
            None => e.to_string(),
        },
    }
}

async fn within<R, E: Into<PostgresError>>(
    timeout: Duration,
    op: &'static str,
    f: impl Future<Output = Result<R, E>>,
) -> Result<R, PostgresError> {
    match tokio::time::timeout(timeout, f).await {
        Ok(result) => result.map_err(Into::into),
        Err(_) => Err(PostgresError::Timeout(op, timeout)),
    }
}

impl Transactional for Postgres {
    type Error = PostgresError;

    /// Drops the statements written and not pre-committed (the open transaction is kept
    /// here until the cut).
    async fn begin(&mut self) -> Result<(), PostgresError> {
        self.open.clear();
        Ok(())
    }

    async fn pre_commit(&mut self, snapshot_id: u64) -> Result<(), PostgresError> {
        let gid = self.gid(snapshot_id);
        let prepare = format!("PREPARE TRANSACTION '{gid}'");
        self.run("PREPARE TRANSACTION", async |client, open| {
            client.batch_execute("BEGIN").await?;
            client
                .execute(
                    "SELECT set_config('cairn.snapshot_id', $1, true)",
                    &[&snapshot_id.to_string()],
                )
                .await?;
            for effect in open {
                let params: Vec<&(dyn ToSql + Sync)> = effect
                    .params
                    .iter()
                    .map(|p| p.as_ref() as &(dyn ToSql + Sync))
                    .collect();
                client.execute(effect.sql.as_str(), &params).await?;
            }
            client
                .execute("INSERT INTO cairn_sink_commits (gid) VALUES ($1)", &[&gid])
                .await?;
            client.batch_execute(&prepare).await
        })
        .await?;
        self.open.clear();
        Ok(())
    }

    fn open_is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// `PREPARE TRANSACTION` refused with "maximum number of prepared transactions
    /// reached" (SQLSTATE 53200, `out_of_memory`; a server short of memory says the same):
    /// the server answered, so the transaction was rolled back, not prepared. The
    /// statements are still kept here for the next cut.
    fn is_full(error: &PostgresError) -> bool {
        matches!(error, PostgresError::Db(e) if e.code() == Some(&SqlState::OUT_OF_MEMORY))
    }

    async fn commit(&mut self, snapshot_id: u64) -> Result<(), PostgresError> {
        if self.settle("COMMIT PREPARED", snapshot_id).await? {
            return Ok(());
        }
        // Nothing prepared under it: committed before (its marker is there), or rolled back.
        let gid = self.gid(snapshot_id);
        let marker = self
            .run("SELECT", async |client, _| {
                client
                    .query_opt("SELECT 1 FROM cairn_sink_commits WHERE gid = $1", &[&gid])
                    .await
            })
            .await?;
        match marker {
            Some(_) => Ok(()),
            None => Err(PostgresError::RolledBack(gid)),
        }
    }

    async fn abort(&mut self, snapshot_id: u64) -> Result<(), PostgresError> {
        self.settle("ROLLBACK PREPARED", snapshot_id)
            .await
            .map(drop)
    }

    async fn pre_committed(&mut self) -> Result<Vec<u64>, PostgresError> {
        let prefix = self.prefix.clone();
        let rows = self
            .run("SELECT", async |client, _| {
                client
                    .query(
                        "SELECT gid FROM pg_prepared_xacts \
                         WHERE database = current_database() AND starts_with(gid, $1)",
                        &[&prefix],
                    )
                    .await
            })
            .await?;
        let mut ids = Vec::with_capacity(rows.len());
        for row in rows {
            let gid: String = row.try_get(0)?;
            // Names hold no `-`, so a gid with this prefix is this sink's; a suffix that is
            // no number was not made here, and is left alone.
            if let Some(Ok(id)) = gid.strip_prefix(&prefix).map(str::parse::<u64>) {
                ids.push(id);
            }
        }
        ids.sort_unstable();
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::gid_part;

    #[test]
    fn names_in_a_transaction_identifier_never_share_a_prefix_nor_need_quoting() {
        assert_eq!(gid_part("n1.a_b"), "n1.a_b");
        assert_eq!(gid_part("c-x"), "c%2Dx");
        assert_eq!(gid_part("a'b"), "a%27b");
        // (cluster "c", node "x-y") and (cluster "c-x", node "y") differ.
        assert_ne!(
            format!("{}-{}", gid_part("c"), gid_part("x-y")),
            format!("{}-{}", gid_part("c-x"), gid_part("y"))
        );
    }
}
