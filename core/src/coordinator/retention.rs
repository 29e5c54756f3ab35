//! Deleting snapshots across the roles: by request and by retention (the newest
//! `--retention` completed snapshots are kept), never one in flight, one whose end is not
//! stored yet or one a restore refers to; then the chunks nothing refers to any more are
//! collected — off the runtime's loop ([`Action::CollectGarbage`], back as
//! [`Input::Collected`]), one collection at a time, and none while a snapshot is in flight
//! (its parts may be uploading chunks not yet listed anywhere). A deletion is answered with
//! the bytes the collection after it freed.
//!
//! [`Input::Collected`]: super::Input::Collected

use super::{Action, Actions, Answer, Note, Persist, Refusal, Roles, Token, Write};
use crate::SnapshotId;
use crate::record::{SnapshotRecord, SnapshotStatus};

/// The collection under way, if one is.
#[derive(Debug, Default)]
pub(super) struct Collection {
    running: bool,
    /// The deletions answered when it ends.
    waiting: Vec<Token>,
    /// The deletions made while it ran: answered by the next one, which lists the parts
    /// after them.
    next: Vec<Token>,
    /// Another collection is due when this one ends.
    again: bool,
}

impl Roles {
    /// A user deletes snapshot `id` (`exists`: the runtime found its record).
    pub(super) fn delete<E>(
        &mut self,
        out: &mut Actions<E>,
        token: Token,
        id: SnapshotId,
        exists: bool,
    ) {
        // An end not yet stored is still in progress for the store: deleting its record now
        // would let the end's next store bring it back without its parts.
        let refusal = if self.snapshots.is_open(id) {
            Some(Refusal::StillInProgress(id))
        } else if !exists {
            Some(Refusal::NotFound(id))
        } else {
            self.restore_holding(id).map(|r| Refusal::HeldByRestore {
                id,
                restore: r.id.clone(),
                status: r.status,
            })
        };
        match refusal {
            Some(refusal) => out.push(deleted_answer(token, Err(refusal))),
            None => out.push(Action::Persist {
                what: Persist::Delete(token, id),
                write: Write::DeleteSnapshot(id),
                attempt: 1,
            }),
        }
    }

    /// The store answered for a deletion: its garbage collection follows (or the user hears
    /// why not).
    pub(super) fn deletion_stored<E>(
        &mut self,
        out: &mut Actions<E>,
        token: Token,
        id: SnapshotId,
        result: Result<(), E>,
    ) {
        match result {
            Ok(()) => {
                self.snapshots.forget_request(id);
                out.push(Action::Note(Note::Deleted { snapshot: id }));
                self.collect_garbage(out, Some(token));
            }
            Err(e) => out.push(deleted_answer(token, Err(Refusal::Store(e)))),
        }
    }

    /// A snapshot completed (its end stored): with `--retention`, the snapshots are listed
    /// to find those beyond it.
    pub(super) fn completed<E>(&mut self, out: &mut Actions<E>) {
        if self.retention > 0 {
            out.push(Action::List {
                purpose: super::Listing::Retention,
            });
        }
    }

    /// The snapshots are listed for retention: every completed one beyond the newest
    /// `--retention` is deleted (one a restore refers to is kept), in one batch.
    pub(super) fn retain<E: std::fmt::Display>(
        &mut self,
        out: &mut Actions<E>,
        result: Result<Vec<SnapshotRecord>, E>,
    ) {
        let records = match result {
            Ok(records) => records,
            Err(e) => return out.push(Action::Note(Note::Retention(format!("{e}")))),
        };
        let mut completed: Vec<SnapshotId> = records
            .iter()
            .filter(|r| r.status == SnapshotStatus::Completed)
            .map(|r| SnapshotId(r.id))
            .collect();
        completed.sort_unstable();
        let excess = completed.len().saturating_sub(self.retention);
        let mut deletes = Vec::new();
        for id in completed.into_iter().take(excess) {
            if let Some(restore) = self.restore_holding(id) {
                out.push(Action::Note(Note::KeptForRestore {
                    snapshot: id,
                    restore: restore.id.clone(),
                }));
                continue;
            }
            deletes.push(id);
        }
        if excess == 0 {
            return;
        }
        let write = Write::Batch(deletes.iter().copied().map(Write::DeleteSnapshot).collect());
        out.push(Action::Persist {
            what: Persist::Retention(deletes),
            write,
            attempt: 1,
        });
    }

    /// The store answered for retention's deletions: the garbage is collected (a failure
    /// is logged; retention tries again after the next completed snapshot).
    pub(super) fn retention_stored<E: std::fmt::Display>(
        &mut self,
        out: &mut Actions<E>,
        deleted: Vec<SnapshotId>,
        result: Result<(), E>,
    ) {
        if let Err(e) = result {
            return out.push(Action::Note(Note::Retention(format!("{e}"))));
        }
        for snapshot in deleted {
            self.snapshots.forget_request(snapshot);
            out.push(Action::Note(Note::RetentionDeleted { snapshot }));
        }
        self.collect_garbage(out, None);
    }

    /// Collects the chunks nothing refers to; `token`, a deletion's, hears the bytes freed.
    /// One runs at a time: a deletion during one waits for the next.
    fn collect_garbage<E>(&mut self, out: &mut Actions<E>, token: Option<Token>) {
        if self.collection.running {
            self.collection.next.extend(token);
            self.collection.again = true;
            return;
        }
        self.start_collection(out, token.into_iter().collect());
    }

    /// Starts a collection that `waiting` hear the end of (nothing freed, at once, while a
    /// snapshot is in flight).
    fn start_collection<E>(&mut self, out: &mut Actions<E>, waiting: Vec<Token>) {
        if self.snapshots.in_flight() > 0 {
            for token in waiting {
                out.push(deleted_answer(token, Ok(0)));
            }
            return;
        }
        self.collection = Collection {
            running: true,
            waiting,
            next: Vec::new(),
            again: false,
        };
        out.push(Action::CollectGarbage);
    }

    /// A collection came back: the deletions that waited for it hear what it freed (a
    /// failure frees nothing: the snapshot is deleted, its chunks are kept until a later
    /// collection), and one asked for while it ran starts.
    pub(super) fn collected<E: std::fmt::Display>(
        &mut self,
        out: &mut Actions<E>,
        result: Result<u64, E>,
    ) {
        if !self.collection.running {
            return;
        }
        let collection = std::mem::take(&mut self.collection);
        let freed = match result {
            Ok(freed) => freed,
            Err(e) => {
                out.push(Action::Note(Note::CollectionFailed(format!("{e}"))));
                0
            }
        };
        for token in collection.waiting {
            out.push(deleted_answer(token, Ok(freed)));
        }
        if collection.again {
            self.start_collection(out, collection.next);
        }
    }

    /// The restore that keeps snapshot `id` from being deleted, if any.
    pub(super) fn restore_holding(&self, id: SnapshotId) -> Option<&crate::record::RestoreRecord> {
        self.restores
            .active()
            .into_iter()
            .chain(self.restores.unfinished())
            .find(|r| r.snapshot_id == id.0)
    }
}

fn deleted_answer<E>(token: Token, result: Result<u64, Refusal<E>>) -> Action<E> {
    Action::Reply {
        token,
        answer: Answer::Deleted(result),
    }
}
