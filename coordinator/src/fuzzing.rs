//! Entry points for fuzzing what the coordinator reads from outside (issue 20): metadata
//! records read back from etcd or the embedded store, the embedded store's files, topology
//! files, tokens files and policy changes. Each takes arbitrary bytes and must not panic;
//! `fuzz/` drives them and `integration-tests/tests/fuzz_replay.rs` replays their corpora.

use prost::Message;

use cairn_proto::v1 as pb;

use crate::store::records::{
    MemberRecord, PartRecord, PolicyRecord, RemovedRecord, RestoreRecord, RosterRecord,
    SnapshotRecord,
};

/// A metadata value read back, as each record type, and a snapshot record on to the wire.
pub fn records(data: &[u8]) {
    if let Ok(record) = serde_json::from_slice::<SnapshotRecord>(data) {
        let _ = crate::records_conv::snapshot_pb(&record);
    }
    let _ = serde_json::from_slice::<PartRecord>(data);
    let _ = serde_json::from_slice::<MemberRecord>(data);
    let _ = serde_json::from_slice::<RemovedRecord>(data);
    let _ = serde_json::from_slice::<RosterRecord>(data);
    let _ = serde_json::from_slice::<RestoreRecord>(data);
    let _ = serde_json::from_slice::<PolicyRecord>(data);
}

/// The embedded store's files: the bytes before the first NUL are its base file, the rest
/// its log (no NUL: no base file, all log) — torn and garbage lines included.
pub fn store_log(data: &[u8]) {
    let (base, log) = match data.iter().position(|b| *b == 0) {
        Some(at) => (Some(&data[..at]), &data[at + 1..]),
        None => (None, data),
    };
    let _ = crate::store::file::replay(base, log);
}

/// A `--topology` file.
pub fn topology(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = crate::config::parse_topology(text);
    }
}

/// An `--auth-tokens` file.
pub fn tokens(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = cairn_sdk::cli::auth::Tokens::parse(text);
    }
}

/// A `SetPolicy` request applied to the default policy.
pub fn policy(data: &[u8]) {
    let Ok(request) = pb::SetPolicyRequest::decode(data) else {
        return;
    };
    let wire = request.policy.unwrap_or_default();
    let _ = crate::policy::apply(&Default::default(), &wire, &request.update);
}
