//! `cairnctl snapshot`: start, inspect, list, watch, abort, verify, delete and restore
//! snapshots.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use cairn_proto::v1 as pb;
use cairn_sdk::CoordinatorClient;
use clap::{Subcommand, ValueEnum};

use crate::output::{
    EVENT_HEADER, Output, SNAPSHOT_HEADER, event_rows, print_json, print_snapshot, proto_json,
    snapshot_row, table,
};
use crate::restore;

mod export;
mod progress;

use export::export;
use progress::{progress_line, start_when_connected};

#[derive(Debug, Subcommand)]
pub(crate) enum SnapshotCommand {
    /// Start a snapshot and print its id.
    Start {
        /// The mode.
        #[arg(long, env = "CAIRN_MODE", value_enum, default_value_t = Mode::ChandyLamport)]
        mode: Mode,
        /// An initiator (repeatable); default: every member for UNALIGNED (as Flink triggers
        /// every source), one member the coordinator chooses for the other modes.
        #[arg(long, env = "CAIRN_INITIATORS", value_delimiter = ',')]
        initiator: Vec<String>,
        /// Timeout (e.g. 30s); default: the coordinator's.
        #[arg(long, env = "CAIRN_SNAPSHOT_TIMEOUT", value_parser = humantime::parse_duration)]
        timeout: Option<Duration>,
        /// Aligned mode: switch to unaligned after this long aligning (e.g. 100ms).
        #[arg(long, env = "CAIRN_ALIGNMENT_TIMEOUT", value_parser = humantime::parse_duration)]
        alignment_timeout: Option<Duration>,
        /// A label KEY=VALUE (repeatable).
        #[arg(long, env = "CAIRN_LABELS", value_delimiter = ',')]
        label: Vec<String>,
        /// Wait until it ends and print it.
        #[arg(long, env = "CAIRN_WAIT")]
        wait: bool,
        /// With --wait: a start refused because members are not connected to the
        /// coordinator (just after a leader change or a restart, while the daemons
        /// register again) is tried again, with the same request id, until they are or
        /// this long has passed (0s: not at all).
        #[arg(long, env = "CAIRN_WAIT_MEMBERS", value_parser = humantime::parse_duration, default_value = "30s")]
        wait_members: Duration,
        /// Makes the start idempotent: a start with the request id of a snapshot the
        /// coordinator knows prints that snapshot's id and starts nothing (e.g. a CI job's
        /// id, so that a re-run of the job does not snapshot twice). Default: a fresh
        /// random one, reused when cairnctl retries after a leader change. 1-128 ASCII
        /// letters, digits and `-_.:`.
        #[arg(long, env = "CAIRN_REQUEST_ID")]
        request_id: Option<String>,
    },
    /// Show one snapshot.
    Get {
        /// Its id.
        id: u64,
        /// Include each node's state and the recorded messages.
        #[arg(long, env = "CAIRN_DATA")]
        data: bool,
        /// Print its timeline too: started, each node's state recorded and part stored
        /// (with sizes), failures, the verdict, the end, with times since the start.
        #[arg(long)]
        events: bool,
    },
    /// Write a completed snapshot's data to files, streamed (states of any size): per node,
    /// DIR/NODE/state (the local state's bytes) and DIR/NODE/channels.pb (its recorded
    /// messages as length-delimited cairn.v1.ChannelState messages). Every chunk is checked
    /// against its SHA-256 as it is read; a node's files appear only once all of its data
    /// arrived and checked (they are written aside and renamed). Refuses a DIR/NODE that
    /// exists.
    Export {
        /// The snapshot.
        id: u64,
        /// The directory to write into (created if missing).
        dir: std::path::PathBuf,
        /// Only this node's part.
        #[arg(long)]
        node: Option<String>,
    },
    /// List snapshots, newest first.
    List {
        /// Only this status.
        #[arg(long, env = "CAIRN_STATUS", value_enum)]
        status: Option<Status>,
        /// Only this mode.
        #[arg(long, value_enum)]
        mode: Option<Mode>,
        /// At most this many.
        #[arg(long, env = "CAIRN_LIMIT", default_value_t = 50)]
        limit: u32,
    },
    /// Compare two snapshots node by node: whether each node's local state changed, by how
    /// many chunks and bytes (chunks are content-addressed: a chunk of TO that FROM does not
    /// hold is new), and the messages each recorded in flight, per channel.
    Diff {
        /// The first snapshot (usually the earlier).
        from: u64,
        /// The second.
        to: u64,
    },
    /// Follow a snapshot's progress until it ends.
    Watch {
        /// Its id.
        id: u64,
    },
    /// Abort a snapshot in progress.
    Abort {
        /// Its id.
        id: u64,
        /// Why.
        #[arg(long, env = "CAIRN_REASON", default_value = "aborted with cairnctl")]
        reason: String,
    },
    /// Delete a finished snapshot and the chunks only it used.
    Delete {
        /// Its id.
        id: u64,
    },
    /// Read every chunk of a COMPLETED snapshot and check it against its SHA-256 name.
    /// Exit 0 if all match; exit 1 naming the first missing or corrupt chunk and its node.
    Verify {
        /// Its id.
        id: u64,
    },
    /// Roll the whole cluster back to a COMPLETED snapshot: every node's application gets
    /// its recorded state, and the recorded in-flight messages are delivered again ahead
    /// of any new traffic. Waits until every node applied its state (exit 0) or the
    /// restore failed (exit 1).
    Restore {
        /// The snapshot.
        id: u64,
        /// Print the operation and return at once.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait.
        #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Refuse unless the cluster is still in this epoch (the EPOCH of the newest
        /// `cairnctl restore list` row; 0 before any restore): a restore chosen from what
        /// you read does not go through if another restore ran meanwhile.
        #[arg(long, value_name = "EPOCH")]
        if_epoch: Option<u64>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Mode {
    ChandyLamport,
    Unaligned,
    Aligned,
}

impl Mode {
    pub(crate) fn pb(self) -> pb::SnapshotMode {
        match self {
            Self::ChandyLamport => pb::SnapshotMode::ChandyLamport,
            Self::Unaligned => pb::SnapshotMode::Unaligned,
            Self::Aligned => pb::SnapshotMode::Aligned,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Status {
    InProgress,
    Completed,
    Failed,
    Aborted,
}

pub(crate) async fn snapshot(
    coordinator: &str,
    output: Output,
    command: SnapshotCommand,
) -> anyhow::Result<ExitCode> {
    let mut client = crate::connect(coordinator).await?;
    match command {
        SnapshotCommand::Start {
            mode,
            initiator,
            timeout,
            alignment_timeout,
            label,
            wait,
            wait_members,
            request_id,
        } => {
            let labels = label
                .iter()
                .map(|l| {
                    l.split_once('=')
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .ok_or_else(|| anyhow::anyhow!("label `{l}` is not KEY=VALUE"))
                })
                .collect::<anyhow::Result<_>>()?;
            let request = pb::StartSnapshotRequest {
                mode: mode.pb() as i32,
                initiators: initiator,
                timeout_ms: timeout.map_or(0, |d| d.as_millis() as u64),
                alignment_timeout_ms: alignment_timeout.map_or(0, |d| d.as_millis() as u64),
                labels,
                request_id: request_id.unwrap_or_else(cairn_sdk::coordinator::new_request_id),
            };
            let patience = if wait { wait_members } else { Duration::ZERO };
            let id = start_when_connected(&mut client, request, patience).await?;
            if !wait {
                match output {
                    Output::Json => print_json(&pb::StartSnapshotResponse { snapshot_id: id })?,
                    Output::Table => outln!("{id}"),
                }
                return Ok(ExitCode::SUCCESS);
            }
            let snapshot = wait_for(&mut client, id, false).await?;
            print_snapshot(&snapshot, output)?;
            Ok(if snapshot.status == pb::SnapshotStatus::Completed as i32 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        SnapshotCommand::Get { id, data, events } => {
            let snapshot = client.get_snapshot(id, data).await?;
            print_snapshot(&snapshot, output)?;
            if events && output == Output::Table {
                outln!();
                table(&EVENT_HEADER, event_rows(&snapshot));
            }
            if data && output == Output::Table {
                for node in &snapshot.nodes {
                    outln!(
                        "\n{}: local state {}",
                        node.node_id,
                        String::from_utf8_lossy(&node.local_state)
                    );
                    for state in &node.channel_states {
                        let channel = state
                            .channel
                            .as_ref()
                            .map(|c| format!("{}->{}", c.from, c.to))
                            .unwrap_or_default();
                        outln!("  {channel}: {} recorded messages", state.messages.len());
                    }
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        SnapshotCommand::Export { id, dir, node } => {
            let exported = export(&mut client, id, &dir, node.as_deref()).await?;
            match output {
                Output::Json => {
                    // Each node's end of its data (`NodeDataEnd`), with its id.
                    let mut nodes = Vec::new();
                    for (node, end) in &exported {
                        let mut end = proto_json(end)?;
                        end["nodeId"] = node.clone().into();
                        nodes.push(end);
                    }
                    print_json(&serde_json::json!({
                        "snapshotId": id.to_string(),
                        "dir": dir.display().to_string(),
                        "nodes": nodes,
                    }))?;
                }
                Output::Table => {
                    for (node, end) in &exported {
                        outln!(
                            "{node}: {} bytes of state, {} recorded messages -> {}",
                            end.local_state_bytes,
                            end.recorded_messages,
                            dir.join(node).display()
                        );
                    }
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        SnapshotCommand::List {
            status,
            mode,
            limit,
        } => {
            let status = match status {
                None => pb::SnapshotStatus::Unspecified,
                Some(Status::InProgress) => pb::SnapshotStatus::InProgress,
                Some(Status::Completed) => pb::SnapshotStatus::Completed,
                Some(Status::Failed) => pb::SnapshotStatus::Failed,
                Some(Status::Aborted) => pb::SnapshotStatus::Aborted,
            };
            let list = client
                .raw()
                .list_snapshots(pb::ListSnapshotsRequest {
                    status: status as i32,
                    page_size: limit,
                    page_token: String::new(),
                    mode: mode.map_or(pb::SnapshotMode::Unspecified, Mode::pb) as i32,
                })
                .await?
                .into_inner();
            match output {
                Output::Json => print_json(&list)?,
                Output::Table => table(&SNAPSHOT_HEADER, list.snapshots.iter().map(snapshot_row)),
            }
            Ok(ExitCode::SUCCESS)
        }
        SnapshotCommand::Watch { id } => {
            let mut stream = client
                .raw()
                .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: id })
                .await?
                .into_inner();
            // On a terminal the line is redrawn in place (the coordinator sends the progress
            // at least once a second while it runs); otherwise a line per message.
            let redraw = matches!(output, Output::Table) && std::io::stdout().is_terminal();
            let mut last = pb::SnapshotStatus::Unspecified as i32;
            while let Some(progress) = stream.message().await? {
                last = progress.status;
                let running = progress.status == pb::SnapshotStatus::InProgress as i32;
                match output {
                    Output::Json => outln!("{}", serde_json::to_string(&progress)?),
                    Output::Table if redraw && running => {
                        out!("\r\x1b[2K{}", progress_line(&progress));
                        std::io::stdout().flush()?;
                    }
                    Output::Table if redraw => outln!("\r\x1b[2K{}", progress_line(&progress)),
                    Output::Table => outln!("{}", progress_line(&progress)),
                }
            }
            if redraw && last == pb::SnapshotStatus::InProgress as i32 {
                outln!();
            }
            Ok(if last == pb::SnapshotStatus::Completed as i32 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        SnapshotCommand::Abort { id, reason } => {
            let snapshot = client
                .raw()
                .abort_snapshot(pb::AbortSnapshotRequest {
                    snapshot_id: id,
                    reason,
                })
                .await?
                .into_inner();
            print_snapshot(&snapshot, output)?;
            Ok(ExitCode::SUCCESS)
        }
        SnapshotCommand::Restore {
            id,
            no_wait,
            timeout,
            if_epoch,
        } => {
            let request = pb::RestoreSnapshotRequest {
                snapshot_id: id,
                if_epoch,
            };
            restore::restore_snapshot(&mut client, output, request, !no_wait, timeout).await
        }
        SnapshotCommand::Diff { from, to } => {
            let diff = client
                .raw()
                .diff_snapshots(pb::DiffSnapshotsRequest {
                    from_snapshot_id: from,
                    to_snapshot_id: to,
                })
                .await?
                .into_inner();
            match output {
                Output::Json => print_json(&diff)?,
                Output::Table => table(&DIFF_HEADER, diff.nodes.iter().map(diff_row)),
            }
            Ok(ExitCode::SUCCESS)
        }
        SnapshotCommand::Verify { id } => {
            let response = client
                .raw()
                .verify_snapshot(pb::VerifySnapshotRequest { snapshot_id: id })
                .await?
                .into_inner();
            match output {
                Output::Json => print_json(&response)?,
                Output::Table => outln!(
                    "snapshot {id} verifies: {} chunks, {} bytes, each matching its SHA-256",
                    response.chunks,
                    response.bytes
                ),
            }
            Ok(ExitCode::SUCCESS)
        }
        SnapshotCommand::Delete { id } => {
            let response = client
                .raw()
                .delete_snapshot(pb::DeleteSnapshotRequest { snapshot_id: id })
                .await?
                .into_inner();
            match output {
                Output::Json => print_json(&response)?,
                Output::Table => outln!(
                    "deleted snapshot {id}; {} bytes of chunks freed",
                    response.bytes_freed
                ),
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Follows a snapshot until it ends, then reads it (with its data if asked).
pub(crate) async fn wait_for(
    client: &mut CoordinatorClient,
    id: u64,
    data: bool,
) -> anyhow::Result<pb::Snapshot> {
    let mut stream = client
        .raw()
        .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: id })
        .await?
        .into_inner();
    while let Some(progress) = stream.message().await? {
        if progress.status != pb::SnapshotStatus::InProgress as i32 {
            break;
        }
    }
    Ok(client.get_snapshot(id, data).await?)
}

/// The columns of `snapshot diff`.
const DIFF_HEADER: [&str; 7] = [
    "NODE",
    "STATE",
    "SIZE FROM",
    "SIZE TO",
    "CHUNKS NEW/TOTAL (BYTES NEW)",
    "IN FLIGHT FROM",
    "IN FLIGHT TO",
];

/// One node of `snapshot diff`.
fn diff_row(n: &pb::NodeDiff) -> Vec<String> {
    let in_flight = |recorded: &[pb::RecordedChannel]| {
        let shown: Vec<String> = recorded
            .iter()
            .filter(|r| r.messages > 0)
            .map(|r| {
                let c = r.channel.clone().unwrap_or_default();
                format!("{}->{} {} ({} B)", c.from, c.to, r.messages, r.bytes)
            })
            .collect();
        if shown.is_empty() {
            "-".to_owned()
        } else {
            shown.join(", ")
        }
    };
    let state = match (n.in_from, n.in_to) {
        (false, _) => "only in TO",
        (_, false) => "only in FROM",
        _ if n.state_changed => "changed",
        _ => "same",
    };
    vec![
        n.node_id.clone(),
        state.to_owned(),
        format!("{} B", n.state_bytes_from),
        format!("{} B", n.state_bytes_to),
        format!("{}/{} ({} B)", n.chunks_new, n.chunks_to, n.bytes_new),
        in_flight(&n.recorded_from),
        in_flight(&n.recorded_to),
    ]
}
