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
            epoch: record.epoch,
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
        request_id: record.request_id.clone(),
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
        start_delay_ms: event.start_delay_ms,
        alignment_ms: event.alignment_ms,
        held_messages: event.held_messages,
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

/// A snapshot's progress for watchers, as of `now_ms` (milliseconds since the Unix epoch:
/// the elapsed time of a snapshot still running).
pub fn progress_pb(record: &SnapshotRecord, now_ms: u64) -> pb::SnapshotProgress {
    let running = record.status == SnapshotStatus::InProgress;
    let end = if running {
        now_ms
    } else {
        record.finished_at_ms
    };
    // One pass over the events and the lists (a watch redraws this every second): each
    // node's first STATE_RECORDED and PART_STORED.
    let mut events: std::collections::HashMap<(&str, EventKind), &EventRecord> =
        std::collections::HashMap::new();
    for e in &record.events {
        events.entry((e.node.as_str(), e.kind)).or_insert(e);
    }
    let recorded_set: std::collections::HashSet<&str> =
        record.recorded.iter().map(String::as_str).collect();
    let reported_set: std::collections::HashSet<&str> =
        record.reported.iter().map(String::as_str).collect();
    let node_progress: Vec<pb::NodeProgress> = record
        .nodes
        .iter()
        .map(|node| {
            let recorded = events
                .get(&(node.as_str(), EventKind::StateRecorded))
                .copied();
            let stored = events.get(&(node.as_str(), EventKind::PartStored)).copied();
            pb::NodeProgress {
                node_id: node.clone(),
                recorded: recorded_set.contains(node.as_str()),
                stored: reported_set.contains(node.as_str()),
                state_recorded_after_ms: recorded
                    .map(|e| e.at_ms.saturating_sub(record.started_at_ms)),
                part_stored_after_ms: stored.map(|e| e.at_ms.saturating_sub(record.started_at_ms)),
                local_state_bytes: stored.map_or(0, |e| e.local_state_bytes),
                recorded_messages: stored.map_or(0, |e| e.recorded_messages),
                bytes_stored: stored.map_or(0, |e| e.bytes_new.saturating_add(e.bytes_reused)),
                start_delay_ms: recorded.and_then(|e| e.start_delay_ms),
                alignment_ms: recorded.and_then(|e| e.alignment_ms),
                held_messages: recorded.and_then(|e| e.held_messages),
                // Uploads in progress are the service's to add: not in the record.
                bytes_uploading: 0,
            }
        })
        .collect();
    pb::SnapshotProgress {
        snapshot_id: record.id,
        status: status_pb(record.status) as i32,
        recorded: record.recorded.clone(),
        reported: record.reported.clone(),
        failure: record.failure.as_ref().map(failure_pb),
        verdict: record.verdict.as_ref().map(verdict_pb),
        started_at_ms: record.started_at_ms,
        elapsed_ms: end.saturating_sub(record.started_at_ms),
        nodes: record.nodes.clone(),
        waiting_for: if running {
            record
                .nodes
                .iter()
                .filter(|n| !reported_set.contains(n.as_str()))
                .cloned()
                .collect()
        } else {
            Vec::new()
        },
        bytes_stored: record.bytes_new.saturating_add(record.bytes_reused),
        recorded_messages: node_progress
            .iter()
            .fold(0u64, |sum, n| sum.saturating_add(n.recorded_messages)),
        node_progress,
        bytes_uploading: 0,
    }
}

/// The overview of `ListSnapshots` over every kept snapshot and `restores` restores.
pub fn overview_pb(records: &[SnapshotRecord], restores: usize) -> pb::SnapshotOverview {
    let count =
        |status: SnapshotStatus| records.iter().filter(|r| r.status == status).count() as u64;
    let completed: Vec<&SnapshotRecord> = records
        .iter()
        .filter(|r| r.status == SnapshotStatus::Completed)
        .collect();
    let summary = |values: Vec<u64>| -> Option<pb::MinAvgMax> {
        let n = values.len() as u128;
        let sum: u128 = values.iter().map(|&v| u128::from(v)).sum();
        Some(pb::MinAvgMax {
            min: *values.iter().min()?,
            avg: u64::try_from(sum / n).unwrap_or(u64::MAX),
            max: *values.iter().max()?,
        })
    };
    pb::SnapshotOverview {
        in_progress: count(SnapshotStatus::InProgress),
        completed: completed.len() as u64,
        failed: count(SnapshotStatus::Failed),
        aborted: count(SnapshotStatus::Aborted),
        restored: restores as u64,
        duration_ms: summary(
            completed
                .iter()
                .map(|r| r.finished_at_ms.saturating_sub(r.started_at_ms))
                .collect(),
        ),
        bytes: summary(
            completed
                .iter()
                .map(|r| r.bytes_new.saturating_add(r.bytes_reused))
                .collect(),
        ),
        newest_completed_id: completed.iter().map(|r| r.id).max().unwrap_or(0),
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
            FailureReason::BadCut {
                node: "b".into(),
                why: "the application cut its state after 5 messages consumed".into(),
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

    #[test]
    fn progress_says_how_long_how_far_and_whom_it_waits_for() {
        let event = |at_ms, kind, node: &str, bytes| EventRecord {
            node: node.into(),
            local_state_bytes: bytes,
            recorded_messages: 2,
            bytes_new: bytes,
            ..EventRecord::new(at_ms, kind)
        };
        let mut record = SnapshotRecord {
            id: 9,
            mode: "ALIGNED".into(),
            initiators: vec!["n1".into()],
            alignment_timeout_ms: 0,
            status: SnapshotStatus::InProgress,
            failure: None,
            verdict: None,
            started_at_ms: 1_000,
            finished_at_ms: 0,
            timeout_ms: 60_000,
            labels: Default::default(),
            nodes: vec!["n1".into(), "n2".into(), "n3".into()],
            channels: Vec::new(),
            recorded: vec!["n1".into(), "n2".into()],
            reported: vec!["n1".into()],
            bytes_new: 100,
            bytes_reused: 0,
            epoch: 0,
            term: 0,
            events: vec![
                EventRecord::new(1_000, EventKind::Started),
                EventRecord {
                    start_delay_ms: Some(15),
                    alignment_ms: Some(20),
                    held_messages: Some(3),
                    ..event(1_040, EventKind::StateRecorded, "n1", 0)
                },
                event(1_090, EventKind::StateRecorded, "n2", 0),
                event(1_200, EventKind::PartStored, "n1", 100),
            ],
            request_id: String::new(),
        };
        let p = progress_pb(&record, 4_500);
        assert_eq!(p.elapsed_ms, 3_500);
        assert_eq!(p.started_at_ms, 1_000);
        assert_eq!(p.waiting_for, ["n2", "n3"]);
        assert_eq!((p.bytes_stored, p.recorded_messages), (100, 2));
        let [n1, n2, n3] = &p.node_progress[..] else {
            panic!("{p:?}")
        };
        assert_eq!(
            (
                n1.recorded,
                n1.stored,
                n1.state_recorded_after_ms,
                n1.part_stored_after_ms
            ),
            (true, true, Some(40), Some(200))
        );
        assert_eq!((n1.local_state_bytes, n1.bytes_stored), (100, 100));
        assert_eq!(
            (n1.start_delay_ms, n1.alignment_ms, n1.held_messages),
            (Some(15), Some(20), Some(3))
        );
        assert_eq!((n2.start_delay_ms, n2.alignment_ms), (None, None));
        assert_eq!(
            (
                n2.recorded,
                n2.stored,
                n2.state_recorded_after_ms,
                n2.part_stored_after_ms
            ),
            (true, false, Some(90), None)
        );
        assert_eq!((n3.recorded, n3.state_recorded_after_ms), (false, None));
        // Ended: its duration, whatever the clock says now; nothing awaited.
        record.status = SnapshotStatus::Failed;
        record.finished_at_ms = 3_000;
        let p = progress_pb(&record, 9_999);
        assert_eq!(p.elapsed_ms, 2_000);
        assert!(p.waiting_for.is_empty());
        // A clock that went back never makes a negative time.
        record.status = SnapshotStatus::InProgress;
        assert_eq!(progress_pb(&record, 10).elapsed_ms, 0);
    }

    #[test]
    fn the_overview_counts_every_status_and_sums_up_the_completed() {
        let record = |id, status, started_at_ms, finished_at_ms, bytes_new| SnapshotRecord {
            id,
            mode: "UNALIGNED".into(),
            initiators: Vec::new(),
            alignment_timeout_ms: 0,
            status,
            failure: None,
            verdict: None,
            started_at_ms,
            finished_at_ms,
            timeout_ms: 0,
            labels: Default::default(),
            nodes: Vec::new(),
            channels: Vec::new(),
            recorded: Vec::new(),
            reported: Vec::new(),
            bytes_new,
            bytes_reused: 1,
            epoch: 0,
            term: 0,
            events: Vec::new(),
            request_id: String::new(),
        };
        let empty = overview_pb(&[], 0);
        assert_eq!(
            (empty.duration_ms, empty.bytes, empty.newest_completed_id),
            (None, None, 0)
        );
        let records = [
            record(1, SnapshotStatus::Completed, 100, 110, 9),
            record(2, SnapshotStatus::Failed, 200, 900, 0),
            record(3, SnapshotStatus::Completed, 300, 340, 99),
            record(4, SnapshotStatus::Completed, 400, 401, u64::MAX),
            record(5, SnapshotStatus::Aborted, 500, 501, 0),
            record(6, SnapshotStatus::InProgress, 600, 0, 0),
        ];
        let o = overview_pb(&records, 2);
        assert_eq!(
            (o.in_progress, o.completed, o.failed, o.aborted, o.restored),
            (1, 3, 1, 1, 2)
        );
        assert_eq!(
            o.duration_ms,
            Some(pb::MinAvgMax {
                min: 1,
                avg: 17,
                max: 40
            })
        );
        // Sizes that overflow a u64 when summed still average (saturating per record).
        let bytes = o.bytes.unwrap();
        assert_eq!((bytes.min, bytes.max), (10, u64::MAX));
        assert_eq!(o.newest_completed_id, 4);
        // The wire names the epoch each was taken in (readers tell histories apart by it).
        let taken_after_a_restore = SnapshotRecord {
            epoch: 3,
            ..record(7, SnapshotStatus::Completed, 700, 701, 0)
        };
        let plan = snapshot_pb(&taken_after_a_restore).plan.unwrap();
        assert_eq!((plan.snapshot_id, plan.epoch), (7, 3));
    }
}
