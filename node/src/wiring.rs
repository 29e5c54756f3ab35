//! Wiring the node to its members: which channels it has, the sending task of each
//! outgoing channel, and how the wiring grows when the coordinator reports new members.
//!
//! A daemon without a coordinator is wired once, from its flags. A daemon with one starts
//! wired to nobody and takes its members, their addresses and its channels from the
//! coordinator's `Registered` and `Membership` messages, which add members (their channels
//! are wired in) and remove them (their channels are dropped: the sending task stops, what
//! was queued for the removed peer is dropped and counted).

use std::collections::BTreeMap;
use std::sync::Arc;

use cairn_core::{ChannelId, NodeId, Topology, TopologyError};
use cairn_rpc::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::node_loop::LoopMsg;
use crate::peer_client::{Link, LinkConfig};
use crate::shared::{ChannelHandles, Shared, Wiring};

/// The wiring of `me` in `topology`, reusing the handles of channels `old` already has.
pub(crate) fn wiring(
    me: &NodeId,
    topology: Topology,
    addresses: BTreeMap<NodeId, String>,
    buffer: usize,
    old: Option<&Wiring>,
) -> Wiring {
    let channels = topology
        .incoming(me)
        .chain(topology.outgoing(me))
        .map(|c| {
            let handles = old
                .and_then(|w| w.channels.get(&c).cloned())
                .unwrap_or_else(|| Arc::new(ChannelHandles::new(buffer)));
            (c, handles)
        })
        .collect();
    Wiring {
        topology,
        addresses,
        channels,
        incarnations: BTreeMap::new(),
        removed: Default::default(),
        down: Default::default(),
    }
}

/// A membership from the coordinator that this daemon cannot follow.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MembershipError {
    /// Its topology is invalid.
    #[error("the coordinator sent a bad topology: {0}")]
    BadTopology(#[from] TopologyError),
    /// It does not include this node.
    #[error("the coordinator's membership does not include this node ({0})")]
    NotAMember(NodeId),
    /// It lacks a channel of this node whose peer it does not say was removed: a
    /// coordinator that is still hearing its members again (it lost its metadata). The
    /// session ends and registers again, until the membership is whole.
    #[error(
        "the coordinator's membership lacks channel {0} without saying its peer was removed; \
         registering again"
    )]
    ChannelGone(ChannelId),
}

/// Starts sending tasks and grows the wiring.
pub(crate) struct Wirer {
    pub shared: Arc<Shared>,
    pub loop_tx: mpsc::Sender<LoopMsg>,
    pub link_config: LinkConfig,
    pub stop: CancellationToken,
    /// The sending tasks, awaited at shutdown.
    pub tasks: TaskTracker,
    /// Outgoing channels whose sending task runs, and what stops it.
    pub linked: BTreeMap<ChannelId, CancellationToken>,
}

impl Wirer {
    /// Starts the sending task of every outgoing channel of the current wiring that has none.
    pub(crate) fn link_all(&mut self) {
        let wiring = self.shared.wiring();
        for channel in wiring.topology.outgoing(&self.shared.node_id) {
            if self.linked.contains_key(&channel) {
                continue;
            }
            let stop = self.stop.child_token();
            self.linked.insert(channel.clone(), stop.clone());
            let link = Link {
                shared: self.shared.clone(),
                loop_tx: self.loop_tx.clone(),
                handles: wiring.channels[&channel].clone(),
                channel,
                config: self.link_config.clone(),
            };
            self.tasks.spawn(link.run(stop));
        }
    }

    /// Stops the sending task of every outgoing channel the current wiring no longer has.
    fn unlink_gone(&mut self) {
        let wiring = self.shared.wiring();
        self.linked.retain(|channel, stop| {
            let keep = wiring.channels.contains_key(channel);
            if !keep {
                stop.cancel();
            }
            keep
        });
    }

    /// Applies a membership from the coordinator: new members and channels are wired in,
    /// removed ones dropped (snapshots in flight here fail either way, as they do at the
    /// coordinator), moved members are reached at their new address from the next
    /// connection on.
    pub(crate) async fn apply(
        &mut self,
        membership: &pb::Membership,
    ) -> Result<(), MembershipError> {
        let me = self.shared.node_id.clone();
        let addresses: BTreeMap<NodeId, String> = membership
            .nodes
            .iter()
            .map(|n| (NodeId::new(n.node_id.clone()), n.address.clone()))
            .collect();
        let channels = membership
            .channels
            .iter()
            .map(|c| ChannelId::new(c.from.as_str(), c.to.as_str()));
        let topology = Topology::from_channels(addresses.keys().cloned(), channels)?;
        if !topology.contains(&me) {
            return Err(MembershipError::NotAMember(me));
        }
        let old = self.shared.wiring();
        let mine =
            |t: &Topology| -> Vec<ChannelId> { t.incoming(&me).chain(t.outgoing(&me)).collect() };
        let (old_channels, new_channels) = (mine(&old.topology), mine(&topology));
        let removed_nodes: std::collections::BTreeSet<NodeId> = membership
            .removed
            .iter()
            .map(|n| NodeId::new(n.clone()))
            .collect();
        if let Some(gone) = old_channels.iter().find(|c| {
            let peer = if c.from == me { &c.to } else { &c.from };
            !new_channels.contains(c) && !removed_nodes.contains(peer)
        }) {
            return Err(MembershipError::ChannelGone(gone.clone()));
        }
        let joined: Vec<&str> = topology
            .nodes()
            .iter()
            .filter(|n| !old.topology.contains(n))
            .map(NodeId::as_str)
            .collect();
        let left: Vec<&str> = old
            .topology
            .nodes()
            .iter()
            .filter(|n| !topology.contains(n))
            .map(NodeId::as_str)
            .collect();
        let added = new_channels
            .iter()
            .filter(|c| !old_channels.contains(c))
            .count();
        let removed = old_channels
            .iter()
            .filter(|c| !new_channels.contains(c))
            .count();
        let mut changes = Vec::new();
        if !joined.is_empty() {
            changes.push(format!("{} joined", joined.join(", ")));
        }
        if !left.is_empty() {
            changes.push(format!("{} removed", left.join(", ")));
        }
        if changes.is_empty() && added + removed > 0 {
            changes.push(format!("{added} channels added, {removed} removed"));
        }
        // Empty: only addresses changed (a member moved), no topology change.
        let what = changes.join("; ");
        let buffer = self.shared.channel_buffer;
        let mut wiring = wiring(&me, topology, addresses, buffer, Some(&old));
        wiring.removed = removed_nodes;
        wiring.down = membership
            .nodes
            .iter()
            .filter(|n| !n.connected)
            .map(|n| NodeId::new(n.node_id.clone()))
            .collect();
        wiring.incarnations = membership
            .nodes
            .iter()
            .filter(|n| n.incarnation != 0)
            .map(|n| (NodeId::new(n.node_id.clone()), n.incarnation))
            .collect();
        let wiring = Arc::new(wiring);
        if what.is_empty() {
            *self.shared.wiring.write().expect("wiring lock") = wiring;
            return Ok(());
        }
        let (reply, done) = oneshot::channel();
        let rewire = LoopMsg::Rewire {
            wiring,
            what,
            reply,
        };
        if self.loop_tx.send(rewire).await.is_err() || done.await.is_err() {
            return Ok(()); // stopping
        }
        self.unlink_gone();
        self.link_all();
        Ok(())
    }
}
