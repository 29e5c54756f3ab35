//! The process-wide budget for what responses hold in memory: inline snapshot data
//! (`GetSnapshot` with `include_data`) and snapshot diffs, on every replica. A response
//! reserves its bytes before it reads them, and gives them back only once its body has been
//! sent (or dropped: the client went away): the handler puts its reservation in the
//! response's extensions ([`Held`]), and [`HoldLayer`] moves it into the body. So a client
//! that asks and never reads holds its reservation, not more memory than the budget. Past
//! the budget a call is refused at once with RESOURCE_EXHAUSTED naming the streaming read,
//! instead of the process growing with every concurrent call.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::body::Body;

use crate::error::Error;

/// The budget's unit: reservations are rounded up to whole KiB.
const UNIT: u64 = 1024;

/// The default budget (`--response-memory-mib`).
pub(crate) const DEFAULT_MIB: u64 = 256;

/// Bytes responses may hold in memory at once.
#[derive(Clone)]
pub(crate) struct ResponseBudget {
    units: Arc<Semaphore>,
    total_units: u64,
}

/// Bytes reserved; given back when dropped.
pub(crate) struct Reserved(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

impl ResponseBudget {
    /// A budget of `bytes` (at least one unit).
    pub(crate) fn new(bytes: u64) -> Self {
        let total_units = (bytes / UNIT).clamp(1, u64::from(u32::MAX));
        Self {
            units: Arc::new(Semaphore::new(total_units as usize)),
            total_units,
        }
    }

    /// The budget in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.total_units * UNIT
    }

    /// Reserves `bytes` for `what` (e.g. "snapshot 7's inline data"), or refuses with
    /// RESOURCE_EXHAUSTED naming `ReadSnapshotData`, the streamed read, as the way.
    pub(crate) fn reserve(&self, bytes: u64, what: &str) -> Result<Reserved, Error> {
        let units = bytes.div_ceil(UNIT).max(1);
        let mib = |b: u64| b.div_ceil(1 << 20);
        if units > self.total_units {
            return Err(Error::TooMuchMemory(format!(
                "{what} needs {} MiB in memory, more than the {} MiB all responses may hold \
                 (--response-memory-mib): read it with ReadSnapshotData, which streams it \
                 (cairnctl snapshot export)",
                mib(bytes),
                mib(self.bytes())
            )));
        }
        let permit = u32::try_from(units)
            .ok()
            .and_then(|n| self.units.clone().try_acquire_many_owned(n).ok())
            .ok_or_else(|| {
                Error::TooMuchMemory(format!(
                    "{what} needs {} MiB in memory and other responses hold most of the {} MiB \
                     all may hold at once (--response-memory-mib): try again later, or read it \
                     with ReadSnapshotData, which streams it (cairnctl snapshot export)",
                    mib(bytes),
                    mib(self.bytes())
                ))
            })?;
        Ok(Reserved(Some(permit)))
    }
}

/// Reservations a handler hands to its response (`response.extensions_mut().insert(..)`),
/// held by [`HoldLayer`] until the body is sent.
#[derive(Clone, Default)]
pub(crate) struct Held(Arc<Mutex<Vec<Reserved>>>);

impl Held {
    /// Holds `reserved`s.
    pub(crate) fn new(reserved: Vec<Reserved>) -> Self {
        Self(Arc::new(Mutex::new(reserved)))
    }

    fn take(&self) -> Vec<Reserved> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A response body that keeps reservations until it is dropped (sent, or abandoned).
struct HoldingBody {
    inner: Body,
    _held: Vec<Reserved>,
}

impl http_body::Body for HoldingBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Moves a response's [`Held`] reservations into its body.
#[derive(Clone, Copy)]
pub(crate) struct HoldLayer;

impl<S> tower_layer::Layer<S> for HoldLayer {
    type Service = Holding<S>;

    fn layer(&self, inner: S) -> Holding<S> {
        Holding { inner }
    }
}

/// The service [`HoldLayer`] makes.
#[derive(Clone)]
pub(crate) struct Holding<S> {
    inner: S,
}

use crate::BoxFuture;

impl<S, B> tower_service::Service<http::Request<B>> for Holding<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<http::Response<Body>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let call = self.inner.call(request);
        Box::pin(async move {
            let response = call.await?;
            let Some(held) = response.extensions().get::<Held>().map(Held::take) else {
                return Ok(response);
            };
            let (parts, inner) = response.into_parts();
            let body = Body::new(HoldingBody { inner, _held: held });
            Ok(http::Response::from_parts(parts, body))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_bounded_and_given_back() {
        let budget = ResponseBudget::new(10 << 20);
        let a = budget.reserve(6 << 20, "a").unwrap();
        let refused = budget.reserve(6 << 20, "b").err().unwrap();
        assert!(
            refused.to_string().contains("ReadSnapshotData"),
            "{refused}"
        );
        assert_eq!(
            tonic::Status::from(refused).code(),
            tonic::Code::ResourceExhausted
        );
        let c = budget.reserve(4 << 20, "c").unwrap();
        drop(a);
        let _b = budget.reserve(6 << 20, "b").unwrap();
        drop(c);
        let whole = budget.reserve(11 << 20, "too big").err().unwrap();
        assert!(
            whole.to_string().contains("more than the 10 MiB"),
            "{whole}"
        );
        // Zero bytes still take a unit, and come back.
        let z = budget.reserve(0, "nothing").unwrap();
        drop(z);
    }

    /// A response's reservation lives in its body: given back when the body is dropped
    /// (sent, or abandoned by its client), not when the handler returns.
    #[tokio::test]
    async fn a_reservation_is_held_until_the_body_goes() {
        use tower_layer::Layer;
        use tower_service::Service;
        /// One frame of bytes, then the end (not at its end before: tonic keeps it).
        struct OneFrame(Option<bytes::Bytes>);
        impl http_body::Body for OneFrame {
            type Data = bytes::Bytes;
            type Error = std::convert::Infallible;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
                Poll::Ready(self.0.take().map(|b| Ok(http_body::Frame::data(b))))
            }
            fn is_end_stream(&self) -> bool {
                self.0.is_none()
            }
        }
        /// A handler that answers with `Held` in the response's extensions.
        struct Handler(Held);
        impl tower_service::Service<http::Request<()>> for Handler {
            type Response = http::Response<Body>;
            type Error = std::convert::Infallible;
            type Future = std::future::Ready<Result<Self::Response, Self::Error>>;
            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
                Poll::Ready(Ok(()))
            }
            fn call(&mut self, _: http::Request<()>) -> Self::Future {
                let body = Body::new(OneFrame(Some(bytes::Bytes::from_static(b"data"))));
                let mut response = http::Response::new(body);
                response.extensions_mut().insert(self.0.clone());
                std::future::ready(Ok(response))
            }
        }
        let budget = ResponseBudget::new(1 << 20);
        let held = Held::new(vec![budget.reserve(1 << 20, "a response").unwrap()]);
        let mut service = HoldLayer.layer(Handler(held));
        let response = service.call(http::Request::new(())).await.unwrap();
        assert!(
            budget.reserve(1, "another").is_err(),
            "held while the body is unsent"
        );
        drop(response);
        budget.reserve(1 << 20, "after").unwrap();
    }
}
