//! Prometheus metrics: the daemon's counters (served at `/metrics` by
//! `cairn_rpc::server::metrics::serve`, as the coordinator's are).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// A label naming an outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `completed` or `failed`.
    pub outcome: String,
}

/// A label naming a direction.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabel {
    /// `sent` or `received`.
    pub direction: String,
}

/// A label naming what of a coordinator's messages was refused.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WhatLabel {
    /// `registered`, `initiate`, `abort`, `membership` or `restore`.
    pub what: String,
}

/// A label naming where a part's state chunks went.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UploadLabel {
    /// `coordinator` (sent in the upload), `store` (written to the blob store by this
    /// daemon) or `reused` (the store held them: only their names were sent).
    pub to: String,
}

/// The node daemon's metrics.
#[derive(Clone, Debug, Default)]
pub(crate) struct NodeMetrics {
    /// This node's parts of snapshots, by outcome.
    pub snapshots: Family<OutcomeLabel, Counter>,
    /// Markers sent and received.
    pub markers: Family<DirectionLabel, Counter>,
    /// Application messages sent and received.
    pub messages: Family<DirectionLabel, Counter>,
    /// Messages this node recorded as channel state.
    pub recorded_messages: Counter,
    /// Of those, messages the application had been handed and had not consumed when it
    /// took its cut at a record request's early copy.
    pub early_cut_messages: Counter,
    /// Times an outgoing channel reconnected.
    pub reconnects: Counter,
    /// Sessions with the coordinator that registered (the first, and each reconnect).
    pub coordinator_sessions: Counter,
    /// Messages waiting for the application.
    pub app_queue_depth: Gauge,
    /// Coordinator messages refused because their leadership term was lower than one
    /// this daemon had seen (a deposed leader), by what they were.
    pub stale_term_refused: Family<WhatLabel, Counter>,
    /// The highest coordinator leadership term this daemon has seen (0: none, or the
    /// embedded store's single coordinator).
    pub coordinator_term: Gauge,
    /// Bytes of state chunks of this node's parts, by where they went.
    pub state_bytes: Family<UploadLabel, Counter>,
    /// Messages of channels to removed members that were dropped.
    pub removed_peer_messages: Counter,
    /// Messages queued on each outgoing channel, not yet sent: its backlog, as of the last
    /// status taken (each heartbeat to the coordinator, each `GetNodeStatus`).
    pub channel_queued: Family<PeerLabel, Gauge>,
}

/// The peer an outgoing channel goes to.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabel {
    /// The peer's node id.
    pub to: String,
}

impl NodeMetrics {
    /// Registers every metric in `registry`.
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "cairn_node_snapshots",
            "This node's parts of snapshots, by outcome",
            self.snapshots.clone(),
        );
        registry.register(
            "cairn_node_markers",
            "Snapshot markers sent and received",
            self.markers.clone(),
        );
        registry.register(
            "cairn_node_messages",
            "Application messages sent and received",
            self.messages.clone(),
        );
        registry.register(
            "cairn_node_recorded_channel_messages",
            "Messages recorded as channel state",
            self.recorded_messages.clone(),
        );
        registry.register(
            "cairn_node_early_cut_messages",
            "Messages recorded as channel state because the application had been handed them \
             and had not consumed them when it took its cut at a record request's early copy",
            self.early_cut_messages.clone(),
        );
        registry.register(
            "cairn_node_channel_reconnects",
            "Reconnects of outgoing channels",
            self.reconnects.clone(),
        );
        registry.register(
            "cairn_node_coordinator_sessions",
            "Sessions with the coordinator that registered (the first and each reconnect)",
            self.coordinator_sessions.clone(),
        );
        registry.register(
            "cairn_node_app_queue_depth",
            "Messages waiting for the application",
            self.app_queue_depth.clone(),
        );
        registry.register(
            "cairn_node_stale_term_refused",
            "Coordinator messages refused for a leadership term lower than one seen (a deposed \
             leader), by what they were",
            self.stale_term_refused.clone(),
        );
        registry.register(
            "cairn_node_coordinator_term",
            "The highest coordinator leadership term this daemon has seen",
            self.coordinator_term.clone(),
        );
        registry.register(
            "cairn_node_removed_peer_messages",
            "Messages dropped because their peer was removed from the cluster: queued for it or \
             not acknowledged by it, sent to it by the application after it left, or received \
             from it and not yet taken in",
            self.removed_peer_messages.clone(),
        );
        registry.register(
            "cairn_node_channel_queued_messages",
            "Messages queued on each outgoing channel and not yet sent (its backlog), as of the \
             last status (every heartbeat)",
            self.channel_queued.clone(),
        );
        registry.register(
            "cairn_node_state_upload_bytes",
            "Bytes of local-state chunks of this node's parts, by where they went: sent to the \
             coordinator, written to the blob store by this daemon, or reused (only names sent)",
            self.state_bytes.clone(),
        );
    }

    pub(crate) fn state_bytes(&self, to: &str, bytes: u64) {
        self.state_bytes
            .get_or_create(&UploadLabel { to: to.into() })
            .inc_by(bytes);
    }

    pub(crate) fn stale_term_refused(&self, what: &str) {
        self.stale_term_refused
            .get_or_create(&WhatLabel { what: what.into() })
            .inc();
    }

    pub(crate) fn outcome(&self, outcome: &str) {
        self.snapshots
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc();
    }

    pub(crate) fn marker(&self, direction: &str) {
        self.markers
            .get_or_create(&DirectionLabel {
                direction: direction.into(),
            })
            .inc();
    }

    pub(crate) fn messages(&self, direction: &str, n: u64) {
        self.messages
            .get_or_create(&DirectionLabel {
                direction: direction.into(),
            })
            .inc_by(n);
    }
}
