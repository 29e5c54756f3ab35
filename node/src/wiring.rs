//! Wiring the node to its members: which channels it has, the sending task of each
//! outgoing channel, and how the wiring grows when the coordinator reports new members.
//!
//! A daemon without a coordinator is wired once, from its flags. A daemon with one starts
//! wired to nobody and takes its members, their addresses and its channels from the
//! coordinator's `Registered` and `Membership` messages. The membership only grows while a
//! daemon runs: a channel is never taken away from a running daemon.

use std::collections::BTreeMap;
use std::sync::Arc;

use cairn_core::{ChannelId, NodeId, Topology, TopologyError};
use cairn_proto::v1 as pb;
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
    /// It takes a channel of this node away.
    #[error("the coordinator's topology no longer has channel {0}; restart this daemon to drop it")]
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
    /// Outgoing channels whose sending task runs.
    pub linked: std::collections::BTreeSet<ChannelId>,
}

impl Wirer {
    /// Starts the sending task of every outgoing channel of the current wiring that has none.
    pub(crate) fn link_all(&mut self) {
        let wiring = self.shared.wiring();
        for channel in wiring.topology.outgoing(&self.shared.node_id) {
            if !self.linked.insert(channel.clone()) {
                continue;
            }
            let link = Link {
                shared: self.shared.clone(),
                loop_tx: self.loop_tx.clone(),
                handles: wiring.channels[&channel].clone(),
                channel,
                config: self.link_config.clone(),
            };
            self.tasks.spawn(link.run(self.stop.clone()));
        }
    }

    /// Applies a membership from the coordinator: new members and channels are wired in
    /// (snapshots in flight here fail, as they do at the coordinator), moved members are
    /// reached at their new address from the next connection on. A membership that would
    /// take a channel away is refused: that needs a restart of this daemon.
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
        if let Some(gone) = old_channels.iter().find(|c| !new_channels.contains(c)) {
            return Err(MembershipError::ChannelGone(gone.clone()));
        }
        let joined: Vec<&str> = topology
            .nodes()
            .iter()
            .filter(|n| !old.topology.contains(n))
            .map(NodeId::as_str)
            .collect();
        let added = new_channels.len() - old_channels.len();
        let what = if !joined.is_empty() {
            format!("{} joined", joined.join(", "))
        } else if added > 0 {
            format!("{added} channels added")
        } else {
            // Only addresses changed (a member moved): no topology change.
            String::new()
        };
        let buffer = self.shared.channel_buffer;
        let mut wiring = wiring(&me, topology, addresses, buffer, Some(&old));
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
        self.link_all();
        Ok(())
    }
}
