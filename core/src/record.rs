//! The records the coordinator keeps and stores (JSON): snapshots and restores from their
//! start to their end (`/cairn/<cluster>/snapshots/<id>`, `…/restores/<epoch>`), and the
//! roster, members and removed nodes (`…/roster/<node>`, `…/members/<node>`,
//! `…/removed/<node>`).
//! The coordinator's engine ([`crate::coordinator`]) builds them; `cairn-proto` stores
//! them. Their byte form is a contract with every store written before: the round-trip
//! tests (`integration-tests/tests/it/roundtrip.rs`) and the fuzzers guard it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::FailureReason;

/// Where a snapshot is in its life; stored as `IN_PROGRESS`, `COMPLETED`, `FAILED`, `ABORTED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SnapshotStatus {
    /// Started, not ended.
    InProgress,
    /// Every part stored and the cut verified.
    Completed,
    /// Ended without a verified cut.
    Failed,
    /// Aborted by a user.
    Aborted,
}

impl SnapshotStatus {
    /// The stored word.
    pub fn name(self) -> &'static str {
        match self {
            Self::InProgress => "IN_PROGRESS",
            Self::Completed => "COMPLETED",
            Self::Failed => "FAILED",
            Self::Aborted => "ABORTED",
        }
    }
}

impl std::fmt::Display for SnapshotStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A snapshot: its plan, lifecycle, verdict, sizes and timings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// The id.
    pub id: u64,
    /// CHANDY_LAMPORT, UNALIGNED or ALIGNED.
    pub mode: String,
    /// The initiators.
    pub initiators: Vec<String>,
    /// Aligned mode's alignment timeout; 0 for none.
    pub alignment_timeout_ms: u64,
    /// Where it is in its life.
    pub status: SnapshotStatus,
    /// Why it failed or was aborted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureRecord>,
    /// The verifier's verdict, once every part arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<VerdictRecord>,
    /// Milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    /// Milliseconds since the Unix epoch; 0 while in progress.
    pub finished_at_ms: u64,
    /// The timeout it ran under.
    pub timeout_ms: u64,
    /// Labels given at start.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The participants.
    pub nodes: Vec<String>,
    /// The channels, as `from->to`.
    pub channels: Vec<String>,
    /// Participants whose application recorded its state.
    #[serde(default)]
    pub recorded: Vec<String>,
    /// Participants whose part is stored.
    #[serde(default)]
    pub reported: Vec<String>,
    /// Bytes stored that no earlier snapshot had stored.
    pub bytes_new: u64,
    /// Bytes shared with earlier snapshots.
    pub bytes_reused: u64,
    /// The cluster's epoch when it started: every part must have been recorded in it.
    #[serde(default)]
    pub epoch: u64,
    /// The leadership term of the coordinator that started it (0: the embedded store;
    /// absent in records of before high availability).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub term: u64,
    /// Its timeline, oldest first (absent in records of before events).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<EventRecord>,
    /// The client's request id of its start (`StartSnapshotRequest.request_id`): a start
    /// that gives it again answers this snapshot. Empty for none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request_id: String,
}

/// What a snapshot event is; stored as `STARTED`, `STATE_RECORDED`, …
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum EventKind {
    /// Started and sent to the initiators.
    Started,
    /// A node's application recorded its local state.
    StateRecorded,
    /// A node's part is stored.
    PartStored,
    /// A node reported a failure.
    NodeFailed,
    /// The cut was checked.
    Verified,
    /// It ended.
    Ended,
}

/// One step of a snapshot's life (`SnapshotEvent` on the wire).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventRecord {
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// What happened.
    pub kind: EventKind,
    /// The node concerned, for a node's events.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
    /// PART_STORED: the local state's bytes.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub local_state_bytes: u64,
    /// PART_STORED: messages the node recorded; VERIFIED: over all channels.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub recorded_messages: u64,
    /// PART_STORED: bytes stored anew.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bytes_new: u64,
    /// PART_STORED: bytes shared with earlier snapshots.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bytes_reused: u64,
    /// NODE_FAILED, VERIFIED, ENDED: in words.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// STATE_RECORDED: milliseconds from the start to the node's first sight of the
    /// snapshot (the marker's start delay); absent from daemons that do not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_delay_ms: Option<u64>,
    /// STATE_RECORDED, ALIGNED: how long the node aligned, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alignment_ms: Option<u64>,
    /// STATE_RECORDED, ALIGNED: data messages held on its channels meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_messages: Option<u64>,
}

impl EventRecord {
    /// An event of `kind` at `at_ms`, every other field empty.
    pub fn new(at_ms: u64, kind: EventKind) -> Self {
        Self {
            at_ms,
            kind,
            node: String::new(),
            local_state_bytes: 0,
            recorded_messages: 0,
            bytes_new: 0,
            bytes_reused: 0,
            detail: String::new(),
            start_delay_ms: None,
            alignment_ms: None,
            held_messages: None,
        }
    }
}

/// Why a snapshot failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureRecord {
    /// A stable word: TIMEOUT, NODE_LOST, CHANNEL_RESET, INCONSISTENT, …
    pub kind: String,
    /// A sentence naming the node or channel.
    pub message: String,
    /// The nodes concerned.
    #[serde(default)]
    pub nodes: Vec<String>,
    /// The channel concerned, as `from->to`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<String>,
    /// The reason's own words beyond its kind (the wire's `detail`); absent when there are
    /// none, and in records stored before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// The consistency check's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictRecord {
    /// Whether the cut is complete and consistent.
    pub consistent: bool,
    /// The first violation; empty when consistent.
    pub violation: String,
    /// Messages recorded as channel state.
    pub recorded_messages: u64,
}

/// Where a restore is; stored as `IN_PROGRESS`, `DONE`, `FAILED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RestoreStatus {
    /// Nodes are applying it.
    InProgress,
    /// Every node applied it.
    Done,
    /// It ended without every node applying it.
    Failed,
}

impl std::fmt::Display for RestoreStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::InProgress => "in progress",
            Self::Done => "done",
            Self::Failed => "failed",
        })
    }
}

/// A restore operation (`/cairn/<cluster>/restores/<epoch>`): who asked, when, which
/// snapshot, who applied, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreRecord {
    /// `restore-<epoch>`.
    pub id: String,
    /// The snapshot restored.
    pub snapshot_id: u64,
    /// The epoch it fenced the cluster with.
    pub epoch: u64,
    /// The nodes that must apply their state.
    pub nodes: Vec<String>,
    /// The nodes that did.
    pub applied: Vec<String>,
    /// Where it is.
    pub status: RestoreStatus,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// "user" or "automatic recovery (…)".
    pub requested_by: String,
    /// Milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    /// Milliseconds since the Unix epoch; 0 while in progress.
    pub finished_at_ms: u64,
    /// Snapshots that automatic recovery passed over because they did not verify, with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
}

/// A registered node daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// The node's id.
    pub node: String,
    /// Its peer address.
    pub address: String,
    /// Its daemon's incarnation.
    pub incarnation: u64,
    /// Milliseconds since the Unix epoch.
    pub registered_at_ms: u64,
}

/// A node removed from the cluster (`RemoveNode`) and not back since: daemons drop their
/// channels to it when a membership names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovedRecord {
    /// The node's id.
    pub node: String,
    /// Milliseconds since the Unix epoch of its removal.
    pub removed_at_ms: u64,
    /// The daemon incarnation it last registered with: that process may not register again
    /// (its channels are gone at every peer); a new process joins as a new member.
    #[serde(default)]
    pub incarnation: u64,
}

/// A node of the cluster's roster: every node that has ever registered (and was not
/// removed). The topology spans the roster, connected or not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RosterRecord {
    /// The node's id.
    pub node: String,
    /// Its peer address, as it last registered.
    pub address: String,
    /// Milliseconds since the Unix epoch of its first registration.
    pub joined_at_ms: u64,
    /// The incarnation it last registered with (a new one means its daemon restarted).
    #[serde(default)]
    pub incarnation: u64,
}

impl From<&FailureReason> for FailureRecord {
    /// A failure for the store: its kind's stable word (`ABORTED` for a user's abort),
    /// its sentence, its nodes, its channel as `from->to` and its own words.
    fn from(reason: &FailureReason) -> Self {
        Self {
            kind: reason.kind().word().to_owned(),
            message: reason.to_string(),
            nodes: reason.nodes().iter().map(ToString::to_string).collect(),
            channel: reason.channel().map(ToString::to_string),
            detail: Some(reason.detail()).filter(|words| !words.is_empty()),
        }
    }
}

impl SnapshotRecord {
    /// Ends its timeline: its status and, if it did not complete, why.
    pub fn push_ended(&mut self) {
        let detail = match &self.failure {
            None => self.status.to_string(),
            Some(f) => event_detail(&format!("{}: {}", self.status, f.message)),
        };
        self.events.push(EventRecord {
            detail,
            ..EventRecord::new(self.finished_at_ms, EventKind::Ended)
        });
    }
}

/// The most bytes of a reason an event keeps: a node's failure message may be far longer
/// (the record's `failure` keeps it whole), and a record must stay storable.
pub const MAX_EVENT_DETAIL: usize = 512;

/// `text` as an event keeps it: at most [`MAX_EVENT_DETAIL`] bytes, cut at a character.
pub fn event_detail(text: &str) -> String {
    cut(text, MAX_EVENT_DETAIL)
}

/// `text` cut to at most `max` bytes at a character, marked `…` where it was cut.
pub fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Whether a number is zero (such fields are left out of the JSON).
fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_keeps_a_bounded_reason_cut_at_a_character() {
        assert_eq!(event_detail("short"), "short");
        let long = "é".repeat(1000);
        let kept = event_detail(&long);
        assert!(
            kept.len() <= MAX_EVENT_DETAIL + '…'.len_utf8(),
            "{}",
            kept.len()
        );
        assert!(kept.ends_with('…') && long.starts_with(kept.trim_end_matches('…')));
    }
}
