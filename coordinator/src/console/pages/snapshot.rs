//! `/snapshots/{id}`'s page: the summary, the cut drawn as a graph of the nodes and the
//! channels with what each recorded, the nodes, the channels, the timeline, the failure.

use super::*;

/// What one node's events say: when it recorded and when its part was stored.
#[derive(Default)]
struct NodeTimes {
    recorded_at: Option<u64>,
    stored_at: Option<u64>,
    recorded_messages: u64,
    /// Its own account, in its STATE_RECORDED event.
    start_delay_ms: Option<u64>,
    alignment_ms: Option<u64>,
    held_messages: Option<u64>,
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

/// `now_ms`: the time of the answer (a snapshot in flight: how long it has run).
pub(super) fn snapshot_page(s: &pb::Snapshot, now_ms: u64) -> Markup {
    let plan = s.plan.clone().unwrap_or_default();
    let status = status_word(s.status);
    let running = s.status == pb::SnapshotStatus::InProgress as i32;
    let mut times: BTreeMap<&str, NodeTimes> = BTreeMap::new();
    for e in &s.events {
        let t = times.entry(e.node_id.as_str()).or_default();
        match pb::snapshot_event::Kind::try_from(e.kind).unwrap_or_default() {
            pb::snapshot_event::Kind::StateRecorded => {
                t.recorded_at = Some(e.at_ms);
                t.start_delay_ms = e.start_delay_ms;
                t.alignment_ms = e.alignment_ms;
                t.held_messages = e.held_messages;
            }
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
    // Node ids as people count them (n2 before n10), everywhere on the page.
    let mut nodes: Vec<&pb::NodePart> = s.nodes.iter().collect();
    nodes.sort_by(|a, b| natural_cmp(&a.node_id, &b.node_id));
    let mut ordered: Vec<(&(String, String), &ChannelRecorded)> = channels.iter().collect();
    ordered.sort_by(|((a1, a2), _), ((b1, b2), _)| {
        natural_cmp(a1, b1).then_with(|| natural_cmp(a2, b2))
    });
    // Past MANY_NODES the tables list only the channels that recorded messages.
    let many = nodes.len() > MANY_NODES;
    let silent = ordered.iter().filter(|(_, r)| r.messages == 0).count();
    // And at most MAX_BUSY_CHANNELS of those, the ones that recorded the most.
    let mut unlisted = 0;
    if many {
        ordered.retain(|(_, r)| r.messages > 0);
        if ordered.len() > MAX_BUSY_CHANNELS {
            unlisted = ordered.len() - MAX_BUSY_CHANNELS;
            ordered.sort_by_key(|(_, c)| std::cmp::Reverse(c.messages));
            ordered.truncate(MAX_BUSY_CHANNELS);
            ordered.sort_by(|((a1, a2), _), ((b1, b2), _)| {
                natural_cmp(a1, b1).then_with(|| natural_cmp(a2, b2))
            });
        }
    }
    let summary = topology_summary(nodes.len(), channels.len());
    let since = |at: Option<u64>| {
        at.map_or("—".into(), |at| {
            duration(at.saturating_sub(s.started_at_ms))
        })
    };
    // In flight: how long, how far, whom it waits for (by part stored).
    let total = s.nodes.len();
    let recorded = s.nodes.iter().filter(|n| n.recorded).count();
    let stored = s.nodes.iter().filter(|n| n.reported).count();
    let waiting: Vec<&str> = s
        .nodes
        .iter()
        .filter(|n| !n.reported)
        .map(|n| n.node_id.as_str())
        .collect();
    let elapsed = now_ms.saturating_sub(s.started_at_ms);
    let aligned = plan.mode == pb::SnapshotMode::Aligned as i32;
    let ms_or_dash = |ms: Option<u64>| ms.map_or("—".into(), duration);
    let title = format!("Snapshot {}", plan.snapshot_id);
    page(
        &title,
        running,
        html! {
            div.row {
            div #summary data-id=(plan.snapshot_id) data-status=(status) data-mode=(mode_word(plan.mode)) {
                dl {
                    dt { "status" } dd class=(status) #status { (status) @if running { " (this page reloads every second)" } }
                    @if running {
                        dt { "progress" }
                        dd #progress data-elapsed-ms=(elapsed) data-recorded=(recorded) data-stored=(stored) data-total=(total) data-waiting=(waiting.join(" ")) {
                            "running for " (duration(elapsed)) " · " (recorded) "/" (total) " recorded · "
                            (stored) "/" (total) " stored"
                            @if !waiting.is_empty() { " · waiting for " (waiting.join(", ")) }
                            " · " (bytes(s.bytes_new.saturating_add(s.bytes_reused))) " stored so far"
                        }
                    }
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
                p #topology-summary data-nodes=(nodes.len()) data-channels=(channels.len()) { (summary) }
                @if many {
                    (ring(&nodes, &ordered))
                    p { small { "Only the channels that recorded messages in flight are drawn (blue)." br; "Green: the node's part is stored; yellow: recorded, not stored." } }
                } @else {
                    (graph(&nodes, &channels))
                    p { small { "Blue: messages recorded in flight on the channel." br; "Green: the node's part is stored; yellow: recorded, not stored." } }
                }
            }
            }
            h2 { "Nodes" }
            table #nodes {
                thead { tr {
                    th { "node" } th { "recorded" } th { "part stored" } th { "state size" }
                    th { "marker's start delay" }
                    @if aligned { th { "alignment" } th { "messages held" } }
                    th { "start → state recorded" } th { "start → part stored" } th { "messages it recorded" }
                } }
                tbody {
                    @for n in &nodes {
                        @let t = times.get(n.node_id.as_str());
                        tr.node data-node=(n.node_id) data-recorded=(n.recorded) data-reported=(n.reported) data-state-bytes=(n.local_state_bytes) {
                            td { (n.node_id) }
                            td { @if n.recorded { "yes" } @else { "no" } }
                            td { @if n.reported { "yes" } @else { "no" } }
                            td.num { (bytes(n.local_state_bytes)) }
                            td.num.start-delay { (ms_or_dash(t.and_then(|t| t.start_delay_ms))) }
                            @if aligned {
                                td.num.alignment { (ms_or_dash(t.and_then(|t| t.alignment_ms))) }
                                td.num.held { (t.and_then(|t| t.held_messages).map_or("—".into(), |n| n.to_string())) }
                            }
                            td.num { (since(t.and_then(|t| t.recorded_at))) }
                            td.num { (since(t.and_then(|t| t.stored_at))) }
                            td.num { (t.map_or(0, |t| t.recorded_messages)) }
                        }
                    }
                }
            }
            @if many && nodes.len() <= MATRIX_MAX_NODES {
                h2 { "Channel matrix" }
                (matrix(&nodes, &channels))
            }
            h2 { "Channels" }
            @if many {
                p #silent-channels data-silent=(silent) {
                    (summary) "; " (ordered.len() + unlisted) " recorded messages in flight"
                    @if unlisted > 0 {
                        " (the " (ordered.len()) " that recorded the most below, " (unlisted) " more not listed)"
                    } @else { " (below)" }
                    "; the other " (silent) " recorded nothing."
                }
            }
            table #channels {
                thead { tr {
                    th { "channel" } th { "messages recorded in flight" } th { "bytes" } th { "recorded by" }
                    th { "sent before the cut" } th { "delivered before the cut" }
                } }
                tbody {
                    @for ((from, to), r) in &ordered {
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
fn graph(
    nodes: &[&pb::NodePart],
    channels: &BTreeMap<(String, String), ChannelRecorded>,
) -> Markup {
    const SIZE: f64 = 520.0;
    const RADIUS: f64 = 190.0;
    let n = nodes.len().max(1) as f64;
    let position: BTreeMap<&str, (f64, f64)> = nodes
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
            @for node in nodes {
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

/// The fill of a node: green once its part is stored, yellow once recorded, grey before.
fn node_fill(node: &pb::NodePart) -> &'static str {
    if node.reported {
        "#e3f4e8"
    } else if node.recorded {
        "#fff4d6"
    } else {
        "#eef1f5"
    }
}

/// The cut of many nodes: small nodes on a ring as large as they need, and only the
/// channels that recorded messages in flight, so the drawing stays readable at hundreds
/// of nodes and tens of thousands of channels.
fn ring(nodes: &[&pb::NodePart], busy: &[(&(String, String), &ChannelRecorded)]) -> Markup {
    let n = nodes.len().max(1) as f64;
    // About 16 px of circumference a node, and room for the labels outside.
    let radius = (n * 16.0 / std::f64::consts::TAU).max(190.0);
    let size = 2.0 * radius + 120.0;
    let position: BTreeMap<&str, (f64, f64, f64)> = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let angle = std::f64::consts::TAU * i as f64 / n - std::f64::consts::FRAC_PI_2;
            (
                node.node_id.as_str(),
                (
                    size / 2.0 + radius * angle.cos(),
                    size / 2.0 + radius * angle.sin(),
                    angle,
                ),
            )
        })
        .collect();
    html! {
        svg #cut .ring width=(size) height=(size) viewBox={ "0 0 " (size) " " (size) } xmlns="http://www.w3.org/2000/svg" {
            defs {
                marker #arrow viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" orient="auto-start-reverse" {
                    path d="M 0 0 L 10 5 L 0 10 z" fill="#1d5fb3";
                }
            }
            @for ((from, to), r) in busy.iter().copied() {
                @if let (Some(&(x1, y1, _)), Some(&(x2, y2, _))) = (position.get(from.as_str()), position.get(to.as_str())) {
                    @let (dx, dy) = (x2 - x1, y2 - y1);
                    @let len = (dx * dx + dy * dy).sqrt().max(1.0);
                    g.channel data-from=(from) data-to=(to) data-messages=(r.messages) data-bytes=(r.bytes) {
                        line x1=(x1 + dx / len * 8.0) y1=(y1 + dy / len * 8.0) x2=(x2 - dx / len * 8.0) y2=(y2 - dy / len * 8.0) stroke="#1d5fb3" stroke-width="1.5" marker-end="url(#arrow)" {}
                        title { (from) " → " (to) ": " (r.messages) " messages (" (bytes(r.bytes)) ") recorded in flight" @if !r.sides.is_empty() { " by the " (r.sides.join(" and ")) } }
                    }
                }
            }
            @for node in nodes {
                @if let Some(&(x, y, angle)) = position.get(node.node_id.as_str()) {
                    @let (lx, ly) = (x + 16.0 * angle.cos(), y + 16.0 * angle.sin());
                    @let left = angle.cos() < 0.0;
                    g.node data-node=(node.node_id) data-reported=(node.reported) data-state-bytes=(node.local_state_bytes) {
                        circle cx=(x) cy=(y) r="6" fill=(node_fill(node)) stroke="#1d2330" {}
                        text x=(lx) y=(ly + 3.0) font-size="9" text-anchor=(if left { "end" } else { "start" }) { (node.node_id) }
                        title { (node.node_id) ": state " (bytes(node.local_state_bytes)) @if node.reported { ", part stored" } @else if node.recorded { ", recorded" } }
                    }
                }
            }
        }
    }
}

/// Every channel as a cell of a matrix, senders down and receivers across: blank where
/// there is no channel, grey where it recorded nothing, blue as deep as the messages it
/// recorded in flight (on a log scale).
fn matrix(
    nodes: &[&pb::NodePart],
    channels: &BTreeMap<(String, String), ChannelRecorded>,
) -> Markup {
    const CELL: f64 = 11.0;
    const LABELS: f64 = 48.0;
    let size = LABELS + CELL * nodes.len() as f64 + 4.0;
    let most = channels
        .values()
        .map(|r| r.messages)
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    html! {
        svg #matrix width=(size) height=(size) viewBox={ "0 0 " (size) " " (size) } xmlns="http://www.w3.org/2000/svg" {
            @for (i, node) in nodes.iter().enumerate() {
                @let at = LABELS + CELL * i as f64 + CELL * 0.75;
                text x=(LABELS - 4.0) y=(at) font-size="8" text-anchor="end" { (node.node_id) }
                text x=(at) y=(LABELS - 4.0) font-size="8" transform={ "rotate(-90 " (at) " " (LABELS - 4.0) ")" } { (node.node_id) }
            }
            @for (i, from) in nodes.iter().enumerate() {
                @for (j, to) in nodes.iter().enumerate() {
                    @if let Some(r) = channels.get(&(from.node_id.clone(), to.node_id.clone())) {
                        @let depth = if r.messages == 0 { 0.0 } else { 0.25 + 0.75 * ((r.messages as f64).ln_1p() / most.ln_1p()) };
                        rect.cell x=(LABELS + CELL * j as f64) y=(LABELS + CELL * i as f64) width=(CELL - 1.0) height=(CELL - 1.0)
                            fill=(if r.messages == 0 { "#e3e6ea".to_owned() } else { format!("rgba(29,95,179,{depth:.2})") })
                            data-from=(from.node_id) data-to=(to.node_id) data-messages=(r.messages) {
                            title { (from.node_id) " → " (to.node_id) ": " (r.messages) " messages (" (bytes(r.bytes)) ")" }
                        }
                    }
                }
            }
        }
    }
}
