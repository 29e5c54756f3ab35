//! The coordinator's configuration.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cairn_core::Topology;
use cairn_core::schedule::Policy;

/// Everything a coordinator needs to run.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// The cluster's name; nodes of another cluster are refused.
    pub cluster: String,
    /// etcd: its endpoints (none: the embedded metadata store), TLS and user.
    pub etcd: EtcdConfig,
    /// Where the embedded store's file and the blob directory live.
    pub data_dir: PathBuf,
    /// The blob store (`--blob-store`, `--s3-*`); no location: the directory
    /// `<data_dir>/blobs`.
    pub blob: cairn_blob::BlobArgs,
    /// Chunks and manifests no record refers to are collected only once they are this old (a
    /// daemon may have written them for a snapshot whose record is not stored yet).
    pub gc_grace: Duration,
    /// Remove a node whose daemon has been down this long; `None`: never by itself.
    pub remove_after: Option<Duration>,
    /// The timeout of a snapshot that names none.
    pub default_timeout: Duration,
    /// Most snapshots in flight at once.
    pub max_concurrent: usize,
    /// MiB that responses may hold in memory at once (inline data, diffs).
    pub response_memory_mib: u64,
    /// Completed snapshots kept; 0 keeps all.
    pub retention: usize,
    /// How long shutdown waits for the coordinator's task.
    pub grace_period: Duration,
    /// A fixed topology; `None`: a full mesh of every node that registers.
    pub topology: Option<Topology>,
    /// The snapshot policy (a policy set through `SetPolicy` and stored wins over it).
    pub policy: Policy,
    /// Automatic recovery: when a member's daemon comes back with a new incarnation, restore
    /// the newest completed snapshot on the whole cluster.
    pub auto_restore: bool,
    /// How long a restore may take before it fails naming the nodes that did not apply.
    pub restore_timeout: Duration,
    /// Who may call what: the bearer tokens of `--auth-tokens`, or open (the default).
    pub auth: cairn_rpc::server::auth::Auth,
    /// `--tls-*`: the gRPC port serves mutual TLS (client certificates required, checked
    /// against the CA). `None`: plaintext (the default).
    pub tls: Option<cairn_rpc::tls::Tls>,
    /// The address (`HOST:PORT`) other replicas, daemons and clients reach this replica at:
    /// the value of its election key, named to them in `cairn-leader`. `None`: the listen
    /// address, or `<hostname>:<port>` when listening on every interface.
    pub advertise: Option<String>,
    /// With etcd: the TTL of the lease a replica campaigns and leads with (kept alive every
    /// TTL/3). A leader that cannot renew it stops acting after TTL − margin; a follower
    /// takes over about TTL after a leader dies.
    pub leader_lease_ttl: Duration,
}

impl CoordinatorConfig {
    /// The address this replica advertises (`advertise`, else the listen address `local`,
    /// with the host name for an unspecified IP).
    pub fn advertise_address(&self, local: Option<std::net::SocketAddr>) -> String {
        if let Some(a) = &self.advertise {
            return a.clone();
        }
        match local {
            Some(addr) if !addr.ip().is_unspecified() => addr.to_string(),
            Some(addr) => format!("{}:{}", host_name(), addr.port()),
            None => host_name(),
        }
    }

    /// Defaults for everything but the cluster and the data directory.
    pub fn new(cluster: impl Into<String>, data_dir: impl Into<PathBuf>) -> Self {
        Self {
            cluster: cluster.into(),
            etcd: EtcdConfig::default(),
            data_dir: data_dir.into(),
            blob: cairn_blob::BlobArgs::default(),
            gc_grace: Duration::from_secs(300),
            remove_after: None,
            default_timeout: Duration::from_secs(30),
            max_concurrent: 4,
            response_memory_mib: crate::budget::DEFAULT_MIB,
            retention: 0,
            grace_period: Duration::from_secs(5),
            topology: None,
            policy: Policy::default(),
            auto_restore: false,
            restore_timeout: Duration::from_secs(60),
            auth: cairn_rpc::server::auth::Auth::open(),
            tls: None,
            advertise: None,
            leader_lease_ttl: Duration::from_secs(5),
        }
    }
}

/// How the coordinator reaches etcd: the endpoints and, optionally, TLS and a user.
#[derive(Clone, Default)]
pub struct EtcdConfig {
    /// `http://host:2379` or `https://host:2379`; empty: the embedded metadata store.
    pub endpoints: Vec<String>,
    /// TLS to etcd (`https://` endpoints only).
    pub tls: Option<EtcdTls>,
    /// etcd's authentication: a user and its password.
    pub user: Option<(String, String)>,
}

/// The PEM contents for TLS to etcd.
#[derive(Clone)]
pub struct EtcdTls {
    /// The CA that etcd's server certificate must chain to.
    pub ca: Vec<u8>,
    /// A client certificate and its key, for an etcd started with `--client-cert-auth`.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl EtcdConfig {
    /// Plain endpoints, no TLS, no user.
    pub fn endpoints(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            ..Self::default()
        }
    }

    /// Whether no etcd is configured (the embedded store is used).
    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }
}

/// Shows the endpoints and how they are reached, never the password or the keys.
impl std::fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.endpoints)?;
        match &self.tls {
            Some(EtcdTls {
                identity: Some(_), ..
            }) => f.write_str(" TLS with a client certificate")?,
            Some(_) => f.write_str(" TLS")?,
            None => {}
        }
        if let Some((user, _)) = &self.user {
            write!(f, " as user {user}")?;
        }
        Ok(())
    }
}

/// The `--etcd*` flags as given (file paths not read yet).
#[derive(Debug, Default, Clone)]
pub struct EtcdFlags {
    /// `--etcd`.
    pub endpoints: Vec<String>,
    /// `--etcd-ca`.
    pub ca: Option<PathBuf>,
    /// `--etcd-cert`.
    pub cert: Option<PathBuf>,
    /// `--etcd-key`.
    pub key: Option<PathBuf>,
    /// `--etcd-user`.
    pub user: Option<String>,
    /// `--etcd-password` (or `CAIRN_ETCD_PASSWORD`).
    pub password: Option<String>,
    /// `--etcd-password-file`.
    pub password_file: Option<PathBuf>,
}

/// Reads `path` for `flag`, checking it holds a PEM block with one of `labels`
/// (`CERTIFICATE`, `PRIVATE KEY`…). An error names the flag and the file.
fn read_pem(flag: &str, path: &Path, what: &str, labels: &[&str]) -> Result<Vec<u8>, String> {
    let error = |why: String| format!("{flag} {}: {why}", path.display());
    let pem = std::fs::read(path).map_err(|e| error(e.to_string()))?;
    let text = String::from_utf8_lossy(&pem);
    let found = labels
        .iter()
        .any(|label| text.contains(&format!("-----BEGIN {label}-----")));
    if !found {
        return Err(error(format!("holds no PEM {what}")));
    }
    Ok(pem)
}

impl EtcdFlags {
    /// Checks the flags together and reads the files they name. Every error is one line
    /// naming the flag (and the file): a usage error (exit 64).
    ///
    /// The rules: the other `--etcd-*` flags need `--etcd`; `--etcd-cert` and
    /// `--etcd-key` go together; TLS flags need `https://` endpoints and `https://`
    /// endpoints need `--etcd-ca`; `--etcd-user` needs a password (`--etcd-password`,
    /// `CAIRN_ETCD_PASSWORD` or `--etcd-password-file`, exactly one) and a password needs a
    /// user.
    pub fn load(self) -> Result<EtcdConfig, String> {
        let given: Vec<&str> = [
            ("--etcd-ca", self.ca.is_some()),
            ("--etcd-cert", self.cert.is_some()),
            ("--etcd-key", self.key.is_some()),
            ("--etcd-user", self.user.is_some()),
            ("--etcd-password", self.password.is_some()),
            ("--etcd-password-file", self.password_file.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect();
        if self.endpoints.is_empty() {
            if let Some(flag) = given.first() {
                return Err(format!(
                    "{flag} needs --etcd (the etcd endpoints); without --etcd the coordinator uses its embedded store"
                ));
            }
            return Ok(EtcdConfig::default());
        }
        if let Some(bad) = self
            .endpoints
            .iter()
            .find(|e| !e.starts_with("http://") && !e.starts_with("https://"))
        {
            return Err(format!(
                "--etcd {bad}: an endpoint is http://HOST:PORT or https://HOST:PORT"
            ));
        }
        let https = self.endpoints.iter().filter(|e| e.starts_with("https://"));
        let https = https.count();
        let wants_tls = self.ca.is_some() || self.cert.is_some() || self.key.is_some();
        if https > 0 && https < self.endpoints.len() {
            return Err(format!(
                "--etcd {}: mixes http:// and https:// endpoints; use https:// for all",
                self.endpoints.join(",")
            ));
        }
        if https == 0 && wants_tls {
            return Err(format!(
                "{} need https:// etcd endpoints, not --etcd {}",
                given
                    .iter()
                    .filter(|f| matches!(**f, "--etcd-ca" | "--etcd-cert" | "--etcd-key"))
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", "),
                self.endpoints.join(",")
            ));
        }
        let tls = if https > 0 {
            let Some(ca) = &self.ca else {
                return Err(format!(
                    "--etcd {} is https://: --etcd-ca (the CA that signed etcd's certificate) is required",
                    self.endpoints.join(",")
                ));
            };
            let ca = read_pem("--etcd-ca", ca, "certificate", &["CERTIFICATE"])?;
            let identity = match (&self.cert, &self.key) {
                (None, None) => None,
                (Some(cert), Some(key)) => Some((
                    read_pem("--etcd-cert", cert, "certificate", &["CERTIFICATE"])?,
                    read_pem(
                        "--etcd-key",
                        key,
                        "private key",
                        &["PRIVATE KEY", "EC PRIVATE KEY", "RSA PRIVATE KEY"],
                    )?,
                )),
                (Some(_), None) => {
                    return Err("--etcd-cert needs --etcd-key (its private key)".into());
                }
                (None, Some(_)) => {
                    return Err("--etcd-key needs --etcd-cert (its certificate)".into());
                }
            };
            let tls = EtcdTls { ca, identity };
            check_tls(&tls)?;
            Some(tls)
        } else {
            None
        };
        let password = match (self.password, &self.password_file) {
            (Some(_), Some(_)) => {
                return Err(
                    "--etcd-password (or CAIRN_ETCD_PASSWORD) and --etcd-password-file: give one"
                        .into(),
                );
            }
            (Some(password), None) => Some(password),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("--etcd-password-file {}: {e}", path.display()))?;
                // One trailing line break (as `echo` writes) is not part of the password.
                let password = text
                    .strip_suffix('\n')
                    .map(|t| t.strip_suffix('\r').unwrap_or(t))
                    .unwrap_or(&text);
                if password.is_empty() {
                    return Err(format!("--etcd-password-file {}: is empty", path.display()));
                }
                Some(password.to_owned())
            }
            (None, None) => None,
        };
        let user = match (self.user, password) {
            (None, None) => None,
            (Some(user), _) if user.is_empty() => return Err("--etcd-user is empty".into()),
            (Some(user), Some(password)) => Some((user, password)),
            (Some(_), None) => {
                return Err(
                    "--etcd-user needs a password: --etcd-password-file, CAIRN_ETCD_PASSWORD or --etcd-password".into(),
                );
            }
            (None, Some(_)) => {
                return Err("an etcd password needs --etcd-user (the user it belongs to)".into());
            }
        };
        Ok(EtcdConfig {
            endpoints: self.endpoints,
            tls,
            user,
        })
    }
}

/// Builds the TLS client configuration once so that a PEM file rustls cannot use (a
/// damaged certificate, a key that is not the certificate's) is an error at start.
fn check_tls(tls: &EtcdTls) -> Result<(), String> {
    cairn_rpc::tls::install_crypto_provider();
    let endpoint = tonic::transport::Endpoint::from_static("https://127.0.0.1");
    let ca = tonic::transport::Certificate::from_pem(&tls.ca);
    let config = tonic::transport::ClientTlsConfig::new().ca_certificate(ca.clone());
    endpoint
        .clone()
        .tls_config(config.clone())
        .map_err(|e| format!("--etcd-ca: {}", causes(&e)))?;
    if let Some((cert, key)) = &tls.identity {
        let identity = tonic::transport::Identity::from_pem(cert, key);
        endpoint
            .tls_config(config.identity(identity))
            .map_err(|e| format!("--etcd-cert/--etcd-key: {}", causes(&e)))?;
    }
    Ok(())
}

/// An error with its causes, `a: b: c`.
pub(crate) fn causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

pub use cairn_proto::files::parse_topology;

/// The lease TTLs a replica accepts (etcd's own minimum is about 2 s with its default
/// timing).
pub const LEADER_LEASE_TTL: std::ops::RangeInclusive<Duration> =
    Duration::from_secs(2)..=Duration::from_secs(300);

/// An advertised address is `HOST:PORT` as the daemons and clients accept a leader they are
/// named (`cairn_rpc::leader::check_address`: a host name, an IPv4 address or a
/// bracketed IPv6 one, a port, at most 255 bytes): it travels in `cairn-leader`.
pub fn check_advertise(address: &str) -> Result<(), String> {
    cairn_rpc::leader::check_address(address)
}

/// This machine's host name (`HOSTNAME`, else /etc/hostname, else `localhost`).
fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.trim().is_empty())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file in a fresh temporary directory holding `text`.
    fn temp_file(name: &str, text: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("cairn-etcd-flags-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn flags(endpoint: &str) -> EtcdFlags {
        EtcdFlags {
            endpoints: vec![endpoint.to_owned()],
            ..EtcdFlags::default()
        }
    }

    #[test]
    fn etcd_flags_without_etcd_are_refused() {
        assert!(EtcdFlags::default().load().unwrap().is_empty());
        let e = EtcdFlags {
            user: Some("cairn".into()),
            ..EtcdFlags::default()
        }
        .load()
        .unwrap_err();
        assert!(e.starts_with("--etcd-user needs --etcd"), "{e}");
        let e = EtcdFlags {
            ca: Some("ca.pem".into()),
            ..EtcdFlags::default()
        }
        .load()
        .unwrap_err();
        assert!(e.starts_with("--etcd-ca needs --etcd"), "{e}");
    }

    #[test]
    fn plain_etcd_stays_plain() {
        let etcd = flags("http://127.0.0.1:2379").load().unwrap();
        assert_eq!(etcd.endpoints, ["http://127.0.0.1:2379"]);
        assert!(etcd.tls.is_none() && etcd.user.is_none());
        let e = flags("127.0.0.1:2379").load().unwrap_err();
        assert!(e.contains("http://HOST:PORT or https://HOST:PORT"), "{e}");
    }

    #[test]
    fn tls_needs_https_and_https_needs_the_ca() {
        let e = EtcdFlags {
            ca: Some("ca.pem".into()),
            ..flags("http://127.0.0.1:2379")
        }
        .load()
        .unwrap_err();
        assert_eq!(
            e,
            "--etcd-ca need https:// etcd endpoints, not --etcd http://127.0.0.1:2379"
        );
        let e = flags("https://127.0.0.1:2379").load().unwrap_err();
        assert!(
            e.contains("--etcd-ca (the CA that signed etcd's certificate) is required"),
            "{e}"
        );
        let e = EtcdFlags {
            endpoints: vec!["https://a:2379".into(), "http://b:2379".into()],
            ..EtcdFlags::default()
        }
        .load()
        .unwrap_err();
        assert!(e.contains("mixes http:// and https://"), "{e}");
    }

    #[test]
    fn cert_and_key_go_together() {
        let ca = temp_file("pair-ca.pem", "-----BEGIN CERTIFICATE-----\n");
        let e = EtcdFlags {
            ca: Some(ca.clone()),
            cert: Some("c.pem".into()),
            ..flags("https://127.0.0.1:2379")
        }
        .load()
        .unwrap_err();
        assert_eq!(e, "--etcd-cert needs --etcd-key (its private key)");
        let e = EtcdFlags {
            ca: Some(ca),
            key: Some("k.pem".into()),
            ..flags("https://127.0.0.1:2379")
        }
        .load()
        .unwrap_err();
        assert_eq!(e, "--etcd-key needs --etcd-cert (its certificate)");
    }

    #[test]
    fn missing_garbage_and_damaged_pem_files_name_the_flag_and_the_file() {
        let missing = std::env::temp_dir().join("cairn-no-such-dir/ca.pem");
        let e = EtcdFlags {
            ca: Some(missing.clone()),
            ..flags("https://127.0.0.1:2379")
        }
        .load()
        .unwrap_err();
        assert!(
            e.starts_with(&format!("--etcd-ca {}: ", missing.display())),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");

        let garbage = temp_file("garbage.pem", "hello");
        let e = EtcdFlags {
            ca: Some(garbage.clone()),
            ..flags("https://127.0.0.1:2379")
        }
        .load()
        .unwrap_err();
        assert_eq!(
            e,
            format!("--etcd-ca {}: holds no PEM certificate", garbage.display())
        );

        // The markers around text that is not base64: rustls cannot read it.
        let damaged = temp_file(
            "damaged.pem",
            "-----BEGIN CERTIFICATE-----\n!!! not base64 !!!\n-----END CERTIFICATE-----\n",
        );
        let e = EtcdFlags {
            ca: Some(damaged),
            ..flags("https://127.0.0.1:2379")
        }
        .load()
        .unwrap_err();
        assert!(e.starts_with("--etcd-ca: "), "{e}");
        assert!(!e.contains('\n'), "{e}");

        let key = temp_file("garbage-key.pem", "-----BEGIN CERTIFICATE-----\n");
        let e = EtcdFlags {
            ca: Some(key.clone()),
            cert: Some(key.clone()),
            key: Some(key.clone()),
            ..flags("https://127.0.0.1:2379")
        }
        .load()
        .unwrap_err();
        assert_eq!(
            e,
            format!("--etcd-key {}: holds no PEM private key", key.display())
        );
    }

    #[test]
    fn a_user_needs_exactly_one_password() {
        let e = EtcdFlags {
            user: Some("cairn".into()),
            ..flags("http://127.0.0.1:2379")
        }
        .load()
        .unwrap_err();
        assert!(e.starts_with("--etcd-user needs a password"), "{e}");
        let e = EtcdFlags {
            password: Some("secret".into()),
            ..flags("http://127.0.0.1:2379")
        }
        .load()
        .unwrap_err();
        assert!(e.contains("needs --etcd-user"), "{e}");
        let file = temp_file("password", "from-file\n");
        let e = EtcdFlags {
            user: Some("cairn".into()),
            password: Some("secret".into()),
            password_file: Some(file.clone()),
            ..flags("http://127.0.0.1:2379")
        }
        .load()
        .unwrap_err();
        assert!(e.contains("give one"), "{e}");

        let etcd = EtcdFlags {
            user: Some("cairn".into()),
            password_file: Some(file),
            ..flags("http://127.0.0.1:2379")
        }
        .load()
        .unwrap();
        assert_eq!(etcd.user, Some(("cairn".into(), "from-file".into())));
        // Debug (the start-up log line) never shows the password.
        let shown = format!("{etcd:?}");
        assert!(
            shown.contains("as user cairn") && !shown.contains("from-file"),
            "{shown}"
        );

        let empty = temp_file("empty-password", "\n");
        let e = EtcdFlags {
            user: Some("cairn".into()),
            password_file: Some(empty.clone()),
            ..flags("http://127.0.0.1:2379")
        }
        .load()
        .unwrap_err();
        assert_eq!(
            e,
            format!("--etcd-password-file {}: is empty", empty.display())
        );
    }
}
