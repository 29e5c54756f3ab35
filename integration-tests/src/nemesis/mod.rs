//! The pieces of `cairn-nemesis`: the run's history ([`history`]) and the checker that
//! judges it ([`check`]), written apart from the engine.

pub mod check;
pub mod history;

#[cfg(test)]
mod tests;
