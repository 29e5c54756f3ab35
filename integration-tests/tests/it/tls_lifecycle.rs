//! Certificate lifecycle (issue 15 item 4), on real processes: the daemons reload their
//! certificate and key when the files change, under load, without dropping a channel,
//! losing or duplicating a message, and serve the new certificate to new connections;
//! expired, not-yet-valid and other-CA client certificates are refused on the
//! coordinator's port and a peer port with the reason in the server's metric and log; a
//! client that dials node X refuses another node's certificate; cairnctl says a server's
//! certificate has expired; a daemon whose own certificate is expired, not yet valid or
//! of another CA does not start (exit 64, one line naming the flag, the file and why);
//! idle connections that never start a handshake cannot use up a TLS port (at most 16 in
//! flight from one address and 256 on the port; the rest closed at once as `busy`).

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cairn_integration_tests::coordinated::{
    CoordinatedCluster, Store, TLS_TEST_USER, TLS_TEST_USER_SPEC, assert_completed, certs_init,
    tls_args,
};
use cairn_integration_tests::processes::{binary, eventually, free_port};
use cairn_integration_tests::tls_support;
use cairn_rpc::v1 as pb;
use cairn_sdk::tls::{Tls, endpoint, endpoint_for};
use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, SanType};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

fn der_of(pem: &[u8]) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem).unwrap()
}

/// A new certificate and key like `template`'s (its common name, SANs and extended key
/// usages: the same identity), valid from `now + from` to `now + to` (seconds; negative
/// is in the past), signed by `issuer`.
fn reissue(
    issuer: &Issuer<'static, KeyPair>,
    template: &Path,
    from: i64,
    to: i64,
) -> (String, String) {
    let pem = std::fs::read(template).unwrap();
    let der = der_of(&pem);
    let (_, old) = x509_parser::parse_x509_certificate(&der).unwrap();
    let mut params = CertificateParams::default();
    if let Some(cn) = old
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
    {
        params.distinguished_name.push(DnType::CommonName, cn);
    }
    if let Ok(Some(san)) = old.subject_alternative_name() {
        use x509_parser::extensions::GeneralName;
        for name in &san.value.general_names {
            params.subject_alt_names.push(match name {
                GeneralName::DNSName(d) => SanType::DnsName((*d).try_into().unwrap()),
                GeneralName::URI(u) => SanType::URI((*u).try_into().unwrap()),
                GeneralName::IPAddress(ip) => SanType::IpAddress(match ip.len() {
                    4 => <[u8; 4]>::try_from(*ip).unwrap().into(),
                    _ => <[u8; 16]>::try_from(*ip).unwrap().into(),
                }),
                other => panic!(
                    "{}: a SAN this test cannot copy: {other:?}",
                    template.display()
                ),
            });
        }
    }
    if let Ok(Some(eku)) = old.extended_key_usage() {
        if eku.value.server_auth {
            params
                .extended_key_usages
                .push(ExtendedKeyUsagePurpose::ServerAuth);
        }
        if eku.value.client_auth {
            params
                .extended_key_usages
                .push(ExtendedKeyUsagePurpose::ClientAuth);
        }
    }
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let at = |offset: i64| {
        let secs = now.as_secs() as i64 + offset;
        rcgen::date_time_ymd(1970, 1, 1) + Duration::from_secs(secs as u64)
    };
    params.not_before = at(from);
    params.not_after = at(to);
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// Replaces `path` with `text` in one step (a new file renamed over it), as a Secret
/// update replaces its files; 0600 for keys.
fn replace(path: &Path, text: &str, secret: bool) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("new");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&tmp)
        .unwrap();
    file.write_all(text.as_bytes()).unwrap();
    file.sync_all().unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn metric_at(
    cluster: &CoordinatedCluster,
    address: &str,
    name: &str,
    label: Option<&str>,
) -> f64 {
    tls_support::metric(&cluster.scrape(address).await.unwrap(), name, label)
}

/// The certificate a new TLS connection to `address` is served, as a client presenting
/// `dir`'s user certificate and trusting `dir`'s CA sees it.
async fn served_certificate(address: &str, dir: &Path) -> CertificateDer<'static> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(der_of(&std::fs::read(dir.join("ca.pem")).unwrap()))
        .unwrap();
    let chain = vec![der_of(
        &std::fs::read(dir.join(format!("{TLS_TEST_USER}.pem"))).unwrap(),
    )];
    let key = PrivateKeyDer::from_pem_file(dir.join(format!("{TLS_TEST_USER}-key.pem"))).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(address).await.unwrap();
    let host = cairn_sdk::tls::host_of(address).to_owned();
    let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(host).unwrap(), tcp)
        .await
        .unwrap();
    let (_, session) = stream.get_ref();
    assert_eq!(session.alpn_protocol(), Some(&b"h2"[..]), "ALPN h2");
    session.peer_certificates().unwrap()[0].clone()
}

fn request(mode: pb::SnapshotMode) -> pb::StartSnapshotRequest {
    pb::StartSnapshotRequest {
        mode: mode as i32,
        timeout_ms: 30_000,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotating_certificates_under_load_keeps_channels_up_and_serves_the_new_ones() {
    let certs = tls_support::temp_dir("tls-life", "rotate");
    certs_init(&certs, 3, &[TLS_TEST_USER_SPEC]).unwrap();
    let cluster = CoordinatedCluster::start_opts(3, Store::Embedded, &[], &[], &[], Some(&certs))
        .await
        .unwrap();
    let snapshot = cluster
        .completed(request(pb::SnapshotMode::ChandyLamport))
        .await
        .unwrap();
    assert_completed(&snapshot, cluster.total());

    // Every channel and every coordinator session is up: their counters now.
    let mut before = Vec::new();
    for node in &cluster.nodes {
        let text = cluster.scrape(&node.metrics).await.unwrap();
        let sessions = tls_support::metric(&text, "cairn_node_coordinator_sessions_total", None);
        assert!(sessions >= 1.0, "{}: {sessions}", node.id);
        before.push((
            tls_support::metric(&text, "cairn_node_channel_reconnects_total", None),
            sessions,
        ));
    }
    let mut daemons: Vec<(String, String, String)> = vec![(
        "coordinator".into(),
        cluster.coordinator.clone(),
        cluster.coordinator_metrics.clone(),
    )];
    for node in &cluster.nodes {
        daemons.push((node.id.clone(), node.peer.clone(), node.metrics.clone()));
    }
    for (name, address, metrics) in &daemons {
        assert_eq!(
            metric_at(&cluster, metrics, "cairn_tls_reloads_total", None).await,
            0.0
        );
        let served = served_certificate(address, &certs).await;
        let file = der_of(&std::fs::read(certs.join(format!("{name}.pem"))).unwrap());
        assert_eq!(served, file, "{name} serves its certificate");
    }

    // A snapshot in flight while the files change, the banks sending all along.
    let in_flight = cluster
        .start_snapshot(request(pb::SnapshotMode::Unaligned))
        .await
        .unwrap();
    let issuer = tls_support::ca_issuer(&certs).unwrap();
    let mut new = Vec::new();
    for (name, _, _) in &daemons {
        let cert_path = certs.join(format!("{name}.pem"));
        let (cert, key) = reissue(&issuer, &cert_path, -3600, 2 * 86_400);
        // The key first, then the certificate: a poll in between sees a key that does not
        // match the certificate, refuses it and keeps the old pair until the next.
        replace(&certs.join(format!("{name}-key.pem")), &key, true);
        replace(&cert_path, &cert, false);
        new.push(der_of(cert.as_bytes()));
    }
    // Each daemon says it reloaded.
    for (name, _, metrics) in &daemons {
        eventually(
            &format!("{name} reloads its certificate"),
            Duration::from_secs(30),
            || async {
                let reloads = metric_at(&cluster, metrics, "cairn_tls_reloads_total", None).await;
                anyhow::ensure!(reloads >= 1.0, "{reloads} reloads");
                Ok(())
            },
        )
        .await
        .unwrap();
    }

    // Snapshots keep completing, in every mode, and the money adds up (no transfer lost
    // or delivered twice).
    assert_completed(&cluster.wait(in_flight).await.unwrap(), cluster.total());
    for mode in [
        pb::SnapshotMode::ChandyLamport,
        pb::SnapshotMode::Unaligned,
        pb::SnapshotMode::Aligned,
    ] {
        let snapshot = cluster
            .completed(request(mode))
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        assert_completed(&snapshot, cluster.total());
    }

    // No channel and no coordinator session reconnected: they stayed up.
    for (node, (reconnects, sessions)) in cluster.nodes.iter().zip(&before) {
        let text = cluster.scrape(&node.metrics).await.unwrap();
        assert_eq!(
            tls_support::metric(&text, "cairn_node_channel_reconnects_total", None),
            *reconnects,
            "{}: channels reconnected",
            node.id
        );
        assert_eq!(
            tls_support::metric(&text, "cairn_node_coordinator_sessions_total", None),
            *sessions,
            "{}: the coordinator session reconnected",
            node.id
        );
        let status = cluster
            .admin(cluster.nodes.iter().position(|n| n.id == node.id).unwrap())
            .await
            .unwrap()
            .get_node_status(pb::GetNodeStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        for channel in &status.channels {
            assert!(channel.connected, "{}: {channel:?}", node.id);
        }
    }

    // A new connection is served the new certificate.
    for ((name, address, _), new) in daemons.iter().zip(&new) {
        assert_eq!(
            &served_certificate(address, &certs).await,
            new,
            "{name} serves its new certificate"
        );
    }

    // A bad file (garbage) keeps the certificate in force, and the daemon keeps serving.
    let (name, address, metrics) = &daemons[1];
    let reloads = metric_at(&cluster, metrics, "cairn_tls_reloads_total", None).await;
    replace(
        &certs.join(format!("{name}.pem")),
        "not a certificate\n",
        false,
    );
    eventually(
        &format!("{name} logs the bad file"),
        Duration::from_secs(30),
        || async {
            let log = cluster.log_of(name);
            anyhow::ensure!(
                log.contains("keeping the TLS certificate in force") && log.contains("--tls-cert"),
                "not logged yet"
            );
            Ok(())
        },
    )
    .await
    .unwrap();
    assert_eq!(&served_certificate(address, &certs).await, &new[1]);
    assert_eq!(
        metric_at(&cluster, metrics, "cairn_tls_reloads_total", None).await,
        reloads
    );

    drop(cluster);
    let _ = std::fs::remove_dir_all(&certs);
}

/// Calls ListNodes (the coordinator) or GetNodeStatus (a peer port) at `address`: the
/// error's text, with what the SDK makes of a TLS failure, if refused.
async fn call(
    address: &str,
    coordinator: bool,
    tls: &Tls,
    name: Option<&str>,
) -> Result<(), String> {
    let call = async {
        let endpoint = match name {
            Some(name) => endpoint_for(address, name, Some(tls)),
            None => endpoint(address, Some(tls)),
        };
        let channel = endpoint
            .map_err(|e| e.to_string())?
            .connect()
            .await
            .map_err(describe)?;
        if coordinator {
            pb::coordinator_client::CoordinatorClient::new(channel)
                .list_nodes(pb::ListNodesRequest {})
                .await
                .map_err(describe)?;
        } else {
            pb::node_admin_client::NodeAdminClient::new(channel)
                .get_node_status(pb::GetNodeStatusRequest {})
                .await
                .map_err(describe)?;
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .map_err(|_| "no answer within 10 s".to_owned())?
}

fn describe<E: std::error::Error + 'static>(error: E) -> String {
    let explained = cairn_sdk::tls::explain(&error).unwrap_or_default();
    format!("{explained} | {error:?}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_early_and_foreign_certificates_are_refused_saying_which() {
    let certs = tls_support::temp_dir("tls-life", "refuse");
    let other = tls_support::temp_dir("tls-life", "refuse-other");
    certs_init(&certs, 1, &[TLS_TEST_USER_SPEC]).unwrap();
    certs_init(&other, 1, &[TLS_TEST_USER_SPEC]).unwrap();
    let cluster = CoordinatedCluster::start_opts(1, Store::Embedded, &[], &[], &[], Some(&certs))
        .await
        .unwrap();
    let ca = certs.join("ca.pem");
    let issuer = tls_support::ca_issuer(&certs).unwrap();
    let user = certs.join(format!("{TLS_TEST_USER}.pem"));
    let client = |name: &str, (cert, key): (String, String)| {
        let dir = certs.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        replace(&dir.join("c.pem"), &cert, false);
        replace(&dir.join("k.pem"), &key, true);
        Tls::from_files(&ca, Some((&dir.join("c.pem"), &dir.join("k.pem")))).unwrap()
    };
    let expired = client("expired", reissue(&issuer, &user, -2 * 86_400, -86_400));
    let early = client("early", reissue(&issuer, &user, 86_400, 2 * 86_400));
    let foreign = Tls::from_files(
        &ca,
        Some((
            &other.join(format!("{TLS_TEST_USER}.pem")),
            &other.join(format!("{TLS_TEST_USER}-key.pem")),
        )),
    )
    .unwrap();
    let good = Tls::from_files(
        &ca,
        Some((&user, &certs.join(format!("{TLS_TEST_USER}-key.pem")))),
    )
    .unwrap();

    let ports = [
        (
            cluster.coordinator.clone(),
            true,
            cluster.coordinator_metrics.clone(),
            "coordinator",
        ),
        (
            cluster.nodes[0].peer.clone(),
            false,
            cluster.nodes[0].metrics.clone(),
            "n1",
        ),
    ];
    for (address, coordinator, metrics, log) in &ports {
        call(address, *coordinator, &good, None).await.unwrap();
        for (tls, reason, client_says, server_says) in [
            (
                &expired,
                "expired",
                "it has expired or is not yet valid",
                "the client's certificate has expired (not after",
            ),
            (
                &early,
                "not_yet_valid",
                "it has expired or is not yet valid",
                "the client's certificate is not yet valid (not before",
            ),
            (
                &foreign,
                "unknown_issuer",
                "not signed by the server's CA",
                "the client's certificate is not signed by this cluster's CA",
            ),
        ] {
            let error = call(address, *coordinator, tls, None).await.unwrap_err();
            // The client learns why from the server's alert only when it reads it before
            // its request is queued (TLS 1.3: the server judges the client's certificate
            // after the client's handshake is done); hyper may report just that the
            // connection closed or was not ready. The server's words are asserted below.
            assert!(
                error.contains(client_says)
                    || error.contains("connection closed")
                    || error.contains("connection was not ready"),
                "{log} {reason}: {error}"
            );
            let label = format!("reason=\"{reason}\"");
            // The server counts the refusal in its handshake task, which may finish after
            // the client has seen the connection close: wait for the count.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            let count = loop {
                let count = metric_at(
                    &cluster,
                    metrics,
                    "cairn_tls_handshake_refused_total",
                    Some(&label),
                )
                .await;
                if count >= 1.0 || tokio::time::Instant::now() >= deadline {
                    break count;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            assert!(count >= 1.0, "{log}: {reason} counted {count}");
            let text = cluster.log_of(log);
            assert!(
                text.contains(server_says),
                "{log}: {reason} not logged:\n{text}"
            );
        }
        // Plaintext.
        let plaintext = async {
            let channel = endpoint(address, None).unwrap().connect().await?;
            pb::node_admin_client::NodeAdminClient::new(channel)
                .get_node_status(pb::GetNodeStatusRequest {})
                .await?;
            anyhow::Ok(())
        };
        assert!(plaintext.await.is_err(), "{log}: plaintext served");
        eventually(
            "the plaintext refusal counted",
            Duration::from_secs(10),
            || async {
                let n = metric_at(
                    &cluster,
                    metrics,
                    "cairn_tls_handshake_refused_total",
                    Some("reason=\"plaintext\""),
                )
                .await;
                anyhow::ensure!(n >= 1.0, "{n}");
                Ok(())
            },
        )
        .await
        .unwrap();
        // Logged once per client address and reason: a second expired attempt adds none.
        let _ = call(address, *coordinator, &expired, None)
            .await
            .unwrap_err();
        let text = cluster.log_of(log);
        assert_eq!(
            text.matches("the client's certificate has expired").count(),
            1,
            "{log}: logged once"
        );
    }

    // A daemon dialing node X checks the certificate names X: n1's is refused as "n2".
    let error = call(&cluster.nodes[0].peer, false, &good, Some("n2"))
        .await
        .unwrap_err();
    assert!(error.contains("does not name n2"), "{error}");
    call(&cluster.nodes[0].peer, false, &good, Some("n1"))
        .await
        .unwrap();

    // A server whose certificate has expired: cairnctl says so.
    let (cert, key) = reissue(
        &issuer,
        &certs.join("coordinator.pem"),
        -2 * 86_400,
        -86_400,
    );
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![der_of(cert.as_bytes())],
        PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let server = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = acceptor.accept(tcp).await;
        }
    });
    let out = tokio::process::Command::new(binary("cairnctl").unwrap())
        .args(["--coordinator", &address, "nodes", "--tls-ca"])
        .arg(&ca)
        .arg("--tls-cert")
        .arg(&user)
        .arg("--tls-key")
        .arg(certs.join(format!("{TLS_TEST_USER}-key.pem")))
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    server.abort();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("the server's certificate has expired (not after"),
        "{stderr}"
    );

    drop(cluster);
    let _ = std::fs::remove_dir_all(&certs);
    let _ = std::fs::remove_dir_all(&other);
}

/// Opens `each` TCP connections to `address` from every address of `sources` (loopback
/// addresses: all of 127.0.0.0/8 is this machine's) that never send a byte.
async fn idle_connections(
    address: &str,
    sources: &[std::net::IpAddr],
    each: usize,
) -> Vec<tokio::net::TcpStream> {
    let target: std::net::SocketAddr = address.parse().unwrap();
    let mut held = Vec::new();
    for source in sources {
        for _ in 0..each {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(std::net::SocketAddr::new(*source, 0)).unwrap();
            held.push(socket.connect(target).await.unwrap());
        }
    }
    held
}

/// Waits until `metrics` shows no TLS handshake in flight.
async fn no_handshake_in_flight(cluster: &CoordinatedCluster, metrics: &str) {
    eventually(
        "no handshake in flight",
        Duration::from_secs(20),
        || async {
            let n = metric_at(cluster, metrics, "cairn_tls_handshakes_in_flight", None).await;
            anyhow::ensure!(n == 0.0, "{n} in flight");
            Ok(())
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_exhaust_a_tls_port() {
    use tokio::io::AsyncReadExt;
    let certs = tls_support::temp_dir("tls-life", "idle");
    certs_init(&certs, 1, &[TLS_TEST_USER_SPEC]).unwrap();
    let cluster = CoordinatedCluster::start_opts(1, Store::Embedded, &[0], &[], &[], Some(&certs))
        .await
        .unwrap();
    let good = Tls::from_files(
        &certs.join("ca.pem"),
        Some((
            &certs.join(format!("{TLS_TEST_USER}.pem")),
            &certs.join(format!("{TLS_TEST_USER}-key.pem")),
        )),
    )
    .unwrap();
    let address = &cluster.coordinator;
    let metrics = &cluster.coordinator_metrics;
    let busy = Some("reason=\"busy\"");
    let refused = "cairn_tls_handshake_refused_total";
    let in_flight = "cairn_tls_handshakes_in_flight";
    let sessions = "cairn_node_coordinator_sessions_total";
    let node_sessions = metric_at(&cluster, &cluster.nodes[0].metrics, sessions, None).await;
    assert_eq!(metric_at(&cluster, metrics, refused, busy).await, 0.0);

    // 300 connections from one address that never start a handshake: 16 wait for theirs
    // (at most 5 s), the others are closed at once.
    let attacker: std::net::IpAddr = "127.0.0.2".parse().unwrap();
    let held = idle_connections(address, &[attacker], 300).await;
    let mut one_more = idle_connections(address, &[attacker], 1).await.remove(0);
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(Duration::from_secs(3), one_more.read(&mut byte))
        .await
        .expect("a connection beyond the bound is closed at once");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    eventually(
        "the busy refusals counted",
        Duration::from_secs(20),
        || async {
            let n = metric_at(&cluster, metrics, refused, busy).await;
            anyhow::ensure!(n >= 285.0, "{n} counted");
            Ok(())
        },
    )
    .await
    .unwrap();
    let n = metric_at(&cluster, metrics, in_flight, None).await;
    assert!(n <= 16.0, "{n} handshakes in flight");

    // A client from elsewhere is served at once meanwhile.
    let started = std::time::Instant::now();
    call(address, true, &good, None).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "served in {:?}",
        started.elapsed()
    );
    let log = cluster.log_of("coordinator");
    assert_eq!(
        log.matches("refused a TLS connection from 127.0.0.2: 16 TLS handshakes from this address")
            .count(),
        1,
        "logged once:\n{log}"
    );
    drop(held);
    drop(one_more);
    no_handshake_in_flight(&cluster, metrics).await;

    // From many addresses (16 each, within the bound per address), 272 connections fill
    // the port's 256 places: the other 16 are closed at once.
    let before = metric_at(&cluster, metrics, refused, busy).await;
    let sources: Vec<std::net::IpAddr> = (10..27)
        .map(|i| std::net::Ipv4Addr::new(127, 0, 0, i).into())
        .collect();
    let held = idle_connections(address, &sources, 16).await;
    eventually(
        "the port's bound reached",
        Duration::from_secs(20),
        || async {
            let n = metric_at(&cluster, metrics, refused, busy).await;
            anyhow::ensure!(n >= before + 16.0, "{} more counted", n - before);
            Ok(())
        },
    )
    .await
    .unwrap();
    let n = metric_at(&cluster, metrics, in_flight, None).await;
    assert!(n <= 256.0, "{n} handshakes in flight");
    drop(held);
    no_handshake_in_flight(&cluster, metrics).await;

    // Everything as before: served, the node still registered on the session it had.
    call(address, true, &good, None).await.unwrap();
    let nodes = cluster
        .client()
        .await
        .unwrap()
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes;
    assert!(
        nodes.iter().any(|n| n.node_id == "n1" && n.connected),
        "{nodes:?}"
    );
    assert_eq!(
        metric_at(&cluster, &cluster.nodes[0].metrics, sessions, None).await,
        node_sessions,
        "the node's coordinator session stayed up"
    );

    drop(cluster);
    let _ = std::fs::remove_dir_all(&certs);
}

#[test]
fn a_daemon_with_an_expired_early_or_foreign_certificate_exits_64_saying_which() {
    let dir = tls_support::temp_dir("tls-life", "own");
    let other = tls_support::temp_dir("tls-life", "own-other");
    certs_init(&dir, 1, &[]).unwrap();
    certs_init(&other, 1, &[]).unwrap();
    let issuer = tls_support::ca_issuer(&dir).unwrap();
    for (name, (from, to)) in [
        ("expired", (-2 * 86_400, -86_400)),
        ("early", (86_400, 2 * 86_400)),
    ] {
        let (cert, key) = reissue(&issuer, &dir.join("n1.pem"), from, to);
        replace(&dir.join(format!("{name}.pem")), &cert, false);
        replace(&dir.join(format!("{name}-key.pem")), &key, true);
    }
    std::fs::copy(other.join("n1.pem"), dir.join("foreign.pem")).unwrap();
    std::fs::copy(other.join("n1-key.pem"), dir.join("foreign-key.pem")).unwrap();
    for (name, says) in [
        ("expired", "the certificate has expired (not after"),
        ("early", "the certificate is not yet valid (not before"),
        (
            "foreign",
            "the certificate is not signed by this cluster's CA",
        ),
    ] {
        let flags = tls_args(&dir, name);
        let file = dir.join(format!("{name}.pem")).display().to_string();
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
            assert_eq!(out.status.code(), Some(64), "{name}: {stderr}");
            assert!(
                stderr.contains(&format!("--tls-cert {file}")) && stderr.contains(says),
                "{name}: {stderr}"
            );
            assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&other);
}
