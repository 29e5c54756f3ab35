//! The pieces of `cairn-nemesis`: the run's history ([`history`]) and the checker that
//! judges it ([`check`], with the ledger's invariant in `ledger`), written apart from the
//! engine.

pub mod check;
pub mod history;
mod ledger;
pub mod lineage;
mod verdict;

#[cfg(test)]
mod tests;
