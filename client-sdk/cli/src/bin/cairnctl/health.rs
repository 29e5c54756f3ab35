//! `cairnctl nodes`, `cairnctl status` and `cairnctl health`: who is in the cluster, the
//! cluster at a glance, and whether a server answers SERVING.

use std::process::ExitCode;
use std::time::Duration;

use cairn_rpc::v1 as pb;

use crate::output::{Output, mode_word, print_json, proto_json, table};
use crate::policy::{age, freshness, human, policy_mode};

/// `cairnctl nodes`: the registered node daemons.
pub(crate) async fn nodes(coordinator: &str, output: Output) -> anyhow::Result<ExitCode> {
    let mut client = crate::connect(coordinator).await?;
    let nodes = client
        .raw()
        .list_nodes(pb::ListNodesRequest {})
        .await?
        .into_inner();
    print_nodes(&nodes, output)
}

/// `cairnctl nodes remove ID`: the nodes left.
pub(crate) async fn remove_node(
    coordinator: &str,
    node_id: String,
    output: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = crate::connect(coordinator).await?;
    let nodes = client
        .raw()
        .remove_node(pb::RemoveNodeRequest {
            node_id: node_id.clone(),
        })
        .await?
        .into_inner();
    if output == Output::Table {
        outln!("node {node_id} removed; the nodes now:");
    }
    print_nodes(&nodes, output)
}

/// `cairnctl nodes status ADDRESS`: one daemon's status, from its NodeAdmin.
pub(crate) async fn node_status(address: &str, output: Output) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    let bearer = cairn_sdk::coordinator::BearerToken::new(crate::token())?;
    let channel = cairn_sdk::tls::endpoint(address, crate::tls())?
        .connect()
        .await
        .with_context(|| format!("cannot reach the daemon at {address}"))?;
    let status = pb::node_admin_client::NodeAdminClient::with_interceptor(channel, bearer)
        .get_node_status(pb::GetNodeStatusRequest {})
        .await
        .with_context(|| format!("GetNodeStatus at {address}"))?
        .into_inner();
    let kind = |k: i32| match pb::FrameKind::try_from(k).unwrap_or(pb::FrameKind::None) {
        pb::FrameKind::None => "",
        pb::FrameKind::Data => "data",
        pb::FrameKind::Marker => "marker",
    };
    let channels = || {
        status.channels.iter().map(|c| {
            let r = c.channel.clone().unwrap_or_default();
            let incoming = r.to == status.node_id;
            (r, incoming, c)
        })
    };
    if output == Output::Json {
        print_json(&status)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "node {} of cluster {} (incarnation {}, epoch {})",
        status.node_id,
        status.cluster,
        status.incarnation,
        status.epoch
    );
    let in_flight: Vec<String> = status
        .snapshots_in_flight
        .iter()
        .map(u64::to_string)
        .collect();
    outln!(
        "inbox {}; snapshots in flight: {}",
        status.inbox_depth,
        if in_flight.is_empty() {
            "none".into()
        } else {
            in_flight.join(", ")
        }
    );
    match &status.delivery_window {
        None => outln!("application: none attached"),
        Some(w) if !w.acknowledges => outln!(
            "application: attached, no delivery window (handed {}, record requests unanswered {})",
            w.handed,
            w.records_pending
        ),
        Some(w) => outln!(
            "application: window {} messages / {} bytes; handed {}, consumed {} ({} out); record requests unanswered {}",
            w.size_messages,
            w.size_bytes,
            w.handed,
            w.consumed,
            w.handed.saturating_sub(w.consumed),
            w.records_pending
        ),
    }
    let limit = |l: u64| {
        if l == u64::MAX {
            "none".to_owned()
        } else {
            l.to_string()
        }
    };
    table(
        &[
            "CHANNEL",
            "DIR",
            "CONNECTED",
            "DATA",
            "MARKERS",
            "QUEUED",
            "HELD",
            "NEXT HELD",
            "RELEASE",
            "CREDIT LIMIT",
            "NEXT INDEX",
            "UNACKED",
            "RECONNECTS",
        ],
        channels().map(|(r, incoming, c)| {
            let held = match (c.alignment_blocked, c.fault_held) {
                (true, true) => "alignment+fault",
                (true, false) => "alignment",
                (false, true) => "fault",
                (false, false) => "",
            };
            vec![
                format!("{}->{}", r.from, r.to),
                if incoming { "in" } else { "out" }.into(),
                if c.connected { "yes" } else { "no" }.into(),
                c.data_messages.to_string(),
                c.markers.to_string(),
                c.queued.to_string(),
                held.into(),
                kind(c.next_held).into(),
                if c.fault_held {
                    c.release_budget.to_string()
                } else {
                    String::new()
                },
                limit(c.credit_limit),
                c.next_index.to_string(),
                if incoming {
                    String::new()
                } else {
                    c.unacked_frames.to_string()
                },
                if incoming {
                    String::new()
                } else {
                    c.reconnects.to_string()
                },
            ]
        }),
    );
    Ok(ExitCode::SUCCESS)
}

fn print_nodes(nodes: &pb::ListNodesResponse, output: Output) -> anyhow::Result<ExitCode> {
    if output == Output::Json {
        print_json(nodes)?;
    } else {
        table(
            &["NODE", "ADDRESS", "CONNECTED", "INCARNATION", "APPLICATION"],
            nodes.nodes.iter().map(|n| {
                vec![
                    n.node_id.clone(),
                    n.address.clone(),
                    if n.connected { "yes" } else { "no" }.into(),
                    n.incarnation.to_string(),
                    if n.application_attached {
                        "attached".into()
                    } else {
                        "none".into()
                    },
                ]
            }),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `cairnctl health`: SERVING → 0; anything else, or no answer, → 1 with the reason.
pub(crate) async fn health(
    address: &str,
    service: &str,
    timeout: Duration,
) -> anyhow::Result<ExitCode> {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let ask = async {
        let channel = cairn_sdk::tls::endpoint(address, crate::tls())?
            .connect()
            .await?;
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await?
            .into_inner();
        anyhow::Ok(answer.status())
    };
    match tokio::time::timeout(timeout, ask).await {
        Ok(Ok(ServingStatus::Serving)) => {
            outln!("SERVING");
            Ok(ExitCode::SUCCESS)
        }
        Ok(Ok(status)) => {
            outln!("{}", status.as_str_name());
            Ok(ExitCode::FAILURE)
        }
        Ok(Err(e)) => {
            eprintln!("error: {address}: {e:#}");
            Ok(ExitCode::FAILURE)
        }
        Err(_) => {
            eprintln!("error: {address}: no answer within {timeout:?}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// `cairnctl status`: the coordinator replicas and which leads, members, snapshots in
/// flight, the newest completed one, the schedule and freshness.
pub(crate) async fn status(coordinator: &str, output: Output) -> anyhow::Result<ExitCode> {
    let mut client = crate::connect(coordinator).await?;
    let coordinator = client.address().to_owned();
    // A coordinator of before high availability does not know GetLeadership: unknown.
    let leadership = match client
        .raw()
        .get_leadership(pb::GetLeadershipRequest {})
        .await
    {
        Ok(answer) => Some(answer.into_inner()),
        Err(status) if status.code() == tonic::Code::Unimplemented => None,
        Err(status) => return Err(status.into()),
    };
    let nodes = client
        .raw()
        .list_nodes(pb::ListNodesRequest {})
        .await?
        .into_inner();
    let list = |status: pb::SnapshotStatus, page_size| pb::ListSnapshotsRequest {
        status: status as i32,
        page_size,
        page_token: String::new(),
        mode: 0,
    };
    let running = client
        .raw()
        .list_snapshots(list(pb::SnapshotStatus::InProgress, 1000))
        .await?
        .into_inner()
        .snapshots;
    let newest = client
        .raw()
        .list_snapshots(list(pb::SnapshotStatus::Completed, 1))
        .await?
        .into_inner()
        .snapshots
        .into_iter()
        .next();
    let policy = client
        .raw()
        .get_policy(pb::GetPolicyRequest {})
        .await?
        .into_inner();
    let last_restore = client
        .raw()
        .list_restores(pb::ListRestoresRequest { limit: 1 })
        .await?
        .into_inner()
        .restores
        .into_iter()
        .next();
    let restore_text = last_restore.as_ref().map(|r| {
        let state = if r.done {
            "DONE".to_owned()
        } else if let Some(f) = &r.failure {
            format!("FAILED: {}", f.message)
        } else {
            format!(
                "IN_PROGRESS ({}/{} applied)",
                r.applied.len(),
                r.nodes.len()
            )
        };
        format!(
            "{} of snapshot {} (epoch {}, by {}): {state}",
            r.restore_id, r.snapshot_id, r.epoch, r.requested_by
        )
    });
    let connected = nodes.nodes.iter().filter(|n| n.connected).count();
    let down: Vec<&str> = nodes
        .nodes
        .iter()
        .filter(|n| !n.connected)
        .map(|n| n.node_id.as_str())
        .collect();
    let id = |s: &pb::Snapshot| s.plan.as_ref().map_or(0, |p| p.snapshot_id);
    if output == Output::Json {
        // The answers it is made of, each in the protobuf JSON mapping, under the names of
        // the table's rows.
        let mut json = serde_json::json!({
            "coordinator": coordinator,
            "nodes": proto_json(&nodes)?,
            "inProgress": running.iter().map(proto_json).collect::<anyhow::Result<Vec<_>>>()?,
            "policy": proto_json(&policy)?,
        });
        if let Some(leadership) = &leadership {
            json["leadership"] = proto_json(leadership)?;
        }
        if let Some(newest) = &newest {
            json["newestCompleted"] = proto_json(newest)?;
        }
        if let Some(restore) = &last_restore {
            json["lastRestore"] = proto_json(restore)?;
        }
        print_json(&json)?;
        return Ok(ExitCode::SUCCESS);
    }
    let [leader, term, replicas] = leadership_rows(leadership.as_ref());
    let mut rows = vec![
        ("coordinator", coordinator.clone()),
        ("leader", leader),
        ("term", term),
        ("replicas", replicas),
        (
            "nodes",
            if down.is_empty() {
                format!("{connected}/{} connected", nodes.nodes.len())
            } else {
                format!(
                    "{connected}/{} connected; not connected: {}",
                    nodes.nodes.len(),
                    down.join(", ")
                )
            },
        ),
        (
            "in progress",
            if running.is_empty() {
                "none".into()
            } else {
                running
                    .iter()
                    .map(|s| id(s).to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        ),
        (
            "newest completed",
            match &newest {
                None => "none".into(),
                Some(s) => format!(
                    "#{} {}, took {} ms, {}",
                    id(s),
                    mode_word(s),
                    s.finished_at_ms.saturating_sub(s.started_at_ms),
                    age(&policy)
                ),
            },
        ),
    ];
    let schedule = if policy.interval_ms == 0 {
        "off".to_owned()
    } else {
        format!(
            "every {}{}, {}; {} started, {} skipped, {} failed in a row{}",
            human(policy.interval_ms),
            if policy.jitter_ms > 0 {
                format!(" (+ up to {})", human(policy.jitter_ms))
            } else {
                String::new()
            },
            policy_mode(&policy),
            policy.started,
            policy.skipped,
            policy.consecutive_failures,
            if policy.failing { " (FAILING)" } else { "" }
        )
    };
    rows.push(("schedule", schedule));
    rows.push((
        "last restore",
        restore_text.unwrap_or_else(|| "none".into()),
    ));
    rows.push(("freshness", freshness(&policy)));
    table(
        &["CLUSTER", ""],
        rows.into_iter().map(|(k, v)| vec![k.to_owned(), v]),
    );
    Ok(ExitCode::SUCCESS)
}

/// The `leader`, `term` and `replicas` rows of `cairnctl status`; `None`: a coordinator
/// that does not tell (before high availability).
fn leadership_rows(leadership: Option<&pb::Leadership>) -> [String; 3] {
    let Some(l) = leadership else {
        return ["unknown".into(), "unknown".into(), "unknown".into()];
    };
    if l.leader.is_empty() {
        return [
            "none (an election is under way)".into(),
            "none".into(),
            replicas_text(&l.replicas),
        ];
    }
    [
        l.leader.clone(),
        l.term.to_string(),
        replicas_text(&l.replicas),
    ]
}

fn replicas_text(replicas: &[pb::CoordinatorReplica]) -> String {
    if replicas.is_empty() {
        return "none".into();
    }
    replicas
        .iter()
        .map(|r| {
            format!(
                "{} ({}revision {})",
                r.address,
                if r.leader { "leader, " } else { "" },
                r.revision
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leadership_rows_read_well() {
        assert_eq!(leadership_rows(None), ["unknown", "unknown", "unknown"]);
        let replica = |address: &str, revision, leader| pb::CoordinatorReplica {
            address: address.into(),
            revision,
            leader,
        };
        let ha = pb::Leadership {
            leader: "c1:7000".into(),
            term: 42,
            replicas: vec![replica("c1:7000", 42, true), replica("c2:7000", 57, false)],
            answered_by: "c2:7000".into(),
        };
        assert_eq!(
            leadership_rows(Some(&ha)),
            [
                "c1:7000",
                "42",
                "c1:7000 (leader, revision 42), c2:7000 (revision 57)"
            ]
        );
        let election = pb::Leadership {
            leader: String::new(),
            term: 0,
            replicas: vec![replica("c2:7000", 57, false)],
            answered_by: "c2:7000".into(),
        };
        assert_eq!(
            leadership_rows(Some(&election)),
            [
                "none (an election is under way)",
                "none",
                "c2:7000 (revision 57)"
            ]
        );
    }
}
