//! Flow control sized to the application: the delivery window (messages handed to the
//! application and not yet consumed) and the credit room of each incoming peer channel
//! (messages a sender may have on the wire or in this daemon's inbox), both measured from
//! the rate at which the application consumes, as Flink's buffer debloating does
//! (FLIP-183). What waits ahead of a record request or a marker is then about
//! [`APP_TARGET`] and [`PEER_TARGET`] of the application's work, whatever the backlog;
//! the rest of a backlog waits in the senders' queues, where an unaligned marker overtakes
//! it. On the sending side, the [`SendWindow`] bounds the application's sends on their way
//! to the daemon to about [`SEND_TARGET`] of what the daemon takes while a peer holds it
//! back, so that a recorded state sent behind them waits behind little. With
//! `--queue-target`, the [`QueueBound`] also bounds each outgoing queue to that long of its
//! peer's measured pace (buffer debloating at the sender).
//! docs/architecture.md §3.2 describes the protocol.

use std::time::{Duration, Instant};

/// Work handed to the application ahead of a record request.
pub(crate) const APP_TARGET: Duration = Duration::from_millis(50);
/// Work on the wire and in the inbox, shared by the incoming channels.
pub(crate) const PEER_TARGET: Duration = Duration::from_millis(100);
/// Fewest messages in the delivery window (a floor for throughput: the window never
/// shrinks to where the round trip to the application, not the application, bounds it).
pub(crate) const APP_FLOOR: u64 = 64;
/// Most messages in the delivery window.
pub(crate) const APP_MAX: u64 = 32_768;
/// The delivery window before the application's pace is measured (it then grows or
/// shrinks at once: a window that holds the application back measures its pace).
pub(crate) const APP_INITIAL: (u64, u64) = (1024, 1 << 20);
/// Fewest bytes in the delivery window (and at least one message, however large).
pub(crate) const APP_FLOOR_BYTES: u64 = 256 << 10;
/// Most bytes in the delivery window.
pub(crate) const APP_MAX_BYTES: u64 = 8 << 20;
/// Fewest credits of an incoming channel.
pub(crate) const PEER_FLOOR: u64 = 64;
/// Sends on their way and not taken, in time at the rate the daemon takes them while a
/// peer holds it back.
pub(crate) const SEND_TARGET: Duration = Duration::from_millis(20);
/// Fewest sends in the send window: one batch of the SDK's.
pub(crate) const SEND_FLOOR: u64 = 256;
/// Most sends in the send window: the SDK's own bound.
pub(crate) const SEND_MAX: u64 = 8192;
/// Shortest interval the consumption rate is measured over.
const SAMPLE: Duration = Duration::from_millis(20);
/// Weight of a new sample in the rate's moving average.
const ALPHA: f64 = 0.3;

/// The application's delivery window.
#[derive(Debug)]
pub(crate) struct DeliveryWindow {
    /// The application acknowledges what it consumes (else: no window, as before).
    acks: bool,
    handed: u64,
    handed_bytes: u64,
    consumed: u64,
    consumed_bytes: u64,
    /// Messages and bytes per second the application consumes while it is the bottleneck;
    /// `None` until measured.
    rate: Option<(f64, f64)>,
    sample: Option<(Instant, u64, u64)>,
    /// The window was full with messages waiting since the last sample: the application,
    /// not the supply, set the pace.
    limited: bool,
}

impl DeliveryWindow {
    pub(crate) fn new(acks: bool) -> Self {
        Self {
            acks,
            handed: 0,
            handed_bytes: 0,
            consumed: 0,
            consumed_bytes: 0,
            rate: None,
            sample: None,
            limited: false,
        }
    }

    /// The window's size now: messages and bytes.
    pub(crate) fn size(&self) -> (u64, u64) {
        match self.rate {
            None => APP_INITIAL,
            Some((messages, bytes)) => {
                let t = APP_TARGET.as_secs_f64();
                (
                    ((messages * t) as u64).clamp(APP_FLOOR, APP_MAX),
                    ((bytes * t) as u64).clamp(APP_FLOOR_BYTES, APP_MAX_BYTES),
                )
            }
        }
    }

    /// How many more messages, and bytes, may be handed over now (`None`: no window).
    /// Bytes bound a batch only after its first message, so a message of any size goes.
    pub(crate) fn room(&self) -> Option<(u64, u64)> {
        if !self.acks {
            return None;
        }
        let (messages, bytes) = self.size();
        let out = self.handed.saturating_sub(self.consumed);
        let out_bytes = self.handed_bytes.saturating_sub(self.consumed_bytes);
        if out >= messages || out_bytes >= bytes {
            return Some((0, 0));
        }
        Some((messages - out, bytes - out_bytes))
    }

    /// Whether the application acknowledges what it consumes (its `Consumed` stream is
    /// open): without, there is no window. The counts so far stay.
    pub(crate) fn acknowledged(&mut self, on: bool) {
        self.acks = on;
    }

    /// The window for `GetNodeStatus` (`records_pending` is the caller's to fill in).
    pub(crate) fn status(&self) -> cairn_proto::v1::DeliveryWindowStatus {
        let (size_messages, size_bytes) = self.size();
        cairn_proto::v1::DeliveryWindowStatus {
            acknowledges: self.acks,
            size_messages,
            size_bytes,
            handed: self.handed,
            handed_bytes: self.handed_bytes,
            consumed: self.consumed,
            consumed_bytes: self.consumed_bytes,
            records_pending: 0,
        }
    }

    /// The window is full while messages wait: note that the application sets the pace.
    pub(crate) fn full_with_backlog(&mut self) {
        self.limited = true;
    }

    /// Messages handed over and consumed since the session opened.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (self.handed, self.consumed)
    }

    /// Whether the application acknowledges what it consumes (so a window applies).
    pub(crate) fn acknowledges(&self) -> bool {
        self.acks
    }

    pub(crate) fn handed(&mut self, messages: u64, bytes: u64) {
        self.handed = self.handed.saturating_add(messages);
        self.handed_bytes = self.handed_bytes.saturating_add(bytes);
    }

    /// The application's cumulative consumption. Counts above what was handed, or below
    /// what it said before, are not believed (they only ever grow up to what was handed).
    pub(crate) fn consumed(&mut self, messages: u64, bytes: u64, now: Instant) {
        self.consumed = messages.clamp(self.consumed, self.handed);
        self.consumed_bytes = bytes.clamp(self.consumed_bytes, self.handed_bytes);
        let Some((at, m0, b0)) = self.sample else {
            self.sample = Some((now, self.consumed, self.consumed_bytes));
            return;
        };
        let elapsed = now.saturating_duration_since(at);
        if elapsed < SAMPLE {
            return;
        }
        if std::mem::take(&mut self.limited) {
            let secs = elapsed.as_secs_f64();
            let m = (self.consumed - m0) as f64 / secs;
            let b = (self.consumed_bytes - b0) as f64 / secs;
            self.rate = Some(match self.rate {
                None => (m, b),
                Some((rm, rb)) => (rm + ALPHA * (m - rm), rb + ALPHA * (b - rb)),
            });
        }
        self.sample = Some((now, self.consumed, self.consumed_bytes));
    }

    /// Credits of one of `channels` incoming channels: their share of [`PEER_TARGET`] of
    /// the application's measured work, at least [`PEER_FLOOR`], at most the channel's
    /// buffer.
    pub(crate) fn peer_room(&self, buffer: u64, channels: usize) -> u64 {
        match (self.acks, self.rate) {
            (true, Some((messages, _))) => {
                let share = messages * PEER_TARGET.as_secs_f64() / channels.max(1) as f64;
                (share as u64).clamp(PEER_FLOOR.min(buffer), buffer)
            }
            _ => buffer,
        }
    }
}

/// The application's send window, as the daemon advises it (`Taken.window`): the sends it
/// may have on their way and not taken. While the daemon waits for a peer's credits to take
/// them, about [`SEND_TARGET`] of the rate it takes them at (at least [`SEND_FLOOR`]); it
/// doubles with each sample in which nothing held the daemon back, up to [`SEND_MAX`] (a
/// peer that drains in bursts does not open it at once). A state the application records
/// follows its sends, so this is what it waits behind — and what an unaligned snapshot
/// records of them — rather than a full window read ahead past a full queue.
#[derive(Debug)]
pub(crate) struct SendWindow {
    taken: u64,
    /// Sends per second taken while a peer held the session back; `None`: not held back.
    rate: Option<f64>,
    sample: Option<(Instant, u64)>,
    /// The session waited for a peer's credit since the last sample.
    held: bool,
}

impl Default for SendWindow {
    fn default() -> Self {
        Self::new()
    }
}

impl SendWindow {
    pub(crate) fn new() -> Self {
        Self {
            taken: 0,
            rate: None,
            sample: None,
            held: false,
        }
    }

    /// The window now, in messages.
    pub(crate) fn size(&self) -> u64 {
        self.rate.map_or(SEND_MAX, |rate| {
            ((rate * SEND_TARGET.as_secs_f64()) as u64).clamp(SEND_FLOOR, SEND_MAX)
        })
    }

    /// The session waits for a peer's credit to take a send.
    pub(crate) fn held(&mut self) {
        self.held = true;
    }

    /// The session took `n` more sends at `now`.
    pub(crate) fn took(&mut self, n: u64, now: Instant) {
        self.taken = self.taken.saturating_add(n);
        let Some((at, t0)) = self.sample else {
            self.sample = Some((now, self.taken));
            return;
        };
        let elapsed = now.saturating_duration_since(at);
        if elapsed < SAMPLE {
            return;
        }
        self.rate = if std::mem::take(&mut self.held) {
            let r = (self.taken - t0) as f64 / elapsed.as_secs_f64();
            Some(self.rate.map_or(r, |old| old + ALPHA * (r - old)))
        } else {
            // Nothing held the session back: the window doubles (the rate it stands for
            // does, from at least the floor's), and is gone once at its top.
            self.rate
                .map(|r| r.max(SEND_FLOOR as f64 / SEND_TARGET.as_secs_f64()) * 2.0)
                .filter(|r| r * SEND_TARGET.as_secs_f64() < SEND_MAX as f64)
        };
        self.sample = Some((now, self.taken));
    }
}

/// Fewest messages an outgoing channel's queue is bounded to by [`QueueBound`].
pub(crate) const QUEUE_FLOOR: u64 = 256;
/// Past this the bound is dropped (the channel's buffer bounds it again).
const QUEUE_UNBOUNDED: u64 = 1 << 24;

/// Buffer debloating at the sender (`--queue-target`, off by default): an outgoing
/// channel's queue (with what is on the wire and not acknowledged) is bounded to the time
/// it takes the peer to drain it, measured as the rate at which the peer's credit limit
/// advances while it holds the channel back — what the peer's application consumes — at
/// least [`QUEUE_FLOOR`] and never above the channel's buffer. A peer that keeps up never
/// holds the channel back: the bound then doubles with each sample until it is the buffer,
/// so it does not limit the rate it is measured from (as long as the target is well above
/// the round trip: the bound counts what is on the wire too). The rest of a backlog waits
/// in the sending application, behind its send window, where no snapshot records it.
#[derive(Debug)]
pub(crate) struct QueueBound {
    target: Duration,
    /// Data indices per second the peer granted while it held the channel back; `None`:
    /// unbounded (it kept up long enough for the bound to pass any buffer).
    rate: Option<f64>,
    /// The sample running: since when, from which limit, and whether data was waiting at
    /// the grant that began it (an interval is the peer's pace only if data waited at both
    /// its ends: one that began with nothing waiting — idle, or the sender the bottleneck —
    /// is not).
    sample: Option<(Instant, u64, bool)>,
}

impl QueueBound {
    /// Starts at the floor and opens as the peer keeps up (doubling with each sample), so
    /// that a flood at the start does not fill a whole buffer before the peer's pace is
    /// known.
    pub(crate) fn new(target: Duration) -> Self {
        Self {
            target,
            rate: Some(QUEUE_FLOOR as f64 / target.as_secs_f64().max(1e-3)),
            sample: None,
        }
    }

    /// The channel starts over (a restarted peer, a new epoch): its limits start again, and
    /// so does the sample. The rate stays (the same peer, most likely at its pace).
    pub(crate) fn restart(&mut self) {
        self.sample = None;
    }

    /// The peer stopped granting credits: nothing to measure, no bound.
    pub(crate) fn unbounded(&mut self) {
        self.rate = None;
        self.sample = None;
    }

    /// The peer granted data up to index `limit` at `now`; `held`: data was waiting for
    /// the credit when it came.
    pub(crate) fn granted(&mut self, limit: u64, held: bool, now: Instant) {
        let Some((at, l0, waited)) = self.sample else {
            self.sample = Some((now, limit, held));
            return;
        };
        if limit < l0 {
            // The channel started over unannounced: so does the sample.
            self.sample = Some((now, limit, held));
            return;
        }
        let elapsed = now.saturating_duration_since(at);
        if elapsed < SAMPLE {
            return;
        }
        if held && !waited {
            // Held back now, but not when the interval began (idle, or the sender the
            // bottleneck, then a burst): the interval is not the peer's pace. Measure from
            // here.
            self.sample = Some((now, limit, true));
            return;
        }
        let target = self.target.as_secs_f64();
        self.rate = if held {
            let r = (limit - l0) as f64 / elapsed.as_secs_f64();
            Some(self.rate.map_or(r, |old| old + ALPHA * (r - old)))
        } else {
            // Nothing waiting at its end: the bound doubles (from at least the floor) with
            // each such sample, as the send window does, rather than opening at once to a
            // buffer a burst would fill; it is gone once past any buffer.
            self.rate
                .map(|r| r.max(QUEUE_FLOOR as f64 / target) * 2.0)
                .filter(|r| r * target < QUEUE_UNBOUNDED as f64)
        };
        self.sample = Some((now, limit, held));
    }

    /// Messages the channel may hold queued and unacknowledged, of its `buffer`.
    pub(crate) fn bound(&self, buffer: u64) -> u64 {
        self.rate.map_or(buffer, |rate| {
            ((rate * self.target.as_secs_f64()) as u64).clamp(QUEUE_FLOOR.min(buffer), buffer)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_is_bounded_by_the_time_its_peer_takes_to_drain_it_while_the_peer_holds_it_back() {
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let mut q = QueueBound::new(Duration::from_millis(100));
        assert_eq!(q.bound(50_000), QUEUE_FLOOR, "not measured: from the floor");
        q.granted(0, true, at(0));
        // The peer grants 2,000 a second while data waits for it: 100 ms of that.
        for i in 1..=5 {
            q.granted(i * 40, true, at(i * 20));
        }
        assert_eq!(q.bound(50_000), 200.max(QUEUE_FLOOR));
        // Faster: 50,000 a second, the moving average follows up.
        let mut limit = 200;
        for i in 6..40 {
            limit += 1_000;
            q.granted(limit, true, at(i * 20));
        }
        assert!(
            (4_900..=5_000).contains(&q.bound(50_000)),
            "{}",
            q.bound(50_000)
        );
        assert_eq!(q.bound(2_000), 2_000, "never above the buffer");
        // Samples in which nothing waited for credit: the peer keeps up, the bound doubles
        // with each, and is gone once past any buffer.
        q.granted(limit + 10, false, at(40 * 20));
        assert!(
            (9_800..=10_000).contains(&q.bound(50_000)),
            "{}",
            q.bound(50_000)
        );
        for i in 41..52 {
            q.granted(limit + 10, false, at(i * 20));
        }
        assert_eq!(q.bound(u64::MAX), u64::MAX);
        // The channel starting over starts the sample over, and a slow peer bounds it to
        // the floor.
        q.restart();
        q.granted(0, true, at(52 * 20));
        q.granted(1, true, at(53 * 20));
        assert_eq!(q.bound(50_000), QUEUE_FLOOR);
        assert_eq!(q.bound(100), 100, "the floor never above the buffer");
        // Idle, then a burst: the interval that began with nothing waiting is not the
        // peer's pace (it would measure the idle time), so the bound does not fall for it.
        let mut q = QueueBound::new(Duration::from_millis(100));
        let mut limit = 0;
        for i in 0..30 {
            q.granted(limit, true, at(i * 20));
            limit += 1_000;
        }
        let before = q.bound(50_000);
        assert!(
            (4_900..=5_000).contains(&before),
            "50,000 a second: {before}"
        );
        q.granted(limit, false, at(30 * 20));
        q.granted(limit + 10, true, at(5_000));
        assert!(q.bound(50_000) >= before, "{}", q.bound(50_000));
        // A peer that stops granting credits leaves the channel unbounded.
        q.unbounded();
        assert_eq!(q.bound(50_000), 50_000);
    }

    #[test]
    fn the_window_follows_the_measured_rate_within_its_bounds() {
        let start = Instant::now();
        let mut w = DeliveryWindow::new(true);
        assert_eq!(w.size(), APP_INITIAL);
        w.handed(10_000, 160_000);
        w.consumed(0, 0, start);
        // 4,000 messages of 16 bytes a second while the window held it back.
        w.full_with_backlog();
        w.consumed(400, 6_400, start + Duration::from_millis(100));
        assert_eq!(w.size(), (200, APP_FLOOR_BYTES));
        assert_eq!(w.room(), Some((0, 0)), "9,600 out: full");
        assert_eq!(w.peer_room(2_000, 1), 400);
        assert_eq!(w.peer_room(2_000, 2), 200, "shared by the channels");
        assert_eq!(w.peer_room(2_000, 100), PEER_FLOOR);
        assert_eq!(w.peer_room(100, 1), 100, "never above the buffer");
        // Not held back by the window: the supply set the pace, the rate stays.
        w.consumed(500, 8_000, start + Duration::from_millis(200));
        assert_eq!(w.size().0, 200);
        // Counts are not believed beyond what was handed, nor backwards.
        w.consumed(u64::MAX, u64::MAX, start + Duration::from_millis(201));
        assert_eq!(w.room(), Some((200, APP_FLOOR_BYTES)));
        w.consumed(5, 5, start + Duration::from_millis(202));
        assert_eq!(w.room(), Some((200, APP_FLOOR_BYTES)));
    }

    #[test]
    fn the_send_window_shrinks_while_a_peer_holds_the_session_back_and_reopens_after() {
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let mut w = SendWindow::new();
        assert_eq!(w.size(), SEND_MAX);
        w.took(100, at(0));
        // 100,000 a second taken, waiting for credits: 20 ms of it.
        w.held();
        w.took(2_000, at(20));
        assert_eq!(w.size(), 2_000);
        // A slow peer: 2,000 a second (the moving average follows), then the floor.
        for i in 2..40 {
            w.held();
            w.took(40, at(i * 20));
        }
        assert_eq!(w.size(), SEND_FLOOR);
        // A sample too short changes nothing.
        w.took(1, at(790));
        assert_eq!(w.size(), SEND_FLOOR);
        // Samples in which nothing held the session back: the window doubles each time,
        // up to its top.
        let mut sizes = Vec::new();
        for i in 0..6 {
            w.took(5_000, at(800 + i * 20));
            sizes.push(w.size());
        }
        assert_eq!(sizes, [512, 1024, 2048, 4096, SEND_MAX, SEND_MAX]);
        // A fast peer that holds it back now and then leaves the window at its top.
        w.held();
        w.took(1_000_000, at(920));
        assert_eq!(w.size(), SEND_MAX);
        // Counts past the top saturate.
        w.took(u64::MAX, at(940));
        assert_eq!(w.size(), SEND_MAX);
    }

    #[test]
    fn without_acknowledgements_there_is_no_window() {
        let w = DeliveryWindow::new(false);
        assert_eq!(w.room(), None);
        assert_eq!(w.peer_room(2_000, 1), 2_000);
    }
}
