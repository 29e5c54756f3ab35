//! The engine driven synchronously: each test feeds inputs and compares the actions queued.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::*;
use crate::control::{NodeCommand, NodeReport, Registration, StateTimes};
use crate::lifecycle::{Outcomes, SnapshotOutcome};
use crate::record::{EventKind, RemovedRecord, RestoreRecord, RestoreStatus, SnapshotStatus};
use crate::report::{IncomingCut, LocalReport, OutgoingCut};
use crate::schedule::{PolicyChange, PolicySource};
use crate::tracker::{StartError, StartRequest};
use crate::types::{ChannelId, SnapshotMode};
use crate::verifier::NodePart;

/// The store's error in these tests.
type E = String;

const T0: u64 = 1_000;
const TIMEOUT: Duration = Duration::from_secs(30);

const RESTORE_TIMEOUT: Duration = Duration::from_secs(60);

fn config(max_in_flight: usize) -> Config {
    Config {
        cluster: "test".into(),
        max_in_flight,
        restore_timeout: RESTORE_TIMEOUT,
        remove_after: None,
        auto_restore: false,
        retention: 0,
        policy: crate::schedule::Policy::default(),
        seed: 1,
        term: 7,
        topology: None,
    }
}

/// `ms` on both clocks.
fn at(ms: u64) -> Now {
    Now {
        wall_ms: ms,
        mono_ms: ms,
    }
}

fn registration(node: &str, incarnation: u64) -> Registration {
    Registration {
        cluster: "test".into(),
        node: node.into(),
        address: format!("{node}:7100"),
        incarnation,
        ..Registration::default()
    }
}

/// Registers `node` (its records stored) and returns the actions that followed.
fn register(
    engine: &mut CoordinatorEngine<E>,
    token: Token,
    registration: Registration,
) -> Vec<Action<E>> {
    engine.handle(
        at(T0),
        Input::Register {
            token,
            registration,
            session: token,
        },
    );
    match engine.drain_actions().as_slice() {
        [
            Action::Persist {
                what: Persist::Register(got),
                write: Write::Batch(_),
                ..
            },
        ] if *got == token => {}
        other => panic!("expected the registration's records stored first, got {other:?}"),
    }
    let what = Persist::Register(token);
    engine.handle(
        at(T0),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    engine.drain_actions()
}

/// An engine with members a and b.
fn engine_of(max_in_flight: usize) -> CoordinatorEngine<E> {
    let mut engine = CoordinatorEngine::new(config(max_in_flight));
    register(&mut engine, 100, registration("a", 1));
    register(&mut engine, 101, registration("b", 1));
    engine
}

fn engine() -> CoordinatorEngine<E> {
    engine_of(4)
}

fn start_input(token: Token) -> Input<E> {
    Input::Start {
        token,
        start: StartInput {
            request: StartRequest {
                mode: SnapshotMode::ChandyLamport,
                initiators: BTreeSet::from([NodeId::new("a")]),
                alignment_timeout: None,
            },
            timeout: TIMEOUT,
            labels: BTreeMap::from([("why".to_owned(), "test".to_owned())]),
            term: 7,
            request_id: String::new(),
        },
    }
}

/// An empty cut of `node` (no messages on either channel): with the other's, consistent.
fn part(id: u64, node: &str) -> Input<E> {
    let other = if node == "a" { "b" } else { "a" };
    let report = LocalReport {
        id: SnapshotId(id),
        node: NodeId::new(node),
        incoming: BTreeMap::from([(
            ChannelId::new(other, node),
            IncomingCut {
                delivered: 0,
                marker_at: 0,
            },
        )]),
        outgoing: BTreeMap::from([(
            ChannelId::new(node, other),
            OutgoingCut {
                sent: 0,
                marker_at: 0,
            },
        )]),
    };
    Input::PartStored {
        part: NodePart {
            report,
            recorded: BTreeMap::new(),
        },
        sizes: PartSizes {
            bytes_new: 10,
            ..PartSizes::default()
        },
        epoch: 0,
        applied_restore_id: String::new(),
    }
}

/// Starts snapshot `id` (the counter hands out `id`) and checks every step of its start.
fn started(engine: &mut CoordinatorEngine<E>, id: u64) -> SnapshotRecord {
    engine.handle(at(T0), start_input(1));
    assert_eq!(engine.drain_actions(), [Action::TakeId]);
    engine.handle(
        at(T0),
        Input::IdTaken {
            result: Ok(SnapshotId(id)),
        },
    );
    let record = match engine.drain_actions().as_slice() {
        [
            Action::Persist {
                what: Persist::Snapshot(SnapshotWrite::Started(got)),
                write: Write::Snapshot(record),
                attempt: 1,
            },
        ] if *got == SnapshotId(id) => (**record).clone(),
        other => panic!("expected the start's record to be stored first, got {other:?}"),
    };
    assert_eq!(record.status, SnapshotStatus::InProgress);
    assert_eq!(
        (record.epoch, record.term, record.started_at_ms),
        (0, 7, T0)
    );
    assert_eq!(record.nodes, ["a", "b"]);
    assert_eq!(record.channels, ["a->b", "b->a"]);
    // Nobody hears of it before the store answers.
    assert!(engine.live_record(SnapshotId(id)).is_none());
    engine.handle(
        at(T0),
        Input::Persisted {
            what: Persist::Snapshot(SnapshotWrite::Started(SnapshotId(id))),
            result: Ok(()),
        },
    );
    let actions = engine.drain_actions();
    let plan = match actions.as_slice() {
        [
            Action::Send {
                node,
                command: NodeCommand::Initiate(plan),
            },
            ..,
        ] if node.as_str() == "a" => plan.clone(),
        other => panic!("expected the initiator told first, got {other:?}"),
    };
    assert_eq!((plan.id, plan.started_at_ms), (SnapshotId(id), T0));
    assert_eq!(
        actions[1..],
        [
            Action::SetTimer {
                timer: Timer::Snapshot(SnapshotId(id)),
                after: TIMEOUT,
            },
            Action::Started { plan },
            Action::Reply {
                token: 1,
                answer: Answer::Started(Ok(SnapshotId(id))),
            },
        ]
    );
    assert!(engine.live_record(SnapshotId(id)).is_some());
    record
}

/// The record of the end the engine asks to store, checked to be the only action.
fn end_to_store(actions: Vec<Action<E>>, id: u64, attempt: u64) -> SnapshotRecord {
    match actions.as_slice() {
        [
            Action::Persist {
                what: Persist::Snapshot(SnapshotWrite::End(got)),
                write: Write::Snapshot(record),
                attempt: n,
            },
        ] if *got == SnapshotId(id) && *n == attempt => (**record).clone(),
        other => panic!("expected the end stored (attempt {attempt}), got {other:?}"),
    }
}

#[test]
fn a_snapshot_completes_stored_before_told() {
    let mut engine = engine();
    started(&mut engine, 1);
    engine.handle(at(T0 + 1), part(1, "a"));
    let actions = engine.drain_actions();
    assert!(
        matches!(&actions[..], [Action::Step { event, .. }, Action::Progress { id }]
            if event.kind == EventKind::PartStored && event.bytes_new == 10 && *id == SnapshotId(1)),
        "{actions:?}"
    );
    let live = engine.live_record(SnapshotId(1)).unwrap();
    assert_eq!(
        (live.reported.as_slice(), live.bytes_new),
        (&["a".to_owned()][..], 10)
    );

    engine.handle(at(T0 + 2), part(1, "b"));
    let actions = engine.drain_actions();
    assert!(matches!(&actions[0], Action::Step { .. }), "{actions:?}");
    let end = end_to_store(actions[1..].to_vec(), 1, 1);
    assert_eq!(end.status, SnapshotStatus::Completed);
    assert_eq!(end.finished_at_ms, T0 + 2);
    assert_eq!(end.bytes_new, 20);
    assert!(end.verdict.as_ref().is_some_and(|v| v.consistent));
    let kinds: Vec<EventKind> = end.events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            EventKind::Started,
            EventKind::PartStored,
            EventKind::PartStored,
            EventKind::Verified,
            EventKind::Ended
        ]
    );
    // Ended, but open for the store until it acknowledges the end.
    assert_eq!(engine.in_flight(), 0);
    assert!(engine.is_open(SnapshotId(1)));

    // The store refuses: nobody is told; the next tick tries again.
    engine.handle(
        at(T0 + 3),
        Input::Persisted {
            what: Persist::Snapshot(SnapshotWrite::End(SnapshotId(1))),
            result: Err("etcd: no leader".into()),
        },
    );
    assert_eq!(engine.drain_actions(), []);
    assert_eq!(engine.unstored(), 1);
    engine.handle(at(T0 + 250), Input::Tick);
    assert_eq!(end_to_store(engine.drain_actions(), 1, 2), end);
    engine.handle(
        at(T0 + 251),
        Input::Persisted {
            what: Persist::Snapshot(SnapshotWrite::End(SnapshotId(1))),
            result: Ok(()),
        },
    );
    // A completed snapshot: no node drops anything; the applications hear it (stored
    // before told), and the runtime.
    assert_eq!(
        engine.drain_actions(),
        [
            told(1, None, 0),
            Action::Ended {
                record: Box::new(end)
            }
        ]
    );
    assert!(!engine.is_open(SnapshotId(1)));
    engine.handle(at(T0 + 500), Input::Tick);
    assert_eq!(engine.drain_actions(), []);
}

#[test]
fn ids_stay_above_what_daemons_saw() {
    let mut engine = engine();
    for (token, highest) in [(102, 41), (103, 9)] {
        let seen = Registration {
            highest_snapshot_id: highest,
            ..registration("a", 1)
        };
        register(&mut engine, token, seen);
    }
    assert_eq!(engine.id_floor(), 41);
    engine.handle(at(T0), start_input(1));
    assert_eq!(engine.drain_actions(), [Action::TakeId]);
    // The counter (lost with the metadata?) hands out 5: the counter is set above 41.
    engine.handle(
        at(T0),
        Input::IdTaken {
            result: Ok(SnapshotId(5)),
        },
    );
    assert_eq!(
        engine.drain_actions(),
        [Action::SetIdCounter {
            id: SnapshotId(42),
            floor: 41
        }]
    );
    engine.handle(
        at(T0),
        Input::IdTaken {
            result: Ok(SnapshotId(42)),
        },
    );
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Persist {
            what: Persist::Snapshot(SnapshotWrite::Started(SnapshotId(42))),
            ..
        }]
    ));
}

#[test]
fn a_start_whose_record_is_not_stored_is_told_to_nobody_and_frees_its_place() {
    let mut engine = engine_of(1);
    engine.handle(at(T0), start_input(1));
    engine.handle(
        at(T0),
        Input::IdTaken {
            result: Ok(SnapshotId(1)),
        },
    );
    engine.drain_actions();
    engine.handle(
        at(T0),
        Input::Persisted {
            what: Persist::Snapshot(SnapshotWrite::Started(SnapshotId(1))),
            result: Err("answer lost".into()),
        },
    );
    assert_eq!(
        engine.drain_actions(),
        [Action::Reply {
            token: 1,
            answer: Answer::Started(Err(Refusal::Store("answer lost".into()))),
        }]
    );
    assert_eq!(engine.in_flight(), 0);
    // Its place (of one) is free again.
    started(&mut engine, 2);
}

#[test]
fn a_refused_start_spends_no_id() {
    let mut engine = engine();
    let mut input = start_input(9);
    if let Input::Start { start, .. } = &mut input {
        start.request.initiators = BTreeSet::from([NodeId::new("z")]);
    }
    engine.handle(at(T0), input);
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Reply {
            token: 9,
            answer: Answer::Started(Err(Refusal::Start(StartError::UnknownInitiator(_))))
        }]
    ));
}

#[test]
fn an_abort_is_answered_with_the_stored_end_and_dropped_everywhere() {
    let mut engine = engine();
    started(&mut engine, 1);
    engine.handle(
        at(T0 + 5),
        Input::Abort {
            token: 2,
            id: SnapshotId(1),
            reason: String::new(),
        },
    );
    let end = end_to_store(engine.drain_actions(), 1, 1);
    assert_eq!(end.status, SnapshotStatus::Aborted);
    let failure = end.failure.clone().unwrap();
    assert_eq!(
        (failure.kind.as_str(), failure.message.as_str()),
        ("ABORTED", "aborted: aborted by a user")
    );
    engine.handle(
        at(T0 + 6),
        Input::Persisted {
            what: Persist::Snapshot(SnapshotWrite::End(SnapshotId(1))),
            result: Ok(()),
        },
    );
    let reason = FailureReason::Aborted("aborted by a user".into());
    assert_eq!(
        engine.drain_actions(),
        [
            Action::Broadcast {
                command: NodeCommand::Abort {
                    snapshot: SnapshotId(1),
                    reason: reason.to_string(),
                },
                except: None,
            },
            Action::Reply {
                token: 2,
                answer: Answer::Aborted(Ok(Box::new(end.clone()))),
            },
            told(1, Some("aborted: aborted by a user"), 0),
            Action::Ended {
                record: Box::new(end)
            },
        ]
    );
    // A second abort: the runtime asks the store whether it ended or never was.
    engine.handle(
        at(T0 + 7),
        Input::Abort {
            token: 3,
            id: SnapshotId(1),
            reason: String::new(),
        },
    );
    assert_eq!(
        engine.drain_actions(),
        [Action::Reply {
            token: 3,
            answer: Answer::Aborted(Err(Refusal::NotInFlight(SnapshotId(1)))),
        }]
    );
}

#[test]
fn an_abort_whose_end_is_not_stored_is_not_reported_done() {
    let mut engine = engine();
    started(&mut engine, 1);
    let abort = |token| Input::Abort {
        token,
        id: SnapshotId(1),
        reason: "operator".into(),
    };
    engine.handle(at(T0), abort(2));
    engine.drain_actions();
    engine.handle(
        at(T0),
        Input::Persisted {
            what: Persist::Snapshot(SnapshotWrite::End(SnapshotId(1))),
            result: Err("timed out".into()),
        },
    );
    assert_eq!(
        engine.drain_actions(),
        [Action::Reply {
            token: 2,
            answer: Answer::Aborted(Err(Refusal::AbortNotStored(SnapshotId(1)))),
        }]
    );
    // Its end is decided: a second abort cannot change it.
    engine.handle(at(T0), abort(3));
    assert_eq!(
        engine.drain_actions(),
        [Action::Reply {
            token: 3,
            answer: Answer::Aborted(Err(Refusal::EndNotStored(SnapshotId(1)))),
        }]
    );
}

#[test]
fn a_part_of_another_epoch_fails_the_snapshot_naming_the_node() {
    let mut engine = engine();
    started(&mut engine, 1);
    let mut input = part(1, "b");
    if let Input::PartStored {
        epoch,
        applied_restore_id,
        ..
    } = &mut input
    {
        *epoch = 4;
        *applied_restore_id = "restore-4".into();
    }
    engine.handle(at(T0 + 1), input);
    let end = end_to_store(engine.drain_actions(), 1, 1);
    let failure = end.failure.unwrap();
    assert_eq!(
        (failure.kind.as_str(), failure.nodes.as_slice()),
        ("MIXED_EPOCHS", &["b".to_owned()][..])
    );
    assert_eq!(
        failure.detail.as_deref(),
        Some(
            "snapshot 1 started in epoch 0, node b recorded its part in epoch 4 (after restore-4)"
        )
    );
}

/// Starts snapshot `id` in `mode`, its steps unchecked (see [`started`]).
fn started_in(engine: &mut CoordinatorEngine<E>, id: u64, mode: SnapshotMode) {
    let mut input = start_input(1);
    if let Input::Start { start, .. } = &mut input {
        start.request.mode = mode;
    }
    engine.handle(at(T0), input);
    engine.handle(
        at(T0),
        Input::IdTaken {
            result: Ok(SnapshotId(id)),
        },
    );
    engine.handle(
        at(T0),
        Input::Persisted {
            what: Persist::Snapshot(SnapshotWrite::Started(SnapshotId(id))),
            result: Ok(()),
        },
    );
    engine.drain_actions();
    assert!(engine.live_record(SnapshotId(id)).is_some());
}

#[test]
fn a_nodes_state_report_says_its_start_delay_and_in_aligned_mode_its_alignment() {
    let recorded = |node: &str, recording_for_ms| Input::Report {
        node: NodeId::new(node),
        id: SnapshotId(1),
        report: NodeReport::StateRecorded(StateTimes {
            recording_for_ms,
            aligned_ms: Some(20),
            held_messages: Some(4),
        }),
    };
    let event = |engine: &CoordinatorEngine<E>, node: &str| {
        engine
            .live_record(SnapshotId(1))
            .unwrap()
            .events
            .iter()
            .find(|e| e.kind == EventKind::StateRecorded && e.node == node)
            .cloned()
            .unwrap()
    };
    for mode in [SnapshotMode::ChandyLamport, SnapshotMode::Aligned] {
        let mut engine = engine();
        started_in(&mut engine, 1, mode);
        // Reported 100 ms after the start, 30 ms after the node first met the snapshot:
        // its marker took 70 ms to come (by each side's own clock).
        engine.handle(at(T0 + 100), recorded("a", Some(30)));
        let actions = engine.drain_actions();
        assert!(
            matches!(&actions[0], Action::Step { event, .. } if event.start_delay_ms == Some(70)),
            "{actions:?}"
        );
        let a = event(&engine, "a");
        let aligned = mode == SnapshotMode::Aligned;
        assert_eq!(a.start_delay_ms, Some(70));
        assert_eq!(a.alignment_ms, aligned.then_some(20), "{mode:?}");
        assert_eq!(a.held_messages, aligned.then_some(4), "{mode:?}");
        // A node's time longer than the coordinator's (clocks differ) is no negative delay;
        // a daemon that says nothing leaves it unknown.
        engine.handle(at(T0 + 10), recorded("b", Some(50)));
        assert_eq!(event(&engine, "b").start_delay_ms, Some(0));
        let mut engine = engine_of(4);
        started_in(&mut engine, 1, mode);
        engine.handle(at(T0 + 10), recorded("a", None));
        assert_eq!(event(&engine, "a").start_delay_ms, None);
    }
}

#[test]
fn a_node_failure_is_one_step_and_a_lost_node_fails_what_it_takes_part_in() {
    let mut engine = engine();
    started(&mut engine, 1);
    let failed = |node: &str| Input::Report {
        node: NodeId::new(node),
        id: SnapshotId(1),
        report: NodeReport::Failed(FailureReason::NoApplication(NodeId::new(node))),
    };
    engine.handle(at(T0 + 1), failed("b"));
    let actions = engine.drain_actions();
    assert!(
        matches!(&actions[0], Action::Step { event, .. }
            if event.kind == EventKind::NodeFailed && event.node == "b"
                && event.detail == "node b has no application attached"),
        "{actions:?}"
    );
    let end = end_to_store(actions[1..].to_vec(), 1, 1);
    assert_eq!(end.status, SnapshotStatus::Failed);
    // Reports after its end change nothing.
    engine.handle(at(T0 + 2), failed("a"));
    assert_eq!(engine.drain_actions(), []);

    started(&mut engine, 2);
    let gone = Input::SessionEnded {
        node: NodeId::new("b"),
        session: 101,
    };
    engine.handle(at(T0 + 3), gone);
    let actions = engine.drain_actions();
    assert!(
        matches!(&actions[..4], [
            Action::Note(Note::Gone { .. }),
            Action::Dismiss { node },
            Action::Broadcast { command: NodeCommand::Membership(m), except: None },
            Action::Persist { what: Persist::DeleteMember(_), .. },
        ] if node.as_str() == "b" && m.nodes.iter().any(|n| n.node.as_str() == "b" && !n.connected)),
        "{actions:?}"
    );
    let end = end_to_store(actions[4..].to_vec(), 2, 1);
    assert_eq!(end.failure.unwrap().kind, "NODE_LOST");
    // An older session of the node changes nothing; nor does a start without it.
    let older = Input::SessionEnded {
        node: NodeId::new("a"),
        session: 1,
    };
    engine.handle(at(T0 + 3), older);
    assert_eq!(engine.drain_actions(), []);
    engine.handle(at(T0 + 4), start_input(5));
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Reply { token: 5, answer: Answer::Started(Err(Refusal::NodesNotConnected(why))) }]
            if why.contains(": b")
    ));
}

#[test]
fn uploads_are_checked_against_the_snapshots_in_flight() {
    let mut engine = engine();
    assert_eq!(
        engine.check_upload(SnapshotId(1), &NodeId::new("a")),
        Err(Refusal::NotInFlight(SnapshotId(1)))
    );
    started(&mut engine, 1);
    assert_eq!(
        engine.check_upload(SnapshotId(1), &NodeId::new("a")),
        Ok(())
    );
    assert_eq!(
        engine.check_upload(SnapshotId(1), &NodeId::new("z")),
        Err(Refusal::NotAParticipant(SnapshotId(1), NodeId::new("z")))
    );
}

#[test]
fn every_snapshot_in_flight_fails_at_once() {
    let mut engine = engine();
    started(&mut engine, 1);
    started(&mut engine, 2);
    engine.handle(
        at(T0 + 9),
        Input::FailAll {
            reason: FailureReason::Restore,
        },
    );
    let actions = engine.drain_actions();
    assert_eq!(actions.len(), 2, "{actions:?}");
    for (action, id) in actions.into_iter().zip([1, 2]) {
        let end = end_to_store(vec![action], id, 1);
        assert_eq!(end.failure.unwrap().kind, "RESTORE");
    }
    assert_eq!(engine.in_flight(), 0);
}

fn restore_record(epoch: u64) -> RestoreRecord {
    RestoreRecord {
        id: format!("restore-{epoch}"),
        snapshot_id: 1,
        epoch,
        nodes: vec!["a".into(), "b".into()],
        applied: Vec::new(),
        status: RestoreStatus::InProgress,
        failure: None,
        requested_by: "user".into(),
        started_at_ms: T0,
        finished_at_ms: 0,
        skipped: Vec::new(),
    }
}

/// The restore record the engine asks to store, checked to be the only action.
fn restore_to_store(actions: Vec<Action<E>>, attempt: u64) -> RestoreRecord {
    match actions.as_slice() {
        [
            Action::Persist {
                what: Persist::Restore(..),
                write: Write::Restore(record),
                attempt: n,
            },
        ] if *n == attempt => record.clone(),
        other => panic!("expected the restore stored (attempt {attempt}), got {other:?}"),
    }
}

fn restore_stored(engine: &mut CoordinatorEngine<E>, epoch: u64, result: Result<(), E>) {
    // The status written: the record's as it stands (each test acknowledges a write before
    // the next input, as the runtime does).
    let written = engine
        .active_restore()
        .map_or(RestoreStatus::InProgress, |r| r.status);
    let what = Persist::Restore(epoch, written);
    engine.handle(at(T0), Input::Persisted { what, result });
}

/// A completed snapshot 1 over a and b, as the store holds it.
fn completed_snapshot() -> SnapshotRecord {
    let mut engine = engine();
    started(&mut engine, 1);
    engine.handle(at(T0 + 1), part(1, "a"));
    engine.handle(at(T0 + 2), part(1, "b"));
    let actions = engine.drain_actions();
    let end = end_to_store(actions[actions.len() - 1..].to_vec(), 1, 1);
    assert_eq!(end.status, SnapshotStatus::Completed);
    end
}

/// Asks to restore snapshot 1 (token 8), its chunks verified and epoch 5 allocated; returns
/// the actions that followed the allocation.
fn restore_to_epoch_5(engine: &mut CoordinatorEngine<E>) -> Vec<Action<E>> {
    let snapshot = completed_snapshot();
    let input = Input::Restore {
        token: 8,
        snapshot: SnapshotId(1),
        record: Some(snapshot.clone()),
        if_epoch: None,
    };
    engine.handle(at(T0), input);
    assert_eq!(
        engine.drain_actions(),
        [Action::Verify {
            candidates: vec![snapshot.clone()]
        }]
    );
    let verified = Input::Verified {
        chosen: Some(SnapshotId(1)),
        record: Some(snapshot),
        skipped: Vec::new(),
    };
    engine.handle(at(T0), verified);
    assert_eq!(engine.drain_actions(), [Action::AllocateEpoch]);
    engine.handle(at(T0), Input::EpochAllocated { result: Ok(5) });
    engine.drain_actions()
}

/// Starts the restore of epoch 5 over a and b, checking that the nodes hear of it only once
/// its record is stored.
fn restore_started(engine: &mut CoordinatorEngine<E>) {
    let record = restore_record(5);
    assert_eq!(restore_to_store(restore_to_epoch_5(engine), 1), record);
    assert_eq!(
        engine.epoch(),
        0,
        "the epoch is entered once the record is stored"
    );
    restore_stored(engine, 5, Ok(()));
    let command = NodeCommand::Restore(crate::control::NodeRestore {
        restore_id: "restore-5".into(),
        snapshot: SnapshotId(1),
        epoch: 5,
    });
    assert_eq!(
        engine.drain_actions(),
        [
            Action::Send {
                node: NodeId::new("a"),
                command: command.clone(),
            },
            Action::Send {
                node: NodeId::new("b"),
                command,
            },
            Action::SetTimer {
                timer: Timer::Restore(5),
                after: RESTORE_TIMEOUT,
            },
            Action::Note(Note::RestoreStarted {
                restore_id: "restore-5".into(),
                snapshot: SnapshotId(1),
                epoch: 5,
                requested_by: "user".into(),
            }),
            Action::Reply {
                token: 8,
                answer: Answer::RestoreStarted(Ok(Box::new(record))),
            },
        ]
    );
    assert_eq!(engine.epoch(), 5);
}

#[test]
fn a_conditional_restore_goes_through_only_in_the_epoch_it_names() {
    let mut engine = engine();
    let snapshot = completed_snapshot();
    let ask = |token, if_epoch| Input::Restore {
        token,
        snapshot: SnapshotId(1),
        record: Some(snapshot.clone()),
        if_epoch,
    };
    engine.handle(at(T0), ask(3, Some(4)));
    assert_eq!(
        engine.drain_actions(),
        [Action::Reply {
            token: 3,
            answer: Answer::RestoreStarted(Err(Refusal::EpochMoved {
                expected: 4,
                current: 0
            })),
        }],
        "another epoch than the cluster's: refused before anything is verified"
    );
    engine.handle(at(T0), ask(8, Some(0)));
    assert_eq!(
        engine.drain_actions(),
        [Action::Verify {
            candidates: vec![snapshot.clone()]
        }]
    );
    // Chosen and fenced as any restore: the cluster enters epoch 5.
    let verified = Input::Verified {
        chosen: Some(SnapshotId(1)),
        record: Some(snapshot.clone()),
        skipped: Vec::new(),
    };
    engine.handle(at(T0), verified);
    engine.drain_actions();
    engine.handle(at(T0), Input::EpochAllocated { result: Ok(5) });
    engine.drain_actions();
    restore_stored(&mut engine, 5, Ok(()));
    engine.drain_actions();
    assert_eq!(engine.epoch(), 5);
    for node in ["a", "b"] {
        let applied = Input::RestoreApplied {
            node: NodeId::new(node),
            restore_id: "restore-5".into(),
        };
        engine.handle(at(T0 + 1), applied);
        engine.drain_actions();
    }
    restore_stored(&mut engine, 5, Ok(()));
    engine.drain_actions();
    assert!(engine.active_restore().is_none(), "the restore ended");
    // A reader that chose before that restore is refused; one that saw it goes through.
    engine.handle(at(T0 + 2), ask(9, Some(0)));
    assert_eq!(
        engine.drain_actions(),
        [Action::Reply {
            token: 9,
            answer: Answer::RestoreStarted(Err(Refusal::EpochMoved {
                expected: 0,
                current: 5
            })),
        }]
    );
    engine.handle(at(T0 + 2), ask(10, Some(5)));
    assert!(matches!(
        engine.drain_actions()[..],
        [Action::Verify { .. }]
    ));
}

#[test]
fn a_restore_fails_the_snapshots_in_flight_before_its_record_is_stored() {
    let mut engine = engine();
    started(&mut engine, 2);
    let actions = restore_to_epoch_5(&mut engine);
    let end = end_to_store(actions[..1].to_vec(), 2, 1);
    assert_eq!(end.failure.unwrap().kind, "RESTORE");
    assert_eq!(
        restore_to_store(actions[1..].to_vec(), 1),
        restore_record(5)
    );
}

#[test]
fn a_restore_whose_record_is_not_stored_tells_no_node_and_keeps_the_epoch() {
    let mut engine = engine();
    restore_to_epoch_5(&mut engine);
    restore_stored(&mut engine, 5, Err("no leader".into()));
    assert_eq!(
        engine.drain_actions(),
        [Action::Reply {
            token: 8,
            answer: Answer::RestoreStarted(Err(Refusal::RestoreNotStored {
                restore: "restore-5".into(),
                snapshot: SnapshotId(1),
                cause: "no leader".into()
            })),
        }]
    );
    assert_eq!(engine.epoch(), 0);
    assert!(engine.active_restore().is_none());
}

#[test]
fn a_restore_ends_done_once_every_node_applied_and_the_end_is_stored() {
    let mut engine = engine();
    restore_started(&mut engine);
    let applied = |node: &str| Input::RestoreApplied {
        node: NodeId::new(node),
        restore_id: "restore-5".into(),
    };
    engine.handle(at(T0 + 1), applied("a"));
    let progress = restore_to_store(engine.drain_actions(), 1);
    assert_eq!(engine.members()[&NodeId::new("a")].epoch, 5);
    assert_eq!(engine.members()[&NodeId::new("b")].epoch, 0);
    assert_eq!(
        (progress.applied, progress.status),
        (vec!["a".to_owned()], RestoreStatus::InProgress)
    );
    restore_stored(&mut engine, 5, Ok(()));
    assert_eq!(engine.drain_actions(), []);

    engine.handle(at(T0 + 2), applied("b"));
    let done = restore_to_store(engine.drain_actions(), 1);
    assert_eq!(
        (done.status, done.finished_at_ms),
        (RestoreStatus::Done, T0 + 2)
    );
    // Not stored: still the restore under way (snapshots stay fenced), stored again at the
    // next tick, and told only then.
    restore_stored(&mut engine, 5, Err("disk full".into()));
    assert_eq!(engine.drain_actions(), []);
    assert!(engine.active_restore().is_some());
    engine.handle(at(T0 + 250), Input::Tick);
    assert_eq!(restore_to_store(engine.drain_actions(), 2), done);
    restore_stored(&mut engine, 5, Ok(()));
    assert_eq!(
        engine.drain_actions(),
        [Action::RestoreEnded { record: done }]
    );
    assert!(engine.active_restore().is_none() && engine.unfinished_restore().is_none());
    assert_eq!(engine.fence(), None, "every member is in epoch 5");
}

#[test]
fn a_failed_restore_keeps_the_cluster_fenced_and_names_the_node() {
    let mut engine = engine();
    restore_started(&mut engine);
    engine.handle(
        at(T0 + 1),
        Input::RestoreFailed {
            node: NodeId::new("b"),
            restore_id: "restore-5".into(),
            why: "no space left".into(),
        },
    );
    let failed = restore_to_store(engine.drain_actions(), 1);
    assert_eq!(failed.status, RestoreStatus::Failed);
    assert_eq!(failed.failure.as_deref(), Some("node b: no space left"));
    restore_stored(&mut engine, 5, Ok(()));
    assert_eq!(
        engine.drain_actions(),
        [Action::RestoreEnded {
            record: failed.clone()
        }]
    );
    assert_eq!(engine.unfinished_restore(), Some(&failed));
    assert_eq!(engine.restore_holding(SnapshotId(1)), Some(&failed));
    // Its epoch is not the cluster's to enter: a late application changes nothing.
    engine.handle(
        at(T0 + 2),
        Input::RestoreApplied {
            node: NodeId::new("a"),
            restore_id: "restore-5".into(),
        },
    );
    assert_eq!(engine.drain_actions(), []);
}

#[test]
fn a_resumed_restore_gets_a_new_deadline_and_fails_when_it_passes() {
    let mut engine = engine();
    let mut record = restore_record(5);
    record.applied = vec!["a".into()];
    engine.handle(
        at(T0),
        Input::RestoresLoaded {
            epoch: 5,
            active: Some(record),
            unfinished: None,
            restored: Some(SnapshotId(3)),
        },
    );
    assert_eq!(
        engine.drain_actions(),
        [Action::SetTimer {
            timer: Timer::Restore(5),
            after: RESTORE_TIMEOUT,
        }]
    );
    // Another restore's deadline changes nothing.
    engine.handle(at(T0 + 1), Input::RestoreTimedOut { epoch: 4 });
    assert_eq!(engine.drain_actions(), []);
    engine.handle(at(T0 + 2), Input::RestoreTimedOut { epoch: 5 });
    let failed = restore_to_store(engine.drain_actions(), 1);
    assert_eq!(failed.status, RestoreStatus::Failed);
    assert!(failed.failure.unwrap().contains('b'));
}

#[test]
fn a_node_restarted_after_applying_fails_the_restore() {
    let mut engine = engine();
    restore_started(&mut engine);
    engine.handle(
        at(T0),
        Input::RestoreApplied {
            node: NodeId::new("a"),
            restore_id: "restore-5".into(),
        },
    );
    engine.drain_actions();
    restore_stored(&mut engine, 5, Ok(()));
    // Its session ends: it had applied, so the restore goes on without it for now.
    let gone = Input::SessionEnded {
        node: NodeId::new("a"),
        session: 100,
    };
    engine.handle(at(T0 + 1), gone);
    let actions = engine.drain_actions();
    assert!(
        !actions.iter().any(|a| matches!(
            a,
            Action::Persist {
                what: Persist::Restore(..),
                ..
            }
        )),
        "{actions:?}"
    );
    // A new process of it comes back, without the restored state.
    let actions = register(&mut engine, 102, registration("a", 2));
    assert!(actions.contains(&Action::Note(Note::Restarted {
        node: NodeId::new("a")
    })));
    let failed = actions
        .iter()
        .find_map(|a| match a {
            Action::Persist {
                write: Write::Restore(record),
                ..
            } => Some(record.clone()),
            _ => None,
        })
        .expect("the restore's end stored");
    assert_eq!(failed.status, RestoreStatus::Failed);
    assert!(
        failed
            .failure
            .unwrap()
            .contains("node a restarted after applying")
    );
    // The new process is not sent the restore that just failed (it would restore alone):
    // it enters the cluster's epoch as a new daemon does.
    assert!(
        !actions.iter().any(|a| matches!(
            a,
            Action::Send {
                command: NodeCommand::Restore(_),
                ..
            }
        )),
        "{actions:?}"
    );
    assert!(actions.iter().any(|a| matches!(a,
        Action::Send { node, command: NodeCommand::Registered(m) } if node.as_str() == "a" && m.epoch == 5)));
}

#[test]
fn a_registration_is_a_membership_only_once_its_records_are_stored() {
    let mut engine = CoordinatorEngine::<E>::new(config(4));
    engine.handle(
        at(T0),
        Input::Register {
            token: 1,
            registration: registration("a", 1),
            session: 1,
        },
    );
    let writes = match engine.drain_actions().as_slice() {
        [
            Action::Persist {
                write: Write::Batch(writes),
                ..
            },
        ] => writes.clone(),
        other => panic!("{other:?}"),
    };
    assert!(matches!(
        writes.as_slice(),
        [Write::Roster(r), Write::Member(m)] if r.node == "a" && m.incarnation == 1
    ));
    let what = Persist::Register(1);
    let result = Err("no leader".to_owned());
    engine.handle(at(T0), Input::Persisted { what, result });
    assert_eq!(
        engine.drain_actions(),
        [Action::Reply {
            token: 1,
            answer: Answer::Registered(Err(Refusal::Store("no leader".into()))),
        }]
    );
    assert!(engine.members().is_empty() && engine.roster_nodes().next().is_none());

    let actions = register(&mut engine, 2, registration("a", 1));
    let membership = engine.membership();
    assert_eq!(
        actions,
        [
            Action::Note(Note::Changed {
                node: NodeId::new("a"),
                change: "node a joined".into()
            }),
            Action::Note(Note::Registered {
                node: NodeId::new("a"),
                address: "a:7100".into(),
                epoch: 0
            }),
            Action::Admit {
                node: NodeId::new("a"),
                token: 2
            },
            Action::Send {
                node: NodeId::new("a"),
                command: NodeCommand::Registered(membership.clone()),
            },
            Action::Broadcast {
                command: NodeCommand::Membership(membership.clone()),
                except: Some(NodeId::new("a")),
            },
            Action::Reply {
                token: 2,
                answer: Answer::Registered(Ok(membership)),
            },
        ]
    );
}

#[test]
fn a_second_daemon_for_a_connected_id_is_refused_until_the_first_is_silent() {
    let mut engine = engine();
    let second = Input::Register {
        token: 7,
        registration: registration("a", 2),
        session: 7,
    };
    engine.handle(at(T0 + 1_000), second);
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Reply { token: 7, answer: Answer::Registered(Err(Refusal::NodeIdHeld(why))) }]
            if why.contains("heard from 1000 ms ago") && why.contains("--node-id a")
    ));
    // b keeps talking; a goes silent: taken as gone after MEMBER_SILENCE_MS.
    for ms in (250..MEMBER_SILENCE_MS).step_by(250) {
        let heartbeat = Input::Heartbeat {
            node: NodeId::new("b"),
            application_attached: true,
            channels: Vec::new(),
        };
        engine.handle(at(T0 + ms), heartbeat);
        engine.handle(at(T0 + ms), Input::Tick);
        assert_eq!(engine.drain_actions(), [], "at {ms} ms");
    }
    engine.handle(at(T0 + MEMBER_SILENCE_MS), Input::Tick);
    let actions = engine.drain_actions();
    assert!(
        matches!(&actions[0], Action::Note(Note::Gone { node, why })
            if node.as_str() == "a" && why == "no heartbeat for 6000 ms"),
        "{actions:?}"
    );
    assert_eq!(engine.members().len(), 1);
    // Now the new process may have the id; it restarted.
    let actions = register(&mut engine, 8, registration("a", 2));
    assert!(actions.contains(&Action::Note(Note::Restarted {
        node: NodeId::new("a")
    })));
}

#[test]
fn a_late_tick_judges_no_silence() {
    let mut engine = engine();
    engine.handle(at(T0 + 250), Input::Tick);
    engine.drain_actions();
    // The runtime was busy for 10 s: the heartbeats may be in its queue.
    engine.handle(at(T0 + 10_250), Input::Tick);
    assert_eq!(engine.drain_actions(), []);
    engine.handle(at(T0 + 10_500), Input::Tick);
    assert_eq!(engine.drain_actions().len(), 2 * 4, "both silent now");
}

#[test]
fn a_removed_node_is_named_in_memberships_and_only_a_new_process_may_return() {
    let mut engine = engine();
    let remove = |token| Input::RemoveNode {
        token,
        node: NodeId::new("b"),
    };
    engine.handle(at(T0), remove(1));
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Reply {
            token: 1,
            answer: Answer::Removed(Err(Refusal::StillConnected { .. }))
        }]
    ));
    let gone = Input::SessionEnded {
        node: NodeId::new("b"),
        session: 101,
    };
    engine.handle(at(T0), gone);
    engine.drain_actions();
    engine.handle(at(T0 + 1), remove(2));
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Persist { what: Persist::Removal(n), write: Write::Remove(r), .. }]
            if n.as_str() == "b" && r.incarnation == 1
    ));
    assert!(
        engine.membership().removed.is_empty(),
        "not before it is stored"
    );
    let what = Persist::Removal(NodeId::new("b"));
    engine.handle(
        at(T0 + 1),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    let actions = engine.drain_actions();
    let membership = engine.membership();
    assert_eq!(membership.removed, [NodeId::new("b")]);
    assert_eq!(membership.nodes.len(), 1);
    assert!(actions.ends_with(&[
        Action::Broadcast {
            command: NodeCommand::Membership(membership.clone()),
            except: None,
        },
        Action::Reply {
            token: 2,
            answer: Answer::Removed(Ok(membership)),
        },
    ]));
    // The removed process may not come back as it is; a new one joins anew.
    engine.handle(
        at(T0 + 2),
        Input::Register {
            token: 3,
            registration: registration("b", 1),
            session: 3,
        },
    );
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Reply {
            token: 3,
            answer: Answer::Registered(Err(Refusal::RemovedNode(_)))
        }]
    ));
    engine.handle(
        at(T0 + 3),
        Input::Register {
            token: 4,
            registration: registration("b", 2),
            session: 4,
        },
    );
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Persist { write: Write::Batch(w), .. }]
            if w.iter().any(|w| matches!(w, Write::DeleteRemoved(n) if n.as_str() == "b"))
    ));
}

#[test]
fn a_leaving_node_hears_whether_it_left_and_no_membership_without_itself_before() {
    let mut engine = engine();
    engine.handle(
        at(T0),
        Input::Leave {
            node: NodeId::new("b"),
        },
    );
    let actions = engine.drain_actions();
    assert_eq!(
        actions,
        [
            Action::Note(Note::Leaving {
                node: NodeId::new("b")
            }),
            Action::Detach {
                node: NodeId::new("b")
            },
            Action::Persist {
                what: Persist::DeleteMember(NodeId::new("b")),
                write: Write::DeleteMember(NodeId::new("b")),
                attempt: 1
            },
            Action::Persist {
                what: Persist::Removal(NodeId::new("b")),
                write: Write::Remove(RemovedRecord {
                    node: "b".into(),
                    removed_at_ms: T0,
                    incarnation: 1
                }),
                attempt: 1
            },
        ]
    );
    let what = Persist::Removal(NodeId::new("b"));
    engine.handle(
        at(T0),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    let actions = engine.drain_actions();
    assert!(
        matches!(&actions[..], [
            Action::Note(Note::Removed { .. }),
            Action::Broadcast { command: NodeCommand::Membership(_), except: None },
            Action::Left { node, refusal: None },
            Action::Dismiss { node: dismissed },
        ] if node.as_str() == "b" && dismissed.as_str() == "b"),
        "{actions:?}"
    );
}

/// Completed snapshot records 1..=n over a and b.
fn completed_records(n: u64) -> Vec<SnapshotRecord> {
    let one = completed_snapshot();
    (1..=n)
        .map(|id| SnapshotRecord { id, ..one.clone() })
        .collect()
}

#[test]
fn a_restarted_member_makes_recovery_restore_the_newest_snapshot_that_verifies() {
    let mut engine = CoordinatorEngine::<E>::new(Config {
        auto_restore: true,
        ..config(4)
    });
    register(&mut engine, 100, registration("a", 1));
    register(&mut engine, 101, registration("b", 1));
    let gone = Input::SessionEnded {
        node: NodeId::new("a"),
        session: 100,
    };
    engine.handle(at(T0), gone);
    engine.drain_actions();
    let actions = register(&mut engine, 102, registration("a", 2));
    assert_eq!(engine.pending_recovery(), None, "taken: under way");
    assert_eq!(
        actions.last(),
        Some(&Action::List {
            purpose: Listing::Recovery
        })
    );
    // Twelve completed snapshots and a failed one: the ten newest completed are tried,
    // newest first.
    let mut records = completed_records(12);
    records.push(SnapshotRecord {
        id: 13,
        status: SnapshotStatus::Failed,
        ..records[0].clone()
    });
    engine.handle(
        at(T0),
        Input::Listed {
            purpose: Listing::Recovery,
            result: Ok(records),
        },
    );
    let candidates = match engine.drain_actions().as_slice() {
        [Action::Verify { candidates }] => candidates.iter().map(|r| r.id).collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    assert_eq!(candidates, (3..=12).rev().collect::<Vec<_>>());
    assert!(engine.choosing_restore());
    // 12 did not verify; 11 did.
    let verified = Input::Verified {
        chosen: Some(SnapshotId(11)),
        record: Some(completed_records(11).pop().unwrap()),
        skipped: vec![(SnapshotId(12), "chunk ab12 is corrupt".to_owned())],
    };
    engine.handle(at(T0), verified);
    assert_eq!(
        engine.drain_actions(),
        [
            Action::Note(Note::Recovery(
                "automatic recovery (a restarted) passes over snapshot 12: chunk ab12 is corrupt"
                    .into()
            )),
            Action::AllocateEpoch,
        ]
    );
    engine.handle(at(T0 + 5), Input::EpochAllocated { result: Ok(3) });
    let record = restore_to_store(engine.drain_actions(), 1);
    assert_eq!(
        (
            record.snapshot_id,
            record.requested_by.as_str(),
            record.skipped.as_slice()
        ),
        (
            11,
            "automatic recovery (a restarted)",
            &["snapshot 12: chunk ab12 is corrupt".to_owned()][..]
        )
    );
    restore_stored(&mut engine, 3, Ok(()));
    let actions = engine.drain_actions();
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Reply { .. })),
        "nobody to answer: {actions:?}"
    );
    assert_eq!(engine.active_restore().map(|r| r.epoch), Some(3));
}

/// An engine of four nodes whose cluster is in epoch 2, restored from snapshot 5.
fn restored_in_epoch_2(auto_restore: bool) -> CoordinatorEngine<E> {
    let mut engine = CoordinatorEngine::<E>::new(Config {
        auto_restore,
        ..config(4)
    });
    engine.handle(
        at(T0),
        Input::RestoresLoaded {
            epoch: 2,
            active: None,
            unfinished: None,
            restored: Some(SnapshotId(5)),
        },
    );
    engine
}

#[test]
fn a_member_behind_a_restore_makes_recovery_due_in_any_term() {
    // A leader of a later term: the restart that left b behind was seen by another, whose
    // recovery never ran. b's process registered then (its incarnation is on the roster),
    // but never heard the epoch it was to enter, so it comes back in epoch 0.
    for auto_restore in [true, false] {
        let mut engine = restored_in_epoch_2(auto_restore);
        engine.drain_actions();
        let in_epoch = |node, incarnation| Registration {
            epoch: 2,
            ..registration(node, incarnation)
        };
        register(&mut engine, 100, in_epoch("a", 1));
        register(&mut engine, 101, in_epoch("b", 1));
        engine.handle(
            at(T0),
            Input::SessionEnded {
                node: NodeId::new("b"),
                session: 101,
            },
        );
        engine.drain_actions();
        let actions = register(&mut engine, 102, registration("b", 1));
        assert!(
            actions.iter().any(|a| matches!(
                a,
                Action::Note(Note::MissedRestore {
                    node_epoch: 0,
                    epoch: 2,
                    ..
                })
            )),
            "{actions:?}"
        );
        assert!(engine.fence().is_some(), "fenced until a restore");
        let recovering = actions.last()
            == Some(&Action::List {
                purpose: Listing::Recovery,
            });
        assert_eq!(recovering, auto_restore, "{actions:?}");
    }
}

#[test]
fn recovery_stays_on_the_history_the_cluster_is_on_after_a_restore() {
    // Snapshot 5 was restored (epoch 2); 6 to 8 were taken before that restore, in epoch 1:
    // a history it discarded. Then 9 and 10 were taken in epoch 2.
    let candidates_after = |records: Vec<SnapshotRecord>| {
        let mut engine = restored_in_epoch_2(true);
        register(&mut engine, 100, registration("a", 1));
        let gone = Input::SessionEnded {
            node: NodeId::new("a"),
            session: 100,
        };
        engine.handle(at(T0), gone);
        engine.drain_actions();
        register(&mut engine, 101, registration("a", 2));
        engine.handle(
            at(T0),
            Input::Listed {
                purpose: Listing::Recovery,
                result: Ok(records),
            },
        );
        match engine.drain_actions().as_slice() {
            [Action::Verify { candidates }] => candidates.iter().map(|r| r.id).collect::<Vec<_>>(),
            [Action::Note(note)] => panic!("{note:?}"),
            other => panic!("{other:?}"),
        }
    };
    let mut records = completed_records(10);
    for r in &mut records {
        r.epoch = if r.id > 8 { 2 } else { 1 };
    }
    assert_eq!(candidates_after(records.clone()), vec![10, 9, 5]);
    // None taken since the restore: the restored snapshot, not 8.
    records.truncate(8);
    assert_eq!(candidates_after(records), vec![5]);
}

#[test]
fn a_recovery_that_finds_nothing_that_verifies_is_tried_again_after_a_pause() {
    let mut engine = CoordinatorEngine::<E>::new(Config {
        auto_restore: true,
        ..config(4)
    });
    register(&mut engine, 100, registration("a", 1));
    let gone = Input::SessionEnded {
        node: NodeId::new("a"),
        session: 100,
    };
    engine.handle(at(T0), gone);
    engine.drain_actions();
    let actions = register(&mut engine, 101, registration("a", 2));
    assert_eq!(
        actions.last(),
        Some(&Action::List {
            purpose: Listing::Recovery
        })
    );
    engine.handle(
        at(T0),
        Input::Listed {
            purpose: Listing::Recovery,
            result: Ok(completed_records(1)),
        },
    );
    engine.drain_actions();
    let verified = Input::Verified {
        chosen: None,
        record: None,
        skipped: vec![(SnapshotId(1), "chunk missing".to_owned())],
    };
    engine.handle(at(T0), verified);
    assert_eq!(
        engine.drain_actions(),
        [
            Action::Note(Note::Recovery(
                "automatic recovery (a restarted) passes over snapshot 1: chunk missing".into()
            )),
            Action::RecoveryFailed {
                requested_by: "automatic recovery (a restarted)".into(),
                refusal: Some(Refusal::Store("chunk missing".into())),
            },
        ]
    );
    assert_eq!(engine.pending_recovery(), Some("a restarted"));
    engine.handle(at(T0 + RECOVERY_BACKOFF_MS - 1), Input::Tick);
    assert_eq!(engine.drain_actions(), []);
    engine.handle(at(T0 + RECOVERY_BACKOFF_MS), Input::Tick);
    assert_eq!(
        engine.drain_actions(),
        [Action::List {
            purpose: Listing::Recovery
        }]
    );
}

#[test]
fn a_user_restore_of_a_snapshot_that_is_not_there_or_not_whole_is_refused_at_once() {
    let mut engine = engine();
    let ask = |record| Input::Restore {
        token: 4,
        snapshot: SnapshotId(1),
        record,
        if_epoch: None,
    };
    engine.handle(at(T0), ask(None));
    assert_eq!(
        engine.drain_actions(),
        [Action::Reply {
            token: 4,
            answer: Answer::RestoreStarted(Err(Refusal::NotFound(SnapshotId(1)))),
        }]
    );
    let failed = SnapshotRecord {
        status: SnapshotStatus::Failed,
        ..completed_snapshot()
    };
    engine.handle(at(T0), ask(Some(failed)));
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Reply {
            answer: Answer::RestoreStarted(Err(Refusal::NotCompleted { .. })),
            ..
        }]
    ));
    // One being verified: a second is refused naming it.
    engine.handle(at(T0), ask(Some(completed_snapshot())));
    engine.drain_actions();
    engine.handle(at(T0), ask(Some(completed_snapshot())));
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Reply { answer: Answer::RestoreStarted(Err(Refusal::RestoreInProgress { restore, .. })), .. }]
            if restore.contains("being verified")
    ));
}

#[test]
fn a_deletion_is_answered_with_what_the_collection_after_it_freed_and_one_waits_for_the_next() {
    let mut engine = engine();
    let delete = |token, id| Input::Delete {
        token,
        snapshot: SnapshotId(id),
        exists: true,
    };
    engine.handle(at(T0), delete(1, 7));
    assert_eq!(
        engine.drain_actions(),
        [Action::Persist {
            what: Persist::Delete(1, SnapshotId(7)),
            write: Write::DeleteSnapshot(SnapshotId(7)),
            attempt: 1,
        }]
    );
    let what = Persist::Delete(1, SnapshotId(7));
    engine.handle(
        at(T0),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    assert_eq!(
        engine.drain_actions(),
        [
            Action::Note(Note::Deleted {
                snapshot: SnapshotId(7)
            }),
            Action::CollectGarbage
        ]
    );
    // A second deletion while it runs waits for the next collection.
    engine.handle(at(T0), delete(2, 8));
    engine.drain_actions();
    let what = Persist::Delete(2, SnapshotId(8));
    engine.handle(
        at(T0),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    assert_eq!(
        engine.drain_actions(),
        [Action::Note(Note::Deleted {
            snapshot: SnapshotId(8)
        })]
    );
    engine.handle(at(T0), Input::Collected { result: Ok(100) });
    assert_eq!(
        engine.drain_actions(),
        [
            Action::Reply {
                token: 1,
                answer: Answer::Deleted(Ok(100)),
            },
            Action::CollectGarbage,
        ]
    );
    engine.handle(
        at(T0),
        Input::Collected {
            result: Err("s3 down".into()),
        },
    );
    assert_eq!(
        engine.drain_actions(),
        [
            Action::Note(Note::CollectionFailed("s3 down".into())),
            Action::Reply {
                token: 2,
                answer: Answer::Deleted(Ok(0)),
            },
        ]
    );
}

#[test]
fn a_snapshot_in_flight_missing_or_held_by_a_restore_is_not_deleted() {
    let mut engine = engine();
    started(&mut engine, 1);
    let delete = |token, id, exists| Input::Delete {
        token,
        snapshot: SnapshotId(id),
        exists,
    };
    engine.handle(at(T0), delete(1, 1, true));
    assert_eq!(
        engine.drain_actions(),
        [Action::Reply {
            token: 1,
            answer: Answer::Deleted(Err(Refusal::StillInProgress(SnapshotId(1)))),
        }]
    );
    engine.handle(at(T0), delete(2, 9, false));
    assert_eq!(
        engine.drain_actions(),
        [Action::Reply {
            token: 2,
            answer: Answer::Deleted(Err(Refusal::NotFound(SnapshotId(9)))),
        }]
    );
    // With a snapshot in flight, a collection frees nothing and is not run.
    engine.handle(at(T0), delete(3, 4, true));
    engine.drain_actions();
    let what = Persist::Delete(3, SnapshotId(4));
    engine.handle(
        at(T0),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    assert_eq!(
        engine.drain_actions(),
        [
            Action::Note(Note::Deleted {
                snapshot: SnapshotId(4)
            }),
            Action::Reply {
                token: 3,
                answer: Answer::Deleted(Ok(0)),
            },
        ]
    );
    let mut engine = engine_restoring();
    engine.handle(at(T0), delete(4, 1, true));
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Reply { answer: Answer::Deleted(Err(Refusal::HeldByRestore { restore, .. })), .. }]
            if restore == "restore-5"
    ));
}

/// An engine with the restore of snapshot 1 (epoch 5) under way.
fn engine_restoring() -> CoordinatorEngine<E> {
    let mut engine = engine();
    restore_started(&mut engine);
    engine
}

#[test]
fn retention_keeps_the_newest_completed_and_what_a_restore_holds() {
    let mut engine = CoordinatorEngine::<E>::new(Config {
        retention: 2,
        ..config(4)
    });
    register(&mut engine, 100, registration("a", 1));
    register(&mut engine, 101, registration("b", 1));
    started(&mut engine, 5);
    engine.handle(at(T0 + 1), part(5, "a"));
    engine.handle(at(T0 + 2), part(5, "b"));
    engine.drain_actions();
    let what = Persist::Snapshot(SnapshotWrite::End(SnapshotId(5)));
    engine.handle(
        at(T0 + 3),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    let actions = engine.drain_actions();
    assert!(
        matches!(
            &actions[..],
            [
                Action::Broadcast {
                    command: NodeCommand::Outcomes(_),
                    except: None
                },
                Action::Ended { .. },
                Action::List {
                    purpose: Listing::Retention
                }
            ]
        ),
        "{actions:?}"
    );
    let mut records = completed_records(5);
    records[2].status = SnapshotStatus::Failed;
    engine.handle(
        at(T0 + 4),
        Input::Listed {
            purpose: Listing::Retention,
            result: Ok(records),
        },
    );
    // Completed: 1, 2, 4, 5; the newest two stay.
    assert_eq!(
        engine.drain_actions(),
        [Action::Persist {
            what: Persist::Retention(vec![SnapshotId(1), SnapshotId(2)]),
            write: Write::Batch(vec![
                Write::DeleteSnapshot(SnapshotId(1)),
                Write::DeleteSnapshot(SnapshotId(2))
            ]),
            attempt: 1,
        }]
    );
    let what = Persist::Retention(vec![SnapshotId(1), SnapshotId(2)]);
    engine.handle(
        at(T0 + 5),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    assert_eq!(
        engine.drain_actions(),
        [
            Action::Note(Note::RetentionDeleted {
                snapshot: SnapshotId(1)
            }),
            Action::Note(Note::RetentionDeleted {
                snapshot: SnapshotId(2)
            }),
            Action::CollectGarbage,
        ]
    );
}

/// An engine with members a and b whose policy takes a snapshot every second, failures
/// tolerated: none.
fn scheduled_engine() -> CoordinatorEngine<E> {
    let policy = crate::schedule::Policy {
        interval: Duration::from_secs(1),
        tolerated_failures: 0,
        ..crate::schedule::Policy::default()
    };
    let mut engine = CoordinatorEngine::<E>::new(Config {
        policy,
        ..config(4)
    });
    register(&mut engine, 100, registration("a", 1));
    register(&mut engine, 101, registration("b", 1));
    engine
}

#[test]
fn a_due_snapshot_starts_through_the_start_path_and_answers_the_schedule() {
    let mut engine = scheduled_engine();
    let due = engine.next_due().expect("a schedule");
    engine.handle(at(due), Input::Due);
    assert_eq!(engine.drain_actions(), [Action::TakeId]);
    engine.handle(
        at(due),
        Input::IdTaken {
            result: Ok(SnapshotId(1)),
        },
    );
    let record = match engine.drain_actions().as_slice() {
        [
            Action::Persist {
                write: Write::Snapshot(record),
                ..
            },
        ] => record.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        record.labels.get("scheduled").map(String::as_str),
        Some("true")
    );
    assert_eq!(record.term, 7);
    let what = Persist::Snapshot(SnapshotWrite::Started(SnapshotId(1)));
    engine.handle(
        at(due),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    let actions = engine.drain_actions();
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Reply { .. })),
        "nobody to answer: {actions:?}"
    );
    let status = engine.schedule_status(at(due));
    assert_eq!((status.started, status.running), (1, 1));
    // Its end is told to the schedule.
    engine.handle(at(due + 10), part(1, "a"));
    engine.handle(at(due + 11), part(1, "b"));
    engine.drain_actions();
    let what = Persist::Snapshot(SnapshotWrite::End(SnapshotId(1)));
    engine.handle(
        at(due + 12),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    engine.drain_actions();
    let status = engine.schedule_status(at(due + 12));
    assert_eq!(status.running, 0);
    assert_eq!(status.newest_completed_age, Some(Duration::ZERO));
}

#[test]
fn a_scheduled_start_refused_is_worded_by_the_runtime_and_a_failure_past_the_tolerated_alarms() {
    let mut engine = scheduled_engine();
    let gone = Input::SessionEnded {
        node: NodeId::new("b"),
        session: 101,
    };
    engine.handle(at(T0), gone);
    engine.drain_actions();
    let due = engine.next_due().expect("a schedule");
    engine.handle(at(due), Input::Due);
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::ScheduleRefused { refusal: Refusal::NodesNotConnected(why) }] if why.contains(": b")
    ));
    let why = "could not start: b is not connected".to_owned();
    let refused = Input::ScheduleRefused {
        busy: false,
        why: why.clone(),
    };
    engine.handle(at(due), refused);
    let actions = engine.drain_actions();
    assert!(
        matches!(&actions[..], [
            Action::Note(Note::ScheduleFailed(w)),
            Action::Note(Note::Failing(f)),
        ] if *w == why && f.consecutive == 1 && f.tolerated == 0),
        "{actions:?}"
    );
    // Refused for want of room: a skip.
    engine.handle(
        at(due),
        Input::ScheduleRefused {
            busy: true,
            why: "2 in flight".into(),
        },
    );
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Note(Note::Skipped(_))]
    ));
}

#[test]
fn a_policy_is_followed_once_stored_and_one_beyond_the_limit_is_refused() {
    let mut engine = engine_of(2);
    let update = |max| crate::schedule::PolicyUpdate {
        interval: Some(Duration::from_secs(60)),
        max_concurrent: Some(max),
        ..crate::schedule::PolicyUpdate::default()
    };
    let set = |token, max| Input::SetPolicy {
        token,
        change: PolicyChange::Update(update(max)),
    };
    engine.handle(at(T0), set(1, 3));
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Reply { token: 1, answer: Answer::Policy(Err(Refusal::Invalid(why))) }]
            if why.contains("--max-concurrent 2")
    ));
    engine.handle(at(T0), set(2, 2));
    let (policy, source) = match engine.drain_actions().as_slice() {
        [
            Action::Persist {
                what: Persist::Policy(2),
                write: Write::Policy { policy, source },
                ..
            },
        ] => (policy.clone(), *source),
        other => panic!("{other:?}"),
    };
    assert_eq!(source, PolicySource::Api);
    assert_eq!(engine.next_due(), None, "followed only once stored");
    engine.handle(
        at(T0),
        Input::Persisted {
            what: Persist::Policy(2),
            result: Ok(()),
        },
    );
    let actions = engine.drain_actions();
    assert!(
        matches!(&actions[..], [
            Action::Note(Note::PolicyAdopted { .. }),
            Action::Reply { token: 2, answer: Answer::Policy(Ok(view)) },
        ] if view.policy == policy && view.source == PolicySource::Api),
        "{actions:?}"
    );
    assert_eq!(engine.next_due(), Some(T0 + 60_000));
    // Back to the flags (no schedule): stored, then followed.
    let reset = Input::SetPolicy {
        token: 3,
        change: PolicyChange::ResetToFlags,
    };
    engine.handle(at(T0 + 1), reset);
    engine.drain_actions();
    engine.handle(
        at(T0 + 1),
        Input::Persisted {
            what: Persist::Policy(3),
            result: Ok(()),
        },
    );
    engine.drain_actions();
    assert_eq!(engine.next_due(), None);
    assert_eq!(engine.policy_view(at(T0 + 1)).source, PolicySource::Flags);
}

#[test]
fn an_acknowledged_progress_write_does_not_tell_an_end_taken_after_it() {
    let mut engine = engine();
    restore_started(&mut engine);
    let applied = |node: &str| Input::RestoreApplied {
        node: NodeId::new(node),
        restore_id: "restore-5".into(),
    };
    engine.handle(at(T0 + 1), applied("a"));
    let first = restore_to_store(engine.drain_actions(), 1);
    assert_eq!(first.status, RestoreStatus::InProgress);
    engine.handle(at(T0 + 2), applied("b"));
    let done = restore_to_store(engine.drain_actions(), 2);
    assert_eq!(done.status, RestoreStatus::Done);
    // The progress write's acknowledgement comes now: it is not the end's.
    let what = Persist::Restore(5, RestoreStatus::InProgress);
    engine.handle(
        at(T0 + 3),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    assert_eq!(engine.drain_actions(), []);
    assert!(
        engine.active_restore().is_some(),
        "fenced until the end is stored"
    );
    let what = Persist::Restore(5, RestoreStatus::Done);
    engine.handle(
        at(T0 + 4),
        Input::Persisted {
            what,
            result: Ok(()),
        },
    );
    assert_eq!(
        engine.drain_actions(),
        [Action::RestoreEnded { record: done }]
    );
}

/// A start with a request id: stored with the record; a start that repeats it is answered
/// with that snapshot and starts nothing — in this term, and in the next one (loaded from
/// the records) — until the record is deleted.
#[test]
fn a_start_that_repeats_its_request_id_answers_the_snapshot_it_started() {
    let with_id = |token: Token, request_id: &str| {
        let mut input = start_input(token);
        if let Input::Start { start, .. } = &mut input {
            start.request_id = request_id.to_owned();
        }
        input
    };
    let mut engine = engine();
    engine.handle(at(T0), with_id(1, "retry-me"));
    assert_eq!(engine.drain_actions(), [Action::TakeId]);
    engine.handle(
        at(T0),
        Input::IdTaken {
            result: Ok(SnapshotId(5)),
        },
    );
    let record = match engine.drain_actions().as_slice() {
        [
            Action::Persist {
                write: Write::Snapshot(record),
                ..
            },
        ] => (**record).clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(record.request_id, "retry-me");
    // Until its record is stored, nobody knows of it: a repeat would wait (the runtime
    // drives one input at a time), so only the stored start is remembered.
    engine.handle(
        at(T0),
        Input::Persisted {
            what: Persist::Snapshot(SnapshotWrite::Started(SnapshotId(5))),
            result: Ok(()),
        },
    );
    engine.drain_actions();
    engine.handle(at(T0 + 1), with_id(2, "retry-me"));
    assert_eq!(
        engine.drain_actions(),
        [
            Action::Note(Note::StartRepeated {
                snapshot: SnapshotId(5),
                request_id: "retry-me".into(),
            }),
            Action::Reply {
                token: 2,
                answer: Answer::Started(Ok(SnapshotId(5)))
            },
        ]
    );
    // Another request id, or none, starts another snapshot.
    engine.handle(at(T0 + 1), with_id(3, "another"));
    assert_eq!(engine.drain_actions(), [Action::TakeId]);

    // The next term knows it from the stored records, even with no member connected.
    let mut next = CoordinatorEngine::<E>::new(config(4));
    next.handle(
        at(T0),
        Input::StartsLoaded {
            requests: vec![
                (SnapshotId(5), "retry-me".into()),
                (SnapshotId(6), String::new()),
            ],
        },
    );
    next.handle(at(T0 + 2), with_id(4, "retry-me"));
    let actions = next.drain_actions();
    assert!(
        matches!(
            actions.last(),
            Some(Action::Reply {
                token: 4,
                answer: Answer::Started(Ok(SnapshotId(5)))
            })
        ),
        "{actions:?}"
    );
    // A start without a request id is no repeat: with no member connected, refused.
    next.handle(at(T0 + 2), with_id(7, ""));
    let actions = next.drain_actions();
    assert!(
        matches!(
            actions.as_slice(),
            [Action::Reply {
                token: 7,
                answer: Answer::Started(Err(_))
            }]
        ),
        "no members: {actions:?}"
    );
}

#[test]
fn request_ids_are_bounded_to_the_newest_snapshots() {
    let mut engine = CoordinatorEngine::<E>::new(config(4));
    let n = snapshots::MAX_REQUESTS as u64 + 10;
    engine.handle(
        at(T0),
        Input::StartsLoaded {
            requests: (1..=n).map(|i| (SnapshotId(i), format!("r{i}"))).collect(),
        },
    );
    let known = |engine: &mut CoordinatorEngine<E>, request_id: &str| {
        let mut input = start_input(9);
        if let Input::Start { start, .. } = &mut input {
            start.request_id = request_id.to_owned();
        }
        engine.handle(at(T0), input);
        engine.drain_actions().iter().any(|a| {
            matches!(
                a,
                Action::Reply {
                    answer: Answer::Started(Ok(_)),
                    ..
                }
            )
        })
    };
    assert!(known(&mut engine, &format!("r{n}")));
    assert!(!known(&mut engine, "r10"), "the oldest are forgotten");
    assert!(known(&mut engine, "r11"));
}

/// The broadcast that tells the applications snapshot `id`'s end (`failure`: why it did not
/// complete), the id told before it being `after`.
fn told(id: u64, failure: Option<&str>, after: u64) -> Action<E> {
    Action::Broadcast {
        command: NodeCommand::Outcomes(Outcomes {
            after,
            outcomes: vec![SnapshotOutcome {
                snapshot: SnapshotId(id),
                failure: failure.map(str::to_owned),
            }],
            through: id,
            catch_up: false,
        }),
        except: None,
    }
}

#[test]
fn ends_are_told_to_the_applications_in_id_order_and_again_on_a_catch_up() {
    let mut engine = engine_of(2);
    started(&mut engine, 1);
    started(&mut engine, 2);
    // 2 ends and is stored first: told to nobody while 1 is open.
    engine.handle(at(T0 + 1), part(2, "a"));
    engine.handle(at(T0 + 1), part(2, "b"));
    engine.drain_actions();
    engine.handle(
        at(T0 + 2),
        Input::Persisted {
            what: Persist::Snapshot(SnapshotWrite::End(SnapshotId(2))),
            result: Ok(()),
        },
    );
    let actions = engine.drain_actions();
    assert!(
        !actions.iter().any(|a| matches!(
            a,
            Action::Broadcast {
                command: NodeCommand::Outcomes(_),
                ..
            }
        )),
        "{actions:?}"
    );
    // 1 fails; its end is stored: 1 and then 2 are told, in one push.
    engine.handle(at(T0 + 3), Input::TimedOut { id: SnapshotId(1) });
    engine.drain_actions();
    engine.handle(
        at(T0 + 4),
        Input::Persisted {
            what: Persist::Snapshot(SnapshotWrite::End(SnapshotId(1))),
            result: Ok(()),
        },
    );
    let pushes: Vec<Outcomes> = engine
        .drain_actions()
        .into_iter()
        .filter_map(|a| match a {
            Action::Broadcast {
                command: NodeCommand::Outcomes(o),
                ..
            } => Some(o),
            _ => None,
        })
        .collect();
    assert_eq!(pushes.len(), 1);
    let ids: Vec<(u64, bool)> = pushes[0]
        .outcomes
        .iter()
        .map(|o| (o.snapshot.0, o.failure.is_none()))
        .collect();
    assert_eq!(ids, [(1, false), (2, true)]);
    assert_eq!((pushes[0].after, pushes[0].through), (0, 2));
    // A daemon catching up from 1 hears 2 again, on its own session.
    engine.handle(
        at(T0 + 5),
        Input::OutcomesAfter {
            node: NodeId::new("a"),
            after: 1,
        },
    );
    match &engine.drain_actions()[..] {
        [
            Action::Send {
                node,
                command: NodeCommand::Outcomes(o),
            },
        ] => {
            assert_eq!(node.as_str(), "a");
            assert!(o.catch_up);
            assert_eq!((o.after, o.through, o.outcomes.len()), (1, 2, 1));
            assert_eq!(o.outcomes[0].snapshot, SnapshotId(2));
        }
        other => panic!("{other:?}"),
    }
}
