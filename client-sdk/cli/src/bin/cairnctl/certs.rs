//! `cairnctl certs init`: a development CA and the certificates of a cluster's nodes and
//! users, with rcgen (P-256 keys, X.509 v3).
//!
//! Every certificate names who it is in one URI SAN (`cairn_rpc::server::identity`):
//! `cairn://<cluster>/node/<id>` for a node (beside `DNS:<id>`, `DNS:localhost`,
//! `IP:127.0.0.1` and the `--san` names, so that clients can check the server they dial),
//! `cairn://<cluster>/coordinator` for the coordinator, and `cairn://<cluster>/<role>/<user>`
//! for a person or tool (client authentication only).
//!
//! With `--servers` (the metadata store, etcd), a second CA of its own (`etcd-ca.pem`)
//! signs those servers' certificates and one client certificate, the coordinator's for
//! etcd (`coordinator-etcd.pem`): etcd trusts that CA alone, so no certificate of the
//! cluster's CA (a node's, a person's, a tool's) reaches etcd, and the etcd CA signs no
//! cairn identity.
//!
//! `cairnctl certs revoke`: a CRL (`crl.pem`) of that CA revoking certificates, for the
//! daemons' `--tls-crl`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use cairn_rpc::server::auth::Role;
use cairn_rpc::server::identity;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

mod revoke;

pub(crate) use revoke::revoke;

#[derive(Debug, clap::Subcommand)]
pub(crate) enum CertsCommand {
    /// Write a development CA (ca.pem, ca-key.pem) and a certificate and key for each node
    /// (NODE.pem, NODE-key.pem: server and client auth; SANs URI:cairn://CLUSTER/node/NODE,
    /// DNS:NODE, DNS:localhost, IP:127.0.0.1), the coordinator (coordinator.pem,
    /// coordinator-key.pem; URI:cairn://CLUSTER/coordinator, DNS:coordinator, DNS:localhost,
    /// IP:127.0.0.1 and each --san), each user (USER.pem, USER-key.pem: client auth only;
    /// URI:cairn://CLUSTER/ROLE/USER, which gives the user that role on the coordinator and
    /// NodeAdmin). With --servers, a second CA for the metadata store (etcd-ca.pem,
    /// etcd-ca-key.pem), which signs each --server's certificate (SERVER.pem, SERVER-key.pem:
    /// server and client auth; DNS:SERVER, DNS:localhost, IP:127.0.0.1, no cairn identity)
    /// and the coordinator's client certificate for it (coordinator-etcd.pem,
    /// coordinator-etcd-key.pem: client auth only, CN coordinator): give etcd
    /// --trusted-ca-file etcd-ca.pem, and only the coordinator can reach it. Keys are P-256
    /// and written 0600. Existing files are an error unless --force.
    Init {
        /// The cluster's name (in every identity: a certificate of another cluster is
        /// refused).
        #[arg(long, default_value = "cairn")]
        cluster: String,
        /// The node ids, comma-separated or repeated.
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<String>,
        /// People and tools as NAME:ROLE (ROLE viewer, operator or admin; NAME alone is a
        /// viewer), comma-separated or repeated: a client certificate each.
        #[arg(long, value_delimiter = ',', value_name = "NAME[:ROLE]")]
        users: Vec<String>,
        /// More DNS names or IP addresses for the coordinator's certificate (the host names
        /// clients dial, e.g. a Kubernetes Service's), comma-separated or repeated. Nodes need
        /// none: daemons check a peer's certificate for DNS:NODE-ID whatever address they
        /// dial, and the coordinator's for DNS:coordinator.
        #[arg(long, value_delimiter = ',')]
        san: Vec<String>,
        /// Other servers of the deployment that are not cairn processes (e.g. `etcd`), a
        /// server and client certificate each, with no cairn identity (it can act as no node
        /// and has no role), comma-separated or repeated. They are signed by a CA of their
        /// own (etcd-ca.pem), which also signs the coordinator's client certificate for them
        /// (coordinator-etcd.pem) and nothing else.
        #[arg(long, value_delimiter = ',')]
        servers: Vec<String>,
        /// Where to write the files (created if missing).
        #[arg(long)]
        dir: PathBuf,
        /// Overwrite files that exist.
        #[arg(long)]
        force: bool,
    },
    /// Revoke certificates: write DIR/crl.pem, a CRL signed by the CA of DIR (ca.pem,
    /// ca-key.pem of `certs init`) that lists the certificates NAME (DIR/NAME.pem, or a
    /// path to a PEM certificate) and those the CRL of DIR/crl.pem listed already. Give
    /// the daemons `--tls-crl DIR/crl.pem` (they re-read it within a second). The file is
    /// replaced in one step (written beside it, then renamed).
    Revoke {
        /// The directory of `certs init` (the CA, the certificates, crl.pem).
        #[arg(long)]
        dir: PathBuf,
        /// Days until the CRL's next update (informational: cairn enforces no CRL expiry).
        #[arg(long, default_value_t = 30)]
        days: u64,
        /// The certificates to revoke: NAME for DIR/NAME.pem, or a path to a PEM file.
        #[arg(required = true, value_name = "NAME")]
        names: Vec<String>,
    },
}

/// How long the CA is valid; the leaves.
const CA_DAYS: u64 = 3650;
const LEAF_DAYS: u64 = 825;

/// Names no node, user or server can have: the CAs' and the coordinator's files.
const RESERVED: [&str; 4] = ["ca", "coordinator", "etcd-ca", "coordinator-etcd"];

pub(crate) fn certs(command: CertsCommand) -> anyhow::Result<ExitCode> {
    let (cluster, nodes, users, san, servers, dir, force) = match command {
        CertsCommand::Init {
            cluster,
            nodes,
            users,
            san,
            servers,
            dir,
            force,
        } => (cluster, nodes, users, san, servers, dir, force),
        CertsCommand::Revoke { dir, days, names } => {
            let listed = revoke(&dir, &names, days)?;
            outln!(
                "wrote {}: {listed} certificate(s) revoked (give the daemons --tls-crl {})",
                dir.join("crl.pem").display(),
                dir.join("crl.pem").display()
            );
            return Ok(ExitCode::SUCCESS);
        }
    };
    let people = users
        .iter()
        .map(|user| parse_user(user))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let files = init(&cluster, &nodes, &people, &san, &servers, &dir, force)?;
    outln!(
        "wrote {} files to {} (CA: ca.pem{}; keys 0600)",
        files.len(),
        dir.display(),
        if servers.is_empty() {
            ""
        } else {
            "; the servers' CA: etcd-ca.pem, trusting only coordinator-etcd.pem"
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// `NAME:ROLE` (or `NAME`, a viewer) of `--users`.
fn parse_user(user: &str) -> anyhow::Result<(String, Role)> {
    Ok(match user.split_once(':') {
        Some((name, role)) => (
            name.to_owned(),
            role.parse::<Role>()
                .map_err(|e| anyhow::anyhow!("--users {user}: {e}"))?,
        ),
        None => (user.to_owned(), Role::Viewer),
    })
}

/// Writes to `dir` a development CA of `cluster` (`ca.pem`, `ca-key.pem`) and a
/// certificate and key for the coordinator, each of `nodes` and each of `people` (a name
/// and its role); with `servers`, a second CA (`etcd-ca.pem`, `etcd-ca-key.pem`) that signs
/// each of `servers` (no cairn identity) and the coordinator's client certificate for them
/// (`coordinator-etcd.pem`), as `certs init` documents; `san`: more host names for the
/// coordinator's certificate. Refuses to overwrite a file unless `force`. Returns the
/// files' names.
/// `certs init` and the local cluster (`cluster up`, `demo`) both make their
/// certificates here.
pub(crate) fn init(
    cluster: &str,
    nodes: &[String],
    people: &[(String, Role)],
    san: &[String],
    servers: &[String],
    dir: &Path,
    force: bool,
) -> anyhow::Result<Vec<String>> {
    let valid = |name: &str| {
        !name.is_empty()
            && name.len() <= 128
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
    };
    if !valid(cluster) {
        bail!("--cluster `{cluster}`: letters, digits, '-', '.', '_' (1 to 128)");
    }
    let mut names: Vec<&str> = Vec::new();
    for name in nodes
        .iter()
        .map(String::as_str)
        .chain(people.iter().map(|(name, _)| name.as_str()))
        .chain(servers.iter().map(String::as_str))
    {
        if !valid(name) || RESERVED.contains(&name) {
            bail!(
                "`{name}` cannot name a certificate (letters, digits, '-', '.', '_'; not {})",
                RESERVED
                    .iter()
                    .map(|r| format!("`{r}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        if names.contains(&name) {
            bail!("`{name}` is named twice");
        }
        names.push(name);
    }
    for name in san {
        CertificateParams::new(vec![name.clone()])
            .map_err(|e| anyhow::anyhow!("--san `{name}` is not a DNS name or IP address: {e}"))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("--dir {}", dir.display()))?;
    let mut files: Vec<String> = [
        "ca.pem",
        "ca-key.pem",
        "coordinator.pem",
        "coordinator-key.pem",
    ]
    .map(str::to_owned)
    .into();
    if !servers.is_empty() {
        files.extend(
            [
                "etcd-ca.pem",
                "etcd-ca-key.pem",
                "coordinator-etcd.pem",
                "coordinator-etcd-key.pem",
            ]
            .map(str::to_owned),
        );
    }
    for name in &names {
        for file in [format!("{name}.pem"), format!("{name}-key.pem")] {
            // `ca-key` would write its certificate over the CA's key (ca-key.pem).
            if files.contains(&file) {
                bail!("`{name}` cannot name a certificate: {file} is another file of the set");
            }
            files.push(file);
        }
    }
    if !force {
        let existing: Vec<_> = files.iter().filter(|f| dir.join(f).exists()).collect();
        if !existing.is_empty() {
            bail!(
                "{} already holds {}; give --force to overwrite",
                dir.display(),
                existing
                    .iter()
                    .map(|f| f.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }

    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .context("the clock is before 1970")?;
    // An hour back, for clocks a little behind this one.
    let not_before =
        rcgen::date_time_ymd(1970, 1, 1) + now.saturating_sub(Duration::from_secs(3600));
    let days = |n: u64| not_before + Duration::from_secs(n * 86_400);

    // A CA of CN `cn`, written as FILE.pem and FILE-key.pem (0600).
    let new_ca = |file: &str, cn: String| {
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.distinguished_name.push(DnType::CommonName, cn);
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        ca.not_before = not_before;
        ca.not_after = days(CA_DAYS);
        let ca_cert = ca.self_signed(&ca_key)?;
        write(dir, &format!("{file}.pem"), &ca_cert.pem(), false)?;
        write(
            dir,
            &format!("{file}-key.pem"),
            &ca_key.serialize_pem(),
            true,
        )?;
        anyhow::Ok(Issuer::new(ca, ca_key))
    };
    let issuer: Issuer<'static, KeyPair> = new_ca("ca", format!("cairn {cluster} CA"))?;

    // `file`: the files' name (FILE.pem, FILE-key.pem); `cn`: the common name; `who`: the
    // path of the identity URI after the cluster (none: no cairn identity); `server`: a
    // server (server and client auth, host names: `cn`, loopback's and `extra`), or a
    // person (client auth only); `issuer`: the CA that signs it.
    let leaf = |file: &str,
                cn: &str,
                who: Option<String>,
                server: bool,
                extra: &[String],
                issuer: &Issuer<'static, KeyPair>| {
        let dns = if server {
            [cn, "localhost", "127.0.0.1"]
                .into_iter()
                .map(str::to_owned)
                .chain(extra.iter().cloned())
                .collect()
        } else {
            Vec::new()
        };
        let mut params = CertificateParams::new(dns)?;
        if let Some(who) = who {
            let uri = format!("{}{cluster}/{who}", identity::SCHEME);
            // The identity checks itself (a cluster or name the servers could not parse
            // would make a useless certificate).
            identity::CertIdentity::parse(&uri).map_err(|e| anyhow::anyhow!("{e}"))?;
            params
                .subject_alt_names
                .push(rcgen::SanType::URI(uri.as_str().try_into()?));
        }
        params.distinguished_name.push(DnType::CommonName, cn);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = if server {
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ]
        } else {
            vec![ExtendedKeyUsagePurpose::ClientAuth]
        };
        params.use_authority_key_identifier_extension = true;
        params.not_before = not_before;
        params.not_after = days(LEAF_DAYS);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, issuer)?;
        write(dir, &format!("{file}.pem"), &cert.pem(), false)?;
        write(dir, &format!("{file}-key.pem"), &key.serialize_pem(), true)?;
        anyhow::Ok(())
    };
    let coordinator = "coordinator";
    leaf(
        coordinator,
        coordinator,
        Some(coordinator.into()),
        true,
        san,
        &issuer,
    )?;
    for node in nodes {
        leaf(node, node, Some(format!("node/{node}")), true, &[], &issuer)?;
    }
    for (user, role) in people {
        leaf(
            user,
            user,
            Some(format!("{role}/{user}")),
            false,
            &[],
            &issuer,
        )?;
    }
    if !servers.is_empty() {
        // The metadata store's own CA: it signs the servers' certificates and the
        // coordinator's client certificate for them, nothing of the cluster's CA, so
        // their --trusted-ca-file admits the coordinator alone.
        let etcd_issuer = new_ca("etcd-ca", format!("cairn {cluster} etcd CA"))?;
        for server in servers {
            leaf(server, server, None, true, &[], &etcd_issuer)?;
        }
        leaf(
            "coordinator-etcd",
            coordinator,
            None,
            false,
            &[],
            &etcd_issuer,
        )?;
    }
    Ok(files)
}

/// Writes `text` to `dir/name`, 0600 when `secret` (set at creation: the key is never
/// readable by others, even for a moment).
pub(crate) fn write(dir: &Path, name: &str, text: &str, secret: bool) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(name);
    let mut options = std::fs::OpenOptions::new();
    options
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 });
    let mut file = options
        .open(&path)
        .with_context(|| format!("{}", path.display()))?;
    if secret {
        // A file that existed (--force) keeps its mode on open: set it.
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("{}", path.display()))?;
    }
    file.write_all(text.as_bytes())
        .with_context(|| format!("{}", path.display()))?;
    Ok(())
}
