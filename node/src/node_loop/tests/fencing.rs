//! Restore fencing and membership change.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use cairn_core::{FailureReason, SnapshotId};

use super::*;

/// Restore fencing: a Restore enters its epoch in one step. The snapshot in flight fails,
/// the inbox and queued frames of the old epoch are dropped (their credits come back),
/// frames of the old epoch are refused, the application gets its state and then the
/// replayed messages, and what it sends before it applied the state is void.
#[tokio::test]
async fn a_restore_fences_the_old_epoch_and_voids_sends_until_applied() {
    let mut node = Node::start(&["a", "b"], true);
    let mut app = node.attach(1, 1).await; // `Attached` fills the stream: the inbox waits
    node.opened(B).await;
    node.send(LoopMsg::InitiatePlan { plan: plan(1) }).await;
    assert!(node.frames(0, 1, vec![data("old1"), data("old2")]).await);
    assert_eq!(node.status().await.inbox_depth, 3); // record request, old1, old2
    assert_eq!(node.credits(&ch("b", "a")), BUFFER - 2);

    let restore = RestoreData {
        restore_id: "r1".into(),
        snapshot_id: 5,
        epoch: 1,
        state: bytes(&["S"]),
        incoming: BTreeMap::from([(ch("b", "a"), bytes(&["m0", "m1"]))]),
        outgoing: BTreeMap::from([(ch("a", "b"), 3)]),
    };
    node.send(LoopMsg::Restore(Box::new(restore))).await;
    let events = node.events().await;
    assert!(
        matches!(
            &events[..],
            [NodeEvent::Failed(SnapshotId(1), FailureReason::Restore)]
        ),
        "{events:?}"
    );
    let status = node.status().await;
    assert_eq!(status.epoch, 1);
    assert_eq!(*node.shared.epoch.borrow(), 1);
    assert!(status.snapshots_in_flight.is_empty());
    assert_eq!(status.inbox_depth, 3); // the restored state, m0, m1
    assert_eq!(
        node.credits(&ch("b", "a")),
        BUFFER,
        "dropped messages give credits back"
    );

    // A stream of the old epoch is refused: its frames are not kept.
    assert_eq!(node.opened(B).await, 0, "the channel starts over");
    assert!(!node.frames(0, 1, vec![data("stale")]).await);
    assert_eq!(node.credits(&ch("b", "a")), BUFFER);

    // The application gets the state, then the replayed messages, and nothing of the old
    // epoch.
    assert!(matches!(app.next().await, Kind::Attached(_)));
    match app.next().await {
        Kind::Restore(r) => {
            assert_eq!(
                (r.restore_id.as_str(), r.snapshot_id, r.epoch),
                ("r1", 5, 1)
            );
            assert_eq!((r.chunk, r.last), (Bytes::from("S"), true));
        }
        other => panic!("expected the restored state, got {other:?}"),
    }
    assert_eq!(app.delivered().await, bytes(&["m0", "m1"]));

    // Until the application applied the state, its sends are void.
    let mut pulled = node.pull(ch("a", "b")).await;
    node.app_send(&app, "void").await;
    node.status().await;
    assert!(answered(&mut pulled).is_none(), "a void send is not queued");
    assert_eq!(node.credits(&ch("a", "b")), BUFFER, "its credit comes back");

    node.send(LoopMsg::AppRestoreApplied {
        session: app.session,
        restore_id: "r1".into(),
    })
    .await;
    let events = node.events().await;
    assert!(
        matches!(&events[..], [NodeEvent::RestoreApplied { restore_id }] if restore_id == "r1"),
        "{events:?}"
    );
    node.app_send(&app, "after").await;
    node.status().await;
    let sent = answered(&mut pulled).expect("sends count again");
    assert_eq!(sent.epoch, 1);
    assert!(matches!(&sent.frames[..], [OutFrame::Data(d)] if d == "after"));

    // A restore of an epoch already passed fails at once.
    let stale = RestoreData {
        restore_id: "r0".into(),
        snapshot_id: 4,
        epoch: 0,
        state: Vec::new(),
        incoming: BTreeMap::new(),
        outgoing: BTreeMap::new(),
    };
    node.send(LoopMsg::Restore(Box::new(stale))).await;
    let events = node.events().await;
    assert!(
        matches!(&events[..], [NodeEvent::RestoreFailed { restore_id, message }]
            if restore_id == "r0" && message.contains("already in epoch 1")),
        "{events:?}"
    );
    assert_eq!(node.status().await.epoch, 1);
    node.stop().await;
}

/// Membership change: a Rewire publishes the new wiring, takes up the new channels, tells
/// the application its peers, and fails the snapshots in flight (planned over the old
/// topology) with "membership changed".
#[tokio::test]
async fn a_rewire_fails_snapshots_in_flight_with_membership_changed() {
    let mut node = Node::start(&["a", "b"], true);
    let mut app = node.attach(1, 16).await;
    app.next().await; // Attached
    node.send(LoopMsg::InitiatePlan { plan: plan(1) }).await;
    assert!(matches!(app.next().await, Kind::RecordState(_)));

    let grown = Arc::new(wiring(&["a", "b", "c"], Some(&node.shared.wiring())));
    let kept = node.handles(&ch("a", "b"));
    node.ask(|reply| LoopMsg::Rewire {
        wiring: grown,
        what: "c joined".into(),
        reply,
    })
    .await;
    let events = node.events().await;
    assert!(
        matches!(&events[..], [NodeEvent::Failed(SnapshotId(1), reason @ FailureReason::MembershipChanged(what))]
            if what == "c joined" && reason.to_string() == "membership changed: c joined"),
        "{events:?}"
    );
    let status = node.status().await;
    assert!(status.snapshots_in_flight.is_empty());
    assert_eq!(status.channels.len(), 4);
    assert!(
        Arc::ptr_eq(&kept, &node.handles(&ch("a", "b"))),
        "handles survive"
    );
    assert!(node.shared.channel(&ch("a", "c")).is_some(), "published");
    assert!(matches!(app.next().await, Kind::Peers(p) if p.peers == ["b", "c"]));

    // The next snapshot runs over the new topology: its marker goes to c too.
    let mut to_c = node.pull(ch("a", "c")).await;
    node.send(LoopMsg::InitiatePlan { plan: plan(2) }).await;
    assert!(matches!(app.next().await, Kind::RecordState(r) if r.snapshot_id == 2));
    node.app_state(&app, 2, "S2").await;
    node.status().await;
    let pulled = answered(&mut to_c).expect("a marker for c");
    assert!(matches!(&pulled.frames[..], [m] if is_marker(m, 2)));
    node.stop().await;
}
