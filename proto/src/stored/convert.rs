//! Conversions between the stored JSON records, the domain and the wire.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::convert::kind_from_word;
use crate::v1 as pb;
use cairn_core::SnapshotMode;

use super::records::{
    EventKind, EventRecord, FailureRecord, RestoreRecord, RestoreStatus, SnapshotRecord,
    SnapshotStatus, VerdictRecord,
};

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The stored name of a mode.
pub fn mode_name(mode: SnapshotMode) -> String {
    mode.to_string()
}

/// The wire value of a stored mode name.
pub fn mode_pb(name: &str) -> pb::SnapshotMode {
    match name {
        "UNALIGNED" => pb::SnapshotMode::Unaligned,
        "ALIGNED" => pb::SnapshotMode::Aligned,
        _ => pb::SnapshotMode::ChandyLamport,
    }
}

/// The wire value of a stored status.
pub fn status_pb(status: SnapshotStatus) -> pb::SnapshotStatus {
    match status {
        SnapshotStatus::InProgress => pb::SnapshotStatus::InProgress,
        SnapshotStatus::Completed => pb::SnapshotStatus::Completed,
        SnapshotStatus::Failed => pb::SnapshotStatus::Failed,
        SnapshotStatus::Aborted => pb::SnapshotStatus::Aborted,
    }
}

/// The stored status a wire status filters on; `None` for unspecified (any).
pub fn status_from_pb(status: pb::SnapshotStatus) -> Option<SnapshotStatus> {
    match status {
        pb::SnapshotStatus::InProgress => Some(SnapshotStatus::InProgress),
        pb::SnapshotStatus::Completed => Some(SnapshotStatus::Completed),
        pb::SnapshotStatus::Failed => Some(SnapshotStatus::Failed),
        pb::SnapshotStatus::Aborted => Some(SnapshotStatus::Aborted),
        pb::SnapshotStatus::Unspecified => None,
    }
}

/// A stored failure on the wire: what [`FailureRecord::from`] a reason gives there.
pub fn failure_pb(record: &FailureRecord) -> pb::FailureReason {
    pb::FailureReason {
        kind: kind_from_word(&record.kind) as i32,
        message: record.message.clone(),
        nodes: record.nodes.clone(),
        channel: record.channel.as_ref().and_then(|c| {
            let (from, to) = c.split_once("->")?;
            Some(pb::ChannelRef {
                from: from.into(),
                to: to.into(),
            })
        }),
        detail: record.detail.clone(),
    }
}

fn verdict_pb(record: &VerdictRecord) -> pb::Verdict {
    pb::Verdict {
        consistent: record.consistent,
        violation: record.violation.clone(),
        recorded_messages: record.recorded_messages,
    }
}

/// A snapshot for the wire, without its parts.
pub fn snapshot_pb(record: &SnapshotRecord) -> pb::Snapshot {
    pb::Snapshot {
        plan: Some(pb::SnapshotPlan {
            snapshot_id: record.id,
            mode: mode_pb(&record.mode) as i32,
            initiators: record.initiators.clone(),
            alignment_timeout_ms: record.alignment_timeout_ms,
            epoch: 0,
            alignment_timed_out: false,
            started_at_ms: 0,
        }),
        status: status_pb(record.status) as i32,
        failure: record.failure.as_ref().map(failure_pb),
        verdict: record.verdict.as_ref().map(verdict_pb),
        started_at_ms: record.started_at_ms,
        finished_at_ms: record.finished_at_ms,
        labels: record.labels.clone().into_iter().collect(),
        nodes: record
            .nodes
            .iter()
            .map(|n| pb::NodePart {
                node_id: n.clone(),
                recorded: record.recorded.contains(n),
                reported: record.reported.contains(n),
                ..Default::default()
            })
            .collect(),
        bytes_new: record.bytes_new,
        bytes_reused: record.bytes_reused,
        term: record.term,
        events: record.events.iter().map(event_pb).collect(),
        channels: record
            .channels
            .iter()
            .filter_map(|c| {
                let (from, to) = c.split_once("->")?;
                Some(pb::ChannelRef {
                    from: from.into(),
                    to: to.into(),
                })
            })
            .collect(),
    }
}

/// A stored event for the wire.
pub fn event_pb(event: &EventRecord) -> pb::SnapshotEvent {
    use pb::snapshot_event::Kind;
    let kind = match event.kind {
        EventKind::Started => Kind::Started,
        EventKind::StateRecorded => Kind::StateRecorded,
        EventKind::PartStored => Kind::PartStored,
        EventKind::NodeFailed => Kind::NodeFailed,
        EventKind::Verified => Kind::Verified,
        EventKind::Ended => Kind::Ended,
    };
    pb::SnapshotEvent {
        at_ms: event.at_ms,
        kind: kind as i32,
        node_id: event.node.clone(),
        local_state_bytes: event.local_state_bytes,
        recorded_messages: event.recorded_messages,
        bytes_new: event.bytes_new,
        bytes_reused: event.bytes_reused,
        detail: event.detail.clone(),
    }
}

/// The wire form of a restore record.
pub fn restore_pb(r: &RestoreRecord) -> pb::RestoreOperation {
    pb::RestoreOperation {
        restore_id: r.id.clone(),
        snapshot_id: r.snapshot_id,
        epoch: r.epoch,
        applied: r.applied.clone(),
        done: r.status == RestoreStatus::Done,
        failure: r.failure.as_ref().map(|message| pb::FailureReason {
            kind: pb::failure_reason::Kind::Restore as i32,
            message: message.clone(),
            ..Default::default()
        }),
        requested_by: r.requested_by.clone(),
        started_at_ms: r.started_at_ms,
        nodes: r.nodes.clone(),
        finished_at_ms: r.finished_at_ms,
        skipped: r.skipped.clone(),
    }
}

/// A snapshot's progress for watchers.
pub fn progress_pb(record: &SnapshotRecord) -> pb::SnapshotProgress {
    pb::SnapshotProgress {
        snapshot_id: record.id,
        status: status_pb(record.status) as i32,
        recorded: record.recorded.clone(),
        reported: record.reported.clone(),
        failure: record.failure.as_ref().map(failure_pb),
        verdict: record.verdict.as_ref().map(verdict_pb),
    }
}

#[cfg(test)]
mod tests {
    use cairn_core::{ChannelId, FailureReason, NodeId, Side, Violation};

    use super::*;

    /// One reason of every kind.
    fn every_reason() -> Vec<FailureReason> {
        vec![
            FailureReason::Timeout {
                missing: vec!["a".into(), "b".into()],
            },
            FailureReason::NodeLost("a".into()),
            FailureReason::ChannelReset(ChannelId::new("a", "b")),
            FailureReason::Inconsistent(Violation::MissingChannel {
                channel: ChannelId::new("b", "a"),
                side: Side::Sender,
            }),
            FailureReason::NoApplication("a".into()),
            FailureReason::CoordinatorRestarted,
            FailureReason::CoordinatorFailover("term 7 ended; term 9 took over".into()),
            FailureReason::Restore,
            FailureReason::Shutdown("b".into()),
            FailureReason::Storage {
                nodes: vec![NodeId::new("a")],
                why: "node a: cannot store its part: no space".into(),
            },
            FailureReason::Aborted("by the operator".into()),
            FailureReason::MembershipChanged("node c joined".into()),
            FailureReason::MixedEpochs {
                nodes: vec!["b".into()],
                detail: "b recorded in epoch 2".into(),
            },
        ]
    }

    /// The record as the coordinator stored it before the conversions moved to
    /// `cairn_proto::convert` (the enum's name without `KIND_`, `ABORTED` for an abort),
    /// with the reason's own words added as `detail`: what is stored must not change
    /// otherwise.
    fn record_before(reason: &FailureReason) -> FailureRecord {
        let wire = pb::FailureReason::from(reason);
        let kind = pb::failure_reason::Kind::try_from(wire.kind)
            .map(|k| k.as_str_name().trim_start_matches("KIND_").to_owned())
            .unwrap_or_default();
        FailureRecord {
            kind: if matches!(reason, FailureReason::Aborted(_)) {
                "ABORTED".into()
            } else {
                kind
            },
            message: wire.message,
            nodes: wire.nodes,
            channel: wire.channel.map(|c| format!("{}->{}", c.from, c.to)),
            detail: Some(reason.detail()).filter(|words| !words.is_empty()),
        }
    }

    #[test]
    fn every_kind_round_trips_through_the_store() {
        for reason in every_reason() {
            let record = FailureRecord::from(&reason);
            let json = serde_json::to_string(&record).unwrap();
            assert_eq!(
                json,
                serde_json::to_string(&record_before(&reason)).unwrap(),
                "{reason}"
            );
            let stored: FailureRecord = serde_json::from_str(&json).unwrap();
            let wire = failure_pb(&stored);
            assert_eq!(wire, pb::FailureReason::from(&reason), "{reason}");
            let back = FailureReason::try_from(&wire).unwrap();
            assert_eq!(back.to_string(), reason.to_string());
            assert_eq!(FailureRecord::from(&back), record, "{reason}");
        }
    }

    #[test]
    fn a_failure_stored_before_detail_keeps_its_sentence() {
        let old = r#"{"kind":"STORAGE","message":"storage failed: no space","nodes":["n1"]}"#;
        let record: FailureRecord = serde_json::from_str(old).unwrap();
        let wire = failure_pb(&record);
        assert_eq!(
            (wire.message.as_str(), wire.detail.as_deref()),
            ("storage failed: no space", None)
        );
        assert_eq!(
            FailureReason::try_from(&wire),
            Ok(FailureReason::Storage {
                nodes: vec!["n1".into()],
                why: "no space".into()
            }),
            "read as its coordinator meant it"
        );
        assert_eq!(
            serde_json::to_string(&record).unwrap(),
            old,
            "read and written back as it was"
        );
    }

    #[test]
    fn stored_failures_keep_their_json() {
        let json =
            |reason: FailureReason| serde_json::to_string(&FailureRecord::from(&reason)).unwrap();
        assert_eq!(
            json(FailureReason::Aborted("enough".into())),
            r#"{"kind":"ABORTED","message":"aborted: enough","nodes":[],"detail":"enough"}"#
        );
        assert_eq!(
            json(FailureReason::ChannelReset(ChannelId::new("a", "b"))),
            r#"{"kind":"CHANNEL_RESET","message":"channel a->b was reset","nodes":[],"channel":"a->b"}"#
        );
        assert_eq!(
            json(FailureReason::Timeout {
                missing: vec!["n2".into()]
            }),
            r#"{"kind":"TIMEOUT","message":"timed out waiting for n2","nodes":["n2"]}"#
        );
        assert_eq!(
            json(FailureReason::MixedEpochs {
                nodes: vec!["n1".into()],
                detail: "n1 is in epoch 5".into()
            }),
            r#"{"kind":"MIXED_EPOCHS","message":"parts recorded in different epochs: n1 is in epoch 5","nodes":["n1"],"detail":"n1 is in epoch 5"}"#
        );
    }
}

#[cfg(test)]
mod status_tests {
    use super::*;
    use crate::stored::records::RestoreStatus;

    #[test]
    fn every_snapshot_status_round_trips_through_the_wire_and_the_store() {
        for status in [
            SnapshotStatus::InProgress,
            SnapshotStatus::Completed,
            SnapshotStatus::Failed,
            SnapshotStatus::Aborted,
        ] {
            assert_eq!(status_from_pb(status_pb(status)), Some(status));
            let json = serde_json::to_string(&status).unwrap();
            assert_eq!(json, format!("\"{}\"", status.name()), "stored as before");
            assert_eq!(
                serde_json::from_str::<SnapshotStatus>(&json).unwrap(),
                status
            );
        }
        assert_eq!(status_from_pb(pb::SnapshotStatus::Unspecified), None);
        for (status, word) in [
            (RestoreStatus::InProgress, "IN_PROGRESS"),
            (RestoreStatus::Done, "DONE"),
            (RestoreStatus::Failed, "FAILED"),
        ] {
            let json = serde_json::to_string(&status).unwrap();
            assert_eq!(json, format!("\"{word}\""));
            assert_eq!(
                serde_json::from_str::<RestoreStatus>(&json).unwrap(),
                status
            );
        }
    }
}
