//! cairn's integration tests, as one test binary (one link of the workspace instead of one per
//! file): each module is one concern — a subsystem under real processes, etcd, S3, TLS or
//! network namespaces, the simulation, the fuzz corpora, the round trips. Run one with
//! `cargo test -p cairn-integration-tests --test it MODULE::` (e.g. `ha::`).

mod auth;
mod bank_snapshots;
mod cli;
mod console;
mod console_login;
mod coordinator;
mod etcd_tls;
mod faults;
mod fuzz_replay;
mod grpcurl;
mod ha;
mod integrity;
mod large_state;
mod ledger;
mod lifecycle;
mod limits;
mod limits_transport;
mod local_cluster;
mod membership;
mod netns;
mod node_channels;
mod object_storage;
mod operational;
mod prometheus;
mod restore;
mod roundtrip;
mod s3_server;
mod schedule;
mod simulation;
mod soak;
mod stalled_store;
mod tls;
mod tls_lifecycle;
mod tls_revocation;
