//! TLS for cairn's gRPC links: the CA and the identity (certificate and key) read from PEM
//! files, turned into a rustls server configuration and tonic's client configurations.
//! The flags that name the files (`--tls-cert`, `--tls-key`, `--tls-ca`) and a daemon's
//! accept loop are in `server::tls` (feature `server`); this part has no clap so that an
//! application's coordinator client (`cairn_sdk::CoordinatorClient`) can use TLS too.
//!
//! With TLS a server requires a client certificate signed by the CA (mutual TLS: rustls'
//! `WebPkiClientVerifier` without `allow_unauthenticated`), and a client checks the
//! server's certificate against the CA for the host it dials (`127.0.0.1` needs an IP SAN,
//! `node-0.cairn` a DNS SAN; `cairnctl certs init` writes both kinds), or for the node id
//! when a daemon dials a peer ([`endpoint_for`]).
//!
//! A [`Tls`] is shared by its clones and reloadable ([`Tls::reload`]): the files are read
//! again by path (a Kubernetes Secret's `..data` symlink swap is seen), and a new pair that
//! parses, matches and (for a daemon) is valid now and signed by the CA goes in force for
//! new handshakes and new connections; connections that are up keep their session.
//!
//! A daemon may also be given certificate revocation lists ([`Tls::for_daemon_with_crl`],
//! `--tls-crl`): its servers then refuse a client certificate that a CRL of the CA revokes
//! (rustls' `WebPkiClientVerifier::with_crls`). The CRL file is reloaded with the others.
//! Certificates of issuers no CRL speaks for are let through, and a CRL past its next
//! update still revokes what it lists (its expiry is not enforced: an out-of-date CRL does
//! not lock every client out). Clients do not check servers' certificates against a CRL:
//! tonic's `ClientTlsConfig` takes none.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{
    CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName, UnixTime,
};
use rustls::{CertificateError, RootCertStore};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// How long a server waits for a TLS handshake before dropping the connection.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why PEM files could not be used; the text names the flag and the file.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{flag} {}: {reason}", .path.display())]
pub struct TlsError {
    /// The flag (or variable) that named the file.
    pub flag: &'static str,
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub reason: String,
}

/// The CA that peers' certificates must chain to, and optionally this process's own
/// certificate and key: what the files held when last loaded. Clones share it, and see
/// a [`reload`](Self::reload).
#[derive(Clone)]
pub struct Tls {
    inner: Arc<Inner>,
}

struct Inner {
    ca: PathBuf,
    identity: Option<(PathBuf, PathBuf)>,
    /// The CRL file (`--tls-crl`), a daemon's only.
    crl: Option<PathBuf>,
    /// A daemon's: its own certificate must be valid now and signed by the CA, at start
    /// and at every reload.
    check_own: bool,
    current: RwLock<Arc<Loaded>>,
    /// What the files held at the last look (loaded or refused), so a change is acted on
    /// (and a refusal logged) once; `None` after a read failed.
    seen: Mutex<Option<Files>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("ca", &self.inner.ca)
            .field("identity", &self.inner.identity)
            .field("crl", &self.inner.crl)
            .finish_non_exhaustive()
    }
}

/// The files' bytes.
#[derive(Clone, PartialEq, Eq)]
struct Files {
    ca: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
    crl: Option<Vec<u8>>,
}

/// What the files hold, parsed.
struct Loaded {
    ca: Certificate,
    identity: Option<Identity>,
    /// The server configuration of the identity (client certificates required).
    server: Option<Arc<rustls::ServerConfig>>,
    /// The same for browsers: a client certificate is verified if presented but not
    /// required (the console's login takes a token instead), ALPN `h2` and `http/1.1`.
    browser: Option<Arc<rustls::ServerConfig>>,
    /// The leaf certificate of the identity.
    leaf: Option<CertificateDer<'static>>,
    /// The client certificate verifier of `server` (the CA and the CRLs in force), for the
    /// check of every call ([`Tls::check_client`]).
    verifier: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
}

/// What [`Tls::reload`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reload {
    /// The files are as they were.
    Unchanged,
    /// New files are in force.
    Reloaded,
    /// The new files were refused (the error was logged); the old ones stay in force.
    Refused(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Parses the PEM certificates of `pem` (from `flag`'s `path`).
fn parse_certs(
    flag: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let error = |reason: String| TlsError {
        flag,
        path: path.to_owned(),
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(error("holds no PEM certificate".into()));
    }
    Ok(certs)
}

/// Parses the PEM CRLs of `pem` (from `--tls-crl`'s `path`): one or more
/// `X509 CRL` blocks.
fn parse_crls(
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    let error = |reason: String| TlsError {
        flag: "--tls-crl",
        path: path.to_owned(),
        reason,
    };
    let crls = CertificateRevocationListDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(format!("not a PEM CRL file: {e}")))?;
    if crls.is_empty() {
        return Err(error(
            "holds no PEM certificate revocation list (-----BEGIN X509 CRL-----)".into(),
        ));
    }
    Ok(crls)
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError {
        flag,
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

impl Inner {
    fn read_files(&self) -> Result<Files, TlsError> {
        let ca = read("--tls-ca", &self.ca)?;
        let identity = match &self.identity {
            None => None,
            Some((cert, key)) => Some((read("--tls-cert", cert)?, read("--tls-key", key)?)),
        };
        let crl = match &self.crl {
            None => None,
            Some(crl) => Some(read("--tls-crl", crl)?),
        };
        Ok(Files { ca, identity, crl })
    }

    /// Parses and checks `files`; every error names the flag and the file at fault.
    fn load(&self, files: &Files) -> Result<Loaded, TlsError> {
        let ca_certs = parse_certs("--tls-ca", &self.ca, &files.ca)?;
        let mut roots = RootCertStore::empty();
        let (added, _) = roots.add_parsable_certificates(ca_certs);
        if added == 0 {
            return Err(TlsError {
                flag: "--tls-ca",
                path: self.ca.clone(),
                reason: "holds no usable CA certificate".into(),
            });
        }
        let roots = Arc::new(roots);
        let crls = match (&self.crl, &files.crl) {
            (Some(path), Some(pem)) => parse_crls(path, pem)?,
            _ => Vec::new(),
        };
        let ca = Certificate::from_pem(&files.ca);
        let (Some((cert_path, key_path)), Some((cert_pem, key_pem))) =
            (&self.identity, &files.identity)
        else {
            return Ok(Loaded {
                ca,
                identity: None,
                server: None,
                browser: None,
                leaf: None,
                verifier: None,
            });
        };
        let chain = parse_certs("--tls-cert", cert_path, cert_pem)?;
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError {
            flag: "--tls-key",
            path: key_path.clone(),
            reason: format!("holds no PEM private key: {e}"),
        })?;
        let cert_error = |reason: String| TlsError {
            flag: "--tls-cert",
            path: cert_path.clone(),
            reason,
        };
        if self.check_own {
            check_own(&chain, roots.clone()).map_err(|reason| TlsError {
                reason: format!("{reason} (--tls-ca {})", self.ca.display()),
                ..cert_error(String::new())
            })?;
        }
        if let Some(crl_path) = &self.crl {
            let crl_error = |reason: String| TlsError {
                flag: "--tls-crl",
                path: crl_path.clone(),
                reason,
            };
            // The CRLs' signatures are checked when a certificate of their issuer is: this
            // process's own (a CRL of the CA's name signed by another key would refuse
            // every client).
            match verify_own(&chain, roots.clone(), &crls) {
                Ok(()) => {}
                Err(rustls::Error::InvalidCertificate(CertificateError::Revoked)) => {
                    return Err(crl_error(format!(
                        "it revokes this process's own certificate (--tls-cert {}); give this \
                         process a new certificate first",
                        cert_path.display()
                    )));
                }
                Err(rustls::Error::InvalidCertRevocationList(e)) => {
                    return Err(crl_error(format!(
                        "a CRL that names the CA of --tls-ca {} as its issuer cannot be used \
                         ({e:?}: not signed by that CA's key, or the CA may not sign CRLs)",
                        self.ca.display()
                    )));
                }
                Err(e) => return Err(crl_error(e.to_string())),
            }
        }
        let (verifier_roots, verifier_crls) = (roots.clone(), crls.clone());
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider())
                .with_crls(crls)
                // A certificate of an issuer no CRL speaks for is let through.
                .allow_unknown_revocation_status()
                .build()
                .map_err(|e| match &self.crl {
                    Some(crl) => TlsError {
                        flag: "--tls-crl",
                        path: crl.clone(),
                        reason: e.to_string(),
                    },
                    None => TlsError {
                        flag: "--tls-ca",
                        path: self.ca.clone(),
                        reason: e.to_string(),
                    },
                })?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| cert_error(e.to_string()))?
            .with_client_cert_verifier(verifier.clone())
            // Checks that the key is the certificate's.
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| TlsError {
                flag: "--tls-cert/--tls-key",
                path: cert_path.clone(),
                reason: e.to_string(),
            })?;
        server.alpn_protocols = vec![b"h2".to_vec()];
        // Browsers: the same CA and CRLs for a certificate presented, none required.
        let optional =
            rustls::server::WebPkiClientVerifier::builder_with_provider(verifier_roots, provider())
                .with_crls(verifier_crls)
                .allow_unknown_revocation_status()
                .allow_unauthenticated()
                .build()
                .map_err(|e| cert_error(e.to_string()))?;
        let mut browser = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| cert_error(e.to_string()))?
            .with_client_cert_verifier(optional)
            .with_single_cert(chain.clone(), key)
            .map_err(|e| cert_error(e.to_string()))?;
        browser.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Loaded {
            ca,
            identity: Some(Identity::from_pem(cert_pem, key_pem)),
            server: Some(Arc::new(server)),
            browser: Some(Arc::new(browser)),
            leaf: chain.into_iter().next(),
            verifier: Some(verifier),
        })
    }
}

/// This process's own certificate (`chain`, leaf first) is valid now and chains to
/// `roots`; the error says which it is not, with the dates.
fn check_own(chain: &[CertificateDer<'static>], roots: Arc<RootCertStore>) -> Result<(), String> {
    match verify_own(chain, roots, &[]) {
        Ok(()) => Ok(()),
        Err(rustls::Error::InvalidCertificate(e)) => {
            Err(format!("the certificate {}", certificate_problem(&e).1))
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Verifies this process's own certificate (`chain`, leaf first) against `roots` and
/// `crls` (a certificate of an issuer no CRL speaks for passes), as a server's and, if it
/// is for client authentication only, as a client's; a name or purpose is not checked.
fn verify_own(
    chain: &[CertificateDer<'static>],
    roots: Arc<RootCertStore>,
    crls: &[CertificateRevocationListDer<'static>],
) -> Result<(), rustls::Error> {
    use rustls::Error::InvalidCertificate;
    let now = UnixTime::now();
    let verify = |server: bool| -> Result<(), rustls::Error> {
        if server {
            let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
                roots.clone(),
                provider(),
            )
            .with_crls(crls.to_vec())
            .allow_unknown_revocation_status()
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
            // Any name: the chain and the dates are checked before the name.
            let name = ServerName::try_from("cairn.invalid").expect("a valid name");
            verifier
                .verify_server_cert(&chain[0], &chain[1..], &name, &[], now)
                .map(|_| ())
        } else {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                roots.clone(),
                provider(),
            )
            .with_crls(crls.to_vec())
            .allow_unknown_revocation_status()
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
            verifier
                .verify_client_cert(&chain[0], &chain[1..], now)
                .map(|_| ())
        }
    };
    let purpose = |e: &rustls::Error| {
        matches!(
            e,
            InvalidCertificate(
                CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. }
            )
        )
    };
    let result = match verify(true) {
        Err(InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        )) => Ok(()),
        // A certificate for client authentication only.
        Err(e) if purpose(&e) => verify(false),
        other => other,
    };
    match result {
        // A certificate for neither use: its chain and dates were checked.
        Err(e) if purpose(&e) => Ok(()),
        other => other,
    }
}

impl Tls {
    fn new(
        ca: &Path,
        identity: Option<(&Path, &Path)>,
        crl: Option<&Path>,
        check_own: bool,
    ) -> Result<Self, TlsError> {
        install_crypto_provider();
        let inner = Inner {
            ca: ca.to_owned(),
            identity: identity.map(|(c, k)| (c.to_owned(), k.to_owned())),
            crl: crl.map(Path::to_owned),
            check_own,
            current: RwLock::new(Arc::new(Loaded {
                ca: Certificate::from_pem(""),
                identity: None,
                server: None,
                browser: None,
                leaf: None,
                verifier: None,
            })),
            seen: Mutex::new(None),
        };
        let files = inner.read_files()?;
        let loaded = inner.load(&files)?;
        *inner.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(loaded);
        *inner.seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(files);
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Reads the CA file and, when given, the identity's certificate and key. Each file
    /// is checked to hold what it should, and the key to be the certificate's; an error
    /// names the flag and the file.
    pub fn from_files(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<Self, TlsError> {
        Self::new(ca, identity, None, false)
    }

    /// As [`from_files`](Self::from_files) for a daemon's own identity, which must also be
    /// valid now (neither expired nor not yet valid) and signed by the CA, here and at
    /// every [`reload`](Self::reload). The error names the flag, the file and the dates.
    pub fn for_daemon(ca: &Path, cert: &Path, key: &Path) -> Result<Self, TlsError> {
        Self::new(ca, Some((cert, key)), None, true)
    }

    /// As [`for_daemon`](Self::for_daemon), with the certificate revocation lists of `crl`
    /// (PEM, one or more `X509 CRL` blocks; `--tls-crl`) if given: the server refuses a
    /// client certificate that a CRL revokes. The file is read again with the others at
    /// every [`reload`](Self::reload). A CRL that names the CA as its issuer must be
    /// signed by the CA's key, and none may revoke this process's own certificate; an
    /// error names `--tls-crl` and the file.
    pub fn for_daemon_with_crl(
        ca: &Path,
        cert: &Path,
        key: &Path,
        crl: Option<&Path>,
    ) -> Result<Self, TlsError> {
        Self::new(ca, Some((cert, key)), crl, true)
    }

    /// The CRL file, if any.
    pub fn crl_path(&self) -> Option<&Path> {
        self.inner.crl.as_deref()
    }

    fn current(&self) -> Arc<Loaded> {
        self.inner
            .current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether this process has its own certificate (to serve, or to present as a client).
    pub fn has_identity(&self) -> bool {
        self.inner.identity.is_some()
    }

    /// The files: the CA's, and the certificate's and key's if any.
    pub fn paths(&self) -> (&Path, Option<(&Path, &Path)>) {
        (
            &self.inner.ca,
            self.inner
                .identity
                .as_ref()
                .map(|(c, k)| (c.as_path(), k.as_path())),
        )
    }

    /// The server configuration in force now: this identity, ALPN `h2`, client
    /// certificates required and verified against the CA (and the CRLs, if any). `None`
    /// without an identity.
    pub fn server_config(&self) -> Option<Arc<rustls::ServerConfig>> {
        self.current().server.clone()
    }

    /// [`Self::server_config`] for a port browsers open (the coordinator's console): a
    /// client certificate is verified if the client presents one, not required, and
    /// HTTP/1.1 is offered beside h2. Every request must then authenticate otherwise (a
    /// token, the console's session): the auth layer finds no identity on such a
    /// connection.
    pub fn browser_server_config(&self) -> Option<Arc<rustls::ServerConfig>> {
        self.current().browser.clone()
    }

    /// Whether a client certificate chain (leaf first) that a connection presented when it
    /// opened is still good under the CA and CRLs in force *now*: a server checks it on
    /// every call, so a CRL reload reaches connections already open, not only new
    /// handshakes. A certificate that merely expired since the handshake is judged as of
    /// its last valid second — still refused if a CRL revokes it, but not refused for its
    /// age: a client that renewed its certificate keeps its connection until it reconnects
    /// (new handshakes check the dates). The error says why not (`revoked`, `unknown
    /// issuer`, …). `Ok` for a process without a server identity (it verifies no clients).
    pub fn check_client(&self, chain: &[CertificateDer<'_>]) -> Result<(), String> {
        let Some(verifier) = self.current().verifier.clone() else {
            return Ok(());
        };
        let Some((leaf, intermediates)) = chain.split_first() else {
            return Err("the connection presented no client certificate".into());
        };
        let mut verified = verifier.verify_client_cert(leaf, intermediates, UnixTime::now());
        if let Err(rustls::Error::InvalidCertificate(CertificateError::ExpiredContext {
            not_after,
            ..
        })) = &verified
        {
            let last = UnixTime::since_unix_epoch(Duration::from_secs(
                not_after.as_secs().saturating_sub(1),
            ));
            verified = verifier.verify_client_cert(leaf, intermediates, last);
        }
        match verified {
            Ok(_) => Ok(()),
            Err(rustls::Error::InvalidCertificate(e)) => {
                let (reason, words) = certificate_problem(&e);
                Err(format!("{reason}: the client certificate {words}"))
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// The leaf certificate in force now (DER), if this process has an identity.
    pub fn certificate(&self) -> Option<CertificateDer<'static>> {
        self.current().leaf.clone()
    }

    /// A client's configuration to dial `address` (HOST:PORT): the CA, this identity (as
    /// in force now) if any, and the server name checked in the server's certificate: HOST.
    pub fn client_config(&self, address: &str) -> ClientTlsConfig {
        self.client_config_for(host_of(address))
    }

    /// A client's configuration that checks that the server's certificate names
    /// `server_name` (a node id, a host name or an IP address).
    pub fn client_config_for(&self, server_name: &str) -> ClientTlsConfig {
        let loaded = self.current();
        let mut config = ClientTlsConfig::new()
            .ca_certificate(loaded.ca.clone())
            .domain_name(server_name);
        if let Some(identity) = &loaded.identity {
            config = config.identity(identity.clone());
        }
        config
    }

    /// Reads the files again; when they changed (or `force`), parses and checks them and,
    /// if they are good, puts them in force for new handshakes and connections. Files that
    /// cannot be read or are bad keep the old ones in force, and are logged at error level
    /// once per change, naming the flag and the file.
    pub fn reload(&self, force: bool) -> Reload {
        let inner = &self.inner;
        let files = match inner.read_files() {
            Ok(files) => files,
            Err(e) => {
                let mut seen = inner.seen.lock().unwrap_or_else(|e| e.into_inner());
                if seen.is_some() || force {
                    tracing::error!("{e}; keeping the TLS certificate in force");
                }
                *seen = None;
                return Reload::Refused(e.to_string());
            }
        };
        {
            let mut seen = inner.seen.lock().unwrap_or_else(|e| e.into_inner());
            if !force && seen.as_ref() == Some(&files) {
                return Reload::Unchanged;
            }
            *seen = Some(files.clone());
        }
        match inner.load(&files) {
            Ok(loaded) => {
                *inner.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(loaded);
                match &inner.identity {
                    Some((cert, _)) => tracing::info!(
                        "--tls-cert {}: reloaded{}; new connections use it, connections that \
                         are up keep theirs",
                        cert.display(),
                        match &inner.crl {
                            Some(crl) => format!(" (and --tls-crl {})", crl.display()),
                            None => String::new(),
                        }
                    ),
                    None => tracing::info!("--tls-ca {}: reloaded", inner.ca.display()),
                }
                Reload::Reloaded
            }
            Err(e) => {
                tracing::error!("{e}; keeping the TLS certificate in force");
                Reload::Refused(e.to_string())
            }
        }
    }
}

/// The host part of `HOST:PORT` (`[::1]:7000` → `::1`).
pub fn host_of(address: &str) -> &str {
    let host = match address.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host,
        _ => address,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

/// An endpoint for `address` (HOST:PORT): `https://` with `tls`, `http://` without. With
/// TLS the server's certificate must name HOST, and this process presents its identity
/// as in force now (a reconnect after a reload presents the new certificate).
pub fn endpoint(address: &str, tls: Option<&Tls>) -> Result<Endpoint, tonic::transport::Error> {
    endpoint_for(address, host_of(address), tls)
}

/// As [`endpoint`], but the server's certificate must name `server_name` rather than the
/// host of `address`: a daemon dialing node X checks that the certificate is X's
/// (`DNS:<node-id>`), wherever X's address points.
pub fn endpoint_for(
    address: &str,
    server_name: &str,
    tls: Option<&Tls>,
) -> Result<Endpoint, tonic::transport::Error> {
    match tls {
        None => Endpoint::from_shared(format!("http://{address}")),
        Some(tls) => Endpoint::from_shared(format!("https://{address}"))?
            .tls_config(tls.client_config_for(server_name)),
    }
}

/// Installs rustls' ring crypto provider as the process default, once (a second call, or
/// one after another provider was installed, does nothing). tonic's TLS client builds its
/// configuration from the process default.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// `secs` since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn format_time(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rest = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

/// A certificate's problem: a short label (a metric's `reason`) and words that follow
/// "the … certificate" ("has expired (not after 2025-01-01T00:00:00Z)").
pub fn certificate_problem(error: &CertificateError) -> (&'static str, String) {
    use CertificateError::*;
    match error {
        Expired => ("expired", "has expired".into()),
        ExpiredContext { time, not_after } => (
            "expired",
            format!(
                "has expired (not after {}; it is now {})",
                format_time(not_after.as_secs()),
                format_time(time.as_secs())
            ),
        ),
        NotValidYet => ("not_yet_valid", "is not yet valid".into()),
        NotValidYetContext { time, not_before } => (
            "not_yet_valid",
            format!(
                "is not yet valid (not before {}; it is now {})",
                format_time(not_before.as_secs()),
                format_time(time.as_secs())
            ),
        ),
        UnknownIssuer => (
            "unknown_issuer",
            "is not signed by this cluster's CA (unknown issuer)".into(),
        ),
        // The issuer named is a CA of the store (same name) but its key did not sign it:
        // another CA of the same name (`cairnctl certs init` for another cluster), or a
        // tampered certificate.
        BadSignature => (
            "unknown_issuer",
            "is not signed by this cluster's CA (bad signature: another CA of the same name \
             signed it)"
                .into(),
        ),
        NotValidForName => ("wrong_name", "does not name the server dialed".into()),
        NotValidForNameContext {
            expected,
            presented,
        } => (
            "wrong_name",
            format!(
                "does not name {} (it names {})",
                expected.to_str(),
                presented.join(", ")
            ),
        ),
        InvalidPurpose | InvalidPurposeContext { .. } => (
            "wrong_purpose",
            "is not for this use (its extended key usage)".into(),
        ),
        Revoked => (
            "revoked",
            "has been revoked (a CRL of the CA lists it)".into(),
        ),
        other => ("bad_certificate", format!("is refused: {other}")),
    }
}

/// The rustls error in `error` or its causes, if any (tokio-rustls wraps it in an
/// `io::Error`, whose `source` skips it).
fn find_rustls_error<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rustls::Error> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(r) = e.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        if let Some(r) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(r);
        }
        next = e.source();
    }
    None
}

/// Why a TLS connection failed, in words, from a client's point of view: the server's
/// certificate was refused (expired, not yet valid, of another CA, not naming the server
/// dialed), or the server refused this client's (as its alert says). `None` if `error`
/// and its causes hold no TLS error.
pub fn explain(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    use rustls::AlertDescription as A;
    if let Some(e) = find_rustls_error(error) {
        return Some(match e {
            rustls::Error::InvalidCertificate(c) => {
                format!("the server's certificate {}", certificate_problem(c).1)
            }
            rustls::Error::AlertReceived(alert) => refused_by_server(*alert),
            rustls::Error::InvalidMessage(_) => {
                "the server did not answer in TLS (a plaintext server?)".into()
            }
            other => format!("TLS: {other}"),
        });
    }
    // Some layers keep only the text of the cause.
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(e) = next {
        text.push_str(": ");
        text.push_str(&e.to_string());
        next = e.source();
    }
    for (alert, name) in [
        (A::CertificateExpired, "CertificateExpired"),
        (A::UnknownCA, "UnknownCA"),
        (A::CertificateRequired, "CertificateRequired"),
        (A::BadCertificate, "BadCertificate"),
        (A::UnsupportedCertificate, "UnsupportedCertificate"),
        (A::DecryptError, "DecryptError"),
        (A::CertificateRevoked, "CertificateRevoked"),
    ] {
        if text.contains(&format!("received fatal alert: {name}")) {
            return Some(refused_by_server(alert));
        }
    }
    None
}

fn refused_by_server(alert: rustls::AlertDescription) -> String {
    use rustls::AlertDescription as A;
    match alert {
        A::CertificateExpired => {
            "the server refused this client's certificate: it has expired or is not yet valid"
                .into()
        }
        A::UnknownCA => "the server refused this client's certificate: it is not signed by the \
                         server's CA (unknown issuer)"
            .into(),
        A::CertificateRequired => {
            "the server requires a client certificate (--tls-cert and --tls-key)".into()
        }
        A::UnsupportedCertificate => {
            "the server refused this client's certificate: it is not for client \
             authentication (its extended key usage)"
                .into()
        }
        A::DecryptError => "the server refused this client's certificate: it is not signed \
                            by the server's CA (bad signature)"
            .into(),
        A::CertificateRevoked => {
            "the server refused this client's certificate: it has been revoked (a CRL of the \
             CA lists it)"
                .into()
        }
        other => format!("the server refused the TLS handshake ({other:?})"),
    }
}

/// An error with its causes, `a: b: c` — tonic's transport errors say little on their own.
/// A cause that only repeats what is already said (hyper's "tcp connect error" wraps
/// another "tcp connect error"; some errors print their cause themselves) is left out. A
/// TLS failure starts with what it means in words ([`explain`]: the server's certificate
/// has expired, the server refused this client's certificate, ...).
pub fn with_causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = match explain(error) {
        Some(words) => format!("{words}: {error}"),
        None => error.to_string(),
    };
    let mut source = error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !said.is_empty() && !text.ends_with(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_of_addresses() {
        assert_eq!(host_of("127.0.0.1:7000"), "127.0.0.1");
        assert_eq!(host_of("node-0.cairn:7100"), "node-0.cairn");
        assert_eq!(host_of("[::1]:7000"), "::1");
        assert_eq!(host_of("localhost"), "localhost");
    }

    #[test]
    fn times() {
        assert_eq!(format_time(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_time(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(format_time(1_735_689_599), "2024-12-31T23:59:59Z");
    }

    #[test]
    fn a_missing_or_garbage_file_names_the_flag_and_the_file() {
        let dir = std::env::temp_dir().join(format!("cairn-tls-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let garbage = dir.join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n").unwrap();
        let e = Tls::from_files(&garbage, None).unwrap_err().to_string();
        assert!(
            e.starts_with("--tls-ca ") && e.contains("garbage.pem"),
            "{e}"
        );
        let missing = dir.join("missing.pem");
        let e = Tls::from_files(&missing, None).unwrap_err().to_string();
        assert!(
            e.starts_with("--tls-ca ") && e.contains("missing.pem"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn causes_that_repeat_what_is_said_are_left_out() {
        #[derive(Debug)]
        struct E(&'static str, Option<Box<E>>);
        impl std::fmt::Display for E {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for E {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let chain = E(
            "transport error",
            Some(Box::new(E(
                "tcp connect error",
                Some(Box::new(E(
                    "tcp connect error",
                    Some(Box::new(E("Connection refused (os error 111)", None))),
                ))),
            ))),
        );
        assert_eq!(
            with_causes(&chain),
            "transport error: tcp connect error: Connection refused (os error 111)"
        );
    }
}
