//! Conversions between the wire types of [`v1`](crate::v1) and the domain types of
//! `cairn-core`, for every part that speaks both (the daemon, the coordinator, the tests).
//!
//! Domain to wire is infallible and written as `From<&core::X> for pb::Y`; wire to domain
//! is checked and written as `TryFrom<&pb::Y> for core::X`, failing with a
//! [`ConvertError`] that names the missing or invalid field. A function stands where a
//! trait cannot say it: a plan needs the epoch it travels in ([`plan_to_pb`]), a mode
//! arrives as a bare `i32` with a default ([`mode_from_pb`]), and a message field that
//! may be absent is an `Option` ([`channel_from_pb`], [`required`]).
//!
//! | subject | domain ⇄ wire |
//! |---|---|
//! | [`mode`] | `SnapshotMode` ⇄ `pb::SnapshotMode` |
//! | [`plan`] | `Plan` ⇄ `pb::SnapshotPlan` |
//! | [`channel`] | `ChannelId` ⇄ `pb::ChannelRef` |
//! | [`cut`] | `(ChannelId, IncomingCut)` ⇄ `pb::IncomingCut`, the same for outgoing |
//! | [`failure`] | `FailureReason` ⇄ `pb::FailureReason`, losslessly |
//! | [`control`] | registrations, commands to nodes, membership, channel status |
//! | [`policy`] | `(Policy, schedule Status)` → `pb::Policy`; policy field names |

pub mod channel;
pub mod control;
pub mod cut;
pub mod failure;
pub mod mode;
pub mod plan;
pub mod policy;

pub use channel::channel_from_pb;
pub use control::command_to_pb;
pub use failure::{kind_from_word, kind_word};
pub use mode::mode_from_pb;
pub use plan::plan_to_pb;
pub use policy::{apply_policy_update, policy_error, policy_field, policy_update_from_pb};

/// A wire message that cannot become a domain value: which field, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    /// A field the domain value needs is not set (named as people say it).
    #[error("{0} is not set")]
    Missing(&'static str),
    /// A field holds a value the domain refuses.
    #[error("{why}")]
    Invalid {
        /// The field, by its wire name.
        field: &'static str,
        /// What is wrong with it, as a sentence naming the field.
        why: String,
    },
}

impl ConvertError {
    /// The field that is missing or invalid.
    pub fn field(&self) -> &'static str {
        match self {
            Self::Missing(field) | Self::Invalid { field, .. } => field,
        }
    }
}

/// The value of a message field that must be set; `field` names it in the error.
pub fn required<'a, T>(value: Option<&'a T>, field: &'static str) -> Result<&'a T, ConvertError> {
    value.ok_or(ConvertError::Missing(field))
}
