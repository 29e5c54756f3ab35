//! Failure reasons, losslessly in both directions.
//!
//! The wire carries a stable `kind`, the reason's sentence (`message`, the domain's
//! `Display`), the nodes and the channel concerned, and the variant's own words
//! (`detail`, absent when there are none). Every domain variant maps to one kind (a user's
//! abort to `KIND_UNSPECIFIED`, as it always has), and back: each part from its own field.
//! A reason without `detail` — one with no words of its own, or from a sender older than
//! the field — is read as senders' reasons always were: its words are its sentence after
//! the words its kind puts before them (`words_of_sentence`), so a rolling upgrade reads
//! an older daemon's failures as that daemon meant them.
//!
//! An inconsistent cut is judged by the coordinator's verifier, which stores and sends
//! only the violation's sentence: no [`Violation`] ever crosses the wire structured, and
//! one read back from the wire (or the store) is a [`Violation::Described`] with that
//! sentence, which displays as the original did.

use cairn_core::failure::FailureKind;
use cairn_core::{FailureReason, NodeId, Violation};

use super::{ConvertError, channel_from_pb};
use crate::v1 as pb;
use pb::failure_reason::Kind;

impl From<&FailureReason> for pb::FailureReason {
    fn from(reason: &FailureReason) -> Self {
        Self {
            kind: Kind::from(reason.kind()) as i32,
            message: reason.to_string(),
            nodes: reason.nodes().iter().map(ToString::to_string).collect(),
            channel: reason.channel().map(Into::into),
            detail: Some(reason.detail()).filter(|words| !words.is_empty()),
        }
    }
}

impl From<FailureKind> for Kind {
    fn from(kind: FailureKind) -> Self {
        match kind {
            FailureKind::Aborted => Kind::Unspecified,
            FailureKind::Timeout => Kind::Timeout,
            FailureKind::NodeLost => Kind::NodeLost,
            FailureKind::ChannelReset => Kind::ChannelReset,
            FailureKind::Inconsistent => Kind::Inconsistent,
            FailureKind::NoApplication => Kind::NoApplication,
            FailureKind::CoordinatorRestarted => Kind::CoordinatorRestarted,
            FailureKind::Restore => Kind::Restore,
            FailureKind::Shutdown => Kind::Shutdown,
            FailureKind::Storage => Kind::Storage,
            FailureKind::MembershipChanged => Kind::MembershipChanged,
            FailureKind::MixedEpochs => Kind::MixedEpochs,
            FailureKind::CoordinatorFailover => Kind::CoordinatorFailover,
            FailureKind::BadCut => Kind::BadCut,
        }
    }
}

/// The domain's kind of a wire kind (`KIND_UNSPECIFIED` is a user's abort).
fn domain_kind(kind: Kind) -> FailureKind {
    FailureKind::ALL
        .into_iter()
        .find(|k| Kind::from(*k) == kind)
        .unwrap_or(FailureKind::Aborted)
}

/// Exact for every kind; a kind that names one node needs it in `nodes`, a channel reset
/// its `channel`.
impl TryFrom<&pb::FailureReason> for FailureReason {
    type Error = ConvertError;

    fn try_from(reason: &pb::FailureReason) -> Result<Self, ConvertError> {
        let kind = Kind::try_from(reason.kind).map_err(|_| ConvertError::Invalid {
            field: "kind",
            why: format!("unknown failure kind {}", reason.kind),
        })?;
        let nodes = || {
            reason
                .nodes
                .iter()
                .map(|n| NodeId::new(n.clone()))
                .collect()
        };
        let node = || {
            reason
                .nodes
                .first()
                .map(|n| NodeId::new(n.clone()))
                .ok_or(ConvertError::Missing("nodes"))
        };
        let text = || match &reason.detail {
            Some(words) => words.clone(),
            None => words_of_sentence(kind, &reason.message),
        };
        Ok(match kind {
            Kind::Unspecified => Self::Aborted(text()),
            Kind::Timeout => Self::Timeout { missing: nodes() },
            Kind::NodeLost => Self::NodeLost(node()?),
            Kind::ChannelReset => Self::ChannelReset(channel_from_pb(reason.channel.as_ref())?),
            Kind::Inconsistent => Self::Inconsistent(Violation::Described(text())),
            Kind::NoApplication => Self::NoApplication(node()?),
            Kind::CoordinatorRestarted => Self::CoordinatorRestarted,
            Kind::CoordinatorFailover => Self::CoordinatorFailover(text()),
            Kind::Restore => Self::Restore,
            Kind::Shutdown => Self::Shutdown(node()?),
            Kind::Storage => Self::Storage {
                nodes: nodes(),
                why: text(),
            },
            Kind::MembershipChanged => Self::MembershipChanged(text()),
            Kind::MixedEpochs => Self::MixedEpochs {
                nodes: nodes(),
                detail: text(),
            },
            Kind::BadCut => Self::BadCut {
                node: node()?,
                why: text(),
            },
        })
    }
}

/// The words a reason's `Display` puts before its own, by kind.
fn kind_words(kind: Kind) -> &'static str {
    match kind {
        Kind::Inconsistent => "inconsistent cut: ",
        Kind::MixedEpochs => "parts recorded in different epochs: ",
        Kind::Storage => "storage failed: ",
        Kind::Unspecified => "aborted: ",
        Kind::MembershipChanged => "membership changed: ",
        Kind::CoordinatorFailover => "coordinator failover: ",
        Kind::BadCut => "bad cut at node ",
        _ => "",
    }
}

/// The words of a reason that carries no `detail`: its sentence after its kind's words
/// (a sentence without them is taken whole). Only for reasons without the field: a sender
/// older than it, or a reason whose words are empty.
fn words_of_sentence(kind: Kind, message: &str) -> String {
    message
        .strip_prefix(kind_words(kind))
        .unwrap_or(message)
        .to_owned()
}

/// A kind's stable word, as the store and scripts spell it ([`FailureKind::word`]:
/// `ABORTED` for `KIND_UNSPECIFIED`, a user's abort).
pub fn kind_word(kind: Kind) -> &'static str {
    domain_kind(kind).word()
}

/// The kind of a stable word ([`kind_word`]'s inverse); a word no kind has is
/// `KIND_UNSPECIFIED`.
pub fn kind_from_word(word: &str) -> Kind {
    FailureKind::of_word(word).map_or(Kind::Unspecified, Kind::from)
}

#[cfg(test)]
pub(crate) mod tests {
    use cairn_core::{ChannelId, Side};

    use super::*;

    /// One reason of every variant (with a violation as the verifier makes one).
    pub(crate) fn every_reason() -> Vec<FailureReason> {
        vec![
            FailureReason::Timeout {
                missing: vec!["a".into(), "b".into()],
            },
            FailureReason::NodeLost("a".into()),
            FailureReason::ChannelReset(ChannelId::new("a", "b")),
            FailureReason::Inconsistent(Violation::WrongMessages {
                channel: ChannelId::new("a", "b"),
                side: Side::Receiver,
                expected: 3..5,
                recorded: "messages 3..4".into(),
            }),
            FailureReason::NoApplication("a".into()),
            FailureReason::CoordinatorRestarted,
            FailureReason::CoordinatorFailover("term 7 ended; term 9 took over".into()),
            FailureReason::Restore,
            FailureReason::Shutdown("b".into()),
            FailureReason::Storage {
                nodes: vec![NodeId::new("a")],
                why: "upload of a's part failed: no space".into(),
            },
            FailureReason::Aborted("by the operator: done".into()),
            FailureReason::MembershipChanged("node c joined".into()),
            FailureReason::MixedEpochs {
                nodes: vec!["b".into()],
                detail: "b recorded in epoch 2, the snapshot is of epoch 1".into(),
            },
            FailureReason::BadCut {
                node: "b".into(),
                why: "the application cut its state after 5 messages consumed, but was asked \
                      after 0 handed over"
                    .into(),
            },
        ]
    }

    #[test]
    fn every_kind_round_trips_through_the_wire() {
        let reasons = every_reason();
        let kinds: std::collections::BTreeSet<i32> = reasons
            .iter()
            .map(|r| pb::FailureReason::from(r).kind)
            .collect();
        assert_eq!(
            kinds.len(),
            FailureKind::ALL.len(),
            "one reason of every wire kind"
        );
        for reason in reasons {
            let wire = pb::FailureReason::from(&reason);
            let back = FailureReason::try_from(&wire).unwrap();
            match (&reason, &back) {
                // The verifier's violation comes back as its sentence.
                (FailureReason::Inconsistent(v), FailureReason::Inconsistent(b)) => {
                    assert_eq!(*b, Violation::Described(v.to_string()));
                }
                _ => assert_eq!(back, reason),
            }
            assert_eq!(back.to_string(), reason.to_string());
            assert_eq!(pb::FailureReason::from(&back), wire, "{reason}");
        }
    }

    #[test]
    fn every_kind_has_its_word() {
        for kind in FailureKind::ALL.map(Kind::from) {
            assert_eq!(kind_from_word(kind_word(kind)), kind);
            if kind != Kind::Unspecified {
                assert_eq!(
                    kind.as_str_name().strip_prefix("KIND_"),
                    Some(kind_word(kind))
                );
            }
        }
        assert_eq!(kind_from_word("UNSPECIFIED"), Kind::Unspecified);
        assert_eq!(kind_from_word("no such kind"), Kind::Unspecified);
    }

    #[test]
    fn the_words_come_from_detail_and_an_older_senders_sentence_is_read_as_before() {
        let storage = |message: &str, detail: Option<&str>| pb::FailureReason {
            kind: Kind::Storage as i32,
            message: message.into(),
            detail: detail.map(str::to_owned),
            ..Default::default()
        };
        let why = |wire: pb::FailureReason| match FailureReason::try_from(&wire) {
            Ok(FailureReason::Storage { why, .. }) => why,
            other => panic!("{other:?}"),
        };
        // The words are the detail field's, whatever the sentence says.
        let current = storage("storage failed: disk full", Some("disk full"));
        assert_eq!(why(current), "disk full");
        assert_eq!(
            why(storage("anything at all", Some("disk full"))),
            "disk full"
        );
        // A sender from before `detail`: its words are its sentence after the kind's.
        assert_eq!(why(storage("storage failed: disk full", None)), "disk full");
        assert_eq!(why(storage("disk full", None)), "disk full");
        // Empty words travel as no detail, and come back empty.
        let empty = FailureReason::Storage {
            nodes: vec![],
            why: String::new(),
        };
        let wire = pb::FailureReason::from(&empty);
        assert_eq!(wire.detail, None);
        assert_eq!(FailureReason::try_from(&wire), Ok(empty));
    }

    #[test]
    fn missing_nodes_channels_and_unknown_kinds_are_named() {
        let wire = |kind: Kind| pb::FailureReason {
            kind: kind as i32,
            ..Default::default()
        };
        for kind in [Kind::NodeLost, Kind::NoApplication, Kind::Shutdown] {
            assert_eq!(
                FailureReason::try_from(&wire(kind)),
                Err(ConvertError::Missing("nodes"))
            );
        }
        assert_eq!(
            FailureReason::try_from(&wire(Kind::ChannelReset)),
            Err(ConvertError::Missing("channel"))
        );
        let unknown = pb::FailureReason {
            kind: 99,
            ..Default::default()
        };
        assert_eq!(
            FailureReason::try_from(&unknown).unwrap_err().field(),
            "kind"
        );
    }
}
