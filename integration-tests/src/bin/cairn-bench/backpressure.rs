//! Scenario c: one slow application behind a backlog; each mode's latency, recorded
//! messages and where the backlog waits.

use super::*;

/// c. One slow application (a fixed delay per message) behind a backlog: each mode's
/// latency and recorded channel state, at three channel buffers (the backlog grows with the
/// buffer: 8,000 gives issue 34's 4× larger backlog, 50,000 the large one; `--channel-buffers`
/// picks others). The modes alternate in rounds (the backlog drifts); the backlog is
/// measured as each snapshot starts; the daemons' peak resident sets are read at the end.
pub(super) async fn backpressure(
    args: &Args,
    store: &Store,
    report: &mut Report,
) -> anyhow::Result<()> {
    let (buffers, rounds, delay) = if args.quick {
        (&[300u64][..], 1, Duration::from_micros(100))
    } else {
        (
            &[2_000u64, 8_000, 50_000][..],
            3,
            Duration::from_micros(250),
        )
    };
    let buffers = if args.channel_buffers.is_empty() {
        buffers
    } else {
        &args.channel_buffers[..]
    };
    for &buffer in buffers {
        backpressure_at(
            buffer,
            args.queue_target.as_deref(),
            rounds,
            delay,
            store,
            report,
        )
        .await?;
    }
    Ok(())
}

pub(super) async fn backpressure_at(
    buffer: u64,
    queue_target: Option<&str>,
    rounds: usize,
    delay: Duration,
    store: &Store,
    report: &mut Report,
) -> anyhow::Result<()> {
    let buffer_arg = buffer.to_string();
    let mut node_args = vec!["--channel-buffer", &buffer_arg];
    if let Some(target) = queue_target {
        node_args.extend(["--queue-target", target]);
    }
    let cluster = BenchCluster::start(3, store, &[], &node_args, 1024).await?;
    // n1 and n2 flood n3, whose application spends `delay` on each message.
    *cluster.apps[2].delay.lock().expect("never poisoned") = delay;
    cluster.apps[0].set_load(Load::Flood);
    cluster.apps[1].set_load(Load::Flood);
    // Wait until the backlog is built: n3 lags the others by at least twice the buffer
    // (debloated queues hold less: a backlog of a few hundred then, the rest held in the
    // senders' applications).
    let want = if queue_target.is_some() {
        (buffer * 2).min(512)
    } else {
        buffer * 2
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while cluster.sent() - cluster.received() < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // (name, mode, alignment timeout in ms, initiators: none lets the coordinator choose:
    // every node for UNALIGNED, as Flink triggers every source; one node otherwise). The
    // one-initiator UNALIGNED line is the A/B of that default (issue 34): n1, the node the
    // coordinator chose before.
    let cases: [(&str, pb::SnapshotMode, u64, &[&str]); 5] = [
        ("ALIGNED", pb::SnapshotMode::Aligned, 0, &[]),
        ("CHANDY_LAMPORT", pb::SnapshotMode::ChandyLamport, 0, &[]),
        (
            "UNALIGNED (every node initiates)",
            pb::SnapshotMode::Unaligned,
            0,
            &[],
        ),
        (
            "UNALIGNED, n1 alone initiates",
            pb::SnapshotMode::Unaligned,
            0,
            &["n1"],
        ),
        (
            "ALIGNED, 100 ms alignment timeout",
            pb::SnapshotMode::Aligned,
            100,
            &[],
        ),
    ];
    let mut results: Vec<Samples> = vec![Default::default(); cases.len()];
    for _ in 0..rounds {
        for (i, (name, mode, alignment, initiators)) in cases.iter().enumerate() {
            let backlog = cluster.sent() - cluster.received();
            let buffers = buffers_to_n3(&cluster).await?;
            let (ms, s) = cluster
                .snapshot(pb::StartSnapshotRequest {
                    mode: *mode as i32,
                    timeout_ms: 300_000,
                    alignment_timeout_ms: *alignment,
                    initiators: initiators.iter().map(|n| n.to_string()).collect(),
                    ..Default::default()
                })
                .await?;
            anyhow::ensure!(
                s.status == pb::SnapshotStatus::Completed as i32,
                "{name}: {:?}",
                s.failure
            );
            results[i].0.push(ms);
            results[i]
                .1
                .push(s.verdict.as_ref().map_or(0, |v| v.recorded_messages));
            results[i].2.push(backlog);
            results[i].3.push(buffers);
            results[i].4.push(phases(&s));
        }
    }
    // Memory: the slow node's daemon and a flooding one's, at their peaks.
    let peak = |i: usize| -> anyhow::Result<u64> {
        let pid = cluster
            .cluster
            .node_pid(i)
            .ok_or_else(|| anyhow::anyhow!("no daemon n{}", i + 1))?;
        peak_rss(pid)
    };
    let (sender_peak, receiver_peak) = (peak(0)?, peak(2)?);
    report.section(
        &format!(
            "c. Backpressure (n3's app takes {delay:?} per message; n1, n2 flood it; --channel-buffer {buffer}{}; {rounds} round(s) of the five; daemon peaks: n1 {} MiB, n3 {} MiB)",
            queue_target.map_or(String::new(), |t| format!(", --queue-target {t}")),
            mib(sender_peak),
            mib(receiver_peak)
        ),
        &["mode", "backlog at start (mean)", "p50 ms", "max ms", "recorded messages (mean)", "recorded bytes (mean)",
          "at start (mean): senders' send windows · senders' queues · wire + held · n3's inbox · n3's app window",
          "p50 ms from the start: n1's · n2's · n3's state recorded; from the last: → last part stored"],
    );
    let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
    for ((name, ..), (lat, recorded, backlog, buffers, phases)) in cases.iter().zip(&results) {
        let to_state =
            |i: usize| quantile(&phases.iter().map(|p| p.states[i]).collect::<Vec<_>>(), 0.5);
        let to_states = [to_state(0), to_state(1), to_state(2)];
        let to_parts = quantile(&phases.iter().map(|p| p.to_part).collect::<Vec<_>>(), 0.5);
        let payload = 16.0;
        let recorded = mean(recorded);
        let of = |f: fn(&Buffers) -> u64| mean(&buffers.iter().map(f).collect::<Vec<_>>());
        let (sending, queues, wire, inbox, window) = (
            of(|b| b.sending),
            of(|b| b.queues),
            of(|b| b.wire),
            of(|b| b.inbox),
            of(|b| b.window),
        );
        report.row(
            vec![
                (*name).into(),
                format!("{:.0}", mean(backlog)),
                f1(quantile(lat, 0.5)),
                f1(lat.iter().copied().fold(0.0, f64::max)),
                format!("{recorded:.0}"),
                format!("{:.0}", recorded * payload),
                format!("{sending:.0} · {queues:.0} · {wire:.0} · {inbox:.0} · {window:.0}"),
                format!(
                    "{:.0} · {:.0} · {:.0}; {to_parts:.0}",
                    to_states[0], to_states[1], to_states[2]
                ),
            ],
            json!({"scenario": "c", "buffer": buffer, "queue_target": queue_target, "mode": name, "backlog": mean(backlog),
                   "p50_ms": quantile(lat, 0.5),
                   "max_ms": lat.iter().copied().fold(0.0, f64::max), "recorded_messages": recorded,
                   "recorded_bytes": recorded * payload,
                   "buffers_at_start": {"send_windows": sending, "sender_queues": queues, "wire_and_held": wire, "inbox": inbox,
                                        "app_window": window},
                   "p50_ms_to_state": {"n1": to_states[0], "n2": to_states[1], "n3": to_states[2]},
                   "p50_ms_state_to_last_part": to_parts,
                   "daemon_peak_bytes": {"n1": sender_peak, "n3": receiver_peak}}),
        );
    }
    Ok(())
}

/// One mode's samples in scenario c: latencies (ms), recorded messages, backlogs at start,
/// where the backlog waited at start, and the snapshot's [`phases`].
pub(super) type Samples = (Vec<f64>, Vec<u64>, Vec<u64>, Vec<Buffers>, Vec<Phases>);

/// Where a snapshot's time went, from its own events (the coordinator's clock, ms): from its
/// start to each node's state recorded (n1, n2: the flooding senders; n3: the slow
/// receiver), and from the last of them to the last part stored (the channels' recording,
/// the upload and the store).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Phases {
    pub(super) states: [f64; 3],
    pub(super) to_part: f64,
}

pub(super) fn phases(s: &pb::Snapshot) -> Phases {
    use pb::snapshot_event::Kind;
    let last = |kind: Kind, node: Option<&str>| {
        s.events
            .iter()
            .filter(|e| e.kind == kind as i32 && node.is_none_or(|n| e.node_id == n))
            .map(|e| e.at_ms)
            .max()
    };
    let started = last(Kind::Started, None).unwrap_or(0);
    let states = ["n1", "n2", "n3"].map(|n| {
        last(Kind::StateRecorded, Some(n)).map_or(0.0, |at| at.saturating_sub(started) as f64)
    });
    let state = last(Kind::StateRecorded, None).unwrap_or(started);
    let part = last(Kind::PartStored, None).unwrap_or(state);
    Phases {
        states,
        to_part: part.saturating_sub(state) as f64,
    }
}

/// Where scenario c's backlog towards n3 waits, read from the daemons' `GetNodeStatus`
/// (one daemon after another, so the parts are approximate while the flood goes on).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Buffers {
    /// Messages n1's and n2's applications sent that their daemons have not taken yet: in
    /// the SDK's send window (at most 8,192 each) and the session's stream.
    pub(super) sending: u64,
    /// Items in n1's and n2's outgoing queues to n3 (an unaligned marker overtakes them; an
    /// aligned one, once its timeout passes there).
    pub(super) queues: u64,
    /// Messages pulled off those queues and not yet in n3's inbox: on the wire, in the peer
    /// streams, or received and held (bounded by the credits n3 grants).
    pub(super) wire: u64,
    /// n3's inbox (a record request goes ahead of it).
    pub(super) inbox: u64,
    /// Messages handed to n3's application and not yet consumed: what a record request
    /// waits behind.
    pub(super) window: u64,
}

pub(super) async fn buffers_to_n3(cluster: &BenchCluster) -> anyhow::Result<Buffers> {
    let status = |i: usize| async move {
        let mut admin = cluster.cluster.admin(i).await?;
        anyhow::Ok(
            admin
                .get_node_status(pb::GetNodeStatusRequest {})
                .await?
                .into_inner(),
        )
    };
    let (n1, n2) = (status(0).await?, status(1).await?);
    // Read between the senders' statuses and n3's, closest to the former it is compared with.
    let sent = cluster.apps[0].sent.load(Relaxed) + cluster.apps[1].sent.load(Relaxed);
    let n3 = status(2).await?;
    let to_n3 = |s: &pb::NodeStatus| {
        s.channels
            .iter()
            .find(|c| {
                c.channel
                    .as_ref()
                    .is_some_and(|c| c.from == s.node_id && c.to == "n3")
            })
            .cloned()
            .unwrap_or_default()
    };
    let (c1, c2) = (to_n3(&n1), to_n3(&n2));
    // What the two senders' daemons took off their sessions, on every outgoing channel,
    // since they started (as the applications' counts are).
    let taken: u64 = [&n1, &n2]
        .iter()
        .flat_map(|s| {
            s.channels
                .iter()
                .filter(move |c| c.channel.as_ref().is_some_and(|c| c.from == s.node_id))
        })
        .map(|c| c.data_messages)
        .sum();
    // Data indices the senders pulled off their queues (queued items are data but for a
    // marker or two), against what n3 has handed its application.
    let pulled =
        (c1.next_index.saturating_sub(c1.queued)) + (c2.next_index.saturating_sub(c2.queued));
    let delivered: u64 = n3
        .channels
        .iter()
        .filter(|c| c.channel.as_ref().is_some_and(|c| c.to == "n3"))
        .map(|c| c.next_index)
        .sum();
    let window = n3
        .delivery_window
        .map_or(0, |w| w.handed.saturating_sub(w.consumed));
    Ok(Buffers {
        sending: sent.saturating_sub(taken),
        queues: c1.queued + c2.queued,
        wire: pulled
            .saturating_sub(delivered)
            .saturating_sub(n3.inbox_depth),
        inbox: n3.inbox_depth,
        window,
    })
}
