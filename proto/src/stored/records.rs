//! The JSON records kept in the metadata store; `etcdctl get --prefix /cairn/` shows them.
//! Their byte form is a contract with every store written before: the round-trip tests
//! (`integration-tests/tests/it/roundtrip.rs`) and the fuzzers guard it.

use serde::{Deserialize, Serialize};

pub use cairn_core::record::{
    EventKind, EventRecord, FailureRecord, MemberRecord, RemovedRecord, RestoreRecord,
    RestoreStatus, RosterRecord, SnapshotRecord, SnapshotStatus, VerdictRecord,
};

/// The most bytes of recorded messages `GetSnapshot` returns inline for one part; a part
/// stored before its recorded bytes were counted is taken to hold this much.
pub const MAX_INLINE_DATA: u64 = 64 << 20;

/// The messages a node recorded of one channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedChannelRecord {
    /// The channel, as `from->to`.
    pub channel: String,
    /// Messages recorded.
    pub messages: u64,
    /// Their payload bytes.
    pub bytes: u64,
}

pub use super::manifest::{ChunkList, ManifestRef};

/// One counter pair of a channel's cut.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CutRecord {
    /// The channel, as `from->to`.
    pub channel: String,
    /// Incoming: delivered before recording. Outgoing: sent before recording.
    pub count: u64,
    /// Data messages before the marker.
    pub marker_at: u64,
}

/// One node's stored part of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartRecord {
    /// The node.
    pub node: String,
    /// Its daemon's incarnation.
    pub incarnation: u64,
    /// Incoming channels: `count` is delivered.
    pub incoming: Vec<CutRecord>,
    /// Outgoing channels: `count` is sent.
    pub outgoing: Vec<CutRecord>,
    /// The part's manifest in the blob store: its chunk lists (state and recorded
    /// messages). `None` in parts stored before manifests, which hold the lists inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<ManifestRef>,
    /// Size of the application's local state in bytes.
    #[serde(default)]
    pub local_state_bytes: u64,
    /// Before manifests: the local state's chunks inline (empty since).
    #[serde(default, skip_serializing_if = "is_empty")]
    pub local_state: ChunkList,
    /// Before manifests: the recorded channel states' chunks inline (empty since).
    #[serde(default, skip_serializing_if = "is_empty")]
    pub channel_states: ChunkList,
    /// Messages recorded by this node.
    pub recorded_messages: u64,
    /// Bytes this part stored anew.
    pub bytes_new: u64,
    /// Bytes this part shared with what was stored before.
    pub bytes_reused: u64,
    /// The epoch the node recorded it in.
    #[serde(default)]
    pub epoch: u64,
    /// The last restore the node's application had applied ("" if none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub applied_restore_id: String,
    /// Per channel it recorded messages of: how many, how many bytes (absent in parts
    /// stored before this was counted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recorded_channels: Vec<RecordedChannelRecord>,
}

impl PartRecord {
    /// Bytes of the messages this part recorded, as counted per channel (parts stored
    /// before that was counted: the inline list's size, or, with messages but no size
    /// known, the most a part returns inline; counted empty payloads are 0), for the
    /// response budget.
    pub fn recorded_bytes(&self) -> u64 {
        let counted = self
            .recorded_channels
            .iter()
            .fold(0u64, |sum, c| sum.saturating_add(c.bytes));
        let known = counted.max(self.channel_states.size);
        if known == 0 && self.recorded_channels.is_empty() && self.recorded_messages > 0 {
            return MAX_INLINE_DATA;
        }
        known
    }

    /// What reading this part inline holds in memory at most, for the response budget: its
    /// bytes twice (the chunks read and what is decoded from them) and each recorded
    /// message's own [`DECODED_MESSAGE_MEMORY`] (a run of empty payloads is a few bytes
    /// stored, but as many messages decoded).
    pub fn inline_memory(&self) -> u64 {
        self.local_state_bytes
            .saturating_add(self.recorded_bytes())
            .saturating_mul(2)
            .saturating_add(
                self.recorded_messages
                    .saturating_mul(DECODED_MESSAGE_MEMORY),
            )
    }
}

/// Memory one recorded message takes decoded, beyond its payload: its index and `Bytes`
/// (40 bytes), twice over for the slack of a `Vec` grown by doubling.
pub const DECODED_MESSAGE_MEMORY: u64 = 80;

/// The snapshot policy (`/cairn/<cluster>/policy`), so that it outlives a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRecord {
    /// Milliseconds between scheduled snapshots; 0: none.
    pub interval_ms: u64,
    /// CHANDY_LAMPORT, UNALIGNED or ALIGNED.
    pub mode: String,
    /// Their timeout.
    pub timeout_ms: u64,
    /// ALIGNED only; 0: none.
    pub alignment_timeout_ms: u64,
    /// Least milliseconds between one's end and the next's start.
    pub min_pause_ms: u64,
    /// Most random milliseconds added to an interval.
    pub jitter_ms: u64,
    /// Most scheduled snapshots in flight.
    pub max_concurrent: u32,
    /// Consecutive failures tolerated.
    pub tolerated_failures: u32,
    /// 0: no freshness threshold.
    pub freshness_threshold_ms: u64,
    /// "flags" or "api".
    pub source: String,
    /// Milliseconds since the Unix epoch of the last change.
    pub updated_at_ms: u64,
}

fn is_empty(list: &ChunkList) -> bool {
    list.size == 0 && list.chunks.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(state: u64, messages: u64, bytes: u64) -> PartRecord {
        PartRecord {
            node: "n1".into(),
            incarnation: 1,
            incoming: Vec::new(),
            outgoing: Vec::new(),
            manifest: None,
            local_state_bytes: state,
            local_state: ChunkList::default(),
            channel_states: ChunkList::default(),
            recorded_messages: messages,
            bytes_new: 0,
            bytes_reused: 0,
            epoch: 0,
            applied_restore_id: String::new(),
            recorded_channels: vec![RecordedChannelRecord {
                channel: "n2->n1".into(),
                messages,
                bytes,
            }],
        }
    }

    #[test]
    fn inline_memory_counts_the_bytes_twice_and_every_message_decoded() {
        assert_eq!(part(1000, 10, 500).inline_memory(), 3000 + 10 * 80);
        // A run of empty payloads: no bytes, yet each message is held once decoded.
        assert_eq!(part(0, 1 << 23, 0).inline_memory(), (1 << 23) * 80);
        assert_eq!(part(u64::MAX, u64::MAX, 1).inline_memory(), u64::MAX);
    }
}
