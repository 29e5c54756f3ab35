//! Leading among coordinator replicas: the election through etcd ([`election`]), what a
//! replica serves while it follows or leads ([`replica`]), and the terms — each won
//! election recovers the task from what the previous leader stored, runs it until the
//! term ends, and campaigns again ([`Terms`]).

pub mod election;
pub mod forward;
pub mod replica;

use std::sync::Arc;
use std::time::Duration;

use cairn_blob::BlobStore;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::store::{AnyKv, EtcdKv, Keys, Metadata};
use crate::{CoordinatorConfig, LEADER_HEALTH, RunError};
use election::{Elector, Leadership};
use replica::{Leading, Replica};

/// How long a term's task may take to stop once its term ended before it is dropped.
const TERM_TASK_GRACE: Duration = Duration::from_secs(2);

/// How often a replica reads who leads from etcd (a follower names the leader within this
/// after an election).
const WATCH_LEADER_EVERY: Duration = Duration::from_millis(200);

/// What every term needs.
pub(crate) struct Terms {
    pub(crate) config: CoordinatorConfig,
    pub(crate) keys: Keys,
    /// The store, unfenced (the embedded store's coordinator writes through it).
    pub(crate) kv: Arc<AnyKv>,
    /// etcd, when the store is etcd: each term writes through its own fenced view.
    pub(crate) etcd: Option<EtcdKv>,
    pub(crate) elector: Option<Elector>,
    pub(crate) blobs: BlobStore,
    pub(crate) metrics: crate::metrics::CoordinatorMetrics,
    pub(crate) health: HealthReporter,
    pub(crate) replica: Arc<Replica>,
}

/// A term won and recovered, ready to run.
pub(crate) struct Term {
    state: crate::task::State,
    rx: mpsc::Receiver<crate::task::Msg>,
    tx: mpsc::Sender<crate::task::Msg>,
    meta: Metadata,
    leadership: Arc<Leadership>,
    /// The election key (none with the embedded store).
    key: Option<etcd_client::LeaderKey>,
}

impl Terms {
    /// A fresh task for a term: over the store fenced by the term's key, recovered from
    /// what the previous leader left.
    pub(crate) async fn start_term(
        &self,
        leadership: Arc<Leadership>,
        key: Option<etcd_client::LeaderKey>,
    ) -> Result<Term, RunError> {
        if key.is_some() {
            // What the previous leader stored and collected since this replica listed the
            // store: its index must not answer from before.
            self.blobs
                .reload_index()
                .await
                .map_err(|error| RunError::Blob {
                    path: self.blobs.location().to_owned(),
                    error,
                })?;
        }
        let kv = match (&self.etcd, &key) {
            (Some(etcd), Some(key)) => {
                let barrier = self.keys.barrier(leadership.lease());
                Arc::new(AnyKv::Etcd(Box::new(etcd.fenced(
                    leadership.clone(),
                    key,
                    barrier,
                ))))
            }
            _ => self.kv.clone(),
        };
        let meta = Metadata::new(kv, self.keys.clone());
        let (tx, rx) = mpsc::channel(1024);
        let config = &self.config;
        let mut state = crate::task::State::new(
            self.metrics.clone(),
            crate::task::Settings {
                cluster: config.cluster.clone(),
                retention: config.retention,
                gc_grace: config.gc_grace,
                remove_after: config.remove_after,
                topology: config.topology.clone(),
                policy: config.policy.clone(),
                auto_restore: config.auto_restore,
                restore_timeout: config.restore_timeout,
                leadership: leadership.clone(),
            },
            meta.clone(),
            self.blobs.clone(),
            config.max_concurrent,
            tx.clone(),
            self.health.clone(),
        );
        state.recover().await?;
        Ok(Term {
            state,
            rx,
            tx,
            meta,
            leadership,
            key,
        })
    }

    /// Leads every term this replica wins until `shutdown`: `first` (the embedded
    /// store's one term), or one won by campaigning, then campaigns again.
    pub(crate) async fn lead(self, mut first: Option<Term>, shutdown: CancellationToken) {
        loop {
            let term = match first.take() {
                Some(term) => term,
                None => match self.elect(&shutdown).await {
                    Some(term) => term,
                    None => return,
                },
            };
            let number = term.leadership.term();
            self.replica.set_leading(Some(Leading {
                tx: term.tx.clone(),
                meta: term.meta.clone(),
                leadership: term.leadership.clone(),
            }));
            self.health
                .set_service_status(LEADER_HEALTH, ServingStatus::Serving)
                .await;
            self.metrics.is_leader.set(1);
            self.metrics
                .term
                .set(i64::try_from(number).unwrap_or(i64::MAX));
            if self.elector.is_some() {
                tracing::info!(term = number, "leading: this replica won the election");
            }
            drop(term.tx);
            let run = term.state.run(term.rx, shutdown.clone());
            let mut run = std::pin::pin!(run);
            tokio::select! {
                () = &mut run => {}
                () = term.leadership.ended() => {
                    // Not a leader from this moment, whatever the task is doing: calls are
                    // refused naming the leader, health says so. The task stops by itself
                    // at its next message; one stuck (an I/O that hangs) is dropped.
                    self.replica.set_leading(None);
                    self.health
                        .set_service_status(LEADER_HEALTH, ServingStatus::NotServing)
                        .await;
                    self.metrics.is_leader.set(0);
                    if tokio::time::timeout(TERM_TASK_GRACE, &mut run).await.is_err() {
                        tracing::error!(
                            term = number,
                            "the term's task did not stop within {TERM_TASK_GRACE:?} of the \
                             term's end; dropped"
                        );
                    }
                }
            }
            self.replica.set_leading(None);
            self.health
                .set_service_status(LEADER_HEALTH, ServingStatus::NotServing)
                .await;
            self.metrics.is_leader.set(0);
            if self.elector.is_some() {
                // What it said of freshness was its term's; a follower does not know.
                self.health
                    .set_service_status(crate::policy::FRESHNESS_SERVICE, ServingStatus::Unknown)
                    .await;
            }
            let (Some(elector), Some(key)) = (&self.elector, term.key) else {
                return;
            };
            let why = term.leadership.why();
            elector.step_down(&term.leadership, key).await;
            if shutdown.is_cancelled() {
                tracing::info!(term = number, "resigned: shutting down");
                return;
            }
            tracing::warn!(
                term = number,
                "term ended ({why}); in-flight work failed, sessions closed; campaigning again as a follower"
            );
        }
    }

    /// Campaigns until this replica wins and recovers a term; `None` on `shutdown`.
    async fn elect(&self, shutdown: &CancellationToken) -> Option<Term> {
        let elector = self.elector.as_ref()?;
        loop {
            match elector.campaign(shutdown).await {
                Ok(None) => return None,
                Ok(Some((leadership, key))) => {
                    match self.start_term(leadership.clone(), Some(key.clone())).await {
                        Ok(term) => return Some(term),
                        Err(e) => {
                            tracing::error!(
                                term = leadership.term(),
                                "taking over failed: {e}; stepping down"
                            );
                            elector.step_down(&leadership, key).await;
                        }
                    }
                }
                Err(e) => tracing::warn!("campaign: {e}; trying again"),
            }
            tokio::select! {
                () = shutdown.cancelled() => return None,
                () = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    }
}

/// Reads who leads from etcd every [`WATCH_LEADER_EVERY`]: a follower names the leader in
/// its answers, and the metrics count changes.
pub(crate) async fn watch_leader(
    elector: Elector,
    replica: Arc<Replica>,
    metrics: crate::metrics::CoordinatorMetrics,
    stop: CancellationToken,
) {
    loop {
        match elector.replicas().await {
            Ok(replicas) => {
                let leader = replicas.leader().map(|(a, t)| (a.to_owned(), t));
                if replica.set_known(replicas) {
                    metrics.leader_changes.inc();
                    match leader {
                        Some((address, term)) => {
                            metrics.term.set(i64::try_from(term).unwrap_or(i64::MAX));
                            tracing::info!(leader = %address, term, "the leader is {address} (term {term})");
                        }
                        None => tracing::warn!("no coordinator leads (an election is under way)"),
                    }
                }
            }
            Err(e) => {
                if replica.set_unknown(e.to_string()) {
                    metrics.leader_changes.inc();
                    tracing::warn!("who leads cannot be read: {e}");
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(WATCH_LEADER_EVERY) => {}
        }
    }
}
