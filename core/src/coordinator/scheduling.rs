//! The schedule and the policy across the roles: a due snapshot started through the same
//! path as `StartSnapshot` (the fence and the topology checked first), skips and failures
//! counted, and the policy — set through `SetPolicy`, or the flags' — stored before it is
//! followed. The decisions themselves are [`Schedule`]'s ([`crate::schedule`]).

use std::collections::{BTreeMap, BTreeSet};

use super::snapshots::StartBy;
use super::{
    Action, Actions, Answer, Note, Now, Persist, Refusal, Roles, StartInput, Token, Write,
};
use crate::schedule::{Due, Policy, PolicyChange, PolicySource, PolicyView, Schedule};
use crate::tracker::StartRequest;

/// The policy's part of the engine: where the policy in force came from, the flags', and
/// the changes whose record is being stored.
pub(super) struct Policies {
    /// The flags' policy (`ResetToFlags` goes back to it).
    pub(super) flags: Policy,
    pub(super) source: PolicySource,
    pending: BTreeMap<Token, (Policy, PolicySource)>,
}

impl Policies {
    pub(super) fn new(flags: Policy) -> Self {
        Self {
            flags,
            source: PolicySource::Flags,
            pending: BTreeMap::new(),
        }
    }
}

impl Roles {
    /// The schedule's timer went off: a due snapshot is started, or skipped.
    pub(super) fn scheduled<E>(&mut self, out: &mut Actions<E>, now: Now, term: u64) {
        let Some(due) = self.snapshots.schedule.poll(now.mono_ms) else {
            return;
        };
        match due {
            Due::Skip(skip) => out.push(Action::Note(Note::Skipped(skip))),
            Due::Start => {
                if let Some(fence) = self.fence() {
                    if let Ok(skip) = self.snapshots.schedule.refused(true, fence) {
                        out.push(Action::Note(Note::Skipped(skip)));
                    }
                    return;
                }
                let topology = match self.spannable() {
                    Ok(topology) => topology,
                    Err(refusal) => return out.push(Action::ScheduleRefused { refusal }),
                };
                let policy = self.snapshots.schedule.policy().clone();
                let start = StartInput {
                    request: StartRequest {
                        mode: policy.mode,
                        initiators: BTreeSet::new(),
                        alignment_timeout: policy.alignment_timeout,
                    },
                    timeout: policy.timeout,
                    labels: BTreeMap::from([("scheduled".to_owned(), "true".to_owned())]),
                    term,
                    request_id: String::new(),
                };
                let epoch = self.restores.epoch();
                self.snapshots
                    .start(out, StartBy::Schedule, start, topology, epoch);
            }
        }
    }

    /// The runtime worded why a scheduled start was refused: for want of room it is a skip,
    /// otherwise a failure (an alarm past the tolerated number in a row).
    pub(super) fn schedule_refused<E>(&mut self, out: &mut Actions<E>, busy: bool, why: String) {
        match self.snapshots.schedule.refused(busy, why.clone()) {
            Ok(skip) => out.push(Action::Note(Note::Skipped(skip))),
            Err(alarm) => {
                out.push(Action::Note(Note::ScheduleFailed(why)));
                if let Some(failing) = alarm {
                    out.push(Action::Note(Note::Failing(failing)));
                }
            }
        }
    }

    /// `SetPolicy`: the new policy (checked, and within the coordinator's limit of
    /// snapshots in flight) is stored, then followed.
    pub(super) fn set_policy<E>(
        &mut self,
        out: &mut Actions<E>,
        token: Token,
        change: PolicyChange,
    ) {
        let (next, source) = match change {
            PolicyChange::ResetToFlags => (self.policies.flags.clone(), PolicySource::Flags),
            PolicyChange::Update(update) => match update.apply(self.snapshots.schedule.policy()) {
                Ok(policy) => (policy, PolicySource::Api),
                Err(e) => return out.push(policy_answer(token, Err(Refusal::Policy(e)))),
            },
        };
        let limit = self.snapshots.tracker().max_in_flight();
        if next.max_concurrent as usize > limit {
            let why = format!(
                "max_concurrent {} is above the coordinator's --max-concurrent {limit}",
                next.max_concurrent
            );
            return out.push(policy_answer(token, Err(Refusal::Invalid(why))));
        }
        self.adopt_policy(out, token, next, source);
    }

    /// Stores `policy` with its source; [`Self::policy_stored`] follows it once stored.
    pub(super) fn adopt_policy<E>(
        &mut self,
        out: &mut Actions<E>,
        token: Token,
        policy: Policy,
        source: PolicySource,
    ) {
        out.push(Action::Persist {
            what: Persist::Policy(token),
            write: Write::Policy {
                policy: policy.clone(),
                source,
            },
            attempt: 1,
        });
        self.policies.pending.insert(token, (policy, source));
    }

    /// The store answered for a policy: stored, it is followed from now.
    pub(super) fn policy_stored<E>(
        &mut self,
        out: &mut Actions<E>,
        now: Now,
        token: Token,
        result: Result<(), E>,
    ) {
        let Some((policy, source)) = self.policies.pending.remove(&token) else {
            return;
        };
        if let Err(e) = result {
            return out.push(policy_answer(token, Err(Refusal::Store(e))));
        }
        out.push(Action::Note(Note::PolicyAdopted {
            policy: policy.clone(),
            source,
        }));
        self.snapshots.schedule.set_policy(policy, now.mono_ms);
        self.policies.source = source;
        out.push(policy_answer(token, Ok(self.policy_view(now))));
    }

    /// The policy in force, where it came from, and the schedule's state.
    pub(super) fn policy_view(&self, now: Now) -> PolicyView {
        let schedule: &Schedule = &self.snapshots.schedule;
        PolicyView {
            policy: schedule.policy().clone(),
            source: self.policies.source,
            status: schedule.status(now.mono_ms),
        }
    }
}

fn policy_answer<E>(token: Token, result: Result<PolicyView, Refusal<E>>) -> Action<E> {
    Action::Reply {
        token,
        answer: Answer::Policy(result),
    }
}
