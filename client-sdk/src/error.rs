//! The SDK's error type.

use tonic::{Code, Status};

/// What can go wrong talking to a cairn daemon or coordinator.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The address is malformed or nothing answers there.
    #[error("cannot connect to {address}: {reason}")]
    Connect {
        /// Where.
        address: String,
        /// Why.
        reason: String,
    },
    /// The server answered with an error status. UNAVAILABLE from a coordinator replica
    /// that follows names the leader ([`Error::leader`]): "… the leader is HOST:PORT".
    #[error("{}", rpc_text(.0))]
    Rpc(Status),
    /// The destination is not a peer of this node.
    #[error("`{0}` is not a peer of this node")]
    UnknownPeer(String),
    /// The session ended.
    #[error("the session with the node daemon ended")]
    SessionClosed,
    /// The daemon sent something the SDK did not expect.
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl Error {
    /// Whether trying again later may succeed (the daemon is restarting, the network
    /// blipped), as opposed to a request that will never work.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Connect { .. } | Self::SessionClosed => true,
            Self::Rpc(status) => matches!(
                status.code(),
                Code::Unavailable
                    | Code::ResourceExhausted
                    | Code::Aborted
                    | Code::DeadlineExceeded
            ),
            Self::UnknownPeer(_) | Self::Protocol(_) => false,
        }
    }

    /// The leading coordinator replica (`HOST:PORT`) that a follower named when it refused
    /// a call with UNAVAILABLE; `None` for any other error. After one,
    /// [`CoordinatorClient::reconnect_to_leader`](crate::CoordinatorClient::reconnect_to_leader)
    /// finds the leader again.
    pub fn leader(&self) -> Option<String> {
        match self {
            Self::Rpc(status) => leader_of(status),
            _ => None,
        }
    }
}

/// The leader an UNAVAILABLE `status` names ([`cairn_rpc::leader::LEADER_METADATA`],
/// checked by [`cairn_rpc::leader::check_address`]); `None` for any other status.
pub fn leader_of(status: &Status) -> Option<String> {
    (status.code() == Code::Unavailable)
        .then(|| cairn_rpc::leader::leader_in(status.metadata()))
        .flatten()
}

/// `; the leader is HOST:PORT`, to follow the message of an UNAVAILABLE `status` that
/// names the leader ([`leader_of`]) unless its message says so already; empty otherwise.
pub fn leader_note(status: &Status) -> String {
    match leader_of(status) {
        Some(leader)
            if !status
                .message()
                .contains(&format!("the leader is {leader}")) =>
        {
            format!("; the leader is {leader}")
        }
        _ => String::new(),
    }
}

/// The server's reason, then the code's name: `snapshot 999 not found (NotFound)` (tonic's
/// own words for a code, "Some requested entity was not found", only when there is no
/// reason).
fn rpc_text(status: &Status) -> String {
    let reason = match status.message() {
        "" => status.code().description(),
        message => message,
    };
    format!("{reason}{} ({:?})", leader_note(status), status.code())
}

pub use cairn_rpc::tls::with_causes;

impl From<Status> for Error {
    fn from(status: Status) -> Self {
        Self::Rpc(status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_rpc_error_reads_as_its_reason_then_its_code() {
        assert_eq!(
            Error::Rpc(Status::not_found("snapshot 999 not found")).to_string(),
            "snapshot 999 not found (NotFound)"
        );
        // No reason: tonic's words for the code.
        assert_eq!(
            Error::Rpc(Status::new(Code::Internal, "")).to_string(),
            format!("{} (Internal)", Code::Internal.description())
        );
    }
}
