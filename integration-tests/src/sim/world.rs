//! The simulated cluster: processes with a token-transfer application, their inboxes and
//! outgoing queues, FIFO links with sequence numbers and acks, and a coordinator driving
//! the real `SnapshotTracker`. A seeded scheduler picks the next step.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use cairn_core::{
    ChannelId, Command, Event, FailureReason, LocalReport, NodeId, NodePart, Plan, SnapshotEngine,
    SnapshotId, SnapshotTracker, StartError, StartRequest, Topology, tracker,
};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

use super::config::SimConfig;
use super::mutant::{Engine, Mutant, MutantEngine};
use super::oracle;
use super::{SimFailure, SimStats};

/// Money each process starts with.
const START_BALANCE: u64 = 100;

/// One application message: a transfer, with a unique id for the oracle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Msg {
    pub uid: u64,
    pub amount: u64,
}

#[derive(Debug)]
enum InboxItem {
    Deliver { channel: ChannelId, msg: Msg },
    Record(SnapshotId),
}

#[derive(Debug)]
enum AppItem {
    Send {
        channel: ChannelId,
        msg: Msg,
    },
    State {
        id: SnapshotId,
        balance: u64,
        unconsumed: Vec<(ChannelId, u64)>,
    },
}

/// Most items the application holds handed over and not consumed (its delivery window).
const WINDOW: usize = 4;

#[derive(Debug, Clone)]
enum Frame {
    Data(Msg),
    Marker(Plan),
}

/// One directed channel: the sender's queue, the wire, and the receiver's position.
#[derive(Debug, Default)]
struct Link {
    outbox: VecDeque<Frame>,
    next_seq: u64,
    unacked: VecDeque<(u64, Frame)>,
    in_transit: VecDeque<(u64, Frame)>,
    received_seq: u64,
    /// Every data message of this incarnation, by data index.
    history: Vec<Msg>,
    blocked: bool,
}

impl Link {
    fn quiescent(&self) -> bool {
        self.outbox.is_empty() && self.in_transit.is_empty() && self.unacked.is_empty()
    }
}

enum Control {
    Initiate(Plan),
    Abort(SnapshotId, FailureReason),
}

pub(crate) struct Process {
    engine: Box<dyn Engine>,
    balance: u64,
    inbox: VecDeque<InboxItem>,
    /// Handed to the application and not consumed yet: messages, and record requests
    /// behind them (the in-band copy).
    handed: VecDeque<InboxItem>,
    /// Early copies of record requests that overtook the inbox: the application may take
    /// one between two messages, before what it was handed.
    early: VecDeque<SnapshotId>,
    /// Requests the application answered from one copy whose other copy is still coming.
    answered: BTreeSet<SnapshotId>,
    app_out: VecDeque<AppItem>,
    pub(crate) sent_log: Vec<(ChannelId, Msg)>,
    pub(crate) delivered_log: Vec<(ChannelId, Msg)>,
    /// The application's cut per snapshot: how much of each log precedes it.
    pub(crate) cuts: BTreeMap<SnapshotId, (usize, usize)>,
    control: VecDeque<Control>,
    timers: Vec<SnapshotId>,
}

impl Process {
    /// The application records its state: everything it consumed is in it, nothing else.
    fn cut(&mut self, id: SnapshotId, unconsumed: Vec<(ChannelId, u64)>) {
        self.cuts
            .insert(id, (self.sent_log.len(), self.delivered_log.len()));
        self.app_out.push_back(AppItem::State {
            id,
            balance: self.balance,
            unconsumed,
        });
    }
}

/// A finished snapshot's evidence, kept for the oracle.
#[derive(Default)]
pub(crate) struct Evidence {
    pub reports: BTreeMap<NodeId, LocalReport>,
    pub states: BTreeMap<NodeId, u64>,
    /// Recorded messages per (recording process, channel), with their data indices.
    pub recorded: BTreeMap<(NodeId, ChannelId), Vec<(u64, Msg)>>,
}

#[derive(Clone, Copy, Debug)]
enum Action {
    AppSend(usize),
    AppProcess(usize),
    AppHand(usize),
    AppEarly(usize),
    NodeTakeApp(usize),
    Control(usize),
    Timer(usize),
    Transmit(usize),
    Deliver(usize),
    Initiate,
    TransportReset(usize),
    ChannelReset(usize),
}

pub(crate) struct World {
    config: SimConfig,
    rng: StdRng,
    pub(crate) topology: Topology,
    names: Vec<NodeId>,
    pub(crate) procs: BTreeMap<NodeId, Process>,
    channels: Vec<ChannelId>,
    links: BTreeMap<ChannelId, Link>,
    tracker: SnapshotTracker,
    next_id: u64,
    next_uid: u64,
    pub(crate) total: u64,
    initiations_left: usize,
    evidence: BTreeMap<SnapshotId, Evidence>,
    modes: BTreeMap<SnapshotId, cairn_core::SnapshotMode>,
    stats: SimStats,
}

impl World {
    pub(crate) fn new(config: SimConfig) -> Self {
        let mut rng = StdRng::seed_from_u64(config.seed);
        let topology = config.shape.build(config.nodes, &mut rng);
        let names: Vec<NodeId> = topology.nodes().iter().cloned().collect();
        let procs = names
            .iter()
            .map(|n| {
                let real = SnapshotEngine::new(n.clone(), topology.clone());
                let engine: Box<dyn Engine> = match config.mutant {
                    Mutant::None => Box::new(real),
                    m => Box::new(MutantEngine::new(real, m, &topology)),
                };
                let p = Process {
                    engine,
                    balance: START_BALANCE,
                    inbox: VecDeque::new(),
                    handed: VecDeque::new(),
                    early: VecDeque::new(),
                    answered: BTreeSet::new(),
                    app_out: VecDeque::new(),
                    sent_log: Vec::new(),
                    delivered_log: Vec::new(),
                    cuts: BTreeMap::new(),
                    control: VecDeque::new(),
                    timers: Vec::new(),
                };
                (n.clone(), p)
            })
            .collect();
        let channels: Vec<ChannelId> = topology.channels().iter().cloned().collect();
        let links = channels
            .iter()
            .map(|c| (c.clone(), Link::default()))
            .collect();
        let stats = SimStats {
            shape: Some(config.shape),
            ..SimStats::default()
        };
        Self {
            tracker: SnapshotTracker::new(config.max_in_flight),
            initiations_left: config.snapshots,
            total: START_BALANCE * names.len() as u64,
            config,
            rng,
            topology,
            names,
            procs,
            channels,
            links,
            next_id: 1,
            next_uid: 1,
            evidence: BTreeMap::new(),
            modes: BTreeMap::new(),
            stats,
        }
    }

    fn fail(&self, snapshot: Option<SnapshotId>) -> SimFailure {
        SimFailure {
            seed: self.config.seed,
            shape: self.config.shape,
            snapshot,
            ..SimFailure::default()
        }
    }

    /// Runs the live phase, then drains every queue, then checks the end state.
    pub(crate) fn run(mut self) -> Result<SimStats, SimFailure> {
        for _ in 0..self.config.steps {
            let actions = self.enabled(true);
            let Some(&action) = actions.choose(&mut self.rng) else {
                break;
            };
            self.step(action)?;
        }
        // Drain: no new transfers, snapshots or faults; everything in flight lands.
        let mut budget = 1_000_000;
        loop {
            let actions = self.enabled(false);
            let Some(&action) = actions.choose(&mut self.rng) else {
                break;
            };
            self.step(action)?;
            budget -= 1;
            assert!(
                budget > 0,
                "seed {}: drain does not terminate",
                self.config.seed
            );
        }
        let stuck: Vec<SnapshotId> = self.tracker.in_flight().map(|p| p.id).collect();
        if let Some(&id) = stuck.first() {
            let missing = match self.tracker.timed_out(id) {
                tracker::Update::Finished(tracker::Outcome::Failed(reason), _) => {
                    reason.to_string()
                }
                other => format!("{other:?}"),
            };
            return Err(SimFailure {
                stuck: Some(format!(
                    "snapshot {id} never completed after every queue drained: {missing}"
                )),
                ..self.fail(Some(id))
            });
        }
        let sum: u64 = self.procs.values().map(|p| p.balance).sum();
        if sum != self.total {
            return Err(SimFailure {
                oracle: Some(format!(
                    "after draining, balances sum to {sum}, not {}",
                    self.total
                )),
                ..self.fail(None)
            });
        }
        self.stats.schedules = 1;
        Ok(self.stats)
    }

    fn enabled(&mut self, live: bool) -> Vec<Action> {
        let mut actions = Vec::new();
        for (i, name) in self.names.iter().enumerate() {
            let p = &self.procs[name];
            if live && p.balance > 0 && self.topology.outgoing(name).next().is_some() {
                actions.push(Action::AppSend(i));
            }
            if !p.inbox.is_empty() && p.handed.len() < WINDOW {
                actions.push(Action::AppHand(i));
            }
            if !p.handed.is_empty() {
                actions.push(Action::AppProcess(i));
            }
            if !p.early.is_empty() {
                actions.push(Action::AppEarly(i));
            }
            if !p.app_out.is_empty() {
                actions.push(Action::NodeTakeApp(i));
            }
            if !p.control.is_empty() {
                actions.push(Action::Control(i));
            }
            if !p.timers.is_empty() {
                actions.push(Action::Timer(i));
            }
        }
        for (i, c) in self.channels.iter().enumerate() {
            let link = &self.links[c];
            if !link.outbox.is_empty() {
                actions.push(Action::Transmit(i));
            }
            if !link.in_transit.is_empty() && !link.blocked {
                actions.push(Action::Deliver(i));
            }
        }
        if live && self.initiations_left > 0 && self.rng.random_bool(0.05) {
            actions.push(Action::Initiate);
        }
        if live && self.config.transport_faults && self.rng.random_bool(0.02) {
            let i = self.rng.random_range(0..self.channels.len().max(1));
            if i < self.channels.len() {
                actions.push(Action::TransportReset(i));
            }
        }
        if live && self.config.channel_resets && self.rng.random_bool(0.02) {
            let quiet: Vec<usize> = (0..self.channels.len())
                .filter(|&i| self.channel_quiescent(i))
                .collect();
            if let Some(&i) = quiet.choose(&mut self.rng) {
                actions.push(Action::ChannelReset(i));
            }
        }
        actions
    }

    /// No frame of the channel is queued, on the wire or waiting for the application.
    fn channel_quiescent(&self, i: usize) -> bool {
        let c = &self.channels[i];
        let to = &self.procs[&c.to];
        self.links[c].quiescent()
            && !to
                .inbox
                .iter()
                .chain(&to.handed)
                .any(|item| matches!(item, InboxItem::Deliver { channel, .. } if channel == c))
            && !self.procs[&c.from]
                .app_out
                .iter()
                .any(|item| matches!(item, AppItem::Send { channel, .. } if channel == c))
    }

    fn step(&mut self, action: Action) -> Result<(), SimFailure> {
        match action {
            Action::AppSend(i) => {
                let name = self.names[i].clone();
                let outs: Vec<ChannelId> = self.topology.outgoing(&name).collect();
                let channel = outs.choose(&mut self.rng).expect("has outgoing").clone();
                let p = self.procs.get_mut(&name).expect("member");
                let amount = self.rng.random_range(1..=p.balance.min(10));
                p.balance -= amount;
                let msg = Msg {
                    uid: self.next_uid,
                    amount,
                };
                self.next_uid += 1;
                p.sent_log.push((channel.clone(), msg));
                p.app_out.push_back(AppItem::Send { channel, msg });
            }
            Action::AppHand(i) => {
                // The daemon hands the front of the inbox over: the engine counts a message
                // delivered now, though the application consumes it later.
                let name = self.names[i].clone();
                let p = self.procs.get_mut(&name).expect("member");
                let item = p.inbox.pop_front().expect("enabled");
                let delivered = match &item {
                    InboxItem::Deliver { channel, .. } => Some(channel.clone()),
                    InboxItem::Record(_) => None,
                };
                p.handed.push_back(item);
                if let Some(channel) = delivered {
                    self.feed(&name, Event::DataDelivered { channel, count: 1 })?;
                }
            }
            Action::AppProcess(i) => {
                let name = self.names[i].clone();
                let p = self.procs.get_mut(&name).expect("member");
                match p.handed.pop_front().expect("enabled") {
                    InboxItem::Deliver { channel, msg } => {
                        p.balance += msg.amount;
                        p.delivered_log.push((channel, msg));
                    }
                    InboxItem::Record(id) => {
                        // Cut at its early copy already, or the cut is here.
                        if !p.answered.remove(&id) {
                            if p.early.contains(&id) {
                                p.answered.insert(id);
                            }
                            p.cut(id, Vec::new());
                        }
                    }
                }
            }
            Action::AppEarly(i) => {
                let name = self.names[i].clone();
                let p = self.procs.get_mut(&name).expect("member");
                let id = p.early.pop_front().expect("enabled");
                if !p.answered.remove(&id) {
                    // Between two messages, before what was handed ahead of the in-band
                    // request (all that was handed, if that is not handed over yet).
                    let mut unconsumed: BTreeMap<ChannelId, u64> = BTreeMap::new();
                    for item in &p.handed {
                        match item {
                            InboxItem::Record(r) if *r == id => break,
                            InboxItem::Record(_) => {}
                            InboxItem::Deliver { channel, .. } => {
                                *unconsumed.entry(channel.clone()).or_default() += 1;
                            }
                        }
                    }
                    if !unconsumed.is_empty() {
                        self.stats.early_cuts += 1;
                    }
                    p.answered.insert(id);
                    p.cut(id, unconsumed.into_iter().collect());
                }
            }
            Action::NodeTakeApp(i) => {
                let name = self.names[i].clone();
                let p = self.procs.get_mut(&name).expect("member");
                match p.app_out.pop_front().expect("enabled") {
                    AppItem::Send { channel, msg } => {
                        let link = self.links.get_mut(&channel).expect("channel");
                        link.history.push(msg);
                        link.outbox.push_back(Frame::Data(msg));
                        self.feed(&name, Event::DataQueued { channel, count: 1 })?;
                    }
                    AppItem::State {
                        id,
                        balance,
                        unconsumed,
                    } => {
                        self.evidence
                            .entry(id)
                            .or_default()
                            .states
                            .insert(name.clone(), balance);
                        self.tracker.state_recorded(id, &name);
                        self.feed(&name, Event::StateRecorded { id, unconsumed })?;
                    }
                }
            }
            Action::Control(i) => {
                let name = self.names[i].clone();
                let p = self.procs.get_mut(&name).expect("member");
                let event = match p.control.pop_front().expect("enabled") {
                    Control::Initiate(plan) => Event::SnapshotInitiated { plan },
                    Control::Abort(id, reason) => Event::SnapshotAborted { id, reason },
                };
                self.feed(&name, event)?;
            }
            Action::Timer(i) => {
                let name = self.names[i].clone();
                let p = self.procs.get_mut(&name).expect("member");
                let k = self.rng.random_range(0..p.timers.len());
                let id = p.timers.swap_remove(k);
                self.stats.alignment_timeouts += 1;
                self.feed(&name, Event::AlignmentTimedOut { id })?;
            }
            Action::Transmit(i) => {
                let channel = self.channels[i].clone();
                let link = self.links.get_mut(&channel).expect("channel");
                let frame = link.outbox.pop_front().expect("enabled");
                link.next_seq += 1;
                link.unacked.push_back((link.next_seq, frame.clone()));
                link.in_transit.push_back((link.next_seq, frame.clone()));
                let from = channel.from.clone();
                match frame {
                    Frame::Data(_) => {
                        self.feed(&from, Event::DataTransmitted { channel, count: 1 })?;
                    }
                    Frame::Marker(plan) => {
                        let id = plan.id;
                        self.feed(&from, Event::MarkerTransmitted { channel, id })?;
                    }
                }
            }
            Action::Deliver(i) => {
                let channel = self.channels[i].clone();
                let link = self.links.get_mut(&channel).expect("channel");
                let (seq, frame) = link.in_transit.pop_front().expect("enabled");
                if seq <= link.received_seq {
                    return Ok(()); // a duplicate after a reconnect: dropped
                }
                assert_eq!(seq, link.received_seq + 1, "links are FIFO");
                link.received_seq = seq;
                // The receiver acknowledges cumulatively; the sender forgets what is acked.
                while link.unacked.front().is_some_and(|(s, _)| *s <= seq) {
                    link.unacked.pop_front();
                }
                let to = channel.to.clone();
                match frame {
                    Frame::Data(msg) => {
                        let p = self.procs.get_mut(&to).expect("member");
                        p.inbox.push_back(InboxItem::Deliver {
                            channel: channel.clone(),
                            msg,
                        });
                        self.feed(&to, Event::DataReceived { channel, count: 1 })?;
                    }
                    Frame::Marker(plan) => {
                        self.feed(&to, Event::MarkerReceived { channel, plan })?
                    }
                }
            }
            Action::Initiate => self.initiate()?,
            Action::TransportReset(i) => {
                // The connection broke: what was on the wire is lost; the sender resends
                // everything unacknowledged and the receiver drops what it already has.
                let link = self.links.get_mut(&self.channels[i]).expect("channel");
                link.in_transit = link.unacked.clone();
                self.stats.transport_resets += 1;
            }
            Action::ChannelReset(i) => {
                let channel = self.channels[i].clone();
                *self.links.get_mut(&channel).expect("channel") = Link::default();
                self.stats.channel_resets += 1;
                for end in [channel.from.clone(), channel.to.clone()] {
                    self.feed(
                        &end,
                        Event::ChannelReset {
                            channel: channel.clone(),
                        },
                    )?;
                }
            }
        }
        Ok(())
    }

    fn initiate(&mut self) -> Result<(), SimFailure> {
        self.initiations_left -= 1;
        let mode = *self.config.modes.choose(&mut self.rng).expect("some mode");
        let initiators: BTreeSet<NodeId> = if self.rng.random_bool(0.5) {
            BTreeSet::new()
        } else {
            let k = self.rng.random_range(1..=2.min(self.names.len()));
            self.names
                .choose_multiple(&mut self.rng, k)
                .cloned()
                .collect()
        };
        let alignment_timeout = self
            .rng
            .random_bool(0.3)
            .then(|| Duration::from_millis(100));
        let id = SnapshotId(self.next_id);
        let request = StartRequest {
            mode,
            initiators,
            alignment_timeout,
        };
        match self.tracker.start(id, request, &self.topology) {
            Ok(plan) => {
                if self.tracker.in_flight().count() > 1 {
                    self.stats.overlapping += 1;
                }
                self.next_id += 1;
                self.modes.insert(id, plan.mode);
                for node in &plan.initiators {
                    let p = self.procs.get_mut(node).expect("member");
                    p.control.push_back(Control::Initiate(plan.clone()));
                }
                Ok(())
            }
            Err(
                StartError::Unreachable { .. }
                | StartError::AlignedInFlight(_)
                | StartError::TooManyInFlight { .. },
            ) => {
                self.stats.refused += 1;
                Ok(())
            }
            Err(other) => Err(SimFailure {
                oracle: Some(format!("tracker refused snapshot {id}: {other}")),
                ..self.fail(Some(id))
            }),
        }
    }

    /// Feeds one event to a process's engine and executes the commands it produces.
    fn feed(&mut self, node: &NodeId, event: Event) -> Result<(), SimFailure> {
        let p = self.procs.get_mut(node).expect("member");
        p.engine.handle(event);
        let commands = p.engine.drain();
        for command in commands {
            self.execute(node, command)?;
        }
        Ok(())
    }

    fn execute(&mut self, node: &NodeId, command: Command) -> Result<(), SimFailure> {
        match command {
            Command::EnqueueRecordState { id, front } => {
                let p = self.procs.get_mut(node).expect("member");
                if front {
                    p.inbox.push_front(InboxItem::Record(id));
                    // Its early copy, on the flow-control stream.
                    p.early.push_back(id);
                } else {
                    p.inbox.push_back(InboxItem::Record(id));
                }
            }
            Command::SendMarker {
                channel,
                plan,
                front,
            } => {
                let link = self.links.get_mut(&channel).expect("channel");
                if front {
                    link.outbox.push_front(Frame::Marker(plan));
                } else {
                    link.outbox.push_back(Frame::Marker(plan));
                }
                self.stats.markers += 1;
            }
            Command::RecordChannelMessages {
                id,
                channel,
                indices,
            } => {
                let history = &self.links[&channel].history;
                let Some(messages) = history.get(indices.start as usize..indices.end as usize)
                else {
                    return Err(SimFailure {
                        oracle: Some(format!(
                            "{node} recorded messages {indices:?} of {channel}, which has only {}",
                            history.len()
                        )),
                        ..self.fail(Some(id))
                    });
                };
                let recorded = self
                    .evidence
                    .entry(id)
                    .or_default()
                    .recorded
                    .entry((node.clone(), channel))
                    .or_default();
                let messages = indices.zip(messages.iter().copied());
                // As the daemon does: messages handed over and not consumed at an early cut
                // precede everything recorded on the channel so far.
                match (recorded.first(), messages.clone().last()) {
                    (Some((first, _)), Some((last, _))) if last < *first => {
                        recorded.splice(0..0, messages);
                    }
                    _ => recorded.extend(messages),
                }
            }
            Command::BlockChannel { channel } => {
                self.links.get_mut(&channel).expect("channel").blocked = true;
            }
            Command::UnblockChannel { channel } => {
                self.links.get_mut(&channel).expect("channel").blocked = false;
            }
            Command::OvertakeMarker { id, channel } => {
                let link = self.links.get_mut(&channel).expect("channel");
                let at = link
                    .outbox
                    .iter()
                    .position(|f| matches!(f, Frame::Marker(p) if p.id == id));
                if let Some(Frame::Marker(mut plan)) = at.and_then(|at| link.outbox.remove(at)) {
                    plan.timed_out = true;
                    link.outbox.push_front(Frame::Marker(plan));
                }
            }
            Command::ScheduleAlignmentTimeout { id, .. } => {
                self.procs.get_mut(node).expect("member").timers.push(id);
            }
            Command::ReportLocalDone { report } => {
                let id = report.id;
                let evidence = self.evidence.entry(id).or_default();
                let recorded = evidence
                    .recorded
                    .iter()
                    .filter(|((n, _), _)| n == node)
                    .map(|((_, c), msgs)| (c.clone(), msgs.iter().map(|(i, _)| *i).collect()))
                    .collect();
                evidence.reports.insert(node.clone(), report.clone());
                let update = self.tracker.part_reported(NodePart { report, recorded });
                if let tracker::Update::Finished(outcome, _) = update {
                    self.finished(id, outcome)?;
                }
            }
            Command::Abort { id, reason } => {
                if let tracker::Update::Finished(outcome, _) = self.tracker.fail(id, reason) {
                    self.finished(id, outcome)?;
                }
            }
        }
        Ok(())
    }

    fn finished(&mut self, id: SnapshotId, outcome: tracker::Outcome) -> Result<(), SimFailure> {
        match outcome {
            tracker::Outcome::Completed(consistent) => {
                let evidence = self.evidence.remove(&id).unwrap_or_default();
                if let Err(what) = oracle::check(self, id, &evidence) {
                    return Err(SimFailure {
                        oracle: Some(what),
                        ..self.fail(Some(id))
                    });
                }
                let mode = self.modes[&id];
                *self.stats.completed.entry(mode).or_default() += 1;
                self.stats.recorded_messages += consistent.recorded_messages;
            }
            tracker::Outcome::Failed(FailureReason::Inconsistent(violation)) => {
                let evidence = self.evidence.remove(&id).unwrap_or_default();
                return Err(SimFailure {
                    verifier: Some(violation.to_string()),
                    oracle: oracle::check(self, id, &evidence).err(),
                    ..self.fail(Some(id))
                });
            }
            tracker::Outcome::Failed(reason) => {
                if !self.config.channel_resets {
                    return Err(SimFailure {
                        stuck: Some(format!(
                            "snapshot {id} failed with no fault injected: {reason}"
                        )),
                        ..self.fail(Some(id))
                    });
                }
                self.evidence.remove(&id);
                self.stats.failed += 1;
                for p in self.procs.values_mut() {
                    p.control.push_back(Control::Abort(id, reason.clone()));
                }
            }
        }
        Ok(())
    }
}
