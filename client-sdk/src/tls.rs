//! TLS for cairn's gRPC links: the CA and the identity (certificate and key) read from PEM
//! files, turned into tonic's server and client configurations. The flags that name the
//! files (`--tls-cert`, `--tls-key`, `--tls-ca`) are in `cli::tls`; this part has no clap
//! so that an application's [`CoordinatorClient`](crate::CoordinatorClient) can use TLS too.
//!
//! With TLS a server requires a client certificate signed by the CA (mutual TLS: rustls'
//! `WebPkiClientVerifier` without `allow_unauthenticated`), and a client checks the
//! server's certificate against the CA for the host it dials (`127.0.0.1` needs an IP SAN,
//! `node-0.cairn` a DNS SAN; `cairnctl certs init` writes both kinds).

use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// How long a server waits for a TLS handshake before dropping the connection.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
/// certificate and key.
#[derive(Clone, Debug)]
pub struct Tls {
    ca: Certificate,
    identity: Option<Identity>,
}

/// Reads `path` and checks it holds at least one PEM certificate.
fn read_certs(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let error = |reason: String| TlsError {
        flag,
        path: path.to_owned(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| error(e.to_string()))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(error("holds no PEM certificate".into()));
    }
    Ok(pem)
}

/// Reads `path` and checks it holds a PEM private key.
fn read_key(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let error = |reason: String| TlsError {
        flag,
        path: path.to_owned(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| error(e.to_string()))?;
    PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| error(format!("holds no PEM private key: {e}")))?;
    Ok(pem)
}

impl Tls {
    /// Reads the CA file and, when given, the identity's certificate and key. Each file
    /// is checked to hold what it should; an error names the flag and the file.
    pub fn from_files(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<Self, TlsError> {
        install_crypto_provider();
        let ca = Certificate::from_pem(read_certs("--tls-ca", ca)?);
        let cert_path = identity.map(|(cert, _)| cert.to_owned());
        let identity = match identity {
            None => None,
            Some((cert, key)) => Some(Identity::from_pem(
                read_certs("--tls-cert", cert)?,
                read_key("--tls-key", key)?,
            )),
        };
        let tls = Self { ca, identity };
        if let Some(cert) = cert_path {
            // Builds rustls' configuration once, so that a key that does not match its
            // certificate is a start-up error rather than a failed handshake later.
            let _ = tls.server_config().map_err(|reason| TlsError {
                flag: "--tls-cert/--tls-key",
                path: cert,
                reason,
            })?;
        }
        Ok(tls)
    }

    /// Whether this process has its own certificate (to serve, or to present as a client).
    pub fn has_identity(&self) -> bool {
        self.identity.is_some()
    }

    /// A server's configuration: this identity, and client certificates required and
    /// verified against the CA. An error if there is no identity or rustls refuses it.
    pub fn server_config(&self) -> Result<ServerTlsConfig, String> {
        let identity = self
            .identity
            .clone()
            .ok_or("a TLS server needs a certificate and key")?;
        let config = ServerTlsConfig::new()
            .identity(identity)
            .client_ca_root(self.ca.clone())
            // Required, not optional: a client without a certificate is refused.
            .client_auth_optional(false)
            .timeout(HANDSHAKE_TIMEOUT);
        // tonic parses the PEM and builds rustls' configuration here.
        tonic::transport::Server::builder()
            .tls_config(config.clone())
            .map_err(|e| crate::error::with_causes(&e))?;
        Ok(config)
    }

    /// A client's configuration to dial `address` (HOST:PORT): the CA, this identity if
    /// any, and the server name checked in the server's certificate: HOST.
    pub fn client_config(&self, address: &str) -> ClientTlsConfig {
        let mut config = ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .domain_name(host_of(address));
        if let Some(identity) = &self.identity {
            config = config.identity(identity.clone());
        }
        config
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

/// An endpoint for `address` (HOST:PORT): `https://` with `tls`, `http://` without.
pub fn endpoint(address: &str, tls: Option<&Tls>) -> Result<Endpoint, tonic::transport::Error> {
    match tls {
        None => Endpoint::from_shared(format!("http://{address}")),
        Some(tls) => Endpoint::from_shared(format!("https://{address}"))?
            .tls_config(tls.client_config(address)),
    }
}

/// Installs rustls' ring crypto provider as the process default, once (a second call, or
/// one after another provider was installed, does nothing). tonic's TLS server builds its
/// configuration from the process default.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
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
}
