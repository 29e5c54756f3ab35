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
//! A cut need not pre-commit. While snapshots fail, pending transactions pile up, and an
//! external system holds only so many (PostgreSQL's `max_prepared_transactions`): were
//! every cut to need one more, none could be taken once the system is full, no snapshot
//! could complete to commit and free one, and the application would stall. So past
//! [`TwoPhaseCommitSink::with_max_pending`] pending transactions, or when the system
//! refuses a pre-commit for want of room ([`Transactional::is_full`]), the cut *carries*
//! the open transaction ([`Cut::Carried`]): it goes on past the cut, and the application
//! records its effects in the state instead, to write them again after a restore of that
//! snapshot. Cuts go on being taken, a snapshot completes, its pending transactions are
//! committed, and the next cut pre-commits everything carried. A cut whose open
//! transaction is empty carries it too ([`Transactional::open_is_empty`]): an idle node
//! holds nothing pre-committed.
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

    /// Whether the open transaction holds no effect: a cut then pre-commits nothing (it
    /// carries the empty transaction), so an idle node holds no pre-committed transaction.
    /// Provided: never (every cut pre-commits).
    fn open_is_empty(&self) -> bool {
        false
    }

    /// Whether `error`, from [`Self::pre_commit`], is the system refusing it for want of
    /// room (too many transactions pre-committed), certainly without pre-committing it:
    /// the sink then carries the open transaction past the cut ([`Cut::Carried`]) instead of
    /// failing it. Provided: no error is (every failed pre-commit fails its cut).
    fn is_full(error: &Self::Error) -> bool {
        let _ = error;
        false
    }

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

/// The most pending transactions a state may name.
pub const MAX_PENDING: usize = 4096;

/// How many transactions a sink keeps pending before its cuts carry the open transaction
/// instead of pre-committing it, by default ([`TwoPhaseCommitSink::with_max_pending`]).
pub const DEFAULT_MAX_PENDING: usize = 8;

/// What a cut did with the open transaction, and the sink's state to record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a carried cut's effects must be recorded in the state"]
pub enum Cut {
    /// Pre-committed under the snapshot: record the state with the application's own.
    PreCommitted(SinkState),
    /// Carried: the open transaction goes on past the cut, not pre-committed (it is empty,
    /// the sink holds its most pending transactions, or the system is full). Record the
    /// state, and
    /// with it every effect written since the last cut that pre-committed (this cut's
    /// transaction holds them all): after a restore of this snapshot, write them again.
    Carried(SinkState),
}

impl Cut {
    /// The sink's state to record.
    pub fn state(&self) -> &SinkState {
        match self {
            Self::PreCommitted(s) | Self::Carried(s) => s,
        }
    }

    /// Whether the open transaction was carried past the cut.
    pub fn carried(&self) -> bool {
        matches!(self, Self::Carried(_))
    }
}

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
    /// A cut at or below one already taken.
    #[error("snapshot {snapshot_id}: {why}")]
    Refused {
        /// The snapshot.
        snapshot_id: u64,
        /// Why.
        why: String,
    },
}

/// A two-phase-commit sink over `T`. See the module's documentation.
#[derive(Debug)]
pub struct TwoPhaseCommitSink<T> {
    system: T,
    pending: BTreeSet<u64>,
    /// The highest id cut (pre-committed, tried, or carried) by this process.
    last: u64,
    /// Past this many pending, cuts carry.
    max_pending: usize,
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
            max_pending: DEFAULT_MAX_PENDING,
            doubtful: BTreeSet::new(),
        };
        sink.system.begin().await.map_err(SinkError::System)?;
        Ok(sink)
    }

    /// Keeps at most `max_pending` transactions pending (1 to [`MAX_PENDING`]; default
    /// [`DEFAULT_MAX_PENDING`]): a cut with that many carries the open transaction instead
    /// of pre-committing it. Size the external system for every sink writing to it (for
    /// PostgreSQL, `max_prepared_transactions` of at least the sinks times one more than
    /// this); a system that fills up anyway makes cuts carry too, if it says so
    /// ([`Transactional::is_full`]).
    pub fn with_max_pending(mut self, max_pending: usize) -> Self {
        self.max_pending = max_pending.clamp(1, MAX_PENDING);
        self
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
    /// transaction under it and opens the next — or carries it past the cut
    /// ([`Cut::Carried`]: then record its effects in the state too). On an error, do not
    /// answer the record request.
    ///
    /// Cuts are taken in id order: one at or below an id cut before is refused (its
    /// transaction would hold effects after a later cut's, which a restore of the later
    /// snapshot could not tell apart). With concurrent snapshots that fails the lower one.
    pub async fn cut(&mut self, snapshot_id: u64) -> Result<Cut, SinkError<T::Error>> {
        if snapshot_id <= self.last {
            return Err(SinkError::Refused {
                snapshot_id,
                why: format!(
                    "snapshot ids only grow; this one is not above the last cut ({})",
                    self.last
                ),
            });
        }
        if self.pending.len() >= self.max_pending || self.system.open_is_empty() {
            self.last = snapshot_id;
            return Ok(Cut::Carried(self.state()));
        }
        // A doubtful pre-commit holds the effects this one writes again: it goes first.
        self.abort_doubtful().await?;
        self.last = snapshot_id;
        if let Err(e) = self.system.pre_commit(snapshot_id).await {
            if T::is_full(&e) {
                // Refused, not taken: the open transaction is still there, and goes on.
                return Ok(Cut::Carried(self.state()));
            }
            self.doubtful.insert(snapshot_id);
            return Err(SinkError::System(e));
        }
        self.pending.insert(snapshot_id);
        self.system.begin().await.map_err(SinkError::System)?;
        Ok(Cut::PreCommitted(self.state()))
    }

    fn state(&self) -> SinkState {
        SinkState {
            pending: self.pending(),
        }
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
    /// before applying the restored state (and so before acknowledging the restore); if the
    /// restored cut carried its transaction, write the effects recorded with it again after
    /// this returns.
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
