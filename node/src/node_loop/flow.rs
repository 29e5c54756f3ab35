//! Flow control sized to the application: the delivery window (messages handed to the
//! application and not yet consumed) and the credit room of each incoming peer channel
//! (messages a sender may have on the wire or in this daemon's inbox), both measured from
//! the rate at which the application consumes, as Flink's buffer debloating does
//! (FLIP-183). What waits ahead of a record request or a marker is then about
//! [`APP_TARGET`] and [`PEER_TARGET`] of the application's work, whatever the backlog;
//! the rest of a backlog waits in the senders' queues, where an unaligned marker overtakes
//! it. docs/architecture.md §3.2 describes the protocol.

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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn without_acknowledgements_there_is_no_window() {
        let w = DeliveryWindow::new(false);
        assert_eq!(w.room(), None);
        assert_eq!(w.peer_room(2_000, 1), 2_000);
    }
}
