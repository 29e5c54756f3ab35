//! Fetching this node's share of a restore from the coordinator and streaming it into the
//! node loop: the recorded messages of its incoming channels and the replay counts of its
//! outgoing ones come first, and with them the loop enters the restore's epoch; the recorded
//! state's pieces follow, handed on to the application as it takes them. At most
//! [`PIECES_AHEAD`] pieces wait in the loop: the rest waits in the coordinator's stream
//! (HTTP/2 flow control), so the daemon never holds a whole state, however large.
//!
//! A share that breaks before the loop entered the epoch fails the restore and changes
//! nothing here. One that breaks after — the state's stream failed or came up short — is
//! aborted in the loop too: the application drops the pieces it was handed, and the node
//! delivers nothing and sends nothing until a later restore (the coordinator is told, and
//! fails the restore naming this node).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use cairn_proto::convert::channel_from_pb;
use cairn_rpc::v1 as pb;
use tokio::sync::{Semaphore, mpsc};
use tonic::transport::Channel;

use super::{LinkError, restore_failed};
use crate::node_loop::{LoopMsg, RestoreData, RestoreFeed};

/// Pieces of a restored state (a chunk each, at most 128 KiB) that may wait in the node loop
/// for the application to take them.
pub(crate) const PIECES_AHEAD: usize = 8;

/// Numbers the fetches of this process (a restore sent twice may be fetched twice).
static FETCHES: AtomicU64 = AtomicU64::new(1);

/// Fetches this node's share of a restore from the coordinator and streams it into the
/// loop; a failure is reported to the coordinator, which fails the restore naming this node.
pub(super) async fn fetch_and_restore(
    mut client: pb::coordinator_client::CoordinatorClient<Channel>,
    restore: pb::NodeRestore,
    node: String,
    loop_tx: mpsc::Sender<LoopMsg>,
    session: mpsc::Sender<pb::NodeToCoordinator>,
) {
    let restore_id = restore.restore_id.clone();
    let mut fetch = Fetch {
        loop_tx,
        id: FETCHES.fetch_add(1, Ordering::Relaxed),
        room: Arc::new(Semaphore::new(PIECES_AHEAD)),
        entered: false,
    };
    let Err(why) = fetch.run(&mut client, restore, node).await else {
        return;
    };
    if matches!(why, LinkError::NodeStopping | LinkError::RestoreDropped) {
        // Stopping, or the loop dropped the restore (superseded, or its application left
        // mid-way) and told the coordinator itself.
        return;
    }
    tracing::error!(restore = %restore_id, "cannot fetch this node's share of the restore: {why}");
    let message = if fetch.entered {
        let message = format!("the recorded state's stream broke: {why}");
        let _ = fetch
            .loop_tx
            .send(LoopMsg::RestoreAborted {
                fetch: fetch.id,
                reason: message.clone(),
            })
            .await;
        message
    } else {
        format!("cannot fetch the recorded state: {why}")
    };
    let _ = session.send(restore_failed(restore_id, message)).await;
}

struct Fetch {
    loop_tx: mpsc::Sender<LoopMsg>,
    /// This fetch, among the process's.
    id: u64,
    /// Room for pieces in the loop: a permit per piece on its way, given back by the loop
    /// when the application takes it, and closed when the loop drops the restore.
    room: Arc<Semaphore>,
    /// The loop has the restore (and entered its epoch).
    entered: bool,
}

impl Fetch {
    async fn run(
        &mut self,
        client: &mut pb::coordinator_client::CoordinatorClient<Channel>,
        restore: pb::NodeRestore,
        node: String,
    ) -> Result<(), LinkError> {
        use pb::restore_piece::Kind;
        let request = pb::FetchRestorePartRequest {
            snapshot_id: restore.snapshot_id,
            node_id: node,
        };
        let mut pieces = client
            .fetch_restore_part(request)
            .await
            .map_err(LinkError::Fetch)?
            .into_inner();
        let mut data = Some(RestoreData {
            restore_id: restore.restore_id,
            snapshot_id: restore.snapshot_id,
            epoch: restore.epoch,
            incoming: Default::default(),
            outgoing: Default::default(),
            feed: RestoreFeed::new(self.id, self.room.clone()),
        });
        let mut counted = false;
        let mut end_follows = false;
        // A coordinator from before `RestoreEnd` sends the state first and the counts last:
        // its share is collected whole, then handed over as one.
        let mut early: Option<Vec<Bytes>> = None;
        let mut received = 0u64;
        while let Some(piece) = pieces.message().await.map_err(LinkError::Fetch)? {
            match piece.kind {
                Some(Kind::ChannelState(state)) => {
                    let data = data
                        .as_mut()
                        .ok_or(LinkError::PieceOutOfOrder("a channel state"))?;
                    let channel = channel_from_pb(state.channel.as_ref())?;
                    data.incoming
                        .entry(channel)
                        .or_default()
                        .extend(state.messages.into_iter().map(|m| m.payload));
                }
                Some(Kind::Counts(counts)) => {
                    let data = data
                        .as_mut()
                        .ok_or(LinkError::PieceOutOfOrder("the counts"))?;
                    for c in counts.outgoing {
                        let channel = channel_from_pb(c.channel.as_ref())?;
                        data.outgoing.insert(channel, c.messages);
                    }
                    counted = true;
                    end_follows = counts.end_follows;
                }
                Some(Kind::LocalState(bytes)) => {
                    received = received.saturating_add(bytes.len() as u64);
                    if !counted {
                        early.get_or_insert_with(Vec::new).push(bytes);
                        continue;
                    }
                    if let Some(data) = data.take() {
                        self.enter(data).await?;
                    }
                    self.piece(bytes).await?;
                }
                Some(Kind::End(end)) => {
                    if !counted {
                        return Err(LinkError::NoReplayCounts);
                    }
                    if end.state_bytes != received {
                        return Err(LinkError::ShortState {
                            received,
                            expected: end.state_bytes,
                        });
                    }
                    if let Some(data) = data.take() {
                        self.enter(data).await?;
                    }
                    for piece in early.take().unwrap_or_default() {
                        self.piece(piece).await?;
                    }
                    return self.end().await;
                }
                None => {}
            }
        }
        match data {
            // The old order (or an empty state from an old coordinator): all here.
            Some(data) if counted && !end_follows => {
                self.enter(data).await?;
                for piece in early.unwrap_or_default() {
                    self.piece(piece).await?;
                }
                self.end().await
            }
            Some(_) if !counted => Err(LinkError::NoReplayCounts),
            _ => Err(LinkError::NoRestoreEnd { received }),
        }
    }

    async fn enter(&mut self, data: RestoreData) -> Result<(), LinkError> {
        self.send(LoopMsg::Restore(Box::new(data))).await?;
        self.entered = true;
        Ok(())
    }

    /// Hands the loop the next piece once it has room for it.
    async fn piece(&mut self, piece: Bytes) -> Result<(), LinkError> {
        let permit = self
            .room
            .acquire()
            .await
            .map_err(|_| LinkError::RestoreDropped)?;
        // Given back by the loop when the application takes the piece.
        permit.forget();
        let fetch = self.id;
        self.send(LoopMsg::RestorePiece { fetch, piece }).await
    }

    async fn end(&mut self) -> Result<(), LinkError> {
        let fetch = self.id;
        self.send(LoopMsg::RestoreEnd { fetch }).await
    }

    async fn send(&self, msg: LoopMsg) -> Result<(), LinkError> {
        self.loop_tx
            .send(msg)
            .await
            .map_err(|_| LinkError::NodeStopping)
    }
}
