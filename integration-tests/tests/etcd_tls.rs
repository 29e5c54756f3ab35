//! The coordinator's metadata in an etcd that serves TLS, requires client certificates
//! (`--client-cert-auth`) and has authentication enabled (issue 15 item 5), on real
//! processes. Certificates come from `cairnctl certs init` (one CA: `etcd` is etcd's server
//! certificate, SANs `127.0.0.1` and `localhost`; `cairn` and `stranger` are client
//! certificates with those CNs; a second `certs init` is another CA).
//!
//! etcd users: `root` (role root), `cairn` (role `cairn`: read/write on `/cairn/`) and
//! `stranger` (no role). With a password the coordinator is the user it names; with a
//! client certificate and no `--etcd-user`, etcd takes the user from the certificate's CN.
//!
//! Every process is killed by pid when its guard drops, pass or fail.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cairn_integration_tests::coordinated::{CoordinatedCluster, Store, assert_completed};
use cairn_integration_tests::etcd::{Etcd, EtcdTlsFiles};
use cairn_integration_tests::processes::{binary, free_port};
use cairn_integration_tests::tls_support;
use cairn_proto::v1 as pb;

const ROOT: &str = "root:root-secret";
const CAIRN_PASSWORD: &str = "cairn-secret";

/// `cairnctl certs init` into `dir`: a CA, the node certificate `etcd` (server and
/// client), the user certificates `cairn` and `stranger`.
fn certs_init(dir: &Path) {
    let output = Command::new(binary("cairnctl").unwrap())
        .args(["certs", "init", "--cluster", "etcd-test", "--nodes", "etcd"])
        .args(["--users", "cairn,stranger", "--dir"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "cairnctl certs init: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A file of `dir` as an argument.
fn file(dir: &Path, name: &str) -> String {
    dir.join(name).display().to_string()
}

/// A TLS etcd with client-certificate authentication and auth enabled, the certificates
/// (`certs`), another CA's (`other`) and a file holding cairn's password.
struct Fixture {
    etcd: Etcd,
    certs: PathBuf,
    other: PathBuf,
    password_file: PathBuf,
}

impl Fixture {
    async fn start() -> Self {
        let base = tls_support::temp_dir("etcd-tls", "fixture");
        let (certs, other) = (base.join("certs"), base.join("other"));
        certs_init(&certs);
        certs_init(&other);
        let etcd = Etcd::start_tls(EtcdTlsFiles {
            ca: certs.join("ca.pem"),
            cert: certs.join("etcd.pem"),
            key: certs.join("etcd-key.pem"),
        })
        .await
        .unwrap();
        for args in [
            &["user", "add", ROOT][..],
            &["user", "grant-role", "root", "root"],
            &["role", "add", "cairn"],
            &[
                "role",
                "grant-permission",
                "cairn",
                "--prefix=true",
                "readwrite",
                "/cairn/",
            ],
            &["user", "add", &format!("cairn:{CAIRN_PASSWORD}")],
            &["user", "grant-role", "cairn", "cairn"],
            &["user", "add", "stranger:stranger-secret"],
            &["auth", "enable"],
        ] {
            etcd.etcdctl(None, args).await.unwrap();
        }
        // Auth is on: without a user (and with a certificate whose CN, `etcd`, is no etcd
        // user) a read is refused.
        let refused = etcd.etcdctl(None, &["get", "/cairn/x"]).await.unwrap_err();
        eprintln!("etcdctl without a user after auth enable: {refused:#}");
        let password_file = base.join("cairn-password");
        std::fs::write(&password_file, format!("{CAIRN_PASSWORD}\n")).unwrap();
        Self {
            etcd,
            certs,
            other,
            password_file,
        }
    }

    /// `--etcd-ca`, `--etcd-cert`, `--etcd-key` with the CA of `ca_dir` and the client
    /// certificate `client` of `cert_dir`.
    fn tls_args(&self, ca_dir: &Path, cert_dir: &Path, client: &str) -> Vec<String> {
        vec![
            "--etcd-ca".into(),
            file(ca_dir, "ca.pem"),
            "--etcd-cert".into(),
            file(cert_dir, &format!("{client}.pem")),
            "--etcd-key".into(),
            file(cert_dir, &format!("{client}-key.pem")),
        ]
    }
}

/// Runs a coordinator with `--etcd <endpoint>` and `args` until it exits (killed by pid
/// after 30 s, failing the test): its exit code, its stderr and how long it ran.
async fn run_to_exit(endpoint: &str, args: &[String]) -> (Option<i32>, String, Duration) {
    let data = tls_support::temp_dir("etcd-tls", "data");
    let mut command = tokio::process::Command::new(binary("cairn-coordinator").unwrap());
    command
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--data-dir")
        .arg(&data)
        .args(["--etcd", endpoint])
        .args(args)
        .env_remove("CAIRN_ETCD_PASSWORD")
        .kill_on_drop(true);
    let started = Instant::now();
    let output = tokio::time::timeout(Duration::from_secs(30), command.output())
        .await
        .expect("the coordinator neither started nor exited within 30 s (a hang or a retry loop)")
        .unwrap();
    let _ = std::fs::remove_dir_all(&data);
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
        started.elapsed(),
    )
}

/// The coordinator exits with status 1 within 15 s, its error naming etcd and each of
/// `words` (lower case).
async fn assert_refused(fixture: &Fixture, what: &str, args: &[String], words: &[&str]) {
    let (code, stderr, took) = run_to_exit(&fixture.etcd.endpoint, args).await;
    eprintln!("{what}: exit {code:?} after {took:?}: {stderr}");
    assert_eq!(code, Some(1), "{what}: {stderr}");
    assert!(took < Duration::from_secs(15), "{what}: took {took:?}");
    let error = stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("{what}: no `error:` line in {stderr}"))
        .to_lowercase();
    assert!(
        error.contains("etcd at https://127.0.0.1:"),
        "{what}: {error}"
    );
    for word in words {
        assert!(error.contains(word), "{what}: `{word}` not in {error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_on_tls_etcd_with_a_user_completes_snapshots() {
    let fixture = Fixture::start().await;
    let mut args = fixture.tls_args(&fixture.certs, &fixture.certs, "cairn");
    args.extend([
        "--etcd-user".into(),
        "cairn".into(),
        "--etcd-password-file".into(),
        fixture.password_file.display().to_string(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let cluster =
        CoordinatedCluster::start(2, Store::Etcd(fixture.etcd.endpoint.clone()), &[], &args)
            .await
            .unwrap();
    let snapshot = cluster
        .completed(pb::StartSnapshotRequest {
            mode: pb::SnapshotMode::ChandyLamport as i32,
            timeout_ms: 20_000,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_completed(&snapshot, cluster.total());
    // The records are in etcd, written as the user cairn.
    let stored = fixture
        .etcd
        .etcdctl(Some(ROOT), &["get", "--prefix", "--keys-only", "/cairn/"])
        .await
        .unwrap();
    assert!(
        stored.lines().any(|k| k.contains("/snapshots/")),
        "no snapshot record in etcd: {stored}"
    );
    assert!(
        stored.lines().any(|k| k.contains("/members/")),
        "no member in etcd: {stored}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificate_cn_is_the_etcd_user_without_a_password() {
    let fixture = Fixture::start().await;
    // No --etcd-user: etcd authenticates the coordinator as its certificate's CN, cairn.
    let args = fixture.tls_args(&fixture.certs, &fixture.certs, "cairn");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let cluster =
        CoordinatedCluster::start(1, Store::Etcd(fixture.etcd.endpoint.clone()), &[], &args)
            .await
            .unwrap();
    let nodes = cluster
        .client()
        .await
        .unwrap()
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes;
    assert_eq!(nodes.len(), 1);
    let stored = fixture
        .etcd
        .etcdctl(Some(ROOT), &["get", "--prefix", "--keys-only", "/cairn/"])
        .await
        .unwrap();
    assert!(stored.lines().any(|k| k.contains("/roster/")), "{stored}");

    // The CN of `stranger` is an etcd user without a role: refused, naming permission.
    let args = fixture.tls_args(&fixture.certs, &fixture.certs, "stranger");
    assert_refused(
        &fixture,
        "a CN without access",
        &args,
        &["permission denied"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_a_clear_start_up_error() {
    let fixture = Fixture::start().await;
    let good = fixture.tls_args(&fixture.certs, &fixture.certs, "cairn");

    let mut wrong_password = good.clone();
    wrong_password.extend([
        "--etcd-user".into(),
        "cairn".into(),
        "--etcd-password".into(),
        "not-the-password".into(),
    ]);
    assert_refused(
        &fixture,
        "a wrong password",
        &wrong_password,
        &["authentication", "user cairn", "wrong user or password"],
    )
    .await;

    // TLS, but no client certificate: etcd's handshake requires one.
    let no_cert = vec!["--etcd-ca".to_owned(), file(&fixture.certs, "ca.pem")];
    assert_refused(
        &fixture,
        "no client certificate",
        &no_cert,
        &["requires a client certificate", "none was given"],
    )
    .await;

    // A client certificate of another CA.
    let other_ca = fixture.tls_args(&fixture.certs, &fixture.other, "cairn");
    assert_refused(
        &fixture,
        "a client certificate of another CA",
        &other_ca,
        &["refused the coordinator's client certificate"],
    )
    .await;

    // etcd's server certificate checked against another CA.
    let wrong_ca = fixture.tls_args(&fixture.other, &fixture.certs, "cairn");
    assert_refused(
        &fixture,
        "etcd's certificate against another CA",
        &wrong_ca,
        &["refused etcd's server certificate"],
    )
    .await;

    // Flag misuse is a usage error (64) before anything is dialled.
    let garbage = tls_support::temp_dir("etcd-tls", "garbage").join("ca.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let (code, stderr, _) = run_to_exit(
        &fixture.etcd.endpoint,
        &["--etcd-ca".into(), garbage.display().to_string()],
    )
    .await;
    assert_eq!(code, Some(64), "{stderr}");
    assert_eq!(
        stderr.trim(),
        format!(
            "error: --etcd-ca {}: holds no PEM certificate",
            garbage.display()
        )
    );
    let (code, stderr, _) = run_to_exit(&fixture.etcd.endpoint, &[]).await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("--etcd-ca (the CA that signed etcd's certificate) is required"));
}
