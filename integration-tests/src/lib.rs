//! cairn's system-level tests: the deterministic simulation of the snapshot algorithm
//! (multi-process, docker-compose tests and benchmarks join it as they are built).
//!
//! # Layout
//!
//! - [`sim`]: the seeded simulation, its ground-truth oracle and the broken engines that
//!   prove the oracle can fail. Its tests live in `tests/simulation.rs`.

#![forbid(unsafe_code)]

pub mod sim;
