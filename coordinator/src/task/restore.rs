//! Restores, as the coordinator's task carries them out for the engine's restore role: a
//! user's request handed over with its snapshot's record read, the verification of every
//! chunk of the candidates on a task of its own (its outcome back as [`Msg::Verified`],
//! the chosen snapshot's record read again), the epoch allocated, the completed snapshots
//! listed for automatic recovery, and the answer sent to whoever asked. The restores a term
//! resumes are `recovery.rs`'s.

use cairn_core::SnapshotId;
use cairn_core::coordinator::{Input, Refusal, Token};
use tokio::sync::oneshot;

use super::{Msg, State};
use crate::error::Error;
use crate::store::{RestoreRecord, RestoreStatus, SnapshotRecord};

/// The answer a user's `RestoreSnapshot` waits for.
pub(super) type RestoreReply = oneshot::Sender<Result<RestoreRecord, Error>>;

impl State {
    /// A user asks to restore `snapshot_id` (see `Coordinator/RestoreSnapshot`): the
    /// engine checks what can be checked at once and has its chunks verified off this task;
    /// `reply` is answered when the restore is fenced and stored, or refused (also when
    /// `if_epoch` is not the cluster's epoch).
    pub(super) async fn restore(
        &mut self,
        snapshot_id: SnapshotId,
        if_epoch: Option<u64>,
        reply: RestoreReply,
    ) {
        let record = match self.get_record(snapshot_id).await {
            Ok(record) => record,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let token = self.token();
        self.restore_replies.insert(token, reply);
        let input = Input::Restore {
            token,
            snapshot: snapshot_id,
            record,
            if_epoch,
        };
        self.drive(input).await;
    }

    /// Verifies `candidates` in order on a task of its own until one verifies: the blob
    /// store is read there, never on this task (a stalled store must not stall heartbeats,
    /// registrations and snapshot starts). Its outcome comes back as [`Msg::Verified`].
    pub(super) fn verify_off_task(&self, candidates: Vec<SnapshotRecord>) {
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

    /// A verification came back: the chosen snapshot's record is read again now (it may
    /// have been deleted meanwhile), and the engine checks it once more before the fence.
    pub(super) async fn verified(
        &mut self,
        chosen: Option<SnapshotId>,
        mut skipped: Vec<(SnapshotId, Error)>,
    ) {
        let (chosen, record) = match chosen {
            None => (None, None),
            Some(id) => match self.get_record(id).await {
                Ok(record) => (Some(id), record),
                Err(e) => {
                    skipped.push((id, e));
                    (None, None)
                }
            },
        };
        let input = Input::Verified {
            chosen,
            record,
            skipped,
        };
        self.drive(input).await;
    }

    /// Sends the answer to the user's restore of `token`, if it is one. A record whose
    /// store's answer was lost, and not read back before the term ended, is an unknown
    /// outcome — never reported as a failure, for the next leader may find the record and
    /// resume it.
    pub(super) fn answer_restore(
        &mut self,
        token: Token,
        result: Result<Box<RestoreRecord>, Refusal<Error>>,
    ) {
        let Some(reply) = self.restore_replies.remove(&token) else {
            return;
        };
        let result = match result {
            Ok(record) => Ok(*record),
            Err(Refusal::RestoreNotStored {
                restore,
                snapshot,
                cause: Error::Store(e),
            }) if e.outcome_unknown => Err(Error::OutcomeUnknown {
                what: format!("{restore} of snapshot {snapshot}"),
                see: format!("GetRestore {restore}"),
                cause: e.message,
            }),
            Err(refusal) => Err(self.refused(refusal)),
        };
        let _ = reply.send(result);
    }

    /// A restore's end is stored: logged (automatic recovery is the engine's).
    pub(super) fn restore_ended(&self, record: &RestoreRecord) {
        let outcome = match record.status {
            RestoreStatus::Done => Some("done"),
            RestoreStatus::Failed => Some("failed"),
            RestoreStatus::InProgress => None,
        };
        if let Some(outcome) = outcome {
            self.metrics
                .restores
                .get_or_create(&crate::metrics::OutcomeLabel {
                    outcome: outcome.to_owned(),
                })
                .inc();
        }
        match record.status {
            RestoreStatus::Done => tracing::info!(
                restore = %record.id,
                snapshot = record.snapshot_id,
                ms = record.finished_at_ms.saturating_sub(record.started_at_ms),
                "restore done: every node runs on the restored state"
            ),
            RestoreStatus::Failed => tracing::error!(
                restore = %record.id,
                snapshot = record.snapshot_id,
                "restore failed: {}; restore a snapshot again to bring every node to one state",
                record.failure.as_deref().unwrap_or("failed")
            ),
            RestoreStatus::InProgress => {}
        }
    }

    pub(super) async fn put_restore(&self, record: &RestoreRecord) -> Result<(), Error> {
        self.meta.put_restore(record).await
    }
}
