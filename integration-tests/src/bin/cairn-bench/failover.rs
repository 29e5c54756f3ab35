//! Scenario i: coordinator failover under load, two replicas on etcd.

use super::*;

/// i. Coordinator failover: two replicas on etcd, three nodes with banks, a snapshot
/// scheduled every 100 ms; the leader is killed (SIGKILL) again and again (restarted as a
/// follower in between), and each time the time from the kill to the end of the first
/// snapshot the new leader completes is taken (its record's `finished_at_ms` against the
/// kill's wall clock), with the default lease TTL (5 s) and with 2 s. Target: TTL + 1 s.
pub(super) async fn failover(args: &Args, report: &mut Report) -> anyhow::Result<()> {
    use cairn_integration_tests::coordinated::CoordinatedCluster;
    let kills = if args.quick { 2 } else { 10 };
    // etcd: the one given, else one of our own for the scenario.
    let own = match &args.etcd {
        Some(_) => None,
        None => Some(cairn_integration_tests::etcd::Etcd::start().await?),
    };
    let endpoint = match (&args.etcd, &own) {
        (Some(url), _) => url.clone(),
        (None, Some(etcd)) => etcd.endpoint.clone(),
        (None, None) => unreachable!("one of them is set"),
    };
    report.section(
        &format!(
            "i. Coordinator failover (2 replicas, 3 nodes, a snapshot every 100 ms; kill -9 \
             the leader, {kills} times: kill to the first snapshot the new leader completes)"
        ),
        &["lease TTL", "kills", "p50 s", "max s", "target s"],
    );
    for ttl in [5u64, 2] {
        // Each TTL on a cluster of its own (its own keys in etcd).
        let cluster_name = format!("bench-failover-{ttl}s-{}", std::process::id());
        let ttl_flag = format!("{ttl}s");
        let mut cluster = CoordinatedCluster::start_ha(
            2,
            3,
            &endpoint,
            &[
                "--leader-lease-ttl",
                ttl_flag.as_str(),
                "--cluster",
                cluster_name.as_str(),
            ],
            &["--cluster", cluster_name.as_str()],
        )
        .await?;
        cluster.set_workload(100.0).await?;
        cluster.wait_leader(None).await?;
        cluster
            .client()
            .await?
            .set_policy(pb::SetPolicyRequest {
                policy: Some(pb::Policy {
                    interval_ms: 100,
                    timeout_ms: 10_000,
                    max_concurrent: 1,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await?;
        let mut times = Vec::new();
        for _ in 0..kills {
            let (leader, term) = cluster.wait_leader(None).await?;
            // The follower is campaigning (both election keys are there).
            cairn_integration_tests::processes::eventually(
                "both replicas campaign",
                Duration::from_secs(60),
                || async {
                    let n = cluster.leadership(leader).await?.replicas.len();
                    anyhow::ensure!(n == 2, "{n} replicas");
                    Ok(())
                },
            )
            .await?;
            let killed_at = now_ms();
            cluster.kill_replica(leader);
            let done = cairn_integration_tests::processes::eventually(
                "a snapshot completed by the new leader",
                Duration::from_secs(60),
                || async {
                    let all = cluster
                        .client()
                        .await?
                        .list_snapshots(pb::ListSnapshotsRequest {
                            status: pb::SnapshotStatus::Completed as i32,
                            page_size: 50,
                            ..Default::default()
                        })
                        .await?
                        .into_inner()
                        .snapshots;
                    all.iter()
                        .filter(|s| s.term > term)
                        .map(|s| s.finished_at_ms)
                        .min()
                        .ok_or_else(|| anyhow::anyhow!("none yet"))
                },
            )
            .await?;
            times.push(done.saturating_sub(killed_at) as f64 / 1000.0);
            cluster.start_replica(leader)?;
        }
        let p50 = quantile(&times, 0.5);
        let max = times.iter().copied().fold(0.0, f64::max);
        report.row(
            vec![
                format!("{ttl} s"),
                kills.to_string(),
                format!("{p50:.2}"),
                format!("{max:.2}"),
                format!("{}", ttl + 1),
            ],
            json!({"scenario": "i", "ttl_s": ttl, "kills": kills, "p50_s": p50, "max_s": max,
                   "times_s": times, "target_s": ttl + 1}),
        );
    }
    Ok(())
}
