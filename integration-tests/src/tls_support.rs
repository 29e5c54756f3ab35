//! What the TLS tests share: scratch directories, reading a metric from `/metrics` text, and
//! the CA of `cairnctl certs init` as an rcgen issuer (to sign new leaves and CRLs).

use std::path::{Path, PathBuf};

use rcgen::{CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use crate::processes::free_port;

/// A new directory `cairn-{test}-{what}-…` under the system's temporary directory.
pub fn temp_dir(test: &str, what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "cairn-{test}-{what}-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    dir
}

/// The sum of the samples of metric `name` in Prometheus text, of those whose line contains
/// `label` if given (0 when there is none).
pub fn metric(text: &str, name: &str, label: Option<&str>) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter(|l| label.is_none_or(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The CA of `dir` (`ca.pem`, `ca-key.pem` of `cairnctl certs init`) as an issuer.
pub fn ca_issuer(dir: &Path) -> anyhow::Result<Issuer<'static, KeyPair>> {
    let der = CertificateDer::from_pem_file(dir.join("ca.pem"))?;
    let (_, ca) = x509_parser::parse_x509_certificate(&der)?;
    let cn = ca
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .ok_or_else(|| anyhow::anyhow!("the CA of {} has no common name", dir.display()))?
        .to_owned();
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, cn);
    params.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    let key = KeyPair::from_pem(&std::fs::read_to_string(dir.join("ca-key.pem"))?)?;
    Ok(Issuer::new(params, key))
}
