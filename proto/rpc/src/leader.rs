//! How a highly available coordinator names its leader: the health service only the leader
//! serves, the response metadata in which a follower names it, and what a `HOST:PORT` such
//! a name (or a `--coordinator` list entry) may be.

use tonic::metadata::MetadataMap;

/// The gRPC health service name that is SERVING only on the leading coordinator replica
/// (NOT_SERVING on a follower).
pub const LEADER_SERVICE: &str = "cairn.v1.Leader";

/// The response metadata in which a follower names the leader (`HOST:PORT`, the leader's
/// advertised address), on every answer, errors included.
pub const LEADER_METADATA: &str = "cairn-leader";

/// The longest address (a DNS name is at most 253 bytes, plus a port).
pub const MAX_ADDRESS_LEN: usize = 255;

/// Whether `address` is a `HOST:PORT` to dial: at most [`MAX_ADDRESS_LEN`] printable
/// ASCII bytes, a host name or IPv4 address (letters, digits, `-`, `.`, `_`) or an IPv6
/// address in brackets, and a port from 1 to 65535. The error completes a sentence whose
/// subject is the address ("has no port (HOST:PORT)").
pub fn check_address(address: &str) -> Result<(), String> {
    if address.len() > MAX_ADDRESS_LEN {
        return Err(format!("is longer than {MAX_ADDRESS_LEN} bytes"));
    }
    if !address.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("holds a character that is not printable ASCII (or a space)".into());
    }
    if address.contains("://") {
        return Err("is a URL: give HOST:PORT, without a scheme".into());
    }
    let bare_ipv6 = |host: &str| {
        host.contains(':')
            && host
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
    };
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err("has no port (HOST:PORT)".into());
    };
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err(if bare_ipv6(address) {
            "is an IPv6 address without brackets and port ([ADDRESS]:PORT)".into()
        } else {
            "has no port (HOST:PORT)".into()
        });
    }
    if !matches!(port.parse::<u32>(), Ok(1..=65535)) {
        return Err("has a port outside 1-65535".into());
    }
    let host_ok = match host.strip_prefix('[') {
        Some(inner) => inner.strip_suffix(']').is_some_and(|ip| {
            !ip.is_empty()
                && ip
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        }),
        None => {
            !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        }
    };
    if host_ok {
        Ok(())
    } else if bare_ipv6(host) {
        Err("is an IPv6 address without brackets ([ADDRESS]:PORT)".into())
    } else {
        Err("has no valid host (a name, an IPv4 address or [an IPv6 address])".into())
    }
}

/// The leader a follower named in `metadata` ([`LEADER_METADATA`]), if it names one that
/// passes [`check_address`] (anything else is ignored).
pub fn leader_in(metadata: &MetadataMap) -> Option<String> {
    let value = metadata.get(LEADER_METADATA)?.to_str().ok()?.trim();
    check_address(value).ok().map(|()| value.to_owned())
}
