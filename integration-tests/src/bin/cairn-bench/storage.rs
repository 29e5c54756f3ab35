//! Scenarios g, a large state of which 1 % changes, and j, many large states uploaded
//! through the coordinator or straight to S3: on a directory and on S3.

use super::*;

/// The blob store flags and environment of a back end: the coordinator's directory (the
/// daemons send their chunks to it), or `prefix` on `s3` (the daemons write theirs there).
pub(super) struct Backend {
    pub(super) name: &'static str,
    pub(super) coordinator: Vec<String>,
    pub(super) node: Vec<String>,
    pub(super) env: Vec<(String, String)>,
}

pub(super) fn backends(s3: &S3Server, prefix: &str) -> [Backend; 2] {
    let blob = vec![
        "--blob-store".to_owned(),
        s3.url(prefix),
        "--s3-endpoint".to_owned(),
        s3.endpoint.clone(),
        "--s3-allow-http".to_owned(),
    ];
    [
        Backend {
            name: "directory, via the coordinator",
            coordinator: Vec::new(),
            node: Vec::new(),
            env: Vec::new(),
        },
        Backend {
            name: "S3, daemons direct",
            coordinator: blob.clone(),
            node: blob,
            env: s3.env(),
        },
    ]
}

pub(super) fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Bytes of state chunks daemon `i` has sent so far: to the coordinator and to the store.
pub(super) async fn state_bytes_sent(cluster: &BenchCluster, i: usize) -> anyhow::Result<f64> {
    let c = &cluster.cluster;
    let text = c.scrape(&c.nodes[i].metrics).await?;
    let name = "cairn_node_state_upload_bytes_total";
    Ok(metric(&text, name, Some("to=\"coordinator\"")) + metric(&text, name, Some("to=\"store\"")))
}

pub(super) fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / f64::from(1u32 << 20))
}

/// g. A large state of which 1 % changes between snapshots, on each back end: the bytes the
/// daemon sent (to the coordinator or the bucket) and the bytes newly stored, and the peak
/// memory of the daemon and the coordinator.
pub(super) async fn incremental(
    args: &Args,
    store: &Store,
    report: &mut Report,
) -> anyhow::Result<()> {
    let sizes: &[usize] = if args.quick {
        &[16 << 20]
    } else {
        &[256 << 20, 1 << 30]
    };
    let rounds = if args.quick { 3 } else { 4 };
    report.section(
        "g. Incremental state (one node; 1 % of the state rewritten between snapshots, as random 64 KiB blocks)",
        &[
            "back end",
            "state",
            "snapshot",
            "bytes sent",
            "sent of the state",
            "bytes new",
            "ms",
            "daemon peak MiB",
            "coordinator peak MiB",
        ],
    );
    let s3 = S3Server::start().await?;
    for (&size, backend) in sizes
        .iter()
        .flat_map(|size| backends(&s3, "bench-g").map(move |b| (size, b)))
    {
        let cluster = BenchCluster::start_env(
            1,
            store,
            &strs(&backend.coordinator),
            &strs(&backend.node),
            size,
            false,
            &backend.env,
        )
        .await?;
        let mut state = cluster.apps[0]
            .state
            .lock()
            .expect("never poisoned")
            .to_vec();
        let block = 64 << 10;
        let blocks = (size / 100).div_ceil(block);
        for round in 0..rounds {
            if round > 0 {
                for b in 0..blocks {
                    let at = (fastrand(round as u64 * 1000 + b as u64) as usize % (size / block))
                        * block;
                    let fresh = filler(block, round as u64 * 7919 + b as u64);
                    state[at..at + block].copy_from_slice(&fresh);
                }
                *cluster.apps[0].state.lock().expect("never poisoned") =
                    bytes::Bytes::from(state.clone());
            }
            let before = state_bytes_sent(&cluster, 0).await?;
            let (ms, s) = cluster
                .snapshot(pb::StartSnapshotRequest {
                    timeout_ms: 600_000,
                    ..Default::default()
                })
                .await?;
            anyhow::ensure!(
                s.status == pb::SnapshotStatus::Completed as i32,
                "{:?}",
                s.failure
            );
            let sent = (state_bytes_sent(&cluster, 0).await? - before) as u64;
            let daemon = cluster
                .cluster
                .node_pid(0)
                .map(peak_rss)
                .transpose()?
                .unwrap_or(0);
            let coordinator = cluster
                .cluster
                .replica_pid(0)
                .map(peak_rss)
                .transpose()?
                .unwrap_or(0);
            report.row(
                vec![
                    backend.name.into(),
                    format!("{} MiB", size >> 20),
                    if round == 0 { "first (all new)".into() } else { format!("after change {round}") },
                    sent.to_string(),
                    format!("{:.2} %", 100.0 * sent as f64 / size as f64),
                    s.bytes_new.to_string(),
                    f1(ms),
                    mib(daemon),
                    mib(coordinator),
                ],
                json!({"scenario": "g", "backend": backend.name, "state_bytes": size, "round": round,
                       "bytes_sent": sent, "bytes_new": s.bytes_new, "bytes_reused": s.bytes_reused,
                       "sent_of_state": sent as f64 / size as f64, "ms": ms,
                       "daemon_peak_rss": daemon, "coordinator_peak_rss": coordinator}),
            );
        }
    }
    Ok(())
}

/// j. Many nodes with large states: the first (all new) and an unchanged (all reused)
/// snapshot, with the daemons' chunks going through the coordinator or straight to S3 —
/// latency, and the coordinator's CPU time and peak memory.
pub(super) async fn direct_uploads(
    args: &Args,
    store: &Store,
    report: &mut Report,
) -> anyhow::Result<()> {
    let (nodes, size): (usize, usize) = if args.quick {
        (4, 8 << 20)
    } else {
        (16, 64 << 20)
    };
    report.section(
        "j. Many large states: uploads through the coordinator or straight to S3",
        &[
            "back end",
            "nodes × state",
            "snapshot",
            "ms",
            "coordinator CPU ms",
            "coordinator peak MiB",
        ],
    );
    let s3 = S3Server::start().await?;
    for backend in backends(&s3, "bench-j") {
        let cluster = BenchCluster::start_env(
            nodes,
            store,
            &strs(&backend.coordinator),
            &strs(&backend.node),
            size,
            false,
            &backend.env,
        )
        .await?;
        let pid = cluster
            .cluster
            .replica_pid(0)
            .ok_or_else(|| anyhow::anyhow!("no coordinator"))?;
        for which in ["first (all new)", "again (all reused)"] {
            let cpu = cpu_time(pid)?;
            let (ms, s) = cluster
                .snapshot(pb::StartSnapshotRequest {
                    timeout_ms: 600_000,
                    ..Default::default()
                })
                .await?;
            anyhow::ensure!(
                s.status == pb::SnapshotStatus::Completed as i32,
                "{:?}",
                s.failure
            );
            let cpu_ms = (cpu_time(pid)? - cpu).as_secs_f64() * 1000.0;
            let peak = peak_rss(pid)?;
            report.row(
                vec![
                    backend.name.into(),
                    format!("{nodes} × {} MiB", size >> 20),
                    which.into(),
                    f1(ms),
                    f1(cpu_ms),
                    mib(peak),
                ],
                json!({"scenario": "j", "backend": backend.name, "nodes": nodes, "state_bytes": size,
                       "snapshot": which, "ms": ms, "coordinator_cpu_ms": cpu_ms,
                       "coordinator_peak_rss": peak}),
            );
        }
    }
    Ok(())
}

/// A reproducible pseudo-random number.
pub(super) fn fastrand(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
