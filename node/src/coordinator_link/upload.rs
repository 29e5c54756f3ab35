//! Uploading a part to the coordinator: the application's state streamed piece by piece as
//! it arrives, then the recorded messages and the cut, converted to the wire here.

use cairn_core::FailureReason;
use cairn_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use super::{CoordinatorLink, LinkError};
use crate::part::Part;
use crate::shared::StateChunk;

/// Largest piece of a channel's recorded messages per upload message.
const UPLOAD_CHUNK: usize = 1 << 20;

impl CoordinatorLink {
    /// The upload of snapshot `id`'s part, started at its first piece.
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
            tokio::spawn(upload(client.clone(), header, rx, session.clone()));
            items
        })
    }
}

/// What goes into a part's upload, in order.
pub(crate) enum UploadItem {
    /// The next piece of the state.
    State(StateChunk),
    /// The part is complete: its channel states and cut close the upload.
    Finish(Box<Part>),
}

/// Streams one part to the coordinator as its pieces come. The stream holds a few pieces at
/// most; each piece gives its upload room back once it is in the stream. If the items end
/// without `Finish`, the snapshot failed here and the upload is dropped quietly; if the
/// coordinator refuses or fails the upload, the snapshot is reported failed (storage).
pub(super) async fn upload(
    mut client: pb::coordinator_client::CoordinatorClient<Channel>,
    header: pb::UploadHeader,
    mut items: mpsc::UnboundedReceiver<UploadItem>,
    session: mpsc::Sender<pb::NodeToCoordinator>,
) {
    use pb::upload_chunk::Kind;
    let (id, node) = (header.snapshot_id, header.node_id.clone());
    let (tx, rx) = mpsc::channel(4);
    let message = |kind| pb::UploadChunk { kind: Some(kind) };
    let _ = tx.send(message(Kind::Header(header))).await;
    let call =
        tokio::spawn(async move { client.upload_snapshot_part(ReceiverStream::new(rx)).await });
    let mut aborted = true;
    'items: while let Some(item) = items.recv().await {
        match item {
            UploadItem::State(StateChunk { bytes, room }) => {
                if tx.send(message(Kind::LocalState(bytes))).await.is_err() {
                    aborted = false; // the call ended: its result says why
                    break;
                }
                drop(room); // in the stream: room for the next piece
            }
            UploadItem::Finish(part) => {
                aborted = false;
                for piece in channel_pieces(part.channel_states()) {
                    if tx.send(message(Kind::ChannelState(piece))).await.is_err() {
                        break 'items;
                    }
                }
                let cut = pb::UploadCut {
                    incoming: part.incoming_cuts(),
                    outgoing: part.outgoing_cuts(),
                };
                let _ = tx.send(message(Kind::Cut(cut))).await;
                break;
            }
        }
    }
    drop(tx);
    let result = call.await;
    if aborted {
        return;
    }
    let why = match result {
        Ok(Ok(r)) => {
            let r = r.into_inner();
            tracing::debug!(
                snapshot = id,
                new = r.bytes_new,
                reused = r.bytes_reused,
                "part uploaded"
            );
            return;
        }
        Ok(Err(s)) => LinkError::UploadRefused(s),
        Err(e) => LinkError::UploadTask(e),
    };
    tracing::warn!(snapshot = id, %node, "upload failed: {why}");
    // Tell the coordinator now rather than let the snapshot time out.
    let reason = pb::FailureReason::from(&FailureReason::Storage(format!(
        "upload of {node}'s part failed: {why}"
    )));
    let event = pb::NodeSnapshotEvent {
        snapshot_id: id,
        kind: Some(pb::node_snapshot_event::Kind::Failed(reason)),
    };
    let message = pb::NodeToCoordinator {
        kind: Some(pb::node_to_coordinator::Kind::Snapshot(event)),
    };
    let _ = session.send(message).await;
}

/// Each channel's recorded messages in pieces of at most about `UPLOAD_CHUNK` bytes.
fn channel_pieces(states: Vec<pb::ChannelState>) -> Vec<pb::ChannelState> {
    let mut pieces = Vec::new();
    for state in states {
        let mut piece = pb::ChannelState {
            channel: state.channel.clone(),
            messages: Vec::new(),
        };
        let mut size = 0;
        for message in state.messages {
            size += message.payload.len() + 16;
            piece.messages.push(message);
            if size >= UPLOAD_CHUNK {
                let empty = pb::ChannelState {
                    channel: state.channel.clone(),
                    messages: Vec::new(),
                };
                pieces.push(std::mem::replace(&mut piece, empty));
                size = 0;
            }
        }
        if !piece.messages.is_empty() {
            pieces.push(piece);
        }
    }
    pieces
}
