//! Bounds on what a request may carry beside the policy's (see
//! [`cairn_core::schedule::Policy::check`]), so that no caller can make the coordinator
//! keep, store or echo unbounded data, or wait on an unbounded timer: `StartSnapshot`'s
//! timeouts and labels, `AbortSnapshot`'s reason. Every refusal is INVALID_ARGUMENT naming
//! the field (or the label) and the limit.
//!
//! Labels follow the rules of Kubernetes labels:
//!
//! - at most [`MAX_LABELS`] (64) per snapshot;
//! - a key is an optional prefix and a name, `prefix/name`: the name 1 to
//!   [`MAX_LABEL_NAME`] (63) bytes of `[A-Za-z0-9._-]`, beginning and ending with a letter
//!   or digit; the prefix, if any, a DNS subdomain of at most [`MAX_LABEL_PREFIX`] (253)
//!   bytes: lowercase letters, digits, `-` and `.`, beginning and ending with a letter or
//!   digit;
//! - a value is empty, or 1 to [`MAX_LABEL_VALUE`] (63) bytes under the name's rules.

use std::collections::HashMap;
use std::time::Duration;

use cairn_core::SnapshotMode;
use cairn_core::schedule::MAX_TIMEOUT;

use crate::error::Error;

/// The most labels a snapshot carries.
pub const MAX_LABELS: usize = 64;
/// The longest label key prefix (a DNS subdomain), in bytes.
pub const MAX_LABEL_PREFIX: usize = 253;
/// The longest label name (a key without its prefix), in bytes.
pub const MAX_LABEL_NAME: usize = 63;
/// The longest label value, in bytes.
pub const MAX_LABEL_VALUE: usize = 63;
/// The longest abort reason, in bytes.
pub const MAX_REASON: usize = 1024;
/// Most chunks one `HasChunks` call asks about (32 KiB of hashes).
pub const MAX_HAS_CHUNKS: usize = 1024;
/// The longest sentence, and the longest words, of a failure a node reports: the record
/// keeps both, and must stay storable (etcd takes 1.5 MiB a request).
pub const MAX_NODE_REASON: usize = 16 << 10;

/// `text` cut to at most `max` bytes at a character, marked `…` where it was cut (the
/// engine's, which cuts events' reasons the same way).
pub use cairn_core::record::cut;

/// At most the first 40 characters of `text`, for an error message: a refused value is
/// never echoed whole.
fn shown(text: &str) -> String {
    const SHOWN: usize = 40;
    match text.char_indices().nth(SHOWN) {
        None => format!("{text:?}"),
        Some((end, _)) => format!("{:?}… ({} bytes)", &text[..end], text.len()),
    }
}

fn invalid(why: String) -> Error {
    Error::InvalidArgument(why)
}

/// A timeout in milliseconds, 0 for the default: at most [`MAX_TIMEOUT`] (24 h).
pub fn check_timeout(field: &str, ms: u64) -> Result<(), Error> {
    if Duration::from_millis(ms) > MAX_TIMEOUT {
        return Err(invalid(format!(
            "{field}: {ms} ms is above the most allowed, {} ms (24 h)",
            MAX_TIMEOUT.as_millis()
        )));
    }
    Ok(())
}

/// `StartSnapshot`'s numbers: its timeouts, and an alignment timeout only in `mode`
/// ALIGNED (as `SetPolicy` refuses it elsewhere).
pub fn check_start(
    mode: SnapshotMode,
    timeout_ms: u64,
    alignment_timeout_ms: u64,
) -> Result<(), Error> {
    check_timeout("timeout_ms", timeout_ms)?;
    check_timeout("alignment_timeout_ms", alignment_timeout_ms)?;
    if alignment_timeout_ms > 0 && mode != SnapshotMode::Aligned {
        return Err(invalid(format!(
            "alignment_timeout_ms: an alignment timeout applies only to ALIGNED snapshots, \
             not {mode}"
        )));
    }
    Ok(())
}

/// An abort reason: at most [`MAX_REASON`] (1 KiB).
pub fn check_reason(reason: &str) -> Result<(), Error> {
    if reason.len() > MAX_REASON {
        return Err(invalid(format!(
            "reason: {} bytes is above the most allowed, {MAX_REASON}",
            reason.len()
        )));
    }
    Ok(())
}

/// The longest `StartSnapshotRequest.request_id`.
pub const MAX_REQUEST_ID: usize = 128;

/// A start's request id: empty, or 1 to [`MAX_REQUEST_ID`] bytes of ASCII letters,
/// digits and `-_.:` (a UUID, a ULID, a job's name and attempt).
pub fn check_request_id(id: &str) -> Result<(), Error> {
    if id.len() > MAX_REQUEST_ID {
        return Err(invalid(format!(
            "request_id: {} bytes is above the most allowed, {MAX_REQUEST_ID}",
            id.len()
        )));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')))
    {
        return Err(invalid(format!(
            "request_id: {c:?} is not allowed (ASCII letters, digits and `-_.:` only)"
        )));
    }
    Ok(())
}

/// Whether `text` is a label name or a non-empty value: `[A-Za-z0-9._-]`, beginning and
/// ending with a letter or digit.
fn name_like(text: &str) -> bool {
    let ends = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    ends(text.chars().next())
        && ends(text.chars().last())
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Whether `text` is a DNS subdomain: lowercase letters, digits, `-` and `.`, beginning
/// and ending with a letter or digit.
fn subdomain(text: &str) -> bool {
    let ends = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    ends(text.chars().next())
        && ends(text.chars().last())
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'))
}

fn check_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        if prefix.len() > MAX_LABEL_PREFIX {
            return Err(format!(
                "the key's prefix is {} bytes, above the most allowed, {MAX_LABEL_PREFIX}",
                prefix.len()
            ));
        }
        if !subdomain(prefix) {
            return Err(
                "the key's prefix must be a DNS subdomain (lowercase letters, digits, `-` \
                 and `.`, beginning and ending with a letter or digit)"
                    .into(),
            );
        }
    }
    if name.is_empty() {
        return Err("the key's name is empty".into());
    }
    if name.len() > MAX_LABEL_NAME {
        return Err(format!(
            "the key's name is {} bytes, above the most allowed, {MAX_LABEL_NAME}",
            name.len()
        ));
    }
    if !name_like(name) {
        return Err(
            "the key's name must be letters, digits, `-`, `_` and `.`, beginning and ending \
             with a letter or digit (and at most one `/` after a prefix)"
                .into(),
        );
    }
    Ok(())
}

fn check_value(value: &str) -> Result<(), String> {
    if value.len() > MAX_LABEL_VALUE {
        return Err(format!(
            "the value is {} bytes, above the most allowed, {MAX_LABEL_VALUE}",
            value.len()
        ));
    }
    if !value.is_empty() && !name_like(value) {
        return Err(
            "the value must be empty or letters, digits, `-`, `_` and `.`, beginning and \
             ending with a letter or digit"
                .into(),
        );
    }
    Ok(())
}

/// Labels, as Kubernetes bounds them (see the module's documentation). The error names
/// the first label at fault (keys in order), shown truncated.
pub fn check_labels(labels: &HashMap<String, String>) -> Result<(), Error> {
    if labels.len() > MAX_LABELS {
        return Err(invalid(format!(
            "labels: {} labels, above the most allowed, {MAX_LABELS}",
            labels.len()
        )));
    }
    let mut sorted: Vec<(&String, &String)> = labels.iter().collect();
    sorted.sort();
    for (key, value) in sorted {
        if let Err(why) = check_key(key).and_then(|()| check_value(value)) {
            return Err(invalid(format!("labels[{}]: {why}", shown(key))));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_short_plain_ascii() {
        for good in [
            "",
            "a",
            "0b8f0c6e-4a3c-4f43-9d55-0d9c2b7f2a11",
            "job.7:try-2",
        ] {
            assert!(check_request_id(good).is_ok(), "{good:?}");
        }
        let long = "x".repeat(MAX_REQUEST_ID + 1);
        let e = check_request_id(&long).unwrap_err().to_string();
        assert!(
            e.contains("129 bytes is above the most allowed, 128"),
            "{e}"
        );
        for bad in ["a b", "é", "a/b", "a\n"] {
            let e = check_request_id(bad).unwrap_err().to_string();
            assert!(
                e.contains("request_id:") && e.contains("is not allowed"),
                "{e}"
            );
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn refused(pairs: &[(&str, &str)]) -> String {
        check_labels(&labels(pairs)).unwrap_err().to_string()
    }

    #[test]
    fn kubernetes_like_labels_pass() {
        let ok = labels(&[
            ("scheduled", "true"),
            ("reason", "test"),
            ("app.kubernetes.io/name", "bank"),
            ("example.com/Tier_2.x", ""),
            (&"k".repeat(63), &"v".repeat(63)),
            (&format!("{}/n", "a".repeat(253)), "1"),
        ]);
        assert_eq!(check_labels(&ok).map_err(|e| e.to_string()), Ok(()));
        let many: HashMap<String, String> = (0..MAX_LABELS)
            .map(|i| (format!("k{i}"), "v".into()))
            .collect();
        assert!(check_labels(&many).is_ok());
    }

    #[test]
    fn labels_beyond_the_limits_are_refused_naming_them() {
        let huge = "x".repeat(5 << 20);
        let e = refused(&[("big", &huge)]);
        assert!(e.contains("labels[\"big\"]") && e.contains("63"), "{e}");
        assert!(e.len() < 300, "the value is not echoed: {} bytes", e.len());
        let e = refused(&[(&huge, "v")]);
        assert!(e.contains("labels[\"xxxx") && e.contains("bytes)"), "{e}");
        assert!(
            e.len() < 300,
            "the key is shown truncated: {} bytes",
            e.len()
        );
        let too_many: HashMap<String, String> = (0..=MAX_LABELS)
            .map(|i| (format!("k{i}"), "v".into()))
            .collect();
        let e = check_labels(&too_many).unwrap_err().to_string();
        assert!(e.contains("65 labels") && e.contains("64"), "{e}");
        for (key, value) in [
            ("", "v"),
            ("-lead", "v"),
            ("trail.", "v"),
            ("sp ace", "v"),
            ("é", "v"),
            ("a/b/c", "v"),
            ("UPPER.com/x", "v"),
            ("/x", "v"),
            ("x/", "v"),
            (&"k".repeat(64), "v"),
            ("k", &"v".repeat(64)),
            ("k", "-v"),
            ("k", "a b"),
            ("k", "\u{0}"),
        ] {
            let e = refused(&[(key, value)]);
            assert!(
                e.starts_with("invalid argument: labels["),
                "{key:?}={value:?}: {e}"
            );
        }
        let long_prefix = format!("{}/n", "a".repeat(254));
        assert!(refused(&[(&long_prefix, "v")]).contains("253"));
    }

    #[test]
    fn start_timeouts_and_reasons_are_bounded() {
        let day = 86_400_000;
        assert!(check_start(SnapshotMode::Aligned, day, day).is_ok());
        assert!(check_start(SnapshotMode::ChandyLamport, 0, 0).is_ok());
        let e = check_start(SnapshotMode::ChandyLamport, u64::MAX, 0).unwrap_err();
        assert!(e.to_string().contains("timeout_ms"), "{e}");
        let e = check_start(SnapshotMode::Aligned, 1, day + 1).unwrap_err();
        assert!(e.to_string().contains("alignment_timeout_ms"), "{e}");
        let e = check_start(SnapshotMode::Unaligned, 0, 100).unwrap_err();
        assert!(
            e.to_string().contains("alignment_timeout_ms") && e.to_string().contains("ALIGNED"),
            "{e}"
        );
        assert!(check_reason(&"r".repeat(1024)).is_ok());
        let e = check_reason(&"r".repeat(2048)).unwrap_err().to_string();
        assert!(e.contains("reason") && e.contains("1024"), "{e}");
    }
}
