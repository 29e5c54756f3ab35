//! The etcd metadata store. Members are put under one lease that this coordinator keeps
//! alive; when the coordinator dies they disappear with it. A lost connection is retried
//! by the client; every call that fails meanwhile reports UNAVAILABLE.
//!
//! The store remembers every ephemeral key it holds and its value. When the lease is lost
//! (an etcd outage longer than its TTL, or a revoked lease) the keep-alive grants a new one
//! and puts every remembered key again under it, so `members/*` come back by themselves.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, Identity,
    PutOptions, TlsOptions, Txn, TxnOp,
};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::{Kv, StoreError};
use crate::config::{EtcdConfig, causes};

/// Seconds a member key outlives a coordinator that stopped renewing it.
const LEASE_TTL: i64 = 10;

/// The lease and the ephemeral keys held under it. One lock for both: a put and the
/// re-put after a new lease never interleave, so the newest value is the one that stays.
#[derive(Default)]
struct Ephemeral {
    /// The live lease; `None` between losing one and granting the next.
    lease: Option<i64>,
    /// Every ephemeral key this store holds, with its value.
    keys: BTreeMap<String, Vec<u8>>,
}

/// A metadata store in etcd.
pub struct EtcdKv {
    client: Client,
    ephemeral: Arc<Mutex<Ephemeral>>,
}

fn unavailable(e: etcd_client::Error) -> StoreError {
    StoreError(format!("etcd unavailable: {e}"))
}

impl EtcdKv {
    /// Connects to `etcd` (its endpoints, TLS and user) and keeps a lease alive until
    /// `shutdown`. A refused connection (a bad password, a certificate etcd or the
    /// coordinator does not accept) is an error naming etcd and what was refused.
    pub async fn connect(
        etcd: &EtcdConfig,
        shutdown: CancellationToken,
    ) -> Result<Self, StoreError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3));
        if let Some(tls) = &etcd.tls {
            cairn_sdk::tls::install_crypto_provider();
            let mut config = TlsOptions::new().ca_certificate(Certificate::from_pem(&tls.ca));
            if let Some((cert, key)) = &tls.identity {
                config = config.identity(Identity::from_pem(cert, key));
            }
            options = options.with_tls(config);
        }
        if let Some((user, password)) = &etcd.user {
            if etcd.tls.is_none() {
                tracing::warn!(
                    user,
                    "the etcd password is sent over plaintext http://; use https:// endpoints and --etcd-ca"
                );
            }
            // etcd's tokens expire (and are lost when etcd restarts): authenticate again.
            options = options
                .with_user(user.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        let client = Client::connect(&etcd.endpoints, Some(options))
            .await
            .map_err(|e| refused(etcd, &e))?;
        let store = Self {
            client,
            ephemeral: Arc::default(),
        };
        // Prove the connection now, so a wrong endpoint, a refused certificate or a user
        // without access is reported at start; and hold a lease before the first member
        // is put.
        store
            .client
            .clone()
            .get("/cairn/", None)
            .await
            .map_err(|e| refused(etcd, &e))?;
        let lease = store
            .client
            .clone()
            .lease_grant(LEASE_TTL, None)
            .await
            .map_err(|e| refused(etcd, &e))?
            .id();
        store.ephemeral.lock().await.lease = Some(lease);
        tokio::spawn(keep_lease(
            store.client.clone(),
            store.ephemeral.clone(),
            Some(lease),
            shutdown,
        ));
        Ok(store)
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
        return StoreError(format!("etcd unavailable at {endpoints}: {text}"));
    };
    StoreError(format!("etcd at {endpoints}: {why} ({text})"))
}
/// Why a lease's keep-alive ended.
#[derive(Debug)]
enum LeaseLost {
    /// etcd says the lease no longer exists (it expired or was revoked).
    Gone,
    /// The keep-alive stream ended.
    StreamEnded,
    /// etcd could not be reached.
    Etcd(etcd_client::Error),
}

impl std::fmt::Display for LeaseLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Gone => f.write_str("etcd no longer knows the lease (expired or revoked)"),
            Self::StreamEnded => f.write_str("the keep-alive stream ended"),
            Self::Etcd(e) => write!(f, "{e}"),
        }
    }
}

impl From<etcd_client::Error> for LeaseLost {
    fn from(e: etcd_client::Error) -> Self {
        Self::Etcd(e)
    }
}

/// Grants a lease and puts every ephemeral key under it (in one critical section with
/// [`EtcdKv::put_ephemeral`]); returns the lease.
async fn grant_and_restore(
    client: &mut Client,
    ephemeral: &Mutex<Ephemeral>,
) -> Result<i64, etcd_client::Error> {
    let id = client.lease_grant(LEASE_TTL, None).await?.id();
    let mut held = ephemeral.lock().await;
    for (key, value) in &held.keys {
        client
            .put(
                key.as_str(),
                value.clone(),
                Some(PutOptions::new().with_lease(id)),
            )
            .await?;
    }
    if !held.keys.is_empty() {
        tracing::info!(
            lease = id,
            keys = held.keys.len(),
            "etcd lease granted again; ephemeral keys put back under it"
        );
    }
    held.lease = Some(id);
    Ok(id)
}

/// Keeps `granted` (or, without one, a new lease that it grants) alive until it is lost.
async fn hold_lease(
    client: &mut Client,
    ephemeral: &Mutex<Ephemeral>,
    granted: Option<i64>,
) -> Result<std::convert::Infallible, LeaseLost> {
    let id = match granted {
        Some(id) => id,
        None => grant_and_restore(client, ephemeral).await?,
    };
    let (mut keeper, mut responses) = client.lease_keep_alive(id).await?;
    loop {
        keeper.keep_alive().await?;
        match responses.message().await? {
            None => return Err(LeaseLost::StreamEnded),
            Some(response) if response.ttl() <= 0 => return Err(LeaseLost::Gone),
            Some(_) => {}
        }
        tokio::time::sleep(Duration::from_secs((LEASE_TTL / 3) as u64)).await;
    }
}

/// Keeps the lease alive (`granted`, or a new one); when it is lost, grants a new one and
/// puts every ephemeral key back under it.
async fn keep_lease(
    mut client: Client,
    ephemeral: Arc<Mutex<Ephemeral>>,
    mut granted: Option<i64>,
    shutdown: CancellationToken,
) {
    loop {
        let attempt = hold_lease(&mut client, &ephemeral, granted.take());
        tokio::select! {
            _ = shutdown.cancelled() => {
                if let Some(id) = ephemeral.lock().await.lease.take() {
                    let _ = client.lease_revoke(id).await;
                }
                return;
            }
            lost = attempt => {
                ephemeral.lock().await.lease = None;
                let Err(e) = lost;
                tracing::warn!("etcd lease lost: {e}; granting a new one");
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
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
        self.client
            .clone()
            .put(key, value, None)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    /// Remembered, then put under the lease. Between losing a lease and granting the next
    /// there is none: the key is only remembered, and put when the new lease is granted
    /// (never without a lease, which would outlive this coordinator).
    async fn put_ephemeral(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let mut held = self.ephemeral.lock().await;
        held.keys.insert(key.to_owned(), value.clone());
        if let Some(id) = held.lease {
            self.client
                .clone()
                .put(key, value, Some(PutOptions::new().with_lease(id)))
                .await
                .map_err(unavailable)?;
        }
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let mut held = self.ephemeral.lock().await;
        held.keys.remove(key);
        self.client
            .clone()
            .delete(key, None)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<(), StoreError> {
        let mut held = self.ephemeral.lock().await;
        held.keys.retain(|key, _| !key.starts_with(prefix));
        let options = DeleteOptions::new().with_prefix();
        self.client
            .clone()
            .delete(prefix, Some(options))
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let options = GetOptions::new().with_prefix();
        let response = self
            .client
            .clone()
            .get(prefix, Some(options))
            .await
            .map_err(unavailable)?;
        response
            .kvs()
            .iter()
            .map(|kv| {
                let key = kv
                    .key_str()
                    .map_err(|e| StoreError(e.to_string()))?
                    .to_owned();
                Ok((key, kv.value().to_vec()))
            })
            .collect()
    }

    /// A compare-and-swap on the key's modification revision, retried until it wins.
    async fn fetch_increment(&self, key: &str) -> Result<u64, StoreError> {
        let mut client = self.client.clone();
        loop {
            let response = client.get(key, None).await.map_err(unavailable)?;
            let (current, compare) = match response.kvs().first() {
                Some(kv) => {
                    let text = std::str::from_utf8(kv.value()).unwrap_or_default();
                    let n: u64 = text
                        .parse()
                        .map_err(|_| StoreError(format!("{key} is not a number")))?;
                    (
                        n,
                        Compare::mod_revision(key, CompareOp::Equal, kv.mod_revision()),
                    )
                }
                None => (0, Compare::version(key, CompareOp::Equal, 0)),
            };
            let next = current
                .checked_add(1)
                .ok_or_else(|| StoreError(format!("{key} is at its largest value")))?;
            let txn =
                Txn::new()
                    .when([compare])
                    .and_then([TxnOp::put(key, next.to_string(), None)]);
            if client.txn(txn).await.map_err(unavailable)?.succeeded() {
                return Ok(current);
            }
        }
    }
}
