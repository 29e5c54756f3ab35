//! The session's writer: one task that puts what the application sends on the stream in
//! order, sends coalesced into batches and states cut into chunks, counting what it wrote.

use super::*;

/// What the writer counts as it writes sends, and what it gives back.
pub(super) struct Written {
    /// The application's send window.
    pub(super) room: Arc<Semaphore>,
    /// Room comes back as sends are written (no `Consumed` stream), not as taken.
    pub(super) on_write: Arc<AtomicBool>,
    /// Sends written so far.
    pub(super) written: Arc<AtomicU64>,
    /// Sends are confirmed as written (the daemon does not report what it takes).
    pub(super) confirm_on_write: Arc<AtomicBool>,
    /// Sends confirmed so far ([`AppSender::flushed`]).
    pub(super) confirmed: Arc<watch::Sender<(u64, bool)>>,
}

/// Raises the confirmed count to `n` (never lowers it: the writer and the flow task both
/// confirm, and may race).
pub(super) fn confirm(confirmed: &watch::Sender<(u64, bool)>, n: u64) {
    confirmed.send_if_modified(|(c, closed)| {
        let raise = n > *c && !*closed;
        if raise {
            *c = n;
        }
        raise
    });
}

/// No more sends will be confirmed: [`AppSender::flushed`] stops waiting.
pub(super) fn close(confirmed: &watch::Sender<(u64, bool)>) {
    confirmed.send_if_modified(|(_, closed)| !std::mem::replace(closed, true));
}

/// Coalesces consecutive sends into batches, keeping the order of everything sent, and
/// splits states into chunks. Counts the messages `written`; gives their `room` back as
/// it writes them only for a daemon without flow control (else the daemon says when it
/// took them).
pub(super) async fn write_loop(
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    wire: mpsc::Sender<pb::AppToNode>,
    counts: Written,
) {
    use pb::app_to_node::Kind;
    let Written {
        room,
        on_write,
        written,
        confirm_on_write,
        confirmed,
    } = counts;
    let mut next = rx.recv().await;
    while let Some(item) = next.take() {
        let messages: Vec<Kind> = match item {
            Outgoing::State(snapshot_id, consumed, state) => chunks(&state)
                .enumerate()
                .map(|(i, (chunk, last))| {
                    Kind::StateRecorded(pb::StateRecorded {
                        snapshot_id,
                        chunk,
                        last,
                        // The cut is the first chunk's.
                        consumed: consumed.filter(|_| i == 0),
                    })
                })
                .collect(),
            Outgoing::RestoreApplied(restore_id) => {
                vec![Kind::RestoreApplied(pb::RestoreApplied { restore_id })]
            }
            Outgoing::Send(to, payload) => {
                // Consecutive sends to one node share a run: one blob plus lengths.
                let mut runs = cairn_proto::runs::RunBuilder::default();
                let mut n = 1;
                let mut bytes = payload.len();
                runs.push(to, payload);
                while n < SEND_BATCH && bytes < SEND_BATCH_BYTES {
                    match rx.try_recv() {
                        Ok(Outgoing::Send(to, payload)) => {
                            n += 1;
                            bytes += payload.len();
                            runs.push(to, payload);
                        }
                        Ok(other) => {
                            next = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                let runs = runs
                    .finish()
                    .map(|(to, payloads, lengths)| pb::SendRun {
                        to,
                        payloads,
                        lengths,
                    })
                    .collect();
                let kind = Kind::Send(pb::SendBatch {
                    messages: Vec::new(),
                    runs,
                });
                // Counted before they can be taken.
                written.fetch_add(n as u64, Ordering::AcqRel);
                if wire.send(pb::AppToNode { kind: Some(kind) }).await.is_err() {
                    return;
                }
                if on_write.load(Ordering::Acquire) {
                    room.add_permits(n);
                }
                if confirm_on_write.load(Ordering::Acquire) {
                    confirm(&confirmed, written.load(Ordering::Acquire));
                }
                Vec::new()
            }
        };
        for kind in messages {
            if wire.send(pb::AppToNode { kind: Some(kind) }).await.is_err() {
                return;
            }
        }
        if next.is_none() {
            next = rx.recv().await;
        }
    }
}

/// A state as chunks of at most `STATE_CHUNK` bytes, each with whether it is the last.
pub(super) fn chunks(state: &Bytes) -> impl Iterator<Item = (Bytes, bool)> + '_ {
    let n = state.len().div_ceil(STATE_CHUNK).max(1);
    (0..n).map(move |i| {
        let end = ((i + 1) * STATE_CHUNK).min(state.len());
        (state.slice(i * STATE_CHUNK..end), i + 1 == n)
    })
}
