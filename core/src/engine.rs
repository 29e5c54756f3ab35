//! The per-process snapshot engine: Chandy–Lamport's rules, and Flink's aligned and
//! unaligned variants, as a state machine with no I/O.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::event::{Command, Event, Ignored, Outcome};
use crate::failure::FailureReason;
use crate::report::{IncomingCut, LocalReport, OutgoingCut};
use crate::topology::Topology;
use crate::types::{ChannelId, NodeId, Plan, SnapshotId, SnapshotMode};

/// How many finished snapshot ids a process remembers, so that a late marker of a
/// finished snapshot is ignored rather than starting it again.
const FINISHED_MEMORY: usize = 4096;

#[derive(Debug, Default, Clone, Copy)]
struct Inbound {
    /// Data messages appended to the inbox.
    received: u64,
    /// Data messages handed to the application.
    delivered: u64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Outbound {
    /// Data messages the application sent.
    queued: u64,
    /// Data messages that left the outgoing queue.
    transmitted: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not recording yet (aligned mode: waiting for markers).
    Aligning,
    /// The record request is in the inbox; waiting for the application's state.
    AwaitingState,
    /// The application's state is recorded; waiting for markers.
    StateRecorded,
}

#[derive(Debug, Default, Clone, Copy)]
struct InCut {
    delivered: Option<u64>,
    marker_at: Option<u64>,
}

#[derive(Debug, Default, Clone, Copy)]
struct OutCut {
    marker_at: Option<u64>,
    sent: Option<u64>,
    /// The marker left the queue for the wire.
    transmitted: bool,
}

#[derive(Debug)]
struct LocalSnapshot {
    plan: Plan,
    phase: Phase,
    /// Record and send markers by overtaking (unaligned mode, or aligned after timeout).
    overtake: bool,
    /// Aligned with a timeout that passed after the state was recorded: markers not yet
    /// on the wire overtake their queues (Flink's timeout at the senders' output buffers,
    /// FLINK-27251).
    timed_out: bool,
    /// Incoming channels this process does not wait on (aligned mode).
    feedback: BTreeSet<ChannelId>,
    incoming: BTreeMap<ChannelId, InCut>,
    outgoing: BTreeMap<ChannelId, OutCut>,
}

/// One process's snapshot engine: [`Event`]s in, [`Command`]s out, no I/O, no clock.
///
/// Several snapshots may be in flight at once, told apart by id. Every snapshot spans the
/// whole topology.
#[derive(Debug)]
pub struct SnapshotEngine {
    node: NodeId,
    topology: Topology,
    incoming: BTreeMap<ChannelId, Inbound>,
    outgoing: BTreeMap<ChannelId, Outbound>,
    snapshots: BTreeMap<SnapshotId, LocalSnapshot>,
    /// Which snapshots block each incoming channel.
    blocked: BTreeMap<ChannelId, BTreeSet<SnapshotId>>,
    finished: BTreeSet<SnapshotId>,
    /// Unknown ids below this are taken as finished and forgotten.
    forgotten_below: SnapshotId,
    commands: VecDeque<Command>,
}

impl SnapshotEngine {
    /// The engine of process `node` in `topology`.
    pub fn new(node: NodeId, topology: Topology) -> Self {
        let incoming = topology
            .incoming(&node)
            .map(|c| (c, Inbound::default()))
            .collect();
        let outgoing = topology
            .outgoing(&node)
            .map(|c| (c, Outbound::default()))
            .collect();
        Self {
            node,
            topology,
            incoming,
            outgoing,
            snapshots: BTreeMap::new(),
            blocked: BTreeMap::new(),
            finished: BTreeSet::new(),
            forgotten_below: SnapshotId(0),
            commands: VecDeque::new(),
        }
    }

    /// This process's id.
    pub fn node(&self) -> &NodeId {
        &self.node
    }

    /// The snapshots in flight at this process.
    pub fn in_flight(&self) -> impl Iterator<Item = SnapshotId> + '_ {
        self.snapshots.keys().copied()
    }

    /// Whether the channel is blocked by an aligned snapshot.
    pub fn is_blocked(&self, channel: &ChannelId) -> bool {
        self.blocked.contains_key(channel)
    }

    /// Feeds one event. Its commands wait in [`Self::drain_commands`].
    pub fn handle(&mut self, event: Event) -> Outcome {
        match event {
            Event::SnapshotInitiated { plan } => self.on_snapshot_initiated(plan),
            Event::MarkerReceived { channel, plan } => self.on_marker_received(channel, plan),
            Event::DataReceived { channel, count } => self.on_data_received(&channel, count),
            Event::DataDelivered { channel, count } => match self.incoming.get_mut(&channel) {
                Some(inbound) => {
                    inbound.delivered += count;
                    debug_assert!(inbound.delivered <= inbound.received);
                    Outcome::Applied
                }
                None => Outcome::Ignored(Ignored::UnknownChannel),
            },
            Event::DataQueued { channel, count } => self.on_data_queued(&channel, count),
            Event::DataTransmitted { channel, count } => match self.outgoing.get_mut(&channel) {
                Some(outbound) => {
                    outbound.transmitted += count;
                    debug_assert!(outbound.transmitted <= outbound.queued);
                    Outcome::Applied
                }
                None => Outcome::Ignored(Ignored::UnknownChannel),
            },
            Event::StateRecorded { id, unconsumed } => self.on_state_recorded(id, &unconsumed),
            Event::AlignmentTimedOut { id } => self.on_alignment_timed_out(id),
            Event::MarkerTransmitted { channel, id } => self.on_marker_transmitted(&channel, id),
            Event::ChannelReset { channel } => self.on_channel_reset(channel),
            Event::SnapshotAborted { id, reason } => self.on_snapshot_aborted(id, reason),
            Event::TopologyChanged { topology, what } => self.on_topology_changed(topology, what),
        }
    }

    /// The commands produced so far, in the order the runtime must execute them.
    pub fn drain_commands(&mut self) -> impl Iterator<Item = Command> + '_ {
        self.commands.drain(..)
    }

    fn is_finished(&self, id: SnapshotId) -> bool {
        id < self.forgotten_below || self.finished.contains(&id)
    }

    /// Creates this process's part of a snapshot it has not seen yet.
    fn begin(&mut self, plan: Plan) -> SnapshotId {
        let id = plan.id;
        let feedback = match plan.mode {
            SnapshotMode::Aligned => self
                .topology
                .feedback_channels(&plan.initiators)
                .into_iter()
                .filter(|c| c.to == self.node)
                .collect(),
            _ => BTreeSet::new(),
        };
        // An aligned snapshot's timeout runs from the snapshot's start (the plan's
        // `started_at_ms`, at most `after` from when this process joins it): it acts at the
        // alignment (markers still missing) and at the senders' queues (markers still
        // waiting there).
        if let (SnapshotMode::Aligned, Some(after)) = (plan.mode, plan.alignment_timeout) {
            self.commands.push_back(Command::ScheduleAlignmentTimeout {
                id,
                after,
                since_ms: plan.started_at_ms,
            });
        }
        let snapshot = LocalSnapshot {
            overtake: plan.mode == SnapshotMode::Unaligned,
            timed_out: false,
            plan,
            phase: Phase::Aligning,
            feedback,
            incoming: self
                .incoming
                .keys()
                .map(|c| (c.clone(), InCut::default()))
                .collect(),
            outgoing: self
                .outgoing
                .keys()
                .map(|c| (c.clone(), OutCut::default()))
                .collect(),
        };
        self.snapshots.insert(id, snapshot);
        id
    }

    /// The initiator records its state at once (Chandy–Lamport's initiation).
    fn on_snapshot_initiated(&mut self, plan: Plan) -> Outcome {
        let id = plan.id;
        if self.is_finished(id) {
            return Outcome::Ignored(Ignored::FinishedSnapshot);
        }
        if self.snapshots.contains_key(&id) {
            return Outcome::Ignored(Ignored::AlreadyInFlight);
        }
        self.begin(plan);
        self.record_local_state(id);
        self.check_done(id);
        Outcome::Applied
    }

    /// Marker-Receiving Rule: on the first marker, record the local state (after
    /// alignment in aligned mode); the channel's state is what arrived between the
    /// recording and this marker.
    fn on_marker_received(&mut self, channel: ChannelId, plan: Plan) -> Outcome {
        let id = plan.id;
        let Some(inbound) = self.incoming.get(&channel).copied() else {
            return Outcome::Ignored(Ignored::UnknownChannel);
        };
        if self.is_finished(id) {
            return Outcome::Ignored(Ignored::FinishedSnapshot);
        }
        // Carried by a marker that overtook because the timeout passed at its sender.
        let timed_out = plan.timed_out && plan.mode == SnapshotMode::Aligned;
        if !self.snapshots.contains_key(&id) {
            self.begin(Plan {
                timed_out: false,
                ..plan
            });
        }
        let snapshot = self.snapshots.get_mut(&id).expect("begun above");
        let cut = snapshot
            .incoming
            .get_mut(&channel)
            .expect("every incoming channel");
        if cut.marker_at.is_some() {
            return Outcome::Ignored(Ignored::DuplicateMarker);
        }
        cut.marker_at = Some(inbound.received);
        if timed_out && snapshot.phase == Phase::Aligning {
            // The timeout passed upstream: record by overtaking now, as if it had here.
            snapshot.overtake = true;
        }
        if snapshot.phase == Phase::Aligning {
            let waits = snapshot.plan.mode == SnapshotMode::Aligned && !snapshot.overtake;
            if !waits || Self::aligned(snapshot) {
                self.record_local_state(id);
            } else {
                // Messages behind the marker belong after the cut: hold them until this
                // process records (feedback channels too, though it never waits on them).
                self.block(channel, id);
            }
        }
        if timed_out {
            // Past the alignment already: markers still queued here overtake too.
            let _ = self.on_alignment_timed_out(id);
        }
        self.check_done(id);
        Outcome::Applied
    }

    /// Whether the markers of every non-feedback incoming channel arrived.
    fn aligned(snapshot: &LocalSnapshot) -> bool {
        snapshot
            .incoming
            .iter()
            .all(|(c, cut)| cut.marker_at.is_some() || snapshot.feedback.contains(c))
    }

    /// Aligned mode with a timeout: stop waiting and record by overtaking; or, with the
    /// state recorded, let the markers still waiting in outgoing queues overtake them.
    fn on_alignment_timed_out(&mut self, id: SnapshotId) -> Outcome {
        let Some(snapshot) = self.snapshots.get_mut(&id) else {
            return Outcome::Ignored(Ignored::UnknownSnapshot);
        };
        if snapshot.overtake || snapshot.timed_out {
            return Outcome::Ignored(Ignored::NotAligning);
        }
        match snapshot.phase {
            Phase::Aligning => {
                snapshot.overtake = true;
                self.record_local_state(id);
            }
            // The markers go when the state is recorded: at the front (`send_markers`).
            Phase::AwaitingState => snapshot.timed_out = true,
            Phase::StateRecorded => {
                snapshot.timed_out = true;
                for (channel, cut) in &mut snapshot.outgoing {
                    let (Some(marker_at), false) = (cut.marker_at, cut.transmitted) else {
                        continue;
                    };
                    let transmitted = self.outgoing[channel].transmitted;
                    if transmitted < marker_at {
                        // Overtaken by the marker, yet sent before the application's state
                        // (copied first, while they are certainly in the queue).
                        self.commands.push_back(Command::RecordChannelMessages {
                            id,
                            channel: channel.clone(),
                            indices: transmitted..marker_at,
                        });
                    }
                    self.commands.push_back(Command::OvertakeMarker {
                        id,
                        channel: channel.clone(),
                    });
                    cut.marker_at = Some(transmitted);
                }
            }
        }
        self.check_done(id);
        Outcome::Applied
    }

    fn on_marker_transmitted(&mut self, channel: &ChannelId, id: SnapshotId) -> Outcome {
        let Some(cut) = self
            .snapshots
            .get_mut(&id)
            .and_then(|s| s.outgoing.get_mut(channel))
        else {
            return Outcome::Ignored(Ignored::UnknownSnapshot);
        };
        cut.transmitted = true;
        self.check_done(id);
        Outcome::Applied
    }

    /// Asks the application for its state and fixes each incoming channel's recording
    /// point; when overtaking, also sends the markers at once (Marker-Sending Rule).
    fn record_local_state(&mut self, id: SnapshotId) {
        let snapshot = self.snapshots.get_mut(&id).expect("in flight");
        let front = snapshot.overtake;
        self.commands
            .push_back(Command::EnqueueRecordState { id, front });
        for (channel, cut) in &mut snapshot.incoming {
            let inbound = self.incoming[channel];
            let delivered = if front {
                // What waits in the inbox is overtaken by the record request: it is
                // channel state, up to the marker if that already arrived.
                let end = cut.marker_at.unwrap_or(inbound.received);
                if inbound.delivered < end {
                    self.commands.push_back(Command::RecordChannelMessages {
                        id,
                        channel: channel.clone(),
                        indices: inbound.delivered..end,
                    });
                }
                inbound.delivered
            } else {
                inbound.received
            };
            cut.delivered = Some(delivered);
        }
        snapshot.phase = Phase::AwaitingState;
        // Everything held behind a marker now goes into the inbox after the record request.
        let held: Vec<ChannelId> = self
            .blocked
            .iter()
            .filter(|(_, ids)| ids.contains(&id))
            .map(|(c, _)| c.clone())
            .collect();
        for channel in held {
            self.unblock(&channel, id);
        }
        if front {
            self.send_markers(id);
        }
    }

    /// Marker-Sending Rule: one marker on every outgoing channel.
    fn send_markers(&mut self, id: SnapshotId) {
        let snapshot = self.snapshots.get_mut(&id).expect("in flight");
        let front = snapshot.overtake || snapshot.timed_out;
        // An aligned snapshot's markers that overtake say why: its timeout passed.
        let mut plan = snapshot.plan.clone();
        plan.timed_out = front && plan.mode == SnapshotMode::Aligned;
        for (channel, cut) in &mut snapshot.outgoing {
            let outbound = self.outgoing[channel];
            let marker_at = if front {
                outbound.transmitted
            } else {
                outbound.queued
            };
            self.commands.push_back(Command::SendMarker {
                channel: channel.clone(),
                plan: plan.clone(),
                front,
            });
            if marker_at < outbound.queued {
                // Overtaken by the marker, yet sent before the application's state.
                self.commands.push_back(Command::RecordChannelMessages {
                    id,
                    channel: channel.clone(),
                    indices: marker_at..outbound.queued,
                });
            }
            cut.marker_at = Some(marker_at);
        }
    }

    fn on_state_recorded(&mut self, id: SnapshotId, unconsumed: &[(ChannelId, u64)]) -> Outcome {
        let Some(snapshot) = self.snapshots.get_mut(&id) else {
            return Outcome::Ignored(if self.is_finished(id) {
                Ignored::FinishedSnapshot
            } else {
                Ignored::UnknownSnapshot
            });
        };
        if snapshot.phase != Phase::AwaitingState {
            return Outcome::Ignored(Ignored::StateNotAwaited);
        }
        if let Err(why) = Self::cut_earlier(snapshot, unconsumed) {
            let reason = FailureReason::BadCut {
                node: self.node.clone(),
                why,
            };
            self.abort(id, reason);
            return Outcome::Applied;
        }
        let snapshot = self.snapshots.get_mut(&id).expect("in flight");
        for &(ref channel, count) in unconsumed.iter().filter(|(_, n)| *n > 0) {
            let cut = snapshot.incoming.get_mut(channel).expect("checked");
            let delivered = cut.delivered.expect("recorded");
            // Handed over before the request, consumed after the cut: in flight at the
            // cut, and before every message recorded on the channel so far.
            self.commands.push_back(Command::RecordChannelMessages {
                id,
                channel: channel.clone(),
                indices: delivered - count..delivered,
            });
            cut.delivered = Some(delivered - count);
        }
        snapshot.phase = Phase::StateRecorded;
        for (channel, cut) in &mut snapshot.outgoing {
            cut.sent = Some(self.outgoing[channel].queued);
        }
        if !snapshot.overtake {
            self.send_markers(id);
        }
        self.check_done(id);
        Outcome::Applied
    }

    /// Whether the application may have cut before messages it was handed: only when the
    /// request overtook the inbox (an aligned snapshot's cut has no channel state), only
    /// on its incoming channels, each named once, and never before what the cut counted
    /// as delivered on the channel.
    fn cut_earlier(
        snapshot: &LocalSnapshot,
        unconsumed: &[(ChannelId, u64)],
    ) -> Result<(), String> {
        if unconsumed.iter().all(|(_, n)| *n == 0) {
            return Ok(());
        }
        if !snapshot.overtake {
            return Err(
                "the application cut its state before messages it had been handed, \
                 for a record request that did not overtake them"
                    .into(),
            );
        }
        let mut named = BTreeSet::new();
        for (channel, count) in unconsumed {
            let Some(cut) = snapshot.incoming.get(channel) else {
                return Err(format!(
                    "the application's cut names {channel}, not an incoming channel"
                ));
            };
            if !named.insert(channel) {
                return Err(format!("the application's cut names {channel} twice"));
            }
            let delivered = cut.delivered.unwrap_or(0);
            if *count > delivered {
                return Err(format!(
                    "the application's cut leaves {count} messages of {channel} unconsumed, \
                     but only {delivered} were handed over"
                ));
            }
        }
        Ok(())
    }

    fn on_data_received(&mut self, channel: &ChannelId, count: u64) -> Outcome {
        let Some(inbound) = self.incoming.get_mut(channel) else {
            return Outcome::Ignored(Ignored::UnknownChannel);
        };
        let start = inbound.received;
        inbound.received += count;
        // Open from the recording point until the marker.
        self.record_where_open(channel, start..start + count, |s| {
            let cut = &s.incoming[channel];
            cut.delivered.is_some() && cut.marker_at.is_none()
        });
        Outcome::Applied
    }

    fn on_data_queued(&mut self, channel: &ChannelId, count: u64) -> Outcome {
        let Some(outbound) = self.outgoing.get_mut(channel) else {
            return Outcome::Ignored(Ignored::UnknownChannel);
        };
        let start = outbound.queued;
        outbound.queued += count;
        // Open from the marker until the application's state.
        self.record_where_open(channel, start..start + count, |s| {
            let cut = &s.outgoing[channel];
            cut.marker_at.is_some() && cut.sent.is_none()
        });
        Outcome::Applied
    }

    /// Records `indices` of `channel` for every snapshot whose recording window on that
    /// channel is `open`.
    fn record_where_open(
        &mut self,
        channel: &ChannelId,
        indices: std::ops::Range<u64>,
        open: impl Fn(&LocalSnapshot) -> bool,
    ) {
        for (id, snapshot) in &self.snapshots {
            if open(snapshot) {
                self.commands.push_back(Command::RecordChannelMessages {
                    id: *id,
                    channel: channel.clone(),
                    indices: indices.clone(),
                });
            }
        }
    }

    /// A reset channel starts counting again, and every snapshot in flight here fails:
    /// its cut on that channel is lost.
    fn on_channel_reset(&mut self, channel: ChannelId) -> Outcome {
        if let Some(inbound) = self.incoming.get_mut(&channel) {
            *inbound = Inbound::default();
        } else if let Some(outbound) = self.outgoing.get_mut(&channel) {
            *outbound = Outbound::default();
        } else {
            return Outcome::Ignored(Ignored::UnknownChannel);
        }
        let ids: Vec<SnapshotId> = self.snapshots.keys().copied().collect();
        for id in ids {
            self.abort(id, FailureReason::ChannelReset(channel.clone()));
        }
        Outcome::Applied
    }

    fn on_topology_changed(&mut self, topology: Topology, what: String) -> Outcome {
        if !topology.contains(&self.node) {
            return Outcome::Ignored(Ignored::NotAMember);
        }
        let ids: Vec<SnapshotId> = self.snapshots.keys().copied().collect();
        for id in ids {
            self.abort(id, FailureReason::MembershipChanged(what.clone()));
        }
        let mut incoming = BTreeMap::new();
        for channel in topology.incoming(&self.node) {
            let old = self.incoming.remove(&channel).unwrap_or_default();
            incoming.insert(channel, old);
        }
        let mut outgoing = BTreeMap::new();
        for channel in topology.outgoing(&self.node) {
            let old = self.outgoing.remove(&channel).unwrap_or_default();
            outgoing.insert(channel, old);
        }
        self.incoming = incoming;
        self.outgoing = outgoing;
        self.topology = topology;
        Outcome::Applied
    }

    fn on_snapshot_aborted(&mut self, id: SnapshotId, reason: FailureReason) -> Outcome {
        if self.snapshots.contains_key(&id) {
            self.abort(id, reason);
            Outcome::Applied
        } else if self.is_finished(id) {
            Outcome::Ignored(Ignored::FinishedSnapshot)
        } else {
            // Remember it, so that a marker still on its way does not start it here.
            self.finish(id);
            Outcome::Applied
        }
    }

    fn abort(&mut self, id: SnapshotId, reason: FailureReason) {
        let held: Vec<ChannelId> = self
            .blocked
            .iter()
            .filter(|(_, ids)| ids.contains(&id))
            .map(|(c, _)| c.clone())
            .collect();
        for channel in held {
            self.unblock(&channel, id);
        }
        self.commands.push_back(Command::Abort { id, reason });
        self.finish(id);
    }

    /// The part is done when the state is recorded and every incoming marker arrived —
    /// and, for an aligned snapshot with a timeout, every outgoing marker is on the wire
    /// (until then its timeout may still move one, and the channel state with it).
    fn check_done(&mut self, id: SnapshotId) {
        let Some(snapshot) = self.snapshots.get(&id) else {
            return;
        };
        let may_overtake = snapshot.plan.mode == SnapshotMode::Aligned
            && snapshot.plan.alignment_timeout.is_some();
        if snapshot.phase != Phase::StateRecorded
            || snapshot.incoming.values().any(|c| c.marker_at.is_none())
            || (may_overtake && snapshot.outgoing.values().any(|c| !c.transmitted))
        {
            return;
        }
        let report = LocalReport {
            id,
            node: self.node.clone(),
            incoming: snapshot
                .incoming
                .iter()
                .map(|(c, cut)| {
                    let cut = IncomingCut {
                        delivered: cut.delivered.expect("recorded"),
                        marker_at: cut.marker_at.expect("arrived"),
                    };
                    (c.clone(), cut)
                })
                .collect(),
            outgoing: snapshot
                .outgoing
                .iter()
                .map(|(c, cut)| {
                    let cut = OutgoingCut {
                        sent: cut.sent.expect("recorded"),
                        marker_at: cut.marker_at.expect("sent"),
                    };
                    (c.clone(), cut)
                })
                .collect(),
        };
        self.commands.push_back(Command::ReportLocalDone { report });
        self.finish(id);
    }

    fn finish(&mut self, id: SnapshotId) {
        self.snapshots.remove(&id);
        self.finished.insert(id);
        while self.finished.len() > FINISHED_MEMORY {
            let oldest = self.finished.pop_first().expect("non-empty");
            self.forgotten_below = SnapshotId(oldest.0 + 1);
        }
    }

    fn block(&mut self, channel: ChannelId, id: SnapshotId) {
        let ids = self.blocked.entry(channel.clone()).or_default();
        if ids.is_empty() {
            self.commands.push_back(Command::BlockChannel { channel });
        }
        ids.insert(id);
    }

    fn unblock(&mut self, channel: &ChannelId, id: SnapshotId) {
        if let Some(ids) = self.blocked.get_mut(channel) {
            ids.remove(&id);
            if ids.is_empty() {
                self.blocked.remove(channel);
                self.commands.push_back(Command::UnblockChannel {
                    channel: channel.clone(),
                });
            }
        }
    }
}
