//! What to do about an error: a line after it on stderr, for the failures a user meets
//! first (nothing listening, TLS expected, no token, too low a role, no answer in time).

/// A hint for a refusal with `code`; `why` is the transport's causes and any leader note
/// (a follower that named the leader needs none).
pub(crate) fn for_status(code: tonic::Code, why: &str, tls: bool) -> Option<String> {
    use tonic::Code;
    if let Some(hint) = plaintext(why, tls) {
        return Some(hint.to_owned());
    }
    let hint = match code {
        Code::Unauthenticated => {
            "hint: this call needs a token the server's --auth-tokens file lists: --token-file \
             FILE (or CAIRN_TOKEN); `cairnctl auth token --role ROLE` makes one"
        }
        Code::PermissionDenied => {
            "hint: the token or certificate does not carry the role this call needs (viewer \
             reads; operator starts, aborts and sets the schedule; admin deletes and restores: \
             README, Security)"
        }
        Code::DeadlineExceeded | Code::Cancelled => {
            "hint: no answer in time: the call may have taken effect or not; look before you \
             try again (`cairnctl snapshot list`, `cairnctl restore list`)"
        }
        Code::Unavailable if !why.contains("the leader is") && !why.contains("transport") => {
            "hint: the coordinator serves no calls now (an election, or it is stopping): try \
             again in a few seconds, or list every replica in --coordinator"
        }
        _ => return None,
    };
    Some(hint.to_owned())
}

/// A hint for a connection that could not be made to `address` (`reason`: why).
pub(crate) fn for_connect(address: &str, reason: &str, tls: bool) -> Option<String> {
    if let Some(hint) = plaintext(reason, tls) {
        return Some(hint.to_owned());
    }
    (reason.contains("Connection refused") || reason.contains("dns error")).then(|| {
        format!(
            "hint: nothing answers at {address}: start the coordinator there, or point \
             --coordinator (CAIRN_COORDINATOR) at it"
        )
    })
}

/// A plaintext connection a TLS server closed after it was made (`why`: the transport
/// error's causes), as a secure local cluster does without a word.
fn plaintext(why: &str, tls: bool) -> Option<&'static str> {
    let connection_lost = why.contains("transport error")
        && !why.contains("tcp connect error")
        && !why.contains("Connection refused");
    (!tls && connection_lost).then_some(
        "hint: no --tls-ca was given and the server closed the connection: it probably serves \
         TLS (as `cairnctl cluster up` and `demo` start it unless --insecure); give --tls-ca, \
         --tls-cert, --tls-key and --token, or the CAIRN_TLS_* and CAIRN_TOKEN lines `cluster \
         up` printed",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn each_first_failure_says_what_to_do_and_others_say_nothing_more() {
        let hint = |code, why| for_status(code, why, true).unwrap_or_default();
        assert!(hint(Code::Unauthenticated, "").contains("--token-file"));
        assert!(hint(Code::PermissionDenied, "").contains("role"));
        assert!(hint(Code::DeadlineExceeded, "").contains("look before you try again"));
        assert!(hint(Code::Unavailable, "").contains("every replica"));
        // A follower that named the leader, a failed connection: said already.
        assert_eq!(hint(Code::Unavailable, "; the leader is 10.0.0.2:7000"), "");
        assert_eq!(hint(Code::NotFound, ""), "");
        assert_eq!(hint(Code::FailedPrecondition, ""), "");
        // Plaintext to a TLS server: the connection closed after it was made.
        let closed = ": transport error: connection closed before message completed";
        assert!(
            for_status(Code::Unavailable, closed, false).is_some_and(|h| h.contains("--tls-ca"))
        );
        assert!(!hint(Code::Unavailable, closed).contains("--tls-ca"));
        let refused = "transport error: tcp connect error: Connection refused (os error 111)";
        assert!(
            for_connect("127.0.0.1:7000", refused, false)
                .is_some_and(|h| h.contains("nothing answers at 127.0.0.1:7000"))
        );
        assert_eq!(
            for_connect("127.0.0.1:7000", "handshake: bad certificate", true),
            None
        );
    }
}
