//! Scenarios d, channel throughput against raw TCP and plain tonic, and h, what mutual
//! TLS costs.

use super::*;

/// d. Messages/s and MB/s between two daemons against raw TCP and plain tonic.
pub(super) async fn throughput(
    args: &Args,
    store: &Store,
    report: &mut Report,
) -> anyhow::Result<()> {
    let window = Duration::from_secs(if args.quick { 1 } else { 5 });
    report.section(
        "d. Channel throughput (one direction; cairn: app → daemon → daemon → app)",
        &[
            "payload",
            "path",
            "messages/s",
            "MB/s",
            "of raw TCP",
            "of one tonic stream",
        ],
    );
    for size in [64usize, 4096] {
        let tcp = raw_tcp(size, window).await?;
        let tonic = plain_tonic(size, window).await?;
        let relay = relay_tonic(size, 1, window).await?;
        let relay_batched = relay_tonic(size, 64, window).await?;
        let cairn = channel_rate(store, size, window, false).await?;
        for (path, r) in [
            ("raw TCP, length-prefixed (one process)", tcp),
            (
                "tonic bidi stream, one message per item (one process)",
                tonic,
            ),
            (
                "tonic, the same relayed over three hops (one process)",
                relay,
            ),
            (
                "tonic, batches of 64 relayed over three hops (one process)",
                relay_batched,
            ),
            ("cairn, two daemons (four processes)", cairn),
        ] {
            report.row(
                vec![
                    format!("{size} B"),
                    path.into(),
                    rate(r),
                    format!("{:.0}", r * size as f64 / 1e6),
                    format!("{:.1} %", 100.0 * r / tcp),
                    format!("{:.0} %", 100.0 * r / tonic),
                ],
                json!({"scenario": "d", "payload": size, "path": path, "per_s": r,
                       "mb_per_s": r * size as f64 / 1e6, "of_tcp": r / tcp,
                       "of_tonic": r / tonic}),
            );
        }
    }
    Ok(())
}

/// Messages/s from node 0's application to node 1's, flooding, over `window`.
pub(super) async fn channel_rate(
    store: &Store,
    size: usize,
    window: Duration,
    tls: bool,
) -> anyhow::Result<f64> {
    let cluster = BenchCluster::start_tls(2, store, &[], &[], 1024, tls).await?;
    *cluster.apps[0].payload.lock().expect("never poisoned") = filler(size, 3);
    cluster.apps[0].set_load(Load::Flood);
    // Past the start (HTTP/2 windows opening, the first batches).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = cluster.apps[1].received.load(Relaxed);
    let started = Instant::now();
    tokio::time::sleep(window).await;
    Ok((cluster.apps[1].received.load(Relaxed) - before) as f64 / started.elapsed().as_secs_f64())
}

/// h. What mutual TLS costs: scenario a's 8 idle nodes and scenario d's channel, with TLS
/// off and on, alternating in rounds (the machine's speed drifts); medians of the rounds.
pub(super) async fn tls_cost(
    args: &Args,
    store: &Store,
    report: &mut Report,
) -> anyhow::Result<()> {
    let (rounds, count, window) = if args.quick {
        (1, 10, Duration::from_secs(1))
    } else {
        (3, 50, Duration::from_secs(5))
    };
    let n = 8;
    report.section(
        "h. TLS cost (8 nodes idle, 1 KiB states: latency; two daemons flooding: messages/s; \
         TLS off and on in alternating rounds, medians)",
        &[
            "TLS",
            "snapshot p50 ms",
            "snapshot p99 ms",
            "64 B messages/s",
            "4 KiB messages/s",
        ],
    );
    // Per setting: p50s, p99s, 64 B rates, 4 KiB rates.
    let mut results: [[Vec<f64>; 4]; 2] = Default::default();
    for _ in 0..rounds {
        for (i, tls) in [false, true].into_iter().enumerate() {
            let cluster = BenchCluster::start_tls(n, store, &[], &[], 1024, tls).await?;
            let (lat, failed, _) =
                snapshots(&cluster, count, pb::SnapshotMode::ChandyLamport).await?;
            anyhow::ensure!(
                failed == 0,
                "TLS {tls}: {failed} snapshots did not complete"
            );
            drop(cluster);
            results[i][0].push(quantile(&lat, 0.5));
            results[i][1].push(quantile(&lat, 0.99));
            results[i][2].push(channel_rate(store, 64, window, tls).await?);
            results[i][3].push(channel_rate(store, 4096, window, tls).await?);
        }
    }
    let median = |v: &[f64]| quantile(v, 0.5);
    for (i, name) in ["off", "on"].into_iter().enumerate() {
        let r = &results[i];
        report.row(
            vec![
                name.into(),
                f1(median(&r[0])),
                f1(median(&r[1])),
                rate(median(&r[2])),
                rate(median(&r[3])),
            ],
            json!({"scenario": "h", "tls": name, "nodes": n, "rounds": rounds,
                   "p50_ms": median(&r[0]), "p99_ms": median(&r[1]),
                   "per_s_64": median(&r[2]), "per_s_4096": median(&r[3])}),
        );
    }
    let (off, on) = (&results[0], &results[1]);
    report.row(
        vec![
            "on − off".into(),
            format!("{:+.1}", median(&on[0]) - median(&off[0])),
            format!("{:+.1}", median(&on[1]) - median(&off[1])),
            format!("{:+.1} %", 100.0 * (median(&on[2]) / median(&off[2]) - 1.0)),
            format!("{:+.1} %", 100.0 * (median(&on[3]) / median(&off[3]) - 1.0)),
        ],
        json!({"scenario": "h", "tls": "difference",
               "p50_ms": median(&on[0]) - median(&off[0]),
               "throughput_64": median(&on[2]) / median(&off[2]),
               "throughput_4096": median(&on[3]) / median(&off[3])}),
    );
    Ok(())
}
