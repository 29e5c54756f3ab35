//! The engine's restore role: the cluster's epoch, the restore under way (who must apply
//! it, who did, its deadline), and the newest restore that did not finish. A restore's
//! record is stored before the nodes are told to apply it; its progress and end are stored
//! before anyone hears of them, and an end the store refused is stored again at every tick
//! (the restore stays the one under way, and snapshots stay fenced, until it is stored).

use std::collections::BTreeSet;
use std::time::Duration;

use super::{Action, Actions, Answer, Note, Persist, Refusal, Timer, Token, Write};
use crate::control::{NodeCommand, NodeRestore};
use crate::record::{RestoreRecord, RestoreStatus};
use crate::restore::{RestoreProgress, RestoreState};
use crate::types::{NodeId, SnapshotId};

/// The restore under way.
struct Active {
    record: RestoreRecord,
    progress: RestoreProgress,
    /// Stores of its record tried since one last succeeded.
    tries: u64,
}

/// A restore starting: its record is being stored.
struct Starting {
    by: RestoreBy,
    record: RestoreRecord,
    nodes: BTreeSet<NodeId>,
}

/// Who asked for a restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum RestoreBy {
    /// A user's `RestoreSnapshot`, answered with this token.
    User(Token),
    /// Automatic recovery, and why it is due.
    Recovery(String),
}

impl RestoreBy {
    /// What its record says asked for it.
    pub(super) fn requested_by(&self) -> String {
        match self {
            Self::User(_) => "user".to_owned(),
            Self::Recovery(reason) => format!("automatic recovery ({reason})"),
        }
    }
}

/// A restore whose candidates are being verified off the runtime's loop.
pub(super) struct Verifying {
    /// The candidates, in order (automatic recovery tries the newest few).
    snapshots: Vec<SnapshotId>,
    pub(super) by: RestoreBy,
}

impl Verifying {
    pub(super) fn new(snapshots: Vec<SnapshotId>, by: RestoreBy) -> Self {
        Self { snapshots, by }
    }
}

/// A restore whose snapshot verified, waiting for its epoch.
pub(super) struct Allocating {
    pub(super) snapshot: SnapshotId,
    pub(super) nodes: BTreeSet<NodeId>,
    pub(super) by: RestoreBy,
    /// The snapshots automatic recovery passed over, with why.
    pub(super) passed_over: Vec<String>,
}

pub(super) struct Restores {
    /// How long a restore may take.
    timeout: Duration,
    /// The cluster's epoch (raised by every restore).
    epoch: u64,
    /// The snapshot the restore that made this epoch restored: the history the cluster is
    /// on is this epoch's snapshots, then that one (and its own history).
    restored: Option<SnapshotId>,
    active: Option<Active>,
    starting: Option<Starting>,
    /// The newest restore that did not finish (FAILED): until a later one is applied by
    /// every node, the nodes may hold different states and no snapshot may start.
    unfinished: Option<RestoreRecord>,
    /// A restore being chosen: its candidates verified, then its epoch allocated, or the
    /// completed snapshots listed for automatic recovery (why it is due).
    pub(super) verifying: Option<Verifying>,
    pub(super) allocating: Option<Allocating>,
    pub(super) listing: Option<String>,
    /// `--auto-restore`.
    auto_restore: bool,
    /// Automatic recovery is due (why), once every member is connected and not before
    /// `recovery_not_before` (monotonic).
    pending_recovery: Option<String>,
    recovery_not_before: u64,
}

/// How many of the newest completed snapshots automatic recovery tries to verify.
pub const AUTO_RESTORE_CANDIDATES: usize = 10;

/// How long automatic recovery waits before trying again after a failure.
pub const RECOVERY_BACKOFF_MS: u64 = 5_000;

/// The epoch a restore id names (`restore-<epoch>`).
pub fn restore_epoch(id: &str) -> Option<u64> {
    id.strip_prefix("restore-")?.parse().ok()
}

impl Restores {
    pub(super) fn new(timeout: Duration, auto_restore: bool) -> Self {
        Self {
            timeout,
            epoch: 0,
            restored: None,
            active: None,
            starting: None,
            unfinished: None,
            verifying: None,
            allocating: None,
            listing: None,
            auto_restore,
            pending_recovery: None,
            recovery_not_before: 0,
        }
    }

    /// A restore being chosen, if one is, with its first candidate (if known yet).
    pub(super) fn choosing(&self) -> Option<Option<SnapshotId>> {
        if let Some(v) = &self.verifying {
            return Some(v.snapshots.first().copied());
        }
        if let Some(a) = &self.allocating {
            return Some(Some(a.snapshot));
        }
        self.listing.as_ref().map(|_| None)
    }

    /// Automatic recovery is due for `reason` (with `--auto-restore`), not before
    /// `not_before` (monotonic) if given.
    pub(super) fn recovery_due(&mut self, reason: String, not_before: Option<u64>) {
        if self.auto_restore {
            self.pending_recovery = Some(reason);
            if let Some(at) = not_before {
                self.recovery_not_before = at;
            }
        }
    }

    /// The recovery due, if one is and its pause is over (taken: it is under way).
    pub(super) fn take_due_recovery(&mut self, mono_ms: u64) -> Option<String> {
        if mono_ms < self.recovery_not_before {
            return None;
        }
        self.pending_recovery.take()
    }

    /// Why automatic recovery is due, if it is.
    pub(super) fn pending_recovery(&self) -> Option<&str> {
        self.pending_recovery.as_deref()
    }

    pub(super) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The snapshot the current epoch was restored from, if known.
    pub(super) fn restored(&self) -> Option<SnapshotId> {
        self.restored
    }

    pub(super) fn active(&self) -> Option<&RestoreRecord> {
        self.active.as_ref().map(|a| &a.record)
    }

    /// The restore under way if it has not ended (an end not stored yet keeps it active —
    /// and snapshots fenced — but it is no longer one to apply).
    pub(super) fn applying(&self) -> Option<&RestoreRecord> {
        self.active()
            .filter(|r| r.status == RestoreStatus::InProgress)
    }

    pub(super) fn active_nodes(&self) -> Option<&BTreeSet<NodeId>> {
        self.active.as_ref().map(|a| a.progress.nodes())
    }

    pub(super) fn unfinished(&self) -> Option<&RestoreRecord> {
        self.unfinished.as_ref()
    }

    /// At a term's start: the epoch, and the restores a previous coordinator left (one in
    /// progress is resumed under a new deadline).
    pub(super) fn loaded<E>(
        &mut self,
        out: &mut Actions<E>,
        epoch: u64,
        active: Option<RestoreRecord>,
        unfinished: Option<RestoreRecord>,
        restored: Option<SnapshotId>,
    ) {
        self.epoch = epoch;
        self.restored = restored;
        if let Some(record) = &unfinished {
            // The recovery a previous coordinator had pending goes on here.
            self.recovery_due(format!("{} failed", record.id), None);
        }
        self.unfinished = unfinished;
        self.active = active.map(|record| {
            let nodes = record.nodes.iter().map(NodeId::new);
            let mut progress = RestoreProgress::new(nodes);
            for node in &record.applied {
                progress.node_applied(&NodeId::new(node.clone()));
            }
            out.push(self.deadline(record.epoch));
            Active {
                record,
                progress,
                tries: 0,
            }
        });
    }

    /// A daemon is in a later epoch than the store said (lost metadata): the cluster's
    /// epoch follows it (the runtime stored the counter).
    pub(super) fn epoch_raised(&mut self, epoch: u64) {
        self.epoch = self.epoch.max(epoch);
    }

    /// A restore starts: its record is stored, then the nodes are told.
    pub(super) fn start<E>(
        &mut self,
        out: &mut Actions<E>,
        by: RestoreBy,
        record: RestoreRecord,
        nodes: BTreeSet<NodeId>,
    ) {
        out.push(Action::Persist {
            what: Persist::Restore(record.epoch, record.status),
            write: Write::Restore(record.clone()),
            attempt: 1,
        });
        self.starting = Some(Starting { by, record, nodes });
    }

    /// The store answered for the record of the restore of `epoch`; the start's failure,
    /// if a start failed (for its requester).
    pub(super) fn stored<E>(
        &mut self,
        out: &mut Actions<E>,
        mono_ms: u64,
        epoch: u64,
        written: RestoreStatus,
        result: Result<(), E>,
    ) -> Option<(RestoreBy, Refusal<E>)> {
        if let Some(starting) = self.starting.take_if(|s| s.record.epoch == epoch) {
            return self.started(out, starting, result);
        }
        let active = self.active.as_mut().filter(|a| a.record.epoch == epoch)?;
        if result.is_err() {
            // Stays the restore under way; an end is stored again at the next tick.
            return None;
        }
        active.tries = 0;
        // What was written decides: an end taken after an earlier progress write was
        // queued is told only when the end's own write is acknowledged.
        match written {
            RestoreStatus::InProgress => return None,
            RestoreStatus::Done => self.unfinished = None,
            RestoreStatus::Failed => self.unfinished = Some(active.record.clone()),
        }
        let record = active.record.clone();
        self.active = None;
        if record.status == RestoreStatus::Failed {
            // Not at once: a failure that repeats must not spin restores.
            let not_before = mono_ms.saturating_add(RECOVERY_BACKOFF_MS);
            self.recovery_due(format!("{} failed", record.id), Some(not_before));
        }
        out.push(Action::RestoreEnded { record });
        None
    }

    fn started<E>(
        &mut self,
        out: &mut Actions<E>,
        starting: Starting,
        result: Result<(), E>,
    ) -> Option<(RestoreBy, Refusal<E>)> {
        let Starting { by, record, nodes } = starting;
        if let Err(cause) = result {
            let refusal = Refusal::RestoreNotStored {
                restore: record.id,
                snapshot: SnapshotId(record.snapshot_id),
                cause,
            };
            return Some((by, refusal));
        }
        self.epoch = record.epoch;
        self.restored = Some(SnapshotId(record.snapshot_id));
        let command = NodeRestore {
            restore_id: record.id.clone(),
            snapshot: SnapshotId(record.snapshot_id),
            epoch: record.epoch,
        };
        for node in &nodes {
            out.push(Action::Send {
                node: node.clone(),
                command: NodeCommand::Restore(command.clone()),
            });
        }
        out.push(self.deadline(record.epoch));
        out.push(Action::Note(Note::RestoreStarted {
            restore_id: record.id.clone(),
            snapshot: SnapshotId(record.snapshot_id),
            epoch: record.epoch,
            requested_by: record.requested_by.clone(),
        }));
        if let RestoreBy::User(token) = by {
            out.push(Action::Reply {
                token,
                answer: Answer::RestoreStarted(Ok(Box::new(record.clone()))),
            });
        }
        self.active = Some(Active {
            record,
            progress: RestoreProgress::new(nodes),
            tries: 0,
        });
        None
    }

    /// A node's application applied the restore `restore_id`: the epoch the node is in
    /// now, if that is known.
    pub(super) fn applied<E>(
        &mut self,
        out: &mut Actions<E>,
        now: u64,
        node: &NodeId,
        id: &str,
    ) -> Option<u64> {
        let Some(active) = self.active.as_mut().filter(|a| a.record.id == id) else {
            // The restore that made the current epoch ended DONE meanwhile (this node
            // applied it again after a restart): the node is in the cluster's epoch.
            return (restore_epoch(id) == Some(self.epoch) && self.unfinished.is_none())
                .then_some(self.epoch);
        };
        let epoch = active.record.epoch;
        active.progress.node_applied(node);
        active.record.applied = active
            .progress
            .applied()
            .iter()
            .map(ToString::to_string)
            .collect();
        self.moved(out, now);
        Some(epoch)
    }

    /// A node could not restore (`restore_id`: the restore it named, if it named one), or
    /// was lost.
    pub(super) fn node_failed<E>(
        &mut self,
        out: &mut Actions<E>,
        now: u64,
        node: &NodeId,
        restore_id: Option<&str>,
        why: &str,
    ) {
        let failed = self
            .active
            .as_mut()
            .filter(|a| restore_id.is_none_or(|id| a.record.id == id))
            .is_some_and(|a| a.progress.node_failed(node, why));
        if failed {
            self.moved(out, now);
        }
    }

    /// A new process of `node` registered, not having applied the restore under way.
    pub(super) fn node_restarted<E>(&mut self, out: &mut Actions<E>, now: u64, node: &NodeId) {
        if self
            .active
            .as_mut()
            .is_some_and(|a| a.progress.node_restarted(node))
        {
            self.moved(out, now);
        }
    }

    /// The deadline of the restore of `epoch` passed.
    pub(super) fn timed_out<E>(&mut self, out: &mut Actions<E>, now: u64, epoch: u64) {
        if self
            .active
            .as_mut()
            .filter(|a| a.record.epoch == epoch)
            .is_some_and(|a| a.progress.timed_out())
        {
            self.moved(out, now);
        }
    }

    /// The tick: an end the store refused is stored again.
    pub(super) fn tick<E>(&mut self, out: &mut Actions<E>, now: u64) {
        if self
            .active
            .as_ref()
            .is_some_and(|a| a.record.status != RestoreStatus::InProgress)
        {
            self.moved(out, now);
        }
    }

    /// The restore's progress changed: its record says so (and how it ended, if it did),
    /// and is stored; [`Action::RestoreEnded`] follows the store's acknowledgement of an end.
    fn moved<E>(&mut self, out: &mut Actions<E>, now: u64) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        // An end already taken (its store failed and this is the retry) is kept as it was.
        if active.record.status == RestoreStatus::InProgress {
            match active.progress.state() {
                RestoreState::InProgress => {}
                RestoreState::Done => {
                    active.record.status = RestoreStatus::Done;
                    active.record.finished_at_ms = now;
                }
                RestoreState::Failed(why) => {
                    active.record.status = RestoreStatus::Failed;
                    active.record.finished_at_ms = now;
                    active.record.failure = Some(why.clone());
                }
            }
        }
        active.tries = active.tries.saturating_add(1);
        out.push(Action::Persist {
            what: Persist::Restore(active.record.epoch, active.record.status),
            write: Write::Restore(active.record.clone()),
            attempt: active.tries,
        });
    }

    fn deadline<E>(&self, epoch: u64) -> Action<E> {
        Action::SetTimer {
            timer: Timer::Restore(epoch),
            after: self.timeout,
        }
    }
}
