//! Deliberately broken behaviours, for the nemesis checker's mutation check
//! (`scripts/nemesis-mutants.sh`): a daemon built with the `mutants` feature and started
//! with `CAIRN_MUTANT=<name>` misbehaves in one named way, and the checker must notice.
//! Without the feature (every build anyone runs) [`is`] is a constant `false` and the
//! planted branches compile away; the environment variable is not even read.

/// One planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutant {
    /// When recording a channel's in-flight messages, the engine's recording leaves out the
    /// last one (cairn's own verifier sees the missing index).
    RecordOneTooFew,
    /// A channel's second recorded in-flight message gets the first one's bytes: every
    /// index is there, one message is missing and one twice (only the bytes tell). Whether
    /// the messages are recorded in one batch or one by one, any snapshot with two or more
    /// in flight on a channel has it.
    RecordWrongMessage,
    /// When a channel reconnects, the first frame it should resend is dropped.
    DropFrameOnReconnect,
}

#[cfg(feature = "mutants")]
impl Mutant {
    const ALL: [(&'static str, Mutant); 3] = [
        ("record-one-too-few", Mutant::RecordOneTooFew),
        ("record-wrong-message", Mutant::RecordWrongMessage),
        ("drop-frame-on-reconnect", Mutant::DropFrameOnReconnect),
    ];
}

/// Whether `mutant` is planted in this process.
#[cfg(feature = "mutants")]
pub fn is(mutant: Mutant) -> bool {
    static ACTIVE: std::sync::OnceLock<Option<Mutant>> = std::sync::OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let name = std::env::var("CAIRN_MUTANT").ok()?;
        let found = Mutant::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, m)| *m);
        match found {
            Some(m) => tracing::error!(mutant = name, "THIS DAEMON IS A MUTANT: {m:?} is planted"),
            None => tracing::error!(mutant = name, "CAIRN_MUTANT names no mutant"),
        }
        found
    }) == Some(mutant)
}

/// Whether `mutant` is planted in this process: never, without the `mutants` feature.
#[cfg(not(feature = "mutants"))]
pub const fn is(_mutant: Mutant) -> bool {
    false
}
