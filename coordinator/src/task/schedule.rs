//! The schedule and the policy, as the coordinator's task carries them out for the engine
//! (`cairn_core::coordinator`, `scheduling.rs`, which decides): the policy chosen at start
//! (the stored one if it is still valid) and set through `SetPolicy`, the schedule's timer,
//! and the gauges and freshness health brought up to date on each tick.

use cairn_core::coordinator::{Answer, Input};
use cairn_core::schedule::PolicyChange;
use tonic_health::ServingStatus;

use super::State;
use crate::error::Error;
use crate::policy;

impl State {
    /// Takes the stored policy if it was set through the API and is still valid, else the
    /// flags' (stored). A stored policy that fails [`cairn_core::schedule::Policy::check`]
    /// (or no longer fits `--max-concurrent`) is logged at error level with the reason and
    /// replaced by the flags', so it cannot make every start fail.
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
        let token = self.token();
        let input = Input::AdoptPolicy {
            token,
            policy: chosen.policy,
            source: chosen.source,
        };
        self.policy_answer(token, input).await.map(|_| ())
    }

    pub(super) fn policy_view(&self) -> policy::View {
        self.engine.policy_view(self.now())
    }

    pub(super) async fn set_policy(&mut self, change: PolicyChange) -> Result<policy::View, Error> {
        let token = self.token();
        let view = self
            .policy_answer(token, Input::SetPolicy { token, change })
            .await?;
        self.refresh().await;
        Ok(view)
    }

    /// Drives a policy request and returns its answer.
    async fn policy_answer(
        &mut self,
        token: u64,
        input: Input<Error>,
    ) -> Result<policy::View, Error> {
        for (told, answer) in self.drive(input).await {
            if let (true, Answer::Policy(result)) = (told == token, answer) {
                return result.map_err(|refusal| self.refused(refusal));
            }
        }
        Err(super::snapshots::unanswered("SetPolicy"))
    }

    /// The schedule's timer went off: the engine starts the due snapshot, or counts the
    /// skip.
    pub(super) async fn scheduled(&mut self) {
        self.drive(Input::Due).await;
        self.refresh().await;
    }

    /// Brings the schedule's metrics and the freshness health service up to date.
    pub(super) async fn refresh(&mut self) {
        let view = self.engine.policy_view(self.now());
        let status = view.status;
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
            let threshold = view.policy.freshness_threshold;
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
