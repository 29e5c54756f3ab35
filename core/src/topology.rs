//! The directed graph of processes and channels: who can reach whom, and which channels
//! close a cycle as seen from a snapshot's initiators (the aligned mode's feedback
//! channels).

use std::collections::{BTreeMap, BTreeSet};

use crate::types::{ChannelId, NodeId};

/// Why a topology was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// A channel names a process that is not a member.
    #[error("channel {channel} names {node}, which is not a member")]
    UnknownNode {
        /// The channel.
        channel: ChannelId,
        /// The process it names.
        node: NodeId,
    },
    /// A channel from a process to itself.
    #[error("channel {0} goes from a process to itself")]
    SelfLoop(ChannelId),
}

/// The processes of a cluster and the directed channels between them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Topology {
    nodes: BTreeSet<NodeId>,
    channels: BTreeSet<ChannelId>,
    outgoing: BTreeMap<NodeId, BTreeSet<NodeId>>,
    incoming: BTreeMap<NodeId, BTreeSet<NodeId>>,
}

impl Topology {
    /// Every ordered pair of distinct members is a channel.
    pub fn full_mesh(nodes: impl IntoIterator<Item = NodeId>) -> Self {
        let nodes: BTreeSet<NodeId> = nodes.into_iter().collect();
        let channels = nodes
            .iter()
            .flat_map(|from| {
                nodes
                    .iter()
                    .filter(move |to| *to != from)
                    .map(move |to| ChannelId::new(from.clone(), to.clone()))
            })
            .collect::<Vec<_>>();
        Self::build(nodes, channels)
    }

    /// A unidirectional ring in the members' order: `n[0] → n[1] → … → n[0]`.
    pub fn ring(nodes: impl IntoIterator<Item = NodeId>) -> Self {
        let nodes: Vec<NodeId> = nodes.into_iter().collect();
        let channels = (0..nodes.len())
            .filter(|_| nodes.len() > 1)
            .map(|i| ChannelId::new(nodes[i].clone(), nodes[(i + 1) % nodes.len()].clone()))
            .collect::<Vec<_>>();
        Self::build(nodes.into_iter().collect(), channels)
    }

    /// An explicit list of directed channels between the given members.
    pub fn from_channels(
        nodes: impl IntoIterator<Item = NodeId>,
        channels: impl IntoIterator<Item = ChannelId>,
    ) -> Result<Self, TopologyError> {
        let nodes: BTreeSet<NodeId> = nodes.into_iter().collect();
        let channels: Vec<ChannelId> = channels.into_iter().collect();
        for channel in &channels {
            if channel.from == channel.to {
                return Err(TopologyError::SelfLoop(channel.clone()));
            }
            for node in [&channel.from, &channel.to] {
                if !nodes.contains(node) {
                    return Err(TopologyError::UnknownNode {
                        channel: channel.clone(),
                        node: node.clone(),
                    });
                }
            }
        }
        Ok(Self::build(nodes, channels))
    }

    fn build(nodes: BTreeSet<NodeId>, channels: Vec<ChannelId>) -> Self {
        let mut topology = Self {
            outgoing: nodes.iter().map(|n| (n.clone(), BTreeSet::new())).collect(),
            incoming: nodes.iter().map(|n| (n.clone(), BTreeSet::new())).collect(),
            nodes,
            channels: BTreeSet::new(),
        };
        for channel in channels {
            topology
                .outgoing
                .entry(channel.from.clone())
                .or_default()
                .insert(channel.to.clone());
            topology
                .incoming
                .entry(channel.to.clone())
                .or_default()
                .insert(channel.from.clone());
            topology.channels.insert(channel);
        }
        topology
    }

    /// The members.
    pub fn nodes(&self) -> &BTreeSet<NodeId> {
        &self.nodes
    }

    /// Every channel.
    pub fn channels(&self) -> &BTreeSet<ChannelId> {
        &self.channels
    }

    /// Whether `node` is a member.
    pub fn contains(&self, node: &NodeId) -> bool {
        self.nodes.contains(node)
    }

    /// The channels into `node`, in order.
    pub fn incoming<'a>(&'a self, node: &'a NodeId) -> impl Iterator<Item = ChannelId> + 'a {
        self.incoming
            .get(node)
            .into_iter()
            .flatten()
            .map(move |from| ChannelId::new(from.clone(), node.clone()))
    }

    /// The channels out of `node`, in order.
    pub fn outgoing<'a>(&'a self, node: &'a NodeId) -> impl Iterator<Item = ChannelId> + 'a {
        self.outgoing
            .get(node)
            .into_iter()
            .flatten()
            .map(move |to| ChannelId::new(node.clone(), to.clone()))
    }

    /// The members that no marker sent by `initiators` can reach. A snapshot started there
    /// could never finish, so the coordinator refuses it.
    pub fn unreachable_from(&self, initiators: &BTreeSet<NodeId>) -> BTreeSet<NodeId> {
        let mut seen: BTreeSet<&NodeId> = BTreeSet::new();
        let mut stack: Vec<&NodeId> = initiators.iter().filter(|n| self.contains(n)).collect();
        while let Some(node) = stack.pop() {
            if seen.insert(node) {
                stack.extend(self.outgoing.get(node).into_iter().flatten());
            }
        }
        self.nodes
            .iter()
            .filter(|n| !seen.contains(n))
            .cloned()
            .collect()
    }

    /// The feedback channels of an aligned snapshot started at `initiators`: the back edges
    /// of a depth-first search from them (in id order), plus every channel into an
    /// initiator, since initiators record at once and never wait. What remains is acyclic,
    /// so waiting for the markers of the other channels cannot deadlock. Every process
    /// computes the same set from the same topology and plan.
    pub fn feedback_channels(&self, initiators: &BTreeSet<NodeId>) -> BTreeSet<ChannelId> {
        #[derive(Clone, Copy, PartialEq)]
        enum Colour {
            White,
            Grey,
            Black,
        }
        let mut colour: BTreeMap<&NodeId, Colour> =
            self.nodes.iter().map(|n| (n, Colour::White)).collect();
        let mut feedback: BTreeSet<ChannelId> = self
            .channels
            .iter()
            .filter(|c| initiators.contains(&c.to))
            .cloned()
            .collect();
        let empty = BTreeSet::new();
        for root in initiators.iter().filter(|n| self.contains(n)) {
            if colour[root] != Colour::White {
                continue;
            }
            colour.insert(root, Colour::Grey);
            let mut stack = vec![(root, self.outgoing.get(root).unwrap_or(&empty).iter())];
            while let Some((node, children)) = stack.last_mut() {
                let node: &NodeId = node;
                match children.next() {
                    Some(child) => match colour[child] {
                        Colour::White => {
                            colour.insert(child, Colour::Grey);
                            stack.push((child, self.outgoing.get(child).unwrap_or(&empty).iter()));
                        }
                        Colour::Grey => {
                            feedback.insert(ChannelId::new(node.clone(), child.clone()));
                        }
                        Colour::Black => {}
                    },
                    None => {
                        colour.insert(node, Colour::Black);
                        stack.pop();
                    }
                }
            }
        }
        feedback
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(names: &[&str]) -> Vec<NodeId> {
        names.iter().map(|n| NodeId::from(*n)).collect()
    }

    fn set(names: &[&str]) -> BTreeSet<NodeId> {
        ids(names).into_iter().collect()
    }

    #[test]
    fn full_mesh_has_every_ordered_pair() {
        let t = Topology::full_mesh(ids(&["a", "b", "c"]));
        assert_eq!(t.channels().len(), 6);
        assert_eq!(t.incoming(&"a".into()).count(), 2);
    }

    #[test]
    fn ring_feedback_is_the_edge_back_into_the_initiator() {
        let t = Topology::ring(ids(&["a", "b", "c"]));
        assert_eq!(
            t.feedback_channels(&set(&["b"])),
            BTreeSet::from([ChannelId::new("a", "b")])
        );
    }

    #[test]
    fn dag_has_no_feedback_channels_from_its_source() {
        let t = Topology::from_channels(
            ids(&["a", "b", "c"]),
            [
                ChannelId::new("a", "b"),
                ChannelId::new("a", "c"),
                ChannelId::new("b", "c"),
            ],
        )
        .unwrap();
        assert!(t.feedback_channels(&set(&["a"])).is_empty());
        assert!(t.unreachable_from(&set(&["a"])).is_empty());
        assert_eq!(t.unreachable_from(&set(&["b"])), set(&["a"]));
    }

    #[test]
    fn full_mesh_minus_feedback_is_acyclic() {
        let t = Topology::full_mesh(ids(&["a", "b", "c", "d"]));
        let feedback = t.feedback_channels(&set(&["c"]));
        let rest: Vec<ChannelId> = t
            .channels()
            .iter()
            .filter(|c| !feedback.contains(c))
            .cloned()
            .collect();
        // Kahn's algorithm consumes every node only if the rest is acyclic.
        let mut indegree: BTreeMap<&NodeId, usize> = t.nodes().iter().map(|n| (n, 0)).collect();
        for c in &rest {
            *indegree.get_mut(&c.to).unwrap() += 1;
        }
        let mut ready: Vec<&NodeId> = indegree
            .iter()
            .filter(|(_, d)| **d == 0)
            .map(|(n, _)| *n)
            .collect();
        let mut consumed = 0;
        while let Some(n) = ready.pop() {
            consumed += 1;
            for c in rest.iter().filter(|c| &c.from == n) {
                let d = indegree.get_mut(&c.to).unwrap();
                *d -= 1;
                if *d == 0 {
                    ready.push(&c.to);
                }
            }
        }
        assert_eq!(consumed, 4);
    }

    #[test]
    fn channels_must_name_members_and_not_loop() {
        assert_eq!(
            Topology::from_channels(ids(&["a"]), [ChannelId::new("a", "z")]),
            Err(TopologyError::UnknownNode {
                channel: ChannelId::new("a", "z"),
                node: "z".into()
            })
        );
        assert_eq!(
            Topology::from_channels(ids(&["a"]), [ChannelId::new("a", "a")]),
            Err(TopologyError::SelfLoop(ChannelId::new("a", "a")))
        );
    }
}
