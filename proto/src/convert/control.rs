//! The coordinator's control messages with the nodes: registrations, commands, membership
//! and channel status ([`cairn_core::control`]).

use super::{ConvertError, channel_from_pb, plan_to_pb};
use crate::v1 as pb;
use cairn_core::SnapshotId;
use cairn_core::control::{
    ChannelStatus, FrameKind, Membership, NodeCommand, NodeInfo, NodeRestore, Registration,
};
use cairn_core::lifecycle::{MAX_TOLD, Outcomes, SnapshotOutcome};

impl From<&pb::Register> for Registration {
    fn from(r: &pb::Register) -> Self {
        Self {
            cluster: r.cluster.clone(),
            node: r.node_id.clone(),
            address: r.address.clone(),
            incarnation: r.incarnation,
            epoch: r.epoch,
            applied_restore_id: r.applied_restore_id.clone(),
            highest_snapshot_id: r.highest_snapshot_id,
        }
    }
}

impl From<&Registration> for pb::Register {
    fn from(r: &Registration) -> Self {
        Self {
            cluster: r.cluster.clone(),
            node_id: r.node.clone(),
            address: r.address.clone(),
            incarnation: r.incarnation,
            epoch: r.epoch,
            applied_restore_id: r.applied_restore_id.clone(),
            highest_snapshot_id: r.highest_snapshot_id,
        }
    }
}

impl From<FrameKind> for pb::FrameKind {
    fn from(kind: FrameKind) -> Self {
        match kind {
            FrameKind::None => Self::None,
            FrameKind::Data => Self::Data,
            FrameKind::Marker => Self::Marker,
        }
    }
}

impl From<&ChannelStatus> for pb::ChannelStatus {
    fn from(c: &ChannelStatus) -> Self {
        Self {
            channel: Some((&c.channel).into()),
            connected: c.connected,
            unacked_frames: c.unacked_frames,
            data_messages: c.data_messages,
            reconnects: c.reconnects,
            held: c.held,
            queued: c.queued,
            credit_limit: c.credit_limit,
            next_index: c.next_index,
            markers: c.markers,
            alignment_blocked: c.alignment_blocked,
            fault_held: c.fault_held,
            release_budget: c.release_budget,
            next_held: pb::FrameKind::from(c.next_held) as i32,
        }
    }
}

/// The channel must be named; a frame kind this build does not know is none.
impl TryFrom<&pb::ChannelStatus> for ChannelStatus {
    type Error = ConvertError;

    fn try_from(c: &pb::ChannelStatus) -> Result<Self, ConvertError> {
        Ok(Self {
            channel: channel_from_pb(c.channel.as_ref())?,
            connected: c.connected,
            unacked_frames: c.unacked_frames,
            data_messages: c.data_messages,
            reconnects: c.reconnects,
            held: c.held,
            queued: c.queued,
            credit_limit: c.credit_limit,
            next_index: c.next_index,
            markers: c.markers,
            alignment_blocked: c.alignment_blocked,
            fault_held: c.fault_held,
            release_budget: c.release_budget,
            next_held: match pb::FrameKind::try_from(c.next_held) {
                Ok(pb::FrameKind::Data) => FrameKind::Data,
                Ok(pb::FrameKind::Marker) => FrameKind::Marker,
                Ok(pb::FrameKind::None) | Err(_) => FrameKind::None,
            },
        })
    }
}

impl From<&NodeInfo> for pb::NodeInfo {
    fn from(n: &NodeInfo) -> Self {
        Self {
            node_id: n.node.to_string(),
            address: n.address.clone(),
            incarnation: n.incarnation,
            application_attached: n.application_attached,
            last_seen_ms: n.last_seen_ms,
            connected: n.connected,
            channels: n.channels.iter().map(Into::into).collect(),
        }
    }
}

impl From<&Membership> for pb::Membership {
    fn from(m: &Membership) -> Self {
        Self {
            nodes: m.nodes.iter().map(Into::into).collect(),
            channels: m.channels.iter().map(Into::into).collect(),
            epoch: m.epoch,
            removed: m.removed.iter().map(ToString::to_string).collect(),
        }
    }
}

/// `ListNodes`' answer: the membership's nodes and channels.
impl From<&Membership> for pb::ListNodesResponse {
    fn from(m: &Membership) -> Self {
        Self {
            nodes: m.nodes.iter().map(Into::into).collect(),
            channels: m.channels.iter().map(Into::into).collect(),
        }
    }
}

impl From<&NodeRestore> for pb::NodeRestore {
    fn from(r: &NodeRestore) -> Self {
        Self {
            restore_id: r.restore_id.clone(),
            snapshot_id: r.snapshot.0,
            epoch: r.epoch,
        }
    }
}

impl From<&Outcomes> for pb::SnapshotOutcomes {
    fn from(o: &Outcomes) -> Self {
        Self {
            after: o.after,
            outcomes: o
                .outcomes
                .iter()
                .map(|o| pb::SnapshotOutcome {
                    snapshot_id: o.snapshot.0,
                    completed: o.failure.is_none(),
                    reason: o.failure.clone().unwrap_or_default(),
                })
                .collect(),
            through: o.through,
            catch_up: o.catch_up,
        }
    }
}

/// Outcomes as a daemon takes them: at most [`MAX_TOLD`], in increasing id order, all
/// above `after` and at or below `through`; reasons cut to their bound.
impl TryFrom<&pb::SnapshotOutcomes> for Outcomes {
    type Error = ConvertError;

    fn try_from(o: &pb::SnapshotOutcomes) -> Result<Self, ConvertError> {
        let invalid = |why: String| ConvertError::Invalid {
            field: "outcomes",
            why,
        };
        if o.outcomes.len() > MAX_TOLD {
            return Err(invalid(format!(
                "outcomes holds {} ends, more than {MAX_TOLD}",
                o.outcomes.len()
            )));
        }
        let mut last = o.after;
        let mut outcomes = Vec::with_capacity(o.outcomes.len());
        for told in &o.outcomes {
            if told.snapshot_id <= last || told.snapshot_id > o.through {
                return Err(invalid(format!(
                    "outcomes are not in increasing id order within ({}, {}]: snapshot {} \
                     after {last}",
                    o.after, o.through, told.snapshot_id
                )));
            }
            last = told.snapshot_id;
            let snapshot = SnapshotId(told.snapshot_id);
            outcomes.push(if told.completed {
                SnapshotOutcome::completed(snapshot)
            } else {
                SnapshotOutcome::aborted(snapshot, &told.reason)
            });
        }
        Ok(Self {
            after: o.after,
            outcomes,
            through: o.through.max(o.after),
            catch_up: o.catch_up,
        })
    }
}

/// A command as it leaves in `term` (the coordinator's plans carry epoch 0: the daemon
/// stamps its own).
pub fn command_to_pb(command: &NodeCommand, term: u64) -> pb::CoordinatorToNode {
    use pb::coordinator_to_node::Kind;
    let kind = match command {
        NodeCommand::Registered(m) => Kind::Registered(m.into()),
        NodeCommand::Membership(m) => Kind::Membership(m.into()),
        NodeCommand::Initiate(plan) => Kind::Initiate(plan_to_pb(plan, 0)),
        NodeCommand::Abort { snapshot, reason } => Kind::Abort(pb::AbortSnapshotRequest {
            snapshot_id: snapshot.0,
            reason: reason.clone(),
        }),
        NodeCommand::Restore(r) => Kind::Restore(r.into()),
        NodeCommand::Left(error) => Kind::Left(pb::LeaveAnswer {
            error: error.clone().unwrap_or_default(),
        }),
        NodeCommand::Outcomes(o) => Kind::Outcomes(o.into()),
    };
    pb::CoordinatorToNode {
        kind: Some(kind),
        term,
    }
}

#[cfg(test)]
mod tests {
    use cairn_core::ChannelId;

    use super::*;

    #[test]
    fn outcomes_round_trip_and_out_of_order_ones_are_refused() {
        let outcomes = Outcomes {
            after: 3,
            outcomes: vec![
                SnapshotOutcome::completed(SnapshotId(4)),
                SnapshotOutcome::aborted(SnapshotId(6), "node n2 lost"),
            ],
            through: 6,
            catch_up: true,
        };
        let wire = pb::SnapshotOutcomes::from(&outcomes);
        assert_eq!(Outcomes::try_from(&wire), Ok(outcomes));
        let mut backwards = wire.clone();
        backwards.outcomes.reverse();
        assert_eq!(
            Outcomes::try_from(&backwards).unwrap_err().field(),
            "outcomes"
        );
        let mut beyond = wire.clone();
        beyond.through = 5;
        assert!(Outcomes::try_from(&beyond).is_err());
        let mut at_after = wire;
        at_after.after = 4;
        assert!(Outcomes::try_from(&at_after).is_err());
    }

    #[test]
    fn a_channel_status_round_trips_and_needs_its_channel() {
        let status = ChannelStatus {
            channel: ChannelId::new("a", "b"),
            connected: true,
            unacked_frames: 1,
            data_messages: 2,
            reconnects: 3,
            held: true,
            queued: 4,
            credit_limit: 5,
            next_index: 6,
            markers: 7,
            alignment_blocked: true,
            fault_held: false,
            release_budget: 8,
            next_held: FrameKind::Marker,
        };
        let wire = pb::ChannelStatus::from(&status);
        assert_eq!(ChannelStatus::try_from(&wire), Ok(status));
        let unnamed = pb::ChannelStatus {
            channel: None,
            ..wire
        };
        assert_eq!(
            ChannelStatus::try_from(&unnamed),
            Err(ConvertError::Missing("channel"))
        );
    }

    #[test]
    fn a_registration_round_trips() {
        let wire = pb::Register {
            cluster: "c".into(),
            node_id: "n1".into(),
            address: "127.0.0.1:1".into(),
            incarnation: 9,
            epoch: 2,
            applied_restore_id: "restore-3".into(),
            highest_snapshot_id: 17,
        };
        assert_eq!(pb::Register::from(&Registration::from(&wire)), wire);
    }
}
