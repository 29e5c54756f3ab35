//! A node's part of a snapshot as the node loop records it — core types only — and its wire
//! form, built at the edges that send it (`NodeAdmin.GetLocalSnapshot` and the part's
//! upload to the coordinator) with the conversions in `cairn_proto::convert`.

use std::collections::BTreeMap;

use bytes::Bytes;
use cairn_core::{ChannelId, LocalReport};
use cairn_proto::v1 as pb;

/// This node's complete part of one snapshot.
#[derive(Debug, Clone)]
pub(crate) struct Part {
    /// The snapshot, this node, and the cut on each of its channels.
    pub report: LocalReport,
    /// The application's recorded state; empty with a coordinator (the state went ahead to
    /// it in pieces).
    pub state: Bytes,
    /// The messages recorded on each channel, with their data indices, in order.
    pub channels: BTreeMap<ChannelId, Vec<(u64, Bytes)>>,
}

impl Part {
    /// The receiving side of the cut of each incoming channel.
    pub(crate) fn incoming_cuts(&self) -> Vec<pb::IncomingCut> {
        self.report
            .incoming
            .iter()
            .map(pb::IncomingCut::from)
            .collect()
    }

    /// The sending side of the cut of each outgoing channel.
    pub(crate) fn outgoing_cuts(&self) -> Vec<pb::OutgoingCut> {
        self.report
            .outgoing
            .iter()
            .map(pb::OutgoingCut::from)
            .collect()
    }

    /// The recorded messages, one `ChannelState` per channel.
    pub(crate) fn channel_states(&self) -> Vec<pb::ChannelState> {
        self.channels
            .iter()
            .map(|(c, messages)| pb::ChannelState {
                channel: Some(c.into()),
                messages: messages
                    .iter()
                    .map(|(index, payload)| pb::RecordedMessage {
                        index: *index,
                        payload: payload.clone(),
                    })
                    .collect(),
                run: None,
            })
            .collect()
    }
}

impl From<&Part> for pb::LocalSnapshot {
    fn from(part: &Part) -> Self {
        Self {
            snapshot_id: part.report.id.0,
            node_id: part.report.node.to_string(),
            local_state: part.state.clone(),
            incoming: part.incoming_cuts(),
            outgoing: part.outgoing_cuts(),
            channel_states: part.channel_states(),
        }
    }
}
