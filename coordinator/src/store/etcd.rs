//! The etcd metadata store. Members are put under one lease that this coordinator keeps
//! alive; when the coordinator dies they disappear with it. A lost connection is retried
//! by the client; every call that fails meanwhile reports UNAVAILABLE.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp,
};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::{Kv, StoreError};

/// Seconds a member key outlives a coordinator that stopped renewing it.
const LEASE_TTL: i64 = 10;

/// A metadata store in etcd.
pub struct EtcdKv {
    client: Client,
    lease: Arc<Mutex<Option<i64>>>,
}

fn unavailable(e: etcd_client::Error) -> StoreError {
    StoreError(format!("etcd unavailable: {e}"))
}

impl EtcdKv {
    /// Connects to `endpoints` and keeps a lease alive until `shutdown`.
    pub async fn connect(
        endpoints: &[String],
        shutdown: CancellationToken,
    ) -> Result<Self, StoreError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3));
        let client = Client::connect(endpoints, Some(options))
            .await
            .map_err(unavailable)?;
        let store = Self {
            client,
            lease: Arc::default(),
        };
        // Prove the connection now, so a wrong endpoint is reported at start.
        store.get("/cairn/").await?;
        tokio::spawn(keep_lease(
            store.client.clone(),
            store.lease.clone(),
            shutdown,
        ));
        Ok(store)
    }
}

/// Grants a lease and keeps it alive; after a failure, grants a new one.
async fn keep_lease(
    mut client: Client,
    lease: Arc<Mutex<Option<i64>>>,
    shutdown: CancellationToken,
) {
    loop {
        let attempt = async {
            let id = client.lease_grant(LEASE_TTL, None).await?.id();
            *lease.lock().await = Some(id);
            let (mut keeper, mut responses) = client.lease_keep_alive(id).await?;
            loop {
                keeper.keep_alive().await?;
                if responses.message().await?.is_none() {
                    return Ok::<(), etcd_client::Error>(());
                }
                tokio::time::sleep(Duration::from_secs((LEASE_TTL / 3) as u64)).await;
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => {
                if let Some(id) = lease.lock().await.take() {
                    let _ = client.lease_revoke(id).await;
                }
                return;
            }
            result = attempt => {
                *lease.lock().await = None;
                if let Err(e) = result {
                    tracing::warn!("etcd lease lost: {e}; renewing");
                }
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

    async fn put_ephemeral(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let lease = *self.lease.lock().await;
        let options = lease.map(|id| PutOptions::new().with_lease(id));
        self.client
            .clone()
            .put(key, value, options)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.client
            .clone()
            .delete(key, None)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<(), StoreError> {
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
            let txn = Txn::new().when([compare]).and_then([TxnOp::put(
                key,
                (current + 1).to_string(),
                None,
            )]);
            if client.txn(txn).await.map_err(unavailable)?.succeeded() {
                return Ok(current);
            }
        }
    }
}
