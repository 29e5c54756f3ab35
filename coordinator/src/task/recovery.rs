//! The restores a previous coordinator left, read at a term's start: superseded ones
//! stored as failed, the newest handed to the engine (resumed if in progress; if failed,
//! the cluster stays fenced and automatic recovery is due). Automatic recovery itself is
//! the engine's (`cairn_core::coordinator`, `restoring.rs`).

use cairn_core::SnapshotId;
use cairn_core::coordinator::Input;

use super::State;
use crate::error::Error;
use crate::store::{RestoreRecord, RestoreStatus};
use cairn_proto::stored::convert::now_ms;

impl State {
    /// At start: the current epoch, and the restores a previous coordinator left. A restore
    /// is durable: one left in progress is resumed (nodes that have not applied it are sent
    /// it again as they register, under a new deadline); the newest one, if it failed,
    /// keeps the cluster fenced until a later restore is applied by every node.
    pub(super) async fn recover_restores(&mut self) -> Result<(), Error> {
        let mut newest: Option<RestoreRecord> = None;
        for record in self.meta.restores().await? {
            if record.status == RestoreStatus::InProgress
                && newest.as_ref().is_some_and(|n| n.epoch > record.epoch)
            {
                // Superseded long ago by a later restore: it can no longer finish.
                let mut record = record;
                record.status = RestoreStatus::Failed;
                record.failure = Some("superseded by a later restore".into());
                record.finished_at_ms = now_ms();
                self.put_restore(&record).await?;
                continue;
            }
            if newest.as_ref().is_none_or(|n| n.epoch < record.epoch) {
                if let Some(mut older) = newest.take()
                    && older.status == RestoreStatus::InProgress
                {
                    older.status = RestoreStatus::Failed;
                    older.failure = Some(format!("superseded by {}", record.id));
                    older.finished_at_ms = now_ms();
                    self.put_restore(&older).await?;
                }
                newest = Some(record);
            }
        }
        // The cluster is in the epoch of its newest restore (the counter may be ahead of it
        // if a coordinator died between allocating an epoch and storing its restore).
        let epoch = newest.as_ref().map_or(0, |r| r.epoch);
        let restored = newest.as_ref().map(|r| SnapshotId(r.snapshot_id));
        let (mut active, mut unfinished) = (None, None);
        match newest {
            Some(record) if record.status == RestoreStatus::InProgress => {
                tracing::warn!(
                    restore = %record.id,
                    snapshot = record.snapshot_id,
                    applied = ?record.applied,
                    "resuming the restore a previous coordinator left in progress: nodes \
                     that have not applied it get it again when they register"
                );
                active = Some(record);
            }
            Some(record) if record.status == RestoreStatus::Failed => {
                tracing::warn!(
                    restore = %record.id,
                    "the newest restore failed: no snapshot starts until a restore is \
                     applied by every node"
                );
                unfinished = Some(record);
            }
            _ => {}
        }
        let loaded = Input::RestoresLoaded {
            epoch,
            active,
            unfinished,
            restored,
        };
        self.drive(loaded).await;
        tracing::info!(epoch, "epoch loaded");
        Ok(())
    }
}
