//! Restore fencing and membership change.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use cairn_core::{FailureReason, SnapshotId};

use crate::node_loop::RestoreFeed;

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
        feed: RestoreFeed::whole(bytes(&["S"])),
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
        feed: RestoreFeed::whole(Vec::new()),
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

/// A restored state streams through the loop: its pieces are handed over as they come,
/// everything behind them waits (the replayed messages too), and each piece the application
/// takes gives the fetch its room back. A state that breaks off is aborted at the
/// application, which then gets nothing until a later restore; a restore superseded while
/// its state streams closes its fetch's room.
#[tokio::test]
async fn a_restored_state_streams_in_pieces_and_one_broken_off_is_aborted() {
    use tokio::sync::Semaphore;
    let mut node = Node::start(&["a", "b"], true);
    let mut app = node.attach(1, 16).await;
    assert!(matches!(app.next().await, Kind::Attached(_)));
    let restore = |id: &str, epoch, room: &Arc<Semaphore>, replayed| RestoreData {
        restore_id: id.into(),
        snapshot_id: 5,
        epoch,
        // The fetch is numbered by the epoch here.
        feed: RestoreFeed::new(epoch, room.clone()),
        incoming: BTreeMap::from([(ch("b", "a"), bytes(&[replayed]))]),
        outgoing: BTreeMap::new(),
    };
    let piece = |fetch: u64, piece: &'static str| LoopMsg::RestorePiece {
        fetch,
        piece: Bytes::from_static(piece.as_bytes()),
    };
    let chunk = |kind: Kind| match kind {
        Kind::Restore(r) => (r.restore_id, r.chunk, r.last),
        other => panic!("expected a piece of the restored state, got {other:?}"),
    };

    let room = Arc::new(Semaphore::new(2));
    node.send(LoopMsg::Restore(Box::new(restore("r1", 1, &room, "m0"))))
        .await;
    node.status().await;
    app.nothing_more(); // no piece yet: nothing, not even the replayed message
    for p in ["S1", "S2"] {
        room.acquire().await.unwrap().forget();
        node.send(piece(1, p)).await;
    }
    assert_eq!(
        chunk(app.next().await),
        ("r1".into(), Bytes::from("S1"), false)
    );
    assert_eq!(
        chunk(app.next().await),
        ("r1".into(), Bytes::from("S2"), false)
    );
    node.status().await;
    app.nothing_more(); // m0 waits behind the state's end
    assert_eq!(
        room.available_permits(),
        2,
        "pieces taken give their room back"
    );
    node.send(LoopMsg::RestoreEnd { fetch: 1 }).await;
    assert_eq!(chunk(app.next().await), ("r1".into(), Bytes::new(), true));
    assert_eq!(app.delivered().await, bytes(&["m0"]));
    assert!(
        room.is_closed(),
        "a state handed over whole closes its room"
    );
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

    // r2's state breaks off after a piece: the application drops it; nothing more comes.
    let room = Arc::new(Semaphore::new(2));
    node.send(LoopMsg::Restore(Box::new(restore("r2", 2, &room, "x0"))))
        .await;
    room.acquire().await.unwrap().forget();
    node.send(piece(2, "T1")).await;
    assert_eq!(
        chunk(app.next().await),
        ("r2".into(), Bytes::from("T1"), false)
    );
    node.send(LoopMsg::RestoreAborted {
        fetch: 2,
        reason: "the stream broke".into(),
    })
    .await;
    match app.next().await {
        Kind::RestoreAborted(a) => {
            assert_eq!(
                (a.restore_id.as_str(), a.reason.as_str()),
                ("r2", "the stream broke")
            );
        }
        other => panic!("expected the restore aborted, got {other:?}"),
    }
    assert!(room.is_closed(), "the fetch stops");
    node.send(LoopMsg::AppRestoreApplied {
        session: app.session,
        restore_id: "r2".into(),
    })
    .await;
    assert!(
        node.events().await.is_empty(),
        "an aborted restore is not applied"
    );
    app.nothing_more(); // x0 is not delivered onto a state of no epoch
    let mut pulled = node.pull(ch("a", "b")).await;
    node.app_send(&app, "void").await;
    node.status().await;
    assert!(answered(&mut pulled).is_none(), "sends stay void");

    // r3, superseded by r4 while its state streams: its room closes, and only r3 is
    // reported (r2 was, by its fetch).
    let room3 = Arc::new(Semaphore::new(2));
    node.send(LoopMsg::Restore(Box::new(restore("r3", 3, &room3, "y0"))))
        .await;
    assert!(node.events().await.is_empty());
    let room4 = Arc::new(Semaphore::new(2));
    node.send(LoopMsg::Restore(Box::new(restore("r4", 4, &room4, "z0"))))
        .await;
    node.status().await;
    assert!(room3.is_closed());
    assert!(!room4.is_closed());
    let events = node.events().await;
    assert!(
        matches!(&events[..], [NodeEvent::RestoreFailed { restore_id, message }]
            if restore_id == "r3" && message.contains("superseded by restore r4")),
        "{events:?}"
    );
    node.send(piece(3, "late")).await; // a late piece of r3 is dropped
    // A second fetch of r4 (sent twice): its pieces, end and abort touch nothing.
    node.send(piece(40, "twice")).await;
    node.send(LoopMsg::RestoreEnd { fetch: 40 }).await;
    node.send(LoopMsg::RestoreAborted {
        fetch: 40,
        reason: "the second fetch broke".into(),
    })
    .await;
    node.status().await;
    app.nothing_more();
    node.send(LoopMsg::RestoreEnd { fetch: 4 }).await;
    assert_eq!(chunk(app.next().await), ("r4".into(), Bytes::new(), true));
    assert_eq!(app.delivered().await, bytes(&["z0"]));
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

/// A member removed: its channels are dropped live. What was queued for it is dropped and
/// counted, frames of its stream still open are refused, a message of it already in the
/// inbox is still delivered, a send to it that raced the removal is dropped and counted, a
/// late pull or reset of its sending task is ignored, the application hears its new peers,
/// and the snapshot in flight fails with "membership changed".
#[tokio::test]
async fn a_removed_member_s_channels_are_dropped_live() {
    let mut node = Node::start(&["a", "b"], true);
    let mut app = node.attach(1, 1).await; // `Attached` fills the stream: the inbox waits
    node.opened(B).await;
    assert!(node.frames(0, 1, vec![data("m1")]).await);
    node.app_send(&app, "queued").await;
    node.send(LoopMsg::InitiatePlan { plan: plan(1) }).await;

    let shrunk = Arc::new(wiring(&["a"], Some(&node.shared.wiring())));
    node.ask(|reply| LoopMsg::Rewire {
        wiring: shrunk,
        what: "b removed".into(),
        reply,
    })
    .await;
    let events = node.events().await;
    assert!(
        matches!(&events[..], [NodeEvent::Failed(SnapshotId(1), FailureReason::MembershipChanged(what))]
            if what == "b removed"),
        "{events:?}"
    );
    let dropped = || node.shared.metrics.removed_peer_messages.get();
    assert_eq!(dropped(), 1, "the message queued for b");

    // b's stream, still open, is refused; a send to b that raced the removal is dropped.
    let kept = node
        .ask(|kept| LoopMsg::InboundFrames {
            channel: ch("b", "a"),
            incarnation: B,
            epoch: 0,
            first_seq: 2,
            items: vec![data("late")],
            kept,
        })
        .await;
    assert!(!kept);
    node.send(LoopMsg::AppSend {
        session: app.session,
        sends: vec![(ch("a", "b"), Bytes::from_static(b"raced"))],
    })
    .await;
    let _late_pull = node.pull(ch("a", "b")).await;
    node.send(LoopMsg::OutboundReset {
        channel: ch("a", "b"),
        link: Arc::new(ChannelHandles::new(BUFFER)),
        epoch: 0,
        requeue: bytes(&["unacked"]),
        lost_markers: Vec::new(),
    })
    .await;
    node.status().await;
    assert_eq!(
        dropped(),
        3,
        "and the raced send, and what the link handed back"
    );

    // The application: its peers first, then b's message it had received.
    assert!(matches!(app.next().await, Kind::Attached(_)));
    match app.next().await {
        Kind::Peers(p) => assert!(p.peers.is_empty(), "{p:?}"),
        other => panic!("expected the new peers, got {other:?}"),
    }
    assert_eq!(app.delivered().await, bytes(&["m1"]));
    node.status().await;
    app.nothing_more(); // the aborted snapshot's record request is not handed over
    assert!(node.status().await.snapshots_in_flight.is_empty());
    node.stop().await;
}

/// A channel task still in the old epoch can meet the peer's new incarnation after the node
/// entered a restore's epoch (seen in the nemesis: b restarted, the automatic restore
/// followed). Its reset, and a handshake checked in the old epoch, are stale: the restored
/// counts stand, and the next cut agrees with the peer's (which replays the same messages).
#[tokio::test]
async fn a_reset_or_an_open_of_a_past_epoch_leaves_the_restored_channels_alone() {
    let mut node = Node::start(&["a", "b"], true);
    let mut app = node.attach(1, 16).await;
    assert!(matches!(app.next().await, Kind::Attached(_)));
    assert_eq!(node.opened(B).await, 0);
    // Snapshot 1 completes here in epoch 0 (the one the restore below could be of).
    node.send(LoopMsg::InitiatePlan { plan: plan(1) }).await;
    assert!(matches!(app.next().await, Kind::RecordState(r) if r.snapshot_id == 1));
    node.app_state(&app, 1, "S1").await;
    assert!(node.frames(0, 1, vec![InItem::Marker(plan(1))]).await);
    let events = node.events().await;
    assert!(
        matches!(events.last(), Some(NodeEvent::PartReady(p)) if p.report.id == SnapshotId(1)),
        "{events:?}"
    );
    let restore = RestoreData {
        restore_id: "r1".into(),
        snapshot_id: 5,
        epoch: 1,
        feed: RestoreFeed::whole(bytes(&["S"])),
        incoming: BTreeMap::from([(ch("b", "a"), bytes(&["m0"]))]),
        outgoing: BTreeMap::from([(ch("a", "b"), 1)]),
    };
    node.send(LoopMsg::Restore(Box::new(restore))).await;
    let events = node.events().await;
    assert!(events.is_empty(), "nothing was in flight: {events:?}");
    let out_next = |status: &pb::NodeStatus| {
        let a_b = Some(pb::ChannelRef::from(&ch("a", "b")));
        let end = status.channels.iter().find(|c| c.channel == a_b);
        end.map(|c| (c.next_index, c.queued))
    };
    assert_eq!(out_next(&node.status().await), Some((1, 0)));

    // The task of epoch 0 hands back a frame and snapshot 1's marker it held, and resets
    // the channel: ignored but for the frame's credit; snapshot 1 is not failed.
    node.take_credits(&ch("a", "b"), 1);
    node.send(LoopMsg::OutboundReset {
        channel: ch("a", "b"),
        link: node.handles(&ch("a", "b")),
        epoch: 0,
        requeue: bytes(&["old"]),
        lost_markers: vec![SnapshotId(1)],
    })
    .await;
    let events = node.events().await;
    assert!(events.is_empty(), "{events:?}");
    assert!(node.part(1).await.is_ok(), "snapshot 1's part stands");
    assert_eq!(
        out_next(&node.status().await),
        Some((1, 0)),
        "the restored count stands, the old frame is not queued"
    );
    assert_eq!(node.credits(&ch("a", "b")), BUFFER);
    // b's handshake checked in epoch 0, from another incarnation, is refused.
    assert_eq!(node.opened_in(0, B + 1).await, None);

    // The application applies the state, takes the replayed message and sends one.
    assert!(matches!(app.next().await, Kind::Restore(_)));
    assert_eq!(app.delivered().await, bytes(&["m0"]));
    node.send(LoopMsg::AppRestoreApplied {
        session: app.session,
        restore_id: "r1".into(),
    })
    .await;
    node.app_send(&app, "after").await;
    // b opens in epoch 1 (its first contact there), and a snapshot is taken: the cut
    // counts the replayed message on both channels.
    assert_eq!(node.opened(B).await, 0);
    let mut pulled = node.pull(ch("a", "b")).await;
    node.status().await;
    let sent = answered(&mut pulled).expect("the message is pulled");
    assert!(matches!(&sent.frames[..], [OutFrame::Data(d)] if d == "after"));
    let mut pulled = node.pull(ch("a", "b")).await;
    node.send(LoopMsg::InitiatePlan { plan: plan(2) }).await;
    assert!(matches!(app.next().await, Kind::RecordState(r) if r.snapshot_id == 2));
    node.app_state(&app, 2, "S2").await;
    node.status().await;
    let sent = answered(&mut pulled).expect("the marker is pulled");
    assert!(matches!(&sent.frames[..], [m] if is_marker(m, 2)));
    assert!(node.frames(1, 1, vec![InItem::Marker(plan(2))]).await);
    let mut events = node.events().await;
    let Some(NodeEvent::PartReady(part)) = events.pop() else {
        panic!("expected the part: {events:?}");
    };
    let incoming = part.report.incoming[&ch("b", "a")];
    assert_eq!((incoming.delivered, incoming.marker_at), (1, 1));
    let outgoing = part.report.outgoing[&ch("a", "b")];
    assert_eq!(
        (outgoing.sent, outgoing.marker_at),
        (2, 2),
        "the replayed message and the one sent after"
    );
    node.stop().await;
}

/// The epoch a coordinator names at registration is entered only forwards: a past one (a
/// stale answer) is ignored, and its frames stay fenced out.
#[tokio::test]
async fn an_adopted_epoch_never_goes_back() {
    let node = Node::start(&["a", "b"], true);
    node.send(LoopMsg::AdoptEpoch { epoch: 3 }).await;
    assert_eq!(node.status().await.epoch, 3);
    node.send(LoopMsg::AdoptEpoch { epoch: 2 }).await;
    assert_eq!(node.status().await.epoch, 3);
    assert_eq!(*node.shared.epoch.borrow(), 3);
    // A handshake checked in the epoch offered is refused, as of any past one; one in
    // epoch 3 opens, and its frames are kept where frames of epoch 2 are not.
    assert_eq!(node.opened_in(2, B).await, None);
    node.opened(B).await;
    assert!(!node.frames(2, 1, vec![data("stale")]).await);
    assert_eq!(node.status().await.inbox_depth, 0);
    assert!(node.frames(3, 1, vec![data("fresh")]).await);
    assert_eq!(node.status().await.inbox_depth, 1);
    node.stop().await;
}

/// A member removed and added again gets new channel handles, and its new sending task
/// pulls with them. The old task, its shutdown not yet seen, says things about the same
/// channel id: its pull does not take the new task's place, its credits and its reset are
/// ignored (what it hands back is dropped as the removed member's).
#[tokio::test]
async fn a_re_added_member_s_old_task_cannot_take_the_new_task_s_pull() {
    let node = Node::start(&["a", "b"], true);
    let app = node.attach(1, 1).await;
    let old = node.handles(&ch("a", "b"));
    for (members, what) in [(&["a"][..], "b removed"), (&["a", "b"][..], "b added")] {
        let wiring = Arc::new(wiring(members, Some(&node.shared.wiring())));
        node.ask(|reply| LoopMsg::Rewire {
            wiring,
            what: what.into(),
            reply,
        })
        .await;
    }
    let new = node.handles(&ch("a", "b"));
    assert!(!Arc::ptr_eq(&old, &new), "b's channel was built anew");
    let mut pulled = node.pull(ch("a", "b")).await;
    // The old task: a pull, credits for the channel, a reset handing back a frame.
    let (reply, mut stale) = oneshot::channel();
    node.send(LoopMsg::Pull {
        channel: ch("a", "b"),
        link: old.clone(),
        max: 64,
        reply,
    })
    .await;
    node.send(LoopMsg::Credit {
        channel: ch("a", "b"),
        link: old.clone(),
        epoch: 0,
        limit: 0,
    })
    .await;
    node.send(LoopMsg::OutboundReset {
        channel: ch("a", "b"),
        link: old.clone(),
        epoch: 0,
        requeue: bytes(&["old"]),
        lost_markers: Vec::new(),
    })
    .await;
    node.app_send(&app, "new").await;
    node.status().await;
    // The new task's pull is answered with the new message, numbered from 0.
    let sent = answered(&mut pulled).expect("the new task's pull is answered");
    assert!(matches!(&sent.frames[..], [OutFrame::Data(d)] if d == "new"));
    assert!(
        matches!(stale.try_recv(), Err(oneshot::error::TryRecvError::Closed)),
        "the old task's pull is dropped unanswered"
    );
    // Nothing else queued: the old reset requeued nothing and renumbered nothing.
    let a_b = Some(pb::ChannelRef::from(&ch("a", "b")));
    let status = node.status().await;
    let end = status.channels.iter().find(|c| c.channel == a_b).unwrap();
    assert_eq!((end.next_index, end.queued), (1, 0));
    assert_eq!(
        node.shared.metrics.removed_peer_messages.get(),
        1,
        "the old frame"
    );
    node.stop().await;
}
