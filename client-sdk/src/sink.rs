//! Exactly-once effects on an external system: a two-phase-commit sink, as Flink's
//! `TwoPhaseCommitSinkFunction`, driven by the snapshot lifecycle.
//!
//! The application writes its effects (rows, messages to a queue) into the sink's *open
//! transaction*. At each snapshot's cut it pre-commits that transaction under the
//! snapshot's id — durable in the external system, not visible — and records the ids
//! pre-committed and not yet committed (the *pending* ones, [`SinkState`]) in its state.
//! When the snapshot completes ([`AppEvent::SnapshotCompleted`](crate::AppEvent)), every
//! pending transaction at or below its id is committed. After a restore, the restored
//! state's pending transactions are committed (the restored snapshot completed, so they
//! belong to the history that goes on) and every other one this node pre-committed is
//! rolled back (it belongs to a history the restore discarded).
//!
//! So each effect becomes visible exactly once, in the history that survives: an effect
//! is written once into one transaction, that transaction is committed only after a
//! snapshot at or after its cut is durable, and a crash before that rolls it back and
//! replays the messages that caused it from the restored snapshot.
//!
//! [`TwoPhaseCommitSink`] is the state machine (pure bookkeeping around the calls, in
//! order); [`Transactional`] is the external system's side. Its operations must be
//! idempotent — `commit` of a transaction already committed, `abort` of one already
//! rolled back or never pre-committed, succeed — because a crash can come between any two
//! of them and the sink then repeats the last.

use std::collections::BTreeSet;
use std::future::Future;

#[cfg(feature = "postgres")]
pub mod postgres;

/// The external system's side of a two-phase-commit sink.
pub trait Transactional: Send {
    /// What goes wrong.
    type Error: std::fmt::Display + Send;

    /// Opens a transaction for the effects that follow (until the next cut).
    fn begin(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Makes the open transaction durable under `snapshot_id` without making it visible:
    /// once this returns `Ok`, [`Self::commit`] and [`Self::abort`] of that id work even
    /// after this process or the external system crashed.
    ///
    /// On `Err` the open transaction's effects must still be there, for the next
    /// pre-commit to write again. The transaction may nevertheless have been pre-committed
    /// (its answer lost): the sink never commits it, and rolls it back before the next
    /// pre-commit.
    fn pre_commit(
        &mut self,
        snapshot_id: u64,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Makes the transaction pre-committed under `snapshot_id` visible. `Ok` if it was
    /// committed already; an error if it was rolled back (its effects are lost — the sink
    /// never asks for that).
    fn commit(&mut self, snapshot_id: u64) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Rolls back the transaction pre-committed under `snapshot_id`. `Ok` if there is none.
    fn abort(&mut self, snapshot_id: u64) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The ids of every transaction this sink pre-committed and neither committed nor
    /// rolled back, as the external system knows them (after a crash, what the crashed
    /// process left).
    fn pre_committed(&mut self) -> impl Future<Output = Result<Vec<u64>, Self::Error>> + Send;

    /// After a restore of `restored_snapshot_id`, whose state names `pending`: commits
    /// each of `pending` (they belong to the restored history, which completed at or after
    /// them) and rolls back every other transaction pre-committed (of a history the restore
    /// discarded). Provided: built from the other operations, so every system recovers
    /// alike.
    fn recover(
        &mut self,
        restored_snapshot_id: u64,
        pending: &[u64],
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        let _ = restored_snapshot_id;
        async move {
            for id in self.pre_committed().await? {
                if !pending.contains(&id) {
                    self.abort(id).await?;
                }
            }
            for &id in pending {
                self.commit(id).await?;
            }
            Ok(())
        }
    }
}

/// What a sink keeps in the application's recorded state: its pending transactions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SinkState {
    /// Snapshot ids pre-committed at or before the cut and not committed, ascending.
    pub pending: Vec<u64>,
}

/// The most pending transactions a state may name (a sink whose snapshots never complete
/// stops taking cuts past this: [`SinkError::TooManyPending`]).
pub const MAX_PENDING: usize = 4096;

impl SinkState {
    /// The state as bytes: a count, then each id, little-endian `u64`s.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 * (self.pending.len() + 1));
        out.extend_from_slice(&(self.pending.len() as u64).to_le_bytes());
        for id in &self.pending {
            out.extend_from_slice(&id.to_le_bytes());
        }
        out
    }

    /// A state from [`Self::encode`]'s bytes; refused if malformed, longer than
    /// [`MAX_PENDING`], or not strictly ascending.
    pub fn decode(bytes: &[u8]) -> Result<Self, SinkError<std::convert::Infallible>> {
        let malformed = |why: &str| SinkError::Malformed(why.to_owned());
        let mut words = bytes
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("chunks of eight bytes")));
        if !bytes.len().is_multiple_of(8) {
            return Err(malformed("its length is not a multiple of 8"));
        }
        let count = words.next().ok_or_else(|| malformed("it is empty"))?;
        if count > MAX_PENDING as u64 || count != (bytes.len() / 8 - 1) as u64 {
            return Err(malformed(
                "its count does not match its ids (or exceeds 4096)",
            ));
        }
        Self::new(words.collect())
    }

    /// A state naming `pending` (as an application that keeps it in a format of its own
    /// reads it back); refused if longer than [`MAX_PENDING`], or not positive and strictly
    /// ascending.
    pub fn new(pending: Vec<u64>) -> Result<Self, SinkError<std::convert::Infallible>> {
        if pending.len() > MAX_PENDING {
            return Err(SinkError::Malformed(format!(
                "it names {} pending transactions (at most {MAX_PENDING})",
                pending.len()
            )));
        }
        if pending.windows(2).any(|w| w[0] >= w[1]) || pending.first() == Some(&0) {
            return Err(SinkError::Malformed(
                "its ids are not positive and strictly ascending".into(),
            ));
        }
        Ok(Self { pending })
    }
}

/// What a sink's step can fail with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SinkError<E> {
    /// The external system refused or failed: the step did not happen (or its outcome is
    /// unknown). Do not answer the record request (the snapshot fails, and a later one
    /// takes its place); after a failed commit, the next completion commits it again.
    #[error("the external system: {0}")]
    System(E),
    /// A recorded sink state that cannot be read.
    #[error("malformed sink state: {0}")]
    Malformed(String),
    /// A cut at or below one already pre-committed, or beyond [`MAX_PENDING`] pending.
    #[error("snapshot {snapshot_id}: {why}")]
    Refused {
        /// The snapshot.
        snapshot_id: u64,
        /// Why.
        why: String,
    },
    /// Too many transactions are pre-committed and none completes.
    #[error("{0} transactions are pending and no snapshot completes; not taking another")]
    TooManyPending(usize),
}

/// A two-phase-commit sink over `T`. See the module's documentation.
#[derive(Debug)]
pub struct TwoPhaseCommitSink<T> {
    system: T,
    pending: BTreeSet<u64>,
    /// The highest id pre-committed (or tried) by this process.
    last: u64,
    /// Pre-commits that failed and may nevertheless have happened (an answer lost): rolled
    /// back before the next pre-commit, never committed.
    doubtful: BTreeSet<u64>,
}

impl<T: Transactional> TwoPhaseCommitSink<T> {
    /// A sink in a process that starts: opens a transaction. Transactions an earlier
    /// process of this node pre-committed ([`Transactional::pre_committed`]) are left
    /// alone: only a restore settles them, committing those its state names and rolling
    /// back the rest. No completion can: the restore that follows a crash may be of any
    /// completed snapshot, even one older than a completion this process hears first (an
    /// operator's, or recovery passing over a snapshot that does not verify), and its state
    /// may name them. A process that starts afresh and is never restored leaves them
    /// prepared: restore a snapshot, or roll them back by hand.
    pub async fn start(system: T) -> Result<Self, SinkError<T::Error>> {
        let mut sink = Self {
            system,
            pending: BTreeSet::new(),
            last: 0,
            doubtful: BTreeSet::new(),
        };
        sink.system.begin().await.map_err(SinkError::System)?;
        Ok(sink)
    }

    /// The external system, to write effects into the open transaction.
    pub fn system(&mut self) -> &mut T {
        &mut self.system
    }

    /// The pending transactions, ascending.
    pub fn pending(&self) -> Vec<u64> {
        self.pending.iter().copied().collect()
    }

    /// At the cut of `snapshot_id` (while answering its record request, before the state
    /// is handed over, in the critical section that takes the state): pre-commits the open
    /// transaction under it and opens the next. Returns the state to record with the
    /// application's own. On an error, do not answer the record request.
    pub async fn pre_commit(&mut self, snapshot_id: u64) -> Result<SinkState, SinkError<T::Error>> {
        if snapshot_id <= self.last {
            return Err(SinkError::Refused {
                snapshot_id,
                why: "snapshot ids only grow; this one is not above the last pre-committed".into(),
            });
        }
        if self.pending.len() >= MAX_PENDING {
            return Err(SinkError::TooManyPending(self.pending.len()));
        }
        // A doubtful pre-commit holds the effects this one writes again: it goes first.
        self.abort_doubtful().await?;
        self.last = snapshot_id;
        if let Err(e) = self.system.pre_commit(snapshot_id).await {
            self.doubtful.insert(snapshot_id);
            return Err(SinkError::System(e));
        }
        self.pending.insert(snapshot_id);
        self.system.begin().await.map_err(SinkError::System)?;
        Ok(SinkState {
            pending: self.pending(),
        })
    }

    /// Snapshot `snapshot_id` completed: commits every pending transaction at or below
    /// it, oldest first (a repeated or older completion commits nothing new). Those
    /// pre-committed at snapshots that failed are committed here too: they belong to the
    /// history up to this completed cut. What an earlier process left is not touched (see
    /// [`Self::start`]).
    pub async fn completed(&mut self, snapshot_id: u64) -> Result<(), SinkError<T::Error>> {
        while let Some(&id) = self.pending.first() {
            if id > snapshot_id {
                break;
            }
            self.system.commit(id).await.map_err(SinkError::System)?;
            self.pending.remove(&id);
        }
        self.abort_doubtful().await?;
        Ok(())
    }

    /// A restore of `restored_snapshot_id` with the sink state recorded in it: the
    /// recorded pending transactions are committed, every other one rolled back (with the
    /// open transaction; those an earlier process left too), and a new one opened. Call it
    /// before applying the restored state (and so before acknowledging the restore).
    ///
    /// Transactions committed above the restored snapshot stay committed (a sink cannot
    /// undo a commit): after a restore of a snapshot older than the newest completed, the
    /// restored history replays their effects. Remove them in the external system (they
    /// are labelled with their snapshot) before the next cut, as `cairn-bank --ledger`
    /// does.
    pub async fn restored(
        &mut self,
        restored_snapshot_id: u64,
        state: &SinkState,
    ) -> Result<(), SinkError<T::Error>> {
        if state.pending.iter().any(|&id| id > restored_snapshot_id) {
            return Err(SinkError::Malformed(format!(
                "the state of snapshot {restored_snapshot_id} names a transaction above it"
            )));
        }
        self.system
            .recover(restored_snapshot_id, &state.pending)
            .await
            .map_err(SinkError::System)?;
        self.pending.clear();
        self.doubtful.clear();
        self.last = self.last.max(restored_snapshot_id);
        self.system.begin().await.map_err(SinkError::System)?;
        Ok(())
    }

    /// Rolls back the pre-commits whose answers were lost.
    async fn abort_doubtful(&mut self) -> Result<(), SinkError<T::Error>> {
        while let Some(&id) = self.doubtful.first() {
            self.system.abort(id).await.map_err(SinkError::System)?;
            self.doubtful.remove(&id);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
