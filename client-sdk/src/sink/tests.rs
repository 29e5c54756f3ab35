//! The sink's state machine against an in-memory external system that crashes at every
//! call in turn — before the call takes effect, or after it did and before its answer —
//! followed by a restore of the newest completed snapshot and the history replayed from
//! its cut: the committed effects are then every effect of the history exactly once —
//! with cuts that pre-commit, and with cuts that carry the open transaction (a sink that
//! keeps one pending at most, and a system with room for one prepared transaction).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::*;

/// What the external system keeps across crashes.
#[derive(Debug, Default)]
struct Durable {
    prepared: BTreeMap<u64, Vec<u32>>,
    committed: BTreeMap<u64, Vec<u32>>,
    /// Most transactions prepared at once; a pre-commit past it is refused (`Full`).
    room: Option<usize>,
}

/// One process's connection: its open transaction is lost with it.
struct Fake {
    durable: Arc<Mutex<Durable>>,
    open: Vec<u32>,
    /// Calls so far, and the one that crashes the process (`.1`: after taking effect).
    calls: Arc<Mutex<u32>>,
    crash_at: Option<(u32, bool)>,
    /// Pre-commits that take effect and answer `Err` (the answer lost), the process going
    /// on.
    lose_pre_commit_answers: u32,
}

#[derive(Debug, PartialEq, Eq)]
enum Failure {
    Crashed,
    RolledBack(u64),
    Full,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

impl Fake {
    /// Counts a call; `Err` if the process crashes before it takes effect, `Ok(true)` if
    /// it crashes after.
    fn call(&mut self) -> Result<bool, Failure> {
        let mut calls = self.calls.lock().unwrap();
        *calls += 1;
        match self.crash_at {
            Some((at, false)) if *calls >= at => Err(Failure::Crashed),
            Some((at, true)) if *calls > at => Err(Failure::Crashed),
            Some((at, true)) => Ok(*calls == at),
            _ => Ok(false),
        }
    }

    fn done(crash_after: bool) -> Result<(), Failure> {
        if crash_after {
            Err(Failure::Crashed)
        } else {
            Ok(())
        }
    }
}

impl Transactional for Fake {
    type Error = Failure;

    async fn begin(&mut self) -> Result<(), Failure> {
        let after = self.call()?;
        self.open.clear();
        Self::done(after)
    }

    async fn pre_commit(&mut self, id: u64) -> Result<(), Failure> {
        let after = self.call()?;
        let mut d = self.durable.lock().unwrap();
        if d.room.is_some_and(|room| d.prepared.len() >= room) {
            return Err(Failure::Full);
        }
        d.prepared.insert(id, self.open.clone());
        drop(d);
        if self.lose_pre_commit_answers > 0 {
            // As the trait asks: on Err, the open transaction's effects are still there.
            self.lose_pre_commit_answers -= 1;
            return Err(Failure::Crashed);
        }
        self.open.clear();
        Self::done(after)
    }

    fn open_is_empty(&self) -> bool {
        self.open.is_empty()
    }

    fn is_full(error: &Failure) -> bool {
        *error == Failure::Full
    }

    async fn commit(&mut self, id: u64) -> Result<(), Failure> {
        let after = self.call()?;
        let mut d = self.durable.lock().unwrap();
        if let Some(rows) = d.prepared.remove(&id) {
            d.committed.insert(id, rows);
        } else if !d.committed.contains_key(&id) {
            return Err(Failure::RolledBack(id));
        }
        Self::done(after)
    }

    async fn abort(&mut self, id: u64) -> Result<(), Failure> {
        let after = self.call()?;
        self.durable.lock().unwrap().prepared.remove(&id);
        Self::done(after)
    }

    async fn pre_committed(&mut self) -> Result<Vec<u64>, Failure> {
        let after = self.call()?;
        let ids = self
            .durable
            .lock()
            .unwrap()
            .prepared
            .keys()
            .copied()
            .collect();
        if after {
            Err(Failure::Crashed)
        } else {
            Ok(ids)
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Step {
    /// The application applies effect `n` and writes it.
    Write(u32),
    /// A snapshot's cut (its id is the next one the coordinator hands out).
    Cut,
    /// The last cut's snapshot completes (stored), and the application hears it.
    Complete,
    /// The last cut's snapshot fails.
    Fail,
}

use Step::{Complete, Cut, Fail, Write};

const SCRIPT: [Step; 19] = [
    Write(1),
    Write(2),
    Cut,
    Write(3),
    Complete,
    Write(4),
    Cut,
    Fail,
    Write(5),
    Cut,
    Write(6),
    Complete,
    Write(7),
    Cut,
    Write(8),
    Cut,
    Complete,
    Cut,
    Complete,
];

/// A state recorded at a cut: the effects applied so far, the sink's state, the effects
/// carried past the cut, and where in the script the cut was.
#[derive(Clone)]
struct Recorded {
    applied: Vec<u32>,
    sink: SinkState,
    carried: Vec<u32>,
    at: usize,
}

/// The coordinator's side: completed snapshots and the states recorded at their cuts.
#[derive(Default)]
struct Cluster {
    next_id: u64,
    completed: BTreeMap<u64, Recorded>,
    /// Cuts that carried effects.
    carried: usize,
}

/// Runs `SCRIPT` from `from` (with the application's `applied` effects), crashing at
/// `crash_at`; returns the step it crashed at, if it did.
async fn run(
    cluster: &mut Cluster,
    sink: &mut TwoPhaseCommitSink<Fake>,
    applied: &mut Vec<u32>,
    from: usize,
) -> Option<usize> {
    let mut last_cut = None;
    for (at, step) in SCRIPT.iter().enumerate().skip(from) {
        match *step {
            Write(n) => {
                applied.push(n);
                sink.system().open.push(n);
            }
            Cut => {
                cluster.next_id += 1;
                let id = cluster.next_id;
                // The effects of the open transaction, before the cut takes them.
                let open = sink.system().open.clone();
                match sink.cut(id).await {
                    // The state reaches the coordinator only if the cut answered.
                    Ok(cut) => {
                        let carried = if cut.carried() {
                            // (An empty transaction is carried whatever the limits.)
                            cluster.carried += usize::from(!open.is_empty());
                            open
                        } else {
                            Vec::new()
                        };
                        last_cut = Some((
                            id,
                            Recorded {
                                applied: applied.clone(),
                                sink: cut.state().clone(),
                                carried,
                                at,
                            },
                        ));
                    }
                    Err(_) => return Some(at),
                }
            }
            Complete => {
                // None: the cut was the restored snapshot's, completed already.
                let Some((id, recorded)) = last_cut.take() else {
                    continue;
                };
                cluster.completed.insert(id, recorded);
                if sink.completed(id).await.is_err() {
                    return Some(at);
                }
            }
            Fail => {
                last_cut = None;
            }
        }
    }
    None
}

/// How a run's sink keeps pending transactions: the most it keeps, and the room the
/// system has for prepared ones.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_pending: usize,
    room: Option<usize>,
}

const LIMITS: [Limits; 3] = [
    // Every cut pre-commits.
    Limits {
        max_pending: DEFAULT_MAX_PENDING,
        room: None,
    },
    // A cut while one is pending carries.
    Limits {
        max_pending: 1,
        room: None,
    },
    // The system refuses a second prepared transaction: the cut carries.
    Limits {
        max_pending: DEFAULT_MAX_PENDING,
        room: Some(1),
    },
];

async fn started(
    fake: Fake,
    limits: Limits,
) -> Result<TwoPhaseCommitSink<Fake>, SinkError<Failure>> {
    fake.durable.lock().unwrap().room = limits.room;
    Ok(TwoPhaseCommitSink::start(fake)
        .await?
        .with_max_pending(limits.max_pending))
}

fn fake(durable: &Arc<Mutex<Durable>>, crash_at: Option<(u32, bool)>) -> Fake {
    Fake {
        durable: durable.clone(),
        open: Vec::new(),
        calls: Arc::default(),
        crash_at,
        lose_pre_commit_answers: 0,
    }
}

#[tokio::test]
async fn every_effect_is_committed_exactly_once_whatever_call_the_process_crashes_at() {
    for limits in LIMITS {
        crash_at_every_call(limits).await;
    }
}

async fn crash_at_every_call(limits: Limits) {
    // How many calls a run without a crash makes.
    let durable = Arc::new(Mutex::new(Durable::default()));
    let mut sink = started(fake(&durable, None), limits).await.unwrap();
    let mut cluster = Cluster::default();
    assert_eq!(run(&mut cluster, &mut sink, &mut Vec::new(), 0).await, None);
    let calls = *sink.system().calls.lock().unwrap();
    let all: Vec<u32> = (1..=8).collect();
    let committed = |d: &Durable| -> Vec<u32> { d.committed.values().flatten().copied().collect() };
    assert_eq!(committed(&durable.lock().unwrap()), all, "{limits:?}");
    assert!(calls > 10);
    // The limits make cuts carry, or none.
    assert_eq!(
        cluster.carried > 0,
        limits.max_pending == 1 || limits.room.is_some(),
        "{limits:?}: {} cuts carried",
        cluster.carried
    );

    for crash_at in 1..=calls {
        for after_effect in [false, true] {
            let case =
                format!("{limits:?}: crash at call {crash_at}, after its effect: {after_effect}");
            let durable = Arc::new(Mutex::new(Durable::default()));
            let mut cluster = Cluster::default();
            let mut applied = Vec::new();
            let crashed =
                match started(fake(&durable, Some((crash_at, after_effect))), limits).await {
                    Ok(mut sink) => run(&mut cluster, &mut sink, &mut applied, 0).await,
                    Err(_) => Some(0),
                };
            assert!(crashed.is_some(), "{case}: it crashed");
            // A new process, restored to the newest completed snapshot (or to nothing).
            let mut sink = started(fake(&durable, None), limits).await.unwrap();
            let (mut applied, from) = match cluster.completed.last_key_value() {
                Some((&id, recorded)) => {
                    let state = SinkState::decode(&recorded.sink.encode()).unwrap();
                    sink.restored(id, &state)
                        .await
                        .unwrap_or_else(|e| panic!("{case}: {e}"));
                    // What the cut carried is written again.
                    sink.system().open.extend(&recorded.carried);
                    (recorded.applied.clone(), recorded.at + 1)
                }
                // Nothing to restore: the run starts over, and what the crashed process
                // pre-committed is rolled back by hand (a restore to no snapshot).
                None => {
                    sink.restored(0, &SinkState::default()).await.unwrap();
                    (Vec::new(), 0)
                }
            };
            assert_eq!(
                run(&mut cluster, &mut sink, &mut applied, from).await,
                None,
                "{case}"
            );
            assert_eq!(applied, all, "{case}: the history replayed");
            let d = durable.lock().unwrap();
            assert_eq!(committed(&d), all, "{case}: exactly once, none lost");
            assert!(
                d.prepared.is_empty(),
                "{case}: nothing left pre-committed: {:?}",
                d.prepared
            );
        }
    }
}

#[tokio::test]
async fn a_completion_commits_what_failed_snapshots_pre_committed_and_a_repeat_does_nothing() {
    let durable = Arc::new(Mutex::new(Durable::default()));
    let mut sink = TwoPhaseCommitSink::start(fake(&durable, None))
        .await
        .unwrap();
    sink.system().open.push(1);
    assert_eq!(sink.cut(4).await.unwrap().state().pending, vec![4]);
    sink.system().open.push(2);
    assert_eq!(sink.cut(5).await.unwrap().state().pending, vec![4, 5]);
    // 4 failed (nothing to do); 5 completes: both are committed, in order.
    sink.completed(5).await.unwrap();
    sink.completed(5).await.unwrap();
    assert!(sink.pending().is_empty());
    assert_eq!(
        durable
            .lock()
            .unwrap()
            .committed
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        vec![4, 5]
    );
    // Ids only grow.
    assert!(matches!(
        sink.cut(5).await,
        Err(SinkError::Refused { snapshot_id: 5, .. })
    ));
}

#[tokio::test]
async fn a_pre_commit_whose_answer_is_lost_is_rolled_back_and_its_effects_pre_committed_again() {
    let durable = Arc::new(Mutex::new(Durable::default()));
    let mut sink = TwoPhaseCommitSink::start(fake(&durable, None))
        .await
        .unwrap();
    sink.system().open.push(1);
    sink.system().lose_pre_commit_answers = 1;
    assert!(matches!(sink.cut(3).await, Err(SinkError::System(_))));
    assert!(sink.pending().is_empty(), "never counted as pending");
    assert_eq!(
        durable.lock().unwrap().prepared[&3],
        vec![1],
        "yet it happened"
    );
    // The next cut rolls the doubtful one back first, then pre-commits every effect.
    sink.system().open.push(2);
    assert_eq!(sink.cut(4).await.unwrap().state().pending, vec![4]);
    assert_eq!(
        durable.lock().unwrap().prepared,
        BTreeMap::from([(4, vec![1, 2])])
    );
    sink.completed(4).await.unwrap();
    let d = durable.lock().unwrap();
    assert_eq!(d.committed, BTreeMap::from([(4, vec![1, 2])]));
    assert!(d.prepared.is_empty());
}

#[tokio::test]
async fn completions_leave_what_an_earlier_process_pre_committed_for_the_restore() {
    // A crashed process left snapshot 5's transaction pre-committed; 5 completed.
    let durable = Arc::new(Mutex::new(Durable::default()));
    durable.lock().unwrap().prepared.insert(5, vec![1]);
    let mut sink = TwoPhaseCommitSink::start(fake(&durable, None))
        .await
        .unwrap();
    // The new process catches up on ends it did not take part in, before the restore.
    sink.completed(4).await.unwrap();
    sink.completed(5).await.unwrap();
    assert_eq!(durable.lock().unwrap().prepared.len(), 1, "left alone");
    sink.restored(5, &SinkState::new(vec![5]).unwrap())
        .await
        .unwrap();
    assert_eq!(
        durable.lock().unwrap().committed,
        BTreeMap::from([(5, vec![1])])
    );

    // Even the completion of its own cut leaves them: a restore of an older snapshot (5,
    // by hand) may follow, and commits them.
    let durable = Arc::new(Mutex::new(Durable::default()));
    durable.lock().unwrap().prepared.insert(5, vec![1]);
    durable.lock().unwrap().prepared.insert(6, vec![9]);
    let mut sink = TwoPhaseCommitSink::start(fake(&durable, None))
        .await
        .unwrap();
    sink.system().open.push(2);
    assert!(!sink.cut(7).await.unwrap().carried());
    sink.completed(7).await.unwrap();
    assert_eq!(
        durable.lock().unwrap().prepared.keys().collect::<Vec<_>>(),
        vec![&5, &6]
    );
    sink.restored(5, &SinkState::new(vec![5]).unwrap())
        .await
        .unwrap();
    let d = durable.lock().unwrap();
    assert_eq!(
        d.committed,
        BTreeMap::from([(5, vec![1]), (7, vec![2])]),
        "7 stays committed: the application removes it"
    );
    assert!(d.prepared.is_empty(), "6 rolled back: {:?}", d.prepared);
}

#[test]
fn a_sink_state_round_trips_and_bad_bytes_are_refused() {
    let state = SinkState {
        pending: vec![3, 9, 12],
    };
    assert_eq!(SinkState::decode(&state.encode()), Ok(state));
    assert_eq!(
        SinkState::decode(&SinkState::default().encode()),
        Ok(SinkState::default())
    );
    for bad in [
        vec![],
        vec![1, 2, 3],
        SinkState {
            pending: vec![9, 3],
        }
        .encode(),
        SinkState { pending: vec![0] }.encode(),
        (u64::MAX).to_le_bytes().to_vec(),
    ] {
        assert!(SinkState::decode(&bad).is_err(), "{bad:?}");
    }
    assert!(SinkState::new(vec![2, 2]).is_err());
    assert!(SinkState::new((1..=MAX_PENDING as u64 + 1).collect()).is_err());
    assert_eq!(SinkState::new(vec![1, 5]).unwrap().pending, vec![1, 5]);
}

#[tokio::test]
async fn cuts_carry_past_the_most_pending_and_a_full_system_and_the_next_pre_commits_it_all() {
    let durable = Arc::new(Mutex::new(Durable::default()));
    let mut sink = TwoPhaseCommitSink::start(fake(&durable, None))
        .await
        .unwrap()
        .with_max_pending(2);
    sink.system().open.push(1);
    assert_eq!(
        sink.cut(1).await.unwrap(),
        super::Cut::PreCommitted(SinkState::new(vec![1]).unwrap())
    );
    sink.system().open.push(2);
    assert!(!sink.cut(2).await.unwrap().carried());
    // Two pending (snapshots 1 and 2 failed, say): the next cuts carry, calling nothing.
    sink.system().open.push(3);
    let calls = *sink.system().calls.lock().unwrap();
    assert_eq!(
        sink.cut(3).await.unwrap(),
        super::Cut::Carried(SinkState::new(vec![1, 2]).unwrap())
    );
    sink.system().open.push(4);
    assert!(sink.cut(4).await.unwrap().carried());
    assert_eq!(*sink.system().calls.lock().unwrap(), calls);
    assert_eq!(
        sink.system().open,
        vec![3, 4],
        "the open transaction went on"
    );
    // Ids still only grow past a carried cut.
    assert!(matches!(
        sink.cut(4).await,
        Err(SinkError::Refused { snapshot_id: 4, .. })
    ));
    // Snapshot 4 completes: 1 and 2 are committed, and the next cut pre-commits 3 and 4.
    sink.completed(4).await.unwrap();
    assert!(!sink.cut(5).await.unwrap().carried());
    assert_eq!(
        durable.lock().unwrap().prepared,
        BTreeMap::from([(5, vec![3, 4])])
    );

    // A system with no room refuses the pre-commit: the cut carries, nothing is doubtful.
    durable.lock().unwrap().room = Some(1);
    sink.system().open.push(6);
    assert_eq!(
        sink.cut(6).await.unwrap(),
        super::Cut::Carried(SinkState::new(vec![5]).unwrap())
    );
    assert_eq!(sink.system().open, vec![6]);
    sink.completed(6).await.unwrap();
    assert_eq!(
        sink.cut(7).await.unwrap(),
        super::Cut::PreCommitted(SinkState::new(vec![7]).unwrap())
    );
    sink.completed(7).await.unwrap();
    let d = durable.lock().unwrap();
    assert_eq!(
        d.committed,
        BTreeMap::from([(1, vec![1]), (2, vec![2]), (5, vec![3, 4]), (7, vec![6])])
    );
    assert!(d.prepared.is_empty());
}

#[tokio::test]
async fn the_most_pending_is_at_least_one_and_at_most_the_states_bound() {
    let durable = Arc::new(Mutex::new(Durable::default()));
    for (asked, kept) in [(0, 1), (5, 5), (usize::MAX, MAX_PENDING)] {
        let sink = TwoPhaseCommitSink::start(fake(&durable, None))
            .await
            .unwrap()
            .with_max_pending(asked);
        assert_eq!(sink.max_pending, kept);
    }
}
