//! Choosing and starting a restore, across the roles: a user's request or automatic
//! recovery picks a snapshot; what can be checked is checked at once; every chunk of it is
//! verified off the runtime's loop ([`Action::Verify`], back as [`Input::Verified`]); it is
//! checked again (members, the roster and the snapshot may have changed meanwhile), its
//! epoch allocated ([`Action::AllocateEpoch`]), the snapshots in flight failed, and the
//! restore role stores its record and tells the nodes. Automatic recovery is due after a
//! member's restart or a failed restore, and runs once every member is connected.
//!
//! [`Input::Verified`]: super::Input::Verified

use std::collections::BTreeSet;
use std::fmt::Display;

use super::restores::{AUTO_RESTORE_CANDIDATES, RECOVERY_BACKOFF_MS, RestoreBy, Verifying};
use super::{Action, Actions, Answer, Note, Now, Refusal, Roles};
use crate::record::{RestoreRecord, RestoreStatus, SnapshotRecord, SnapshotStatus};
use crate::{FailureReason, NodeId, SnapshotId};

impl Roles {
    /// A user asks to restore snapshot `id`, whose record the runtime read (`None`: there
    /// is none).
    pub(super) fn restore<E>(
        &mut self,
        out: &mut Actions<E>,
        token: super::Token,
        id: SnapshotId,
        record: Option<SnapshotRecord>,
        if_epoch: Option<u64>,
    ) {
        // The epoch is compared while no other restore is under way or being chosen, and
        // none can start until this one is fenced or refused: nothing comes in between.
        let checked = self
            .no_restore_under_way(id)
            .and_then(|()| self.epoch_is(if_epoch))
            .and_then(|()| self.check_restore(id, record.as_ref()));
        match (checked, record) {
            (Ok(_), Some(record)) => {
                self.restores.verifying = Some(Verifying::new(vec![id], RestoreBy::User(token)));
                out.push(Action::Verify {
                    candidates: vec![record],
                });
            }
            (Err(refusal), _) => out.push(restore_answer(token, Err(refusal))),
            (Ok(_), None) => out.push(restore_answer(token, Err(Refusal::NotFound(id)))),
        }
    }

    /// No restore is under way or being chosen.
    fn no_restore_under_way<E>(&self, id: SnapshotId) -> Result<(), Refusal<E>> {
        if let Some(active) = self.restores.active() {
            return Err(Refusal::RestoreInProgress {
                restore: active.id.clone(),
                snapshot: SnapshotId(active.snapshot_id),
            });
        }
        if let Some(snapshot) = self.restores.choosing() {
            return Err(Refusal::RestoreInProgress {
                restore: "a restore whose snapshot is being verified".into(),
                snapshot: snapshot.unwrap_or(id),
            });
        }
        Ok(())
    }

    /// A conditional restore's epoch is the cluster's.
    fn epoch_is<E>(&self, if_epoch: Option<u64>) -> Result<(), Refusal<E>> {
        match if_epoch {
            Some(expected) if expected != self.restores.epoch() => Err(Refusal::EpochMoved {
                expected,
                current: self.restores.epoch(),
            }),
            _ => Ok(()),
        }
    }

    /// What a restore of snapshot `id` needs now: the snapshot completed, every node of it
    /// connected, and no node joined since. The nodes that must apply it.
    fn check_restore<E>(
        &self,
        id: SnapshotId,
        record: Option<&SnapshotRecord>,
    ) -> Result<BTreeSet<NodeId>, Refusal<E>> {
        let record = record.ok_or(Refusal::NotFound(id))?;
        if record.status != SnapshotStatus::Completed {
            return Err(Refusal::NotCompleted {
                id,
                status: record.status,
            });
        }
        let nodes: BTreeSet<NodeId> = record.nodes.iter().map(NodeId::new).collect();
        let members = &self.members.members;
        let missing: Vec<&str> = nodes
            .iter()
            .filter(|n| !members.contains_key(*n))
            .map(NodeId::as_str)
            .collect();
        if !missing.is_empty() {
            return Err(Refusal::NodesNotConnected(format!(
                "cannot restore snapshot {id}: not connected to the coordinator: {} (every \
                 node of the snapshot must be)",
                missing.join(", ")
            )));
        }
        let extra: Vec<String> = self
            .members
            .roster
            .nodes()
            .filter(|n| !nodes.contains(*n))
            .map(ToString::to_string)
            .collect();
        if !extra.is_empty() {
            return Err(Refusal::JoinedSince {
                snapshot: id,
                nodes: extra,
            });
        }
        Ok(nodes)
    }

    /// The verification came back: the first candidate that verified (`record`: its record
    /// read again now), and those that did not, with why. The chosen one is checked again,
    /// then its epoch allocated.
    pub(super) fn verified<E: Display>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        chosen: Option<SnapshotId>,
        record: Option<SnapshotRecord>,
        mut skipped: Vec<(SnapshotId, E)>,
    ) {
        let Some(verifying) = self.restores.verifying.take() else {
            return;
        };
        let by = verifying.by;
        let requested_by = by.requested_by();
        if let RestoreBy::Recovery(_) = &by {
            for (id, e) in &skipped {
                out.push(Action::Note(Note::Recovery(format!(
                    "{requested_by} passes over snapshot {id}: {e}"
                ))));
            }
        }
        let Some(id) = chosen else {
            // Never empty: a verification has a candidate, and each is chosen or skipped.
            let refusal = skipped.pop().map(|(_, e)| Refusal::Store(e));
            return self.restore_failed(out, now, by, refusal);
        };
        match self.check_restore(id, record.as_ref()) {
            Ok(nodes) => {
                let passed_over = skipped
                    .iter()
                    .map(|(id, e)| format!("snapshot {id}: {e}"))
                    .collect();
                self.restores.allocating = Some(super::restores::Allocating {
                    snapshot: id,
                    nodes,
                    by,
                    passed_over,
                });
                out.push(Action::AllocateEpoch);
            }
            Err(refusal) => self.restore_failed(out, now, by, Some(refusal)),
        }
    }

    /// The epoch counter answered: the restore starts — the snapshots in flight fail, its
    /// record is stored, and then the nodes are told.
    pub(super) fn epoch_allocated<E>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        result: Result<u64, E>,
    ) {
        let Some(allocating) = self.restores.allocating.take() else {
            return;
        };
        let epoch = match result {
            Ok(epoch) => epoch,
            Err(e) => return self.restore_failed(out, now, allocating.by, Some(Refusal::Store(e))),
        };
        let record = RestoreRecord {
            id: format!("restore-{epoch}"),
            snapshot_id: allocating.snapshot.0,
            epoch,
            nodes: allocating.nodes.iter().map(ToString::to_string).collect(),
            applied: Vec::new(),
            status: RestoreStatus::InProgress,
            failure: None,
            requested_by: allocating.by.requested_by(),
            started_at_ms: now.wall_ms,
            finished_at_ms: 0,
            skipped: allocating.passed_over,
        };
        // The fence: a snapshot planned in the old epoch can no longer be a cut.
        self.snapshots
            .fail_all(out, now.wall_ms, &FailureReason::Restore);
        self.restores
            .start(out, allocating.by, record, allocating.nodes);
    }

    /// A restore could not be chosen or started: a user hears why; automatic recovery logs
    /// it and stays due, tried again after a pause (perhaps the store answers again later).
    pub(super) fn restore_failed<E>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        by: RestoreBy,
        refusal: Option<Refusal<E>>,
    ) {
        match by {
            RestoreBy::User(token) => {
                let refusal =
                    refusal.unwrap_or(Refusal::Invalid("no snapshot was verified".into()));
                out.push(restore_answer(token, Err(refusal)));
            }
            RestoreBy::Recovery(reason) => {
                out.push(Action::RecoveryFailed {
                    requested_by: format!("automatic recovery ({reason})"),
                    refusal,
                });
                self.restores.recovery_due(
                    reason,
                    Some(now.mono_ms.saturating_add(RECOVERY_BACKOFF_MS)),
                );
            }
        }
    }

    /// Automatic recovery, if it is due and may run now: once every roster node is
    /// connected and no restore runs or is being chosen, the completed snapshots are listed.
    pub(super) fn maybe_recover<E>(&mut self, out: &mut Actions<E>, now: Now) {
        let connected = {
            let members = &self.members;
            members
                .roster
                .nodes()
                .all(|n| members.members.contains_key(n))
        };
        if connected
            && self.restores.active().is_none()
            && self.restores.choosing().is_none()
            && let Some(reason) = self.restores.take_due_recovery(now.mono_ms)
        {
            self.restores.listing = Some(reason);
            out.push(Action::List {
                purpose: super::Listing::Recovery,
            });
        }
    }

    /// The snapshots are listed: the newest completed ones are verified, newest first,
    /// until one does.
    pub(super) fn completed_listed<E: Display>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        result: Result<Vec<SnapshotRecord>, E>,
    ) {
        let Some(reason) = self.restores.listing.take() else {
            return;
        };
        let mut completed = match result {
            Ok(records) => records,
            Err(e) => {
                out.push(Action::Note(Note::Recovery(format!(
                    "automatic recovery ({reason}): cannot list snapshots: {e}"
                ))));
                return self.restores.recovery_due(
                    reason,
                    Some(now.mono_ms.saturating_add(RECOVERY_BACKOFF_MS)),
                );
            }
        };
        // Only the history the cluster is on: the snapshots taken in this epoch, then the
        // one it was restored from. A snapshot of an earlier epoch but that one belongs to
        // a history an operator's restore discarded: restoring it would undo that restore
        // (and bring back effects an application removed when it restored).
        let (epoch, restored) = (self.restores.epoch(), self.restores.restored());
        completed.retain(|r| {
            r.status == SnapshotStatus::Completed
                && (r.epoch >= epoch || Some(SnapshotId(r.id)) == restored)
        });
        if completed.is_empty() {
            return out.push(Action::Note(Note::Recovery(format!(
                "automatic recovery ({reason}): no completed snapshot of the history the \
                 cluster is on (epoch {epoch}); the cluster runs on as it is"
            ))));
        }
        completed.sort_by_key(|r| std::cmp::Reverse(r.id));
        completed.truncate(AUTO_RESTORE_CANDIDATES);
        let ids = completed.iter().map(|r| SnapshotId(r.id)).collect();
        self.restores.verifying = Some(Verifying::new(ids, RestoreBy::Recovery(reason)));
        out.push(Action::Verify {
            candidates: completed,
        });
    }
}

pub(super) fn restore_answer<E>(
    token: super::Token,
    result: Result<Box<RestoreRecord>, Refusal<E>>,
) -> Action<E> {
    Action::Reply {
        token,
        answer: Answer::RestoreStarted(result),
    }
}
