//! The nemesis run's checker: judges a history from the banks' own bookkeeping and the
//! snapshots' recorded data alone. It is written apart from the engine on purpose: it does
//! not call `cairn-core`'s verifier, nor read the cut counters the daemons report, nor use
//! the bank's types (it parses the JSON itself), so a bug shared by the engine and its
//! verifier cannot hide here.
//!
//! What it checks, and how:
//! - **Every COMPLETED snapshot is a consistent cut of all the money.** Each bank's state
//!   records, per peer, the id of the last transfer sent and the last received (with the
//!   sender's line). For a channel `a->b`, the transfers the snapshot must hold in flight
//!   (recorded by `b` as they arrived, then by `a` as overtaken in its queue)
//!   are exactly the ids after `b`'s last received and up to `a`'s last sent, in order: one
//!   missing is a message lost by the cut, one extra or at or below `b`'s last received is a
//!   message counted both in `b`'s state and in flight, and `b` having received an id `a`
//!   never sent is an orphan. The recorded balances plus the recorded in-flight amounts
//!   must equal all the money, whenever every state is of a line the run started with (a
//!   bank killed and started afresh has a new line and a fresh balance until a restore).
//!   And the snapshot must hold every node.
//! - **Nothing lost or duplicated on a channel that stayed up**: the banks count every
//!   delivery at or below the last id applied (a duplicate) and every id skipped (a loss);
//!   every count the nemesis polled must be 0. Once the faults stop and the channels
//!   drain, every transfer sent has been received: each bank's last received id from each
//!   peer equals that peer's last sent.
//! - **Snapshot ids only grow**, in the order the coordinator handed them out, and a
//!   snapshot of a higher id never has a lower leadership term; every snapshot started is
//!   in the final list (none vanished from the metadata); none failed as inconsistent
//!   (that verdict means the engine recorded a wrong cut).
//! - **At most one coordinator per term**: no two replicas were seen leading one term.
//! - **Restores**: none is left neither done nor failed, and after the closing restore the
//!   banks hold exactly the restored snapshot's balances plus its in-flight transfers.
//! - **Recovery**: after every fault ends, a snapshot started within the bound completes.
//! - **Stored before told**: every end a watcher was told is the end the store holds at
//!   the end of the run (told COMPLETED, stored FAILED — or the other way — is an outcome
//!   published that was not stored).
//! - **A restore told failed is never applied**: a restore call answered with an error that
//!   does not say its outcome is unknown leaves no restore of that snapshot started while
//!   the call was open (the coordinator stamps a restore when it starts it, before storing
//!   it, and the answer comes after the store's).

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;

use super::history::{BankView, Entry, SnapshotView};
pub use super::verdict::Verdict;
use super::verdict::{Original, Seen, State, parse_state};

/// A transfer's payload, as the checker reads it.
#[derive(Debug, Clone, Copy, Deserialize)]
struct Transfer {
    amount: u64,
    #[serde(default)]
    line: u64,
    #[serde(default)]
    id: u64,
}

fn states_of(banks: &[BankView]) -> BTreeMap<String, Result<State, String>> {
    banks
        .iter()
        .map(|b| {
            let state = match &b.state {
                Some(text) => parse_state(text),
                None => Err("the bank did not answer".into()),
            };
            (b.node.clone(), state)
        })
        .collect()
}

/// Checks a history; `recovery_bound_s` bounds the time from a fault's end to a completed
/// snapshot.
pub fn check(entries: &[Entry], recovery_bound_s: f64) -> Verdict {
    let mut v = Verdict::default();
    let Some((nodes, total)) = entries.iter().find_map(|e| match e {
        Entry::Setup { nodes, total, .. } => Some((nodes.clone(), *total)),
        _ => None,
    }) else {
        v.violation("the history has no setup line".into());
        return v;
    };
    // The line each bank started with: the first poll of the banks, before any fault.
    let mut original = Original::new();
    match entries.iter().find_map(|e| match e {
        Entry::Banks { banks, .. } => Some(banks),
        _ => None,
    }) {
        Some(banks) => {
            for (node, state) in states_of(banks) {
                match state {
                    Ok(s) => {
                        original.insert(node, s.line);
                    }
                    Err(e) => v.violation(format!("first poll: bank {node}: {e}")),
                }
            }
        }
        None => v.violation("the history never polled the banks".into()),
    }

    check_ids_and_terms(entries, &mut v);
    let snapshots: BTreeMap<u64, &SnapshotView> = entries
        .iter()
        .filter_map(|e| match e {
            Entry::Snapshot(s) => Some((s.id, s)),
            _ => None,
        })
        .collect();
    let mut inconsistent = 0;
    for s in snapshots.values() {
        let outcome = if s.failure_kind.is_empty() {
            s.status.clone()
        } else {
            format!("{} {}", s.status, s.failure_kind)
        };
        *v.snapshots.entry(outcome).or_default() += 1;
        if s.failure_kind == "KIND_INCONSISTENT" {
            inconsistent += 1;
        }
        // The first few by name; a broken build fails hundreds alike.
        if s.failure_kind == "KIND_INCONSISTENT" && inconsistent <= 5 {
            v.violation(format!(
                "snapshot {} failed as inconsistent (cairn's verifier saw a wrong cut, which a \
                 correct engine and channel never record): {}",
                s.id, s.failure
            ));
        }
        if s.status == "COMPLETED" {
            check_snapshot(s, &nodes, total, &original, &mut v);
        }
    }
    if inconsistent > 5 {
        v.violation(format!(
            "{inconsistent} snapshots in all failed as inconsistent"
        ));
    }
    check_banks(entries, &nodes, total, &original, &mut v);
    check_restores(entries, &snapshots, &mut v);
    check_told(entries, &snapshots, &mut v);
    check_refused_restores(entries, &mut v);
    super::lineage::check_restores_stay_in_history(entries, &snapshots, &mut v);
    check_recovery(entries, &snapshots, recovery_bound_s, &mut v);
    super::ledger::check_ledger(entries, &snapshots, &original, &mut v);
    // A run that checked little proves little.
    let modes: BTreeSet<&str> = snapshots
        .values()
        .filter(|s| s.status == "COMPLETED")
        .map(|s| s.mode.as_str())
        .collect();
    for (what, n) in [
        ("snapshots completed", v.completed_checked),
        ("snapshots had their money counted", v.money_checked),
        ("channels were checked id by id", v.channels_checked),
        ("transfers in flight were checked", v.in_flight_checked),
        (
            "ends told to a watcher were compared with the store's",
            v.told_checked,
        ),
    ] {
        if n < 10 {
            v.violation(format!("only {n} {what}: the run proves little"));
        }
    }
    for mode in ["CHANDY_LAMPORT", "UNALIGNED", "ALIGNED"] {
        if !modes.contains(mode) {
            v.violation(format!("no {mode} snapshot completed"));
        }
    }
    v
}

/// Ids grow, terms do not fall, nothing vanished, one replica per term.
fn check_ids_and_terms(entries: &[Entry], v: &mut Verdict) {
    let mut last = 0;
    let mut started = BTreeSet::new();
    let mut ended = BTreeMap::new();
    let mut leaders: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
    for e in entries {
        match e {
            Entry::SnapshotStarted { id, at, .. } => {
                v.snapshots_started += 1;
                if *id <= last {
                    v.violation(format!(
                        "snapshot id {id} handed out at {at:.1}s after id {last}: ids must only grow"
                    ));
                }
                last = last.max(*id);
                started.insert(*id);
            }
            Entry::Snapshot(s) => {
                ended.insert(s.id, s.term);
            }
            Entry::Leader { replica, term, .. } => {
                leaders.entry(*term).or_default().insert(*replica);
            }
            Entry::Fault { kind, .. } => *v.faults.entry(kind.clone()).or_default() += 1,
            Entry::End { refused, .. } => v.starts_refused.clone_from(refused),
            _ => {}
        }
    }
    for id in &started {
        if !ended.contains_key(id) {
            v.violation(format!(
                "snapshot {id} was started but is not in the coordinator's final list"
            ));
        }
    }
    let mut highest = (0, 0);
    for (&id, &term) in &ended {
        if term != 0 && term < highest.1 {
            v.violation(format!(
                "snapshot {id} has term {term}, below snapshot {}'s term {}",
                highest.0, highest.1
            ));
        }
        if term > highest.1 {
            highest = (id, term);
        }
    }
    for (term, replicas) in leaders {
        if replicas.len() > 1 {
            v.violation(format!(
                "term {term} was led by more than one replica: {replicas:?}"
            ));
        }
        if let Some(&r) = replicas.iter().next() {
            v.terms.insert(term, r);
        }
    }
}

/// One COMPLETED snapshot: every node once, every channel of the mesh, each channel's
/// in-flight transfers exactly, the money.
fn check_snapshot(
    s: &SnapshotView,
    nodes: &[String],
    total: u64,
    original: &Original,
    v: &mut Verdict,
) {
    let id = s.id;
    v.completed_checked += 1;
    let mut states = BTreeMap::new();
    for n in &s.nodes {
        if !nodes.contains(&n.node) {
            v.violation(format!(
                "snapshot {id} holds a part of unknown node {}",
                n.node
            ));
            continue;
        }
        match parse_state(&n.state) {
            Ok(state) => {
                if states.insert(n.node.clone(), state).is_some() {
                    v.violation(format!("snapshot {id} holds node {} twice", n.node));
                }
            }
            Err(e) => v.violation(format!("snapshot {id}: node {}: {e}", n.node)),
        }
    }
    for node in nodes {
        if !s.nodes.iter().any(|n| &n.node == node) {
            v.violation(format!("snapshot {id} is COMPLETED without node {node}"));
        }
    }
    if states.len() != nodes.len() {
        return;
    }
    // The cut covers every channel of the full mesh, and nothing is recorded elsewhere.
    let mesh: BTreeSet<String> = nodes
        .iter()
        .flat_map(|a| {
            nodes
                .iter()
                .filter(move |b| *b != a)
                .map(move |b| format!("{a}->{b}"))
        })
        .collect();
    let listed: BTreeSet<String> = s.channels.iter().cloned().collect();
    if listed != mesh {
        v.violation(format!(
            "snapshot {id}: its channels {listed:?} are not the mesh of its nodes"
        ));
    }
    for n in &s.nodes {
        for c in &n.channels {
            let name = format!("{}->{}", c.from, c.to);
            if !mesh.contains(&name) || (n.node != c.from && n.node != c.to) {
                v.violation(format!(
                    "snapshot {id}: node {} recorded messages of channel {name}",
                    n.node
                ));
            }
        }
    }
    let mut in_flight_money: u64 = 0;
    for channel in &mesh {
        let Some((a, b)) = channel.split_once("->") else {
            continue;
        };
        let (sender, receiver) = (&states[a], &states[b]);
        // In channel order: what the receiver recorded arriving before the marker, then
        // what the sender recorded as overtaken in its queue (unaligned mode).
        let recorded: Vec<&String> = [b, a]
            .into_iter()
            .flat_map(|side| s.nodes.iter().filter(move |n| n.node == side))
            .flat_map(|n| n.channels.iter())
            .filter(|c| c.from == a && c.to == b)
            .flat_map(|c| c.messages.iter())
            .collect();
        let mut transfers = Vec::with_capacity(recorded.len());
        for m in recorded {
            match serde_json::from_str::<Transfer>(m) {
                Ok(t) => transfers.push(t),
                Err(e) => v.violation(format!(
                    "snapshot {id}: channel {channel}: an in-flight message is not a transfer ({e}): {m:.200}"
                )),
            }
        }
        for t in &transfers {
            in_flight_money = in_flight_money.saturating_add(t.amount);
        }
        // Transfers without an id (none of the bank's own) are counted as money only.
        transfers.retain(|t| t.id != 0);
        let channel_check = ChannelCut {
            a,
            b,
            sender,
            receiver,
            original,
        };
        match channel_check.check(&transfers) {
            Checked::Exact => v.channels_checked += 1,
            Checked::Unknown => v.channels_across_restart += 1,
            Checked::Wrong(why) => {
                v.channels_checked += 1;
                v.violation(format!("snapshot {id}: channel {channel}: {why}"));
            }
        }
        v.in_flight_checked += transfers.len() as u64;
    }
    if states
        .iter()
        .all(|(n, st)| original.get(n) == Some(&st.line))
    {
        v.money_checked += 1;
        let balances: u64 = states.values().map(|st| st.balance).sum();
        let money = balances.saturating_add(in_flight_money);
        if money != total {
            v.violation(format!(
                "snapshot {id} is COMPLETED but holds {money} ({balances} in balances, \
                 {in_flight_money} in flight), not {total}"
            ));
        }
    }
}

/// What one channel's recorded transfers amount to.
enum Checked {
    /// Exactly the transfers after the receiver's last and up to the sender's last.
    Exact,
    /// Not decidable: the receiver is a bank started afresh that has not yet heard of the
    /// sender's line.
    Unknown,
    /// Wrong, and why.
    Wrong(String),
}

/// One channel of a snapshot, with both ends' recorded states.
struct ChannelCut<'a> {
    a: &'a str,
    b: &'a str,
    sender: &'a State,
    receiver: &'a State,
    original: &'a Original,
}

/// More transfers in flight on one channel than any run moves: a corrupt record.
const MAX_IN_FLIGHT: u64 = 1_000_000;

impl ChannelCut<'_> {
    /// The transfers recorded in flight, in channel order, must be: first, if the receiver
    /// follows an older line of the sender (whose bank started afresh since), the rest of
    /// that line's transfers still in the channel, continuing the receiver's last id; then
    /// the sender's own line's transfers from the receiver's last (or from 1, for a line
    /// the receiver has not heard of) up to the sender's last sent, each id once, in order.
    fn check(&self, transfers: &[Transfer]) -> Checked {
        let (a, b, sender) = (self.a, self.b, self.sender);
        let sent = sender.sent.get(b).copied().unwrap_or(0);
        let last = self.receiver.received.get(a).copied();
        let of_original = |node: &str, line: u64| self.original.get(node) == Some(&line);
        // Counted in the receiver's state and recorded in flight too.
        if let Some(last) = last
            && let Some(t) = transfers
                .iter()
                .find(|t| t.line == last.line && t.id <= last.id)
        {
            return Checked::Wrong(format!(
                "transfer {} is recorded in flight but {b}'s state already counts it (last \
                 received {})",
                t.id, last.id
            ));
        }
        // Where the sender's own line starts in the channel.
        let split = transfers
            .iter()
            .position(|t| t.line == sender.line)
            .unwrap_or(transfers.len());
        let (older, own) = transfers.split_at(split);
        if let Some(t) = own.iter().find(|t| t.line != sender.line) {
            return Checked::Wrong(format!(
                "transfer {} of line {} follows transfers of {a}'s line {}",
                t.id, t.line, sender.line
            ));
        }
        let base = match last {
            Some(last) if last.line == sender.line => {
                if !older.is_empty() {
                    return Checked::Wrong(format!(
                        "transfers of line {} are in flight though {b} follows {a}'s line {}",
                        older[0].line, sender.line
                    ));
                }
                last.id
            }
            Some(last) => {
                // The receiver follows another line of the sender: only one the sender's bank
                // left when it started afresh.
                if of_original(a, sender.line) {
                    return Checked::Wrong(format!(
                        "{b} follows line {} of {a}, but {a} is of the line it started with",
                        last.line
                    ));
                }
                if let Some(why) = contiguous(older, last.line, last.id) {
                    return Checked::Wrong(format!("the rest of {a}'s line {}: {why}", last.line));
                }
                0
            }
            // The receiver, of its original line, has received nothing from the sender: every
            // transfer of the sender's line is in flight; an older line's (the sender's bank
            // started afresh since) in order.
            None if of_original(b, self.receiver.line) => {
                match older.first() {
                    Some(t) if of_original(a, sender.line) => {
                        return Checked::Wrong(format!(
                            "transfer {} of line {} is in flight, not of {a}'s line {}",
                            t.id, t.line, sender.line
                        ));
                    }
                    Some(t) => {
                        if let Some(why) = contiguous(older, t.line, t.id.saturating_sub(1)) {
                            return Checked::Wrong(format!("{a}'s older line: {why}"));
                        }
                    }
                    None => {}
                }
                0
            }
            // A receiver started afresh that has heard nothing from the sender yet: where
            // the sender's line stands for it is not recorded anywhere.
            None => return Checked::Unknown,
        };
        if base > sent {
            return Checked::Wrong(format!(
                "{b} has received transfer {base} but {a} has sent only {sent} (a message \
                 received and never sent)"
            ));
        }
        if sent - base > MAX_IN_FLIGHT {
            return Checked::Wrong(format!(
                "{} transfers would be in flight ({b} received {base}, {a} sent {sent})",
                sent - base
            ));
        }
        let expected = sent - base;
        let ids: Vec<u64> = own.iter().map(|t| t.id).collect();
        let exact = ids.len() as u64 == expected
            && ids.iter().zip(base + 1..).all(|(got, want)| *got == want);
        if exact {
            return Checked::Exact;
        }
        let present: BTreeSet<u64> = ids.iter().copied().collect();
        let missing: Vec<u64> = (base + 1..=sent).filter(|i| !present.contains(i)).collect();
        Checked::Wrong(format!(
            "in flight {} but {a} sent up to {sent} and {b} received up to {base}{}",
            short(&ids),
            if missing.is_empty() {
                String::new()
            } else {
                format!(
                    ": transfers {} are in neither state nor channel",
                    short(&missing)
                )
            }
        ))
    }
}

/// Why `transfers` are not all of `line` with ids `after + 1, after + 2, …`; `None` if they
/// are.
fn contiguous(transfers: &[Transfer], line: u64, after: u64) -> Option<String> {
    for (t, want) in transfers.iter().zip(after.saturating_add(1)..) {
        if t.line != line || t.id != want {
            return Some(format!(
                "transfer {} of line {} where {want} of line {line} was due",
                t.id, t.line
            ));
        }
    }
    None
}

fn short(ids: &[u64]) -> String {
    if ids.len() <= 12 {
        format!("{ids:?}")
    } else {
        format!(
            "{:?}…{:?} ({} ids)",
            &ids[..6],
            &ids[ids.len() - 3..],
            ids.len()
        )
    }
}

/// The banks' own counts of duplicates and gaps, and the drained state at the end.
fn check_banks(
    entries: &[Entry],
    nodes: &[String],
    total: u64,
    original: &Original,
    v: &mut Verdict,
) {
    let mut reported = BTreeSet::new();
    let mut last_poll = None;
    let mut quiet = false;
    for e in entries {
        match e {
            Entry::Quiet { .. } => quiet = true,
            Entry::Banks { at, banks } | Entry::FinalRestore { at, banks, .. } => {
                for b in banks {
                    if (b.duplicates > 0 || b.skipped > 0 || b.rejected > 0)
                        && reported.insert(b.node.clone())
                    {
                        v.violation(format!(
                            "bank {} saw {} duplicate, {} skipped and {} rejected transfers \
                             (polled at {at:.1}s)",
                            b.node, b.duplicates, b.skipped, b.rejected
                        ));
                    }
                }
                if quiet && matches!(e, Entry::Banks { .. }) {
                    last_poll = Some(banks);
                }
            }
            _ => {}
        }
    }
    let Some(banks) = last_poll else {
        v.violation("the banks were not polled after the faults stopped".into());
        return;
    };
    let mut states = BTreeMap::new();
    for (node, state) in states_of(banks) {
        match state {
            Ok(s) => {
                states.insert(node, s);
            }
            Err(e) => v.violation(format!("after the faults: bank {node}: {e}")),
        }
    }
    for node in nodes {
        if !states.contains_key(node) {
            v.violation(format!("after the faults: bank {node} is missing"));
        }
    }
    for (a, sender) in &states {
        for (b, &sent) in &sender.sent {
            v.transfers_final = v.transfers_final.saturating_add(sent);
            let Some(receiver) = states.get(b) else {
                continue;
            };
            let got = receiver.received.get(a).copied();
            if sent > 0
                && got
                    != Some(Seen {
                        line: sender.line,
                        id: sent,
                    })
            {
                v.violation(format!(
                    "after the faults, channel {a}->{b}: {a} sent up to transfer {sent} of line \
                     {} but {b} received up to {got:?}: transfers lost",
                    sender.line
                ));
            }
        }
        // And the other way: nothing received from a line that was not sent.
        for (b, receiver) in &states {
            if let Some(got) = receiver.received.get(a)
                && got.line == sender.line
                && got.id > sender.sent.get(b).copied().unwrap_or(0)
            {
                v.violation(format!(
                    "after the faults, channel {a}->{b}: {b} received transfer {} of {a}'s \
                     line, which {a} never sent (its last: {:?})",
                    got.id,
                    sender.sent.get(b)
                ));
            }
        }
    }
    if states.iter().all(|(n, s)| original.get(n) == Some(&s.line)) {
        let live: u64 = states.values().map(|s| s.balance).sum();
        if live != total {
            v.violation(format!(
                "after the faults the banks hold {live}, not {total}"
            ));
        }
    } else {
        v.violation(
            "after the faults a bank is still of a line the run did not start with (a fresh \
             start never restored)"
                .into(),
        );
    }
}

/// Restores end, and the closing one gives the banks exactly the snapshot's money.
/// Every end a watcher was told is the end the store holds.
fn check_told(entries: &[Entry], snapshots: &BTreeMap<u64, &SnapshotView>, v: &mut Verdict) {
    for e in entries {
        if let Entry::Told { id, status, .. } = e {
            v.told_checked += 1;
            match snapshots.get(id) {
                Some(stored) if stored.status == *status => {}
                Some(stored) => v.violation(format!(
                    "snapshot {id}: a watcher was told {status}, the store holds {} (an \
                     outcome published that was not stored)",
                    stored.status
                )),
                None => v.violation(format!(
                    "snapshot {id}: a watcher was told {status}, the store holds no end"
                )),
            }
        }
    }
}

/// No restore was started while a restore call was open that was answered as a failure
/// (not "outcome unknown"): such a restore would be applied after its caller heard it
/// failed.
fn check_refused_restores(entries: &[Entry], v: &mut Verdict) {
    let restores: Vec<(&str, u64, &str, u64)> = entries
        .iter()
        .filter_map(|e| match e {
            Entry::Restore {
                restore_id,
                snapshot,
                requested_by,
                started_at_ms,
                ..
            } => Some((
                restore_id.as_str(),
                *snapshot,
                requested_by.as_str(),
                *started_at_ms,
            )),
            _ => None,
        })
        .collect();
    for e in entries {
        let Entry::RestoreRefused {
            snapshot,
            sent_ms,
            answered_ms,
            code,
            message,
            ..
        } = e
        else {
            continue;
        };
        if code == "Aborted" && message.contains("outcome unknown") {
            continue; // told unknown: whatever the store holds is the answer
        }
        for (id, restored, by, started) in &restores {
            if *by == "user" && restored == snapshot && (*sent_ms..=*answered_ms).contains(started)
            {
                v.violation(format!(
                    "{id} (of snapshot {snapshot}) started while a restore call was open that \
                     was answered {code}: {message}"
                ));
            }
        }
    }
}

fn check_restores(entries: &[Entry], snapshots: &BTreeMap<u64, &SnapshotView>, v: &mut Verdict) {
    for e in entries {
        if let Entry::Restore {
            restore_id,
            requested_by,
            done,
            failure,
            ..
        } = e
        {
            let who = if requested_by == "user" {
                "user"
            } else {
                "automatic"
            };
            let how = if *done {
                "done"
            } else if !failure.is_empty() {
                "failed"
            } else {
                v.violation(format!(
                    "restore {restore_id} is neither done nor failed after the run"
                ));
                "stuck"
            };
            *v.restores.entry(format!("{who} {how}")).or_default() += 1;
        }
    }
    let Some((snapshot, banks)) = entries.iter().find_map(|e| match e {
        Entry::FinalRestore {
            snapshot, banks, ..
        } => Some((*snapshot, banks)),
        _ => None,
    }) else {
        v.violation("the history has no closing restore".into());
        return;
    };
    let Some(s) = snapshots.get(&snapshot).filter(|s| s.status == "COMPLETED") else {
        v.violation(format!(
            "the closing restore names snapshot {snapshot}, which is not COMPLETED"
        ));
        return;
    };
    let mut expected: BTreeMap<String, State> = BTreeMap::new();
    for n in &s.nodes {
        match parse_state(&n.state) {
            Ok(state) => {
                expected.insert(n.node.clone(), state);
            }
            Err(e) => {
                v.violation(format!(
                    "closing restore: snapshot {snapshot}: {}: {e}",
                    n.node
                ));
                return;
            }
        }
    }
    // Its in-flight transfers are delivered after the restore, in channel order (what the
    // receiver recorded, then what the sender did): credited, and the last counted as
    // received.
    let names: Vec<String> = s.nodes.iter().map(|n| n.node.clone()).collect();
    for a in &names {
        for b in names.iter().filter(|b| *b != a) {
            for side in [b, a] {
                let recorded = s
                    .nodes
                    .iter()
                    .filter(|n| &n.node == side)
                    .flat_map(|n| n.channels.iter())
                    .filter(|c| &c.from == a && &c.to == b)
                    .flat_map(|c| c.messages.iter());
                for m in recorded {
                    let Ok(t) = serde_json::from_str::<Transfer>(m) else {
                        continue;
                    };
                    if let Some(state) = expected.get_mut(b) {
                        state.balance = state.balance.saturating_add(t.amount);
                        if t.id != 0 {
                            state.received.insert(
                                a.clone(),
                                Seen {
                                    line: t.line,
                                    id: t.id,
                                },
                            );
                        }
                    }
                }
            }
        }
    }
    for (node, state) in states_of(banks) {
        let Some(want) = expected.get(&node) else {
            continue;
        };
        match state {
            Ok(got) => {
                if got.balance != want.balance
                    || got.line != want.line
                    || got.sent != want.sent
                    || got.received != want.received
                {
                    v.violation(format!(
                        "after restoring snapshot {snapshot}, bank {node} holds balance {} \
                         (line {}, sent {:?}, received {:?}), not the snapshot's {} (line {}, \
                         sent {:?}, received {:?}) with its in-flight transfers delivered",
                        got.balance,
                        got.line,
                        got.sent,
                        got.received,
                        want.balance,
                        want.line,
                        want.sent,
                        want.received
                    ));
                }
            }
            Err(e) => v.violation(format!("after the closing restore: bank {node}: {e}")),
        }
    }
}

/// After every fault ends, a snapshot started within the bound completes.
fn check_recovery(
    entries: &[Entry],
    snapshots: &BTreeMap<u64, &SnapshotView>,
    bound_s: f64,
    v: &mut Verdict,
) {
    // When each fault ended: its heal, or the fault itself if it has none.
    let mut open: BTreeMap<(String, String), Vec<(f64, String)>> = BTreeMap::new();
    let mut ends: Vec<(f64, String)> = Vec::new();
    for e in entries {
        match e {
            Entry::Fault {
                at,
                kind,
                target,
                detail,
            } => {
                let what = format!("{kind} {target} at {at:.1}s ({detail})");
                if heals(kind) {
                    open.entry((kind.clone(), target.clone()))
                        .or_default()
                        .push((*at, what));
                } else {
                    ends.push((*at, what));
                }
            }
            Entry::Heal { at, kind, target } => {
                if let Some(list) = open.get_mut(&(kind.clone(), target.clone()))
                    && !list.is_empty()
                {
                    let (_, what) = list.remove(0);
                    ends.push((*at, what));
                }
            }
            _ => {}
        }
    }
    for (_, list) in open {
        for (_, what) in list {
            v.violation(format!("fault {what} never ended"));
        }
    }
    let completed: Vec<f64> = entries
        .iter()
        .filter_map(|e| match e {
            Entry::SnapshotStarted { at, id, .. }
                if snapshots.get(id).is_some_and(|s| s.status == "COMPLETED") =>
            {
                Some(*at)
            }
            _ => None,
        })
        .collect();
    for (end, what) in ends {
        match completed.iter().find(|&&at| at >= end) {
            Some(at) => {
                let took = at - end;
                v.longest_recovery_s = v.longest_recovery_s.max(took);
                if took > bound_s {
                    v.violation(format!(
                        "after fault {what}, ended at {end:.1}s, the first snapshot to complete \
                         started {took:.1}s later (bound {bound_s}s)"
                    ));
                }
            }
            None => v.violation(format!(
                "after fault {what}, ended at {end:.1}s, no snapshot completed"
            )),
        }
    }
}

/// Faults that end with a heal line (a pause, a hold, a delay, a process down for a while,
/// a fault of the network).
pub fn heals(kind: &str) -> bool {
    kind.starts_with("pause-")
        || kind.starts_with("net-")
        || matches!(kind, "hold" | "delay" | "kill-etcd" | "kill-postgres")
}
