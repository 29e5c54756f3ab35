//! The console's pages, rendered on the server with `maud` (which escapes every value):
//! plain HTML, inline CSS and SVG, no script. Elements carry `data-*` attributes with the
//! raw values (ids, statuses, counts) so that a test or a script can read the page.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::response::{Html, IntoResponse, Response};
use cairn_proto::v1 as pb;
use maud::{DOCTYPE, Markup, PreEscaped, html};

use super::{Caller, Console, Failure, ListQuery, NoQuery, path, query};

mod nodes;
mod snapshot;

pub(super) use nodes::nodes;
use nodes::{MANY_NODES, MATRIX_MAX_NODES, MAX_BUSY_CHANNELS, natural_cmp, topology_summary};
use snapshot::snapshot_page;

const STYLE: &str = "
body{font-family:system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:.6em 1.2em;display:flex;gap:1.5em;align-items:baseline}
header a{color:#cfe3ff;text-decoration:none}header .brand{font-weight:700;color:#fff}
header .logout{margin:0 0 0 auto}
main{padding:1em 1.5em}table{border-collapse:collapse;background:#fff;font-size:.9em}
th,td{border-bottom:1px solid #e3e6ea;padding:.35em .6em;text-align:left;vertical-align:top}
th{background:#eef1f5}td.num{text-align:right;font-variant-numeric:tabular-nums}
.COMPLETED{color:#17723a}.FAILED{color:#b3261e}.ABORTED{color:#8a5a00}.IN_PROGRESS{color:#1d5fb3}
.failure{background:#fdecea;border-left:4px solid #b3261e;padding:.6em 1em}
.cards{display:flex;gap:1em;flex-wrap:wrap;margin-bottom:1em}
.card{background:#fff;border:1px solid #e3e6ea;padding:.6em 1em;min-width:12em}
.card b{display:block;font-size:1.3em}dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}
dt{color:#5b6475}form{margin:.5em 0 1em}svg{background:#fff;border:1px solid #e3e6ea}
.row{display:flex;gap:2em;align-items:flex-start}#summary{flex:1 1 28em;min-width:0}.row>.cut{flex:0 0 auto}
";

/// A page: the header, `title`, `body`; `refresh` reloads it every second.
fn page(title: &str, refresh: bool, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                @if refresh { meta http-equiv="refresh" content="1"; }
                title { (title) " · cairn" }
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    a.brand href="/snapshots" { "cairn" }
                    a href="/snapshots" { "Snapshots" }
                    a href="/restores" { "Restores" }
                    a href="/nodes" { "Nodes" }
                    a href="/policy" { "Policy" }
                    a href="/api/v1/snapshots" { "API" }
                    // Ends the session cookie (a client certificate stays signed in).
                    form.logout method="post" action="/logout" {
                        button type="submit" { "Log out" }
                    }
                }
                main { h1 { (title) } (body) }
            }
        }
    }
}

/// A failure as a page with its status.
pub(super) fn failure_page(failure: Failure) -> Response {
    // Not signed in: the login page, saying why.
    if failure.status == axum::http::StatusCode::UNAUTHORIZED {
        return login_page(failure.status, Some(&failure.message));
    }
    let title = format!(
        "{} {}",
        failure.status.as_u16(),
        failure.status.canonical_reason().unwrap_or("")
    );
    let body =
        html! { p.failure #error data-status=(failure.status.as_u16()) { (failure.message) } };
    (
        failure.status,
        Html(page(&title, false, body).into_string()),
    )
        .into_response()
}

/// The login page: a bearer token, typed once, opens a session (a cookie) for 8 hours;
/// `message` says why it is shown (a wrong token, a page that needs a login).
pub(super) fn login_page(status: axum::http::StatusCode, message: Option<&str>) -> Response {
    let body = html! {
        @if let Some(message) = message {
            p.failure #error data-status=(status.as_u16()) { (message) }
        }
        form #login method="post" action="/login" {
            label for="token" { "Bearer token " }
            input #token type="password" name="token" autocomplete="current-password" required;
            " "
            button type="submit" { "Log in" }
        }
        p {
            "A token of the coordinator's --auth-tokens file (cairnctl auth token prints one). "
            "The session lasts 8 hours, in a cookie this browser sends only to this console. "
            "A client certificate with a role works without a login, and wins."
        }
    };
    (status, Html(page("Log in", false, body).into_string())).into_response()
}

/// `GET /login`.
pub(super) async fn login() -> Response {
    login_page(axum::http::StatusCode::OK, None)
}

fn respond(result: Result<Markup, Failure>) -> Response {
    match result {
        Ok(markup) => Html(markup.into_string()).into_response(),
        Err(failure) => failure_page(failure),
    }
}

/// `name` of a protobuf enum without its prefix: `SNAPSHOT_STATUS_COMPLETED` → `COMPLETED`.
fn word(name: &str, prefix: &str) -> String {
    name.strip_prefix(prefix).unwrap_or(name).to_owned()
}

fn status_word(status: i32) -> String {
    let status = pb::SnapshotStatus::try_from(status).unwrap_or_default();
    word(status.as_str_name(), "SNAPSHOT_STATUS_")
}

fn mode_word(mode: i32) -> String {
    let mode = pb::SnapshotMode::try_from(mode).unwrap_or_default();
    word(mode.as_str_name(), "SNAPSHOT_MODE_")
}

/// Milliseconds since the Unix epoch as UTC `YYYY-MM-DD HH:MM:SS.mmm` (the date from the
/// SDK's `format_time`, `YYYY-MM-DDTHH:MM:SSZ`).
fn time(ms: u64) -> String {
    if ms == 0 {
        return "—".into();
    }
    let utc = cairn_rpc::tls::format_time(ms / 1000);
    let (date, clock) = utc.split_once('T').unwrap_or((&utc, ""));
    format!("{date} {}.{:03}", clock.trim_end_matches('Z'), ms % 1000)
}

/// A duration in milliseconds for people.
fn duration(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{:.2} s", ms as f64 / 1000.0),
        _ => format!("{} min {} s", ms / 60_000, ms % 60_000 / 1000),
    }
}

/// Bytes for people.
fn bytes(n: u64) -> String {
    match n {
        0..1024 => format!("{n} B"),
        1024..1_048_576 => format!("{:.1} KiB", n as f64 / 1024.0),
        _ => format!("{:.1} MiB", n as f64 / 1_048_576.0),
    }
}

fn failure_text(failure: Option<&pb::FailureReason>) -> String {
    failure.map_or_else(String::new, |f| {
        let kind = pb::failure_reason::Kind::try_from(f.kind).unwrap_or_default();
        format!("{}: {}", word(kind.as_str_name(), "KIND_"), f.message)
    })
}

fn verdict_text(verdict: Option<&pb::Verdict>) -> String {
    match verdict {
        None => "—".into(),
        Some(v) if v.consistent => "consistent".into(),
        Some(v) => format!("inconsistent: {}", v.violation),
    }
}

fn labels_text(labels: &std::collections::HashMap<String, String>) -> String {
    let sorted: BTreeMap<_, _> = labels.iter().collect();
    let mut out = String::new();
    for (k, v) in sorted {
        if !out.is_empty() {
            out.push_str(", ");
        }
        let _ = write!(out, "{k}={v}");
    }
    out
}

fn options(current: &str, choices: &[&str]) -> Markup {
    html! {
        option value="" selected[current.is_empty()] { "all" }
        @for choice in choices {
            option value=(choice) selected[current == *choice] { (choice) }
        }
    }
}

/// `/snapshots`: freshness and schedule, filters, the table, the next page.
pub(super) async fn snapshots(
    State(c): State<Arc<Console>>,
    caller: Caller,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Response {
    respond(
        async {
            let q = query(q)?;
            let list = c.list_snapshots(&caller, &q).await?;
            let policy = c.get_policy(&caller).await?;
            let status = q.status.clone().unwrap_or_default();
            let mode = q.mode.clone().unwrap_or_default();
            let mut next = None;
            if !list.next_page_token.is_empty() {
                let mut url = format!("/snapshots?page_token={}", list.next_page_token);
                for (key, value) in [("status", &status), ("mode", &mode)] {
                    if !value.is_empty() {
                        let _ = write!(url, "&{key}={value}");
                    }
                }
                if let Some(size) = q.page_size {
                    let _ = write!(url, "&page_size={size}");
                }
                next = Some(url);
            }
            Ok(page(
                "Snapshots",
                false,
                html! {
                    (overview(&policy))
                    (counts(list.overview.as_ref()))
                    form method="get" action="/snapshots" {
                        label { "Status " select name="status" {
                            (options(&status, &["IN_PROGRESS", "COMPLETED", "FAILED", "ABORTED"]))
                        } }
                        " "
                        label { "Mode " select name="mode" {
                            (options(&mode, &["CHANDY_LAMPORT", "UNALIGNED", "ALIGNED"]))
                        } }
                        " " button type="submit" { "Filter" }
                    }
                    table #snapshots {
                        thead { tr {
                            th { "id" } th { "mode" } th { "status" } th { "initiators" }
                            th { "started (UTC)" } th { "duration" } th { "nodes" }
                            th { "in-flight recorded" } th { "bytes new" } th { "bytes reused" }
                            th { "verdict" } th { "labels" } th { "failure" }
                        } }
                        tbody {
                            @for s in &list.snapshots {
                                (snapshot_row(s))
                            }
                        }
                    }
                    @if list.snapshots.is_empty() { p #empty { "No snapshot matches." } }
                    @if let Some(next) = next { p { a #next href=(next) { "Older snapshots →" } } }
                },
            ))
        }
        .await,
    )
}

/// Freshness and the schedule, as cards.
fn overview(policy: &pb::Policy) -> Markup {
    let freshness = if policy.has_completed {
        format!("{} ago", duration(policy.newest_completed_age_ms))
    } else {
        "none yet".into()
    };
    let schedule = if policy.interval_ms == 0 {
        "off".to_owned()
    } else {
        format!(
            "every {}, {}",
            duration(policy.interval_ms),
            mode_word(policy.mode)
        )
    };
    html! {
        div.cards {
            div.card #freshness data-age-ms=(policy.newest_completed_age_ms) data-stale=(policy.stale) {
                "newest completed snapshot" b { (freshness) }
                @if policy.stale { span.FAILED { "stale" } }
            }
            div.card #schedule data-interval-ms=(policy.interval_ms) {
                "schedule" b { (schedule) }
                @if policy.interval_ms > 0 { "next in " (duration(policy.next_due_in_ms)) }
            }
            div.card #failing data-failing=(policy.failing) {
                "consecutive failures" b { (policy.consecutive_failures) }
                (policy.last_failure)
            }
        }
    }
}

/// Every kept snapshot counted by status, the restores, and the completed ones' duration
/// and size, least / mean / greatest (Flink's checkpoint overview).
fn counts(overview: Option<&pb::SnapshotOverview>) -> Markup {
    let o = overview.cloned().unwrap_or_default();
    let summary = |m: Option<pb::MinAvgMax>, show: fn(u64) -> String| {
        m.map_or("—".to_owned(), |m| {
            format!("{} / {} / {}", show(m.min), show(m.avg), show(m.max))
        })
    };
    html! {
        div.cards #counts data-in-progress=(o.in_progress) data-completed=(o.completed)
            data-failed=(o.failed) data-aborted=(o.aborted) data-restored=(o.restored) {
            div.card { "in progress" b { (o.in_progress) } }
            div.card { "completed" b { (o.completed) } }
            div.card { "failed" b { (o.failed) } }
            div.card { "aborted" b { (o.aborted) } }
            div.card { "restored" b { (o.restored) } }
            div.card #duration-summary { "duration, min / avg / max" b { (summary(o.duration_ms, duration)) } }
            div.card #size-summary { "size, min / avg / max" b { (summary(o.bytes, bytes)) } }
        }
    }
}

fn snapshot_row(s: &pb::Snapshot) -> Markup {
    let plan = s.plan.clone().unwrap_or_default();
    let status = status_word(s.status);
    let took = if s.finished_at_ms > 0 {
        duration(s.finished_at_ms.saturating_sub(s.started_at_ms))
    } else {
        "running".into()
    };
    let recorded = s.verdict.as_ref().map_or(0, |v| v.recorded_messages);
    html! {
        tr.snapshot data-id=(plan.snapshot_id) data-status=(status) data-mode=(mode_word(plan.mode)) {
            td { a href={ "/snapshots/" (plan.snapshot_id) } { (plan.snapshot_id) } }
            td { (mode_word(plan.mode)) }
            td class=(status) { (status) }
            td { (plan.initiators.join(", ")) }
            td { (time(s.started_at_ms)) }
            td.num { (took) }
            td.num { (s.nodes.len()) }
            td.num { (recorded) }
            td.num { (bytes(s.bytes_new)) }
            td.num { (bytes(s.bytes_reused)) }
            td { (verdict_text(s.verdict.as_ref())) }
            td { (labels_text(&s.labels)) }
            td.reason { (failure_text(s.failure.as_ref())) }
        }
    }
}

/// `/snapshots/{id}`: the summary, the cut as a graph, the nodes, the channels, the
/// timeline, the failure; reloads every second while it runs.
pub(super) async fn snapshot(
    State(c): State<Arc<Console>>,
    caller: Caller,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<NoQuery>, QueryRejection>,
) -> Response {
    respond(
        async {
            let id = path(id)?;
            query(q)?;
            let s = c.get_snapshot(&caller, &id, false).await?;
            Ok(snapshot_page(&s, cairn_proto::stored::convert::now_ms()))
        }
        .await,
    )
}

/// `/restores`: who restored what, when, who applied it, how it ended.
pub(super) async fn restores(
    State(c): State<Arc<Console>>,
    caller: Caller,
    q: Result<Query<NoQuery>, QueryRejection>,
) -> Response {
    respond(
        async {
            query(q)?;
            let list = c.list_restores(&caller, 0).await?;
            Ok(page(
                "Restores",
                false,
                html! {
                    table #restores {
                        thead { tr {
                            th { "restore" } th { "snapshot" } th { "epoch" } th { "requested by" }
                            th { "started (UTC)" } th { "finished (UTC)" } th { "applied" } th { "skipped" } th { "result" }
                        } }
                        tbody {
                            @for r in &list.restores {
                                @let result = if !r.done { "in progress".to_owned() } else if r.failure.is_some() { failure_text(r.failure.as_ref()) } else { "done".to_owned() };
                                tr.restore data-id=(r.restore_id) data-snapshot=(r.snapshot_id) data-done=(r.done) data-failed=(r.failure.is_some()) {
                                    td { (r.restore_id) }
                                    td { a href={ "/snapshots/" (r.snapshot_id) } { (r.snapshot_id) } }
                                    td.num { (r.epoch) }
                                    td { (r.requested_by) }
                                    td { (time(r.started_at_ms)) }
                                    td { (time(r.finished_at_ms)) }
                                    td { (r.applied.join(", ")) }
                                    td { (r.skipped.join(", ")) }
                                    td { (result) }
                                }
                            }
                        }
                    }
                    @if list.restores.is_empty() { p #empty { "No restore yet." } }
                },
            ))
        }
        .await,
    )
}

/// `/policy`: the schedule and its state.
pub(super) async fn policy(
    State(c): State<Arc<Console>>,
    caller: Caller,
    q: Result<Query<NoQuery>, QueryRejection>,
) -> Response {
    respond(
        async {
            query(q)?;
            let p = c.get_policy(&caller).await?;
            Ok(page(
                "Policy",
                false,
                html! {
                    (overview(&p))
                    dl #policy data-interval-ms=(p.interval_ms) {
                        dt { "interval" } dd { @if p.interval_ms == 0 { "off (no scheduled snapshots)" } @else { (duration(p.interval_ms)) } }
                        dt { "mode" } dd { (mode_word(p.mode)) }
                        dt { "timeout" } dd { (duration(p.timeout_ms)) }
                        dt { "alignment timeout" } dd { @if p.alignment_timeout_ms == 0 { "none" } @else { (duration(p.alignment_timeout_ms)) } }
                        dt { "minimum pause" } dd { (duration(p.min_pause_ms)) }
                        dt { "jitter" } dd { (duration(p.jitter_ms)) }
                        dt { "at most in flight" } dd { (p.max_concurrent) }
                        dt { "tolerated failures" } dd { (p.tolerated_failures) }
                        dt { "freshness threshold" } dd { @if p.freshness_threshold_ms == 0 { "none" } @else { (duration(p.freshness_threshold_ms)) } }
                        dt { "started by the schedule" } dd { (p.started) }
                        dt { "skipped" } dd { (p.skipped) }
                        dt { "set by" } dd { (p.source) }
                    }
                },
            ))
        }
        .await,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_utc_dates() {
        assert_eq!(time(0), "—");
        assert_eq!(time(1), "1970-01-01 00:00:00.001");
        assert_eq!(time(951_782_400_000), "2000-02-29 00:00:00.000");
        assert_eq!(time(1_796_203_845_123), "2026-12-02 09:30:45.123");
        assert_eq!(duration(999), "999 ms");
        assert_eq!(duration(61_500), "1 min 1 s");
        assert_eq!(bytes(2048), "2.0 KiB");
    }

    #[test]
    fn a_failed_snapshot_names_its_reason_and_values_are_escaped() {
        let s = pb::Snapshot {
            plan: Some(pb::SnapshotPlan {
                snapshot_id: 9,
                ..Default::default()
            }),
            status: pb::SnapshotStatus::Failed as i32,
            failure: Some(pb::FailureReason {
                kind: pb::failure_reason::Kind::ChannelReset as i32,
                message: "channel n1->n2 was reset <script>".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let html = snapshot_page(&s, 0).into_string();
        assert!(
            html.contains("CHANNEL_RESET: channel n1-&gt;n2 was reset &lt;script&gt;"),
            "{html}"
        );
        assert!(!html.contains("<script>"));
        assert!(!html.contains("http-equiv=\"refresh\""));
        let part = |id: &str, recorded: bool, reported: bool| pb::NodePart {
            node_id: id.into(),
            recorded,
            reported,
            ..Default::default()
        };
        let running = pb::Snapshot {
            status: pb::SnapshotStatus::InProgress as i32,
            failure: None,
            started_at_ms: 10_000,
            bytes_new: 2048,
            nodes: vec![
                part("n1", true, true),
                part("n2", true, false),
                part("n3", false, false),
            ],
            ..s
        };
        let html = snapshot_page(&running, 12_500).into_string();
        assert!(html.contains("http-equiv=\"refresh\""));
        assert!(
            html.contains(
                "running for 2.50 s · 2/3 recorded · 1/3 stored · waiting for n2, n3 · 2.0 KiB \
                 stored so far"
            ),
            "{html}"
        );
        assert!(html.contains("data-waiting=\"n2 n3\""), "{html}");
    }

    #[test]
    fn names_sort_as_people_count() {
        let mut ids = vec![
            "n10", "n2", "n1", "node-b", "n02", "node-a", "n2a", "10", "9",
        ];
        ids.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            ids,
            [
                "9", "10", "n1", "n02", "n2", "n2a", "n10", "node-a", "node-b"
            ]
        );
        assert_eq!(
            natural_cmp("n99999999999999999999999", "n100000000000000000000000"),
            std::cmp::Ordering::Less
        );
    }

    #[test]
    fn a_topology_is_summed_up_in_a_few_words() {
        assert_eq!(
            topology_summary(20, 380),
            "full mesh, 20 nodes, 380 channels"
        );
        assert_eq!(
            topology_summary(20, 20),
            "20 nodes, 20 channels (of 380 possible)"
        );
        assert_eq!(topology_summary(1, 0), "1 node, 0 channels (of 0 possible)");
    }

    /// A completed snapshot of `n` nodes in a full mesh where `busy` channels recorded
    /// messages in flight.
    fn mesh_snapshot(n: usize, busy: &[(usize, usize)]) -> pb::Snapshot {
        let id = |i: usize| format!("n{}", i + 1);
        let mut channels = Vec::new();
        for from in 0..n {
            for to in 0..n {
                if from != to {
                    channels.push(pb::ChannelRef {
                        from: id(from),
                        to: id(to),
                    });
                }
            }
        }
        // Listed in the order a store might give them: lexicographic (n10 before n2).
        let mut nodes: Vec<pb::NodePart> = (0..n)
            .map(|i| pb::NodePart {
                node_id: id(i),
                recorded: true,
                reported: true,
                local_state_bytes: 100,
                recorded_channels: busy
                    .iter()
                    .filter(|(_, to)| *to == i)
                    .map(|&(from, to)| pb::RecordedChannel {
                        channel: Some(pb::ChannelRef {
                            from: id(from),
                            to: id(to),
                        }),
                        messages: 3,
                        bytes: 30,
                    })
                    .collect(),
                ..Default::default()
            })
            .collect();
        nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        pb::Snapshot {
            plan: Some(pb::SnapshotPlan {
                snapshot_id: 9,
                mode: pb::SnapshotMode::Unaligned as i32,
                ..Default::default()
            }),
            status: pb::SnapshotStatus::Completed as i32,
            started_at_ms: 1,
            finished_at_ms: 2,
            nodes,
            channels,
            ..Default::default()
        }
    }

    #[test]
    fn a_cut_of_many_nodes_stays_readable() {
        // A few nodes: every channel drawn and listed.
        let html = snapshot_page(&mesh_snapshot(3, &[(0, 1)]), 0).into_string();
        assert!(html.contains("full mesh, 3 nodes, 6 channels"));
        assert_eq!(html.matches("<g class=\"channel\"").count(), 6);
        assert_eq!(html.matches("<tr class=\"channel\"").count(), 6);
        assert!(!html.contains("id=\"matrix\""));

        let busy = [(0, 1), (9, 1), (1, 19)];
        for (n, matrix) in [(20, true), (64, true), (256, false)] {
            let html = snapshot_page(&mesh_snapshot(n, &busy), 0).into_string();
            let channels = n * (n - 1);
            assert!(
                html.contains(&format!("full mesh, {n} nodes, {channels} channels")),
                "{n}"
            );
            // Only the channels that recorded something are drawn and listed.
            assert_eq!(html.matches("<g class=\"channel\"").count(), 3, "{n}");
            assert_eq!(html.matches("<tr class=\"channel\"").count(), 3, "{n}");
            assert!(html.contains(&format!("the other {} recorded nothing", channels - 3)));
            assert_eq!(html.matches("<g class=\"node\"").count(), n);
            // The matrix up to 64 nodes: a cell per channel, the busy ones deeper.
            let cells = html.matches("<rect class=\"cell\"").count();
            assert_eq!(cells, if matrix { channels } else { 0 }, "{n}");
            // Nodes in natural order: n2 before n10 before n20.
            let at = |id: &str| {
                html.find(&format!("<tr class=\"node\" data-node=\"{id}\""))
                    .unwrap()
            };
            assert!(at("n2") < at("n10") && at("n10") < at("n20"), "{n}");
            // Bounded: a browser loads it at once.
            assert!(html.len() < 1_500_000, "{n} nodes: {} bytes", html.len());
        }
    }
}
