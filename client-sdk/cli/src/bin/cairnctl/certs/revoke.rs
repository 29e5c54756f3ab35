//! `cairnctl certs revoke`: a CRL of the cluster's CA, for the daemons' `--tls-crl`.

use super::*;

/// Writes `dir/crl.pem`: a CRL signed by the CA of `dir` listing the certificates `names`
/// (`dir/NAME.pem` or paths) and those `dir/crl.pem` listed before; next update in `days`.
/// Returns how many certificates it lists.
pub(crate) fn revoke(dir: &Path, names: &[String], days: u64) -> anyhow::Result<usize> {
    use rcgen::{
        CertificateRevocationListParams, KeyIdMethod, RevocationReason, RevokedCertParams,
        SerialNumber,
    };
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, CertificateRevocationListDer};

    let read = |path: &Path| std::fs::read(path).with_context(|| format!("{}", path.display()));
    let ca_path = dir.join("ca.pem");
    let ca_der = CertificateDer::from_pem_slice(&read(&ca_path)?)
        .map_err(|e| anyhow::anyhow!("{}: not a PEM certificate: {e}", ca_path.display()))?;
    let (_, ca) = x509_parser::parse_x509_certificate(&ca_der)
        .map_err(|e| anyhow::anyhow!("{}: {e}", ca_path.display()))?;
    let key_path = dir.join("ca-key.pem");
    let key = KeyPair::from_pem(&String::from_utf8_lossy(&read(&key_path)?))
        .map_err(|e| anyhow::anyhow!("{}: not a PEM private key: {e}", key_path.display()))?;
    if key.public_key_raw() != ca.public_key().subject_public_key.data.as_ref() {
        bail!(
            "{} is not the key of {}",
            key_path.display(),
            ca_path.display()
        );
    }
    // The issuer as `init` wrote it: a CN only (the CRL's issuer name must be the CA's
    // subject, byte for byte).
    let cn = ca
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .with_context(|| format!("{}: a CA without a common name", ca_path.display()))?;
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, cn);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let issuer = Issuer::new(params, key);

    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .context("the clock is before 1970")?;
    let at = |secs: u64| rcgen::date_time_ymd(1970, 1, 1) + Duration::from_secs(secs);
    let mut revoked: Vec<RevokedCertParams> = Vec::new();
    let crl_path = dir.join("crl.pem");
    if crl_path.exists() {
        for crl in CertificateRevocationListDer::pem_slice_iter(&read(&crl_path)?) {
            let crl =
                crl.map_err(|e| anyhow::anyhow!("{}: not a PEM CRL: {e}", crl_path.display()))?;
            let (_, crl) = x509_parser::parse_x509_crl(&crl)
                .map_err(|e| anyhow::anyhow!("{}: {e}", crl_path.display()))?;
            for entry in crl.iter_revoked_certificates() {
                revoked.push(RevokedCertParams {
                    serial_number: SerialNumber::from_slice(entry.raw_serial()),
                    revocation_time: at(entry.revocation_date.timestamp().max(0) as u64),
                    reason_code: None,
                    invalidity_date: None,
                });
            }
        }
    }
    for name in names {
        let path = if name.contains('/') || name.ends_with(".pem") {
            PathBuf::from(name)
        } else {
            dir.join(format!("{name}.pem"))
        };
        let der = CertificateDer::from_pem_slice(&read(&path)?)
            .map_err(|e| anyhow::anyhow!("{}: not a PEM certificate: {e}", path.display()))?;
        let (_, cert) = x509_parser::parse_x509_certificate(&der)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let not_before = cert.validity().not_before.timestamp().max(0) as u64;
        if cert.issuer() != ca.subject() || !signed_by(&ca_der, &der, not_before) {
            bail!(
                "{}: not issued by the CA of {} (its issuer is {}{})",
                path.display(),
                ca_path.display(),
                cert.issuer(),
                if cert.issuer() == ca.subject() {
                    ", another CA of that name"
                } else {
                    ""
                }
            );
        }
        let serial = SerialNumber::from_slice(cert.raw_serial());
        if revoked.iter().all(|r| r.serial_number != serial) {
            revoked.push(RevokedCertParams {
                serial_number: serial,
                revocation_time: at(now.as_secs()),
                reason_code: Some(RevocationReason::Unspecified),
                invalidity_date: None,
            });
        }
    }
    let listed = revoked.len();
    let crl = CertificateRevocationListParams {
        // A minute back, for clocks a little behind this one.
        this_update: at(now.as_secs().saturating_sub(60)),
        next_update: at(now.as_secs() + days.max(1) * 86_400),
        // Increasing from one CRL to the next.
        crl_number: SerialNumber::from(now.as_secs()),
        issuing_distribution_point: None,
        revoked_certs: revoked,
        key_identifier_method: KeyIdMethod::Sha256,
    }
    .signed_by(&issuer)
    .context("signing the CRL")?;
    let pem = crl.pem().context("the CRL's PEM")?;
    write(dir, "crl.pem.new", &pem, false)?;
    std::fs::rename(dir.join("crl.pem.new"), &crl_path)
        .with_context(|| format!("{}", crl_path.display()))?;
    Ok(listed)
}

/// Whether `ca` signed `leaf` (checked as rustls checks a client's or a server's
/// certificate, at `at`, seconds since the epoch: the leaf's not-before, so that an expired
/// certificate can be revoked too).
fn signed_by(ca: &[u8], leaf: &[u8], at: u64) -> bool {
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{CertificateError, Error::InvalidCertificate};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    if roots.add(CertificateDer::from(ca.to_vec())).is_err() {
        return false;
    }
    let roots = Arc::new(roots);
    let leaf = CertificateDer::from(leaf.to_vec());
    let at = UnixTime::since_unix_epoch(Duration::from_secs(at));
    let as_client = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .map(|v| v.verify_client_cert(&leaf, &[], at).map(|_| ()));
    let result = match as_client {
        Ok(Err(InvalidCertificate(
            CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. },
        ))) => {
            let name = ServerName::try_from("cairn.invalid").expect("a valid name");
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map(|v| v.verify_server_cert(&leaf, &[], &name, &[], at).map(|_| ()))
        }
        other => other,
    };
    !matches!(
        result,
        Ok(Err(InvalidCertificate(
            CertificateError::UnknownIssuer | CertificateError::BadSignature
        )))
    )
}
