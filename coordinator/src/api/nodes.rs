//! The node daemons' calls: their sessions (registration, heartbeats, snapshot events),
//! part uploads, which chunks the store holds, and a restore's fetch. Each checks that the
//! caller is the node it claims to be, then hands over to the task or to a pipeline in
//! `parts`.

use std::sync::atomic::Ordering;

use cairn_core::control::{ChannelStatus, NodeReport, StateTimes};
use cairn_core::{FailureReason, NodeId, SnapshotId};
use cairn_proto::convert::command_to_pb;
use cairn_rpc::server::identity::{Peer, check_node};
use cairn_rpc::v1 as pb;
use pb::coordinator_server::Coordinator;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::{CoordinatorService, ELECTION_HOLD, ask_task};
use crate::error::Error;
use crate::limits;
use crate::parts;
use crate::task::{Msg, PartSizes, ToNode};

impl CoordinatorService {
    pub(super) async fn has_chunks_call(
        &self,
        request: Request<pb::HasChunksRequest>,
    ) -> Result<Response<pb::HasChunksResponse>, Status> {
        let peer = Peer::of(&request);
        let r = request.into_inner();
        check_node(peer.as_ref(), &r.node_id, "ask for chunks")?;
        // The leader's index: it is the one kept as chunks are stored and collected.
        self.replica.leading()?;
        if r.sha256.len() > limits::MAX_HAS_CHUNKS {
            return Err(Error::InvalidArgument(format!(
                "{} chunks asked at once; at most {}",
                r.sha256.len(),
                limits::MAX_HAS_CHUNKS
            ))
            .into());
        }
        // A hold while answering: garbage collection does not run while a chunk is vouched
        // for, and one decided on before this answer does not run at all (the chunks it
        // names are uploaded, or named, under holds of their own).
        let _hold = self.blobs.hold().await;
        let present = r
            .sha256
            .iter()
            .map(|hash| <[u8; 32]>::try_from(hash.as_ref()).map(|h| self.blobs.has(&h)))
            .collect::<Result<Vec<bool>, _>>()
            .map_err(|_| Error::InvalidArgument("a chunk's sha256 is 32 bytes".into()))?;
        Ok(Response::new(pb::HasChunksResponse { present }))
    }

    pub(super) async fn fetch_restore_part_call(
        &self,
        request: Request<pb::FetchRestorePartRequest>,
    ) -> Result<Response<ReceiverStream<Result<pb::RestorePiece, Status>>>, Status> {
        let peer = Peer::of(&request);
        let r = request.into_inner();
        check_node(peer.as_ref(), &r.node_id, "fetch a restore")?;
        let id = SnapshotId(r.snapshot_id);
        self.completed(id, "can be restored").await?;
        let parts = self.parts(id).await?;
        let own = parts
            .iter()
            .find(|p| p.node == r.node_id)
            .cloned()
            .ok_or_else(|| Error::NoPart {
                id,
                node: r.node_id.clone(),
            })?;
        let rx = parts::restore::pieces(self.blobs.clone(), &parts, own, r.node_id).await?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    pub(super) async fn node_session_call(
        &self,
        request: Request<Streaming<pb::NodeToCoordinator>>,
    ) -> Result<Response<<CoordinatorService as Coordinator>::NodeSessionStream>, Status> {
        use pb::node_to_coordinator::Kind;
        let peer = Peer::of(&request);
        let mut inbound = request.into_inner();
        let Some(pb::NodeToCoordinator {
            kind: Some(Kind::Register(register)),
        }) = inbound.message().await?
        else {
            return Err(Error::InvalidArgument(
                "the first message of a node session must be Register".into(),
            )
            .into());
        };
        check_node(peer.as_ref(), &register.node_id, "register")?;
        let node = NodeId::new(register.node_id.clone());
        let session = self.sessions.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, rx) = mpsc::channel(256);
        // The session belongs to this term: when the term ends, its task is gone and
        // the session with it. During an election the daemon's request waits for a leader
        // (here, or named in the refusal) rather than retrying blind.
        let leading = self.replica.leading_or_wait(ELECTION_HOLD).await?;
        ask_task(
            &leading.tx,
            |reply| Msg::Register {
                registration: (&register).into(),
                session,
                tx,
                reply,
            },
            &self.replica,
        )
        .await??;
        let state = leading.tx;
        tokio::spawn(async move {
            loop {
                match inbound.message().await {
                    Ok(Some(pb::NodeToCoordinator { kind: Some(kind) })) => {
                        if let Some(msg) = session_msg(&node, kind)
                            && state.send(msg).await.is_err()
                        {
                            return;
                        }
                    }
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
            let _ = state.send(Msg::SessionEnded { node, session }).await;
        });
        // Each command leaves only while its term holds: one queued before the term ended
        // ends the session instead (the daemon goes to the next leader).
        let leadership = leading.leadership;
        let commands = tokio_stream::StreamExt::map(ReceiverStream::new(rx), move |item| {
            if leadership.valid() {
                item.map(|sent: ToNode| command_to_pb(&sent.command, sent.term))
            } else {
                Err(Status::unavailable(format!(
                    "coordinator term {} ended: reconnect to the leader",
                    leadership.term()
                )))
            }
        });
        Ok(Response::new(Box::pin(commands)))
    }

    pub(super) async fn upload_snapshot_part_call(
        &self,
        request: Request<Streaming<pb::UploadChunk>>,
    ) -> Result<Response<pb::UploadSnapshotPartResponse>, Status> {
        use pb::upload_chunk::Kind;
        let peer = Peer::of(&request);
        let mut chunks = request.into_inner();
        let Some(pb::UploadChunk {
            kind: Some(Kind::Header(header)),
        }) = chunks.message().await?
        else {
            return Err(Error::InvalidArgument("an upload starts with its header".into()).into());
        };
        check_node(peer.as_ref(), &header.node_id, "upload a part")?;
        let id = SnapshotId(header.snapshot_id);
        let node = NodeId::new(header.node_id.clone());
        // Stored in the term that checked it, through that term's fence.
        let leading = self.replica.leading()?;
        ask_task(
            &leading.tx,
            |reply| Msg::CheckUpload {
                id,
                node: node.clone(),
                reply,
            },
            &self.replica,
        )
        .await??;
        // Held until the part's record is written: garbage collection does not run between
        // the chunks this upload names and the record that names them.
        let _hold = self.blobs.hold().await;
        let count = self.uploading.start(id, node.clone());
        let stored = match parts::store_upload(&self.blobs, &header, &mut chunks, &count).await {
            Ok(stored) => stored,
            Err(e) => {
                // A write that fails (a full disk, an I/O error) fails the snapshot here,
                // naming this node and the cause, whatever the daemon does with the error.
                if let Error::Storage(why) = &e {
                    let why = why.clone();
                    let _ = leading.tx.try_send(Msg::StorageFailed {
                        id,
                        node: node.clone(),
                        why,
                    });
                }
                return Err(e.into());
            }
        };
        leading.meta.put_part(id, &stored.record).await?;
        let (bytes_new, bytes_reused) = (stored.record.bytes_new, stored.record.bytes_reused);
        let sizes = PartSizes {
            bytes_new,
            bytes_reused,
            local_state_bytes: stored.record.local_state_bytes,
            recorded_messages: stored.record.recorded_messages,
        };
        leading
            .tx
            .send(Msg::PartStored {
                part: stored.part,
                sizes,
                epoch: header.epoch,
                applied_restore_id: header.applied_restore_id,
            })
            .await
            .map_err(|_| self.replica.not_leader())?;
        Ok(Response::new(pb::UploadSnapshotPartResponse {
            bytes_new,
            bytes_reused,
        }))
    }
}

/// The task's message for what a node's session says; `None` for what needs nothing (a
/// second `Register`, a part uploaded: its upload tells).
fn session_msg(node: &NodeId, kind: pb::node_to_coordinator::Kind) -> Option<Msg> {
    use pb::node_snapshot_event::Kind as Event;
    use pb::node_to_coordinator::Kind;
    let node = node.clone();
    Some(match kind {
        Kind::Snapshot(event) => {
            let report = match event.kind? {
                Event::StateRecorded(times) => NodeReport::StateRecorded(StateTimes {
                    recording_for_ms: times.recording_for_ms,
                    aligned_ms: times.aligned_ms,
                    held_messages: times.held_messages,
                }),
                Event::Failed(reason) => NodeReport::Failed(node_failure(&node, &reason)),
                Event::PartUploaded(_) => return None,
            };
            Msg::NodeEvent {
                node,
                id: SnapshotId(event.snapshot_id),
                report,
            }
        }
        Kind::Heartbeat(beat) => {
            // Only the node's own channels, and not more than a node can have.
            let channels = beat
                .channels
                .iter()
                .filter_map(|c| ChannelStatus::try_from(c).ok())
                .filter(|c| c.channel.from == node || c.channel.to == node)
                .take(crate::task::MAX_HEARTBEAT_CHANNELS)
                .collect();
            Msg::Heartbeat {
                node,
                application_attached: beat.application_attached,
                channels,
            }
        }
        Kind::RestoreApplied(applied) => Msg::RestoreApplied {
            node,
            restore_id: applied.restore_id,
        },
        Kind::RestoreFailed(failed) => Msg::RestoreFailed {
            node,
            restore_id: failed.restore_id,
            message: failed.message,
        },
        Kind::Leave(_) => Msg::Leave { node },
        Kind::OutcomesAfter(ask) => Msg::OutcomesAfter {
            node,
            after: ask.after,
        },
        Kind::Register(_) => return None,
    })
}

/// The failure `node` reported. The wire's reason is taken exactly
/// (`cairn_proto::convert::failure`), except where the reporter is who it concerns: a
/// node lost, without an application or shutting down is the reporting node (whatever
/// the wire names), a reset without its channel is the reporter lost, and a reason
/// without a kind (or one this coordinator does not know, or cannot read) is an abort
/// naming the node.
fn node_failure(node: &NodeId, reason: &pb::FailureReason) -> FailureReason {
    use pb::failure_reason::Kind;
    // Bounded before anything keeps it (the record stores the sentence and the words).
    let reason = &pb::FailureReason {
        message: limits::cut(&reason.message, limits::MAX_NODE_REASON),
        detail: reason
            .detail
            .as_deref()
            .map(|words| limits::cut(words, limits::MAX_NODE_REASON)),
        ..reason.clone()
    };
    let aborted = |why: String| FailureReason::Aborted(format!("on node {node}: {why}"));
    match Kind::try_from(reason.kind).unwrap_or(Kind::Unspecified) {
        Kind::ChannelReset if reason.channel.is_none() => FailureReason::NodeLost(node.clone()),
        Kind::NoApplication => FailureReason::NoApplication(node.clone()),
        Kind::Shutdown => FailureReason::Shutdown(node.clone()),
        Kind::NodeLost => FailureReason::NodeLost(node.clone()),
        // A daemon's own storage failure names the daemon, whatever it says.
        Kind::Storage => match FailureReason::try_from(reason) {
            Ok(FailureReason::Storage { why, .. }) => FailureReason::Storage {
                nodes: vec![node.clone()],
                why,
            },
            // Never: a storage reason always converts.
            other => other.unwrap_or_else(|e| aborted(format!("{} ({e})", reason.message))),
        },
        // So does a bad cut of its application.
        Kind::BadCut => FailureReason::BadCut {
            node: node.clone(),
            why: reason
                .detail
                .clone()
                .unwrap_or_else(|| reason.message.clone()),
        },
        Kind::Unspecified => aborted(reason.message.clone()),
        _ => FailureReason::try_from(reason)
            .unwrap_or_else(|e| aborted(format!("{} ({e})", reason.message))),
    }
}

#[cfg(test)]
mod tests {
    use cairn_core::ChannelId;

    use super::*;

    #[test]
    fn a_node_failure_is_bounded_before_it_is_kept() {
        let node = NodeId::from("n2");
        let huge = FailureReason::Storage {
            nodes: vec![node.clone()],
            why: "é".repeat(1 << 19),
        };
        let FailureReason::Storage { why, .. } = node_failure(&node, &(&huge).into()) else {
            panic!("a storage failure stays one");
        };
        assert!(
            why.len() <= limits::MAX_NODE_REASON + '…'.len_utf8(),
            "{}",
            why.len()
        );
        assert!(why.ends_with('…'));
        // The sentence alone (a daemon older than `detail`) is bounded too.
        let old = pb::FailureReason {
            detail: None,
            ..(&huge).into()
        };
        let FailureReason::Storage { why, .. } = node_failure(&node, &old) else {
            panic!("a storage failure stays one");
        };
        assert!(
            why.len() <= limits::MAX_NODE_REASON + '…'.len_utf8(),
            "{}",
            why.len()
        );
    }

    #[test]
    fn a_node_failure_is_exact_and_names_its_reporter() {
        let node = NodeId::from("n2");
        let wire = |reason: &FailureReason| pb::FailureReason::from(reason);
        // Taken exactly (Timeout and MixedEpochs once became aborts).
        for reason in [
            FailureReason::ChannelReset(ChannelId::new("n1", "n2")),
            FailureReason::Storage {
                nodes: vec![NodeId::new("n2")],
                why: "upload of n2's part failed: no space".into(),
            },
            FailureReason::MembershipChanged("node n3 joined".into()),
            FailureReason::Timeout {
                missing: vec!["n1".into()],
            },
            FailureReason::Restore,
            FailureReason::MixedEpochs {
                nodes: vec!["n2".into()],
                detail: "n2 is in epoch 2".into(),
            },
        ] {
            assert_eq!(node_failure(&node, &wire(&reason)), reason);
        }
        // The reporter is who these concern, whatever the wire names.
        for (sent, taken) in [
            (
                FailureReason::NoApplication("n9".into()),
                FailureReason::NoApplication(node.clone()),
            ),
            (
                FailureReason::Shutdown("n9".into()),
                FailureReason::Shutdown(node.clone()),
            ),
            (
                FailureReason::NodeLost("n9".into()),
                FailureReason::NodeLost(node.clone()),
            ),
        ] {
            assert_eq!(node_failure(&node, &wire(&sent)), taken);
        }
        let mut reset = wire(&FailureReason::ChannelReset(ChannelId::new("n1", "n2")));
        reset.channel = None;
        assert_eq!(
            node_failure(&node, &reset),
            FailureReason::NodeLost(node.clone())
        );
        let unknown = pb::FailureReason {
            kind: 99,
            message: "what".into(),
            ..Default::default()
        };
        assert_eq!(
            node_failure(&node, &unknown),
            FailureReason::Aborted("on node n2: what".into())
        );
    }
}
