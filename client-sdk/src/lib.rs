//! `cairn-sdk`: what an application links to live under cairn.
//!
//! An application talks to the cairn daemon beside it over one [`AppSession`]: it sends
//! messages to other nodes, receives theirs, and — when a snapshot reaches it — records
//! its local state. The session's two directions are ordered, which is what makes the
//! cut exact without pausing anything: messages received before
//! [`AppEvent::RecordState`] belong in the state, and messages sent before
//! [`AppSender::state_recorded`] precede the snapshot's marker.
//!
//! A message and the state change it stands for must be on the same side of the cut:
//! reserve room first, then change the state and send in one critical section.
//!
//! ```no_run
//! use std::sync::{Arc, Mutex};
//! use cairn_sdk::{AppEvent, AppSession};
//!
//! # async fn example() -> Result<(), cairn_sdk::Error> {
//! let mut session = AppSession::connect("127.0.0.1:7200", "counter").await?;
//! let sender = session.sender();
//! let count = Arc::new(Mutex::new(0u64));
//!
//! // Sending: reserve (may wait), then change state and send together.
//! let permit = sender.reserve().await?;
//! {
//!     let mut c = count.lock().unwrap();
//!     *c += 1;
//!     permit.send("n2", bytes::Bytes::from_static(b"hello"))?;
//! }
//!
//! // Receiving, and recording the state when asked.
//! while let Some(event) = session.next_event().await? {
//!     match event {
//!         AppEvent::Message { from, payload } => println!("{from}: {payload:?}"),
//!         AppEvent::RecordState { snapshot_id } => {
//!             let c = count.lock().unwrap();
//!             sender.state_recorded(snapshot_id, c.to_string().into())?;
//!         }
//!         AppEvent::Restore { state, restore_id, .. } => {
//!             let mut c = count.lock().unwrap();
//!             *c = String::from_utf8_lossy(&state).parse().unwrap_or(0);
//!             sender.restore_applied(&restore_id)?;
//!         }
//!         // Only with `session.restore_in_pieces(true)`, for states too large to hold twice.
//!         AppEvent::RestorePiece { .. } | AppEvent::RestoreAborted { .. } => {}
//!         // Only with `AttachOptions::snapshot_outcomes_after` (see `AppSession::attach`).
//!         AppEvent::SnapshotCompleted { .. } | AppEvent::SnapshotAborted { .. } => {}
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! # Layout
//!
//! - [`session`]: [`AppSession`], [`AppSender`], [`SendPermit`], [`AppEvent`].
//! - [`coordinator`]: the coordinator client, [`CoordinatorClient`].
//! - [`sink`]: exactly-once effects on an external system, a two-phase-commit sink
//!   ([`sink::TwoPhaseCommitSink`] over a [`sink::Transactional`]) driven by the snapshots'
//!   ends ([`AttachOptions::snapshot_outcomes_after`]).
//! - [`tls`]: TLS from PEM files (a CA, an identity) for clients (and servers): cairn-rpc's.
//! - [`error`]: [`Error`], with [`Error::is_retryable`].
//!
//! No server code: the daemons' runtime is `cairn-rpc`'s `server` feature, which this
//! crate does not enable; `cairnctl` and the example bank are `cairn-cli`
//! (`client-sdk/cli/`).

#![forbid(unsafe_code)]

pub mod coordinator;
pub mod error;
pub mod session;
pub mod sink;

/// TLS from PEM files for cairn's gRPC links (cairn-rpc's, re-exported).
pub use cairn_rpc::tls;

pub use coordinator::CoordinatorClient;
pub use error::Error;
pub use session::{AppEvent, AppSender, AppSession, AttachOptions, SendPermit};
/// The PostgreSQL client the `postgres` sink is built on (feature `postgres`).
#[cfg(feature = "postgres")]
pub use tokio_postgres;
