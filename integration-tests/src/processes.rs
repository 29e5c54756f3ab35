//! Real processes for tests: the built binaries, started on free loopback ports and
//! killed (by pid) when their guard drops, pass or fail.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A child process that is killed and reaped when dropped.
pub struct ChildGuard {
    name: String,
    child: Child,
}

impl ChildGuard {
    /// Starts `command`, its output appended to `log`.
    pub fn spawn(name: &str, mut command: Command, log: &std::path::Path) -> anyhow::Result<Self> {
        let out = std::fs::File::create(log)?;
        let child = command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {name}: {e}"))?;
        Ok(Self {
            name: name.to_owned(),
            child,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends SIGTERM and waits up to `timeout` for it to exit; its exit status, or
    /// `None` if it did not exit in time (it is then killed).
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
        None
    }

    /// Sends it `signal` (`-STOP`, `-CONT`, ...) without waiting.
    pub fn signal(&self, signal: &str) {
        signal_pid(self.child.id(), signal);
    }

    /// Kills it now (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends process `pid` `signal` (`-STOP`, `-CONT`, ...) through `kill`.
pub fn signal_pid(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status();
}

/// A free TCP port on 127.0.0.1 for a process to listen on (see
/// [`cairn_cli::local_cluster::free_port`]: never the same port twice in one process).
pub fn free_port() -> u16 {
    cairn_cli::local_cluster::free_port().expect("a free port below the ephemeral range")
}

/// The path of the workspace's built binary `name` (next to the test executable), or the
/// one `CAIRN_BINARY_<NAME>` names (`CAIRN_BINARY_CAIRN_NODE` for `cairn-node`).
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    // Another build of one binary (`cairn-nemesis --node-binary`, a mutant daemon).
    let key = format!("CAIRN_BINARY_{}", name.to_uppercase().replace('-', "_"));
    if let Some(path) = std::env::var_os(&key) {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe()?;
    // A test runs from target/<profile>/deps, a binary (cairn-bench) from target/<profile>.
    let own = exe
        .parent()
        .ok_or_else(|| anyhow::anyhow!("cannot locate the target directory"))?;
    let dir = if own.ends_with("deps") {
        own.parent().unwrap_or(own)
    } else {
        own
    };
    let path = dir.join(name);
    if !path.exists() {
        anyhow::bail!(
            "{} is missing: build the binaries first with `cargo build --bins` (scripts/test.sh does)",
            path.display()
        );
    }
    Ok(path)
}

/// Runs the built `cairnctl` with `args`; panics with its stderr unless it exits 0; its
/// stdout.
pub fn cairnctl_ok(args: &[&str]) -> String {
    let out = Command::new(binary("cairnctl").unwrap())
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cairnctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Retries `probe` every 20 ms until it succeeds or `timeout` passes.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match probe().await {
            Ok(value) => return Ok(value),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                anyhow::bail!("{what}: not within {timeout:?}: {e:#}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}
