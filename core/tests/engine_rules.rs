//! One state, one event, the exact commands: each rule of Chandy–Lamport and each mode's
//! difference, as the engine implements it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use cairn_core::{
    ChannelId, Command, Event, FailureReason, Ignored, IncomingCut, LocalReport, NodeId, Outcome,
    OutgoingCut, Plan, SnapshotEngine, SnapshotId, SnapshotMode, Topology,
};

fn ch(from: &str, to: &str) -> ChannelId {
    ChannelId::new(from, to)
}

/// `b` in a full mesh of a, b, c: incoming a->b, c->b; outgoing b->a, b->c.
fn mesh_b() -> SnapshotEngine {
    let t = Topology::full_mesh(["a", "b", "c"].map(NodeId::from));
    SnapshotEngine::new("b".into(), t)
}

/// `b` waiting on two channels in aligned mode from initiator a: a->b, a->c, c->b, b->a.
/// The depth-first search from a makes only b->a (into the initiator) a feedback channel.
fn dag_b() -> SnapshotEngine {
    let t = Topology::from_channels(
        ["a", "b", "c"].map(NodeId::from),
        [ch("a", "b"), ch("a", "c"), ch("c", "b"), ch("b", "a")],
    )
    .unwrap();
    SnapshotEngine::new("b".into(), t)
}

fn plan(id: u64, mode: SnapshotMode, initiator: &str) -> Plan {
    Plan::new(id, mode, initiator)
}

fn feed(e: &mut SnapshotEngine, event: Event) -> Vec<Command> {
    assert_eq!(e.handle(event), Outcome::Applied);
    e.drain_commands().collect()
}

fn marker(from: &str, p: &Plan) -> Event {
    Event::MarkerReceived {
        channel: ch(from, "b"),
        plan: p.clone(),
    }
}

fn received(c: ChannelId, count: u64) -> Event {
    Event::DataReceived { channel: c, count }
}
fn delivered(c: ChannelId, count: u64) -> Event {
    Event::DataDelivered { channel: c, count }
}
fn queued(c: ChannelId, count: u64) -> Event {
    Event::DataQueued { channel: c, count }
}
fn transmitted(c: ChannelId, count: u64) -> Event {
    Event::DataTransmitted { channel: c, count }
}

fn record(id: u64, c: ChannelId, indices: std::ops::Range<u64>) -> Command {
    Command::RecordChannelMessages {
        id: SnapshotId(id),
        channel: c,
        indices,
    }
}

/// The plan an overtaking marker of an aligned snapshot carries.
fn timed(p: &Plan) -> Plan {
    Plan {
        timed_out: true,
        ..p.clone()
    }
}

fn marker_out(to: &str, p: &Plan, front: bool) -> Command {
    Command::SendMarker {
        channel: ch("b", to),
        plan: p.clone(),
        front,
    }
}

#[test]
fn initiator_records_its_state_behind_the_inbox_and_waits_for_it_before_sending_markers() {
    let mut e = mesh_b();
    let p = plan(1, SnapshotMode::ChandyLamport, "b");
    assert_eq!(
        feed(&mut e, Event::SnapshotInitiated { plan: p }),
        vec![Command::EnqueueRecordState {
            id: SnapshotId(1),
            front: false
        }]
    );
}

#[test]
fn recorded_state_sends_a_marker_behind_the_queue_on_every_outgoing_channel() {
    let mut e = mesh_b();
    let p = plan(1, SnapshotMode::ChandyLamport, "b");
    feed(&mut e, Event::SnapshotInitiated { plan: p.clone() });
    assert_eq!(
        feed(
            &mut e,
            Event::StateRecorded {
                id: SnapshotId(1),
                unconsumed: vec![]
            }
        ),
        vec![marker_out("a", &p, false), marker_out("c", &p, false)]
    );
}

#[test]
fn first_marker_records_the_state_and_its_channel_is_empty() {
    let mut e = mesh_b();
    let p = plan(1, SnapshotMode::ChandyLamport, "a");
    feed(&mut e, received(ch("a", "b"), 4));
    assert_eq!(
        feed(&mut e, marker("a", &p)),
        vec![Command::EnqueueRecordState {
            id: SnapshotId(1),
            front: false
        }]
    );
    // Messages on a->b after its marker belong after the cut: not recorded.
    assert_eq!(feed(&mut e, received(ch("a", "b"), 2)), vec![]);
}

#[test]
fn messages_arriving_after_recording_and_before_the_marker_are_channel_state() {
    let mut e = mesh_b();
    let p = plan(1, SnapshotMode::ChandyLamport, "a");
    feed(&mut e, received(ch("c", "b"), 3));
    feed(&mut e, marker("a", &p));
    assert_eq!(
        feed(&mut e, received(ch("c", "b"), 2)),
        vec![record(1, ch("c", "b"), 3..5)]
    );
}

#[test]
fn marker_on_last_channel_completes_local_snapshot() {
    let mut e = mesh_b();
    let p = plan(7, SnapshotMode::ChandyLamport, "a");
    feed(&mut e, queued(ch("b", "a"), 2));
    feed(&mut e, received(ch("c", "b"), 1));
    feed(&mut e, marker("a", &p));
    feed(
        &mut e,
        Event::StateRecorded {
            id: SnapshotId(7),
            unconsumed: vec![],
        },
    );
    feed(&mut e, received(ch("c", "b"), 2));
    let report = LocalReport {
        id: SnapshotId(7),
        node: "b".into(),
        incoming: BTreeMap::from([
            (
                ch("a", "b"),
                IncomingCut {
                    delivered: 0,
                    marker_at: 0,
                },
            ),
            (
                ch("c", "b"),
                IncomingCut {
                    delivered: 1,
                    marker_at: 3,
                },
            ),
        ]),
        outgoing: BTreeMap::from([
            (
                ch("b", "a"),
                OutgoingCut {
                    sent: 2,
                    marker_at: 2,
                },
            ),
            (
                ch("b", "c"),
                OutgoingCut {
                    sent: 0,
                    marker_at: 0,
                },
            ),
        ]),
    };
    assert_eq!(
        feed(&mut e, marker("c", &p)),
        vec![Command::ReportLocalDone { report }]
    );
    assert_eq!(e.in_flight().count(), 0);
}

#[test]
fn second_marker_on_a_channel_is_ignored() {
    let mut e = mesh_b();
    let p = plan(1, SnapshotMode::ChandyLamport, "a");
    feed(&mut e, marker("a", &p));
    assert_eq!(
        e.handle(marker("a", &p)),
        Outcome::Ignored(Ignored::DuplicateMarker)
    );
}

#[test]
fn marker_of_a_finished_snapshot_is_ignored() {
    let t = Topology::from_channels(["a", "b"].map(NodeId::from), [ch("a", "b")]).unwrap();
    let mut e = SnapshotEngine::new("b".into(), t);
    let p = plan(1, SnapshotMode::ChandyLamport, "a");
    feed(&mut e, marker("a", &p));
    feed(
        &mut e,
        Event::StateRecorded {
            id: SnapshotId(1),
            unconsumed: vec![],
        },
    );
    assert_eq!(
        e.handle(marker("a", &p)),
        Outcome::Ignored(Ignored::FinishedSnapshot)
    );
}

#[test]
fn state_for_an_unknown_snapshot_is_ignored() {
    let mut e = mesh_b();
    assert_eq!(
        e.handle(Event::StateRecorded {
            id: SnapshotId(9),
            unconsumed: vec![]
        }),
        Outcome::Ignored(Ignored::UnknownSnapshot)
    );
}

#[test]
fn unaligned_record_request_overtakes_the_inbox_which_becomes_channel_state() {
    let mut e = mesh_b();
    let p = plan(2, SnapshotMode::Unaligned, "a");
    feed(&mut e, received(ch("a", "b"), 3));
    feed(&mut e, delivered(ch("a", "b"), 1));
    feed(&mut e, received(ch("c", "b"), 2));
    let commands = feed(&mut e, marker("a", &p));
    assert_eq!(
        commands,
        vec![
            Command::EnqueueRecordState {
                id: SnapshotId(2),
                front: true
            },
            record(2, ch("a", "b"), 1..3),
            record(2, ch("c", "b"), 0..2),
            marker_out("a", &p, true),
            marker_out("c", &p, true),
        ]
    );
}

#[test]
fn unaligned_marker_overtakes_the_outgoing_queue_which_the_sender_records() {
    let mut e = mesh_b();
    let p = plan(2, SnapshotMode::Unaligned, "b");
    feed(&mut e, queued(ch("b", "a"), 5));
    feed(&mut e, transmitted(ch("b", "a"), 2));
    assert_eq!(
        feed(&mut e, Event::SnapshotInitiated { plan: p.clone() }),
        vec![
            Command::EnqueueRecordState {
                id: SnapshotId(2),
                front: true
            },
            marker_out("a", &p, true),
            record(2, ch("b", "a"), 2..5),
            marker_out("c", &p, true),
        ]
    );
    // Sent after the marker but before the application's state: recorded by the sender.
    assert_eq!(
        feed(&mut e, queued(ch("b", "c"), 1)),
        vec![record(2, ch("b", "c"), 0..1)]
    );
    feed(
        &mut e,
        Event::StateRecorded {
            id: SnapshotId(2),
            unconsumed: vec![],
        },
    );
    assert_eq!(feed(&mut e, queued(ch("b", "c"), 1)), vec![]);
}

#[test]
fn aligned_marker_blocks_its_channel_until_every_marker_arrived() {
    let mut e = dag_b();
    let p = plan(3, SnapshotMode::Aligned, "a");
    // b waits on a->b and c->b.
    assert_eq!(
        feed(&mut e, marker("a", &p)),
        vec![Command::BlockChannel {
            channel: ch("a", "b")
        }]
    );
    assert!(e.is_blocked(&ch("a", "b")));
    assert_eq!(
        feed(&mut e, marker("c", &p)),
        vec![
            Command::EnqueueRecordState {
                id: SnapshotId(3),
                front: false
            },
            Command::UnblockChannel {
                channel: ch("a", "b")
            },
        ]
    );
}

#[test]
fn aligned_initiator_never_waits_for_markers() {
    let t = Topology::ring(["a", "b", "c"].map(NodeId::from));
    let mut e = SnapshotEngine::new("a".into(), t);
    let p = plan(4, SnapshotMode::Aligned, "a");
    // a is the initiator; a marker for its own snapshot reaching it first (before the
    // coordinator's initiation) must not make it wait.
    assert_eq!(
        feed(
            &mut e,
            Event::MarkerReceived {
                channel: ch("c", "a"),
                plan: p
            }
        ),
        vec![Command::EnqueueRecordState {
            id: SnapshotId(4),
            front: false
        }]
    );
}

#[test]
fn aligned_full_mesh_waits_only_on_the_depth_first_tree() {
    // From initiator a the search runs a -> b -> c, so c->b closes a cycle: b waits on
    // a->b alone.
    let mut e = mesh_b();
    let p = plan(3, SnapshotMode::Aligned, "a");
    assert_eq!(
        feed(&mut e, marker("a", &p)),
        vec![Command::EnqueueRecordState {
            id: SnapshotId(3),
            front: false
        }]
    );
}

#[test]
fn aligned_feedback_marker_before_recording_holds_the_channel_without_waiting() {
    // a -> b, b -> c, c -> b, initiator a: c->b closes the cycle b -> c -> b (feedback).
    let t = Topology::from_channels(
        ["a", "b", "c"].map(NodeId::from),
        [ch("a", "b"), ch("b", "c"), ch("c", "b")],
    )
    .unwrap();
    let mut e = SnapshotEngine::new("b".into(), t);
    let p = plan(5, SnapshotMode::Aligned, "a");
    assert_eq!(
        feed(
            &mut e,
            Event::MarkerReceived {
                channel: ch("c", "b"),
                plan: p.clone()
            }
        ),
        vec![Command::BlockChannel {
            channel: ch("c", "b")
        }]
    );
    assert_eq!(
        feed(
            &mut e,
            Event::MarkerReceived {
                channel: ch("a", "b"),
                plan: p
            }
        ),
        vec![
            Command::EnqueueRecordState {
                id: SnapshotId(5),
                front: false
            },
            Command::UnblockChannel {
                channel: ch("c", "b")
            },
        ]
    );
}

#[test]
fn aligned_first_marker_schedules_the_alignment_timeout() {
    let mut e = dag_b();
    let mut p = plan(6, SnapshotMode::Aligned, "a");
    p.alignment_timeout = Some(Duration::from_millis(100));
    assert_eq!(
        feed(&mut e, marker("a", &p)),
        vec![
            Command::ScheduleAlignmentTimeout {
                id: SnapshotId(6),
                after: Duration::from_millis(100),
                since_ms: 0,
            },
            Command::BlockChannel {
                channel: ch("a", "b")
            },
        ]
    );
}

#[test]
fn alignment_timeout_switches_to_unaligned_recording() {
    let mut e = dag_b();
    let mut p = plan(6, SnapshotMode::Aligned, "a");
    p.alignment_timeout = Some(Duration::from_millis(100));
    feed(&mut e, received(ch("a", "b"), 2));
    feed(&mut e, received(ch("c", "b"), 1));
    feed(&mut e, marker("a", &p));
    feed(&mut e, queued(ch("b", "a"), 1));
    assert_eq!(
        feed(&mut e, Event::AlignmentTimedOut { id: SnapshotId(6) }),
        vec![
            Command::EnqueueRecordState {
                id: SnapshotId(6),
                front: true
            },
            record(6, ch("a", "b"), 0..2),
            record(6, ch("c", "b"), 0..1),
            Command::UnblockChannel {
                channel: ch("a", "b")
            },
            marker_out("a", &timed(&p), true),
            record(6, ch("b", "a"), 0..1),
        ]
    );
    assert_eq!(
        e.handle(Event::AlignmentTimedOut { id: SnapshotId(6) }),
        Outcome::Ignored(Ignored::NotAligning)
    );
}

#[test]
fn alignment_timeout_after_the_state_moves_markers_still_queued_to_the_front() {
    // b is an initiator of an aligned snapshot with a timeout; its marker to a waits
    // behind 5 queued messages (2 already on the wire) when the timeout passes.
    let mut e = mesh_b();
    let mut p = plan(9, SnapshotMode::Aligned, "b");
    p.alignment_timeout = Some(Duration::from_millis(100));
    feed(&mut e, queued(ch("b", "a"), 5));
    feed(&mut e, transmitted(ch("b", "a"), 2));
    assert_eq!(
        feed(&mut e, Event::SnapshotInitiated { plan: p.clone() }),
        vec![
            Command::ScheduleAlignmentTimeout {
                id: SnapshotId(9),
                after: Duration::from_millis(100),
                since_ms: 0,
            },
            Command::EnqueueRecordState {
                id: SnapshotId(9),
                front: false
            },
        ]
    );
    assert_eq!(
        feed(
            &mut e,
            Event::StateRecorded {
                id: SnapshotId(9),
                unconsumed: vec![]
            }
        ),
        vec![marker_out("a", &p, false), marker_out("c", &p, false)]
    );
    feed(&mut e, marker("a", &p));
    // b->c's marker left at once; every incoming marker is in: the part still waits for
    // b->a's marker, which the timeout may yet move.
    assert_eq!(
        feed(
            &mut e,
            Event::MarkerTransmitted {
                channel: ch("b", "c"),
                id: SnapshotId(9)
            }
        ),
        vec![]
    );
    assert_eq!(feed(&mut e, marker("c", &p)), vec![]);
    feed(&mut e, transmitted(ch("b", "a"), 1));
    assert_eq!(
        feed(&mut e, Event::AlignmentTimedOut { id: SnapshotId(9) }),
        vec![
            record(9, ch("b", "a"), 3..5),
            Command::OvertakeMarker {
                id: SnapshotId(9),
                channel: ch("b", "a")
            },
        ]
    );
    let done = feed(
        &mut e,
        Event::MarkerTransmitted {
            channel: ch("b", "a"),
            id: SnapshotId(9),
        },
    );
    let [Command::ReportLocalDone { report }] = &done[..] else {
        panic!("expected the part: {done:?}");
    };
    assert_eq!(
        report.outgoing[&ch("b", "a")],
        OutgoingCut {
            sent: 5,
            marker_at: 3
        },
        "the marker now precedes the 2 messages it overtook, recorded by b"
    );
    assert_eq!(
        report.outgoing[&ch("b", "c")],
        OutgoingCut {
            sent: 0,
            marker_at: 0
        }
    );
}

#[test]
fn alignment_timeout_while_the_state_is_awaited_sends_the_markers_in_front() {
    let mut e = mesh_b();
    let mut p = plan(10, SnapshotMode::Aligned, "b");
    p.alignment_timeout = Some(Duration::from_millis(100));
    feed(&mut e, queued(ch("b", "a"), 4));
    feed(&mut e, Event::SnapshotInitiated { plan: p.clone() });
    assert_eq!(
        feed(&mut e, Event::AlignmentTimedOut { id: SnapshotId(10) }),
        vec![]
    );
    assert_eq!(
        feed(
            &mut e,
            Event::StateRecorded {
                id: SnapshotId(10),
                unconsumed: vec![]
            }
        ),
        vec![
            marker_out("a", &timed(&p), true),
            record(10, ch("b", "a"), 0..4),
            marker_out("c", &timed(&p), true),
        ]
    );
    assert_eq!(
        e.handle(Event::AlignmentTimedOut { id: SnapshotId(10) }),
        Outcome::Ignored(Ignored::NotAligning)
    );
}

#[test]
fn a_marker_that_timed_out_upstream_ends_the_alignment_at_once() {
    let mut e = dag_b();
    let mut p = plan(11, SnapshotMode::Aligned, "a");
    p.alignment_timeout = Some(Duration::from_millis(100));
    feed(&mut e, received(ch("c", "b"), 3));
    assert_eq!(
        feed(&mut e, marker("a", &timed(&p))),
        vec![
            Command::ScheduleAlignmentTimeout {
                id: SnapshotId(11),
                after: Duration::from_millis(100),
                since_ms: 0,
            },
            // No alignment: it records at once, overtaking its inbox, and c->b's
            // messages so far are channel state until c's marker.
            Command::EnqueueRecordState {
                id: SnapshotId(11),
                front: true
            },
            record(11, ch("c", "b"), 0..3),
            marker_out("a", &timed(&p), true),
        ]
    );
}

#[test]
fn channel_reset_aborts_every_snapshot_in_flight_naming_the_channel() {
    let mut e = dag_b();
    let p = plan(8, SnapshotMode::Aligned, "a");
    feed(&mut e, marker("a", &p));
    assert_eq!(
        feed(
            &mut e,
            Event::ChannelReset {
                channel: ch("a", "b")
            }
        ),
        vec![
            Command::UnblockChannel {
                channel: ch("a", "b")
            },
            Command::Abort {
                id: SnapshotId(8),
                reason: FailureReason::ChannelReset(ch("a", "b"))
            },
        ]
    );
    assert_eq!(
        e.handle(marker("c", &p)),
        Outcome::Ignored(Ignored::FinishedSnapshot)
    );
}

#[test]
fn abort_of_a_snapshot_not_yet_seen_makes_its_late_markers_harmless() {
    let mut e = mesh_b();
    let p = plan(9, SnapshotMode::ChandyLamport, "a");
    let reason = FailureReason::Aborted("by test".into());
    assert_eq!(
        feed(
            &mut e,
            Event::SnapshotAborted {
                id: SnapshotId(9),
                reason
            }
        ),
        vec![]
    );
    assert_eq!(
        e.handle(marker("a", &p)),
        Outcome::Ignored(Ignored::FinishedSnapshot)
    );
}

#[test]
fn concurrent_snapshots_keep_separate_cuts() {
    let mut e = mesh_b();
    let p1 = plan(1, SnapshotMode::ChandyLamport, "a");
    let p2 = plan(2, SnapshotMode::ChandyLamport, "c");
    feed(&mut e, marker("a", &p1));
    feed(&mut e, received(ch("c", "b"), 1));
    feed(&mut e, marker("c", &p2));
    // c->b is recording for snapshot 1 only (snapshot 2's marker already came on it);
    // a->b is recording for snapshot 2 only.
    assert_eq!(
        feed(&mut e, received(ch("c", "b"), 1)),
        vec![record(1, ch("c", "b"), 1..2)]
    );
    assert_eq!(
        feed(&mut e, received(ch("a", "b"), 1)),
        vec![record(2, ch("a", "b"), 0..1)]
    );
    let ids: BTreeSet<SnapshotId> = e.in_flight().collect();
    assert_eq!(ids, BTreeSet::from([SnapshotId(1), SnapshotId(2)]));
}

#[test]
fn process_without_incoming_channels_is_done_once_its_state_is_recorded() {
    let t = Topology::from_channels(["a", "b"].map(NodeId::from), [ch("a", "b")]).unwrap();
    let mut e = SnapshotEngine::new("a".into(), t);
    let p = plan(1, SnapshotMode::ChandyLamport, "a");
    feed(&mut e, Event::SnapshotInitiated { plan: p.clone() });
    let commands = feed(
        &mut e,
        Event::StateRecorded {
            id: SnapshotId(1),
            unconsumed: vec![],
        },
    );
    assert_eq!(commands.len(), 2);
    assert_eq!(
        commands[0],
        Command::SendMarker {
            channel: ch("a", "b"),
            plan: p,
            front: false
        }
    );
    assert!(matches!(commands[1], Command::ReportLocalDone { .. }));
}

#[test]
fn events_on_channels_that_are_not_ours_are_ignored() {
    let mut e = mesh_b();
    assert_eq!(
        e.handle(received(ch("a", "c"), 1)),
        Outcome::Ignored(Ignored::UnknownChannel)
    );
    let p = plan(1, SnapshotMode::ChandyLamport, "a");
    assert_eq!(
        e.handle(Event::MarkerReceived {
            channel: ch("b", "a"),
            plan: p
        }),
        Outcome::Ignored(Ignored::UnknownChannel)
    );
    assert_eq!(
        e.handle(delivered(ch("b", "a"), 1)),
        Outcome::Ignored(Ignored::UnknownChannel)
    );
}

#[test]
fn a_topology_change_fails_the_snapshots_in_flight_and_keeps_the_counters_of_channels_that_remain()
{
    let mut e = mesh_b();
    feed(&mut e, received(ch("a", "b"), 3));
    let p = plan(4, SnapshotMode::ChandyLamport, "a");
    feed(&mut e, marker("a", &p));
    let grown = Topology::full_mesh(["a", "b", "c", "d"].map(NodeId::from));
    assert_eq!(
        feed(
            &mut e,
            Event::TopologyChanged {
                topology: grown,
                what: "node d joined".into()
            }
        ),
        vec![Command::Abort {
            id: SnapshotId(4),
            reason: FailureReason::MembershipChanged("node d joined".into())
        }]
    );
    // The new channel d->b counts from 0 and a->b keeps its 3 messages: a new snapshot
    // whose marker arrives on d->b first records what a->b carries after its third.
    let p = plan(5, SnapshotMode::ChandyLamport, "d");
    feed(&mut e, received(ch("d", "b"), 2));
    assert_eq!(
        feed(&mut e, marker("d", &p)),
        vec![Command::EnqueueRecordState {
            id: SnapshotId(5),
            front: false
        }]
    );
    assert_eq!(
        feed(&mut e, received(ch("a", "b"), 1)),
        vec![record(5, ch("a", "b"), 3..4)]
    );
    // A topology without this process is refused.
    let without_b = Topology::full_mesh(["a", "c"].map(NodeId::from));
    assert_eq!(
        e.handle(Event::TopologyChanged {
            topology: without_b,
            what: "b removed".into()
        }),
        Outcome::Ignored(Ignored::NotAMember)
    );
}

/// An unaligned record request overtakes the inbox, and its early copy overtakes what the
/// application was handed: the application cuts before the last messages it was handed
/// and had not consumed. They are in flight at the cut: recorded ahead of the channel's
/// other recorded messages, and the cut counts them as not delivered.
#[test]
fn an_early_cut_records_what_the_application_was_handed_and_had_not_consumed() {
    let mut e = mesh_b();
    let p = plan(3, SnapshotMode::Unaligned, "a");
    feed(&mut e, received(ch("a", "b"), 5));
    feed(&mut e, delivered(ch("a", "b"), 5));
    feed(&mut e, received(ch("c", "b"), 4));
    feed(&mut e, delivered(ch("c", "b"), 3));
    // The marker on a->b: the request goes to the front; c->b's undelivered one is
    // channel state, and c->b stays open until its marker.
    assert_eq!(
        feed(&mut e, marker("a", &p)),
        vec![
            Command::EnqueueRecordState {
                id: SnapshotId(3),
                front: true
            },
            record(3, ch("c", "b"), 3..4),
            marker_out("a", &p, true),
            marker_out("c", &p, true),
        ]
    );
    // The application had consumed 3 of a->b's 5 and 1 of c->b's 3.
    assert_eq!(
        feed(
            &mut e,
            Event::StateRecorded {
                id: SnapshotId(3),
                unconsumed: vec![(ch("a", "b"), 2), (ch("c", "b"), 2)],
            }
        ),
        vec![record(3, ch("a", "b"), 3..5), record(3, ch("c", "b"), 1..3)]
    );
    let commands = feed(&mut e, marker("c", &p));
    let [Command::ReportLocalDone { report }] = &commands[..] else {
        panic!("expected the report, got {commands:?}");
    };
    assert_eq!(
        report.incoming[&ch("a", "b")],
        IncomingCut {
            delivered: 3,
            marker_at: 5
        }
    );
    assert_eq!(
        report.incoming[&ch("c", "b")],
        IncomingCut {
            delivered: 1,
            marker_at: 4
        }
    );
}

/// A cut earlier than the request is refused where it cannot be consistent: for a request
/// that did not overtake the inbox (an aligned snapshot has no channel state), for more
/// messages than were handed over, or for a channel that is not incoming.
#[test]
fn an_early_cut_that_cannot_be_consistent_fails_the_snapshot_naming_the_node() {
    type Case = (SnapshotMode, Vec<(ChannelId, u64)>, &'static str);
    let cases: [Case; 4] = [
        (
            SnapshotMode::ChandyLamport,
            vec![(ch("a", "b"), 1)],
            "did not overtake them",
        ),
        (
            SnapshotMode::Unaligned,
            vec![(ch("a", "b"), 6)],
            "only 5 were handed over",
        ),
        (
            SnapshotMode::Unaligned,
            vec![(ch("b", "a"), 1)],
            "not an incoming channel",
        ),
        (
            SnapshotMode::Unaligned,
            vec![(ch("a", "b"), 1), (ch("a", "b"), 1)],
            "twice",
        ),
    ];
    for (mode, unconsumed, words) in cases {
        let mut e = mesh_b();
        let p = plan(4, mode, "a");
        feed(&mut e, received(ch("a", "b"), 5));
        feed(&mut e, delivered(ch("a", "b"), 5));
        feed(&mut e, marker("a", &p));
        let commands = feed(
            &mut e,
            Event::StateRecorded {
                id: SnapshotId(4),
                unconsumed,
            },
        );
        let [
            Command::Abort {
                reason: FailureReason::BadCut { node, why },
                ..
            },
        ] = &commands[..]
        else {
            panic!("{mode:?}: expected an abort, got {commands:?}");
        };
        assert_eq!(node.as_str(), "b");
        assert!(why.contains(words), "{why}");
        assert_eq!(e.in_flight().count(), 0);
    }
}
