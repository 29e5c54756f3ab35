//! `cairn-sdk`: the Rust SDK an application links, `cairnctl`, and the bank example.
//!
//! Not built yet: it arrives with the node daemon issue. The crate exists so the
//! workspace has its final shape.
//!
//! # Layout
//!
//! Empty for now.
