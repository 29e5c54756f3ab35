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
use crate::store::{Metadata, RestoreRecord};
use crate::task::{Msg, mode_of};
use cairn_core::coordinator::restore_epoch;
pub(crate) use stored::MAX_FOLLOWS;
mod nodes;
mod reads;
mod stored;

use cairn_blob::BlobStore;
use cairn_proto::stored::convert::{restore_pb, snapshot_pb};

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
    /// Room for `WatchSnapshot` streams, on the leader or following the stored record
    /// ([`MAX_FOLLOWS`]).
    pub follows: Arc<tokio::sync::Semaphore>,
    /// What responses may hold in memory at once (inline data, diffs).
    pub budget: crate::budget::ResponseBudget,
    /// The bytes of the parts uploading now (`WatchSnapshot`'s progress).
    pub uploading: crate::parts::Uploading,
}

/// What a `DiffSnapshots` call reserves: two manifests' chunk lists per node at a time.
const DIFF_RESERVE: u64 = 16 << 20;

/// How long a daemon's session request waits on a replica that knows no leader yet (below
/// the 10 s a daemon gives a registration).
const ELECTION_HOLD: Duration = Duration::from_secs(8);

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
}

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
        limits::check_request_id(&r.request_id)?;
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
                request_id: r.request_id,
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

    type WatchSnapshotStream = stored::WatchStream;

    async fn watch_snapshot(
        &self,
        request: Request<pb::WatchSnapshotRequest>,
    ) -> Result<Response<Self::WatchSnapshotStream>, Status> {
        let id = SnapshotId(request.into_inner().snapshot_id);
        if self.replica.is_leading() {
            // Each watch's stream redraws its progress every second: at most MAX_FOLLOWS
            // watches on the leader at once, as on a follower.
            let permit = self.follows.clone().try_acquire_owned().map_err(|_| {
                Status::resource_exhausted(format!(
                    "{MAX_FOLLOWS} snapshots are watched on this replica already, the most \
                     allowed: try again later"
                ))
            })?;
            let (tx, rx) = mpsc::channel(64);
            // A term that ends meanwhile: follow the record like a follower.
            if let Ok(answer) = self.ask(|reply| Msg::Watch { id, tx, reply }).await {
                answer?;
                return Ok(Response::new(stored::progress_stream(
                    rx,
                    self.uploading.clone(),
                    Some(permit),
                )));
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
        let request = request.into_inner();
        let (snapshot_id, if_epoch) = (SnapshotId(request.snapshot_id), request.if_epoch);
        let record = self
            .ask_write("RestoreSnapshot", |reply| Msg::Restore {
                snapshot_id,
                if_epoch,
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
            return Ok(Response::new((&nodes).into()));
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
        Ok(Response::new((&nodes).into()))
    }

    async fn get_policy(
        &self,
        _request: Request<pb::GetPolicyRequest>,
    ) -> Result<Response<pb::Policy>, Status> {
        if self.replica.is_leading()
            && let Ok(view) = self.ask(|reply| Msg::GetPolicy { reply }).await
        {
            return Ok(Response::new(policy::view_pb(&view)));
        }
        // The stored policy (or the flags'); the schedule's state is the leader's.
        let stored = self.meta.policy_bytes().await?;
        let chosen = policy::at_start(&self.flags_policy, stored.as_deref(), self.max_in_flight);
        let view = policy::View {
            policy: chosen.policy,
            source: chosen.source,
            status: Default::default(),
        };
        Ok(Response::new(policy::view_pb(&view)))
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
        // A follower refuses it naming the leader, whatever it asks (as every write).
        self.replica.leading()?;
        let change = policy::change_from_pb(request.into_inner())?;
        let view = self
            .ask_write("SetPolicy", |reply| Msg::SetPolicy { change, reply })
            .await??;
        Ok(Response::new(policy::view_pb(&view)))
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
