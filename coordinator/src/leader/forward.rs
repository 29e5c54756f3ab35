//! One door: a follower forwards every client call to the leader, so that a plain gRPC
//! client (grpcurl, a load balancer's health-checked pool, a Kubernetes Service over every
//! replica) may call any replica.
//!
//! [`ForwardLayer`] sits inside the auth layer: the caller is authenticated here first, and
//! the call goes on to the leader — over this replica's own connection, with its own
//! certificate (mutual TLS, the leader's certificate checked for `DNS:coordinator` as the
//! daemons check it) — carrying the caller's role in
//! [`ON_BEHALF_OF`](cairn_rpc::server::auth::ON_BEHALF_OF), which the leader accepts only
//! from a coordinator's certificate. The caller's bearer token goes no further than here.
//!
//! What is forwarded: every method of `cairn.v1.Coordinator` a person or tool calls
//! (writes, reads and the streams `WatchSnapshot` and `ReadSnapshotData`, whose bodies
//! stream through), but not `GetLeadership` (it says which replica answers, and who leads)
//! nor the daemons' own calls (a daemon follows `cairn-leader` to the leader itself).
//! While no leader is known the replica answers itself: reads from the metadata store,
//! writes with UNAVAILABLE. A call is forwarded once: one that arrives forwarded
//! ([`FORWARDED_BY`]) at a replica that does not lead (leadership moved meanwhile) is
//! answered there, UNAVAILABLE for a write — retryable, and a `StartSnapshot` retried with
//! its `request_id` starts nothing twice.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use cairn_rpc::server::auth::{Caller, ON_BEHALF_OF, Required, required};
use http::HeaderValue;
use tonic::Status;
use tonic::body::Body;
use tonic::transport::Channel;

use super::replica::Replica;

/// The request header a forwarded call carries: the address of the replica that forwarded
/// it (a call is forwarded once).
pub(crate) const FORWARDED_BY: &str = "cairn-forwarded-by";

/// Whether a follower forwards a call to `path` to the leader.
pub(crate) fn forwarded(path: &str) -> bool {
    path.strip_prefix("/cairn.v1.Coordinator/")
        .is_some_and(|method| method != "GetLeadership")
        && required(path) != Required::Node
}

/// How long connecting to the leader may take before a forwarded call fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The forwarding of a follower's client calls to the leader.
#[derive(Clone)]
pub(crate) struct ForwardLayer {
    replica: Arc<Replica>,
    tls: Option<cairn_rpc::tls::Tls>,
    /// The connection to the leader last forwarded to, by its address.
    channel: Arc<Mutex<Option<(String, Channel)>>>,
}

impl ForwardLayer {
    pub(crate) fn new(replica: Arc<Replica>, tls: Option<cairn_rpc::tls::Tls>) -> Self {
        Self {
            replica,
            tls,
            channel: Arc::new(Mutex::new(None)),
        }
    }

    /// The connection to `leader` (made lazily, kept while it leads).
    fn channel(&self, leader: &str) -> Result<Channel, String> {
        let mut cached = self.channel.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((address, channel)) = cached.as_ref()
            && address == leader
        {
            return Ok(channel.clone());
        }
        // As a daemon does: the leader's certificate must be a coordinator's, wherever its
        // advertised address points.
        let channel = cairn_rpc::tls::endpoint_for(leader, "coordinator", self.tls.as_ref())
            .map_err(|e| format!("the address {leader} cannot be dialled: {e}"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .initial_stream_window_size(4 << 20)
            .initial_connection_window_size(16 << 20)
            .connect_lazy();
        *cached = Some((leader.to_owned(), channel.clone()));
        Ok(channel)
    }
}

impl<S> tower_layer::Layer<S> for ForwardLayer {
    type Service = Forward<S>;

    fn layer(&self, inner: S) -> Forward<S> {
        Forward {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`ForwardLayer`] makes.
#[derive(Clone)]
pub(crate) struct Forward<S> {
    inner: S,
    layer: ForwardLayer,
}

use crate::BoxFuture;

impl<S> tower_service::Service<http::Request<Body>> for Forward<S>
where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<http::Response<Body>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let leader = (forwarded(request.uri().path())
            && !request.headers().contains_key(FORWARDED_BY))
        .then(|| self.layer.replica.leader_elsewhere())
        .flatten();
        let Some((leader, term)) = leader else {
            return Box::pin(self.inner.call(request));
        };
        let layer = self.layer.clone();
        Box::pin(async move { Ok(forward(&layer, request, &leader, term).await) })
    }
}

/// Sends `request` to `leader` on behalf of its caller and answers with the leader's
/// response, or UNAVAILABLE when the leader cannot be reached.
async fn forward(
    layer: &ForwardLayer,
    request: http::Request<Body>,
    leader: &str,
    term: u64,
) -> http::Response<Body> {
    let own = layer.replica.own().to_owned();
    let method = request_method(&request);
    let unreachable = |why: String| {
        Status::unavailable(format!(
            "this coordinator ({own}) forwards {method} to the leader, {leader} (term \
             {term}), which it cannot reach: {why}; try again (a StartSnapshot retried \
             with its request_id starts nothing twice)"
        ))
    };
    let mut channel = match layer.channel(leader) {
        Ok(channel) => channel,
        Err(why) => return unreachable(why).into_http(),
    };
    let (mut parts, body) = request.into_parts();
    let caller = parts.extensions.get::<Caller>().cloned();
    // Nothing of the server side travels on: not its extensions, not the caller's token
    // (the leader takes the role from this replica's word), not a header it could forge.
    parts.extensions = http::Extensions::new();
    parts.headers.remove(http::header::AUTHORIZATION);
    parts.headers.remove(ON_BEHALF_OF);
    if let Some(caller) = caller {
        parts.headers.insert(ON_BEHALF_OF, caller.header_value());
    }
    if let Ok(value) = HeaderValue::from_str(&own) {
        parts.headers.insert(FORWARDED_BY, value);
    }
    let path = parts.uri.path().to_owned();
    if let Ok(uri) = http::Uri::builder().path_and_query(path.as_str()).build() {
        parts.uri = uri;
    }
    let outbound = http::Request::from_parts(parts, body);
    if let Err(e) =
        std::future::poll_fn(|cx| tower_service::Service::poll_ready(&mut channel, cx)).await
    {
        return unreachable(cairn_rpc::tls::with_causes(&e)).into_http();
    }
    match tower_service::Service::call(&mut channel, outbound).await {
        Ok(response) => response,
        Err(e) => {
            tracing::debug!(%leader, path, "forwarding failed: {e}");
            Status::unavailable(format!(
                "this coordinator ({own}) forwarded {method} to the leader, {leader} (term \
                 {term}), and lost the answer: {}; its outcome is unknown until read back (a \
                 StartSnapshot retried with its request_id starts nothing twice)",
                cairn_rpc::tls::with_causes(&e)
            ))
            .into_http()
        }
    }
}

/// The method a request calls, for messages.
fn request_method<B>(request: &http::Request<B>) -> String {
    let path = request.uri().path();
    path.rsplit('/').next().unwrap_or(path).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_calls_are_forwarded_and_the_daemons_are_not() {
        for method in [
            "StartSnapshot",
            "AbortSnapshot",
            "DeleteSnapshot",
            "VerifySnapshot",
            "RestoreSnapshot",
            "SetPolicy",
            "RemoveNode",
            "WatchSnapshot",
            "ReadSnapshotData",
            "GetSnapshot",
            "ListSnapshots",
            "ListNodes",
            "GetPolicy",
            "GetRestore",
            "ListRestores",
            "DiffSnapshots",
        ] {
            assert!(
                forwarded(&format!("/cairn.v1.Coordinator/{method}")),
                "{method}"
            );
        }
        for path in [
            "/cairn.v1.Coordinator/GetLeadership",
            "/cairn.v1.Coordinator/NodeSession",
            "/cairn.v1.Coordinator/UploadSnapshotPart",
            "/cairn.v1.Coordinator/HasChunks",
            "/cairn.v1.Coordinator/FetchRestorePart",
            "/grpc.health.v1.Health/Check",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            "/cairn.v1.NodeAdmin/GetNodeStatus",
        ] {
            assert!(!forwarded(path), "{path}");
        }
    }
}
