//! `cairn.v1.Coordinator`: what users script against, and what node daemons use to keep
//! a session and upload their parts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use cairn_core::{NodeId, SnapshotId, StartRequest};
use cairn_rpc::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::error::Error;
use crate::leader::election::Elector;
use crate::leader::replica::Replica;
use crate::limits;
use crate::policy;
use crate::store::{
    MemberRecord, Metadata, PartRecord, RestoreRecord, SnapshotRecord, SnapshotStatus,
};
use crate::task::{Msg, mode_of, restore_epoch, restore_pb};
mod nodes;
mod reads;

use cairn_blob::BlobStore;
use cairn_proto::stored::convert::{progress_pb, snapshot_pb};

/// The `Coordinator` service. The leader answers everything; a follower answers reads
/// from the metadata store and refuses the rest with UNAVAILABLE naming the leader.
pub(crate) struct CoordinatorService {
    /// Leader or follower, now.
    pub replica: Arc<Replica>,
    /// The metadata, for reads (every replica reads; only a term's fenced view writes).
    pub meta: Metadata,
    pub blobs: BlobStore,
    pub default_timeout: Duration,
    pub sessions: AtomicU64,
    /// The election (`None`: the embedded store, one replica).
    pub elector: Option<Elector>,
    /// The policy of the flags and the tracker's bound (a follower's `GetPolicy`).
    pub flags_policy: cairn_core::schedule::Policy,
    pub max_in_flight: usize,
    /// Room for `WatchSnapshot` streams that follow the stored record ([`MAX_FOLLOWS`]).
    pub follows: Arc<tokio::sync::Semaphore>,
    /// What responses may hold in memory at once (inline data, diffs).
    pub budget: crate::budget::ResponseBudget,
}

/// What a `DiffSnapshots` call reserves: two manifests' chunk lists per node at a time.
const DIFF_RESERVE: u64 = 16 << 20;

/// Most `WatchSnapshot` streams a replica follows by reading the store at once (each reads
/// etcd four times a second).
pub(crate) const MAX_FOLLOWS: usize = 256;

/// How long a daemon's session request waits on a replica that knows no leader yet (below
/// the 10 s a daemon gives a registration).
const ELECTION_HOLD: Duration = Duration::from_secs(8);

/// How often a follower's `WatchSnapshot` reads the record it follows.
const FOLLOW_EVERY: Duration = Duration::from_millis(250);

impl CoordinatorService {
    /// Asks the task of the term this replica leads; UNAVAILABLE naming the leader on a
    /// follower.
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Msg) -> Result<T, Status> {
        let leading = self.replica.leading()?;
        ask_task(&leading.tx, make, &self.replica).await
    }

    /// [`Self::ask`] for a request that writes (start, abort, delete, restore, policy,
    /// removal): once the task took it, a term that ends before it answers (the task is
    /// dropped with a write in flight, whose request may still reach etcd while the lease
    /// lives) leaves its outcome unknown — ABORTED, never a failure.
    async fn ask_write<T>(
        &self,
        what: &str,
        make: impl FnOnce(oneshot::Sender<T>) -> Msg,
    ) -> Result<T, Status> {
        let leading = self.replica.leading()?;
        let (reply, answer) = oneshot::channel();
        leading
            .tx
            .send(make(reply))
            .await
            .map_err(|_| self.replica.not_leader())?;
        answer.await.map_err(|_| {
            Status::from(Error::OutcomeUnknown {
                what: what.to_owned(),
                see: "the read calls (GetSnapshot, ListSnapshots, GetRestore, GetPolicy, \
                      ListNodes) once a leader answers"
                    .into(),
                cause: "this coordinator's term ended while it handled the call".into(),
            })
        })
    }

    /// A snapshot's record: stored, or with its live progress while it is in flight (on
    /// the leader; a follower has the stored record).
    async fn record(&self, id: SnapshotId) -> Result<SnapshotRecord, Error> {
        let stored = self
            .meta
            .snapshot(id)
            .await?
            .ok_or(Error::SnapshotNotFound(id))?;
        if stored.status != SnapshotStatus::InProgress {
            return Ok(stored);
        }
        let Ok(leading) = self.replica.leading() else {
            return Ok(stored);
        };
        let (reply, answer) = oneshot::channel();
        if leading.tx.send(Msg::Live { id, reply }).await.is_err() {
            return Ok(stored);
        }
        match answer.await {
            Ok(Some(live)) => Ok(live),
            // Ended meanwhile (or the term did): read it again.
            _ => self
                .meta
                .snapshot(id)
                .await?
                .ok_or(Error::SnapshotNotFound(id)),
        }
    }

    /// Snapshot `id`'s record if it is COMPLETED; otherwise FAILED_PRECONDITION saying it
    /// `only` (e.g. "can be restored") when completed.
    async fn completed(&self, id: SnapshotId, only: &'static str) -> Result<SnapshotRecord, Error> {
        let record = self.record(id).await?;
        if record.status != SnapshotStatus::Completed {
            return Err(Error::NotCompleted {
                id,
                status: record.status,
                only,
            });
        }
        Ok(record)
    }

    async fn parts(&self, id: SnapshotId) -> Result<Vec<PartRecord>, Error> {
        self.meta.parts(id).await
    }

    /// [`loss_or_gone`] with this replica's store.
    async fn loss_or_gone(&self, id: SnapshotId, error: Error) -> Error {
        loss_or_gone(&self.meta, id, error).await
    }

    /// A follower's `ListNodes`: the roster and the members as the leader stored them.
    async fn stored_nodes(&self) -> Result<pb::ListNodesResponse, Error> {
        let members: BTreeMap<String, MemberRecord> = self
            .meta
            .members()
            .await?
            .into_iter()
            .map(|m| (m.node.clone(), m))
            .collect();
        let nodes = self
            .meta
            .roster()
            .await?
            .into_iter()
            .map(|r| {
                let live = members.get(&r.node);
                pb::NodeInfo {
                    incarnation: live.map_or(r.incarnation, |m| m.incarnation),
                    connected: live.is_some(),
                    last_seen_ms: live.map_or(0, |m| m.registered_at_ms),
                    application_attached: false,
                    node_id: r.node,
                    address: r.address,
                    channels: Vec::new(),
                }
            })
            .collect();
        Ok(pb::ListNodesResponse {
            nodes,
            channels: Vec::new(),
        })
    }

    /// A follower's `WatchSnapshot`: the stored record, read again every
    /// [`FOLLOW_EVERY`], each change sent, until it ends or the watcher goes.
    async fn follow(&self, id: SnapshotId) -> Result<WatchStream, Status> {
        let permit = self.follows.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "{MAX_FOLLOWS} snapshots are followed on this replica already, the most \
                 allowed: watch on the leader, or later"
            ))
        })?;
        let first = self
            .meta
            .snapshot(id)
            .await?
            .ok_or(Error::SnapshotNotFound(id))?;
        let (tx, rx) = mpsc::channel(64);
        let meta = self.meta.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut last = progress_pb(&first);
            let mut ended = first.status != SnapshotStatus::InProgress;
            if tx.send(Ok(last.clone())).await.is_err() {
                return;
            }
            while !ended {
                tokio::select! {
                    () = tx.closed() => return,
                    () = tokio::time::sleep(FOLLOW_EVERY) => {}
                }
                let record = match meta.snapshot(id).await {
                    Ok(Some(record)) => record,
                    Ok(None) => {
                        let _ = tx.send(Err(Error::SnapshotNotFound(id).into())).await;
                        return;
                    }
                    // etcd unreachable for a moment: keep following.
                    Err(_) => continue,
                };
                ended = record.status != SnapshotStatus::InProgress;
                let now = progress_pb(&record);
                if now != last {
                    if tx.send(Ok(now.clone())).await.is_err() {
                        return;
                    }
                    last = now;
                }
            }
        });
        Ok(ReceiverStream::new(rx))
    }
}

type WatchStream = ReceiverStream<Result<pb::SnapshotProgress, Status>>;

/// Sends a request to a term's task and waits for its answer; a task that is gone (the
/// term ended meanwhile) is UNAVAILABLE naming the leader if known.
async fn ask_task<T>(
    tx: &mpsc::Sender<Msg>,
    make: impl FnOnce(oneshot::Sender<T>) -> Msg,
    replica: &Replica,
) -> Result<T, Status> {
    let (reply, answer) = oneshot::channel();
    tx.send(make(reply))
        .await
        .map_err(|_| replica.not_leader())?;
    answer.await.map_err(|_| replica.not_leader())
}

#[tonic::async_trait]
impl pb::coordinator_server::Coordinator for CoordinatorService {
    async fn start_snapshot(
        &self,
        request: Request<pb::StartSnapshotRequest>,
    ) -> Result<Response<pb::StartSnapshotResponse>, Status> {
        let r = request.into_inner();
        let mode = mode_of(r.mode)?;
        limits::check_start(mode, r.timeout_ms, r.alignment_timeout_ms)?;
        limits::check_labels(&r.labels)?;
        let request = StartRequest {
            mode,
            initiators: r
                .initiators
                .iter()
                .map(|n| NodeId::new(n.clone()))
                .collect(),
            alignment_timeout: (r.alignment_timeout_ms > 0)
                .then(|| Duration::from_millis(r.alignment_timeout_ms)),
        };
        let timeout = if r.timeout_ms > 0 {
            Duration::from_millis(r.timeout_ms)
        } else {
            self.default_timeout
        };
        let labels: BTreeMap<String, String> = r.labels.into_iter().collect();
        let id = self
            .ask_write("StartSnapshot", |reply| Msg::Start {
                request,
                timeout,
                labels,
                reply,
            })
            .await??;
        Ok(Response::new(pb::StartSnapshotResponse {
            snapshot_id: id.0,
        }))
    }

    async fn get_snapshot(
        &self,
        request: Request<pb::GetSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        self.get_snapshot_call(request).await
    }

    async fn list_snapshots(
        &self,
        request: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        self.list_snapshots_call(request).await
    }

    type WatchSnapshotStream = ReceiverStream<Result<pb::SnapshotProgress, Status>>;

    async fn watch_snapshot(
        &self,
        request: Request<pb::WatchSnapshotRequest>,
    ) -> Result<Response<Self::WatchSnapshotStream>, Status> {
        let id = SnapshotId(request.into_inner().snapshot_id);
        if self.replica.is_leading() {
            let (tx, rx) = mpsc::channel(64);
            // A term that ends meanwhile: follow the record like a follower.
            if let Ok(answer) = self.ask(|reply| Msg::Watch { id, tx, reply }).await {
                answer?;
                return Ok(Response::new(ReceiverStream::new(rx)));
            }
        }
        Ok(Response::new(self.follow(id).await?))
    }

    async fn abort_snapshot(
        &self,
        request: Request<pb::AbortSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        let r = request.into_inner();
        limits::check_reason(&r.reason)?;
        let record = self
            .ask_write("AbortSnapshot", |reply| Msg::Abort {
                id: SnapshotId(r.snapshot_id),
                reason: r.reason,
                reply,
            })
            .await??;
        Ok(Response::new(snapshot_pb(&record)))
    }

    async fn delete_snapshot(
        &self,
        request: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        let id = SnapshotId(request.into_inner().snapshot_id);
        let bytes_freed = self
            .ask_write("DeleteSnapshot", |reply| Msg::Delete { id, reply })
            .await??;
        Ok(Response::new(pb::DeleteSnapshotResponse { bytes_freed }))
    }

    async fn verify_snapshot(
        &self,
        request: Request<pb::VerifySnapshotRequest>,
    ) -> Result<Response<pb::VerifySnapshotResponse>, Status> {
        self.verify_snapshot_call(request).await
    }

    async fn diff_snapshots(
        &self,
        request: Request<pb::DiffSnapshotsRequest>,
    ) -> Result<Response<pb::SnapshotDiff>, Status> {
        self.diff_snapshots_call(request).await
    }

    async fn restore_snapshot(
        &self,
        request: Request<pb::RestoreSnapshotRequest>,
    ) -> Result<Response<pb::RestoreOperation>, Status> {
        let snapshot_id = SnapshotId(request.into_inner().snapshot_id);
        let record = self
            .ask_write("RestoreSnapshot", |reply| Msg::Restore {
                snapshot_id,
                reply,
            })
            .await??;
        Ok(Response::new(restore_pb(&record)))
    }

    async fn get_restore(
        &self,
        request: Request<pb::GetRestoreRequest>,
    ) -> Result<Response<pb::RestoreOperation>, Status> {
        let id = request.into_inner().restore_id;
        let unknown = || Status::not_found(format!("no restore `{id}`"));
        let epoch = restore_epoch(&id).ok_or_else(unknown)?;
        let record = self.meta.restore(epoch).await?.ok_or_else(unknown)?;
        Ok(Response::new(restore_pb(&record)))
    }

    async fn list_restores(
        &self,
        request: Request<pb::ListRestoresRequest>,
    ) -> Result<Response<pb::ListRestoresResponse>, Status> {
        let limit = match request.into_inner().limit {
            0 => 100,
            n => n as usize,
        };
        let mut records: Vec<RestoreRecord> = self.meta.restores().await?;
        records.sort_by_key(|r| std::cmp::Reverse(r.epoch));
        records.truncate(limit);
        Ok(Response::new(pb::ListRestoresResponse {
            restores: records.iter().map(restore_pb).collect(),
        }))
    }

    async fn has_chunks(
        &self,
        request: Request<pb::HasChunksRequest>,
    ) -> Result<Response<pb::HasChunksResponse>, Status> {
        self.has_chunks_call(request).await
    }

    type ReadSnapshotDataStream = ReceiverStream<Result<pb::SnapshotData, Status>>;

    async fn read_snapshot_data(
        &self,
        request: Request<pb::ReadSnapshotDataRequest>,
    ) -> Result<Response<Self::ReadSnapshotDataStream>, Status> {
        self.read_snapshot_data_call(request).await
    }

    type FetchRestorePartStream = ReceiverStream<Result<pb::RestorePiece, Status>>;

    async fn fetch_restore_part(
        &self,
        request: Request<pb::FetchRestorePartRequest>,
    ) -> Result<Response<Self::FetchRestorePartStream>, Status> {
        self.fetch_restore_part_call(request).await
    }

    async fn list_nodes(
        &self,
        _request: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        if self.replica.is_leading()
            && let Ok(nodes) = self.ask(|reply| Msg::ListNodes { reply }).await
        {
            return Ok(Response::new(nodes));
        }
        Ok(Response::new(self.stored_nodes().await?))
    }

    async fn remove_node(
        &self,
        request: Request<pb::RemoveNodeRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        let r = request.into_inner();
        if r.node_id.is_empty() {
            return Err(Error::InvalidArgument("RemoveNode needs a node_id".into()).into());
        }
        let node = NodeId::new(r.node_id);
        let nodes = self
            .ask_write("RemoveNode", |reply| Msg::RemoveNode { node, reply })
            .await??;
        Ok(Response::new(nodes))
    }

    async fn get_policy(
        &self,
        _request: Request<pb::GetPolicyRequest>,
    ) -> Result<Response<pb::Policy>, Status> {
        if self.replica.is_leading()
            && let Ok(policy) = self.ask(|reply| Msg::GetPolicy { reply }).await
        {
            return Ok(Response::new(policy));
        }
        // The stored policy (or the flags'); the schedule's state is the leader's.
        let stored = self.meta.policy_bytes().await?;
        let chosen = policy::at_start(&self.flags_policy, stored.as_deref(), self.max_in_flight);
        Ok(Response::new(policy::to_pb(
            &chosen.policy,
            chosen.source,
            &Default::default(),
        )))
    }

    async fn get_leadership(
        &self,
        _request: Request<pb::GetLeadershipRequest>,
    ) -> Result<Response<pb::Leadership>, Status> {
        self.get_leadership_call(_request).await
    }

    async fn set_policy(
        &self,
        request: Request<pb::SetPolicyRequest>,
    ) -> Result<Response<pb::Policy>, Status> {
        let request = request.into_inner();
        let policy = self
            .ask_write("SetPolicy", |reply| Msg::SetPolicy { request, reply })
            .await??;
        Ok(Response::new(policy))
    }

    type NodeSessionStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<pb::CoordinatorToNode, Status>> + Send>,
    >;

    async fn node_session(
        &self,
        request: Request<Streaming<pb::NodeToCoordinator>>,
    ) -> Result<Response<Self::NodeSessionStream>, Status> {
        self.node_session_call(request).await
    }

    async fn upload_snapshot_part(
        &self,
        request: Request<Streaming<pb::UploadChunk>>,
    ) -> Result<Response<pb::UploadSnapshotPartResponse>, Status> {
        self.upload_snapshot_part_call(request).await
    }
}

/// A read that found bytes missing or corrupt (`error` DATA_LOSS) reads the snapshot's
/// record again: if retention or a delete removed the snapshot meanwhile, the chunks went
/// with it, and the answer is NOT_FOUND — not a false data-loss alarm. Any other error,
/// or a record still there, is returned as it was.
async fn loss_or_gone(meta: &crate::store::Metadata, id: SnapshotId, error: Error) -> Error {
    if !matches!(error, Error::DataLoss(_)) {
        return error;
    }
    match meta.snapshot(id).await {
        Ok(None) => Error::SnapshotNotFound(id),
        _ => error,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::{AnyKv, Keys, MemoryKv, Metadata};

    /// A read that races retention's delete of the same snapshot answers NOT_FOUND, not
    /// DATA_LOSS (issue 31, finding 7): the record is read again before loss is reported.
    #[tokio::test]
    async fn a_loss_of_a_snapshot_deleted_meanwhile_is_not_found() {
        let meta = Metadata::new(Arc::new(AnyKv::Memory(MemoryKv::default())), Keys::new("c"));
        let loss = || Error::DataLoss("node n1's state: chunk abc is missing".into());
        let gone = loss_or_gone(&meta, SnapshotId(7), loss()).await;
        assert!(
            matches!(gone, Error::SnapshotNotFound(SnapshotId(7))),
            "{gone}"
        );
        assert_eq!(Status::from(gone).code(), tonic::Code::NotFound);
        let record = crate::store::sample_snapshot(7);
        meta.put_snapshot(&record).await.unwrap();
        let still = loss_or_gone(&meta, SnapshotId(7), loss()).await;
        assert!(matches!(still, Error::DataLoss(_)), "{still}");
        let other = loss_or_gone(&meta, SnapshotId(8), Error::Blob("timeout".into())).await;
        assert!(matches!(other, Error::Blob(_)), "{other}");
    }
}
