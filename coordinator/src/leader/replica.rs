//! What one coordinator replica is now: the leader of a term (with the channel to that
//! term's task and the fenced metadata it writes through) or a follower that knows, from
//! etcd, which replica leads. The service asks it before every write; the server's
//! [`HintLayer`] adds `cairn-leader: HOST:PORT` to every response of a follower that knows
//! the leader, so daemons, `cairnctl` and the SDK can follow it.

use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use http::HeaderValue;
use tokio::sync::mpsc;
use tonic::Status;
use tonic::body::Body;

use crate::leader::election::Replicas;
use crate::store::Metadata;
use crate::task::Msg;

/// The response metadata naming the leader.
pub(crate) const LEADER_HEADER: &str = "cairn-leader";

/// The leader's side of a term, as the service uses it.
#[derive(Clone)]
pub(crate) struct Leading {
    /// The term's task.
    pub tx: mpsc::Sender<Msg>,
    /// The metadata, written through the term's fence.
    pub meta: Metadata,
    /// The term itself: what is sent on its behalf is checked against it when it leaves.
    pub leadership: Arc<crate::leader::election::Leadership>,
}

/// This replica's role now.
pub(crate) struct Replica {
    /// This replica's advertised address.
    own: String,
    leading: RwLock<Option<Leading>>,
    /// Who leads, as last read from etcd.
    known: RwLock<Replicas>,
    /// Why the last read of who leads failed ("" after one that worked).
    unknown_why: RwLock<String>,
    /// Bumped whenever the role or the known leader changes.
    changes: tokio::sync::watch::Sender<u64>,
}

impl Replica {
    pub(crate) fn new(own: String) -> Self {
        Self {
            own,
            leading: RwLock::new(None),
            known: RwLock::new(Replicas::default()),
            unknown_why: RwLock::new(String::new()),
            changes: tokio::sync::watch::Sender::new(0),
        }
    }

    /// This replica's advertised address.
    pub(crate) fn own(&self) -> &str {
        &self.own
    }

    /// The term this replica leads, or UNAVAILABLE naming the leader (in the message and
    /// in `cairn-leader`).
    pub(crate) fn leading(&self) -> Result<Leading, Status> {
        self.leading
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| self.not_leader())
    }

    /// Whether this replica leads a term now.
    pub(crate) fn is_leading(&self) -> bool {
        self.leading
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The term this replica leads, waiting up to `limit` while no leader is known (an
    /// election under way): a daemon that asks during an election is answered as soon as
    /// there is a leader, here or named, instead of retrying with a growing backoff.
    pub(crate) async fn leading_or_wait(&self, limit: Duration) -> Result<Leading, Status> {
        let mut changes = self.changes.subscribe();
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Ok(leading) = self.leading() {
                return Ok(leading);
            }
            if self.leader_elsewhere().is_some() {
                return Err(self.not_leader());
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                _ => return Err(self.not_leader()),
            }
        }
    }

    /// UNAVAILABLE for a call only the leader answers.
    pub(crate) fn not_leader(&self) -> Status {
        let mut status = match self.leader_elsewhere() {
            Some((address, term)) => Status::unavailable(format!(
                "this coordinator ({}) is a follower: the leader is {address} (term {term}); \
                 writes and node sessions go there",
                self.own
            )),
            None => {
                let why = self.unknown_why.read().unwrap_or_else(|e| e.into_inner());
                let why = if why.is_empty() {
                    "an election is under way".to_owned()
                } else {
                    format!("who leads cannot be read: {why}")
                };
                Status::unavailable(format!(
                    "this coordinator ({}) is a follower and no leader is known yet ({why}): \
                     try again shortly",
                    self.own
                ))
            }
        };
        if let Some(value) = self
            .hint()
            .and_then(|v| tonic::metadata::AsciiMetadataValue::try_from(v.as_bytes()).ok())
        {
            status.metadata_mut().insert(LEADER_HEADER, value);
        }
        status
    }

    /// The leader's address and term when another replica leads.
    pub(crate) fn leader_elsewhere(&self) -> Option<(String, u64)> {
        if self.is_leading() {
            return None;
        }
        let known = self.known.read().unwrap_or_else(|e| e.into_inner());
        known
            .leader()
            .filter(|(address, _)| *address != self.own)
            .map(|(a, t)| (a.to_owned(), t))
    }

    /// The `cairn-leader` value, when another replica leads.
    fn hint(&self) -> Option<HeaderValue> {
        let (address, _) = self.leader_elsewhere()?;
        HeaderValue::from_str(&address).ok()
    }

    /// Starts (`Some`) or ends (`None`) a term.
    pub(crate) fn set_leading(&self, leading: Option<Leading>) {
        *self.leading.write().unwrap_or_else(|e| e.into_inner()) = leading;
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// What etcd says about the replicas; returns whether the leader changed.
    pub(crate) fn set_known(&self, replicas: Replicas) -> bool {
        self.unknown_why
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        let mut known = self.known.write().unwrap_or_else(|e| e.into_inner());
        let changed = known.leader() != replicas.leader();
        *known = replicas;
        drop(known);
        if changed {
            self.changes.send_modify(|n| *n = n.wrapping_add(1));
        }
        changed
    }

    /// The replicas as last read from etcd.
    pub(crate) fn known(&self) -> Replicas {
        self.known.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Who leads could not be read (etcd unreachable): no leader is named until it can
    /// be; returns whether a leader was known until now.
    pub(crate) fn set_unknown(&self, why: String) -> bool {
        *self.unknown_why.write().unwrap_or_else(|e| e.into_inner()) = why;
        let mut known = self.known.write().unwrap_or_else(|e| e.into_inner());
        let had = known.leader().is_some();
        *known = Replicas::default();
        had
    }
}

/// Adds `cairn-leader` to every response of a follower that knows the leader.
#[derive(Clone)]
pub(crate) struct HintLayer(pub Arc<Replica>);

impl<S> tower_layer::Layer<S> for HintLayer {
    type Service = Hinted<S>;

    fn layer(&self, inner: S) -> Hinted<S> {
        Hinted {
            inner,
            replica: self.0.clone(),
        }
    }
}

/// The service [`HintLayer`] makes.
#[derive(Clone)]
pub(crate) struct Hinted<S> {
    inner: S,
    replica: Arc<Replica>,
}

use crate::BoxFuture;

impl<S, B> tower_service::Service<http::Request<B>> for Hinted<S>
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
        let replica = self.replica.clone();
        let call = self.inner.call(request);
        Box::pin(async move {
            let mut response = call.await?;
            if let Some(value) = replica.hint() {
                response.headers_mut().insert(LEADER_HEADER, value);
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_session_asked_during_an_election_is_answered_when_a_leader_is_known() {
        let replica = Arc::new(Replica::new("c1:7000".into()));
        let waiting = tokio::spawn({
            let replica = replica.clone();
            async move { replica.leading_or_wait(Duration::from_secs(30)).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        replica.set_known(Replicas {
            list: vec![("c2:7000".into(), 9)],
        });
        let status = waiting.await.unwrap().err().unwrap();
        assert_eq!(status.metadata().get(LEADER_HEADER).unwrap(), "c2:7000");
        // Without any news, it gives up at the limit, saying no leader is known.
        let alone = Replica::new("c3:7000".into());
        let status = alone
            .leading_or_wait(Duration::from_millis(10))
            .await
            .err()
            .unwrap();
        assert!(
            status.message().contains("no leader is known"),
            "{status:?}"
        );
    }

    #[test]
    fn a_follower_names_the_leader_and_the_leader_names_nobody() {
        let replica = Replica::new("c1:7000".into());
        let status = replica.not_leader();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(
            status.message().contains("no leader is known"),
            "{status:?}"
        );
        assert!(status.metadata().get(LEADER_HEADER).is_none());
        let changed = replica.set_known(Replicas {
            list: vec![("c2:7000".into(), 41), ("c1:7000".into(), 44)],
        });
        assert!(changed);
        let status = replica.not_leader();
        assert!(
            status.message().contains("the leader is c2:7000 (term 41)"),
            "{status:?}"
        );
        assert_eq!(status.metadata().get(LEADER_HEADER).unwrap(), "c2:7000");
        // The same leader again is no change; a new term is.
        assert!(!replica.set_known(Replicas {
            list: vec![("c2:7000".into(), 41)],
        }));
        assert!(replica.set_known(Replicas {
            list: vec![("c2:7000".into(), 50)],
        }));
        // etcd unreachable: nobody is named, and the message says why.
        assert!(replica.set_unknown("etcd unavailable: connection refused".into()));
        let status = replica.not_leader();
        assert!(
            status
                .message()
                .contains("who leads cannot be read: etcd unavailable"),
            "{status:?}"
        );
        assert!(status.metadata().get(LEADER_HEADER).is_none());
        // A replica that reads itself as the leader (before its term starts) names nobody.
        replica.set_known(Replicas {
            list: vec![("c1:7000".into(), 60)],
        });
        assert!(replica.hint().is_none());
    }
}
