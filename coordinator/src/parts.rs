//! A node's part of a snapshot, end to end: the upload stream chunked into the blob store
//! and summed up as a part record ([`store_upload`]); a part read back for a client, with
//! or without its bytes ([`read_part`]); its recorded messages ([`channel_states`]); and a
//! whole snapshot's parts checked chunk by chunk ([`verify`]). The gRPC services only
//! translate requests to these.

use std::collections::BTreeMap;

use bytes::Bytes;
use cairn_core::{ChannelId, IncomingCut, LocalReport, NodeId, NodePart, OutgoingCut, SnapshotId};
use cairn_proto::convert::{ConvertError, channel_from_pb};
use cairn_proto::v1 as pb;
use prost::Message;
use tonic::Streaming;

use crate::blob::BlobStore;
use crate::error::Error;
use crate::store::records::CutRecord;
use crate::store::{ChunkList, PartRecord, SnapshotRecord};

/// A stored part: its record (already in the blob store's terms) and what the tracker needs.
pub(crate) struct StoredPart {
    /// The record to store under `parts/<id>/<node>`.
    pub record: PartRecord,
    /// The counters and the indices of the recorded messages, for the verifier.
    pub part: NodePart,
}

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

fn not_its_own(node: &NodeId, channel: &ChannelId, what: &str) -> Error {
    Error::InvalidArgument(format!(
        "node {node}'s part holds {what} channel {channel}, which is not one of {node}'s"
    ))
}

/// Reads an upload after its header: pieces of the state, then the recorded messages, then
/// the cut. Bytes go to the blob store as they come. A blob store that fails is
/// [`Error::Storage`] naming the node (the snapshot fails); bad input is INVALID_ARGUMENT.
pub(crate) async fn store_upload(
    blobs: &BlobStore,
    header: &pb::UploadHeader,
    chunks: &mut Streaming<pb::UploadChunk>,
) -> Result<StoredPart, Error> {
    use pb::upload_chunk::Kind;
    let id = header.snapshot_id;
    let node = NodeId::new(header.node_id.clone());
    let invalid = |e: ConvertError| Error::InvalidArgument(e.to_string());
    let storage =
        |e: std::io::Error| Error::Storage(format!("node {node}: cannot store its part: {e}"));
    let mut local_state = blobs.writer();
    let mut channel_states = blobs.writer();
    let mut recorded: BTreeMap<ChannelId, Vec<u64>> = BTreeMap::new();
    let mut messages = 0u64;
    let mut cut = None;
    while let Some(chunk) = chunks.message().await.map_err(Error::Stream)? {
        if cut.is_some() {
            return Err(Error::InvalidArgument("a message after the cut".into()));
        }
        match chunk.kind {
            Some(Kind::Cut(c)) => cut = Some(c),
            Some(Kind::LocalState(bytes)) => local_state.write(&bytes).await.map_err(storage)?,
            Some(Kind::ChannelState(state)) => {
                let channel = channel_from_pb(state.channel.as_ref()).map_err(invalid)?;
                touches(&node, &channel, "recorded messages of")?;
                recorded
                    .entry(channel)
                    .or_default()
                    .extend(state.messages.iter().map(|m| m.index));
                messages += state.messages.len() as u64;
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
    let local_state = local_state.finish().await.map_err(storage)?;
    let channel_states = channel_states.finish().await.map_err(storage)?;
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
        local_state: local_state.list,
        channel_states: channel_states.list,
        recorded_messages: messages,
        bytes_new: local_state.new + channel_states.new,
        bytes_reused: local_state.reused + channel_states.reused,
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

fn cut_record(channel: &ChannelId, count: u64, marker_at: u64) -> CutRecord {
    CutRecord {
        channel: channel.to_string(),
        count,
        marker_at,
    }
}

/// The channel of a stored cut (`from->to`).
fn cut_channel(cut: &CutRecord) -> ChannelId {
    let (from, to) = cut.channel.split_once("->").unwrap_or_default();
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
        local_state_bytes: part.local_state.size,
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
        ..Default::default()
    };
    if include_data {
        let what = format!("node {}'s state", part.node);
        out.local_state = Bytes::from(read(blobs, &part.local_state, &what).await?);
        out.channel_states = channel_states(blobs, part).await?;
    }
    Ok(out)
}

/// A part's recorded messages, channel by channel, every chunk checked.
pub(crate) async fn channel_states(
    blobs: &BlobStore,
    part: &PartRecord,
) -> Result<Vec<pb::ChannelState>, Error> {
    let what = format!("node {}'s channel states", part.node);
    let bytes = read(blobs, &part.channel_states, &what).await?;
    let mut buf = &bytes[..];
    let mut states = Vec::new();
    while !buf.is_empty() {
        let state = pb::ChannelState::decode_length_delimited(&mut buf)
            .map_err(|e| Error::DataLoss(format!("{what} do not decode: {e}")))?;
        states.push(state);
    }
    Ok(states)
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
    let (mut chunks, mut bytes) = (0u64, 0u64);
    for part in parts {
        for (list, what) in [
            (&part.local_state, "state"),
            (&part.channel_states, "channel states"),
        ] {
            let checked = blobs.verify(list).await.map_err(|e| {
                Error::reading(&format!("snapshot {id}: node {}'s {what}", part.node), &e)
            })?;
            chunks += list.chunks.len() as u64;
            bytes += checked;
        }
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
