//! `ReadSnapshotData`'s pipeline: every part's state and recorded channel states streamed
//! chunk by chunk from the blob store, each chunk verified as it is read, with at most a
//! few messages buffered; a loss found on the way is reported as the snapshot's deletion
//! when the snapshot is gone meanwhile.

use cairn_blob::{BlobStore, Manifest};
use cairn_core::SnapshotId;
use cairn_rpc::v1 as pb;
use tokio::sync::mpsc;
use tonic::Status;

use crate::error::Error;
use crate::store::{Metadata, PartRecord};

/// Streams `parts` of snapshot `id` (`first`: the first part's manifest, already read so
/// that a missing one fails the call itself).
pub(crate) fn stream(
    blobs: BlobStore,
    meta: Metadata,
    id: SnapshotId,
    parts: Vec<PartRecord>,
    first: Option<Manifest>,
) -> mpsc::Receiver<Result<pb::SnapshotData, Status>> {
    let (tx, rx) = mpsc::channel(4);
    // A loss found while streaming is checked the same way before it is sent.
    let (stream_tx, mut stream_rx) = mpsc::channel::<Result<pb::SnapshotData, Status>>(4);
    tokio::spawn(async move {
        while let Some(item) = stream_rx.recv().await {
            let item = match item {
                Err(status) if status.code() == tonic::Code::DataLoss => {
                    match meta.snapshot(id).await {
                        Ok(None) => Err(Status::from(Error::SnapshotNotFound(id))),
                        _ => Err(status),
                    }
                }
                item => item,
            };
            if tx.send(item).await.is_err() {
                return;
            }
        }
    });
    let tx = stream_tx;
    tokio::spawn(async move {
        use pb::snapshot_data::Kind;
        let mut first = first;
        for part in parts {
            let node = part.node.clone();
            let manifest = match first.take() {
                Some(manifest) => manifest,
                None => match super::manifest_of(&blobs, &part).await {
                    Ok(manifest) => manifest,
                    Err(e) => {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                },
            };
            let data = |kind| pb::SnapshotData {
                node_id: node.clone(),
                kind: Some(kind),
            };
            let what = format!("snapshot {id}: node {node}'s state");
            let Some(state_bytes) =
                super::send_chunks(&blobs, &manifest.local_state, &what, &tx, |bytes| {
                    data(Kind::LocalState(bytes))
                })
                .await
            else {
                return;
            };
            let what = format!("snapshot {id}: node {node}'s channel states");
            let mut decoder = super::ChannelStateDecoder::default();
            let mut messages = 0u64;
            let mut read = 0u64;
            for hash in &manifest.channel_states.chunks {
                let decoded = match blobs.read_chunk(hash).await {
                    Ok(chunk) => {
                        read = read.saturating_add(chunk.len() as u64);
                        decoder
                            .push(&chunk)
                            .map_err(|e| Error::DataLoss(format!("{what} do not decode: {e}")))
                    }
                    Err(e) => Err(Error::reading(&what, &e)),
                };
                let states = match decoded {
                    Ok(states) => states,
                    Err(e) => {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                };
                for state in states {
                    // One run at a time as messages: what is held stays bounded.
                    let state = match super::expand(state) {
                        Ok(state) => state,
                        Err(e) => {
                            let e = Error::DataLoss(format!("{what} do not decode: {e}"));
                            let _ = tx.send(Err(e.into())).await;
                            return;
                        }
                    };
                    messages += state.messages.len() as u64;
                    if tx.send(Ok(data(Kind::ChannelState(state)))).await.is_err() {
                        return;
                    }
                }
            }
            let end = decoder
                .finish()
                .map_err(|e| Error::DataLoss(format!("{what} do not decode: {e}")))
                .and_then(|()| {
                    if read == manifest.channel_states.size {
                        Ok(())
                    } else {
                        Err(Error::DataLoss(format!(
                            "{what}: the chunks hold {read} bytes where their list says {}",
                            manifest.channel_states.size
                        )))
                    }
                });
            let item = end.map(|()| {
                data(Kind::End(pb::NodeDataEnd {
                    local_state_bytes: state_bytes,
                    recorded_messages: messages,
                }))
            });
            let failed = item.is_err();
            if tx.send(item.map_err(Status::from)).await.is_err() || failed {
                return;
            }
        }
    });
    rx
}
