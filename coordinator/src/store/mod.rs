//! The metadata store: a small key-value interface that etcd and the embedded file store
//! both implement, and the cairn records kept in it as readable JSON.
//!
//! Keys, under `/cairn/<cluster>/`:
//!
//! | key | value |
//! |---|---|
//! | `next-snapshot-id` | the next id to hand out (decimal) |
//! | `snapshots/<id, 20 digits>` | [`SnapshotRecord`] |
//! | `parts/<id, 20 digits>/<node>` | [`PartRecord`]: one node's part |
//! | `members/<node>` | [`MemberRecord`] (in etcd under the leader's lease) |
//! | `leader/<lease>` | a replica's advertised address (etcd's election keys) |
//! | `barrier/<lease>` | a term's barrier, under its lease (etcd; see [`EtcdKv`]) |

mod etcd;
pub(crate) mod file;
mod memory;
mod meta;
/// The stored records: their format is cairn-proto's (the fuzzers read it there).
pub(crate) use cairn_proto::stored::records;

use std::future::Future;

pub use etcd::EtcdKv;
pub use file::FileKv;
pub use memory::MemoryKv;
pub use meta::Metadata;
pub use records::{
    ChunkList, EventKind, EventRecord, FailureRecord, MemberRecord, PartRecord, PolicyRecord,
    RecordedChannelRecord, RemovedRecord, RestoreRecord, RestoreStatus, RosterRecord,
    SnapshotRecord, SnapshotStatus, VerdictRecord,
};

/// A metadata store that cannot be reached or answered wrongly.
///
/// `outcome_unknown` marks a write whose answer was lost and could not be read back before
/// the writer's term ended: it may have been applied or not, and only the next term's
/// recovery (which reads the store) decides. It is never a failure to report as one.
#[derive(Debug, Clone, thiserror::Error)]
#[error("metadata store: {message}")]
pub struct StoreError {
    /// What happened.
    pub message: String,
    /// The write may have been applied: its outcome is unknown until the store is read.
    pub outcome_unknown: bool,
}

impl StoreError {
    /// A store that refused or could not be reached: nothing was written.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            outcome_unknown: false,
        }
    }

    /// A write whose outcome is unknown (see the type's documentation).
    pub fn unknown(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            outcome_unknown: true,
        }
    }
}

/// The key-value operations cairn needs. Values are JSON.
pub trait Kv: Send + Sync + 'static {
    /// The value of `key`.
    fn get(&self, key: &str) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send;
    /// Sets `key`.
    fn put(&self, key: &str, value: Vec<u8>)
    -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Sets `key` for as long as this coordinator lives (etcd: under its lease).
    fn put_ephemeral(
        &self,
        key: &str,
        value: Vec<u8>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Removes `key`.
    fn delete(&self, key: &str) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Removes every key under `prefix`.
    fn delete_prefix(&self, prefix: &str) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Every key under `prefix` with its value, in key order.
    fn list(
        &self,
        prefix: &str,
    ) -> impl Future<Output = Result<Vec<(String, Vec<u8>)>, StoreError>> + Send;
    /// Atomically reads the number at `key` (0 if absent), stores it plus one, and returns
    /// the number read.
    fn fetch_increment(&self, key: &str) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// Either store, chosen at start.
pub enum AnyKv {
    /// etcd.
    Etcd(Box<EtcdKv>),
    /// The embedded file store.
    File(Box<FileKv>),
    /// In memory, for unit tests.
    Memory(MemoryKv),
}

impl Kv for AnyKv {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        match self {
            Self::Etcd(s) => s.get(key).await,
            Self::File(s) => s.get(key).await,
            Self::Memory(s) => s.get(key).await,
        }
    }
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        match self {
            Self::Etcd(s) => s.put(key, value).await,
            Self::File(s) => s.put(key, value).await,
            Self::Memory(s) => s.put(key, value).await,
        }
    }
    async fn put_ephemeral(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        match self {
            Self::Etcd(s) => s.put_ephemeral(key, value).await,
            Self::File(s) => s.put_ephemeral(key, value).await,
            Self::Memory(s) => s.put_ephemeral(key, value).await,
        }
    }
    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        match self {
            Self::Etcd(s) => s.delete(key).await,
            Self::File(s) => s.delete(key).await,
            Self::Memory(s) => s.delete(key).await,
        }
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<(), StoreError> {
        match self {
            Self::Etcd(s) => s.delete_prefix(prefix).await,
            Self::File(s) => s.delete_prefix(prefix).await,
            Self::Memory(s) => s.delete_prefix(prefix).await,
        }
    }
    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        match self {
            Self::Etcd(s) => s.list(prefix).await,
            Self::File(s) => s.list(prefix).await,
            Self::Memory(s) => s.list(prefix).await,
        }
    }
    async fn fetch_increment(&self, key: &str) -> Result<u64, StoreError> {
        match self {
            Self::Etcd(s) => s.fetch_increment(key).await,
            Self::File(s) => s.fetch_increment(key).await,
            Self::Memory(s) => s.fetch_increment(key).await,
        }
    }
}

impl AnyKv {
    /// Whether this coordinator still leads its term, asked of the store itself (etcd: a
    /// guarded transaction; the embedded store has one coordinator).
    pub async fn still_leads(&self) -> Result<(), StoreError> {
        match self {
            Self::Etcd(s) => s.still_leads().await,
            Self::File(_) | Self::Memory(_) => Ok(()),
        }
    }

    /// Whether the store's own files are intact (the embedded store's may be deleted under
    /// it; etcd answers for itself).
    pub fn check_files(&self) -> Result<(), StoreError> {
        match self {
            Self::Etcd(_) | Self::Memory(_) => Ok(()),
            Self::File(s) => s.check_files(),
        }
    }
}

/// The keys of one cluster.
#[derive(Debug, Clone)]
pub struct Keys {
    root: String,
}

impl Keys {
    /// Keys under `/cairn/<cluster>/`.
    pub fn new(cluster: &str) -> Self {
        Self {
            root: format!("/cairn/{cluster}/"),
        }
    }
    /// The id counter.
    pub fn next_id(&self) -> String {
        format!("{}next-snapshot-id", self.root)
    }
    /// Every snapshot record.
    pub fn snapshots(&self) -> String {
        format!("{}snapshots/", self.root)
    }
    /// One snapshot record.
    pub fn snapshot(&self, id: u64) -> String {
        format!("{}snapshots/{id:020}", self.root)
    }
    /// Every part of every snapshot.
    pub fn all_parts(&self) -> String {
        format!("{}parts/", self.root)
    }
    /// Every part of one snapshot.
    pub fn parts(&self, id: u64) -> String {
        format!("{}parts/{id:020}/", self.root)
    }
    /// One node's part.
    pub fn part(&self, id: u64, node: &str) -> String {
        format!("{}parts/{id:020}/{node}", self.root)
    }
    /// The roster: every node of the cluster.
    pub fn roster(&self) -> String {
        format!("{}roster/", self.root)
    }
    /// One node of the roster.
    pub fn roster_node(&self, node: &str) -> String {
        format!("{}roster/{node}", self.root)
    }
    /// Every node removed and not back.
    pub fn removed(&self) -> String {
        format!("{}removed/", self.root)
    }
    /// One removed node.
    pub fn removed_node(&self, node: &str) -> String {
        format!("{}removed/{node}", self.root)
    }
    /// Every member.
    pub fn members(&self) -> String {
        format!("{}members/", self.root)
    }
    /// One member.
    pub fn member(&self, node: &str) -> String {
        format!("{}members/{node}", self.root)
    }
    /// The election: replicas campaign under `<this>/` (etcd's keys `<this>/<lease>`).
    pub fn leader(&self) -> String {
        format!("{}leader", self.root)
    }
    /// A term's barrier (etcd, under the term's lease): every guarded write of the term
    /// compares it, and settling a lost answer moves it.
    pub fn barrier(&self, lease: i64) -> String {
        format!("{}barrier/{lease:x}", self.root)
    }
    /// The snapshot policy.
    pub fn policy(&self) -> String {
        format!("{}policy", self.root)
    }
    /// The cluster's epoch counter (raised by every restore).
    pub fn epoch(&self) -> String {
        format!("{}epoch", self.root)
    }
    /// Every restore record.
    pub fn restores(&self) -> String {
        format!("{}restores/", self.root)
    }
    /// One restore record, by its epoch.
    pub fn restore(&self, epoch: u64) -> String {
        format!("{}restores/{epoch:020}", self.root)
    }
}

/// A COMPLETED snapshot record of node `n1` with id `id`, for tests.
#[cfg(test)]
pub(crate) fn sample_snapshot(id: u64) -> SnapshotRecord {
    SnapshotRecord {
        id,
        mode: "CHANDY_LAMPORT".into(),
        initiators: vec!["n1".into()],
        alignment_timeout_ms: 0,
        status: SnapshotStatus::Completed,
        failure: None,
        verdict: None,
        started_at_ms: 1,
        finished_at_ms: 2,
        timeout_ms: 3,
        labels: Default::default(),
        nodes: vec!["n1".into()],
        channels: Vec::new(),
        recorded: Vec::new(),
        reported: Vec::new(),
        bytes_new: 4,
        bytes_reused: 5,
        epoch: 0,
        term: 0,
        events: Vec::new(),
        request_id: String::new(),
    }
}
