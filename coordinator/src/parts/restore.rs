//! `FetchRestorePart`'s pipeline: what a node restores — the recorded messages of its
//! channels (replayed in order: `cairn_core::restore::replay`), the counts of those it
//! sends again, then its state — streamed from the blob store, each chunk verified as read.

use cairn_blob::BlobStore;
use cairn_core::NodeId;
use cairn_proto::convert::channel_from_pb;
use cairn_rpc::v1 as pb;
use tokio::sync::mpsc;
use tonic::Status;

use crate::error::Error;
use crate::store::PartRecord;

/// The pieces node `node` restores from `parts` (its own part is `own`).
pub(crate) async fn pieces(
    blobs: BlobStore,
    parts: &[PartRecord],
    own: PartRecord,
    node: String,
) -> Result<mpsc::Receiver<Result<pb::RestorePiece, Status>>, Error> {
    let r_node = node;
    // Every part may hold recorded messages of this node's channels: the receiver's
    // (in flight to it) or, unaligned, the sender's (still queued there). Each part is read
    // chunk by chunk, and only this node's channels are expanded and kept: the payloads of
    // those it receives on, the indices alone of those it sends on (it replays only their
    // count).
    let mut recorded = Vec::new();
    for part in parts {
        let manifest = super::manifest_of(&blobs, part).await?;
        let what = format!("node {}'s channel states", part.node);
        let owner = NodeId::new(part.node.clone());
        super::each_channel_state(&blobs, part, &manifest, |state| {
            let channel = channel_from_pb(state.channel.as_ref())
                .map_err(|e| Error::DataLoss(format!("{what}: {e}")))?;
            // Only the messages a part's own node recorded on its own channels (older
            // parts were stored before uploads were checked for that).
            let own = super::touches(&owner, &channel, "").is_ok();
            let sends = channel.from.as_str() == r_node;
            if !own || !(sends || channel.to.as_str() == r_node) {
                return Ok(());
            }
            let state = super::expand(state)
                .map_err(|e| Error::DataLoss(format!("{what} do not decode: {e}")))?;
            for m in state.messages {
                let payload = if sends {
                    bytes::Bytes::new()
                } else {
                    m.payload
                };
                recorded.push((channel.clone(), m.index, payload));
            }
            Ok(())
        })
        .await?;
    }
    let plan = cairn_core::restore::replay(recorded);
    let manifest = super::manifest_of(&blobs, &own).await?;
    let (tx, rx) = mpsc::channel(4);
    let node = r_node;
    tokio::spawn(async move {
        use pb::restore_piece::Kind;
        let piece = |kind| Ok(pb::RestorePiece { kind: Some(kind) });
        let what = format!("node {node}'s state");
        // The recorded messages and the counts first: the daemon enters the epoch with
        // them and streams the state's pieces on to its application as they come.
        let mut counts = Vec::new();
        for (channel, messages) in plan {
            if channel.from.as_str() == node {
                counts.push(pb::ChannelCount {
                    channel: Some((&channel).into()),
                    messages: messages.len() as u64,
                });
                continue;
            }
            for (i, batch) in messages.chunks(256).enumerate() {
                let state = pb::ChannelState {
                    channel: Some((&channel).into()),
                    messages: batch
                        .iter()
                        .enumerate()
                        .map(|(j, payload)| pb::RecordedMessage {
                            index: (i * 256 + j) as u64,
                            payload: payload.clone(),
                        })
                        .collect(),
                    run: None,
                };
                if tx.send(piece(Kind::ChannelState(state))).await.is_err() {
                    return;
                }
            }
        }
        let counts = pb::ReplayCounts {
            outgoing: counts,
            end_follows: true,
        };
        if tx.send(piece(Kind::Counts(counts))).await.is_err() {
            return;
        }
        let state = |bytes| pb::RestorePiece {
            kind: Some(Kind::LocalState(bytes)),
        };
        let Some(state_bytes) =
            super::send_chunks(&blobs, &manifest.local_state, &what, &tx, state).await
        else {
            return;
        };
        let _ = tx
            .send(piece(Kind::End(pb::RestoreEnd { state_bytes })))
            .await;
    });
    Ok(rx)
}
