//! The coordinator's side: the tracker's lifecycle and refusals, and the verifier's
//! verdicts, one violation at a time.

use std::collections::{BTreeMap, BTreeSet};

use cairn_core::{
    ChannelId, Consistent, FailureReason, IncomingCut, LocalReport, NodeId, NodePart, OutgoingCut,
    Side, SnapshotId, SnapshotMode, SnapshotTracker, StartError, StartRequest, Topology, Update,
    Violation, tracker::Outcome, tracker::Progress, verify,
};

fn ch(from: &str, to: &str) -> ChannelId {
    ChannelId::new(from, to)
}

fn pair() -> Topology {
    Topology::from_channels(["a", "b"].map(NodeId::from), [ch("a", "b")]).unwrap()
}

/// Parts for a -> b with the given counters and recorded indices.
fn parts(
    out: OutgoingCut,
    sender_recorded: Vec<u64>,
    inc: IncomingCut,
    receiver_recorded: Vec<u64>,
) -> BTreeMap<NodeId, NodePart> {
    let a = NodePart {
        report: LocalReport {
            id: SnapshotId(1),
            node: "a".into(),
            incoming: BTreeMap::new(),
            outgoing: BTreeMap::from([(ch("a", "b"), out)]),
        },
        recorded: BTreeMap::from([(ch("a", "b"), sender_recorded)]),
    };
    let b = NodePart {
        report: LocalReport {
            id: SnapshotId(1),
            node: "b".into(),
            incoming: BTreeMap::from([(ch("a", "b"), inc)]),
            outgoing: BTreeMap::new(),
        },
        recorded: BTreeMap::from([(ch("a", "b"), receiver_recorded)]),
    };
    BTreeMap::from([("a".into(), a), ("b".into(), b)])
}

#[test]
fn verifier_accepts_receiver_and_sender_parts_that_cover_sent_minus_delivered() {
    let p = parts(
        OutgoingCut {
            sent: 4,
            marker_at: 2,
        },
        vec![2, 3],
        IncomingCut {
            delivered: 1,
            marker_at: 2,
        },
        vec![1],
    );
    assert_eq!(
        verify(&pair(), &p),
        Ok(Consistent {
            recorded_messages: 3
        })
    );
}

#[test]
fn verifier_names_a_node_that_did_not_report() {
    let mut p = parts(
        OutgoingCut {
            sent: 0,
            marker_at: 0,
        },
        vec![],
        IncomingCut {
            delivered: 0,
            marker_at: 0,
        },
        vec![],
    );
    p.remove(&NodeId::from("b"));
    assert_eq!(verify(&pair(), &p), Err(Violation::MissingNode("b".into())));
}

#[test]
fn verifier_rejects_ends_that_disagree_on_the_marker() {
    let p = parts(
        OutgoingCut {
            sent: 2,
            marker_at: 2,
        },
        vec![],
        IncomingCut {
            delivered: 1,
            marker_at: 1,
        },
        vec![],
    );
    assert_eq!(
        verify(&pair(), &p),
        Err(Violation::MarkerMismatch {
            channel: ch("a", "b"),
            sender: 2,
            receiver: 1
        })
    );
}

#[test]
fn verifier_rejects_a_message_received_but_never_sent() {
    let p = parts(
        OutgoingCut {
            sent: 1,
            marker_at: 1,
        },
        vec![],
        IncomingCut {
            delivered: 2,
            marker_at: 1,
        },
        vec![],
    );
    assert_eq!(
        verify(&pair(), &p),
        Err(Violation::ReceivedNotSent {
            channel: ch("a", "b"),
            delivered: 2,
            sent: 1
        })
    );
}

#[test]
fn verifier_rejects_a_message_delivered_past_the_marker() {
    let p = parts(
        OutgoingCut {
            sent: 3,
            marker_at: 1,
        },
        vec![1, 2],
        IncomingCut {
            delivered: 2,
            marker_at: 1,
        },
        vec![],
    );
    assert_eq!(
        verify(&pair(), &p),
        Err(Violation::DeliveredPastMarker {
            channel: ch("a", "b"),
            delivered: 2,
            marker_at: 1
        })
    );
}

#[test]
fn verifier_rejects_a_missing_recorded_message_naming_the_side() {
    let p = parts(
        OutgoingCut {
            sent: 3,
            marker_at: 1,
        },
        vec![1],
        IncomingCut {
            delivered: 0,
            marker_at: 1,
        },
        vec![0],
    );
    let err = verify(&pair(), &p).unwrap_err();
    assert!(
        matches!(&err, Violation::WrongMessages { channel, side: Side::Sender, expected, .. }
            if *channel == ch("a", "b") && *expected == (1..3)),
        "{err:?}"
    );
    assert!(err.to_string().contains("a->b"), "{err}");
}

fn request(mode: SnapshotMode, initiators: &[&str]) -> StartRequest {
    StartRequest {
        mode,
        initiators: initiators.iter().map(|n| NodeId::from(*n)).collect(),
        alignment_timeout: None,
    }
}

#[test]
fn tracker_refuses_initiators_that_cannot_reach_every_node() {
    let mut t = SnapshotTracker::new(4);
    assert_eq!(
        t.start(
            SnapshotId(1),
            request(SnapshotMode::ChandyLamport, &["b"]),
            &pair()
        ),
        Err(StartError::Unreachable {
            initiators: BTreeSet::from(["b".into()]),
            unreachable: BTreeSet::from(["a".into()]),
        })
    );
}

#[test]
fn tracker_chooses_an_initiator_that_reaches_every_node() {
    let mut t = SnapshotTracker::new(4);
    let plan = t
        .start(SnapshotId(1), StartRequest::default(), &pair())
        .unwrap();
    assert_eq!(plan.initiators, BTreeSet::from(["a".into()]));
    let aligned = t
        .start(SnapshotId(2), request(SnapshotMode::Aligned, &[]), &pair())
        .unwrap();
    assert_eq!(aligned.initiators, BTreeSet::from(["a".into()]));
}

#[test]
fn tracker_starts_an_unaligned_snapshot_at_every_member_unless_told_otherwise() {
    let mut t = SnapshotTracker::new(4);
    let every = t
        .start(
            SnapshotId(1),
            request(SnapshotMode::Unaligned, &[]),
            &pair(),
        )
        .unwrap();
    assert_eq!(every.initiators, BTreeSet::from(["a".into(), "b".into()]));
    let named = t
        .start(
            SnapshotId(2),
            request(SnapshotMode::Unaligned, &["a"]),
            &pair(),
        )
        .unwrap();
    assert_eq!(named.initiators, BTreeSet::from(["a".into()]));
}

#[test]
fn tracker_refuses_past_its_limit_a_second_aligned_snapshot_and_strangers() {
    let topology = Topology::full_mesh(["a", "b"].map(NodeId::from));
    let mut t = SnapshotTracker::new(2);
    t.start(
        SnapshotId(1),
        request(SnapshotMode::Aligned, &["a"]),
        &topology,
    )
    .unwrap();
    assert_eq!(
        t.start(
            SnapshotId(2),
            request(SnapshotMode::Aligned, &["b"]),
            &topology
        ),
        Err(StartError::AlignedInFlight(SnapshotId(1)))
    );
    assert_eq!(
        t.start(
            SnapshotId(2),
            request(SnapshotMode::ChandyLamport, &["z"]),
            &topology
        ),
        Err(StartError::UnknownInitiator("z".into()))
    );
    t.start(
        SnapshotId(2),
        request(SnapshotMode::Unaligned, &["b"]),
        &topology,
    )
    .unwrap();
    assert_eq!(
        t.start(
            SnapshotId(3),
            request(SnapshotMode::ChandyLamport, &[]),
            &topology
        ),
        Err(StartError::TooManyInFlight { limit: 2 })
    );
}

#[test]
fn tracker_completes_a_snapshot_when_the_last_part_verifies() {
    let mut t = SnapshotTracker::new(1);
    t.start(
        SnapshotId(1),
        request(SnapshotMode::ChandyLamport, &["a"]),
        &pair(),
    )
    .unwrap();
    let mut p = parts(
        OutgoingCut {
            sent: 1,
            marker_at: 1,
        },
        vec![],
        IncomingCut {
            delivered: 0,
            marker_at: 1,
        },
        vec![0],
    );
    assert_eq!(
        t.part_reported(p.remove(&NodeId::from("a")).unwrap()),
        Update::Progress
    );
    assert_eq!(
        t.part_reported(p.remove(&NodeId::from("b")).unwrap()),
        Update::Finished(
            Outcome::Completed(Consistent {
                recorded_messages: 1
            }),
            Progress {
                recorded: vec!["a".into(), "b".into()],
                reported: vec!["a".into(), "b".into()],
            }
        )
    );
    assert_eq!(t.in_flight().count(), 0);
}

#[test]
fn tracker_fails_an_inconsistent_cut_with_its_violation() {
    let mut t = SnapshotTracker::new(1);
    t.start(
        SnapshotId(1),
        request(SnapshotMode::ChandyLamport, &["a"]),
        &pair(),
    )
    .unwrap();
    let p = parts(
        OutgoingCut {
            sent: 1,
            marker_at: 1,
        },
        vec![],
        IncomingCut {
            delivered: 0,
            marker_at: 1,
        },
        vec![],
    );
    let mut last = Update::Ignored;
    for part in p.into_values() {
        last = t.part_reported(part);
    }
    let Update::Finished(outcome, _) = last else {
        panic!("{last:?}")
    };
    assert!(matches!(
        outcome.violation(),
        Some(Violation::WrongMessages {
            side: Side::Receiver,
            ..
        })
    ));
}

#[test]
fn tracker_timeout_names_the_nodes_that_had_not_reported() {
    let mut t = SnapshotTracker::new(1);
    t.start(
        SnapshotId(1),
        request(SnapshotMode::ChandyLamport, &["a"]),
        &pair(),
    )
    .unwrap();
    let mut p = parts(
        OutgoingCut {
            sent: 0,
            marker_at: 0,
        },
        vec![],
        IncomingCut {
            delivered: 0,
            marker_at: 0,
        },
        vec![],
    );
    t.part_reported(p.remove(&NodeId::from("a")).unwrap());
    assert_eq!(
        t.timed_out(SnapshotId(1)),
        Update::Finished(
            Outcome::Failed(FailureReason::Timeout {
                missing: vec!["b".into()]
            }),
            Progress {
                recorded: vec!["a".into()],
                reported: vec!["a".into()],
            }
        )
    );
    assert_eq!(t.timed_out(SnapshotId(1)), Update::Ignored);
}

#[test]
fn tracker_fails_every_snapshot_through_a_lost_node() {
    let topology = Topology::full_mesh(["a", "b"].map(NodeId::from));
    let mut t = SnapshotTracker::new(3);
    t.start(
        SnapshotId(1),
        request(SnapshotMode::ChandyLamport, &["a"]),
        &topology,
    )
    .unwrap();
    t.start(
        SnapshotId(2),
        request(SnapshotMode::Unaligned, &["b"]),
        &topology,
    )
    .unwrap();
    let lost = t.node_lost(&"b".into());
    let nothing = Progress {
        recorded: Default::default(),
        reported: Default::default(),
    };
    assert_eq!(
        lost,
        vec![
            (
                SnapshotId(1),
                Update::Finished(
                    Outcome::Failed(FailureReason::NodeLost("b".into())),
                    nothing.clone()
                )
            ),
            (
                SnapshotId(2),
                Update::Finished(
                    Outcome::Failed(FailureReason::NodeLost("b".into())),
                    nothing
                )
            ),
        ]
    );
}
