//! Restore with the bank: take a snapshot during transfers, keep transferring, restore it;
//! once the replayed messages are delivered (and transfers paused), every balance is its
//! recorded balance plus the recorded money in flight to it — in each mode, and after a
//! node is killed and restarted under automatic recovery. A restore fails the snapshot it
//! races with, blocks new ones while it runs, and refuses what it cannot do by name.

use std::time::Duration;

use cairn_integration_tests::coordinated::{CoordinatedCluster, Store, channel_fault};
use cairn_integration_tests::processes::eventually;
use cairn_integration_tests::restore::{
    assert_restored, moved_on, restore, snapshot, wait_newest_restore, wait_restore,
};
use cairn_proto::v1 as pb;
use cairn_sdk::{AppEvent, AppSession};
use tonic::Code;

const MODES: [pb::SnapshotMode; 3] = [
    pb::SnapshotMode::ChandyLamport,
    pb::SnapshotMode::Unaligned,
    pb::SnapshotMode::Aligned,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restoring_a_snapshot_of_each_mode_brings_back_balances_and_money_in_flight() {
    let cluster = CoordinatedCluster::start(3, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let mut last = None;
    for mode in MODES {
        cluster.set_workload(200.0).await.unwrap();
        let taken = snapshot(&cluster, mode).await;
        moved_on(&cluster, &taken).await;
        cluster.set_workload(0.0).await.unwrap();
        let id = taken.plan.as_ref().unwrap().snapshot_id;
        let op = restore(&cluster, id).await.unwrap();
        assert_eq!((op.snapshot_id, op.requested_by.as_str()), (id, "user"));
        assert_eq!(op.nodes.len(), 3);
        let op = wait_restore(&cluster, &op.restore_id).await;
        assert!(op.done, "{mode:?}: {:?}", op.failure);
        assert_restored(&cluster, &taken).await;
        // The cluster goes on in the new epoch: transfers, and snapshots that add up.
        cluster.set_workload(200.0).await.unwrap();
        moved_on(&cluster, &taken).await;
        for after in MODES {
            last = Some(snapshot(&cluster, after).await);
        }
    }
    let mut client = cluster.client().await.unwrap();
    let restores = client
        .list_restores(pb::ListRestoresRequest::default())
        .await
        .unwrap()
        .into_inner()
        .restores;
    assert_eq!(restores.len(), 3);
    assert!(
        restores.windows(2).all(|w| w[0].epoch > w[1].epoch),
        "newest first"
    );
    // The wire names the epoch a snapshot was taken in; a restore conditional on an epoch
    // the cluster left is refused, on the one it is in goes through.
    let (now, before) = (restores[0].epoch, restores[1].epoch);
    let last = last.unwrap().plan.unwrap();
    assert_eq!(last.epoch, now, "taken after the newest restore");
    let ask = |if_epoch| pb::RestoreSnapshotRequest {
        snapshot_id: last.snapshot_id,
        if_epoch: Some(if_epoch),
    };
    let stale = client.restore_snapshot(ask(before)).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition, "{stale:?}");
    assert!(
        stale
            .message()
            .starts_with(&format!("the cluster is in epoch {now}, not {before}")),
        "{stale:?}"
    );
    let op = client
        .restore_snapshot(ask(now))
        .await
        .unwrap()
        .into_inner();
    assert!(wait_restore(&cluster, &op.restore_id).await.done);
}

/// A restore as the test application hands it to the test: its id and state, a sender to
/// acknowledge it with, and the signal to go on receiving.
type HeldRestore = (
    String,
    bytes::Bytes,
    cairn_sdk::AppSender,
    tokio::sync::oneshot::Sender<()>,
);

/// A test application on a node: records `state`; on a restore, hands it to the test and
/// receives nothing more (so the session does not acknowledge it) until told to go on.
fn test_app(
    mut session: AppSession,
    state: &'static str,
) -> tokio::sync::mpsc::UnboundedReceiver<HeldRestore> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let sender = session.sender();
        while let Ok(Some(event)) = session.next_event().await {
            match event {
                AppEvent::RecordState { snapshot_id } => {
                    let _ = sender.state_recorded(snapshot_id, state.into());
                }
                AppEvent::Restore {
                    restore_id, state, ..
                } => {
                    let (go, wait) = tokio::sync::oneshot::channel();
                    let _ = tx.send((restore_id, state, sender.clone(), go));
                    let _ = wait.await;
                }
                AppEvent::Message { .. }
                | AppEvent::RestorePiece { .. }
                | AppEvent::RestoreAborted { .. }
                | AppEvent::SnapshotCompleted { .. }
                | AppEvent::SnapshotAborted { .. } => {}
            }
        }
    });
    rx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_fails_the_snapshot_it_races_and_blocks_new_ones_until_applied() {
    use pb::inject_fault_request::Fault;
    let mut cluster = CoordinatedCluster::start_with(
        3,
        Store::Embedded,
        &[2],
        &["--restore-timeout", "60s"],
        &["--fault-injection"],
    )
    .await
    .unwrap();
    let session = AppSession::connect(&cluster.nodes[2].app, "restore-test")
        .await
        .unwrap();
    let mut restores = test_app(session, "custom-state");
    cluster.wait_ready(2).await.unwrap();
    let first = cluster
        .completed(pb::StartSnapshotRequest::default())
        .await
        .unwrap();

    // A snapshot held in flight by a held channel...
    let mut n2 = cluster.admin(1).await.unwrap();
    let hold = |fault| channel_fault("n1", "n2", fault);
    n2.inject_fault(hold(Fault::Hold(pb::Hold {})))
        .await
        .unwrap();
    let held = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            initiators: vec!["n1".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    cluster.wait_recorded(held, 1).await.unwrap();
    // ...fails, naming the restore, when one starts.
    let op = restore(&cluster, first.plan.as_ref().unwrap().snapshot_id)
        .await
        .unwrap();
    let failed = cluster.wait_with(held, false).await.unwrap();
    assert_eq!(failed.status, pb::SnapshotStatus::Failed as i32);
    let failure = failed.failure.unwrap();
    assert_eq!(
        failure.kind,
        pb::failure_reason::Kind::Restore as i32,
        "{failure:?}"
    );
    assert!(failure.message.contains("restore"), "{}", failure.message);
    n2.inject_fault(hold(Fault::Resume(pb::Resume {})))
        .await
        .unwrap();

    // n3's application holds the restore unapplied: snapshots and restores wait.
    let (restore_id, state, sender, go) = restores.recv().await.unwrap();
    assert_eq!(restore_id, op.restore_id);
    assert_eq!(&state[..], b"custom-state");
    let refused = cluster
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(refused.message().contains(&op.restore_id), "{refused:?}");
    let refused = restore(&cluster, first.plan.as_ref().unwrap().snapshot_id)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(refused.message().contains("in progress"), "{refused:?}");
    let pending = cluster
        .client()
        .await
        .unwrap()
        .get_restore(pb::GetRestoreRequest {
            restore_id: op.restore_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!pending.done && pending.failure.is_none());
    assert!(!pending.applied.contains(&"n3".to_owned()), "{pending:?}");

    // Applied: the restore is done and snapshots complete again.
    sender.restore_applied(&restore_id).unwrap();
    go.send(()).unwrap();
    let op = wait_restore(&cluster, &op.restore_id).await;
    assert!(op.done, "{:?}", op.failure);
    let after = cluster
        .completed(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    assert!(after.verdict.unwrap().consistent);

    // What cannot be restored is refused by name.
    let unknown = restore(&cluster, 999).await.unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    let not_completed = restore(&cluster, held).await.unwrap_err();
    assert_eq!(not_completed.code(), Code::FailedPrecondition);
    assert!(
        not_completed.message().contains("only a COMPLETED"),
        "{not_completed:?}"
    );
    cluster.kill_node(0);
    let missing = eventually("n1 is seen gone", Duration::from_secs(30), || async {
        match restore(&cluster, first.plan.as_ref().unwrap().snapshot_id).await {
            Err(status) if status.message().contains("n1") => Ok(status),
            other => anyhow::bail!("{other:?}"),
        }
    })
    .await
    .unwrap();
    assert_eq!(missing.code(), Code::FailedPrecondition);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_recovery_restores_the_newest_snapshot_after_a_node_restarts() {
    let mut cluster = CoordinatedCluster::start(3, Store::Embedded, &[], &["--auto-restore"])
        .await
        .unwrap();
    let taken = snapshot(&cluster, pb::SnapshotMode::Unaligned).await;
    moved_on(&cluster, &taken).await;
    cluster.set_workload(0.0).await.unwrap();

    // n2 crashes and comes back with a fresh bank (initial balance): without a restore,
    // money would appear from nowhere.
    cluster.kill_node(1);
    cluster.bank_workload = 0.0;
    cluster.start_node(1).unwrap();
    let op = wait_newest_restore(&cluster).await;
    assert!(op.done, "{:?}", op.failure);
    assert_eq!(op.snapshot_id, taken.plan.as_ref().unwrap().snapshot_id);
    assert!(
        op.requested_by.starts_with("automatic recovery") && op.requested_by.contains("n2"),
        "{}",
        op.requested_by
    );
    assert_restored(&cluster, &taken).await;
    cluster.set_workload(200.0).await.unwrap();
    moved_on(&cluster, &taken).await;
    snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
}

/// A restore is durable: the coordinator killed (-9) while a node's application holds its
/// restored state unapplied resumes the restore when it comes back instead of failing it,
/// keeps every snapshot from starting (naming the restore) until that node has applied it,
/// and refuses to delete the snapshot being restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_survives_a_coordinator_crash_and_fences_the_cluster_until_applied() {
    let mut cluster = CoordinatedCluster::start_with(
        3,
        Store::Embedded,
        &[2],
        &["--restore-timeout", "120s"],
        &[],
    )
    .await
    .unwrap();
    let session = AppSession::connect(&cluster.nodes[2].app, "restore-test")
        .await
        .unwrap();
    let mut restores = test_app(session, "custom-state");
    cluster.wait_ready(2).await.unwrap();
    let first = cluster
        .completed(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    let snapshot_id = first.plan.as_ref().unwrap().snapshot_id;
    let op = restore(&cluster, snapshot_id).await.unwrap();
    let (restore_id, _state, sender, go) = restores.recv().await.unwrap();
    assert_eq!(restore_id, op.restore_id);

    // The snapshot being restored cannot be deleted.
    let refused = cluster
        .client()
        .await
        .unwrap()
        .delete_snapshot(pb::DeleteSnapshotRequest { snapshot_id })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(refused.message().contains(&op.restore_id), "{refused:?}");

    // The coordinator dies in the middle of the restore and comes back.
    cluster.kill_coordinator();
    cluster.start_coordinator().unwrap();
    cluster.wait_registered(3).await.unwrap();
    let refused = eventually(
        "a fenced StartSnapshot",
        Duration::from_secs(30),
        || async {
            match cluster
                .start_snapshot(pb::StartSnapshotRequest::default())
                .await
            {
                Err(e) if e.to_string().contains(&op.restore_id) => Ok(e.to_string()),
                other => anyhow::bail!("{other:?}"),
            }
        },
    )
    .await
    .unwrap();
    assert!(refused.contains("in progress"), "{refused}");
    let pending = cluster
        .client()
        .await
        .unwrap()
        .get_restore(pb::GetRestoreRequest {
            restore_id: op.restore_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        !pending.done && pending.failure.is_none(),
        "the restarted coordinator resumes the restore: {pending:?}"
    );

    // n3 applies: the restore is done with every node, and snapshots complete again.
    sender.restore_applied(&restore_id).unwrap();
    go.send(()).unwrap();
    let op = wait_restore(&cluster, &op.restore_id).await;
    assert!(op.done, "{:?}", op.failure);
    assert_eq!(op.applied.len(), 3, "{op:?}");
    let after = cluster
        .completed(pb::StartSnapshotRequest::default())
        .await
        .unwrap();
    assert!(after.verdict.is_some_and(|v| v.consistent));
}

/// The coordinator killed (-9) right after it started a restore, before or while the nodes
/// fetch their shares: when it comes back every node ends on the restored state (none
/// enters the new epoch with its live state), and the money adds up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_cut_short_by_a_coordinator_crash_still_restores_every_node() {
    let mut cluster = CoordinatedCluster::start(3, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let taken = snapshot(&cluster, pb::SnapshotMode::Unaligned).await;
    moved_on(&cluster, &taken).await;
    cluster.set_workload(0.0).await.unwrap();
    let id = taken.plan.as_ref().unwrap().snapshot_id;
    let op = restore(&cluster, id).await.unwrap();
    cluster.kill_coordinator();
    cluster.start_coordinator().unwrap();
    let op = wait_restore(&cluster, &op.restore_id).await;
    assert!(op.done, "{:?}", op.failure);
    assert_restored(&cluster, &taken).await;
    cluster.set_workload(200.0).await.unwrap();
    moved_on(&cluster, &taken).await;
    snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
}

/// Restore, start, abort and delete calls racing each other are taken one at a time: once
/// they settle, every node is in one epoch and snapshots add up again (after one more
/// restore if the last one raced into a failure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_restore_start_and_delete_calls_leave_one_state() {
    let cluster = CoordinatedCluster::start(3, Store::Embedded, &[], &[])
        .await
        .unwrap();
    let a = snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
    let b = snapshot(&cluster, pb::SnapshotMode::Unaligned).await;
    let (a, b) = (
        a.plan.as_ref().unwrap().snapshot_id,
        b.plan.as_ref().unwrap().snapshot_id,
    );
    let mut calls = Vec::new();
    for i in 0..24u64 {
        let client = cluster.client().await.unwrap();
        calls.push(tokio::spawn(async move {
            let mut client = client;
            match i % 4 {
                0 => client
                    .restore_snapshot(pb::RestoreSnapshotRequest {
                        snapshot_id: if i % 8 == 0 { a } else { b },
                        if_epoch: None,
                    })
                    .await
                    .map(|_| ()),
                1 => client
                    .start_snapshot(pb::StartSnapshotRequest::default())
                    .await
                    .map(|_| ()),
                2 => client
                    .delete_snapshot(pb::DeleteSnapshotRequest { snapshot_id: b })
                    .await
                    .map(|_| ()),
                _ => client
                    .abort_snapshot(pb::AbortSnapshotRequest {
                        snapshot_id: i / 4 + b,
                        reason: "racing".into(),
                    })
                    .await
                    .map(|_| ()),
            }
        }));
    }
    for call in calls {
        // Refusals are expected; a panic or a dropped connection is not.
        if let Err(status) = call.await.unwrap() {
            assert_ne!(status.code(), Code::Unavailable, "{status:?}");
            assert_ne!(status.code(), Code::Internal, "{status:?}");
        }
    }
    // Let the last restore end; if none is done, restore the first snapshot once more.
    let newest = eventually("the restores end", Duration::from_secs(90), || async {
        let restores = cluster
            .client()
            .await?
            .list_restores(pb::ListRestoresRequest::default())
            .await?
            .into_inner()
            .restores;
        let newest = restores.into_iter().next();
        anyhow::ensure!(
            newest
                .as_ref()
                .is_none_or(|r| r.done || r.failure.is_some()),
            "in progress"
        );
        Ok(newest)
    })
    .await
    .unwrap();
    if !newest.as_ref().is_some_and(|r| r.done) {
        let op = restore(&cluster, a).await.unwrap();
        assert!(wait_restore(&cluster, &op.restore_id).await.done);
    }
    let mut epochs = std::collections::BTreeSet::new();
    for i in 0..3 {
        let status = cluster
            .admin(i)
            .await
            .unwrap()
            .get_node_status(pb::GetNodeStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        epochs.insert(status.epoch);
    }
    assert_eq!(epochs.len(), 1, "nodes in epochs {epochs:?}");
    snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
    snapshot(&cluster, pb::SnapshotMode::Aligned).await;
}
