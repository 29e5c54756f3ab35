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
//! And etcd as the deployments run it (issue 31, finding 3): the command line of
//! deploy/docker-compose.yml and of deploy/k8s (base and dev-certs), with the files
//! deploy/make-certs.sh writes, admits the coordinator's etcd client certificate alone
//! (etcd trusts a CA of its own), not a viewer's, a node's or an admin's of cairn's CA.
//!
//! Every process is killed by pid when its guard drops, pass or fail.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cairn_integration_tests::coordinated::{CoordinatedCluster, Store, assert_completed};
use cairn_integration_tests::etcd::{Etcd, EtcdTlsFiles};
use cairn_integration_tests::processes::{ChildGuard, binary, eventually, free_port};
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

// --- etcd as the deployments run it (issue 31, finding 3) --------------------------------
//
// etcd started from the command line that deploy/docker-compose.yml and the Kubernetes
// manifests (deploy/k8s/base/etcd.yaml with the Secrets of deploy/k8s/dev-certs) give it,
// its in-container paths mapped to the files deploy/make-certs.sh writes through the
// deployment's own mounts; only the listen and advertise URLs, the data directory and the
// peer URLs (unset there: etcd's default port would clash) are this test's. A viewer's
// and a node's certificate (of cairn's CA) must be refused for reads and writes; the
// coordinator, with the files the deployment gives it as CAIRN_ETCD_CA/CERT/KEY, reads and
// writes and completes a snapshot.

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_owned()
}

/// Leading spaces.
fn indent(line: &str) -> usize {
    line.len() - line.trim_start_matches(' ').len()
}

/// A line that holds nothing (blank, or a comment).
fn empty(line: &str) -> bool {
    let t = line.trim();
    t.is_empty() || t.starts_with('#')
}

/// A line's text without indentation and list dash, and that text's indentation.
fn key_text(line: &str) -> (usize, &str) {
    let t = line.trim_start();
    match t.strip_prefix("- ") {
        Some(rest) => (indent(line) + 2, rest.trim_start()),
        None => (indent(line), t),
    }
}

/// The value after `key:` on `line` (its text, list dash removed), unquoted.
fn value_of(line: &str, key: &str) -> Option<String> {
    let (_, text) = key_text(line);
    let rest = text.strip_prefix(key)?.strip_prefix(':')?;
    if !(rest.is_empty() || rest.starts_with(' ')) {
        return None;
    }
    Some(rest.trim().trim_matches('"').trim_matches('\'').to_owned())
}

/// The lines under the first child `key:` of `lines` (a child: at the indentation of the
/// block's first line, or of its first item's keys), or none.
fn child<'a>(lines: &[&'a str], key: &str) -> Option<Vec<&'a str>> {
    let first = lines.iter().find(|l| !empty(l))?;
    let base = indent(first);
    let levels = [base, key_text(first).0];
    let at = lines
        .iter()
        .position(|l| !empty(l) && levels.contains(&key_text(l).0) && value_of(l, key).is_some())?;
    let own = key_text(lines[at]).0;
    Some(
        lines[at + 1..]
            .iter()
            .take_while(|l| empty(l) || indent(l) > own)
            .copied()
            .collect(),
    )
}

/// `child` down a path of keys; panics naming `what` when one is missing.
fn at_path<'a>(what: &str, lines: &[&'a str], keys: &[&str]) -> Vec<&'a str> {
    let mut lines = lines.to_vec();
    for key in keys {
        lines = child(&lines, key).unwrap_or_else(|| panic!("{what}: no `{key}` in {keys:?}"));
    }
    lines
}

/// A block list's items, each its lines.
fn items<'a>(lines: &[&'a str]) -> Vec<Vec<&'a str>> {
    let mut out: Vec<Vec<&str>> = Vec::new();
    let Some(base) = lines.iter().find(|l| !empty(l)).map(|l| indent(l)) else {
        return out;
    };
    for line in lines.iter().filter(|l| !empty(l)) {
        if indent(line) == base && line.trim_start().starts_with("- ") {
            out.push(vec![line]);
        } else if let Some(item) = out.last_mut() {
            item.push(line);
        }
    }
    out
}

/// The first `key:` value among `lines`.
fn value(lines: &[&str], key: &str) -> Option<String> {
    lines.iter().find_map(|l| value_of(l, key))
}

/// A block list of scalars (`- etcd`, `- --name=etcd`).
fn scalars(lines: &[&str]) -> Vec<String> {
    items(lines)
        .iter()
        .map(|item| {
            key_text(item[0])
                .1
                .trim_matches('"')
                .trim_matches('\'')
                .to_owned()
        })
        .collect()
}

/// The double-quoted strings of `lines` (a flow list: `["etcdctl", "--cacert=..."]`).
fn quoted(lines: &[&str]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| !empty(l))
        .flat_map(|l| l.split('"').skip(1).step_by(2).map(str::to_owned))
        .collect()
}

/// The document of a multi-document YAML file whose `kind:` is `kind`.
fn document<'a>(text: &'a str, kind: &str) -> Vec<&'a str> {
    text.split("\n---\n")
        .map(|doc| doc.lines().collect::<Vec<_>>())
        .find(|doc| {
            doc.iter()
                .any(|l| value_of(l, "kind").as_deref() == Some(kind))
        })
        .unwrap_or_else(|| panic!("no {kind} in the manifest"))
}

/// What a deployment gives etcd and the coordinator, its paths mapped to host files.
#[derive(Debug)]
struct Deployed {
    /// etcd's command line (`etcd`, then its flags), file paths mapped.
    etcd: Vec<String>,
    /// The etcdctl line of its healthcheck or readiness probe, file paths mapped.
    probe: Vec<String>,
    /// CAIRN_ETCD_CA, CAIRN_ETCD_CERT, CAIRN_ETCD_KEY of the coordinator, mapped.
    coordinator: [PathBuf; 3],
}

/// Maps every `--flag=/path` of `args` through `map` (a path it cannot map fails the test:
/// the deployment would not find the file either).
fn map_args(what: &str, args: &[String], map: &dyn Fn(&str) -> Option<PathBuf>) -> Vec<String> {
    args.iter()
        .map(|arg| match arg.split_once('=') {
            Some((flag, path)) if path.starts_with('/') && flag != "--data-dir" => {
                let file =
                    map(path).unwrap_or_else(|| panic!("{what}: {flag} {path} is on no mount"));
                assert!(
                    file.exists(),
                    "{what}: {flag} {path} is {}, which make-certs.sh did not write",
                    file.display()
                );
                format!("{flag}={}", file.display())
            }
            _ => arg.clone(),
        })
        .collect()
}

/// The coordinator's CAIRN_ETCD_CA/CERT/KEY through `map`.
fn coordinator_files(
    what: &str,
    env: &dyn Fn(&str) -> Option<String>,
    map: &dyn Fn(&str) -> Option<PathBuf>,
) -> [PathBuf; 3] {
    ["CAIRN_ETCD_CA", "CAIRN_ETCD_CERT", "CAIRN_ETCD_KEY"].map(|key| {
        let path = env(key).unwrap_or_else(|| panic!("{what}: the coordinator has no {key}"));
        let file = map(&path).unwrap_or_else(|| panic!("{what}: {key} {path} is on no mount"));
        assert!(
            file.exists(),
            "{what}: {key} {path} is {}, which make-certs.sh did not write",
            file.display()
        );
        file
    })
}

/// A compose volume entry as (host file under `certs`, target): a `{type: bind, ...}` flow
/// mapping, or an alias (`*ca`) of a top-level `x-...: &ca` mapping of `compose`.
fn compose_bind(compose: &[&str], entry: &str, certs: &Path) -> Option<(PathBuf, String)> {
    let (source, target) = if let Some(alias) = entry.strip_prefix('*') {
        let at = compose
            .iter()
            .position(|l| indent(l) == 0 && l.trim_end().ends_with(&format!("&{alias}")))?;
        let block: Vec<&str> = compose[at + 1..]
            .iter()
            .take_while(|l| empty(l) || indent(l) > 0)
            .copied()
            .collect();
        (value(&block, "source")?, value(&block, "target")?)
    } else {
        let inner = entry.strip_prefix('{')?.strip_suffix('}')?;
        let field = |key: &str| {
            inner
                .split(',')
                .find_map(|f| f.trim().strip_prefix(key)?.strip_prefix(':'))
                .map(|v| v.trim().trim_matches('"').to_owned())
        };
        (field("source")?, field("target")?)
    };
    let file = source.strip_prefix("${CAIRN_CERTS:-./certs}/")?;
    Some((certs.join(file), target))
}

/// docker-compose.yml's etcd and coordinator, with the files of `certs`.
fn compose_deployment(certs: &Path) -> Deployed {
    let text = std::fs::read_to_string(repo().join("deploy/docker-compose.yml")).unwrap();
    let compose: Vec<&str> = text.lines().collect();
    let what = "docker-compose.yml";
    let mounts = |service: &[&str]| -> Vec<(PathBuf, String)> {
        items(&at_path(what, service, &["volumes"]))
            .iter()
            .filter_map(|item| compose_bind(&compose, key_text(item[0]).1, certs))
            .collect()
    };
    let etcd = at_path(what, &compose, &["services", "etcd"]);
    let etcd_mounts = mounts(&etcd);
    let etcd_map = |path: &str| {
        etcd_mounts
            .iter()
            .find(|(_, target)| target == path)
            .map(|(file, _)| file.clone())
    };
    let command = scalars(&at_path(what, &etcd, &["command"]));
    let test = quoted(&at_path(what, &etcd, &["healthcheck"]));
    let probe: Vec<String> = test.into_iter().skip_while(|t| t != "etcdctl").collect();
    let coordinator = at_path(what, &compose, &["services", "coordinator"]);
    let coordinator_mounts = mounts(&coordinator);
    let environment = at_path(what, &coordinator, &["environment"]);
    Deployed {
        etcd: map_args(what, &command, &etcd_map),
        probe: map_args(what, &probe, &etcd_map),
        coordinator: coordinator_files(what, &|key| value(&environment, key), &|path| {
            coordinator_mounts
                .iter()
                .find(|(_, target)| target == path)
                .map(|(file, _)| file.clone())
        }),
    }
}

/// A Kubernetes container path as a host file: the container's `volumeMounts`, the pod's
/// `volumes` (Secrets) and the dev-certs overlay's `secretGenerator` (KEY=certs/FILE).
fn k8s_file(
    container: &[&str],
    pod: &[&str],
    generator: &[Vec<&str>],
    certs: &Path,
    path: &str,
) -> Option<PathBuf> {
    let mounts = items(&child(container, "volumeMounts")?);
    let (name, key) = mounts.iter().find_map(|m| {
        let dir = value(m, "mountPath")?;
        let key = path.strip_prefix(&format!("{}/", dir.trim_end_matches('/')))?;
        Some((value(m, "name")?, key.to_owned()))
    })?;
    let volume = items(&child(pod, "volumes")?)
        .into_iter()
        .find(|v| value(v, "name").as_deref() == Some(name.as_str()))?;
    let secret = value(&volume, "secretName")?;
    let made = generator
        .iter()
        .find(|s| value(s, "name").as_deref() == Some(secret.as_str()))?;
    scalars(&child(made, "files")?).iter().find_map(|f| {
        let (k, file) = f.split_once('=')?;
        (k == key).then(|| certs.join(file.strip_prefix("certs/").unwrap_or(file)))
    })
}

/// The pod spec of the `kind` object of a manifest, and its first container.
fn pod_of<'a>(what: &str, text: &'a str, kind: &str) -> (Vec<&'a str>, Vec<&'a str>) {
    let doc = document(text, kind);
    let pod = at_path(what, &doc, &["spec", "template", "spec"]);
    let container = items(&at_path(what, &pod, &["containers"]))
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("{what}: no container"));
    (pod, container)
}

/// deploy/k8s/base's etcd and coordinator with the Secrets of the dev-certs overlay, made
/// from the files of `certs`.
fn kubernetes_deployment(certs: &Path) -> Deployed {
    let read = |file: &str| std::fs::read_to_string(repo().join(file)).unwrap();
    let (etcd_text, coordinator_text, overlay_text) = (
        read("deploy/k8s/base/etcd.yaml"),
        read("deploy/k8s/base/coordinator.yaml"),
        read("deploy/k8s/dev-certs/kustomization.yaml"),
    );
    let overlay: Vec<&str> = overlay_text.lines().collect();
    let generator = items(&at_path("dev-certs", &overlay, &["secretGenerator"]));
    let what = "k8s etcd.yaml";
    let (pod, container) = pod_of(what, &etcd_text, "StatefulSet");
    let map = |path: &str| k8s_file(&container, &pod, &generator, certs, path);
    let mut command = scalars(&at_path(what, &container, &["command"]));
    if let Some(args) = child(&container, "args") {
        command.extend(scalars(&args));
    }
    let probe: Vec<String> = quoted(&at_path(what, &container, &["readinessProbe"]))
        .into_iter()
        .skip_while(|t| t != "etcdctl")
        .collect();
    let deployed_etcd = map_args(what, &command, &map);
    let deployed_probe = map_args(what, &probe, &map);

    let what = "k8s coordinator.yaml";
    let (pod, container) = pod_of(what, &coordinator_text, "Deployment");
    let env = items(&at_path(what, &container, &["env"]));
    let coordinator = coordinator_files(
        what,
        &|key| {
            env.iter()
                .find(|e| value(e, "name").as_deref() == Some(key))
                .and_then(|e| value(e, "value"))
        },
        &|path| k8s_file(&container, &pod, &generator, certs, path),
    );
    Deployed {
        etcd: deployed_etcd,
        probe: deployed_probe,
        coordinator,
    }
}

/// `deploy/make-certs.sh DIR ARGS` with this build's cairnctl.
fn make_certs(dir: &Path, args: &[&str]) {
    let output = Command::new("bash")
        .arg(repo().join("deploy/make-certs.sh"))
        .arg(dir)
        .args(args)
        .env("CAIRNCTL", binary("cairnctl").unwrap())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "make-certs.sh: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// etcd as `deployed` starts it, on free loopback ports and a data directory in `dir`;
/// ready when the deployment's own probe passes. Its endpoint, its process and its log.
async fn start_deployed_etcd(
    what: &str,
    deployed: &Deployed,
    dir: &Path,
) -> (String, ChildGuard, PathBuf) {
    let (client, peer) = (free_port(), free_port());
    let endpoint = format!("https://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    assert_eq!(deployed.etcd[0], "etcd", "{what}: {:?}", deployed.etcd);
    let mut name = "default".to_owned();
    let mut args = Vec::new();
    for arg in &deployed.etcd[1..] {
        let (flag, value) = arg.split_once('=').unwrap_or((arg, ""));
        assert!(
            !flag.contains("peer") && flag != "--initial-cluster",
            "{what}: etcd's {flag} (this test sets the peer URLs)"
        );
        args.push(match flag {
            "--name" => {
                name = value.to_owned();
                arg.clone()
            }
            "--data-dir" => format!("--data-dir={}", dir.join("data").display()),
            "--listen-client-urls" | "--advertise-client-urls" => format!("{flag}={endpoint}"),
            _ => arg.clone(),
        });
    }
    args.extend([
        format!("--listen-peer-urls={peer_url}"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--initial-cluster={name}={peer_url}"),
    ]);
    eprintln!("{what}: etcd {}", args.join(" "));
    let binary = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("etcd is not installed: apt-get install -y etcd-server etcd-client");
    let mut command = Command::new(binary);
    command.args(&args).env("ETCD_UNSUPPORTED_ARCH", "");
    let log = dir.join("etcd.log");
    let process = ChildGuard::spawn("etcd", command, &log).unwrap();
    // Ready when the deployment's healthcheck / readiness probe passes (its etcdctl line,
    // at this etcd's address).
    assert_eq!(
        deployed.probe.first().map(String::as_str),
        Some("etcdctl"),
        "{what}: the probe {:?}",
        deployed.probe
    );
    let probe: Vec<String> = deployed.probe[1..]
        .iter()
        .map(|a| match a.split_once('=') {
            Some(("--endpoints", _)) => format!("--endpoints={endpoint}"),
            _ => a.clone(),
        })
        .collect();
    eventually(
        &format!("{what}: etcd's probe passes"),
        Duration::from_secs(30),
        || async {
            let out = tokio::process::Command::new("etcdctl")
                .args(&probe)
                .env("ETCDCTL_API", "3")
                .kill_on_drop(true)
                .output()
                .await?;
            anyhow::ensure!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(())
        },
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e:#}\netcd's log: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    });
    (endpoint, process, log)
}

/// etcdctl at `endpoint` with the CA `ca` and the client certificate `cert`, `key`: its
/// stdout, or an error with its stderr.
async fn etcdctl_as(
    endpoint: &str,
    [ca, cert, key]: [&Path; 3],
    args: &[&str],
) -> anyhow::Result<String> {
    let out = tokio::process::Command::new("etcdctl")
        .args([
            "--endpoints",
            endpoint,
            "--dial-timeout=2s",
            "--command-timeout=3s",
        ])
        .arg("--cacert")
        .arg(ca)
        .arg("--cert")
        .arg(cert)
        .arg("--key")
        .arg(key)
        .args(args)
        .env("ETCDCTL_API", "3")
        .kill_on_drop(true)
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "etcdctl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// The checks of issue 31 finding 3 on the deployment `what`: certificates from
/// make-certs.sh with `cert_args`; `people`: the certificates of cairn's CA to refuse.
async fn only_the_coordinator_reaches_etcd(
    what: &str,
    cert_args: &[&str],
    people: &[&str],
    deployment: fn(&Path) -> Deployed,
) {
    let base = tls_support::temp_dir("etcd-tls", what);
    let certs = base.join("certs");
    make_certs(&certs, cert_args);
    let deployed = deployment(&certs);
    eprintln!("{what}: {deployed:#?}");
    let (endpoint, _etcd, log) = start_deployed_etcd(what, &deployed, &base).await;
    let [ca, cert, key] = &deployed.coordinator;
    let coordinator = [ca.as_path(), cert.as_path(), key.as_path()];

    // The coordinator's etcd client certificate reads and writes under /cairn/.
    etcdctl_as(
        &endpoint,
        coordinator,
        &["put", "/cairn/probe", "coordinator"],
    )
    .await
    .unwrap_or_else(|e| panic!("{what}: the coordinator cannot write: {e:#}"));
    let read = etcdctl_as(
        &endpoint,
        coordinator,
        &["get", "--print-value-only", "/cairn/probe"],
    )
    .await
    .unwrap_or_else(|e| panic!("{what}: the coordinator cannot read: {e:#}"));
    assert_eq!(read.trim(), "coordinator", "{what}");

    // Every certificate of cairn's CA is refused, for a read and for a write, by etcd's
    // TLS handshake (the client checks etcd's certificate against etcd's CA, as the
    // coordinator does, so the refusal is etcd's): each attempt adds a line to etcd's log
    // naming the client certificate's unknown issuer.
    let rejections = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                l.contains("rejected connection")
                    && l.contains("certificate signed by unknown authority")
            })
            .count()
    };
    for who in people {
        let files = [
            ca.as_path(),
            &certs.join(format!("{who}.pem")),
            &certs.join(format!("{who}-key.pem")),
        ];
        for (op, args) in [
            ("read", &["get", "--prefix", "/cairn/"][..]),
            ("write", &["put", "/cairn/probe", who][..]),
        ] {
            let before = rejections();
            match etcdctl_as(&endpoint, files, args).await {
                Ok(out) => panic!("{what}: etcd let {who}'s certificate {op} /cairn/: {out}"),
                Err(e) => eprintln!("{what}: {who}'s {op} refused: {e:#}"),
            }
            eventually(
                &format!("{what}: etcd logging that it rejected {who}'s certificate"),
                Duration::from_secs(10),
                || async {
                    anyhow::ensure!(rejections() > before, "no new rejection in etcd's log");
                    Ok(())
                },
            )
            .await
            .unwrap();
        }
    }
    let read = etcdctl_as(
        &endpoint,
        coordinator,
        &["get", "--print-value-only", "/cairn/probe"],
    )
    .await
    .unwrap();
    assert_eq!(
        read.trim(),
        "coordinator",
        "{what}: /cairn/probe was rewritten"
    );

    // A real coordinator with those files: it joins, leads, and completes a snapshot, its
    // records in etcd.
    let args = [
        "--etcd-ca".to_owned(),
        ca.display().to_string(),
        "--etcd-cert".to_owned(),
        cert.display().to_string(),
        "--etcd-key".to_owned(),
        key.display().to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let cluster = CoordinatedCluster::start(2, Store::Etcd(endpoint.clone()), &[], &args)
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
    let stored = etcdctl_as(
        &endpoint,
        coordinator,
        &["get", "--prefix", "--keys-only", "/cairn/"],
    )
    .await
    .unwrap();
    assert!(
        stored.lines().any(|k| k.contains("/snapshots/")),
        "{what}: no snapshot record in etcd: {stored}"
    );
    drop(cluster);
    let _ = std::fs::remove_dir_all(&base);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_etcd_admits_only_the_coordinator() {
    // As docker-compose.yml's header says (and deploy/test/compose-test.sh runs it), with
    // a viewer besides the admin.
    only_the_coordinator_reaches_etcd(
        "compose",
        &[
            "--nodes",
            "n1,n2,n3",
            "--users",
            "admin:admin,monitor:viewer",
            "--servers",
            "etcd",
        ],
        &["monitor", "n1", "admin"],
        compose_deployment,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_etcd_admits_only_the_coordinator() {
    // As deploy/k8s/dev-certs/kustomization.yaml's header says (and scripts/test.sh runs
    // it), with a viewer besides the admin.
    only_the_coordinator_reaches_etcd(
        "k8s",
        &[
            "--san",
            "cairn-coordinator",
            "--nodes",
            "cairn-node-0,cairn-node-1,cairn-node-2",
            "--users",
            "admin:admin,monitor:viewer",
            "--servers",
            "cairn-etcd",
        ],
        &["monitor", "cairn-node-0", "admin"],
        kubernetes_deployment,
    )
    .await;
}

/// `cairnctl certs init --servers`: the servers' certificates and the coordinator's etcd
/// client certificate come from a CA of their own, and nothing else does.
#[test]
fn certs_init_gives_the_servers_a_ca_of_their_own() {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    use std::os::unix::fs::PermissionsExt;

    let base = tls_support::temp_dir("etcd-tls", "servers-ca");
    let init = |dir: &Path, nodes: &str, servers: bool| {
        let mut command = Command::new(binary("cairnctl").unwrap());
        command
            .args(["certs", "init", "--cluster", "etcd-test", "--nodes", nodes])
            .args(["--users", "watcher:viewer", "--dir"])
            .arg(dir);
        if servers {
            command.args(["--servers", "etcd"]);
        }
        command.output().unwrap()
    };
    let dir = base.join("certs");
    let out = init(&dir, "n1", true);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // (subject, issuer, whether it names a URI) of DIR/NAME.pem.
    let read = |name: &str| {
        let der = CertificateDer::from_pem_file(dir.join(format!("{name}.pem"))).unwrap();
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        let uri = cert.subject_alternative_name().unwrap().is_some_and(|san| {
            san.value
                .general_names
                .iter()
                .any(|n| matches!(n, x509_parser::extensions::GeneralName::URI(_)))
        });
        (cert.subject().to_string(), cert.issuer().to_string(), uri)
    };
    let cluster_ca = "CN=cairn etcd-test CA";
    let etcd_ca = "CN=cairn etcd-test etcd CA";
    assert_eq!(read("ca"), (cluster_ca.into(), cluster_ca.into(), false));
    assert_eq!(read("etcd-ca"), (etcd_ca.into(), etcd_ca.into(), false));
    assert_eq!(read("etcd"), ("CN=etcd".into(), etcd_ca.into(), false));
    assert_eq!(
        read("coordinator-etcd"),
        ("CN=coordinator".into(), etcd_ca.into(), false)
    );
    for name in ["coordinator", "n1", "watcher"] {
        let (_, issuer, uri) = read(name);
        assert_eq!(issuer, cluster_ca, "{name}");
        assert!(uri, "{name}: no cairn identity");
    }
    for key in ["ca-key.pem", "etcd-ca-key.pem", "coordinator-etcd-key.pem"] {
        let mode = std::fs::metadata(dir.join(key))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{key}");
    }
    // Without --servers, no etcd CA.
    let plain = base.join("plain");
    assert!(init(&plain, "n1", false).status.success());
    assert!(!plain.join("etcd-ca.pem").exists());
    assert!(!plain.join("coordinator-etcd.pem").exists());
    // The CAs' and the coordinator's files cannot be a node's (nor a user's or a server's).
    for name in ["etcd-ca", "coordinator-etcd", "ca-key", "etcd-ca-key"] {
        let out = init(&base.join(name), &format!("n1,{name}"), true);
        assert!(!out.status.success(), "{name} accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("cannot name a certificate"),
            "{name}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&base);
}
