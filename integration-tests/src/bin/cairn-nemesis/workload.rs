//! The run's workload and its observation: snapshots started in every mode at whichever
//! replica accepts them, each one's end as told and as stored, written to the history.

use super::*;

/// Milliseconds since the epoch, by this machine's clock (the coordinators' too).
pub(super) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Watches snapshot `id` at `client`'s replica and writes the end it is told, if it is
/// told one (a term that ends first closes the stream with an error: nothing told).
pub(super) async fn watch_told(
    shared: SharedRef,
    mut client: pb::coordinator_client::CoordinatorClient<Channel>,
    id: u64,
) {
    let watched = async {
        let mut stream = client
            .watch_snapshot(pb::WatchSnapshotRequest { snapshot_id: id })
            .await?
            .into_inner();
        while let Some(progress) = stream.message().await? {
            if progress.status != pb::SnapshotStatus::InProgress as i32 {
                return anyhow::Ok(Some(status_name(progress.status)));
            }
        }
        Ok(None)
    };
    // Past the snapshot's own 10 s timeout and a lost answer's settling.
    if let Ok(Ok(Some(status))) = timeout(Duration::from_secs(60), watched).await {
        let mut shared = lock(&shared);
        let at = shared.history.at();
        shared.push(&Entry::Told { at, id, status });
    }
}

pub(super) fn status_name(status: i32) -> String {
    pb::SnapshotStatus::try_from(status).map_or_else(
        |_| format!("STATUS_{status}"),
        |s| {
            s.as_str_name()
                .trim_start_matches("SNAPSHOT_STATUS_")
                .to_owned()
        },
    )
}

pub(super) fn mode_name(mode: i32) -> String {
    pb::SnapshotMode::try_from(mode).map_or_else(
        |_| format!("MODE_{mode}"),
        |m| {
            m.as_str_name()
                .trim_start_matches("SNAPSHOT_MODE_")
                .to_owned()
        },
    )
}

pub(super) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The history's view of a snapshot (its data, if it has any).
pub(super) fn view(s: &pb::Snapshot) -> SnapshotView {
    let plan = s.plan.clone().unwrap_or_default();
    let (failure_kind, failure) = s
        .failure
        .as_ref()
        .map_or((String::new(), String::new()), |f| {
            (
                pb::failure_reason::Kind::try_from(f.kind).map_or_else(
                    |_| format!("KIND_{}", f.kind),
                    |k| k.as_str_name().to_owned(),
                ),
                f.message.clone(),
            )
        });
    SnapshotView {
        id: plan.snapshot_id,
        term: s.term,
        epoch: Some(plan.epoch),
        mode: mode_name(plan.mode),
        status: status_name(s.status),
        failure_kind,
        failure,
        started_at_ms: s.started_at_ms,
        finished_at_ms: s.finished_at_ms,
        channels: s
            .channels
            .iter()
            .map(|c| format!("{}->{}", c.from, c.to))
            .collect(),
        nodes: s
            .nodes
            .iter()
            .map(|n| NodeView {
                node: n.node_id.clone(),
                state: text(&n.local_state),
                channels: n
                    .channel_states
                    .iter()
                    .map(|c| {
                        let channel = c.channel.clone().unwrap_or_default();
                        ChannelView {
                            from: channel.from,
                            to: channel.to,
                            messages: c.messages.iter().map(|m| text(&m.payload)).collect(),
                        }
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// Starts a snapshot in a random mode every 150–250 ms, at whichever replica accepts it
/// (a follower refuses; the next is tried), each call bounded.
pub(super) async fn snapshots(shared: SharedRef, replicas: String, seed: u64) {
    let shared_ref = shared.clone();
    let replicas: Vec<String> = replicas.split(',').map(str::to_owned).collect();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_5eed);
    let mut at = 0;
    let mut client: Option<pb::coordinator_client::CoordinatorClient<Channel>> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(rng.random_range(150..250))).await;
        if lock(&shared).stop {
            return;
        }
        let mode = match rng.random_range(0..3) {
            0 => pb::SnapshotMode::ChandyLamport,
            1 => pb::SnapshotMode::Unaligned,
            _ => pb::SnapshotMode::Aligned,
        };
        let request = pb::StartSnapshotRequest {
            mode: mode as i32,
            timeout_ms: 10_000,
            ..Default::default()
        };
        let started = timeout(CALL_LIMIT, async {
            let mut c = match client.take() {
                Some(c) => c,
                None => pb::coordinator_client::CoordinatorClient::new(
                    cairn_sdk::tls::endpoint(&replicas[at % replicas.len()], None)?
                        .connect_timeout(Duration::from_secs(1))
                        .connect()
                        .await?,
                ),
            };
            let id = c.start_snapshot(request).await?.into_inner().snapshot_id;
            client = Some(c);
            anyhow::Ok(id)
        })
        .await;
        let mut shared = lock(&shared);
        match started {
            Ok(Ok(id)) => {
                shared.last_id = shared.last_id.max(id);
                if let Some(ids) = &mut shared.after_quiet {
                    ids.insert(id);
                }
                let at = shared.history.at();
                shared.push(&Entry::SnapshotStarted {
                    at,
                    id,
                    mode: mode_name(mode as i32),
                });
                if let Some(c) = client.clone() {
                    tokio::spawn(watch_told(shared_ref.clone(), c, id));
                }
            }
            Ok(Err(e)) => {
                let code = e.downcast_ref::<tonic::Status>().map(tonic::Status::code);
                let why = code.map_or_else(|| "no connection".to_owned(), |c| format!("{c:?}"));
                *shared.refused.entry(why).or_default() += 1;
                // The leader at its limit (ResourceExhausted) or fenced by a restore
                // (FailedPrecondition) is still the leader: try it again.
                if !matches!(
                    code,
                    Some(tonic::Code::ResourceExhausted | tonic::Code::FailedPrecondition)
                ) {
                    client = None;
                    at += 1;
                }
            }
            Err(_) => {
                *shared.refused.entry("timed out".into()).or_default() += 1;
                client = None;
                at += 1;
            }
        }
    }
}

pub(super) fn node_index(id: &str) -> usize {
    id.trim_start_matches('n')
        .parse::<usize>()
        .map_or(0, |n| n.saturating_sub(1))
}

/// The `line` of a bank's state JSON.
pub(super) fn line_of(state: Option<&str>) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(state?).ok()?["line"].as_u64()
}

/// Every bank drained: each one's last received from each peer is that peer's last sent.
pub(super) fn drained(banks: &[BankView]) -> bool {
    let states: BTreeMap<&str, serde_json::Value> = banks
        .iter()
        .filter_map(|b| {
            let s = serde_json::from_str(b.state.as_deref()?).ok()?;
            Some((b.node.as_str(), s))
        })
        .collect();
    if states.len() != banks.len() {
        return false;
    }
    states.iter().all(|(a, s)| {
        let line = &s["line"];
        s["sent"].as_object().is_none_or(|sent| {
            sent.iter().all(|(b, id)| {
                states.get(b.as_str()).is_some_and(|r| {
                    let got = &r["received"][*a];
                    got["id"] == *id && got["line"] == *line
                })
            })
        })
    })
}
