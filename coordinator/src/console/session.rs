//! The console's login: a person types a bearer token once into the login page and gets a
//! session cookie, so that an ordinary browser — which cannot send a bearer token, and
//! should not need a client certificate imported — can read the console under mutual TLS.
//!
//! The cookie (`__Host-cairn_session`, `HttpOnly; Secure; SameSite=Strict; Path=/`, for
//! [`SESSION_TTL`]) holds no secret of the token: `EXPIRY.SHA256(token).MAC`, the MAC an
//! HMAC-SHA256 under a key derived from the coordinator's TLS private key. So every replica
//! with the same certificate (both in the shipped deployments) accepts the sessions of the
//! others — a Service may spread the requests — and a restart with a new key (a rotated
//! certificate) ends every session. Each request finds the token in the tokens file again by its hash: a token
//! removed from the file ends its sessions at once, and a changed role applies at once.
//! A request that presents a client certificate with a role, or a bearer token, is judged
//! by that first; the session counts only when they give no identity.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use ring::hmac;
use serde::Deserialize;

use super::{Console, now_s, pages};

/// The cookie's name: `__Host-` makes browsers keep it only as set by this very origin
/// (Secure, `Path=/`, no Domain), so no other site or port can plant one that shadows it.
pub(crate) const COOKIE: &str = "__Host-cairn_session";

/// How long a login lasts.
pub(crate) const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);

/// The longest cookie header value read (a browser's whole `Cookie:` line is larger only
/// with other sites' cookies, which a `SameSite` host has none of).
const MAX_COOKIE_HEADER: usize = 4096;

/// Signs and checks session cookies.
pub(crate) struct Sessions {
    key: hmac::Key,
}

impl Sessions {
    /// Sessions signed under a key derived from `secret` (the TLS private key's PEM).
    pub(crate) fn new(secret: &[u8]) -> Self {
        let derive = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let key = hmac::sign(&derive, b"cairn console session v1");
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, key.as_ref()),
        }
    }

    /// A cookie value for the token with SHA-256 `hash`, valid until `now_s` + the TTL.
    pub(crate) fn issue(&self, hash: &[u8; 32], now_s: u64) -> String {
        let body = format!(
            "{}.{}",
            now_s.saturating_add(SESSION_TTL.as_secs()),
            hex::encode(hash)
        );
        let mac = hmac::sign(&self.key, body.as_bytes());
        format!("{body}.{}", hex::encode(mac.as_ref()))
    }

    /// The token hash of a cookie value this key signed that has not expired at `now_s`.
    pub(crate) fn verify(&self, value: &str, now_s: u64) -> Option<[u8; 32]> {
        let (body, mac) = value.rsplit_once('.')?;
        let mac = hex::decode(mac).ok()?;
        hmac::verify(&self.key, body.as_bytes(), &mac).ok()?;
        let (expiry, hash) = body.split_once('.')?;
        if expiry.parse::<u64>().ok()? <= now_s {
            return None;
        }
        hex::decode(hash).ok()?.try_into().ok()
    }

    /// The `Set-Cookie` value of a new session.
    pub(crate) fn set_cookie(value: &str) -> String {
        format!(
            "{COOKIE}={value}; Max-Age={}; Path=/; HttpOnly; Secure; SameSite=Strict",
            SESSION_TTL.as_secs()
        )
    }

    /// The `Set-Cookie` value that ends a session.
    pub(crate) fn clear_cookie() -> String {
        format!("{COOKIE}=; Max-Age=0; Path=/; HttpOnly; Secure; SameSite=Strict")
    }
}

/// Every value of the session cookie among a request's `Cookie` headers: a browser may
/// send more than one of a name (another path's), so each is tried.
pub(crate) fn cookies(headers: &axum::http::HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter(|v| v.len() <= MAX_COOKIE_HEADER)
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE && !value.is_empty()).then_some(value)
        })
}

/// Whether a form post comes from the console's own pages: the browser's `Origin` (or,
/// without one, `Sec-Fetch-Site`) says so. A post from another site is refused (CSRF), as
/// is one that says nothing of where it comes from.
/// Over HTTP/2 a browser sends no `Host`: the request's authority (`uri`) stands for it.
pub(crate) fn same_origin(headers: &axum::http::HeaderMap, uri: &axum::http::Uri) -> bool {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let host = header("host").or_else(|| uri.authority().map(|a| a.as_str()));
    match (header("origin"), host) {
        (Some(origin), Some(host)) => {
            origin.strip_prefix("https://") == Some(host)
                || origin.strip_prefix("http://") == Some(host)
        }
        _ => header("sec-fetch-site") == Some("same-origin"),
    }
}

/// The login form's fields.
#[derive(Debug, Deserialize)]
pub(crate) struct LoginForm {
    token: String,
}

/// The longest token the login form takes (the tokens cairnctl makes are 64 characters).
const MAX_LOGIN_TOKEN: usize = 512;

/// `POST /login`: a token of the tokens file opens a session (a cookie) and goes to the
/// snapshots; anything else is the login page again with why. Refused from another site.
pub(super) async fn login(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    form: Result<axum::Form<LoginForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    let again = |status: StatusCode, message: &str| pages::login_page(status, Some(message));
    if !same_origin(&headers, &uri) {
        return again(
            StatusCode::FORBIDDEN,
            "the login must come from this console's own page (its Origin was another site's, \
             or none)",
        );
    }
    let Some(sessions) = console.sessions.as_ref() else {
        return again(
            StatusCode::UNAUTHORIZED,
            "this coordinator takes no logins: they need --auth-tokens and --tls-* (without \
             tokens, use a client certificate with a role)",
        );
    };
    let token = match form {
        Ok(axum::Form(form)) if form.token.len() <= MAX_LOGIN_TOKEN => form.token,
        Ok(_) => return again(StatusCode::BAD_REQUEST, "that token is too long"),
        Err(e) => {
            return again(
                StatusCode::BAD_REQUEST,
                &format!("bad form: {}", e.body_text()),
            );
        }
    };
    let Some(entry) = console.auth.token(&token) else {
        tracing::debug!("console login refused: unknown token");
        return again(StatusCode::UNAUTHORIZED, "unknown token");
    };
    let value = sessions.issue(&entry.hash, now_s());
    tracing::info!(
        role = %entry.role,
        name = entry.name.as_deref().unwrap_or(""),
        "console login"
    );
    (
        StatusCode::SEE_OTHER,
        [
            (header::SET_COOKIE, Sessions::set_cookie(&value)),
            (header::LOCATION, "/snapshots".to_owned()),
        ],
    )
        .into_response()
}

/// `POST /logout`: the session cookie is cleared; to the login page.
pub(super) async fn logout(headers: HeaderMap, uri: axum::http::Uri) -> Response {
    if !same_origin(&headers, &uri) {
        return pages::login_page(
            StatusCode::FORBIDDEN,
            Some("the logout must come from this console's own page"),
        );
    }
    (
        StatusCode::SEE_OTHER,
        [
            (header::SET_COOKIE, Sessions::clear_cookie()),
            (header::LOCATION, "/login".to_owned()),
        ],
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_what_this_key_signed_until_it_expires() {
        let sessions = Sessions::new(b"-----BEGIN PRIVATE KEY----- one");
        let hash = [7u8; 32];
        let value = sessions.issue(&hash, 1_000);
        assert_eq!(sessions.verify(&value, 1_000), Some(hash));
        let expiry = 1_000 + SESSION_TTL.as_secs();
        assert_eq!(sessions.verify(&value, expiry - 1), Some(hash));
        assert_eq!(sessions.verify(&value, expiry), None, "expired");
        // Another key (a rotated certificate) signs other sessions.
        let other = Sessions::new(b"-----BEGIN PRIVATE KEY----- two");
        assert_eq!(other.verify(&value, 1_000), None);
        // A longer expiry or another token, with the old MAC, is refused.
        let (_, mac) = value.rsplit_once('.').unwrap();
        for forged in [
            format!("{}.{}.{mac}", expiry + 1_000_000, hex::encode(hash)),
            format!("{expiry}.{}.{mac}", hex::encode([8u8; 32])),
            "".into(),
            "1.2".into(),
            "x.y.z".into(),
            format!("{expiry}.{}.", hex::encode(hash)),
        ] {
            assert_eq!(sessions.verify(&forged, 1_000), None, "{forged}");
        }
    }

    #[test]
    fn the_cookie_is_found_and_posts_must_be_same_origin() {
        let mut headers = axum::http::HeaderMap::new();
        headers.append(
            "cookie",
            "a=1; __Host-cairn_session=abc.def; b=2; __Host-cairn_session=ghi"
                .parse()
                .unwrap(),
        );
        assert_eq!(cookies(&headers).collect::<Vec<_>>(), ["abc.def", "ghi"]);
        assert_eq!(cookies(&axum::http::HeaderMap::new()).count(), 0);
        let set = Sessions::set_cookie("v");
        for attribute in [
            "HttpOnly",
            "Secure",
            "SameSite=Strict",
            "Max-Age=28800",
            "Path=/",
        ] {
            assert!(set.contains(attribute), "{set}");
        }
        let path: axum::http::Uri = "/login".parse().unwrap();
        let mut post = axum::http::HeaderMap::new();
        post.insert("host", "127.0.0.1:9000".parse().unwrap());
        assert!(
            !same_origin(&post, &path),
            "says nothing of where it comes from"
        );
        post.insert("origin", "https://127.0.0.1:9000".parse().unwrap());
        assert!(same_origin(&post, &path));
        post.insert("origin", "https://evil.example".parse().unwrap());
        assert!(!same_origin(&post, &path));
        // HTTP/2: no Host, the authority in the request's URI.
        let mut h2 = axum::http::HeaderMap::new();
        h2.insert("origin", "https://localhost:9000".parse().unwrap());
        let full: axum::http::Uri = "https://localhost:9000/login".parse().unwrap();
        assert!(same_origin(&h2, &full));
        let other: axum::http::Uri = "https://127.0.0.1:9000/login".parse().unwrap();
        assert!(!same_origin(&h2, &other));
        let mut fetch = axum::http::HeaderMap::new();
        fetch.insert("sec-fetch-site", "same-origin".parse().unwrap());
        assert!(same_origin(&fetch, &path));
        fetch.insert("sec-fetch-site", "cross-site".parse().unwrap());
        assert!(!same_origin(&fetch, &path));
    }
}
