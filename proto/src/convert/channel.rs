//! Channel references.

use cairn_core::ChannelId;

use super::{ConvertError, required};
use crate::v1 as pb;

impl From<&ChannelId> for pb::ChannelRef {
    fn from(channel: &ChannelId) -> Self {
        Self {
            from: channel.from.to_string(),
            to: channel.to.to_string(),
        }
    }
}

/// Both ends must be named.
impl TryFrom<&pb::ChannelRef> for ChannelId {
    type Error = ConvertError;

    fn try_from(channel: &pb::ChannelRef) -> Result<Self, ConvertError> {
        if channel.from.is_empty() || channel.to.is_empty() {
            return Err(ConvertError::Invalid {
                field: "channel",
                why: "channel must name both `from` and `to`".into(),
            });
        }
        Ok(ChannelId::new(channel.from.as_str(), channel.to.as_str()))
    }
}

/// A message's `channel` field, which must be set (a function: `Option` is not ours to
/// convert from).
pub fn channel_from_pb(channel: Option<&pb::ChannelRef>) -> Result<ChannelId, ConvertError> {
    ChannelId::try_from(required(channel, "channel")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_channel_round_trips() {
        let channel = ChannelId::new("a", "b");
        let wire = pb::ChannelRef::from(&channel);
        assert_eq!(channel_from_pb(Some(&wire)), Ok(channel));
    }

    #[test]
    fn a_channel_must_be_set_and_name_both_ends() {
        assert_eq!(
            channel_from_pb(None).unwrap_err().to_string(),
            "channel is not set"
        );
        let half = pb::ChannelRef {
            from: "a".into(),
            to: String::new(),
        };
        assert_eq!(
            ChannelId::try_from(&half).unwrap_err().to_string(),
            "channel must name both `from` and `to`"
        );
    }
}
