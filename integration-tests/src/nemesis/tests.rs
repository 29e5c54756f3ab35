//! The checker against made-up histories: a good one passes, and each way a broken build
//! shows in a history (the mutants of `scripts/nemesis-mutants.sh` among them) is caught.

use std::collections::BTreeMap;

use super::check::check;
use super::history::{BankView, ChannelView, Entry, LedgerIsland, NodeView, SnapshotView};

fn island(from: &str, to: &str, line: u64, first: u64, last: u64) -> LedgerIsland {
    LedgerIsland {
        from: from.into(),
        to: to.into(),
        line,
        first,
        last,
    }
}

fn bank(node: &str, state: &str) -> BankView {
    BankView {
        node: node.into(),
        state: Some(state.into()),
        duplicates: 0,
        skipped: 0,
        rejected: 0,
    }
}

/// Snapshot `k` of two banks (a: line 11, b: line 22, 100 each): a has sent k transfers of
/// 1 to b, b has received k − 1 of them, and transfer k is in flight: recorded by b as it
/// arrived (k odd), or by a as overtaken in its queue (k even, the unaligned mode's way).
fn snapshot(k: u64) -> SnapshotView {
    let in_flight = vec![ChannelView {
        from: "a".into(),
        to: "b".into(),
        messages: vec![format!(r#"{{"amount":1,"line":11,"id":{k}}}"#)],
    }];
    let (by_a, by_b) = if k.is_multiple_of(2) {
        (in_flight, vec![])
    } else {
        (vec![], in_flight)
    };
    SnapshotView {
        id: k,
        term: 7,
        mode: ["CHANDY_LAMPORT", "UNALIGNED", "ALIGNED"][(k % 3) as usize].into(),
        status: "COMPLETED".into(),
        failure_kind: String::new(),
        failure: String::new(),
        started_at_ms: 0,
        finished_at_ms: 0,
        channels: vec!["a->b".into(), "b->a".into()],
        epoch: Some(0),
        nodes: vec![
            NodeView {
                node: "a".into(),
                state: format!(r#"{{"balance":{},"line":11,"sent":{{"b":{k}}}}}"#, 100 - k),
                channels: by_a,
            },
            NodeView {
                node: "b".into(),
                state: format!(
                    r#"{{"balance":{},"line":22,"received":{{"a":{{"line":11,"id":{}}}}}}}"#,
                    100 + k - 1,
                    k - 1
                ),
                channels: by_b,
            },
        ],
    }
}

fn good() -> Vec<Entry> {
    let mut h = vec![
        Entry::Setup {
            seed: 1,
            nodes: vec!["a".into(), "b".into()],
            replicas: 2,
            total: 200,
            seconds: 10,
        },
        Entry::Banks {
            at: 0.5,
            banks: vec![
                bank("a", r#"{"balance":100,"line":11}"#),
                bank("b", r#"{"balance":100,"line":22}"#),
            ],
        },
        Entry::Leader {
            at: 0.6,
            replica: 1,
            term: 7,
        },
    ];
    for k in 1..=12 {
        h.push(Entry::SnapshotStarted {
            at: k as f64,
            id: k,
            mode: "CHANDY_LAMPORT".into(),
        });
        if k == 3 {
            h.push(Entry::Fault {
                at: 3.5,
                kind: "cut".into(),
                target: "a->b".into(),
                detail: String::new(),
            });
        }
        if k == 4 {
            h.push(Entry::Fault {
                at: 4.2,
                kind: "pause-daemon".into(),
                target: "a".into(),
                detail: "800 ms".into(),
            });
            h.push(Entry::Heal {
                at: 5.0,
                kind: "pause-daemon".into(),
                target: "a".into(),
            });
        }
    }
    h.push(Entry::Quiet { at: 13.0 });
    h.push(Entry::Banks {
        at: 14.0,
        banks: vec![
            bank("a", r#"{"balance":88,"line":11,"sent":{"b":12}}"#),
            bank(
                "b",
                r#"{"balance":112,"line":22,"received":{"a":{"line":11,"id":12}}}"#,
            ),
        ],
    });
    for k in 1..=12 {
        h.push(Entry::Told {
            at: k as f64 + 0.5,
            id: k,
            status: "COMPLETED".into(),
        });
    }
    for k in 1..=12 {
        h.push(Entry::Snapshot(snapshot(k)));
    }
    h.push(Entry::Restore {
        restore_id: "r1".into(),
        snapshot: 12,
        requested_by: "user".into(),
        done: true,
        failure: String::new(),
        started_at_ms: 5_000,
    });
    h.push(Entry::FinalRestore {
        at: 15.0,
        snapshot: 12,
        banks: vec![
            bank("a", r#"{"balance":88,"line":11,"sent":{"b":12}}"#),
            bank(
                "b",
                r#"{"balance":112,"line":22,"received":{"a":{"line":11,"id":12}}}"#,
            ),
        ],
    });
    // Snapshot 12 says b received a's transfers 1 to 11 (12 was in flight, delivered after
    // the restore and not cut since).
    h.push(Entry::Ledger {
        at: 15.5,
        snapshot: 12,
        islands: vec![island("a", "b", 11, 1, 11)],
        prepared: Vec::new(),
    });
    h.push(Entry::End {
        at: 16.0,
        faults: BTreeMap::new(),
        refused: BTreeMap::new(),
    });
    h
}

fn snapshot_mut(h: &mut [Entry], id: u64) -> &mut SnapshotView {
    h.iter_mut()
        .find_map(|e| match e {
            Entry::Snapshot(s) if s.id == id => Some(s),
            _ => None,
        })
        .unwrap()
}

/// The violations of `h`, which must include one containing `needle`.
fn caught(h: &[Entry], needle: &str) {
    let v = check(h, 30.0);
    assert!(
        v.violations.iter().any(|x| x.contains(needle)),
        "no violation mentions {needle:?}: {:#?}",
        v.violations
    );
}

#[test]
fn a_good_history_passes() {
    let v = check(&good(), 30.0);
    assert!(v.violations.is_empty(), "{:#?}", v.violations);
    assert_eq!(v.completed_checked, 12);
    assert_eq!(v.money_checked, 12);
    assert_eq!(v.channels_checked, 24);
    assert_eq!(v.in_flight_checked, 12);
    assert_eq!(v.snapshots_started, 12);
    assert_eq!(v.faults.get("cut"), Some(&1));
    assert_eq!(v.restores.get("user done"), Some(&1));
    assert_eq!(v.ledger_transfers_checked, 11);
    // The pause ended at 5.0 s; snapshot 5 started then.
    assert!(v.longest_recovery_s <= 1.0, "{}", v.longest_recovery_s);
}

#[test]
fn a_cut_that_records_one_message_too_few_is_caught() {
    // The mutant `record-one-too-few`: the in-flight transfer is missing from the part.
    let mut h = good();
    snapshot_mut(&mut h, 7).nodes[1].channels[0]
        .messages
        .clear();
    caught(
        &h,
        "snapshot 7: channel a->b: in flight [] but a sent up to 7",
    );
    caught(&h, "transfers [7] are in neither state nor channel");
    caught(&h, "snapshot 7 is COMPLETED but holds 199");
    // And on the sender's side.
    let mut h = good();
    snapshot_mut(&mut h, 6).nodes[0].channels[0]
        .messages
        .clear();
    caught(&h, "transfers [6] are in neither state nor channel");
}

#[test]
fn a_message_in_the_receivers_state_and_in_flight_is_caught() {
    let mut h = good();
    snapshot_mut(&mut h, 5).nodes[1].channels[0]
        .messages
        .insert(0, r#"{"amount":1,"line":11,"id":4}"#.into());
    caught(
        &h,
        "transfer 4 is recorded in flight but b's state already counts it",
    );
}

#[test]
fn an_orphan_message_is_caught() {
    let mut h = good();
    let s = snapshot_mut(&mut h, 5);
    s.nodes[0].state = r#"{"balance":96,"line":11,"sent":{"b":4}}"#.into();
    caught(
        &h,
        "in flight [5] but a sent up to 4 and b received up to 4",
    );
    let mut h = good();
    let s = snapshot_mut(&mut h, 5);
    s.nodes[0].state = r#"{"balance":97,"line":11,"sent":{"b":3}}"#.into();
    caught(&h, "b has received transfer 4 but a has sent only 3");
}

#[test]
fn a_frame_dropped_on_reconnect_is_caught() {
    // The mutant `drop-frame-on-reconnect`: the receiving bank counts the gap, and the
    // drained banks disagree.
    let mut h = good();
    if let Entry::Banks { banks, .. } = &mut h[1] {
        banks[1].skipped = 1;
    }
    caught(
        &h,
        "bank b saw 0 duplicate, 1 skipped and 0 rejected transfers",
    );
    let mut h = good();
    for e in &mut h {
        if let Entry::Banks { at, banks } = e
            && *at > 13.0
        {
            banks[1].state =
                Some(r#"{"balance":111,"line":22,"received":{"a":{"line":11,"id":11}}}"#.into());
        }
    }
    caught(
        &h,
        "channel a->b: a sent up to transfer 12 of line 11 but b received up to Some(Seen { line: 11, id: 11 })",
    );
    caught(&h, "after the faults the banks hold 199, not 200");
}

#[test]
fn ids_that_go_back_terms_that_fall_and_two_leaders_of_a_term_are_caught() {
    let mut h = good();
    h.push(Entry::SnapshotStarted {
        at: 20.0,
        id: 5,
        mode: "ALIGNED".into(),
    });
    caught(&h, "snapshot id 5 handed out at 20.0s after id 12");
    let mut h = good();
    snapshot_mut(&mut h, 9).term = 6;
    caught(&h, "snapshot 9 has term 6, below snapshot 1's term 7");
    let mut h = good();
    h.push(Entry::Leader {
        at: 9.0,
        replica: 2,
        term: 7,
    });
    caught(&h, "term 7 was led by more than one replica");
    let mut h = good();
    h.retain(|e| !matches!(e, Entry::Snapshot(s) if s.id == 8));
    caught(
        &h,
        "snapshot 8 was started but is not in the coordinator's final list",
    );
}

#[test]
fn a_wrong_restore_and_a_stuck_one_are_caught() {
    let mut h = good();
    for e in &mut h {
        if let Entry::FinalRestore { banks, .. } = e {
            banks[1].state =
                Some(r#"{"balance":111,"line":22,"received":{"a":{"line":11,"id":11}}}"#.into());
        }
    }
    caught(&h, "after restoring snapshot 12, bank b holds balance 111");
    let mut h = good();
    h.push(Entry::Restore {
        restore_id: "r2".into(),
        snapshot: 3,
        requested_by: "b restarted".into(),
        done: false,
        failure: String::new(),
        started_at_ms: 0,
    });
    caught(&h, "restore r2 is neither done nor failed");
}

/// Issue 31: an outcome told that the store does not hold, and a restore started under a
/// call answered as a failure, are caught; told what the store holds, or a refusal that
/// says the outcome is unknown, are not.
#[test]
fn an_end_told_but_not_stored_and_a_restore_told_failed_are_caught() {
    let mut h = good();
    h.push(Entry::Told {
        at: 3.0,
        id: 8,
        status: "COMPLETED".into(),
    });
    assert!(check(&h, 45.0).violations.is_empty(), "told as stored");
    h.push(Entry::Told {
        at: 3.0,
        id: 9,
        status: "FAILED".into(),
    });
    caught(
        &h,
        "snapshot 9: a watcher was told FAILED, the store holds COMPLETED",
    );
    let refused = |code: &str, message: &str| Entry::RestoreRefused {
        at: 4.0,
        snapshot: 12,
        sent_ms: 4_000,
        answered_ms: 9_000,
        code: code.into(),
        message: message.into(),
    };
    let mut h = good();
    h.push(refused(
        "Aborted",
        "outcome unknown: restore-1 of snapshot 12 may or may not have been stored",
    ));
    assert!(check(&h, 45.0).violations.is_empty(), "told unknown");
    let mut h = good();
    h.push(refused(
        "Unavailable",
        "metadata store: etcd unavailable: timeout",
    ));
    caught(
        &h,
        "r1 (of snapshot 12) started while a restore call was open that was answered Unavailable",
    );
}

#[test]
fn an_inconsistent_verdict_and_a_fault_without_recovery_are_caught() {
    let mut h = good();
    let s = snapshot_mut(&mut h, 12);
    s.status = "FAILED".into();
    s.failure_kind = "KIND_INCONSISTENT".into();
    caught(&h, "snapshot 12 failed as inconsistent");
    let mut h = good();
    h.push(Entry::Fault {
        at: 12.5,
        kind: "kill-leader".into(),
        target: "coordinator1".into(),
        detail: String::new(),
    });
    caught(&h, "no snapshot completed");
    let mut h = good();
    h.push(Entry::Fault {
        at: 12.5,
        kind: "pause-etcd".into(),
        target: "etcd".into(),
        detail: String::new(),
    });
    caught(&h, "never ended");
}

#[test]
fn a_fresh_bank_is_not_money_checked_until_restored() {
    // Bank a started afresh (line 33) in snapshot 11: its channel is across the restart
    // and the money is not counted; the run must still end on the original lines.
    let mut h = good();
    let s = snapshot_mut(&mut h, 11);
    s.nodes[0].state = r#"{"balance":100,"line":33}"#.into();
    s.nodes[1].channels.clear();
    let v = check(&h, 30.0);
    assert!(v.violations.is_empty(), "{:#?}", v.violations);
    assert_eq!(v.money_checked, 11);
    // a->b is checked (a's new line has sent nothing; b follows its old one); b->a is not
    // (a, started afresh, has heard nothing from b).
    assert_eq!(v.channels_across_restart, 1);
    assert_eq!(v.channels_checked, 23);
}

#[test]
fn a_cut_of_the_wrong_channels_or_nodes_is_caught() {
    let mut h = good();
    snapshot_mut(&mut h, 3).channels.pop();
    caught(&h, "snapshot 3: its channels");
    let mut h = good();
    let s = snapshot_mut(&mut h, 4);
    let twice = s.nodes[1].clone();
    s.nodes.push(twice);
    caught(&h, "snapshot 4 holds node b twice");
    let mut h = good();
    snapshot_mut(&mut h, 5).nodes[1].channels[0].from = "c".into();
    caught(&h, "snapshot 5: node b recorded messages of channel c->b");
}

#[test]
fn the_rest_of_an_old_line_then_the_new_one_is_checked_in_order() {
    // a started afresh (line 33) after sending 6 of line 11; b has received 5 of them:
    // 6 of line 11 is still in the channel, then a's new line's 1 and 2.
    let mut h = good();
    let s = snapshot_mut(&mut h, 7);
    s.nodes[0].state = r#"{"balance":98,"line":33,"sent":{"b":2}}"#.into();
    s.nodes[1].state = r#"{"balance":105,"line":22,"received":{"a":{"line":11,"id":5}}}"#.into();
    let transfers = |ids: &[(u64, u64)]| -> Vec<String> {
        ids.iter()
            .map(|(line, id)| format!(r#"{{"amount":1,"line":{line},"id":{id}}}"#))
            .collect()
    };
    s.nodes[1].channels[0].messages = transfers(&[(11, 6), (33, 1), (33, 2)]);
    let v = check(&h, 30.0);
    assert!(v.violations.is_empty(), "{:#?}", v.violations);
    assert_eq!(
        v.money_checked, 11,
        "a fresh line's snapshot has no money count"
    );
    // A gap in the old line's rest, or in the new line, is caught.
    let mut h2 = h.clone();
    snapshot_mut(&mut h2, 7).nodes[1].channels[0].messages =
        transfers(&[(11, 7), (33, 1), (33, 2)]);
    caught(
        &h2,
        "the rest of a's line 11: transfer 7 of line 11 where 6 of line 11 was due",
    );
    let mut h3 = h.clone();
    snapshot_mut(&mut h3, 7).nodes[1].channels[0].messages = transfers(&[(11, 6), (33, 2)]);
    caught(&h3, "transfers [1] are in neither state nor channel");
    // An old line's transfer after the new line's is out of order.
    let mut h4 = h;
    snapshot_mut(&mut h4, 7).nodes[1].channels[0].messages =
        transfers(&[(33, 1), (33, 2), (11, 6)]);
    caught(
        &h4,
        "transfer 6 of line 11 follows transfers of a's line 33",
    );
}

#[test]
fn a_receiver_following_a_line_the_sender_left_for_its_original_is_caught() {
    let mut h = good();
    snapshot_mut(&mut h, 9).nodes[1].state =
        r#"{"balance":108,"line":22,"received":{"a":{"line":33,"id":8}}}"#.into();
    caught(
        &h,
        "b follows line 33 of a, but a is of the line it started with",
    );
}

/// Replaces the ledger reading's islands and prepared transactions.
fn ledger(h: &mut [Entry], with: Vec<LedgerIsland>, left: Vec<&str>) {
    for e in h.iter_mut() {
        if let Entry::Ledger {
            islands, prepared, ..
        } = e
        {
            *islands = with.clone();
            *prepared = left.iter().map(|s| (*s).to_owned()).collect();
        }
    }
}

#[test]
fn a_ledger_that_lost_wrote_twice_or_kept_a_discarded_transfer_is_caught() {
    // One lost between a pre-commit and its commit: a gap.
    let mut h = good();
    ledger(
        &mut h,
        vec![island("a", "b", 11, 1, 5), island("a", "b", 11, 7, 11)],
        vec![],
    );
    caught(&h, "the ledger lacks transfers of a's line 11 to b");
    caught(&h, "the ledger holds transfers 7..=11 of a's line 11 to b");
    // One of a history a restore discarded (or written again after it): past the last.
    let mut h = good();
    ledger(&mut h, vec![island("a", "b", 11, 1, 12)], vec![]);
    caught(&h, "the ledger holds transfers 1..=12 of a's line 11 to b");
    // Another line's, and one left prepared.
    let mut h = good();
    ledger(
        &mut h,
        vec![island("a", "b", 11, 1, 11), island("a", "b", 99, 1, 3)],
        vec!["cairn-c-b-9"],
    );
    caught(&h, "of a's line 99 to b");
    caught(
        &h,
        "ledger transactions are still prepared: [\"cairn-c-b-9\"]",
    );
    // A run without a ledger: not checked, and said so.
    let h: Vec<Entry> = good()
        .into_iter()
        .filter(|e| !matches!(e, Entry::Ledger { .. }))
        .collect();
    let v = check(&h, 30.0);
    assert!(v.violations.is_empty(), "{:#?}", v.violations);
    assert!(v.ledger_unchecked.is_some());
}
