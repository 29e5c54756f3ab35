//! Bearer tokens and roles for the people and tools that call the coordinator and a
//! daemon's `NodeAdmin` (issue 15, item 3; TLS and certificate identities come later).
//!
//! - [`TokenFile`]: the tokens file of `--auth-tokens` (one `ROLE SHA256HEX [NAME]` a line),
//!   parsed with an error naming the bad line, reloaded when it changes or on SIGHUP.
//! - [`required`]: the one table mapping each gRPC method path to what it needs.
//! - [`AuthLayer`]: the tower layer both daemons put in front of every service; it reads
//!   `authorization: Bearer <token>`, compares the token's SHA-256 in constant time with the
//!   file's, and refuses with `UNAUTHENTICATED` (no or unknown token) or
//!   `PERMISSION_DENIED` (a role too low), counted in `cairn_auth_refused_total{code}`.
//! - [`new_token`]: a random token and the line of the tokens file that admits it.
//!
//! Without `--auth-tokens` the layer lets everything through ([`Auth::open`]).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tonic::body::Body;

pub use cairn_proto::files::tokens::{Role, TokenEntry, Tokens};

use super::identity::{CertIdentity, Identity, Peer, Refusals};

/// The request header a coordinator replica that forwards a client's call to the leader
/// sets to the caller's role and name (`ROLE NAME`, e.g. `operator alice`): the leader takes
/// the caller's role from it — and only on a connection whose client certificate is a
/// coordinator's of this cluster; anyone else who sends it is refused.
pub const ON_BEHALF_OF: &str = "cairn-on-behalf-of";

/// Who a call was authenticated as, put in the request's extensions by [`AuthLayer`] for
/// the methods that need a role: what a forwarding replica passes on in [`ON_BEHALF_OF`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The role checked (the token's, the certificate's, or the forwarded one).
    pub role: Role,
    /// A name for logs: the token's or the certificate's (may be empty).
    pub name: String,
}

impl Caller {
    /// The [`ON_BEHALF_OF`] value for this caller.
    pub fn header_value(&self) -> http::HeaderValue {
        let name: String = self
            .name
            .chars()
            .filter(|c| c.is_ascii_graphic())
            .take(128)
            .collect();
        let text = if name.is_empty() {
            self.role.to_string()
        } else {
            format!("{} {name}", self.role)
        };
        http::HeaderValue::from_str(&text)
            .unwrap_or_else(|_| http::HeaderValue::from_static("viewer"))
    }

    /// Parses an [`ON_BEHALF_OF`] value.
    fn parse(value: &http::HeaderValue) -> Result<Self, String> {
        let text = value
            .to_str()
            .map_err(|_| format!("{ON_BEHALF_OF} is not ASCII"))?;
        let (role, name) = text.trim().split_once(' ').unwrap_or((text.trim(), ""));
        Ok(Self {
            role: role.parse().map_err(|e| format!("{ON_BEHALF_OF}: {e}"))?,
            name: name.trim().to_owned(),
        })
    }
}

/// What a gRPC method needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Required {
    /// Nothing: health, reflection, and the application's session (the loopback port).
    Open,
    /// A node's own call: on a TLS connection, a certificate naming a node of this
    /// cluster (the handler then checks it is the node the call claims to be, with
    /// [`identity::check_node`](super::identity::check_node)); open on plaintext.
    Node,
    /// A token of at least this role.
    Role(Role),
}

/// The methods each role needs (a role also has every method of the roles below it).
const TABLE: &[(&str, Role)] = &[
    ("/cairn.v1.Coordinator/GetSnapshot", Role::Viewer),
    ("/cairn.v1.Coordinator/ListSnapshots", Role::Viewer),
    ("/cairn.v1.Coordinator/WatchSnapshot", Role::Viewer),
    ("/cairn.v1.Coordinator/ListNodes", Role::Viewer),
    ("/cairn.v1.Coordinator/GetPolicy", Role::Viewer),
    ("/cairn.v1.Coordinator/GetRestore", Role::Viewer),
    ("/cairn.v1.Coordinator/ListRestores", Role::Viewer),
    ("/cairn.v1.Coordinator/VerifySnapshot", Role::Viewer),
    ("/cairn.v1.Coordinator/GetLeadership", Role::Viewer),
    ("/cairn.v1.Coordinator/DiffSnapshots", Role::Viewer),
    ("/cairn.v1.Coordinator/ReadSnapshotData", Role::Viewer),
    ("/cairn.v1.NodeAdmin/GetNodeStatus", Role::Viewer),
    ("/cairn.v1.NodeAdmin/GetLocalSnapshot", Role::Viewer),
    ("/cairn.v1.Coordinator/StartSnapshot", Role::Operator),
    ("/cairn.v1.Coordinator/AbortSnapshot", Role::Operator),
    ("/cairn.v1.Coordinator/SetPolicy", Role::Operator),
    ("/cairn.v1.Coordinator/DeleteSnapshot", Role::Admin),
    ("/cairn.v1.Coordinator/RestoreSnapshot", Role::Admin),
    ("/cairn.v1.Coordinator/RemoveNode", Role::Admin),
    ("/cairn.v1.NodeAdmin/InitiateSnapshot", Role::Admin),
    ("/cairn.v1.NodeAdmin/InjectFault", Role::Admin),
    // The HTTP endpoint's Prometheus text (`cli::metrics::serve`).
    ("/metrics", Role::Viewer),
    // The example application's API, on a bank's TLS port.
    ("/cairn.bank.v1.Bank/GetBalance", Role::Viewer),
    ("/cairn.bank.v1.Bank/Transfer", Role::Operator),
    ("/cairn.bank.v1.Bank/SetWorkload", Role::Operator),
];

/// The node RPCs: a daemon's own calls, not a person's, bound to the node its certificate
/// names.
const NODE_RPCS: &[&str] = &[
    "/cairn.v1.Coordinator/NodeSession",
    "/cairn.v1.Coordinator/UploadSnapshotPart",
    "/cairn.v1.Coordinator/HasChunks",
    "/cairn.v1.Coordinator/FetchRestorePart",
    "/cairn.v1.Peer/Channel",
];

/// What the method at `path` (`/package.Service/Method`) needs. Health, reflection and
/// the application's session and its flow-control stream are open (their handlers check,
/// with TLS, that the application holds its node's certificate), the node RPCs need a node; a method in no table
/// needs `admin` (deny by default).
pub fn required(path: &str) -> Required {
    if path.starts_with("/grpc.health.v1.Health/")
        || path.starts_with("/grpc.reflection.v1.ServerReflection/")
        || path.starts_with("/grpc.reflection.v1alpha.ServerReflection/")
        || path == "/cairn.v1.App/Session"
        || path == "/cairn.v1.App/Consumed"
    {
        return Required::Open;
    }
    if NODE_RPCS.contains(&path) {
        return Required::Node;
    }
    TABLE
        .iter()
        .find(|(p, _)| *p == path)
        .map_or(Required::Role(Role::Admin), |(_, r)| Required::Role(*r))
}

/// A new random token (32 bytes, hex) and the tokens-file line that admits it with `role`.
pub fn new_token(role: Role, name: Option<&str>) -> (String, String) {
    let bytes: [u8; 32] = rand::random();
    let token = hex::encode(bytes);
    let hash = hex::encode(Sha256::digest(token.as_bytes()));
    let line = match name {
        Some(name) => format!("{role} {hash} {name}"),
        None => format!("{role} {hash}"),
    };
    (token, line)
}

/// The `--auth-tokens` file: the tokens it holds now, and where it is.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    tokens: RwLock<Arc<Tokens>>,
    /// The text last read (loaded or refused), so a change is acted on once.
    seen: std::sync::Mutex<Option<String>>,
    /// Whether the file could be read at its last reload (if not, no token is in force).
    readable: std::sync::atomic::AtomicBool,
}

impl TokenFile {
    /// Reads and parses `path`; the error names the file and the bad line.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let tokens = Tokens::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self {
            path: path.to_owned(),
            tokens: RwLock::new(Arc::new(tokens)),
            seen: std::sync::Mutex::new(Some(text)),
            readable: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// The tokens in force.
    pub fn tokens(&self) -> Arc<Tokens> {
        self.tokens
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Reads the file again; when its text changed (or `force`), parses it and, if it is
    /// good, puts it in force. A bad or unreadable file keeps the tokens in force and
    /// logs an error naming the line.
    pub fn reload(&self, force: bool) {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) => {
                // Fails closed: no file, no tokens (a file deleted to revoke every token
                // must not leave them in force). A file that does not parse is different:
                // half an edit keeps the tokens in force (below).
                let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
                if seen.is_some() || force {
                    tracing::error!(
                        "--auth-tokens {}: cannot read it ({e}); no token is accepted until \
                         it can be read again",
                        self.path.display()
                    );
                }
                *seen = None;
                *self.tokens.write().unwrap_or_else(|e| e.into_inner()) = Arc::default();
                self.readable
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                return;
            }
        };
        self.readable
            .store(true, std::sync::atomic::Ordering::Relaxed);
        {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if !force && seen.as_deref() == Some(text.as_str()) {
                return;
            }
            *seen = Some(text.clone());
        }
        match Tokens::parse(&text) {
            Ok(tokens) => {
                let count = tokens.entries().len();
                *self.tokens.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(tokens);
                tracing::info!(
                    tokens = count,
                    "--auth-tokens {}: reloaded",
                    self.path.display()
                );
            }
            Err(e) => tracing::error!(
                "--auth-tokens {}: {e}; keeping the tokens in force",
                self.path.display()
            ),
        }
    }

    /// Reloads the file when it changes (checked every second) and on SIGHUP, until `stop`.
    pub fn watch(self: &Arc<Self>, stop: CancellationToken) {
        let file = self.clone();
        super::watch_files("--auth-tokens", move |force| file.reload(force), stop);
    }
}

/// How a server authenticates its callers: by the role of their certificate's identity
/// (on TLS connections), by the tokens of a file, or not at all.
#[derive(Debug, Clone)]
pub struct Auth {
    file: Option<Arc<TokenFile>>,
    refused: Family<Vec<(String, String)>, Counter>,
    identities: Refusals,
    /// The tokens in force (`cairn_auth_tokens`).
    tokens: prometheus_client::metrics::gauge::Gauge,
}

/// The health service that says whether the tokens file can be read (with `--auth-tokens`):
/// NOT_SERVING while it cannot, and then no token is accepted.
pub const TOKENS_HEALTH: &str = "cairn.v1.AuthTokens";

impl Auth {
    /// No tokens: on plaintext connections every call is let through; on TLS ones a
    /// certificate's role still applies.
    pub fn open() -> Self {
        Self {
            file: None,
            refused: Family::default(),
            identities: Refusals::default(),
            tokens: Default::default(),
        }
    }

    /// The tokens of `--auth-tokens` `path`, or [`Auth::open`] without one. The error is a
    /// start-up error naming the flag, the file and the line.
    pub fn from_flag(path: Option<&Path>) -> Result<Self, String> {
        match path {
            None => Ok(Self::open()),
            Some(path) => Ok(Self {
                file: Some(Arc::new(
                    TokenFile::load(path).map_err(|e| format!("--auth-tokens {e}"))?,
                )),
                ..Self::open()
            }),
        }
    }

    /// Whether tokens are required.
    pub fn enabled(&self) -> bool {
        self.file.is_some()
    }

    /// The entry of `token` in the tokens in force (the console's login); `None` without
    /// `--auth-tokens` or for an unknown token.
    pub fn token(&self, token: &str) -> Option<TokenEntry> {
        self.file.as_ref()?.tokens().find(token.trim()).cloned()
    }

    /// The entry of the token whose SHA-256 is `hash`, if it is still in force (a console
    /// session: a token removed from the file ends its sessions at once).
    pub fn token_by_hash(&self, hash: &[u8; 32]) -> Option<TokenEntry> {
        self.file.as_ref()?.tokens().find_hash(hash).cloned()
    }

    /// A role-only check (the console's session, whose token was checked at login): `role`
    /// may call `path`, or PERMISSION_DENIED naming both, counted as any refusal.
    pub fn check_session(&self, path: &str, role: Role, name: &str) -> Result<Caller, Status> {
        let needed = match required(path) {
            Required::Open => {
                return Ok(Caller {
                    role,
                    name: name.to_owned(),
                });
            }
            Required::Role(needed) => needed,
            Required::Node => Role::Admin,
        };
        if role < needed {
            self.refused
                .get_or_create(&vec![("code".to_owned(), "permission_denied".to_owned())])
                .inc();
            let method = path.rsplit('/').next().unwrap_or(path);
            return Err(Status::permission_denied(format!(
                "{method} needs {needed}; the session of {name} is {role}"
            )));
        }
        Ok(Caller {
            role,
            name: name.to_owned(),
        })
    }

    /// Tokens need TLS (`tls`: this process serves mutual TLS): a start-up check. Nodes
    /// are authenticated by their certificates, so without TLS the node RPCs could only be
    /// open to anyone while the API asks for tokens — a phantom node could register — and
    /// the tokens would travel in plaintext. The error names the flags.
    pub fn require_tls(&self, tls: bool) -> Result<(), String> {
        match &self.file {
            Some(file) if !tls => Err(format!(
                "--auth-tokens {} needs --tls-cert, --tls-key and --tls-ca: nodes prove who \
                 they are with their certificates, so without TLS the node RPCs \
                 (NodeSession, UploadSnapshotPart, FetchRestorePart, Peer/Channel) would be \
                 open to anyone, and tokens would travel in plaintext (`cairnctl certs init` \
                 writes a CA and every certificate)",
                file.path.display()
            )),
            _ => Ok(()),
        }
    }

    /// Starts what a running server needs: with tokens, the reload on change and SIGHUP.
    /// Logs the one line that says what protects the server (`what` names its API): a
    /// warning without TLS (`tls` false: its links are unencrypted and unauthenticated).
    ///
    /// With tokens, `health` gets the service [`TOKENS_HEALTH`]: SERVING while the file can
    /// be read, NOT_SERVING (no token accepted) while it cannot; the gauge
    /// `cairn_auth_tokens` counts the tokens in force.
    pub fn start(
        &self,
        what: &str,
        tls: bool,
        stop: CancellationToken,
        health: tonic_health::server::HealthReporter,
    ) {
        match &self.file {
            Some(file) => {
                let (file_, stop_, gauge) = (file.clone(), stop.clone(), self.tokens.clone());
                tokio::spawn(async move {
                    let mut last = None;
                    loop {
                        let readable = file_.readable.load(std::sync::atomic::Ordering::Relaxed);
                        gauge.set(file_.tokens().entries().len() as i64);
                        if last != Some(readable) {
                            let status = if readable {
                                tonic_health::ServingStatus::Serving
                            } else {
                                tonic_health::ServingStatus::NotServing
                            };
                            health.set_service_status(TOKENS_HEALTH, status).await;
                            last = Some(readable);
                        }
                        tokio::select! {
                            () = stop_.cancelled() => return,
                            () = tokio::time::sleep(std::time::Duration::from_millis(500)) => {}
                        }
                    }
                });
                tracing::info!(
                    tokens = file.tokens().entries().len(),
                    "{what}: bearer tokens accepted (--auth-tokens {}){}",
                    file.path.display(),
                    if tls {
                        ", and client certificates with a role"
                    } else {
                        ""
                    }
                );
                if !tls {
                    tracing::warn!(
                        "no --tls-cert/--tls-key/--tls-ca: this process's links are unencrypted \
                         and unauthenticated, and bearer tokens travel in plaintext"
                    );
                }
                file.watch(stop);
            }
            None if tls => tracing::info!(
                "{what}: mutual TLS; callers need a client certificate with a role \
                 ({}CLUSTER/ROLE/NAME; give --auth-tokens to accept bearer tokens too)",
                super::identity::SCHEME
            ),
            None => tracing::warn!(
                "no --tls-cert/--tls-key/--tls-ca and no --auth-tokens: this process's links \
                 are unencrypted and unauthenticated, and {what} is open to anyone who can \
                 reach it"
            ),
        }
    }

    /// Registers `cairn_auth_refused_total{code}` and `cairn_identity_refused_total{what}`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "cairn_auth_refused",
            "Calls refused for want of a token or certificate role (code=unauthenticated) or \
             of a high enough role or a node's certificate (code=permission_denied)",
            self.refused.clone(),
        );
        self.identities.register(registry);
        if self.file.is_some() {
            registry.register(
                "cairn_auth_tokens",
                "Bearer tokens in force (--auth-tokens); 0 while the file cannot be read",
                self.tokens.clone(),
            );
        }
    }

    /// The layer that enforces this on a server of cluster `cluster`; with `tls` (the
    /// server's, reloaded in place), every call's client certificate is checked again
    /// against the CA and CRLs in force ([`crate::tls::Tls::check_client`]), so that a
    /// revocation reaches connections that are already open.
    pub fn layer(&self, cluster: &str, tls: Option<&crate::tls::Tls>) -> AuthLayer {
        AuthLayer {
            auth: self.clone(),
            cluster: cluster.into(),
            tls: tls.cloned(),
        }
    }

    /// Checks a call to `path` with these request headers, on a connection whose client
    /// presented `cert` (DER; `None` on plaintext), on a server of `cluster`: the
    /// [`Peer`] to put in the request's extensions (TLS connections), or the refusal.
    pub fn check(
        &self,
        path: &str,
        headers: &http::HeaderMap,
        cert: Option<&[u8]>,
        cluster: &str,
    ) -> Result<Option<Peer>, Status> {
        self.check_caller(path, headers, cert, cluster)
            .map(|(peer, _)| peer)
    }

    /// [`Self::check`], and who the caller is for a method that needs a role (`None`:
    /// the method is open, or the server is: plaintext without tokens).
    pub fn check_caller(
        &self,
        path: &str,
        headers: &http::HeaderMap,
        cert: Option<&[u8]>,
        cluster: &str,
    ) -> Result<(Option<Peer>, Option<Caller>), Status> {
        let peer = cert.map(|der| self.identities.peer(der, cluster));
        let mut caller = None;
        let result = match required(path) {
            Required::Open => Ok(()),
            Required::Node => match &peer {
                // Plaintext: open only while authentication is off (a process with tokens
                // and no TLS does not start: `require_tls`).
                None if self.file.is_none() => Ok(()),
                None => {
                    let method = path.rsplit('/').next().unwrap_or(path);
                    Err(Status::unauthenticated(format!(
                        "{method} is for the nodes of cluster {cluster}: a node's client \
                         certificate is required"
                    )))
                }
                Some(Peer {
                    identity:
                        Ok(CertIdentity {
                            identity: Identity::Node(_),
                            ..
                        }),
                    ..
                }) => Ok(()),
                Some(Peer { identity, .. }) => {
                    let method = path.rsplit('/').next().unwrap_or(path);
                    let who = match identity {
                        Ok(identity) => format!("the certificate is {identity}"),
                        Err(why) => why.clone(),
                    };
                    Err(self.identities.refuse(
                        method,
                        format!("{method} is for the nodes of cluster {cluster}; {who}"),
                    ))
                }
            },
            Required::Role(needed) => self
                .check_role(path, needed, headers, peer.as_ref())
                .map(|checked| caller = checked),
        };
        if let Err(status) = &result {
            let code = match status.code() {
                tonic::Code::Unauthenticated => "unauthenticated",
                _ => "permission_denied",
            };
            self.refused
                .get_or_create(&vec![("code".to_owned(), code.to_owned())])
                .inc();
            tracing::debug!(method = path, "refused: {}", status.message());
        }
        result.map(|()| (peer, caller))
    }

    /// A call that needs `needed`: the role a coordinator forwarded it with
    /// ([`ON_BEHALF_OF`], only from a coordinator's certificate), else the role of the
    /// bearer token if one is given and tokens are on, else the role of the certificate's
    /// identity; open (`None`) only on a plaintext connection to a server without tokens.
    fn check_role(
        &self,
        path: &str,
        needed: Role,
        headers: &http::HeaderMap,
        peer: Option<&Peer>,
    ) -> Result<Option<Caller>, Status> {
        let person = |peer: &Peer| match &peer.identity {
            Ok(CertIdentity {
                identity: Identity::Person { role, name },
                ..
            }) => Some((*role, name.clone())),
            _ => None,
        };
        let (caller, what) = if let Some(value) = headers.get(ON_BEHALF_OF) {
            match peer {
                // Plaintext without tokens: everything is open, the header means nothing.
                None if self.file.is_none() => return Ok(None),
                Some(Peer {
                    identity:
                        Ok(CertIdentity {
                            identity: Identity::Coordinator,
                            ..
                        }),
                    ..
                }) => {
                    let caller = Caller::parse(value).map_err(Status::invalid_argument)?;
                    let what = format!("the caller a coordinator forwarded ({})", caller.name);
                    (caller, what)
                }
                _ => {
                    return Err(Status::permission_denied(format!(
                        "{ON_BEHALF_OF} is accepted only from a coordinator replica's \
                         certificate ({}CLUSTER/coordinator)",
                        super::identity::SCHEME
                    )));
                }
            }
        } else {
            match (&self.file, headers.get(http::header::AUTHORIZATION)) {
                (Some(file), Some(value)) => {
                    let tokens = file.tokens();
                    let entry = token_entry(&tokens, value)?;
                    let caller = Caller {
                        role: entry.role,
                        name: entry.name.clone().unwrap_or_default(),
                    };
                    (caller, "the token".into())
                }
                _ => match peer.and_then(person) {
                    Some((role, name)) => {
                        let what = format!("the certificate of {name}");
                        (Caller { role, name }, what)
                    }
                    None if peer.is_none() && self.file.is_none() => return Ok(None),
                    None => {
                        let token = "a bearer token is required (authorization: Bearer <token>)";
                        let Some(peer) = peer else {
                            return Err(Status::unauthenticated(token));
                        };
                        let who = match &peer.identity {
                            Ok(identity) => format!("this one is {identity}"),
                            Err(why) => why.clone(),
                        };
                        let certificate = format!(
                            "a client certificate with a role is required ({}CLUSTER/ROLE/NAME; {who})",
                            super::identity::SCHEME
                        );
                        return Err(Status::unauthenticated(if self.file.is_some() {
                            format!("{token}, or {certificate}")
                        } else {
                            certificate
                        }));
                    }
                },
            }
        };
        if caller.role < needed {
            let method = path.rsplit('/').next().unwrap_or(path);
            return Err(Status::permission_denied(format!(
                "{method} needs {needed}; {what} is {}",
                caller.role
            )));
        }
        Ok(Some(caller))
    }
}

impl Auth {
    /// Refuses a call on a connection whose certificate is no longer good (`why`): counted
    /// as `cairn_auth_refused_total{code="unauthenticated"}`.
    fn refuse_connection(&self, method: &str, why: &str) -> Status {
        self.refused
            .get_or_create(&vec![("code".to_owned(), "unauthenticated".to_owned())])
            .inc();
        tracing::debug!(method, "refused on an open connection: {why}");
        Status::unauthenticated(format!(
            "this connection's client certificate is no longer accepted ({why}); {method} \
             refused"
        ))
    }
}

/// The entry of the bearer token in an `authorization` header value.
fn token_entry<'t>(
    tokens: &'t Tokens,
    value: &http::HeaderValue,
) -> Result<&'t TokenEntry, Status> {
    let token = value
        .to_str()
        .ok()
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            Status::unauthenticated("a bearer token is required (authorization: Bearer <token>)")
        })?;
    tokens
        .find(token)
        .ok_or_else(|| Status::unauthenticated("unknown token"))
}

/// The tower layer of [`Auth`].
#[derive(Debug, Clone)]
pub struct AuthLayer {
    auth: Auth,
    cluster: Arc<str>,
    tls: Option<crate::tls::Tls>,
}

impl<S> tower_layer::Layer<S> for AuthLayer {
    type Service = Authenticated<S>;

    fn layer(&self, inner: S) -> Authenticated<S> {
        Authenticated {
            inner,
            auth: self.auth.clone(),
            cluster: self.cluster.clone(),
            tls: self.tls.clone(),
        }
    }
}

/// The service [`AuthLayer`] makes.
#[derive(Debug, Clone)]
pub struct Authenticated<S> {
    inner: S,
    auth: Auth,
    cluster: Arc<str>,
    tls: Option<crate::tls::Tls>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// The certificate chain (leaf first) the client of this request presented on its TLS
/// connection; `None` on plaintext.
fn client_certificates<B>(
    request: &http::Request<B>,
) -> Option<Arc<Vec<rustls::pki_types::CertificateDer<'static>>>> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let info = request
        .extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()?;
    // A TLS connection without a client certificate cannot happen (the servers require
    // one); it would count as a certificate naming nobody.
    Some(info.peer_certs().unwrap_or_default())
}

impl<S, B> tower_service::Service<http::Request<B>> for Authenticated<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<http::Response<Body>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let chain = client_certificates(&request);
        // The certificate was good at the handshake; is it still (a CRL reloaded since)?
        // Checked on every call, before anything else.
        if let (Some(tls), Some(chain)) = (&self.tls, &chain)
            && let Err(why) = tls.check_client(chain)
        {
            let method = request.uri().path().rsplit('/').next().unwrap_or_default();
            let status = self.auth.refuse_connection(method, &why);
            let response = status.into_http::<Body>();
            return Box::pin(async move { Ok(response) });
        }
        let cert = chain
            .as_ref()
            .map(|c| c.first().map(|c| c.to_vec()).unwrap_or_default());
        match self.auth.check_caller(
            request.uri().path(),
            request.headers(),
            cert.as_deref(),
            &self.cluster,
        ) {
            Ok((peer, caller)) => {
                if let Some(peer) = peer {
                    request.extensions_mut().insert(peer);
                }
                if let Some(caller) = caller {
                    request.extensions_mut().insert(caller);
                }
                Box::pin(self.inner.call(request))
            }
            Err(status) => {
                let response = status.into_http::<Body>();
                Box::pin(async move { Ok(response) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(auth: &Auth, path: &str, headers: &http::HeaderMap) -> Result<(), Status> {
        auth.check(path, headers, None, "c").map(|_| ())
    }

    fn hash_of(token: &str) -> String {
        hex::encode(Sha256::digest(token.as_bytes()))
    }

    #[test]
    fn the_table() {
        use Required::*;
        for (path, want) in [
            (
                "/cairn.v1.Coordinator/GetSnapshot",
                Role(super::Role::Viewer),
            ),
            (
                "/cairn.v1.Coordinator/ListRestores",
                Role(super::Role::Viewer),
            ),
            (
                "/cairn.v1.Coordinator/VerifySnapshot",
                Role(super::Role::Viewer),
            ),
            (
                "/cairn.v1.Coordinator/GetLeadership",
                Role(super::Role::Viewer),
            ),
            (
                "/cairn.v1.NodeAdmin/GetLocalSnapshot",
                Role(super::Role::Viewer),
            ),
            (
                "/cairn.v1.Coordinator/StartSnapshot",
                Role(super::Role::Operator),
            ),
            (
                "/cairn.v1.Coordinator/SetPolicy",
                Role(super::Role::Operator),
            ),
            (
                "/cairn.v1.Coordinator/DeleteSnapshot",
                Role(super::Role::Admin),
            ),
            (
                "/cairn.v1.Coordinator/RestoreSnapshot",
                Role(super::Role::Admin),
            ),
            ("/cairn.v1.NodeAdmin/InjectFault", Role(super::Role::Admin)),
            (
                "/cairn.v1.NodeAdmin/InitiateSnapshot",
                Role(super::Role::Admin),
            ),
            ("/grpc.health.v1.Health/Check", Open),
            ("/grpc.health.v1.Health/Watch", Open),
            (
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                Open,
            ),
            (
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                Open,
            ),
            ("/cairn.v1.Coordinator/NodeSession", Node),
            ("/cairn.v1.Coordinator/UploadSnapshotPart", Node),
            ("/cairn.v1.Coordinator/FetchRestorePart", Node),
            ("/cairn.v1.Peer/Channel", Node),
            ("/cairn.v1.App/Session", Open),
            ("/cairn.v1.App/Consumed", Open),
            // Deny by default.
            (
                "/cairn.v1.Coordinator/SomethingNew",
                Role(super::Role::Admin),
            ),
            ("/grpc.health.v1.HealthX/Check", Role(super::Role::Admin)),
            ("/cairn.bank.v1.Bank/Transfer", Role(super::Role::Operator)),
            ("/cairn.bank.v1.Bank/Steal", Role(super::Role::Admin)),
            ("", Role(super::Role::Admin)),
        ] {
            assert_eq!(required(path), want, "{path}");
        }
    }

    #[test]
    fn the_file() {
        let text = format!(
            "# the team's tokens\n\nviewer {} grafana\n  operator {}  # ci\nadmin {} alice smith\n",
            hash_of("v"),
            hash_of("o"),
            hash_of("a").to_uppercase()
        );
        let tokens = Tokens::parse(&text).unwrap();
        assert_eq!(tokens.entries().len(), 3);
        assert_eq!(tokens.find("v").unwrap().role, Role::Viewer);
        assert_eq!(tokens.find("v").unwrap().name.as_deref(), Some("grafana"));
        assert_eq!(tokens.find("o").unwrap().name, None);
        assert_eq!(tokens.find("a").unwrap().role, Role::Admin);
        assert_eq!(
            tokens.find("a").unwrap().name.as_deref(),
            Some("alice smith")
        );
        assert!(tokens.find("x").is_none());
        assert!(Tokens::parse("").unwrap().entries().is_empty());

        for (text, line, what) in [
            ("viewer\n".to_owned(), "line 1", "expected ROLE SHA256HEX"),
            (
                format!("\n# x\nroot {}\n", hash_of("v")),
                "line 3",
                "unknown role \"root\"",
            ),
            ("viewer abc\n".to_owned(), "line 1", "not a SHA-256"),
            (
                format!("viewer {}\nadmin {}\n", hash_of("v"), hash_of("v")),
                "line 2",
                "already listed",
            ),
        ] {
            let e = Tokens::parse(&text).unwrap_err();
            assert!(e.starts_with(line) && e.contains(what), "{e}");
        }
    }

    #[test]
    fn checks() {
        let dir = std::env::temp_dir().join(format!("cairn-auth-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokens");
        std::fs::write(&path, format!("viewer {}\n", hash_of("v"))).unwrap();
        let auth = Auth::from_flag(Some(&path)).unwrap();
        let headers = |v: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(http::header::AUTHORIZATION, v.parse().unwrap());
            h
        };
        let set = "/cairn.v1.Coordinator/SetPolicy";
        let get = "/cairn.v1.Coordinator/GetPolicy";
        let e = plain(&auth, get, &http::HeaderMap::new()).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("a bearer token"), "{e:?}");
        let e = plain(&auth, get, &headers("Bearer w")).unwrap_err();
        assert_eq!(
            (e.code(), e.message()),
            (tonic::Code::Unauthenticated, "unknown token")
        );
        assert!(plain(&auth, get, &headers("Bearer v")).is_ok());
        assert!(plain(&auth, get, &headers("bearer  v ")).is_ok());
        assert!(plain(&auth, get, &headers("Basic v")).is_err());
        let e = plain(&auth, set, &headers("Bearer v")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert_eq!(e.message(), "SetPolicy needs operator; the token is viewer");
        assert!(
            plain(
                &auth,
                "/grpc.health.v1.Health/Check",
                &http::HeaderMap::new()
            )
            .is_ok()
        );

        // A bad reload keeps the tokens in force; a good one replaces them.
        let file = auth.file.clone().unwrap();
        std::fs::write(&path, "viewer nothex\n").unwrap();
        file.reload(false);
        assert!(plain(&auth, get, &headers("Bearer v")).is_ok());
        std::fs::write(&path, format!("operator {}\n", hash_of("o"))).unwrap();
        file.reload(false);
        assert!(plain(&auth, get, &headers("Bearer v")).is_err());
        assert!(plain(&auth, set, &headers("Bearer o")).is_ok());
        assert!(plain(&Auth::open(), set, &http::HeaderMap::new()).is_ok());

        let e = Auth::from_flag(Some(&dir.join("missing"))).unwrap_err();
        assert!(
            e.starts_with("--auth-tokens ") && e.contains("missing"),
            "{e}"
        );
        std::fs::write(&path, "admin\n").unwrap();
        let e = Auth::from_flag(Some(&path)).unwrap_err();
        assert!(e.contains("line 1"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn new_tokens_are_admitted_by_their_line() {
        let (token, line) = new_token(Role::Operator, Some("ci"));
        assert_eq!(token.len(), 64);
        let tokens = Tokens::parse(&line).unwrap();
        let entry = tokens.find(&token).unwrap();
        assert_eq!(
            (entry.role, entry.name.as_deref()),
            (Role::Operator, Some("ci"))
        );
        assert_ne!(new_token(Role::Viewer, None).0, token);
    }

    fn cert(uri: &str) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .subject_alt_names
            .push(rcgen::SanType::URI(uri.try_into().unwrap()));
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn certificates_carry_roles_and_node_rpcs_need_nodes() {
        let get = "/cairn.v1.Coordinator/GetPolicy";
        let restore = "/cairn.v1.Coordinator/RestoreSnapshot";
        let session = "/cairn.v1.Coordinator/NodeSession";
        let none = http::HeaderMap::new();
        let auth = Auth::open();
        let check = |path: &str, uri: &str| auth.check(path, &none, Some(&cert(uri)), "c");
        // A person's certificate: its role, never a node.
        assert!(check(get, "cairn://c/viewer/grafana").is_ok());
        let e = check(restore, "cairn://c/operator/ci").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            e.message(),
            "RestoreSnapshot needs admin; the certificate of ci is operator"
        );
        assert!(check(restore, "cairn://c/admin/alice").is_ok());
        let e = check(session, "cairn://c/admin/alice").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message()
                .contains("NodeSession is for the nodes of cluster c; the certificate is alice (admin) of cluster c"),
            "{e:?}"
        );
        // A node's certificate: node RPCs (the handler checks which node), no role.
        let peer = check(session, "cairn://c/node/n1").unwrap().unwrap();
        assert!(peer.check_node("n1", "register").is_ok());
        assert!(peer.check_node("n2", "register").is_err());
        let e = check(get, "cairn://c/node/n1").unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(
            e.message().contains("this one is node n1 of cluster c"),
            "{e:?}"
        );
        // Another cluster's admin is nobody here.
        let e = check(get, "cairn://d/admin/alice").unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("not of cluster c"), "{e:?}");
        assert!(check(session, "cairn://d/node/n1").is_err());
        // Plaintext without tokens: open, node RPCs too; with TLS, health stays open.
        assert!(plain(&auth, restore, &none).is_ok());
        assert!(plain(&auth, session, &none).is_ok());
        assert!(check("/grpc.health.v1.Health/Check", "cairn://d/x/y").is_ok());
    }

    /// A forwarded call carries its caller's role in `cairn-on-behalf-of`: the leader takes
    /// it from a coordinator's certificate only, and the role is checked as ever.
    #[test]
    fn only_a_coordinator_may_call_on_behalf_of_another() {
        let restore = "/cairn.v1.Coordinator/RestoreSnapshot";
        let start = "/cairn.v1.Coordinator/StartSnapshot";
        let auth = Auth::open();
        let forwarded = |value: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(ON_BEHALF_OF, value.parse().unwrap());
            h
        };
        let check = |path: &str, uri: &str, headers: &http::HeaderMap| {
            auth.check_caller(path, headers, Some(&cert(uri)), "c")
        };
        let (_, caller) =
            check(restore, "cairn://c/coordinator", &forwarded("admin alice")).unwrap();
        assert_eq!(
            caller,
            Some(Caller {
                role: Role::Admin,
                name: "alice".into()
            })
        );
        let e = check(restore, "cairn://c/coordinator", &forwarded("operator ci")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("RestoreSnapshot needs admin"), "{e:?}");
        assert!(e.message().contains("forwarded (ci) is operator"), "{e:?}");
        // Anyone else who sends it is refused, whatever their own role.
        for uri in [
            "cairn://c/admin/mallory",
            "cairn://c/node/n1",
            "cairn://d/coordinator",
        ] {
            let e = check(start, uri, &forwarded("admin x")).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{uri}");
            assert!(e.message().contains("only from a coordinator"), "{e:?}");
        }
        let e = check(start, "cairn://c/coordinator", &forwarded("root x")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        // The coordinator's own certificate has no role of its own.
        assert!(check(start, "cairn://c/coordinator", &http::HeaderMap::new()).is_err());
        // The header a forwarder writes reads back as the caller.
        let caller = Caller {
            role: Role::Operator,
            name: "ci job\n7".into(),
        };
        let parsed = Caller::parse(&caller.header_value()).unwrap();
        assert_eq!(
            (parsed.role, parsed.name.as_str()),
            (Role::Operator, "cijob7")
        );
    }
}
