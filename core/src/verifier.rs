//! The consistent-cut verifier: from every process's report, decide whether a snapshot is
//! complete and consistent (docs/architecture.md §4).
//!
//! For every channel `i → j` a consistent cut has `recorded(i→j) = sent_i − delivered_j`,
//! message for message, in order: the receiver recorded the indices
//! `[delivered_j, marker)`, the sender `[marker, sent_i)`, both ends agree where the
//! marker is, and nothing was delivered that was not sent.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;

use crate::report::LocalReport;
use crate::topology::Topology;
use crate::types::{ChannelId, NodeId};

/// Which end of a channel recorded something.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The sending process.
    Sender,
    /// The receiving process.
    Receiver,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Sender => "sender",
            Self::Receiver => "receiver",
        })
    }
}

/// A process's complete part of a snapshot as the verifier sees it: its counters and the
/// data indices of the messages it recorded, per channel (incoming and outgoing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePart {
    /// The counters.
    pub report: LocalReport,
    /// The indices of the recorded messages, per channel, in recording order.
    pub recorded: BTreeMap<ChannelId, Vec<u64>>,
}

/// The first reason a cut is not complete and consistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// A participant did not report.
    #[error("node {0} did not report")]
    MissingNode(NodeId),
    /// A process reported a snapshot other than the one checked, or under another name.
    #[error("node {0} reported a part that is not its own")]
    ForeignReport(NodeId),
    /// A channel of the topology is missing from one end's report.
    #[error("channel {channel} is missing from its {side}'s report")]
    MissingChannel {
        /// The channel.
        channel: ChannelId,
        /// The end whose report lacks it.
        side: Side,
    },
    /// The two ends disagree on where the marker is.
    #[error(
        "channel {channel}: sender put the marker after {sender} messages, receiver saw it after {receiver}"
    )]
    MarkerMismatch {
        /// The channel.
        channel: ChannelId,
        /// The sender's count.
        sender: u64,
        /// The receiver's count.
        receiver: u64,
    },
    /// The receiver's state includes messages the sender's state never sent.
    #[error(
        "channel {channel}: receiver's state took in {delivered} messages but the sender's state sent only {sent}"
    )]
    ReceivedNotSent {
        /// The channel.
        channel: ChannelId,
        /// Delivered before the receiver recorded.
        delivered: u64,
        /// Sent before the sender recorded.
        sent: u64,
    },
    /// The receiver's state includes messages that came after the marker.
    #[error(
        "channel {channel}: receiver's state took in {delivered} messages, past the marker at {marker_at}"
    )]
    DeliveredPastMarker {
        /// The channel.
        channel: ChannelId,
        /// Delivered before the receiver recorded.
        delivered: u64,
        /// Where the marker was.
        marker_at: u64,
    },
    /// The sender's state omits messages that preceded its marker.
    #[error(
        "channel {channel}: sender's marker followed {marker_at} messages but its state sent only {sent}"
    )]
    SentAfterMarker {
        /// The channel.
        channel: ChannelId,
        /// Sent before the sender recorded.
        sent: u64,
        /// Where the marker was.
        marker_at: u64,
    },
    /// One end recorded other messages than its counters call for.
    #[error(
        "channel {channel}: {side} recorded {recorded} but should have recorded messages {expected:?}"
    )]
    WrongMessages {
        /// The channel.
        channel: ChannelId,
        /// The end.
        side: Side,
        /// The indices it should have recorded.
        expected: Range<u64>,
        /// What it recorded, summarised.
        recorded: String,
    },
    /// A violation known only by its sentence: how the wire and the store carry one. The
    /// verifier never produces it; a reason read back from the wire does.
    #[error("{0}")]
    Described(String),
}

/// The verifier's verdict on a consistent cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Consistent {
    /// Messages recorded as channel state, over all channels.
    pub recorded_messages: u64,
}

/// Checks that `parts` form a complete, consistent cut of `topology`; the error is the
/// first violation found, in channel order.
pub fn verify(
    topology: &Topology,
    parts: &BTreeMap<NodeId, NodePart>,
) -> Result<Consistent, Violation> {
    for node in topology.nodes() {
        let part = parts
            .get(node)
            .ok_or_else(|| Violation::MissingNode(node.clone()))?;
        if &part.report.node != node {
            return Err(Violation::ForeignReport(node.clone()));
        }
    }
    let ids: BTreeSet<_> = parts.values().map(|p| p.report.id).collect();
    if ids.len() > 1 {
        let odd = parts
            .values()
            .find(|p| p.report.id != parts.values().next().unwrap().report.id);
        return Err(Violation::ForeignReport(
            odd.expect("two ids").report.node.clone(),
        ));
    }
    let mut recorded_messages = 0;
    for channel in topology.channels() {
        let sender = &parts[&channel.from];
        let receiver = &parts[&channel.to];
        let out = sender
            .report
            .outgoing
            .get(channel)
            .ok_or_else(|| Violation::MissingChannel {
                channel: channel.clone(),
                side: Side::Sender,
            })?;
        let inc =
            receiver
                .report
                .incoming
                .get(channel)
                .ok_or_else(|| Violation::MissingChannel {
                    channel: channel.clone(),
                    side: Side::Receiver,
                })?;
        if out.marker_at != inc.marker_at {
            return Err(Violation::MarkerMismatch {
                channel: channel.clone(),
                sender: out.marker_at,
                receiver: inc.marker_at,
            });
        }
        if inc.delivered > out.sent {
            return Err(Violation::ReceivedNotSent {
                channel: channel.clone(),
                delivered: inc.delivered,
                sent: out.sent,
            });
        }
        if inc.delivered > inc.marker_at {
            return Err(Violation::DeliveredPastMarker {
                channel: channel.clone(),
                delivered: inc.delivered,
                marker_at: inc.marker_at,
            });
        }
        if out.sent < out.marker_at {
            return Err(Violation::SentAfterMarker {
                channel: channel.clone(),
                sent: out.sent,
                marker_at: out.marker_at,
            });
        }
        check_recorded(channel, Side::Receiver, inc.recorded(), receiver)?;
        check_recorded(channel, Side::Sender, out.recorded(), sender)?;
        recorded_messages += out.sent - inc.delivered;
    }
    Ok(Consistent { recorded_messages })
}

fn check_recorded(
    channel: &ChannelId,
    side: Side,
    expected: Range<u64>,
    part: &NodePart,
) -> Result<(), Violation> {
    let recorded = part.recorded.get(channel).map(Vec::as_slice).unwrap_or(&[]);
    if recorded.iter().copied().eq(expected.clone()) {
        return Ok(());
    }
    let summary = match (recorded.first(), recorded.last()) {
        (Some(first), Some(last)) => format!("{} messages ({first}..={last})", recorded.len()),
        _ => "nothing".to_owned(),
    };
    Err(Violation::WrongMessages {
        channel: channel.clone(),
        side,
        expected,
        recorded: summary,
    })
}
