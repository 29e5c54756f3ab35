//! `cairn-node`: the node daemon that runs beside every application process.
//!
//! Not built yet: the peer channels, the application session and the event loop around
//! `cairn_core::SnapshotEngine` arrive with the node daemon issue. The crate exists so
//! the workspace has its final shape.
//!
//! # Layout
//!
//! Empty for now.
