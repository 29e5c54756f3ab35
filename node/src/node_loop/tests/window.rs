//! The delivery window applies exactly while the application's `Consumed` stream is open.

use super::*;

/// Feeds up to `n` messages from b, a batch at a time as credits allow (they come back
/// as messages are handed over), taking what the loop hands the application as it goes.
/// Returns how many were handed over and how many fed: fewer than `n` when the window
/// held deliveries back and the credits ran out.
async fn feed(node: &Node, app: &mut App, seq: &mut u64, n: usize) -> (usize, usize) {
    let mut handed = 0;
    let mut fed = 0;
    while fed < n {
        let batch = BUFFER.min(n - fed);
        while node.credits(&ch("b", "a")) < batch {
            let got = drain(node, app).await;
            if got == 0 {
                return (handed, fed);
            }
            handed += got;
        }
        let items = (0..batch).map(|_| data("m")).collect();
        assert!(node.frames(0, *seq, items).await);
        *seq += batch as u64;
        fed += batch;
    }
    (handed + drain(node, app).await, fed)
}

/// Takes every delivery handed over: until, after a barrier, there is none (the loop
/// hands over before it takes its next message, so nothing more is deliverable then).
async fn drain(node: &Node, app: &mut App) -> usize {
    let mut handed = 0;
    loop {
        node.status().await;
        match app.rx.try_recv() {
            Ok(Ok(pb::NodeToApp {
                kind: Some(Kind::Deliver(d)),
            })) => handed += d.messages.len(),
            Ok(other) => panic!("expected a delivery, got {other:?}"),
            Err(_) => return handed,
        }
    }
}

/// A session whose `Consumed` stream never opens (refused, or an application without
/// one) gets everything, acknowledged or not; once the stream opens, at most the window
/// (1,024 messages before a pace is measured) goes unacknowledged; when it ends, the rest
/// follows. (A refused stream once left the window on with nothing acknowledged: the
/// application got 1,024 messages and then nothing, record requests included.)
#[tokio::test]
async fn the_delivery_window_applies_exactly_while_the_consumed_stream_is_open() {
    let node = Node::start(&["a", "b"], false);
    let mut app = node.attach(1, 4).await;
    assert!(matches!(app.next().await, Kind::Attached(_)));
    node.opened(B).await;
    let mut seq = 1;
    assert_eq!(feed(&node, &mut app, &mut seq, 1_500).await, (1_500, 1_500));
    let window = node.status().await.delivery_window.expect("attached");
    assert!(!window.acknowledges);
    assert_eq!((window.handed, window.consumed), (1_500, 0));

    // The stream opens: the application has consumed all it was handed.
    node.send(LoopMsg::AppWindow {
        session: 1,
        on: true,
    })
    .await;
    node.send(LoopMsg::AppConsumed {
        session: 1,
        messages: 1_500,
        bytes: 1_500,
    })
    .await;
    // 1,024 handed over, then the channel's credits' worth waits in the inbox.
    let (handed, fed) = feed(&node, &mut app, &mut seq, 1_500).await;
    assert_eq!((handed, fed), (1_024, 1_024 + BUFFER));
    let status = node.status().await;
    let window = status.delivery_window.expect("attached");
    assert!(window.acknowledges);
    assert_eq!((window.handed, window.consumed), (2_524, 1_500));
    assert_eq!(status.inbox_depth, BUFFER as u64);

    // A window of another session (one already replaced) changes nothing.
    node.send(LoopMsg::AppWindow {
        session: 2,
        on: false,
    })
    .await;
    assert_eq!(drain(&node, &mut app).await, 0);

    // The stream ends: the rest goes.
    node.send(LoopMsg::AppWindow {
        session: 1,
        on: false,
    })
    .await;
    assert_eq!(drain(&node, &mut app).await, BUFFER);
    assert_eq!(node.status().await.inbox_depth, 0);
    node.stop().await;
}
