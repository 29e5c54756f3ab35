//! Fetching this node's share of a restore from the coordinator: the recorded state, the
//! recorded messages of its incoming channels and the replay counts of its outgoing ones,
//! handed to the node loop in one message once all of it is here.

use cairn_proto::convert::channel_from_pb;
use cairn_proto::v1 as pb;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use super::{LinkError, restore_failed};
use crate::node_loop::{LoopMsg, RestoreData};

/// Fetches this node's share of a restore from the coordinator and hands it to the loop;
/// a failure is reported to the coordinator, which fails the restore naming this node.
pub(super) async fn fetch_and_restore(
    mut client: pb::coordinator_client::CoordinatorClient<Channel>,
    restore: pb::NodeRestore,
    node: String,
    loop_tx: mpsc::Sender<LoopMsg>,
    session: mpsc::Sender<pb::NodeToCoordinator>,
) {
    let result = async {
        let request = pb::FetchRestorePartRequest {
            snapshot_id: restore.snapshot_id,
            node_id: node,
        };
        let mut pieces = client
            .fetch_restore_part(request)
            .await
            .map_err(LinkError::Fetch)?
            .into_inner();
        let mut data = RestoreData {
            restore_id: restore.restore_id.clone(),
            snapshot_id: restore.snapshot_id,
            epoch: restore.epoch,
            state: Vec::new(),
            incoming: Default::default(),
            outgoing: Default::default(),
        };
        let mut complete = false;
        while let Some(piece) = pieces.message().await.map_err(LinkError::Fetch)? {
            use pb::restore_piece::Kind;
            match piece.kind {
                Some(Kind::LocalState(bytes)) => data.state.push(bytes),
                Some(Kind::ChannelState(state)) => {
                    let channel = channel_from_pb(state.channel.as_ref())?;
                    data.incoming
                        .entry(channel)
                        .or_default()
                        .extend(state.messages.into_iter().map(|m| m.payload));
                }
                Some(Kind::Counts(counts)) => {
                    for c in counts.outgoing {
                        let channel = channel_from_pb(c.channel.as_ref())?;
                        data.outgoing.insert(channel, c.messages);
                    }
                    complete = true;
                }
                None => {}
            }
        }
        if !complete {
            return Err(LinkError::NoReplayCounts);
        }
        Ok::<_, LinkError>(data)
    }
    .await;
    match result {
        Ok(data) => {
            let _ = loop_tx.send(LoopMsg::Restore(Box::new(data))).await;
        }
        Err(why) => {
            tracing::error!(restore = %restore.restore_id, "cannot fetch this node's share of the restore: {why}");
            let message = format!("cannot fetch the recorded state: {why}");
            let _ = session
                .send(restore_failed(restore.restore_id, message))
                .await;
        }
    }
}
