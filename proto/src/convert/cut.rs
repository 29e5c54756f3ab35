//! The two sides of a channel's cut, as parts report them.

use cairn_core::{ChannelId, IncomingCut, OutgoingCut};

use super::{ConvertError, channel_from_pb};
use crate::v1 as pb;

/// The receiving side of a cut, with the range the receiver recorded.
impl From<(&ChannelId, &IncomingCut)> for pb::IncomingCut {
    fn from((channel, cut): (&ChannelId, &IncomingCut)) -> Self {
        let recorded = cut.recorded();
        Self {
            channel: Some(channel.into()),
            delivered: cut.delivered,
            marker_at: cut.marker_at,
            recorded_from: recorded.start,
            recorded_to: recorded.end,
        }
    }
}

/// The sending side of a cut, with the range the sender recorded.
impl From<(&ChannelId, &OutgoingCut)> for pb::OutgoingCut {
    fn from((channel, cut): (&ChannelId, &OutgoingCut)) -> Self {
        let recorded = cut.recorded();
        Self {
            channel: Some(channel.into()),
            sent: cut.sent,
            marker_at: cut.marker_at,
            recorded_from: recorded.start,
            recorded_to: recorded.end,
        }
    }
}

/// The receiving side of a cut from the wire (the recorded range follows from it).
impl TryFrom<&pb::IncomingCut> for (ChannelId, IncomingCut) {
    type Error = ConvertError;

    fn try_from(cut: &pb::IncomingCut) -> Result<Self, ConvertError> {
        Ok((
            channel_from_pb(cut.channel.as_ref())?,
            IncomingCut {
                delivered: cut.delivered,
                marker_at: cut.marker_at,
            },
        ))
    }
}

/// The sending side of a cut from the wire (the recorded range follows from it).
impl TryFrom<&pb::OutgoingCut> for (ChannelId, OutgoingCut) {
    type Error = ConvertError;

    fn try_from(cut: &pb::OutgoingCut) -> Result<Self, ConvertError> {
        Ok((
            channel_from_pb(cut.channel.as_ref())?,
            OutgoingCut {
                sent: cut.sent,
                marker_at: cut.marker_at,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_round_trip() {
        let channel = ChannelId::new("a", "b");
        let incoming = IncomingCut {
            delivered: 3,
            marker_at: 5,
        };
        let wire = pb::IncomingCut::from((&channel, &incoming));
        assert_eq!((wire.recorded_from, wire.recorded_to), (3, 5));
        assert_eq!(
            <(ChannelId, IncomingCut)>::try_from(&wire),
            Ok((channel.clone(), incoming))
        );
        let outgoing = OutgoingCut {
            sent: 9,
            marker_at: 4,
        };
        let wire = pb::OutgoingCut::from((&channel, &outgoing));
        assert_eq!((wire.recorded_from, wire.recorded_to), (4, 9));
        assert_eq!(
            <(ChannelId, OutgoingCut)>::try_from(&wire),
            Ok((channel, outgoing))
        );
    }

    #[test]
    fn a_cut_without_its_channel_is_refused() {
        let wire = pb::IncomingCut::default();
        assert_eq!(
            <(ChannelId, IncomingCut)>::try_from(&wire)
                .unwrap_err()
                .field(),
            "channel"
        );
    }
}
