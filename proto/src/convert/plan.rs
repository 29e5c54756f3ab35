//! Snapshot plans, as markers and initiate commands carry them.

use std::time::Duration;

use cairn_core::{NodeId, Plan, SnapshotId};

use super::{ConvertError, mode_from_pb};
use crate::v1 as pb;

/// A plan as it travels in `epoch` (a function, not a `From`: the domain plan has no
/// epoch; the coordinator's commands carry 0, a daemon's markers its own).
pub fn plan_to_pb(plan: &Plan, epoch: u64) -> pb::SnapshotPlan {
    pb::SnapshotPlan {
        snapshot_id: plan.id.0,
        mode: pb::SnapshotMode::from(plan.mode) as i32,
        initiators: plan.initiators.iter().map(ToString::to_string).collect(),
        alignment_timeout_ms: plan.alignment_timeout.map_or(0, |d| d.as_millis() as u64),
        epoch,
        alignment_timed_out: plan.timed_out,
        started_at_ms: plan.started_at_ms,
    }
}

/// Every field a plan must have is checked; the epoch is the caller's to read.
impl TryFrom<&pb::SnapshotPlan> for Plan {
    type Error = ConvertError;

    fn try_from(plan: &pb::SnapshotPlan) -> Result<Self, ConvertError> {
        if plan.snapshot_id == 0 {
            return Err(ConvertError::Invalid {
                field: "snapshot_id",
                why: "snapshot id 0 is not a valid snapshot".into(),
            });
        }
        if plan.initiators.is_empty() {
            return Err(ConvertError::Invalid {
                field: "initiators",
                why: format!("snapshot {} names no initiator", plan.snapshot_id),
            });
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
            timed_out: plan.alignment_timed_out,
            started_at_ms: plan.started_at_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use cairn_core::SnapshotMode;

    use super::*;

    #[test]
    fn a_plan_round_trips_and_carries_its_epoch() {
        let mut plan = Plan::new(7, SnapshotMode::Aligned, "a");
        plan.initiators.insert("b".into());
        plan.alignment_timeout = Some(Duration::from_millis(250));
        plan.timed_out = true;
        plan.started_at_ms = 1_700_000_000_000;
        let wire = plan_to_pb(&plan, 3);
        assert_eq!(wire.epoch, 3);
        assert_eq!(Plan::try_from(&wire), Ok(plan));
    }

    #[test]
    fn a_plan_without_id_initiator_or_mode_is_refused() {
        let plan = plan_to_pb(&Plan::new(7, SnapshotMode::ChandyLamport, "a"), 0);
        let field = |wire: pb::SnapshotPlan| Plan::try_from(&wire).unwrap_err().field();
        assert_eq!(
            field(pb::SnapshotPlan {
                snapshot_id: 0,
                ..plan.clone()
            }),
            "snapshot_id"
        );
        assert_eq!(
            field(pb::SnapshotPlan {
                initiators: vec![],
                ..plan.clone()
            }),
            "initiators"
        );
        assert_eq!(field(pb::SnapshotPlan { mode: 0, ..plan }), "snapshot mode");
    }
}
