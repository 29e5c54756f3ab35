//! The fenced writes of a term: the guard every write carries, and the settling of a write
//! whose answer was lost.
//!
//! **Lost answers.** A guarded write whose answer does not come (the client's timeout, a
//! cancelled request, a lost connection, etcd's own "request timed out") may have been
//! applied or not: its outcome is *unknown*, never a failure. It is settled here, before
//! the caller hears anything, by one transaction that (a) moves the term's **barrier** — a
//! key under the term's lease that every guarded write of the term compares — to a value
//! never used before, and (b) reads back what the write would have left, at that same
//! revision. From the barrier's move on, the lost request can no longer apply wherever it
//! is (its compare names the old value), so what the read-back shows is final: applied, the
//! write succeeded; not applied, it is sent again. The settling transaction is retried until
//! etcd answers or the term ends; a term that ends first returns
//! [`StoreError::unknown`] — the next term's recovery, which reads the store, decides — and
//! a write that cannot be settled within [`SETTLE_LIMIT`] ends the term itself.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};

use super::{EtcdKv, unavailable};
use crate::leader::election::Leadership;
use crate::store::StoreError;

/// How long a guarded write may go unsettled (lost answers, read-backs that get no answer
/// either) before the leader gives up its term: the next term's recovery decides.
pub(crate) const SETTLE_LIMIT: Duration = Duration::from_secs(30);

/// The term a fenced view writes in.
#[derive(Clone)]
pub(super) struct Fence {
    /// The election key of the term.
    pub(super) key: Vec<u8>,
    /// Its creation revision: the term.
    pub(super) rev: i64,
    pub(super) leadership: Arc<Leadership>,
    /// The term's barrier key (under its lease): every guarded write compares its value,
    /// and settling a lost answer moves it.
    pub(super) barrier_key: Vec<u8>,
    /// The barrier's value as this replica last set or saw it (`None`: not created yet).
    pub(super) barrier: Arc<Mutex<Option<Vec<u8>>>>,
    /// Settlements so far (each moves the barrier to a value never used before).
    pub(super) settlements: Arc<AtomicU64>,
}

impl Fence {
    pub(super) fn barrier(&self) -> Option<Vec<u8>> {
        self.barrier
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(super) fn set_barrier(&self, value: Option<Vec<u8>>) {
        *self.barrier.lock().unwrap_or_else(|e| e.into_inner()) = value;
    }

    /// The compare a guarded write carries for the barrier at `value` (`None`: absent).
    pub(super) fn barrier_compare_with(&self, value: &Option<Vec<u8>>) -> Compare {
        match value {
            None => Compare::version(self.barrier_key.clone(), CompareOp::Equal, 0),
            Some(value) => {
                Compare::value(self.barrier_key.clone(), CompareOp::Equal, value.clone())
            }
        }
    }

    /// The term's compare: its election key is still the one it was created as.
    pub(super) fn term_compare(&self) -> Compare {
        Compare::create_revision(self.key.clone(), CompareOp::Equal, self.rev)
    }
}

/// What a guarded write leaves in the store once applied: how its lost answer is settled.
#[derive(Clone, Copy)]
pub(crate) enum After<'a> {
    /// `key` holds `value`.
    Holds(&'a str, &'a [u8]),
    /// `key` is absent.
    Absent(&'a str),
    /// No key starts with the prefix.
    NoneUnder(&'a str),
    /// Nothing: the transaction changes nothing (an unknown outcome is then just an error).
    Nothing,
}

impl After<'_> {
    /// The read that tells whether the write applied.
    fn read(self) -> Option<TxnOp> {
        match self {
            After::Holds(key, _) | After::Absent(key) => Some(TxnOp::get(key, None)),
            After::NoneUnder(prefix) => Some(TxnOp::get(
                prefix,
                Some(GetOptions::new().with_prefix().with_count_only()),
            )),
            After::Nothing => None,
        }
    }

    /// Whether `read`'s answer shows the write applied.
    fn applied(self, answer: Option<&TxnOpResponse>) -> bool {
        let Some(TxnOpResponse::Get(get)) = answer else {
            return false;
        };
        match self {
            After::Holds(_, value) => get.kvs().first().is_some_and(|kv| kv.value() == value),
            After::Absent(_) => get.kvs().is_empty(),
            After::NoneUnder(_) => get.count() == 0,
            After::Nothing => false,
        }
    }
}

/// How settling a lost answer ended.
pub(super) enum Settled {
    /// The write is in the store.
    Applied,
    /// It is not, and it can no longer apply (the barrier moved, or the term is gone).
    NotApplied,
}

/// Whether etcd's error leaves a write's outcome unknown: anything but a refusal etcd
/// gave before applying (a bad request, no permission, no such thing). A transport error,
/// a timeout, a cancellation, etcd's own "request timed out" or "leader changed" may come
/// after the write was applied.
pub(super) fn outcome_unknown(error: &etcd_client::Error) -> bool {
    use tonic::Code;
    match error {
        etcd_client::Error::GRpcStatus(status) => !matches!(
            status.code(),
            Code::InvalidArgument
                | Code::NotFound
                | Code::AlreadyExists
                | Code::PermissionDenied
                | Code::Unauthenticated
                | Code::FailedPrecondition
                | Code::OutOfRange
                | Code::Unimplemented
                | Code::ResourceExhausted
        ),
        etcd_client::Error::InvalidArgs(_) | etcd_client::Error::InvalidUri(_) => false,
        _ => true,
    }
}

impl EtcdKv {
    /// The fence of a write, if this view may still write.
    pub(super) fn fence(&self) -> Result<&Fence, StoreError> {
        let fence = self.fence.as_ref().ok_or_else(|| {
            StoreError::new("this coordinator is a follower: only the leader writes")
        })?;
        if !fence.leadership.valid() {
            return Err(lost(fence));
        }
        Ok(fence)
    }
}

impl EtcdKv {
    /// Runs `ops` if and only if the term still holds; a term that no longer holds ends
    /// here. `extra` compares are added to the guard (a counter's revision). A lost answer
    /// is settled before this returns (`after` says what the write leaves once applied):
    /// `Ok` means stored, an error with `outcome_unknown` means the term ended first, any
    /// other error means nothing was written.
    pub(super) async fn guarded(
        &self,
        extra: Vec<Compare>,
        ops: Vec<TxnOp>,
        after: After<'_>,
    ) -> Result<Guarded, StoreError> {
        let fence = self.fence()?;
        let since = tokio::time::Instant::now();
        loop {
            if !fence.leadership.valid() {
                return Err(lost(fence));
            }
            // The barrier as this write compares it (a settlement may move the cached one
            // while the write is in flight: the failure below is judged against this).
            let sent_barrier = fence.barrier();
            let mut when = vec![
                fence.term_compare(),
                fence.barrier_compare_with(&sent_barrier),
            ];
            let checks_extra = !extra.is_empty();
            when.extend(extra.iter().cloned());
            let txn = Txn::new().when(when).and_then(ops.clone()).or_else([
                TxnOp::get(fence.key.clone(), None),
                TxnOp::get(fence.barrier_key.clone(), None),
            ]);
            let response = match self.client.clone().txn(txn).await {
                Ok(response) => response,
                Err(e) if outcome_unknown(&e) && !matches!(after, After::Nothing) => {
                    tracing::warn!(
                        term = fence.rev,
                        "a guarded write's answer was lost ({e}): reading it back"
                    );
                    match self.settle(fence, after, since).await? {
                        Settled::Applied => return Ok(Guarded::Done),
                        // It can no longer apply: sending it again is safe.
                        Settled::NotApplied => continue,
                    }
                }
                Err(e) => return Err(unavailable(e)),
            };
            if response.succeeded() {
                return Ok(Guarded::Done);
            }
            // Failed: which compare? The term is gone unless the election key is still ours.
            let answers = response.op_responses();
            let got = |i: usize| match answers.get(i) {
                Some(TxnOpResponse::Get(get)) => get.kvs().first().cloned(),
                _ => None,
            };
            let ours = got(0).is_some_and(|kv| kv.create_revision() == fence.rev);
            if !ours {
                fence.leadership.end(format!(
                    "a guarded write found the election key of term {} gone: another replica leads",
                    fence.rev
                ));
                return Err(lost(fence));
            }
            let barrier = got(1).map(|kv| kv.value().to_vec());
            if barrier != sent_barrier {
                // A settlement of this term moved the barrier after this write read it (one
                // whose own answer was lost): this write did not apply; again, with the
                // barrier as etcd holds it (unless a settlement of this process set a newer
                // one meanwhile).
                if fence.barrier() == sent_barrier {
                    fence.set_barrier(barrier);
                }
                continue;
            }
            if checks_extra {
                return Ok(Guarded::ExtraFailed);
            }
            return Err(StoreError::new(format!(
                "a guarded write of term {} failed with the term and its barrier intact",
                fence.rev
            )));
        }
    }

    /// Settles a guarded write whose answer was lost: moves the term's barrier (so the
    /// lost request can no longer apply) and reads back, in the same transaction, whether
    /// it applied. Retried until etcd answers; an error with `outcome_unknown` if the term
    /// ends first or [`SETTLE_LIMIT`] passes (which ends the term).
    async fn settle(
        &self,
        fence: &Fence,
        after: After<'_>,
        since: tokio::time::Instant,
    ) -> Result<Settled, StoreError> {
        let read = after
            .read()
            .expect("only writes that leave something are settled");
        let mut pause = Duration::from_millis(50);
        loop {
            if !fence.leadership.valid() {
                return Err(unknown(fence));
            }
            if since.elapsed() >= SETTLE_LIMIT {
                fence.leadership.end(format!(
                    "a write's lost answer could not be read back within {SETTLE_LIMIT:?}"
                ));
                return Err(unknown(fence));
            }
            let n = fence.settlements.fetch_add(1, Ordering::Relaxed);
            // Never used before, even by another view of the same term: a random part too.
            let nonce = std::collections::hash_map::RandomState::new().hash_one(n);
            let token = format!("settled {n} ({nonce:016x}) of term {}", fence.rev).into_bytes();
            let lease = PutOptions::new().with_lease(fence.leadership.lease());
            let txn = Txn::new()
                .when([fence.term_compare()])
                .and_then([
                    TxnOp::put(fence.barrier_key.clone(), token.clone(), Some(lease)),
                    read.clone(),
                ])
                .or_else([read.clone()]);
            match self.client.clone().txn(txn).await {
                Ok(response) if response.succeeded() => {
                    fence.set_barrier(Some(token));
                    let applied = after.applied(response.op_responses().get(1));
                    tracing::info!(term = fence.rev, applied, "a lost answer was settled");
                    return Ok(if applied {
                        Settled::Applied
                    } else {
                        Settled::NotApplied
                    });
                }
                Ok(response) => {
                    // The term is gone, so nothing of it can apply any more: the read-back,
                    // at the same revision, is final.
                    fence.leadership.end(format!(
                        "settling a lost answer found the election key of term {} gone",
                        fence.rev
                    ));
                    if after.applied(response.op_responses().first()) {
                        return Ok(Settled::Applied);
                    }
                    return Err(lost(fence));
                }
                Err(e) => {
                    tracing::warn!(term = fence.rev, "reading back a lost answer: {e}");
                    tokio::select! {
                        () = fence.leadership.ended() => {}
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

/// How a guarded transaction ended.
pub(super) enum Guarded {
    Done,
    /// The term holds; an extra compare failed.
    ExtraFailed,
}

/// A write whose outcome is unknown: its term ended before it could be read back.
pub(super) fn unknown(fence: &Fence) -> StoreError {
    StoreError::unknown(format!(
        "outcome unknown: term {} ended ({}) before a write whose answer was lost could be \
         read back; the next leader's recovery reads the store and decides",
        fence.rev,
        fence.leadership.why()
    ))
}

pub(super) fn lost(fence: &Fence) -> StoreError {
    StoreError::new(format!(
        "leadership of term {} lost ({}): this coordinator writes nothing more",
        fence.rev,
        fence.leadership.why()
    ))
}
