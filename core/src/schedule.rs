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
pub const MIN_INTERVAL: Duration = Duration::from_millis(10);

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

/// Why a policy cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PolicyError(String);

impl Policy {
    /// Checks that the policy makes sense.
    pub fn check(&self) -> Result<(), PolicyError> {
        let bad = |why: String| Err(PolicyError(why));
        if !self.interval.is_zero() && self.interval < MIN_INTERVAL {
            return bad(format!(
                "interval {:?} is below the least allowed, {MIN_INTERVAL:?} (0 turns the schedule off)",
                self.interval
            ));
        }
        if self.timeout.is_zero() {
            return bad("timeout must be above zero".into());
        }
        if self.max_concurrent == 0 {
            return bad("max concurrent must be at least 1".into());
        }
        if self.alignment_timeout.is_some() && self.mode != SnapshotMode::Aligned {
            return bad(format!(
                "an alignment timeout applies only to ALIGNED snapshots, not {}",
                self.mode
            ));
        }
        if self.freshness_threshold == Some(Duration::ZERO) {
            return bad("a freshness threshold must be above zero (none turns it off)".into());
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
        self.next_due = self.policy.enabled().then(|| now + self.period());
    }

    /// Tells the schedule that a snapshot completed `age` before `now` (at start-up, from
    /// stored records).
    pub fn completed_before(&mut self, now: u64, age: Duration) {
        let at = now.saturating_sub(age.as_millis() as u64);
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
        let next = due + self.period();
        // Late (a slow store, a paused process): no burst to catch up.
        self.next_due = Some(if next > now {
            next
        } else {
            now + self.period()
        });
        let running = self.running.len() as u32;
        let pause = self.policy.min_pause.as_millis() as u64;
        let skip = if running >= self.policy.max_concurrent || (pause > 0 && running > 0) {
            Some(Skip::Running { running })
        } else {
            match self.last_end {
                Some(end) if pause > 0 && now < end + pause => Some(Skip::MinPause {
                    remaining: Duration::from_millis(end + pause - now),
                }),
                _ => None,
            }
        };
        Some(match skip {
            Some(skip) => {
                self.skipped += 1;
                Due::Skip(skip)
            }
            None => Due::Start,
        })
    }

    /// The snapshot [`Due::Start`] asked for started as `id`.
    pub fn started(&mut self, id: SnapshotId) {
        self.started += 1;
        self.running.insert(id);
    }

    /// The snapshot [`Due::Start`] asked for could not start. `busy`: for want of room,
    /// counted as a skip; otherwise (a node is down…) a failure.
    pub fn refused(&mut self, busy: bool, why: String) -> Result<Skip, Option<Failing>> {
        if busy {
            self.skipped += 1;
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
                > threshold.as_millis() as u64
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
            running: self.running.len() as u32,
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
        self.consecutive_failures += 1;
        self.last_failure = Some(why.clone());
        self.failing().then_some(Failing {
            consecutive: self.consecutive_failures,
            tolerated: self.policy.tolerated_failures,
            last_failure: why,
        })
    }

    /// One interval plus a random share of the jitter, in milliseconds.
    fn period(&mut self) -> u64 {
        let jitter = self.policy.jitter.as_millis() as u64;
        let extra = if jitter == 0 {
            0
        } else {
            self.next_random() % (jitter + 1)
        };
        self.policy.interval.as_millis() as u64 + extra
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
            ..every(100)
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
        assert!(every(5).check().unwrap_err().to_string().contains("10ms"));
        let aligned_only = Policy {
            alignment_timeout: Some(Duration::from_millis(100)),
            ..every(100)
        };
        assert!(
            aligned_only
                .check()
                .unwrap_err()
                .to_string()
                .contains("ALIGNED")
        );
        let zero = Policy {
            max_concurrent: 0,
            ..every(100)
        };
        assert!(zero.check().is_err());
    }
}
