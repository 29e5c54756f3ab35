//! A part's manifest — its chunk lists, stored in the blob store as an object of its own —
//! and the reference a part record keeps to it. What a chunk list names is checked here,
//! when it is read: a chunk name is a path in the store.

use serde::{Deserialize, Serialize};

/// The largest manifest read: about 1M chunks, 32 GiB of state at the average chunk size.
pub const MAX_MANIFEST: u64 = 64 << 20;

/// Bytes stored as content-addressed chunks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkList {
    /// Total size.
    pub size: u64,
    /// The chunks' sha256, in order.
    pub chunks: Vec<String>,
}

/// A part's chunk lists, stored as an object of its own (it can outgrow any metadata
/// value: 1 GiB of state is ~2 MiB of names).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The application's local state.
    pub local_state: ChunkList,
    /// The recorded channel states, as length-delimited `cairn.v1.ChannelState` messages.
    pub channel_states: ChunkList,
}

impl Manifest {
    /// A manifest from its stored bytes: JSON whose every chunk name is 64 lowercase hex
    /// digits (a name is a path in the store); why not, otherwise.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let manifest: Manifest = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        for name in manifest
            .local_state
            .chunks
            .iter()
            .chain(&manifest.channel_states.chunks)
        {
            if !valid_name(name) {
                return Err(format!("bad chunk name `{}`", name.escape_debug()));
            }
        }
        Ok(manifest)
    }
}

/// Where a manifest is: the sha256 of its bytes, and their size.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestRef {
    /// The sha256 of the manifest's bytes.
    pub sha256: String,
    /// Their size.
    pub size: u64,
}

/// Whether `name` is a chunk name: 64 lowercase hex digits.
pub fn valid_name(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}
