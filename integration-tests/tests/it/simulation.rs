//! The deterministic simulation of ARCHITECTURE.md §4–§5: thousands of seeded schedules,
//! every mode on every topology shape, checked against ground truth.
//!
//! - `CAIRN_SIM_SEED=<n>` replays one schedule (the seed a failure prints).
//! - `CAIRN_SIM_SCHEDULES=<n>` sets how many schedules the sweep runs (default 6,000);
//!   `CAIRN_SIM_SCHEDULES=200000 cargo test --release -p cairn-integration-tests --test it simulation::sweep`
//!   is the long sweep.

use std::collections::BTreeMap;

use cairn_core::SnapshotMode;
use cairn_integration_tests::sim::{self, Mutant, Shape, SimConfig, SimFailure, SimStats};

const DEFAULT_SCHEDULES: u64 = 6_000;

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value} is not a number")),
    )
}

/// Runs `configs` on every core; returns the stats per shape or the first failure.
fn sweep(configs: Vec<SimConfig>) -> Result<BTreeMap<Shape, SimStats>, SimFailure> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let chunks: Vec<Vec<SimConfig>> = (0..threads)
        .map(|t| configs.iter().skip(t).step_by(threads).cloned().collect())
        .collect();
    let results: Vec<Result<BTreeMap<Shape, SimStats>, SimFailure>> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                s.spawn(move || {
                    let mut per_shape: BTreeMap<Shape, SimStats> = BTreeMap::new();
                    for config in chunk {
                        let shape = config.shape;
                        let stats = sim::run(config)?;
                        per_shape.entry(shape).or_default().merge(&stats);
                    }
                    Ok(per_shape)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("sim thread"))
            .collect()
    });
    let mut total: BTreeMap<Shape, SimStats> = BTreeMap::new();
    for result in results {
        for (shape, stats) in result? {
            total.entry(shape).or_default().merge(&stats);
        }
    }
    Ok(total)
}

#[test]
fn sweep_completes_and_verifies_every_snapshot_in_every_mode_on_every_shape() {
    let configs: Vec<SimConfig> = match env_u64("CAIRN_SIM_SEED") {
        Some(seed) => vec![SimConfig::from_seed(seed)],
        None => (0..env_u64("CAIRN_SIM_SCHEDULES").unwrap_or(DEFAULT_SCHEDULES))
            .map(SimConfig::from_seed)
            .collect(),
    };
    let replay = configs.len() == 1;
    let per_shape = sweep(configs).unwrap_or_else(|failure| panic!("{failure}"));
    for (shape, stats) in &per_shape {
        eprintln!(
            "{shape}: {} schedules, completed {:?}, refused {}, {} overlapping, {} channel-state messages, {} markers, {} connection resets, {} alignment timeouts, {} early cuts",
            stats.schedules,
            stats.completed,
            stats.refused,
            stats.overlapping,
            stats.recorded_messages,
            stats.markers,
            stats.transport_resets,
            stats.alignment_timeouts,
            stats.early_cuts
        );
    }
    if replay {
        return;
    }
    for shape in Shape::ALL {
        let stats = &per_shape[&shape];
        for mode in [
            SnapshotMode::ChandyLamport,
            SnapshotMode::Unaligned,
            SnapshotMode::Aligned,
        ] {
            let n = stats.completed.get(&mode).copied().unwrap_or(0);
            assert!(n >= 50, "{shape} completed only {n} {mode} snapshots");
        }
        assert!(
            stats.recorded_messages > 0,
            "{shape} never recorded channel state"
        );
        assert!(
            stats.transport_resets > 0,
            "{shape} never broke a connection"
        );
        assert!(
            stats.overlapping > 0,
            "{shape} never overlapped two snapshots"
        );
        assert!(
            stats.early_cuts > 0,
            "{shape} never cut at a record request's early copy before unconsumed messages"
        );
        // In a ring every process has one incoming channel: alignment ends with the first
        // marker, so there is nothing to time out.
        if shape != Shape::Ring {
            assert!(
                stats.alignment_timeouts > 0,
                "{shape} never timed out an alignment"
            );
        }
    }
}

#[test]
fn channel_resets_fail_snapshots_in_flight_and_never_complete_an_inconsistent_cut() {
    let configs: Vec<SimConfig> = (0..400)
        .map(|seed| SimConfig {
            channel_resets: true,
            snapshots: 12,
            steps: 1500,
            ..SimConfig::from_seed(1_000_000 + seed)
        })
        .collect();
    let per_shape = sweep(configs).unwrap_or_else(|failure| panic!("{failure}"));
    let failed: u64 = per_shape.values().map(|s| s.failed).sum();
    let resets: u64 = per_shape.values().map(|s| s.channel_resets).sum();
    let completed: u64 = per_shape.values().flat_map(|s| s.completed.values()).sum();
    assert!(resets > 0, "no channel was reset");
    assert!(failed > 0, "no snapshot was failed by a reset");
    assert!(completed > 0, "no snapshot completed around the resets");
}

/// Runs schedules with `mutant` planted until one fails; returns that failure.
fn first_catch(mutant: Mutant, modes: &[SnapshotMode]) -> SimFailure {
    for seed in 0..500 {
        let config = SimConfig {
            mutant,
            modes: modes.to_vec(),
            snapshots: 6,
            ..SimConfig::from_seed(seed)
        };
        if let Err(failure) = sim::run(config) {
            return failure;
        }
    }
    panic!("{mutant:?} survived 500 schedules: the simulation's oracles cannot see it");
}

#[test]
fn oracle_catches_a_message_recorded_that_arrived_before_the_local_state() {
    let failure = first_catch(
        Mutant::RecordsMessageBeforeState,
        &[SnapshotMode::ChandyLamport, SnapshotMode::Aligned],
    );
    assert!(failure.oracle.is_some(), "oracle missed it: {failure}");
    assert!(failure.verifier.is_some(), "verifier missed it: {failure}");
}

#[test]
fn liveness_check_catches_a_marker_never_forwarded_on_one_channel() {
    let failure = first_catch(
        Mutant::ForgetsMarkerOnOneChannel,
        &[SnapshotMode::ChandyLamport],
    );
    let stuck = failure
        .stuck
        .as_deref()
        .unwrap_or_else(|| panic!("not caught as stuck: {failure}"));
    assert!(stuck.contains("never completed"), "{stuck}");
}

#[test]
fn oracle_catches_overtaken_messages_dropped_in_unaligned_mode() {
    let failure = first_catch(Mutant::DropsOvertakenMessages, &[SnapshotMode::Unaligned]);
    assert!(failure.oracle.is_some(), "oracle missed it: {failure}");
    assert!(failure.verifier.is_some(), "verifier missed it: {failure}");
}

#[test]
fn oracle_catches_messages_delivered_past_a_marker_in_aligned_mode() {
    let failure = first_catch(Mutant::IgnoresAlignment, &[SnapshotMode::Aligned]);
    assert!(failure.oracle.is_some(), "oracle missed it: {failure}");
    assert!(failure.verifier.is_some(), "verifier missed it: {failure}");
}
