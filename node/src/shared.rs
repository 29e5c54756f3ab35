//! What every part of the daemon reads without asking the node loop: the node's identity
//! and limits ([`Shared`]), the members and channels it is wired to ([`Wiring`]), each
//! channel's credits, counters and injected faults ([`ChannelHandles`]), and the pieces of
//! recorded state on their way to the coordinator ([`StateChunk`]).
//!
//! This module depends on no other part of the daemon but its metrics: every part may
//! import it without an import cycle.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use cairn_core::{ChannelId, NodeId, Topology};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::NodeMetrics;

/// Bytes of recorded state on their way from the application to the coordinator at once.
pub(crate) const UPLOAD_ROOM: usize = 8 << 20;

/// Faults either end of a channel can be asked to inject at its own side.
#[derive(Debug, Default)]
pub(crate) struct ChannelFaults {
    /// Break the channel's current connection (it reconnects and resends).
    pub cut: tokio::sync::Notify,
    /// Milliseconds to wait before sending each batch (sender side).
    pub delay_ms: AtomicU64,
}

/// Counters of one outgoing channel, kept by its sending task.
#[derive(Debug, Default)]
pub(crate) struct LinkStats {
    pub connected: AtomicBool,
    pub reconnects: AtomicU64,
    pub unacked: AtomicU64,
}

/// A piece of the application's recorded state. It holds its share of the upload room
/// (`Shared::upload_room`) until it is on its way to the coordinator, so a large state
/// flows through the daemon without piling up in it: the application's session waits for
/// room instead.
#[derive(Debug)]
pub(crate) struct StateChunk {
    pub bytes: Bytes,
    pub room: OwnedSemaphorePermit,
}

/// What the parts of the daemon share about one channel of this node.
#[derive(Debug)]
pub(crate) struct ChannelHandles {
    /// Incoming: messages held inside this daemon. Outgoing: messages queued or
    /// unacknowledged. Each message takes one; the sender waits when none is left.
    pub credits: Semaphore,
    /// Outgoing only: kept by the channel's sending task.
    pub stats: LinkStats,
    /// Fault injection at this node's end.
    pub faults: ChannelFaults,
    /// Outgoing only: messages taken in without a credit (read ahead of a recorded state);
    /// credits coming back pay this off first.
    pub debt: AtomicU64,
    /// The channel's buffer (`--channel-buffer`): the credits it started with.
    pub buffer: u64,
    /// Outgoing only: (the bound on what it holds, credits kept back to keep it there) —
    /// see [`Self::bound_to`].
    bound: std::sync::Mutex<(u64, u64)>,
    /// Incoming only: the credit limit granted to the sender (data index below which it may
    /// transmit), raised by the node loop as it delivers; each stream's reader watches it and
    /// passes it on (a watch, not a notification: a stream replaced but not yet closed
    /// cannot take a wake-up meant for the live one).
    pub grant: tokio::sync::watch::Sender<u64>,
}

impl ChannelHandles {
    pub(crate) fn new(buffer: usize) -> Self {
        Self {
            credits: Semaphore::new(buffer),
            stats: LinkStats::default(),
            faults: ChannelFaults::default(),
            debt: AtomicU64::new(0),
            buffer: buffer as u64,
            bound: std::sync::Mutex::new((buffer as u64, 0)),
            grant: tokio::sync::watch::Sender::new(buffer as u64),
        }
    }

    /// Outgoing: from now on the channel holds at most `bound` messages (of its buffer;
    /// buffer debloating, `--queue-target`). Credits above it are kept back as they come
    /// free, or given back at once when the bound grows.
    pub(crate) fn bound_to(&self, bound: u64) {
        let mut b = self.bound.lock().expect("never poisoned");
        let bound = bound.clamp(1, self.buffer);
        let keep = self.buffer - bound;
        b.0 = bound;
        if b.1 > keep {
            self.credits.add_permits((b.1 - keep) as usize);
            b.1 = keep;
        } else if b.1 < keep {
            // What is free now is kept back at once; the rest as it comes back.
            b.1 += self.credits.forget_permits((keep - b.1) as usize) as u64;
        }
    }

    /// The outgoing channel's bound now (its buffer unless debloated).
    pub(crate) fn bound(&self) -> u64 {
        self.bound.lock().expect("never poisoned").0
    }

    /// Incoming: grants the sender credits up to data index `limit`.
    pub(crate) fn set_grant(&self, limit: u64) {
        self.grant.send_if_modified(|grant| {
            let changed = *grant != limit;
            *grant = limit;
            changed
        });
    }

    /// Gives back `n` credits of an outgoing channel, paying off its debt first.
    pub(crate) fn release(&self, n: usize) {
        let mut n = n as u64;
        let _ = self
            .debt
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |debt| {
                let paid = debt.min(n);
                Some(debt - paid)
            })
            .map(|debt| n -= debt.min(n));
        if n > 0 {
            // Then what the bound keeps back.
            let mut b = self.bound.lock().expect("never poisoned");
            let keep = (self.buffer - b.0).saturating_sub(b.1).min(n);
            b.1 += keep;
            n -= keep;
        }
        if n > 0 {
            self.credits.add_permits(n as usize);
        }
    }
}

/// The members and channels this node is wired to. Replaced whole when the membership
/// grows; a channel keeps its handles across replacements.
#[derive(Debug)]
pub(crate) struct Wiring {
    pub topology: Topology,
    /// Every member's peer address.
    pub addresses: BTreeMap<NodeId, String>,
    /// This node's channels, incoming and outgoing.
    pub channels: BTreeMap<ChannelId, Arc<ChannelHandles>>,
    /// The daemon incarnation the coordinator admitted for each member (empty without a
    /// coordinator): a peer stream from any other incarnation claiming that id is refused.
    pub incarnations: BTreeMap<NodeId, u64>,
    /// Members removed while this daemon ran (and not back since): the application's sends
    /// to them, made before it heard, are dropped and counted rather than refused.
    pub removed: std::collections::BTreeSet<NodeId>,
    /// Members the coordinator last said are not connected to it: readiness does not wait
    /// for the links to them.
    pub down: std::collections::BTreeSet<NodeId>,
}

/// What every part of the daemon may read without asking the loop.
#[derive(Debug)]
pub(crate) struct Shared {
    pub metrics: NodeMetrics,
    pub node_id: NodeId,
    pub cluster: String,
    pub incarnation: u64,
    pub max_payload: usize,
    /// Messages each channel may hold in this daemon.
    pub channel_buffer: usize,
    /// Buffer debloating of the outgoing queues (`--queue-target`), if on.
    pub queue_target: Option<std::time::Duration>,
    /// Read often, written when the membership changes; never held across an await.
    pub wiring: RwLock<Arc<Wiring>>,
    /// Whether fault injection is allowed.
    pub fault_injection: bool,
    /// Bytes of recorded state that may be on their way to the coordinator at once.
    pub upload_room: Arc<Semaphore>,
    /// The epoch: raised by every restore. Written only by the node loop; the peer service
    /// refuses streams of another epoch, and sending tasks start over when it changes.
    pub epoch: tokio::sync::watch::Sender<u64>,
    /// `--tls-*`: the links to peers and to the coordinator use it (https, this node's
    /// certificate presented); `None`: plaintext.
    pub tls: Option<cairn_rpc::tls::Tls>,
    /// The highest coordinator leadership term this daemon has seen, for its lifetime: a
    /// message of a lower term comes from a deposed leader and is refused
    /// (`coordinator_link::term`). Written only by the coordinator link.
    pub highest_term: AtomicU64,
    /// Registered with the coordinator now (always true without one): half of readiness,
    /// with every outgoing channel connected (health service `cairn.v1.Wired`).
    pub registered: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// The current wiring.
    pub(crate) fn wiring(&self) -> Arc<Wiring> {
        self.wiring.read().expect("wiring lock").clone()
    }

    /// One channel's handles, if it is one of this node's.
    pub(crate) fn channel(&self, channel: &ChannelId) -> Option<Arc<ChannelHandles>> {
        self.wiring
            .read()
            .expect("wiring lock")
            .channels
            .get(channel)
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::ChannelHandles;

    #[test]
    fn a_bound_keeps_credits_back_as_they_come_free_and_gives_them_back_when_it_grows() {
        let h = ChannelHandles::new(1_000);
        let free = |h: &ChannelHandles| h.credits.available_permits();
        // 900 messages queued or unacknowledged: 100 credits free.
        h.credits.forget_permits(900);
        assert_eq!(free(&h), 100);
        // Bounded to 300: the 100 free are kept back at once, 600 more as they come back.
        h.bound_to(300);
        assert_eq!((free(&h), h.bound()), (0, 300));
        h.release(500);
        assert_eq!(free(&h), 0, "500 acknowledged, all kept back");
        h.release(300);
        assert_eq!(free(&h), 200, "the bound reached: 100 held, 200 free");
        // A debt is paid before anything is kept back.
        h.debt.store(50, std::sync::atomic::Ordering::Release);
        h.release(60);
        assert_eq!(free(&h), 210);
        // The bound grows: what was kept back beyond it comes back at once.
        h.bound_to(800);
        assert_eq!(free(&h), 710);
        h.bound_to(u64::MAX);
        assert_eq!(
            (free(&h), h.bound()),
            (910, 1_000),
            "never above the buffer"
        );
        h.release(90);
        assert_eq!(free(&h), 1_000, "every credit back");
    }
}
