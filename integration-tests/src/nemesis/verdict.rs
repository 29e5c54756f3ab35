//! What the checker reads a bank's state as, and its verdict: shared by the checker
//! ([`super::check`]) and the ledger's invariant ([`super::ledger`]).

use std::collections::BTreeMap;

use serde::Deserialize;

/// A bank's state, as the checker reads it (its own definition of the bank's JSON).
#[derive(Debug, Clone, Deserialize)]
pub(super) struct State {
    pub(super) balance: u64,
    #[serde(default)]
    pub(super) line: u64,
    #[serde(default)]
    pub(super) sent: BTreeMap<String, u64>,
    #[serde(default)]
    pub(super) received: BTreeMap<String, Seen>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(super) struct Seen {
    pub(super) line: u64,
    pub(super) id: u64,
}

/// The checker's verdict and the run's numbers.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Verdict {
    /// Every violation found, each naming the snapshot, node or channel.
    pub violations: Vec<String>,
    /// Snapshots the nemesis started.
    pub snapshots_started: u64,
    /// Snapshot starts refused or timed out, by why.
    pub starts_refused: BTreeMap<String, u64>,
    /// Snapshots by outcome (`COMPLETED`, `FAILED KIND_TIMEOUT`, …).
    pub snapshots: BTreeMap<String, u64>,
    /// COMPLETED snapshots whose channels were checked.
    pub completed_checked: u64,
    /// Of those, the ones whose money was counted (every state of an original line).
    pub money_checked: u64,
    /// Channels whose in-flight transfers were checked id by id.
    pub channels_checked: u64,
    /// Channels across a bank's fresh start (the receiver follows another line of the
    /// sender): not checked id by id.
    pub channels_across_restart: u64,
    /// In-flight transfers checked.
    pub in_flight_checked: u64,
    /// Transfers the final banks' lines account for (the sum of the last ids sent).
    pub transfers_final: u64,
    /// Faults by kind.
    pub faults: BTreeMap<String, u64>,
    /// Restores by requester and outcome.
    pub restores: BTreeMap<String, u64>,
    /// The longest time from a fault's end to the start of a snapshot that completed, s.
    pub longest_recovery_s: f64,
    /// Terms seen, with the replica that led each.
    pub terms: BTreeMap<u64, usize>,
    /// Ends a watcher was told, compared with the store's.
    pub told_checked: u64,
    /// Transfers of the ledger checked id by id against the closing restore's snapshot.
    pub ledger_transfers_checked: u64,
    /// Restores held to the history the cluster was on (those whose snapshot's epoch the
    /// history holds).
    pub restores_in_history_checked: u64,
    /// Why the ledger was not checked (the restored snapshot holds a bank's fresh line).
    pub ledger_unchecked: Option<String>,
}

impl Verdict {
    pub(super) fn violation(&mut self, v: String) {
        // A broken run repeats itself: the first hundred tell the story.
        if self.violations.len() < 100 {
            self.violations.push(v);
        } else if self.violations.len() == 100 {
            self.violations.push("(more violations left out)".into());
        }
    }
}

/// The line each bank started the run with.
pub(super) type Original = BTreeMap<String, u64>;

pub(super) fn parse_state(text: &str) -> Result<State, String> {
    serde_json::from_str(text).map_err(|e| format!("not a bank state ({e}): {text:.200}"))
}
