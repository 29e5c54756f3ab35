//! How `cairnctl` prints: the output format, aligned tables, and a snapshot as a table row
//! or as JSON.

use cairn_proto::v1 as pb;
use clap::ValueEnum;

/// The output format (`--output`).
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
pub(crate) enum Output {
    Table,
    Json,
}

pub(crate) fn status_word(status: i32) -> &'static str {
    match pb::SnapshotStatus::try_from(status).unwrap_or(pb::SnapshotStatus::Unspecified) {
        pb::SnapshotStatus::InProgress => "IN_PROGRESS",
        pb::SnapshotStatus::Completed => "COMPLETED",
        pb::SnapshotStatus::Failed => "FAILED",
        pb::SnapshotStatus::Aborted => "ABORTED",
        pb::SnapshotStatus::Unspecified => "?",
    }
}

pub(crate) fn mode_word(snapshot: &pb::Snapshot) -> &'static str {
    let mode = snapshot.plan.as_ref().map_or(0, |p| p.mode);
    match pb::SnapshotMode::try_from(mode).unwrap_or(pb::SnapshotMode::Unspecified) {
        pb::SnapshotMode::Unaligned => "UNALIGNED",
        pb::SnapshotMode::Aligned => "ALIGNED",
        _ => "CHANDY_LAMPORT",
    }
}

pub(crate) fn snapshot_json(s: &pb::Snapshot) -> serde_json::Value {
    serde_json::json!({
        "id": s.plan.as_ref().map_or(0, |p| p.snapshot_id),
        "mode": mode_word(s),
        "initiators": s.plan.as_ref().map(|p| p.initiators.clone()).unwrap_or_default(),
        "epoch": s.plan.as_ref().map_or(0, |p| p.epoch),
        "status": status_word(s.status),
        "failure": s.failure.as_ref().map(|f| f.message.clone()),
        "verdict": s.verdict.as_ref().map(|v| serde_json::json!({"consistent": v.consistent, "violation": v.violation, "recorded_messages": v.recorded_messages})),
        "started_at_ms": s.started_at_ms,
        "finished_at_ms": s.finished_at_ms,
        "duration_ms": s.finished_at_ms.saturating_sub(s.started_at_ms),
        "nodes": s.nodes.iter().map(|n| serde_json::json!({
            "node_id": n.node_id, "recorded": n.recorded, "reported": n.reported,
            "local_state_bytes": n.local_state_bytes,
            "recorded_messages": n.channel_states.iter().map(|c| c.messages.len()).sum::<usize>(),
        })).collect::<Vec<_>>(),
        "bytes_new": s.bytes_new,
        "bytes_reused": s.bytes_reused,
        "labels": s.labels,
        "events": s.events.iter().map(|e| serde_json::json!({
            "at_ms": e.at_ms,
            "kind": event_word(e.kind),
            "node_id": e.node_id,
            "local_state_bytes": e.local_state_bytes,
            "recorded_messages": e.recorded_messages,
            "bytes_new": e.bytes_new,
            "bytes_reused": e.bytes_reused,
            "detail": e.detail,
            "start_delay_ms": e.start_delay_ms,
            "alignment_ms": e.alignment_ms,
            "held_messages": e.held_messages,
        })).collect::<Vec<_>>(),
    })
}

/// An event's kind as its stable word: `STARTED`, `STATE_RECORDED`, `PART_STORED`, …
pub(crate) fn event_word(kind: i32) -> &'static str {
    let kind = pb::snapshot_event::Kind::try_from(kind).unwrap_or_default();
    let name = kind.as_str_name();
    name.strip_prefix("KIND_").unwrap_or(name)
}

/// The columns of `snapshot get --events`.
pub(crate) const EVENT_HEADER: [&str; 4] = ["SINCE START", "EVENT", "NODE", "DETAIL"];

/// A snapshot's timeline, one row per event.
pub(crate) fn event_rows(s: &pb::Snapshot) -> Vec<Vec<String>> {
    s.events
        .iter()
        .map(|e| {
            let detail = match pb::snapshot_event::Kind::try_from(e.kind).unwrap_or_default() {
                pb::snapshot_event::Kind::PartStored => format!(
                    "state {} B, {} messages recorded, {} B new, {} B reused",
                    e.local_state_bytes, e.recorded_messages, e.bytes_new, e.bytes_reused
                ),
                pb::snapshot_event::Kind::StateRecorded => {
                    let mut said = Vec::new();
                    if let Some(ms) = e.start_delay_ms {
                        said.push(format!("marker's start delay {ms} ms"));
                    }
                    if let Some(ms) = e.alignment_ms {
                        said.push(format!("aligned {ms} ms"));
                    }
                    if let Some(n) = e.held_messages {
                        said.push(format!("{n} messages held"));
                    }
                    said.join(", ")
                }
                pb::snapshot_event::Kind::Verified if e.detail.is_empty() => format!(
                    "consistent, {} messages recorded in flight",
                    e.recorded_messages
                ),
                _ => e.detail.clone(),
            };
            vec![
                format!("+{} ms", e.at_ms.saturating_sub(s.started_at_ms)),
                event_word(e.kind).to_owned(),
                if e.node_id.is_empty() {
                    "-".into()
                } else {
                    e.node_id.clone()
                },
                detail,
            ]
        })
        .collect()
}

pub(crate) fn snapshot_row(s: &pb::Snapshot) -> Vec<String> {
    let done = s.finished_at_ms > 0;
    vec![
        s.plan.as_ref().map_or(0, |p| p.snapshot_id).to_string(),
        mode_word(s).to_owned(),
        status_word(s.status).to_owned(),
        if done {
            format!("{} ms", s.finished_at_ms.saturating_sub(s.started_at_ms))
        } else {
            "-".into()
        },
        s.nodes.len().to_string(),
        s.verdict
            .as_ref()
            .map_or("-".into(), |v| v.recorded_messages.to_string()),
        s.failure
            .as_ref()
            .map(|f| f.message.clone())
            .or_else(|| {
                s.verdict.as_ref().map(|v| {
                    if v.consistent {
                        "consistent".into()
                    } else {
                        v.violation.clone()
                    }
                })
            })
            .unwrap_or_default(),
    ]
}

pub(crate) const SNAPSHOT_HEADER: [&str; 7] = [
    "ID",
    "MODE",
    "STATUS",
    "DURATION",
    "NODES",
    "IN-FLIGHT",
    "VERDICT",
];

pub(crate) fn print_snapshot(snapshot: &pb::Snapshot, output: Output) -> anyhow::Result<()> {
    match output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&snapshot_json(snapshot))?
        ),
        Output::Table => table(&SNAPSHOT_HEADER, [snapshot_row(snapshot)]),
    }
    Ok(())
}

pub(crate) fn table(header: &[&str], rows: impl IntoIterator<Item = Vec<String>>) {
    let rows: Vec<Vec<String>> = rows.into_iter().collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.iter().map(|h| (*h).to_owned()).collect());
    for row in rows {
        line(row);
    }
}
