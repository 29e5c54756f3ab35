//! The node loop's state of each channel end: an incoming channel's order and hold-back,
//! an outgoing channel's queue and credits.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cairn_core::Plan;
use tokio::sync::oneshot;

use super::flow::QueueBound;
use super::{InItem, Pulled};
use crate::shared::ChannelHandles;

/// The loop's state of one incoming channel.
pub(super) struct Incoming {
    pub(super) handles: Arc<ChannelHandles>,
    /// The sending daemon's incarnation; 0 before the first contact.
    pub(super) incarnation: u64,
    /// Highest sequence number taken in (processed or held).
    pub(super) received_seq: u64,
    /// Bumped at each reset, so messages of an older incarnation are not counted.
    pub(super) generation: u64,
    /// Data index of the next message.
    pub(super) next_index: u64,
    /// Data index of the next message to hand to the application (credits are granted
    /// from here).
    pub(super) delivered_next: u64,
    pub(super) blocked: bool,
    pub(super) held: VecDeque<InItem>,
    pub(super) data_messages: u64,
    /// Markers taken in since the daemon started.
    pub(super) markers: u64,
    /// Fault injection holds the channel...
    pub(super) fault_hold: bool,
    /// ...except for this many more frames.
    pub(super) release: u64,
}

impl Incoming {
    pub(super) fn new(handles: Arc<ChannelHandles>) -> Self {
        Self {
            handles,
            incarnation: 0,
            received_seq: 0,
            generation: 0,
            next_index: 0,
            delivered_next: 0,
            blocked: false,
            held: VecDeque::new(),
            data_messages: 0,
            markers: 0,
            fault_hold: false,
            release: 0,
        }
    }

    /// Whether the next held frame may go in.
    pub(super) fn may_take(&self) -> bool {
        !self.blocked && (!self.fault_hold || self.release > 0)
    }

    pub(super) fn took(&mut self) {
        if self.fault_hold {
            self.release -= 1;
        }
    }
}

/// An item of an outgoing queue.
pub(super) enum OutItem {
    Data { index: u64, payload: Bytes },
    Marker(Plan),
}

/// The loop's state of one outgoing channel.
pub(super) struct Outgoing {
    pub(super) handles: Arc<ChannelHandles>,
    pub(super) queue: VecDeque<OutItem>,
    pub(super) next_index: u64,
    pub(super) pending_pull: Option<(usize, oneshot::Sender<Pulled>)>,
    pub(super) data_messages: u64,
    /// Markers put on the wire since the daemon started.
    pub(super) markers: u64,
    /// Data with an index below this may go on the wire (the peer's credits).
    pub(super) credit_limit: u64,
    /// The peer grants credits (else `credit_limit` is `u64::MAX`).
    pub(super) credited: bool,
    /// Buffer debloating (`--queue-target`), if on.
    pub(super) debloat: Option<QueueBound>,
}

impl Outgoing {
    pub(super) fn new(handles: Arc<ChannelHandles>, queue_target: Option<Duration>) -> Self {
        Self {
            handles,
            queue: VecDeque::new(),
            next_index: 0,
            pending_pull: None,
            data_messages: 0,
            markers: 0,
            credit_limit: u64::MAX,
            credited: false,
            debloat: queue_target.map(QueueBound::new),
        }
    }
}
