//! The embedded metadata store: every key in one JSON file, rewritten atomically
//! (write, fsync, rename) on each change. For a single machine and the demo.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tokio::sync::Mutex;

use super::{Kv, StoreError};

/// A metadata store in a local file.
pub struct FileKv {
    path: PathBuf,
    data: Mutex<BTreeMap<String, String>>,
}

impl FileKv {
    /// Opens (or creates) the store at `path`. Ephemeral keys of a previous run (members)
    /// are dropped, as etcd drops them when their lease expires.
    pub async fn open(path: &Path, ephemeral_prefix: &str) -> Result<Self, StoreError> {
        let mut data: BTreeMap<String, String> = match tokio::fs::read(path).await {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| StoreError(format!("{} is not a cairn store: {e}", path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(StoreError(format!("cannot read {}: {e}", path.display()))),
        };
        data.retain(|k, _| !k.starts_with(ephemeral_prefix));
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(|e| StoreError(format!("cannot create {}: {e}", dir.display())))?;
        }
        let store = Self {
            path: path.to_owned(),
            data: Mutex::new(data),
        };
        store.save(&*store.data.lock().await).await?;
        Ok(store)
    }

    async fn save(&self, data: &BTreeMap<String, String>) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec_pretty(data).map_err(|e| StoreError(e.to_string()))?;
        let tmp = self.path.with_extension("tmp");
        let write = async {
            let mut file = tokio::fs::File::create(&tmp).await?;
            tokio::io::AsyncWriteExt::write_all(&mut file, &bytes).await?;
            file.sync_all().await?;
            tokio::fs::rename(&tmp, &self.path).await
        };
        write
            .await
            .map_err(|e| StoreError(format!("cannot write {}: {e}", self.path.display())))
    }

    fn text(value: Vec<u8>) -> Result<String, StoreError> {
        String::from_utf8(value).map_err(|_| StoreError("values must be UTF-8 JSON".into()))
    }
}

impl Kv for FileKv {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self
            .data
            .lock()
            .await
            .get(key)
            .map(|v| v.clone().into_bytes()))
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let mut data = self.data.lock().await;
        data.insert(key.to_owned(), Self::text(value)?);
        self.save(&data).await
    }

    async fn put_ephemeral(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.put(key, value).await
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let mut data = self.data.lock().await;
        if data.remove(key).is_some() {
            self.save(&data).await?;
        }
        Ok(())
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<(), StoreError> {
        let mut data = self.data.lock().await;
        let before = data.len();
        data.retain(|k, _| !k.starts_with(prefix));
        if data.len() != before {
            self.save(&data).await?;
        }
        Ok(())
    }

    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let data = self.data.lock().await;
        Ok(data
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
            .collect())
    }

    async fn fetch_increment(&self, key: &str) -> Result<u64, StoreError> {
        let mut data = self.data.lock().await;
        let current: u64 = match data.get(key) {
            Some(v) => v
                .parse()
                .map_err(|_| StoreError(format!("{key} is not a number")))?,
            None => 0,
        };
        data.insert(key.to_owned(), (current + 1).to_string());
        self.save(&data).await?;
        Ok(current)
    }
}
