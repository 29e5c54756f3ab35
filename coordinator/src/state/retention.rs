//! Deleting snapshots: by request and by retention, never one a restore refers to, and
//! collecting the chunks nothing refers to any more.

use std::collections::BTreeSet;

use super::State;
use crate::error::Error;
use crate::store::{Kv, RestoreRecord, SnapshotRecord, SnapshotStatus};

impl State {
    /// The restore that keeps snapshot `id` from being deleted, if any.
    pub(super) fn restore_holding(&self, id: u64) -> Option<&RestoreRecord> {
        self.restore
            .as_ref()
            .map(|a| &a.record)
            .into_iter()
            .chain(self.unfinished_restore.as_ref())
            .find(|r| r.snapshot_id == id)
    }

    pub(super) async fn delete(&mut self, id: u64) -> Result<u64, Error> {
        if self.inflight.contains_key(&id) {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {id} is in progress; abort it first"
            )));
        }
        if self.get_record(id).await?.is_none() {
            return Err(Error::NotFound(id));
        }
        if let Some(restore) = self.restore_holding(id) {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {id} is being restored by {} ({}); it can be deleted once a \
                 restore has finished",
                restore.id, restore.status
            )));
        }
        self.kv.delete_prefix(&self.keys.parts(id)).await?;
        self.kv.delete(&self.keys.snapshot(id)).await?;
        tracing::info!(snapshot = id, "snapshot deleted");
        self.collect_garbage().await
    }

    /// Keeps the newest `retention` completed snapshots; deletes older ones.
    pub(super) async fn apply_retention(&mut self) -> Result<(), Error> {
        if self.settings.retention == 0 {
            return Ok(());
        }
        let mut completed: Vec<u64> = Vec::new();
        for (_, value) in self.kv.list(&self.keys.snapshots()).await? {
            if let Ok(record) = serde_json::from_slice::<SnapshotRecord>(&value)
                && record.status == SnapshotStatus::Completed
            {
                completed.push(record.id);
            }
        }
        completed.sort_unstable();
        let excess = completed.len().saturating_sub(self.settings.retention);
        for id in completed.into_iter().take(excess) {
            if let Some(restore) = self.restore_holding(id) {
                tracing::info!(snapshot = id, restore = %restore.id, "retention: kept while a restore refers to it");
                continue;
            }
            self.kv.delete_prefix(&self.keys.parts(id)).await?;
            self.kv.delete(&self.keys.snapshot(id)).await?;
            tracing::info!(snapshot = id, "retention: deleted");
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
        let mut referenced = BTreeSet::new();
        let parts_root = format!("/cairn/{}/parts/", self.settings.cluster);
        for (_, value) in self.kv.list(&parts_root).await? {
            if let Ok(part) = serde_json::from_slice::<crate::store::PartRecord>(&value) {
                referenced.extend(part.local_state.chunks);
                referenced.extend(part.channel_states.chunks);
            }
        }
        let freed = self
            .blobs
            .collect_garbage(&referenced)
            .await
            .map_err(|e| Error::Blob(e.to_string()))?;
        Ok(freed)
    }
}
