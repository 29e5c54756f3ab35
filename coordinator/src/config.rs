//! The coordinator's configuration.

use std::path::PathBuf;
use std::time::Duration;

use cairn_core::schedule::Policy;
use cairn_core::{ChannelId, NodeId, Topology};

/// Everything a coordinator needs to run.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// The cluster's name; nodes of another cluster are refused.
    pub cluster: String,
    /// etcd endpoints; empty for the embedded metadata store.
    pub etcd: Vec<String>,
    /// Where the embedded store's file and the blob directory live.
    pub data_dir: PathBuf,
    /// The blob store's directory; `None`: `<data_dir>/blobs`.
    pub blob_dir: Option<PathBuf>,
    /// The timeout of a snapshot that names none.
    pub default_timeout: Duration,
    /// Most snapshots in flight at once.
    pub max_concurrent: usize,
    /// Completed snapshots kept; 0 keeps all.
    pub retention: usize,
    /// How long shutdown waits for the coordinator's task.
    pub grace_period: Duration,
    /// A fixed topology; `None`: a full mesh of every node that registers.
    pub topology: Option<Topology>,
    /// The snapshot policy (a policy set through `SetPolicy` and stored wins over it).
    pub policy: Policy,
    /// Automatic recovery: when a member's daemon comes back with a new incarnation, restore
    /// the newest completed snapshot on the whole cluster.
    pub auto_restore: bool,
    /// How long a restore may take before it fails naming the nodes that did not apply.
    pub restore_timeout: Duration,
    /// Who may call what: the bearer tokens of `--auth-tokens`, or open (the default).
    pub auth: cairn_sdk::cli::auth::Auth,
    /// `--tls-*`: the gRPC port serves mutual TLS (client certificates required, checked
    /// against the CA). `None`: plaintext (the default).
    pub tls: Option<cairn_sdk::tls::Tls>,
}

impl CoordinatorConfig {
    /// Defaults for everything but the cluster and the data directory.
    pub fn new(cluster: impl Into<String>, data_dir: impl Into<PathBuf>) -> Self {
        Self {
            cluster: cluster.into(),
            etcd: Vec::new(),
            data_dir: data_dir.into(),
            blob_dir: None,
            default_timeout: Duration::from_secs(30),
            max_concurrent: 4,
            retention: 0,
            grace_period: Duration::from_secs(5),
            topology: None,
            policy: Policy::default(),
            auto_restore: false,
            restore_timeout: Duration::from_secs(60),
            auth: cairn_sdk::cli::auth::Auth::open(),
            tls: None,
        }
    }
}

/// Parses a topology file: one directed channel `FROM>TO` per line, or a lone node id for a
/// node without channels; blank lines and `#` comments are skipped. The nodes are every id
/// named. Errors name the line.
pub fn parse_topology(text: &str) -> Result<Topology, String> {
    let mut nodes = Vec::new();
    let mut channels = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| format!("line {}: `{line}`: {why}", number + 1);
        match line.split_once('>') {
            Some((from, to)) => {
                let (from, to) = (from.trim(), to.trim());
                if from.is_empty() || to.is_empty() || to.contains('>') {
                    return Err(bad("expected FROM>TO"));
                }
                if from.contains(char::is_whitespace) || to.contains(char::is_whitespace) {
                    return Err(bad("node ids cannot hold spaces"));
                }
                nodes.extend([NodeId::new(from), NodeId::new(to)]);
                channels.push(ChannelId::new(from, to));
            }
            None if line.contains(char::is_whitespace) => {
                return Err(bad("expected FROM>TO or a single node id"));
            }
            None => nodes.push(NodeId::new(line)),
        }
    }
    if nodes.is_empty() {
        return Err("no nodes: the file names no channel and no node".into());
    }
    Topology::from_channels(nodes, channels).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_with_comments_and_a_lone_node() {
        let t = parse_topology("# ring\nn1>n2\n n2 > n3 \nn3>n1 # back\n\nn4\n").unwrap();
        assert_eq!(t.nodes().len(), 4);
        assert_eq!(t.channels().len(), 3);
        assert!(t.channels().contains(&ChannelId::new("n2", "n3")));
    }

    #[test]
    fn bad_lines_are_named() {
        assert_eq!(
            parse_topology("n1>n2\nn1>\n").unwrap_err(),
            "line 2: `n1>`: expected FROM>TO"
        );
        assert!(parse_topology("n1>n1").unwrap_err().contains("n1"));
        assert!(parse_topology("a b").unwrap_err().starts_with("line 1"));
        assert!(parse_topology("# nothing\n").is_err());
    }
}
