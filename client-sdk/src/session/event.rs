//! What a session hands the application ([`AppEvent`]), and how it attaches
//! ([`AttachOptions`]).

use bytes::Bytes;

#[cfg(doc)]
use super::{AppSender, AppSession};

/// Something the daemon asks of, or hands to, the application.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AppEvent {
    /// A message from a peer.
    Message {
        /// The sending node.
        from: String,
        /// The payload, as sent.
        payload: Bytes,
    },
    /// Record your local state now and answer with [`AppSender::state_recorded`].
    /// Everything received before this event belongs in the state; nothing after it.
    ///
    /// For an unaligned snapshot it comes between the next two messages, ahead of
    /// messages the daemon already handed the session: those are recorded as in flight,
    /// and follow as usual. Answer before asking for the next event (or at least before
    /// applying it), so that the state holds exactly the messages received before this.
    RecordState {
        /// The snapshot.
        snapshot_id: u64,
    },
    /// Replace your state with this recorded one, then call
    /// [`AppSender::restore_applied`] in the same critical section (see there). The
    /// recorded messages that were in flight at the snapshot follow as ordinary
    /// [`AppEvent::Message`]s, ahead of any new traffic.
    Restore {
        /// The restore operation.
        restore_id: String,
        /// The snapshot restored.
        snapshot_id: u64,
        /// The recorded local state.
        state: Bytes,
    },
    /// Only after [`AppSession::restore_in_pieces`]: the next piece of a restored state,
    /// instead of one [`AppEvent::Restore`] with all of it, so the application need not
    /// hold a large state twice. Stage the pieces (a restore may break off: see
    /// [`AppEvent::RestoreAborted`]); on the `last` one, replace your state with them and
    /// call [`AppSender::restore_applied`], as for [`AppEvent::Restore`].
    RestorePiece {
        /// The restore operation.
        restore_id: String,
        /// The snapshot restored.
        snapshot_id: u64,
        /// The next bytes of the recorded local state.
        piece: Bytes,
        /// True on the last piece.
        last: bool,
    },
    /// Only after [`AppSession::restore_in_pieces`]: a restore whose pieces were being
    /// handed over broke off before its last (the daemon lost the rest; the restore fails
    /// and a later one follows). Drop its pieces and keep the state you had; the daemon
    /// drops what you send, and delivers nothing, until a later restore is applied.
    RestoreAborted {
        /// The restore operation.
        restore_id: String,
        /// Why, in words.
        reason: String,
    },
    /// Only with [`AttachOptions::snapshot_outcomes_after`]: a snapshot completed. Every
    /// node's part is stored and verified, and the coordinator has stored that it
    /// completed — so a restore can bring back this snapshot's state from now on. Effects
    /// the application held back until its state was durable (what a two-phase-commit
    /// sink pre-committed at this snapshot or before) may be made final now.
    ///
    /// Guarantees: told only after the coordinator stored the end; in increasing id order
    /// together with [`AppEvent::SnapshotAborted`]; at least once — a session that breaks
    /// and attaches again naming a lower id (see [`AppSession::outcomes_heard`]) hears
    /// again what it may have missed, as far as the coordinator still keeps it (the newest
    /// 4,096 ends). An application must therefore treat a repeated id as done already.
    SnapshotCompleted {
        /// The snapshot.
        snapshot_id: u64,
    },
    /// Only with [`AttachOptions::snapshot_outcomes_after`]: a snapshot failed or was
    /// aborted, and the coordinator stored that. Its state will never be restored. Same
    /// guarantees as [`AppEvent::SnapshotCompleted`]. Effects pre-committed at it stay
    /// pending: they belong to the history up to the next snapshot that completes, which
    /// makes them final.
    SnapshotAborted {
        /// The snapshot.
        snapshot_id: u64,
        /// Why, in words (at most 512 bytes).
        reason: String,
    },
}

/// How a session attaches, beyond the defaults of [`AppSession::connect_with`].
#[derive(Debug, Clone, Default)]
pub struct AttachOptions {
    /// Follow the snapshots' ends: hear [`AppEvent::SnapshotCompleted`] and
    /// [`AppEvent::SnapshotAborted`] for every snapshot with an id above this one — first
    /// those that ended already (as far as the coordinator keeps them), then each as it
    /// ends. Give the highest id the application has acted on: 0 on a fresh start, the
    /// restored state's on a restart, [`AppSession::outcomes_heard`] on a reattach.
    /// `None` (the default): none are told.
    pub snapshot_outcomes_after: Option<u64>,
}
