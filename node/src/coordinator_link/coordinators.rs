//! Which coordinator replica the link tries next, and how long it waits first.
//!
//! The daemon is given one address or several (`--coordinator a:7000,b:7000,c:7000`) and
//! tries them in turn, backing off exponentially. A replica that is not the leader answers
//! UNAVAILABLE with the leader's address in the `cairn-leader` metadata; the next attempt
//! goes there after a short pause, with the backoff reset. Such redirects are bounded: after
//! [`MAX_REDIRECTS`] since the last registered session, hints are ignored and the daemon
//! goes round its list with the ordinary backoff, until that backoff reaches its maximum
//! (then it follows hints again). Replicas naming each other in a loop cost a few quick
//! attempts and then a growing pause, never a spin. When a registered session ends, the
//! replica after the one it was with is asked first (a frozen leader is not dialled again
//! before the others). Pure: the link applies the jitter.

use std::time::Duration;

use crate::config::check_host_port;

/// The pause before following a leader hint (the link's jitter makes it 50 to 100 ms or so).
pub(crate) const REDIRECT_PAUSE: Duration = Duration::from_millis(75);
/// Hints followed since the last registered session before they are ignored.
pub(crate) const MAX_REDIRECTS: u32 = 8;
/// The first pause after a failed attempt without a hint; doubled after each.
pub(crate) const BACKOFF_INITIAL: Duration = Duration::from_millis(100);
/// The longest pause between attempts.
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The longest pause within one turn of the list after a replica answered (refused with a
/// status): a live replica that leads nobody yet is in an election, which ends within a lease
/// TTL, so the daemon keeps asking at this pace rather than backing off to
/// [`BACKOFF_MAX`] and registering seconds after the new leader is there.
pub(crate) const LIVE_PAUSE_MAX: Duration = Duration::from_millis(250);

/// What became of a leader hint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Redirect {
    /// The next attempt goes to the hinted address.
    Taken,
    /// Not a `HOST:PORT` fit to dial: ignored (why).
    Invalid(String),
    /// Too many redirects since the last registered session: ignored.
    TooMany,
}

/// The coordinator addresses and where the link is among them.
#[derive(Debug, Clone)]
pub(crate) struct Coordinators {
    /// The addresses given (`--coordinator`), at least one.
    list: Vec<String>,
    /// The index in `list` of the next address to try without a hint.
    next: usize,
    /// A leader's address to try next, once.
    hint: Option<String>,
    /// Hints followed since the last registered session.
    redirects: u32,
    /// The next pause after a failed attempt without a hint.
    backoff: Duration,
    /// Attempts since a replica last answered (`None`: none has since the last
    /// registration).
    since_answer: Option<usize>,
}

impl Coordinators {
    /// The addresses to try in turn (checked by `NodeConfig::topology`; not empty).
    pub(crate) fn new(list: Vec<String>) -> Self {
        Self {
            list,
            next: 0,
            hint: None,
            redirects: 0,
            backoff: BACKOFF_INITIAL,
            since_answer: None,
        }
    }

    /// The address of the next attempt: a hint taken since the last attempt, else the
    /// next address of the list in turn.
    pub(crate) fn next_address(&mut self) -> String {
        if let Some(hint) = self.hint.take() {
            return hint;
        }
        let Some(address) = self.list.get(self.next).cloned() else {
            return String::new(); // no list: the connect fails naming the empty address
        };
        self.next = (self.next + 1) % self.list.len();
        address
    }

    /// A failed attempt or session named the leader (`cairn-leader`): unless the hint is
    /// malformed or there were too many redirects, the next attempt goes there, after
    /// [`REDIRECT_PAUSE`], with the backoff reset.
    pub(crate) fn redirected_to(&mut self, hint: &str) -> Redirect {
        if let Err(why) = check_host_port(hint) {
            return Redirect::Invalid(why);
        }
        if self.redirects >= MAX_REDIRECTS {
            if self.backoff < BACKOFF_MAX {
                return Redirect::TooMany;
            }
            // A long pause has been waited out: hints may be followed again.
            self.redirects = 0;
        }
        self.redirects += 1;
        self.hint = Some(hint.to_owned());
        self.backoff = BACKOFF_INITIAL;
        Redirect::Taken
    }

    /// A session with `address` registered: the redirects start over, and so does the
    /// backoff; and once it ends, the next attempt goes to the replica after it in the list.
    /// A leader that stopped answering (frozen, cut off) would otherwise be dialled again
    /// first and cost a connect timeout before the replica that leads now is asked (the
    /// nemesis saw 4 s of it); a leader that merely dropped the session is named by the
    /// next replica's hint, 75 ms away.
    pub(crate) fn registered(&mut self, address: &str) {
        self.redirects = 0;
        self.backoff = BACKOFF_INITIAL;
        self.since_answer = None;
        if let Some(i) = self.list.iter().position(|a| a == address) {
            self.next = (i + 1) % self.list.len();
        }
    }

    /// The replica just asked answered UNAVAILABLE (it is alive, and leads nobody yet or
    /// names the leader).
    pub(crate) fn answered(&mut self) {
        self.since_answer = Some(0);
    }

    /// The pause before the next attempt, after a failed one: short if a hint was taken,
    /// else the backoff, which doubles (up to [`BACKOFF_MAX`]) for the time after.
    pub(crate) fn pause(&mut self) -> Duration {
        if self.hint.is_some() {
            return REDIRECT_PAUSE;
        }
        let mut pause = self.backoff;
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        // Within one turn of the list after a replica answered: an election, not an outage.
        if let Some(n) = self.since_answer {
            if n < self.list.len().max(1) {
                pause = pause.min(LIVE_PAUSE_MAX);
            }
            self.since_answer = Some(n.saturating_add(1));
        }
        pause
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three() -> Coordinators {
        Coordinators::new(vec!["a:7000".into(), "b:7000".into(), "c:7000".into()])
    }

    #[test]
    fn addresses_are_tried_in_turn() {
        let mut c = three();
        let tried: Vec<String> = (0..7).map(|_| c.next_address()).collect();
        assert_eq!(
            tried,
            [
                "a:7000", "b:7000", "c:7000", "a:7000", "b:7000", "c:7000", "a:7000"
            ]
        );
        let mut one = Coordinators::new(vec!["cairn-coordinator:7000".into()]);
        assert_eq!(one.next_address(), "cairn-coordinator:7000");
        assert_eq!(one.next_address(), "cairn-coordinator:7000");
    }

    #[test]
    fn the_backoff_doubles_up_to_its_maximum_and_a_registration_resets_it() {
        let mut c = three();
        let pauses: Vec<u64> = (0..8).map(|_| c.pause().as_millis() as u64).collect();
        assert_eq!(pauses, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        c.registered("elsewhere:7000");
        assert_eq!(c.pause(), BACKOFF_INITIAL);
    }

    #[test]
    fn a_hint_is_taken_once_at_once_and_resets_the_backoff() {
        let mut c = three();
        assert_eq!(c.next_address(), "a:7000");
        for _ in 0..4 {
            c.pause();
        }
        // The hint need not be in the list.
        assert_eq!(c.redirected_to("d.example:7001"), Redirect::Taken);
        assert_eq!(c.pause(), REDIRECT_PAUSE);
        assert_eq!(c.next_address(), "d.example:7001");
        // Taken once; the rotation goes on where it was, from the first backoff.
        assert_eq!(c.pause(), BACKOFF_INITIAL);
        assert_eq!(c.next_address(), "b:7000");
        assert_eq!(c.next_address(), "c:7000");
    }

    #[test]
    fn after_a_replica_answered_the_pause_stays_short_for_a_turn_of_the_list() {
        let mut c = Coordinators::new(vec!["dead:7000".into(), "follower:7000".into()]);
        for _ in 0..6 {
            c.pause();
        }
        assert_eq!(c.pause(), BACKOFF_MAX, "nothing answered: the full backoff");
        // The follower answers (an election under way): the dead one and the follower
        // are asked again at a short pace, turn after turn while it keeps answering.
        for _ in 0..5 {
            c.answered();
            assert_eq!(c.pause(), LIVE_PAUSE_MAX);
            assert_eq!(c.pause(), LIVE_PAUSE_MAX);
        }
        // A whole turn without an answer: the backoff again.
        assert_eq!(c.pause(), BACKOFF_MAX);
        c.registered("elsewhere:7000");
        assert_eq!(c.pause(), BACKOFF_INITIAL);
    }

    #[test]
    fn invalid_hints_are_ignored() {
        let mut c = three();
        assert_eq!(c.next_address(), "a:7000");
        let long = format!("{}:7000", "h".repeat(300));
        for hint in [
            "",
            "b",
            "b:",
            "b:0",
            "b:99999",
            "http://evil:80/",
            "user@b:7000",
            "b 7000",
            "b:7000\n",
            "b\u{e9}:7000",
            &long,
        ] {
            assert!(
                matches!(c.redirected_to(hint), Redirect::Invalid(_)),
                "{hint:?}"
            );
        }
        assert_eq!(c.pause(), BACKOFF_INITIAL);
        assert_eq!(c.next_address(), "b:7000");
        assert_eq!(c.redirected_to("[::1]:7000"), Redirect::Taken);
        assert_eq!(c.next_address(), "[::1]:7000");
    }

    #[test]
    fn redirects_are_bounded_and_a_ping_pong_does_not_spin() {
        let mut c = three();
        assert_eq!(c.next_address(), "a:7000");
        // Two replicas naming each other.
        for i in 0..MAX_REDIRECTS {
            let hint = if i % 2 == 0 { "b:7000" } else { "a:7000" };
            assert_eq!(c.redirected_to(hint), Redirect::Taken, "redirect {i}");
            assert_eq!(c.pause(), REDIRECT_PAUSE);
            assert_eq!(c.next_address(), hint);
        }
        // The next hint is ignored: the rotation and the backoff take over, and reach
        // c, which the ping-pong never named.
        assert_eq!(c.redirected_to("b:7000"), Redirect::TooMany);
        assert_eq!(c.pause(), BACKOFF_INITIAL);
        assert_eq!(c.next_address(), "b:7000");
        assert_eq!(c.redirected_to("a:7000"), Redirect::TooMany);
        assert_eq!(c.pause(), BACKOFF_INITIAL * 2);
        assert_eq!(c.next_address(), "c:7000");
        // Hints are followed again once the backoff has grown to its maximum.
        while c.backoff < BACKOFF_MAX {
            assert_eq!(c.redirected_to("a:7000"), Redirect::TooMany);
            c.pause();
        }
        assert_eq!(c.redirected_to("a:7000"), Redirect::Taken);
        assert_eq!(c.next_address(), "a:7000");
        // A registered session starts the count over.
        for _ in 1..MAX_REDIRECTS {
            assert_eq!(c.redirected_to("b:7000"), Redirect::Taken);
        }
        assert_eq!(c.redirected_to("b:7000"), Redirect::TooMany);
        c.registered("elsewhere:7000");
        assert_eq!(c.redirected_to("b:7000"), Redirect::Taken);
    }

    #[test]
    fn after_a_session_ends_the_replica_after_its_own_is_tried_first() {
        let mut c = three();
        assert_eq!(c.next_address(), "a:7000");
        // a names b, the leader; the session with b registers, then ends (b frozen).
        assert_eq!(c.redirected_to("b:7000"), Redirect::Taken);
        assert_eq!(c.next_address(), "b:7000");
        c.registered("b:7000");
        assert_eq!(c.next_address(), "c:7000");
        assert_eq!(c.next_address(), "a:7000");
        // A leader reached by a hint outside the list leaves the rotation as it was.
        c.registered("d.example:7001");
        assert_eq!(c.next_address(), "b:7000");
        let mut one = Coordinators::new(vec!["cairn-coordinator:7000".into()]);
        one.registered("cairn-coordinator:7000");
        assert_eq!(one.next_address(), "cairn-coordinator:7000");
    }
}
