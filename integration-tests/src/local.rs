//! Node daemons inside the test process: real tonic servers on `127.0.0.1:0`, stopped
//! when the cluster drops.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use cairn_core::NodeId;
use cairn_node::{Listeners, NodeConfig};
use cairn_rpc::v1 as pb;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// Listeners bound for every node, before any starts, so every address is known.
pub struct Bound {
    /// Each node's peer and application addresses.
    pub addresses: BTreeMap<NodeId, (SocketAddr, SocketAddr)>,
    listeners: BTreeMap<NodeId, Listeners>,
}

/// Binds a peer and an application listener for each id.
pub async fn bind(ids: &[&str]) -> anyhow::Result<Bound> {
    let mut addresses = BTreeMap::new();
    let mut listeners = BTreeMap::new();
    for id in ids {
        let peer = TcpListener::bind("127.0.0.1:0").await?;
        let app = TcpListener::bind("127.0.0.1:0").await?;
        addresses.insert(NodeId::from(*id), (peer.local_addr()?, app.local_addr()?));
        listeners.insert(
            NodeId::from(*id),
            Listeners {
                peer,
                app,
                metrics: None,
            },
        );
    }
    Ok(Bound {
        addresses,
        listeners,
    })
}

/// A running in-process daemon.
pub struct LocalNode {
    /// Its peer (and admin) address.
    pub peer: SocketAddr,
    /// Its application address.
    pub app: SocketAddr,
    config: NodeConfig,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), cairn_node::RunError>>,
}

/// In-process daemons; each is shut down when this drops.
pub struct LocalCluster {
    /// The nodes by id.
    pub nodes: BTreeMap<NodeId, LocalNode>,
}

impl Bound {
    /// Starts every node with a default configuration that `configure` may change.
    pub fn start(mut self, configure: impl Fn(&NodeId, &mut NodeConfig)) -> LocalCluster {
        let peers: BTreeMap<NodeId, String> = self
            .addresses
            .iter()
            .map(|(id, (peer, _))| (id.clone(), peer.to_string()))
            .collect();
        let mut nodes = BTreeMap::new();
        for (id, (peer, app)) in &self.addresses {
            let mut config = NodeConfig::new(id.clone(), "test", peers.clone());
            config.grace_period = std::time::Duration::from_millis(200);
            configure(id, &mut config);
            let listeners = self.listeners.remove(id).expect("bound");
            let shutdown = CancellationToken::new();
            let task = tokio::spawn(cairn_node::run(config.clone(), listeners, shutdown.clone()));
            nodes.insert(
                id.clone(),
                LocalNode {
                    peer: *peer,
                    app: *app,
                    config,
                    shutdown,
                    task,
                },
            );
        }
        LocalCluster { nodes }
    }
}

impl LocalCluster {
    /// A NodeAdmin client of node `id`.
    pub async fn admin(
        &self,
        id: &str,
    ) -> anyhow::Result<pb::node_admin_client::NodeAdminClient<Channel>> {
        let node = &self.nodes[&NodeId::from(id)];
        Ok(
            pb::node_admin_client::NodeAdminClient::connect(format!("http://{}", node.peer))
                .await?,
        )
    }

    /// Node `id`'s status.
    pub async fn status(&self, id: &str) -> anyhow::Result<pb::NodeStatus> {
        Ok(self
            .admin(id)
            .await?
            .get_node_status(pb::GetNodeStatusRequest {})
            .await?
            .into_inner())
    }

    /// Stops node `id` and starts it again on the same addresses: a new incarnation.
    pub async fn restart(&mut self, id: &str) -> anyhow::Result<()> {
        let node = self.nodes.get_mut(&NodeId::from(id)).expect("member");
        node.shutdown.cancel();
        (&mut node.task).await??;
        let listeners = Listeners {
            peer: TcpListener::bind(node.peer).await?,
            app: TcpListener::bind(node.app).await?,
            metrics: None,
        };
        node.shutdown = CancellationToken::new();
        node.task = tokio::spawn(cairn_node::run(
            node.config.clone(),
            listeners,
            node.shutdown.clone(),
        ));
        Ok(())
    }

    /// Stops every node and waits for them.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        for node in self.nodes.values() {
            node.shutdown.cancel();
        }
        for (_, node) in std::mem::take(&mut self.nodes) {
            node.task.await??;
        }
        Ok(())
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for node in self.nodes.values() {
            node.shutdown.cancel();
            node.task.abort();
        }
    }
}
