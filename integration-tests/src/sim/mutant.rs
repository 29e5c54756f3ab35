//! Deliberately broken engines: wrappers that corrupt the real engine's commands in one
//! specific way. The simulation must catch each of them; if it did not, its oracles
//! would be worth nothing.

use std::collections::{BTreeMap, BTreeSet};

use cairn_core::{ChannelId, Command, Event, SnapshotEngine, SnapshotId, SnapshotMode, Topology};

/// An engine under test: the real one, or a broken one.
pub trait Engine {
    /// Feeds one event.
    fn handle(&mut self, event: Event);
    /// Takes the commands produced so far.
    fn drain(&mut self) -> Vec<Command>;
}

impl Engine for SnapshotEngine {
    fn handle(&mut self, event: Event) {
        SnapshotEngine::handle(self, event);
    }

    fn drain(&mut self) -> Vec<Command> {
        self.drain_commands().collect()
    }
}

/// Which bug to plant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mutant {
    /// The real engine.
    #[default]
    None,
    /// Records, as channel state, a message that arrived before the local state was
    /// recorded (so it is in the state and in the channel).
    RecordsMessageBeforeState,
    /// Never sends the marker on the process's first outgoing channel.
    ForgetsMarkerOnOneChannel,
    /// Unaligned mode: drops the messages a marker overtook in the outgoing queue.
    DropsOvertakenMessages,
    /// Aligned mode: never blocks a channel, so messages behind a marker are delivered
    /// before the local state is recorded.
    IgnoresAlignment,
}

/// The real engine with `mutant` planted in it.
pub struct MutantEngine {
    inner: SnapshotEngine,
    mutant: Mutant,
    received: BTreeMap<ChannelId, u64>,
    unaligned: BTreeSet<SnapshotId>,
    first_outgoing: Option<ChannelId>,
}

impl MutantEngine {
    /// Wraps `inner`.
    pub fn new(inner: SnapshotEngine, mutant: Mutant, topology: &Topology) -> Self {
        let first_outgoing = topology.outgoing(inner.node()).next();
        Self {
            inner,
            mutant,
            received: BTreeMap::new(),
            unaligned: BTreeSet::new(),
            first_outgoing,
        }
    }

    fn corrupt(&mut self, command: Command, out: &mut Vec<Command>) {
        match (self.mutant, &command) {
            (
                Mutant::RecordsMessageBeforeState,
                Command::EnqueueRecordState { id, front: false },
            ) => {
                let id = *id;
                out.push(command);
                if let Some((channel, &n)) = self.received.iter().find(|(_, n)| **n > 0) {
                    out.push(Command::RecordChannelMessages {
                        id,
                        channel: channel.clone(),
                        indices: n - 1..n,
                    });
                }
            }
            (Mutant::ForgetsMarkerOnOneChannel, Command::SendMarker { channel, .. }) => {
                if self.first_outgoing.as_ref() != Some(channel) {
                    out.push(command);
                }
            }
            (
                Mutant::DropsOvertakenMessages,
                Command::RecordChannelMessages { id, channel, .. },
            ) if channel.from == *self.inner.node() && self.unaligned.contains(id) => {}
            (
                Mutant::IgnoresAlignment,
                Command::BlockChannel { .. } | Command::UnblockChannel { .. },
            ) => {}
            _ => out.push(command),
        }
    }
}

impl Engine for MutantEngine {
    fn handle(&mut self, event: Event) {
        match &event {
            Event::DataReceived { channel, count } => {
                *self.received.entry(channel.clone()).or_default() += count;
            }
            Event::ChannelReset { channel } => {
                self.received.remove(channel);
            }
            Event::SnapshotInitiated { plan } | Event::MarkerReceived { plan, .. }
                if plan.mode == SnapshotMode::Unaligned =>
            {
                self.unaligned.insert(plan.id);
            }
            _ => {}
        }
        self.inner.handle(event);
    }

    fn drain(&mut self) -> Vec<Command> {
        let commands: Vec<Command> = self.inner.drain_commands().collect();
        let mut out = Vec::with_capacity(commands.len());
        for command in commands {
            self.corrupt(command, &mut out);
        }
        out
    }
}
