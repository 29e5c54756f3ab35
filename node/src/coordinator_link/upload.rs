//! Uploading a part to the coordinator: the application's state cut into content-defined
//! chunks as its pieces arrive, only the chunks the blob store lacks sent (or written to the
//! store by this daemon when it has one); the messages recorded on outgoing channels as
//! runs (one blob and its lengths per run of consecutive messages) as they are recorded;
//! then the rest of the recorded messages and the cut, converted to the wire here.

use std::collections::BTreeMap;

use bytes::Bytes;
use cairn_blob::{BlobStore, Chunk, Chunker};
use cairn_core::{ChannelId, FailureReason};
use cairn_rpc::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tracing::Instrument;

use super::{CoordinatorLink, LinkError};
use crate::metrics::NodeMetrics;
use crate::part::Part;
use crate::shared::StateChunk;

/// Chunks asked about in one `HasChunks` call (at most the coordinator's 1024)…
const BATCH_CHUNKS: usize = 64;
/// …or fewer, once they hold this many bytes: what a part's upload holds at most, beside
/// the chunker's buffer and the stream's few messages.
const BATCH_BYTES: usize = 2 << 20;

impl CoordinatorLink {
    /// The upload of snapshot `id`'s part, started at its first piece (of state, or of
    /// messages recorded on an outgoing channel).
    pub(super) fn upload(
        &mut self,
        id: u64,
        session: &mpsc::Sender<pb::NodeToCoordinator>,
        client: &pb::coordinator_client::CoordinatorClient<Channel>,
    ) -> &mpsc::UnboundedSender<UploadItem> {
        self.uploads.entry(id).or_insert_with(|| {
            let (items, rx) = mpsc::unbounded_channel();
            let header = pb::UploadHeader {
                snapshot_id: id,
                node_id: self.shared.node_id.to_string(),
                incarnation: self.shared.incarnation,
                epoch: *self.shared.epoch.borrow(),
                applied_restore_id: self.applied_restore.clone(),
            };
            let uploader = Uploader {
                client: client.clone(),
                blobs: self.blobs.clone(),
                metrics: self.shared.metrics.clone(),
                id,
                node: header.node_id.clone(),
            };
            // The node's part of the snapshot's trace, as its recording's span is named.
            let span = tracing::info_span!(parent: None, "snapshot", snapshot = id);
            tokio::spawn(uploader.run(header, rx, session.clone()).instrument(span));
            items
        })
    }
}

/// What goes into a part's upload, in order.
pub(crate) enum UploadItem {
    /// The next piece of the state.
    State(StateChunk),
    /// Messages recorded on an outgoing channel, after those recorded on it before: sent
    /// at once, and not again with the part.
    Recorded(ChannelId, Vec<(u64, Bytes)>),
    /// The part is complete: its channel states and cut close the upload.
    Finish(Box<Part>),
}

/// One part's upload.
struct Uploader {
    client: pb::coordinator_client::CoordinatorClient<Channel>,
    /// The blob store this daemon writes new chunks to itself (`--blob-store`); `None`:
    /// they go to the coordinator in the upload.
    blobs: Option<BlobStore>,
    metrics: NodeMetrics,
    id: u64,
    node: String,
}

/// How feeding an upload ended.
enum Fed {
    /// The items ended without `Finish`: the snapshot failed here.
    Aborted,
    /// Everything was sent, or the call ended early (its result says why).
    Sent,
}

type Stream = mpsc::Sender<pb::UploadChunk>;

fn message(kind: pb::upload_chunk::Kind) -> pb::UploadChunk {
    pb::UploadChunk { kind: Some(kind) }
}

impl Uploader {
    /// Streams one part to the coordinator as its pieces come. The stream holds a few
    /// messages at most; each piece gives its upload room back once it is in the chunker.
    /// If the items end without `Finish`, the snapshot failed here and the upload is dropped
    /// quietly; if the coordinator refuses or fails the upload, or the blob store fails, the
    /// snapshot is reported failed (storage), naming this node and the cause.
    async fn run(
        mut self,
        header: pb::UploadHeader,
        items: mpsc::UnboundedReceiver<UploadItem>,
        session: mpsc::Sender<pb::NodeToCoordinator>,
    ) {
        let (tx, rx) = mpsc::channel(4);
        let _ = tx
            .send(message(pb::upload_chunk::Kind::Header(header)))
            .await;
        let mut client = self.client.clone();
        let call =
            tokio::spawn(async move { client.upload_snapshot_part(ReceiverStream::new(rx)).await });
        let fed = self.feed(items, &tx).await;
        drop(tx);
        let why = match fed {
            Ok(Fed::Aborted) => return,
            // The coordinator sees the stream end without its cut and keeps nothing.
            Err(why) => why,
            Ok(Fed::Sent) => match call.await {
                Ok(Ok(r)) => {
                    let r = r.into_inner();
                    tracing::debug!(new = r.bytes_new, reused = r.bytes_reused, "part uploaded");
                    return;
                }
                Ok(Err(s)) => LinkError::UploadRefused(s),
                Err(e) => LinkError::UploadTask(e),
            },
        };
        let node = &self.node;
        tracing::warn!(%node, "upload failed: {why}");
        // Tell the coordinator now rather than let the snapshot time out.
        let reason = pb::FailureReason::from(&FailureReason::Storage {
            nodes: vec![cairn_core::NodeId::new(node.clone())],
            why: format!("upload of {node}'s part failed: {why}"),
        });
        let event = pb::NodeSnapshotEvent {
            snapshot_id: self.id,
            kind: Some(pb::node_snapshot_event::Kind::Failed(reason)),
        };
        let message = pb::NodeToCoordinator {
            kind: Some(pb::node_to_coordinator::Kind::Snapshot(event)),
        };
        let _ = session.send(message).await;
    }

    async fn feed(
        &mut self,
        mut items: mpsc::UnboundedReceiver<UploadItem>,
        tx: &Stream,
    ) -> Result<Fed, LinkError> {
        use pb::upload_chunk::Kind;
        let mut chunker = Chunker::new();
        let mut batch: Vec<Chunk> = Vec::new();
        // Per channel: the recorded messages sent ahead of the part.
        let mut streamed: BTreeMap<ChannelId, usize> = BTreeMap::new();
        while let Some(item) = items.recv().await {
            match item {
                UploadItem::Recorded(channel, messages) => {
                    for run in cairn_proto::runs::recorded_runs(&messages) {
                        let piece = pb::ChannelState {
                            channel: Some((&channel).into()),
                            messages: Vec::new(),
                            run: Some(run),
                        };
                        if tx.send(message(Kind::ChannelRun(piece))).await.is_err() {
                            return Ok(Fed::Sent);
                        }
                    }
                    *streamed.entry(channel).or_default() += messages.len();
                }
                UploadItem::State(StateChunk { bytes, room }) => {
                    batch.extend(chunker.push(&bytes));
                    drop(room); // in the chunker: room for the next piece
                    let held: usize = batch.iter().map(|c| c.data.len()).sum();
                    if (batch.len() >= BATCH_CHUNKS || held >= BATCH_BYTES)
                        && !self.send_chunks(std::mem::take(&mut batch), tx).await?
                    {
                        return Ok(Fed::Sent);
                    }
                }
                UploadItem::Finish(part) => {
                    batch.extend(std::mem::take(&mut chunker).finish());
                    for batch in batch.chunks(BATCH_CHUNKS) {
                        if !self.send_chunks(batch.to_vec(), tx).await? {
                            return Ok(Fed::Sent);
                        }
                    }
                    for piece in channel_runs(&part, &streamed) {
                        if tx.send(message(Kind::ChannelRun(piece))).await.is_err() {
                            return Ok(Fed::Sent);
                        }
                    }
                    let cut = pb::UploadCut {
                        incoming: part.incoming_cuts(),
                        outgoing: part.outgoing_cuts(),
                    };
                    let _ = tx.send(message(Kind::Cut(cut))).await;
                    return Ok(Fed::Sent);
                }
            }
        }
        Ok(Fed::Aborted)
    }

    /// Asks which of `chunks` the store holds, writes the others to this daemon's store or
    /// sends their bytes, and names them all in the upload, in order. `Ok(false)`: the call
    /// ended.
    async fn send_chunks(&mut self, chunks: Vec<Chunk>, tx: &Stream) -> Result<bool, LinkError> {
        if chunks.is_empty() {
            return Ok(true);
        }
        let request = pb::HasChunksRequest {
            snapshot_id: self.id,
            node_id: self.node.clone(),
            sha256: chunks
                .iter()
                .map(|c| Bytes::copy_from_slice(&c.hash))
                .collect(),
        };
        let present = self
            .client
            .has_chunks(request)
            .await
            .map_err(LinkError::UploadRefused)?
            .into_inner()
            .present;
        if present.len() != chunks.len() {
            return Err(LinkError::BlobStore(format!(
                "HasChunks answered {} of {} chunks",
                present.len(),
                chunks.len()
            )));
        }
        for (chunk, present) in chunks.into_iter().zip(present) {
            let size = chunk.data.len();
            let data = if present {
                self.metrics.state_bytes("reused", size as u64);
                Bytes::new()
            } else if let Some(blobs) = &self.blobs {
                blobs
                    .put_chunk(&chunk)
                    .await
                    .map_err(|e| LinkError::BlobStore(format!("{}: {e}", blobs.location())))?;
                self.metrics.state_bytes("store", size as u64);
                Bytes::new()
            } else {
                self.metrics.state_bytes("coordinator", size as u64);
                chunk.data
            };
            let piece = pb::StateChunk {
                sha256: Bytes::copy_from_slice(&chunk.hash),
                size: size as u32,
                data,
            };
            if tx
                .send(message(pb::upload_chunk::Kind::StateChunk(piece)))
                .await
                .is_err()
            {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// Each channel's recorded messages, but the first `streamed` of it (sent ahead), as runs of
/// consecutive indices of at most about 1 MiB (`cairn_proto::runs::recorded_runs`), built
/// one at a time as they are sent: one blob and its lengths each, which the coordinator
/// stores as they come.
fn channel_runs<'a>(
    part: &'a Part,
    streamed: &'a BTreeMap<ChannelId, usize>,
) -> impl Iterator<Item = pb::ChannelState> + 'a {
    part.channels.iter().flat_map(move |(channel, messages)| {
        let sent = streamed
            .get(channel)
            .copied()
            .unwrap_or(0)
            .min(messages.len());
        cairn_proto::runs::recorded_runs(&messages[sent..]).map(move |run| pb::ChannelState {
            channel: Some(channel.into()),
            messages: Vec::new(),
            run: Some(run),
        })
    })
}
