//! `snapshot start --wait` waiting for the members to connect, and `snapshot watch`'s
//! line and JSON.

use std::time::Duration;

use cairn_proto::v1 as pb;
use cairn_sdk::CoordinatorClient;

use crate::output::status_word;

/// What the coordinator says when a member has no session with it (a start refused with
/// FAILED_PRECONDITION): after a leader change or a restart, until the daemons register.
const NOT_CONNECTED: &str = "not connected to the coordinator";

/// Starts `request`; while the coordinator refuses because members are not connected,
/// tries again every half second for up to `patience`, saying so once on stderr.
pub(super) async fn start_when_connected(
    client: &mut CoordinatorClient,
    request: pb::StartSnapshotRequest,
    patience: Duration,
) -> anyhow::Result<u64> {
    let deadline = tokio::time::Instant::now() + patience;
    let mut told = false;
    loop {
        let status = match client.start_snapshot(request.clone()).await {
            Ok(id) => return Ok(id),
            Err(cairn_sdk::Error::Rpc(status))
                if status.code() == tonic::Code::FailedPrecondition
                    && status.message().contains(NOT_CONNECTED) =>
            {
                status
            }
            Err(e) => return Err(e.into()),
        };
        if tokio::time::Instant::now() >= deadline {
            if patience.is_zero() {
                return Err(cairn_sdk::Error::Rpc(status).into());
            }
            anyhow::bail!(
                "the members did not all connect to the coordinator within {} \
                 (--wait-members): {}",
                humantime::format_duration(patience),
                status.message()
            );
        }
        if !told {
            eprintln!(
                "waiting up to {} for the members to connect to the coordinator ({}); a \
                 new leader hears from every daemon again within seconds",
                humantime::format_duration(patience),
                status.message()
            );
            told = true;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// One line of `snapshot watch`: elapsed, status, how many recorded and stored of how many,
/// whom it waits for, what is stored so far; the failure, if any.
pub(super) fn progress_line(p: &pb::SnapshotProgress) -> String {
    let total = p.nodes.len();
    let mut line = format!(
        "{:>7.1}s  {:<11}  recorded {}/{total}  stored {}/{total}",
        p.elapsed_ms as f64 / 1000.0,
        status_word(p.status),
        p.recorded.len(),
        p.reported.len(),
    );
    // A few names, so the line fits a terminal (and redraws in place) at any size.
    const NAMED: usize = 5;
    if !p.waiting_for.is_empty() {
        let named: Vec<&str> = p
            .waiting_for
            .iter()
            .take(NAMED)
            .map(String::as_str)
            .collect();
        line.push_str(&format!("  waiting for {}", named.join(" ")));
        if p.waiting_for.len() > NAMED {
            line.push_str(&format!(" +{} more", p.waiting_for.len() - NAMED));
        }
    }
    line.push_str(&format!("  {} B stored", p.bytes_stored));
    if p.bytes_uploading > 0 {
        line.push_str(&format!(", {} B uploading", p.bytes_uploading));
    }
    line.push_str(&format!(", {} messages in flight", p.recorded_messages));
    if let Some(failure) = &p.failure {
        line.push_str(&format!("  {}", failure.message));
    }
    // Nothing the server says may steer the terminal.
    line.replace(|c: char| c.is_control(), " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_line_says_how_far_and_whom_it_waits_for() {
        let progress = pb::SnapshotProgress {
            snapshot_id: 7,
            status: pb::SnapshotStatus::InProgress as i32,
            elapsed_ms: 3_300,
            nodes: vec!["n1".into(), "n2".into(), "n3".into()],
            recorded: vec!["n1".into(), "n2".into()],
            reported: vec!["n1".into()],
            waiting_for: vec!["n2".into(), "n3".into()],
            bytes_stored: 2048,
            recorded_messages: 5,
            ..Default::default()
        };
        assert_eq!(
            progress_line(&progress),
            "    3.3s  IN_PROGRESS  recorded 2/3  stored 1/3  waiting for n2 n3  2048 B stored, \
             5 messages in flight"
        );
        let many = pb::SnapshotProgress {
            waiting_for: (1..=8).map(|i| format!("n{i}")).collect(),
            failure: Some(pb::FailureReason {
                message: "bad\x1b[2Jnews".into(),
                ..Default::default()
            }),
            ..progress.clone()
        };
        let line = progress_line(&many);
        assert!(
            line.contains("waiting for n1 n2 n3 n4 n5 +3 more"),
            "{line}"
        );
        assert!(
            line.contains("bad [2Jnews") && !line.contains('\x1b'),
            "{line}"
        );
        // `-o json`: the protobuf JSON mapping, as grpcurl prints it.
        let json = crate::output::proto_json(&progress).unwrap();
        assert_eq!(json["snapshotId"], "7");
        assert_eq!(json["elapsedMs"], "3300");
        assert_eq!(json["status"], "SNAPSHOT_STATUS_IN_PROGRESS");
        assert_eq!(json["waitingFor"], serde_json::json!(["n2", "n3"]));
        assert!(json.get("bytesUploading").is_none(), "{json}");
    }
}
