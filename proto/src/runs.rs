//! Runs: consecutive payloads for one destination carried as one blob plus lengths
//! (`DataRun`, `SendRun`, `DeliverRun`), which is much cheaper on the wire and in memory
//! than one `bytes` field each for small messages. A large payload is not worth copying
//! into a blob: it travels as a run of its own, as the `Bytes` it already is.

use bytes::{Bytes, BytesMut};

use crate::v1 as pb;

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

/// What one recorded run holds at most: about this many bytes, each message counted with
/// 16 bytes of overhead (a run's real overhead is 1–4 bytes a message)…
pub const RECORDED_RUN_BYTES: usize = 1 << 20;
/// …so at most this many messages (a run is refused above it: a run of empty payloads must
/// not make a reader build millions of messages out of a few bytes).
pub const MAX_RUN_MESSAGES: usize = RECORDED_RUN_BYTES / 16 + 1;

/// A channel's recorded messages (`(data index, payload)`, in order) as runs, one at a time:
/// consecutive indices share a run until it holds about [`RECORDED_RUN_BYTES`]; a gap in
/// the indices starts a new run, and a payload of [`OWN_RUN`] bytes or more travels as a run
/// of its own, uncopied.
pub fn recorded_runs(messages: &[(u64, Bytes)]) -> RecordedRuns<'_> {
    RecordedRuns { rest: messages }
}

/// The runs of [`recorded_runs`].
#[derive(Debug)]
pub struct RecordedRuns<'a> {
    rest: &'a [(u64, Bytes)],
}

impl Iterator for RecordedRuns<'_> {
    type Item = pb::RecordedRun;

    fn next(&mut self) -> Option<pb::RecordedRun> {
        let ((first, payload), _) = self.rest.split_first()?;
        if payload.len() >= OWN_RUN {
            self.rest = &self.rest[1..];
            return Some(pb::RecordedRun {
                first_index: *first,
                payloads: payload.clone(),
                lengths: vec![payload.len() as u32],
            });
        }
        let mut blob = BytesMut::new();
        let mut lengths = Vec::new();
        let mut size = 0usize;
        let mut taken = 0usize;
        for (index, payload) in self.rest {
            let next = first.checked_add(taken as u64) == Some(*index);
            if !next || payload.len() >= OWN_RUN || size >= RECORDED_RUN_BYTES {
                break;
            }
            blob.extend_from_slice(payload);
            lengths.push(payload.len() as u32);
            size += payload.len() + 16;
            taken += 1;
        }
        self.rest = &self.rest[taken..];
        Some(pb::RecordedRun {
            first_index: *first,
            payloads: blob.freeze(),
            lengths,
        })
    }
}

/// Why a recorded run cannot be taken apart.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordedRunError {
    /// Its payloads do not split.
    #[error(transparent)]
    Run(#[from] RunError),
    /// Its indices run past the largest one.
    #[error("a run of {count} messages from index {first} runs past the largest index")]
    Overflow {
        /// Its first index.
        first: u64,
        /// Its messages.
        count: usize,
    },
    /// It holds more messages than a run may.
    #[error("a run of {count} messages, above the {MAX_RUN_MESSAGES} a run may hold")]
    TooMany {
        /// Its messages.
        count: usize,
    },
    /// A channel state holds messages and a run at once.
    #[error("a channel state holds both messages and a run")]
    Both,
}

/// The data indices of a recorded run's messages, every check made: at most
/// [`MAX_RUN_MESSAGES`], the lengths add up to its payloads, each is at most `max_payload`,
/// the indices do not overflow.
pub fn run_indices(
    run: &pb::RecordedRun,
    max_payload: usize,
) -> Result<std::ops::Range<u64>, RecordedRunError> {
    if run.lengths.len() > MAX_RUN_MESSAGES {
        return Err(RecordedRunError::TooMany {
            count: run.lengths.len(),
        });
    }
    let end = u64::try_from(run.lengths.len())
        .ok()
        .and_then(|count| run.first_index.checked_add(count))
        .ok_or(RecordedRunError::Overflow {
            first: run.first_index,
            count: run.lengths.len(),
        })?;
    split(&run.payloads, &run.lengths, max_payload).map(drop)?;
    Ok(run.first_index..end)
}

/// The messages of a recorded run, each payload a slice of its blob (no copy), every
/// check of [`run_indices`] made first.
pub fn run_messages(
    run: &pb::RecordedRun,
    max_payload: usize,
) -> Result<impl Iterator<Item = pb::RecordedMessage>, RecordedRunError> {
    let indices = run_indices(run, max_payload)?;
    let payloads = split(&run.payloads, &run.lengths, max_payload)?;
    Ok(indices
        .zip(payloads)
        .map(|(index, payload)| pb::RecordedMessage { index, payload }))
}

/// A channel state with its run, if any, turned into messages (what readers are given):
/// refused if it holds messages and a run at once, or the run does not take apart.
pub fn expand(
    mut state: pb::ChannelState,
    max_payload: usize,
) -> Result<pb::ChannelState, RecordedRunError> {
    if let Some(run) = state.run.take() {
        if !state.messages.is_empty() {
            return Err(RecordedRunError::Both);
        }
        state.messages = run_messages(&run, max_payload)?.collect();
    }
    Ok(state)
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

    #[test]
    fn recorded_messages_go_as_runs_of_consecutive_indices_and_come_back_as_they_were() {
        let messages: Vec<(u64, Bytes)> = [(3, "a"), (4, "bc"), (5, ""), (9, "d"), (10, "ef")]
            .into_iter()
            .map(|(i, p)| (i, Bytes::from_static(p.as_bytes())))
            .collect();
        let runs: Vec<_> = recorded_runs(&messages).collect();
        assert_eq!(runs.len(), 2, "a gap starts a run");
        assert_eq!(
            (runs[0].first_index, &runs[0].lengths[..]),
            (3, &[1, 2, 0][..])
        );
        assert_eq!(runs[0].payloads, "abc");
        let back: Vec<(u64, Bytes)> = runs
            .iter()
            .flat_map(|r| run_messages(r, 8).unwrap())
            .map(|m| (m.index, m.payload))
            .collect();
        assert_eq!(back, messages);
        assert_eq!(recorded_runs(&[]).count(), 0);
        // A run is cut once it holds about RECORDED_RUN_BYTES (16 each of overhead here),
        // and never holds more messages than a run may.
        let empty: Vec<(u64, Bytes)> = (0..MAX_RUN_MESSAGES as u64 * 2)
            .map(|i| (i, Bytes::new()))
            .collect();
        let runs: Vec<_> = recorded_runs(&empty).collect();
        assert_eq!(runs.len(), 3);
        assert_eq!(runs[0].lengths.len(), RECORDED_RUN_BYTES / 16);
        assert!(runs.iter().all(|r| run_indices(r, 0).is_ok()));
        assert_eq!(runs[1].first_index, (RECORDED_RUN_BYTES / 16) as u64);
        // A large payload goes alone, uncopied, between the runs of small ones.
        let large = Bytes::from(vec![1u8; OWN_RUN]);
        let mixed = [
            (0, Bytes::from_static(b"a")),
            (1, large.clone()),
            (2, Bytes::from_static(b"b")),
        ];
        let runs: Vec<_> = recorded_runs(&mixed).collect();
        assert_eq!(runs.len(), 3);
        assert_eq!(runs[1].payloads.as_ptr(), large.as_ptr(), "not copied");
        assert_eq!((runs[2].first_index, &runs[2].lengths[..]), (2, &[1][..]));
    }

    #[test]
    fn a_bad_recorded_run_is_refused_before_any_message() {
        let run = |first, payloads: &'static str, lengths: Vec<u32>| pb::RecordedRun {
            first_index: first,
            payloads: Bytes::from_static(payloads.as_bytes()),
            lengths,
        };
        assert!(matches!(
            run_messages(&run(u64::MAX, "ab", vec![1, 1]), 8).err(),
            Some(RecordedRunError::Overflow { .. })
        ));
        assert!(run_messages(&run(u64::MAX - 1, "a", vec![1]), 8).is_ok());
        assert_eq!(
            run_indices(&run(0, "", vec![0; MAX_RUN_MESSAGES + 1]), 8).err(),
            Some(RecordedRunError::TooMany {
                count: MAX_RUN_MESSAGES + 1
            })
        );
        assert!(matches!(
            run_messages(&run(0, "ab", vec![1]), 8).err(),
            Some(RecordedRunError::Run(RunError::Mismatch { .. }))
        ));
        let both = pb::ChannelState {
            channel: None,
            messages: vec![pb::RecordedMessage::default()],
            run: Some(run(0, "a", vec![1])),
        };
        assert_eq!(expand(both, 8).err(), Some(RecordedRunError::Both));
        let one = pb::ChannelState {
            run: Some(run(7, "xy", vec![2])),
            ..Default::default()
        };
        let one = expand(one, 8).unwrap();
        assert_eq!(
            (one.messages.len(), one.messages[0].index, one.run),
            (1, 7, None)
        );
    }
}
