//! The snapshots' ends relayed to the application: asked for at attach and after every
//! registration, handed over in id order, each once per catch-up.

use cairn_core::SnapshotId;
use cairn_core::lifecycle::{Outcomes, SnapshotOutcome};

use super::*;

fn asks(events: Vec<NodeEvent>) -> Vec<u64> {
    events
        .into_iter()
        .filter_map(|e| match e {
            NodeEvent::OutcomesAfter(after) => Some(after),
            _ => None,
        })
        .collect()
}

fn outcomes(after: u64, ends: &[(u64, bool)], catch_up: bool) -> LoopMsg {
    let outcomes: Vec<SnapshotOutcome> = ends
        .iter()
        .map(|&(id, completed)| {
            if completed {
                SnapshotOutcome::completed(SnapshotId(id))
            } else {
                SnapshotOutcome::aborted(SnapshotId(id), "node n2 lost")
            }
        })
        .collect();
    let through = outcomes.last().map_or(after, |o| o.snapshot.0);
    LoopMsg::Outcomes(Outcomes {
        after,
        outcomes,
        through,
        catch_up,
    })
}

#[tokio::test]
async fn an_application_following_outcomes_hears_them_in_order_and_again_after_registering() {
    let mut node = Node::start(&["a", "b"], true);
    // An application that does not follow them asks for nothing.
    let app = node.attach(1, 8).await;
    assert_eq!(asks(node.events().await), Vec::<u64>::new());
    node.send(LoopMsg::AppDetached {
        session: app.session,
    })
    .await;

    let mut app = node.attach_following(2, 8, Some(3)).await;
    assert!(matches!(app.next().await, Kind::Attached(_)));
    assert_eq!(asks(node.events().await), vec![3]);
    // A push before the answer is left to the answer.
    node.send(outcomes(5, &[(6, true)], false)).await;
    node.send(outcomes(3, &[(4, false), (5, true), (6, true)], true))
        .await;
    match app.next().await {
        Kind::SnapshotAborted(a) => {
            assert_eq!((a.snapshot_id, a.reason.as_str()), (4, "node n2 lost"))
        }
        other => panic!("{other:?}"),
    }
    for id in [5, 6] {
        match app.next().await {
            Kind::SnapshotCompleted(c) => assert_eq!(c.snapshot_id, id),
            other => panic!("{other:?}"),
        }
    }
    // A push that skips what was told meanwhile is a gap: asked for from the cursor.
    node.send(outcomes(7, &[(8, true)], false)).await;
    assert_eq!(asks(node.events().await), vec![6]);
    // A new coordinator session: asked again from the cursor, whatever was pending.
    node.send(LoopMsg::Registered).await;
    assert_eq!(asks(node.events().await), vec![6]);
    node.send(outcomes(6, &[(7, true), (8, true)], true)).await;
    for id in [7, 8] {
        match app.next().await {
            Kind::SnapshotCompleted(c) => assert_eq!(c.snapshot_id, id),
            other => panic!("{other:?}"),
        }
    }
    node.status().await;
    app.nothing_more();
    // Gone: nothing is asked for it after a registration.
    node.send(LoopMsg::AppDetached {
        session: app.session,
    })
    .await;
    node.send(LoopMsg::Registered).await;
    assert_eq!(asks(node.events().await), Vec::<u64>::new());
    node.stop().await;
}
