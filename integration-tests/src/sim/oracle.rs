//! The simulation's own judgement of a completed snapshot, from its ground-truth log of
//! every transfer, independent of the verifier: tokens are conserved, every recorded
//! message was in flight at the cut (sent before its sender recorded, not delivered
//! before its receiver recorded), none is counted twice, none is missing, and each
//! channel's messages are in the order they were sent.

use std::collections::{BTreeMap, BTreeSet};

use cairn_core::{ChannelId, SnapshotId};

use super::world::{Evidence, Msg, World};

/// Checks snapshot `id`; the error says what is wrong, naming the message and channel.
pub(crate) fn check(world: &World, id: SnapshotId, evidence: &Evidence) -> Result<(), String> {
    let mut sent_before: BTreeMap<u64, (ChannelId, Msg)> = BTreeMap::new();
    let mut delivered_before: BTreeSet<u64> = BTreeSet::new();
    for (name, p) in &world.procs {
        let &(sent, delivered) = p
            .cuts
            .get(&id)
            .ok_or_else(|| format!("the application at {name} never recorded its state"))?;
        for (c, m) in &p.sent_log[..sent] {
            sent_before.insert(m.uid, (c.clone(), *m));
        }
        delivered_before.extend(p.delivered_log[..delivered].iter().map(|(_, m)| m.uid));
    }
    if let Some(orphan) = delivered_before
        .iter()
        .find(|uid| !sent_before.contains_key(uid))
    {
        return Err(format!(
            "message {orphan} is in its receiver's recorded state but not sent in its sender's"
        ));
    }
    let in_flight: BTreeSet<u64> = sent_before
        .keys()
        .filter(|uid| !delivered_before.contains(uid))
        .copied()
        .collect();

    let mut recorded: BTreeSet<u64> = BTreeSet::new();
    let mut per_channel: BTreeMap<&ChannelId, Vec<(u64, Msg)>> = BTreeMap::new();
    for ((node, channel), messages) in &evidence.recorded {
        for (index, m) in messages {
            if !recorded.insert(m.uid) {
                return Err(format!(
                    "message {} on {channel} is recorded twice (again by {node})",
                    m.uid
                ));
            }
            per_channel.entry(channel).or_default().push((*index, *m));
        }
    }
    if let Some(extra) = recorded.difference(&in_flight).next() {
        return Err(format!(
            "message {extra} is recorded as channel state but was not in flight at the cut"
        ));
    }
    if let Some(missing) = in_flight.difference(&recorded).next() {
        let (c, _) = &sent_before[missing];
        return Err(format!(
            "message {missing} on {c} was in flight at the cut but not recorded"
        ));
    }
    for (channel, mut messages) in per_channel {
        messages.sort_by_key(|(index, _)| *index);
        if messages.windows(2).any(|w| w[0].1.uid >= w[1].1.uid) {
            return Err(format!(
                "channel {channel}'s recorded messages are out of send order"
            ));
        }
    }

    let states: u64 = world
        .topology
        .nodes()
        .iter()
        .map(|n| {
            evidence
                .states
                .get(n)
                .copied()
                .ok_or_else(|| format!("no local state of {n}"))
        })
        .sum::<Result<u64, String>>()?;
    let channels: u64 = evidence
        .recorded
        .values()
        .flatten()
        .map(|(_, m)| m.amount)
        .sum();
    if states + channels != world.total {
        return Err(format!(
            "tokens are not conserved: local states {states} + channel states {channels} != {}",
            world.total
        ));
    }
    Ok(())
}
