//! Scenarios b and e: what a snapshot every 100 ms costs the application's throughput,
//! against a stop-the-world pause.

use super::*;

/// b. Throughput with and without a snapshot every 100 ms; e. the same against the
/// bench's own stop-the-world coordinator, and the longest pause each costs the
/// application. The three alternate in rounds (the machine's speed drifts); medians.
pub(super) async fn cost_and_stop_the_world(
    args: &Args,
    store: &Store,
    report: &mut Report,
) -> anyhow::Result<()> {
    let n = if args.quick { 3 } else { 4 };
    let (rounds, window) = if args.quick {
        (1, Duration::from_secs(1))
    } else {
        (5, Duration::from_secs(3))
    };
    let cluster = BenchCluster::start(n, store, &[], &[], 1024).await?;
    cluster.set_load(Load::Flood);
    tokio::time::sleep(Duration::from_millis(500)).await; // warm up
    let mut client = cluster.cluster.client().await?;
    let schedule = |interval_ms: u64| pb::SetPolicyRequest {
        policy: Some(pb::Policy {
            interval_ms,
            ..Default::default()
        }),
        update: vec!["interval_ms".into()],
        reset_to_flags: false,
    };
    let (mut none, mut cairn, mut stw, mut pauses) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut taken = 0;
    for app in &cluster.apps {
        app.record_max_us.store(0, Relaxed);
        app.record_us.lock().expect("never poisoned").clear();
    }
    for _ in 0..rounds {
        let before = cluster.received();
        let started = Instant::now();
        tokio::time::sleep(window).await;
        none.push((cluster.received() - before) as f64 / started.elapsed().as_secs_f64());

        // cairn: the coordinator's own schedule, every 100 ms.
        client.set_policy(schedule(100)).await?;
        let policy_before = client
            .get_policy(pb::GetPolicyRequest {})
            .await?
            .into_inner();
        let before = cluster.received();
        let started = Instant::now();
        tokio::time::sleep(window).await;
        cairn.push((cluster.received() - before) as f64 / started.elapsed().as_secs_f64());
        let policy_after = client
            .get_policy(pb::GetPolicyRequest {})
            .await?
            .into_inner();
        client.set_policy(schedule(0)).await?;
        taken += policy_after.started - policy_before.started;

        // Stop-the-world, every 100 ms.
        let before = cluster.received();
        let started = Instant::now();
        while started.elapsed() < window {
            tokio::time::sleep(Duration::from_millis(100)).await;
            pauses.push(cluster.stop_the_world().await.as_secs_f64() * 1000.0);
        }
        stw.push((cluster.received() - before) as f64 / started.elapsed().as_secs_f64());
    }
    let (none, with_cairn, with_stw) = (
        quantile(&none, 0.5),
        quantile(&cairn, 0.5),
        quantile(&stw, 0.5),
    );
    let cairn_pause_us = cluster
        .apps
        .iter()
        .map(|a| a.record_max_us.load(Relaxed))
        .max()
        .unwrap_or(0);
    let stw_max = pauses.iter().copied().fold(0.0, f64::max);
    let records: Vec<f64> = cluster
        .apps
        .iter()
        .flat_map(|a| a.record_us.lock().expect("never poisoned").clone())
        .map(|us| us / 1000.0)
        .collect();
    report.section(
        "b. Cost to the application (end-to-end transfers/s, 16-byte messages, as fast as backpressure allows; medians of alternating rounds)",
        &["nodes", "no snapshots", "snapshot every 100 ms", "ratio", "snapshots taken"],
    );
    report.row(
        vec![
            n.to_string(),
            rate(none),
            rate(with_cairn),
            format!("{:.1} %", 100.0 * with_cairn / none),
            taken.to_string(),
        ],
        json!({"scenario": "b", "nodes": n, "rounds": rounds, "none_per_s": none, "cairn_100ms_per_s": with_cairn,
               "ratio": with_cairn / none, "snapshots": taken}),
    );
    report.section(
        "e. Stop-the-world baseline (every 100 ms: stop every app's sending, drain the channels, read the states, resume)",
        &["approach", "transfers/s", "of no snapshots", "longest application pause"],
    );
    report.row(
        vec![
            "cairn (Chandy–Lamport)".into(),
            rate(with_cairn),
            format!("{:.1} %", 100.0 * with_cairn / none),
            format!(
                "{:.3} ms (p50 {:.3} ms, p99 {:.3} ms over {} records; the app answers RecordState, nothing stops)",
                cairn_pause_us as f64 / 1000.0,
                quantile(&records, 0.5),
                quantile(&records, 0.99),
                records.len()
            ),
        ],
        json!({"scenario": "e", "approach": "cairn", "per_s": with_cairn, "max_pause_ms": cairn_pause_us as f64 / 1000.0,
               "p50_pause_ms": quantile(&records, 0.5), "p99_pause_ms": quantile(&records, 0.99), "records": records.len()}),
    );
    report.row(
        vec![
            "stop-the-world".into(),
            rate(with_stw),
            format!("{:.1} %", 100.0 * with_stw / none),
            format!(
                "{:.3} ms (p50 {:.3} ms, p99 {:.3} ms over {} pauses)",
                stw_max,
                quantile(&pauses, 0.5),
                quantile(&pauses, 0.99),
                pauses.len()
            ),
        ],
        json!({"scenario": "e", "approach": "stop-the-world", "per_s": with_stw, "max_pause_ms": stw_max,
               "p50_pause_ms": quantile(&pauses, 0.5), "p99_pause_ms": quantile(&pauses, 0.99), "pauses": pauses.len()}),
    );
    Ok(())
}
