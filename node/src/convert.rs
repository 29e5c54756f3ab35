//! Conversions between the wire types of `cairn-proto` and the domain types of
//! `cairn-core`, at the edge. A message from the network that lacks a field or names an
//! unknown mode is refused with an `InvalidInput` error naming what is wrong.

use std::time::Duration;

use cairn_core::{
    ChannelId, FailureReason, IncomingCut, NodeId, OutgoingCut, Plan, SnapshotId, SnapshotMode,
};
use cairn_proto::v1 as pb;

/// A wire message that cannot become a domain value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidInput(pub String);

/// The wire mode of a domain mode.
pub fn mode_to_pb(mode: SnapshotMode) -> pb::SnapshotMode {
    match mode {
        SnapshotMode::ChandyLamport => pb::SnapshotMode::ChandyLamport,
        SnapshotMode::Unaligned => pb::SnapshotMode::Unaligned,
        SnapshotMode::Aligned => pb::SnapshotMode::Aligned,
    }
}

/// The domain mode of a wire value; UNSPECIFIED becomes `default` when given, else an error.
pub fn mode_from_pb(
    value: i32,
    default: Option<SnapshotMode>,
) -> Result<SnapshotMode, InvalidInput> {
    match pb::SnapshotMode::try_from(value) {
        Ok(pb::SnapshotMode::ChandyLamport) => Ok(SnapshotMode::ChandyLamport),
        Ok(pb::SnapshotMode::Unaligned) => Ok(SnapshotMode::Unaligned),
        Ok(pb::SnapshotMode::Aligned) => Ok(SnapshotMode::Aligned),
        Ok(pb::SnapshotMode::Unspecified) => {
            default.ok_or_else(|| InvalidInput("snapshot mode is not set".into()))
        }
        Err(_) => Err(InvalidInput(format!("unknown snapshot mode {value}"))),
    }
}

/// A plan as markers carry it.
pub fn plan_to_pb(plan: &Plan, epoch: u64) -> pb::SnapshotPlan {
    pb::SnapshotPlan {
        snapshot_id: plan.id.0,
        mode: mode_to_pb(plan.mode) as i32,
        initiators: plan.initiators.iter().map(|n| n.to_string()).collect(),
        alignment_timeout_ms: plan.alignment_timeout.map_or(0, |d| d.as_millis() as u64),
        epoch,
    }
}

/// A marker's plan; every field a marker must have is checked.
pub fn plan_from_pb(plan: &pb::SnapshotPlan) -> Result<Plan, InvalidInput> {
    if plan.snapshot_id == 0 {
        return Err(InvalidInput("snapshot id 0 is not a valid snapshot".into()));
    }
    if plan.initiators.is_empty() {
        return Err(InvalidInput(format!(
            "snapshot {} names no initiator",
            plan.snapshot_id
        )));
    }
    Ok(Plan {
        id: SnapshotId(plan.snapshot_id),
        mode: mode_from_pb(plan.mode, None)?,
        initiators: plan
            .initiators
            .iter()
            .map(|n| NodeId::new(n.clone()))
            .collect(),
        alignment_timeout: (plan.alignment_timeout_ms > 0)
            .then(|| Duration::from_millis(plan.alignment_timeout_ms)),
    })
}

/// A channel reference.
pub fn channel_to_pb(channel: &ChannelId) -> pb::ChannelRef {
    pb::ChannelRef {
        from: channel.from.to_string(),
        to: channel.to.to_string(),
    }
}

/// A channel from its reference; both ends must be named.
pub fn channel_from_pb(channel: Option<&pb::ChannelRef>) -> Result<ChannelId, InvalidInput> {
    let channel = channel.ok_or_else(|| InvalidInput("channel is not set".into()))?;
    if channel.from.is_empty() || channel.to.is_empty() {
        return Err(InvalidInput(
            "channel must name both `from` and `to`".into(),
        ));
    }
    Ok(ChannelId::new(channel.from.as_str(), channel.to.as_str()))
}

/// The receiving side of a cut, with the range the receiver recorded.
pub fn incoming_to_pb(channel: &ChannelId, cut: &IncomingCut) -> pb::IncomingCut {
    let recorded = cut.recorded();
    pb::IncomingCut {
        channel: Some(channel_to_pb(channel)),
        delivered: cut.delivered,
        marker_at: cut.marker_at,
        recorded_from: recorded.start,
        recorded_to: recorded.end,
    }
}

/// The sending side of a cut, with the range the sender recorded.
pub fn outgoing_to_pb(channel: &ChannelId, cut: &OutgoingCut) -> pb::OutgoingCut {
    let recorded = cut.recorded();
    pb::OutgoingCut {
        channel: Some(channel_to_pb(channel)),
        sent: cut.sent,
        marker_at: cut.marker_at,
        recorded_from: recorded.start,
        recorded_to: recorded.end,
    }
}

/// The receiving side of a cut from the wire.
pub fn incoming_from_pb(cut: &pb::IncomingCut) -> Result<(ChannelId, IncomingCut), InvalidInput> {
    Ok((
        channel_from_pb(cut.channel.as_ref())?,
        IncomingCut {
            delivered: cut.delivered,
            marker_at: cut.marker_at,
        },
    ))
}

/// The sending side of a cut from the wire.
pub fn outgoing_from_pb(cut: &pb::OutgoingCut) -> Result<(ChannelId, OutgoingCut), InvalidInput> {
    Ok((
        channel_from_pb(cut.channel.as_ref())?,
        OutgoingCut {
            sent: cut.sent,
            marker_at: cut.marker_at,
        },
    ))
}

/// A failure reason for the wire: a stable kind, a sentence, and who is concerned.
pub fn failure_to_pb(reason: &FailureReason) -> pb::FailureReason {
    use pb::failure_reason::Kind;
    let (kind, nodes, channel) = match reason {
        FailureReason::Timeout { missing } => (Kind::Timeout, missing.clone(), None),
        FailureReason::NodeLost(n) => (Kind::NodeLost, vec![n.clone()], None),
        FailureReason::ChannelReset(c) => (Kind::ChannelReset, vec![], Some(channel_to_pb(c))),
        FailureReason::Inconsistent(_) => (Kind::Inconsistent, vec![], None),
        FailureReason::NoApplication(n) => (Kind::NoApplication, vec![n.clone()], None),
        FailureReason::CoordinatorRestarted => (Kind::CoordinatorRestarted, vec![], None),
        FailureReason::Restore => (Kind::Restore, vec![], None),
        FailureReason::Shutdown(n) => (Kind::Shutdown, vec![n.clone()], None),
        FailureReason::Storage(_) => (Kind::Storage, vec![], None),
        FailureReason::Aborted(_) => (Kind::Unspecified, vec![], None),
        FailureReason::MembershipChanged(_) => (Kind::MembershipChanged, vec![], None),
        FailureReason::MixedEpochs { nodes, .. } => (Kind::MixedEpochs, nodes.clone(), None),
    };
    pb::FailureReason {
        kind: kind as i32,
        message: reason.to_string(),
        nodes: nodes.iter().map(ToString::to_string).collect(),
        channel,
    }
}
