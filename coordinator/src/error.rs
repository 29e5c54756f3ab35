//! The coordinator's errors, each with a deliberate gRPC status code.

use tonic::{Code, Status};

use crate::store::StoreError;

/// What can go wrong serving a request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The request is malformed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No snapshot with that id.
    #[error("snapshot {0} not found")]
    NotFound(u64),
    /// The cluster is not in a state that allows the request.
    #[error("{0}")]
    FailedPrecondition(String),
    /// Too many snapshots in flight.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The metadata store cannot be reached.
    #[error("{0}")]
    Store(#[from] StoreError),
    /// The blob store failed.
    #[error("blob store: {0}")]
    Blob(String),
    /// Stored data is missing or corrupt (names the chunk and the node).
    #[error("data loss: {0}")]
    DataLoss(String),
    /// The blob store could not store a part (names the node and the cause).
    #[error("storage failed: {0}")]
    Storage(String),
    /// A metadata record that does not parse.
    #[error("the metadata record {key} is corrupt: {why}")]
    CorruptRecord {
        /// Its key.
        key: String,
        /// What is wrong with it.
        why: String,
    },
    /// The coordinator is shutting down.
    #[error("the coordinator is shutting down")]
    ShuttingDown,
}

impl Error {
    /// A blob store error while reading `what` (e.g. "node n1's state"): `DataLoss` if
    /// the bytes are missing or corrupt, else `Blob`.
    pub fn reading(what: &str, e: &std::io::Error) -> Self {
        if crate::blob::is_data_loss(e) {
            Self::DataLoss(format!("{what}: {e}"))
        } else {
            Self::Blob(format!("{what}: {e}"))
        }
    }
}

impl From<Error> for Status {
    fn from(error: Error) -> Self {
        let code = match &error {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NotFound(_) => Code::NotFound,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::ResourceExhausted(_) => Code::ResourceExhausted,
            Error::Store(_) => Code::Unavailable,
            Error::Blob(_) | Error::Storage(_) => Code::Internal,
            Error::DataLoss(_) | Error::CorruptRecord { .. } => Code::DataLoss,
            Error::ShuttingDown => Code::Unavailable,
        };
        Status::new(code, error.to_string())
    }
}
