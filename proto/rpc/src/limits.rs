//! What every cairn server bounds, in one place: the largest message each RPC may decode,
//! how long a message may stall half received, and the HTTP/2 settings (concurrent streams,
//! header list size, keepalive) that bound what one connection can make a server hold.
//!
//! tonic's own `max_decoding_message_size` is per service and reserves the declared length
//! of a message as soon as its 5-byte gRPC prefix arrives. [`MessageLimits`] is a layer in
//! front of every service that reads those prefixes itself: a message declaring more than
//! its RPC's limit fails the stream with `RESOURCE_EXHAUSTED` naming the RPC and the limit
//! before a byte of it is buffered, and a message that stops arriving half way is dropped
//! after [`MESSAGE_STALL`]. The per-service limits stay set as a second line.
//!
//! What a connection can hold at most is then: its window (h2 keeps unread data only up to
//! it) plus, per concurrent stream, one message up to its RPC's limit — and a partial
//! message only for as long as bytes keep arriving.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;
use tonic::transport::Server;

/// Largest message of a control RPC (snapshot and policy calls, node sessions, admin,
/// health, reflection): their real messages are a few KiB at most.
pub const CONTROL_MESSAGE: usize = 1 << 20;
/// Largest `--max-payload` a daemon accepts: one application message.
pub const MAX_PAYLOAD_CEILING: usize = 16 << 20;
/// Room beside the largest application message in a data message: a peer `FrameBatch`
/// holds up to 1 MiB of payloads (or one larger message alone) plus lengths and markers;
/// an upload piece holds recorded messages up to 1 MiB plus the one that crossed it.
pub const DATA_MARGIN: usize = 2 << 20;
/// How long a message may go without a byte once it started arriving.
pub const MESSAGE_STALL: Duration = Duration::from_secs(20);
/// Largest HTTP/2 header list a server accepts (gRPC requests send well under 1 KiB).
pub const MAX_HEADER_LIST: u32 = 16 << 10;
/// Idle time after which a server pings a connection.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// A connection whose ping is not answered within this is closed (a dead or stopped peer).
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Streams a client may reset before the server answers them, before it is sent GOAWAY.
pub const MAX_PENDING_RESETS: usize = 20;
/// Streams a server may reset because of a client's protocol error before GOAWAY.
pub const MAX_ERROR_RESETS: usize = 256;

/// The largest data message of a daemon with this `--max-payload`: a peer frame batch, an
/// application session message, an upload piece.
pub const fn data_message(max_payload: usize) -> usize {
    max_payload + DATA_MARGIN
}

/// A server builder with cairn's HTTP/2 limits: at most `max_concurrent_streams` streams
/// per connection, header lists up to [`MAX_HEADER_LIST`], keepalive pings that close a
/// connection whose peer stopped answering, bounded resets, and `TCP_NODELAY`. Windows are
/// the caller's (they differ per server); add [`MessageLimits`] with `.layer(...)`.
pub fn server(max_concurrent_streams: u32) -> Server {
    Server::builder()
        .tcp_nodelay(true)
        .max_frame_size(MAX_FRAME)
        .max_concurrent_streams(max_concurrent_streams)
        .http2_max_header_list_size(MAX_HEADER_LIST)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_RESETS))
        .http2_max_local_error_reset_streams(Some(MAX_ERROR_RESETS))
}

/// The largest HTTP/2 frame a cairn server or data client accepts: batches of large
/// payloads cross in few frames (the default, 16 KiB, costs a frame header, a flow-control
/// step and a wake-up per 16 KiB; CALIBRATION.md measured 1 MiB frames doubling a stream).
pub const MAX_FRAME: u32 = 1 << 20;

/// A layer that bounds every request message by its RPC: `default` for any RPC not named
/// with [`MessageLimits::rpc`].
#[derive(Debug, Clone)]
pub struct MessageLimits {
    default: usize,
    rpcs: Arc<Vec<(String, usize)>>,
    stall: Duration,
}

impl MessageLimits {
    /// Every RPC's messages up to `default` bytes, stalls up to [`MESSAGE_STALL`].
    pub fn new(default: usize) -> Self {
        Self {
            default,
            rpcs: Arc::new(Vec::new()),
            stall: MESSAGE_STALL,
        }
    }

    /// Messages of `path` (`/package.Service/Method`) up to `limit` bytes.
    pub fn rpc(mut self, path: &str, limit: usize) -> Self {
        Arc::make_mut(&mut self.rpcs).push((path.to_owned(), limit));
        self
    }

    /// A message that started arriving fails once no byte of it came for `stall`.
    pub fn stall(mut self, stall: Duration) -> Self {
        self.stall = stall;
        self
    }

    /// The limit of the RPC at `path`.
    pub fn limit(&self, path: &str) -> usize {
        self.rpcs
            .iter()
            .find(|(p, _)| p == path)
            .map_or(self.default, |(_, l)| *l)
    }

    /// `body`, bounded as the RPC at `path` is.
    pub fn bound(&self, path: &str, body: Body) -> Body {
        Body::new(BoundedBody {
            inner: body,
            rpc: path.into(),
            limit: self.limit(path),
            stall: self.stall,
            prefix: [0; 5],
            have: 0,
            declared: 0,
            remaining: 0,
            timer: None,
            done: false,
        })
    }
}

impl<S> tower_layer::Layer<S> for MessageLimits {
    type Service = Bounded<S>;

    fn layer(&self, inner: S) -> Bounded<S> {
        Bounded {
            inner,
            limits: self.clone(),
        }
    }
}

/// The service [`MessageLimits`] makes.
#[derive(Debug, Clone)]
pub struct Bounded<S> {
    inner: S,
    limits: MessageLimits,
}

impl<S> tower_service::Service<http::Request<Body>> for Bounded<S>
where
    S: tower_service::Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let path = request.uri().path().to_owned();
        let request = request.map(|body| self.limits.bound(&path, body));
        self.inner.call(request)
    }
}

/// A request body that follows the gRPC framing (a flag byte, a 4-byte big-endian length,
/// the message) and fails when a length is over the limit or a message stalls.
struct BoundedBody {
    inner: Body,
    rpc: Arc<str>,
    limit: usize,
    stall: Duration,
    /// The prefix being read, and how much of it is in.
    prefix: [u8; 5],
    have: usize,
    /// The current message's declared length and how much of it is still to come.
    declared: usize,
    remaining: usize,
    /// Armed while a message is partly in.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    done: bool,
}

impl BoundedBody {
    /// Follows the framing through `data`; an error if a prefix declares too much.
    fn scan(&mut self, mut data: &[u8]) -> Result<(), Status> {
        while !data.is_empty() {
            if self.remaining == 0 {
                let take = (5 - self.have).min(data.len());
                self.prefix[self.have..self.have + take].copy_from_slice(&data[..take]);
                self.have += take;
                data = &data[take..];
                if self.have == 5 {
                    self.have = 0;
                    let len = u32::from_be_bytes([
                        self.prefix[1],
                        self.prefix[2],
                        self.prefix[3],
                        self.prefix[4],
                    ]) as usize;
                    if len > self.limit {
                        return Err(Status::resource_exhausted(format!(
                            "{}: a message of {len} bytes is over this server's limit of {} bytes for it",
                            self.rpc, self.limit
                        )));
                    }
                    self.declared = len;
                    self.remaining = len;
                }
            } else {
                let take = self.remaining.min(data.len());
                self.remaining -= take;
                data = &data[take..];
            }
        }
        Ok(())
    }

    fn partial(&self) -> bool {
        self.have > 0 || self.remaining > 0
    }
}

impl HttpBody for BoundedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && let Err(status) = this.scan(data)
                {
                    this.done = true;
                    return Poll::Ready(Some(Err(status)));
                }
                if this.partial() {
                    let deadline = tokio::time::Instant::now() + this.stall;
                    match &mut this.timer {
                        Some(timer) => timer.as_mut().reset(deadline),
                        None => this.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
                    }
                } else {
                    this.timer = None;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(other) => Poll::Ready(other),
            Poll::Pending => {
                if let Some(timer) = &mut this.timer
                    && timer.as_mut().poll(cx).is_ready()
                {
                    this.done = true;
                    let got = this.declared - this.remaining;
                    return Poll::Ready(Some(Err(Status::resource_exhausted(format!(
                        "{}: a message stalled: {got} of its {} bytes arrived, then none for {:?}",
                        this.rpc, this.declared, this.stall
                    )))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn prefix(len: u32) -> Vec<u8> {
        let mut v = vec![0u8];
        v.extend_from_slice(&len.to_be_bytes());
        v
    }

    /// A body fed by the test, chunk by chunk.
    fn fed() -> (tokio::sync::mpsc::Sender<Bytes>, Body) {
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let body = http_body_util::StreamBody::new(tokio_stream::StreamExt::map(stream, |b| {
            Ok::<_, Status>(Frame::data(b))
        }));
        (tx, Body::new(body))
    }

    #[tokio::test]
    async fn a_prefix_over_the_limit_fails_before_its_message_arrives() {
        let limits = MessageLimits::new(100).rpc("/p.S/Big", 1000);
        let (tx, body) = fed();
        let mut body = limits.bound("/p.S/Small", body);
        // Split prefixes and several messages in one chunk are followed.
        let mut first = prefix(3);
        first.extend_from_slice(b"abc");
        first.extend_from_slice(&prefix(100)[..2]);
        tx.send(Bytes::from(first)).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        let mut rest = prefix(100)[2..].to_vec();
        rest.extend_from_slice(&[0; 100]);
        rest.extend_from_slice(&prefix(101));
        tx.send(Bytes::from(rest)).await.unwrap();
        let status = body.frame().await.unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(
            status.message().contains("101 bytes") && status.message().contains("limit of 100"),
            "{}",
            status.message()
        );
        assert_eq!(limits.limit("/p.S/Big"), 1000);
    }

    #[tokio::test]
    async fn a_stalled_message_fails_and_an_idle_stream_does_not() {
        let limits = MessageLimits::new(1000).stall(Duration::from_millis(50));
        let (tx, body) = fed();
        let mut body = limits.bound("/p.S/M", body);
        let mut whole = prefix(2);
        whole.extend_from_slice(b"ok");
        tx.send(Bytes::from(whole)).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        // Between messages a stream may be quiet as long as it likes.
        let idle = tokio::time::timeout(Duration::from_millis(200), body.frame()).await;
        assert!(idle.is_err(), "an idle stream must not fail");
        let mut half = prefix(10);
        half.extend_from_slice(b"12345");
        tx.send(Bytes::from(half)).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        let status = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("the stall is noticed")
            .unwrap()
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(
            status.message().contains("5 of its 10 bytes"),
            "{}",
            status.message()
        );
        drop(tx);
    }
}
