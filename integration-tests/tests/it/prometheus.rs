//! Metrics as Prometheus reads them (issue 37): `promtool check metrics` on a live scrape
//! of the coordinator and a daemon, and a real Prometheus (Debian's `prometheus` package)
//! scraping a mutual-TLS cluster with the README's configuration, asked through its API for
//! each metric's type and help.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use cairn_integration_tests::coordinated::{
    CoordinatedCluster, Store, TLS_TEST_USER_SPEC, certs_init, http_get,
};
use cairn_integration_tests::processes::{ChildGuard, eventually, free_port};
use cairn_integration_tests::tls_support;
use cairn_proto::v1 as pb;

/// `promtool`, or a failure saying what to install.
fn promtool() -> Command {
    let found = Command::new("promtool").arg("--version").output();
    assert!(
        found.is_ok_and(|o| o.status.success()),
        "promtool is not on PATH: install Debian's prometheus package (scripts/test.sh does)"
    );
    Command::new("promtool")
}

/// Runs `promtool check metrics` on `text`: its complaints, if any.
fn check_metrics(text: &str) -> Result<(), String> {
    use std::io::Write as _;
    let mut child = promtool()
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// The metric families a scrape names in its `# TYPE` lines, with their types.
fn families(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_owned(), kind.to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_finds_nothing_wrong_in_a_live_scrape_of_the_coordinator_and_a_daemon() {
    let cluster = CoordinatedCluster::start(2, Store::Embedded, &[], &[])
        .await
        .unwrap();
    // A snapshot, so the histograms and labelled counters have samples.
    cluster
        .completed(pb::StartSnapshotRequest {
            mode: pb::SnapshotMode::Unaligned as i32,
            ..Default::default()
        })
        .await
        .unwrap();
    for address in [&cluster.coordinator_metrics, &cluster.nodes[0].metrics] {
        let raw = cluster.scrape(address).await.unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: text/plain; version=0.0.4; charset=utf-8"),
            "{address}: {head}"
        );
        assert!(
            !body.contains("# EOF") && !body.contains("# UNIT"),
            "{body}"
        );
        if let Err(complaints) = check_metrics(body) {
            panic!("promtool check metrics on {address}:\n{complaints}\n{body}");
        }
        let families = families(body);
        for (name, kind) in [
            ("process_cpu_seconds_total", "counter"),
            ("process_resident_memory_bytes", "gauge"),
            ("process_open_fds", "gauge"),
            ("process_max_fds", "gauge"),
            ("process_start_time_seconds", "gauge"),
            ("cairn_build_info", "gauge"),
        ] {
            assert!(
                families.contains(&(name.to_owned(), kind.to_owned())),
                "{address}: no {kind} {name} in {families:?}"
            );
        }
        let revision = body
            .lines()
            .find(|l| l.starts_with("cairn_build_info{"))
            .unwrap();
        assert!(
            revision.contains(&format!("revision=\"{}\"", cairn_rpc::version::REVISION))
                && revision.ends_with(" 1"),
            "{revision}"
        );
        // A counter's samples are named as its TYPE says.
        for (name, kind) in &families {
            if kind == "counter" {
                assert!(name.ends_with("_total"), "{address}: counter {name}");
            }
        }
    }
    let coordinator = cluster.scrape(&cluster.coordinator_metrics).await.unwrap();
    for renamed in [
        "cairn_snapshot_new_bytes_total",
        "cairn_snapshot_reused_bytes_total",
    ] {
        assert!(
            coordinator.contains(&format!("# TYPE {renamed} counter")),
            "{renamed}"
        );
    }

    // Every metric the shipped alert rules and dashboard name is one the programs export.
    let node = cluster.scrape(&cluster.nodes[0].metrics).await.unwrap();
    let mut exported: Vec<String> = families(&coordinator)
        .into_iter()
        .chain(families(&node))
        .map(|(name, _)| name)
        .collect();
    exported.push("up".into());
    let monitoring = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/monitoring");
    let rules = std::fs::read_to_string(monitoring.join("cairn-rules.yaml")).unwrap();
    let dashboard = std::fs::read_to_string(monitoring.join("cairn-dashboard.json")).unwrap();
    let dashboard: serde_json::Value =
        serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let mut queries: Vec<String> = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let targets = panel["targets"].as_array().expect("each panel has targets");
        assert!(!targets.is_empty(), "{}", panel["title"]);
        for target in targets {
            queries.push(target["expr"].as_str().expect("a PromQL expr").to_owned());
        }
    }
    assert!(queries.len() >= 10, "{queries:?}");
    let named = |text: &str| -> Vec<String> {
        text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("cairn_") || w.starts_with("process_"))
            .map(|w| {
                let w = w.strip_suffix("_bucket").unwrap_or(w);
                w.to_owned()
            })
            .collect()
    };
    for (source, text) in [
        ("cairn-rules.yaml", rules),
        ("cairn-dashboard.json", queries.join("\n")),
    ] {
        let names = named(&text);
        assert!(!names.is_empty(), "{source} names no metric");
        for name in names {
            assert!(
                exported.contains(&name),
                "{source} names {name}, which neither the coordinator nor a daemon exports"
            );
        }
    }
}

/// A Prometheus on a free port, scraping every second with `config`; killed when dropped.
struct Prometheus {
    address: String,
    _process: ChildGuard,
}

impl Prometheus {
    fn start(dir: &Path, config: &str) -> Self {
        assert!(
            Command::new("prometheus").arg("--version").output().is_ok(),
            "prometheus is not on PATH: install Debian's prometheus package (scripts/test.sh does)"
        );
        let file = dir.join("prometheus.yml");
        std::fs::write(&file, config).unwrap();
        let check = promtool()
            .args(["check", "config"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(check.status.success(), "promtool check config: {check:?}");
        let address = format!("127.0.0.1:{}", free_port());
        let mut command = Command::new("prometheus");
        command
            .arg(format!("--config.file={}", file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={address}"));
        let process =
            ChildGuard::spawn("prometheus", command, &dir.join("prometheus.log")).unwrap();
        Self {
            address,
            _process: process,
        }
    }

    /// `GET path` of Prometheus' HTTP API, as JSON, once it answers `success`.
    async fn api(&self, path: &str) -> anyhow::Result<serde_json::Value> {
        let (status, body) = http_get(&self.address, path).await?;
        anyhow::ensure!(status == 200, "{path}: {status} {body}");
        let value: serde_json::Value = serde_json::from_str(&body)?;
        anyhow::ensure!(value["status"] == "success", "{path}: {body}");
        Ok(value)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_a_tls_cluster_and_knows_each_metrics_type_and_help() {
    let certs = tls_support::temp_dir("prometheus", "certs");
    certs_init(&certs, 2, &[TLS_TEST_USER_SPEC, "prometheus:viewer"]).unwrap();
    let cluster = CoordinatedCluster::start_opts(2, Store::Embedded, &[], &[], &[], Some(&certs))
        .await
        .unwrap();
    let dir = tls_support::temp_dir("prometheus", "server");
    // The README's configuration ("Metrics"), one job per kind of target.
    let job = |name: &str, server_name: &str, target: &str| {
        format!(
            "  - job_name: {name}
    scheme: https
    tls_config:
      ca_file: {certs}/ca.pem
      cert_file: {certs}/prometheus.pem
      key_file: {certs}/prometheus-key.pem
      server_name: {server_name}
    static_configs:
      - targets: [\"{target}\"]
",
            certs = certs.display()
        )
    };
    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n{}{}",
        job(
            "cairn-coordinator",
            "coordinator",
            &cluster.coordinator_metrics
        ),
        job("cairn-node", "n1", &cluster.nodes[0].metrics),
    );
    let prometheus = Prometheus::start(&dir, &config);
    eventually("both targets up", Duration::from_secs(60), || async {
        let targets = prometheus.api("/api/v1/targets").await?;
        let active = targets["data"]["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        anyhow::ensure!(active.len() == 2, "{targets}");
        for t in &active {
            anyhow::ensure!(
                t["health"] == "up",
                "{} is {}: {}",
                t["scrapeUrl"],
                t["health"],
                t["lastError"]
            );
        }
        Ok(())
    })
    .await
    .unwrap();
    for (metric, kind) in [
        ("cairn_snapshots_total", "counter"),
        ("cairn_snapshot_duration_seconds", "histogram"),
        ("cairn_members", "gauge"),
        ("cairn_node_messages_total", "counter"),
        ("process_cpu_seconds_total", "counter"),
        ("cairn_build_info", "gauge"),
    ] {
        let what = format!("{metric}'s metadata");
        let metadata = eventually(&what, Duration::from_secs(30), || async {
            let value = prometheus
                .api(&format!("/api/v1/metadata?metric={metric}"))
                .await?;
            let entry = value["data"][metric][0].clone();
            anyhow::ensure!(!entry.is_null(), "none yet: {value}");
            Ok(entry)
        })
        .await
        .unwrap();
        assert_eq!(metadata["type"], kind, "{metric}: {metadata}");
        assert!(
            metadata["help"].as_str().is_some_and(|h| h.len() > 5),
            "{metric}: {metadata}"
        );
    }
    let info = prometheus
        .api("/api/v1/query?query=cairn_build_info")
        .await
        .unwrap();
    let programs: Vec<&str> = info["data"]["result"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["metric"]["program"].as_str())
        .collect();
    assert_eq!(programs.len(), 2, "{info}");
    assert!(programs.contains(&"cairn-coordinator") && programs.contains(&"cairn-node"));
    drop(prometheus);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&certs);
}

/// The shipped alert rules load, and their unit tests pass: each alert fires on a series
/// of a cluster in trouble and stays quiet on a healthy one (`cairn-rules-test.yaml`).
#[test]
fn the_alert_rules_load_and_pass_their_unit_tests() {
    let monitoring = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/monitoring");
    for args in [
        &["check", "rules", "cairn-rules.yaml"][..],
        &["test", "rules", "cairn-rules-test.yaml"][..],
    ] {
        let out = promtool()
            .args(args)
            .current_dir(&monitoring)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Every alert of the rules file has a test case.
    let rules = std::fs::read_to_string(monitoring.join("cairn-rules.yaml")).unwrap();
    let tests = std::fs::read_to_string(monitoring.join("cairn-rules-test.yaml")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 8, "{alerts:?}");
    for alert in alerts {
        assert!(
            tests.contains(&format!("alertname: {alert}")),
            "{alert} has no test in cairn-rules-test.yaml"
        );
    }
}
