//! A real etcd for tests, started on free loopback ports with its own data directory and
//! killed when dropped. Fails with a message naming the package when etcd is missing.
//! [`Etcd::start_tls`] starts one serving `https://` that requires client certificates.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::processes::{ChildGuard, eventually, free_port};

/// A running etcd.
pub struct Etcd {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    client_port: u16,
    peer_port: u16,
    dir: PathBuf,
    process: Option<ChildGuard>,
    tls: Option<EtcdTlsFiles>,
}

/// The PEM files of an etcd serving TLS with client-certificate authentication.
#[derive(Debug, Clone)]
pub struct EtcdTlsFiles {
    /// The CA that signed the server's certificate and that client certificates must
    /// chain to (`--trusted-ca-file`).
    pub ca: PathBuf,
    /// The server's certificate (SANs `127.0.0.1` and `localhost`) and key; `etcdctl`
    /// calls of this harness present them as their client certificate too.
    pub cert: PathBuf,
    /// The key of `cert`.
    pub key: PathBuf,
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub async fn start() -> anyhow::Result<Self> {
        let dir =
            std::env::temp_dir().join(format!("cairn-etcd-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir)?;
        let mut etcd = Self {
            endpoint: String::new(),
            client_port: free_port(),
            peer_port: free_port(),
            dir,
            process: None,
            tls: None,
        };
        etcd.endpoint = format!("http://127.0.0.1:{}", etcd.client_port);
        etcd.resume().await?;
        Ok(etcd)
    }

    /// Starts etcd serving `https://127.0.0.1:PORT` with `tls`'s certificate, requiring
    /// client certificates signed by its CA (`--client-cert-auth`); waits until it answers.
    pub async fn start_tls(tls: EtcdTlsFiles) -> anyhow::Result<Self> {
        let dir =
            std::env::temp_dir().join(format!("cairn-etcd-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir)?;
        let client_port = free_port();
        let mut etcd = Self {
            endpoint: format!("https://127.0.0.1:{client_port}"),
            client_port,
            peer_port: free_port(),
            dir,
            process: None,
            tls: Some(tls),
        };
        etcd.resume().await?;
        Ok(etcd)
    }

    /// `etcdctl` against this etcd (with TLS: the server's certificate as client
    /// certificate), as `user` (`NAME:PASSWORD`) if given; its stdout, or an error with
    /// its stderr.
    pub async fn etcdctl(&self, user: Option<&str>, args: &[&str]) -> anyhow::Result<String> {
        let mut command = tokio::process::Command::new("etcdctl");
        command
            .args(["--endpoints", &self.endpoint])
            .env("ETCDCTL_API", "3")
            .kill_on_drop(true);
        if let Some(tls) = &self.tls {
            command
                .arg("--cacert")
                .arg(&tls.ca)
                .arg("--cert")
                .arg(&tls.cert)
                .arg("--key")
                .arg(&tls.key);
        }
        if let Some(user) = user {
            command.args(["--user", user]);
        }
        let out = command.args(args).output().await?;
        anyhow::ensure!(
            out.status.success(),
            "etcdctl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8(out.stdout)?)
    }

    /// Stops etcd (SIGKILL), keeping its data.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.kill();
        }
    }

    /// Its process id while it runs (to pause it with SIGSTOP).
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(ChildGuard::pid)
    }

    /// Starts etcd again on the same ports and data; waits until it answers.
    pub async fn resume(&mut self) -> anyhow::Result<()> {
        let binary = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .ok_or_else(|| anyhow::anyhow!("etcd is not installed: run `apt-get install -y etcd-server etcd-client` (scripts/test.sh does)"))?;
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new(binary);
        command
            .args(["--name", "test", "--data-dir"])
            .arg(self.dir.join("data"))
            .args([
                "--listen-client-urls",
                &self.endpoint,
                "--advertise-client-urls",
                &self.endpoint,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("test={peer}")])
            .env("ETCD_UNSUPPORTED_ARCH", "");
        if let Some(tls) = &self.tls {
            command
                .arg("--cert-file")
                .arg(&tls.cert)
                .arg("--key-file")
                .arg(&tls.key)
                .arg("--trusted-ca-file")
                .arg(&tls.ca)
                .arg("--client-cert-auth");
        }
        self.process = Some(ChildGuard::spawn(
            "etcd",
            command,
            &self.dir.join("etcd.log"),
        )?);
        eventually("etcd answers", Duration::from_secs(20), || async {
            self.etcdctl(None, &["endpoint", "health"]).await.map(drop)
        })
        .await
    }

    /// `etcdctl get --prefix PREFIX` as text.
    pub async fn get_prefix(&self, prefix: &str) -> anyhow::Result<String> {
        let out = tokio::process::Command::new("etcdctl")
            .args(["--endpoints", &self.endpoint, "get", "--prefix", prefix])
            .env("ETCDCTL_API", "3")
            .output()
            .await?;
        anyhow::ensure!(
            out.status.success(),
            "etcdctl: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8(out.stdout)?)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
