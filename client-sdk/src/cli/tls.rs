//! The TLS flags every daemon takes (`--tls-cert`, `--tls-key`, `--tls-ca` and their
//! `CAIRN_TLS_*` variables), read into a [`Tls`] at start (the warning
//! a daemon logs without them is [`Auth::start`](super::auth::Auth::start)'s). The configurations themselves are
//! built in [`crate::tls`].

use std::path::PathBuf;

use crate::tls::Tls;

/// `--tls-cert`, `--tls-key`, `--tls-ca`: all three or none.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "TLS")]
pub struct TlsArgs {
    /// This process's certificate (PEM; leaf first). Daemons: with --tls-key and --tls-ca,
    /// the coordinator's port and a daemon's peer port serve mutual TLS (client
    /// certificates required) and a daemon's links to the coordinator and to peers use it;
    /// the application port stays plaintext. cairnctl: the client certificate to present
    /// (with --tls-key; --tls-ca alone only checks the server's). `cairnctl certs init`
    /// writes a development CA and certificates.
    #[arg(long, global = true, env = "CAIRN_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, global = true, env = "CAIRN_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The CA (PEM) that peers', the coordinator's and clients' certificates must chain to.
    #[arg(long, global = true, env = "CAIRN_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// A daemon's TLS: `None` without any flag; all three read and checked with all
    /// three; otherwise an error naming the missing flag (or the flag and file at fault).
    pub fn load_daemon(&self) -> Result<Option<Tls>, String> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Tls::from_files(ca, Some((cert, key)))
                .map(Some)
                .map_err(|e| e.to_string()),
            _ => Err(format!(
                "TLS needs --tls-cert, --tls-key and --tls-ca together; {} missing",
                self.missing().join(", ")
            )),
        }
    }

    /// A client's TLS (cairnctl): `None` without any flag; with --tls-ca, the CA and, if
    /// given, the identity of --tls-cert and --tls-key (both or neither).
    pub fn load_client(&self) -> Result<Option<Tls>, String> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => Ok(None),
            (None, None, Some(ca)) => Tls::from_files(ca, None)
                .map(Some)
                .map_err(|e| e.to_string()),
            (Some(cert), Some(key), Some(ca)) => Tls::from_files(ca, Some((cert, key)))
                .map(Some)
                .map_err(|e| e.to_string()),
            (_, _, None) => Err("--tls-cert and --tls-key need --tls-ca".into()),
            _ => Err(format!(
                "a client certificate needs --tls-cert and --tls-key together; {} missing",
                self.missing().join(", ")
            )),
        }
    }

    fn missing(&self) -> Vec<&'static str> {
        [
            ("--tls-cert", self.tls_cert.is_none()),
            ("--tls-key", self.tls_key.is_none()),
            ("--tls-ca", self.tls_ca.is_none()),
        ]
        .into_iter()
        .filter(|(_, missing)| *missing)
        .map(|(flag, _)| flag)
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_three_or_none() {
        assert!(TlsArgs::default().load_daemon().unwrap().is_none());
        let args = TlsArgs {
            tls_cert: Some("c.pem".into()),
            ..Default::default()
        };
        let e = args.load_daemon().unwrap_err();
        assert!(e.contains("--tls-key, --tls-ca missing"), "{e}");
    }
}
