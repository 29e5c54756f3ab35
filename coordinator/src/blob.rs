//! The blob store: bytes kept as content-defined chunks (FastCDC) named by their sha256
//! in a local directory, so a snapshot stores only the chunks no earlier snapshot stored,
//! while each snapshot still lists all of its chunks — no chain to replay.
//!
//! Integrity, as enforced here:
//! - a chunk is written to a temporary file, fully written (every error checked), fsynced,
//!   renamed to its name, and its directory fsynced: a name never points at partial bytes,
//!   and a full disk or any I/O error is an error of the write, never an empty chunk;
//! - an existing chunk is reused only if its bytes are the bytes being stored (a damaged one
//!   is rewritten);
//! - every chunk read is checked against its name: a missing chunk or one whose bytes do not
//!   hash to its name is an error naming the chunk ([`is_data_loss`]), never wrong bytes.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::store::ChunkList;

const MIN_CHUNK: u32 = 8 << 10;
const AVG_CHUNK: u32 = 32 << 10;
const MAX_CHUNK: u32 = 128 << 10;

/// A directory of chunks, `<dir>/<first two hex digits>/<sha256>`.
#[derive(Debug, Clone)]
pub struct BlobStore {
    dir: PathBuf,
}

/// What storing some bytes did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    /// The chunks.
    pub list: ChunkList,
    /// Bytes written anew.
    pub new: u64,
    /// Bytes already present.
    pub reused: u64,
}

/// Whether a read failed because stored data is missing or corrupt (as opposed to an I/O
/// error that may pass): such errors are `DATA_LOSS` to a client.
pub fn is_data_loss(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::InvalidData
    )
}

/// Whether `hash` is a chunk name: 64 lowercase hex digits.
fn valid_name(hash: &str) -> bool {
    hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl BlobStore {
    /// Opens (creating) the directory.
    pub async fn open(dir: &Path) -> std::io::Result<Self> {
        tokio::fs::create_dir_all(dir).await?;
        Ok(Self {
            dir: dir.to_owned(),
        })
    }

    fn path(&self, hash: &str) -> PathBuf {
        self.dir.join(&hash[..2]).join(hash)
    }

    /// A writer that chunks a stream of bytes as they come, holding at most a few chunks.
    pub fn writer(&self) -> ChunkWriter<'_> {
        ChunkWriter {
            store: self,
            buffer: Vec::new(),
            stored: Stored::default(),
        }
    }

    async fn put_chunk(&self, data: &[u8], stored: &mut Stored) -> std::io::Result<()> {
        let hash = hex::encode(Sha256::digest(data));
        let path = self.path(&hash);
        let size = data.len() as u64;
        // Reused only if the stored bytes are these bytes: same size, then same content
        // (a chunk damaged on disk is rewritten here rather than handed on to another
        // snapshot).
        let present = match tokio::fs::metadata(&path).await {
            Ok(meta) if meta.len() == size => match tokio::fs::read(&path).await {
                Ok(stored) if stored == data => true,
                Ok(_) => {
                    tracing::warn!(chunk = %hash, "a stored chunk is corrupt: rewriting it");
                    false
                }
                Err(e) => return Err(chunk_error(&hash, "cannot read", e)),
            },
            Ok(meta) => {
                tracing::warn!(
                    chunk = %hash,
                    found = meta.len(),
                    expected = size,
                    "a stored chunk has the wrong size: rewriting it"
                );
                false
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => return Err(chunk_error(&hash, "cannot look up", e)),
        };
        if present {
            stored.reused += size;
        } else {
            let data = data.to_vec();
            let name = hash.clone();
            tokio::task::spawn_blocking(move || write_chunk(&path, &name, &data))
                .await
                .map_err(std::io::Error::other)??;
            stored.new += size;
        }
        stored.list.size += size;
        stored.list.chunks.push(hash);
        Ok(())
    }

    /// Reads back the bytes of `list`, every chunk checked.
    pub async fn read(&self, list: &ChunkList) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(usize::try_from(list.size).unwrap_or(0).min(1 << 30));
        for hash in &list.chunks {
            out.extend_from_slice(&self.read_chunk(hash).await?);
        }
        if out.len() as u64 != list.size {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the chunks hold {} bytes where their list says {}",
                    out.len(),
                    list.size
                ),
            ));
        }
        Ok(out)
    }

    /// Reads one chunk (at most `MAX_CHUNK` bytes) and checks that its bytes hash to its name.
    pub async fn read_chunk(&self, hash: &str) -> std::io::Result<Vec<u8>> {
        if !valid_name(hash) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("bad chunk name `{hash}`"),
            ));
        }
        let missing_or = |e: std::io::Error| {
            if e.kind() == std::io::ErrorKind::NotFound {
                std::io::Error::new(e.kind(), format!("chunk {hash} is missing"))
            } else {
                chunk_error(hash, "cannot read", e)
            }
        };
        // No chunk is larger than FastCDC's maximum: a larger file is not one (and is not
        // read into memory).
        let len = tokio::fs::metadata(self.path(hash))
            .await
            .map_err(missing_or)?
            .len();
        if len > u64::from(MAX_CHUNK) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "chunk {hash} is corrupt: {len} bytes, above the {MAX_CHUNK}-byte chunk size"
                ),
            ));
        }
        let bytes = tokio::fs::read(self.path(hash)).await.map_err(missing_or)?;
        let actual = hex::encode(Sha256::digest(&bytes));
        if actual != hash {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "chunk {hash} is corrupt: its {} bytes hash to {actual}",
                    bytes.len()
                ),
            ));
        }
        Ok(bytes)
    }

    /// Checks that every chunk of `list` exists and matches its name, and that they add
    /// up to the list's size; returns the bytes checked.
    pub async fn verify(&self, list: &ChunkList) -> std::io::Result<u64> {
        let mut total = 0u64;
        for hash in &list.chunks {
            total = total.saturating_add(self.read_chunk(hash).await?.len() as u64);
        }
        if total != list.size {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the chunks hold {total} bytes where their list says {}",
                    list.size
                ),
            ));
        }
        Ok(total)
    }

    /// Removes every chunk not in `referenced` while `may_delete()` holds (asked before each
    /// removal: a coordinator whose leadership ended deletes nothing more); returns the bytes
    /// freed.
    pub async fn collect_garbage(
        &self,
        referenced: &BTreeSet<String>,
        may_delete: impl Fn() -> bool,
    ) -> std::io::Result<u64> {
        let mut freed = 0;
        let mut dirs = tokio::fs::read_dir(&self.dir).await?;
        while let Some(dir) = dirs.next_entry().await? {
            if !dir.file_type().await?.is_dir() {
                continue;
            }
            let mut files = tokio::fs::read_dir(dir.path()).await?;
            while let Some(file) = files.next_entry().await? {
                let name = file.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') || referenced.contains(&name) {
                    continue;
                }
                let size = file.metadata().await?.len();
                if !may_delete() {
                    return Err(std::io::Error::other(
                        "stopped: this coordinator no longer leads",
                    ));
                }
                tokio::fs::remove_file(file.path()).await?;
                freed += size;
            }
        }
        Ok(freed)
    }
}

/// An I/O error on chunk `hash`, saying what was being done.
fn chunk_error(hash: &str, doing: &str, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{doing} chunk {hash}: {e}"))
}

/// Writes a chunk durably: temporary file, every byte written, fsynced, renamed, the
/// directory fsynced. Concurrent writers of one chunk each use their own temporary file;
/// the renames (same content) may both win. On any error the temporary file is removed.
fn write_chunk(path: &Path, hash: &str, data: &[u8]) -> std::io::Result<()> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = path.parent().expect("a chunk path has a directory");
    std::fs::create_dir_all(dir)
        .map_err(|e| chunk_error(hash, "cannot create the directory of", e))?;
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{hash}.{}.{n}.tmp", std::process::id()));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        file.write_all(data)?;
        file.flush()?;
        file.sync_all()?;
        let len = file.metadata()?.len();
        if len != data.len() as u64 {
            return Err(std::io::Error::other(format!(
                "wrote {len} bytes of {}",
                data.len()
            )));
        }
        drop(file);
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(chunk_error(hash, "cannot write", e));
    }
    Ok(())
}

/// Chunks bytes as they arrive. FastCDC places a boundary from the chunk's own start, so
/// cutting the stream at the boundaries found so far gives the chunks the whole would.
pub struct ChunkWriter<'a> {
    store: &'a BlobStore,
    buffer: Vec<u8>,
    stored: Stored,
}

impl ChunkWriter<'_> {
    /// Adds bytes; stores every chunk that is certainly complete.
    pub async fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.buffer.extend_from_slice(data);
        if self.buffer.len() < 2 * MAX_CHUNK as usize {
            return Ok(());
        }
        let chunks: Vec<(usize, usize)> =
            fastcdc::v2020::FastCDC::new(&self.buffer, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK)
                .map(|c| (c.offset, c.length))
                .collect();
        // The last chunk may still grow: keep it for the next write.
        let Some((&(last_offset, _), complete)) = chunks.split_last() else {
            return Ok(());
        };
        for &(offset, length) in complete {
            let chunk = self.buffer[offset..offset + length].to_vec();
            self.store.put_chunk(&chunk, &mut self.stored).await?;
        }
        self.buffer.drain(..last_offset);
        Ok(())
    }

    /// Stores the rest; returns the chunk list and what was new.
    pub async fn finish(mut self) -> std::io::Result<Stored> {
        let buffer = std::mem::take(&mut self.buffer);
        let chunks: Vec<(usize, usize)> =
            fastcdc::v2020::FastCDC::new(&buffer, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK)
                .map(|c| (c.offset, c.length))
                .collect();
        for (offset, length) in chunks {
            self.store
                .put_chunk(&buffer[offset..offset + length], &mut self.stored)
                .await?;
        }
        Ok(self.stored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    async fn store(blobs: &BlobStore, data: &[u8], piece: usize) -> Stored {
        let mut writer = blobs.writer();
        for part in data.chunks(piece) {
            writer.write(part).await.unwrap();
        }
        writer.finish().await.unwrap()
    }

    #[tokio::test]
    async fn streaming_chunks_like_the_whole_and_a_small_change_stores_little() {
        let dir = std::env::temp_dir().join(format!("cairn-blob-test-{}", std::process::id()));
        let blobs = BlobStore::open(&dir).await.unwrap();
        let mut data = pseudo_random(4 << 20, 7);
        let first = store(&blobs, &data, 100_000).await;
        assert_eq!(first.list.size, data.len() as u64);
        assert_eq!(first.new, data.len() as u64);
        // The same bytes in other pieces: the same chunks, nothing new.
        let again = store(&blobs, &data, 1 << 20).await;
        assert_eq!(again.list, first.list);
        assert_eq!(again.new, 0);
        // Change 1 % in one place: only the chunks it touches are new — at most the changed
        // bytes plus a chunk boundary's worth on either side.
        for b in &mut data[2 << 20..(2 << 20) + 40_000] {
            *b = b.wrapping_add(1);
        }
        let changed = store(&blobs, &data, 65_536).await;
        assert!(
            changed.new <= 40_000 + 2 * u64::from(MAX_CHUNK),
            "stored {} of {}",
            changed.new,
            data.len()
        );
        assert_eq!(blobs.read(&changed.list).await.unwrap(), data);
        // Keep only the changed version: the first version's unique chunks go.
        let keep: BTreeSet<String> = changed.list.chunks.iter().cloned().collect();
        // A coordinator that no longer leads deletes nothing.
        let refused = blobs
            .collect_garbage(&BTreeSet::new(), || false)
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("no longer leads"), "{refused}");
        assert_eq!(blobs.read(&changed.list).await.unwrap(), data);
        let freed = blobs.collect_garbage(&keep, || true).await.unwrap();
        assert!(freed > 0);
        assert_eq!(blobs.read(&changed.list).await.unwrap(), data);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_corrupt_or_missing_chunk_is_an_error_and_a_wrong_sized_one_is_rewritten() {
        let dir = std::env::temp_dir().join(format!("cairn-blob-bad-{}", std::process::id()));
        let blobs = BlobStore::open(&dir).await.unwrap();
        let data = pseudo_random(300_000, 11);
        let first = store(&blobs, &data, 50_000).await;
        let victim = first.list.chunks[0].clone();
        let path = blobs.path(&victim);
        // Same size, other bytes: read and verify name the chunk as corrupt.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[0] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let err = blobs.read(&first.list).await.unwrap_err();
        assert!(is_data_loss(&err), "{err}");
        assert!(err.to_string().contains(&victim), "{err}");
        assert!(blobs.verify(&first.list).await.is_err());
        // Truncated to nothing (what a full disk left before): not reused, rewritten.
        std::fs::write(&path, b"").unwrap();
        let again = store(&blobs, &data, 50_000).await;
        assert_eq!(again.new, bytes.len() as u64, "only the empty chunk is new");
        assert_eq!(blobs.read(&again.list).await.unwrap(), data);
        // Missing: named too.
        std::fs::remove_file(&path).unwrap();
        let err = blobs.read_chunk(&victim).await.unwrap_err();
        assert!(
            is_data_loss(&err) && err.to_string().contains("missing"),
            "{err}"
        );
        // A file larger than any chunk is refused without being read whole.
        std::fs::write(&path, vec![0u8; MAX_CHUNK as usize + 1]).unwrap();
        let err = blobs.read_chunk(&victim).await.unwrap_err();
        assert!(
            is_data_loss(&err) && err.to_string().contains("above"),
            "{err}"
        );
        std::fs::remove_file(&path).unwrap();
        // A name that is not a sha256 never reaches the file system.
        assert!(blobs.read_chunk("../../etc/passwd").await.is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
