//! `/snapshots/{id}`'s page: the summary, the cut drawn as a graph of the nodes and the
//! channels with what each recorded, the nodes, the channels, the timeline, the failure.

use super::*;

/// What one node's events say: when it recorded and when its part was stored.
#[derive(Default)]
struct NodeTimes {
    recorded_at: Option<u64>,
    stored_at: Option<u64>,
    recorded_messages: u64,
}

/// Per channel (`from`, `to`): messages and bytes recorded, and by which side; the
/// sender's and receiver's cut counters.
#[derive(Default)]
struct ChannelRecorded {
    messages: u64,
    bytes: u64,
    sides: Vec<&'static str>,
    sent: Option<u64>,
    delivered: Option<u64>,
}

pub(super) fn snapshot_page(s: &pb::Snapshot) -> Markup {
    let plan = s.plan.clone().unwrap_or_default();
    let status = status_word(s.status);
    let running = s.status == pb::SnapshotStatus::InProgress as i32;
    let mut times: BTreeMap<&str, NodeTimes> = BTreeMap::new();
    for e in &s.events {
        let t = times.entry(e.node_id.as_str()).or_default();
        match pb::snapshot_event::Kind::try_from(e.kind).unwrap_or_default() {
            pb::snapshot_event::Kind::StateRecorded => t.recorded_at = Some(e.at_ms),
            pb::snapshot_event::Kind::PartStored => {
                t.stored_at = Some(e.at_ms);
                t.recorded_messages = e.recorded_messages;
            }
            _ => {}
        }
    }
    let mut channels: BTreeMap<(String, String), ChannelRecorded> = s
        .channels
        .iter()
        .map(|c| ((c.from.clone(), c.to.clone()), ChannelRecorded::default()))
        .collect();
    let key = |c: &pb::ChannelRef| (c.from.clone(), c.to.clone());
    for node in &s.nodes {
        for o in &node.outgoing {
            if let Some(entry) = o.channel.as_ref().and_then(|c| channels.get_mut(&key(c))) {
                entry.sent = Some(o.sent);
            }
        }
        for i in &node.incoming {
            if let Some(entry) = i.channel.as_ref().and_then(|c| channels.get_mut(&key(c))) {
                entry.delivered = Some(i.delivered);
            }
        }
        for r in &node.recorded_channels {
            let Some(channel) = &r.channel else { continue };
            let entry = channels
                .entry((channel.from.clone(), channel.to.clone()))
                .or_default();
            entry.messages = entry.messages.saturating_add(r.messages);
            entry.bytes = entry.bytes.saturating_add(r.bytes);
            entry.sides.push(if channel.to == node.node_id {
                "receiver"
            } else {
                "sender"
            });
        }
    }
    let since = |at: Option<u64>| {
        at.map_or("—".into(), |at| {
            duration(at.saturating_sub(s.started_at_ms))
        })
    };
    let title = format!("Snapshot {}", plan.snapshot_id);
    page(
        &title,
        running,
        html! {
            div.row {
            div #summary data-id=(plan.snapshot_id) data-status=(status) data-mode=(mode_word(plan.mode)) {
                dl {
                    dt { "status" } dd class=(status) #status { (status) @if running { " (this page reloads every second)" } }
                    dt { "mode" } dd { (mode_word(plan.mode)) }
                    dt { "initiators" } dd { (plan.initiators.join(", ")) }
                    dt { "started (UTC)" } dd { (time(s.started_at_ms)) }
                    dt { "finished (UTC)" } dd { (time(s.finished_at_ms)) }
                    @if s.finished_at_ms > 0 {
                        dt { "duration" } dd { (duration(s.finished_at_ms.saturating_sub(s.started_at_ms))) }
                    }
                    dt { "verdict" } dd #verdict { (verdict_text(s.verdict.as_ref())) }
                    dt { "in-flight messages recorded" } dd #recorded-messages {
                        (s.verdict.as_ref().map_or(0, |v| v.recorded_messages))
                    }
                    dt { "bytes new / reused" } dd { (bytes(s.bytes_new)) " / " (bytes(s.bytes_reused)) }
                    dt { "labels" } dd { (labels_text(&s.labels)) }
                    dt { "coordinator term" } dd { (s.term) }
                }
                @if let Some(f) = &s.failure {
                    p.failure #failure data-kind=(word(pb::failure_reason::Kind::try_from(f.kind).unwrap_or_default().as_str_name(), "KIND_")) {
                        b { "Why it did not complete: " } (failure_text(Some(f)))
                    }
                }
            }
            div.cut {
                h2 { "The cut" }
                (graph(s, &channels))
                p { small { "Blue: messages recorded in flight on the channel." br; "Green: the node's part is stored; yellow: recorded, not stored." } }
            }
            }
            h2 { "Nodes" }
            table #nodes {
                thead { tr {
                    th { "node" } th { "recorded" } th { "part stored" } th { "state size" }
                    th { "start → state recorded" } th { "start → part stored" } th { "messages it recorded" }
                } }
                tbody {
                    @for n in &s.nodes {
                        @let t = times.get(n.node_id.as_str());
                        tr.node data-node=(n.node_id) data-recorded=(n.recorded) data-reported=(n.reported) data-state-bytes=(n.local_state_bytes) {
                            td { (n.node_id) }
                            td { @if n.recorded { "yes" } @else { "no" } }
                            td { @if n.reported { "yes" } @else { "no" } }
                            td.num { (bytes(n.local_state_bytes)) }
                            td.num { (since(t.and_then(|t| t.recorded_at))) }
                            td.num { (since(t.and_then(|t| t.stored_at))) }
                            td.num { (t.map_or(0, |t| t.recorded_messages)) }
                        }
                    }
                }
            }
            h2 { "Channels" }
            table #channels {
                thead { tr {
                    th { "channel" } th { "messages recorded in flight" } th { "bytes" } th { "recorded by" }
                    th { "sent before the cut" } th { "delivered before the cut" }
                } }
                tbody {
                    @for ((from, to), r) in &channels {
                        @let sent = r.sent;
                        @let delivered = r.delivered;
                        tr.channel data-from=(from) data-to=(to) data-messages=(r.messages) data-bytes=(r.bytes) {
                            td { (from) " → " (to) }
                            td.num { (r.messages) }
                            td.num { (bytes(r.bytes)) }
                            td { (r.sides.join(", ")) }
                            td.num { (sent.map_or("—".into(), |n| n.to_string())) }
                            td.num { (delivered.map_or("—".into(), |n| n.to_string())) }
                        }
                    }
                }
            }
            h2 { "Timeline" }
            table #timeline {
                thead { tr { th { "at (UTC)" } th { "since start" } th { "event" } th { "node" } th { "details" } } }
                tbody {
                    @for e in &s.events {
                        @let kind = word(pb::snapshot_event::Kind::try_from(e.kind).unwrap_or_default().as_str_name(), "KIND_");
                        tr.event data-kind=(kind) data-node=(e.node_id) {
                            td { (time(e.at_ms)) }
                            td.num { (duration(e.at_ms.saturating_sub(s.started_at_ms))) }
                            td { (kind) }
                            td { (e.node_id) }
                            td { (event_details(e)) }
                        }
                    }
                }
            }
        },
    )
}

fn event_details(e: &pb::SnapshotEvent) -> String {
    match pb::snapshot_event::Kind::try_from(e.kind).unwrap_or_default() {
        pb::snapshot_event::Kind::PartStored => format!(
            "state {}, {} messages recorded, {} new, {} reused",
            bytes(e.local_state_bytes),
            e.recorded_messages,
            bytes(e.bytes_new),
            bytes(e.bytes_reused)
        ),
        pb::snapshot_event::Kind::Verified if e.detail.is_empty() => {
            format!(
                "consistent, {} messages recorded in flight",
                e.recorded_messages
            )
        }
        _ => e.detail.clone(),
    }
}

/// The cut as an SVG graph: nodes on a circle (green once their part is stored), an arrow
/// per channel labelled with the messages recorded in flight on it.
fn graph(s: &pb::Snapshot, channels: &BTreeMap<(String, String), ChannelRecorded>) -> Markup {
    const SIZE: f64 = 520.0;
    const RADIUS: f64 = 190.0;
    let n = s.nodes.len().max(1) as f64;
    let position: BTreeMap<&str, (f64, f64)> = s
        .nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let angle = std::f64::consts::TAU * i as f64 / n - std::f64::consts::FRAC_PI_2;
            (
                node.node_id.as_str(),
                (
                    SIZE / 2.0 + RADIUS * angle.cos(),
                    SIZE / 2.0 + RADIUS * angle.sin(),
                ),
            )
        })
        .collect();
    html! {
        svg #cut width=(SIZE) height=(SIZE) viewBox={ "0 0 " (SIZE) " " (SIZE) } xmlns="http://www.w3.org/2000/svg" {
            defs {
                marker #arrow viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse" {
                    path d="M 0 0 L 10 5 L 0 10 z" fill="#5b6475";
                }
            }
            @for ((from, to), r) in channels {
                @if let (Some(&(x1, y1)), Some(&(x2, y2))) = (position.get(from.as_str()), position.get(to.as_str())) {
                    @let (dx, dy) = (x2 - x1, y2 - y1);
                    @let len = (dx * dx + dy * dy).sqrt().max(1.0);
                    // Each direction a little to its own side, so a→b and b→a do not overlap.
                    @let (ox, oy) = (-dy / len * 7.0, dx / len * 7.0);
                    @let (sx, sy) = (x1 + dx / len * 34.0 + ox, y1 + dy / len * 34.0 + oy);
                    @let (ex, ey) = (x2 - dx / len * 34.0 + ox, y2 - dy / len * 34.0 + oy);
                    g.channel data-from=(from) data-to=(to) data-messages=(r.messages) data-bytes=(r.bytes) {
                        line x1=(sx) y1=(sy) x2=(ex) y2=(ey) stroke=(if r.messages > 0 { "#1d5fb3" } else { "#9aa3b2" }) stroke-width=(if r.messages > 0 { "2.5" } else { "1.2" }) marker-end="url(#arrow)" {}
                        @if r.messages > 0 {
                            text x=((sx + ex) / 2.0 + ox * 1.6) y=((sy + ey) / 2.0 + oy * 1.6) font-size="11" fill="#1d5fb3" text-anchor="middle" {
                                (r.messages) " msg · " (bytes(r.bytes))
                            }
                        }
                        title { (from) " → " (to) ": " (r.messages) " messages (" (bytes(r.bytes)) ") recorded in flight" @if !r.sides.is_empty() { " by the " (r.sides.join(" and ")) } }
                    }
                }
            }
            @for node in &s.nodes {
                @if let Some(&(x, y)) = position.get(node.node_id.as_str()) {
                    g.node data-node=(node.node_id) data-reported=(node.reported) data-state-bytes=(node.local_state_bytes) {
                        circle cx=(x) cy=(y) r="30" fill=(if node.reported { "#e3f4e8" } else if node.recorded { "#fff4d6" } else { "#eef1f5" }) stroke="#1d2330" {}
                        text x=(x) y=(y - 2.0) font-size="13" text-anchor="middle" font-weight="700" { (node.node_id) }
                        text x=(x) y=(y + 13.0) font-size="10" text-anchor="middle" { (bytes(node.local_state_bytes)) }
                    }
                }
            }
        }
    }
}
