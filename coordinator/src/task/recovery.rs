//! Restores across terms and restarts: automatic recovery (the newest completed snapshot
//! that verifies, once every member is connected) and, at a term's start, the restores a
//! previous coordinator left.

use cairn_core::coordinator::Input;

use super::State;
use super::restore::{AUTO_RESTORE_CANDIDATES, RECOVERY_BACKOFF, Requester};
use crate::error::Error;
use crate::store::{RestoreRecord, RestoreStatus, SnapshotRecord, SnapshotStatus};
use cairn_proto::stored::convert::now_ms;

impl State {
    /// Automatic recovery: once a restarted member and every other one are connected (and
    /// no restore runs), restores the newest completed snapshot.
    pub(super) async fn maybe_auto_restore(&mut self) {
        let Some(reason) = self.pending_recovery.clone() else {
            return;
        };
        if self.engine.active_restore().is_some()
            || self.verifying.is_some()
            || !self.engine.all_connected()
            || tokio::time::Instant::now() < self.recovery_not_before
        {
            return; // again when that changes (a registration, a restore's end, a tick)
        }
        self.pending_recovery = None;
        // Until a restore starts, the recovery stays due (tried again after a pause).
        let retry = |state: &mut Self| {
            state.pending_recovery = Some(reason.clone());
            state.recovery_not_before = tokio::time::Instant::now() + RECOVERY_BACKOFF;
        };
        let completed = match self.completed_newest_first().await {
            Ok(completed) => completed,
            Err(e) => {
                tracing::error!("automatic recovery ({reason}): cannot list snapshots: {e}");
                retry(self);
                return;
            }
        };
        if completed.is_empty() {
            tracing::error!(
                "automatic recovery ({reason}): no completed snapshot; the cluster runs on as it is"
            );
            return;
        }
        // The newest snapshot whose every chunk verifies, found off this task; the ones
        // passed over are named ([`Self::verified`]).
        let candidates = completed
            .into_iter()
            .take(AUTO_RESTORE_CANDIDATES)
            .collect();
        self.verify_off_task(candidates, Requester::Recovery(reason));
    }

    async fn completed_newest_first(&self) -> Result<Vec<SnapshotRecord>, Error> {
        let mut completed: Vec<SnapshotRecord> = self
            .meta
            .snapshots()
            .await?
            .into_iter()
            .filter(|record| record.status == SnapshotStatus::Completed)
            .collect();
        completed.sort_by_key(|r| std::cmp::Reverse(r.id));
        Ok(completed)
    }
}

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
                if self.settings.auto_restore {
                    // The recovery a previous coordinator had pending goes on here.
                    self.pending_recovery = Some(format!("{} failed", record.id));
                }
                unfinished = Some(record);
            }
            _ => {}
        }
        let loaded = Input::RestoresLoaded {
            epoch,
            active,
            unfinished,
        };
        self.drive(loaded).await;
        tracing::info!(epoch, "epoch loaded");
        Ok(())
    }
}
