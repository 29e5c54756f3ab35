//! A node's part of a snapshot, end to end: the upload stream — the state's chunks as the
//! daemon cut them, sent only when new, and the recorded messages, chunked here — stored in
//! the blob store with the part's manifest and summed up as a part record
//! ([`store_upload`], `upload.rs`); a part's manifest read back ([`manifest_of`]); a part read for a
//! client, with or without its bytes ([`read_part`]); its recorded messages
//! ([`channel_states`]); and a whole snapshot's parts checked chunk by chunk ([`verify`]).
//! The streaming pipelines are [`read`] (`ReadSnapshotData`) and [`restore`]
//! (`FetchRestorePart`). The gRPC service only checks and translates requests to these.

pub(crate) mod read;
pub(crate) mod restore;
mod upload;
mod uploading;

pub(crate) use upload::store_upload;
pub(crate) use uploading::{UploadCount, Uploading};

use bytes::Bytes;
use cairn_core::{ChannelId, IncomingCut, NodeId, OutgoingCut, SnapshotId};
use cairn_proto::v1 as pb;
use prost::Message;

use cairn_blob::{BlobStore, ChunkList, Manifest};

use crate::error::Error;
use crate::store::records::CutRecord;
use crate::store::{PartRecord, SnapshotRecord};

/// The most data `GetSnapshot` returns inline per part; larger ones are read with the
/// streaming `ReadSnapshotData`.
pub(crate) use cairn_proto::stored::records::MAX_INLINE_DATA;

/// `Ok` when `channel` starts or ends at `node`: a node records messages only of its own
/// channels (in flight to it, or, unaligned, queued at it). Otherwise INVALID_ARGUMENT:
/// a node may not plant messages on other nodes' channels, which a restore would replay as
/// theirs.
pub(crate) fn touches(node: &NodeId, channel: &ChannelId, what: &str) -> Result<(), Error> {
    if channel.from == *node || channel.to == *node {
        Ok(())
    } else {
        Err(not_its_own(node, channel, what))
    }
}

pub(super) fn not_its_own(node: &NodeId, channel: &ChannelId, what: &str) -> Error {
    Error::InvalidArgument(format!(
        "node {node}'s part holds {what} channel {channel}, which is not one of {node}'s"
    ))
}

/// The channel of a stored cut.
fn cut_channel(cut: &CutRecord) -> ChannelId {
    stored_channel(&cut.channel)
}

/// A channel as records store it (`from->to`).
fn stored_channel(channel: &str) -> ChannelId {
    let (from, to) = channel.split_once("->").unwrap_or_default();
    ChannelId::new(from, to)
}

/// A part for a client: its cut (with the recorded ranges, as core computes them) and,
/// if `include_data`, its state and recorded messages, every chunk checked.
pub(crate) async fn read_part(
    blobs: &BlobStore,
    part: &PartRecord,
    include_data: bool,
) -> Result<pb::NodePart, Error> {
    let mut out = pb::NodePart {
        node_id: part.node.clone(),
        recorded: true,
        reported: true,
        local_state_bytes: part.local_state_bytes.max(part.local_state.size),
        incoming: part
            .incoming
            .iter()
            .map(|c| {
                let cut = IncomingCut {
                    delivered: c.count,
                    marker_at: c.marker_at,
                };
                pb::IncomingCut::from((&cut_channel(c), &cut))
            })
            .collect(),
        outgoing: part
            .outgoing
            .iter()
            .map(|c| {
                let cut = OutgoingCut {
                    sent: c.count,
                    marker_at: c.marker_at,
                };
                pb::OutgoingCut::from((&cut_channel(c), &cut))
            })
            .collect(),
        recorded_channels: recorded_channels_pb(part),
        ..Default::default()
    };
    if include_data {
        let manifest = manifest_of(blobs, part).await?;
        let size = manifest
            .local_state
            .size
            .saturating_add(manifest.channel_states.size);
        if size > MAX_INLINE_DATA {
            return Err(Error::Stream(tonic::Status::resource_exhausted(format!(
                "node {}'s part holds {size} bytes, above the {MAX_INLINE_DATA} GetSnapshot \
                 returns inline: read it with ReadSnapshotData (cairnctl snapshot export)",
                part.node
            ))));
        }
        let what = format!("node {}'s state", part.node);
        out.local_state = Bytes::from(read(blobs, &manifest.local_state, &what).await?);
        out.channel_states = decode_channel_states(blobs, part, &manifest).await?;
    }
    Ok(out)
}

/// What a part recorded in flight, per channel, for the wire.
fn recorded_channels_pb(part: &PartRecord) -> Vec<pb::RecordedChannel> {
    part.recorded_channels
        .iter()
        .map(|r| pb::RecordedChannel {
            channel: Some(pb::ChannelRef::from(&stored_channel(&r.channel))),
            messages: r.messages,
            bytes: r.bytes,
        })
        .collect()
}

/// Two snapshots' parts compared node by node (`DiffSnapshots`): the local states' chunk
/// lists (content-addressed, so a chunk name of `to` missing from `from` is new bytes),
/// read from the manifests, and what each part recorded in flight.
pub(crate) async fn diff(
    blobs: &BlobStore,
    from: &[PartRecord],
    to: &[PartRecord],
) -> Result<Vec<pb::NodeDiff>, Error> {
    let nodes: std::collections::BTreeSet<&str> =
        from.iter().chain(to).map(|p| p.node.as_str()).collect();
    let mut out = Vec::with_capacity(nodes.len());
    for node in nodes {
        let a = from.iter().find(|p| p.node == node);
        let b = to.iter().find(|p| p.node == node);
        let state_a = match a {
            Some(part) => manifest_of(blobs, part).await?.local_state,
            None => ChunkList::default(),
        };
        let state_b = match b {
            Some(part) => manifest_of(blobs, part).await?.local_state,
            None => ChunkList::default(),
        };
        let names_a: std::collections::HashSet<&str> =
            state_a.chunks.iter().map(String::as_str).collect();
        let names_b: std::collections::HashSet<&str> =
            state_b.chunks.iter().map(String::as_str).collect();
        let (mut chunks_new, mut bytes_new) = (0u64, 0u64);
        for name in names_b.iter().filter(|n| !names_a.contains(*n)) {
            let size = blobs
                .chunk_size(name)
                .await
                .map_err(|e| Error::reading(&format!("node {node}'s state"), &e))?
                .ok_or_else(|| {
                    Error::DataLoss(format!("node {node}'s state: chunk {name} is missing"))
                })?;
            chunks_new += 1;
            bytes_new = bytes_new.saturating_add(size);
        }
        let chunks_dropped = names_a.iter().filter(|n| !names_b.contains(*n)).count() as u64;
        out.push(pb::NodeDiff {
            node_id: node.to_owned(),
            in_from: a.is_some(),
            in_to: b.is_some(),
            state_changed: state_a.chunks != state_b.chunks,
            state_bytes_from: state_a.size,
            state_bytes_to: state_b.size,
            chunks_from: state_a.chunks.len() as u64,
            chunks_to: state_b.chunks.len() as u64,
            chunks_new,
            bytes_new,
            chunks_dropped,
            recorded_from: a.map(recorded_channels_pb).unwrap_or_default(),
            recorded_to: b.map(recorded_channels_pb).unwrap_or_default(),
        });
    }
    Ok(out)
}

/// A part's chunk lists: its manifest read from the blob store (checked against its name),
/// or, for a part stored before manifests, the lists it holds inline.
pub(crate) async fn manifest_of(blobs: &BlobStore, part: &PartRecord) -> Result<Manifest, Error> {
    match &part.manifest {
        Some(reference) => blobs
            .read_manifest(reference)
            .await
            .map_err(|e| Error::reading(&format!("node {}'s manifest", part.node), &e)),
        None => Ok(Manifest {
            local_state: part.local_state.clone(),
            channel_states: part.channel_states.clone(),
        }),
    }
}

/// Each of a part's stored channel states as stored (a run still a run), chunk by chunk,
/// every chunk checked as it is read: only one chunk and the states decoded from it are
/// held at a time. `keep` is given each state and may stop the read with an error.
pub(crate) async fn each_channel_state(
    blobs: &BlobStore,
    part: &PartRecord,
    manifest: &Manifest,
    mut keep: impl FnMut(pb::ChannelState) -> Result<(), Error>,
) -> Result<(), Error> {
    let what = format!("node {}'s channel states", part.node);
    let loss = |e: String| Error::DataLoss(format!("{what} do not decode: {e}"));
    let mut decoder = ChannelStateDecoder::default();
    let mut read = 0u64;
    for hash in &manifest.channel_states.chunks {
        let chunk = blobs
            .read_chunk(hash)
            .await
            .map_err(|e| Error::reading(&what, &e))?;
        read = read.saturating_add(chunk.len() as u64);
        for state in decoder.push(&chunk).map_err(loss)? {
            keep(state)?;
        }
    }
    decoder.finish().map_err(loss)?;
    if read != manifest.channel_states.size {
        return Err(Error::DataLoss(format!(
            "{what}: the chunks hold {read} bytes where their list says {}",
            manifest.channel_states.size
        )));
    }
    Ok(())
}

/// A part's recorded messages, channel by channel (runs as messages), every chunk checked.
async fn decode_channel_states(
    blobs: &BlobStore,
    part: &PartRecord,
    manifest: &Manifest,
) -> Result<Vec<pb::ChannelState>, Error> {
    let what = format!("node {}'s channel states", part.node);
    let mut states = Vec::new();
    each_channel_state(blobs, part, manifest, |state| {
        let state =
            expand(state).map_err(|e| Error::DataLoss(format!("{what} do not decode: {e}")))?;
        states.push(state);
        Ok(())
    })
    .await?;
    Ok(states)
}

/// Sends the chunks of `list` one by one, each read and checked as it goes, wrapped by
/// `wrap`; then checks that they added up to the list's size. A chunk that cannot be read
/// is sent as the stream's error (DATA_LOSS naming it and `what`). Returns the bytes sent,
/// or `None` when the stream ended (the receiver is gone, or an error was sent).
pub(crate) async fn send_chunks<T>(
    blobs: &BlobStore,
    list: &ChunkList,
    what: &str,
    tx: &tokio::sync::mpsc::Sender<Result<T, tonic::Status>>,
    wrap: impl Fn(Bytes) -> T,
) -> Option<u64> {
    let mut sent = 0u64;
    for hash in &list.chunks {
        let item = match blobs.read_chunk(hash).await {
            Ok(bytes) => {
                sent = sent.saturating_add(bytes.len() as u64);
                Ok(wrap(bytes))
            }
            Err(e) => Err(tonic::Status::from(Error::reading(what, &e))),
        };
        let failed = item.is_err();
        if tx.send(item).await.is_err() || failed {
            return None;
        }
    }
    if sent != list.size {
        let e = Error::DataLoss(format!(
            "{what}: the chunks hold {sent} bytes where their list says {}",
            list.size
        ));
        let _ = tx.send(Err(e.into())).await;
        return None;
    }
    Some(sent)
}

/// The largest recorded-messages piece an upload carries: ~1 MiB of messages plus one of the
/// largest payload a daemon accepts.
const MAX_CHANNEL_STATE: usize =
    cairn_rpc::limits::data_message(cairn_rpc::limits::MAX_PAYLOAD_CEILING);

/// A stored channel state as readers are given it: its run, if any, as messages (at most
/// [`cairn_proto::runs::MAX_RUN_MESSAGES`]).
pub(crate) fn expand(state: pb::ChannelState) -> Result<pb::ChannelState, String> {
    cairn_proto::runs::expand(state, cairn_rpc::limits::MAX_PAYLOAD_CEILING)
        .map_err(|e| e.to_string())
}

/// Decodes the recorded messages of a part as their chunks arrive: each chunk is appended,
/// and every `ChannelState` whose bytes are all here is taken out as stored — a run still a
/// run, for the reader to [`expand`] one at a time (a chunk of runs of empty payloads is
/// millions of messages).
#[derive(Default)]
pub(crate) struct ChannelStateDecoder {
    buffer: bytes::BytesMut,
}

impl ChannelStateDecoder {
    /// Adds a chunk; returns the messages now complete.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Result<Vec<pb::ChannelState>, String> {
        self.buffer.extend_from_slice(chunk);
        let mut out = Vec::new();
        loop {
            let mut peek = &self.buffer[..];
            let Ok(len) = prost::encoding::decode_length_delimiter(&mut peek) else {
                // A delimiter needs at most 10 bytes: fewer is an incomplete one.
                if self.buffer.len() >= 10 {
                    return Err("a length delimiter does not decode".into());
                }
                return Ok(out);
            };
            let prefix = self.buffer.len() - peek.len();
            if len > MAX_CHANNEL_STATE {
                return Err(format!(
                    "a recorded-messages piece of {len} bytes, above the {MAX_CHANNEL_STATE} an \
                     upload may hold"
                ));
            }
            if peek.len() < len {
                return Ok(out);
            }
            let message = self.buffer.split_to(prefix + len).freeze();
            let state =
                pb::ChannelState::decode(message.slice(prefix..)).map_err(|e| e.to_string())?;
            out.push(state);
        }
    }

    /// Checks that nothing is left half decoded.
    pub(crate) fn finish(self) -> Result<(), String> {
        if self.buffer.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} bytes after the last message",
                self.buffer.len()
            ))
        }
    }
}

/// Reads `list` (`what` names it in errors), every chunk checked against its name.
async fn read(blobs: &BlobStore, list: &ChunkList, what: &str) -> Result<Vec<u8>, Error> {
    blobs.read(list).await.map_err(|e| Error::reading(what, &e))
}

/// Checks every chunk of every part of a snapshot against its name, and that every node of
/// the snapshot has a part; returns the chunks and bytes checked. Errors name the node.
pub(crate) async fn verify(
    blobs: &BlobStore,
    id: SnapshotId,
    record: &SnapshotRecord,
    parts: &[PartRecord],
) -> Result<(u64, u64), Error> {
    for node in &record.nodes {
        if !parts.iter().any(|p| &p.node == node) {
            return Err(Error::DataLoss(format!(
                "snapshot {id}: node {node}'s part is missing"
            )));
        }
    }
    // Every part is read, past a bad one: each bad chunk found is forgotten by the store's
    // index, so the next snapshot that has those bytes stores them again. The error names
    // the first.
    let (mut chunks, mut bytes) = (0u64, 0u64);
    let mut first: Option<Error> = None;
    for part in parts {
        let manifest = match manifest_of(blobs, part).await {
            Ok(manifest) => manifest,
            Err(e) => {
                first.get_or_insert(e);
                continue;
            }
        };
        for (list, what) in [
            (&manifest.local_state, "state"),
            (&manifest.channel_states, "channel states"),
        ] {
            match blobs.verify(list).await {
                Ok(checked) => bytes += checked,
                Err(e) => {
                    let what = format!("snapshot {id}: node {}'s {what}", part.node);
                    first.get_or_insert(Error::reading(&what, &e));
                }
            }
            chunks += list.chunks.len() as u64;
        }
    }
    if let Some(e) = first {
        return Err(e);
    }
    Ok((chunks, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_holds_only_its_nodes_channels() {
        let n2 = NodeId::new("n2");
        assert!(touches(&n2, &ChannelId::new("n1", "n2"), "x").is_ok());
        assert!(touches(&n2, &ChannelId::new("n2", "n3"), "x").is_ok());
        let e = touches(&n2, &ChannelId::new("n1", "n3"), "recorded messages of").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert!(
            e.to_string()
                .contains("node n2's part holds recorded messages of channel n1->n3"),
            "{e}"
        );
    }
}
