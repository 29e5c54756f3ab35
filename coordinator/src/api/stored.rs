//! What every replica reads from the metadata store for the calls above: a snapshot's
//! record (with its live progress on the leader), its parts, the roster and members a
//! follower shows, and a follower's `WatchSnapshot`, which follows the stored record.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cairn_core::{NodeId, SnapshotId};
use cairn_rpc::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::CoordinatorService;
use crate::error::Error;
use crate::store::{MemberRecord, PartRecord, SnapshotRecord, SnapshotStatus};
use crate::task::Msg;
use cairn_proto::stored::convert::{now_ms, progress_pb};

/// Most `WatchSnapshot` streams a replica serves at once: on the leader each redraws its
/// progress every second; on a follower that follows the stored record each reads etcd
/// four times a second.
pub(crate) const MAX_FOLLOWS: usize = 256;

/// How often a follower's `WatchSnapshot` reads the record it follows.
const FOLLOW_EVERY: Duration = Duration::from_millis(250);

impl CoordinatorService {
    /// A snapshot's record: stored, or with its live progress while it is in flight (on
    /// the leader; a follower has the stored record).
    pub(super) async fn record(&self, id: SnapshotId) -> Result<SnapshotRecord, Error> {
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
    pub(super) async fn completed(
        &self,
        id: SnapshotId,
        only: &'static str,
    ) -> Result<SnapshotRecord, Error> {
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

    pub(super) async fn parts(&self, id: SnapshotId) -> Result<Vec<PartRecord>, Error> {
        self.meta.parts(id).await
    }

    /// [`loss_or_gone`] with this replica's store.
    pub(super) async fn loss_or_gone(&self, id: SnapshotId, error: Error) -> Error {
        loss_or_gone(&self.meta, id, error).await
    }

    /// A follower's `ListNodes`: the roster and the members as the leader stored them.
    pub(super) async fn stored_nodes(&self) -> Result<pb::ListNodesResponse, Error> {
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
    pub(super) async fn follow(&self, id: SnapshotId) -> Result<WatchStream, Status> {
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
            let mut ended = first.status != SnapshotStatus::InProgress;
            let mut last = Arc::new(first);
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
                if record != *last {
                    last = Arc::new(record);
                    if tx.send(Ok(last.clone())).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(progress_stream(rx, self.uploading.clone(), None))
    }
}

/// How often a watch repeats the progress of a snapshot still running, so that its elapsed
/// time keeps counting while nothing else changes (a node slow to record).
pub(super) const WATCH_TICK: Duration = Duration::from_secs(1);

/// A snapshot's progress as `WatchSnapshot` streams it.
pub(super) type WatchStream = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = Result<pb::SnapshotProgress, Status>> + Send>,
>;

/// The stream of a watch: each record `records` gives, as progress, and while the snapshot
/// runs the last one again every [`WATCH_TICK`] with its elapsed time. Ends when `records`
/// ends (after the snapshot's end) or the watcher goes.
pub(super) fn progress_stream(
    mut records: mpsc::Receiver<Result<Arc<SnapshotRecord>, Status>>,
    uploading: crate::parts::Uploading,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
) -> WatchStream {
    // The stored record's progress, and the bytes of the parts uploading now.
    let progress = move |record: &SnapshotRecord| {
        let mut p = progress_pb(record, now_ms());
        if record.status == SnapshotStatus::InProgress {
            let live = uploading.of(SnapshotId(record.id));
            for n in &mut p.node_progress {
                if !n.stored {
                    n.bytes_uploading = live
                        .get(&NodeId::new(n.node_id.clone()))
                        .copied()
                        .unwrap_or(0);
                }
            }
            p.bytes_uploading = p
                .node_progress
                .iter()
                .fold(0u64, |sum, n| sum.saturating_add(n.bytes_uploading));
        }
        p
    };
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        // Held as long as the stream runs.
        let _permit = permit;
        let mut last: Option<Arc<SnapshotRecord>> = None;
        let mut tick = tokio::time::interval(WATCH_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let running = last
                .as_ref()
                .is_some_and(|r| r.status == SnapshotStatus::InProgress);
            let item = tokio::select! {
                () = tx.closed() => return,
                item = records.recv() => match item {
                    None => return,
                    Some(Err(status)) => Err(status),
                    Some(Ok(record)) => {
                        tick.reset();
                        let now = progress(&record);
                        last = Some(record);
                        Ok(now)
                    }
                },
                _ = tick.tick(), if running => match &last {
                    Some(record) => Ok(progress(record)),
                    None => continue,
                },
            };
            if tx.send(item).await.is_err() {
                return;
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
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
