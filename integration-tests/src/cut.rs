//! Checking a snapshot taken by real daemons: the parts each node reported, turned back
//! into `cairn-core` values, judged by the verifier, and the bank's money counted.

use std::collections::BTreeMap;

use cairn_cli::bank::{BankState, TransferPayload};
use cairn_core::{
    ChannelId, Consistent, IncomingCut, LocalReport, NodeId, NodePart, OutgoingCut, SnapshotId,
    Topology, verify,
};
use cairn_proto::convert::channel_from_pb;
use cairn_proto::v1 as pb;

/// What a snapshot of bank applications shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BankCut {
    /// The verifier's verdict.
    pub consistent: Consistent,
    /// Sum of the recorded balances.
    pub balances: u64,
    /// Sum of the recorded money in flight.
    pub in_flight: u64,
    /// Messages recorded as channel state.
    pub messages: u64,
}

impl BankCut {
    /// All the money the snapshot saw.
    pub fn total(&self) -> u64 {
        self.balances + self.in_flight
    }
}

/// Verifies the parts of one snapshot against `topology` and counts the bank's money.
pub fn check_bank_cut(
    topology: &Topology,
    parts: &BTreeMap<NodeId, pb::LocalSnapshot>,
) -> anyhow::Result<BankCut> {
    let mut core_parts = BTreeMap::new();
    let mut balances = 0;
    let mut in_flight = 0;
    let mut messages = 0;
    for (node, part) in parts {
        let report = LocalReport {
            id: SnapshotId(part.snapshot_id),
            node: NodeId::new(part.node_id.clone()),
            incoming: part
                .incoming
                .iter()
                .map(<(ChannelId, IncomingCut)>::try_from)
                .collect::<Result<_, _>>()?,
            outgoing: part
                .outgoing
                .iter()
                .map(<(ChannelId, OutgoingCut)>::try_from)
                .collect::<Result<_, _>>()?,
        };
        let mut recorded: BTreeMap<ChannelId, Vec<u64>> = BTreeMap::new();
        for state in &part.channel_states {
            let channel = channel_from_pb(state.channel.as_ref())?;
            for message in &state.messages {
                recorded
                    .entry(channel.clone())
                    .or_default()
                    .push(message.index);
                in_flight += TransferPayload::decode(&message.payload)?.amount;
                messages += 1;
            }
        }
        let state: BankState = serde_json::from_slice(&part.local_state)
            .map_err(|e| anyhow::anyhow!("node {node}: local state is not a bank state: {e}"))?;
        balances += state.balance;
        core_parts.insert(node.clone(), NodePart { report, recorded });
    }
    let consistent = verify(topology, &core_parts).map_err(|v| anyhow::anyhow!("verifier: {v}"))?;
    Ok(BankCut {
        consistent,
        balances,
        in_flight,
        messages,
    })
}
