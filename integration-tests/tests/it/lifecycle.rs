//! Snapshot lifecycle to applications, with real processes: an application that follows
//! the snapshots' ends hears each once the coordinator stored it, in id order; one that
//! attaches again naming a lower id hears them again (at least once); and after a
//! coordinator restart, an end the restarted coordinator stored without pushing it (the
//! snapshot it failed at its start) is caught up.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cairn_cli::bank::BankState;
use cairn_integration_tests::coordinated::{CoordinatedCluster, Store};
use cairn_rpc::v1 as pb;
use cairn_sdk::{AppEvent, AppSession, AttachOptions};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// An end as the application heard it: the snapshot, and why it failed (`None`: completed).
type Heard = (u64, Option<String>);

/// An application on a node without a bank that follows the snapshots' ends above `after`
/// and hands each to `heard`; it answers record requests (an empty bank's state) only while
/// `answer` is set.
fn following_app(
    address: String,
    after: u64,
    answer: Arc<AtomicBool>,
    heard: mpsc::UnboundedSender<Heard>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let options = AttachOptions {
            snapshot_outcomes_after: Some(after),
        };
        let mut session = loop {
            match AppSession::attach(&address, "following", None, options.clone()).await {
                Ok(s) => break s,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        let sender = session.sender();
        while let Ok(Some(event)) = session.next_event().await {
            match event {
                AppEvent::RecordState { snapshot_id } => {
                    while !answer.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let state = serde_json::to_vec(&BankState::default()).unwrap();
                    let _ = sender.state_recorded(snapshot_id, state.into());
                }
                AppEvent::SnapshotCompleted { snapshot_id } => {
                    let _ = heard.send((snapshot_id, None));
                }
                AppEvent::SnapshotAborted {
                    snapshot_id,
                    reason,
                } => {
                    let _ = heard.send((snapshot_id, Some(reason)));
                }
                AppEvent::Message { .. }
                | AppEvent::Restore { .. }
                | AppEvent::RestorePiece { .. }
                | AppEvent::RestoreAborted { .. } => {}
            }
        }
    })
}

/// The next `n` ends heard, each within 30 s.
async fn next_heard(rx: &mut mpsc::UnboundedReceiver<Heard>, n: usize) -> Vec<Heard> {
    let mut out = Vec::new();
    for _ in 0..n {
        let next = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("an end heard within 30 s; heard {out:?}"))
            .expect("the application runs");
        out.push(next);
    }
    out
}

fn start(mode: pb::SnapshotMode, timeout_ms: u64) -> pb::StartSnapshotRequest {
    pb::StartSnapshotRequest {
        mode: mode as i32,
        timeout_ms,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applications_hear_stored_ends_in_order_again_on_reattach_and_after_a_coordinator_restart()
{
    let mut cluster = CoordinatedCluster::start(3, Store::Embedded, &[2], &[])
        .await
        .unwrap();
    let answer = Arc::new(AtomicBool::new(true));
    let (heard_tx, mut heard) = mpsc::unbounded_channel();
    let app = following_app(
        cluster.nodes[2].app.clone(),
        0,
        answer.clone(),
        heard_tx.clone(),
    );
    cluster.wait_ready(2).await.unwrap();

    // One completes; one fails (n3 holds its state past the timeout); one completes.
    let first = cluster
        .start_snapshot(start(pb::SnapshotMode::Unaligned, 20_000))
        .await
        .unwrap();
    assert_eq!(
        cluster.wait(first).await.unwrap().status,
        pb::SnapshotStatus::Completed as i32
    );
    assert_eq!(next_heard(&mut heard, 1).await, vec![(first, None)]);
    answer.store(false, Ordering::Relaxed);
    let failed = cluster
        .start_snapshot(start(pb::SnapshotMode::ChandyLamport, 1_000))
        .await
        .unwrap();
    let snapshot = cluster.wait(failed).await.unwrap();
    assert_eq!(snapshot.status, pb::SnapshotStatus::Failed as i32);
    let stored_reason = snapshot.failure.unwrap().message;
    answer.store(true, Ordering::Relaxed);
    let third = cluster
        .start_snapshot(start(pb::SnapshotMode::Aligned, 20_000))
        .await
        .unwrap();
    assert_eq!(
        cluster.wait(third).await.unwrap().status,
        pb::SnapshotStatus::Completed as i32
    );
    let got = next_heard(&mut heard, 2).await;
    assert_eq!(got[0].0, failed);
    assert_eq!(
        got[0].1.as_deref(),
        Some(stored_reason.as_str()),
        "the stored reason"
    );
    assert_eq!(got[1], (third, None));

    // The application goes away and attaches again naming the first: it hears the rest
    // again, in order (at least once).
    app.abort();
    let _ = app.await;
    let app = following_app(
        cluster.nodes[2].app.clone(),
        first,
        answer.clone(),
        heard_tx.clone(),
    );
    let again = next_heard(&mut heard, 2).await;
    assert_eq!(
        again.iter().map(|h| h.0).collect::<Vec<_>>(),
        vec![failed, third]
    );
    cluster.wait_ready(2).await.unwrap();

    // A snapshot in flight when the coordinator dies: the restarted coordinator fails it at
    // its start and pushes that to nobody; the daemon's catch-up after registering again
    // tells it, then the next snapshot's completion follows.
    answer.store(false, Ordering::Relaxed);
    let lost = cluster
        .start_snapshot(start(pb::SnapshotMode::ChandyLamport, 60_000))
        .await
        .unwrap();
    cluster.wait_recorded(lost, 2).await.unwrap();
    cluster.kill_coordinator();
    cluster.start_coordinator().unwrap();
    cluster.wait_registered(3).await.unwrap();
    answer.store(true, Ordering::Relaxed);
    let got = next_heard(&mut heard, 1).await;
    assert_eq!(got[0].0, lost, "{got:?}");
    let reason = got[0].1.as_deref().expect("failed");
    assert!(reason.contains("coordinator restarted"), "{reason}");
    let next = cluster
        .start_snapshot(start(pb::SnapshotMode::Unaligned, 20_000))
        .await
        .unwrap();
    assert_eq!(
        cluster.wait(next).await.unwrap().status,
        pb::SnapshotStatus::Completed as i32
    );
    assert_eq!(next_heard(&mut heard, 1).await, vec![(next, None)]);
    // Nothing was told twice within the session, nor out of order.
    assert!(heard.try_recv().is_err());
    app.abort();
}
