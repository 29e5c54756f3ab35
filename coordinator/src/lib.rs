//! `cairn-coordinator`: membership, triggering, collection, metadata and blob storage.
//!
//! Not built yet: it arrives with the coordinator issue, around
//! `cairn_core::SnapshotTracker`. The crate exists so the workspace has its final shape.
//!
//! # Layout
//!
//! Empty for now.
