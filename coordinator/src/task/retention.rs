//! Deleting snapshots: by request and by retention, never one a restore refers to, and
//! collecting the chunks nothing refers to any more — on a task of its own, whose result
//! comes back as [`Msg::Collected`].

use std::collections::BTreeSet;
use std::time::Duration;

use cairn_blob::BlobStore;
use cairn_core::SnapshotId;
use tokio::sync::oneshot;

use super::{Msg, State};
use crate::error::Error;
use crate::leader::election::Leadership;
use crate::store::{Metadata, SnapshotStatus};

/// How long garbage collection waits for uploads in progress before it skips a round.
const GC_WAIT: Duration = Duration::from_secs(2);

impl State {
    /// Deletes snapshot `id` (see `Coordinator/DeleteSnapshot`); `reply` is answered with
    /// the bytes the garbage collection that follows freed, once it ran off this task.
    pub(super) async fn delete(&mut self, id: SnapshotId, reply: DeleteReply) {
        match self.delete_record(id).await {
            Ok(()) => self.collect_garbage(Some(reply)),
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        }
    }

    async fn delete_record(&mut self, id: SnapshotId) -> Result<(), Error> {
        // An end not yet stored is still in progress for the store: deleting its record now
        // would let the end's next store bring it back without its parts.
        if self.engine.is_open(id) {
            return Err(Error::StillInProgress(id));
        }
        if self.get_record(id).await?.is_none() {
            return Err(Error::SnapshotNotFound(id));
        }
        if let Some(restore) = self.engine.restore_holding(id) {
            return Err(Error::HeldByRestore {
                id,
                restore: restore.id.clone(),
                status: restore.status,
            });
        }
        self.meta.delete_snapshot(id).await?;
        tracing::info!(snapshot = id.0, "snapshot deleted");
        Ok(())
    }

    /// Keeps the newest `retention` completed snapshots; deletes older ones.
    pub(super) async fn apply_retention(&mut self) -> Result<(), Error> {
        if self.settings.retention == 0 {
            return Ok(());
        }
        let mut completed: Vec<SnapshotId> = self
            .meta
            .snapshots()
            .await?
            .into_iter()
            .filter(|record| record.status == SnapshotStatus::Completed)
            .map(|record| SnapshotId(record.id))
            .collect();
        completed.sort_unstable();
        let excess = completed.len().saturating_sub(self.settings.retention);
        for id in completed.into_iter().take(excess) {
            if let Some(restore) = self.engine.restore_holding(id) {
                tracing::info!(snapshot = id.0, restore = %restore.id, "retention: kept while a restore refers to it");
                continue;
            }
            self.meta.delete_snapshot(id).await?;
            tracing::info!(snapshot = id.0, "retention: deleted");
        }
        if excess > 0 {
            self.collect_garbage(None);
        }
        Ok(())
    }

    /// Removes chunks no stored part refers to, on a task of its own (a stalled blob store
    /// must not stall this one); `reply`, a deletion's, hears the bytes freed. Skipped while
    /// snapshots are in flight (their parts may be uploading chunks not yet listed anywhere),
    /// and by a collection that finds a hold on the store was taken since it was decided on
    /// here ([`BlobStore::exclusive_since`]). One runs at a time: a deletion during one
    /// waits for the next, which lists the parts after it.
    pub(super) fn collect_garbage(&mut self, reply: Option<DeleteReply>) {
        if let Some(collection) = &mut self.collection {
            collection.next.extend(reply);
            collection.again = true;
            return;
        }
        self.start_collection(reply.into_iter().collect());
    }

    /// Starts a collection that `waiting` hear the end of (nothing freed, at once, while a
    /// snapshot is in flight).
    fn start_collection(&mut self, waiting: Vec<DeleteReply>) {
        if self.engine.in_flight() > 0 {
            for reply in waiting {
                let _ = reply.send(Ok(0));
            }
            return;
        }
        self.collection = Some(Collection {
            waiting,
            next: Vec::new(),
            again: false,
        });
        let since = self.blobs.holds_taken();
        let (meta, blobs) = (self.meta.clone(), self.blobs.clone());
        let (leadership, grace, tx) = (
            self.leadership.clone(),
            self.settings.gc_grace,
            self.self_tx.clone(),
        );
        tokio::spawn(async move {
            let result = collect(&meta, &blobs, &leadership, grace, since).await;
            let _ = tx.send(Msg::Collected { result }).await;
        });
    }

    /// A collection of [`Self::collect_garbage`] came back: the deletions that waited for
    /// it hear what it freed (a failure frees nothing: the snapshot is deleted, its chunks
    /// are kept until a later collection), and one asked for while it ran starts.
    pub(super) fn collected(&mut self, result: Result<u64, Error>) {
        let Some(collection) = self.collection.take() else {
            return;
        };
        let freed = match result {
            Ok(freed) => freed,
            Err(e) => {
                tracing::warn!("garbage collection failed; the chunks are kept: {e}");
                0
            }
        };
        for reply in collection.waiting {
            let _ = reply.send(Ok(freed));
        }
        if collection.again {
            self.start_collection(collection.next);
        }
    }
}

/// The answer a `DeleteSnapshot` waits for: the bytes freed.
pub(super) type DeleteReply = oneshot::Sender<Result<u64, Error>>;

/// A garbage collection under way off the task.
pub(super) struct Collection {
    /// The deletions answered when it ends.
    waiting: Vec<DeleteReply>,
    /// The deletions made while it ran: answered by the next one.
    next: Vec<DeleteReply>,
    /// Another collection is due when this one ends.
    again: bool,
}

impl Collection {
    /// The task ends before the collection came back: the deletions waiting for it are
    /// stored; their chunks go at a later collection (nothing freed now).
    pub(super) fn abandon(self) {
        for reply in self.waiting.into_iter().chain(self.next) {
            let _ = reply.send(Ok(0));
        }
    }
}

/// One garbage collection, off the coordinator's task: every chunk no stored part refers
/// to, older than `grace`, is deleted while the term holds.
async fn collect(
    meta: &Metadata,
    blobs: &BlobStore,
    leadership: &Leadership,
    grace: Duration,
    since: u64,
) -> Result<u64, Error> {
    // Deleting is the one thing the store's fence cannot guard: ask etcd first that the
    // term holds, then check the term before each removal (a watch on the election key
    // ends it within milliseconds of a revoked lease).
    meta.kv().still_leads().await?;
    // No upload or HasChunks answer in progress while it runs, and none since it was
    // decided on (with no snapshot in flight): what they vouch for is in a record before the
    // list below, or they wait for the collection to end.
    let Some(exclusive) = blobs.exclusive_since(GC_WAIT, since).await else {
        tracing::info!("garbage collection skipped: uploads in progress or begun since");
        return Ok(0);
    };
    let mut referenced = BTreeSet::new();
    // Every part, strictly: a chunk that only an unreadable part (or manifest) refers to
    // must not go, so one that cannot be read stops the collection.
    for part in meta.all_parts().await? {
        if let Some(reference) = &part.manifest {
            referenced.insert(reference.sha256.clone());
        }
        let manifest = crate::parts::manifest_of(blobs, &part).await?;
        referenced.extend(manifest.local_state.chunks);
        referenced.extend(manifest.channel_states.chunks);
    }
    blobs
        .collect_garbage(&exclusive, &referenced, grace, || leadership.valid())
        .await
        .map_err(|e| Error::Blob(e.to_string()))
}
