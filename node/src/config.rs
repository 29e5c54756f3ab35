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
    /// Largest application payload accepted, in bytes.
    pub max_payload: usize,
    /// Whether `NodeAdmin/InjectFault` is allowed.
    pub fault_injection: bool,
    /// How long shutdown waits for in-flight work before it stops anyway.
    pub grace_period: Duration,
    /// First reconnect delay to a peer; doubled up to `reconnect_max`, with jitter.
    pub reconnect_initial: Duration,
    /// Longest reconnect delay.
    pub reconnect_max: Duration,
    /// Completed local snapshot parts kept for `GetLocalSnapshot`.
    pub keep_parts: usize,
    /// The coordinator's address; `None` runs without one (snapshots by `NodeAdmin` only).
    pub coordinator: Option<String>,
    /// With a coordinator: the peer address it hands out for this node (required).
    pub advertise: Option<String>,
    /// Who may call NodeAdmin: the bearer tokens of `--auth-tokens`, or open (the default).
    /// The peer channels and the application session are not governed by tokens.
    pub auth: cairn_sdk::cli::auth::Auth,
    /// `--tls-*`: the peer port serves mutual TLS (client certificates required, checked
    /// against the CA) and the links to peers and to the coordinator use it. `None`:
    /// plaintext (the default).
    pub tls: Option<cairn_sdk::tls::Tls>,
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
            max_payload: 4 << 20,
            fault_injection: false,
            grace_period: Duration::from_secs(10),
            reconnect_initial: Duration::from_millis(50),
            reconnect_max: Duration::from_secs(2),
            keep_parts: 256,
            coordinator: None,
            advertise: None,
            auth: cairn_sdk::cli::auth::Auth::open(),
            tls: None,
        }
    }

    /// A daemon that takes its members from the coordinator at `coordinator` and tells it
    /// that peers reach it at `advertise`.
    pub fn with_coordinator(
        node_id: NodeId,
        cluster: impl Into<String>,
        coordinator: impl Into<String>,
        advertise: impl Into<String>,
    ) -> Self {
        let mut config = Self::new(node_id, cluster, BTreeMap::new());
        config.coordinator = Some(coordinator.into());
        config.advertise = Some(advertise.into());
        config
    }

    /// The topology to start with, checked. With a coordinator: this node alone (the
    /// coordinator's membership follows). Without: this node must be a member and every
    /// channel must join members. Also checks `max_payload` against
    /// [`cairn_proto::limits::MAX_PAYLOAD_CEILING`] (the coordinator's upload limit fits a
    /// message up to it).
    pub fn topology(&self) -> Result<Topology, ConfigError> {
        let ceiling = cairn_proto::limits::MAX_PAYLOAD_CEILING;
        if self.max_payload == 0 || self.max_payload > ceiling {
            return Err(ConfigError::Invalid(format!(
                "--max-payload must be 1 to {ceiling} bytes (16 MiB); got {}",
                self.max_payload
            )));
        }
        if self.coordinator.is_some() {
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
