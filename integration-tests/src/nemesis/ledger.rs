//! The checker's ledger invariant: after the closing restore of snapshot S (and before any
//! cut after it), the banks' ledger in PostgreSQL holds exactly the transfers S's recorded
//! states say each bank received — for each receiver and sender, ids 1 to the last received,
//! of the sender's line, each once — and no transaction is left prepared. A transfer of a
//! history a restore discarded, one lost between a pre-commit and its commit, or one written
//! twice shows as an island of ids that is not `[1, last]`. A history without a reading of
//! the ledger (a run without `--ledger`) is not checked, and the verdict says so; a reading
//! that cannot be checked (the closing restore brought back a bank's fresh line) fails.

use std::collections::{BTreeMap, BTreeSet};

use super::history::{Entry, LedgerIsland, SnapshotView};
use super::verdict::{Original, Verdict, parse_state};

/// Checks the `Ledger` line against the closing restore's snapshot.
pub(super) fn check_ledger(
    entries: &[Entry],
    snapshots: &BTreeMap<u64, &SnapshotView>,
    original: &Original,
    v: &mut Verdict,
) {
    let Some((snapshot, islands, prepared)) = entries.iter().find_map(|e| match e {
        Entry::Ledger {
            snapshot,
            islands,
            prepared,
            ..
        } => Some((*snapshot, islands, prepared)),
        _ => None,
    }) else {
        v.ledger_unchecked = Some("the run wrote no ledger (cairn-nemesis --ledger)".into());
        return;
    };
    if !prepared.is_empty() {
        v.violation(format!(
            "after the closing restore, ledger transactions are still prepared: {prepared:?}"
        ));
    }
    let Some(s) = snapshots.get(&snapshot).filter(|s| s.status == "COMPLETED") else {
        // The closing restore's own check names this.
        return;
    };
    let mut expected = BTreeSet::new();
    for n in &s.nodes {
        let Ok(state) = parse_state(&n.state) else {
            return;
        };
        // A bank of a fresh line holds what its predecessor received too: not checkable.
        // The nemesis closes on a snapshot of the original lines whenever the history
        // has one, so a ledger read and left unchecked fails the run.
        if original.get(&n.node) != Some(&state.line) {
            let why = format!("snapshot {snapshot} holds bank {}'s fresh line", n.node);
            v.violation(format!("the ledger was read but cannot be checked: {why}"));
            v.ledger_unchecked = Some(why);
            return;
        }
        for (from, seen) in &state.received {
            if seen.id > 0 {
                expected.insert(LedgerIsland {
                    from: from.clone(),
                    to: n.node.clone(),
                    line: seen.line,
                    first: 1,
                    last: seen.id,
                });
            }
        }
    }
    let got: BTreeSet<LedgerIsland> = islands.iter().cloned().collect();
    for island in got.difference(&expected) {
        v.violation(format!(
            "the ledger holds transfers {}..={} of {}'s line {} to {}, which snapshot {snapshot} \
             (restored) does not account for as {:?}",
            island.first,
            island.last,
            island.from,
            island.line,
            island.to,
            expected
                .iter()
                .find(|e| e.from == island.from && e.to == island.to)
                .map(|e| (e.line, e.first, e.last))
        ));
    }
    for island in expected.difference(&got) {
        v.violation(format!(
            "the ledger lacks transfers of {}'s line {} to {}: snapshot {snapshot} (restored) \
             says {}..={} were received",
            island.from, island.line, island.to, island.first, island.last
        ));
    }
    v.ledger_transfers_checked = expected.iter().map(|i| i.last).sum();
    if v.ledger_transfers_checked < 10 {
        v.violation(format!(
            "only {} ledger transfers were checked: the run proves little",
            v.ledger_transfers_checked
        ));
    }
}
