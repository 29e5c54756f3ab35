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
    })
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
