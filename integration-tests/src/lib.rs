//! cairn's system-level tests: the deterministic simulation of the snapshot algorithm
//! (multi-process, docker-compose tests and benchmarks join it as they are built).
//!
//! # Layout
//!
//! - [`sim`]: the seeded simulation, its ground-truth oracle and the broken engines that
//!   prove the oracle can fail. Its tests live in `tests/it/simulation.rs`.
//! - [`processes`]: child processes killed on drop, free ports, polling with a deadline.
//! - [`bank_cluster`]: real `cairn-node` + `cairn-bank` processes on static config.
//! - [`cut`]: a real snapshot's parts, verified and its money counted.
//! - [`local`]: node daemons inside the test process.
//! - [`etcd`]: a real etcd started by the test.
//! - [`coordinated`]: a coordinator, node daemons and banks as processes.
//! - [`proxy`]: a TCP proxy that cuts its connections on demand.
//! - [`restore`]: what banks must hold after a restore, and the restore calls tests share.
//! - [`mod@bench`]: the pieces of `cairn-bench` (in-process applications, baselines, stats).
//! - [`nemesis`]: the history of a `cairn-nemesis` run and its independent checker.
//! - [`netns`]: hosts in network namespaces of their own, and partitions, packet loss and
//!   slow links between them.

#![forbid(unsafe_code)]

pub mod bank_cluster;
pub mod bench;
pub mod browser;
pub mod coordinated;
pub mod cut;
pub mod etcd;
pub mod local;
pub mod nemesis;
pub mod netns;
pub mod postgres;
pub mod processes;
pub mod proxy;
pub mod restore;
pub mod s3;
pub mod sim;
pub mod tls_support;
