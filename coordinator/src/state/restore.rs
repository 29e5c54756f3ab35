//! Restores, as the coordinator's task runs them: checks, the epoch fence, the command to
//! every node, their acknowledgements, the deadline, the record in the metadata store, and
//! automatic recovery after a member restarts.

use std::collections::BTreeSet;

use cairn_core::restore::{RestoreProgress, RestoreState};
use cairn_core::{FailureReason, NodeId, SnapshotId};
use cairn_proto::v1 as pb;

use super::{Msg, State};
use crate::error::Error;
use crate::records_conv::now_ms;
use crate::store::{Kv, RestoreRecord, SnapshotRecord};

/// The restore under way.
pub(crate) struct ActiveRestore {
    pub record: RestoreRecord,
    pub progress: RestoreProgress,
}

/// The wire form of a restore record.
pub(crate) fn restore_pb(r: &RestoreRecord) -> pb::RestoreOperation {
    pb::RestoreOperation {
        restore_id: r.id.clone(),
        snapshot_id: r.snapshot_id,
        epoch: r.epoch,
        applied: r.applied.clone(),
        done: r.status == "DONE",
        failure: r.failure.as_ref().map(|message| pb::FailureReason {
            kind: pb::failure_reason::Kind::Restore as i32,
            message: message.clone(),
            ..Default::default()
        }),
        requested_by: r.requested_by.clone(),
        started_at_ms: r.started_at_ms,
        nodes: r.nodes.clone(),
        finished_at_ms: r.finished_at_ms,
    }
}

/// The epoch a restore id names (`restore-<epoch>`).
pub(crate) fn restore_epoch(id: &str) -> Option<u64> {
    id.strip_prefix("restore-")?.parse().ok()
}

impl State {
    /// Whether a restore is under way, and which.
    pub(super) fn restore_in_progress(&self) -> Option<&str> {
        self.restore.as_ref().map(|r| r.record.id.as_str())
    }

    /// Starts restoring `snapshot_id`; see `Coordinator/RestoreSnapshot`.
    pub(super) async fn restore(
        &mut self,
        snapshot_id: u64,
        requested_by: String,
    ) -> Result<RestoreRecord, Error> {
        if let Some(active) = &self.restore {
            return Err(Error::FailedPrecondition(format!(
                "{} (of snapshot {}) is in progress",
                active.record.id, active.record.snapshot_id
            )));
        }
        let snapshot = self
            .get_record(snapshot_id)
            .await?
            .ok_or(Error::NotFound(snapshot_id))?;
        if snapshot.status != "COMPLETED" {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {snapshot_id} is {}; only a COMPLETED snapshot can be restored",
                snapshot.status
            )));
        }
        let nodes: BTreeSet<NodeId> = snapshot.nodes.iter().map(NodeId::new).collect();
        let missing: Vec<&str> = nodes
            .iter()
            .filter(|n| !self.members.contains_key(*n))
            .map(NodeId::as_str)
            .collect();
        if !missing.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "cannot restore snapshot {snapshot_id}: not connected to the coordinator: {} \
                 (every node of the snapshot must be)",
                missing.join(", ")
            )));
        }
        let extra: Vec<&str> = self
            .roster
            .keys()
            .filter(|n| !nodes.contains(*n))
            .map(NodeId::as_str)
            .collect();
        if !extra.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "cannot restore snapshot {snapshot_id}: {} joined after it was taken and \
                 has no state in it",
                extra.join(", ")
            )));
        }
        // The fence: from here on, frames of the old epoch are dropped wherever they are.
        let epoch = self.kv.fetch_increment(&self.keys.epoch()).await? + 1;
        self.epoch = epoch;
        let in_flight: Vec<u64> = self.inflight.keys().copied().collect();
        for id in in_flight {
            let update = self.tracker.fail(SnapshotId(id), FailureReason::Restore);
            self.settle(id, update).await;
        }
        let record = RestoreRecord {
            id: format!("restore-{epoch}"),
            snapshot_id,
            epoch,
            nodes: nodes.iter().map(ToString::to_string).collect(),
            applied: Vec::new(),
            status: "IN_PROGRESS".into(),
            failure: None,
            requested_by,
            started_at_ms: now_ms(),
            finished_at_ms: 0,
        };
        self.put_restore(&record).await?;
        let command = pb::NodeRestore {
            restore_id: record.id.clone(),
            snapshot_id,
            epoch,
        };
        for node in &nodes {
            if let Some(member) = self.members.get(node) {
                let _ = member.tx.try_send(Ok(pb::CoordinatorToNode {
                    kind: Some(pb::coordinator_to_node::Kind::Restore(command.clone())),
                }));
            }
        }
        let tx = self.self_tx.clone();
        let timeout = self.settings.restore_timeout;
        tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            let _ = tx.send(Msg::RestoreTimedOut { epoch }).await;
        });
        tracing::warn!(
            restore = %record.id,
            snapshot = snapshot_id,
            epoch,
            by = %record.requested_by,
            "restore started: the cluster is fenced with a new epoch"
        );
        self.restore = Some(ActiveRestore {
            record: record.clone(),
            progress: RestoreProgress::new(nodes),
        });
        Ok(record)
    }

    /// A node's application applied its restored state.
    pub(super) async fn restore_applied(&mut self, node: &NodeId, restore_id: &str) {
        let Some(active) = self.restore.as_mut().filter(|a| a.record.id == restore_id) else {
            return;
        };
        active.progress.node_applied(node);
        active.record.applied = active
            .progress
            .applied()
            .iter()
            .map(ToString::to_string)
            .collect();
        tracing::info!(restore = %restore_id, %node, "node applied the restored state");
        self.restore_moved().await;
    }

    /// A node could not restore, or was lost.
    pub(super) async fn restore_node_failed(
        &mut self,
        node: &NodeId,
        restore_id: Option<&str>,
        why: &str,
    ) {
        let Some(active) = self
            .restore
            .as_mut()
            .filter(|a| restore_id.is_none_or(|id| a.record.id == id))
        else {
            return;
        };
        if active.progress.node_failed(node, why) {
            self.restore_moved().await;
        }
    }

    /// The restore's deadline passed.
    pub(super) async fn restore_timed_out(&mut self, epoch: u64) {
        let Some(active) = self.restore.as_mut().filter(|a| a.record.epoch == epoch) else {
            return;
        };
        if active.progress.timed_out() {
            self.restore_moved().await;
        }
    }

    /// Stores the restore's progress; if it ended, records how and lets snapshots start.
    async fn restore_moved(&mut self) {
        let Some(active) = self.restore.as_mut() else {
            return;
        };
        match active.progress.state().clone() {
            RestoreState::InProgress => {}
            RestoreState::Done => {
                active.record.status = "DONE".into();
                active.record.finished_at_ms = now_ms();
                tracing::info!(
                    restore = %active.record.id,
                    snapshot = active.record.snapshot_id,
                    ms = active.record.finished_at_ms - active.record.started_at_ms,
                    "restore done: every node runs on the restored state"
                );
            }
            RestoreState::Failed(why) => {
                active.record.status = "FAILED".into();
                active.record.finished_at_ms = now_ms();
                tracing::error!(
                    restore = %active.record.id,
                    snapshot = active.record.snapshot_id,
                    "restore failed: {why}; restore a snapshot again to bring every node to one state"
                );
                active.record.failure = Some(why);
            }
        }
        let record = active.record.clone();
        if let Err(e) = self.put_restore(&record).await {
            tracing::error!(restore = %record.id, "cannot store the restore record: {e}");
        }
        if record.status != "IN_PROGRESS" {
            self.restore = None;
            self.maybe_auto_restore().await;
        }
    }

    /// Automatic recovery: once a restarted member and every other one are connected (and
    /// no restore runs), restores the newest completed snapshot.
    pub(super) async fn maybe_auto_restore(&mut self) {
        let Some(reason) = self.pending_recovery.clone() else {
            return;
        };
        if self.restore.is_some() || self.roster.keys().any(|n| !self.members.contains_key(n)) {
            return; // again when that changes
        }
        self.pending_recovery = None;
        let newest = match self.newest_completed().await {
            Ok(newest) => newest,
            Err(e) => {
                tracing::error!("automatic recovery ({reason}): cannot list snapshots: {e}");
                return;
            }
        };
        let Some(snapshot) = newest else {
            tracing::error!(
                "automatic recovery ({reason}): no completed snapshot to restore; the \
                 cluster runs on as it is"
            );
            return;
        };
        if let Err(e) = self
            .restore(snapshot.id, format!("automatic recovery ({reason})"))
            .await
        {
            tracing::error!(
                snapshot = snapshot.id,
                "automatic recovery ({reason}) could not restore: {e}"
            );
        }
    }

    async fn newest_completed(&self) -> Result<Option<SnapshotRecord>, Error> {
        let mut newest: Option<SnapshotRecord> = None;
        for (_, value) in self.kv.list(&self.keys.snapshots()).await? {
            if let Ok(record) = serde_json::from_slice::<SnapshotRecord>(&value)
                && record.status == "COMPLETED"
                && newest.as_ref().is_none_or(|n| n.id < record.id)
            {
                newest = Some(record);
            }
        }
        Ok(newest)
    }

    async fn put_restore(&self, record: &RestoreRecord) -> Result<(), Error> {
        let value = serde_json::to_vec_pretty(record).expect("plain record");
        Ok(self.kv.put(&self.keys.restore(record.epoch), value).await?)
    }

    /// At start: the current epoch, and restores a previous coordinator left running
    /// marked failed.
    pub(super) async fn recover_restores(&mut self) -> Result<(), Error> {
        if let Some(value) = self.kv.get(&self.keys.epoch()).await? {
            self.epoch = String::from_utf8_lossy(&value).trim().parse().unwrap_or(0);
        }
        for (key, value) in self.kv.list(&self.keys.restores()).await? {
            let Ok(mut record) = serde_json::from_slice::<RestoreRecord>(&value) else {
                tracing::warn!(%key, "skipping an unreadable restore record");
                continue;
            };
            if record.status == "IN_PROGRESS" {
                record.status = "FAILED".into();
                record.failure = Some("the coordinator restarted during the restore".into());
                record.finished_at_ms = now_ms();
                tracing::warn!(restore = %record.id, "restore failed: coordinator restarted");
                self.put_restore(&record).await?;
            }
        }
        tracing::info!(epoch = self.epoch, "epoch loaded");
        Ok(())
    }
}
