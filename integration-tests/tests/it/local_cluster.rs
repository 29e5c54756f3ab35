//! `cairnctl cluster up` and `cairnctl demo` are secure by default (issue 15 item 6): the
//! cluster runs mutual TLS and bearer tokens, refuses plaintext clients and clients without
//! a certificate or a token, and the lines it prints (cairnctl's variables, a grpcurl
//! command) work as pasted; `--insecure` runs a plaintext cluster.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};
use std::time::Duration;

use cairn_integration_tests::processes::{binary, eventually, free_port};

/// A `cairnctl` started by a test: on drop, SIGTERM (so that it stops the processes it
/// started) and, after 15 s, SIGKILL — pass or fail.
struct Cairnctl {
    child: std::process::Child,
    log: PathBuf,
}

impl Cairnctl {
    fn spawn(command: &mut Command, log: &Path) -> Self {
        let out = std::fs::File::create(log).unwrap();
        let child = command
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        Self {
            child,
            log: log.to_owned(),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its exit status once it exits, or `None` after `timeout`.
    async fn exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        eventually("cairnctl exits", timeout, || {
            let status = self.child.try_wait();
            async move { status?.ok_or_else(|| anyhow::anyhow!("still running")) }
        })
        .await
        .ok()
    }

    /// SIGTERM, and its exit status within 15 s (else SIGKILL and `None`).
    async fn terminate(&mut self) -> Option<ExitStatus> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Some(status);
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        match self.exit(Duration::from_secs(15)).await {
            Some(status) => Some(status),
            None => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                None
            }
        }
    }
}

impl Drop for Cairnctl {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            let deadline = std::time::Instant::now() + Duration::from_secs(15);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A cairnctl command without the caller's `CAIRN_*` variables.
fn cairnctl() -> Command {
    let mut command = Command::new(binary("cairnctl").unwrap());
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("CAIRN_") {
            command.env_remove(&key);
        }
    }
    command
}

fn dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "cairn-{name}-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `line` with `sh -c` (as a user pastes it), cairnctl's directory first on PATH.
fn sh(line: &str) -> Output {
    let bin = binary("cairnctl").unwrap();
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = Command::new("sh");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("CAIRN_") {
            command.env_remove(&key);
        }
    }
    command
        .args(["-c", line])
        .env("PATH", path)
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The printed line that starts (after indentation) with `start`.
fn printed_line(log: &str, start: &str) -> Option<String> {
    log.lines()
        .map(str::trim)
        .find(|l| l.starts_with(start))
        .map(str::to_owned)
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_up_runs_tls_and_tokens_and_prints_lines_that_work() {
    let dir = dir("secure-up");
    let addresses = dir.join("addresses.json");
    let mut up = Cairnctl::spawn(
        cairnctl()
            .args(["cluster", "up", "--nodes", "2", "--workload", "20"])
            .arg("--dir")
            .arg(dir.join("cluster"))
            .arg("--addresses")
            .arg(&addresses),
        &dir.join("cairnctl.log"),
    );
    // The lines are printed once the cluster is ready.
    let grpcurl_line = eventually("the grpcurl line", Duration::from_secs(60), || {
        let log = up.log();
        async move { printed_line(&log, "grpcurl -cacert").ok_or_else(|| anyhow::anyhow!("{log}")) }
    })
    .await
    .unwrap();
    let log = up.log();
    let export = printed_line(&log, "export CAIRN_COORDINATOR=").expect(&log);
    let file: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&addresses).unwrap()).expect("the addresses file");
    let coordinator = file["coordinator"].as_str().unwrap().to_owned();
    let security = &file["security"];
    let path = |key: &str| PathBuf::from(security[key].as_str().expect(key));
    let (ca, cert, key, token_file) = (path("ca"), path("cert"), path("key"), path("token_file"));
    let token = std::fs::read_to_string(&token_file)
        .unwrap()
        .trim()
        .to_owned();
    assert_eq!(token.len(), 64, "{token}");
    assert!(
        log.contains(&token) && log.contains(&ca.display().to_string()),
        "{log}"
    );
    assert_eq!(mode(&token_file), 0o600);
    assert_eq!(mode(&key), 0o600);
    assert!(grpcurl_line.contains(&coordinator), "{grpcurl_line}");
    assert!(
        grpcurl_line.contains(&format!("authorization: Bearer {token}")),
        "{grpcurl_line}"
    );
    let coordinator_log =
        std::fs::read_to_string(dir.join("cluster/logs/coordinator.log")).unwrap();
    assert!(
        coordinator_log.contains("bearer tokens accepted")
            && coordinator_log.contains("client certificates with a role"),
        "{coordinator_log}"
    );

    // The printed cairnctl variables work as pasted: a snapshot over TLS with the token.
    let out = sh(&format!("{export}; cairnctl snapshot start --wait"));
    assert!(out.status.success(), "{}", text(&out));
    // The printed grpcurl line works as pasted, and lists that snapshot.
    let out = sh(&grpcurl_line);
    assert!(out.status.success(), "{grpcurl_line}: {}", text(&out));
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        listed.contains("SNAPSHOT_STATUS_COMPLETED") && listed.contains("\"snapshotId\": \"1\""),
        "{listed}"
    );

    // Refused: cairnctl without the TLS flags (plaintext) ...
    let out = cairnctl()
        .args(["--coordinator", &coordinator, "nodes"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).starts_with("error:"), "{}", text(&out));
    assert!(
        text(&out).contains("hint: no --tls-ca was given"),
        "{}",
        text(&out)
    );
    // ... grpcurl in plaintext, and with the CA but no client certificate ...
    for flags in [
        vec!["-plaintext".to_owned()],
        vec!["-cacert".to_owned(), ca.display().to_string()],
    ] {
        let out = Command::new("grpcurl")
            .args(&flags)
            .args(["-H", &format!("authorization: Bearer {token}")])
            .args([&coordinator, "cairn.v1.Coordinator/ListNodes"])
            .output()
            .expect("grpcurl is installed (scripts/test.sh installs it)");
        assert!(!out.status.success(), "{flags:?}: {}", text(&out));
    }
    // ... and a certificate without a role (a node's) without a token.
    let node_cert = ca.parent().unwrap().join("n1.pem");
    let node_key = ca.parent().unwrap().join("n1-key.pem");
    let with_node_cert = |token: Option<&str>| {
        let mut command = cairnctl();
        command
            .arg("--coordinator")
            .arg(&coordinator)
            .arg("--tls-ca")
            .arg(&ca)
            .arg("--tls-cert")
            .arg(&node_cert)
            .arg("--tls-key")
            .arg(&node_key);
        if let Some(token) = token {
            command.args(["--token", token]);
        }
        command.arg("nodes").output().unwrap()
    };
    let out = with_node_cert(None);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("Unauthenticated") && text(&out).contains("bearer token"),
        "{}",
        text(&out)
    );
    let out = with_node_cert(Some(&token));
    assert!(out.status.success(), "{}", text(&out));
    let nodes = String::from_utf8_lossy(&out.stdout);
    assert!(nodes.contains("n1") && nodes.contains("n2"), "{nodes}");
    // The admin certificate alone carries its role.
    let out = cairnctl()
        .arg("--coordinator")
        .arg(&coordinator)
        .arg("--tls-ca")
        .arg(&ca)
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .args(["snapshot", "list"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));

    let status = up.terminate().await.expect("cairnctl stops on SIGTERM");
    assert!(status.success(), "cairnctl cluster up exited with {status}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_up_insecure_runs_plaintext_with_one_warning() {
    let dir = dir("insecure-up");
    let addresses = dir.join("addresses.json");
    let mut up = Cairnctl::spawn(
        cairnctl()
            .args(["cluster", "up", "--nodes", "2", "--insecure"])
            .arg("--dir")
            .arg(dir.join("cluster"))
            .arg("--addresses")
            .arg(&addresses),
        &dir.join("cairnctl.log"),
    );
    // The file is written once the cluster is ready.
    let file = eventually("addresses file", Duration::from_secs(60), || async {
        Ok(serde_json::from_slice::<serde_json::Value>(
            &std::fs::read(&addresses)?,
        )?)
    })
    .await
    .unwrap();
    let coordinator = file["coordinator"].as_str().unwrap().to_owned();
    assert!(file["security"].is_null(), "{file}");
    assert!(!dir.join("cluster/tls").exists());
    let log = up.log();
    assert_eq!(log.matches("warning: --insecure").count(), 1, "{log}");
    assert!(!log.contains("grpcurl"), "{log}");

    let out = cairnctl()
        .args(["--coordinator", &coordinator, "nodes"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let out = Command::new("grpcurl")
        .args(["-plaintext", &coordinator, "cairn.v1.Coordinator/ListNodes"])
        .output()
        .expect("grpcurl is installed (scripts/test.sh installs it)");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .matches("\"nodeId\"")
            .count(),
        2,
        "{}",
        text(&out)
    );

    let status = up.terminate().await.expect("cairnctl stops on SIGTERM");
    assert!(status.success(), "cairnctl cluster up exited with {status}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_verifies_its_snapshots_over_tls_and_with_insecure() {
    let dir = dir("demo");
    for insecure in [false, true] {
        let cluster = dir.join(if insecure { "insecure" } else { "secure" });
        let mut command = cairnctl();
        command
            .args(["demo", "--nodes", "2", "--workload", "100"])
            .arg("--dir")
            .arg(&cluster);
        if insecure {
            command.arg("--insecure");
        }
        let log = dir.join(format!("demo-{insecure}.log"));
        let mut demo = Cairnctl::spawn(&mut command, &log);
        let status = demo.exit(Duration::from_secs(120)).await;
        let out = demo.log();
        assert!(status.is_some_and(|s| s.success()), "{status:?}: {out}");
        assert!(
            out.contains("every snapshot completed, verified as a consistent cut"),
            "{out}"
        );
        let verified = out
            .lines()
            .filter(|l| l.trim_end().ends_with(" consistent"))
            .count();
        assert_eq!(verified, 3, "one verified row per mode: {out}");
        let coordinator_log =
            std::fs::read_to_string(cluster.join("logs/coordinator.log")).unwrap();
        if insecure {
            assert_eq!(out.matches("warning: --insecure").count(), 1, "{out}");
            assert!(!out.contains("grpcurl"), "{out}");
            assert!(
                coordinator_log.contains("no --tls-cert"),
                "{coordinator_log}"
            );
        } else {
            assert!(!out.contains("warning"), "{out}");
            assert!(
                out.contains("mutual TLS and bearer tokens on")
                    && printed_line(&out, "grpcurl -cacert").is_some(),
                "{out}"
            );
            assert!(
                coordinator_log.contains("client certificates with a role")
                    && !coordinator_log.contains("no --tls-cert"),
                "{coordinator_log}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
