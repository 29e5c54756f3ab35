//! What the node loop tells the coordinator link. The loop owns these events: the link
//! imports them from here, and nothing in the loop knows of the link.

use bytes::Bytes;
use cairn_core::control::StateTimes;
use cairn_core::{ChannelId, FailureReason, SnapshotId};
use tokio::sync::mpsc;

use crate::part::Part;
use crate::shared::StateChunk;

/// What the node loop tells the coordinator.
#[derive(Debug)]
pub(crate) enum NodeEvent {
    /// The application recorded its state for this snapshot, and how long it took here.
    StateRecorded { id: SnapshotId, times: StateTimes },
    /// The next piece of the application's state (streamed into the part's upload).
    StateChunk { id: SnapshotId, chunk: StateChunk },
    /// Messages recorded on one of this node's outgoing channels, after every message
    /// recorded on it before (streamed into the part's upload while the snapshot runs).
    Recorded {
        id: SnapshotId,
        channel: ChannelId,
        messages: Vec<(u64, Bytes)>,
    },
    /// This node's part is complete (its state, if any, went ahead in pieces).
    PartReady(Box<Part>),
    /// The snapshot failed here.
    Failed(SnapshotId, FailureReason),
    /// The application applied a restored state.
    RestoreApplied { restore_id: String },
    /// This node could not restore.
    RestoreFailed { restore_id: String, message: String },
    /// The application follows the snapshots' ends above this id: ask the coordinator for
    /// those told already (answered with `LoopMsg::Outcomes`).
    OutcomesAfter(u64),
}

impl NodeEvent {
    /// The snapshot the event is about, if any.
    pub(crate) fn snapshot(&self) -> Option<SnapshotId> {
        match self {
            Self::StateRecorded { id, .. }
            | Self::StateChunk { id, .. }
            | Self::Recorded { id, .. }
            | Self::Failed(id, _) => Some(*id),
            Self::PartReady(part) => Some(part.report.id),
            Self::RestoreApplied { .. } | Self::RestoreFailed { .. } | Self::OutcomesAfter(_) => {
                None
            }
        }
    }
}

/// Where the loop's events go: nowhere for a daemon without a coordinator.
#[derive(Debug, Clone, Default)]
pub(crate) struct Events(Option<mpsc::UnboundedSender<NodeEvent>>);

impl Events {
    pub(crate) fn new(tx: Option<mpsc::UnboundedSender<NodeEvent>>) -> Self {
        Self(tx)
    }

    /// Whether a coordinator link hears the events.
    pub(crate) fn heard(&self) -> bool {
        self.0.is_some()
    }

    /// Tells the coordinator link, if there is one (a link already gone hears nothing).
    pub(crate) fn tell(&self, event: NodeEvent) {
        if let Some(tx) = &self.0 {
            let _ = tx.send(event);
        }
    }
}
