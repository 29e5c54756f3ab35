//! What one simulated schedule looks like, derived from its seed.

use std::fmt;

use cairn_core::{ChannelId, NodeId, SnapshotMode, Topology};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::mutant::Mutant;

/// The shape of a simulated cluster's topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Shape {
    /// Every ordered pair of processes.
    #[default]
    FullMesh,
    /// A unidirectional ring.
    Ring,
    /// A ring in random order plus random chords.
    StronglyConnected,
    /// A random DAG whose first process reaches every other.
    Dag,
}

impl Shape {
    /// Every shape.
    pub const ALL: [Shape; 4] = [
        Self::FullMesh,
        Self::Ring,
        Self::StronglyConnected,
        Self::Dag,
    ];

    /// A topology of this shape over `n` processes named `n1…`.
    pub fn build(self, n: usize, rng: &mut StdRng) -> Topology {
        let nodes: Vec<NodeId> = (1..=n).map(|i| NodeId::new(format!("n{i}"))).collect();
        let edge = |a: &NodeId, b: &NodeId| ChannelId::new(a.clone(), b.clone());
        let mut channels = Vec::new();
        match self {
            Self::FullMesh => return Topology::full_mesh(nodes),
            Self::Ring => return Topology::ring(nodes),
            Self::StronglyConnected => {
                let mut order = nodes.clone();
                order.shuffle(rng);
                for i in 0..n {
                    channels.push(edge(&order[i], &order[(i + 1) % n]));
                }
                for a in &nodes {
                    for b in &nodes {
                        if a != b && rng.random_bool(0.3) {
                            channels.push(edge(a, b));
                        }
                    }
                }
            }
            Self::Dag => {
                for j in 1..n {
                    let parent = rng.random_range(0..j);
                    channels.push(edge(&nodes[parent], &nodes[j]));
                    for i in 0..j {
                        if i != parent && rng.random_bool(0.3) {
                            channels.push(edge(&nodes[i], &nodes[j]));
                        }
                    }
                }
            }
        }
        Topology::from_channels(nodes, channels).expect("built from members")
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// One schedule's parameters.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Seeds every random choice of the schedule.
    pub seed: u64,
    /// Processes.
    pub nodes: usize,
    /// The topology's shape.
    pub shape: Shape,
    /// Scheduler steps of live traffic before the schedule drains.
    pub steps: usize,
    /// Snapshot initiations attempted.
    pub snapshots: usize,
    /// The modes snapshots are drawn from.
    pub modes: Vec<SnapshotMode>,
    /// The tracker's limit of snapshots in flight.
    pub max_in_flight: usize,
    /// Break connections: frames in transit are lost and resent, duplicates dropped.
    pub transport_faults: bool,
    /// Reset quiescent channels (as after a peer's restart): snapshots in flight there fail.
    pub channel_resets: bool,
    /// The engine's planted bug, if any.
    pub mutant: Mutant,
}

impl SimConfig {
    /// The schedule for `seed`: shape, size and faults drawn from it, every mode used.
    pub fn from_seed(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_ca1e);
        Self {
            seed,
            nodes: rng.random_range(2..=6),
            shape: Shape::ALL[(seed % 4) as usize],
            steps: rng.random_range(200..=1200),
            snapshots: rng.random_range(1..=8),
            modes: vec![
                SnapshotMode::ChandyLamport,
                SnapshotMode::Unaligned,
                SnapshotMode::Aligned,
            ],
            max_in_flight: rng.random_range(1..=4),
            transport_faults: rng.random_bool(0.5),
            channel_resets: false,
            mutant: Mutant::None,
        }
    }
}
