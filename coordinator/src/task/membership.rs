//! Membership, as the coordinator's task keeps it: registrations (one live process per node
//! id, the epoch a node is to be in), sessions that end or go silent, and what nodes and
//! `ListNodes` are told. The roster's rules are plain data in [`crate::roster`].

use std::time::Duration;

use cairn_core::control::{
    ChannelStatus, Membership, NodeCommand, NodeInfo, NodeRestore, Registration,
};
use cairn_core::coordinator::Input;
use cairn_core::{FailureReason, NodeId, SnapshotId, Topology};
use tokio::time::Instant;

use super::{NodeTx, State};
use crate::error::Error;
use crate::store::MemberRecord;
use cairn_proto::stored::convert::now_ms;

pub(super) struct Member {
    pub(super) record: MemberRecord,
    pub(super) session: u64,
    pub(super) tx: NodeTx,
    pub(super) last_seen_ms: u64,
    /// When it was last heard from, on the monotonic clock.
    pub(super) heard: Instant,
    pub(super) application_attached: bool,
    /// The epoch the daemon is in, as far as the coordinator knows.
    pub(super) epoch: u64,
    /// Its channels as of its last heartbeat.
    pub(super) channels: Vec<ChannelStatus>,
}

/// What a registering node still has to do about a restore.
pub(super) enum OnRegister {
    Nothing,
    /// It had applied the restore under way (its word was lost with a session).
    Applied(String),
    /// It has not: send it the restore.
    Restore(NodeRestore),
}

/// A daemon that has not been heard from for this long is taken as gone (three
/// heartbeats), and a second daemon claiming a node id whose holder was heard from
/// within it is refused.
pub(super) const MEMBER_SILENCE_MS: u64 = 6_000;

/// The largest snapshot id or epoch a daemon may report at registration (far above any a
/// real cluster reaches; keeps the counters' arithmetic clear of overflow).
const MAX_REPORTED: u64 = 1 << 48;

impl State {
    /// The topology snapshots span ([`crate::roster::Roster::spanning`]): every one of its
    /// nodes must be connected.
    pub(super) fn topology(&self) -> Result<Topology, Error> {
        self.roster
            .spanning(|node| self.members.contains_key(node))
            .map_err(Error::NodesNotConnected)
    }

    /// What nodes are told: every known node with its address, and the channels among them.
    pub(super) fn membership(&self) -> Membership {
        Membership {
            nodes: self.nodes(),
            channels: self
                .roster
                .known_topology()
                .channels()
                .iter()
                .cloned()
                .collect(),
            epoch: self.engine.epoch(),
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

    /// Sends `membership` to every connected member but `except`.
    fn tell_members(&self, membership: &Membership, except: Option<&NodeId>) {
        for (id, member) in &self.members {
            if Some(id) != except {
                self.command(&member.tx, NodeCommand::Membership(membership.clone()));
            }
        }
    }

    /// What `ListNodes` answers (the membership's nodes and channels).
    pub(super) fn list_nodes(&self) -> Membership {
        self.membership()
    }

    /// Puts a registering node on the roster, or moves it to its new address, and notes its
    /// incarnation ([`crate::roster::Roster::enroll`] decides; this stores and tells).
    /// Returns what changed for the other nodes, if anything, and whether the node's
    /// daemon restarted since it last registered.
    pub(super) async fn enroll(
        &mut self,
        node: &NodeId,
        address: &str,
        incarnation: u64,
    ) -> Result<(Option<String>, bool), Error> {
        let enrollment = self.roster.enroll(node, address, incarnation, now_ms());
        if let Some(record) = enrollment.record {
            self.meta.put_roster(&record).await?;
            self.roster.insert(record);
        }
        if self.removed.remove(node).is_some() {
            // Back after a removal: a new member (the roster record above says so first).
            self.meta.delete_removed(node.as_str()).await?;
        }
        let Some(change) = enrollment.change else {
            return Ok((None, enrollment.restarted));
        };
        if enrollment.joined {
            // Snapshots in flight were planned without it.
            let reason = FailureReason::MembershipChanged(change.clone());
            self.drive(Input::FailAll { reason }).await;
        }
        tracing::info!(%node, %address, "{change}");
        Ok((Some(change), enrollment.restarted))
    }

    pub(super) async fn register(
        &mut self,
        register: Registration,
        session: u64,
        tx: NodeTx,
    ) -> Result<Membership, Error> {
        if register.cluster != self.settings.cluster {
            return Err(Error::ClusterMismatch {
                ours: self.settings.cluster.clone(),
                theirs: register.cluster.clone(),
            });
        }
        if register.node.is_empty() || register.address.is_empty() {
            return Err(Error::InvalidArgument(
                "register needs node_id and address".into(),
            ));
        }
        let node = NodeId::new(register.node.clone());
        // One live process per node id: a second daemon claiming an id whose holder is
        // connected and heard from is refused (a restarted daemon's predecessor has gone
        // silent or its session has ended).
        // Its session ends, or the silence check drops it (`MEMBER_SILENCE_MS`), before
        // another process may take the id.
        if let Some(old) = self.members.get(&node)
            && old.record.incarnation != register.incarnation
        {
            let silent = old.heard.elapsed().as_millis();
            return Err(Error::NodeIdHeld(format!(
                "node id {node} is held by a connected daemon at {} (incarnation {}, heard \
                 from {silent} ms ago); this daemon (incarnation {}, at {}) is refused: is a \
                 second process running with --node-id {node}?",
                old.record.address, old.record.incarnation, register.incarnation, register.address
            )));
        }
        if register.highest_snapshot_id > MAX_REPORTED || register.epoch > MAX_REPORTED {
            return Err(Error::InvalidArgument(format!(
                "register: highest_snapshot_id {} or epoch {} is above {MAX_REPORTED}",
                register.highest_snapshot_id, register.epoch
            )));
        }
        self.roster.admits(&node).map_err(Error::NotInTopology)?;
        // The process that was removed may not come back as it is: its peers dropped their
        // channels to it and would meet its old sequence numbers and state. A new process
        // (a restart) joins as a new member.
        if let Some(&removed) = self.removed.get(&node)
            && removed != 0
            && removed == register.incarnation
        {
            return Err(Error::Removed(node.to_string()));
        }
        // A daemon that saw higher ids or epochs than the store holds: the metadata was
        // lost or rolled back. Never hand out what the daemons already know.
        let (highest, floor) = (register.highest_snapshot_id, self.engine.id_floor());
        if highest > floor.saturating_add(1_000_000) {
            tracing::error!(%node, reported = highest, floor, "a daemon reports a snapshot id far above any known: ids continue above it");
        }
        self.drive(Input::IdSeen { highest }).await;
        if register.epoch > self.engine.epoch() {
            tracing::error!(
                %node,
                node_epoch = register.epoch,
                epoch = self.engine.epoch(),
                "a daemon is in a later epoch than the metadata store says (lost metadata?): \
                 raising the cluster's epoch"
            );
            self.meta.set_epoch_counter(register.epoch).await?;
            let epoch = register.epoch;
            self.drive(Input::EpochRaised { epoch }).await;
        }
        // A new daemon process (no epoch of its own yet, an incarnation the roster does not
        // know) may enter the cluster's epoch as it is; one that has an epoch keeps it.
        let fresh = register.epoch == 0
            && register.applied_restore_id.is_empty()
            && self
                .roster
                .get(&node)
                .is_none_or(|r| r.incarnation != register.incarnation);
        let (_, restarted) = self
            .enroll(&node, &register.address, register.incarnation)
            .await?;
        if restarted && self.settings.auto_restore {
            tracing::warn!(%node, "node restarted: automatic recovery will restore the newest completed snapshot");
            self.pending_recovery = Some(format!("{node} restarted"));
        }
        // A new process of a node that had applied the restore under way: its previous
        // process went on from the restored state with the nodes that applied too, so the
        // restore cannot be finished by restoring it alone (it would fall behind them: their
        // transfers from it counted, its own undone). The restore fails, and starts over for
        // every node (automatic recovery) or waits for one (the cluster stays fenced).
        if restarted
            && self
                .engine
                .active_restore()
                .is_some_and(|active| register.applied_restore_id != active.id)
        {
            let node = node.clone();
            self.drive(Input::RestoreNodeRestarted { node }).await;
        }
        if let Some(old) = self.members.get(&node)
            && old.record.incarnation != register.incarnation
        {
            tracing::warn!(%node, "node restarted: failing the snapshots in flight through it");
            let node = node.clone();
            self.drive(Input::NodeLost { node }).await;
        }
        let (epoch, next) = self.epoch_on_register(&node, &register, fresh);
        let record = MemberRecord {
            node: register.node.clone(),
            address: register.address,
            incarnation: register.incarnation,
            registered_at_ms: now_ms(),
        };
        self.meta.put_member(&record).await?;
        tracing::info!(%node, address = %record.address, epoch, "node registered");
        self.members.insert(
            node.clone(),
            Member {
                record,
                session,
                tx: tx.clone(),
                last_seen_ms: now_ms(),
                heard: Instant::now(),
                application_attached: false,
                epoch,
                channels: Vec::new(),
            },
        );
        self.metrics.members.set(self.members.len() as i64);
        let membership = self.membership();
        // `Registered` goes first on the new session, before any command can. It carries
        // the epoch this node is to be in, which is the cluster's only if it may enter it.
        let registered = NodeCommand::Registered(Membership {
            epoch,
            ..membership.clone()
        });
        if !self.command(&tx, registered) {
            return Err(Error::ShuttingDown);
        }
        // Every member learns who holds each id now (peers admit streams from it only).
        self.tell_members(&membership, Some(&node));
        match next {
            OnRegister::Nothing => {}
            OnRegister::Applied(restore_id) => {
                let node = node.clone();
                self.drive(Input::RestoreApplied { node, restore_id }).await;
            }
            OnRegister::Restore(command) => {
                tracing::info!(%node, restore = %command.restore_id, "the node has not applied the restore under way: sending it again");
                self.command(&tx, NodeCommand::Restore(command));
            }
        }
        self.maybe_auto_restore().await;
        Ok(membership)
    }

    /// The epoch a registering node is to be in, and what it still has to do. A node
    /// never enters an epoch without that epoch's state: behind a restore under way, it
    /// keeps its epoch and is sent the restore; behind one that ended, it keeps its epoch
    /// and the cluster stays fenced ([`Self::fence`]) until a restore brings every node
    /// to one state. Only a new daemon enters the cluster's epoch as it is.
    pub(super) fn epoch_on_register(
        &self,
        node: &NodeId,
        register: &Registration,
        fresh: bool,
    ) -> (u64, OnRegister) {
        if let Some(restore) = self.engine.active_restore()
            && self
                .engine
                .restore_nodes()
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
        let epoch = self.engine.epoch();
        if register.epoch == epoch || fresh {
            return (epoch, OnRegister::Nothing);
        }
        tracing::error!(
            %node,
            node_epoch = register.epoch,
            epoch,
            "the node missed a restore: it stays in its epoch, and no snapshot starts until \
             a restore is applied by every node"
        );
        (register.epoch, OnRegister::Nothing)
    }

    /// Takes a node that is down off the roster and out of the topology: snapshots in
    /// flight fail (planned over it), and every member is told its new membership (its
    /// daemon drops the channels to and from the node).
    pub(super) async fn remove_node(&mut self, node: &NodeId) -> Result<Membership, Error> {
        if !self.roster.contains(node) {
            return Err(Error::NotAMember(node.to_string()));
        }
        if let Some(member) = self.members.get(node) {
            return Err(Error::StillConnected {
                node: node.to_string(),
                address: member.record.address.clone(),
            });
        }
        if let Some(active) = self.engine.active_restore() {
            return Err(Error::RestoreInProgress {
                restore: active.id.clone(),
                snapshot: SnapshotId(active.snapshot_id),
            });
        }
        let record = crate::store::RemovedRecord {
            node: node.to_string(),
            removed_at_ms: now_ms(),
            incarnation: self.roster.get(node).map_or(0, |r| r.incarnation),
        };
        self.meta.remove_node(&record).await?;
        self.roster.remove(node);
        self.removed.insert(node.clone(), record.incarnation);
        let change = format!("{node} removed");
        tracing::warn!(%node, "node removed from the cluster");
        let reason = FailureReason::MembershipChanged(change.clone());
        self.drive(Input::FailAll { reason }).await;
        self.tell_members(&self.membership(), None);
        Ok(self.list_nodes())
    }

    /// A connected node leaves for good: it is disconnected and removed
    /// ([`Self::remove_node`]), and told whether it was.
    pub(super) async fn leave(&mut self, node: &NodeId) {
        let Some(member) = self.members.get(node) else {
            return;
        };
        let tx = member.tx.clone();
        let error = if let Some(active) = self.engine.active_restore() {
            Some(Error::RestoreInProgress {
                restore: active.id.clone(),
                snapshot: SnapshotId(active.snapshot_id),
            })
        } else {
            self.members.remove(node);
            self.metrics.members.set(self.members.len() as i64);
            if let Err(e) = self.meta.delete_member(node.as_str()).await {
                tracing::warn!("{e}");
            }
            tracing::info!(%node, "node leaving the cluster");
            self.remove_node(node).await.err()
        };
        if let Some(e) = &error {
            tracing::warn!(%node, "node asked to leave and stays on the roster: {e}");
        }
        let answer = error.map(|e| e.to_string());
        self.command(&tx, NodeCommand::Left(answer));
    }

    pub(super) async fn session_ended(&mut self, node: NodeId, session: u64) {
        if self.members.get(&node).map(|m| m.session) != Some(session) {
            return; // an older session of a node that has re-registered
        }
        self.member_gone(&node, "its session with the coordinator ended")
            .await;
    }

    /// A member is no longer connected: it leaves `members` (which ends its session's
    /// stream), its restore share and its snapshots in flight fail.
    pub(super) async fn member_gone(&mut self, node: &NodeId, why: &str) {
        tracing::warn!(%node, "node disconnected: {why}");
        self.members.remove(node);
        // The others hear it is down (their readiness stops waiting for their link to it).
        self.tell_members(&self.membership(), None);
        let input = Input::RestoreNodeFailed {
            node: node.clone(),
            restore_id: None,
            why: why.to_owned(),
        };
        self.drive(input).await;
        self.metrics.members.set(self.members.len() as i64);
        if let Err(e) = self.meta.delete_member(node.as_str()).await {
            tracing::warn!("{e}");
        }
        let node = node.clone();
        self.drive(Input::NodeLost { node }).await;
    }

    /// `--remove-after`: removes the roster nodes down longer than that.
    pub(super) async fn remove_long_gone(&mut self) {
        let Some(after) = self.settings.remove_after else {
            return;
        };
        let now = Instant::now();
        let roster: Vec<NodeId> = self.roster.nodes().cloned().collect();
        self.down_since.retain(|n, _| roster.contains(n));
        // Only while most of the roster is connected: a coordinator cut off from its nodes
        // (a partition, daemons slow to come back after an outage) must not remove them all.
        if self.members.len() * 2 <= roster.len() {
            return;
        }
        let mut due = Vec::new();
        for node in roster {
            if self.members.contains_key(&node) {
                self.down_since.remove(&node);
                continue;
            }
            let since = *self.down_since.entry(node.clone()).or_insert(now);
            if now.duration_since(since) >= after {
                due.push(node);
            }
        }
        for node in due {
            match self.remove_node(&node).await {
                Ok(_) => tracing::warn!(
                    %node,
                    "removed: down for more than --remove-after ({})",
                    humantime::format_duration(after)
                ),
                // A restore under way: tried again at a later tick.
                Err(e) => tracing::debug!(%node, "not removed yet: {e}"),
            }
        }
    }

    /// Members not heard from for [`MEMBER_SILENCE_MS`] (a paused or partitioned daemon
    /// whose connection has not broken) are taken as disconnected.
    pub(super) async fn drop_silent_members(&mut self) {
        // A tick that comes late means this task was busy (a long verification, say): the
        // heartbeats may be waiting in its queue, not missing. Judge at the next tick.
        let last = std::mem::replace(&mut self.last_silence_check, Instant::now());
        if last.elapsed() > Duration::from_secs(1) {
            return;
        }
        let silent: Vec<(NodeId, u64)> = self
            .members
            .iter()
            .map(|(n, m)| (n.clone(), m.heard.elapsed().as_millis() as u64))
            .filter(|(_, silent)| *silent >= MEMBER_SILENCE_MS)
            .collect();
        for (node, silent) in silent {
            self.member_gone(&node, &format!("no heartbeat for {silent} ms"))
                .await;
        }
    }
}
