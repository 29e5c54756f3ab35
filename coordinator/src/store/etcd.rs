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
//! a write that cannot be settled within [`fence::SETTLE_LIMIT`] ends the term itself.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, Identity,
    LeaderKey, PutOptions, TlsOptions, TxnOp,
};

use super::{Kv, StoreError};

mod fence;

use fence::{After, Fence, Guarded};

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
}

impl EtcdKv {
    /// Asks etcd whether the term still holds (a guarded transaction that changes
    /// nothing); a term that does not ends here.
    pub(crate) async fn still_leads(&self) -> Result<(), StoreError> {
        self.guarded(vec![], vec![], After::Nothing).await.map(drop)
    }
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
