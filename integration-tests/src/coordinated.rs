//! A coordinated cluster of real processes: `cairn-coordinator` (embedded store or etcd),
//! `cairn-node` daemons registered with it, and `cairn-bank` apps — or, for chosen nodes,
//! no bank, so a test can attach its own application.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use cairn_rpc::v1 as pb;
use tonic::transport::Channel;

use crate::processes::{ChildGuard, binary, eventually, free_port};

/// Which metadata store the coordinator uses.
#[derive(Debug, Clone)]
pub enum Store {
    /// The embedded file store.
    Embedded,
    /// etcd at this endpoint.
    Etcd(String),
}

/// Where a cluster's processes run: all on loopback (the default), or the coordinators on
/// one address and each node (daemon and bank) on a host of its own ([`crate::netns`]).
#[derive(Debug, Clone, Default)]
pub struct Placement {
    /// The address the coordinators listen on (`127.0.0.1` if empty).
    pub coordinator_ip: String,
    /// Per node, by index: its address, and the pid of a process in whose network
    /// namespace it runs (`None`: this one). Nodes past the list are on loopback.
    pub nodes: Vec<(String, Option<u32>)>,
}

impl Placement {
    /// Where the coordinators (and the servers beside them) listen: 127.0.0.1 unless placed.
    pub fn coordinator_ip(&self) -> &str {
        if self.coordinator_ip.is_empty() {
            "127.0.0.1"
        } else {
            &self.coordinator_ip
        }
    }

    fn node_ip(&self, i: usize) -> &str {
        self.nodes.get(i).map_or("127.0.0.1", |(ip, _)| ip.as_str())
    }

    /// A command that runs `program` in node `i`'s place.
    pub fn command_for(&self, i: usize, program: &Path) -> Command {
        match self.nodes.get(i).and_then(|(_, pid)| *pid) {
            Some(pid) => {
                // nsenter execs the program: the child's pid is the program's.
                let mut command = Command::new("nsenter");
                command
                    .args(["--target", &pid.to_string(), "--net", "--"])
                    .arg(program);
                command
            }
            None => Command::new(program),
        }
    }
}

/// One member's processes.
pub struct CoordinatedNode {
    /// Its id.
    pub id: String,
    /// Its peer address.
    pub peer: String,
    /// Its application address.
    pub app: String,
    /// Its bank's address, if it has one.
    pub bank: Option<String>,
    /// Its daemon's `/metrics` address.
    pub metrics: String,
    node_args: Vec<String>,
    node: Option<ChildGuard>,
    bank_process: Option<ChildGuard>,
}

/// One coordinator replica's process.
pub struct CoordinatorReplica {
    /// Its address (also what it advertises).
    pub address: String,
    /// Its `/metrics` address.
    pub metrics: String,
    args: Vec<String>,
    process: Option<ChildGuard>,
}

/// The processes; all killed when dropped.
pub struct CoordinatedCluster {
    /// The (first) coordinator's address.
    pub coordinator: String,
    /// The (first) coordinator's `/metrics` address.
    pub coordinator_metrics: String,
    /// The members.
    pub nodes: Vec<CoordinatedNode>,
    /// Every coordinator replica (one but with [`Self::start_ha`]).
    pub replicas: Vec<CoordinatorReplica>,
    /// Whether the coordinators are on etcd (and so elect a leader, even alone).
    on_etcd: bool,
    dir: PathBuf,
    /// Each bank's starting balance.
    pub initial_balance: u64,
    /// Random transfers per second of each bank started from now on.
    pub bank_workload: f64,
    keep_logs: bool,
    /// With TLS: the directory of `cairnctl certs init`'s files.
    tls_dir: Option<PathBuf>,
    /// With TLS: what this harness's clients use (the CA and the user `tester`).
    tls: Option<cairn_sdk::tls::Tls>,
    /// Environment variables of every coordinator, daemon and bank started (S3
    /// credentials, a bank's `CAIRN_LEDGER`).
    env: Vec<(String, String)>,
    /// Where the processes run.
    placement: Placement,
}

/// The user whose certificate the harness's clients present in a TLS cluster.
pub const TLS_TEST_USER: &str = "tester";
/// [`TLS_TEST_USER`] as `cairnctl certs init --users` takes it: an admin.
pub const TLS_TEST_USER_SPEC: &str = "tester:admin";

/// Runs `cairnctl certs init` into `dir` for the nodes `n1` to `n{nodes}` and `users`: a
/// CA, a certificate per node (and the coordinator) and per user.
pub fn certs_init(dir: &Path, nodes: usize, users: &[&str]) -> anyhow::Result<()> {
    certs_init_for(dir, "cairn", nodes, users)
}

/// As [`certs_init`], for the cluster `cluster`.
pub fn certs_init_for(
    dir: &Path,
    cluster: &str,
    nodes: usize,
    users: &[&str],
) -> anyhow::Result<()> {
    let nodes: Vec<String> = (1..=nodes).map(|i| format!("n{i}")).collect();
    let mut command = Command::new(binary("cairnctl")?);
    command.args([
        "certs",
        "init",
        "--cluster",
        cluster,
        "--nodes",
        &nodes.join(","),
    ]);
    if !users.is_empty() {
        command.args(["--users", &users.join(",")]);
    }
    command.arg("--dir").arg(dir);
    let output = command.output()?;
    anyhow::ensure!(
        output.status.success(),
        "cairnctl certs init: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// `--tls-cert`, `--tls-key`, `--tls-ca` for the certificate `name` of `dir`.
pub fn tls_args(dir: &Path, name: &str) -> Vec<String> {
    let path = |file: String| dir.join(file).display().to_string();
    vec![
        "--tls-cert".into(),
        path(format!("{name}.pem")),
        "--tls-key".into(),
        path(format!("{name}-key.pem")),
        "--tls-ca".into(),
        path("ca.pem".into()),
    ]
}

impl CoordinatedCluster {
    /// Starts a coordinator and `n` nodes; nodes whose index is in `without_bank` get no
    /// bank. `coordinator_args` are added to the coordinator's command line.
    pub async fn start(
        n: usize,
        store: Store,
        without_bank: &[usize],
        coordinator_args: &[&str],
    ) -> anyhow::Result<Self> {
        Self::start_with(n, store, without_bank, coordinator_args, &[]).await
    }

    /// As [`Self::start`], with `extra_node_args` added to every daemon's command line.
    pub async fn start_with(
        n: usize,
        store: Store,
        without_bank: &[usize],
        coordinator_args: &[&str],
        extra_node_args: &[&str],
    ) -> anyhow::Result<Self> {
        Self::start_opts(
            n,
            store,
            without_bank,
            coordinator_args,
            extra_node_args,
            None,
        )
        .await
    }

    /// As [`Self::start_with`]; with `tls_dir` (files of [`certs_init`] for `n` nodes and
    /// the user [`TLS_TEST_USER`]), the coordinator and every daemon run with `--tls-*`
    /// flags and this harness's clients of the coordinator and of NodeAdmin use TLS with
    /// the user's certificate; each bank holds its node's certificate.
    pub async fn start_opts(
        n: usize,
        store: Store,
        without_bank: &[usize],
        coordinator_args: &[&str],
        extra_node_args: &[&str],
        tls_dir: Option<&Path>,
    ) -> anyhow::Result<Self> {
        Self::start_replicas(
            1,
            n,
            store,
            without_bank,
            coordinator_args,
            extra_node_args,
            tls_dir,
            &[],
        )
        .await
    }

    /// As [`Self::start_with`], with `env` set on every coordinator and daemon it starts
    /// (and restarts): the blob store's credentials.
    pub async fn start_env(
        n: usize,
        store: Store,
        without_bank: &[usize],
        coordinator_args: &[&str],
        extra_node_args: &[&str],
        env: &[(String, String)],
    ) -> anyhow::Result<Self> {
        Self::start_replicas(
            1,
            n,
            store,
            without_bank,
            coordinator_args,
            extra_node_args,
            None,
            env,
        )
        .await
    }

    /// `replicas` coordinator replicas on the etcd at `etcd` (sharing one blob
    /// directory), `n` nodes with banks whose daemons know every replica
    /// (`--coordinator a,b,..`). The harness's clients talk to the leader.
    pub async fn start_ha(
        replicas: usize,
        n: usize,
        etcd: &str,
        coordinator_args: &[&str],
        extra_node_args: &[&str],
    ) -> anyhow::Result<Self> {
        Self::start_replicas(
            replicas,
            n,
            Store::Etcd(etcd.to_owned()),
            &[],
            coordinator_args,
            extra_node_args,
            None,
            &[],
        )
        .await
    }

    /// Every option at once: `replicas` coordinators (on etcd when more than one), `n`
    /// nodes (banks but for `without_bank`), extra arguments, TLS files, and `env` on every
    /// coordinator and daemon.
    #[allow(clippy::too_many_arguments)]
    pub async fn start_replicas(
        replicas: usize,
        n: usize,
        store: Store,
        without_bank: &[usize],
        coordinator_args: &[&str],
        extra_node_args: &[&str],
        tls_dir: Option<&Path>,
        env: &[(String, String)],
    ) -> anyhow::Result<Self> {
        Self::start_placed(
            Placement::default(),
            replicas,
            n,
            store,
            without_bank,
            coordinator_args,
            extra_node_args,
            tls_dir,
            env,
        )
        .await
    }

    /// [`Self::start_replicas`] with the processes placed by `placement`.
    #[allow(clippy::too_many_arguments)]
    pub async fn start_placed(
        placement: Placement,
        replicas: usize,
        n: usize,
        store: Store,
        without_bank: &[usize],
        coordinator_args: &[&str],
        extra_node_args: &[&str],
        tls_dir: Option<&Path>,
        env: &[(String, String)],
    ) -> anyhow::Result<Self> {
        let tls = match tls_dir {
            None => None,
            Some(dir) => {
                let cert = dir.join(format!("{TLS_TEST_USER}.pem"));
                let key = dir.join(format!("{TLS_TEST_USER}-key.pem"));
                Some(cairn_sdk::tls::Tls::from_files(
                    &dir.join("ca.pem"),
                    Some((&cert, &key)),
                )?)
            }
        };
        let dir = std::env::temp_dir().join(format!(
            "cairn-coord-test-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir)?;
        let replicas: Vec<CoordinatorReplica> = (0..replicas.max(1))
            .map(|_| {
                let ip = placement.coordinator_ip();
                let address = format!("{ip}:{}", free_port());
                let metrics = format!("{ip}:{}", free_port());
                let mut args = vec![
                    "--listen".to_owned(),
                    address.clone(),
                    "--metrics-listen".to_owned(),
                    metrics.clone(),
                    "--data-dir".to_owned(),
                ];
                args.push(dir.join("data").display().to_string());
                if let Store::Etcd(endpoint) = &store {
                    args.extend(["--etcd".to_owned(), endpoint.clone()]);
                }
                args.extend(coordinator_args.iter().map(|a| (*a).to_owned()));
                if let Some(tls_dir) = tls_dir {
                    args.extend(tls_args(tls_dir, "coordinator"));
                }
                CoordinatorReplica {
                    address,
                    metrics,
                    args,
                    process: None,
                }
            })
            .collect();
        let mut cluster = Self {
            on_etcd: matches!(store, Store::Etcd(_)),
            coordinator: replicas[0].address.clone(),
            coordinator_metrics: replicas[0].metrics.clone(),
            nodes: Vec::new(),
            replicas,
            dir,
            initial_balance: 1000,
            bank_workload: 200.0,
            keep_logs: false,
            tls_dir: tls_dir.map(Path::to_owned),
            tls,
            env: env.to_vec(),
            placement,
        };
        for r in 0..cluster.replicas.len() {
            cluster.start_replica(r)?;
        }
        for i in 0..n {
            cluster.add_node(!without_bank.contains(&i), extra_node_args)?;
        }
        let ready = async {
            cluster.wait_registered(n).await?;
            for i in 0..n {
                let with_bank = cluster.nodes[i].bank.is_some();
                cluster.wait_wired(i, with_bank).await?;
            }
            anyhow::Ok(())
        }
        .await;
        if let Err(e) = ready {
            cluster.keep_logs = true;
            anyhow::bail!("{e} (logs kept in {})", cluster.dir.display());
        }
        Ok(cluster)
    }

    fn log(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.log"))
    }

    /// Adds node `n<len+1>` (with a bank if `bank`) and starts it; returns its index. It
    /// registers with the coordinator, which hands it the members and tells them of it.
    pub fn add_node(&mut self, bank: bool, extra_node_args: &[&str]) -> anyhow::Result<usize> {
        let i = self.nodes.len();
        let id = format!("n{}", i + 1);
        let ip = self.placement.node_ip(i).to_owned();
        let peer = format!("{ip}:{}", free_port());
        let app = format!("{ip}:{}", free_port());
        let metrics = format!("{ip}:{}", free_port());
        let mut node_args: Vec<String> = vec![
            "--node-id".into(),
            id.clone(),
            "--peer-listen".into(),
            peer.clone(),
            "--app-listen".into(),
            app.clone(),
            "--coordinator".into(),
            self.coordinator_list(),
            "--grace-period".into(),
            "1s".into(),
            "--metrics-listen".into(),
            metrics.clone(),
        ];
        node_args.extend(extra_node_args.iter().map(|a| (*a).to_owned()));
        if let Some(tls_dir) = &self.tls_dir {
            node_args.extend(tls_args(tls_dir, &id));
        }
        let bank = bank.then(|| format!("{ip}:{}", free_port()));
        self.nodes.push(CoordinatedNode {
            metrics,
            id,
            peer,
            app,
            bank,
            node_args,
            node: None,
            bank_process: None,
        });
        self.start_node(i)?;
        Ok(i)
    }

    /// Every replica's address, comma-separated (the daemons' `--coordinator`).
    pub fn coordinator_list(&self) -> String {
        let all: Vec<&str> = self.replicas.iter().map(|r| r.address.as_str()).collect();
        all.join(",")
    }

    /// (Re)starts the (first) coordinator with its original arguments.
    pub fn start_coordinator(&mut self) -> anyhow::Result<()> {
        self.start_replica(0)
    }

    /// Kills the (first) coordinator (SIGKILL).
    pub fn kill_coordinator(&mut self) {
        self.kill_replica(0);
    }

    /// (Re)starts replica `r` with its original arguments.
    pub fn start_replica(&mut self, r: usize) -> anyhow::Result<()> {
        let mut command = Command::new(binary("cairn-coordinator")?);
        command.args(&self.replicas[r].args);
        command.envs(self.env.iter().cloned());
        let log = self.log(&format!("coordinator{}-{}", r + 1, free_port()));
        self.replicas[r].process = Some(ChildGuard::spawn("cairn-coordinator", command, &log)?);
        Ok(())
    }

    /// Kills replica `r` (SIGKILL).
    pub fn kill_replica(&mut self, r: usize) {
        if let Some(mut p) = self.replicas[r].process.take() {
            p.kill();
        }
    }

    /// Stops replica `r` gracefully (SIGTERM: a leader resigns), waiting up to 15 s.
    pub fn stop_replica(&mut self, r: usize) -> Option<std::process::ExitStatus> {
        let mut p = self.replicas[r].process.take()?;
        p.terminate(Duration::from_secs(15))
    }

    /// Replica `r`'s process, to signal it (SIGSTOP, SIGCONT).
    pub fn replica_process(&self, r: usize) -> Option<&ChildGuard> {
        self.replicas[r].process.as_ref()
    }

    /// Node `i`'s bank's process, to signal it.
    pub fn bank_process(&self, i: usize) -> Option<&ChildGuard> {
        self.nodes[i].bank_process.as_ref()
    }

    /// Replica `r`'s process id, if it runs.
    pub fn replica_pid(&self, r: usize) -> Option<u32> {
        self.replicas[r].process.as_ref().map(ChildGuard::pid)
    }

    /// Who leads, as replica `r` answers `GetLeadership` (plain connection).
    pub async fn leadership(&self, r: usize) -> anyhow::Result<pb::Leadership> {
        let channel = cairn_sdk::tls::endpoint(&self.replicas[r].address, self.tls.as_ref())?
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(5))
            .connect()
            .await?;
        Ok(pb::coordinator_client::CoordinatorClient::new(channel)
            .get_leadership(pb::GetLeadershipRequest {})
            .await?
            .into_inner())
    }

    /// The index of the replica that leads now and its term: the running replica whose
    /// health says it leads (`cairn.v1.Leader` SERVING), with the term it answers
    /// `GetLeadership` with; an error while none does.
    pub async fn leader(&self) -> anyhow::Result<(usize, u64)> {
        for r in 0..self.replicas.len() {
            if self.replicas[r].process.is_none() || !self.leads(r).await.unwrap_or(false) {
                continue;
            }
            let l = self.leadership(r).await?;
            if l.leader == self.replicas[r].address {
                return Ok((r, l.term));
            }
        }
        anyhow::bail!("no coordinator replica leads")
    }

    /// Every running replica that claims to lead now (its health says so and its
    /// `GetLeadership` names itself), with the term it answers: more than one of a term
    /// would be a split brain.
    pub async fn leader_claims(&self) -> Vec<(usize, u64)> {
        let mut claims = Vec::new();
        for r in 0..self.replicas.len() {
            if self.replicas[r].process.is_none() || !self.leads(r).await.unwrap_or(false) {
                continue;
            }
            if let Ok(l) = self.leadership(r).await
                && l.leader == self.replicas[r].address
            {
                claims.push((r, l.term));
            }
        }
        claims
    }

    /// Whether replica `r`'s health says it leads (`cairn.v1.Leader` SERVING).
    pub async fn leads(&self, r: usize) -> anyhow::Result<bool> {
        let status = health_of(
            &self.replicas[r].address,
            "cairn.v1.Leader",
            self.tls.as_ref(),
        )
        .await?;
        Ok(status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32)
    }

    /// Waits until a replica leads (other than `not`, if given); returns it and its term.
    pub async fn wait_leader(&self, not: Option<usize>) -> anyhow::Result<(usize, u64)> {
        eventually(
            "a coordinator replica leads",
            Duration::from_secs(60),
            || async {
                let (i, term) = self.leader().await?;
                anyhow::ensure!(Some(i) != not, "replica {} still leads", i + 1);
                Ok((i, term))
            },
        )
        .await
    }

    /// (Re)starts node `i`'s daemon and, if it has one, its bank.
    pub fn start_node(&mut self, i: usize) -> anyhow::Result<()> {
        let node_bin = binary("cairn-node")?;
        let log = self.log(&format!("{}-node-{}", self.nodes[i].id, free_port()));
        let mut command = self.placement.command_for(i, &node_bin);
        command.args(&self.nodes[i].node_args);
        command.envs(self.env.iter().cloned());
        self.nodes[i].node = Some(ChildGuard::spawn("cairn-node", command, &log)?);
        self.start_bank(i)
    }

    /// (Re)starts node `i`'s bank, if it has one, with a fresh balance.
    pub fn start_bank(&mut self, i: usize) -> anyhow::Result<()> {
        let bank_bin = binary("cairn-bank")?;
        if let Some(bank) = self.nodes[i].bank.clone() {
            let log = self.log(&format!("{}-bank-{}", self.nodes[i].id, free_port()));
            let mut command = self.placement.command_for(i, &bank_bin);
            command.args([
                "--node",
                &self.nodes[i].app,
                "--listen",
                &bank,
                "--workload",
                &self.bank_workload.to_string(),
            ]);
            command.args(["--initial-balance", &self.initial_balance.to_string()]);
            command.envs(self.env.iter().cloned());
            // The bank is part of its node: it holds the node's certificate.
            if let Some(tls_dir) = &self.tls_dir {
                command.args(tls_args(tls_dir, &self.nodes[i].id));
            }
            self.nodes[i].bank_process = Some(ChildGuard::spawn("cairn-bank", command, &log)?);
        }
        Ok(())
    }

    /// Stops node `i`'s bank, then its daemon with SIGTERM (a graceful stop: it drains, and
    /// leaves with `--leave-on-shutdown`); the daemon's exit status.
    pub fn stop_node(&mut self, i: usize) -> Option<std::process::ExitStatus> {
        if let Some(mut p) = self.nodes[i].bank_process.take() {
            p.terminate(Duration::from_secs(15));
        }
        let mut p = self.nodes[i].node.take()?;
        p.terminate(Duration::from_secs(30))
    }

    /// Kills node `i`'s bank alone (SIGKILL).
    pub fn kill_bank(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].bank_process.take() {
            p.kill();
        }
    }

    /// Kills node `i`'s daemon and bank (SIGKILL).
    pub fn kill_node(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].bank_process.take() {
            p.kill();
        }
        if let Some(mut p) = self.nodes[i].node.take() {
            p.kill();
        }
    }

    /// A client of the coordinator (over TLS in a TLS cluster); on etcd, of the replica
    /// that leads now (an error while none does: a restarted coordinator leads once the
    /// previous one's lease is gone).
    pub async fn client(
        &self,
    ) -> anyhow::Result<pb::coordinator_client::CoordinatorClient<Channel>> {
        let address = if self.on_etcd {
            let (i, _) = self.leader().await?;
            self.replicas[i].address.clone()
        } else {
            self.coordinator.clone()
        };
        let channel = cairn_sdk::tls::endpoint(&address, self.tls.as_ref())?
            .connect()
            .await?;
        Ok(pb::coordinator_client::CoordinatorClient::new(channel))
    }

    /// Waits until `n` nodes are registered.
    pub async fn wait_registered(&self, n: usize) -> anyhow::Result<()> {
        self.wait_registered_within(n, Duration::from_secs(30))
            .await
    }

    /// Waits until `n` nodes are registered, for at most `within`.
    pub async fn wait_registered_within(&self, n: usize, within: Duration) -> anyhow::Result<()> {
        eventually("nodes register", within, || async {
            let nodes = self
                .client()
                .await?
                .list_nodes(pb::ListNodesRequest {})
                .await?
                .into_inner()
                .nodes;
            let connected = nodes.iter().filter(|n| n.connected).count();
            anyhow::ensure!(connected == n, "{connected} of {n} connected");
            Ok(())
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e} (logs in {})", self.dir.display()))
    }

    /// Waits until node `i`'s daemon is wired to every other node with an application
    /// attached and, if it has a bank, the bank knows every peer.
    pub async fn wait_ready(&self, i: usize) -> anyhow::Result<()> {
        self.wait_wired(i, true).await
    }

    /// Waits until node `i`'s daemon has every channel the coordinator's topology gives it
    /// (and, with `app`, an application attached; with a bank, the bank knows its peers).
    pub async fn wait_wired(&self, i: usize, app: bool) -> anyhow::Result<()> {
        self.wait_wired_within(i, app, Duration::from_secs(30))
            .await
    }

    /// As [`Self::wait_wired`], for up to `within` (a large cluster on two cores).
    pub async fn wait_wired_within(
        &self,
        i: usize,
        app: bool,
        within: Duration,
    ) -> anyhow::Result<()> {
        let node = &self.nodes[i];
        let topology = self
            .client()
            .await?
            .list_nodes(pb::ListNodesRequest {})
            .await?
            .into_inner();
        let ready = cairn_cli::local_cluster::Readiness {
            channels: topology
                .channels
                .iter()
                .filter(|c| c.from == node.id || c.to == node.id)
                .count(),
            peers: topology
                .channels
                .iter()
                .filter(|c| c.from == node.id)
                .count(),
            app,
        };
        cairn_cli::local_cluster::wait_node_ready(
            &node.peer,
            node.bank.as_deref(),
            ready,
            within,
            self.tls.as_ref(),
        )
        .await
        .map_err(|e| anyhow::anyhow!("node {}: {e} (logs in {})", node.id, self.dir.display()))
    }

    /// Starts a snapshot; returns its id.
    pub async fn start_snapshot(
        &self,
        request: pb::StartSnapshotRequest,
    ) -> Result<u64, tonic::Status> {
        let mut client = self
            .client()
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        Ok(client
            .start_snapshot(request)
            .await?
            .into_inner()
            .snapshot_id)
    }

    /// Follows snapshot `id` until it ends; returns it with its data.
    pub async fn wait(&self, id: u64) -> anyhow::Result<pb::Snapshot> {
        self.wait_with(id, true).await
    }

    /// As [`Self::wait`], with the states and recorded messages only if `include_data`.
    pub async fn wait_with(&self, id: u64, include_data: bool) -> anyhow::Result<pb::Snapshot> {
        let mut client = self.client().await?;
        let mut stream = client
            .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: id })
            .await?
            .into_inner();
        let deadline = Duration::from_secs(60);
        tokio::time::timeout(deadline, async {
            while let Some(p) = stream.message().await? {
                if p.status != pb::SnapshotStatus::InProgress as i32 {
                    break;
                }
            }
            anyhow::Ok(())
        })
        .await
        .map_err(|_| anyhow::anyhow!("snapshot {id} did not end within {deadline:?}"))??;
        Ok(client
            .get_snapshot(pb::GetSnapshotRequest {
                snapshot_id: id,
                include_data,
            })
            .await?
            .into_inner())
    }

    /// Takes a snapshot and waits for it: its record with data if it COMPLETED, else an error
    /// with its failure.
    pub async fn completed(
        &self,
        request: pb::StartSnapshotRequest,
    ) -> anyhow::Result<pb::Snapshot> {
        let id = self.start_snapshot(request).await?;
        let snapshot = self.wait(id).await?;
        anyhow::ensure!(
            snapshot.status == pb::SnapshotStatus::Completed as i32,
            "snapshot {id} did not complete: {:?}",
            snapshot.failure
        );
        Ok(snapshot)
    }

    /// Waits until at least `n` participants of snapshot `id` recorded their state.
    pub async fn wait_recorded(&self, id: u64, n: usize) -> anyhow::Result<()> {
        let mut client = self.client().await?;
        let mut progress = client
            .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: id })
            .await?
            .into_inner();
        while let Some(p) = progress.message().await? {
            if p.recorded.len() >= n {
                return Ok(());
            }
        }
        anyhow::bail!("snapshot {id} ended before {n} participants recorded")
    }

    /// After `node` restarted: starts snapshots until one completes. Those started before
    /// every peer reconnected to its new incarnation may fail, but only naming `node`.
    pub async fn complete_after_restart(
        &self,
        node: &str,
        attempts: usize,
    ) -> anyhow::Result<pb::Snapshot> {
        for _ in 0..attempts {
            let request = pb::StartSnapshotRequest {
                mode: pb::SnapshotMode::Unaligned as i32,
                timeout_ms: 20_000,
                ..Default::default()
            };
            let id = self.start_snapshot(request).await?;
            let snapshot = self.wait(id).await?;
            if snapshot.status == pb::SnapshotStatus::Completed as i32 {
                return Ok(snapshot);
            }
            let failure = snapshot.failure.unwrap_or_default();
            anyhow::ensure!(
                failure.message.contains(node),
                "snapshot {id} failed without naming {node}: {}",
                failure.message
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        anyhow::bail!("no snapshot completed in {attempts} attempts after {node} came back")
    }

    /// The `/metrics` text at `address`, over TLS with the harness's user certificate in a
    /// TLS cluster.
    pub async fn scrape(&self, address: &str) -> anyhow::Result<String> {
        scrape_with(
            address,
            self.tls_dir.as_deref().map(|dir| (dir, TLS_TEST_USER)),
        )
        .await
    }

    /// Everything the process `name` (`coordinator` or a node id) has logged so far, over
    /// its restarts.
    pub fn log_of(&self, name: &str) -> String {
        // "coordinator": every replica's log; "coordinator2": replica 2's.
        let prefix = match name {
            "coordinator" => "coordinator".to_owned(),
            replica if replica.starts_with("coordinator") => format!("{replica}-"),
            node => format!("{node}-node-"),
        };
        let mut text = String::new();
        if let Ok(entries) = std::fs::read_dir(self.logs()) {
            for path in entries.flatten().map(|e| e.path()) {
                let file = path.file_name().unwrap_or_default().to_string_lossy();
                if file.starts_with(&prefix) {
                    text.push_str(&std::fs::read_to_string(&path).unwrap_or_default());
                }
            }
        }
        text
    }

    /// A client of node `i`'s bank.
    pub async fn bank(
        &self,
        i: usize,
    ) -> anyhow::Result<cairn_rpc::bank::v1::bank_client::BankClient<Channel>> {
        let address = self.nodes[i]
            .bank
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("node {} has no bank", self.nodes[i].id))?;
        let channel = cairn_sdk::tls::endpoint(address, self.tls.as_ref())?
            .connect()
            .await?;
        Ok(cairn_rpc::bank::v1::bank_client::BankClient::new(channel))
    }

    /// Sets every bank's rate of random transfers (0 pauses them).
    pub async fn set_workload(&self, rate: f64) -> anyhow::Result<()> {
        // Every bank that runs (a killed node's does not).
        for i in 0..self.nodes.len() {
            if self.nodes[i].bank_process.is_some() {
                self.bank(i)
                    .await?
                    .set_workload(cairn_rpc::bank::v1::SetWorkloadRequest { rate })
                    .await?;
            }
        }
        Ok(())
    }

    /// A client of node `i`'s `NodeAdmin` (served on its peer address).
    pub async fn admin(
        &self,
        i: usize,
    ) -> anyhow::Result<pb::node_admin_client::NodeAdminClient<Channel>> {
        let channel = cairn_sdk::tls::endpoint(&self.nodes[i].peer, self.tls.as_ref())?
            .connect()
            .await?;
        Ok(pb::node_admin_client::NodeAdminClient::new(channel))
    }

    /// The money there is.
    pub fn total(&self) -> u64 {
        self.initial_balance * self.nodes.iter().filter(|n| n.bank.is_some()).count() as u64
    }

    /// The process id of node `i`'s daemon, if it runs.
    pub fn node_pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].node.as_ref().map(ChildGuard::pid)
    }

    /// The (first) coordinator's process id, if it runs.
    pub fn coordinator_pid(&self) -> Option<u32> {
        self.replica_pid(0)
    }

    /// Where the logs are.
    pub fn logs(&self) -> &std::path::Path {
        &self.dir
    }

    /// Keeps the logs when the cluster is dropped (for a run that found something).
    pub fn keep_logs(&mut self) {
        self.keep_logs = true;
    }

    /// The coordinator's `--data-dir` (the embedded store and, by default, the blobs).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Starts a second daemon that claims node `i`'s id (a process started by mistake with
    /// an id in use), on ports of its own; returns it and its log file.
    pub fn spawn_impostor(&self, i: usize) -> anyhow::Result<(ChildGuard, PathBuf)> {
        let log = self.log(&format!("{}-impostor-{}", self.nodes[i].id, free_port()));
        let mut command = Command::new(binary("cairn-node")?);
        command.args([
            "--node-id",
            &self.nodes[i].id,
            "--peer-listen",
            &format!("127.0.0.1:{}", free_port()),
            "--app-listen",
            &format!("127.0.0.1:{}", free_port()),
            "--coordinator",
            &self.coordinator_list(),
            "--grace-period",
            "1s",
        ]);
        Ok((ChildGuard::spawn("cairn-node", command, &log)?, log))
    }
}

impl Drop for CoordinatedCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill_node(i);
        }
        for r in 0..self.replicas.len() {
            self.kill_replica(r);
        }
        if std::thread::panicking() || self.keep_logs {
            eprintln!("cluster logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A fault injection request for channel `from -> to`.
pub fn channel_fault(
    from: &str,
    to: &str,
    fault: pb::inject_fault_request::Fault,
) -> pb::InjectFaultRequest {
    pb::InjectFaultRequest {
        channel: Some(pb::ChannelRef {
            from: from.into(),
            to: to.into(),
        }),
        fault: Some(fault),
    }
}

/// The Prometheus text served at `http://{address}/metrics`.
pub async fn scrape(address: &str) -> anyhow::Result<String> {
    scrape_with(address, None).await
}

/// As [`scrape`]; with `tls` (a directory of [`certs_init`] and the name of a certificate
/// in it), over mutual TLS as the endpoints of a TLS daemon serve it.
pub async fn scrape_with(address: &str, tls: Option<(&Path, &str)>) -> anyhow::Result<String> {
    let (status, response) = raw_get(address, "/metrics", tls, &[]).await?;
    anyhow::ensure!(status == 200, "{response}");
    Ok(response)
}

/// `GET http://{address}{path}` (HTTP/1.1, one connection): the status code and the body.
pub async fn http_get(address: &str, path: &str) -> anyhow::Result<(u16, String)> {
    http_request(address, path, None, &[]).await
}

/// `GET {path}` at `address` with `headers`; with `tls` (as [`scrape_with`]) over mutual
/// TLS: the status code and the body.
pub async fn http_request(
    address: &str,
    path: &str,
    tls: Option<(&Path, &str)>,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, String)> {
    let (status, response) = raw_get(address, path, tls, headers).await?;
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_owned());
    Ok((status, body))
}

/// `GET {path}` at `address`: the status code and the whole response (headers and body).
async fn raw_get(
    address: &str,
    path: &str,
    tls: Option<(&Path, &str)>,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
    let mut extra = String::new();
    for (name, value) in headers {
        extra.push_str(&format!("{name}: {value}\r\n"));
    }
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: {address}\r\n{extra}Connection: close\r\n\r\n");
    async fn exchange(
        stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
        request: String,
    ) -> anyhow::Result<(u16, String)> {
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        // A TLS server may close without close_notify once it has answered.
        let read = stream.read_to_end(&mut response).await;
        let response = String::from_utf8_lossy(&response).into_owned();
        if response.is_empty() {
            read?;
        }
        let status = response
            .strip_prefix("HTTP/1.1 ")
            .and_then(|r| r.get(..3))
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("not an HTTP/1.1 response: {response}"))?;
        Ok((status, response))
    }
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    let Some((dir, name)) = tls else {
        return exchange(&mut stream, request).await;
    };
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    cairn_sdk::tls::install_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(dir.join("ca.pem"))? {
        roots.add(cert?)?;
    }
    let chain = CertificateDer::pem_file_iter(dir.join(format!("{name}.pem")))?
        .collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_file(dir.join(format!("{name}-key.pem")))?;
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)?;
    let host = cairn_sdk::tls::host_of(address).to_owned();
    let mut stream = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(ServerName::try_from(host)?, stream)
        .await?;
    exchange(&mut stream, request).await
}

/// Asserts that a snapshot of banks completed, verified, and accounts for `total`.
pub fn assert_completed(snapshot: &pb::Snapshot, total: u64) {
    let id = snapshot.plan.as_ref().map_or(0, |p| p.snapshot_id);
    assert_eq!(
        snapshot.status,
        pb::SnapshotStatus::Completed as i32,
        "snapshot {id}: {:?}",
        snapshot.failure
    );
    assert!(
        snapshot.verdict.as_ref().is_some_and(|v| v.consistent),
        "snapshot {id}: {:?}",
        snapshot.verdict
    );
    assert_eq!(
        bank_money(snapshot).unwrap(),
        total,
        "snapshot {id}: the money does not add up"
    );
}

/// Sums a snapshot of banks: recorded balances plus recorded transfers in flight.
pub fn bank_money(snapshot: &pb::Snapshot) -> anyhow::Result<u64> {
    let mut total = 0;
    for node in &snapshot.nodes {
        let state: cairn_cli::bank::BankState = serde_json::from_slice(&node.local_state)
            .map_err(|e| anyhow::anyhow!("{}: {e}", node.node_id))?;
        total += state.balance;
        for channel in &node.channel_states {
            for m in &channel.messages {
                total += cairn_cli::bank::TransferPayload::decode(&m.payload)?.amount;
            }
        }
    }
    Ok(total)
}

/// The gRPC health status (`tonic_health`'s `ServingStatus` as a number) that the server at
/// `address` reports for `service`.
pub async fn health_of(
    address: &str,
    service: &str,
    tls: Option<&cairn_sdk::tls::Tls>,
) -> anyhow::Result<i32> {
    let channel = cairn_sdk::tls::endpoint(address, tls)?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .connect()
        .await?;
    Ok(tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await?
        .into_inner()
        .status)
}
