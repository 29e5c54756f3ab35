//! Snapshot modes.

use cairn_core::SnapshotMode;

use super::ConvertError;
use crate::v1 as pb;

impl From<SnapshotMode> for pb::SnapshotMode {
    fn from(mode: SnapshotMode) -> Self {
        match mode {
            SnapshotMode::ChandyLamport => Self::ChandyLamport,
            SnapshotMode::Unaligned => Self::Unaligned,
            SnapshotMode::Aligned => Self::Aligned,
        }
    }
}

/// UNSPECIFIED is refused: [`mode_from_pb`] takes a default for it.
impl TryFrom<pb::SnapshotMode> for SnapshotMode {
    type Error = ConvertError;

    fn try_from(mode: pb::SnapshotMode) -> Result<Self, ConvertError> {
        match mode {
            pb::SnapshotMode::ChandyLamport => Ok(Self::ChandyLamport),
            pb::SnapshotMode::Unaligned => Ok(Self::Unaligned),
            pb::SnapshotMode::Aligned => Ok(Self::Aligned),
            pb::SnapshotMode::Unspecified => Err(ConvertError::Missing("snapshot mode")),
        }
    }
}

/// The domain mode of a wire value (a message's `mode` field); UNSPECIFIED becomes
/// `default` when given, else an error, as does a value no mode has.
pub fn mode_from_pb(
    value: i32,
    default: Option<SnapshotMode>,
) -> Result<SnapshotMode, ConvertError> {
    match pb::SnapshotMode::try_from(value) {
        Ok(pb::SnapshotMode::Unspecified) if default.is_some() => Ok(default.unwrap_or_default()),
        Ok(mode) => SnapshotMode::try_from(mode),
        Err(_) => Err(ConvertError::Invalid {
            field: "mode",
            why: format!("unknown snapshot mode {value}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mode_round_trips() {
        for mode in [
            SnapshotMode::ChandyLamport,
            SnapshotMode::Unaligned,
            SnapshotMode::Aligned,
        ] {
            let wire = pb::SnapshotMode::from(mode);
            assert_eq!(SnapshotMode::try_from(wire), Ok(mode));
            assert_eq!(mode_from_pb(wire as i32, None), Ok(mode));
        }
    }

    #[test]
    fn unspecified_takes_the_default_or_is_refused() {
        let unset = pb::SnapshotMode::Unspecified as i32;
        assert_eq!(
            mode_from_pb(unset, Some(SnapshotMode::Aligned)),
            Ok(SnapshotMode::Aligned)
        );
        let err = mode_from_pb(unset, None).unwrap_err();
        assert_eq!(err.to_string(), "snapshot mode is not set");
        let err = mode_from_pb(42, Some(SnapshotMode::Aligned)).unwrap_err();
        assert_eq!(err.field(), "mode");
        assert_eq!(err.to_string(), "unknown snapshot mode 42");
    }
}
