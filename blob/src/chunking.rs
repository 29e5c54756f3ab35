//! Content-defined chunking (FastCDC) of a stream of bytes, as the pieces arrive, and the
//! sha256 names of chunks. The node daemon cuts its application's state with it and the
//! coordinator its recorded channel states: both cut the same bytes into the same chunks,
//! so a chunk stored once is never stored again.

use bytes::Bytes;
use sha2::{Digest, Sha256};

/// FastCDC's smallest chunk.
pub const MIN_CHUNK: u32 = 8 << 10;
/// FastCDC's average chunk.
pub const AVG_CHUNK: u32 = 32 << 10;
/// FastCDC's largest chunk: no stored chunk is larger.
pub const MAX_CHUNK: u32 = 128 << 10;

/// The sha256 of `data`, as 64 lowercase hex digits (a chunk's name).
pub fn name_of(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// The sha256 of `data`.
pub fn digest(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

pub use cairn_proto::stored::manifest::valid_name;

/// One chunk: its bytes and their sha256.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// The sha256 of `data`.
    pub hash: [u8; 32],
    /// The bytes.
    pub data: Bytes,
}

impl Chunk {
    /// A chunk of `data`, hashed.
    pub fn new(data: Bytes) -> Self {
        Self {
            hash: digest(&data),
            data,
        }
    }

    /// Its name (hex sha256).
    pub fn name(&self) -> String {
        hex::encode(self.hash)
    }
}

/// Cuts a stream of bytes into content-defined chunks as it comes. FastCDC places a
/// boundary from the chunk's own start, so cutting the stream at the boundaries found so far
/// gives the chunks the whole would. Holds at most about two largest chunks plus the last
/// piece pushed.
#[derive(Debug, Default)]
pub struct Chunker {
    buffer: Vec<u8>,
}

impl Chunker {
    /// A chunker with nothing in it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds bytes; returns every chunk that is certainly complete.
    pub fn push(&mut self, data: &[u8]) -> Vec<Chunk> {
        self.buffer.extend_from_slice(data);
        if self.buffer.len() < 2 * MAX_CHUNK as usize {
            return Vec::new();
        }
        let cuts = cuts(&self.buffer);
        // The last chunk may still grow: keep it for the next push.
        let Some((&(last_offset, _), complete)) = cuts.split_last() else {
            return Vec::new();
        };
        let chunks = complete
            .iter()
            .map(|&(offset, length)| {
                Chunk::new(Bytes::copy_from_slice(
                    &self.buffer[offset..offset + length],
                ))
            })
            .collect();
        self.buffer.drain(..last_offset);
        chunks
    }

    /// The remaining chunks.
    pub fn finish(self) -> Vec<Chunk> {
        let buffer = Bytes::from(self.buffer);
        cuts(&buffer)
            .into_iter()
            .map(|(offset, length)| Chunk::new(buffer.slice(offset..offset + length)))
            .collect()
    }

    /// Bytes held, not yet cut.
    pub fn buffered(&self) -> usize {
        self.buffer.len()
    }
}

fn cuts(buffer: &[u8]) -> Vec<(usize, usize)> {
    fastcdc::v2020::FastCDC::new(buffer, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK)
        .map(|c| (c.offset, c.length))
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
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

    fn chunk_all(data: &[u8], piece: usize) -> Vec<Chunk> {
        let mut chunker = Chunker::new();
        let mut out = Vec::new();
        for p in data.chunks(piece) {
            out.extend(chunker.push(p));
            assert!(chunker.buffered() <= 2 * MAX_CHUNK as usize + piece);
        }
        out.extend(chunker.finish());
        out
    }

    #[test]
    fn streaming_cuts_like_the_whole_in_any_pieces() {
        let data = pseudo_random(3 << 20, 5);
        let whole = chunk_all(&data, data.len());
        for piece in [1_000, 65_536, 300_001] {
            assert_eq!(chunk_all(&data, piece), whole, "pieces of {piece}");
        }
        let joined: Vec<u8> = whole.iter().flat_map(|c| c.data.to_vec()).collect();
        assert_eq!(joined, data);
        assert!(whole.iter().all(|c| c.data.len() <= MAX_CHUNK as usize));
        assert!(whole.iter().all(|c| valid_name(&c.name())));
        assert!(chunk_all(&[], 10).is_empty());
    }
}
