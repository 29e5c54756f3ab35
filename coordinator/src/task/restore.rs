//! Restores, as the coordinator's task starts them: the checks (the snapshot completed,
//! every node of it connected, none joined since), the verification of every chunk off
//! this task, the epoch allocated; then the engine's restore role fails the snapshots in
//! flight, stores the record, tells the nodes and follows their acknowledgements and the
//! deadline. Automatic recovery and a term's resumption are `recovery.rs`'s.

use std::collections::BTreeSet;

use cairn_core::coordinator::{Answer, Input, Refusal};
use cairn_core::{NodeId, SnapshotId};

use tokio::sync::oneshot;

use super::{Msg, State};
use crate::error::Error;
use crate::store::{RestoreRecord, RestoreStatus, SnapshotRecord, SnapshotStatus};
use cairn_proto::stored::convert::now_ms;

/// How many of the newest completed snapshots automatic recovery tries to verify.
pub(super) const AUTO_RESTORE_CANDIDATES: usize = 10;

/// How long automatic recovery waits before trying again after a failure.
pub(super) const RECOVERY_BACKOFF: std::time::Duration = std::time::Duration::from_secs(5);

/// The answer a user's `RestoreSnapshot` waits for.
pub(super) type RestoreReply = oneshot::Sender<Result<RestoreRecord, Error>>;

/// Who asked for a restore being verified.
pub(super) enum Requester {
    /// A user's `RestoreSnapshot`, answered when the verification comes back.
    User(RestoreReply),
    /// Automatic recovery, and why it is due.
    Recovery(String),
}

/// A restore whose snapshot is being verified off the task ([`State::verify_off_task`]):
/// no other restore starts until it comes back.
pub(super) struct Verification {
    /// The snapshots tried, in order (automatic recovery tries the newest few).
    snapshots: Vec<SnapshotId>,
    requester: Requester,
}

impl Verification {
    /// The task ends before the verification came back: a user's restore hears that
    /// nothing was fenced or stored (UNAVAILABLE: ask the next leader).
    pub(super) fn abandon(self) {
        if let Requester::User(reply) = self.requester {
            let _ = reply.send(Err(Error::ShuttingDown));
        }
    }
}

impl State {
    /// Starts restoring `snapshot_id` (see `Coordinator/RestoreSnapshot`): checks what can
    /// be checked at once, then verifies every chunk of the snapshot off this task
    /// ([`Verification`]); `reply` is answered when the verification comes back
    /// ([`Self::verified`]) and the restore is fenced, or refused.
    pub(super) async fn restore(&mut self, snapshot_id: SnapshotId, reply: RestoreReply) {
        let snapshot = match self.check_restore(snapshot_id).await {
            Ok((snapshot, _)) => snapshot,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        self.verify_off_task(vec![snapshot], Requester::User(reply));
    }

    /// Verifies `candidates` in order on a task of its own until one verifies: the blob
    /// store is read there, never on this task (a stalled store must not stall heartbeats,
    /// registrations and snapshot starts). Its outcome comes back as [`Msg::Verified`].
    pub(super) fn verify_off_task(
        &mut self,
        candidates: Vec<SnapshotRecord>,
        requester: Requester,
    ) {
        self.verifying = Some(Verification {
            snapshots: candidates.iter().map(|s| SnapshotId(s.id)).collect(),
            requester,
        });
        let (meta, blobs, tx) = (self.meta.clone(), self.blobs.clone(), self.self_tx.clone());
        tokio::spawn(async move {
            let mut skipped = Vec::new();
            let mut chosen = None;
            for snapshot in candidates {
                let id = SnapshotId(snapshot.id);
                let verified = match meta.parts(id).await {
                    Ok(parts) => crate::parts::verify(&blobs, id, &snapshot, &parts)
                        .await
                        .map(|_| ()),
                    Err(e) => Err(e),
                };
                match verified {
                    Ok(()) => {
                        chosen = Some(id);
                        break;
                    }
                    Err(e) => skipped.push((id, e)),
                }
            }
            let _ = tx.send(Msg::Verified { chosen, skipped }).await;
        });
    }

    /// A verification of [`Self::verify_off_task`] came back: the restore it was for starts
    /// (checked once more: members, the roster and the snapshot may have changed while it
    /// ran), or is refused naming why; automatic recovery names the snapshots it passed over.
    pub(super) async fn verified(
        &mut self,
        chosen: Option<SnapshotId>,
        mut skipped: Vec<(SnapshotId, Error)>,
    ) {
        let Some(verification) = self.verifying.take() else {
            return;
        };
        let requested_by = match &verification.requester {
            Requester::User(_) => "user".to_owned(),
            Requester::Recovery(reason) => format!("automatic recovery ({reason})"),
        };
        if let Requester::Recovery(_) = &verification.requester {
            for (id, e) in &skipped {
                tracing::error!(
                    snapshot = id.0,
                    "{requested_by} passes over snapshot {id}: {e}"
                );
            }
        }
        let result = match chosen {
            Some(id) => {
                let passed_over = skipped
                    .iter()
                    .map(|(id, e)| format!("snapshot {id}: {e}"))
                    .collect();
                self.restore_with(id, requested_by.clone(), passed_over)
                    .await
            }
            // Never empty: a verification has a candidate, and each is chosen or skipped.
            None => Err(skipped.pop().map_or_else(
                || Error::Blob("no snapshot was verified".into()),
                |(_, e)| e,
            )),
        };
        match verification.requester {
            Requester::User(reply) => {
                let _ = reply.send(result);
            }
            Requester::Recovery(reason) => {
                let Err(e) = result else { return };
                if chosen.is_some() {
                    tracing::error!("{requested_by} could not restore: {e}");
                } else {
                    tracing::error!(
                        "{requested_by}: no completed snapshot that verifies (of the newest \
                         {AUTO_RESTORE_CANDIDATES}); the cluster runs on as it is"
                    );
                }
                // Perhaps the store answers again later: tried again after a pause.
                self.pending_recovery = Some(reason);
                self.recovery_not_before = tokio::time::Instant::now() + RECOVERY_BACKOFF;
            }
        }
    }

    /// What a restore of `snapshot_id` needs now: no restore under way or being verified,
    /// the snapshot completed, every node of it connected, and no node joined since.
    async fn check_restore(
        &self,
        snapshot_id: SnapshotId,
    ) -> Result<(SnapshotRecord, BTreeSet<NodeId>), Error> {
        if let Some(e) = self.restore_in_progress() {
            return Err(e);
        }
        if let Some(verifying) = &self.verifying {
            return Err(Error::RestoreInProgress {
                restore: "a restore whose snapshot is being verified".into(),
                snapshot: verifying.snapshots.first().copied().unwrap_or(snapshot_id),
            });
        }
        let snapshot = self
            .get_record(snapshot_id)
            .await?
            .ok_or(Error::SnapshotNotFound(snapshot_id))?;
        if snapshot.status != SnapshotStatus::Completed {
            return Err(Error::NotCompleted {
                id: snapshot_id,
                status: snapshot.status,
                only: "can be restored",
            });
        }
        let nodes: BTreeSet<NodeId> = snapshot.nodes.iter().map(NodeId::new).collect();
        let missing = self.not_connected(nodes.iter());
        if !missing.is_empty() {
            return Err(Error::NodesNotConnected(format!(
                "cannot restore snapshot {snapshot_id}: not connected to the coordinator: {} \
                 (every node of the snapshot must be)",
                missing.join(", ")
            )));
        }
        let extra: Vec<&str> = self
            .engine
            .roster_nodes()
            .filter(|n| !nodes.contains(*n))
            .map(NodeId::as_str)
            .collect();
        if !extra.is_empty() {
            return Err(Error::JoinedSince {
                snapshot: snapshot_id,
                nodes: extra.iter().map(ToString::to_string).collect(),
            });
        }
        Ok((snapshot, nodes))
    }

    /// Fences and starts the restore of `snapshot_id`, whose chunks verified, noting the
    /// snapshots automatic recovery passed over.
    async fn restore_with(
        &mut self,
        snapshot_id: SnapshotId,
        requested_by: String,
        skipped: Vec<String>,
    ) -> Result<RestoreRecord, Error> {
        // Checked again: the verification ran off this task, and members, the roster and
        // the snapshot may have changed meanwhile. Nothing else runs on this task from here
        // to the fence, so what is checked now holds then.
        let (_, nodes) = self.check_restore(snapshot_id).await?;
        // The fence: from here on, frames of the old epoch are dropped wherever they are.
        // The counter only allocates: the cluster's epoch is that of the newest restore
        // record, so an epoch is entered only once its record is stored.
        let epoch = self.meta.allocate_epoch().await?;
        let record = RestoreRecord {
            id: format!("restore-{epoch}"),
            snapshot_id: snapshot_id.0,
            epoch,
            nodes: nodes.iter().map(ToString::to_string).collect(),
            applied: Vec::new(),
            status: RestoreStatus::InProgress,
            failure: None,
            requested_by,
            started_at_ms: now_ms(),
            finished_at_ms: 0,
            skipped,
        };
        // The engine fails the snapshots in flight, stores the record and only then tells
        // the nodes. A lost answer was read back by the store; if its term ended first, the
        // outcome is unknown — never reported as a failure, for the next leader may find
        // the record and resume it.
        let (id, token) = (record.id.clone(), self.token());
        let answers = self
            .drive(Input::RestoreStart {
                token,
                record,
                nodes,
            })
            .await;
        let result = answers.into_iter().find_map(|(told, answer)| match answer {
            Answer::RestoreStarted(result) if told == token => Some(result),
            _ => None,
        });
        match result {
            Some(Ok(record)) => {
                tracing::warn!(
                    restore = %record.id,
                    snapshot = snapshot_id.0,
                    epoch,
                    by = %record.requested_by,
                    "restore started: the cluster is fenced with a new epoch"
                );
                Ok(*record)
            }
            Some(Err(Refusal::Store(Error::Store(e)))) if e.outcome_unknown => {
                Err(Error::OutcomeUnknown {
                    what: format!("{id} of snapshot {snapshot_id}"),
                    see: format!("GetRestore {id}"),
                    cause: e.message,
                })
            }
            Some(Err(refusal)) => Err(self.refused(refusal)),
            None => Err(super::snapshots::unanswered("RestoreSnapshot")),
        }
    }

    /// A restore's end is stored: automatic recovery follows a failed one, and may start
    /// now.
    pub(super) async fn restore_ended(&mut self, record: &RestoreRecord) {
        match record.status {
            RestoreStatus::Done => tracing::info!(
                restore = %record.id,
                snapshot = record.snapshot_id,
                ms = record.finished_at_ms.saturating_sub(record.started_at_ms),
                "restore done: every node runs on the restored state"
            ),
            RestoreStatus::Failed => {
                tracing::error!(
                    restore = %record.id,
                    snapshot = record.snapshot_id,
                    "restore failed: {}; restore a snapshot again to bring every node to one \
                     state",
                    record.failure.as_deref().unwrap_or("failed")
                );
                if self.settings.auto_restore {
                    self.pending_recovery = Some(format!("{} failed", record.id));
                    // Not at once: a failure that repeats must not spin restores.
                    self.recovery_not_before = tokio::time::Instant::now() + RECOVERY_BACKOFF;
                }
            }
            RestoreStatus::InProgress => return,
        }
        self.maybe_auto_restore().await;
    }

    pub(super) async fn put_restore(&self, record: &RestoreRecord) -> Result<(), Error> {
        self.meta.put_restore(record).await
    }
}
