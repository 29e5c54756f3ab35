//! A local cluster of processes — a coordinator, N node daemons and N bank applications on
//! loopback — as `cairnctl cluster up` and `cairnctl demo` start it. Every process is
//! killed when the cluster is dropped.
//!
//! With [`ClusterSpec::security`] every port serves mutual TLS (the banks present their
//! nodes' certificates) and the coordinator and NodeAdmin want a certificate with a role
//! or a bearer token.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Serialize;
use tokio::process::{Child, Command};

/// Where each process of a local cluster listens.
#[derive(Debug, Clone, Serialize)]
pub struct Addresses {
    /// The coordinator.
    pub coordinator: String,
    /// The coordinator's Prometheus `/metrics` address.
    pub coordinator_metrics: String,
    /// etcd endpoints, if the coordinator uses etcd.
    pub etcd: Vec<String>,
    /// The coordinator's data directory.
    pub data_dir: PathBuf,
    /// One entry per node.
    pub nodes: Vec<NodeAddresses>,
    /// The files a client needs to call a secure cluster; `None`: plaintext, no tokens.
    pub security: Option<Security>,
}

/// A secure local cluster's files: the certificates and tokens file its processes are
/// started with, and what a client of it (cairnctl, grpcurl) presents.
#[derive(Debug, Clone, Serialize)]
pub struct Security {
    /// The certificates, named as `cairnctl certs init` writes them: `ca.pem`,
    /// `coordinator.pem` and `coordinator-key.pem`, and `<node id>.pem` and
    /// `<node id>-key.pem` for each node.
    pub certs_dir: PathBuf,
    /// The `--auth-tokens` file of the coordinator and every daemon.
    pub auth_tokens: PathBuf,
    /// The CA every certificate chains to (`certs_dir/ca.pem`).
    pub ca: PathBuf,
    /// A person's client certificate (its role is in its identity) …
    pub cert: PathBuf,
    /// … and its key.
    pub key: PathBuf,
    /// A file (0600) holding a bearer token that `auth_tokens` admits.
    pub token_file: PathBuf,
}

/// One node's addresses.
#[derive(Debug, Clone, Serialize)]
pub struct NodeAddresses {
    /// Its id.
    pub id: String,
    /// Its daemon's peer (and NodeAdmin) address.
    pub peer: String,
    /// Its daemon's application address.
    pub app: String,
    /// Its bank's address.
    pub bank: String,
    /// Its daemon's Prometheus `/metrics` address.
    pub metrics: String,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Nodes (and banks).
    pub nodes: usize,
    /// etcd endpoints; empty for the embedded store.
    pub etcd: Vec<String>,
    /// Where the coordinator listens (`host:port`); `None` for a free loopback port.
    pub coordinator: Option<String>,
    /// The coordinator's data directory; the processes' logs go beside it.
    pub data_dir: PathBuf,
    /// Random transfers per second per bank.
    pub workload: f64,
    /// Each bank's starting balance.
    pub initial_balance: u64,
    /// Where the binaries are.
    pub bin_dir: PathBuf,
    /// Mutual TLS and tokens with these files; `None`: plaintext and open.
    pub security: Option<Security>,
}

/// The running processes.
pub struct LocalCluster {
    /// Their addresses.
    pub addresses: Addresses,
    /// A client's TLS (the CA and [`Security::cert`]), for a secure cluster.
    client_tls: Option<cairn_rpc::tls::Tls>,
    children: Vec<(String, Child)>,
}

/// The ports [`free_port`] handed out, and those given on the command line
/// ([`coordinator_addresses`]): it never hands any of them out again.
static GIVEN_PORTS: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// A free port below the kernel's ephemeral range, so that no outgoing connection of the
/// processes already started can take it before its own process binds it. A port is never
/// handed out twice by one process: between the check and the bind of the process it is
/// for, nothing else here may draw it again.
pub fn free_port() -> std::io::Result<u16> {
    use rand::Rng;
    let ephemeral: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let low = 10_000.min(ephemeral / 2);
    let mut rng = rand::rng();
    for _ in 0..1000 {
        let port = rng.random_range(low..ephemeral);
        let mut given = GIVEN_PORTS.lock().expect("never poisoned");
        if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.insert(port);
            return Ok(port);
        }
    }
    Err(std::io::Error::other("no free port found"))
}

fn loopback() -> std::io::Result<String> {
    Ok(format!("127.0.0.1:{}", free_port()?))
}

/// The coordinator's listen address and the address the others dial: `requested` if given
/// (the dial address is loopback when it names every interface), else a free loopback
/// port. A requested address that cannot be bound is refused here, naming it.
fn coordinator_addresses(requested: Option<&str>) -> anyhow::Result<(String, String)> {
    let Some(requested) = requested else {
        let address = loopback()?;
        return Ok((address.clone(), address));
    };
    let listen = std::net::ToSocketAddrs::to_socket_addrs(requested)
        .map_err(|e| {
            anyhow::anyhow!("--coordinator {requested}: not an address to listen on: {e}")
        })?
        .next()
        .ok_or_else(|| anyhow::anyhow!("--coordinator {requested}: resolves to no address"))?;
    anyhow::ensure!(
        listen.port() != 0,
        "--coordinator {requested}: give the port the coordinator is to listen on"
    );
    std::net::TcpListener::bind(listen).map_err(|e| {
        anyhow::anyhow!("--coordinator {requested}: cannot listen on {listen}: {e}")
    })?;
    // Free until the coordinator binds it: no other process of the cluster may draw it.
    GIVEN_PORTS
        .lock()
        .expect("never poisoned")
        .insert(listen.port());
    let mut dial = listen;
    if dial.ip().is_unspecified() {
        dial.set_ip(if listen.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        });
    }
    Ok((listen.to_string(), dial.to_string()))
}

impl LocalCluster {
    /// Starts every process. The binaries `cairn-coordinator`, `cairn-node` and
    /// `cairn-bank` must be in `spec.bin_dir`. `addresses.coordinator` is the address the
    /// others dial: `spec.coordinator` if given (loopback if it names every interface).
    pub async fn start(spec: &ClusterSpec) -> anyhow::Result<Self> {
        for bin in ["cairn-coordinator", "cairn-node", "cairn-bank"] {
            if !spec.bin_dir.join(bin).exists() {
                anyhow::bail!(
                    "{} is missing from {}: build every binary first with `cargo build --release --bins`",
                    bin,
                    spec.bin_dir.display()
                );
            }
        }
        let client_tls = match &spec.security {
            Some(security) => Some(
                cairn_rpc::tls::Tls::from_files(
                    &security.ca,
                    Some((security.cert.as_path(), security.key.as_path())),
                )
                .map_err(|e| anyhow::anyhow!("{e}"))?,
            ),
            None => None,
        };
        let (coordinator_listen, coordinator) = coordinator_addresses(spec.coordinator.as_deref())?;
        std::fs::create_dir_all(&spec.data_dir)?;
        let logs = spec.data_dir.join("logs");
        std::fs::create_dir_all(&logs)?;
        let coordinator_metrics = loopback()?;
        let nodes: Vec<NodeAddresses> = (1..=spec.nodes)
            .map(|i| {
                Ok(NodeAddresses {
                    id: format!("n{i}"),
                    peer: loopback()?,
                    app: loopback()?,
                    bank: loopback()?,
                    metrics: loopback()?,
                })
            })
            .collect::<std::io::Result<_>>()?;
        let mut cluster = Self {
            addresses: Addresses {
                coordinator: coordinator.clone(),
                coordinator_metrics: coordinator_metrics.clone(),
                etcd: spec.etcd.clone(),
                data_dir: spec.data_dir.clone(),
                nodes: nodes.clone(),
                security: spec.security.clone(),
            },
            client_tls,
            children: Vec::new(),
        };
        // `--tls-*` and `--auth-tokens` of the process whose certificate is `name`.
        // A bank takes its node's certificate and no tokens file.
        let tls = |command: &mut Command, name: &str| {
            if let Some(security) = &spec.security {
                command
                    .arg("--tls-cert")
                    .arg(security.certs_dir.join(format!("{name}.pem")))
                    .arg("--tls-key")
                    .arg(security.certs_dir.join(format!("{name}-key.pem")))
                    .arg("--tls-ca")
                    .arg(&security.ca);
            }
        };
        let secure = |command: &mut Command, name: &str| {
            tls(command, name);
            if let Some(security) = &spec.security {
                command.arg("--auth-tokens").arg(&security.auth_tokens);
            }
        };
        let mut command = Command::new(spec.bin_dir.join("cairn-coordinator"));
        command
            .args([
                "--listen",
                &coordinator_listen,
                "--metrics-listen",
                &coordinator_metrics,
            ])
            .arg("--data-dir")
            .arg(&spec.data_dir);
        if !spec.etcd.is_empty() {
            command.args(["--etcd", &spec.etcd.join(",")]);
        }
        secure(&mut command, "coordinator");
        cluster.spawn("coordinator", command, &logs)?;
        for node in &nodes {
            let mut command = Command::new(spec.bin_dir.join("cairn-node"));
            command.args(["--node-id", &node.id, "--peer-listen", &node.peer]);
            command.args([
                "--app-listen",
                &node.app,
                "--coordinator",
                &coordinator,
                "--grace-period",
                "2s",
                "--metrics-listen",
                &node.metrics,
            ]);
            secure(&mut command, &node.id);
            cluster.spawn(&format!("{}.node", node.id), command, &logs)?;
            let mut command = Command::new(spec.bin_dir.join("cairn-bank"));
            command.args(["--node", &node.app, "--listen", &node.bank]);
            command.args(["--initial-balance", &spec.initial_balance.to_string()]);
            command.args(["--workload", &spec.workload.to_string()]);
            tls(&mut command, &node.id);
            cluster.spawn(&format!("{}.bank", node.id), command, &logs)?;
        }
        Ok(cluster)
    }

    fn spawn(&mut self, name: &str, mut command: Command, logs: &Path) -> anyhow::Result<()> {
        // Each process gets its configuration from its flags alone, not from CAIRN_
        // variables meant for cairnctl.
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("CAIRN_") {
                command.env_remove(&key);
            }
        }
        let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {name}: {e}"))?;
        self.children.push((name.to_owned(), child));
        Ok(())
    }

    /// The TLS a client of this cluster uses (the CA and [`Security::cert`]); `None` for a
    /// plaintext cluster.
    pub fn client_tls(&self) -> Option<&cairn_rpc::tls::Tls> {
        self.client_tls.as_ref()
    }

    /// Processes that have exited, with their status.
    pub fn exited(&mut self) -> Vec<String> {
        self.children
            .iter_mut()
            .filter_map(|(name, child)| match child.try_wait() {
                Ok(Some(status)) => Some(format!("{name} exited ({status})")),
                _ => None,
            })
            .collect()
    }

    /// Waits until every node is registered and wired to every other, and every bank is
    /// attached and knows every peer: the cluster is ready for transfers and snapshots.
    pub async fn wait_ready(&self, timeout: Duration) -> anyhow::Result<()> {
        let n = self.addresses.nodes.len();
        for node in &self.addresses.nodes {
            wait_node_ready(
                &node.peer,
                Some(&node.bank),
                Readiness::full_mesh(n),
                timeout,
                self.client_tls.as_ref(),
            )
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "{e} (logs in {})",
                    self.addresses.data_dir.join("logs").display()
                )
            })?;
        }
        Ok(())
    }

    /// Stops every process: SIGTERM, then SIGKILL after `grace`.
    pub async fn stop(mut self, grace: Duration) {
        for (_, child) in &self.children {
            if let Some(pid) = child.id() {
                let _ = Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .await;
            }
        }
        for (name, child) in &mut self.children {
            if tokio::time::timeout(grace, child.wait()).await.is_err() {
                tracing::warn!("{name} did not stop within {grace:?}; killing it");
                let _ = child.kill().await;
            }
        }
    }
}

/// What a ready node looks like.
#[derive(Debug, Clone, Copy)]
pub struct Readiness {
    /// Its channels, incoming and outgoing.
    pub channels: usize,
    /// The nodes it has an outgoing channel to.
    pub peers: usize,
    /// Whether an application must be attached.
    pub app: bool,
}

impl Readiness {
    /// A node of a full mesh of `members` with its application attached.
    pub fn full_mesh(members: usize) -> Self {
        Self {
            channels: 2 * (members - 1),
            peers: members - 1,
            app: true,
        }
    }
}

/// Waits until the daemon at `peer` (its NodeAdmin address) has `ready.channels` channels
/// and, with `ready.app`, an application attached; and, if given, the bank at `bank`
/// knows `ready.peers` peers. Fails after `timeout` saying what is missing. With `tls`,
/// NodeAdmin and the bank are called over TLS.
pub async fn wait_node_ready(
    peer: &str,
    bank: Option<&str>,
    ready: Readiness,
    timeout: Duration,
    tls: Option<&cairn_rpc::tls::Tls>,
) -> anyhow::Result<()> {
    use cairn_rpc::bank::v1 as bank_pb;
    use cairn_rpc::v1 as pb;
    let deadline = tokio::time::Instant::now() + timeout;
    let want = ready.channels;
    let app = ready.app;
    loop {
        let check = async {
            let channel = cairn_rpc::tls::endpoint(peer, tls)?.connect().await?;
            let mut admin = pb::node_admin_client::NodeAdminClient::new(channel);
            let status = admin
                .get_node_status(pb::GetNodeStatusRequest {})
                .await?
                .into_inner();
            anyhow::ensure!(
                status.channels.len() == want,
                "node {} has {} of {want} channels",
                status.node_id,
                status.channels.len()
            );
            anyhow::ensure!(
                !app || status.application_attached,
                "node {} has no application attached",
                status.node_id
            );
            if let Some(bank) = bank {
                let channel = cairn_rpc::tls::endpoint(bank, tls)?.connect().await?;
                let mut client = bank_pb::bank_client::BankClient::new(channel);
                let balance = client
                    .get_balance(bank_pb::GetBalanceRequest {})
                    .await?
                    .into_inner();
                anyhow::ensure!(
                    balance.peers.len() == ready.peers,
                    "bank {} knows {} of {} peers",
                    balance.node_id,
                    balance.peers.len(),
                    ready.peers
                );
            }
            anyhow::Ok(())
        };
        match check.await {
            Ok(()) => return Ok(()),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                anyhow::bail!("not ready within {timeout:?}: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_requested_coordinator_address_is_the_listen_address() {
        let port = free_port().unwrap();
        let requested = format!("127.0.0.1:{port}");
        assert_eq!(
            coordinator_addresses(Some(&requested)).unwrap(),
            (requested.clone(), requested)
        );
        assert!(
            GIVEN_PORTS.lock().unwrap().contains(&port),
            "free_port never hands out the coordinator's port"
        );
        let port = free_port().unwrap();
        assert_eq!(
            coordinator_addresses(Some(&format!("0.0.0.0:{port}"))).unwrap(),
            (format!("0.0.0.0:{port}"), format!("127.0.0.1:{port}")),
            "every interface is dialled on loopback"
        );
        let (listen, dial) = coordinator_addresses(None).unwrap();
        assert_eq!(listen, dial);
        assert!(listen.starts_with("127.0.0.1:"), "{listen}");
    }

    #[test]
    fn a_coordinator_address_that_cannot_be_listened_on_is_refused() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = taken.local_addr().unwrap().to_string();
        let e = coordinator_addresses(Some(&address))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&address) && e.contains("cannot listen"), "{e}");
        let e = coordinator_addresses(Some("127.0.0.1:0"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("port"), "{e}");
        let e = coordinator_addresses(Some("no-port"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no-port"), "{e}");
    }
}
