//! What the application sends through: messages to its peers (each against room the
//! daemon gives back), recorded states and restore acknowledgements.

use super::*;

/// Sends messages and recorded states; cheap to clone, usable from any task. Everything
/// sent through clones of one sender reaches the daemon in the order it was sent.
///
/// Sends wait for room (the daemon pushes back when a peer is slow); recording a state
/// never waits, so an application that answers [`AppEvent::RecordState`] from the same
/// loop that receives messages never stops receiving because its sends are backed up.
#[derive(Clone)]
pub struct AppSender {
    pub(super) tx: mpsc::UnboundedSender<Outgoing>,
    pub(super) room: Arc<Semaphore>,
    /// Updated by the session when the daemon reports new peers.
    pub(super) peers: Arc<RwLock<BTreeSet<String>>>,
    /// A restore handed to the application and not yet acknowledged.
    pub(super) restore: Arc<std::sync::Mutex<Option<String>>>,
    /// Messages sent through this session so far...
    pub(super) sends: Arc<AtomicU64>,
    /// ...and how many of them the daemon took off the session (as its `Consumed` stream
    /// reports; without that stream, how many were written to the session's stream), and
    /// whether no more will be confirmed (the stream, or the session, ended).
    pub(super) confirmed: watch::Receiver<(u64, bool)>,
    /// Where the application took each cut it has not answered yet: messages consumed.
    pub(super) cuts: Arc<std::sync::Mutex<BTreeMap<u64, u64>>>,
}

/// Room for one message, reserved by [`AppSender::reserve`]. Sending through it does not
/// wait, so it can happen inside the same critical section as the state change the
/// message stands for (see the crate docs).
pub struct SendPermit {
    pub(super) permit: OwnedSemaphorePermit,
    pub(super) sender: AppSender,
}

impl SendPermit {
    /// Sends `payload` to node `to`.
    pub fn send(self, to: &str, payload: Bytes) -> Result<(), Error> {
        if !self.sender.knows(to) {
            return Err(Error::UnknownPeer(to.to_owned()));
        }
        self.sender.sends.fetch_add(1, Ordering::AcqRel);
        self.sender
            .tx
            .send(Outgoing::Send(to.to_owned(), payload))
            .map_err(|_| Error::SessionClosed)?;
        self.permit.forget(); // returned by the writer once the message is on the wire
        Ok(())
    }
}

impl AppSender {
    /// Waits for room for one message.
    pub async fn reserve(&self) -> Result<SendPermit, Error> {
        let permit = self
            .room
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Error::SessionClosed)?;
        Ok(SendPermit {
            permit,
            sender: self.clone(),
        })
    }

    /// Sends `payload` to node `to`, waiting while the daemon's queue is full.
    pub async fn send(&self, to: &str, payload: Bytes) -> Result<(), Error> {
        if !self.knows(to) {
            return Err(Error::UnknownPeer(to.to_owned()));
        }
        // The hot path: one semaphore permit and one queue push, no clone of the sender.
        let permit = self
            .room
            .acquire()
            .await
            .map_err(|_| Error::SessionClosed)?;
        self.sends.fetch_add(1, Ordering::AcqRel);
        self.tx
            .send(Outgoing::Send(to.to_owned(), payload))
            .map_err(|_| Error::SessionClosed)?;
        permit.forget(); // returned by the writer once the message is on the wire
        Ok(())
    }

    /// Waits until the daemon has taken every message sent through this session before
    /// the call off the session and queued it for its peer: a `NodeAdmin/GetNodeStatus`
    /// read after it counts them in the channels' `dataMessages`. A daemon that does not
    /// report what it takes (no `Consumed` stream) is waited for only until they are
    /// written to the session's stream. `SessionClosed` if the session (or its `Consumed`
    /// stream) ends first: then they may or may not have been taken.
    pub async fn flushed(&self) -> Result<(), Error> {
        let target = self.sends.load(Ordering::Acquire);
        let mut confirmed = self.confirmed.clone();
        let (n, _) = *confirmed
            .wait_for(|(n, closed)| *n >= target || *closed)
            .await
            .map_err(|_| Error::SessionClosed)?;
        if n >= target {
            Ok(())
        } else {
            Err(Error::SessionClosed)
        }
    }

    /// Answers [`AppEvent::RecordState`] with the local state (sent in chunks). Never
    /// waits: it follows everything sent before it, and precedes everything after.
    pub fn state_recorded(&self, snapshot_id: u64, state: Bytes) -> Result<(), Error> {
        let consumed = self
            .cuts
            .lock()
            .expect("never poisoned")
            .remove(&snapshot_id);
        self.tx
            .send(Outgoing::State(snapshot_id, consumed, state))
            .map_err(|_| Error::SessionClosed)
    }

    /// Acknowledges [`AppEvent::Restore`]: the application now runs on the restored state.
    /// Until the daemon gets this, it drops every message the application sends — they
    /// were decided on the state the restore replaced — so call it inside the same
    /// critical section that replaces the state, before anything can send on the new one.
    /// If the application never calls it, the session acknowledges when the application
    /// next asks for an event (exact only if nothing sends concurrently). Never waits.
    pub fn restore_applied(&self, restore_id: &str) -> Result<(), Error> {
        let mut pending = self.restore.lock().expect("never poisoned");
        if pending.as_deref() != Some(restore_id) {
            return Ok(()); // acknowledged already, or not the pending one
        }
        *pending = None;
        self.tx
            .send(Outgoing::RestoreApplied(restore_id.to_owned()))
            .map_err(|_| Error::SessionClosed)
    }

    /// The nodes this node has a channel to now (the set grows when members join).
    pub fn peers(&self) -> BTreeSet<String> {
        self.peers.read().expect("never poisoned").clone()
    }

    fn knows(&self, peer: &str) -> bool {
        self.peers.read().expect("never poisoned").contains(peer)
    }
}

/// The send window's permits in circulation — free, held by the application, or spent on
/// sends the daemon has not taken — kept at the window the daemon advises
/// (`Taken.window`, at most [`SEND_ROOM`]): a window that shrinks holds back permits
/// that come back; one that grows adds permits.
pub(super) struct Circulation {
    circulating: u64,
}

impl Default for Circulation {
    fn default() -> Self {
        Self {
            circulating: SEND_ROOM as u64,
        }
    }
}

impl Circulation {
    /// The daemon took `returned` more sends and advises `window`: the permits to add.
    pub(super) fn taken(&mut self, returned: u64, window: Option<u64>) -> u64 {
        let target = window.map_or(SEND_ROOM as u64, |w| w.clamp(1, SEND_ROOM as u64));
        let keep = self.circulating.saturating_sub(returned);
        let now = target.max(keep);
        self.circulating = now;
        now - keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_permits_in_circulation_follow_the_advised_window() {
        let mut c = Circulation::default();
        let room = SEND_ROOM as u64;
        assert_eq!(
            c.taken(100, None),
            100,
            "no advice: every permit comes back"
        );
        // The window shrinks to 256: what comes back is held back until fewer than 256
        // permits are left in circulation.
        assert_eq!(c.taken(100, Some(256)), 0, "8,092 left: none back");
        assert_eq!(c.taken(room - 300, Some(256)), 56, "200 left: back to 256");
        assert_eq!(c.taken(200, Some(256)), 200, "at the window: each one back");
        // It grows back without a send taken.
        assert_eq!(c.taken(0, Some(1024)), 768);
        // A window past the SDK's bound, or of 0, is held to 1..=SEND_ROOM.
        assert_eq!(c.taken(0, Some(u64::MAX)), room - 1024);
        assert_eq!(c.taken(room, Some(0)), 1);
        // A daemon that returns more than is out cannot underflow.
        assert_eq!(c.taken(u64::MAX, None), room);
    }
}
