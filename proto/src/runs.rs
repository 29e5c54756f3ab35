//! Runs: consecutive payloads for one destination carried as one blob plus lengths
//! (`DataRun`, `SendRun`, `DeliverRun`), which is much cheaper on the wire and in memory
//! than one `bytes` field each for small messages. A large payload is not worth copying
//! into a blob: it travels as a run of its own, as the `Bytes` it already is.

use bytes::{Bytes, BytesMut};

/// Payloads from this size on travel as a run of their own, uncopied.
pub const OWN_RUN: usize = 1 << 10;

/// Builds runs in order: consecutive small payloads with the same key share a blob.
#[derive(Debug)]
pub struct RunBuilder<K> {
    runs: Vec<(K, Blob, Vec<u32>)>,
}

#[derive(Debug)]
enum Blob {
    /// One large payload, as it came.
    Own(Bytes),
    /// Small payloads, copied together.
    Packed(BytesMut),
}

impl<K: PartialEq> Default for RunBuilder<K> {
    fn default() -> Self {
        Self { runs: Vec::new() }
    }
}

impl<K: PartialEq> RunBuilder<K> {
    /// Appends `payload` for `key`.
    pub fn push(&mut self, key: K, payload: Bytes) {
        let len = payload.len() as u32;
        if payload.len() >= OWN_RUN {
            self.runs.push((key, Blob::Own(payload), vec![len]));
            return;
        }
        match self.runs.last_mut() {
            Some((k, Blob::Packed(blob), lengths)) if *k == key => {
                blob.extend_from_slice(&payload);
                lengths.push(len);
            }
            _ => self
                .runs
                .push((key, Blob::Packed(BytesMut::from(&payload[..])), vec![len])),
        }
    }

    /// Whether nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// The runs, in order: key, blob, lengths.
    pub fn finish(self) -> impl Iterator<Item = (K, Bytes, Vec<u32>)> {
        self.runs.into_iter().map(|(key, blob, lengths)| {
            let blob = match blob {
                Blob::Own(bytes) => bytes,
                Blob::Packed(blob) => blob.freeze(),
            };
            (key, blob, lengths)
        })
    }
}

/// Why a received run cannot be taken apart.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    /// The lengths do not add up to the blob.
    #[error("a run's lengths add up to {total} bytes but it carries {carried}")]
    Mismatch {
        /// What the lengths add up to.
        total: u64,
        /// The blob's size.
        carried: usize,
    },
    /// One payload is above the limit.
    #[error("a payload of {size} bytes is above the limit of {limit}")]
    TooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
}

/// A received run's payloads: slices of `blob` (no copy) of `lengths`, in order. Refused
/// unless the lengths add up to the blob exactly and each is at most `max_payload`; every
/// check is made before the first payload is handed out.
pub fn split(
    blob: &Bytes,
    lengths: &[u32],
    max_payload: usize,
) -> Result<impl Iterator<Item = Bytes>, RunError> {
    let mut total = 0u64;
    for len in lengths {
        let size = *len as usize;
        if size > max_payload {
            return Err(RunError::TooLarge {
                size,
                limit: max_payload,
            });
        }
        total = total.saturating_add(u64::from(*len));
    }
    if total != blob.len() as u64 {
        return Err(RunError::Mismatch {
            total,
            carried: blob.len(),
        });
    }
    let blob = blob.clone();
    let mut at = 0usize;
    Ok(lengths.iter().map(move |len| {
        let end = at + *len as usize;
        let payload = blob.slice(at..end);
        at = end;
        payload
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_splits_only_when_its_lengths_add_up_and_fit() {
        let blob = Bytes::from_static(b"abcdef");
        let parts: Vec<Bytes> = split(&blob, &[1, 0, 2, 3], 8).unwrap().collect();
        assert_eq!(parts, ["a", "", "bc", "def"]);
        assert_eq!(
            split(&blob, &[1, 2], 8).err(),
            Some(RunError::Mismatch {
                total: 3,
                carried: 6
            })
        );
        assert_eq!(
            split(&blob, &[6], 5).err(),
            Some(RunError::TooLarge { size: 6, limit: 5 })
        );
        assert!(split(&blob, &[u32::MAX; 3], usize::MAX).is_err());
    }

    #[test]
    fn small_payloads_share_a_run_per_key_and_large_ones_go_alone_uncopied() {
        let large = Bytes::from(vec![7u8; OWN_RUN]);
        let mut runs = RunBuilder::default();
        runs.push("a", Bytes::from_static(b"x"));
        runs.push("a", Bytes::from_static(b"yz"));
        runs.push("a", large.clone());
        runs.push("a", Bytes::from_static(b"w"));
        runs.push("b", Bytes::from_static(b"v"));
        let runs: Vec<_> = runs.finish().collect();
        assert_eq!(runs.len(), 4);
        assert_eq!(runs[0], ("a", Bytes::from_static(b"xyz"), vec![1, 2]));
        assert_eq!(runs[1].2, vec![OWN_RUN as u32]);
        assert_eq!(runs[1].1.as_ptr(), large.as_ptr(), "not copied");
        assert_eq!(runs[2], ("a", Bytes::from_static(b"w"), vec![1]));
        assert_eq!(runs[3], ("b", Bytes::from_static(b"v"), vec![1]));
    }
}
