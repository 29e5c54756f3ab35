//! `cairn-cli`: what cairnctl and the example application share, as a library the
//! multi-process tests reuse.
//!
//! - [`bank`]: `cairn-bank`, the example application — accounts moved between nodes
//!   through the cairn session, with a gRPC API and a workload.
//! - [`local_cluster`]: the processes of `cairnctl cluster up` and `cairnctl demo`.
//!
//! The binaries are `cairnctl` (`src/bin/cairnctl/`) and `cairn-bank`.

#![forbid(unsafe_code)]

pub mod bank;
pub mod local_cluster;
