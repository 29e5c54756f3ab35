//! The daemon's configuration, validated once in `main` (or by a test) before anything
//! starts.

use std::collections::BTreeMap;
use std::time::Duration;

use cairn_core::{ChannelId, NodeId, Topology, TopologyError};

/// Everything a node daemon needs to run.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node's id.
    pub node_id: NodeId,
    /// The cluster's name; peers of another cluster are refused.
    pub cluster: String,
    /// Without a coordinator: every member's peer address (`host:port`), this node's
    /// included. With one: empty, since the coordinator hands out the members.
    pub peers: BTreeMap<NodeId, String>,
    /// Without a coordinator: the directed channels; `None` means a full mesh of the
    /// members. With one: `None`.
    pub channels: Option<Vec<ChannelId>>,
    /// Messages each channel may hold inside this daemon (incoming: waiting for the
    /// application; outgoing: queued or unacknowledged) before the sender is pushed back.
    pub channel_buffer: usize,
    /// Buffer debloating at the sender: bound each outgoing queue (with what is on the wire
    /// and not acknowledged) to this much of its peer's measured drain rate while the peer
    /// holds it back (`None`: `channel_buffer` alone bounds it; at least 1 ms).
    pub queue_target: Option<Duration>,
    /// Largest application payload accepted, in bytes.
    pub max_payload: usize,
    /// Whether `NodeAdmin/InjectFault` is allowed.
    pub fault_injection: bool,
    /// How long shutdown waits for in-flight work before it stops anyway.
    pub grace_period: Duration,
    /// With a coordinator: at shutdown, after draining, leave the cluster (the coordinator
    /// removes this node).
    pub leave_on_shutdown: bool,
    /// First reconnect delay to a peer; doubled up to `reconnect_max`, with jitter.
    pub reconnect_initial: Duration,
    /// Longest reconnect delay.
    pub reconnect_max: Duration,
    /// Completed local snapshot parts kept for `GetLocalSnapshot`.
    pub keep_parts: usize,
    /// The coordinator replicas' addresses (`host:port` each, at most
    /// [`MAX_COORDINATORS`]), tried in turn until one registers this daemon; a replica
    /// that is not the leader names the leader, which is tried next. Empty: the daemon
    /// runs without a coordinator (snapshots by `NodeAdmin` only).
    pub coordinators: Vec<String>,
    /// With a coordinator: the peer address it hands out for this node (required).
    pub advertise: Option<String>,
    /// Who may call NodeAdmin: the bearer tokens of `--auth-tokens`, or open (the default).
    /// The peer channels and the application session are not governed by tokens.
    pub auth: cairn_rpc::server::auth::Auth,
    /// `--tls-*`: the peer port serves mutual TLS (client certificates required, checked
    /// against the CA) and the links to peers and to the coordinator use it. `None`:
    /// plaintext (the default).
    pub tls: Option<cairn_rpc::tls::Tls>,
    /// With a coordinator: the blob store this daemon writes its parts' new state chunks to
    /// itself (the coordinator's; `--blob-store`). No location: the chunks travel in the
    /// upload to the coordinator.
    pub blob: cairn_blob::BlobArgs,
}

impl NodeConfig {
    /// A configuration with defaults for everything but the identity and the members.
    pub fn new(
        node_id: NodeId,
        cluster: impl Into<String>,
        peers: BTreeMap<NodeId, String>,
    ) -> Self {
        Self {
            node_id,
            cluster: cluster.into(),
            peers,
            channels: None,
            channel_buffer: 16_384,
            queue_target: None,
            max_payload: 4 << 20,
            fault_injection: false,
            grace_period: Duration::from_secs(10),
            leave_on_shutdown: false,
            reconnect_initial: Duration::from_millis(50),
            reconnect_max: Duration::from_secs(2),
            keep_parts: 256,
            coordinators: Vec::new(),
            advertise: None,
            auth: cairn_rpc::server::auth::Auth::open(),
            tls: None,
            blob: cairn_blob::BlobArgs::default(),
        }
    }

    /// A daemon that takes its members from the coordinator at `coordinator` (one address)
    /// and tells it that peers reach it at `advertise`. Set `coordinators` for several
    /// replicas.
    pub fn with_coordinator(
        node_id: NodeId,
        cluster: impl Into<String>,
        coordinator: impl Into<String>,
        advertise: impl Into<String>,
    ) -> Self {
        let mut config = Self::new(node_id, cluster, BTreeMap::new());
        config.coordinators = vec![coordinator.into()];
        config.advertise = Some(advertise.into());
        config
    }

    /// The topology to start with, checked. With a coordinator: this node alone (the
    /// coordinator's membership follows). Without: this node must be a member and every
    /// channel must join members. Also checks `max_payload` against
    /// [`cairn_rpc::limits::MAX_PAYLOAD_CEILING`] (the coordinator's upload limit fits a
    /// message up to it).
    pub fn topology(&self) -> Result<Topology, ConfigError> {
        let ceiling = cairn_rpc::limits::MAX_PAYLOAD_CEILING;
        if self.max_payload == 0 || self.max_payload > ceiling {
            return Err(ConfigError::Invalid(format!(
                "--max-payload must be 1 to {ceiling} bytes (16 MiB); got {}",
                self.max_payload
            )));
        }
        if !self.coordinators.is_empty() {
            check_coordinators(&self.coordinators)?;
            if !self.peers.is_empty() || self.channels.is_some() {
                return Err(ConfigError::Invalid(
                    "--peer and --channel are for a daemon without --coordinator; with one, the \
                     coordinator hands out the members and channels"
                        .into(),
                ));
            }
            if self.advertise.as_deref().is_none_or(str::is_empty) {
                return Err(ConfigError::Invalid(
                    "a daemon with --coordinator needs --advertise HOST:PORT, the address its \
                     peers reach its --peer-listen at"
                        .into(),
                ));
            }
            return Ok(Topology::full_mesh([self.node_id.clone()]));
        }
        if self.peers.is_empty() {
            return Err(ConfigError::Invalid(
                "no members: give --coordinator HOST:PORT (the coordinator hands out the \
                 members), or every member with --peer ID=HOST:PORT"
                    .into(),
            ));
        }
        if !self.peers.contains_key(&self.node_id) {
            return Err(ConfigError::NotAMember(self.node_id.clone()));
        }
        let nodes = self.peers.keys().cloned();
        match &self.channels {
            None => Ok(Topology::full_mesh(nodes)),
            Some(channels) => Ok(Topology::from_channels(nodes, channels.iter().cloned())?),
        }
    }
}

/// Most coordinator addresses `--coordinator` may list.
pub const MAX_COORDINATORS: usize = 16;

/// Longest `HOST:PORT` accepted as a coordinator's address (a DNS name is at most 253).
pub const MAX_ADDRESS_LEN: usize = 255;

/// Checks the coordinators' addresses: at most [`MAX_COORDINATORS`], each a `HOST:PORT`
/// (see [`check_host_port`]), none twice.
pub fn check_coordinators(addresses: &[String]) -> Result<(), ConfigError> {
    if addresses.len() > MAX_COORDINATORS {
        return Err(ConfigError::Invalid(format!(
            "--coordinator lists {} addresses; at most {MAX_COORDINATORS}",
            addresses.len()
        )));
    }
    for (i, address) in addresses.iter().enumerate() {
        check_host_port(address).map_err(|why| {
            ConfigError::Invalid(format!(
                "--coordinator: `{address}` is not HOST:PORT ({why}); give one address or \
                 several separated by commas, e.g. a:7000,b:7000,c:7000"
            ))
        })?;
        if addresses[..i].contains(address) {
            return Err(ConfigError::Invalid(format!(
                "--coordinator lists {address} twice"
            )));
        }
    }
    Ok(())
}

/// Checks that `text` is a `HOST:PORT` fit to dial: at most [`MAX_ADDRESS_LEN`] bytes, the
/// host a name or IPv4 address (letters, digits, `.`, `-`, `_`) or an IPv6 address in
/// brackets, the port 1 to 65535. Nothing else (no scheme, path, user or space) gets
/// through, so the address can go into a URI as it is. `Err` says what is wrong.
pub fn check_host_port(text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err("empty".into());
    }
    if text.len() > MAX_ADDRESS_LEN {
        return Err(format!("longer than {MAX_ADDRESS_LEN} bytes"));
    }
    if text.contains("://") {
        return Err("a URL: give HOST:PORT without a scheme".into());
    }
    let (host, port) = text.rsplit_once(':').ok_or("no :PORT")?;
    if port.is_empty()
        || !port.bytes().all(|b| b.is_ascii_digit())
        || port.parse::<u16>().map_or(true, |p| p == 0)
    {
        return Err(format!("port `{port}` is not 1 to 65535"));
    }
    let ok = match host.strip_prefix('[') {
        Some(inner) => inner
            .strip_suffix(']')
            .is_some_and(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok()),
        None => {
            !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
        }
    };
    if !ok {
        return Err(format!(
            "host `{host}` is not a name, an IPv4 address or an IPv6 address in brackets"
        ));
    }
    Ok(())
}

/// A configuration that cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// This node is missing from the member list.
    #[error("node {0} is not in the peer list; add it as {0}=HOST:PORT")]
    NotAMember(NodeId),
    /// The channels do not fit the members.
    #[error("bad topology: {0}")]
    Topology(#[from] TopologyError),
    /// A flag's value is malformed.
    #[error("{0}")]
    Invalid(String),
}

/// Parses `n1=127.0.0.1:7001` into a member and its address.
pub fn parse_peer(text: &str) -> Result<(NodeId, String), ConfigError> {
    let (id, addr) = text
        .split_once('=')
        .ok_or_else(|| ConfigError::Invalid(format!("peer `{text}` is not ID=HOST:PORT")))?;
    if id.is_empty() || addr.is_empty() || !addr.contains(':') {
        return Err(ConfigError::Invalid(format!(
            "peer `{text}` is not ID=HOST:PORT"
        )));
    }
    Ok((NodeId::new(id), addr.to_owned()))
}

/// Parses `n1>n2` into a channel.
pub fn parse_channel(text: &str) -> Result<ChannelId, ConfigError> {
    let (from, to) = text
        .split_once('>')
        .ok_or_else(|| ConfigError::Invalid(format!("channel `{text}` is not FROM>TO")))?;
    if from.is_empty() || to.is_empty() {
        return Err(ConfigError::Invalid(format!(
            "channel `{text}` is not FROM>TO"
        )));
    }
    Ok(ChannelId::new(from, to))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(coordinators: &[&str]) -> NodeConfig {
        let mut config =
            NodeConfig::with_coordinator(NodeId::new("n1"), "c", "x:1", "127.0.0.1:7100");
        config.coordinators = coordinators.iter().map(|s| (*s).to_owned()).collect();
        config
    }

    #[test]
    fn one_coordinator_or_a_list() {
        let one = NodeConfig::with_coordinator(NodeId::new("n1"), "c", "a:7000", "h:7100");
        assert_eq!(one.coordinators, ["a:7000"]);
        assert!(one.topology().is_ok());
        let list = [
            "a:7000",
            "10.0.0.2:7000",
            "[::1]:7000",
            "cairn-coordinator.ns.svc:7000",
        ];
        assert!(with(&list).topology().is_ok());
    }

    #[test]
    fn bad_coordinator_lists_are_refused_clearly() {
        for (list, says) in [
            (&["a:7000", ""][..], "`` is not HOST:PORT (empty)"),
            (&["a"][..], "no :PORT"),
            (&["a:0"][..], "port `0`"),
            (&["a:70000"][..], "port `70000`"),
            (&[":7000"][..], "host ``"),
            (&["http://a:7000"][..], "without a scheme"),
            (&["a/b:7000"][..], "host `a/b`"),
            (&["a b:7000"][..], "host `a b`"),
            (&["[zz]:7000"][..], "host `[zz]`"),
            (&["a:7000", "a:7000"][..], "lists a:7000 twice"),
        ] {
            let err = with(list).topology().unwrap_err().to_string();
            assert!(err.contains(says), "{list:?}: {err}");
        }
        let many: Vec<String> = (0..=MAX_COORDINATORS)
            .map(|i| format!("c{i}:7000"))
            .collect();
        let mut config = with(&[]);
        config.coordinators = many;
        let err = config.topology().unwrap_err().to_string();
        assert!(err.contains("at most 16"), "{err}");
        let long = format!("{}:7000", "a".repeat(MAX_ADDRESS_LEN));
        assert!(check_host_port(&long).unwrap_err().contains("longer than"));
    }
}
