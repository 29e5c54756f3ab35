//! A cluster of real `cairn-node` and `cairn-bank` processes on loopback, with static
//! configuration (no coordinator), for tests and benchmarks.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use cairn_core::{NodeId, SnapshotMode, Topology};
use cairn_rpc::bank::v1 as bank_pb;
use cairn_rpc::v1 as pb;
use tonic::Code;
use tonic::transport::Channel;

use crate::processes::{ChildGuard, binary, eventually, free_port};

/// One node daemon with its bank.
pub struct Member {
    /// Its id.
    pub id: NodeId,
    /// Its daemon's peer (and admin) address.
    pub peer: String,
    /// Its daemon's application address.
    pub app: String,
    /// Its bank's address.
    pub bank: String,
    node_process: ChildGuard,
    bank_process: ChildGuard,
}

impl Member {
    /// The daemon's process.
    pub fn node_process(&mut self) -> &mut ChildGuard {
        &mut self.node_process
    }

    /// The bank's process.
    pub fn bank_process(&mut self) -> &mut ChildGuard {
        &mut self.bank_process
    }
}

/// Processes of a static cluster; all killed when dropped.
pub struct BankCluster {
    /// The members, in id order.
    pub members: Vec<Member>,
    /// The full mesh of the members.
    pub topology: Topology,
    /// Each bank's starting balance.
    pub initial_balance: u64,
    logs: PathBuf,
    keep_logs: bool,
}

impl BankCluster {
    /// Starts `n` daemons (full mesh) and `n` banks each making `workload` random
    /// transfers per second, and waits until every bank answers.
    pub async fn start(n: usize, workload: f64, node_args: &[&str]) -> anyhow::Result<Self> {
        let node_bin = binary("cairn-node")?;
        let bank_bin = binary("cairn-bank")?;
        let logs =
            std::env::temp_dir().join(format!("cairn-test-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&logs)?;
        let ids: Vec<NodeId> = (1..=n).map(|i| NodeId::new(format!("n{i}"))).collect();
        let peers: Vec<(NodeId, String)> = ids
            .iter()
            .map(|id| (id.clone(), format!("127.0.0.1:{}", free_port())))
            .collect();
        let peer_list = peers
            .iter()
            .map(|(id, addr)| format!("{id}={addr}"))
            .collect::<Vec<_>>()
            .join(",");
        let initial_balance = 1000;
        let mut members = Vec::new();
        for (id, peer) in &peers {
            let app = format!("127.0.0.1:{}", free_port());
            let bank = format!("127.0.0.1:{}", free_port());
            let mut node = Command::new(&node_bin);
            node.args([
                "--node-id",
                id.as_str(),
                "--peer",
                &peer_list,
                "--peer-listen",
                peer,
                "--app-listen",
                &app,
            ])
            .args(["--grace-period", "1s", "--log", "info"])
            .args(node_args);
            let node_process = ChildGuard::spawn(
                &format!("cairn-node {id}"),
                node,
                &logs.join(format!("{id}.node.log")),
            )?;
            let mut bank_cmd = Command::new(&bank_bin);
            bank_cmd
                .args(["--node", &app, "--listen", &bank])
                .args(["--initial-balance", &initial_balance.to_string()])
                .args(["--workload", &workload.to_string()]);
            let bank_process = ChildGuard::spawn(
                &format!("cairn-bank {id}"),
                bank_cmd,
                &logs.join(format!("{id}.bank.log")),
            )?;
            members.push(Member {
                id: id.clone(),
                peer: peer.clone(),
                app,
                bank,
                node_process,
                bank_process,
            });
        }
        let mut cluster = Self {
            topology: Topology::full_mesh(ids),
            members,
            initial_balance,
            logs,
            keep_logs: false,
        };
        for i in 0..n {
            let ready = eventually("bank answers", Duration::from_secs(30), || async {
                cluster
                    .bank(i)
                    .await?
                    .get_balance(bank_pb::GetBalanceRequest {})
                    .await?;
                Ok(())
            })
            .await;
            if let Err(e) = ready {
                cluster.keep_logs = true;
                anyhow::bail!("{e} (logs kept in {})", cluster.logs.display());
            }
        }
        Ok(cluster)
    }

    /// The money there is.
    pub fn total(&self) -> u64 {
        self.initial_balance * self.members.len() as u64
    }

    /// A client of member `i`'s NodeAdmin.
    pub async fn admin(
        &self,
        i: usize,
    ) -> anyhow::Result<pb::node_admin_client::NodeAdminClient<Channel>> {
        let uri = format!("http://{}", self.members[i].peer);
        Ok(pb::node_admin_client::NodeAdminClient::connect(uri).await?)
    }

    /// A client of member `i`'s bank.
    pub async fn bank(
        &self,
        i: usize,
    ) -> anyhow::Result<bank_pb::bank_client::BankClient<Channel>> {
        let uri = format!("http://{}", self.members[i].bank);
        Ok(bank_pb::bank_client::BankClient::connect(uri).await?)
    }

    /// Starts snapshot `id` at member `initiator` and waits for every member's part.
    pub async fn snapshot(
        &self,
        id: u64,
        mode: SnapshotMode,
        initiator: usize,
        timeout: Duration,
    ) -> anyhow::Result<BTreeMap<NodeId, pb::LocalSnapshot>> {
        self.admin(initiator)
            .await?
            .initiate_snapshot(pb::InitiateSnapshotRequest {
                snapshot_id: id,
                mode: pb::SnapshotMode::from(mode) as i32,
                alignment_timeout_ms: 0,
            })
            .await?;
        let mut parts = BTreeMap::new();
        for (i, member) in self.members.iter().enumerate() {
            let part = eventually(
                &format!("part of {} in snapshot {id}", member.id),
                timeout,
                || async {
                    let mut admin = self.admin(i).await?;
                    match admin
                        .get_local_snapshot(pb::GetLocalSnapshotRequest { snapshot_id: id })
                        .await
                    {
                        Ok(part) => Ok(Ok(part.into_inner())),
                        Err(status) if status.code() == Code::NotFound => {
                            Err(anyhow::anyhow!("{}", status.message()))
                        }
                        Err(status) => {
                            Ok(Err(anyhow::anyhow!("{}: {}", member.id, status.message())))
                        }
                    }
                },
            )
            .await??;
            parts.insert(member.id.clone(), part);
        }
        Ok(parts)
    }

    /// Where the processes' logs are.
    pub fn logs(&self) -> &std::path::Path {
        &self.logs
    }
}

impl Drop for BankCluster {
    fn drop(&mut self) {
        for member in &mut self.members {
            member.bank_process.kill();
            member.node_process.kill();
        }
        if std::thread::panicking() || self.keep_logs {
            eprintln!("cluster logs kept in {}", self.logs.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.logs);
        }
    }
}
