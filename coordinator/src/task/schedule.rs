//! The schedule and the policy, as the coordinator's task follows them: the policy chosen at
//! start and set through `SetPolicy`, scheduled starts and skips, the alarm on failures in a
//! row, and the gauges and freshness health brought up to date on each tick.

use std::collections::{BTreeMap, BTreeSet};

use cairn_core::StartRequest;
use cairn_core::schedule::{Due, Failing, Policy};
use tonic_health::ServingStatus;

use super::State;
use crate::error::Error;
use crate::policy;

impl State {
    /// Takes the stored policy if it was set through the API and is still valid, else the
    /// flags' (stored). A stored policy that fails [`Policy::check`] (or no longer fits
    /// `--max-concurrent`) is logged at error level with the reason and replaced by the
    /// flags', so it cannot make every start fail.
    pub(super) async fn load_policy(&mut self) -> Result<(), Error> {
        let flags = self.settings.policy.clone();
        let stored = self.meta.policy_bytes().await?;
        let chosen = policy::at_start(
            &flags,
            stored.as_deref(),
            self.engine.tracker().max_in_flight(),
        );
        if let Some(why) = &chosen.rejected {
            tracing::error!(
                flags = %policy::describe(&flags),
                "the stored snapshot policy is invalid ({why}); it is replaced by the flags'"
            );
        } else if chosen.source == policy::Source::Api && chosen.policy != flags {
            tracing::warn!(
                stored = %policy::describe(&chosen.policy),
                flags = %policy::describe(&flags),
                "the policy set through SetPolicy overrides the flags' \
                 (`cairnctl policy reset` goes back to the flags)"
            );
        }
        self.adopt_policy(chosen.policy, chosen.source).await
    }

    /// Stores `policy` with its source, then follows it from now.
    pub(super) async fn adopt_policy(
        &mut self,
        policy: Policy,
        source: policy::Source,
    ) -> Result<(), Error> {
        let record = policy::to_record(&policy, source);
        self.meta.put_policy(&record).await?;
        tracing::info!(
            source = source.name(),
            "snapshot policy: {}",
            policy::describe(&policy)
        );
        let now = self.clock_ms();
        self.schedule.set_policy(policy, now);
        self.policy_source = source;
        Ok(())
    }

    pub(super) fn policy_view(&self) -> policy::View {
        policy::View {
            policy: self.schedule.policy().clone(),
            source: self.policy_source,
            status: self.schedule.status(self.clock_ms()),
        }
    }

    pub(super) async fn set_policy(
        &mut self,
        change: policy::Change,
    ) -> Result<policy::View, Error> {
        let (next, source) = match change {
            policy::Change::ResetToFlags => (self.settings.policy.clone(), policy::Source::Flags),
            policy::Change::Update(update) => (
                policy::apply(self.schedule.policy(), &update)?,
                policy::Source::Api,
            ),
        };
        let limit = self.engine.tracker().max_in_flight();
        if next.max_concurrent as usize > limit {
            return Err(Error::InvalidArgument(format!(
                "max_concurrent {} is above the coordinator's --max-concurrent {limit}",
                next.max_concurrent
            )));
        }
        self.adopt_policy(next, source).await?;
        self.refresh().await;
        Ok(self.policy_view())
    }

    /// A scheduled snapshot is due: start it, or count the skip.
    pub(super) async fn scheduled(&mut self) {
        let Some(due) = self.schedule.poll(self.clock_ms()) else {
            return;
        };
        match due {
            Due::Skip(skip) => self.skipped(&skip),
            Due::Start if self.engine.fence().is_some() => {
                let why = self.engine.fence().unwrap_or_default();
                if let Ok(skip) = self.schedule.refused(true, why) {
                    self.skipped(&skip);
                }
            }
            Due::Start => {
                let policy = self.schedule.policy().clone();
                let request = StartRequest {
                    mode: policy.mode,
                    initiators: BTreeSet::new(),
                    alignment_timeout: policy.alignment_timeout,
                };
                let labels = BTreeMap::from([("scheduled".to_owned(), "true".to_owned())]);
                match self.start(request, policy.timeout, labels).await {
                    Ok(id) => self.schedule.started(id),
                    Err(e) => {
                        let busy = matches!(e, Error::TooManyInFlight(_));
                        let why = format!("could not start: {e}");
                        match self.schedule.refused(busy, why.clone()) {
                            Ok(skip) => self.skipped(&skip),
                            Err(alarm) => {
                                tracing::warn!("scheduled snapshot {why}");
                                self.alarm(alarm);
                            }
                        }
                    }
                }
            }
        }
        self.refresh().await;
    }

    pub(super) fn skipped(&self, skip: &cairn_core::schedule::Skip) {
        self.metrics.schedule_skipped.inc();
        tracing::info!("scheduled snapshot skipped: {skip}");
    }

    pub(super) fn alarm(&self, alarm: Option<Failing>) {
        if let Some(f) = alarm {
            tracing::error!(
                consecutive = f.consecutive,
                tolerated = f.tolerated,
                "scheduled snapshots are failing: {} in a row, more than the {} tolerated; \
                 last: {}",
                f.consecutive,
                f.tolerated,
                f.last_failure
            );
        }
    }

    /// Brings the schedule's metrics and the freshness health service up to date.
    pub(super) async fn refresh(&mut self) {
        let status = self.schedule.status(self.clock_ms());
        let m = &self.metrics;
        m.schedule_consecutive_failures
            .set(i64::from(status.consecutive_failures));
        m.schedule_failing.set(i64::from(status.failing));
        m.snapshot_stale.set(i64::from(status.stale));
        m.newest_completed_age.set(
            status
                .newest_completed_age
                .map_or(-1.0, |d| d.as_secs_f64()),
        );
        if self.failing && !status.failing {
            tracing::info!("scheduled snapshots are completing again");
        }
        self.failing = status.failing;
        if Some(status.stale) != self.stale {
            if self.stale == Some(true) {
                tracing::info!(
                    "a snapshot completed: {} is SERVING again",
                    policy::FRESHNESS_SERVICE
                );
            }
            self.stale = Some(status.stale);
            let threshold = self.schedule.policy().freshness_threshold;
            let serving = if status.stale {
                tracing::error!(
                    age = ?status.newest_completed_age,
                    ?threshold,
                    "no snapshot completed within the freshness threshold: {FRESHNESS} is NOT_SERVING",
                    FRESHNESS = policy::FRESHNESS_SERVICE
                );
                ServingStatus::NotServing
            } else {
                ServingStatus::Serving
            };
            self.health
                .set_service_status(policy::FRESHNESS_SERVICE, serving)
                .await;
        }
    }
}
