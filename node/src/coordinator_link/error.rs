//! Why a session with the coordinator ended, or an upload or a fetch failed.

use cairn_proto::convert::ConvertError;
use cairn_rpc::v1 as pb;

use super::REGISTER_TIMEOUT;
use crate::wiring::MembershipError;

/// The response metadata in which a replica that is not the leader names it.
pub(super) const LEADER_HINT: &str = "cairn-leader";

/// Why a session with the coordinator ended, or a part's upload or a restore's fetch
/// failed. The texts are what the daemon logs (the session's as
/// "coordinator session: {why}; retrying").
#[derive(Debug, thiserror::Error)]
pub(crate) enum LinkError {
    /// The coordinator's address is not a valid endpoint.
    #[error("{0}")]
    Address(tonic::transport::Error),
    /// The coordinator could not be reached.
    #[error("cannot connect: {}", cairn_rpc::tls::with_causes(.0))]
    Connect(tonic::transport::Error),
    /// The coordinator refused the session (a node id held by a connected daemon, a node
    /// not in its topology, ...): its message.
    #[error("refused: {}", .0.message())]
    Refused(tonic::Status),
    /// The coordinator's first answer was not `Registered`.
    #[error("expected Registered, got {0:?}")]
    NotRegistered(Box<Option<pb::CoordinatorToNode>>),
    /// The coordinator ended the session.
    #[error("the coordinator closed the session")]
    ClosedByCoordinator,
    /// The session's stream failed: its status message.
    #[error("{}", .0.message())]
    Stream(tonic::Status),
    /// This daemon's half of the session is gone.
    #[error("session closed")]
    SessionClosed,
    /// The node loop has stopped.
    #[error("node stopping")]
    NodeStopping,
    /// A membership this daemon cannot follow.
    #[error(transparent)]
    Membership(#[from] MembershipError),
    /// Fetching a restore's share failed: the coordinator's message.
    #[error("{}", .0.message())]
    Fetch(tonic::Status),
    /// A piece of a restore's share names no valid channel.
    #[error("{0}")]
    BadPiece(#[from] ConvertError),
    /// A restore's share ended early.
    #[error("the coordinator's stream ended before the replay counts")]
    NoReplayCounts,
    /// A restore's share came in the wrong order.
    #[error("{0} came after the recorded state's first piece")]
    PieceOutOfOrder(&'static str),
    /// A restore's state stream ended without its end.
    #[error(
        "the coordinator's stream ended after {received} bytes of the recorded state, before its end"
    )]
    NoRestoreEnd { received: u64 },
    /// A restore's state came up short or long.
    #[error(
        "the recorded state came as {received} bytes where the coordinator's end says {expected}"
    )]
    ShortState { received: u64, expected: u64 },
    /// The node loop dropped the restore being streamed (superseded, or its application
    /// left mid-way), and said so itself.
    #[error("the restore was dropped by the node")]
    RestoreDropped,
    /// The coordinator refused or failed a part's upload: its message.
    #[error("{}", .0.message())]
    UploadRefused(tonic::Status),
    /// The blob store this daemon writes its new chunks to failed (or `HasChunks` answered
    /// wrongly): what and why.
    #[error("blob store: {0}")]
    BlobStore(String),
    /// The upload's call ended abnormally.
    #[error("{0}")]
    UploadTask(tokio::task::JoinError),
    /// The coordinator did not answer `Register` in time.
    #[error("no answer to Register within {}s", REGISTER_TIMEOUT.as_secs())]
    RegisterTimeout,
    /// A message of a leadership term lower than the highest this daemon has seen: a
    /// deposed leader's. Nothing of it was acted on; the session ends.
    #[error(
        "FAILED_PRECONDITION: refused {what} of coordinator term {term} (at {address}): this \
         daemon has seen term {highest}; a deposed leader commands nobody"
    )]
    StaleTerm {
        /// What the message was: `registered`, `initiate`, `abort`, `membership` or
        /// `restore`.
        what: &'static str,
        /// Its term.
        term: u64,
        /// The highest term seen.
        highest: u64,
        /// The coordinator's address.
        address: String,
    },
}

impl LinkError {
    /// The leader's address a replica named (`cairn-leader`) when it refused or ended the
    /// session, as sent (not yet checked; bytes that are not UTF-8 replaced).
    pub(super) fn leader_hint(&self) -> Option<String> {
        let (LinkError::Refused(status) | LinkError::Stream(status)) = self else {
            return None;
        };
        let value = status.metadata().get(LEADER_HINT)?;
        Some(String::from_utf8_lossy(value.as_bytes()).into_owned())
    }
}
