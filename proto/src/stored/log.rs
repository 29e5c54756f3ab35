//! The embedded metadata store's files (`cairn-coordinator --metadata-dir`): a base file,
//! one JSON object of every key, and an append-only log of changes, one JSON line each.
//! Reading them back is here, where the fuzzers reach it; the store itself (locking,
//! syncing, compaction) is the coordinator's `store::file`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One change, as a line of the log.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Change {
    /// `key` holds `value`.
    Put {
        /// The key.
        key: String,
        /// Its new value.
        value: String,
    },
    /// `key` is gone.
    Delete {
        /// The key.
        key: String,
    },
    /// Every key starting with `prefix` is gone.
    DeletePrefix {
        /// The prefix.
        prefix: String,
    },
}

/// What a replay gives: the contents, and the unreadable tail dropped (its line, why).
pub type Replayed = (BTreeMap<String, String>, Option<(usize, String)>);

/// The store's contents from its base file (`None`: none yet; an unreadable one is an
/// error) and its log, each line a change applied in order. An unreadable last line is a
/// write cut short by a crash and is dropped: its number (from 1) and why are returned. An
/// unreadable line with changes after it is no crash's doing (a write is acknowledged only
/// once synced, and the log is compacted at every start): the log is damaged, and dropping
/// the acknowledged changes after it would lose them silently, so the replay is refused.
pub fn replay(base: Option<&[u8]>, log: &[u8]) -> Result<Replayed, String> {
    let mut data: BTreeMap<String, String> = match base {
        Some(bytes) => serde_json::from_slice(bytes).map_err(|e| e.to_string())?,
        None => BTreeMap::new(),
    };
    for (number, line) in log.split(|b| *b == b'\n').enumerate() {
        if line.is_empty() {
            continue;
        }
        match serde_json::from_slice::<Change>(line) {
            Ok(change) => change.apply(&mut data),
            Err(e) => {
                let after = log
                    .split(|b| *b == b'\n')
                    .skip(number + 1)
                    .filter(|l| !l.is_empty())
                    .count();
                if after > 0 {
                    return Err(format!(
                        "line {} of its log is unreadable ({e}) and {after} changes follow it: \
                         the log is damaged, not cut short by a crash; refusing to drop them \
                         (repair the line, or move the log aside to start from the base alone)",
                        number + 1
                    ));
                }
                return Ok((data, Some((number + 1, e.to_string()))));
            }
        }
    }
    Ok((data, None))
}

impl Change {
    /// Applies the change to `data`.
    pub fn apply(self, data: &mut BTreeMap<String, String>) {
        match self {
            Self::Put { key, value } => {
                data.insert(key, value);
            }
            Self::Delete { key } => {
                data.remove(&key);
            }
            Self::DeletePrefix { prefix } => data.retain(|k, _| !k.starts_with(&prefix)),
        }
    }
}
