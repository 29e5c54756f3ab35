//! What every cairn program's `/metrics` says of the process and the build: the
//! `process_*` metrics Prometheus' own clients export (read from `/proc` at each scrape),
//! and `cairn_build_info`.

use procfs::WithCurrentSystemInfo as _;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

/// Registers the `process_*` metrics and `cairn_build_info{program, version, revision}`
/// (always 1) for `program` (`cairn-node`, …).
pub fn register_process(registry: &mut Registry, program: &str) {
    let info = Family::<Vec<(String, String)>, Gauge>::default();
    info.get_or_create(&vec![
        ("program".to_owned(), program.to_owned()),
        ("version".to_owned(), crate::version::RELEASE.to_owned()),
        ("revision".to_owned(), crate::version::REVISION.to_owned()),
    ])
    .set(1);
    registry.register(
        "cairn_build_info",
        "The program, its release and the git revision it was built from (always 1)",
        info,
    );
    registry.register_collector(Box::new(ProcessCollector));
}

/// The process' CPU time, memory, file descriptors, threads and start, read at each
/// scrape. A figure `/proc` does not give (another OS, a restricted mount) is left out.
#[derive(Debug)]
struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(me) = procfs::process::Process::myself() else {
            return Ok(());
        };
        let e = &mut encoder;
        let ticks = procfs::ticks_per_second() as f64;
        if let Ok(stat) = me.stat() {
            if let Ok(boot) = procfs::boot_time_secs() {
                let start = boot as f64 + stat.starttime as f64 / ticks;
                gauge(e, "process_start_time_seconds", START, start)?;
            }
            gauge(
                e,
                "process_resident_memory_bytes",
                RSS,
                stat.rss_bytes().get() as f64,
            )?;
            gauge(e, "process_virtual_memory_bytes", VSIZE, stat.vsize as f64)?;
            gauge(e, "process_threads", THREADS, stat.num_threads as f64)?;
            let cpu = ConstCounter::new(stat.utime.saturating_add(stat.stime) as f64 / ticks);
            cpu.encode(e.encode_descriptor(
                "process_cpu_seconds",
                CPU,
                None,
                cpu.metric_type(),
            )?)?;
        }
        if let Ok(fds) = me.fd_count() {
            gauge(e, "process_open_fds", OPEN_FDS, fds as f64)?;
        }
        if let Ok(limits) = me.limits()
            && let procfs::process::LimitValue::Value(max) = limits.max_open_files.soft_limit
        {
            gauge(e, "process_max_fds", MAX_FDS, max as f64)?;
        }
        Ok(())
    }
}

const START: &str = "Start time of the process since the Unix epoch in seconds";
const RSS: &str = "Resident memory size in bytes";
const VSIZE: &str = "Virtual memory size in bytes";
const THREADS: &str = "Number of OS threads in the process";
const CPU: &str = "Total user and system CPU time spent in seconds";
const OPEN_FDS: &str = "Number of open file descriptors";
const MAX_FDS: &str = "Maximum number of open file descriptors";

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}
