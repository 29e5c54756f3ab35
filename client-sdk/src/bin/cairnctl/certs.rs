//! `cairnctl certs init`: a development CA and the certificates of a cluster's nodes and
//! users, with rcgen (P-256 keys, X.509 v3).
//!
//! A node's identity is the SAN `DNS:<node-id>` of its certificate (beside `DNS:localhost`
//! and `IP:127.0.0.1`, so that clients dialling loopback can check it). A user's
//! certificate names the user as `DNS:<user>` and is for client authentication only.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

#[derive(Debug, clap::Subcommand)]
pub(crate) enum CertsCommand {
    /// Write a development CA (ca.pem, ca-key.pem) and a certificate and key for each node
    /// (NODE.pem, NODE-key.pem: server and client auth; SANs DNS:NODE, DNS:localhost,
    /// IP:127.0.0.1) and each user (USER.pem, USER-key.pem: client auth; SAN DNS:USER),
    /// and one for the coordinator like a node's (coordinator.pem,
    /// coordinator-key.pem; SAN DNS:coordinator). Keys are P-256 and written 0600.
    /// Existing files are kept unless --force.
    Init {
        /// The cluster's name (in the CA's name).
        #[arg(long, default_value = "cairn")]
        cluster: String,
        /// The node ids, comma-separated or repeated.
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<String>,
        /// People and tools, comma-separated or repeated: a client certificate each.
        #[arg(long, value_delimiter = ',')]
        users: Vec<String>,
        /// Where to write the files (created if missing).
        #[arg(long)]
        dir: PathBuf,
        /// Overwrite files that exist.
        #[arg(long)]
        force: bool,
    },
}

/// How long the CA is valid; the leaves.
const CA_DAYS: u64 = 3650;
const LEAF_DAYS: u64 = 825;

pub(crate) fn certs(command: CertsCommand) -> anyhow::Result<ExitCode> {
    let CertsCommand::Init {
        cluster,
        nodes,
        users,
        dir,
        force,
    } = command;
    let mut names: Vec<&str> = Vec::new();
    for name in nodes.iter().chain(&users) {
        if name.is_empty()
            || name == "ca"
            || name == "coordinator"
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
        {
            bail!(
                "`{name}` cannot name a certificate (letters, digits, '-', '.', '_'; not `ca` or `coordinator`)"
            );
        }
        if names.contains(&name.as_str()) {
            bail!("`{name}` is named twice");
        }
        names.push(name);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("--dir {}", dir.display()))?;
    let mut files = vec!["ca.pem".to_owned(), "ca-key.pem".to_owned()];
    for name in std::iter::once(&"coordinator").chain(&names) {
        files.push(format!("{name}.pem"));
        files.push(format!("{name}-key.pem"));
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

    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, format!("cairn {cluster} CA"));
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = not_before;
    ca.not_after = days(CA_DAYS);
    let ca_cert = ca.self_signed(&ca_key)?;
    write(&dir, "ca.pem", &ca_cert.pem(), false)?;
    write(&dir, "ca-key.pem", &ca_key.serialize_pem(), true)?;
    let issuer = Issuer::new(ca, ca_key);

    let leaf = |name: &str, node: bool| -> anyhow::Result<()> {
        let sans = if node {
            vec![
                name.to_owned(),
                "localhost".to_owned(),
                "127.0.0.1".to_owned(),
            ]
        } else {
            vec![name.to_owned()]
        };
        let mut params = CertificateParams::new(sans)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = if node {
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
        let cert = params.signed_by(&key, &issuer)?;
        write(&dir, &format!("{name}.pem"), &cert.pem(), false)?;
        write(&dir, &format!("{name}-key.pem"), &key.serialize_pem(), true)?;
        Ok(())
    };
    leaf("coordinator", true)?;
    for node in &nodes {
        leaf(node, true)?;
    }
    for user in &users {
        leaf(user, false)?;
    }
    println!(
        "wrote {} files to {} (CA: ca.pem; keys 0600)",
        files.len(),
        dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Writes `text` to `dir/name`, 0600 when `secret` (set at creation: the key is never
/// readable by others, even for a moment).
fn write(dir: &Path, name: &str, text: &str, secret: bool) -> anyhow::Result<()> {
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
