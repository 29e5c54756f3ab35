//! The leadership-term rule: every message from a coordinator carries its leader's term
//! (0 with the embedded store); the daemon keeps the highest term it has seen for its
//! lifetime and refuses every message of a lower one. A deposed leader that has not yet
//! noticed commands nobody.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a message's term means, against the highest term seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TermCheck {
    /// The term seen so far: act on the message.
    Same,
    /// A new, higher term: act on the message; it is now the highest.
    Raised {
        /// The highest term before.
        from: u64,
    },
    /// A lower term: a deposed leader's message, refused whole.
    Stale {
        /// The highest term seen.
        highest: u64,
    },
}

/// Compares a message's `term` with the `highest` seen (pure).
pub(crate) fn compare(highest: u64, term: u64) -> TermCheck {
    match term.cmp(&highest) {
        std::cmp::Ordering::Less => TermCheck::Stale { highest },
        std::cmp::Ordering::Equal => TermCheck::Same,
        std::cmp::Ordering::Greater => TermCheck::Raised { from: highest },
    }
}

/// Compares `term` with `highest` and raises `highest` to it if it is higher, in one step.
pub(crate) fn observe(highest: &AtomicU64, term: u64) -> TermCheck {
    let before = highest.fetch_max(term, Ordering::AcqRel);
    compare(before, term)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_is_refused_equal_passes_higher_raises() {
        assert_eq!(compare(7, 6), TermCheck::Stale { highest: 7 });
        assert_eq!(compare(7, 0), TermCheck::Stale { highest: 7 });
        assert_eq!(compare(7, 7), TermCheck::Same);
        assert_eq!(compare(7, 9), TermCheck::Raised { from: 7 });
    }

    #[test]
    fn the_highest_is_kept() {
        let highest = AtomicU64::new(0);
        // The embedded store's coordinator: 0, then 0 again.
        assert_eq!(observe(&highest, 0), TermCheck::Same);
        assert_eq!(observe(&highest, 0), TermCheck::Same);
        assert_eq!(observe(&highest, 5), TermCheck::Raised { from: 0 });
        assert_eq!(observe(&highest, 5), TermCheck::Same);
        // A deposed leader's message leaves the highest as it was.
        assert_eq!(observe(&highest, 3), TermCheck::Stale { highest: 5 });
        assert_eq!(highest.load(Ordering::Acquire), 5);
        assert_eq!(observe(&highest, 12), TermCheck::Raised { from: 5 });
        assert_eq!(observe(&highest, 5), TermCheck::Stale { highest: 12 });
    }
}
