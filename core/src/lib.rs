//! `cairn-core`: the snapshot algorithm, sans-IO.
//!
//! Chandy–Lamport's marker algorithm (ACM TOCS 1985) with Flink's aligned and unaligned
//! variants (arXiv:1506.08603, FLIP-76), as pure state machines. No tokio, tonic, prost
//! or etcd here: time and randomness come in as inputs, iteration follows `BTreeMap`
//! order, and every run is reproducible.
//!
//! ```text
//!          node daemon (I/O)                          cairn-core (pure)
//!   ┌──────────────────────────────┐  Event   ┌─────────────────────────────┐
//!   │ peer streams, app session,   │ ───────▶ │ SnapshotEngine::handle      │
//!   │ inbox, outgoing queues,      │          │   (one per process)         │
//!   │ timers                       │ ◀─────── │ SnapshotEngine::drain_commands
//!   └──────────────────────────────┘ Command  └─────────────────────────────┘
//!                 │ LocalReport + recorded messages
//!                 ▼
//!   coordinator ── SnapshotTracker (lifecycle) ── verify (consistent cut?)
//! ```
//!
//! The runtime owns one [`SnapshotEngine`] per process in one task. It reports what
//! happened as [`Event`]s — a marker arrived, the application was handed messages, it
//! recorded its state — and executes the [`Command`]s that come out, in order: put a
//! record request into the application's inbox, send a marker, keep a copy of these
//! messages as channel state, hold a channel back, report the part as done.
//!
//! ```
//! use cairn_core::{ChannelId, Command, Event, NodeId, Plan, SnapshotEngine, SnapshotMode, Topology};
//!
//! // Process b of a two-process ring a -> b -> a.
//! let topology = Topology::ring([NodeId::from("a"), NodeId::from("b")]);
//! let mut engine = SnapshotEngine::new("b".into(), topology);
//!
//! // The first marker of snapshot 1 arrives from a: record the local state.
//! let plan = Plan::new(1, SnapshotMode::ChandyLamport, "a");
//! engine.handle(Event::MarkerReceived { channel: ChannelId::new("a", "b"), plan: plan.clone() });
//! let commands: Vec<Command> = engine.drain_commands().collect();
//! assert_eq!(commands, [Command::EnqueueRecordState { id: plan.id, front: false }]);
//!
//! // The application answered: the marker goes out and b's part is complete.
//! engine.handle(Event::StateRecorded { id: plan.id, unconsumed: vec![] });
//! let commands: Vec<Command> = engine.drain_commands().collect();
//! assert!(matches!(&commands[0], Command::SendMarker { channel, .. } if channel == &ChannelId::new("b", "a")));
//! assert!(matches!(&commands[1], Command::ReportLocalDone { .. }));
//! ```
//!
//! # Layout
//!
//! - [`types`]: [`NodeId`], [`SnapshotId`], [`ChannelId`], [`SnapshotMode`], [`Plan`].
//! - [`topology`]: [`Topology`], reachability and the aligned mode's feedback channels.
//! - [`event`]: the engine's [`Event`]s, [`Command`]s and [`Outcome`]s.
//! - [`engine`]: [`SnapshotEngine`], one process's side of every snapshot.
//! - [`report`]: [`LocalReport`] (a process's counters).
//! - [`failure`]: [`FailureReason`], why a snapshot can fail.
//! - [`verifier`]: [`verify`], the consistent-cut check, and its [`Violation`]s.
//! - [`tracker`]: [`SnapshotTracker`], the coordinator's view of every snapshot.
//! - [`restore`]: the replay of recorded channel state, and a restore's progress.
//! - [`control`]: what the coordinator and the nodes tell each other (registrations,
//!   commands, membership), as data.
//! - [`schedule`]: [`schedule::Schedule`], when the coordinator takes scheduled snapshots.

#![forbid(unsafe_code)]

pub mod control;
pub mod coordinator;
pub mod engine;
pub mod event;
pub mod failure;
pub mod lifecycle;
pub mod record;
pub mod report;
pub mod restore;
pub mod schedule;
pub mod topology;
pub mod tracker;
pub mod types;
pub mod verifier;

pub use engine::SnapshotEngine;
pub use event::{Command, Event, Ignored, Outcome};
pub use failure::{FailureKind, FailureReason};
pub use report::{IncomingCut, LocalReport, OutgoingCut};
pub use topology::{Topology, TopologyError};
pub use tracker::{SnapshotTracker, StartError, StartRequest, Update};
pub use types::{ChannelId, NodeId, Plan, SnapshotId, SnapshotMode};
pub use verifier::{Consistent, NodePart, Side, Violation, verify};
