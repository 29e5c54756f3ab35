//! `cairn.v1.Coordinator`: what users script against, and what node daemons use to keep
//! a session and upload their parts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cairn_core::{NodeId, SnapshotId, StartRequest};
use cairn_proto::convert::channel_from_pb;
use cairn_rpc::server::identity::{Peer, check_node};
use cairn_rpc::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::election::Elector;
use crate::error::Error;
use crate::limits;
use crate::parts;
use crate::policy;
use crate::replica::Replica;
use crate::state::{Msg, PartSizes, mode_of, restore_epoch, restore_pb};
use crate::store::{
    MemberRecord, Metadata, PartRecord, RestoreRecord, SnapshotRecord, SnapshotStatus,
};
use cairn_blob::BlobStore;
use cairn_proto::stored::convert::{mode_pb, progress_pb, snapshot_pb, status_from_pb};

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
        let r = request.into_inner();
        let record = self.record(SnapshotId(r.snapshot_id)).await?;
        let mut snapshot = snapshot_pb(&record);
        let parts = self.parts(SnapshotId(r.snapshot_id)).await?;
        // Inline data is read whole: its bytes are reserved first, for every part at once
        // (twice: the chunks read and the messages decoded from them), and held until the
        // response's body has been sent (`budget::HoldLayer`).
        let mut reserved = Vec::new();
        if r.include_data {
            let bytes = parts.iter().fold(0u64, |sum, part| {
                sum.saturating_add(
                    part.local_state_bytes
                        .saturating_add(part.recorded_bytes())
                        .saturating_mul(2),
                )
            });
            let what = format!("snapshot {}'s inline data", r.snapshot_id);
            reserved.push(self.budget.reserve(bytes, &what)?);
        }
        for part in &parts {
            let full = match parts::read_part(&self.blobs, part, r.include_data).await {
                Ok(full) => full,
                Err(e) => return Err(self.loss_or_gone(SnapshotId(r.snapshot_id), e).await.into()),
            };
            if let Some(slot) = snapshot.nodes.iter_mut().find(|n| n.node_id == part.node) {
                *slot = full;
            }
        }
        let mut response = Response::new(snapshot);
        response
            .extensions_mut()
            .insert(crate::budget::Held::new(reserved));
        Ok(response)
    }

    async fn list_snapshots(
        &self,
        request: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let r = request.into_inner();
        let status = pb::SnapshotStatus::try_from(r.status)
            .map_err(|_| Error::InvalidArgument(format!("unknown status {}", r.status)))?;
        let wanted = status_from_pb(status);
        let mode = pb::SnapshotMode::try_from(r.mode)
            .map_err(|_| Error::InvalidArgument(format!("unknown mode {}", r.mode)))?;
        let mode = (mode != pb::SnapshotMode::Unspecified).then_some(mode);
        let page_size = if r.page_size == 0 {
            100
        } else {
            r.page_size.min(1000)
        } as usize;
        let before: u64 = if r.page_token.is_empty() {
            u64::MAX
        } else {
            r.page_token
                .parse()
                .map_err(|_| Error::InvalidArgument(format!("bad page token `{}`", r.page_token)))?
        };
        let mut records: Vec<SnapshotRecord> = self
            .meta
            .snapshots()
            .await?
            .into_iter()
            .filter(|r| r.id < before)
            .filter(|r| wanted.is_none_or(|w| r.status == w))
            .filter(|r| mode.is_none_or(|m| mode_pb(&r.mode) == m))
            .collect();
        records.sort_by_key(|r| std::cmp::Reverse(r.id));
        let more = records.len() > page_size;
        records.truncate(page_size);
        let next_page_token = if more {
            records.last().map(|r| r.id.to_string()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListSnapshotsResponse {
            snapshots: records.iter().map(snapshot_pb).collect(),
            next_page_token,
        }))
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
        let id = SnapshotId(request.into_inner().snapshot_id);
        let record = self.completed(id, "has data to verify").await?;
        let parts = self.parts(id).await?;
        let (chunks, bytes) = match parts::verify(&self.blobs, id, &record, &parts).await {
            Ok(verified) => verified,
            Err(e) => return Err(self.loss_or_gone(id, e).await.into()),
        };
        Ok(Response::new(pb::VerifySnapshotResponse {
            snapshot_id: id.0,
            chunks,
            bytes,
        }))
    }

    async fn diff_snapshots(
        &self,
        request: Request<pb::DiffSnapshotsRequest>,
    ) -> Result<Response<pb::SnapshotDiff>, Status> {
        let r = request.into_inner();
        let (from, to) = (SnapshotId(r.from_snapshot_id), SnapshotId(r.to_snapshot_id));
        self.record(from).await?;
        self.record(to).await?;
        let (parts_from, parts_to) = (self.parts(from).await?, self.parts(to).await?);
        let reserved = self.budget.reserve(
            DIFF_RESERVE,
            &format!("the diff of snapshots {from} and {to}"),
        )?;
        let nodes = parts::diff(&self.blobs, &parts_from, &parts_to).await?;
        let mut response = Response::new(pb::SnapshotDiff {
            from_snapshot_id: from.0,
            to_snapshot_id: to.0,
            nodes,
        });
        response
            .extensions_mut()
            .insert(crate::budget::Held::new(vec![reserved]));
        Ok(response)
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
        let present = r
            .sha256
            .iter()
            .map(|hash| <[u8; 32]>::try_from(hash.as_ref()).map(|h| self.blobs.has(&h)))
            .collect::<Result<Vec<bool>, _>>()
            .map_err(|_| Error::InvalidArgument("a chunk's sha256 is 32 bytes".into()))?;
        Ok(Response::new(pb::HasChunksResponse { present }))
    }

    type ReadSnapshotDataStream = ReceiverStream<Result<pb::SnapshotData, Status>>;

    async fn read_snapshot_data(
        &self,
        request: Request<pb::ReadSnapshotDataRequest>,
    ) -> Result<Response<Self::ReadSnapshotDataStream>, Status> {
        let r = request.into_inner();
        let id = SnapshotId(r.snapshot_id);
        self.completed(id, "has data to read").await?;
        let mut parts = self.parts(id).await?;
        if !r.node_id.is_empty() {
            parts.retain(|p| p.node == r.node_id);
            if parts.is_empty() {
                return Err(Error::NoPart {
                    id,
                    node: r.node_id,
                }
                .into());
            }
        }
        // One manifest at a time (each may be tens of MiB); the first before answering, so a
        // missing one fails the call itself.
        let first = match parts.first() {
            Some(part) => match parts::manifest_of(&self.blobs, part).await {
                Ok(manifest) => Some(manifest),
                Err(e) => return Err(self.loss_or_gone(id, e).await.into()),
            },
            None => None,
        };
        let (tx, rx) = mpsc::channel(4);
        let blobs = self.blobs.clone();
        // A loss found while streaming is checked the same way before it is sent.
        let (stream_tx, mut stream_rx) = mpsc::channel::<Result<pb::SnapshotData, Status>>(4);
        let meta = self.meta.clone();
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
                    None => match parts::manifest_of(&blobs, &part).await {
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
                    parts::send_chunks(&blobs, &manifest.local_state, &what, &tx, |bytes| {
                        data(Kind::LocalState(bytes))
                    })
                    .await
                else {
                    return;
                };
                let what = format!("snapshot {id}: node {node}'s channel states");
                let mut decoder = parts::ChannelStateDecoder::default();
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
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type FetchRestorePartStream = ReceiverStream<Result<pb::RestorePiece, Status>>;

    async fn fetch_restore_part(
        &self,
        request: Request<pb::FetchRestorePartRequest>,
    ) -> Result<Response<Self::FetchRestorePartStream>, Status> {
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
        // Every part may hold recorded messages of this node's channels: the receiver's
        // (in flight to it) or, unaligned, the sender's (still queued there).
        let mut recorded = Vec::new();
        for part in &parts {
            for state in parts::channel_states(&self.blobs, part).await? {
                let channel = channel_from_pb(state.channel.as_ref()).map_err(|e| {
                    Error::DataLoss(format!("node {}'s channel states: {e}", part.node))
                })?;
                // Only the messages a part's own node recorded on its own channels (older
                // parts were stored before uploads were checked for that).
                let own = parts::touches(&NodeId::new(part.node.clone()), &channel, "").is_ok();
                if own && (channel.to.as_str() == r.node_id || channel.from.as_str() == r.node_id) {
                    for m in state.messages {
                        recorded.push((channel.clone(), m.index, m.payload));
                    }
                }
            }
        }
        let plan = cairn_core::restore::replay(recorded);
        let manifest = parts::manifest_of(&self.blobs, &own).await?;
        let (tx, rx) = mpsc::channel(4);
        let blobs = self.blobs.clone();
        let node = r.node_id;
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
                parts::send_chunks(&blobs, &manifest.local_state, &what, &tx, state).await
            else {
                return;
            };
            let _ = tx
                .send(piece(Kind::End(pb::RestoreEnd { state_bytes })))
                .await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
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
        let own = self.replica.own().to_owned();
        if self.elector.is_none() {
            // The embedded store: this coordinator is the only one, the leader of term 0.
            return Ok(Response::new(pb::Leadership {
                leader: own.clone(),
                term: 0,
                replicas: vec![pb::CoordinatorReplica {
                    address: own.clone(),
                    revision: 0,
                    leader: true,
                }],
                answered_by: own,
            }));
        }
        // As last read (every 200 ms): a viewer cannot multiply etcd's reads. The leader
        // answers its own term exactly (what it read may lag its election by a poll).
        let replicas = self.replica.known();
        let (leader, term) = match self.replica.leading() {
            Ok(leading) => (own.clone(), leading.leadership.term()),
            Err(_) => replicas
                .leader()
                .map(|(a, t)| (a.to_owned(), t))
                .unwrap_or_default(),
        };
        let mut list: Vec<pb::CoordinatorReplica> = replicas
            .list
            .iter()
            .map(|(address, revision)| pb::CoordinatorReplica {
                address: address.clone(),
                revision: *revision,
                leader: *revision == term && *address == leader,
            })
            .collect();
        if term > 0 && !list.iter().any(|r| r.leader) {
            list.insert(
                0,
                pb::CoordinatorReplica {
                    address: leader.clone(),
                    revision: term,
                    leader: true,
                },
            );
        }
        Ok(Response::new(pb::Leadership {
            leader,
            term,
            replicas: list,
            answered_by: own,
        }))
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
                register,
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
                item
            } else {
                Err(Status::unavailable(format!(
                    "coordinator term {} ended: reconnect to the leader",
                    leadership.term()
                )))
            }
        });
        Ok(Response::new(Box::pin(commands)))
    }

    async fn upload_snapshot_part(
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
        let stored = match parts::store_upload(&self.blobs, &header, &mut chunks).await {
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
/// second `Register`).
fn session_msg(node: &NodeId, kind: pb::node_to_coordinator::Kind) -> Option<Msg> {
    use pb::node_to_coordinator::Kind;
    let node = node.clone();
    Some(match kind {
        Kind::Snapshot(event) => Msg::NodeEvent { node, event },
        Kind::Heartbeat(beat) => {
            // Only the node's own channels, and not more than a node can have.
            let mut channels = beat.channels;
            channels.retain(|c| {
                c.channel
                    .as_ref()
                    .is_some_and(|c| c.from == node.as_str() || c.to == node.as_str())
            });
            channels.truncate(crate::state::MAX_HEARTBEAT_CHANNELS);
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
        Kind::Register(_) => return None,
    })
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
