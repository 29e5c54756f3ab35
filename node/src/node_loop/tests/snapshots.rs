//! Start, part ready, failure and abort.

use std::collections::BTreeSet;

use bytes::Bytes;
use cairn_core::{FailureReason, NodeId, Plan, SnapshotId, SnapshotMode};
use cairn_proto::v1 as pb;

use super::*;

/// Start: the coordinator makes a an initiator. The application is asked to record, the
/// snapshot is in flight, and once the state is recorded the marker goes out on a->b.
#[tokio::test]
async fn a_plan_starts_a_snapshot_the_application_records_and_the_marker_goes_out() {
    let mut node = Node::start(&["a", "b"], true);
    let mut app = node.attach(1, 16).await;
    assert!(matches!(app.next().await, Kind::Attached(a) if a.peers == ["b"]));
    let mut pulled = node.pull(ch("a", "b")).await;

    node.send(LoopMsg::InitiatePlan { plan: plan(1) }).await;
    assert!(matches!(app.next().await, Kind::RecordState(r) if r.snapshot_id == 1));
    let status = node.status().await;
    assert_eq!(status.snapshots_in_flight, [1]);
    assert!(
        answered(&mut pulled).is_none(),
        "no marker before the state"
    );
    assert!(node.events().await.is_empty());
    node.app_state(&app, 1, "S1").await;
    node.status().await;
    let pulled = answered(&mut pulled).expect("the marker is pulled");
    assert_eq!(pulled.epoch, 0);
    assert!(matches!(&pulled.frames[..], [m] if is_marker(m, 1)));

    // A plan that does not name this node as an initiator starts nothing here.
    let other = Plan::new(2, SnapshotMode::ChandyLamport, "b");
    node.send(LoopMsg::InitiatePlan { plan: other }).await;
    assert_eq!(node.status().await.snapshots_in_flight, [1]);
    // Nor can NodeAdmin reuse an id the node has met.
    let again = node
        .ask(|reply| LoopMsg::Initiate {
            id: SnapshotId(1),
            mode: SnapshotMode::ChandyLamport,
            alignment_timeout: None,
            reply,
        })
        .await;
    assert!(matches!(
        again,
        Err(Error::DuplicateSnapshot(SnapshotId(1)))
    ));
    node.stop().await;
}

/// Part ready: the state streams to the link as it comes, a message that arrives after the
/// state and before b's marker is recorded, and the part completes with its cut.
#[tokio::test]
async fn the_part_is_ready_with_the_state_the_recorded_message_and_the_cut() {
    let mut node = Node::start(&["a", "b"], true);
    let mut app = node.attach(1, 16).await;
    app.next().await; // Attached
    assert_eq!(node.opened(B).await, 0);
    node.send(LoopMsg::InitiatePlan { plan: plan(1) }).await;
    assert!(matches!(app.next().await, Kind::RecordState(_)));

    node.app_state(&app, 1, "S1").await;
    let events = node.events().await;
    assert!(
        matches!(&events[..], [NodeEvent::StateRecorded { id: SnapshotId(1), .. }, NodeEvent::StateChunk { id: SnapshotId(1), chunk }] if chunk.bytes == "S1"),
        "{events:?}"
    );

    // b sends "x", then its marker for snapshot 1.
    assert!(
        node.frames(0, 1, vec![data("x"), InItem::Marker(plan(1))])
            .await
    );
    assert_eq!(app.delivered().await, bytes(&["x"]));
    let mut events = node.events().await;
    let Some(NodeEvent::PartReady(part)) = events.pop() else {
        panic!("expected the part: {events:?}");
    };
    assert!(events.is_empty(), "{events:?}");
    assert_eq!(part.report.id, SnapshotId(1));
    assert_eq!(part.report.node, NodeId::new("a"));
    assert!(
        part.state.is_empty(),
        "with a coordinator the state went ahead"
    );
    assert_eq!(part.channels[&ch("b", "a")], [(0, Bytes::from("x"))]);
    let incoming = part.report.incoming[&ch("b", "a")];
    assert_eq!((incoming.delivered, incoming.marker_at), (0, 1));
    let outgoing = part.report.outgoing[&ch("a", "b")];
    assert_eq!((outgoing.sent, outgoing.marker_at), (0, 0));
    assert!(node.status().await.snapshots_in_flight.is_empty());

    // NodeAdmin reads the same part back, and its wire form carries the recorded range.
    let kept = node.part(1).await.expect("kept");
    let wire = pb::LocalSnapshot::from(&kept);
    assert_eq!((wire.snapshot_id, wire.node_id.as_str()), (1, "a"));
    assert_eq!(
        (wire.incoming[0].recorded_from, wire.incoming[0].recorded_to),
        (0, 1)
    );
    assert_eq!(wire.channel_states[0].messages[0].payload, "x");
    node.stop().await;
}

/// Without a coordinator, a snapshot started by hand keeps the state in its part.
#[tokio::test]
async fn without_a_coordinator_the_part_keeps_the_state() {
    let node = Node::start(&["a", "b"], false);
    let mut app = node.attach(1, 16).await;
    app.next().await; // Attached
    node.opened(B).await;
    let plan = node
        .ask(|reply| LoopMsg::Initiate {
            id: SnapshotId(3),
            mode: SnapshotMode::ChandyLamport,
            alignment_timeout: None,
            reply,
        })
        .await
        .expect("initiated");
    assert_eq!(plan.initiators, BTreeSet::from([NodeId::new("a")]));
    assert!(matches!(app.next().await, Kind::RecordState(r) if r.snapshot_id == 3));
    node.app_state(&app, 3, "state").await;
    assert!(node.frames(0, 1, vec![InItem::Marker(plan)]).await);
    node.status().await;
    let part = node.part(3).await.expect("complete");
    assert_eq!(part.state, "state");
    assert!(part.channels.is_empty());
    node.stop().await;
}

/// Failure: a node without an application fails a snapshot it has to record; a peer that
/// restarts fails the snapshot in flight, naming the channel; the link hears both.
#[tokio::test]
async fn snapshots_fail_without_an_application_and_when_a_peer_restarts() {
    let mut node = Node::start(&["a", "b"], true);
    node.send(LoopMsg::InitiatePlan { plan: plan(1) }).await;
    let events = node.events().await;
    assert!(
        matches!(&events[..], [NodeEvent::Failed(SnapshotId(1), FailureReason::NoApplication(n))] if n.as_str() == "a"),
        "{events:?}"
    );
    assert!(matches!(
        node.part(1).await,
        Err(Error::SnapshotFailed {
            reason: FailureReason::NoApplication(_),
            ..
        })
    ));
    assert!(matches!(node.part(9).await, Err(Error::NoSuchPart(_))));

    let mut app = node.attach(1, 16).await;
    app.next().await; // Attached
    node.opened(B).await;
    node.send(LoopMsg::InitiatePlan { plan: plan(2) }).await;
    assert!(matches!(app.next().await, Kind::RecordState(_)));
    // b comes back with a new incarnation.
    assert_eq!(node.opened(B + 1).await, 0);
    let events = node.events().await;
    assert!(
        matches!(&events[..], [NodeEvent::Failed(SnapshotId(2), FailureReason::ChannelReset(c))] if *c == ch("b", "a")),
        "{events:?}"
    );
    assert!(node.status().await.snapshots_in_flight.is_empty());

    // The application leaves while a snapshot waits for its state: that one fails too.
    node.send(LoopMsg::InitiatePlan { plan: plan(3) }).await;
    assert!(matches!(app.next().await, Kind::RecordState(_)));
    node.send(LoopMsg::AppDetached { session: 1 }).await;
    let events = node.events().await;
    assert!(
        matches!(
            &events[..],
            [NodeEvent::Failed(
                SnapshotId(3),
                FailureReason::NoApplication(_)
            )]
        ),
        "{events:?}"
    );
    node.stop().await;
}

/// Abort: the coordinator's abort ends the snapshot here without a report back; a record
/// request still waiting in the inbox is never handed over, and a late state is ignored.
#[tokio::test]
async fn an_abort_ends_the_snapshot_quietly_and_drops_its_waiting_record_request() {
    let mut node = Node::start(&["a", "b"], true);
    // Room for one message only: `Attached` fills it, so the record request waits.
    let mut app = node.attach(1, 1).await;
    node.send(LoopMsg::InitiatePlan { plan: plan(1) }).await;
    assert_eq!(node.status().await.inbox_depth, 1);
    node.send(LoopMsg::Abort {
        id: SnapshotId(1),
        reason: FailureReason::Aborted("by hand".into()),
    })
    .await;
    let status = node.status().await;
    assert!(status.snapshots_in_flight.is_empty());
    assert!(
        node.events().await.is_empty(),
        "an ordered abort is not reported"
    );
    assert!(matches!(
        node.part(1).await,
        Err(Error::SnapshotFailed { reason: FailureReason::Aborted(why), .. }) if why == "by hand"
    ));
    assert!(matches!(app.next().await, Kind::Attached(_)));
    node.status().await;
    app.nothing_more();

    // A snapshot aborted after its record request went out: the state that comes anyway
    // is ignored.
    node.send(LoopMsg::InitiatePlan { plan: plan(2) }).await;
    assert!(matches!(app.next().await, Kind::RecordState(r) if r.snapshot_id == 2));
    node.send(LoopMsg::Abort {
        id: SnapshotId(2),
        reason: FailureReason::Aborted("by hand".into()),
    })
    .await;
    node.app_state(&app, 2, "late").await;
    assert!(node.events().await.is_empty());
    assert!(node.status().await.snapshots_in_flight.is_empty());
    node.stop().await;
}
