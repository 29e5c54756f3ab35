//! Leadership among coordinator replicas, through etcd's election API.
//!
//! Each replica grants a lease (`--leader-lease-ttl`, kept alive every TTL/3) and campaigns
//! on `/cairn/<cluster>/leader` with its advertised address as the value. The winner's
//! **term** is the creation revision of its election key: etcd's revision only grows, so a
//! later leader always has a higher term. A term ends, for good, when any of these happens:
//!
//! - a guarded write finds the election key gone or another's (the store's fence,
//!   [`crate::store::EtcdKv`]);
//! - etcd says the lease is gone (expired or revoked), or the election key is deleted (a
//!   watch on it, so a lease revoked from outside ends the term within milliseconds, not at
//!   the next keep-alive);
//! - the local clock passes the last successful keep-alive + TTL − margin: the replica stops
//!   by itself, before etcd can have given the lease away, without waiting to be told
//!   (a replica that was paused finds this first when it wakes up);
//! - the replica shuts down (it resigns, so a follower takes over at once).
//!
//! A term that ended is never resumed: the replica campaigns again with a new lease, and a
//! win is a new, higher term.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, EventType, GetOptions, LeaderKey, ResignOptions, SortOrder, SortTarget, WatchOptions,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::store::StoreError;

/// One term of leadership (or, while campaigning, the lease it would lead with).
pub(crate) struct Leadership {
    term: AtomicU64,
    /// The lease under which the election key and the members' keys are held; 0 for the
    /// embedded store.
    lease: i64,
    /// Ended, for good.
    ended: CancellationToken,
    /// Why it ended.
    why: Mutex<Option<String>>,
    /// The zero of `deadline_ms`.
    base: Instant,
    /// Milliseconds after `base` past which the lease may have expired; `u64::MAX`: never.
    deadline_ms: AtomicU64,
}

impl Leadership {
    /// The only coordinator of an embedded store: term 0, for as long as it runs.
    pub(crate) fn forever() -> Arc<Self> {
        Arc::new(Self::with_lease(0, u64::MAX))
    }

    fn with_lease(lease: i64, deadline_ms: u64) -> Self {
        Self {
            term: AtomicU64::new(0),
            lease,
            ended: CancellationToken::new(),
            why: Mutex::new(None),
            base: Instant::now(),
            deadline_ms: AtomicU64::new(deadline_ms),
        }
    }

    /// The term (0 before it is won, and for the embedded store).
    pub(crate) fn term(&self) -> u64 {
        self.term.load(Ordering::Relaxed)
    }

    /// The lease of the election key.
    pub(crate) fn lease(&self) -> i64 {
        self.lease
    }

    /// Whether this replica may still act as the leader of its term: not ended, and its
    /// lease surely alive by the local monotonic clock. Past the deadline it ends here.
    pub(crate) fn valid(&self) -> bool {
        if self.ended.is_cancelled() {
            return false;
        }
        let deadline = self.deadline_ms.load(Ordering::Relaxed);
        if deadline != u64::MAX && self.elapsed_ms() >= deadline {
            self.end("no successful keep-alive of the lease for TTL − margin: it may have expired");
            return false;
        }
        true
    }

    /// Ends the term (the first reason is kept).
    pub(crate) fn end(&self, why: impl Into<String>) {
        let mut held = self.why.lock().unwrap_or_else(|e| e.into_inner());
        if held.is_none() {
            let why = why.into();
            if self.term() > 0 {
                tracing::warn!(term = self.term(), "leadership lost: {why}");
            }
            *held = Some(why);
        }
        self.ended.cancel();
    }

    /// Why the term ended ("" while it has not).
    pub(crate) fn why(&self) -> String {
        self.why
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default()
    }

    /// Resolves when the term ends: told (a fenced write, the lease gone, shutdown) or by
    /// the local clock passing the deadline.
    pub(crate) async fn ended(&self) {
        loop {
            let deadline = self.deadline_ms.load(Ordering::Relaxed);
            if deadline == u64::MAX {
                return self.ended.cancelled().await;
            }
            let at = self.base + Duration::from_millis(deadline);
            tokio::select! {
                () = self.ended.cancelled() => return,
                () = tokio::time::sleep_until(at) => {
                    if !self.valid() {
                        return;
                    }
                }
            }
        }
    }

    fn elapsed_ms(&self) -> u64 {
        self.base
            .elapsed()
            .as_millis()
            .try_into()
            .unwrap_or(u64::MAX)
    }

    /// A keep-alive sent at `sent` succeeded: the lease lives at least until `sent + ttl`
    /// at etcd; this replica believes it until `sent + ttl − margin`.
    fn renewed(&self, sent: Instant, ttl: Duration) {
        let until = sent.saturating_duration_since(self.base) + ttl.saturating_sub(margin(ttl));
        let ms = until.as_millis().try_into().unwrap_or(u64::MAX - 1);
        self.deadline_ms.fetch_max(ms, Ordering::Relaxed);
    }
}

/// How much sooner than etcd a replica gives up its lease: a fifth of the TTL, at least
/// 200 ms (clock rates differ a little; a keep-alive's answer takes time).
pub(crate) fn margin(ttl: Duration) -> Duration {
    (ttl / 5).max(Duration::from_millis(200))
}

/// How long a read of who leads may take.
const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// A replica's view of who leads, from etcd.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Replicas {
    /// Every campaigning replica as (address, creation revision), lowest revision (the
    /// leader) first.
    pub list: Vec<(String, u64)>,
}

impl Replicas {
    /// The leader's address and term, if one leads.
    pub(crate) fn leader(&self) -> Option<(&str, u64)> {
        self.list.first().map(|(a, r)| (a.as_str(), *r))
    }
}

/// Campaigns for leadership of one cluster.
#[derive(Clone)]
pub(crate) struct Elector {
    /// A client without a request timeout: a campaign waits as long as it takes.
    client: Client,
    /// The election's name, `/cairn/<cluster>/leader`.
    name: String,
    /// This replica's advertised address: the election key's value.
    address: String,
    ttl: Duration,
}

impl Elector {
    pub(crate) fn new(client: Client, name: String, address: String, ttl: Duration) -> Self {
        Self {
            client,
            name,
            address,
            ttl,
        }
    }

    /// Every campaigning replica, the leader first (etcd's election keys are
    /// `<name>/<lease in hex>`; the lowest creation revision leads).
    pub(crate) async fn replicas(&self) -> Result<Replicas, StoreError> {
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(64);
        // This client has no request timeout (for the campaign): bound the read here, so
        // that a hung etcd makes who leads unknown rather than stale.
        let mut client = self.client.clone();
        let read = client.get(format!("{}/", self.name), Some(options));
        let response = tokio::time::timeout(READ_TIMEOUT, read)
            .await
            .map_err(|_| StoreError::new(format!("etcd did not answer within {READ_TIMEOUT:?}")))?
            .map_err(|e| StoreError::new(format!("etcd unavailable: {e}")))?;
        let list = response
            .kvs()
            .iter()
            .map(|kv| {
                let address = String::from_utf8_lossy(kv.value())
                    .chars()
                    .take(256)
                    .collect();
                (address, u64::try_from(kv.create_revision()).unwrap_or(0))
            })
            .collect();
        Ok(Replicas { list })
    }

    /// Grants a lease, keeps it alive, and campaigns until this replica leads (the term
    /// returned) or `stop`. An error (etcd unreachable, the lease lost while waiting) is
    /// returned for the caller to try again.
    pub(crate) async fn campaign(
        &self,
        stop: &CancellationToken,
    ) -> Result<Option<(Arc<Leadership>, LeaderKey)>, StoreError> {
        let etcd = |e: etcd_client::Error| StoreError::new(format!("etcd unavailable: {e}"));
        let mut client = self.client.clone();
        let ttl_secs = i64::try_from(self.ttl.as_secs()).unwrap_or(i64::MAX);
        let sent = Instant::now();
        let granted = tokio::time::timeout(self.ttl, client.lease_grant(ttl_secs, None))
            .await
            .map_err(|_| StoreError::new("etcd did not grant a lease in time"))?
            .map_err(etcd)?;
        let ttl = Duration::from_secs(u64::try_from(granted.ttl()).unwrap_or(0).max(1));
        let leadership = Arc::new(Leadership::with_lease(granted.id(), 0));
        leadership.renewed(sent, ttl);
        tokio::spawn(keep_alive(client.clone(), leadership.clone(), ttl));
        let campaign = client.campaign(self.name.as_str(), self.address.as_str(), granted.id());
        let won = tokio::select! {
            () = stop.cancelled() => None,
            () = leadership.ended() => None,
            won = campaign => Some(won),
        };
        let Some(won) = won else {
            let why = if stop.is_cancelled() {
                "shutting down"
            } else {
                "the lease was lost while campaigning"
            };
            leadership.end(why);
            revoke(&mut client, granted.id()).await;
            return if stop.is_cancelled() {
                Ok(None)
            } else {
                Err(StoreError::new(leadership.why()))
            };
        };
        let key = match won.map_err(etcd).map(|mut r| r.take_leader()) {
            Ok(Some(key)) => key,
            Ok(None) => {
                leadership.end("etcd's campaign answer named no leader key");
                revoke(&mut client, granted.id()).await;
                return Err(StoreError::new(
                    "etcd's campaign answer named no leader key",
                ));
            }
            Err(e) => {
                leadership.end(e.to_string());
                revoke(&mut client, granted.id()).await;
                return Err(e);
            }
        };
        leadership
            .term
            .store(u64::try_from(key.rev()).unwrap_or(0), Ordering::Relaxed);
        if !leadership.valid() {
            // Won after the lease may have expired (a long pause while campaigning).
            self.step_down(&leadership, key).await;
            return Err(StoreError::new(
                "won the election after the lease may have expired",
            ));
        }
        tokio::spawn(watch_key(
            client,
            key.key().to_vec(),
            key.rev(),
            leadership.clone(),
        ));
        Ok(Some((leadership, key)))
    }

    /// Gives up a term: resigns (so a follower can win at once) and revokes the lease (the
    /// members' keys held under it go with it). Best effort: etcd may be unreachable, and
    /// then the lease expires by itself.
    pub(crate) async fn step_down(&self, leadership: &Leadership, key: LeaderKey) {
        leadership.end("stepped down");
        let mut client = self.client.clone();
        let resign = client.resign(Some(ResignOptions::new().with_leader(key)));
        let _ = tokio::time::timeout(Duration::from_secs(2), resign).await;
        revoke(&mut client, leadership.lease()).await;
    }
}

async fn revoke(client: &mut Client, lease: i64) {
    let _ = tokio::time::timeout(Duration::from_secs(2), client.lease_revoke(lease)).await;
}

/// Keeps `leadership`'s lease alive every TTL/3 until the term ends. A keep-alive that
/// succeeds moves the local deadline on; etcd saying the lease is gone ends the term; a
/// failure to reach etcd is retried (the deadline ends the term if it lasts).
async fn keep_alive(mut client: Client, leadership: Arc<Leadership>, ttl: Duration) {
    let period = ttl / 3;
    'stream: while !leadership.ended.is_cancelled() {
        let opened =
            tokio::time::timeout(period, client.lease_keep_alive(leadership.lease())).await;
        let (mut keeper, mut answers) = match opened {
            Ok(Ok(pair)) => pair,
            Ok(Err(e)) => {
                tracing::debug!("lease keep-alive: {e}");
                pause(&leadership, Duration::from_millis(250)).await;
                continue;
            }
            Err(_) => continue,
        };
        loop {
            let sent = Instant::now();
            let answer = tokio::time::timeout(period, async {
                keeper.keep_alive().await?;
                answers.message().await
            });
            tokio::select! {
                () = leadership.ended.cancelled() => return,
                answer = answer => match answer {
                    Ok(Ok(Some(a))) if a.ttl() > 0 => leadership.renewed(sent, ttl),
                    Ok(Ok(Some(_))) => {
                        leadership.end("etcd says the lease is gone (expired or revoked)");
                        return;
                    }
                    Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                        pause(&leadership, Duration::from_millis(250)).await;
                        continue 'stream;
                    }
                },
            }
            pause(&leadership, period.saturating_sub(sent.elapsed())).await;
        }
    }
}

/// Ends the term as soon as its election key is deleted (its lease revoked or expired, or
/// the key removed by hand), by watching the key from the revision that created it. A
/// broken watch is opened again; while etcd cannot be reached the local deadline rules.
async fn watch_key(mut client: Client, key: Vec<u8>, created: i64, leadership: Arc<Leadership>) {
    let mut from = created;
    while !leadership.ended.is_cancelled() {
        let options = WatchOptions::new().with_start_revision(from);
        let mut stream = match client.watch(key.clone(), Some(options)).await {
            Ok(stream) => stream,
            Err(_) => {
                pause(&leadership, Duration::from_millis(250)).await;
                continue;
            }
        };
        loop {
            let message = tokio::select! {
                () = leadership.ended.cancelled() => return,
                message = stream.message() => message,
            };
            let Ok(Some(response)) = message else {
                break;
            };
            if response.compact_revision() > 0 {
                // The history from `from` is compacted: read the key as it is now.
                let gone = client.get(key.clone(), None).await.is_ok_and(|r| {
                    r.kvs()
                        .first()
                        .is_none_or(|kv| kv.create_revision() != created)
                });
                if gone {
                    leadership.end("the election key is gone (compacted history)");
                    return;
                }
                from = response.compact_revision();
                break;
            }
            for event in response.events() {
                if event.event_type() == EventType::Delete {
                    leadership
                        .end("the election key was deleted (the lease was revoked or expired)");
                    return;
                }
                if let Some(kv) = event.kv() {
                    from = from.max(kv.mod_revision() + 1);
                }
            }
        }
        pause(&leadership, Duration::from_millis(250)).await;
    }
}

/// Sleeps `d`, or until the term ends.
async fn pause(leadership: &Leadership, d: Duration) {
    tokio::select! {
        () = leadership.ended.cancelled() => {}
        () = tokio::time::sleep(d) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_local_deadline_ends_a_term_without_being_told() {
        let ttl = Duration::from_secs(5);
        let l = Leadership::with_lease(7, 0);
        l.term.store(42, Ordering::Relaxed);
        l.renewed(Instant::now(), ttl);
        assert!(l.valid());
        // Just before TTL − margin: still valid; at it: ended, with the reason.
        tokio::time::advance(ttl - margin(ttl) - Duration::from_millis(1)).await;
        assert!(l.valid());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!l.valid());
        assert!(l.why().contains("may have expired"), "{}", l.why());
        // Ended is for good: a late keep-alive does not bring it back.
        l.renewed(Instant::now(), ttl);
        assert!(!l.valid());
    }

    #[tokio::test(start_paused = true)]
    async fn ended_resolves_at_the_deadline_and_a_renewal_moves_it() {
        let ttl = Duration::from_secs(5);
        let l = Arc::new(Leadership::with_lease(7, 0));
        l.renewed(Instant::now(), ttl);
        let start = Instant::now();
        let waiter = tokio::spawn({
            let l = l.clone();
            async move { l.ended().await }
        });
        tokio::time::sleep(Duration::from_secs(2)).await;
        l.renewed(Instant::now(), ttl);
        waiter.await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(2) + ttl - margin(ttl));
    }

    #[tokio::test]
    async fn forever_never_ends_by_itself_and_the_first_reason_stays() {
        let l = Leadership::forever();
        assert!(l.valid());
        assert_eq!(l.term(), 0);
        l.end("first");
        l.end("second");
        assert!(!l.valid());
        assert_eq!(l.why(), "first");
        l.ended().await;
    }

    #[test]
    fn the_margin() {
        assert_eq!(margin(Duration::from_secs(5)), Duration::from_secs(1));
        assert_eq!(margin(Duration::from_secs(2)), Duration::from_millis(400));
        assert_eq!(
            margin(Duration::from_millis(500)),
            Duration::from_millis(200)
        );
    }
}
