//! The reads users script against: snapshots (one, a page of them, their data streamed,
//! verified chunk by chunk, two compared) and who leads. Every replica answers them from
//! the metadata store; the blob store is read on the caller's own task, never the
//! coordinator's.

use cairn_core::SnapshotId;
use cairn_rpc::v1 as pb;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::{CoordinatorService, DIFF_RESERVE};
use crate::error::Error;
use crate::parts;
use crate::store::SnapshotRecord;
use cairn_proto::stored::convert::{mode_pb, overview_pb, snapshot_pb, status_from_pb};

impl CoordinatorService {
    pub(super) async fn get_snapshot_call(
        &self,
        request: Request<pb::GetSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        let r = request.into_inner();
        let record = self.record(SnapshotId(r.snapshot_id)).await?;
        let mut snapshot = snapshot_pb(&record);
        let parts = self.parts(SnapshotId(r.snapshot_id)).await?;
        // Inline data is read whole: its memory is reserved first, for every part at once
        // (its bytes twice, the chunks read and the messages decoded from them, and each
        // message decoded), and held until the response's body has been sent
        // (`budget::HoldLayer`).
        let mut reserved = Vec::new();
        if r.include_data {
            let bytes = parts
                .iter()
                .fold(0u64, |sum, part| sum.saturating_add(part.inline_memory()));
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

    pub(super) async fn list_snapshots_call(
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
        let all = self.meta.snapshots().await?;
        let overview = overview_pb(&all, self.meta.restores().await?.len());
        let mut records: Vec<SnapshotRecord> = all
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
            overview: Some(overview),
        }))
    }

    pub(super) async fn verify_snapshot_call(
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

    pub(super) async fn diff_snapshots_call(
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

    pub(super) async fn read_snapshot_data_call(
        &self,
        request: Request<pb::ReadSnapshotDataRequest>,
    ) -> Result<Response<ReceiverStream<Result<pb::SnapshotData, Status>>>, Status> {
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
        let rx = parts::read::stream(self.blobs.clone(), self.meta.clone(), id, parts, first);
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    pub(super) async fn get_leadership_call(
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
}
