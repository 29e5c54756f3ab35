//! The coordinator's engine, sans-IO: what the coordinator decides, as data in and data
//! out (docs/architecture.md §6.1).
//!
//! [`CoordinatorEngine::handle`] takes an [`Input`] with the time it happened ([`Now`]);
//! the engine changes its state and queues [`Action`]s, which the runtime (the
//! coordinator's task) takes with [`CoordinatorEngine::next_action`] and carries out in
//! order. An action whose answer the engine needs — taking an id, storing records — is
//! answered by feeding the result back as an input before the next action is taken
//! ([`Input::IdTaken`], [`Input::Persisted`]): a record is stored before anyone hears of it
//! *by construction*, because the engine only queues the telling ([`Action::Send`],
//! [`Action::Ended`], [`Action::Reply`], …) when the store's acknowledgement comes in.
//!
//! Nothing here does I/O, reads a clock or spawns: tests drive it synchronously and
//! compare the actions it queued ([`CoordinatorEngine::drain_actions`]).
//!
//! The engine's state is split into roles, each with its own fields: `snapshots.rs` (the
//! tracker, the records in flight, ends not yet stored, the id floor, the schedule),
//! `restores.rs` (the epoch, the restore under way, the newest unfinished one, the restore
//! being chosen, automatic recovery due) and `members.rs` (the roster, the removed nodes,
//! the members connected, registrations and removals under way). Flows that cross roles
//! borrow the roles they need: `membership.rs` (a registration, a member gone, a removal, a
//! start's checks), `restoring.rs` (choosing and starting a restore, automatic recovery),
//! `retention.rs` (deletion, retention, garbage collection) and `scheduling.rs` (a due
//! snapshot, the policy). What reads the blob store (a restore's verification, a garbage
//! collection) runs in the runtime, off its loop, asked for by [`Action::Verify`] and
//! [`Action::CollectGarbage`], its outcome fed back as an input.

use std::collections::{BTreeMap, VecDeque};

use crate::FailureReason;
use crate::control::{Membership, NodeCommand};
use crate::record::{RestoreRecord, SnapshotRecord};
use crate::schedule::{PolicyView, Schedule, Status};
use crate::tracker::SnapshotTracker;
use crate::types::{NodeId, SnapshotId};

mod members;
mod membership;
mod messages;
mod restores;
mod restoring;
mod retention;
pub mod roster;
mod scheduling;
mod snapshots;
#[cfg(test)]
mod tests;

pub use members::{MEMBER_SILENCE_MS, Member};
pub use membership::MAX_REPORTED;
pub use messages::{
    Action, Answer, Config, Input, Listing, Note, Now, Persist, Refusal, SnapshotWrite, StartInput,
    Timer, Token, Write,
};
pub use restores::restore_epoch;
pub use restores::{AUTO_RESTORE_CANDIDATES, RECOVERY_BACKOFF_MS};
pub use snapshots::{MAX_REQUESTS, PartSizes};

/// The engine's roles, each with its own fields.
struct Roles {
    snapshots: snapshots::Snapshots,
    restores: restores::Restores,
    members: members::Members,
    /// `--retention`.
    retention: usize,
    /// The policy's source and the flags'.
    policies: scheduling::Policies,
    /// The garbage collection under way, if one is.
    collection: retention::Collection,
}

/// The coordinator's engine. See the module's documentation.
pub struct CoordinatorEngine<E> {
    cluster: String,
    term: u64,
    roles: Roles,
    actions: Actions<E>,
}

/// The queue of actions, which each role pushes onto.
#[derive(Debug)]
pub(crate) struct Actions<E>(VecDeque<Action<E>>);

impl<E> Actions<E> {
    fn push(&mut self, action: Action<E>) {
        self.0.push_back(action);
    }
}

impl<E: std::fmt::Display> CoordinatorEngine<E> {
    /// An engine set up with `config`.
    pub fn new(config: Config) -> Self {
        let tracker = SnapshotTracker::new(config.max_in_flight.max(1));
        let schedule = Schedule::new(config.policy.clone(), 0, config.seed);
        Self {
            cluster: config.cluster,
            term: config.term,
            roles: Roles {
                policies: scheduling::Policies::new(config.policy),
                snapshots: snapshots::Snapshots::new(tracker, schedule),
                restores: restores::Restores::new(config.restore_timeout, config.auto_restore),
                members: members::Members::new(config.topology, config.remove_after),
                retention: config.retention,
                collection: retention::Collection::default(),
            },
            actions: Actions(VecDeque::new()),
        }
    }

    /// Takes `input`, which happened at `now`, and queues what follows from it.
    pub fn handle(&mut self, now: Now, input: Input<E>) {
        let out = &mut self.actions;
        let roles = &mut self.roles;
        let wall = now.wall_ms;
        match input {
            Input::MembersLoaded { roster, removed } => {
                roles.members.loaded(out, roster, removed);
            }
            Input::RestoresLoaded {
                epoch,
                active,
                unfinished,
                restored,
            } => roles
                .restores
                .loaded(out, epoch, active, unfinished, restored),
            Input::Register {
                token,
                registration,
                session,
            } => {
                roles.register(out, now, token, registration, session, &self.cluster);
                roles.maybe_recover(out, now);
            }
            Input::SessionEnded { node, session } => {
                roles.session_ended(out, now, &node, session);
            }
            Input::Heartbeat {
                node,
                application_attached,
                channels,
            } => {
                if let Some(member) = roles.members.heard(now, &node) {
                    member.application_attached = application_attached;
                    member.channels = channels;
                }
            }
            Input::RemoveNode { token, node } => roles.remove_node(out, now, token, &node),
            Input::Leave { node } => roles.leave(out, now, &node),
            Input::Start { token, start }
                if let Some(id) = roles.snapshots.requested(&start.request_id) =>
            {
                out.push(Action::Note(Note::StartRepeated {
                    snapshot: id,
                    request_id: start.request_id,
                }));
                out.push(Action::Reply {
                    token,
                    answer: Answer::Started(Ok(id)),
                });
            }
            Input::Start { token, start } => match roles.spannable() {
                Ok(topology) => {
                    let epoch = roles.restores.epoch();
                    let by = snapshots::StartBy::User(token);
                    roles.snapshots.start(out, by, start, topology, epoch);
                }
                Err(refusal) => out.push(Action::Reply {
                    token,
                    answer: Answer::Started(Err(refusal)),
                }),
            },
            Input::IdTaken { result } => roles.snapshots.id_taken(out, wall, result),
            Input::Persisted { what, result } => match what {
                Persist::Snapshot(what) => {
                    if roles.snapshots.stored(out, now.mono_ms, what, result) {
                        roles.completed(out);
                    }
                }
                Persist::Delete(token, id) => roles.deletion_stored(out, token, id, result),
                Persist::Retention(deleted) => roles.retention_stored(out, deleted, result),
                Persist::Policy(token) => roles.policy_stored(out, now, token, result),
                Persist::Restore(epoch, written) => {
                    if let Some((by, refusal)) =
                        roles
                            .restores
                            .stored(out, now.mono_ms, epoch, written, result)
                    {
                        roles.restore_failed(out, now, by, Some(refusal));
                    }
                    roles.maybe_recover(out, now);
                }
                Persist::Register(token) => {
                    roles.registration_stored(out, now, token, result);
                    roles.maybe_recover(out, now);
                }
                Persist::Removal(node) => roles.removal_stored(out, now, &node, result),
                // Logged by the runtime; the member is gone either way.
                Persist::DeleteMember(_) => {}
            },
            Input::Report { node, id, report } => {
                roles.members.heard(now, &node);
                roles.snapshots.report(out, wall, &node, id, report);
            }
            Input::PartStored {
                part,
                sizes,
                epoch,
                applied_restore_id,
            } => roles
                .snapshots
                .part_stored(out, wall, part, &sizes, epoch, applied_restore_id),
            Input::StorageFailed { id, node, why } => {
                let nodes = vec![node];
                let reason = FailureReason::Storage { nodes, why };
                roles.snapshots.fail(out, wall, id, reason);
            }
            Input::TimedOut { id } => roles.snapshots.timed_out(out, wall, id),
            Input::Abort { token, id, reason } => {
                roles.snapshots.abort(out, wall, token, id, reason);
            }
            Input::FailAll { reason } => roles.snapshots.fail_all(out, wall, &reason),
            Input::Restore {
                token,
                snapshot,
                record,
                if_epoch,
            } => roles.restore(out, token, snapshot, record, if_epoch),
            Input::Verified {
                chosen,
                record,
                skipped,
            } => roles.verified(out, now, chosen, record, skipped),
            Input::EpochAllocated { result } => roles.epoch_allocated(out, now, result),
            Input::Listed { purpose, result } => match purpose {
                Listing::Recovery => roles.completed_listed(out, now, result),
                Listing::Retention => roles.retain(out, result),
            },
            Input::Delete {
                token,
                snapshot,
                exists,
            } => roles.delete(out, token, snapshot, exists),
            Input::Collected { result } => roles.collected(out, result),
            Input::RestoreApplied { node, restore_id } => {
                roles.restore_applied(out, now, &node, &restore_id);
            }
            Input::RestoreFailed {
                node,
                restore_id,
                why,
            } => roles
                .restores
                .node_failed(out, wall, &node, Some(&restore_id), &why),
            Input::RestoreTimedOut { epoch } => roles.restores.timed_out(out, wall, epoch),
            Input::Due => roles.scheduled(out, now, self.term),
            Input::ScheduleRefused { busy, why } => roles.schedule_refused(out, busy, why),
            Input::SetPolicy { token, change } => roles.set_policy(out, token, change),
            Input::AdoptPolicy {
                token,
                policy,
                source,
            } => roles.adopt_policy(out, token, policy, source),
            Input::StartsLoaded { requests } => {
                for (id, request_id) in requests {
                    roles.snapshots.remember_request(id, request_id);
                }
            }
            Input::OutcomesLoaded { outcomes } => roles.snapshots.outcomes_loaded(outcomes),
            Input::OutcomesAfter { node, after } => out.push(Action::Send {
                command: NodeCommand::Outcomes(roles.snapshots.outcomes_after(after)),
                node,
            }),
            Input::NewestCompleted { age } => {
                roles.snapshots.schedule.completed_before(now.mono_ms, age);
            }
            Input::Tick => {
                roles.snapshots.tick(out);
                roles.restores.tick(out, wall);
                roles.membership_tick(out, now);
                roles.maybe_recover(out, now);
            }
        }
    }

    /// The next action to carry out, oldest first.
    pub fn next_action(&mut self) -> Option<Action<E>> {
        self.actions.0.pop_front()
    }

    /// Every action queued, oldest first.
    pub fn drain_actions(&mut self) -> Vec<Action<E>> {
        self.actions.0.drain(..).collect()
    }

    /// The snapshot tracker (to read the snapshots in flight and the limit).
    pub fn tracker(&self) -> &SnapshotTracker {
        self.roles.snapshots.tracker()
    }

    /// A snapshot in flight's record as it stands, with the tracker's progress; `None` if
    /// it is not in flight.
    pub fn live_record(&self, id: SnapshotId) -> Option<SnapshotRecord> {
        self.roles.snapshots.live_record(id)
    }

    /// The snapshots in flight.
    pub fn in_flight(&self) -> usize {
        self.roles.snapshots.in_flight()
    }

    /// Whether snapshot `id` is not over for the store: in flight, or ended and its end
    /// not stored yet.
    pub fn is_open(&self, id: SnapshotId) -> bool {
        self.roles.snapshots.is_open(id)
    }

    /// Whether `node` may upload its part of snapshot `id` (it is in flight and `node`
    /// takes part).
    pub fn check_upload(&self, id: SnapshotId, node: &NodeId) -> Result<(), Refusal<E>> {
        self.roles.snapshots.check_upload(id, node)
    }

    /// The highest snapshot id a daemon reported.
    pub fn id_floor(&self) -> u64 {
        self.roles.snapshots.id_floor()
    }

    /// Ends whose store failed, waiting for the next [`Input::Tick`].
    pub fn unstored(&self) -> usize {
        self.roles.snapshots.unstored()
    }

    /// The cluster's epoch.
    pub fn epoch(&self) -> u64 {
        self.roles.restores.epoch()
    }

    /// The restore under way (its record as it stands: an end not yet stored is still
    /// the restore under way).
    pub fn active_restore(&self) -> Option<&RestoreRecord> {
        self.roles.restores.active()
    }

    /// The newest restore, if it failed: until a later one is applied by every node, no
    /// snapshot starts.
    pub fn unfinished_restore(&self) -> Option<&RestoreRecord> {
        self.roles.restores.unfinished()
    }

    /// The restore that keeps snapshot `id` from being deleted, if any.
    pub fn restore_holding(&self, id: SnapshotId) -> Option<&RestoreRecord> {
        self.roles.restore_holding(id)
    }

    /// When the next scheduled snapshot is due, on the monotonic clock; `None`: none is.
    pub fn next_due(&self) -> Option<u64> {
        self.roles.snapshots.schedule.next_due()
    }

    /// The schedule's state at `now`.
    pub fn schedule_status(&self, now: Now) -> Status {
        self.roles.snapshots.schedule.status(now.mono_ms)
    }

    /// The policy in force, where it came from, and the schedule's state at `now`.
    pub fn policy_view(&self, now: Now) -> PolicyView {
        self.roles.policy_view(now)
    }

    /// Why automatic recovery is due, if it is.
    pub fn pending_recovery(&self) -> Option<&str> {
        self.roles.restores.pending_recovery()
    }

    /// Whether a restore is being chosen (verified, or its epoch allocated).
    pub fn choosing_restore(&self) -> bool {
        self.roles.restores.choosing().is_some()
    }

    /// Why snapshots may not start now, if they may not.
    pub fn fence(&self) -> Option<String> {
        self.roles.fence()
    }

    /// The membership nodes are told now (and `ListNodes` answers).
    pub fn membership(&self) -> Membership {
        self.roles.membership()
    }

    /// The members connected now.
    pub fn members(&self) -> &BTreeMap<NodeId, Member> {
        &self.roles.members.members
    }

    /// Whether every node of the roster is connected.
    pub fn all_connected(&self) -> bool {
        let members = &self.roles.members;
        members
            .roster
            .nodes()
            .all(|n| members.members.contains_key(n))
    }

    /// The roster's nodes.
    pub fn roster_nodes(&self) -> impl Iterator<Item = &NodeId> + '_ {
        self.roles.members.roster.nodes()
    }
}
