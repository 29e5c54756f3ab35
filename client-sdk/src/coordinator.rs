//! A client of the coordinator's `cairn.v1.Coordinator` service.

use cairn_proto::v1 as pb;
use tonic::transport::{Channel, Endpoint};

use crate::error::Error;

/// A connection to a coordinator. The coordinator itself arrives with the coordinator
/// issue; until then this is the typed entry point scripts and `cairnctl` will use.
#[derive(Clone)]
pub struct CoordinatorClient {
    inner: pb::coordinator_client::CoordinatorClient<Channel>,
}

impl CoordinatorClient {
    /// Connects to the coordinator at `host:port`.
    pub async fn connect(address: &str) -> Result<Self, Error> {
        let channel = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| Error::Connect {
                address: address.to_owned(),
                reason: crate::error::with_causes(&e),
            })?
            .connect()
            .await
            .map_err(|e| Error::Connect {
                address: address.to_owned(),
                reason: crate::error::with_causes(&e),
            })?;
        Ok(Self {
            inner: pb::coordinator_client::CoordinatorClient::new(channel),
        })
    }

    /// Starts a snapshot; returns its id.
    pub async fn start_snapshot(
        &mut self,
        request: pb::StartSnapshotRequest,
    ) -> Result<u64, Error> {
        Ok(self
            .inner
            .start_snapshot(request)
            .await?
            .into_inner()
            .snapshot_id)
    }

    /// A snapshot's metadata, optionally with its data.
    pub async fn get_snapshot(
        &mut self,
        snapshot_id: u64,
        include_data: bool,
    ) -> Result<pb::Snapshot, Error> {
        let request = pb::GetSnapshotRequest {
            snapshot_id,
            include_data,
        };
        Ok(self.inner.get_snapshot(request).await?.into_inner())
    }

    /// The generated client, for every other call.
    pub fn raw(&mut self) -> &mut pb::coordinator_client::CoordinatorClient<Channel> {
        &mut self.inner
    }
}
