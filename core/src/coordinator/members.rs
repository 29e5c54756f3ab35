//! The engine's membership role: the roster (every node that ever registered, kept while
//! it is down), the nodes removed and not back, the members connected now, and the
//! registrations and removals under way. A registration or a removal is stored before it
//! takes effect: the records it needs are written as one batch, and only once the store
//! acknowledged them does the node count as a member (or as removed) and anyone hear of
//! it (`register.rs` follows a registration across the roles).

use std::collections::BTreeMap;
use std::time::Duration;

use super::roster::{Enrollment, Roster};
use super::{Action, Actions, Answer, Note, Now, Persist, Refusal, Token, Write};
use crate::control::{ChannelStatus, Membership, NodeCommand, NodeInfo, Registration};
use crate::record::{MemberRecord, RemovedRecord};
use crate::{NodeId, Topology};

/// A daemon that has not been heard from for this long is taken as gone (three
/// heartbeats), and a second daemon claiming a node id whose holder was heard from within
/// it is refused.
pub const MEMBER_SILENCE_MS: u64 = 6_000;

/// A silence check is skipped when the ticks come further apart than this: the runtime
/// was busy, and the heartbeats may be waiting in its queue, not missing.
const LATE_TICK_MS: u64 = 1_000;

/// A connected node.
#[derive(Debug, Clone)]
pub struct Member {
    /// Its record (as stored).
    pub record: MemberRecord,
    /// Its session with the coordinator.
    pub session: u64,
    /// When it was last heard from, in milliseconds since the Unix epoch.
    pub last_seen_ms: u64,
    /// When it was last heard from, on the monotonic clock.
    pub heard: u64,
    /// Whether its application is attached.
    pub application_attached: bool,
    /// The epoch the daemon is in, as far as the coordinator knows.
    pub epoch: u64,
    /// Its channels as of its last heartbeat.
    pub channels: Vec<ChannelStatus>,
}

/// A registration whose records are being stored.
pub(super) struct Registering {
    pub(super) registration: Registration,
    pub(super) node: NodeId,
    pub(super) session: u64,
    pub(super) enrollment: Enrollment,
    /// A new daemon process: it may enter the cluster's epoch as it is.
    pub(super) fresh: bool,
    pub(super) record: MemberRecord,
}

/// Who asked for a removal, and so who hears of its outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RemovalBy {
    /// A user's `RemoveNode`.
    User(Token),
    /// The node's daemon leaving for good: it hears `Left`.
    Leave,
    /// `--remove-after`.
    LongGone,
}

pub(super) struct Members {
    pub(super) roster: Roster,
    /// Nodes removed and not back, with the incarnation that may not return.
    pub(super) removed: BTreeMap<NodeId, u64>,
    pub(super) members: BTreeMap<NodeId, Member>,
    /// Since when (monotonic) each roster node is not connected, for `--remove-after`.
    down_since: BTreeMap<NodeId, u64>,
    remove_after: Option<Duration>,
    /// Removals whose record is being stored.
    removing: BTreeMap<NodeId, (RemovedRecord, RemovalBy)>,
    /// When silent members were last looked for (monotonic).
    last_silence_check: Option<u64>,
    /// Registrations whose records are being stored.
    pub(super) registering: BTreeMap<Token, Registering>,
}

impl Members {
    pub(super) fn new(topology: Option<Topology>, remove_after: Option<Duration>) -> Self {
        Self {
            roster: Roster::new(topology),
            removed: BTreeMap::new(),
            members: BTreeMap::new(),
            down_since: BTreeMap::new(),
            remove_after,
            removing: BTreeMap::new(),
            last_silence_check: None,
            registering: BTreeMap::new(),
        }
    }

    /// At a term's start: the stored roster and removed nodes.
    pub(super) fn loaded<E>(
        &mut self,
        out: &mut Actions<E>,
        roster: Vec<crate::record::RosterRecord>,
        removed: BTreeMap<NodeId, u64>,
    ) {
        for node in self.roster.load(roster) {
            out.push(Action::Note(Note::LeftOutOfTopology { node }));
        }
        // A node on the roster is not removed: its removal did not finish, or its return is
        // not recorded yet (the runtime deletes such records).
        self.removed = removed
            .into_iter()
            .filter(|(node, _)| !self.roster.contains(node))
            .collect();
    }

    /// The topology snapshots span: every one of its nodes must be connected.
    pub(super) fn topology(&self) -> Result<Topology, String> {
        self.roster.spanning(|node| self.members.contains_key(node))
    }

    /// What nodes are told: every known node with its address, the channels among them,
    /// the cluster's `epoch` and the nodes removed.
    pub(super) fn membership(&self, epoch: u64) -> Membership {
        Membership {
            nodes: self.nodes(),
            channels: self
                .roster
                .known_topology()
                .channels()
                .iter()
                .cloned()
                .collect(),
            epoch,
            removed: self.removed.keys().cloned().collect(),
        }
    }

    /// Every roster node as `ListNodes` and the membership show it.
    fn nodes(&self) -> Vec<NodeInfo> {
        self.roster
            .iter()
            .map(|(id, r)| {
                let live = self.members.get(id);
                NodeInfo {
                    node: id.clone(),
                    address: r.address.clone(),
                    // The incarnation admitted last, connected or not: peers accept
                    // streams from this daemon only.
                    incarnation: live.map_or(r.incarnation, |m| m.record.incarnation),
                    application_attached: live.is_some_and(|m| m.application_attached),
                    last_seen_ms: live.map_or(0, |m| m.last_seen_ms),
                    connected: live.is_some(),
                    channels: live.map(|m| m.channels.clone()).unwrap_or_default(),
                }
            })
            .collect()
    }

    /// `node` was heard from.
    pub(super) fn heard(&mut self, now: Now, node: &NodeId) -> Option<&mut Member> {
        let member = self.members.get_mut(node)?;
        member.last_seen_ms = now.wall_ms;
        member.heard = now.mono_ms;
        Some(member)
    }

    /// The members' epochs that are not `epoch`, as the fence names them.
    pub(super) fn behind(&self, epoch: u64) -> Vec<String> {
        self.members
            .iter()
            .filter(|(_, m)| m.epoch != epoch)
            .map(|(n, m)| format!("{n} (epoch {})", m.epoch))
            .collect()
    }

    /// Starts removing `node` (on the roster, not connected, no restore under way: the
    /// caller checked): its record is stored, then it is removed.
    pub(super) fn remove<E>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        node: &NodeId,
        by: RemovalBy,
    ) {
        let record = RemovedRecord {
            node: node.to_string(),
            removed_at_ms: now.wall_ms,
            incarnation: self.roster.get(node).map_or(0, |r| r.incarnation),
        };
        out.push(Action::Persist {
            what: Persist::Removal(node.clone()),
            write: Write::Remove(record.clone()),
            attempt: 1,
        });
        self.removing.insert(node.clone(), (record, by));
    }

    /// Why `node` cannot be removed now, if it cannot (`restore`: the restore under way).
    pub(super) fn check_removal<E>(
        &self,
        node: &NodeId,
        restore: Option<(&str, u64)>,
    ) -> Result<(), Refusal<E>> {
        if !self.roster.contains(node) {
            return Err(Refusal::NotAMember(node.clone()));
        }
        if let Some(member) = self.members.get(node) {
            return Err(Refusal::StillConnected {
                node: node.clone(),
                address: member.record.address.clone(),
            });
        }
        if let Some((restore, snapshot)) = restore {
            return Err(Refusal::RestoreInProgress {
                restore: restore.to_owned(),
                snapshot: crate::SnapshotId(snapshot),
            });
        }
        Ok(())
    }

    /// The store answered for the removal of `node`: the removal, if stored, and who
    /// asked.
    pub(super) fn removal_stored<E>(
        &mut self,
        out: &mut Actions<E>,
        node: &NodeId,
        result: Result<(), E>,
    ) -> Option<(RemovalBy, Result<(), E>)> {
        let (record, by) = self.removing.remove(node)?;
        if result.is_ok() {
            self.roster.remove(node);
            self.removed.insert(node.clone(), record.incarnation);
            self.down_since.remove(node);
            out.push(Action::Note(Note::Removed {
                node: node.clone(),
                long_gone: (by == RemovalBy::LongGone)
                    .then_some(self.remove_after)
                    .flatten(),
            }));
        }
        Some((by, result))
    }

    /// A member is no longer connected: it leaves the members (its session's stream ends),
    /// the others hear it is down, and its record is deleted (a failure is only logged).
    pub(super) fn gone<E>(&mut self, out: &mut Actions<E>, node: &NodeId, why: &str, epoch: u64) {
        out.push(Action::Note(Note::Gone {
            node: node.clone(),
            why: why.to_owned(),
        }));
        self.members.remove(node);
        out.push(Action::Dismiss { node: node.clone() });
        // The others hear it is down (their readiness stops waiting for their link to it).
        out.push(Action::Broadcast {
            command: NodeCommand::Membership(self.membership(epoch)),
            except: None,
        });
        out.push(Action::Persist {
            what: Persist::DeleteMember(node.clone()),
            write: Write::DeleteMember(node.clone()),
            attempt: 1,
        });
    }

    /// The members not heard from for [`MEMBER_SILENCE_MS`] (a paused or partitioned
    /// daemon whose connection has not broken), with how long; none if the ticks came late.
    pub(super) fn silent(&mut self, now: Now) -> Vec<(NodeId, u64)> {
        let last = self.last_silence_check.replace(now.mono_ms);
        if last.is_some_and(|last| now.mono_ms.saturating_sub(last) > LATE_TICK_MS) {
            return Vec::new();
        }
        self.members
            .iter()
            .map(|(n, m)| (n.clone(), now.mono_ms.saturating_sub(m.heard)))
            .filter(|(_, silent)| *silent >= MEMBER_SILENCE_MS)
            .collect()
    }

    /// `--remove-after`: the roster nodes down longer than that (none while most of the
    /// roster is down: a coordinator cut off from its nodes must not remove them all).
    pub(super) fn long_gone(&mut self, now: Now) -> Vec<NodeId> {
        let Some(after) = self.remove_after else {
            return Vec::new();
        };
        let after = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        let roster: Vec<NodeId> = self.roster.nodes().cloned().collect();
        self.down_since.retain(|n, _| roster.contains(n));
        if self.members.len() * 2 <= roster.len() {
            return Vec::new();
        }
        let mut due = Vec::new();
        for node in roster {
            if self.members.contains_key(&node) {
                self.down_since.remove(&node);
                continue;
            }
            let since = *self.down_since.entry(node.clone()).or_insert(now.mono_ms);
            if now.mono_ms.saturating_sub(since) >= after && !self.removing.contains_key(&node) {
                due.push(node);
            }
        }
        due
    }
}

/// The answer to whoever removed a node.
pub(super) fn removed_answer<E>(token: Token, result: Result<Membership, Refusal<E>>) -> Action<E> {
    Action::Reply {
        token,
        answer: Answer::Removed(result),
    }
}
