//! Membership across the roles: a registration (one live process per node id, the epoch a
//! node is to be in, what it still has to do about a restore), a session that ends or goes
//! silent, a removal and a daemon leaving for good, and the start's checks that need the
//! members (the fence, the topology).

use std::fmt::Display;

use super::members::{MEMBER_SILENCE_MS, Member, Registering, RemovalBy, removed_answer};
use super::{Action, Actions, Answer, Note, Now, Persist, Refusal, Roles, Token, Write};
use crate::control::{Membership, NodeCommand, NodeRestore, Registration};
use crate::record::MemberRecord;
use crate::{FailureReason, NodeId, SnapshotId, Topology};

/// The largest snapshot id or epoch a daemon may report at registration (far above any a
/// real cluster reaches; keeps the counters' arithmetic clear of overflow).
pub const MAX_REPORTED: u64 = 1 << 48;

/// What a registering node still has to do about a restore.
enum OnRegister {
    Nothing,
    /// It is behind a restore that ended: it keeps its epoch, and the cluster is fenced.
    Missed,
    /// It had applied the restore under way (its word was lost with a session).
    Applied(String),
    /// It has not: send it the restore.
    Restore(NodeRestore),
}

impl Roles {
    /// Why snapshots may not start now, if they may not: a restore under way, one that
    /// failed and left the nodes possibly in different states, or members that missed one.
    pub(super) fn fence(&self) -> Option<String> {
        if let Some(active) = self.restores.active() {
            return Some(format!(
                "{} (of snapshot {}) is in progress; snapshots can start once every node has \
                 applied it",
                active.id, active.snapshot_id
            ));
        }
        if let Some(r) = self.restores.unfinished() {
            return Some(format!(
                "{} (of snapshot {}) did not finish ({}): the nodes may hold different states, \
                 so no snapshot starts until a restore is applied by every node (cairnctl \
                 snapshot restore ID)",
                r.id,
                r.snapshot_id,
                r.failure.as_deref().unwrap_or("failed")
            ));
        }
        let epoch = self.restores.epoch();
        let behind = self.members.behind(epoch);
        (!behind.is_empty()).then(|| {
            format!(
                "nodes missed a restore and are not in the cluster's epoch {epoch}: {}; no \
                 snapshot starts until a restore is applied by every node",
                behind.join(", ")
            )
        })
    }

    /// What a snapshot may span now: no fence, every node of the topology connected, at
    /// least one node.
    pub(super) fn spannable<E>(&self) -> Result<Topology, Refusal<E>> {
        if let Some(fence) = self.fence() {
            return Err(Refusal::Fenced(fence));
        }
        let topology = self
            .members
            .topology()
            .map_err(Refusal::NodesNotConnected)?;
        if self.members.roster.is_empty() {
            return Err(Refusal::NoMembers);
        }
        Ok(topology)
    }

    /// The membership nodes are told now.
    pub(super) fn membership(&self) -> Membership {
        self.members.membership(self.restores.epoch())
    }

    /// A daemon registers: every check, then its records are stored in one batch (the
    /// epoch counter if it saw a later epoch, its roster record if it changed, the end of
    /// its removal, its member record); [`Self::registration_stored`] goes on.
    pub(super) fn register<E>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        token: Token,
        registration: Registration,
        session: u64,
        cluster: &str,
    ) {
        match self.check_registration(now, &registration, cluster) {
            Err(refusal) => out.push(registered_answer(token, Err(refusal))),
            Ok(node) => {
                // A daemon that saw higher ids than the store holds: the metadata was lost
                // or rolled back. Never hand out what the daemons already know.
                self.snapshots.id_seen(registration.highest_snapshot_id);
                let mut writes = Vec::new();
                if registration.epoch > self.restores.epoch() {
                    // A daemon in a later epoch than the store says (lost metadata?).
                    writes.push(Write::EpochCounter(registration.epoch));
                }
                // A new daemon process (no epoch of its own yet, an incarnation the roster
                // does not know) may enter the cluster's epoch as it is; one that has an
                // epoch keeps it.
                let fresh = registration.epoch == 0
                    && registration.applied_restore_id.is_empty()
                    && self
                        .members
                        .roster
                        .get(&node)
                        .is_none_or(|r| r.incarnation != registration.incarnation);
                let enrollment = self.members.roster.enroll(
                    &node,
                    &registration.address,
                    registration.incarnation,
                    now.wall_ms,
                );
                writes.extend(enrollment.record.clone().map(Write::Roster));
                if self.members.removed.contains_key(&node) {
                    // Back after a removal: a new member (the roster record says so first).
                    writes.push(Write::DeleteRemoved(node.clone()));
                }
                let record = MemberRecord {
                    node: node.to_string(),
                    address: registration.address.clone(),
                    incarnation: registration.incarnation,
                    registered_at_ms: now.wall_ms,
                };
                writes.push(Write::Member(record.clone()));
                out.push(Action::Persist {
                    what: Persist::Register(token),
                    write: Write::Batch(writes),
                    attempt: 1,
                });
                self.members.registering.insert(
                    token,
                    Registering {
                        registration,
                        node,
                        session,
                        enrollment,
                        fresh,
                        record,
                    },
                );
            }
        }
    }

    fn check_registration<E>(
        &self,
        now: Now,
        register: &Registration,
        cluster: &str,
    ) -> Result<NodeId, Refusal<E>> {
        if register.cluster != cluster {
            return Err(Refusal::ClusterMismatch {
                ours: cluster.to_owned(),
                theirs: register.cluster.clone(),
            });
        }
        if register.node.is_empty() || register.address.is_empty() {
            return Err(Refusal::Invalid(
                "register needs node_id and address".into(),
            ));
        }
        let node = NodeId::new(register.node.clone());
        // One live process per node id: a second daemon claiming an id whose holder is
        // connected and heard from is refused (a restarted daemon's predecessor has gone
        // silent or its session has ended). Its session ends, or the silence check drops
        // it (`MEMBER_SILENCE_MS`), before another process may take the id.
        if let Some(old) = self.members.members.get(&node)
            && old.record.incarnation != register.incarnation
        {
            let silent = now.mono_ms.saturating_sub(old.heard);
            return Err(Refusal::NodeIdHeld(format!(
                "node id {node} is held by a connected daemon at {} (incarnation {}, heard \
                 from {silent} ms ago); this daemon (incarnation {}, at {}) is refused: is a \
                 second process running with --node-id {node}?",
                old.record.address, old.record.incarnation, register.incarnation, register.address
            )));
        }
        if register.highest_snapshot_id > MAX_REPORTED || register.epoch > MAX_REPORTED {
            return Err(Refusal::Invalid(format!(
                "register: highest_snapshot_id {} or epoch {} is above {MAX_REPORTED}",
                register.highest_snapshot_id, register.epoch
            )));
        }
        self.members
            .roster
            .admits(&node)
            .map_err(Refusal::NotInTopology)?;
        // The process that was removed may not come back as it is: its peers dropped their
        // channels to it and would meet its old sequence numbers and state. A new process
        // (a restart) joins as a new member.
        if let Some(&removed) = self.members.removed.get(&node)
            && removed != 0
            && removed == register.incarnation
        {
            return Err(Refusal::RemovedNode(node));
        }
        Ok(node)
    }

    /// The store answered for a registration's records: stored, the node is a member —
    /// what its joining, moving or restarting does to snapshots and the restore is done,
    /// its session is told the membership first, and every other member after.
    pub(super) fn registration_stored<E: Display>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        token: Token,
        result: Result<(), E>,
    ) {
        let Some(Registering {
            registration,
            node,
            session,
            enrollment,
            fresh,
            record,
        }) = self.members.registering.remove(&token)
        else {
            return;
        };
        if let Err(e) = result {
            return out.push(registered_answer(token, Err(Refusal::Store(e))));
        }
        self.restores.epoch_raised(registration.epoch);
        if let Some(roster) = enrollment.record {
            self.members.roster.insert(roster);
        }
        self.members.removed.remove(&node);
        if let Some(change) = enrollment.change {
            if enrollment.joined {
                // Snapshots in flight were planned without it.
                let reason = FailureReason::MembershipChanged(change.clone());
                self.snapshots.fail_all(out, now.wall_ms, &reason);
            }
            out.push(Action::Note(Note::Changed {
                node: node.clone(),
                change,
            }));
        }
        if enrollment.restarted {
            out.push(Action::Note(Note::Restarted { node: node.clone() }));
            self.restores
                .recovery_due(format!("{node} restarted"), None);
            // A new process of a node of the restore under way: if its previous process
            // applied (heard or not: an acknowledgement lost with a leader or a session is
            // unknown), it went on from the restored state with the nodes that applied too,
            // so the restore cannot be finished by restoring it alone (its new process
            // would send that epoch's messages again). The restore fails, and starts over
            // for every node (automatic recovery) or waits for one (the cluster stays
            // fenced).
            if self
                .restores
                .active()
                .is_some_and(|active| registration.applied_restore_id != active.id)
            {
                self.restores.node_restarted(out, now.wall_ms, &node);
            }
        }
        if let Some(old) = self.members.members.get(&node)
            && old.record.incarnation != registration.incarnation
        {
            // Its previous process is gone: the snapshots through it fail.
            self.snapshots.node_lost(out, now.wall_ms, &node);
        }
        let (epoch, next) = self.epoch_on_register(out, &node, &registration, fresh);
        if matches!(next, OnRegister::Missed) {
            // Behind a restore that ended, the cluster is fenced until one brings every node
            // to one state: automatic recovery's. Due at each such registration, so that a
            // leader of a later term recovers too: the restart behind it may have been seen
            // only by a term that ended before its recovery ran (the long nemesis run: 40 s
            // fenced, until an operator restored).
            self.restores.recovery_due(
                format!(
                    "{node} missed a restore (in epoch {}, the cluster in {})",
                    registration.epoch,
                    self.restores.epoch()
                ),
                None,
            );
        }
        out.push(Action::Note(Note::Registered {
            node: node.clone(),
            address: record.address.clone(),
            epoch,
        }));
        self.members.members.insert(
            node.clone(),
            Member {
                record,
                session,
                last_seen_ms: now.wall_ms,
                heard: now.mono_ms,
                application_attached: false,
                epoch,
                channels: Vec::new(),
            },
        );
        out.push(Action::Admit {
            node: node.clone(),
            token,
        });
        let membership = self.membership();
        // `Registered` goes first on the new session, before any command can. It carries
        // the epoch this node is to be in, which is the cluster's only if it may enter it.
        out.push(Action::Send {
            node: node.clone(),
            command: NodeCommand::Registered(Membership {
                epoch,
                ..membership.clone()
            }),
        });
        // Every member learns who holds each id now (peers admit streams from it only).
        out.push(Action::Broadcast {
            command: NodeCommand::Membership(membership.clone()),
            except: Some(node.clone()),
        });
        match next {
            OnRegister::Nothing | OnRegister::Missed => {}
            OnRegister::Applied(restore_id) => {
                self.restore_applied(out, now, &node, &restore_id);
            }
            OnRegister::Restore(command) => {
                out.push(Action::Note(Note::RestoreResent {
                    node: node.clone(),
                    restore_id: command.restore_id.clone(),
                }));
                out.push(Action::Send {
                    node,
                    command: NodeCommand::Restore(command),
                });
            }
        }
        out.push(registered_answer(token, Ok(membership)));
    }

    /// The epoch a registering node is to be in, and what it still has to do. A node
    /// never enters an epoch without that epoch's state: behind a restore under way, it
    /// keeps its epoch and is sent the restore; behind one that ended, it keeps its epoch
    /// and the cluster stays fenced ([`Self::fence`]) until a restore brings every node to
    /// one state. Only a new daemon enters the cluster's epoch as it is.
    fn epoch_on_register<E>(
        &self,
        out: &mut Actions<E>,
        node: &NodeId,
        register: &Registration,
        fresh: bool,
    ) -> (u64, OnRegister) {
        // A restore whose end is taken (if not stored yet) is no longer one to apply: a
        // node that restarted is not sent it (it would restore alone).
        if let Some(restore) = self.restores.applying()
            && self
                .restores
                .active_nodes()
                .is_some_and(|nodes| nodes.contains(node))
        {
            if register.applied_restore_id == restore.id {
                return (restore.epoch, OnRegister::Applied(restore.id.clone()));
            }
            if register.epoch == restore.epoch {
                // In the epoch, its application about to apply: its word comes later.
                return (restore.epoch, OnRegister::Nothing);
            }
            let command = NodeRestore {
                restore_id: restore.id.clone(),
                snapshot: SnapshotId(restore.snapshot_id),
                epoch: restore.epoch,
            };
            return (register.epoch, OnRegister::Restore(command));
        }
        let epoch = self.restores.epoch();
        if register.epoch == epoch || fresh {
            return (epoch, OnRegister::Nothing);
        }
        out.push(Action::Note(Note::MissedRestore {
            node: node.clone(),
            node_epoch: register.epoch,
            epoch,
        }));
        (register.epoch, OnRegister::Missed)
    }

    /// A node's session ended (`session`: only its current one counts).
    pub(super) fn session_ended<E>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        node: &NodeId,
        session: u64,
    ) {
        if self.members.members.get(node).map(|m| m.session) == Some(session) {
            self.member_gone(out, now, node, "its session with the coordinator ended");
        }
    }

    /// A member is no longer connected: it leaves the members (which ends its session's
    /// stream), its restore share and its snapshots in flight fail.
    pub(super) fn member_gone<E>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        node: &NodeId,
        why: &str,
    ) {
        let epoch = self.restores.epoch();
        self.members.gone(out, node, why, epoch);
        self.restores.node_failed(out, now.wall_ms, node, None, why);
        self.snapshots.node_lost(out, now.wall_ms, node);
    }

    /// A user removes a node that is down.
    pub(super) fn remove_node<E>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        token: Token,
        node: &NodeId,
    ) {
        match self.members.check_removal(node, self.restore_named()) {
            Ok(()) => self.members.remove(out, now, node, RemovalBy::User(token)),
            Err(refusal) => out.push(removed_answer(token, Err(refusal))),
        }
    }

    /// A connected node leaves for good: it is disconnected and removed, and told whether
    /// it was (it stays on the roster while a restore is under way).
    pub(super) fn leave<E>(&mut self, out: &mut Actions<E>, now: Now, node: &NodeId) {
        if !self.members.members.contains_key(node) {
            return;
        }
        if let Some((restore, snapshot)) = self.restore_named() {
            let refusal = Refusal::RestoreInProgress {
                restore: restore.to_owned(),
                snapshot: SnapshotId(snapshot),
            };
            return self.left(out, node, Some(refusal));
        }
        out.push(Action::Note(Note::Leaving { node: node.clone() }));
        self.members.members.remove(node);
        // It hears no membership without itself before its answer.
        out.push(Action::Detach { node: node.clone() });
        out.push(Action::Persist {
            what: Persist::DeleteMember(node.clone()),
            write: Write::DeleteMember(node.clone()),
            attempt: 1,
        });
        self.members.remove(out, now, node, RemovalBy::Leave);
    }

    /// Tells a leaving node whether it was removed, then ends its session if it is no
    /// longer a member.
    fn left<E>(&mut self, out: &mut Actions<E>, node: &NodeId, refusal: Option<Refusal<E>>) {
        out.push(Action::Left {
            node: node.clone(),
            refusal,
        });
        if !self.members.members.contains_key(node) {
            out.push(Action::Dismiss { node: node.clone() });
        }
    }

    /// The store answered for the removal of `node`: if stored, the snapshots in flight
    /// fail (planned over it) and every member hears its new membership; whoever asked is
    /// answered.
    pub(super) fn removal_stored<E: Display>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        node: &NodeId,
        result: Result<(), E>,
    ) {
        let Some((by, result)) = self.members.removal_stored(out, node, result) else {
            return;
        };
        if result.is_ok() {
            let reason = FailureReason::MembershipChanged(format!("{node} removed"));
            self.snapshots.fail_all(out, now.wall_ms, &reason);
            out.push(Action::Broadcast {
                command: NodeCommand::Membership(self.membership()),
                except: None,
            });
        }
        match by {
            RemovalBy::User(token) => {
                let answer = result.map(|()| self.membership()).map_err(Refusal::Store);
                out.push(removed_answer(token, answer));
            }
            RemovalBy::Leave => self.left(out, node, result.err().map(Refusal::Store)),
            // A failure is tried again at a later tick.
            RemovalBy::LongGone => {}
        }
    }

    /// The tick: members gone silent are dropped, nodes down longer than `--remove-after`
    /// removed.
    pub(super) fn membership_tick<E>(&mut self, out: &mut Actions<E>, now: Now) {
        for (node, silent) in self.members.silent(now) {
            debug_assert!(silent >= MEMBER_SILENCE_MS);
            self.member_gone(out, now, &node, &format!("no heartbeat for {silent} ms"));
        }
        for node in self.members.long_gone(now) {
            // A restore under way: tried again at a later tick.
            if self
                .members
                .check_removal::<E>(&node, self.restore_named())
                .is_ok()
            {
                self.members.remove(out, now, &node, RemovalBy::LongGone);
            }
        }
    }

    /// A node's application applied a restore: the node is in its epoch, if it is the
    /// one under way (or the current epoch's).
    pub(super) fn restore_applied<E>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        node: &NodeId,
        id: &str,
    ) {
        if let Some(epoch) = self.restores.applied(out, now.wall_ms, node, id)
            && let Some(member) = self.members.members.get_mut(node)
        {
            member.epoch = epoch;
        }
    }

    /// The restore under way, as a refusal names it.
    fn restore_named(&self) -> Option<(&str, u64)> {
        self.restores
            .active()
            .map(|r| (r.id.as_str(), r.snapshot_id))
    }
}

fn registered_answer<E>(token: Token, result: Result<Membership, Refusal<E>>) -> Action<E> {
    Action::Reply {
        token,
        answer: Answer::Registered(result),
    }
}
