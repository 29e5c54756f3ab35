//! The history of a nemesis run: one JSON object per line, written as the run goes (a
//! crashed run still leaves what it saw) and read back by the checker.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// One line of the history. `at` is the run's second.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Entry {
    /// The run's setup: the cluster's nodes, coordinator replicas and money.
    Setup {
        /// The nemesis's seed.
        seed: u64,
        /// The node ids, each with a bank.
        nodes: Vec<String>,
        /// Coordinator replicas.
        replicas: usize,
        /// All the money (every bank's initial balance).
        total: u64,
        /// Seconds of faults.
        seconds: u64,
    },
    /// A fault begins (a kill, a pause, a cut, a hold, a delay, a restore).
    Fault {
        /// When.
        at: f64,
        /// What (`kill-daemon`, `pause-leader`, …).
        kind: String,
        /// Whom (`n2`, `coordinator2`, `etcd`, `n1->n3`).
        target: String,
        /// More (how long, which snapshot).
        detail: String,
    },
    /// A fault ends (a paused process resumed, a held or delayed channel freed, a killed
    /// process started again).
    Heal {
        /// When.
        at: f64,
        /// The fault's kind.
        kind: String,
        /// Whom.
        target: String,
    },
    /// The coordinator accepted a snapshot the nemesis started.
    SnapshotStarted {
        /// When.
        at: f64,
        /// Its id.
        id: u64,
        /// Its mode.
        mode: String,
    },
    /// The coordinator accepted a restore the nemesis asked for.
    RestoreRequested {
        /// When.
        at: f64,
        /// The snapshot restored.
        snapshot: u64,
        /// The restore's id.
        restore_id: String,
    },
    /// A replica answered that it leads, in this term.
    Leader {
        /// When.
        at: f64,
        /// The replica (1-based).
        replica: usize,
        /// Its term.
        term: u64,
    },
    /// The banks, as `GetBalance` answered.
    Banks {
        /// When.
        at: f64,
        /// One per node.
        banks: Vec<BankView>,
    },
    /// The faults stopped: every paused process resumed, every channel freed.
    Quiet {
        /// When.
        at: f64,
    },
    /// A snapshot that ended, as the coordinator reports it (with its data when COMPLETED).
    Snapshot(SnapshotView),
    /// A restore, as the coordinator reports it at the end.
    Restore {
        /// Its id.
        restore_id: String,
        /// The snapshot restored.
        snapshot: u64,
        /// `user`, or the automatic recovery's reason.
        requested_by: String,
        /// Whether every node applied it.
        done: bool,
        /// Why it failed; empty if it did not.
        failure: String,
        /// When the coordinator started it (ms since the epoch; 0 in older histories).
        #[serde(default)]
        started_at_ms: u64,
    },
    /// A watcher of a snapshot the nemesis started was told it ended (before the nemesis
    /// read the store): what it was told.
    Told {
        /// When.
        at: f64,
        /// The snapshot.
        id: u64,
        /// The status it was told (`COMPLETED`, `FAILED`, …).
        status: String,
    },
    /// The coordinator answered a restore the nemesis asked for with an error.
    RestoreRefused {
        /// When.
        at: f64,
        /// The snapshot it asked to restore.
        snapshot: u64,
        /// When the call was sent and answered (ms since the epoch).
        sent_ms: u64,
        /// See `sent_ms`.
        answered_ms: u64,
        /// The gRPC code.
        code: String,
        /// The message.
        message: String,
    },
    /// The closing check of a restore: with the workload stopped, snapshot `snapshot` was
    /// restored and the channels drained; the banks then.
    FinalRestore {
        /// When.
        at: f64,
        /// The snapshot restored.
        snapshot: u64,
        /// The banks after it.
        banks: Vec<BankView>,
    },
    /// The bank's ledger in PostgreSQL, read right after the closing restore (before any
    /// cut after it): its transfers as islands of consecutive ids, and the transactions
    /// left prepared.
    Ledger {
        /// When.
        at: f64,
        /// The snapshot the closing restore restored.
        snapshot: u64,
        /// Every run of consecutive transfer ids of one sender's line to one receiver.
        islands: Vec<LedgerIsland>,
        /// The transactions still prepared (`pg_prepared_xacts`).
        prepared: Vec<String>,
    },
    /// The run ended; what the nemesis did, by kind.
    End {
        /// When.
        at: f64,
        /// Faults injected, by kind.
        faults: BTreeMap<String, u64>,
        /// Snapshot starts the coordinator refused or that timed out, by why (a gRPC code,
        /// `timed out`, `no connection`).
        refused: BTreeMap<String, u64>,
    },
}

/// Consecutive transfer ids of one sender's line to one receiver in the ledger.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LedgerIsland {
    /// The sender.
    pub from: String,
    /// The receiver.
    pub to: String,
    /// The sender's line.
    pub line: u64,
    /// The first id.
    pub first: u64,
    /// The last id.
    pub last: u64,
}

/// One bank, as `GetBalance` answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BankView {
    /// Its node.
    pub node: String,
    /// Its state as it would record it (`state_json`); none if it did not answer.
    pub state: Option<String>,
    /// Duplicate deliveries it saw since it started.
    pub duplicates: u64,
    /// Transfer ids it saw skipped since it started.
    pub skipped: u64,
    /// Transfers it refused since it started.
    pub rejected: u64,
}

/// A snapshot, as the coordinator reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotView {
    /// Its id.
    pub id: u64,
    /// The term of the coordinator that started it.
    pub term: u64,
    /// Its mode (`CHANDY_LAMPORT`, …).
    pub mode: String,
    /// `COMPLETED`, `FAILED`, …
    pub status: String,
    /// The failure's kind (`KIND_TIMEOUT`, …); empty if none.
    pub failure_kind: String,
    /// The failure's message; empty if none.
    pub failure: String,
    /// When it started and ended (the coordinator's clock, ms since the epoch).
    pub started_at_ms: u64,
    /// When it ended.
    pub finished_at_ms: u64,
    /// The cut's channels, `from->to`.
    pub channels: Vec<String>,
    /// Each node's part (COMPLETED snapshots only).
    pub nodes: Vec<NodeView>,
    /// The epoch it was taken in (absent in older histories).
    #[serde(default)]
    pub epoch: Option<u64>,
}

/// One node's part of a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    /// The node.
    pub node: String,
    /// Its recorded local state (the bank's JSON).
    pub state: String,
    /// Its incoming channels' recorded messages.
    pub channels: Vec<ChannelView>,
}

/// One channel's recorded messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChannelView {
    /// The sender.
    pub from: String,
    /// The receiver.
    pub to: String,
    /// The payloads, in channel order (the bank's JSON).
    pub messages: Vec<String>,
}

/// Writes a history as it is made; every line is flushed.
pub struct Writer {
    out: std::io::BufWriter<std::fs::File>,
    started: std::time::Instant,
}

impl Writer {
    /// Creates (truncates) `path`.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            out: std::io::BufWriter::new(std::fs::File::create(path)?),
            started: std::time::Instant::now(),
        })
    }

    /// Seconds since the run began.
    pub fn at(&self) -> f64 {
        (self.started.elapsed().as_secs_f64() * 1000.0).round() / 1000.0
    }

    /// Appends `entry`.
    pub fn push(&mut self, entry: &Entry) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.out, entry)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }
}

/// Reads a history; a line that does not parse is an error naming it.
pub fn read(path: &Path) -> anyhow::Result<Vec<Entry>> {
    let file = std::fs::File::open(path)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    let mut entries = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        entries.push(
            serde_json::from_str(&line)
                .map_err(|e| anyhow::anyhow!("{} line {}: {e}", path.display(), n + 1))?,
        );
    }
    Ok(entries)
}
