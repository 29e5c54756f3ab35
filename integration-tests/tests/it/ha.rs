//! Coordinator high availability with real processes and a real etcd: several replicas
//! elect one leader; killing, pausing, deposing (a revoked lease) or restarting the leader,
//! or losing etcd for a while, loses no completed snapshot, reuses no id, lets no deposed
//! leader write or command, and the cluster goes on taking snapshots. Every replica runs
//! with a 2 s lease so that failovers take seconds.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use cairn_integration_tests::coordinated::{CoordinatedCluster, bank_money, health_of, scrape};
use cairn_integration_tests::etcd::Etcd;
use cairn_integration_tests::processes::{ChildGuard, binary, eventually, free_port};
use cairn_integration_tests::proxy::{Loss, LossyProxy};
use cairn_integration_tests::restore;
use cairn_rpc::v1 as pb;
use etcd_client::{EventType, GetOptions, WatchOptions};
use pb::failure_reason::Kind;

/// A 2 s lease: a leader that stops renewing is replaced in about 2 s.
const FAST: [&str; 2] = ["--leader-lease-ttl", "2s"];

/// Every snapshot record, by id.
async fn snapshots(cluster: &CoordinatedCluster) -> anyhow::Result<Vec<pb::Snapshot>> {
    let mut all = cluster
        .client()
        .await?
        .list_snapshots(pb::ListSnapshotsRequest {
            page_size: 1000,
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshots;
    all.sort_by_key(id);
    Ok(all)
}

fn id(s: &pb::Snapshot) -> u64 {
    s.plan.as_ref().map_or(0, |p| p.snapshot_id)
}

fn completed(s: &pb::Snapshot) -> bool {
    s.status == pb::SnapshotStatus::Completed as i32
}

fn kind(s: &pb::Snapshot) -> Option<Kind> {
    s.failure.as_ref().and_then(|f| Kind::try_from(f.kind).ok())
}

/// Scheduled snapshots every 200 ms from now (set once every node is up, so that every
/// snapshot spans the whole cluster).
async fn every_200ms(cluster: &CoordinatedCluster) -> anyhow::Result<()> {
    cluster
        .client()
        .await?
        .set_policy(pb::SetPolicyRequest {
            policy: Some(pb::Policy {
                interval_ms: 200,
                timeout_ms: 10_000,
                max_concurrent: 1,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await?;
    Ok(())
}

/// Waits until a snapshot of `term` (or later) above `after` completes; returns its id.
async fn wait_completed_in(
    cluster: &CoordinatedCluster,
    term: u64,
    after: u64,
) -> anyhow::Result<u64> {
    eventually(
        "a snapshot of the new term completes",
        Duration::from_secs(60),
        || async {
            let done = snapshots(cluster)
                .await?
                .into_iter()
                .find(|s| completed(s) && s.term >= term && id(s) > after);
            done.map(|s| id(&s))
                .ok_or_else(|| anyhow::anyhow!("none yet above {after} in term {term}"))
        },
    )
    .await
}

/// Checks every snapshot recorded: ids strictly increase with the term (no term hands out
/// an id at or below one of an earlier term), every one that did not complete failed with
/// one of `allowed` kinds (or, with `shutdowns`, was aborted by a leader that shut down
/// while it was in flight), and the money adds up in every completed one.
async fn check_history(
    cluster: &CoordinatedCluster,
    allowed: &[Kind],
    shutdowns: bool,
) -> anyhow::Result<Vec<pb::Snapshot>> {
    let mut all = snapshots(cluster).await?;
    for s in all.iter_mut() {
        if s.status == pb::SnapshotStatus::InProgress as i32 {
            // Still in flight (the schedule goes on): its outcome is what is checked.
            *s = cluster.wait_with(id(s), false).await?;
        }
    }
    for pair in all.windows(2) {
        anyhow::ensure!(
            pair[0].term <= pair[1].term,
            "snapshot {} of term {} comes after {} of term {}",
            id(&pair[1]),
            pair[1].term,
            id(&pair[0]),
            pair[0].term
        );
    }
    let mut client = cluster.client().await?;
    for s in &all {
        if completed(s) {
            let full = client
                .get_snapshot(pb::GetSnapshotRequest {
                    snapshot_id: id(s),
                    include_data: true,
                })
                .await?
                .into_inner();
            anyhow::ensure!(
                bank_money(&full)? == cluster.total(),
                "the money of snapshot {} does not add up",
                id(s)
            );
        } else {
            let shut_down = s.status == pb::SnapshotStatus::Aborted as i32
                && s.failure
                    .as_ref()
                    .is_some_and(|f| f.detail.as_deref() == Some("coordinator shut down"));
            anyhow::ensure!(
                (s.status == pb::SnapshotStatus::Failed as i32
                    && kind(s).is_some_and(|k| allowed.contains(&k)))
                    || (shutdowns && shut_down),
                "snapshot {} (term {}) ended {:?}: {:?}",
                id(s),
                s.term,
                pb::SnapshotStatus::try_from(s.status),
                s.failure
            );
        }
    }
    Ok(all)
}

/// The value of an unlabelled metric on a `/metrics` page.
fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_under_scheduled_snapshots_loses_nothing_and_reuses_no_id() {
    let etcd = Etcd::start().await.expect("etcd starts");
    let cluster = CoordinatedCluster::start_ha(2, 3, &etcd.endpoint, &FAST, &[])
        .await
        .unwrap();
    let (old, old_term) = cluster.wait_leader(None).await.unwrap();
    every_200ms(&cluster).await.unwrap();
    assert!(old_term > 0);
    wait_completed_in(&cluster, old_term, 3).await.unwrap();
    // A snapshot held in flight at the kill: n3's bank is paused, so n3 cannot record.
    cluster.bank_process(2).unwrap().signal("-STOP");
    let paused_at = snapshots(&cluster)
        .await
        .unwrap()
        .iter()
        .map(id)
        .max()
        .unwrap();
    let held = eventually("a snapshot in flight", Duration::from_secs(20), || async {
        snapshots(&cluster)
            .await?
            .into_iter()
            .find(|s| s.status == pb::SnapshotStatus::InProgress as i32 && id(s) > paused_at)
            .map(|s| id(&s))
            .ok_or_else(|| anyhow::anyhow!("none in flight"))
    })
    .await
    .unwrap();
    let before = snapshots(&cluster).await.unwrap();
    let done_before: BTreeSet<u64> = before.iter().filter(|s| completed(s)).map(id).collect();
    let max_before = before.iter().map(id).max().unwrap();

    let mut cluster = cluster;
    cluster.kill_replica(old);
    let (new, new_term) = cluster.wait_leader(Some(old)).await.unwrap();
    assert_ne!(new, old);
    assert!(new_term > old_term, "term {new_term} after {old_term}");
    // The snapshot in flight under the old leader failed as a failover, written by the new.
    let failed = eventually(
        "the held snapshot failed",
        Duration::from_secs(20),
        || async {
            let s = snapshots(&cluster)
                .await?
                .into_iter()
                .find(|s| id(s) == held)
                .ok_or_else(|| anyhow::anyhow!("snapshot {held} is gone"))?;
            anyhow::ensure!(
                s.status != pb::SnapshotStatus::InProgress as i32,
                "still in progress"
            );
            Ok(s)
        },
    )
    .await
    .unwrap();
    assert_eq!(kind(&failed), Some(Kind::CoordinatorFailover), "{failed:?}");
    assert!(
        failed
            .failure
            .as_ref()
            .unwrap()
            .message
            .contains(&format!("term {new_term}")),
        "{:?}",
        failed.failure
    );
    cluster.bank_process(2).unwrap().signal("-CONT");
    // The schedule goes on under the new leader, above every id handed out before.
    let first = wait_completed_in(&cluster, new_term, max_before)
        .await
        .unwrap();
    assert!(first > max_before);
    let after = check_history(&cluster, &[Kind::CoordinatorFailover, Kind::Timeout], false)
        .await
        .unwrap();
    let done_after: BTreeSet<u64> = after.iter().filter(|s| completed(s)).map(id).collect();
    assert!(
        done_before.is_subset(&done_after),
        "completed snapshots lost: {:?}",
        done_before.difference(&done_after).collect::<Vec<_>>()
    );
    // The new leader's metrics.
    let page = scrape(&cluster.replicas[new].metrics).await.unwrap();
    assert_eq!(metric(&page, "cairn_coordinator_is_leader"), Some(1.0));
    assert_eq!(
        metric(&page, "cairn_coordinator_term"),
        Some(new_term as f64)
    );
    assert!(metric(&page, "cairn_leader_changes_total").unwrap() >= 1.0);
}

/// Every change etcd made under `prefix` after revision `after`, as (key, kind), read from
/// its revision history until nothing more comes for a second.
async fn changes_since(
    endpoint: &str,
    prefix: &str,
    after: i64,
) -> anyhow::Result<Vec<(String, EventType)>> {
    let mut client = etcd_client::Client::connect([endpoint], None).await?;
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(after + 1);
    let mut stream = client.watch(prefix, Some(options)).await?;
    let mut changes = Vec::new();
    loop {
        let response = match tokio::time::timeout(Duration::from_secs(1), stream.message()).await {
            // Quiet for a second: the history is read.
            Err(_) | Ok(Ok(None)) => break,
            Ok(Ok(Some(response))) => response,
            Ok(Err(e)) => return Err(e.into()),
        };
        for event in response.events() {
            let key = event
                .kv()
                .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
                .unwrap_or_default();
            changes.push((key, event.event_type()));
        }
    }
    Ok(changes)
}

async fn etcd_revision(endpoint: &str) -> anyhow::Result<i64> {
    let mut client = etcd_client::Client::connect([endpoint], None).await?;
    let response = client
        .get(
            "/cairn/",
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await?;
    Ok(response.header().map_or(0, |h| h.revision()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_writes_nothing_once_deposed_and_comes_back_a_follower() {
    let etcd = Etcd::start().await.expect("etcd starts");
    let cluster = CoordinatedCluster::start_ha(2, 2, &etcd.endpoint, &FAST, &[])
        .await
        .unwrap();
    cluster.set_workload(50.0).await.unwrap();
    let (old, old_term) = cluster.wait_leader(None).await.unwrap();
    // Work in flight at the pause: a snapshot n2 cannot record (its bank is paused).
    cluster.bank_process(1).unwrap().signal("-STOP");
    let held = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            timeout_ms: 60_000,
            ..Default::default()
        })
        .await
        .unwrap();
    cluster.replica_process(old).unwrap().signal("-STOP");
    let (new, new_term) = cluster.wait_leader(Some(old)).await.unwrap();
    assert!(new_term > old_term);
    eventually(
        "the held snapshot failed as a failover",
        Duration::from_secs(30),
        || async {
            let s = snapshots(&cluster).await?;
            let s = s.iter().find(|s| id(s) == held).unwrap();
            anyhow::ensure!(kind(s) == Some(Kind::CoordinatorFailover), "{s:?}");
            Ok(())
        },
    )
    .await
    .unwrap();
    cluster.wait_registered(2).await.unwrap();
    // From here on, nothing writes but the old leader if its fence leaked: the new leader
    // is idle (no schedule, no restore), the daemons are registered with it.
    let mark = etcd_revision(&etcd.endpoint).await.unwrap();
    cluster.replica_process(old).unwrap().signal("-CONT");
    // It finds its lease expired by its own clock, stops, and campaigns as a follower.
    eventually(
        "the old leader is a follower again",
        Duration::from_secs(30),
        || async {
            let page = scrape(&cluster.replicas[old].metrics).await?;
            anyhow::ensure!(metric(&page, "cairn_coordinator_is_leader") == Some(0.0));
            let replicas = cluster.leadership(new).await?.replicas;
            anyhow::ensure!(replicas.len() == 2, "{replicas:?}");
            Ok(())
        },
    )
    .await
    .unwrap();
    let log = cluster.log_of(&format!("coordinator{}", old + 1));
    assert!(log.contains("leadership lost"), "{log}");
    // etcd's history since the pause ended: only the old replica's new campaign key.
    let changes = changes_since(&etcd.endpoint, "/cairn/", mark)
        .await
        .unwrap();
    for (key, _) in &changes {
        assert!(
            key.starts_with("/cairn/cairn/leader/"),
            "a write after the new term began: {key} ({changes:?})"
        );
    }
    assert_eq!(
        cluster.leader().await.unwrap(),
        (new, new_term),
        "the new leader stays"
    );
    cluster.bank_process(1).unwrap().signal("-CONT");
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            timeout_ms: 20_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let done = cluster.wait(id).await.unwrap();
    assert!(completed(&done), "{done:?}");
    assert_eq!(done.term, new_term);
    assert_eq!(bank_money(&done).unwrap(), cluster.total());
}

/// A follower answers every call — reads, and writes and streams forwarded to the leader
/// (a start repeated with its request id starts nothing) — and names the leader; revoking
/// the leader's lease from outside deposes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_answers_every_call_and_a_revoked_lease_deposes_the_leader() {
    let etcd = Etcd::start().await.expect("etcd starts");
    let cluster = CoordinatedCluster::start_ha(2, 2, &etcd.endpoint, &FAST, &[])
        .await
        .unwrap();
    let (leader, term) = cluster.wait_leader(None).await.unwrap();
    let follower = 1 - leader;
    let leader_address = cluster.replicas[leader].address.clone();
    let done = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            timeout_ms: 20_000,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(completed(&cluster.wait(done).await.unwrap()));

    let channel = tonic::transport::Endpoint::from_shared(format!(
        "http://{}",
        cluster.replicas[follower].address
    ))
    .unwrap()
    .connect()
    .await
    .unwrap();
    let mut client = pb::coordinator_client::CoordinatorClient::new(channel.clone());
    // Reads: from etcd, each answer naming the leader (once the follower has read who
    // leads: within its 200 ms poll).
    let got = eventually(
        "the follower names the leader",
        Duration::from_secs(10),
        || {
            let mut client = client.clone();
            async move {
                let got = client
                    .get_snapshot(pb::GetSnapshotRequest {
                        snapshot_id: done,
                        include_data: true,
                    })
                    .await?;
                anyhow::ensure!(got.metadata().get("cairn-leader").is_some(), "no hint yet");
                Ok(got)
            }
        },
    )
    .await
    .unwrap();
    assert_eq!(
        got.metadata().get("cairn-leader").unwrap(),
        leader_address.as_str()
    );
    assert_eq!(bank_money(got.get_ref()).unwrap(), cluster.total());
    let listed = client
        .list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.snapshots.iter().any(|s| id(s) == done));
    let nodes = client
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(nodes.nodes.iter().filter(|n| n.connected).count(), 2);
    client.get_policy(pb::GetPolicyRequest {}).await.unwrap();
    let mut watch = client
        .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: done })
        .await
        .unwrap()
        .into_inner();
    let progress = watch.message().await.unwrap().unwrap();
    assert_eq!(progress.status, pb::SnapshotStatus::Completed as i32);
    // Both replicas campaign (as the follower read them, every 200 ms).
    let who = eventually(
        "the follower sees both replicas",
        Duration::from_secs(10),
        || {
            let mut client = client.clone();
            async move {
                let who = client
                    .get_leadership(pb::GetLeadershipRequest {})
                    .await?
                    .into_inner();
                anyhow::ensure!(who.replicas.len() == 2, "{who:?}");
                Ok(who)
            }
        },
    )
    .await
    .unwrap();
    assert_eq!(
        (who.leader.as_str(), who.term),
        (leader_address.as_str(), term)
    );
    assert_eq!(who.answered_by, cluster.replicas[follower].address);
    // Writes: forwarded to the leader on the caller's behalf, answered as the leader
    // answers them (a refusal of the leader's, never UNAVAILABLE).
    let start = pb::StartSnapshotRequest {
        timeout_ms: 20_000,
        request_id: "ha-forwarded-1".into(),
        ..Default::default()
    };
    let forwarded = client
        .start_snapshot(start.clone())
        .await
        .unwrap()
        .into_inner()
        .snapshot_id;
    assert!(forwarded > done);
    // Its progress streams through the follower to the end.
    let mut watch = client
        .watch_snapshot(pb::WatchSnapshotRequest {
            snapshot_id: forwarded,
        })
        .await
        .unwrap()
        .into_inner();
    let mut last = None;
    while let Some(progress) = watch.message().await.unwrap() {
        last = Some(progress.status);
    }
    assert_eq!(last, Some(pb::SnapshotStatus::Completed as i32));
    // The same request id again, through either replica: the same snapshot, none started.
    for again in [
        client.start_snapshot(start.clone()).await,
        cluster
            .client()
            .await
            .unwrap()
            .start_snapshot(start.clone())
            .await,
    ] {
        assert_eq!(again.unwrap().into_inner().snapshot_id, forwarded);
    }
    let listed = client
        .list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed
            .snapshots
            .iter()
            .filter(|s| s.request_id == start.request_id)
            .count(),
        1
    );
    let refused = [
        client
            .abort_snapshot(pb::AbortSnapshotRequest {
                snapshot_id: done,
                reason: "x".into(),
            })
            .await
            .map(drop),
        client
            .delete_snapshot(pb::DeleteSnapshotRequest { snapshot_id: 999 })
            .await
            .map(drop),
        client
            .restore_snapshot(pb::RestoreSnapshotRequest {
                snapshot_id: 999,
                if_epoch: None,
            })
            .await
            .map(drop),
    ];
    for result in refused {
        let status = result.unwrap_err();
        assert_ne!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(
            status.message().contains("999") || status.message().contains(&done.to_string()),
            "the leader's own refusal: {status:?}"
        );
    }
    // A daemon's session too.
    let register = pb::NodeToCoordinator {
        kind: Some(pb::node_to_coordinator::Kind::Register(pb::Register {
            cluster: "cairn".into(),
            node_id: "n9".into(),
            address: "127.0.0.1:1".into(),
            ..Default::default()
        })),
    };
    let status = client
        .node_session(tokio_stream::iter([register]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    // Health: cairn.v1.Leader SERVING only on the leader.
    for (r, want) in [
        (
            leader,
            tonic_health::pb::health_check_response::ServingStatus::Serving,
        ),
        (
            follower,
            tonic_health::pb::health_check_response::ServingStatus::NotServing,
        ),
    ] {
        let status = health_of(&cluster.replicas[r].address, "cairn.v1.Leader", None)
            .await
            .unwrap();
        assert_eq!(status, want as i32, "replica {}", r + 1);
    }
    // Freshness is the leader's to judge: a follower does not know.
    let freshness = health_of(
        &cluster.replicas[follower].address,
        "cairn.v1.SnapshotFreshness",
        None,
    )
    .await
    .unwrap();
    assert_eq!(
        freshness,
        tonic_health::pb::health_check_response::ServingStatus::Unknown as i32
    );

    // cairnctl, given the follower first, finds the leader and shows the replicas. The
    // list is what the leader last read from etcd (every 200 ms), and a follower whose
    // lease lapsed under load campaigns again with a new key: wait for both to be listed.
    let coordinators = format!("{},{}", cluster.replicas[follower].address, leader_address);
    let status = eventually(
        "cairnctl status lists both replicas",
        Duration::from_secs(20),
        || {
            let coordinators = coordinators.clone();
            async move {
                let out = tokio::process::Command::new(binary("cairnctl")?)
                    .args(["--coordinator", &coordinators, "-o", "json", "status"])
                    .output()
                    .await?;
                anyhow::ensure!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let status: serde_json::Value = serde_json::from_slice(&out.stdout)?;
                anyhow::ensure!(
                    status["leadership"]["replicas"].as_array().map(Vec::len) == Some(2),
                    "{status}"
                );
                Ok(status)
            }
        },
    )
    .await
    .unwrap();
    // `-o json` is the protobuf JSON mapping: a uint64 is a string.
    let leadership = &status["leadership"];
    assert_eq!(leadership["leader"], leader_address.as_str(), "{status}");
    assert_eq!(leadership["term"], term.to_string(), "{status}");
    assert_eq!(status["coordinator"], leader_address.as_str(), "{status}");

    // The leader's lease, revoked from outside (etcd's election key ends in the lease id).
    let mut etcd_client = etcd_client::Client::connect([etcd.endpoint.as_str()], None)
        .await
        .unwrap();
    let keys = etcd_client
        .get(
            "/cairn/cairn/leader/",
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let own = keys
        .kvs()
        .iter()
        .find(|kv| kv.value() == leader_address.as_bytes())
        .expect("the leader's election key");
    let lease = own.lease();
    etcd_client.lease_revoke(lease).await.unwrap();
    // The other replica was next in line: it leads a new term (the deposed one campaigns
    // again behind it).
    let (_, new_term) = eventually("a new term", Duration::from_secs(30), || async {
        let (i, t) = cluster.leader().await?;
        anyhow::ensure!(t > term, "still term {t}");
        Ok((i, t))
    })
    .await
    .unwrap();
    let name = format!("coordinator{}", leader + 1);
    eventually(
        "the deposed leader says so",
        Duration::from_secs(20),
        || async {
            let log = cluster.log_of(&name);
            anyhow::ensure!(log.contains("leadership lost"), "not yet: {log}");
            Ok(())
        },
    )
    .await
    .unwrap();
    // The members' keys went with the old lease; the new leader holds them again.
    cluster.wait_registered(2).await.unwrap();
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            timeout_ms: 20_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let done = cluster.wait(id).await.unwrap();
    assert!(completed(&done), "{done:?}");
    assert_eq!(done.term, new_term);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_every_replica_under_load_keeps_snapshots_completing() {
    let etcd = Etcd::start().await.expect("etcd starts");
    let mut cluster = CoordinatedCluster::start_ha(2, 3, &etcd.endpoint, &FAST, &[])
        .await
        .unwrap();
    let (_, mut term) = cluster.wait_leader(None).await.unwrap();
    every_200ms(&cluster).await.unwrap();
    let mut after = wait_completed_in(&cluster, term, 0).await.unwrap();
    for r in 0..cluster.replicas.len() {
        let status = cluster
            .stop_replica(r)
            .expect("the replica stops on SIGTERM");
        assert!(status.success(), "replica {} exited {status}", r + 1);
        cluster.start_replica(r).unwrap();
        eventually(
            "both replicas campaign",
            Duration::from_secs(30),
            || async {
                let (i, _) = cluster.leader().await?;
                let n = cluster.leadership(i).await?.replicas.len();
                anyhow::ensure!(n == 2, "{n} replicas");
                Ok(())
            },
        )
        .await
        .unwrap();
        let (_, now) = cluster.leader().await.unwrap();
        assert!(now >= term);
        term = now;
        after = wait_completed_in(&cluster, term, after).await.unwrap();
    }
    // At most what was in flight at a restart failed: aborted by the replica that shut
    // down (ABORTED, "coordinator shut down"; it resigned), or failed over.
    check_history(
        &cluster,
        &[Kind::CoordinatorFailover, Kind::Unspecified],
        true,
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_etcd_no_replica_leads_and_service_returns_with_it() {
    let mut etcd = Etcd::start().await.expect("etcd starts");
    let cluster = CoordinatedCluster::start_ha(2, 2, &etcd.endpoint, &FAST, &[])
        .await
        .unwrap();
    let (leader, term) = cluster.wait_leader(None).await.unwrap();
    etcd.stop();
    // Within the lease's TTL (2 s, − its margin) no replica believes it leads.
    eventually("no replica leads", Duration::from_secs(5), || async {
        for r in &cluster.replicas {
            let page = scrape(&r.metrics).await?;
            anyhow::ensure!(
                metric(&page, "cairn_coordinator_is_leader") == Some(0.0),
                "{} still leads",
                r.address
            );
        }
        Ok(())
    })
    .await
    .unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!(
        "http://{}",
        cluster.replicas[leader].address
    ))
    .unwrap()
    .connect()
    .await
    .unwrap();
    let status = pb::coordinator_client::CoordinatorClient::new(channel)
        .start_snapshot(pb::StartSnapshotRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    // etcd is down for 10 s in all (the fault's length, not a wait for an event).
    tokio::time::sleep(Duration::from_secs(8)).await;
    etcd.resume().await.unwrap();
    let (_, new_term) = cluster.wait_leader(None).await.unwrap();
    assert!(new_term > term);
    // At once, before the daemons are back with the new leader: `snapshot start --wait`
    // waits for them (bounded) instead of failing, and the snapshot completes.
    let out = Command::new(binary("cairnctl").unwrap())
        .args(["--coordinator", &cluster.coordinator_list(), "-o", "json"])
        .args(["snapshot", "start", "--wait", "--timeout", "20s"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "cairnctl snapshot start --wait: {stderr}"
    );
    let done: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        done["status"], "SNAPSHOT_STATUS_COMPLETED",
        "{done} ({stderr})"
    );
    // A member down: a start with --wait waits for it (saying so) and completes once it is
    // back, instead of failing at once.
    let mut cluster = cluster;
    cluster.kill_node(1);
    eventually("n2 disconnected", Duration::from_secs(20), || async {
        let nodes = cluster
            .client()
            .await?
            .list_nodes(pb::ListNodesRequest {})
            .await?;
        let n2 = nodes
            .into_inner()
            .nodes
            .into_iter()
            .find(|n| n.node_id == "n2");
        anyhow::ensure!(n2.is_some_and(|n| !n.connected), "n2 still connected");
        Ok(())
    })
    .await
    .unwrap();
    let mut waiting = tokio::process::Command::new(binary("cairnctl").unwrap())
        .args(["--coordinator", &cluster.coordinator_list(), "-o", "json"])
        .args([
            "snapshot",
            "start",
            "--wait",
            "--timeout",
            "20s",
            "--wait-members",
            "60s",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut said = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
        waiting.stderr.take().unwrap(),
    ));
    let line = tokio::time::timeout(Duration::from_secs(20), said.next_line())
        .await
        .expect("cairnctl says it waits")
        .unwrap()
        .unwrap_or_default();
    assert!(
        line.contains("waiting up to 1m for the members") && line.contains("n2"),
        "{line}"
    );
    cluster.start_node(1).unwrap();
    let out = tokio::time::timeout(Duration::from_secs(60), waiting.wait_with_output())
        .await
        .expect("cairnctl ends once n2 is back")
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let done: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(done["status"], "SNAPSHOT_STATUS_COMPLETED", "{done}");
    // A refusal that is not about members connecting is not waited on.
    let out = Command::new(binary("cairnctl").unwrap())
        .args(["--coordinator", &cluster.coordinator_list()])
        .args([
            "snapshot",
            "start",
            "--wait",
            "--initiator",
            "n9",
            "--wait-members",
            "1s",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("n9"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A daemon that has seen a term refuses a coordinator of a lower one: here a coordinator
/// on another etcd whose revisions (so its terms) are far lower.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_refuses_a_coordinator_of_a_lower_term() {
    let high = Etcd::start().await.expect("etcd starts");
    let low = Etcd::start().await.expect("etcd starts");
    let mut client = etcd_client::Client::connect([high.endpoint.as_str()], None)
        .await
        .unwrap();
    for i in 0..50 {
        client.put(format!("/bump/{i}"), "x", None).await.unwrap();
    }
    let dir = std::env::temp_dir().join(format!("cairn-ha-term-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let coordinator = |etcd: &Etcd, name: &str| {
        let address = format!("127.0.0.1:{}", free_port());
        let mut command = std::process::Command::new(binary("cairn-coordinator").unwrap());
        command.args(["--listen", &address, "--etcd", &etcd.endpoint]);
        command.args(FAST);
        command.arg("--data-dir").arg(dir.join(name));
        let process = ChildGuard::spawn(
            "cairn-coordinator",
            command,
            &dir.join(format!("{name}.log")),
        )
        .unwrap();
        (address, process)
    };
    let (high_address, mut high_process) = coordinator(&high, "high");
    let (low_address, _low_process) = coordinator(&low, "low");
    // Each leads its own etcd before the daemon starts (it tries the high one first).
    for address in [&high_address, &low_address] {
        eventually("the coordinator leads", Duration::from_secs(30), || async {
            let status = health_of(address, "cairn.v1.Leader", None).await?;
            anyhow::ensure!(status == 1, "not leading yet");
            Ok(())
        })
        .await
        .unwrap();
    }
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut node = std::process::Command::new(binary("cairn-node").unwrap());
    node.args([
        "--node-id",
        "n1",
        "--peer-listen",
        &format!("127.0.0.1:{}", free_port()),
        "--app-listen",
        &format!("127.0.0.1:{}", free_port()),
        "--coordinator",
        &format!("{high_address},{low_address}"),
        "--metrics-listen",
        &metrics,
    ]);
    let node_log = dir.join("n1.log");
    let _node = ChildGuard::spawn("cairn-node", node, &node_log).unwrap();
    let registered_with = |address: String| async move {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
            .connect()
            .await?;
        let nodes = pb::coordinator_client::CoordinatorClient::new(channel)
            .list_nodes(pb::ListNodesRequest {})
            .await?
            .into_inner()
            .nodes;
        anyhow::ensure!(nodes.iter().any(|n| n.connected), "n1 not connected");
        Ok(())
    };
    eventually(
        "n1 registers with the high-term coordinator",
        Duration::from_secs(30),
        || registered_with(high_address.clone()),
    )
    .await
    .unwrap();
    high_process.kill();
    eventually(
        "n1 refuses the low-term coordinator",
        Duration::from_secs(30),
        || async {
            let page = scrape(&metrics).await?;
            let refused: f64 = page
                .lines()
                .filter(|l| l.starts_with("cairn_node_stale_term_refused_total"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            anyhow::ensure!(refused >= 1.0, "none refused yet");
            Ok(())
        },
    )
    .await
    .unwrap();
    let log = std::fs::read_to_string(&node_log).unwrap();
    assert!(log.contains("FAILED_PRECONDITION"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The metadata a replica reads when it takes over can outgrow one etcd response (the
/// client takes at most 4 MiB): a 30-minute nemesis run found every replica failing its
/// recovery past ~4,000 snapshots, so that none could lead. Listings go in pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_larger_than_one_etcd_response_comes_back_whole_and_in_order() {
    use cairn_coordinator::config::EtcdConfig;
    use cairn_coordinator::store::{EtcdKv, Kv};

    let etcd = Etcd::start().await.unwrap();
    let kv = EtcdKv::connect(&EtcdConfig::endpoints(vec![etcd.endpoint.clone()]))
        .await
        .unwrap();
    // 300 values of 20 KiB: about 6 MiB under one prefix, and neighbours beside it (written
    // with a plain client: the store writes only as a leader).
    let mut client = etcd_client::Client::connect([etcd.endpoint.as_str()], None)
        .await
        .unwrap();
    let value = vec![b'x'; 20 << 10];
    for i in 0..300 {
        client
            .put(format!("/big/{i:04}"), value.clone(), None)
            .await
            .unwrap();
    }
    client.put("/big0", "neighbour", None).await.unwrap();
    client.put("/bif", "neighbour", None).await.unwrap();
    let listed = kv.list("/big/").await.unwrap();
    let keys: Vec<&str> = listed.iter().map(|(k, _)| k.as_str()).collect();
    let expected: Vec<String> = (0..300).map(|i| format!("/big/{i:04}")).collect();
    assert_eq!(keys, expected);
    assert!(listed.iter().all(|(_, v)| v == &value));
    // The whole keyspace too (the empty prefix).
    assert_eq!(kv.list("").await.unwrap().len(), 302);
}

/// Issue 31, finding 1: etcd applies the restore record's write but its answer is lost (the
/// proxy holds it past the client's 5 s timeout, then cuts the connection). The caller is
/// told the restore started (the lost answer was read back) or that its outcome is unknown
/// (ABORTED, naming the restore to look up) — never that it failed — and the restore is
/// carried out either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_whose_answer_is_lost_is_never_told_failed() {
    let (_etcd, proxy, cluster) = behind_a_lossy_proxy().await;
    let snapshot = restore::snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
    restore::moved_on(&cluster, &snapshot).await;
    // Quiet, so that the restored balances can be compared with the snapshot's.
    cluster.set_workload(0.0).await.unwrap();
    // Only a restore record's value has "requested_by".
    proxy.arm(b"\"requested_by\"", Loss::Answer, Duration::from_secs(7));
    let answer = restore::restore(&cluster, id(&snapshot)).await;
    assert_eq!(proxy.fired(), 1, "the restore record's write went through");
    let restore_id = match answer {
        Ok(op) => op.restore_id,
        Err(status) => {
            assert_eq!(
                status.code(),
                tonic::Code::Aborted,
                "a lost answer is not a failure: {status:?}"
            );
            let message = status.message();
            assert!(message.contains("outcome unknown"), "{message}");
            let at = message
                .find("GetRestore restore-")
                .unwrap_or_else(|| panic!("names the restore to read back: {message}"));
            message[at + "GetRestore ".len()..]
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .next()
                .unwrap()
                .to_owned()
        }
    };
    let op = restore::wait_restore(&cluster, &restore_id).await;
    assert!(
        op.done,
        "the restore whose answer was lost is carried out: {op:?}"
    );
    restore::assert_restored(&cluster, &snapshot).await;
}

/// Issue 31, finding 2: the request storing a snapshot's COMPLETED record is lost (held past
/// the client's timeout, then its connection cut: etcd never sees it). No watcher hears of
/// the end before the store holds it: at the moment the watcher is told COMPLETED, etcd
/// (read directly, not through the proxy) says COMPLETED too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_end_is_told_only_once_stored() {
    let (etcd, proxy, cluster) = behind_a_lossy_proxy().await;
    // One snapshot first, so the cluster is known to complete them.
    restore::snapshot(&cluster, pb::SnapshotMode::ChandyLamport).await;
    proxy.arm(
        b"\"status\": \"COMPLETED\"",
        Loss::Request,
        Duration::from_secs(7),
    );
    let snapshot_id = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            timeout_ms: 60_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut watch = cluster
        .client()
        .await
        .unwrap()
        .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id })
        .await
        .unwrap()
        .into_inner();
    let end = loop {
        let progress = tokio::time::timeout(Duration::from_secs(60), watch.message())
            .await
            .expect("the watch ends within a minute")
            .expect("the watch is not broken")
            .expect("the watch tells the end before it closes");
        if progress.status != pb::SnapshotStatus::InProgress as i32 {
            break progress;
        }
    };
    let mut direct = etcd_client::Client::connect([etcd.endpoint.as_str()], None)
        .await
        .unwrap();
    let stored = direct
        .get("/cairn/", Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let suffix = format!("/snapshots/{snapshot_id:020}");
    let record = stored
        .kvs()
        .iter()
        .find(|kv| kv.key_str().unwrap().ends_with(&suffix))
        .expect("the snapshot's record is stored");
    let record: serde_json::Value = serde_json::from_slice(record.value()).unwrap();
    assert_eq!(proxy.fired(), 1, "the COMPLETED record's write was lost");
    assert_eq!(
        end.status,
        pb::SnapshotStatus::Completed as i32,
        "the snapshot completed: {end:?}"
    );
    assert_eq!(
        record["status"], "COMPLETED",
        "told COMPLETED while the store says {record}"
    );
}

/// etcd, a lossy proxy in front of it, and one coordinator replica reaching etcd through
/// the proxy, with three banks moving money and the replica leading.
async fn behind_a_lossy_proxy() -> (Etcd, LossyProxy, CoordinatedCluster) {
    let etcd = Etcd::start().await.expect("etcd starts");
    let target = etcd
        .endpoint
        .trim_start_matches("http://")
        .parse()
        .expect("etcd listens on an IP address");
    let proxy = LossyProxy::start(target).await.unwrap();
    let endpoint = format!("http://{}", proxy.addr);
    let cluster = CoordinatedCluster::start_ha(1, 3, &endpoint, &FAST, &[])
        .await
        .unwrap();
    cluster.set_workload(50.0).await.unwrap();
    cluster.wait_leader(None).await.unwrap();
    (etcd, proxy, cluster)
}
