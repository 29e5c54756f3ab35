//! The roster and the topology rules, as plain data: which nodes belong to the cluster
//! (every node that ever registered, kept while it is down), what a registration changes,
//! and which topology a snapshot spans. No I/O: the engine's membership role has what
//! [`Roster::enroll`] returns stored before it [`Roster::insert`]s it.

use std::collections::BTreeMap;

use crate::record::RosterRecord;
use crate::{NodeId, Topology};

/// Every node of the cluster, and the fixed topology if there is one (`--topology`).
#[derive(Debug, Default)]
pub struct Roster {
    fixed: Option<Topology>,
    nodes: BTreeMap<NodeId, RosterRecord>,
}

/// What a registration changes.
#[derive(Debug, PartialEq, Eq)]
pub struct Enrollment {
    /// The record to store, if it changed.
    pub record: Option<RosterRecord>,
    /// What the other nodes must hear of (a node joined or moved).
    pub change: Option<String>,
    /// The node is new to the roster.
    pub joined: bool,
    /// The node's daemon restarted since it last registered (a new incarnation).
    pub restarted: bool,
}

impl Roster {
    /// An empty roster; `fixed` is the `--topology` file's topology, if given.
    pub fn new(fixed: Option<Topology>) -> Self {
        Self {
            fixed,
            nodes: BTreeMap::new(),
        }
    }

    /// Takes stored records; a node the fixed topology does not name is left out (and
    /// returned, to be logged).
    pub fn load(&mut self, records: impl IntoIterator<Item = RosterRecord>) -> Vec<NodeId> {
        let mut left_out = Vec::new();
        for record in records {
            let node = NodeId::new(record.node.clone());
            if self.admits(&node).is_err() {
                left_out.push(node);
                continue;
            }
            self.nodes.insert(node, record);
        }
        left_out
    }

    /// Whether `node` may be a member: every node, or only those `--topology` names.
    pub fn admits(&self, node: &NodeId) -> Result<(), String> {
        match &self.fixed {
            Some(fixed) if !fixed.contains(node) => Err(format!(
                "node {node} is not in this coordinator's --topology file"
            )),
            _ => Ok(()),
        }
    }

    /// `node`'s record.
    pub fn get(&self, node: &NodeId) -> Option<&RosterRecord> {
        self.nodes.get(node)
    }

    /// Whether `node` is on the roster.
    pub fn contains(&self, node: &NodeId) -> bool {
        self.nodes.contains_key(node)
    }

    /// Whether no node has registered yet.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The nodes, in id order.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeId> + '_ {
        self.nodes.keys()
    }

    /// The nodes and their records, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (&NodeId, &RosterRecord)> + '_ {
        self.nodes.iter()
    }

    /// What `node` registering at `address` as `incarnation` changes (`now_ms` dates a
    /// first registration). Nothing is changed here: [`Self::insert`] the record once it is
    /// stored.
    pub fn enroll(
        &self,
        node: &NodeId,
        address: &str,
        incarnation: u64,
        now_ms: u64,
    ) -> Enrollment {
        let known = self.nodes.get(node);
        let restarted = known.is_some_and(|r| r.incarnation != 0 && r.incarnation != incarnation);
        let change = match known {
            Some(r) if r.address == address && r.incarnation == incarnation => {
                return Enrollment {
                    record: None,
                    change: None,
                    joined: false,
                    restarted: false,
                };
            }
            Some(r) if r.address == address => None,
            Some(r) => Some(format!("node {node} moved from {} to {address}", r.address)),
            None => Some(format!("node {node} joined")),
        };
        Enrollment {
            record: Some(RosterRecord {
                node: node.to_string(),
                address: address.to_owned(),
                joined_at_ms: known.map_or(now_ms, |r| r.joined_at_ms),
                incarnation,
            }),
            change,
            joined: known.is_none(),
            restarted,
        }
    }

    /// Puts a (stored) record on the roster.
    pub fn insert(&mut self, record: RosterRecord) {
        self.nodes.insert(NodeId::new(record.node.clone()), record);
    }

    /// Takes `node` off the roster (once its removal is stored).
    pub fn remove(&mut self, node: &NodeId) -> Option<RosterRecord> {
        self.nodes.remove(node)
    }

    /// The topology over the nodes whose address is known: the fixed one restricted to the
    /// roster, or a full mesh of the roster.
    pub fn known_topology(&self) -> Topology {
        let nodes = self.nodes.keys().cloned();
        match &self.fixed {
            None => Topology::full_mesh(nodes),
            Some(fixed) => {
                let channels = fixed
                    .channels()
                    .iter()
                    .filter(|c| self.contains(&c.from) && self.contains(&c.to));
                let nodes: Vec<NodeId> = fixed
                    .nodes()
                    .iter()
                    .filter(|n| self.contains(n))
                    .cloned()
                    .collect();
                Topology::from_channels(nodes, channels.cloned())
                    .expect("a restriction of a topology")
            }
        }
    }

    /// The topology a snapshot spans: [`Self::known_topology`]. Every one of its nodes must
    /// be `connected`; otherwise why not, naming them.
    pub fn spanning(&self, connected: impl Fn(&NodeId) -> bool) -> Result<Topology, String> {
        let topology = self.known_topology();
        let missing: Vec<&str> = topology
            .nodes()
            .iter()
            .filter(|n| !connected(n))
            .map(NodeId::as_str)
            .collect();
        if missing.is_empty() {
            return Ok(topology);
        }
        Err(format!(
            "not connected to the coordinator: {} (a snapshot needs every node of the \
             topology)",
            missing.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(id: &str) -> NodeId {
        NodeId::new(id)
    }

    fn roster_of(fixed: Option<Topology>, nodes: &[&str]) -> Roster {
        let mut roster = Roster::new(fixed);
        for (i, id) in nodes.iter().enumerate() {
            let e = roster.enroll(&n(id), &format!("h:{i}"), 1, 10);
            roster.insert(e.record.unwrap());
        }
        roster
    }

    #[test]
    fn a_registration_joins_moves_restarts_or_changes_nothing() {
        let roster = roster_of(None, &["a"]);
        let same = roster.enroll(&n("a"), "h:0", 1, 99);
        assert_eq!(same.record, None);
        assert!(!same.joined && !same.restarted && same.change.is_none());
        let restarted = roster.enroll(&n("a"), "h:0", 2, 99);
        assert!(restarted.restarted && restarted.change.is_none());
        assert_eq!(
            restarted.record.unwrap().joined_at_ms,
            10,
            "first registration kept"
        );
        let moved = roster.enroll(&n("a"), "h:9", 1, 99);
        assert_eq!(
            moved.change.as_deref(),
            Some("node a moved from h:0 to h:9")
        );
        let joined = roster.enroll(&n("b"), "h:1", 1, 99);
        assert!(joined.joined);
        assert_eq!(joined.change.as_deref(), Some("node b joined"));
        assert_eq!(joined.record.unwrap().joined_at_ms, 99);
    }

    #[test]
    fn the_topology_is_a_mesh_of_the_roster_or_the_fixed_one_restricted_to_it() {
        let mesh = roster_of(None, &["a", "b", "c"]).known_topology();
        assert_eq!(mesh.channels().len(), 6);
        let ring = Topology::from_channels(
            [n("a"), n("b"), n("c")],
            [("a", "b"), ("b", "c"), ("c", "a")].map(|(f, t)| crate::ChannelId::new(f, t)),
        )
        .unwrap();
        let roster = roster_of(Some(ring), &["a", "b"]);
        let known = roster.known_topology();
        assert_eq!(known.nodes().len(), 2);
        assert_eq!(known.channels().len(), 1, "only a->b has both ends known");
        assert!(roster.admits(&n("c")).is_ok());
        assert!(roster.admits(&n("z")).unwrap_err().contains("--topology"));
    }

    #[test]
    fn a_snapshot_needs_every_node_connected_and_names_the_missing() {
        let roster = roster_of(None, &["a", "b", "c"]);
        let err = roster.spanning(|node| node.as_str() != "b").unwrap_err();
        assert!(err.contains("not connected to the coordinator: b"), "{err}");
        assert_eq!(roster.spanning(|_| true).unwrap().nodes().len(), 3);
        // A fixed topology spans the nodes that registered so far.
        let fixed = Topology::full_mesh([n("a"), n("b"), n("x")]);
        let roster = roster_of(Some(fixed), &["a", "b"]);
        assert_eq!(roster.spanning(|_| true).unwrap().nodes().len(), 2);
    }

    #[test]
    fn loading_leaves_out_nodes_the_fixed_topology_does_not_name() {
        let fixed = Topology::full_mesh([n("a")]);
        let mut roster = Roster::new(Some(fixed));
        let record = |id: &str| RosterRecord {
            node: id.into(),
            address: "h".into(),
            joined_at_ms: 0,
            incarnation: 1,
        };
        assert_eq!(roster.load([record("a"), record("z")]), [n("z")]);
        assert!(roster.contains(&n("a")) && !roster.contains(&n("z")));
    }
}
