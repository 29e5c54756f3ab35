//! The embedded metadata store, for a single machine and the demo: every key in memory, a
//! base file (`metadata.json`, one JSON object) and an append-only log beside it
//! (`metadata.log`, one JSON change per line, each synced before the change is
//! acknowledged). At start the log is replayed over the base (a torn last line is dropped;
//! an unreadable line with changes after it is damage, and the store refuses to open)
//! and both are compacted into a new base; the log is compacted again once it outgrows the
//! base. Ephemeral keys (members) live in memory only, as etcd drops them with their lease.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

use cairn_proto::stored::log::{Change, replay};

use super::{Kv, StoreError};

/// The log is compacted once it is larger than this and than the base.
const COMPACT_AT: u64 = 4 << 20;

struct Inner {
    data: BTreeMap<String, String>,
    log: tokio::fs::File,
    log_bytes: u64,
    base_bytes: u64,
    /// Bumped by each compaction (the log's offsets start over).
    generation: u64,
}

/// How far the log is known to be on disk.
#[derive(Default)]
struct Synced {
    generation: u64,
    bytes: u64,
}

/// A metadata store in local files.
pub struct FileKv {
    base: PathBuf,
    log_path: PathBuf,
    ephemeral: String,
    inner: Mutex<Inner>,
    /// Group commit: a change is acknowledged once a sync covering it is done; one sync
    /// covers every change appended before it, so concurrent writers share it.
    synced: Mutex<Synced>,
    /// A handle on the log for syncing outside `inner`'s lock.
    sync_handle: std::sync::Arc<std::fs::File>,
    /// The lock file, held (an exclusive `flock`) for as long as the store is open: a
    /// second coordinator on the same directory is refused instead of forking the store.
    lock: std::fs::File,
    lock_path: PathBuf,
}

fn io(path: &Path, what: &str, e: std::io::Error) -> StoreError {
    StoreError::new(format!("cannot {what} {}: {e}", path.display()))
}

/// Opens and locks the store's lock file, writing this process's id into it.
fn lock_store(path: &Path) -> Result<std::fs::File, StoreError> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| io(path, "open", e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(path).unwrap_or_default();
            return Err(StoreError::new(format!(
                "the embedded store is in use by another coordinator (pid {}; lock {}): \
                 the embedded store serves one coordinator at a time; several coordinators \
                 need etcd (--etcd)",
                holder.trim(),
                path.display()
            )));
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(path, "lock", e)),
    }
    file.set_len(0).map_err(|e| io(path, "write", e))?;
    writeln!(file, "{}", std::process::id()).map_err(|e| io(path, "write", e))?;
    Ok(file)
}

impl FileKv {
    /// Opens (or creates) the store at `path` (the base file; the log is beside it).
    /// Ephemeral keys of a previous run (members) are dropped, as etcd drops them when their
    /// lease expires.
    pub async fn open(path: &Path, ephemeral_prefix: &str) -> Result<Self, StoreError> {
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(|e| io(dir, "create", e))?;
        }
        let lock_path = path.with_extension("lock");
        let lock = lock_store(&lock_path)?;
        let base = match tokio::fs::read(path).await {
            Ok(bytes) => Some(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io(path, "read", e)),
        };
        let log_path = path.with_extension("log");
        let log = match tokio::fs::read(&log_path).await {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io(&log_path, "read", e)),
        };
        let (mut data, dropped) = replay(base.as_deref(), &log).map_err(|e| {
            StoreError::new(format!("{} is not a cairn store: {e}", path.display()))
        })?;
        if let Some((line, why)) = dropped {
            // A write cut short by a crash: nothing after it was acknowledged.
            tracing::warn!(
                log = %log_path.display(),
                line,
                "dropping an unreadable tail of the metadata log: {why}"
            );
        }
        data.retain(|k, _| !k.starts_with(ephemeral_prefix));
        let log = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .await
            .map_err(|e| io(&log_path, "open", e))?;
        let sync_handle = log
            .try_clone()
            .await
            .map_err(|e| io(&log_path, "open", e))?
            .into_std()
            .await;
        let store = Self {
            base: path.to_owned(),
            log_path,
            ephemeral: ephemeral_prefix.to_owned(),
            inner: Mutex::new(Inner {
                data,
                log,
                log_bytes: 0,
                base_bytes: 0,
                generation: 0,
            }),
            synced: Mutex::new(Synced::default()),
            sync_handle: std::sync::Arc::new(sync_handle),
            lock,
            lock_path,
        };
        store.compact(&mut *store.inner.lock().await).await?;
        Ok(store)
    }

    /// Checks that the store's files are still the ones it has open: the lock file and the
    /// log (same inode) and the base. A store whose files were deleted or replaced under it
    /// would lose every change from here on at the next restart.
    pub fn check_files(&self) -> Result<(), StoreError> {
        use std::os::unix::fs::MetadataExt;
        let same = |path: &Path, open: &std::fs::File| -> Result<(), StoreError> {
            let on_disk = std::fs::metadata(path).map_err(|e| io(path, "find", e))?;
            let held = open.metadata().map_err(|e| io(path, "stat", e))?;
            if (on_disk.dev(), on_disk.ino()) != (held.dev(), held.ino()) {
                return Err(StoreError::new(format!(
                    "{} was replaced while the coordinator runs",
                    path.display()
                )));
            }
            Ok(())
        };
        same(&self.lock_path, &self.lock)?;
        same(&self.log_path, &self.sync_handle)?;
        std::fs::metadata(&self.base).map_err(|e| io(&self.base, "find", e))?;
        Ok(())
    }

    /// Writes the whole map as the new base (write, sync, rename), then empties the log.
    async fn compact(&self, inner: &mut Inner) -> Result<(), StoreError> {
        let durable: BTreeMap<&String, &String> = inner
            .data
            .iter()
            .filter(|(k, _)| !k.starts_with(&self.ephemeral))
            .collect();
        let bytes =
            serde_json::to_vec_pretty(&durable).map_err(|e| StoreError::new(e.to_string()))?;
        let tmp = self.base.with_extension("tmp");
        let write = async {
            let mut file = tokio::fs::File::create(&tmp).await?;
            file.write_all(&bytes).await?;
            // tokio's file writes in the background: flush surfaces its errors (a full
            // disk), which `sync_all` alone would not report.
            file.flush().await?;
            file.sync_all().await?;
            tokio::fs::rename(&tmp, &self.base).await
        };
        write.await.map_err(|e| io(&self.base, "write", e))?;
        inner
            .log
            .set_len(0)
            .await
            .map_err(|e| io(&self.log_path, "truncate", e))?;
        inner.log_bytes = 0;
        inner.base_bytes = bytes.len() as u64;
        inner.generation += 1;
        Ok(())
    }

    /// Applies `change` in memory and appends it to the log, then (with `inner` released)
    /// waits until a sync covers it.
    async fn commit(
        &self,
        mut inner: tokio::sync::MutexGuard<'_, Inner>,
        change: Change,
    ) -> Result<(), StoreError> {
        let mut line = serde_json::to_vec(&change).map_err(|e| StoreError::new(e.to_string()))?;
        line.push(b'\n');
        let write = async {
            inner.log.write_all(&line).await?;
            inner.log.flush().await
        };
        write
            .await
            .map_err(|e| io(&self.log_path, "append to", e))?;
        inner.log_bytes += line.len() as u64;
        change.apply(&mut inner.data);
        if inner.log_bytes > COMPACT_AT && inner.log_bytes > inner.base_bytes {
            // The base is written and synced whole: the change is durable with it.
            return self.compact(&mut inner).await;
        }
        let mine = (inner.generation, inner.log_bytes);
        drop(inner);
        let mut synced = self.synced.lock().await;
        if (synced.generation, synced.bytes) >= mine {
            return Ok(()); // a sync that started after this append covered it
        }
        // This sync covers everything appended until now, other writers' changes too.
        let upto = {
            let inner = self.inner.lock().await;
            (inner.generation, inner.log_bytes)
        };
        let handle = self.sync_handle.clone();
        tokio::task::spawn_blocking(move || handle.sync_data())
            .await
            .map_err(|e| StoreError::new(e.to_string()))?
            .map_err(|e| io(&self.log_path, "sync", e))?;
        (synced.generation, synced.bytes) = upto;
        Ok(())
    }

    fn text(value: Vec<u8>) -> Result<String, StoreError> {
        String::from_utf8(value).map_err(|_| StoreError::new("values must be UTF-8 JSON"))
    }
}

impl Kv for FileKv {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self
            .inner
            .lock()
            .await
            .data
            .get(key)
            .map(|v| v.clone().into_bytes()))
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let value = Self::text(value)?;
        let mut inner = self.inner.lock().await;
        if key.starts_with(&self.ephemeral) {
            inner.data.insert(key.to_owned(), value);
            return Ok(());
        }
        let change = Change::Put {
            key: key.to_owned(),
            value,
        };
        self.commit(inner, change).await
    }

    async fn put_ephemeral(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let value = Self::text(value)?;
        self.inner.lock().await.data.insert(key.to_owned(), value);
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let mut inner = self.inner.lock().await;
        if !inner.data.contains_key(key) {
            return Ok(());
        }
        if key.starts_with(&self.ephemeral) {
            inner.data.remove(key);
            return Ok(());
        }
        let change = Change::Delete {
            key: key.to_owned(),
        };
        self.commit(inner, change).await
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<(), StoreError> {
        let inner = self.inner.lock().await;
        let any = inner
            .data
            .range(prefix.to_owned()..)
            .next()
            .is_some_and(|(k, _)| k.starts_with(prefix));
        if !any {
            return Ok(());
        }
        let change = Change::DeletePrefix {
            prefix: prefix.to_owned(),
        };
        self.commit(inner, change).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let inner = self.inner.lock().await;
        Ok(inner
            .data
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
            .collect())
    }

    async fn fetch_increment(&self, key: &str) -> Result<u64, StoreError> {
        let inner = self.inner.lock().await;
        let current: u64 = match inner.data.get(key) {
            Some(v) => v
                .parse()
                .map_err(|_| StoreError::new(format!("{key} is not a number")))?,
            None => 0,
        };
        let next = current
            .checked_add(1)
            .ok_or_else(|| StoreError::new(format!("{key} is at its largest value")))?;
        let change = Change::Put {
            key: key.to_owned(),
            value: next.to_string(),
        };
        self.commit(inner, change).await?;
        Ok(current)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn changes_survive_a_reopen_and_a_torn_tail_is_dropped() {
        let dir = std::env::temp_dir().join(format!("cairn-filekv-{}", std::process::id()));
        let path = dir.join("metadata.json");
        let _ = std::fs::remove_dir_all(&dir);
        {
            let kv = FileKv::open(&path, "/m/").await.unwrap();
            kv.put("/a/1", b"\"one\"".to_vec()).await.unwrap();
            kv.put("/a/2", b"\"two\"".to_vec()).await.unwrap();
            kv.put("/b", b"1".to_vec()).await.unwrap();
            kv.put_ephemeral("/m/n1", b"{}".to_vec()).await.unwrap();
            assert_eq!(kv.fetch_increment("/id").await.unwrap(), 0);
            assert_eq!(kv.fetch_increment("/id").await.unwrap(), 1);
            kv.delete_prefix("/a/").await.unwrap();
            kv.put("/a/3", b"\"three\"".to_vec()).await.unwrap();
            kv.delete("/b").await.unwrap();
        }
        // A crash in the middle of an append.
        let log = path.with_extension("log");
        let mut text = std::fs::read(&log).unwrap();
        text.extend_from_slice(b"{\"op\":\"put\",\"key\":\"/x\",\"val");
        std::fs::write(&log, text).unwrap();
        let kv = FileKv::open(&path, "/m/").await.unwrap();
        let keys: Vec<String> = kv
            .list("/")
            .await
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(keys, ["/a/3", "/id"]);
        assert_eq!(kv.fetch_increment("/id").await.unwrap(), 2);
        assert!(std::fs::metadata(&log).unwrap().len() > 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_line_with_changes_after_it_is_refused_not_dropped() {
        let put = |k: &str| format!("{{\"op\":\"put\",\"key\":\"{k}\",\"value\":\"1\"}}\n");
        // Torn last line: dropped, the rest kept.
        let log = format!("{}{}{{\"op\":\"pu", put("/a"), put("/b"));
        let (data, dropped) = replay(None, log.as_bytes()).unwrap();
        assert_eq!(data.keys().collect::<Vec<_>>(), ["/a", "/b"]);
        assert_eq!(dropped.map(|(line, _)| line), Some(3));
        // Garbage in the middle: refused, naming the line and what follows.
        let log = format!("{}garbage\n{}{}", put("/a"), put("/b"), put("/c"));
        let e = replay(None, log.as_bytes()).unwrap_err();
        assert!(
            e.contains("line 2") && e.contains("2 changes follow it"),
            "{e}"
        );
        // Blank lines after a torn one are no changes.
        let log = format!("{}{{\"op\n\n", put("/a"));
        assert!(replay(None, log.as_bytes()).is_ok());
    }
}
