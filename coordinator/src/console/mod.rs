//! The web console and its JSON API, served on the coordinator's HTTP endpoint beside
//! `/metrics` (`--metrics-listen`; over mutual TLS with `--tls-*`).
//!
//! - `/api/v1/…` answers with the very messages the gRPC methods return, in the protobuf
//!   JSON mapping (what `grpcurl` prints): each route calls the method it mirrors.
//! - `/snapshots`, `/snapshots/{id}`, `/restores`, `/nodes`, `/policy`: server-rendered
//!   pages ([`pages`]) over the same calls; no JavaScript. A snapshot in flight reloads its
//!   page every second until it ends.
//!
//! Every route checks the role of its gRPC method (viewer) with the same [`Auth`] as the
//! gRPC port: a bearer token (`authorization: Bearer …`) when `--auth-tokens` is set, or the
//! role of the client's certificate on TLS, or else the console's session ([`session`]: a
//! token typed once into `/login`, kept as a signed cookie). Under TLS the port admits a
//! browser without a client certificate; a page it may not read without one is the login
//! page (401) with the reason. Reads go to the store or, for a snapshot in
//! flight, ask the coordinator's task one short question: a page never holds the task.
//! Bad input is a 400 naming it, an unknown id a 404; nothing here panics on input.

mod api;
mod pages;
mod session;

use std::sync::Arc;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use cairn_rpc::server::auth::Auth;
use cairn_rpc::server::metrics::ClientCert;
use cairn_rpc::v1 as pb;
use cairn_rpc::v1::coordinator_server::Coordinator;
use serde::Deserialize;
use tonic::{Code, Request};

use crate::api::CoordinatorService;

/// Requests the console serves at once; more are answered 503 at once, so that a flood
/// of page loads can neither pile up memory nor crowd the coordinator's task.
const MAX_REQUESTS: usize = 32;

/// What every handler shares.
pub(crate) struct Console {
    service: Arc<CoordinatorService>,
    auth: Auth,
    cluster: String,
    busy: Arc<tokio::sync::Semaphore>,
    /// Logins: with `--auth-tokens` and a TLS key to sign sessions with.
    sessions: Option<session::Sessions>,
}

/// The console's routes, to serve beside `/metrics`.
pub(crate) fn router(
    service: Arc<CoordinatorService>,
    auth: Auth,
    cluster: String,
    session_secret: Option<Vec<u8>>,
) -> axum::Router {
    let sessions = session_secret
        .filter(|_| auth.enabled())
        .map(|secret| session::Sessions::new(&secret));
    let console = Arc::new(Console {
        service,
        auth,
        cluster,
        busy: Arc::new(tokio::sync::Semaphore::new(MAX_REQUESTS)),
        sessions,
    });
    axum::Router::new()
        .route("/", get(|| async { Redirect::to("/snapshots") }))
        .route("/login", get(pages::login).post(session::login))
        .route("/logout", axum::routing::post(session::logout))
        .route("/snapshots", get(pages::snapshots))
        .route("/snapshots/{id}", get(pages::snapshot))
        .route("/restores", get(pages::restores))
        .route("/nodes", get(pages::nodes))
        .route("/policy", get(pages::policy))
        .route("/api/v1/snapshots", get(api::api_snapshots))
        .route("/api/v1/snapshots/{id}", get(api::api_snapshot))
        .route("/api/v1/restores", get(api::api_restores))
        .route("/api/v1/restores/{id}", get(api::api_restore))
        .route("/api/v1/nodes", get(api::api_nodes))
        .route("/api/v1/policy", get(api::api_policy))
        .route("/api/v1/leadership", get(api::api_leadership))
        .fallback(not_found)
        .method_not_allowed_fallback(not_allowed)
        .with_state(console)
}

/// Who is asking: the request's headers and how it is connected, and its place among the
/// [`MAX_REQUESTS`] served at once.
pub(crate) struct Caller {
    headers: HeaderMap,
    cert: ClientCert,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

/// Seconds since the Unix epoch, for sessions.
fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Console {
    /// Refused unless the caller may call gRPC method `method` (its full path): by its
    /// token or its certificate's role, else by its session.
    fn allow(&self, caller: &Caller, method: &str) -> Result<(), Failure> {
        match self
            .auth
            .check(method, &caller.headers, caller.cert.der(), &self.cluster)
        {
            Ok(_) => Ok(()),
            Err(status) if status.code() == Code::Unauthenticated => {
                let Some(entry) = self.session(&caller.headers) else {
                    return Err(Failure::from(status));
                };
                let name = entry.name.unwrap_or_else(|| "a token".into());
                self.auth
                    .check_session(method, entry.role, &name)
                    .map(drop)
                    .map_err(Failure::from)
            }
            Err(status) => Err(Failure::from(status)),
        }
    }

    /// The token of the request's session, if it has one that is signed, unexpired, and
    /// whose token is still in force.
    fn session(&self, headers: &HeaderMap) -> Option<cairn_rpc::server::auth::TokenEntry> {
        let sessions = self.sessions.as_ref()?;
        let now = now_s();
        let hash = session::cookies(headers).find_map(|v| sessions.verify(v, now))?;
        self.auth.token_by_hash(&hash)
    }

    async fn list_snapshots(
        &self,
        caller: &Caller,
        query: &ListQuery,
    ) -> Result<pb::ListSnapshotsResponse, Failure> {
        self.allow(caller, "/cairn.v1.Coordinator/ListSnapshots")?;
        let request = pb::ListSnapshotsRequest {
            status: query.status()? as i32,
            mode: query.mode()? as i32,
            page_size: query.page_size.unwrap_or(0),
            page_token: query.page_token.clone().unwrap_or_default(),
        };
        Ok(self
            .service
            .list_snapshots(Request::new(request))
            .await?
            .into_inner())
    }

    async fn get_snapshot(
        &self,
        caller: &Caller,
        id: &str,
        include_data: bool,
    ) -> Result<pb::Snapshot, Failure> {
        self.allow(caller, "/cairn.v1.Coordinator/GetSnapshot")?;
        let snapshot_id = snapshot_id(id)?;
        let request = pb::GetSnapshotRequest {
            snapshot_id,
            include_data,
        };
        Ok(self
            .service
            .get_snapshot(Request::new(request))
            .await?
            .into_inner())
    }

    async fn list_restores(
        &self,
        caller: &Caller,
        limit: u32,
    ) -> Result<pb::ListRestoresResponse, Failure> {
        self.allow(caller, "/cairn.v1.Coordinator/ListRestores")?;
        let request = pb::ListRestoresRequest { limit };
        Ok(self
            .service
            .list_restores(Request::new(request))
            .await?
            .into_inner())
    }

    async fn list_nodes(&self, caller: &Caller) -> Result<pb::ListNodesResponse, Failure> {
        self.allow(caller, "/cairn.v1.Coordinator/ListNodes")?;
        let request = pb::ListNodesRequest {};
        Ok(self
            .service
            .list_nodes(Request::new(request))
            .await?
            .into_inner())
    }

    async fn get_policy(&self, caller: &Caller) -> Result<pb::Policy, Failure> {
        self.allow(caller, "/cairn.v1.Coordinator/GetPolicy")?;
        let request = pb::GetPolicyRequest {};
        Ok(self
            .service
            .get_policy(Request::new(request))
            .await?
            .into_inner())
    }

    async fn get_leadership(&self, caller: &Caller) -> Result<pb::Leadership, Failure> {
        self.allow(caller, "/cairn.v1.Coordinator/GetLeadership")?;
        let request = pb::GetLeadershipRequest {};
        Ok(self
            .service
            .get_leadership(Request::new(request))
            .await?
            .into_inner())
    }
}

impl axum::extract::FromRequestParts<Arc<Console>> for Caller {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        console: &Arc<Console>,
    ) -> Result<Self, Self::Rejection> {
        let refuse = |status, message: &str| {
            Failure {
                status,
                message: message.to_owned(),
            }
            .for_path(parts.uri.path())
        };
        // Fails closed: without the connection's kind no role can be checked.
        let Some(ConnectInfo(cert)) = parts.extensions.get::<ConnectInfo<ClientCert>>().cloned()
        else {
            return Err(refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the connection's kind is unknown",
            ));
        };
        let Ok(permit) = console.busy.clone().try_acquire_owned() else {
            return Err(refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "the console is serving as many requests as it takes; try again",
            ));
        };
        Ok(Caller {
            headers: parts.headers.clone(),
            cert,
            _permit: permit,
        })
    }
}

/// The query of the snapshot lists: `status`, `mode`, `page_size`, `page_token`; any other
/// parameter is refused (400), so a typo is not silently an unfiltered list.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    status: Option<String>,
    mode: Option<String>,
    page_size: Option<u32>,
    page_token: Option<String>,
}

impl ListQuery {
    fn status(&self) -> Result<pb::SnapshotStatus, Failure> {
        match self.status.as_deref().unwrap_or("") {
            "" => Ok(pb::SnapshotStatus::Unspecified),
            word => pb::SnapshotStatus::from_str_name(&format!("SNAPSHOT_STATUS_{word}"))
                .filter(|s| *s != pb::SnapshotStatus::Unspecified)
                .ok_or_else(|| {
                    Failure::bad(format!(
                        "status {word:?}: one of IN_PROGRESS, COMPLETED, FAILED, ABORTED"
                    ))
                }),
        }
    }

    fn mode(&self) -> Result<pb::SnapshotMode, Failure> {
        match self.mode.as_deref().unwrap_or("") {
            "" => Ok(pb::SnapshotMode::Unspecified),
            word => pb::SnapshotMode::from_str_name(&format!("SNAPSHOT_MODE_{word}"))
                .filter(|m| *m != pb::SnapshotMode::Unspecified)
                .ok_or_else(|| {
                    Failure::bad(format!(
                        "mode {word:?}: one of CHANDY_LAMPORT, UNALIGNED, ALIGNED"
                    ))
                }),
        }
    }
}

/// The query of one snapshot: `include_data`, refused (400): states and recorded messages
/// may be large, and they stream with `ReadSnapshotData` (`cairnctl snapshot export`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SnapshotQuery {
    #[serde(default)]
    include_data: bool,
}

/// The query of the restores: `limit`, as `ListRestores` takes it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RestoresQuery {
    #[serde(default)]
    limit: u32,
}

/// A query that allows no parameter.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NoQuery {}

/// The query, or a 400 naming what is wrong with it.
fn query<T>(query: Result<Query<T>, QueryRejection>) -> Result<T, Failure> {
    query
        .map(|Query(q)| q)
        .map_err(|e| Failure::bad(format!("bad query string: {}", e.body_text())))
}

/// The path's id, or a 400 (not UTF-8, say).
fn path(path: Result<Path<String>, PathRejection>) -> Result<String, Failure> {
    path.map(|Path(p)| p)
        .map_err(|e| Failure::bad(format!("bad path: {}", e.body_text())))
}

/// A snapshot id from a path: a decimal number that fits in 64 bits, or a 400.
fn snapshot_id(text: &str) -> Result<u64, Failure> {
    let shown: String = text.chars().take(32).collect();
    if text.is_empty() || text.len() > 20 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Failure::bad(format!(
            "snapshot id {shown:?} is not a number from 1 to {}",
            u64::MAX
        )));
    }
    text.parse().map_err(|_| {
        Failure::bad(format!(
            "snapshot id {shown:?} is above the largest, {}",
            u64::MAX
        ))
    })
}

/// A restore id from a path: at most 128 bytes of letters, digits, '-', '_' and '.'.
fn restore_id(text: &str) -> Result<String, Failure> {
    let ok = !text.is_empty()
        && text.len() <= 128
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !ok {
        let shown: String = text.chars().take(32).collect();
        return Err(Failure::bad(format!(
            "restore id {shown:?}: 1 to 128 letters, digits, '-', '_' or '.'"
        )));
    }
    Ok(text.to_owned())
}

/// Why a request was not answered: an HTTP status and a sentence; the API shows it as
/// JSON, a page as HTML.
#[derive(Debug)]
pub(crate) struct Failure {
    status: StatusCode,
    message: String,
}

impl Failure {
    fn bad(message: String) -> Self {
        Failure {
            status: StatusCode::BAD_REQUEST,
            message,
        }
    }

    /// The answer for a request of `path`: JSON under `/api/`, a page elsewhere.
    fn for_path(self, path: &str) -> Response {
        if path.starts_with("/api/") {
            self.json()
        } else {
            pages::failure_page(self)
        }
    }

    /// The JSON answer of the API.
    fn json(self) -> Response {
        let body = serde_json::json!({
            "error": {
                "code": self.status.as_u16(),
                "status": self.status.canonical_reason().unwrap_or(""),
                "message": self.message,
            }
        });
        (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response()
    }
}

impl From<tonic::Status> for Failure {
    fn from(status: tonic::Status) -> Self {
        let code = match status.code() {
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::FailedPrecondition | Code::Aborted | Code::AlreadyExists => StatusCode::CONFLICT,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Failure {
            status: code,
            message: status.message().to_owned(),
        }
    }
}

/// Any other path: a 404, as JSON under `/api/`, as a page elsewhere.
async fn not_found(uri: axum::http::Uri) -> Response {
    let path: String = uri.path().chars().take(64).collect();
    Failure {
        status: StatusCode::NOT_FOUND,
        message: format!("no page {path}"),
    }
    .for_path(uri.path())
}

/// A method other than GET (or HEAD), or POST on /login and /logout: a 405.
async fn not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    Failure {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!(
            "{method}: the console and its API only read (GET); only /login and /logout take \
             a POST"
        ),
    }
    .for_path(uri.path())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_numbers_that_fit() {
        assert_eq!(snapshot_id("42").unwrap(), 42);
        assert_eq!(snapshot_id("18446744073709551615").unwrap(), u64::MAX);
        for bad in [
            "",
            "-1",
            "1e3",
            "x",
            "18446744073709551616",
            &"9".repeat(500),
        ] {
            let e = snapshot_id(bad).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
            assert!(e.message.len() < 120, "{}", e.message);
        }
        assert!(restore_id("restore-7-1").is_ok());
        for bad in ["", "a/b", "a b", &"r".repeat(129)] {
            assert_eq!(restore_id(bad).unwrap_err().status, StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn filters_are_names_or_a_400() {
        let q = |status: &str, mode: &str| ListQuery {
            status: Some(status.into()),
            mode: Some(mode.into()),
            ..Default::default()
        };
        assert_eq!(
            q("FAILED", "ALIGNED").status().unwrap(),
            pb::SnapshotStatus::Failed
        );
        assert_eq!(q("", "ALIGNED").mode().unwrap(), pb::SnapshotMode::Aligned);
        assert_eq!(q("", "").mode().unwrap(), pb::SnapshotMode::Unspecified);
        for (status, mode) in [
            ("UNSPECIFIED", ""),
            ("done", ""),
            ("", "UNSPECIFIED"),
            ("", "x"),
        ] {
            let e = q(status, mode)
                .status()
                .and(q(status, mode).mode())
                .unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn grpc_codes_become_http_statuses() {
        for (code, http) in [
            (Code::NotFound, 404),
            (Code::InvalidArgument, 400),
            (Code::Unauthenticated, 401),
            (Code::PermissionDenied, 403),
            (Code::Unavailable, 503),
            (Code::Internal, 500),
        ] {
            let f = Failure::from(tonic::Status::new(code, "why"));
            assert_eq!(f.status.as_u16(), http);
            assert_eq!(f.message, "why");
        }
    }
}
