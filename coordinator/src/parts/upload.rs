//! A part's upload, stored: the state's chunks as the daemon cut them (sent only when new),
//! the recorded messages (runs stored as they come, per byte), chunked here, the part's
//! manifest, and the part record summing it up for the tracker.

use std::collections::BTreeMap;

use cairn_core::{ChannelId, IncomingCut, LocalReport, NodeId, NodePart, OutgoingCut, SnapshotId};
use cairn_proto::convert::{ConvertError, channel_from_pb};
use cairn_proto::runs::{MAX_RUN_MESSAGES, run_indices};
use cairn_proto::v1 as pb;
use prost::Message;
use tonic::Streaming;

use cairn_blob::chunking::MIN_CHUNK;
use cairn_blob::{BlobStore, Chunk, ChunkList, MAX_CHUNK, Manifest, check_chunk};
use cairn_rpc::limits::MAX_PAYLOAD_CEILING;

use super::{not_its_own, touches};
use crate::error::Error;
use crate::store::records::CutRecord;
use crate::store::{PartRecord, RecordedChannelRecord};

/// Most chunks in one part's state: its manifest stays under the blob store's manifest
/// bound (about 28 GiB of state at the average chunk size).
const MAX_PART_CHUNKS: usize = 900_000;

/// Most messages one part records in flight, over all its channels: their indices are kept
/// for the verifier (8 bytes each: 64 MiB, up to twice that while their `Vec`s grow), and
/// a run of empty payloads costs its sender about one byte a message.
pub(crate) const MAX_PART_RECORDED: u64 = 1 << 23;

/// A stored part: its record (already in the blob store's terms) and what the tracker needs.
pub(crate) struct StoredPart {
    /// The record to store under `parts/<id>/<node>`.
    pub record: PartRecord,
    /// The counters and the indices of the recorded messages, for the verifier.
    pub part: NodePart,
}

/// Reads an upload after its header: the state's chunks, then the recorded messages, then
/// the cut. A chunk sent with its bytes is checked against its name and stored (create-only);
/// one sent without is checked to be in the store (the daemon found it there with
/// `HasChunks`, or wrote it there itself). The recorded messages are chunked into the store
/// as they come — a run as it came, its lengths and indices checked, never taken apart; the
/// part's manifest is stored last. A blob store that fails is [`Error::Storage`] naming the
/// node (the snapshot fails); bad input is INVALID_ARGUMENT.
pub(crate) async fn store_upload(
    blobs: &BlobStore,
    header: &pb::UploadHeader,
    chunks: &mut Streaming<pb::UploadChunk>,
    count: &super::UploadCount,
) -> Result<StoredPart, Error> {
    use pb::upload_chunk::Kind;
    let id = header.snapshot_id;
    let node = NodeId::new(header.node_id.clone());
    let invalid = |e: ConvertError| Error::InvalidArgument(e.to_string());
    let storage =
        |e: std::io::Error| Error::Storage(format!("node {node}: cannot store its part: {e}"));
    let mut local_state = ChunkList::default();
    let (mut state_new, mut state_reused) = (0u64, 0u64);
    // FastCDC cuts no chunk smaller than its minimum but the last: a node that sends more
    // after a short one is not cutting its state (it could name one chunk a million times).
    let mut short = false;
    let mut channel_states = blobs.writer();
    let mut recorded: BTreeMap<ChannelId, Vec<u64>> = BTreeMap::new();
    // Per channel: messages and payload bytes recorded, for the console and `snapshot diff`.
    let mut sizes: BTreeMap<ChannelId, (u64, u64)> = BTreeMap::new();
    let mut messages = 0u64;
    let mut cut = None;
    while let Some(chunk) = chunks.message().await.map_err(Error::Stream)? {
        if cut.is_some() {
            return Err(Error::InvalidArgument("a message after the cut".into()));
        }
        match chunk.kind {
            Some(Kind::Cut(c)) => cut = Some(c),
            Some(Kind::StateChunk(c)) => {
                let size = u64::from(c.size);
                let bad =
                    |why: String| Error::InvalidArgument(format!("node {node}'s state: {why}"));
                let hash: [u8; 32] = c.sha256.as_ref().try_into().map_err(|_| {
                    bad(format!(
                        "a chunk's sha256 has {} bytes, not 32",
                        c.sha256.len()
                    ))
                })?;
                let name = hex::encode(hash);
                if c.size == 0 || c.size > MAX_CHUNK {
                    return Err(bad(format!(
                        "chunk {name} has {size} bytes (1 to {MAX_CHUNK})"
                    )));
                }
                if local_state.chunks.len() >= MAX_PART_CHUNKS {
                    return Err(bad(format!("more than {MAX_PART_CHUNKS} chunks")));
                }
                if short {
                    return Err(bad(format!(
                        "a chunk of fewer than {MIN_CHUNK} bytes before chunk {name}: only the \
                         last chunk may be that short"
                    )));
                }
                short = c.size < MIN_CHUNK;
                let new = if c.data.is_empty() {
                    blobs
                        .confirm_chunk(&hash, size)
                        .await
                        .map_err(storage)?
                        .ok_or_else(|| {
                            bad(format!(
                                "chunk {name} ({size} bytes) was sent without its bytes, and the blob store does not hold it"
                            ))
                        })?
                } else {
                    check_chunk(&hash, size, &c.data).map_err(bad)?;
                    blobs
                        .put_chunk(&Chunk { hash, data: c.data })
                        .await
                        .map_err(storage)?
                };
                if new {
                    state_new += size;
                } else {
                    state_reused += size;
                }
                local_state.size = local_state.size.saturating_add(size);
                local_state.chunks.push(name);
                count.add(size);
            }
            Some(Kind::ChannelState(state)) => {
                if state.run.is_some() {
                    // Its indices would go unchecked while its bytes are stored.
                    return Err(Error::InvalidArgument(format!(
                        "node {node}'s recorded messages: a run comes as channel_run, not in \
                         channel_state"
                    )));
                }
                let payload = state
                    .messages
                    .iter()
                    .fold(0u64, |n, m| n.saturating_add(m.payload.len() as u64));
                let channel = channel_from_pb(state.channel.as_ref()).map_err(invalid)?;
                touches(&node, &channel, "recorded messages of")?;
                let n = state.messages.len() as u64;
                note(&node, &mut sizes, &mut messages, &channel, n, payload)?;
                let indices = state.messages.iter().map(|m| m.index);
                recorded.entry(channel).or_default().extend(indices);
                count.add(payload);
                if state.messages.len() <= MAX_RUN_MESSAGES {
                    channel_states
                        .write(&state.encode_length_delimited_to_vec())
                        .await
                        .map_err(storage)?;
                } else {
                    // Stored in pieces a reader decodes one at a time, as a run is.
                    for messages in state.messages.chunks(MAX_RUN_MESSAGES) {
                        let piece = pb::ChannelState {
                            channel: state.channel.clone(),
                            messages: messages.to_vec(),
                            run: None,
                        };
                        channel_states
                            .write(&piece.encode_length_delimited_to_vec())
                            .await
                            .map_err(storage)?;
                    }
                }
            }
            Some(Kind::ChannelRun(state)) => {
                // Per byte: the run's lengths are checked and its indices noted; its
                // payloads are stored as they came, never taken apart.
                let channel = channel_from_pb(state.channel.as_ref()).map_err(invalid)?;
                touches(&node, &channel, "recorded messages of")?;
                let bad = |why: String| {
                    Error::InvalidArgument(format!(
                        "node {node}'s recorded messages of channel {channel}: {why}"
                    ))
                };
                let run = match (&state.run, state.messages.is_empty()) {
                    (Some(run), true) => run,
                    _ => return Err(bad("a run upload holds one run and no messages".into())),
                };
                let indices =
                    run_indices(run, MAX_PAYLOAD_CEILING).map_err(|e| bad(e.to_string()))?;
                let payload = run.payloads.len() as u64;
                let n = indices.end - indices.start;
                note(&node, &mut sizes, &mut messages, &channel, n, payload)?;
                recorded.entry(channel).or_default().extend(indices);
                count.add(payload);
                channel_states
                    .write(&state.encode_length_delimited_to_vec())
                    .await
                    .map_err(storage)?;
            }
            Some(Kind::Header(_)) | None => {
                return Err(Error::InvalidArgument(
                    "a second header in one upload".into(),
                ));
            }
        }
    }
    let Some(cut) = cut else {
        return Err(Error::InvalidArgument(format!(
            "the upload of {node}'s part of snapshot {id} ended without its cut"
        )));
    };
    let incoming: BTreeMap<ChannelId, IncomingCut> = cut
        .incoming
        .iter()
        .map(<(ChannelId, IncomingCut)>::try_from)
        .collect::<Result<_, _>>()
        .map_err(invalid)?;
    let outgoing: BTreeMap<ChannelId, OutgoingCut> = cut
        .outgoing
        .iter()
        .map(<(ChannelId, OutgoingCut)>::try_from)
        .collect::<Result<_, _>>()
        .map_err(invalid)?;
    // A node's cut names its own channels only: into it (incoming), out of it (outgoing).
    for channel in incoming.keys() {
        if channel.to != node {
            return Err(not_its_own(&node, channel, "an incoming cut of"));
        }
    }
    for channel in outgoing.keys() {
        if channel.from != node {
            return Err(not_its_own(&node, channel, "an outgoing cut of"));
        }
    }
    // Messages are recorded on the channels of the part's cut only: stored for a channel it
    // does not report, they would be read back (and reserved for) as nothing.
    let reported = |c: &ChannelId| incoming.contains_key(c) || outgoing.contains_key(c);
    if let Some((channel, _)) = sizes.iter().find(|(c, (n, _))| *n > 0 && !reported(c)) {
        return Err(Error::InvalidArgument(format!(
            "node {node}'s part records messages of channel {channel}, which its cut does not \
             name"
        )));
    }
    sizes.retain(|c, _| reported(c));
    let channel_states = channel_states.finish().await.map_err(storage)?;
    let (bytes_new, bytes_reused) = (
        state_new + channel_states.new,
        state_reused + channel_states.reused,
    );
    let local_state_bytes = local_state.size;
    let manifest = blobs
        .put_manifest(&Manifest {
            local_state,
            channel_states: channel_states.list,
        })
        .await
        .map_err(storage)?;
    let record = PartRecord {
        node: node.to_string(),
        incarnation: header.incarnation,
        epoch: header.epoch,
        applied_restore_id: header.applied_restore_id.clone(),
        incoming: incoming
            .iter()
            .map(|(c, x)| cut_record(c, x.delivered, x.marker_at))
            .collect(),
        outgoing: outgoing
            .iter()
            .map(|(c, x)| cut_record(c, x.sent, x.marker_at))
            .collect(),
        manifest: Some(manifest),
        local_state_bytes,
        local_state: ChunkList::default(),
        channel_states: ChunkList::default(),
        recorded_messages: messages,
        bytes_new,
        bytes_reused,
        recorded_channels: sizes
            .iter()
            .map(|(channel, &(messages, bytes))| RecordedChannelRecord {
                channel: channel.to_string(),
                messages,
                bytes,
            })
            .collect(),
    };
    let part = NodePart {
        report: LocalReport {
            id: SnapshotId(id),
            node,
            incoming,
            outgoing,
        },
        recorded,
    };
    Ok(StoredPart { record, part })
}

/// Counts `n` recorded messages of `payload` bytes on `channel`; refused past
/// [`MAX_PART_RECORDED`] in the part.
fn note(
    node: &NodeId,
    sizes: &mut BTreeMap<ChannelId, (u64, u64)>,
    messages: &mut u64,
    channel: &ChannelId,
    n: u64,
    payload: u64,
) -> Result<(), Error> {
    *messages = messages.saturating_add(n);
    if *messages > MAX_PART_RECORDED {
        return Err(Error::InvalidArgument(format!(
            "node {node}'s part records more than {MAX_PART_RECORDED} messages in flight, the \
             most one part may hold"
        )));
    }
    let size = sizes.entry(channel.clone()).or_default();
    size.0 = size.0.saturating_add(n);
    size.1 = size.1.saturating_add(payload);
    Ok(())
}

fn cut_record(channel: &ChannelId, count: u64, marker_at: u64) -> CutRecord {
    CutRecord {
        channel: channel.to_string(),
        count,
        marker_at,
    }
}
