//! Entry points for fuzzing every decoder of bytes from outside (issue 20): what arrives on
//! the wire, the metadata records and the embedded store's files read back, a manifest from
//! the blob store, topology and tokens files, policy changes. Each takes arbitrary bytes,
//! decodes them as the daemons and the coordinator would, and runs every check and
//! conversion that follows the decoding. None may panic, whatever the
//! bytes; `fuzz/` (cargo-fuzz, outside the workspace) drives them, and
//! `integration-tests/tests/it/fuzz_replay.rs` replays their corpora and past crashes on the
//! stable toolchain.

use prost::Message;

use crate::runs;
use crate::stored::records::{
    MemberRecord, PartRecord, PolicyRecord, RemovedRecord, RestoreRecord, RosterRecord,
    SnapshotRecord,
};
use crate::v1 as pb;

/// The largest payload the fuzzers let a run carry (a daemon's default limit).
const MAX_PAYLOAD: usize = 1 << 20;

/// A peer's first frame and its frames: `Handshake`, then `FrameBatch` with its data runs
/// taken apart and its markers' plans converted (`peer_server.rs`).
pub fn peer_frames(data: &[u8]) {
    let _ = pb::Handshake::decode(data);
    let Ok(batch) = pb::FrameBatch::decode(data) else {
        return;
    };
    let mut count = 0usize;
    for frame in &batch.frames {
        match &frame.kind {
            Some(pb::frame::Kind::Data(run)) => {
                if let Ok(payloads) = runs::split(&run.payloads, &run.lengths, MAX_PAYLOAD) {
                    count = count.saturating_add(payloads.count());
                }
            }
            Some(pb::frame::Kind::Marker(marker)) => {
                if let Some(plan) = &marker.plan {
                    let _ = cairn_core::Plan::try_from(plan);
                }
            }
            None => {}
        }
    }
    let _ = batch.first_seq.checked_add(count as u64);
}

/// What an application sends its daemon (`AppToNode`): its sends' runs taken apart, its
/// state's pieces, its channels named.
pub fn app_messages(data: &[u8]) {
    let Ok(message) = pb::AppToNode::decode(data) else {
        return;
    };
    if let Some(pb::app_to_node::Kind::Send(batch)) = message.kind {
        for run in &batch.runs {
            if let Ok(payloads) = runs::split(&run.payloads, &run.lengths, usize::MAX) {
                let _ = payloads.count();
            }
        }
    }
}

/// One message of a part's upload (`UploadChunk`): the cut's counters and the recorded
/// messages' channels converted as the coordinator converts them (`parts.rs`).
pub fn upload_chunk(data: &[u8]) {
    let Ok(chunk) = pb::UploadChunk::decode(data) else {
        return;
    };
    match chunk.kind {
        Some(pb::upload_chunk::Kind::Cut(cut)) => {
            for c in &cut.incoming {
                let _ = <(cairn_core::ChannelId, cairn_core::IncomingCut)>::try_from(c);
            }
            for c in &cut.outgoing {
                let _ = <(cairn_core::ChannelId, cairn_core::OutgoingCut)>::try_from(c);
            }
        }
        Some(pb::upload_chunk::Kind::ChannelState(state)) => {
            let _ = crate::convert::channel_from_pb(state.channel.as_ref());
        }
        Some(pb::upload_chunk::Kind::ChannelRun(state)) => {
            let _ = crate::convert::channel_from_pb(state.channel.as_ref());
            let _ = runs::expand(state, MAX_PAYLOAD);
        }
        Some(pb::upload_chunk::Kind::Header(_) | pb::upload_chunk::Kind::StateChunk(_)) | None => {}
    }
}

/// A metadata value read back, as each record type, and a snapshot record on to the wire.
pub fn records(data: &[u8]) {
    if let Ok(record) = serde_json::from_slice::<SnapshotRecord>(data) {
        let _ = crate::stored::convert::snapshot_pb(&record);
    }
    let _ = serde_json::from_slice::<PartRecord>(data);
    let _ = serde_json::from_slice::<MemberRecord>(data);
    let _ = serde_json::from_slice::<RemovedRecord>(data);
    let _ = serde_json::from_slice::<RosterRecord>(data);
    let _ = serde_json::from_slice::<RestoreRecord>(data);
    let _ = serde_json::from_slice::<PolicyRecord>(data);
}

/// The embedded store's files: the bytes before the first NUL are its base file, the rest
/// its log (no NUL: no base file, all log) — torn and garbage lines included.
pub fn store_log(data: &[u8]) {
    let (base, log) = match data.iter().position(|b| *b == 0) {
        Some(at) => (Some(&data[..at]), &data[at + 1..]),
        None => (None, data),
    };
    let _ = crate::stored::log::replay(base, log);
}

/// A `--topology` file.
pub fn topology(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = crate::files::parse_topology(text);
    }
}

/// An `--auth-tokens` file.
pub fn tokens(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = crate::files::tokens::Tokens::parse(text);
    }
}

/// A `SetPolicy` request applied to the default policy.
pub fn policy(data: &[u8]) {
    let Ok(request) = pb::SetPolicyRequest::decode(data) else {
        return;
    };
    let wire = request.policy.unwrap_or_default();
    let _ = crate::convert::apply_policy_update(&Default::default(), &wire, &request.update);
}

/// A part's manifest read back from the blob store.
pub fn manifest(data: &[u8]) {
    let _ = crate::stored::manifest::Manifest::parse(data);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Valid messages and every prefix of them go through without a panic.
    #[test]
    fn valid_messages_and_their_prefixes_decode_without_panic() {
        let batch = pb::FrameBatch {
            first_seq: u64::MAX,
            frames: vec![pb::Frame {
                kind: Some(pb::frame::Kind::Data(pb::DataRun {
                    payloads: bytes::Bytes::from_static(b"abc"),
                    lengths: vec![1, 2],
                })),
            }],
            epoch: 1,
        }
        .encode_to_vec();
        for end in 0..=batch.len() {
            peer_frames(&batch[..end]);
            app_messages(&batch[..end]);
            upload_chunk(&batch[..end]);
        }
    }
}
