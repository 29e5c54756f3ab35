//! The engine driven synchronously: each test feeds inputs and compares the actions queued.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::*;
use crate::record::{EventKind, SnapshotStatus};
use crate::report::{IncomingCut, LocalReport, OutgoingCut};
use crate::types::{ChannelId, SnapshotMode};

/// The store's error in these tests.
type E = String;

const T0: u64 = 1_000;
const TIMEOUT: Duration = Duration::from_secs(30);

fn engine() -> CoordinatorEngine<E> {
    CoordinatorEngine::new(4)
}

fn mesh() -> Topology {
    Topology::full_mesh([NodeId::new("a"), NodeId::new("b")])
}

fn start_input(token: Token) -> Input<E> {
    Input::Start {
        token,
        request: StartRequest {
            mode: SnapshotMode::ChandyLamport,
            initiators: BTreeSet::from([NodeId::new("a")]),
            alignment_timeout: None,
        },
        topology: mesh(),
        timeout: TIMEOUT,
        labels: BTreeMap::from([("why".to_owned(), "test".to_owned())]),
        epoch: 3,
        term: 7,
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
        epoch: 3,
        applied_restore_id: String::new(),
    }
}

/// Starts snapshot `id` (the counter hands out `id`) and checks every step of its start.
fn started(engine: &mut CoordinatorEngine<E>, id: u64) -> SnapshotRecord {
    engine.handle(T0, start_input(1));
    assert_eq!(engine.drain_actions(), [Action::TakeId]);
    engine.handle(
        T0,
        Input::IdTaken {
            result: Ok(SnapshotId(id)),
        },
    );
    let record = match engine.drain_actions().as_slice() {
        [
            Action::Persist {
                what: Persist::Started(got),
                record,
                attempt: 1,
            },
        ] if *got == SnapshotId(id) => record.clone(),
        other => panic!("expected the start's record to be stored first, got {other:?}"),
    };
    assert_eq!(record.status, SnapshotStatus::InProgress);
    assert_eq!(
        (record.epoch, record.term, record.started_at_ms),
        (3, 7, T0)
    );
    assert_eq!(record.nodes, ["a", "b"]);
    assert_eq!(record.channels, ["a->b", "b->a"]);
    // Nobody hears of it before the store answers.
    assert!(engine.live_record(SnapshotId(id)).is_none());
    engine.handle(
        T0,
        Input::Persisted {
            what: Persist::Started(SnapshotId(id)),
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
                id: SnapshotId(id),
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
                what: Persist::End(got),
                record,
                attempt: n,
            },
        ] if *got == SnapshotId(id) && *n == attempt => record.clone(),
        other => panic!("expected the end stored (attempt {attempt}), got {other:?}"),
    }
}

#[test]
fn a_snapshot_completes_stored_before_told() {
    let mut engine = engine();
    started(&mut engine, 1);
    engine.handle(T0 + 1, part(1, "a"));
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

    engine.handle(T0 + 2, part(1, "b"));
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
        T0 + 3,
        Input::Persisted {
            what: Persist::End(SnapshotId(1)),
            result: Err("etcd: no leader".into()),
        },
    );
    assert_eq!(engine.drain_actions(), []);
    assert_eq!(engine.unstored(), 1);
    engine.handle(T0 + 250, Input::Tick);
    assert_eq!(end_to_store(engine.drain_actions(), 1, 2), end);
    engine.handle(
        T0 + 251,
        Input::Persisted {
            what: Persist::End(SnapshotId(1)),
            result: Ok(()),
        },
    );
    // A completed snapshot is told to the runtime only (no node drops anything).
    assert_eq!(engine.drain_actions(), [Action::Ended { record: end }]);
    assert!(!engine.is_open(SnapshotId(1)));
    engine.handle(T0 + 500, Input::Tick);
    assert_eq!(engine.drain_actions(), []);
}

#[test]
fn ids_stay_above_what_daemons_saw() {
    let mut engine = engine();
    engine.handle(T0, Input::IdSeen { highest: 41 });
    engine.handle(T0, Input::IdSeen { highest: 9 });
    assert_eq!(engine.id_floor(), 41);
    engine.handle(T0, start_input(1));
    assert_eq!(engine.drain_actions(), [Action::TakeId]);
    // The counter (lost with the metadata?) hands out 5: the counter is set above 41.
    engine.handle(
        T0,
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
        T0,
        Input::IdTaken {
            result: Ok(SnapshotId(42)),
        },
    );
    assert!(matches!(
        engine.drain_actions().as_slice(),
        [Action::Persist {
            what: Persist::Started(SnapshotId(42)),
            ..
        }]
    ));
}

#[test]
fn a_start_whose_record_is_not_stored_is_told_to_nobody_and_frees_its_place() {
    let mut engine = CoordinatorEngine::<E>::new(1);
    engine.handle(T0, start_input(1));
    engine.handle(
        T0,
        Input::IdTaken {
            result: Ok(SnapshotId(1)),
        },
    );
    engine.drain_actions();
    engine.handle(
        T0,
        Input::Persisted {
            what: Persist::Started(SnapshotId(1)),
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
    if let Input::Start { request, .. } = &mut input {
        request.initiators = BTreeSet::from([NodeId::new("z")]);
    }
    engine.handle(T0, input);
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
        T0 + 5,
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
        T0 + 6,
        Input::Persisted {
            what: Persist::End(SnapshotId(1)),
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
            },
            Action::Reply {
                token: 2,
                answer: Answer::Aborted(Ok(Box::new(end.clone()))),
            },
            Action::Ended { record: end },
        ]
    );
    // A second abort: the runtime asks the store whether it ended or never was.
    engine.handle(
        T0 + 7,
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
    engine.handle(T0, abort(2));
    engine.drain_actions();
    engine.handle(
        T0,
        Input::Persisted {
            what: Persist::End(SnapshotId(1)),
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
    engine.handle(T0, abort(3));
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
    engine.handle(T0 + 1, input);
    let end = end_to_store(engine.drain_actions(), 1, 1);
    let failure = end.failure.unwrap();
    assert_eq!(
        (failure.kind.as_str(), failure.nodes.as_slice()),
        ("MIXED_EPOCHS", &["b".to_owned()][..])
    );
    assert_eq!(
        failure.detail.as_deref(),
        Some(
            "snapshot 1 started in epoch 3, node b recorded its part in epoch 4 (after restore-4)"
        )
    );
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
    engine.handle(T0 + 1, failed("b"));
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
    engine.handle(T0 + 2, failed("a"));
    assert_eq!(engine.drain_actions(), []);

    started(&mut engine, 2);
    engine.handle(
        T0 + 3,
        Input::NodeLost {
            node: NodeId::new("b"),
        },
    );
    let end = end_to_store(engine.drain_actions(), 2, 1);
    assert_eq!(end.failure.unwrap().kind, "NODE_LOST");
    engine.handle(
        T0 + 3,
        Input::NodeLost {
            node: NodeId::new("b"),
        },
    );
    assert_eq!(engine.drain_actions(), []);
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
        T0 + 9,
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
