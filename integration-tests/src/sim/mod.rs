//! The deterministic simulation: N processes running a token-transfer application on FIFO
//! links, under a seeded scheduler that picks which queue moves next, with snapshots
//! started at random processes in every mode, on every topology shape, with connection
//! faults. After every completed snapshot it checks the cut against its own ground truth
//! (see `oracle.rs`); at the end, that every snapshot finished and no token was lost.
//!
//! A failure names its seed; `CAIRN_SIM_SEED=<seed>` replays exactly that schedule.

mod config;
mod mutant;
mod oracle;
mod world;

use std::collections::BTreeMap;
use std::fmt;

use cairn_core::{SnapshotId, SnapshotMode};

pub use config::{Shape, SimConfig};
pub use mutant::{Engine, Mutant, MutantEngine};

/// What a schedule (or many) did.
#[derive(Debug, Clone, Default)]
pub struct SimStats {
    /// The shape, for a single schedule.
    pub shape: Option<Shape>,
    /// Schedules run.
    pub schedules: u64,
    /// Completed, verified snapshots per mode.
    pub completed: BTreeMap<SnapshotMode, u64>,
    /// Snapshots failed by an injected channel reset.
    pub failed: u64,
    /// Snapshot starts the tracker refused (unreachable, aligned in flight, limit).
    pub refused: u64,
    /// Channel-state messages recorded over all completed snapshots.
    pub recorded_messages: u64,
    /// Markers sent.
    pub markers: u64,
    /// Connections broken and resumed.
    pub transport_resets: u64,
    /// Channels reset.
    pub channel_resets: u64,
    /// Snapshots started while another was in flight.
    pub overlapping: u64,
    /// Alignment timeouts that fired.
    pub alignment_timeouts: u64,
    /// Cuts the application took at a record request's early copy, before messages it had
    /// been handed and not consumed.
    pub early_cuts: u64,
}

impl SimStats {
    /// Adds another run's numbers.
    pub fn merge(&mut self, other: &SimStats) {
        self.schedules += other.schedules;
        for (mode, n) in &other.completed {
            *self.completed.entry(*mode).or_default() += n;
        }
        self.failed += other.failed;
        self.refused += other.refused;
        self.recorded_messages += other.recorded_messages;
        self.markers += other.markers;
        self.transport_resets += other.transport_resets;
        self.channel_resets += other.channel_resets;
        self.overlapping += other.overlapping;
        self.alignment_timeouts += other.alignment_timeouts;
        self.early_cuts += other.early_cuts;
    }
}

/// A schedule that went wrong: which check caught what.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimFailure {
    /// The schedule's seed.
    pub seed: u64,
    /// Its topology's shape.
    pub shape: Shape,
    /// The snapshot concerned, if one.
    pub snapshot: Option<SnapshotId>,
    /// What the ground-truth oracle found.
    pub oracle: Option<String>,
    /// What the verifier rejected.
    pub verifier: Option<String>,
    /// A snapshot that never finished, or failed with no fault injected.
    pub stuck: Option<String>,
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seed {} ({})", self.seed, self.shape)?;
        if let Some(id) = self.snapshot {
            write!(f, ", snapshot {id}")?;
        }
        for (what, text) in [
            ("oracle", &self.oracle),
            ("verifier", &self.verifier),
            ("liveness", &self.stuck),
        ] {
            if let Some(text) = text {
                write!(f, "; {what}: {text}")?;
            }
        }
        write!(f, " — replay with CAIRN_SIM_SEED={}", self.seed)
    }
}

/// Runs one schedule.
pub fn run(config: SimConfig) -> Result<SimStats, SimFailure> {
    world::World::new(config).run()
}
