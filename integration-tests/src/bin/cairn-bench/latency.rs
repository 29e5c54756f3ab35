//! Scenario a, StartSnapshot to COMPLETED on a full mesh, and f, the same at 32 and 64
//! nodes.

use super::*;

/// a. StartSnapshot to COMPLETED (stored and verified), full mesh.
pub(super) async fn latency(args: &Args, store: &Store, report: &mut Report) -> anyhow::Result<()> {
    let (sizes, count): (&[usize], usize) = if args.quick {
        (&[2, 4], 10)
    } else {
        (&[2, 4, 8, 16], 100)
    };
    report.section(
        "a. Snapshot latency (StartSnapshot → COMPLETED, Chandy–Lamport, full mesh)",
        &[
            "nodes",
            "load",
            "state",
            "snapshots",
            "p50 ms",
            "p99 ms",
            "failed",
        ],
    );
    for &n in sizes {
        let cluster = BenchCluster::start(n, store, &[], &[], 1024).await?;
        for (load_name, load) in [
            ("idle", Load::Idle),
            ("1k msg/s per node", Load::Rate(1000.0)),
        ] {
            cluster.set_load(load);
            for (state_name, size) in [("1 KiB", 1024usize), ("1 MiB", 1 << 20)] {
                for app in &cluster.apps {
                    *app.state.lock().expect("never poisoned") = filler(size, 1);
                }
                let (lat, failed, _) =
                    snapshots(&cluster, count, pb::SnapshotMode::ChandyLamport).await?;
                let (p50, p99) = (quantile(&lat, 0.5), quantile(&lat, 0.99));
                report.row(
                    vec![
                        n.to_string(),
                        load_name.into(),
                        state_name.into(),
                        lat.len().to_string(),
                        f1(p50),
                        f1(p99),
                        failed.to_string(),
                    ],
                    json!({"scenario": "a", "nodes": n, "load": load_name, "state_bytes": size,
                           "snapshots": lat.len(), "p50_ms": p50, "p99_ms": p99, "failed": failed}),
                );
            }
        }
    }
    Ok(())
}

/// f. Latency at 32 and 64 nodes, ring and full mesh.
pub(super) async fn scale(args: &Args, store: &Store, report: &mut Report) -> anyhow::Result<()> {
    let (sizes, count): (&[usize], usize) = if args.quick {
        (&[8], 3)
    } else {
        (&[32, 64], 20)
    };
    report.section(
        "f. Scale (idle, 1 KiB states, Chandy–Lamport)",
        &[
            "nodes",
            "topology",
            "channels",
            "start-up s",
            "p50 ms",
            "max ms",
            "failed",
        ],
    );
    let dir = std::env::temp_dir().join(format!("cairn-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for &n in sizes {
        for topology in ["ring", "full mesh"] {
            let mut coordinator_args = Vec::new();
            let file = dir.join(format!("ring-{n}.txt"));
            if topology == "ring" {
                let lines: Vec<String> = (1..=n).map(|i| format!("n{i}>n{}", i % n + 1)).collect();
                std::fs::write(&file, lines.join("\n"))?;
                coordinator_args = vec!["--topology".to_owned(), file.display().to_string()];
            }
            let c_args: Vec<&str> = coordinator_args.iter().map(String::as_str).collect();
            let started = Instant::now();
            let cluster =
                BenchCluster::start(n, store, &c_args, &["--channel-buffer", "1024"], 1024).await?;
            let startup = started.elapsed().as_secs_f64();
            let (lat, failed, all) =
                snapshots(&cluster, count, pb::SnapshotMode::ChandyLamport).await?;
            let channels = all.first().map_or(0, |s| s.channels.len());
            report.row(
                vec![
                    n.to_string(),
                    topology.into(),
                    channels.to_string(),
                    f1(startup),
                    f1(quantile(&lat, 0.5)),
                    f1(lat.iter().copied().fold(0.0, f64::max)),
                    failed.to_string(),
                ],
                json!({"scenario": "f", "nodes": n, "topology": topology, "channels": channels,
                       "startup_s": startup, "p50_ms": quantile(&lat, 0.5),
                       "max_ms": lat.iter().copied().fold(0.0, f64::max), "failed": failed}),
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
