//! Operational edges with real processes: the bank refuses a transfer it cannot apply (a
//! payload that does not decode, a credit that would overflow) and counts it;
//! `cairnctl cluster up --coordinator ADDR` starts its coordinator on ADDR; after the etcd
//! lease is lost, the coordinator puts the `members/*` keys back under a new one.

use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use cairn_cli::bank::TransferPayload;
use cairn_integration_tests::coordinated::{CoordinatedCluster, Store};
use cairn_integration_tests::etcd::Etcd;
use cairn_integration_tests::processes::{ChildGuard, binary, eventually, free_port};
use cairn_proto::bank::v1 as bank_pb;
use cairn_proto::v1 as pb;
use cairn_sdk::AppSession;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bank_counts_and_never_applies_a_malformed_or_overflowing_transfer() {
    // n1 has no bank: the test is its application and sends n2's bank what it likes.
    let cluster = CoordinatedCluster::start(2, Store::Embedded, &[0], &[])
        .await
        .unwrap();
    cluster.set_workload(0.0).await.unwrap();
    let mut session = AppSession::connect(&cluster.nodes[0].app, "test")
        .await
        .unwrap();
    let sender = session.sender();
    eventually("n1's application knows n2", Duration::from_secs(30), || {
        let known = sender.peers().contains("n2");
        async move {
            anyhow::ensure!(known, "n2 is not a peer yet");
            Ok(())
        }
    })
    .await
    .unwrap();
    // Drain what n2's workload sent before it paused, so the session never backs up.
    tokio::spawn(async move { while let Ok(Some(_)) = session.next_event().await {} });

    let mut bank = cluster.bank(1).await.unwrap();
    let before = bank
        .get_balance(bank_pb::GetBalanceRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(before.rejected_transfers, 0);
    let amount = |amount| {
        TransferPayload {
            amount,
            ..Default::default()
        }
        .encode()
    };
    // In FIFO order: 5 makes the balance positive, so u64::MAX overflows it.
    for payload in [
        amount(5),
        amount(u64::MAX),
        Bytes::from_static(b"not a transfer"),
        amount(7),
    ] {
        sender.send("n2", payload).await.unwrap();
    }
    let applied = before.balance + 12;
    let after = eventually(
        "n2's bank applied the last transfer",
        Duration::from_secs(30),
        || {
            let mut bank = bank.clone();
            async move {
                let balance = bank
                    .get_balance(bank_pb::GetBalanceRequest {})
                    .await?
                    .into_inner();
                // The two refusals come before the 7 in FIFO order: seeing them is not
                // seeing the 7 applied (a balance read in between once failed this test).
                anyhow::ensure!(balance.rejected_transfers >= 2, "{balance:?}");
                anyhow::ensure!(balance.balance >= applied, "{balance:?}");
                Ok(balance)
            }
        },
    )
    .await
    .unwrap();
    assert_eq!(after.rejected_transfers, 2, "{after:?}");
    assert_eq!(
        after.balance,
        before.balance + 12,
        "only the two good transfers were applied: {after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_up_starts_its_coordinator_on_the_address_given() {
    let dir = std::env::temp_dir().join(format!(
        "cairn-cluster-up-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let requested = format!("127.0.0.1:{}", free_port());
    let addresses = dir.join("addresses.json");
    let mut command = Command::new(binary("cairnctl").unwrap());
    command
        .args(["cluster", "up", "--nodes", "2", "--coordinator", &requested])
        .arg("--dir")
        .arg(dir.join("cluster"))
        .arg("--addresses")
        .arg(&addresses)
        .env_remove("CAIRN_COORDINATOR");
    let mut cluster =
        ChildGuard::spawn("cairnctl cluster up", command, &dir.join("cairnctl.log")).unwrap();
    let file = eventually("addresses file", Duration::from_secs(60), || async {
        Ok(serde_json::from_slice::<serde_json::Value>(
            &std::fs::read(&addresses)?,
        )?)
    })
    .await
    .unwrap();
    assert_eq!(file["coordinator"].as_str(), Some(requested.as_str()));
    // `cluster up` wrote the file once the cluster was ready: both nodes are registered
    // with the coordinator on the requested address (over TLS, with the cluster's admin
    // certificate and token).
    let security = &file["security"];
    let path = |key: &str| std::path::PathBuf::from(security[key].as_str().expect(key));
    let tls =
        cairn_sdk::tls::Tls::from_files(&path("ca"), Some((&path("cert"), &path("key")))).unwrap();
    let token = std::fs::read_to_string(path("token_file")).unwrap();
    let mut client =
        cairn_sdk::CoordinatorClient::connect_with(&requested, Some(token.trim()), Some(&tls))
            .await
            .unwrap();
    let nodes = client
        .raw()
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes;
    assert_eq!(nodes.len(), 2, "{nodes:?}");
    assert!(nodes.iter().all(|n| n.connected), "{nodes:?}");

    let status = cluster
        .terminate(Duration::from_secs(15))
        .expect("cairnctl stops on SIGTERM");
    assert!(status.success(), "cairnctl cluster up exited with {status}");

    // An address that cannot be listened on is refused at once, naming it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let out = Command::new(binary("cairnctl").unwrap())
        .args(["cluster", "up", "--nodes", "1", "--coordinator", &taken])
        .arg("--dir")
        .arg(dir.join("refused"))
        .arg("--addresses")
        .arg(dir.join("refused.json"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(&taken), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

async fn etcdctl(endpoint: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = tokio::process::Command::new("etcdctl")
        .arg("--endpoints")
        .arg(endpoint)
        .args(args)
        .env("ETCDCTL_API", "3")
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "etcdctl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// The lease ids `etcdctl lease list` shows (hex).
async fn leases(endpoint: &str) -> anyhow::Result<Vec<String>> {
    let list = etcdctl(endpoint, &["lease", "list"]).await?;
    Ok(list
        .lines()
        .skip(1) // "found N leases"
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_etcd_lease_is_lost_the_members_keys_are_put_back() {
    let etcd = Etcd::start().await.expect("etcd starts");
    let cluster = CoordinatedCluster::start(2, Store::Etcd(etcd.endpoint.clone()), &[], &[])
        .await
        .unwrap();
    let members = "/cairn/cairn/members/";
    let keys = || async {
        let dump = etcdctl(&etcd.endpoint, &["get", "--prefix", "--keys-only", members]).await?;
        let mut keys: Vec<String> = dump
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect();
        keys.sort();
        anyhow::Ok(keys)
    };
    let both = vec![format!("{members}n1"), format!("{members}n2")];
    assert_eq!(keys().await.unwrap(), both);

    // The keys are under the lease (checked before it goes: once revoked the coordinator
    // may put them back at once, so their absence is not something to wait for).
    let attached = |lease: String| {
        let endpoint = etcd.endpoint.clone();
        async move { etcdctl(&endpoint, &["lease", "timetolive", &lease, "--keys"]).await }
    };
    // The lease is lost as after an outage longer than its TTL: revoked, its keys gone.
    let old = leases(&etcd.endpoint).await.unwrap();
    assert_eq!(old.len(), 1, "the coordinator holds one lease: {old:?}");
    let under = attached(old[0].clone()).await.unwrap();
    assert!(both.iter().all(|k| under.contains(k.as_str())), "{under}");
    etcdctl(&etcd.endpoint, &["lease", "revoke", &old[0]])
        .await
        .unwrap();

    eventually(
        "members/* put back under a new lease",
        Duration::from_secs(30),
        || async {
            let now = keys().await?;
            anyhow::ensure!(now == both, "members keys: {now:?}");
            Ok(())
        },
    )
    .await
    .unwrap();
    let new = leases(&etcd.endpoint).await.unwrap();
    assert_eq!(new.len(), 1, "{new:?}");
    assert_ne!(new, old, "a new lease");
    // The keys are under the new lease: they go with it.
    let under = attached(new[0].clone()).await.unwrap();
    assert!(both.iter().all(|k| under.contains(k.as_str())), "{under}");
    etcdctl(&etcd.endpoint, &["lease", "revoke", &new[0]])
        .await
        .unwrap();
    // And come back again; the cluster still takes snapshots.
    eventually(
        "members/* put back again",
        Duration::from_secs(30),
        || async {
            let now = keys().await?;
            anyhow::ensure!(now == both, "members keys: {now:?}");
            Ok(())
        },
    )
    .await
    .unwrap();
    let id = cluster
        .start_snapshot(pb::StartSnapshotRequest {
            mode: pb::SnapshotMode::ChandyLamport as i32,
            timeout_ms: 20_000,
            ..Default::default()
        })
        .await
        .unwrap();
    cairn_integration_tests::coordinated::assert_completed(
        &cluster.wait(id).await.unwrap(),
        cluster.total(),
    );
}

/// A daemon whose standard error is a pipe nobody reads any more (its log collector died)
/// keeps running, and stops on SIGTERM: a log line that cannot be written is dropped (it
/// used to panic in whichever task logged, the signal's included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_whose_log_pipe_broke_keeps_running_and_stops_on_sigterm() {
    /// Killed when the test ends, pass or fail.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let peer = format!("127.0.0.1:{}", free_port());
    let child = std::process::Command::new(binary("cairn-node").unwrap())
        .args([
            "--node-id",
            "a",
            "--peer",
            &format!("a={peer}"),
            "--peer-listen",
            &peer,
            "--app-listen",
            &format!("127.0.0.1:{}", free_port()),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Killed(child);
    // The reader goes away at once: every log line meets a broken pipe.
    drop(child.0.stderr.take());
    let pid = child.0.id();
    // It serves (its health answers) rather than dying at its first log line.
    eventually("the daemon answers", Duration::from_secs(10), || async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{peer}"))?
            .connect()
            .await?;
        let status = tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await?
            .into_inner()
            .status;
        anyhow::ensure!(status == 1, "not serving: {status}");
        Ok(())
    })
    .await
    .unwrap();
    assert!(child.0.try_wait().unwrap().is_none(), "the daemon died");
    cairn_integration_tests::processes::signal_pid(pid, "-TERM");
    let status = eventually(
        "the daemon stops on SIGTERM",
        Duration::from_secs(15),
        || {
            let status = child.0.try_wait();
            async move { status?.ok_or_else(|| anyhow::anyhow!("still running")) }
        },
    )
    .await
    .unwrap();
    assert!(status.success(), "exited {status}");
}
