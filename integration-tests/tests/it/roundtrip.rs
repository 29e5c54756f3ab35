//! Round-trip properties (proptest): what the engine produces survives the wire, and what
//! the coordinator stores survives the disk — core ⇄ wire ⇄ storage.
//!
//! - core ⇄ wire: a snapshot plan and both sides of a channel's cut, through their protobuf
//!   conversions and prost's bytes, come back equal (the epoch and the recorded ranges
//!   too); payloads packed into runs come back as the same payloads in the same order.
//! - storage: a part manifest through its JSON and `Manifest::parse`; the embedded
//!   metadata store's base and log after any sequence of puts and deletes, reopened — and
//!   reopened after its log was cut at any byte, as a crash cuts a write: it holds the
//!   changes of some first lines, never a mix.
//! - the example bank's state through its JSON, and its transfer ids: delivered in order
//!   they are all `Next`; a duplicate or a gap is always told.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use cairn_blob::{ChunkList, Manifest};
use cairn_cli::bank::{BankState, LedgerRow, Order, Received, TransferPayload};
use cairn_coordinator::store::{FileKv, Kv};
use cairn_core::{ChannelId, IncomingCut, NodeId, OutgoingCut, Plan, SnapshotId, SnapshotMode};
use cairn_proto::convert::plan_to_pb;
use cairn_proto::runs::{RunBuilder, split};
use cairn_proto::v1 as pb;
use proptest::collection::{btree_map, btree_set, vec};
use proptest::prelude::*;
use prost::Message;

fn node_id() -> impl Strategy<Value = String> {
    "[a-z0-9][a-z0-9-]{0,11}"
}

fn mode() -> impl Strategy<Value = SnapshotMode> {
    prop_oneof![
        Just(SnapshotMode::ChandyLamport),
        Just(SnapshotMode::Unaligned),
        Just(SnapshotMode::Aligned),
    ]
}

fn plan() -> impl Strategy<Value = Plan> {
    (
        1..=u64::MAX,
        mode(),
        btree_set(node_id(), 1..5),
        0..1_000_000_000u64,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(id, mode, initiators, timeout_ms, timed_out, started_at_ms)| Plan {
                id: SnapshotId(id),
                mode,
                initiators: initiators.into_iter().map(NodeId::new).collect(),
                alignment_timeout: (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms)),
                timed_out,
                started_at_ms,
            },
        )
}

fn channel() -> impl Strategy<Value = ChannelId> {
    (node_id(), node_id())
        .prop_filter("a channel joins two nodes", |(a, b)| a != b)
        .prop_map(|(a, b)| ChannelId::new(a, b))
}

/// A chunk name: 64 lowercase hex digits.
fn chunk_name() -> impl Strategy<Value = String> {
    "[0-9a-f]{64}"
}

fn chunk_list() -> impl Strategy<Value = ChunkList> {
    (any::<u64>(), vec(chunk_name(), 0..8)).prop_map(|(size, chunks)| ChunkList { size, chunks })
}

/// One change to the embedded store.
#[derive(Debug, Clone)]
enum Change {
    Put(String, String),
    Delete(String),
    DeletePrefix(String),
}

fn change() -> impl Strategy<Value = Change> {
    let key = "k/[abc]/[0-3]";
    prop_oneof![
        6 => (key, "\\PC{0,40}").prop_map(|(k, v)| Change::Put(k, v)),
        2 => key.prop_map(Change::Delete),
        1 => "k/[abc]/".prop_map(Change::DeletePrefix),
    ]
}

fn apply(model: &mut BTreeMap<String, String>, change: &Change) {
    match change {
        Change::Put(k, v) => {
            model.insert(k.clone(), v.clone());
        }
        Change::Delete(k) => {
            model.remove(k);
        }
        Change::DeletePrefix(p) => model.retain(|k, _| !k.starts_with(p.as_str())),
    }
}

/// Opens the embedded store at `base`. Its lock (an `flock`) is released when the previous
/// handle is dropped, but a process another test of this binary spawns at that moment holds
/// a copy of the lock's descriptor from its fork until it execs (the descriptor is
/// close-on-exec): so "in use" by this very process is waited out, up to 5 s.
async fn reopen(base: &std::path::Path) -> FileKv {
    let ours = format!("(pid {};", std::process::id());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match FileKv::open(base, "members/").await {
            Ok(kv) => return kv,
            Err(e) if e.message.contains(&ours) && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            Err(e) => panic!("cannot open the embedded store at {}: {e}", base.display()),
        }
    }
}

async fn contents(kv: &FileKv) -> BTreeMap<String, String> {
    kv.list("")
        .await
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8(v).unwrap()))
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_plan_survives_the_wire(plan in plan(), epoch in any::<u64>()) {
        let bytes = plan_to_pb(&plan, epoch).encode_to_vec();
        let wire = pb::SnapshotPlan::decode(&bytes[..]).unwrap();
        prop_assert_eq!(wire.epoch, epoch);
        prop_assert_eq!(Plan::try_from(&wire).unwrap(), plan);
    }

    #[test]
    fn both_sides_of_a_cut_survive_the_wire(
        channel in channel(),
        delivered in any::<u64>(),
        marker_at in any::<u64>(),
        sent in any::<u64>(),
    ) {
        let incoming = IncomingCut { delivered, marker_at };
        let bytes = pb::IncomingCut::from((&channel, &incoming)).encode_to_vec();
        let wire = pb::IncomingCut::decode(&bytes[..]).unwrap();
        prop_assert_eq!(wire.recorded_from..wire.recorded_to, incoming.recorded());
        prop_assert_eq!(
            <(ChannelId, IncomingCut)>::try_from(&wire).unwrap(),
            (channel.clone(), incoming)
        );
        let outgoing = OutgoingCut { sent, marker_at };
        let bytes = pb::OutgoingCut::from((&channel, &outgoing)).encode_to_vec();
        let wire = pb::OutgoingCut::decode(&bytes[..]).unwrap();
        prop_assert_eq!(wire.recorded_from..wire.recorded_to, outgoing.recorded());
        prop_assert_eq!(
            <(ChannelId, OutgoingCut)>::try_from(&wire).unwrap(),
            (channel, outgoing)
        );
    }

    #[test]
    fn payloads_packed_into_runs_come_back_in_order(
        sends in vec((0..3u8, vec(any::<u8>(), 0..2_000)), 0..40),
    ) {
        let mut builder = RunBuilder::default();
        for (key, payload) in &sends {
            builder.push(*key, Bytes::from(payload.clone()));
        }
        let mut back = Vec::new();
        for (key, blob, lengths) in builder.finish() {
            for payload in split(&blob, &lengths, 4_096).unwrap() {
                back.push((key, payload.to_vec()));
            }
        }
        prop_assert_eq!(back, sends);
    }

    #[test]
    fn a_manifest_survives_its_storage(local in chunk_list(), channels in chunk_list()) {
        let manifest = Manifest { local_state: local, channel_states: channels };
        let bytes = serde_json::to_vec(&manifest).unwrap();
        prop_assert_eq!(Manifest::parse(&bytes).unwrap(), manifest);
    }

    #[test]
    fn the_bank_state_survives_its_json(
        balance in any::<u64>(),
        line in any::<u64>(),
        sent in btree_map(node_id(), any::<u64>(), 0..5),
        received in btree_map(node_id(), (any::<u64>(), any::<u64>()), 0..5),
        pending in vec(1..u64::MAX, 0..4),
        open in vec((node_id(), any::<u64>(), any::<u64>(), any::<u64>()), 0..4),
    ) {
        let state = BankState {
            balance,
            line,
            sent,
            received: received
                .into_iter()
                .map(|(k, (line, id))| (k, Received { line, id }))
                .collect(),
            ledger_pending: pending,
            ledger_open: open
                .into_iter()
                .map(|(from, line, id, amount)| LedgerRow { from, line, id, amount })
                .collect(),
        };
        let bytes = serde_json::to_vec(&state).unwrap();
        prop_assert_eq!(serde_json::from_slice::<BankState>(&bytes).unwrap(), state);
    }

    #[test]
    fn transfer_ids_tell_every_duplicate_and_gap(ids in vec(1..60u64, 1..80)) {
        let mut state = BankState::default();
        let mut last = 0u64;
        for (n, &id) in ids.iter().enumerate() {
            let payload = TransferPayload { amount: 1, line: 5, id }.encode();
            let order = state.receive("a", &payload).unwrap();
            let expected = if n == 0 {
                if id == 1 { Order::Next } else { Order::NewLine }
            } else if id == last + 1 {
                Order::Next
            } else if id <= last {
                Order::Duplicate
            } else {
                Order::Skipped(id - last - 1)
            };
            prop_assert_eq!(order, expected);
            last = last.max(id);
        }
        prop_assert_eq!(state.balance, ids.len() as u64);
        prop_assert_eq!(state.received["a"], Received { line: 5, id: last });
    }
}

proptest! {
    // Each case syncs its log line by line: fewer cases.
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn the_embedded_store_replays_whole_changes_only(
        changes in vec(change(), 1..25),
        cut in any::<prop::sample::Index>(),
    ) {
        let dir = std::env::temp_dir().join(format!(
            "cairn-roundtrip-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        let base = dir.join("metadata.json");
        let rt = runtime();
        let result = rt.block_on(async {
            // The model after each change: states[i] holds the first i.
            let mut states = vec![BTreeMap::new()];
            {
                let kv = reopen(&base).await;
                for change in &changes {
                    match change {
                        Change::Put(k, v) => kv.put(k, v.clone().into_bytes()).await.unwrap(),
                        Change::Delete(k) => kv.delete(k).await.unwrap(),
                        Change::DeletePrefix(p) => kv.delete_prefix(p).await.unwrap(),
                    }
                    let mut next = states.last().unwrap().clone();
                    apply(&mut next, change);
                    states.push(next);
                }
                prop_assert_eq!(&contents(&kv).await, states.last().unwrap());
            }
            // Reopened as it is: everything.
            let log_path = base.with_extension("log");
            let log = std::fs::read(&log_path).unwrap();
            {
                let kv = reopen(&base).await;
                prop_assert_eq!(&contents(&kv).await, states.last().unwrap());
            }
            // Reopening compacted the log into the base: put the log back over the first
            // base, cut at any byte, as a crash in the middle of a write leaves it.
            std::fs::write(&base, b"{}").unwrap();
            let at = cut.index(log.len() + 1);
            std::fs::write(&log_path, &log[..at]).unwrap();
            let kv = reopen(&base).await;
            let got = contents(&kv).await;
            // The changes of some first lines (a change that changes nothing writes no
            // line), never a mix; all of them when nothing was cut.
            prop_assert!(
                states.contains(&got),
                "log cut at byte {at} of {}: {got:?} is no prefix of the changes",
                log.len()
            );
            if at == log.len() {
                prop_assert_eq!(&got, states.last().unwrap());
            }
            Ok(())
        });
        let _ = std::fs::remove_dir_all(&dir);
        result?;
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
