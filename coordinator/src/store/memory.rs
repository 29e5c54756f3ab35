//! An in-memory metadata store: every key in a map, nothing on disk. For unit tests that
//! drive the coordinator's task directly, as the other stores are driven through processes.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::{Kv, StoreError};

/// A metadata store in memory.
#[derive(Debug, Default)]
pub struct MemoryKv {
    data: Mutex<BTreeMap<String, Vec<u8>>>,
}

impl MemoryKv {
    fn data(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        self.data
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Kv for MemoryKv {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.data().get(key).cloned())
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.data().insert(key.to_owned(), value);
        Ok(())
    }

    async fn put_ephemeral(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.put(key, value).await
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.data().remove(key);
        Ok(())
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<(), StoreError> {
        self.data().retain(|k, _| !k.starts_with(prefix));
        Ok(())
    }

    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        Ok(self
            .data()
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    async fn fetch_increment(&self, key: &str) -> Result<u64, StoreError> {
        let mut data = self.data();
        let current: u64 = match data.get(key) {
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|t| t.trim().parse().ok())
                .ok_or_else(|| StoreError::new(format!("{key} is not a number")))?,
            None => 0,
        };
        let next = current
            .checked_add(1)
            .ok_or_else(|| StoreError::new(format!("{key} is at its largest value")))?;
        data.insert(key.to_owned(), next.to_string().into_bytes());
        Ok(current)
    }
}
