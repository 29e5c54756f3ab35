//! A bank's state and its transfers: the balance, the ids sent and received per peer, and a
//! delivered transfer checked (decoded, its id in sequence, its credit within the balance)
//! before it is applied.

use std::collections::BTreeMap;

use bytes::Bytes;
use rand::Rng;
use serde::{Deserialize, Serialize};

/// The recorded state of a bank. The fields beyond `balance` are absent from states of
/// older banks (`{"balance": N}` still parses).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BankState {
    /// The balance.
    pub balance: u64,
    /// The line of this bank's transfers: drawn at random when the bank starts with a
    /// fresh balance, kept through a restore (it is part of the state restored).
    #[serde(default)]
    pub line: u64,
    /// Per peer, the id of the last transfer sent to it (of `line`): ids are 1, 2, ….
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sent: BTreeMap<String, u64>,
    /// Per peer, the last transfer received from it: the sender's line and id.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub received: BTreeMap<String, Received>,
    /// With a ledger: the snapshots whose ledger transactions were pre-committed and not
    /// committed at the cut (the sink's state), ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ledger_pending: Vec<u64>,
    /// With a ledger, when the cut carried its transaction: the transfers applied since
    /// the last cut that pre-committed, written again after a restore of this state.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ledger_open: Vec<super::LedgerRow>,
}

/// The last transfer received from one peer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Received {
    /// The sender's line.
    pub line: u64,
    /// The id of its last transfer applied.
    pub id: u64,
}

/// A transfer's payload. `line` and `id` are 0 in payloads of older banks and of
/// of other programs sending on the bank's session (applied without an order check).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferPayload {
    /// The amount moved.
    pub amount: u64,
    /// The sender's line.
    #[serde(default)]
    pub line: u64,
    /// The transfer's id in the sender's line, towards this receiver (1, 2, …).
    #[serde(default)]
    pub id: u64,
}

/// Where a delivered transfer stands in its sender's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// The next id of the line followed.
    Next,
    /// The payload carries no id (an older bank's, or one made by hand).
    Untracked,
    /// The first transfer seen from this sender (this bank started with a fresh balance,
    /// with any id), or transfer 1 of a new line of it (the sender did): followed from here.
    NewLine,
    /// An id at or below the last applied: a duplicate.
    Duplicate,
    /// This many ids were skipped: a loss.
    Skipped(u64),
}

impl BankState {
    /// A bank's state when it starts: `balance`, a fresh random line, nothing sent or
    /// received.
    pub fn fresh(balance: u64) -> Self {
        Self {
            balance,
            line: rand::rng().random_range(1..=u64::MAX >> 11),
            ..Self::default()
        }
    }

    /// Applies a delivered transfer from `from`: credits it and tells where it stands in
    /// the sender's order (a duplicate or a gap is applied too, and reported). A payload
    /// that does not decode, or a credit that would overflow, is rejected and changes
    /// nothing.
    pub fn receive(&mut self, from: &str, payload: &[u8]) -> Result<Order, Rejected> {
        let transfer =
            TransferPayload::decode(payload).map_err(|e| Rejected::Malformed(e.to_string()))?;
        self.balance = self
            .balance
            .checked_add(transfer.amount)
            .ok_or(Rejected::Overflow {
                balance: self.balance,
                amount: transfer.amount,
            })?;
        if transfer.id == 0 {
            return Ok(Order::Untracked);
        }
        let seen = Received {
            line: transfer.line,
            id: transfer.id,
        };
        let Some(last) = self.received.get_mut(from) else {
            self.received.insert(from.to_owned(), seen);
            return Ok(if transfer.id == 1 {
                Order::Next
            } else {
                Order::NewLine
            });
        };
        if last.line != transfer.line {
            // The sender started afresh: its new line begins at 1, and anything before the
            // first one seen was lost.
            *last = seen;
            return Ok(match transfer.id {
                1 => Order::NewLine,
                id => Order::Skipped(id - 1),
            });
        }
        let order = match transfer.id.checked_sub(last.id) {
            Some(1) => Order::Next,
            None | Some(0) => return Ok(Order::Duplicate),
            Some(n) => Order::Skipped(n - 1),
        };
        last.id = transfer.id;
        Ok(order)
    }
}

impl TransferPayload {
    /// The payload's bytes.
    pub fn encode(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).expect("plain struct"))
    }

    /// Parses a payload.
    pub fn decode(payload: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(payload)
    }
}

/// Why a delivered transfer was not applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejected {
    /// The payload is not a transfer.
    Malformed(String),
    /// Crediting it would overflow the balance.
    Overflow {
        /// The balance before.
        balance: u64,
        /// The amount delivered.
        amount: u64,
    },
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Malformed(e) => write!(f, "the payload is not a transfer: {e}"),
            Self::Overflow { balance, amount } => write!(
                f,
                "crediting {amount} to the balance {balance} would overflow it (u64)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(amount: u64) -> Bytes {
        TransferPayload {
            amount,
            ..Default::default()
        }
        .encode()
    }

    /// `credit` as it was: the balance after a delivery, or why it was refused.
    fn credit(balance: &mut u64, payload: &[u8]) -> Result<u64, Rejected> {
        let mut state = BankState {
            balance: *balance,
            ..Default::default()
        };
        state.receive("n1", payload)?;
        *balance = state.balance;
        Ok(state.balance)
    }

    #[test]
    fn a_transfer_is_credited() {
        let mut balance = 10;
        assert_eq!(credit(&mut balance, &payload(5)), Ok(15));
        assert_eq!(balance, 15);
    }

    #[test]
    fn a_credit_that_would_overflow_is_rejected_and_not_applied() {
        let mut balance = u64::MAX - 3;
        assert_eq!(
            credit(&mut balance, &payload(4)),
            Err(Rejected::Overflow {
                balance: u64::MAX - 3,
                amount: 4
            })
        );
        assert_eq!(balance, u64::MAX - 3, "the balance did not wrap");
        assert_eq!(credit(&mut balance, &payload(3)), Ok(u64::MAX));
        assert!(credit(&mut balance, &payload(u64::MAX)).is_err());
        assert_eq!(balance, u64::MAX);
    }

    #[test]
    fn a_payload_that_does_not_decode_is_rejected_and_not_applied() {
        let mut balance = 7;
        for bad in [
            &b"garbage"[..],
            b"",
            br#"{"amount":-1}"#,
            br#"{"amount":18446744073709551616}"#,
            br#"{"amount":"5"}"#,
        ] {
            let result = credit(&mut balance, bad);
            assert!(
                matches!(result, Err(Rejected::Malformed(_))),
                "{:?}: {result:?}",
                String::from_utf8_lossy(bad)
            );
            assert_eq!(balance, 7);
        }
    }

    fn transfer(line: u64, id: u64) -> Bytes {
        TransferPayload {
            amount: 1,
            line,
            id,
        }
        .encode()
    }

    #[test]
    fn transfer_ids_tell_duplicates_gaps_and_new_lines() {
        let mut state = BankState::fresh(0);
        assert_ne!(state.line, 0);
        assert_eq!(state.receive("a", &transfer(7, 1)), Ok(Order::Next));
        assert_eq!(state.receive("a", &transfer(7, 2)), Ok(Order::Next));
        assert_eq!(state.receive("a", &transfer(7, 2)), Ok(Order::Duplicate));
        assert_eq!(state.receive("a", &transfer(7, 1)), Ok(Order::Duplicate));
        assert_eq!(state.receive("a", &transfer(7, 5)), Ok(Order::Skipped(2)));
        assert_eq!(state.receive("a", &transfer(7, 6)), Ok(Order::Next));
        // The sender started afresh: its new line is followed from transfer 1; a later first
        // one means the ones before it were lost.
        assert_eq!(state.receive("a", &transfer(9, 1)), Ok(Order::NewLine));
        assert_eq!(state.receive("a", &transfer(9, 2)), Ok(Order::Next));
        assert_eq!(state.receive("a", &transfer(8, 3)), Ok(Order::Skipped(2)));
        assert_eq!(state.receive("a", &transfer(8, 4)), Ok(Order::Next));
        // Another sender, joined in the middle of its line; and a transfer by hand.
        assert_eq!(state.receive("b", &transfer(3, 40)), Ok(Order::NewLine));
        assert_eq!(state.receive("b", &payload(1)), Ok(Order::Untracked));
        // Every one of them was credited.
        assert_eq!(state.balance, 12);
        assert_eq!(state.received["a"], Received { line: 8, id: 4 });
        assert_eq!(state.received["b"], Received { line: 3, id: 40 });
        // The state round-trips through its JSON, and an older bank's state still parses.
        let json = serde_json::to_vec(&state).unwrap();
        assert_eq!(serde_json::from_slice::<BankState>(&json).unwrap(), state);
        let old: BankState = serde_json::from_slice(br#"{"balance":5}"#).unwrap();
        assert_eq!((old.balance, old.line, old.sent.len()), (5, 0, 0));
    }
}
