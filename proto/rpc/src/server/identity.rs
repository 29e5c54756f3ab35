//! Who a TLS peer is: the one `cairn://` URI SAN of its certificate (issue 15, item 2).
//!
//! - `cairn://<cluster>/node/<id>`: the daemon of node `<id>`. Only such a certificate may
//!   register as `<id>` with the coordinator, upload its parts, fetch its restores, and
//!   open channels from `<id>` to a peer.
//! - `cairn://<cluster>/coordinator`: the coordinator.
//! - `cairn://<cluster>/<role>/<name>` with `<role>` `viewer`, `operator` or `admin`: a
//!   person or tool, with that role on the coordinator and on NodeAdmin; it can never act as
//!   a node.
//!
//! The certificate's other SANs (DNS names, IP addresses) are only for checking the server
//! a client dials (a node's certificate also names `DNS:<id>`, which peers check). A
//! certificate with no `cairn://` URI, with two, or of another cluster, has no identity
//! here.

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tonic::Status;
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use cairn_proto::files::tokens::Role;

/// The scheme of identity URIs.
pub const SCHEME: &str = "cairn://";

/// The longest cluster name, node id or user name an identity may carry.
const MAX_NAME: usize = 128;

/// What a certificate names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    /// The daemon of a node.
    Node(String),
    /// The coordinator.
    Coordinator,
    /// A person or tool, with a role.
    Person {
        /// What it may do.
        role: Role,
        /// Its name (for messages and logs).
        name: String,
    },
}

/// An identity and the cluster it belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CertIdentity {
    /// The cluster named in the URI.
    pub cluster: String,
    /// Who.
    pub identity: Identity,
}

impl CertIdentity {
    /// The identity's URI, as a certificate carries it.
    pub fn uri(&self) -> String {
        match &self.identity {
            Identity::Node(id) => format!("{SCHEME}{}/node/{id}", self.cluster),
            Identity::Coordinator => format!("{SCHEME}{}/coordinator", self.cluster),
            Identity::Person { role, name } => format!("{SCHEME}{}/{role}/{name}", self.cluster),
        }
    }

    /// Parses an identity URI; the error says what is wrong with it.
    pub fn parse(uri: &str) -> Result<Self, String> {
        let rest = uri
            .strip_prefix(SCHEME)
            .ok_or_else(|| format!("{uri:?} does not start with {SCHEME}"))?;
        let segments: Vec<&str> = rest.split('/').collect();
        for segment in &segments {
            if segment.is_empty() || segment.len() > MAX_NAME {
                return Err(format!(
                    "{uri:?}: every part must have 1 to {MAX_NAME} characters"
                ));
            }
        }
        let identity = match segments[1..] {
            ["node", id] => Identity::Node(id.to_owned()),
            ["coordinator"] => Identity::Coordinator,
            [role, name] => Identity::Person {
                role: role.parse().map_err(|e| format!("{uri:?}: {e}"))?,
                name: name.to_owned(),
            },
            _ => {
                return Err(format!(
                    "{uri:?} is not {SCHEME}CLUSTER/node/ID, {SCHEME}CLUSTER/coordinator or \
                     {SCHEME}CLUSTER/ROLE/NAME"
                ));
            }
        };
        Ok(Self {
            cluster: segments[0].to_owned(),
            identity,
        })
    }

    /// The identity of a DER certificate: its one `cairn://` URI SAN.
    pub fn of_certificate(der: &[u8]) -> Result<Self, String> {
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|e| format!("the certificate cannot be parsed: {e}"))?;
        let san = cert
            .subject_alternative_name()
            .map_err(|e| format!("the certificate's SAN extension cannot be parsed: {e}"))?;
        let uris: Vec<&str> = san
            .iter()
            .flat_map(|san| san.value.general_names.iter())
            .filter_map(|name| match name {
                GeneralName::URI(uri) if uri.starts_with(SCHEME) => Some(*uri),
                _ => None,
            })
            .collect();
        match uris[..] {
            [uri] => Self::parse(uri),
            [] => Err(format!(
                "the certificate of {} carries no {SCHEME} URI SAN",
                subject_of(&cert)
            )),
            _ => Err(format!(
                "the certificate of {} carries {} {SCHEME} URI SANs; one is allowed",
                subject_of(&cert),
                uris.len()
            )),
        }
    }
}

/// The subject's common name, or the whole subject, for messages.
fn subject_of(cert: &X509Certificate<'_>) -> String {
    cert.subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map_or_else(|| cert.subject().to_string(), |cn| format!("CN={cn}"))
}

impl std::fmt::Display for CertIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.identity {
            Identity::Node(id) => write!(f, "node {id}")?,
            Identity::Coordinator => f.write_str("the coordinator")?,
            Identity::Person { role, name } => write!(f, "{name} ({role})")?,
        }
        write!(f, " of cluster {}", self.cluster)
    }
}

/// What a server knows of the peer of a call, put in the request's extensions by the
/// auth layer when the connection is TLS: its identity (or why it has none), and where
/// refusals are counted.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The identity, or why the certificate names none of this cluster.
    pub identity: Result<CertIdentity, String>,
    refusals: Refusals,
}

impl Peer {
    /// A node RPC's check that the caller is node `claimed`: `Ok` when its certificate
    /// names that node of this cluster; otherwise PERMISSION_DENIED naming the identity
    /// and `what` it tried (`"register"`, `"upload a part"`), counted and logged once.
    ///
    /// A claimed id that cannot be a node id (longer than 128 bytes, or with a character
    /// other than ASCII letters, digits, '-', '.' and '_', as `cairnctl certs init`
    /// allows) is refused without being echoed whole: the message shows its first 64
    /// characters, escaped, and its length. (An empty one is refused as any other id no
    /// certificate names.)
    pub fn check_node(&self, claimed: &str, what: &str) -> Result<(), Status> {
        if !may_name_a_node(claimed) {
            return Err(self.refusals.refuse(
                what,
                format!(
                    "the claimed node id {} is not a node id (1 to {MAX_NAME} ASCII letters, \
                     digits, '-', '.' or '_'); it may not {what} as it",
                    shown(claimed)
                ),
            ));
        }
        match &self.identity {
            Ok(CertIdentity {
                identity: Identity::Node(id),
                ..
            }) if id == claimed => Ok(()),
            Ok(identity) => Err(self.refusals.refuse(
                what,
                format!("the certificate is {identity}; it may not {what} as node {claimed}"),
            )),
            Err(why) => Err(self
                .refusals
                .refuse(what, format!("{why}; it may not {what} as node {claimed}"))),
        }
    }
}

/// Whether a claimed node id is one `cairnctl certs init` allows, or empty: at most
/// [`MAX_NAME`] bytes of ASCII letters, digits, '-', '.' and '_'.
fn may_name_a_node(id: &str) -> bool {
    id.len() <= MAX_NAME
        && id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_'))
}

/// The characters of a claimed id a message may show.
const SHOWN: usize = 64;

/// A claimed id for a message: at most its first [`SHOWN`] characters, escaped, and its
/// length in bytes.
fn shown(id: &str) -> String {
    let head: String = id.chars().take(SHOWN).collect();
    let more = if head.len() < id.len() { "…" } else { "" };
    format!("{head:?}{more} ({} bytes)", id.len())
}

impl Peer {
    /// The peer the auth layer put in `request`'s extensions: `None` on a plaintext
    /// connection.
    pub fn of<T>(request: &tonic::Request<T>) -> Option<Peer> {
        request.extensions().get::<Peer>().cloned()
    }
}

/// A node RPC's check that its caller is node `claimed`: on a TLS connection (`peer`), see
/// [`Peer::check_node`]; on a plaintext one there is no certificate to bind, and it is `Ok`.
pub fn check_node(peer: Option<&Peer>, claimed: &str, what: &str) -> Result<(), Status> {
    peer.map_or(Ok(()), |peer| peer.check_node(claimed, what))
}

/// How many identity refusals a server remembers having logged (then it logs again).
const LOGGED_CAP: usize = 1024;

/// The counter of identity refusals and the refusals already logged (a hash of each
/// message: bounded memory whatever the messages hold).
#[derive(Debug, Clone, Default)]
pub struct Refusals {
    counter: Family<Vec<(String, String)>, Counter>,
    logged: Arc<Mutex<HashSet<u64>>>,
}

impl Refusals {
    /// Registers `cairn_identity_refused_total{what}`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "cairn_identity_refused",
            "Calls refused because the caller's certificate does not name the node it acts \
             as (what: the action tried)",
            self.counter.clone(),
        );
    }

    /// Counts a refusal of `what`, logs `message` the first time it is seen, and returns
    /// PERMISSION_DENIED with it.
    pub fn refuse(&self, what: &str, message: String) -> Status {
        self.counter
            .get_or_create(&vec![("what".to_owned(), what.to_owned())])
            .inc();
        let key = {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            message.hash(&mut hasher);
            hasher.finish()
        };
        let first = {
            let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
            if logged.len() >= LOGGED_CAP {
                logged.clear();
            }
            logged.insert(key)
        };
        if first {
            tracing::warn!("refused: {message}");
        }
        Status::permission_denied(message)
    }

    /// The [`Peer`] of a certificate, for `cluster`: its identity when it names one of
    /// this cluster.
    pub fn peer(&self, der: &[u8], cluster: &str) -> Peer {
        let identity = CertIdentity::of_certificate(der).and_then(|identity| {
            if identity.cluster == cluster {
                Ok(identity)
            } else {
                Err(format!(
                    "the certificate is {identity}, not of cluster {cluster}"
                ))
            }
        });
        Peer {
            identity,
            refusals: self.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        for (uri, identity) in [
            ("cairn://c/node/n1", Identity::Node("n1".into())),
            ("cairn://c/coordinator", Identity::Coordinator),
            (
                "cairn://c/admin/alice",
                Identity::Person {
                    role: Role::Admin,
                    name: "alice".into(),
                },
            ),
            (
                "cairn://c/viewer/grafana",
                Identity::Person {
                    role: Role::Viewer,
                    name: "grafana".into(),
                },
            ),
        ] {
            let parsed = CertIdentity::parse(uri).unwrap();
            assert_eq!(parsed.cluster, "c");
            assert_eq!(parsed.identity, identity);
            assert_eq!(parsed.uri(), uri);
        }
        for (uri, why) in [
            ("https://c/node/n1", "does not start with"),
            ("cairn://c/node/", "1 to 128"),
            ("cairn:///node/n1", "1 to 128"),
            ("cairn://c/root/alice", "unknown role"),
            ("cairn://c/node/n1/x", "is not cairn://CLUSTER/node/ID"),
            ("cairn://c", "is not cairn://"),
            ("cairn://c/admin", "is not cairn://"),
        ] {
            let e = CertIdentity::parse(uri).unwrap_err();
            assert!(e.contains(why), "{uri}: {e}");
        }
    }

    fn cert(sans: &[&str]) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "someone");
        for san in sans {
            params
                .subject_alt_names
                .push(match san.strip_prefix("dns:") {
                    Some(dns) => rcgen::SanType::DnsName(dns.try_into().unwrap()),
                    None => rcgen::SanType::URI((*san).try_into().unwrap()),
                });
        }
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn certificates() {
        let refusals = Refusals::default();
        let n1 = refusals.peer(&cert(&["dns:n1", "cairn://c/node/n1"]), "c");
        assert!(n1.check_node("n1", "register").is_ok());
        let e = n1.check_node("n2", "register").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            e.message(),
            "the certificate is node n1 of cluster c; it may not register as node n2"
        );
        let alice = refusals.peer(&cert(&["cairn://c/admin/alice"]), "c");
        let e = alice.check_node("n1", "open a channel").unwrap_err();
        assert!(e.message().contains("alice (admin) of cluster c"), "{e:?}");
        let other = refusals.peer(&cert(&["cairn://d/node/n1"]), "c");
        let e = other.check_node("n1", "register").unwrap_err();
        assert!(e.message().contains("not of cluster c"), "{e:?}");
        let bare = refusals.peer(&cert(&["dns:n1"]), "c");
        let e = bare.check_node("n1", "register").unwrap_err();
        assert!(
            e.message()
                .contains("CN=someone carries no cairn:// URI SAN"),
            "{e:?}"
        );
        let two = refusals.peer(&cert(&["cairn://c/node/n1", "cairn://c/node/n2"]), "c");
        assert!(two.check_node("n1", "register").is_err());
        assert!(refusals.peer(b"garbage", "c").identity.is_err());
    }

    #[test]
    fn a_claimed_id_that_cannot_be_a_node_id_is_refused_without_echoing_it() {
        let refusals = Refusals::default();
        let n1 = refusals.peer(&cert(&["dns:n1", "cairn://c/node/n1"]), "c");
        assert!(may_name_a_node("n1") && may_name_a_node("node-0.cairn_a"));
        assert!(may_name_a_node(&"a".repeat(128)));
        // Empty: refused as an id the certificate does not name.
        let e = n1.check_node("", "register").unwrap_err();
        assert!(e.message().ends_with("may not register as node "), "{e:?}");
        for bad in ["n 1", "n1\n", "n/1", "nœud"] {
            assert!(!may_name_a_node(bad), "{bad:?}");
            let e = n1.check_node(bad, "register").unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied);
            assert!(e.message().contains("is not a node id"), "{e:?}");
        }
        let e = n1.check_node("n1\n", "register").unwrap_err();
        assert!(e.message().contains(r#""n1\n" (3 bytes)"#), "{e:?}");
        // A huge claimed id: its head, escaped, and its length; never the whole.
        let huge = format!("{}\u{1b}[31m{}", "x".repeat(10), "y".repeat(4 << 20));
        let e = n1.check_node(&huge, "register").unwrap_err();
        let message = e.message();
        assert!(message.len() < 400, "{} bytes", message.len());
        assert!(
            message.contains(&format!("({} bytes)", huge.len())),
            "{message}"
        );
        assert!(message.contains(r"\u{1b}[31m"), "escaped: {message}");
        assert!(!message.contains('\u{1b}'), "{message}");
        assert!(message.contains('…'), "{message}");
        // Too long, even of good characters.
        let e = n1.check_node(&"n".repeat(129), "register").unwrap_err();
        assert!(e.message().contains("(129 bytes)"), "{e:?}");
        assert!(!e.message().contains(&"n".repeat(65)), "{e:?}");
        // The logged set holds hashes: bounded whatever was claimed.
        for i in 0..3 * LOGGED_CAP {
            let _ = n1.check_node(&format!("{i}{}", "z".repeat(200)), "register");
        }
        assert!(refusals.logged.lock().unwrap().len() <= LOGGED_CAP);
    }
}
