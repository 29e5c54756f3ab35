//! A real etcd for tests, started on free loopback ports with its own data directory and
//! killed when dropped. Fails with a message naming the package when etcd is missing.

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
        };
        etcd.endpoint = format!("http://127.0.0.1:{}", etcd.client_port);
        etcd.resume().await?;
        Ok(etcd)
    }

    /// Stops etcd (SIGKILL), keeping its data.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.kill();
        }
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
        self.process = Some(ChildGuard::spawn(
            "etcd",
            command,
            &self.dir.join("etcd.log"),
        )?);
        let endpoint = self.endpoint.clone();
        eventually("etcd answers", Duration::from_secs(20), || {
            let endpoint = endpoint.clone();
            async move {
                let out = tokio::process::Command::new("etcdctl")
                    .args(["--endpoints", &endpoint, "endpoint", "health"])
                    .env("ETCDCTL_API", "3")
                    .output()
                    .await?;
                anyhow::ensure!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                Ok(())
            }
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
