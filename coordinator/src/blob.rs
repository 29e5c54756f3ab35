//! The blob store: bytes kept as content-defined chunks (FastCDC) named by their sha256
//! in a local directory, so a snapshot stores only the chunks no earlier snapshot stored,
//! while each snapshot still lists all of its chunks — no chain to replay.

use std::collections::BTreeSet;
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
        if tokio::fs::try_exists(&path).await? {
            stored.reused += data.len() as u64;
        } else {
            let dir = path.parent().expect("has a parent");
            tokio::fs::create_dir_all(dir).await?;
            // Concurrent uploads may store the same chunk: each writes its own temporary
            // file, and the renames (same content) may both win.
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let tmp = dir.join(format!(".{hash}.{}.{n}.tmp", std::process::id()));
            // Synced before it gets its name: a part's record (synced in the metadata store)
            // never names a chunk a crash could lose.
            let mut file = tokio::fs::File::create(&tmp).await?;
            tokio::io::AsyncWriteExt::write_all(&mut file, data).await?;
            file.sync_data().await?;
            drop(file);
            tokio::fs::rename(&tmp, &path).await?;
            stored.new += data.len() as u64;
        }
        stored.list.size += data.len() as u64;
        stored.list.chunks.push(hash);
        Ok(())
    }

    /// Reads back the bytes of `list`.
    pub async fn read(&self, list: &ChunkList) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(list.size as usize);
        for hash in &list.chunks {
            out.extend_from_slice(&self.read_chunk(hash).await?);
        }
        Ok(out)
    }

    /// Reads one chunk (at most 256 KiB), for reading a large list piece by piece.
    pub async fn read_chunk(&self, hash: &str) -> std::io::Result<Vec<u8>> {
        if hash.len() < 2 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(std::io::Error::other(format!("bad chunk name {hash}")));
        }
        tokio::fs::read(self.path(hash)).await
    }

    /// Removes every chunk not in `referenced`; returns the bytes freed.
    pub async fn collect_garbage(&self, referenced: &BTreeSet<String>) -> std::io::Result<u64> {
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
                freed += file.metadata().await?.len();
                tokio::fs::remove_file(file.path()).await?;
            }
        }
        Ok(freed)
    }
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
        let freed = blobs.collect_garbage(&keep).await.unwrap();
        assert!(freed > 0);
        assert_eq!(blobs.read(&changed.list).await.unwrap(), data);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
