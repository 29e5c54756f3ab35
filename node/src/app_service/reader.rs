//! A session's reader: what the application sends (records of its state, sends to its
//! channels, answers) taken off its stream and into the loop, each send against a credit of
//! its channel, a few read ahead while a recorded state is due.

use super::*;

/// Most messages a session reads ahead of a full channel, without credits, while a recorded
/// state is due (so the state, and the cut, are not held up behind a slow peer)…
const READ_AHEAD_MAX: u64 = 1 << 16;
/// …and most a channel owes over time: each state lets the application send up to its
/// window more on debt, which a stalled peer never pays back, so without this bound every
/// snapshot would grow the queue to it (its queue holds at most `--channel-buffer` plus
/// this many; past it a state due waits for the peer like any send).
const DEBT_MAX: u64 = 1 << 16;

pub(super) struct SessionReader {
    /// Record requests handed to the application and not answered yet.
    pub(super) records: Arc<RecordsDue>,
    /// Messages taken in without a credit since the last answer.
    pub(super) read_ahead: AtomicU64,
    pub(super) shared: Arc<Shared>,
    pub(super) loop_tx: mpsc::Sender<LoopMsg>,
    pub(super) session: u64,
    /// Sends taken off the stream, for the application's window.
    pub(super) taken: Arc<SendsTaken>,
}

impl SessionReader {
    pub(super) async fn run(
        &self,
        mut inbound: Streaming<pb::AppToNode>,
        shutdown: CancellationToken,
    ) -> Result<(), Status> {
        use pb::app_to_node::Kind;
        loop {
            let message = tokio::select! {
                _ = shutdown.cancelled() => return Err(Error::ShuttingDown.into()),
                m = inbound.message() => m,
            };
            let kind = match message {
                Ok(Some(pb::AppToNode { kind: Some(kind) })) => kind,
                Ok(Some(_)) => return Err(invalid("empty message").into()),
                Ok(None) => return Ok(()),
                Err(status) => {
                    tracing::debug!(session = self.session, %status, "session stream broke");
                    return Ok(());
                }
            };
            match kind {
                Kind::Send(batch) => {
                    let n = batch.messages.len() as u64
                        + batch
                            .runs
                            .iter()
                            .map(|r| r.lengths.len() as u64)
                            .sum::<u64>();
                    self.send(batch).await?;
                    self.taken.took(n);
                }
                Kind::StateRecorded(state) => {
                    if state.snapshot_id == 0 {
                        return Err(invalid("StateRecorded for snapshot 0").into());
                    }
                    // Wait for upload room: a large state flows on to the coordinator as
                    // it arrives instead of piling up here.
                    let want = state.chunk.len().clamp(1, UPLOAD_ROOM) as u32;
                    let room = self
                        .shared
                        .upload_room
                        .clone()
                        .acquire_many_owned(want)
                        .await
                        .map_err(|_| Error::ShuttingDown)?;
                    let chunk = StateChunk {
                        bytes: state.chunk,
                        room,
                    };
                    let last = state.last;
                    self.to_loop(LoopMsg::AppState {
                        session: self.session,
                        id: SnapshotId(state.snapshot_id),
                        chunk,
                        last,
                        consumed: state.consumed,
                    })
                    .await?;
                    if last && self.records.settled(SnapshotId(state.snapshot_id)) {
                        self.read_ahead.store(0, Ordering::Relaxed);
                    }
                }
                Kind::RestoreApplied(applied) => {
                    self.to_loop(LoopMsg::AppRestoreApplied {
                        session: self.session,
                        restore_id: applied.restore_id,
                    })
                    .await?;
                }
                Kind::Attach(_) => return Err(invalid("Attach sent twice").into()),
            }
        }
    }

    /// Whether a recorded state is due and the read-ahead, and the channel's debt, have room.
    fn may_read_ahead(&self, handles: &ChannelHandles) -> bool {
        self.records.count() > 0
            && self.read_ahead.load(Ordering::Relaxed) < READ_AHEAD_MAX
            && handles.debt.load(Ordering::Acquire) < DEBT_MAX
    }

    /// Takes a message in on credit: the channel's credits pay it back. The peer still
    /// holds the session back (its window stays shrunk).
    fn on_credit(&self, handles: &ChannelHandles) {
        self.taken.held();
        handles.debt.fetch_add(1, Ordering::AcqRel);
        self.read_ahead.fetch_add(1, Ordering::Relaxed);
    }

    async fn to_loop(&self, msg: LoopMsg) -> Result<(), Status> {
        self.loop_tx
            .send(msg)
            .await
            .map_err(|_| Error::ShuttingDown.into())
    }

    /// Checks every message, then forwards them in order, taking one credit each; when a
    /// channel is full what is ready goes first and the session waits (backpressure) —
    /// unless the application owes a recorded state: then the session reads ahead (up to
    /// `READ_AHEAD_MAX` messages, while the channel owes fewer than `DEBT_MAX`), queueing
    /// what it reads on credit, so that the state
    /// behind these sends reaches the loop without waiting for a slow peer. The messages
    /// are queued all the same, before the state, and an unaligned snapshot records them.
    async fn send(&self, batch: pb::SendBatch) -> Result<(), Status> {
        let me = &self.shared.node_id;
        let wiring = self.shared.wiring();
        if !batch.messages.is_empty() && !batch.runs.is_empty() {
            return Err(invalid("a SendBatch carries messages or runs, not both").into());
        }
        // Every message as (destination, payload); a run's payloads are slices of its blob.
        let mut entries: Vec<(&str, Bytes)> = Vec::new();
        for message in &batch.messages {
            entries.push((message.to.as_str(), message.payload.clone()));
        }
        for run in &batch.runs {
            // Each payload's size is checked below, with the message's.
            let payloads = cairn_proto::runs::split(&run.payloads, &run.lengths, usize::MAX)
                .map_err(|e| invalid(&e.to_string()))?;
            entries.extend(payloads.map(|p| (run.to.as_str(), p)));
        }
        let mut checked = Vec::with_capacity(entries.len());
        // The channels this batch names, built once each (a batch names few peers).
        let mut named: Vec<ChannelId> = Vec::new();
        for (to, payload) in entries {
            let channel = match named.iter().find(|c| c.to.as_str() == to) {
                Some(c) => c.clone(),
                None => {
                    let c = ChannelId::new(me.clone(), to);
                    named.push(c.clone());
                    c
                }
            };
            if !wiring.channels.contains_key(&channel) {
                if wiring.removed.contains(&channel.to) {
                    // Sent before the application heard that the peer left.
                    tracing::warn!(%channel, "a send to a removed member: dropped");
                    self.shared.metrics.removed_peer_messages.inc();
                    continue;
                }
                return Err(Error::Unknown(format!(
                    "node {me} has no channel to `{to}`: it is not a member (or was removed)"
                ))
                .into());
            }
            if payload.len() > self.shared.max_payload {
                return Err(Error::PayloadTooLarge {
                    size: payload.len(),
                    limit: self.shared.max_payload,
                }
                .into());
            }
            checked.push((channel, payload));
        }
        let mut ready: Vec<(ChannelId, Bytes)> = Vec::with_capacity(checked.len());
        let mut removed = false;
        for (channel, payload) in checked {
            let handles = &wiring.channels[&channel];
            let credits = &handles.credits;
            match credits.try_acquire() {
                Ok(permit) => permit.forget(),
                Err(_) if self.may_read_ahead(handles) => self.on_credit(handles),
                Err(_) => {
                    if !ready.is_empty() {
                        let sends = std::mem::take(&mut ready);
                        self.to_loop(LoopMsg::AppSend {
                            session: self.session,
                            sends,
                        })
                        .await?;
                    }
                    // Wait for a credit — or for a record request, which lets the session
                    // read ahead. The peer holds the session back: its window shrinks.
                    self.taken.held();
                    loop {
                        let woken = self.records.wake.notified();
                        if self.may_read_ahead(handles) {
                            self.on_credit(handles);
                            break;
                        }
                        tokio::select! {
                            permit = credits.acquire() => {
                                match permit {
                                    Ok(permit) => permit.forget(),
                                    // Closed: the peer was removed while this send waited
                                    // for room (the loop dropped the channel).
                                    Err(_) if self.shared.wiring().removed.contains(&channel.to) => {
                                        tracing::warn!(%channel, "a send to a removed member: dropped");
                                        self.shared.metrics.removed_peer_messages.inc();
                                        removed = true;
                                    }
                                    Err(_) => return Err(Error::ShuttingDown.into()),
                                }
                                break;
                            }
                            _ = woken => {}
                        }
                    }
                }
            }
            if std::mem::take(&mut removed) {
                continue;
            }
            ready.push((channel, payload));
        }
        if !ready.is_empty() {
            self.to_loop(LoopMsg::AppSend {
                session: self.session,
                sends: ready,
            })
            .await?;
        }
        Ok(())
    }
}
