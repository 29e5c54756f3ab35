//! Restoring the bank: what each bank must hold after a restore, and the calls and waits
//! the restore tests share.

use std::collections::BTreeMap;
use std::time::Duration;

use cairn_cli::bank::{BankState, TransferPayload};
use cairn_proto::bank::v1 as bank;
use cairn_proto::v1 as pb;

use crate::coordinated::{CoordinatedCluster, assert_completed};
use crate::processes::eventually;

/// What each bank must hold after restoring `snapshot`: its recorded balance plus the
/// recorded transfers in flight to it (recorded by either end of the channel).
pub fn expected_balances(snapshot: &pb::Snapshot) -> BTreeMap<String, u64> {
    let mut expected = BTreeMap::new();
    for node in &snapshot.nodes {
        let state: BankState = serde_json::from_slice(&node.local_state).unwrap();
        *expected.entry(node.node_id.clone()).or_default() += state.balance;
    }
    for node in &snapshot.nodes {
        for channel in &node.channel_states {
            let to = channel.channel.as_ref().unwrap().to.clone();
            for m in &channel.messages {
                *expected.entry(to.clone()).or_default() +=
                    TransferPayload::decode(&m.payload).unwrap().amount;
            }
        }
    }
    expected
}

/// Every bank's balance now, by node.
pub async fn balances(cluster: &CoordinatedCluster) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    for (i, node) in cluster.nodes.iter().enumerate() {
        if node.bank.is_some() {
            let b = cluster
                .bank(i)
                .await?
                .get_balance(bank::GetBalanceRequest {})
                .await?
                .into_inner();
            out.insert(b.node_id, b.balance);
        }
    }
    Ok(out)
}

/// Asks the coordinator to restore `snapshot_id`.
pub async fn restore(
    cluster: &CoordinatedCluster,
    snapshot_id: u64,
) -> Result<pb::RestoreOperation, tonic::Status> {
    let mut client = cluster
        .client()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    Ok(client
        .restore_snapshot(pb::RestoreSnapshotRequest {
            snapshot_id,
            if_epoch: None,
        })
        .await?
        .into_inner())
}

/// Waits until a restore ends (done or failed) and returns it.
pub async fn wait_restore(cluster: &CoordinatedCluster, restore_id: &str) -> pb::RestoreOperation {
    eventually(
        &format!("{restore_id} ends"),
        Duration::from_secs(60),
        || async {
            let op = cluster
                .client()
                .await?
                .get_restore(pb::GetRestoreRequest {
                    restore_id: restore_id.to_owned(),
                })
                .await?
                .into_inner();
            anyhow::ensure!(
                op.done || op.failure.is_some(),
                "in progress: {:?}",
                op.applied
            );
            Ok(op)
        },
    )
    .await
    .unwrap()
}

/// Waits until every bank holds what restoring `snapshot` must give it.
pub async fn assert_restored(cluster: &CoordinatedCluster, snapshot: &pb::Snapshot) {
    let expected = expected_balances(snapshot);
    let id = snapshot.plan.as_ref().unwrap().snapshot_id;
    let got = eventually("the restored balances", Duration::from_secs(30), || async {
        let got = balances(cluster).await?;
        anyhow::ensure!(got == expected, "balances {got:?}, expected {expected:?}");
        Ok(got)
    })
    .await
    .unwrap();
    assert_eq!(
        got.values().sum::<u64>(),
        cluster.total(),
        "the money there is"
    );
    for i in 0..cluster.nodes.len() {
        let restored = cluster
            .bank(i)
            .await
            .unwrap()
            .get_balance(bank::GetBalanceRequest {})
            .await
            .unwrap()
            .into_inner()
            .restored_snapshot;
        assert_eq!(restored, id);
    }
}

/// Takes a snapshot in `mode` and asserts it completed with all the money.
pub async fn snapshot(cluster: &CoordinatedCluster, mode: pb::SnapshotMode) -> pb::Snapshot {
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            mode: mode as i32,
            timeout_ms: 20_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let snapshot = cluster.wait(id).await.unwrap();
    assert_completed(&snapshot, cluster.total());
    snapshot
}

/// Waits until the banks have moved on from what `snapshot` recorded.
pub async fn moved_on(cluster: &CoordinatedCluster, snapshot: &pb::Snapshot) {
    let recorded = expected_balances(snapshot);
    eventually(
        "transfers after the snapshot",
        Duration::from_secs(30),
        || async {
            let now = balances(cluster).await?;
            anyhow::ensure!(now != recorded, "no transfer yet");
            Ok(())
        },
    )
    .await
    .unwrap();
}

/// The newest restore operation, if there is one.
pub async fn newest_restore(
    cluster: &CoordinatedCluster,
) -> anyhow::Result<Option<pb::RestoreOperation>> {
    Ok(cluster
        .client()
        .await?
        .list_restores(pb::ListRestoresRequest::default())
        .await?
        .into_inner()
        .restores
        .into_iter()
        .next())
}

/// Waits until there is a restore (an automatic one, say) and the newest has ended.
pub async fn wait_newest_restore(cluster: &CoordinatedCluster) -> pb::RestoreOperation {
    eventually("a restore that ends", Duration::from_secs(60), || async {
        let op = newest_restore(cluster)
            .await?
            .ok_or_else(|| anyhow::anyhow!("no restore yet"))?;
        anyhow::ensure!(op.done || op.failure.is_some(), "in progress");
        Ok(op)
    })
    .await
    .unwrap()
}
