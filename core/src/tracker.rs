//! The coordinator's side of the algorithm: a snapshot's lifecycle over its participants,
//! from the checks that refuse a snapshot that could never finish to the verifier's verdict.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::failure::FailureReason;
use crate::topology::Topology;
use crate::types::{NodeId, Plan, SnapshotId, SnapshotMode};
use crate::verifier::{Consistent, NodePart, Violation, verify};

/// What a user asks for when starting a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StartRequest {
    /// The mode.
    pub mode: SnapshotMode,
    /// The initiators; empty lets the tracker choose (every member for an unaligned
    /// snapshot, one member otherwise).
    pub initiators: BTreeSet<NodeId>,
    /// Aligned mode: switch to unaligned recording after this long aligning.
    pub alignment_timeout: Option<Duration>,
}

/// Why a snapshot was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    /// The limit of snapshots in flight is reached.
    #[error("{limit} snapshots are already in flight, the most allowed")]
    TooManyInFlight {
        /// The limit.
        limit: usize,
    },
    /// Aligned snapshots run one at a time: two of them started at different initiators
    /// can meet their markers in opposite orders and block each other's channels.
    #[error("aligned snapshot {0} is still in flight; aligned snapshots run one at a time")]
    AlignedInFlight(SnapshotId),
    /// The cluster has no members.
    #[error("the cluster has no members")]
    NoMembers,
    /// An initiator is not a member.
    #[error("initiator {0} is not a member")]
    UnknownInitiator(NodeId),
    /// Markers from the initiators cannot reach every member.
    #[error("markers from {} cannot reach {}", names(.initiators), names(.unreachable))]
    Unreachable {
        /// The initiators.
        initiators: BTreeSet<NodeId>,
        /// The members they cannot reach.
        unreachable: BTreeSet<NodeId>,
    },
    /// The id is not new.
    #[error("snapshot {0} already exists")]
    DuplicateId(SnapshotId),
}

fn names(nodes: &BTreeSet<NodeId>) -> String {
    nodes
        .iter()
        .map(NodeId::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where a snapshot ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every part arrived and the verifier accepted the cut.
    Completed(Consistent),
    /// It failed; the reason names the process or channel.
    Failed(FailureReason),
}

/// What an input did to a tracked snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    /// The snapshot progressed and is still in flight.
    Progress,
    /// The snapshot ended: how, and who had recorded and reported by then (the tracker
    /// is the one place that follows progress).
    Finished(Outcome, Progress),
    /// The snapshot is not in flight, or the process is not one of its participants.
    Ignored,
}

#[derive(Debug)]
struct Tracked {
    plan: Plan,
    topology: Topology,
    /// In the order they recorded.
    recorded: Vec<NodeId>,
    /// In the order their parts arrived.
    reported: Vec<NodeId>,
    parts: BTreeMap<NodeId, NodePart>,
}

/// The snapshots in flight, as the coordinator follows them.
#[derive(Debug)]
pub struct SnapshotTracker {
    max_in_flight: usize,
    in_flight: BTreeMap<SnapshotId, Tracked>,
}

/// A snapshot's progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// Processes whose application recorded its state, in the order they did.
    pub recorded: Vec<NodeId>,
    /// Processes whose part is complete, in the order their parts arrived.
    pub reported: Vec<NodeId>,
}

impl Tracked {
    fn progress(&self) -> Progress {
        Progress {
            recorded: self.recorded.clone(),
            reported: self.reported.clone(),
        }
    }
}

impl SnapshotTracker {
    /// A tracker allowing `max_in_flight` snapshots at once.
    pub fn new(max_in_flight: usize) -> Self {
        Self {
            max_in_flight,
            in_flight: BTreeMap::new(),
        }
    }

    /// Checks a request against `topology` and the snapshots in flight, without starting
    /// anything: a caller can refuse a bad request before it spends an id on it.
    pub fn check(
        &self,
        request: &StartRequest,
        topology: &Topology,
    ) -> Result<BTreeSet<NodeId>, StartError> {
        if self.in_flight.len() >= self.max_in_flight {
            return Err(StartError::TooManyInFlight {
                limit: self.max_in_flight,
            });
        }
        let aligned_in_flight = self
            .in_flight
            .iter()
            .find(|(_, t)| t.plan.mode == SnapshotMode::Aligned);
        if let (SnapshotMode::Aligned, Some((other, _))) = (request.mode, aligned_in_flight) {
            return Err(StartError::AlignedInFlight(*other));
        }
        if topology.nodes().is_empty() {
            return Err(StartError::NoMembers);
        }
        let initiators = if request.initiators.is_empty() {
            Self::default_initiators(request.mode, topology)
        } else {
            request.initiators.clone()
        };
        if let Some(stranger) = initiators.iter().find(|n| !topology.contains(n)) {
            return Err(StartError::UnknownInitiator(stranger.clone()));
        }
        let unreachable = topology.unreachable_from(&initiators);
        if !unreachable.is_empty() {
            return Err(StartError::Unreachable {
                initiators,
                unreachable,
            });
        }
        Ok(initiators)
    }

    /// Checks a request against `topology` and starts tracking snapshot `id`.
    pub fn start(
        &mut self,
        id: SnapshotId,
        request: StartRequest,
        topology: &Topology,
    ) -> Result<Plan, StartError> {
        if self.in_flight.contains_key(&id) {
            return Err(StartError::DuplicateId(id));
        }
        let initiators = self.check(&request, topology)?;
        let plan = Plan {
            id,
            mode: request.mode,
            initiators,
            alignment_timeout: request
                .alignment_timeout
                .filter(|_| request.mode == SnapshotMode::Aligned),
            timed_out: false,
            started_at_ms: 0,
        };
        self.in_flight.insert(
            id,
            Tracked {
                plan: plan.clone(),
                topology: topology.clone(),
                recorded: Vec::new(),
                reported: Vec::new(),
                parts: BTreeMap::new(),
            },
        );
        Ok(plan)
    }

    /// The initiators of a request that names none. An unaligned snapshot starts at every
    /// member, as Flink triggers every source: no node waits for a marker to travel to it
    /// before it records, so the slowest node joins at once rather than a path later. The
    /// other modes start at one member: the first, in id
    /// order, that reaches every member; else the first member (and the reachability check
    /// then explains why it cannot work).
    fn default_initiators(mode: SnapshotMode, topology: &Topology) -> BTreeSet<NodeId> {
        if mode == SnapshotMode::Unaligned {
            return topology.nodes().iter().cloned().collect();
        }
        let pick = topology
            .nodes()
            .iter()
            .find(|n| {
                topology
                    .unreachable_from(&BTreeSet::from([(*n).clone()]))
                    .is_empty()
            })
            .or_else(|| topology.nodes().first())
            .cloned();
        pick.into_iter().collect()
    }

    /// The most snapshots allowed in flight at once.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    /// The snapshots in flight.
    pub fn in_flight(&self) -> impl Iterator<Item = &Plan> + '_ {
        self.in_flight.values().map(|t| &t.plan)
    }

    /// A snapshot's progress, if in flight.
    pub fn progress(&self, id: SnapshotId) -> Option<Progress> {
        self.in_flight.get(&id).map(Tracked::progress)
    }

    /// A participant's application recorded its state.
    pub fn state_recorded(&mut self, id: SnapshotId, node: &NodeId) -> Update {
        match self.in_flight.get_mut(&id) {
            Some(t) if t.topology.contains(node) => {
                if !t.recorded.contains(node) {
                    t.recorded.push(node.clone());
                }
                Update::Progress
            }
            _ => Update::Ignored,
        }
    }

    /// A participant's part is complete. When it is the last, the verifier decides.
    pub fn part_reported(&mut self, part: NodePart) -> Update {
        let id = part.report.id;
        let node = part.report.node.clone();
        let Some(t) = self.in_flight.get_mut(&id) else {
            return Update::Ignored;
        };
        if !t.topology.contains(&node) {
            return Update::Ignored;
        }
        if !t.recorded.contains(&node) {
            t.recorded.push(node.clone());
        }
        if !t.reported.contains(&node) {
            t.reported.push(node.clone());
        }
        t.parts.insert(node, part);
        if t.parts.len() < t.topology.nodes().len() {
            return Update::Progress;
        }
        let t = self.in_flight.remove(&id).expect("present");
        let outcome = match verify(&t.topology, &t.parts) {
            Ok(consistent) => Outcome::Completed(consistent),
            Err(violation) => Outcome::Failed(FailureReason::Inconsistent(violation)),
        };
        Update::Finished(outcome, t.progress())
    }

    /// The snapshot failed (at a process, or for any reason the caller names).
    pub fn fail(&mut self, id: SnapshotId, reason: FailureReason) -> Update {
        match self.in_flight.remove(&id) {
            Some(t) => Update::Finished(Outcome::Failed(reason), t.progress()),
            None => Update::Ignored,
        }
    }

    /// The snapshot passed its timeout: it fails naming whom it waited for — the processes
    /// whose application never recorded its state if there are any (they hold everyone
    /// else up), else those whose part never arrived.
    pub fn timed_out(&mut self, id: SnapshotId) -> Update {
        let Some(t) = self.in_flight.get(&id) else {
            return Update::Ignored;
        };
        let not_recorded: Vec<NodeId> = t
            .topology
            .nodes()
            .iter()
            .filter(|n| !t.recorded.contains(*n) && !t.parts.contains_key(n))
            .cloned()
            .collect();
        let missing = if not_recorded.is_empty() {
            t.topology
                .nodes()
                .iter()
                .filter(|n| !t.parts.contains_key(n))
                .cloned()
                .collect()
        } else {
            not_recorded
        };
        self.fail(id, FailureReason::Timeout { missing })
    }

    /// A member was lost: every snapshot in flight fails naming it.
    pub fn node_lost(&mut self, node: &NodeId) -> Vec<(SnapshotId, Update)> {
        let ids: Vec<SnapshotId> = self
            .in_flight
            .iter()
            .filter(|(_, t)| t.topology.contains(node))
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter()
            .map(|id| {
                let reason = FailureReason::NodeLost(node.clone());
                (id, self.fail(id, reason))
            })
            .collect()
    }
}

/// Shorthand used by tests and the simulation: the violation, if the outcome is one.
impl Outcome {
    /// The verifier's violation, if the snapshot failed on one.
    pub fn violation(&self) -> Option<&Violation> {
        match self {
            Self::Failed(FailureReason::Inconsistent(v)) => Some(v),
            _ => None,
        }
    }
}
