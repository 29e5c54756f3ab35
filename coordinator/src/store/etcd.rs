//! The etcd metadata store. A lost connection is retried by the client; every call that
//! fails meanwhile reports UNAVAILABLE.
//!
//! **Fencing.** Only a leader writes, and only through a fenced view
//! ([`EtcdKv::fenced`]): every write is one transaction guarded by
//! `create_revision(election key) == term`, so a replica whose term ended (its key expired,
//! was revoked or resigned, and another replica's key leads now) can write nothing, however
//! late its request arrives. A guarded write that fails ends the term at once
//! ([`Leadership::end`]); a term that ended refuses every further write locally, without
//! asking etcd. The members' keys are put under the term's lease: they go with it. An
//! unfenced view (a follower's) refuses every write.
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

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, Identity,
    LeaderKey, PutOptions, TlsOptions, Txn, TxnOp, TxnOpResponse,
};

use super::{Kv, StoreError};

/// How long a guarded write may go unsettled (lost answers, read-backs that get no answer
/// either) before the leader gives up its term: the next term's recovery decides.
pub(crate) const SETTLE_LIMIT: Duration = Duration::from_secs(30);

/// Keys per page of a listing, at first (a page that still outgrows the client's 4 MiB
/// message limit is asked for again in halves; etcd's own limit on a value is 1.5 MiB).
const LIST_PAGE: i64 = 128;

/// The first key after every key that starts with `prefix` (etcd's range end for a prefix);
/// `[0]`, etcd's "to the end", when there is none.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}
use crate::config::{EtcdConfig, causes};
use crate::leader::election::Leadership;

/// The term a fenced view writes in.
#[derive(Clone)]
struct Fence {
    /// The election key of the term.
    key: Vec<u8>,
    /// Its creation revision: the term.
    rev: i64,
    leadership: Arc<Leadership>,
    /// The term's barrier key (under its lease): every guarded write compares its value,
    /// and settling a lost answer moves it.
    barrier_key: Vec<u8>,
    /// The barrier's value as this replica last set or saw it (`None`: not created yet).
    barrier: Arc<Mutex<Option<Vec<u8>>>>,
    /// Settlements so far (each moves the barrier to a value never used before).
    settlements: Arc<AtomicU64>,
}

impl Fence {
    fn barrier(&self) -> Option<Vec<u8>> {
        self.barrier
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_barrier(&self, value: Option<Vec<u8>>) {
        *self.barrier.lock().unwrap_or_else(|e| e.into_inner()) = value;
    }

    /// The compare a guarded write carries for the barrier at `value` (`None`: absent).
    fn barrier_compare_with(&self, value: &Option<Vec<u8>>) -> Compare {
        match value {
            None => Compare::version(self.barrier_key.clone(), CompareOp::Equal, 0),
            Some(value) => {
                Compare::value(self.barrier_key.clone(), CompareOp::Equal, value.clone())
            }
        }
    }

    /// The term's compare: its election key is still the one it was created as.
    fn term_compare(&self) -> Compare {
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
enum Settled {
    /// The write is in the store.
    Applied,
    /// It is not, and it can no longer apply (the barrier moved, or the term is gone).
    NotApplied,
}

/// Whether etcd's error leaves a write's outcome unknown: anything but a refusal etcd
/// gave before applying (a bad request, no permission, no such thing). A transport error,
/// a timeout, a cancellation, etcd's own "request timed out" or "leader changed" may come
/// after the write was applied.
fn outcome_unknown(error: &etcd_client::Error) -> bool {
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

/// A metadata store in etcd.
#[derive(Clone)]
pub struct EtcdKv {
    client: Client,
    /// The same connection settings without a request timeout, for the election (a
    /// campaign waits as long as it takes).
    untimed: Client,
    fence: Option<Fence>,
}

fn unavailable(e: etcd_client::Error) -> StoreError {
    StoreError::new(format!("etcd unavailable: {e}"))
}

fn options(etcd: &EtcdConfig, timeout: bool) -> ConnectOptions {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(3))
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(3))
        .with_keep_alive_while_idle(true);
    if timeout {
        options = options.with_timeout(Duration::from_secs(5));
    }
    if let Some(tls) = &etcd.tls {
        cairn_rpc::tls::install_crypto_provider();
        let mut config = TlsOptions::new().ca_certificate(Certificate::from_pem(&tls.ca));
        if let Some((cert, key)) = &tls.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        options = options.with_tls(config);
    }
    if let Some((user, password)) = &etcd.user {
        // etcd's tokens expire (and are lost when etcd restarts): authenticate again.
        options = options
            .with_user(user.clone(), password.clone())
            .with_auto_token_refresh(true);
    }
    options
}

impl EtcdKv {
    /// Connects to `etcd` (its endpoints, TLS and user). A refused connection (a bad
    /// password, a certificate etcd or the coordinator does not accept) is an error naming
    /// etcd and what was refused. The view returned reads only; a leader writes through
    /// `fenced`, a view whose every write is guarded by its term.
    pub async fn connect(etcd: &EtcdConfig) -> Result<Self, StoreError> {
        if etcd.user.is_some() && etcd.tls.is_none() {
            tracing::warn!(
                "the etcd password is sent over plaintext http://; use https:// endpoints and --etcd-ca"
            );
        }
        let client = Client::connect(&etcd.endpoints, Some(options(etcd, true)))
            .await
            .map_err(|e| refused(etcd, &e))?;
        // Prove the connection now, so a wrong endpoint, a refused certificate or a user
        // without access is reported at start.
        client
            .clone()
            .get("/cairn/", None)
            .await
            .map_err(|e| refused(etcd, &e))?;
        let untimed = Client::connect(&etcd.endpoints, Some(options(etcd, false)))
            .await
            .map_err(|e| refused(etcd, &e))?;
        Ok(Self {
            client,
            untimed,
            fence: None,
        })
    }

    /// The client for the election (no request timeout).
    pub(crate) fn election_client(&self) -> Client {
        self.untimed.clone()
    }

    /// The view a leader writes through: every write guarded by `key`'s creation revision
    /// and by the term's barrier at `barrier_key` (see the module's documentation).
    pub(crate) fn fenced(
        &self,
        leadership: Arc<Leadership>,
        key: &LeaderKey,
        barrier_key: String,
    ) -> Self {
        Self {
            client: self.client.clone(),
            untimed: self.untimed.clone(),
            fence: Some(Fence {
                key: key.key().to_vec(),
                rev: key.rev(),
                leadership,
                barrier_key: barrier_key.into_bytes(),
                barrier: Arc::default(),
                settlements: Arc::default(),
            }),
        }
    }

    /// The fence of a write, if this view may still write.
    fn fence(&self) -> Result<&Fence, StoreError> {
        let fence = self.fence.as_ref().ok_or_else(|| {
            StoreError::new("this coordinator is a follower: only the leader writes")
        })?;
        if !fence.leadership.valid() {
            return Err(lost(fence));
        }
        Ok(fence)
    }

    /// Runs `ops` if and only if the term still holds; a term that no longer holds ends
    /// here. `extra` compares are added to the guard (a counter's revision). A lost answer
    /// is settled before this returns (`after` says what the write leaves once applied):
    /// `Ok` means stored, an error with `outcome_unknown` means the term ended first, any
    /// other error means nothing was written.
    async fn guarded(
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

impl EtcdKv {
    /// Asks etcd whether the term still holds (a guarded transaction that changes
    /// nothing); a term that does not ends here.
    pub(crate) async fn still_leads(&self) -> Result<(), StoreError> {
        self.guarded(vec![], vec![], After::Nothing).await.map(drop)
    }
}

/// How a guarded transaction ended.
enum Guarded {
    Done,
    /// The term holds; an extra compare failed.
    ExtraFailed,
}

/// A write whose outcome is unknown: its term ended before it could be read back.
fn unknown(fence: &Fence) -> StoreError {
    StoreError::unknown(format!(
        "outcome unknown: term {} ended ({}) before a write whose answer was lost could be \
         read back; the next leader's recovery reads the store and decides",
        fence.rev,
        fence.leadership.why()
    ))
}

fn lost(fence: &Fence) -> StoreError {
    StoreError::new(format!(
        "leadership of term {} lost ({}): this coordinator writes nothing more",
        fence.rev,
        fence.leadership.why()
    ))
}

/// A start-up failure to reach or use etcd, saying what was refused when etcd or the TLS
/// handshake refused something (the whole chain of causes: tonic's transport errors say
/// little on their own).
fn refused(etcd: &EtcdConfig, error: &etcd_client::Error) -> StoreError {
    let text = causes(error);
    let lower = text.to_lowercase();
    let endpoints = etcd.endpoints.join(",");
    let why = if lower.contains("authentication failed") {
        format!(
            "etcd refused the authentication of user {}: wrong user or password (--etcd-user, --etcd-password)",
            etcd.user.as_ref().map_or("?", |(u, _)| u.as_str())
        )
    } else if lower.contains("user name is empty") || lower.contains("user name not found") {
        "etcd requires authentication: give --etcd-user and its password, or a client certificate whose CN is an etcd user".to_owned()
    } else if lower.contains("permission denied") {
        "etcd refused access (permission denied): the etcd user lacks read/write on the coordinator's keys".to_owned()
    } else if lower.contains("invalid peer certificate") {
        "the coordinator refused etcd's server certificate (not signed by --etcd-ca, or not for this host)".to_owned()
    } else if let Some(tls) = etcd.tls.as_ref().filter(|_| {
        // etcd's TLS alert, or, as often with TLS 1.3 (the client's side of the handshake
        // is done before etcd checks its certificate), only the connection it closed.
        [
            "certificaterequired",
            "badcertificate",
            "unknownca",
            "connection closed",
            "broken pipe",
            "tls handshake eof",
            "connection reset",
        ]
        .iter()
        .any(|w| lower.contains(w))
    }) {
        if tls.identity.is_none() {
            "etcd refused the TLS connection: it requires a client certificate (an etcd with --client-cert-auth) and none was given (--etcd-cert, --etcd-key)".to_owned()
        } else {
            "etcd refused the coordinator's client certificate (--etcd-cert: not signed by etcd's --trusted-ca-file CA, expired, or not for client authentication)".to_owned()
        }
    } else {
        return StoreError::new(format!("etcd unavailable at {endpoints}: {text}"));
    };
    StoreError::new(format!("etcd at {endpoints}: {why} ({text})"))
}
impl Kv for EtcdKv {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let response = self
            .client
            .clone()
            .get(key, None)
            .await
            .map_err(unavailable)?;
        Ok(response.kvs().first().map(|kv| kv.value().to_vec()))
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let ops = vec![TxnOp::put(key, value.clone(), None)];
        self.guarded(vec![], ops, After::Holds(key, &value))
            .await
            .map(drop)
    }

    /// Under the term's lease: the key goes when the term's lease does.
    async fn put_ephemeral(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let lease = self.fence()?.leadership.lease();
        let options = PutOptions::new().with_lease(lease);
        let ops = vec![TxnOp::put(key, value.clone(), Some(options))];
        self.guarded(vec![], ops, After::Holds(key, &value))
            .await
            .map(drop)
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.guarded(vec![], vec![TxnOp::delete(key, None)], After::Absent(key))
            .await
            .map(drop)
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<(), StoreError> {
        let options = DeleteOptions::new().with_prefix();
        let ops = vec![TxnOp::delete(prefix, Some(options))];
        self.guarded(vec![], ops, After::NoneUnder(prefix))
            .await
            .map(drop)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        // In pages, all at the first page's revision: one response with every record would
        // outgrow the client's 4 MiB message limit once there are some thousands of
        // snapshots, and then no replica could take over (each would fail its recovery).
        let end = prefix_end(prefix.as_bytes());
        let mut start = if prefix.is_empty() {
            vec![0]
        } else {
            prefix.as_bytes().to_vec()
        };
        let mut client = self.client.clone();
        let mut revision = 0;
        let mut page = LIST_PAGE;
        let mut out = Vec::new();
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(page);
            if revision > 0 {
                options = options.with_revision(revision);
            }
            let response = match client.get(start.clone(), Some(options)).await {
                Ok(response) => response,
                Err(e) if page > 1 && e.to_string().contains("message length too large") => {
                    page /= 2;
                    continue;
                }
                Err(e) => return Err(unavailable(e)),
            };
            if revision == 0 {
                revision = response.header().map_or(0, |h| h.revision());
            }
            for kv in response.kvs() {
                let key = kv
                    .key_str()
                    .map_err(|e| StoreError::new(e.to_string()))?
                    .to_owned();
                out.push((key, kv.value().to_vec()));
            }
            match response.kvs().last() {
                Some(last) if response.more() => {
                    start = last.key().to_vec();
                    start.push(0);
                }
                _ => return Ok(out),
            }
        }
    }

    /// A compare-and-swap on the key's modification revision, guarded by the term,
    /// retried until it wins (or the term is gone).
    async fn fetch_increment(&self, key: &str) -> Result<u64, StoreError> {
        let mut client = self.client.clone();
        loop {
            let response = client.get(key, None).await.map_err(unavailable)?;
            let (current, compare) = match response.kvs().first() {
                Some(kv) => {
                    let text = std::str::from_utf8(kv.value()).unwrap_or_default();
                    let n: u64 = text
                        .parse()
                        .map_err(|_| StoreError::new(format!("{key} is not a number")))?;
                    (
                        n,
                        Compare::mod_revision(key, CompareOp::Equal, kv.mod_revision()),
                    )
                }
                None => (0, Compare::version(key, CompareOp::Equal, 0)),
            };
            let next = current
                .checked_add(1)
                .ok_or_else(|| StoreError::new(format!("{key} is at its largest value")))?;
            let value = next.to_string().into_bytes();
            let put = TxnOp::put(key, value.clone(), None);
            // Read back, `key` holding `next` is this increment: only the term's task
            // increments the counters (`take_snapshot_id`, `allocate_epoch`), one at a time —
            // were two increments of one term concurrent, a lost answer could be taken for
            // the other's, and a number handed out twice.
            match self
                .guarded(vec![compare], vec![put], After::Holds(key, &value))
                .await?
            {
                Guarded::Done => return Ok(current),
                Guarded::ExtraFailed => continue,
            }
        }
    }
}
