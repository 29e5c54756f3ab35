//! How `cairnctl` prints: the output format, aligned tables, a snapshot as a table row, and
//! JSON in the protobuf JSON mapping.

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

/// `message` in the protobuf JSON mapping, as grpcurl and the coordinator's HTTP API give it:
/// field names in lowerCamelCase, 64-bit integers as strings, enums by name, fields at their
/// default (0, "", false, empty) left out. The one dialect of `-o json`.
pub(crate) fn proto_json(message: &impl serde::Serialize) -> anyhow::Result<serde_json::Value> {
    Ok(serde_json::to_value(message)?)
}

/// Prints `value` as indented JSON.
pub(crate) fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    outln!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
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
        Output::Json => print_json(snapshot)?,
        Output::Table => table(&SNAPSHOT_HEADER, [snapshot_row(snapshot)]),
    }
    Ok(())
}

/// Writes to stdout (what [`out!`] and [`outln!`] expand to). A reader that closed the pipe
/// wants no more: the program ends at once, quietly, with 0. Any other failure to write
/// (a full disk behind a redirection) ends it with 74 (EX_IOERR), saying so: output cut
/// short must not look like success.
pub(crate) fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: cannot write the output: {e}");
        std::process::exit(74);
    }
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
        outln!("{}", padded.join("  ").trim_end());
    };
    line(header.iter().map(|h| (*h).to_owned()).collect());
    for row in rows {
        line(row);
    }
}
