//! The coordinator's snapshot schedule, sans-IO: when a scheduled snapshot is due, whether
//! it starts or is skipped, how its failures are judged, and whether the newest completed
//! snapshot is fresh enough.
//!
//! Time comes in as milliseconds of a monotonic clock the caller owns; jitter comes from a
//! generator seeded by the caller, so a run is reproducible.
//!
//! ```
//! use std::time::Duration;
//! use cairn_core::schedule::{Due, Policy, Schedule};
//! use cairn_core::SnapshotId;
//!
//! let policy = Policy { interval: Duration::from_millis(100), ..Policy::default() };
//! let mut schedule = Schedule::new(policy, 0, 7);
//! assert_eq!(schedule.next_due(), Some(100));
//! assert_eq!(schedule.poll(100), Some(Due::Start));
//! schedule.started(SnapshotId(1));
//! // The next one is due while the first still runs: skipped, not queued.
//! assert!(matches!(schedule.poll(200), Some(Due::Skip(_))));
//! schedule.finished(SnapshotId(1), 250, Ok(()));
//! assert_eq!(schedule.poll(300), Some(Due::Start));
//! ```

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use crate::types::{SnapshotId, SnapshotMode};

/// The shortest interval a schedule accepts.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);
/// The longest interval a schedule accepts, and the longest jitter (which is also at most
/// the interval): 30 days.
pub const MAX_INTERVAL: Duration = Duration::from_secs(30 * 24 * 3600);
/// The longest timeout, alignment timeout and minimum pause: 24 hours. `StartSnapshot`'s
/// timeouts are held to it too.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// The longest freshness threshold: 30 days.
pub const MAX_FRESHNESS_THRESHOLD: Duration = Duration::from_secs(30 * 24 * 3600);
/// The most scheduled snapshots in flight at once a policy may allow.
pub const MAX_CONCURRENT: u32 = 1024;
/// The most consecutive failures a policy may tolerate.
pub const MAX_TOLERATED_FAILURES: u32 = 1_000_000;

/// `d` in whole milliseconds, `u64::MAX` when it does not fit.
pub fn saturating_millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// What scheduled snapshots are taken, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Time between scheduled snapshots; zero: no schedule.
    pub interval: Duration,
    /// The mode of scheduled snapshots.
    pub mode: SnapshotMode,
    /// Their timeout.
    pub timeout: Duration,
    /// `Aligned` only: switch to unaligned after this long aligning.
    pub alignment_timeout: Option<Duration>,
    /// Least time between the end of one scheduled snapshot and the start of the next. When
    /// set, a snapshot is never started while another scheduled one runs.
    pub min_pause: Duration,
    /// Up to this much random time is added to each interval.
    pub jitter: Duration,
    /// Most scheduled snapshots in flight at once.
    pub max_concurrent: u32,
    /// Consecutive failures tolerated before the schedule is reported failing.
    pub tolerated_failures: u32,
    /// The newest completed snapshot is stale once older than this; `None`: never.
    pub freshness_threshold: Option<Duration>,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            interval: Duration::ZERO,
            mode: SnapshotMode::ChandyLamport,
            timeout: Duration::from_secs(30),
            alignment_timeout: None,
            min_pause: Duration::ZERO,
            jitter: Duration::ZERO,
            max_concurrent: 1,
            tolerated_failures: 3,
            freshness_threshold: None,
        }
    }
}

/// A field of [`Policy`], to name in errors (the coordinator maps it to its wire field or
/// flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyField {
    /// [`Policy::interval`].
    Interval,
    /// [`Policy::mode`].
    Mode,
    /// [`Policy::timeout`].
    Timeout,
    /// [`Policy::alignment_timeout`].
    AlignmentTimeout,
    /// [`Policy::min_pause`].
    MinPause,
    /// [`Policy::jitter`].
    Jitter,
    /// [`Policy::max_concurrent`].
    MaxConcurrent,
    /// [`Policy::tolerated_failures`].
    ToleratedFailures,
    /// [`Policy::freshness_threshold`].
    FreshnessThreshold,
}

impl PolicyField {
    /// Its name in [`Policy`].
    pub fn name(self) -> &'static str {
        match self {
            Self::Interval => "interval",
            Self::Mode => "mode",
            Self::Timeout => "timeout",
            Self::AlignmentTimeout => "alignment_timeout",
            Self::MinPause => "min_pause",
            Self::Jitter => "jitter",
            Self::MaxConcurrent => "max_concurrent",
            Self::ToleratedFailures => "tolerated_failures",
            Self::FreshnessThreshold => "freshness_threshold",
        }
    }
}

impl fmt::Display for PolicyField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a policy cannot be used: the field at fault and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct PolicyError {
    /// The field at fault.
    pub field: PolicyField,
    /// Why, with the limit.
    pub reason: String,
}

/// `d` for an error message: whole milliseconds (the wire's unit), or its exact form when
/// it has a fraction of a millisecond or is too long for a `u64` of them.
fn show(d: Duration) -> String {
    match u64::try_from(d.as_millis()) {
        Ok(ms) if Duration::from_millis(ms) == d => format!("{ms} ms"),
        _ => format!("{d:?}"),
    }
}

/// `limit` for an error message: milliseconds and a human form.
fn show_limit(limit: Duration) -> String {
    let secs = limit.as_secs();
    let human = if secs >= 86_400 && secs.is_multiple_of(86_400) {
        format!("{} days", secs / 86_400)
    } else if secs >= 3600 && secs.is_multiple_of(3600) {
        format!("{} h", secs / 3600)
    } else {
        format!("{limit:?}")
    };
    format!("{} ({human})", show(limit))
}

/// Where the policy in force came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicySource {
    /// The coordinator's flags and variables.
    Flags,
    /// `SetPolicy`; outlives restarts until reset.
    Api,
}

impl PolicySource {
    /// Its stored and wire name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Flags => "flags",
            Self::Api => "api",
        }
    }
}

/// What `SetPolicy` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyChange {
    /// Back to the coordinator's flags.
    ResetToFlags,
    /// These fields changed on the policy in force.
    Update(PolicyUpdate),
}

/// The policy in force as `GetPolicy` and `SetPolicy` answer it: where it came from and
/// the schedule's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyView {
    /// The policy.
    pub policy: Policy,
    /// Where it came from.
    pub source: PolicySource,
    /// The schedule's state now.
    pub status: Status,
}

/// A change to the policy in force: the fields it sets, each taken as given (the rest stay).
/// Setting the mode to one other than `Aligned` without an alignment timeout drops the
/// alignment timeout (it applies to aligned snapshots only).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PolicyUpdate {
    /// A new interval.
    pub interval: Option<Duration>,
    /// A new mode.
    pub mode: Option<SnapshotMode>,
    /// A new timeout.
    pub timeout: Option<Duration>,
    /// A new alignment timeout (`Some(None)`: none).
    pub alignment_timeout: Option<Option<Duration>>,
    /// A new least pause.
    pub min_pause: Option<Duration>,
    /// A new jitter.
    pub jitter: Option<Duration>,
    /// A new limit of scheduled snapshots in flight.
    pub max_concurrent: Option<u32>,
    /// A new count of tolerated failures.
    pub tolerated_failures: Option<u32>,
    /// A new freshness threshold (`Some(None)`: none).
    pub freshness_threshold: Option<Option<Duration>>,
}

impl PolicyUpdate {
    /// `current` with this update's fields, checked ([`Policy::check`]).
    pub fn apply(&self, current: &Policy) -> Result<Policy, PolicyError> {
        let mut next = current.clone();
        if let Some(v) = self.interval {
            next.interval = v;
        }
        if let Some(mode) = self.mode {
            next.mode = mode;
            if mode != SnapshotMode::Aligned && self.alignment_timeout.is_none() {
                next.alignment_timeout = None;
            }
        }
        if let Some(v) = self.timeout {
            next.timeout = v;
        }
        if let Some(v) = self.alignment_timeout {
            next.alignment_timeout = v;
        }
        if let Some(v) = self.min_pause {
            next.min_pause = v;
        }
        if let Some(v) = self.jitter {
            next.jitter = v;
        }
        if let Some(v) = self.max_concurrent {
            next.max_concurrent = v;
        }
        if let Some(v) = self.tolerated_failures {
            next.tolerated_failures = v;
        }
        if let Some(v) = self.freshness_threshold {
            next.freshness_threshold = v;
        }
        next.check()?;
        Ok(next)
    }
}

impl Policy {
    /// Checks that the policy makes sense and every value is within its limit:
    ///
    /// | field | allowed |
    /// |---|---|
    /// | interval | 0 (no schedule), or [`MIN_INTERVAL`] (100 ms) to [`MAX_INTERVAL`] (30 days) |
    /// | jitter | at most the interval (at most 30 days without a schedule) |
    /// | timeout | above 0, at most [`MAX_TIMEOUT`] (24 h) |
    /// | alignment timeout | `Aligned` only; above 0, at most 24 h |
    /// | min pause | at most 24 h |
    /// | max concurrent | 1 to [`MAX_CONCURRENT`] |
    /// | tolerated failures | at most [`MAX_TOLERATED_FAILURES`] |
    /// | freshness threshold | above 0, at most [`MAX_FRESHNESS_THRESHOLD`] (30 days) |
    pub fn check(&self) -> Result<(), PolicyError> {
        use PolicyField as F;
        let bad = |field, reason: String| Err(PolicyError { field, reason });
        if self.enabled() && !(MIN_INTERVAL..=MAX_INTERVAL).contains(&self.interval) {
            return bad(
                F::Interval,
                format!(
                    "{} is outside the allowed {} to {} (0 turns the schedule off)",
                    show(self.interval),
                    show(MIN_INTERVAL),
                    show_limit(MAX_INTERVAL)
                ),
            );
        }
        if self.enabled() && self.jitter > self.interval {
            return bad(
                F::Jitter,
                format!(
                    "{} is above the interval, {}; the jitter may be at most the interval",
                    show(self.jitter),
                    show(self.interval)
                ),
            );
        }
        if self.jitter > MAX_INTERVAL {
            return bad(
                F::Jitter,
                format!(
                    "{} is above the most allowed, {}",
                    show(self.jitter),
                    show_limit(MAX_INTERVAL)
                ),
            );
        }
        if self.timeout.is_zero() {
            return bad(F::Timeout, "must be above zero".into());
        }
        if self.timeout > MAX_TIMEOUT {
            return bad(
                F::Timeout,
                format!(
                    "{} is above the most allowed, {}",
                    show(self.timeout),
                    show_limit(MAX_TIMEOUT)
                ),
            );
        }
        if let Some(alignment) = self.alignment_timeout {
            if self.mode != SnapshotMode::Aligned {
                return bad(
                    F::AlignmentTimeout,
                    format!(
                        "an alignment timeout applies only to ALIGNED snapshots, not {}",
                        self.mode
                    ),
                );
            }
            if alignment.is_zero() {
                return bad(
                    F::AlignmentTimeout,
                    "must be above zero (none turns it off)".into(),
                );
            }
            if alignment > MAX_TIMEOUT {
                return bad(
                    F::AlignmentTimeout,
                    format!(
                        "{} is above the most allowed, {}",
                        show(alignment),
                        show_limit(MAX_TIMEOUT)
                    ),
                );
            }
        }
        if self.min_pause > MAX_TIMEOUT {
            return bad(
                F::MinPause,
                format!(
                    "{} is above the most allowed, {}",
                    show(self.min_pause),
                    show_limit(MAX_TIMEOUT)
                ),
            );
        }
        if !(1..=MAX_CONCURRENT).contains(&self.max_concurrent) {
            return bad(
                F::MaxConcurrent,
                format!(
                    "{} is outside the allowed 1 to {MAX_CONCURRENT}",
                    self.max_concurrent
                ),
            );
        }
        if self.tolerated_failures > MAX_TOLERATED_FAILURES {
            return bad(
                F::ToleratedFailures,
                format!(
                    "{} is above the most allowed, {MAX_TOLERATED_FAILURES}",
                    self.tolerated_failures
                ),
            );
        }
        if let Some(threshold) = self.freshness_threshold {
            if threshold.is_zero() {
                return bad(
                    F::FreshnessThreshold,
                    "must be above zero (none turns it off)".into(),
                );
            }
            if threshold > MAX_FRESHNESS_THRESHOLD {
                return bad(
                    F::FreshnessThreshold,
                    format!(
                        "{} is above the most allowed, {}",
                        show(threshold),
                        show_limit(MAX_FRESHNESS_THRESHOLD)
                    ),
                );
            }
        }
        Ok(())
    }

    /// Whether snapshots are scheduled at all.
    pub fn enabled(&self) -> bool {
        !self.interval.is_zero()
    }
}

/// A due snapshot that is not started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// Scheduled snapshots still run: as many as allowed, or one while a pause is set.
    Running {
        /// How many run.
        running: u32,
    },
    /// The minimum pause since the last scheduled snapshot ended has not passed.
    MinPause {
        /// How much of it is left.
        remaining: Duration,
    },
    /// The coordinator refused to start one for want of room (manual snapshots fill it).
    Busy(String),
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Running { running } => write!(f, "{running} scheduled snapshot(s) still run"),
            Self::MinPause { remaining } => {
                write!(f, "within the minimum pause ({remaining:?} left)")
            }
            Self::Busy(why) => write!(f, "no room: {why}"),
        }
    }
}

/// What to do about a due snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Due {
    /// Start one as the policy says, then call [`Schedule::started`] or
    /// [`Schedule::refused`].
    Start,
    /// Do not; the skip is counted.
    Skip(Skip),
}

/// The schedule has failed more often in a row than the policy tolerates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failing {
    /// Failures in a row.
    pub consecutive: u32,
    /// How many the policy tolerates.
    pub tolerated: u32,
    /// Why the last one failed.
    pub last_failure: String,
}

/// The schedule's state as users see it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Status {
    /// Scheduled snapshots started.
    pub started: u64,
    /// Due snapshots skipped.
    pub skipped: u64,
    /// Scheduled snapshots that failed in a row (reset by one that completes).
    pub consecutive_failures: u32,
    /// Whether that is more than tolerated.
    pub failing: bool,
    /// Why the last scheduled snapshot failed, if it did.
    pub last_failure: Option<String>,
    /// Scheduled snapshots running now.
    pub running: u32,
    /// Time until the next due snapshot, if scheduled.
    pub next_due_in: Option<Duration>,
    /// Age of the newest completed snapshot (scheduled or not), if any.
    pub newest_completed_age: Option<Duration>,
    /// Whether the freshness threshold is passed.
    pub stale: bool,
}

/// The schedule: one per coordinator.
#[derive(Debug, Clone)]
pub struct Schedule {
    policy: Policy,
    rng: u64,
    next_due: Option<u64>,
    running: BTreeSet<SnapshotId>,
    last_end: Option<u64>,
    consecutive_failures: u32,
    skipped: u64,
    started: u64,
    last_failure: Option<String>,
    newest_completed: Option<u64>,
    since: u64,
}

impl Schedule {
    /// A schedule following `policy` from `now`; `seed` drives the jitter.
    pub fn new(policy: Policy, now: u64, seed: u64) -> Self {
        let mut schedule = Self {
            policy: Policy::default(),
            rng: seed,
            next_due: None,
            running: BTreeSet::new(),
            last_end: None,
            consecutive_failures: 0,
            skipped: 0,
            started: 0,
            last_failure: None,
            newest_completed: None,
            since: now,
        };
        schedule.set_policy(policy, now);
        schedule
    }

    /// The policy followed.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Follows `policy` from `now`: the next snapshot is due one interval (plus jitter) on.
    /// Counters and snapshots in flight are kept.
    pub fn set_policy(&mut self, policy: Policy, now: u64) {
        self.policy = policy;
        self.next_due = self
            .policy
            .enabled()
            .then(|| now.saturating_add(self.period()));
    }

    /// Tells the schedule that a snapshot completed `age` before `now` (at start-up, from
    /// stored records).
    pub fn completed_before(&mut self, now: u64, age: Duration) {
        let at = now.saturating_sub(saturating_millis(age));
        if self.newest_completed.is_none_or(|t| t < at) {
            self.newest_completed = Some(at);
        }
    }

    /// When the next snapshot is due; `None` without a schedule.
    pub fn next_due(&self) -> Option<u64> {
        self.next_due
    }

    /// At or after [`Self::next_due`]: whether to start a snapshot now. `None` if nothing
    /// is due yet.
    pub fn poll(&mut self, now: u64) -> Option<Due> {
        let due = self.next_due.filter(|&due| due <= now)?;
        let next = due.saturating_add(self.period());
        // Late (a slow store, a paused process): no burst to catch up.
        self.next_due = Some(if next > now {
            next
        } else {
            now.saturating_add(self.period())
        });
        let running = self.running_count();
        let pause = saturating_millis(self.policy.min_pause);
        let skip = if running >= self.policy.max_concurrent || (pause > 0 && running > 0) {
            Some(Skip::Running { running })
        } else {
            match self.last_end {
                Some(end) if pause > 0 && now < end.saturating_add(pause) => Some(Skip::MinPause {
                    remaining: Duration::from_millis(end.saturating_add(pause) - now),
                }),
                _ => None,
            }
        };
        Some(match skip {
            Some(skip) => {
                self.skipped = self.skipped.saturating_add(1);
                Due::Skip(skip)
            }
            None => Due::Start,
        })
    }

    /// The snapshot [`Due::Start`] asked for started as `id`.
    pub fn started(&mut self, id: SnapshotId) {
        self.started = self.started.saturating_add(1);
        self.running.insert(id);
    }

    /// The snapshot [`Due::Start`] asked for could not start. `busy`: for want of room,
    /// counted as a skip; otherwise (a node is down…) a failure.
    pub fn refused(&mut self, busy: bool, why: String) -> Result<Skip, Option<Failing>> {
        if busy {
            self.skipped = self.skipped.saturating_add(1);
            return Ok(Skip::Busy(why));
        }
        Err(self.failed(why))
    }

    /// Snapshot `id` ended at `now` (scheduled or not). Returns the alarm when a scheduled
    /// one failed once more than tolerated.
    pub fn finished(
        &mut self,
        id: SnapshotId,
        now: u64,
        result: Result<(), String>,
    ) -> Option<Failing> {
        if result.is_ok() && self.newest_completed.is_none_or(|t| t < now) {
            self.newest_completed = Some(now);
        }
        if !self.running.remove(&id) {
            return None;
        }
        self.last_end = Some(now);
        match result {
            Ok(()) => {
                self.consecutive_failures = 0;
                self.last_failure = None;
                None
            }
            Err(why) => self.failed(why),
        }
    }

    /// Whether snapshot `id` is a scheduled one in flight.
    pub fn is_scheduled(&self, id: SnapshotId) -> bool {
        self.running.contains(&id)
    }

    /// Whether more scheduled snapshots failed in a row than tolerated.
    pub fn failing(&self) -> bool {
        self.consecutive_failures > self.policy.tolerated_failures
    }

    /// Whether no snapshot completed within the freshness threshold (counted from the
    /// schedule's creation when none ever did).
    pub fn stale(&self, now: u64) -> bool {
        self.policy.freshness_threshold.is_some_and(|threshold| {
            now.saturating_sub(self.newest_completed.unwrap_or(self.since))
                > saturating_millis(threshold)
        })
    }

    /// The state at `now`.
    pub fn status(&self, now: u64) -> Status {
        Status {
            started: self.started,
            skipped: self.skipped,
            consecutive_failures: self.consecutive_failures,
            failing: self.failing(),
            last_failure: self.last_failure.clone(),
            running: self.running_count(),
            next_due_in: self
                .next_due
                .map(|due| Duration::from_millis(due.saturating_sub(now))),
            newest_completed_age: self
                .newest_completed
                .map(|t| Duration::from_millis(now.saturating_sub(t))),
            stale: self.stale(now),
        }
    }

    fn failed(&mut self, why: String) -> Option<Failing> {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.last_failure = Some(why.clone());
        self.failing().then_some(Failing {
            consecutive: self.consecutive_failures,
            tolerated: self.policy.tolerated_failures,
            last_failure: why,
        })
    }

    /// Scheduled snapshots in flight.
    fn running_count(&self) -> u32 {
        u32::try_from(self.running.len()).unwrap_or(u32::MAX)
    }

    /// One interval plus a random share of the jitter, in milliseconds. Both are held to
    /// the limits [`Policy::check`] enforces (which leaves a checked policy as it is), so a
    /// policy that bypassed the check can neither make the schedule spin nor push a due
    /// time beyond what a clock can add: a period is 100 ms to 60 days.
    fn period(&mut self) -> u64 {
        let interval = saturating_millis(self.policy.interval).clamp(
            saturating_millis(MIN_INTERVAL),
            saturating_millis(MAX_INTERVAL),
        );
        let jitter = saturating_millis(self.policy.jitter).min(interval);
        let extra = if jitter == 0 {
            0
        } else {
            // jitter <= 30 days in ms: the + 1 cannot overflow.
            self.next_random() % jitter.saturating_add(1)
        };
        interval.saturating_add(extra)
    }

    /// splitmix64.
    fn next_random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every(ms: u64) -> Policy {
        Policy {
            interval: Duration::from_millis(ms),
            ..Policy::default()
        }
    }

    #[test]
    fn off_by_default_and_never_due() {
        let mut s = Schedule::new(Policy::default(), 0, 1);
        assert_eq!(s.next_due(), None);
        assert_eq!(s.poll(1_000_000), None);
        assert!(!s.stale(1_000_000));
    }

    #[test]
    fn due_times_stay_within_the_jitter_and_do_not_drift() {
        let policy = Policy {
            jitter: Duration::from_millis(50),
            ..every(100)
        };
        let mut s = Schedule::new(policy, 0, 42);
        let mut last = 0;
        let mut saw_jitter = false;
        for _ in 0..200 {
            let due = s.next_due().unwrap();
            assert!((last + 100..=last + 150).contains(&due), "{last} -> {due}");
            saw_jitter |= due - last != 100;
            last = due;
            assert_eq!(s.poll(due), Some(Due::Start));
            s.started(SnapshotId(due));
            s.finished(SnapshotId(due), due + 1, Ok(()));
        }
        assert!(saw_jitter);
        assert_eq!(s.status(last).started, 200);
    }

    #[test]
    fn same_seed_same_schedule() {
        let policy = Policy {
            jitter: Duration::from_millis(1000),
            ..every(1000)
        };
        let run = |seed| {
            let mut s = Schedule::new(policy.clone(), 0, seed);
            (0..20)
                .map(|_| {
                    let due = s.next_due().unwrap();
                    s.poll(due);
                    due
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn a_late_poll_does_not_burst() {
        let mut s = Schedule::new(every(100), 0, 1);
        assert_eq!(s.poll(1_000), Some(Due::Start));
        assert_eq!(s.next_due(), Some(1_100));
        assert_eq!(s.poll(1_050), None);
    }

    #[test]
    fn skipped_not_queued_while_at_the_limit() {
        let policy = Policy {
            max_concurrent: 2,
            ..every(100)
        };
        let mut s = Schedule::new(policy, 0, 1);
        assert_eq!(s.poll(100), Some(Due::Start));
        s.started(SnapshotId(1));
        assert_eq!(s.poll(200), Some(Due::Start));
        s.started(SnapshotId(2));
        assert_eq!(s.poll(300), Some(Due::Skip(Skip::Running { running: 2 })));
        assert_eq!(
            s.poll(350),
            None,
            "a skip is not retried before the next due"
        );
        s.finished(SnapshotId(1), 360, Ok(()));
        assert_eq!(s.poll(400), Some(Due::Start));
        assert_eq!(s.status(400).skipped, 1);
    }

    #[test]
    fn the_minimum_pause_holds_after_a_slow_snapshot() {
        let policy = Policy {
            min_pause: Duration::from_millis(250),
            max_concurrent: 3,
            ..every(100)
        };
        let mut s = Schedule::new(policy, 0, 1);
        assert_eq!(s.poll(100), Some(Due::Start));
        s.started(SnapshotId(1));
        // A pause implies one at a time, whatever max_concurrent says.
        assert_eq!(s.poll(200), Some(Due::Skip(Skip::Running { running: 1 })));
        s.finished(SnapshotId(1), 450, Ok(()));
        assert_eq!(
            s.poll(500),
            Some(Due::Skip(Skip::MinPause {
                remaining: Duration::from_millis(200)
            }))
        );
        assert_eq!(
            s.poll(600),
            Some(Due::Skip(Skip::MinPause {
                remaining: Duration::from_millis(100)
            }))
        );
        assert_eq!(s.poll(700), Some(Due::Start));
        assert_eq!(s.status(700).skipped, 3);
    }

    #[test]
    fn failures_beyond_the_tolerance_alarm_and_reset_on_success() {
        let policy = Policy {
            tolerated_failures: 2,
            ..every(100)
        };
        let mut s = Schedule::new(policy, 0, 1);
        let mut alarms = Vec::new();
        for i in 1..=4u64 {
            assert_eq!(s.poll(i * 100), Some(Due::Start));
            s.started(SnapshotId(i));
            alarms.push(s.finished(SnapshotId(i), i * 100 + 10, Err(format!("boom {i}"))));
        }
        assert_eq!(alarms[..2], [None, None]);
        assert_eq!(
            alarms[2],
            Some(Failing {
                consecutive: 3,
                tolerated: 2,
                last_failure: "boom 3".into()
            })
        );
        assert!(alarms[3].is_some());
        assert!(s.failing());
        assert_eq!(s.status(500).consecutive_failures, 4);
        // A refused start counts too; a busy one is a skip.
        assert_eq!(s.poll(500), Some(Due::Start));
        assert!(matches!(
            s.refused(false, "n3 is down".into()),
            Err(Some(_))
        ));
        assert_eq!(s.status(500).last_failure.as_deref(), Some("n3 is down"));
        assert_eq!(s.poll(600), Some(Due::Start));
        assert!(matches!(s.refused(true, "full".into()), Ok(Skip::Busy(_))));
        assert_eq!(s.status(600).consecutive_failures, 5);
        assert_eq!(s.poll(700), Some(Due::Start));
        s.started(SnapshotId(9));
        assert_eq!(s.finished(SnapshotId(9), 710, Ok(())), None);
        let status = s.status(710);
        assert_eq!((status.consecutive_failures, status.failing), (0, false));
        assert_eq!(status.last_failure, None);
    }

    #[test]
    fn manual_snapshots_count_for_freshness_only() {
        let policy = Policy {
            freshness_threshold: Some(Duration::from_millis(1_000)),
            tolerated_failures: 0,
            ..Policy::default()
        };
        let mut s = Schedule::new(policy, 0, 1);
        assert!(!s.stale(1_000));
        assert!(s.stale(1_001), "nothing completed since the start");
        assert_eq!(s.finished(SnapshotId(1), 1_500, Err("x".into())), None);
        assert!(!s.failing());
        assert!(s.stale(1_600));
        s.finished(SnapshotId(2), 2_000, Ok(()));
        assert!(!s.stale(3_000));
        assert!(s.stale(3_001));
        assert_eq!(
            s.status(3_001).newest_completed_age,
            Some(Duration::from_millis(1_001))
        );
    }

    #[test]
    fn a_completion_before_start_up_is_remembered() {
        let policy = Policy {
            freshness_threshold: Some(Duration::from_secs(10)),
            ..Policy::default()
        };
        let mut s = Schedule::new(policy, 60_000, 1);
        s.completed_before(60_000, Duration::from_secs(30));
        assert!(s.stale(60_000));
        assert_eq!(
            s.status(60_000).newest_completed_age,
            Some(Duration::from_secs(30))
        );
    }

    #[test]
    fn a_new_policy_reschedules_and_keeps_counters() {
        let mut s = Schedule::new(every(100), 0, 1);
        assert_eq!(s.poll(100), Some(Due::Start));
        s.started(SnapshotId(1));
        s.set_policy(every(1_000), 150);
        assert_eq!(s.next_due(), Some(1_150));
        assert!(s.is_scheduled(SnapshotId(1)));
        s.set_policy(Policy::default(), 200);
        assert_eq!(s.next_due(), None);
        assert_eq!(s.status(200).started, 1);
    }

    #[test]
    fn policies_are_checked() {
        assert!(Policy::default().check().is_ok());
        let e = every(10).check().unwrap_err();
        assert_eq!(e.field, PolicyField::Interval);
        assert!(e.to_string().contains("100 ms"), "{e}");
        assert!(every(100).check().is_ok());
        let aligned_only = Policy {
            alignment_timeout: Some(Duration::from_millis(100)),
            ..every(100)
        };
        let e = aligned_only.check().unwrap_err();
        assert_eq!(e.field, PolicyField::AlignmentTimeout);
        assert!(e.to_string().contains("ALIGNED"), "{e}");
        let zero = Policy {
            max_concurrent: 0,
            ..every(100)
        };
        assert_eq!(zero.check().unwrap_err().field, PolicyField::MaxConcurrent);
    }

    #[test]
    fn every_value_is_held_to_its_limit_naming_the_field() {
        let day = Duration::from_secs(86_400);
        let ms = Duration::from_millis;
        let max = Duration::from_millis(u64::MAX);
        let cases: Vec<(Policy, PolicyField)> = vec![
            (every(u64::MAX), PolicyField::Interval),
            (every(30 * 86_400_000 + 1), PolicyField::Interval),
            (every(99), PolicyField::Interval),
            (
                Policy {
                    jitter: max,
                    ..every(1000)
                },
                PolicyField::Jitter,
            ),
            (
                Policy {
                    jitter: ms(1001),
                    ..every(1000)
                },
                PolicyField::Jitter,
            ),
            (
                Policy {
                    jitter: max,
                    ..Policy::default()
                },
                PolicyField::Jitter,
            ),
            (
                Policy {
                    timeout: Duration::ZERO,
                    ..Policy::default()
                },
                PolicyField::Timeout,
            ),
            (
                Policy {
                    timeout: day + ms(1),
                    ..Policy::default()
                },
                PolicyField::Timeout,
            ),
            (
                Policy {
                    mode: SnapshotMode::Aligned,
                    alignment_timeout: Some(max),
                    ..Policy::default()
                },
                PolicyField::AlignmentTimeout,
            ),
            (
                Policy {
                    mode: SnapshotMode::Aligned,
                    alignment_timeout: Some(Duration::ZERO),
                    ..Policy::default()
                },
                PolicyField::AlignmentTimeout,
            ),
            (
                Policy {
                    min_pause: max,
                    ..Policy::default()
                },
                PolicyField::MinPause,
            ),
            (
                Policy {
                    max_concurrent: u32::MAX,
                    ..Policy::default()
                },
                PolicyField::MaxConcurrent,
            ),
            (
                Policy {
                    tolerated_failures: u32::MAX,
                    ..Policy::default()
                },
                PolicyField::ToleratedFailures,
            ),
            (
                Policy {
                    freshness_threshold: Some(max),
                    ..Policy::default()
                },
                PolicyField::FreshnessThreshold,
            ),
            (
                Policy {
                    freshness_threshold: Some(Duration::ZERO),
                    ..Policy::default()
                },
                PolicyField::FreshnessThreshold,
            ),
        ];
        for (policy, field) in cases {
            let e = policy.check().unwrap_err();
            assert_eq!(e.field, field, "{policy:?}: {e}");
            assert!(e.to_string().starts_with(field.name()), "{e}");
        }
        let at_the_limits = Policy {
            interval: MAX_INTERVAL,
            jitter: MAX_INTERVAL,
            timeout: MAX_TIMEOUT,
            mode: SnapshotMode::Aligned,
            alignment_timeout: Some(MAX_TIMEOUT),
            min_pause: MAX_TIMEOUT,
            max_concurrent: MAX_CONCURRENT,
            tolerated_failures: MAX_TOLERATED_FAILURES,
            freshness_threshold: Some(MAX_FRESHNESS_THRESHOLD),
        };
        assert_eq!(at_the_limits.check(), Ok(()));
        // Off: the jitter is kept within bounds but need not be below a zero interval.
        let off_with_jitter = Policy {
            jitter: Duration::from_secs(1),
            ..Policy::default()
        };
        assert_eq!(off_with_jitter.check(), Ok(()));
    }

    #[test]
    fn the_reported_crash_policy_is_refused_and_harmless_unchecked() {
        // interval 10 ms, jitter u64::MAX ms: once a panic in the coordinator's task.
        let policy = Policy {
            jitter: Duration::from_millis(u64::MAX),
            ..every(10)
        };
        assert_eq!(policy.check().unwrap_err().field, PolicyField::Interval);
        let s = Schedule::new(policy, 0, 1);
        let due = s.next_due().unwrap();
        assert!((100..=200).contains(&due), "{due}");
        // interval u64::MAX ms: once a spin (the due time wrapped around).
        let mut s = Schedule::new(every(u64::MAX), 5, 1);
        assert_eq!(s.next_due(), Some(5 + saturating_millis(MAX_INTERVAL)));
        assert_eq!(s.poll(1_000), None);
    }

    /// splitmix64, for the property tests' inputs.
    struct Gen(u64);

    impl Gen {
        fn one_in(&mut self, n: u64) -> bool {
            self.next().is_multiple_of(n)
        }

        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        /// Any u64, edges often: 0, 1, MAX, MAX - 1, powers of two and their neighbours,
        /// the limits and their neighbours, small values, anything.
        fn value(&mut self) -> u64 {
            let limits = [
                saturating_millis(MIN_INTERVAL),
                saturating_millis(MAX_INTERVAL),
                saturating_millis(MAX_TIMEOUT),
            ];
            let pick = self.next();
            match self.next() % 8 {
                0 => [0, 1, 2, u64::MAX, u64::MAX - 1, u64::MAX / 2][(pick % 6) as usize],
                1 => 1u64 << (pick % 64),
                2 => (1u64 << (pick % 64)).wrapping_sub(1),
                3 => limits[(pick % 3) as usize]
                    .wrapping_add(pick % 3)
                    .wrapping_sub(1),
                4 | 5 => pick % 10_000,
                _ => pick,
            }
        }

        fn duration(&mut self) -> Duration {
            match self.next() % 4 {
                // Beyond u64 milliseconds, with a fraction of one.
                0 => Duration::new(self.value(), (self.next() % 1_000_000_000) as u32),
                _ => Duration::from_millis(self.value()),
            }
        }

        fn small(&mut self) -> u32 {
            match self.next() % 3 {
                0 => self.value() as u32,
                _ => (self.next() % 4) as u32,
            }
        }

        fn policy(&mut self) -> Policy {
            let mode = match self.next() % 3 {
                0 => SnapshotMode::ChandyLamport,
                1 => SnapshotMode::Unaligned,
                _ => SnapshotMode::Aligned,
            };
            let maybe = |g: &mut Self| (g.one_in(2)).then(|| g.duration());
            Policy {
                interval: if self.one_in(5) {
                    Duration::ZERO
                } else {
                    self.duration()
                },
                mode,
                timeout: self.duration(),
                alignment_timeout: maybe(self),
                min_pause: if self.one_in(2) {
                    Duration::ZERO
                } else {
                    self.duration()
                },
                jitter: if self.one_in(2) {
                    Duration::ZERO
                } else {
                    self.duration()
                },
                max_concurrent: self.small(),
                tolerated_failures: self.small(),
                freshness_threshold: maybe(self),
            }
        }

        /// A policy that passes the check: `p` with every value folded into its range.
        fn valid(&mut self) -> Policy {
            let mut p = self.policy();
            let fold = |d: Duration, lo: Duration, hi: Duration| {
                let span = saturating_millis(hi - lo) + 1;
                lo + Duration::from_millis(saturating_millis(d) % span)
            };
            if p.enabled() {
                p.interval = fold(p.interval, MIN_INTERVAL, MAX_INTERVAL);
                p.jitter = fold(p.jitter, Duration::ZERO, p.interval);
            } else {
                p.jitter = fold(p.jitter, Duration::ZERO, MAX_INTERVAL);
            }
            p.timeout = fold(p.timeout, Duration::from_millis(1), MAX_TIMEOUT);
            p.alignment_timeout = (p.mode == SnapshotMode::Aligned)
                .then_some(p.alignment_timeout)
                .flatten()
                .map(|d| fold(d, Duration::from_millis(1), MAX_TIMEOUT));
            p.min_pause = fold(p.min_pause, Duration::ZERO, MAX_TIMEOUT);
            p.max_concurrent = p.max_concurrent % MAX_CONCURRENT + 1;
            p.tolerated_failures %= MAX_TOLERATED_FAILURES + 1;
            p.freshness_threshold = p
                .freshness_threshold
                .map(|d| fold(d, Duration::from_millis(1), MAX_FRESHNESS_THRESHOLD));
            p
        }
    }

    /// Whether `gap` ms is a period `policy` allows: at least [`MIN_INTERVAL`] and at most
    /// twice [`MAX_INTERVAL`], checked policy or not; interval..=interval + jitter for a
    /// checked one.
    fn allowed_gap(policy: &Policy, gap: u64) -> bool {
        let lo = saturating_millis(MIN_INTERVAL);
        let hi = 2 * saturating_millis(MAX_INTERVAL);
        if !(lo..=hi).contains(&gap) {
            return false;
        }
        if policy.check().is_ok() {
            let interval = saturating_millis(policy.interval);
            let jitter = saturating_millis(policy.jitter);
            return (interval..=interval + jitter).contains(&gap);
        }
        true
    }

    /// The due time is one allowed period after `from` (or saturated at `u64::MAX`).
    fn assert_due_after(s: &Schedule, from: u64) {
        let policy = s.policy();
        let Some(due) = s.next_due() else {
            assert!(!policy.enabled(), "{policy:?}: enabled without a due time");
            return;
        };
        assert!(
            policy.enabled(),
            "{policy:?}: a due time without a schedule"
        );
        assert!(due >= from, "{policy:?}: due {due} before {from}");
        assert!(
            due == u64::MAX || allowed_gap(policy, due - from),
            "{policy:?}: due {} ms after {from}",
            due - from
        );
    }

    /// Drives a schedule from `policy` through every call at times from `g`; with
    /// `monotonic`, time never goes back and the due-time bounds are checked after each
    /// step.
    fn drive(g: &mut Gen, policy: Policy, monotonic: bool) {
        let mut now = g.value();
        let mut s = Schedule::new(policy, now, g.next());
        if monotonic {
            assert_due_after(&s, now);
        }
        let mut ids = 0u64;
        for _ in 0..24 {
            let step = match g.next() % 4 {
                0 => g.value(),
                _ => g.next() % 5_000,
            };
            now = if monotonic {
                now.saturating_add(step)
            } else {
                g.value()
            };
            match g.next() % 10 {
                0 => {
                    let p = if g.one_in(2) { g.policy() } else { g.valid() };
                    s.set_policy(p, now);
                    if monotonic {
                        assert_due_after(&s, now);
                    }
                }
                1 => s.completed_before(now, g.duration()),
                2 => {
                    let id = SnapshotId(g.next() % (ids + 1));
                    let result = if g.one_in(2) { Ok(()) } else { Err("x".into()) };
                    let alarm = s.finished(id, now, result);
                    if let Some(alarm) = alarm {
                        assert!(alarm.consecutive > alarm.tolerated);
                    }
                }
                _ => {
                    // Poll at or past the due time (or anywhere, out of order).
                    let at = if monotonic {
                        s.next_due().map_or(now, |due| due.max(now))
                    } else {
                        now
                    };
                    now = at;
                    let before = s.next_due();
                    match s.poll(at) {
                        None => assert!(before.is_none_or(|due| due > at)),
                        Some(Due::Start) => {
                            if g.one_in(4) {
                                let _ = s.refused(g.one_in(2), "no".into());
                            } else {
                                ids += 1;
                                s.started(SnapshotId(ids));
                                assert!(s.is_scheduled(SnapshotId(ids)));
                            }
                        }
                        Some(Due::Skip(skip)) => {
                            let _ = skip.to_string();
                        }
                    }
                    if let (true, Some(before), Some(after)) = (monotonic, before, s.next_due())
                        && before <= at
                    {
                        // On the grid of due times, or (late) one period after now.
                        assert!(
                            after == u64::MAX
                                || allowed_gap(s.policy(), after - before)
                                || allowed_gap(s.policy(), after - at),
                            "{:?}: due {before}, polled at {at}, next due {after}",
                            s.policy()
                        );
                    }
                    if monotonic {
                        assert!(
                            !s.policy().enabled()
                                || at == u64::MAX
                                || s.next_due().is_some_and(|due| due > at),
                            "polled at {at}, due again at {:?}: a spin",
                            s.next_due()
                        );
                    }
                }
            }
            let status = s.status(now);
            assert_eq!(status.failing, s.failing());
            assert_eq!(status.stale, s.stale(now));
            assert!(status.running <= u32::try_from(ids).unwrap_or(u32::MAX));
            if let Some(due) = s.next_due() {
                assert_eq!(
                    status.next_due_in,
                    Some(Duration::from_millis(due.saturating_sub(now)))
                );
            }
        }
    }

    #[test]
    fn no_input_over_the_whole_u64_range_panics_or_spins() {
        let mut g = Gen(0x5eed);
        for i in 0..20_000u32 {
            let policy = if i.is_multiple_of(3) {
                g.valid()
            } else {
                g.policy()
            };
            // The check never panics either, and a folded policy passes it.
            let checked = policy.check();
            if i.is_multiple_of(3) {
                assert_eq!(checked, Ok(()), "{policy:?}");
            }
            drive(&mut g, policy, !i.is_multiple_of(4));
        }
    }

    #[test]
    fn a_checked_policy_keeps_its_interval_and_jitter_at_the_extremes() {
        let mut g = Gen(7);
        for interval in [MIN_INTERVAL, Duration::from_millis(101), MAX_INTERVAL] {
            for jitter in [Duration::ZERO, Duration::from_millis(1), interval] {
                let policy = Policy {
                    interval,
                    jitter,
                    ..Policy::default()
                };
                assert_eq!(policy.check(), Ok(()));
                for now in [0, 1, u64::MAX / 2, u64::MAX - 1, u64::MAX] {
                    let mut s = Schedule::new(policy.clone(), now, g.next());
                    assert_due_after(&s, now);
                    let due = s.next_due().unwrap();
                    assert_eq!(s.poll(due), Some(Due::Start));
                    assert_due_after(&s, due);
                }
            }
        }
    }
}
