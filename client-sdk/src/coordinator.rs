//! A client of the coordinator's `cairn.v1.Coordinator` service.

use cairn_proto::v1 as pb;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::error::Error;

/// A connection to a coordinator. The coordinator itself arrives with the coordinator
/// issue; until then this is the typed entry point scripts and `cairnctl` will use.
#[derive(Clone)]
pub struct CoordinatorClient {
    inner: pb::coordinator_client::CoordinatorClient<TokenChannel>,
}

/// A channel that adds `authorization: Bearer <token>` to every call, when it has a token.
pub type TokenChannel = InterceptedService<Channel, BearerToken>;

/// Adds `authorization: Bearer <token>` to every request (nothing without a token). The
/// value is marked sensitive: its `Debug` (and so any log of the request's metadata)
/// shows `Sensitive`, never the token.
#[derive(Clone, Debug, Default)]
pub struct BearerToken(Option<AsciiMetadataValue>);

impl BearerToken {
    /// The header of `token`; an error if it cannot be a header value.
    pub fn new(token: Option<&str>) -> Result<Self, Error> {
        match token {
            None => Ok(Self(None)),
            Some(token) => MetadataValue::try_from(format!("Bearer {}", token.trim()))
                .map(|mut v: AsciiMetadataValue| {
                    v.set_sensitive(true);
                    Self(Some(v))
                })
                .map_err(|_| Error::Connect {
                    address: String::new(),
                    reason: "the token holds characters a header cannot carry".into(),
                }),
        }
    }
}

impl Interceptor for BearerToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

impl CoordinatorClient {
    /// Connects to the coordinator at `host:port`.
    pub async fn connect(address: &str) -> Result<Self, Error> {
        Self::connect_with_token(address, None).await
    }

    /// Connects to the coordinator at `host:port`, sending `token` as a bearer token on
    /// every call (`--auth-tokens` on the coordinator; `None`: no token).
    pub async fn connect_with_token(address: &str, token: Option<&str>) -> Result<Self, Error> {
        Self::connect_with(address, token, None).await
    }

    /// As [`connect_with_token`](Self::connect_with_token), over TLS with `tls`: the
    /// coordinator's certificate is checked against its CA for the host of `address`, and
    /// its identity, if any, is presented as the client certificate (a coordinator with
    /// `--tls-*` flags requires one).
    pub async fn connect_with(
        address: &str,
        token: Option<&str>,
        tls: Option<&crate::tls::Tls>,
    ) -> Result<Self, Error> {
        let bearer = BearerToken::new(token).map_err(|e| match e {
            Error::Connect { reason, .. } => Error::Connect {
                address: address.to_owned(),
                reason,
            },
            other => other,
        })?;
        let channel = crate::tls::endpoint(address, tls)
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
            inner: pb::coordinator_client::CoordinatorClient::with_interceptor(channel, bearer),
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
    pub fn raw(&mut self) -> &mut pb::coordinator_client::CoordinatorClient<TokenChannel> {
        &mut self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_never_shows_in_debug() {
        let mut bearer = BearerToken::new(Some(" s3cr3t-token\n")).unwrap();
        assert!(!format!("{bearer:?}").contains("s3cr3t"), "{bearer:?}");
        let request = bearer.call(tonic::Request::new(())).unwrap();
        let value = request.metadata().get("authorization").unwrap();
        assert!(value.is_sensitive());
        assert_eq!(value.to_str().unwrap(), "Bearer s3cr3t-token");
        assert!(!format!("{request:?}").contains("s3cr3t"), "{request:?}");
        assert!(!format!("{:?}", request.metadata().clone().into_headers()).contains("s3cr3t"));
        assert!(BearerToken::new(Some("bad\ntoken")).is_err());
    }
}
