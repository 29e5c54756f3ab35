//! Deleting snapshots: by request and by retention, never one a restore refers to, and
//! collecting the chunks nothing refers to any more.

use std::collections::BTreeSet;

use super::State;
use cairn_core::SnapshotId;

use crate::error::Error;
use crate::store::{RestoreRecord, SnapshotStatus};

/// How long garbage collection waits for uploads in progress before it skips a round.
const GC_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl State {
    /// The restore that keeps snapshot `id` from being deleted, if any.
    pub(super) fn restore_holding(&self, id: SnapshotId) -> Option<&RestoreRecord> {
        self.restore
            .as_ref()
            .map(|a| &a.record)
            .into_iter()
            .chain(self.unfinished_restore.as_ref())
            .find(|r| r.snapshot_id == id.0)
    }

    pub(super) async fn delete(&mut self, id: SnapshotId) -> Result<u64, Error> {
        // An end not yet stored is still in progress for the store: deleting its record now
        // would let the end's next store bring it back without its parts.
        if self.inflight.contains_key(&id) || self.unstored.contains_key(&id) {
            return Err(Error::StillInProgress(id));
        }
        if self.get_record(id).await?.is_none() {
            return Err(Error::SnapshotNotFound(id));
        }
        if let Some(restore) = self.restore_holding(id) {
            return Err(Error::HeldByRestore {
                id,
                restore: restore.id.clone(),
                status: restore.status,
            });
        }
        self.meta.delete_snapshot(id).await?;
        tracing::info!(snapshot = id.0, "snapshot deleted");
        // The snapshot is gone; chunks a failed collection leaves behind (a part record
        // that does not parse stops it) are freed by a later one.
        match self.collect_garbage().await {
            Ok(freed) => Ok(freed),
            Err(e) => {
                tracing::warn!(
                    snapshot = id.0,
                    "snapshot deleted; its chunks are kept: {e}"
                );
                Ok(0)
            }
        }
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
            if let Some(restore) = self.restore_holding(id) {
                tracing::info!(snapshot = id.0, restore = %restore.id, "retention: kept while a restore refers to it");
                continue;
            }
            self.meta.delete_snapshot(id).await?;
            tracing::info!(snapshot = id.0, "retention: deleted");
        }
        if excess > 0 {
            self.collect_garbage().await?;
        }
        Ok(())
    }

    /// Removes chunks no stored part refers to. Skipped while snapshots are in flight:
    /// their parts may be uploading chunks not yet listed anywhere.
    pub(super) async fn collect_garbage(&self) -> Result<u64, Error> {
        if !self.inflight.is_empty() {
            return Ok(0);
        }
        // Deleting is the one thing the store's fence cannot guard: ask etcd first that the
        // term holds, then check the term before each removal (a watch on the election key
        // ends it within milliseconds of a revoked lease).
        self.meta.kv().still_leads().await?;
        // No upload or HasChunks answer in progress while it runs (a snapshot that failed
        // may still be uploading): what they vouch for is in a record before the list below.
        let Some(exclusive) = self.blobs.exclusive(GC_WAIT).await else {
            tracing::info!("garbage collection skipped: uploads still in progress");
            return Ok(0);
        };
        let mut referenced = BTreeSet::new();
        // Every part, strictly: a chunk that only an unreadable part (or manifest) refers to
        // must not go, so one that cannot be read stops the collection.
        for part in self.meta.all_parts().await? {
            if let Some(reference) = &part.manifest {
                referenced.insert(reference.sha256.clone());
            }
            let manifest = crate::parts::manifest_of(&self.blobs, &part).await?;
            referenced.extend(manifest.local_state.chunks);
            referenced.extend(manifest.channel_states.chunks);
        }
        let freed = self
            .blobs
            .collect_garbage(&exclusive, &referenced, self.settings.gc_grace, || {
                self.leadership.valid()
            })
            .await
            .map_err(|e| Error::Blob(e.to_string()))?;
        Ok(freed)
    }
}
