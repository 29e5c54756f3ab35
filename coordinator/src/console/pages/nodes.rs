//! `/nodes`'s page, and what keeps every page readable with many nodes: names in the order
//! people count, a topology in words, and the bounds past which pages show less.

use super::*;

/// Past this many nodes a snapshot's cut is drawn as a ring of small nodes with only the
/// channels that recorded messages, and the tables list only what carries something.
pub(super) const MANY_NODES: usize = 12;

/// Up to this many nodes a large cut also gets a channel matrix (a cell per channel).
pub(super) const MATRIX_MAX_NODES: usize = 64;

/// Past [`MANY_NODES`], the most channels a page draws or lists (the busiest first): a
/// busy mesh of hundreds of nodes has tens of thousands.
pub(super) const MAX_BUSY_CHANNELS: usize = 500;

/// Orders names as people count: runs of digits compare as numbers (`n2` before `n10`),
/// the rest as text; equal so far, the plain order decides.
pub(super) fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    fn runs(s: &str) -> impl Iterator<Item = (bool, &str)> {
        let mut rest = s;
        std::iter::from_fn(move || {
            let first = rest.chars().next()?;
            let digits = first.is_ascii_digit();
            let end = rest
                .find(|c: char| c.is_ascii_digit() != digits)
                .unwrap_or(rest.len());
            let (run, tail) = rest.split_at(end);
            rest = tail;
            Some((digits, run))
        })
    }
    let (mut x, mut y) = (runs(a), runs(b));
    loop {
        match (x.next(), y.next()) {
            (None, None) => return a.cmp(b),
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some((true, p)), Some((true, q))) => {
                let (p, q) = (p.trim_start_matches('0'), q.trim_start_matches('0'));
                let order = p.len().cmp(&q.len()).then_with(|| p.cmp(q));
                if order != Ordering::Equal {
                    return order;
                }
            }
            (Some((_, p)), Some((_, q))) => {
                if p != q {
                    return p.cmp(q);
                }
            }
        }
    }
}

/// A topology in a few words: "full mesh, 20 nodes, 380 channels", or "20 nodes, 57
/// channels (of 380 possible)".
pub(super) fn topology_summary(nodes: usize, channels: usize) -> String {
    let possible = nodes.saturating_mul(nodes.saturating_sub(1));
    let noun = |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    if nodes > 1 && channels == possible {
        format!(
            "full mesh, {}, {}",
            noun(nodes, "node", "nodes"),
            noun(channels, "channel", "channels")
        )
    } else {
        format!(
            "{}, {} (of {possible} possible)",
            noun(nodes, "node", "nodes"),
            noun(channels, "channel", "channels")
        )
    }
}

/// `/nodes`: the members, their sessions and applications, the topology.
pub(in crate::console) async fn nodes(
    State(c): State<Arc<Console>>,
    caller: Caller,
    q: Result<Query<NoQuery>, QueryRejection>,
) -> Response {
    respond(
        async {
            query(q)?;
            let mut list = c.list_nodes(&caller).await?;
            let leadership = c.get_leadership(&caller).await?;
            let now = cairn_proto::stored::convert::now_ms();
            list.nodes.sort_by(|a, b| natural_cmp(&a.node_id, &b.node_id));
            list.channels
                .sort_by(|a, b| natural_cmp(&a.from, &b.from).then_with(|| natural_cmp(&a.to, &b.to)));
            let many = list.nodes.len() > MANY_NODES;
            let summary = topology_summary(list.nodes.len(), list.channels.len());
            // Many nodes: only the channels with something to see (down, frames not yet
            // acknowledged, queued, held).
            let notable = |c: &pb::ChannelStatus| {
                !many
                    || !c.connected
                    || c.unacked_frames > 0
                    || c.queued > 0
                    || c.alignment_blocked
                    || c.fault_held
            };
            let all_channels: usize = list.nodes.iter().map(|n| n.channels.len()).sum();
            // The rows: every channel end, or with many nodes the notable ones, at most
            // MAX_BUSY_CHANNELS of them.
            let rows: Vec<(&pb::NodeInfo, &pb::ChannelStatus)> = list
                .nodes
                .iter()
                .flat_map(|n| n.channels.iter().filter(|c| notable(c)).map(move |c| (n, c)))
                .take(if many { MAX_BUSY_CHANNELS } else { usize::MAX })
                .collect();
            let shown = rows.len();
            Ok(page(
                "Nodes",
                false,
                html! {
                    p #leadership data-term=(leadership.term) {
                        "Coordinator leader: " b { (if leadership.leader.is_empty() { "—" } else { &leadership.leader }) }
                        " (term " (leadership.term) ", answered by " (leadership.answered_by) ")"
                    }
                    table #members {
                        thead { tr {
                            th { "node" } th { "address" } th { "incarnation" } th { "session" }
                            th { "application" } th { "last heard" }
                        } }
                        tbody {
                            @for n in &list.nodes {
                                tr.member data-node=(n.node_id) data-connected=(n.connected) data-attached=(n.application_attached) {
                                    td { (n.node_id) }
                                    td { (n.address) }
                                    td.num { (n.incarnation) }
                                    td class=(if n.connected { "COMPLETED" } else { "FAILED" }) { (if n.connected { "connected" } else { "disconnected" }) }
                                    td { (if n.application_attached { "attached" } else { "none" }) }
                                    td { @if n.last_seen_ms > 0 { (duration(now.saturating_sub(n.last_seen_ms))) " ago" } @else { "—" } }
                                }
                            }
                        }
                    }
                    h2 { "Topology" }
                    p #topology data-channels=(list.channels.len()) { (summary) }
                    @if list.channels.len() <= 1000 {
                        details open[!many] {
                            summary { "every channel" }
                            p #topology-channels {
                                @for (i, ch) in list.channels.iter().enumerate() {
                                    @if i > 0 { ", " } (ch.from) " → " (ch.to)
                                }
                            }
                        }
                    }
                    h2 { "Channels, as each daemon sees them" }
                    p { small { "From each connected daemon's last heartbeat (every 2 s); "
                        code { "cairnctl nodes status HOST:PORT" } " asks a daemon directly." } }
                    @if many {
                        p #quiet-channels data-shown=(shown) data-all=(all_channels) {
                            (shown) " of " (all_channels) " channel ends shown: those down, with frames not \
                             acknowledged or queued, or held (at most " (MAX_BUSY_CHANNELS) "); the \
                             others are up and idle."
                        }
                    }
                    table #node-channels {
                        thead { tr {
                            th { "node" } th { "channel" } th { "stream" } th { "frames not acknowledged" }
                            th { "queued" } th { "reconnects" } th { "data messages" } th { "markers" } th { "held" }
                        } }
                        tbody {
                            @for (n, c) in &rows {
                                @let ch = c.channel.clone().unwrap_or_default();
                                @let side = if ch.from == n.node_id { "out" } else { "in" };
                                tr.node-channel data-node=(n.node_id) data-from=(ch.from) data-to=(ch.to) data-connected=(c.connected) data-unacked=(c.unacked_frames) data-reconnects=(c.reconnects) {
                                    td { (n.node_id) }
                                    td { (ch.from) " → " (ch.to) " (" (side) ")" }
                                    td class=(if c.connected { "COMPLETED" } else { "FAILED" }) { (if c.connected { "up" } else { "down" }) }
                                    td.num { (c.unacked_frames) }
                                    td.num { (c.queued) }
                                    td.num { (c.reconnects) }
                                    td.num { (c.data_messages) }
                                    td.num { (c.markers) }
                                    td { @if c.alignment_blocked { "aligning" } @else if c.fault_held { "fault" } @else { "—" } }
                                }
                            }
                        }
                    }
                },
            ))
        }
        .await,
    )
}
