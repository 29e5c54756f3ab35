//! A real PostgreSQL server for tests (Debian's `postgresql` package): `initdb` into a fresh
//! temporary directory and `postgres` on a free loopback port, with prepared transactions
//! on; killed (its whole process group, by id) and removed when dropped, pass or fail.
//! Fails with a message naming the package when PostgreSQL is missing.
//!
//! PostgreSQL refuses to run as root: when the tests run as root (CI does), the data
//! directory is handed to the `postgres` user the package creates (or `nobody`) and the
//! server runs as that user. It listens on TCP only (no Unix socket, on 127.0.0.1 or the
//! address given), trusts every connection (user `cairn`, a superuser), and does not fsync: a kill of the server (what
//! the tests do) loses nothing the kernel was handed, which is all a committed or prepared
//! transaction needs.

use std::os::unix::fs::MetadataExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use cairn_sdk::tokio_postgres::{self, Client, NoTls};

use crate::processes::{ChildGuard, eventually, free_port};

/// How long the server may take to accept connections (about a second; crash recovery
/// after a kill takes a little longer).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A running PostgreSQL server with prepared transactions on.
pub struct PgServer {
    /// The address it listens on (127.0.0.1 unless [`PgServer::start_on`] said).
    pub host: String,
    /// The port it listens on.
    pub port: u16,
    dir: PathBuf,
    bin: PathBuf,
    /// The user the server runs as, when the tests run as root.
    run_as: Option<(u32, u32)>,
    /// `-c` settings over the defaults.
    settings: Vec<String>,
    process: Option<ChildGuard>,
    starts: u32,
}

/// The directory of `initdb` and `postgres`: on PATH, or Debian's versioned one.
fn pg_bin() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        if dir.join("initdb").is_file() && dir.join("postgres").is_file() {
            return Ok(dir);
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin)| bin.join("initdb").is_file())
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or_else(|| {
        anyhow::anyhow!(
            "PostgreSQL is not installed (no initdb on PATH nor in /usr/lib/postgresql/*/bin): \
             apt-get install postgresql (./scripts/test.sh installs it)"
        )
    })
}

/// The uid and gid of `user` in /etc/passwd.
fn user_ids(user: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        (fields.first() == Some(&user) && fields.len() > 3)
            .then(|| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
            .flatten()
    })
}

/// Hands `path` (and everything under it) to `ids`.
fn chown_all(path: &Path, (uid, gid): (u32, u32)) -> std::io::Result<()> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid))?;
    if path.is_dir() {
        for entry in std::fs::read_dir(path)? {
            chown_all(&entry?.path(), (uid, gid))?;
        }
    }
    Ok(())
}

impl PgServer {
    /// Runs `initdb` into a fresh directory and starts the server on a free port; returns
    /// once it accepts connections.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(&[]).await
    }

    /// As [`Self::start`], with `settings` (`name=value`) over the defaults.
    pub async fn start_with(settings: &[&str]) -> anyhow::Result<Self> {
        Self::start_on("127.0.0.1", settings).await
    }

    /// As [`Self::start_with`], listening on `host` (an address of this machine, e.g. the
    /// bridge's side of network namespaces) instead of 127.0.0.1.
    pub async fn start_on(host: &str, settings: &[&str]) -> anyhow::Result<Self> {
        let bin = pg_bin()?;
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("cairn-pg-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let root = std::fs::metadata("/proc/self")?.uid() == 0;
        let run_as = if root {
            let ids = user_ids("postgres").or_else(|| user_ids("nobody")).ok_or_else(|| {
                anyhow::anyhow!("running as root, and neither a postgres nor a nobody user to run PostgreSQL as")
            })?;
            chown_all(&dir, ids)?;
            Some(ids)
        } else {
            None
        };
        let mut server = Self {
            host: host.to_owned(),
            port,
            dir,
            bin,
            run_as,
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
            process: None,
            starts: 0,
        };
        let mut initdb = server.command("initdb");
        initdb
            .arg("-D")
            .arg(server.data())
            .args([
                "-U",
                "cairn",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "-N",
            ])
            .stdin(Stdio::null());
        let out = initdb.output().context("cannot run initdb")?;
        anyhow::ensure!(
            out.status.success(),
            "initdb failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // initdb trusts loopback only; clients in network namespaces come from the bridge.
        let hba = server.data().join("pg_hba.conf");
        let mut rules = std::fs::read_to_string(&hba)?;
        rules.push_str("host all all 0.0.0.0/0 trust\n");
        std::fs::write(&hba, rules)?;
        server.launch().await?;
        Ok(server)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// A PostgreSQL program, as the user the server runs as.
    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(self.bin.join(program));
        command.current_dir(&self.dir);
        if let Some((uid, gid)) = self.run_as {
            command.uid(uid).gid(gid);
        }
        command
    }

    /// `postgres://cairn@HOST:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://cairn@{}:{}/postgres", self.host, self.port)
    }

    /// The server's process id, `None` while stopped.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(ChildGuard::pid)
    }

    /// A connection (its task spawned on the current runtime).
    pub async fn client(&self) -> anyhow::Result<Client> {
        let (client, connection) = tokio_postgres::connect(&self.url(), NoTls)
            .await
            .with_context(|| format!("connecting to {}", self.url()))?;
        tokio::spawn(connection);
        Ok(client)
    }

    /// Kills the server and every backend of it (SIGKILL to its process group), keeping
    /// its data: a crash. Connections fail until [`PgServer::start_again`].
    pub fn kill(&mut self) {
        if let Some(mut p) = self.process.take() {
            let group = format!("-{}", p.pid());
            let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
            p.kill();
            // Until every backend is gone too: a server started while one lives refuses
            // to start ("pre-existing shared memory block is still in use").
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while std::time::Instant::now() < deadline
                && Command::new("kill")
                    .args(["-0", "--", &group])
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// What the server logged, over all its starts.
    pub fn logged(&self) -> String {
        (1..=self.starts)
            .map(|n| {
                std::fs::read_to_string(self.dir.join(format!("postgres-{n}.log")))
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Starts the server again (killing it first if it runs) on the same port and data;
    /// returns once it accepts connections (after its crash recovery).
    pub async fn start_again(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.launch().await
    }

    async fn launch(&mut self) -> anyhow::Result<()> {
        self.starts += 1;
        let log = self.dir.join(format!("postgres-{}.log", self.starts));
        let mut command = self.command("postgres");
        command
            .arg("-D")
            .arg(self.data())
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-c")
            .arg(format!("listen_addresses={}", self.host))
            .args(["-c", "unix_socket_directories="])
            // Each node keeps at most 8 pending (cairn-bank's --ledger-max-pending) and
            // one in doubt; past the server's limit cuts carry instead of pre-committing.
            .args(["-c", "max_prepared_transactions=64"])
            .args(["-c", "max_connections=60"])
            .args(["-c", "shared_buffers=16MB"])
            .args(["-c", "fsync=off"])
            .args(["-c", "full_page_writes=off"])
            // Its own process group: a kill takes the backends with the postmaster.
            .process_group(0);
        for setting in &self.settings {
            command.args(["-c", setting]);
        }
        let process = ChildGuard::spawn("postgres", command, &log)?;
        self.process = Some(process);
        let url = self.url();
        let ready = eventually("PostgreSQL accepts connections", READY_TIMEOUT, || {
            let url = url.clone();
            async move {
                let (client, connection) = tokio_postgres::connect(&url, NoTls).await?;
                tokio::spawn(connection);
                client.simple_query("SELECT 1").await?;
                Ok(())
            }
        })
        .await;
        if let Err(e) = ready {
            let logged = std::fs::read_to_string(&log).unwrap_or_default();
            self.kill();
            anyhow::bail!("{e:#}\n{}: {logged}", log.display());
        }
        Ok(())
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
