//! `cairnctl cluster up` and `cairnctl demo`: a local cluster on loopback, and the whole
//! story told on one.
//!
//! Both are secure unless `--insecure`: they write a CA and every certificate into
//! `<dir>/tls` (`certs::init`, as `certs init` does, anew at each start), a tokens file
//! admitting one admin token, start every process with `--tls-*` and `--auth-tokens`,
//! and print what a user needs to call the cluster (`access`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use cairn_cli::bank::{BankState, TransferPayload};
use cairn_cli::local_cluster::{ClusterSpec, LocalCluster, Security};
use cairn_proto::v1 as pb;
use cairn_rpc::server::auth::Role;
use cairn_sdk::CoordinatorClient;
use clap::Subcommand;

use crate::output::{snapshot_row, table};
use crate::snapshot::{Mode, wait_for};

#[derive(Debug, Subcommand)]
pub(crate) enum ClusterCommand {
    /// Start the processes, write their addresses to a JSON file, and stay in the
    /// foreground until interrupted (Ctrl-C), then stop them all.
    Up {
        /// Nodes (and bank apps).
        #[arg(long, env = "CAIRN_NODES", default_value_t = 3)]
        nodes: usize,
        /// etcd endpoint(s) for the coordinator (default: the embedded store).
        #[arg(long, env = "CAIRN_ETCD", value_delimiter = ',')]
        etcd: Vec<String>,
        /// Data directory (metadata, blobs, logs).
        #[arg(long, env = "CAIRN_DIR", default_value = "cairn-cluster")]
        dir: PathBuf,
        /// Where to write the addresses.
        #[arg(long, env = "CAIRN_ADDRESSES", default_value = "cairn-cluster.json")]
        addresses: PathBuf,
        /// Random transfers per second per bank.
        #[arg(long, env = "CAIRN_WORKLOAD", default_value_t = 0.0)]
        workload: f64,
        /// Run plaintext and without tokens: anyone who can reach a port may call
        /// everything, restores and deletes included. Without it the cluster runs mutual
        /// TLS and bearer tokens, with a CA, certificates and an admin token written anew
        /// to DIR/tls at each start, and prints what cairnctl and grpcurl need.
        #[arg(long)]
        insecure: bool,
    },
}

/// `cairnctl cluster …`.
pub(crate) async fn cluster(
    command: ClusterCommand,
    coordinator: Option<String>,
) -> anyhow::Result<ExitCode> {
    match command {
        ClusterCommand::Up {
            nodes,
            etcd,
            dir,
            addresses,
            workload,
            insecure,
        } => cluster_up(nodes, etcd, coordinator, dir, addresses, workload, insecure).await,
    }
}

fn bin_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    Ok(exe
        .parent()
        .ok_or_else(|| anyhow::anyhow!("cannot locate cairnctl's directory"))?
        .to_owned())
}

/// The name of the person's certificate a secure local cluster writes (role admin).
const ADMIN: &str = "admin";

/// Writes `dir/tls`: a CA, the coordinator's and every node's certificate, an admin's
/// (`admin.pem`, role admin), a tokens file admitting one admin token and that token
/// (`admin.token`, 0600). Everything is written anew: a cluster started again gets a new
/// CA and token. `coordinator`: the address it was asked to listen on, whose host (if not
/// loopback or every interface) its certificate names too.
fn secure_files(
    dir: &Path,
    nodes: usize,
    coordinator: Option<&str>,
) -> anyhow::Result<(Security, String)> {
    let tls = std::path::absolute(dir.join("tls"))?;
    let ids: Vec<String> = (1..=nodes).map(|i| format!("n{i}")).collect();
    let mut san = Vec::new();
    if let Some(address) = coordinator
        && let Some(host) = std::net::ToSocketAddrs::to_socket_addrs(address)
            .ok()
            .and_then(|mut a| a.next())
            .map(|a| a.ip())
        && !host.is_loopback()
        && !host.is_unspecified()
    {
        san.push(host.to_string());
    }
    crate::certs::init(
        "cairn",
        &ids,
        &[(ADMIN.to_owned(), Role::Admin)],
        &san,
        &[],
        &tls,
        true,
    )?;
    let (token, line) = cairn_rpc::server::auth::new_token(Role::Admin, Some(ADMIN));
    crate::certs::write(
        &tls,
        "tokens",
        &format!("# the local cluster's tokens: ROLE SHA256HEX NAME\n{line}\n"),
        true,
    )?;
    crate::certs::write(&tls, "admin.token", &format!("{token}\n"), true)?;
    let security = Security {
        ca: tls.join("ca.pem"),
        cert: tls.join(format!("{ADMIN}.pem")),
        key: tls.join(format!("{ADMIN}-key.pem")),
        auth_tokens: tls.join("tokens"),
        token_file: tls.join("admin.token"),
        certs_dir: tls,
    };
    Ok((security, token))
}

/// A word for a shell: as it is, or single-quoted.
fn shell_word(text: &str) -> String {
    if !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-:=@,+".contains(c))
    {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// What a user needs to call the secure cluster at `coordinator`, ready to paste, under
/// `heading`: the files, the token, cairnctl's variables and a grpcurl line.
fn access(
    heading: &str,
    coordinator: &str,
    console: &str,
    security: &Security,
    token: &str,
) -> String {
    let path = |p: &Path| shell_word(&p.display().to_string());
    let (ca, cert, key) = (
        path(&security.ca),
        path(&security.cert),
        path(&security.key),
    );
    format!(
        "{heading}\n  \
         coordinator   {coordinator}\n  \
         CA            {ca}\n  \
         certificate   {cert} (key {key}; role admin)\n  \
         admin token   {token} (also in {}, 0600)\n\
         cairnctl:\n  \
         export CAIRN_COORDINATOR={coordinator} CAIRN_TLS_CA={ca} CAIRN_TLS_CERT={cert} CAIRN_TLS_KEY={key} CAIRN_TOKEN={token}\n\
         grpcurl:\n  \
         grpcurl -cacert {ca} -cert {cert} -key {key} -H \"authorization: Bearer {token}\" {coordinator} cairn.v1.Coordinator/ListSnapshots\n\
         web console (a browser with the certificate imported, or curl):\n  \
         https://{console}/\n  \
         curl --cacert {ca} --cert {cert} --key {key} https://{console}/api/v1/snapshots",
        path(&security.token_file),
    )
}

/// The one line `--insecure` prints.
const INSECURE: &str = "warning: --insecure: the cluster runs plaintext without tokens; anyone who can reach its ports can call everything, restores and deletes included";

async fn cluster_up(
    nodes: usize,
    etcd: Vec<String>,
    coordinator: Option<String>,
    dir: PathBuf,
    addresses: PathBuf,
    workload: f64,
    insecure: bool,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(nodes >= 1, "--nodes must be at least 1");
    let (security, token) = if insecure {
        eprintln!("{INSECURE}");
        (None, None)
    } else {
        let (security, token) = secure_files(&dir, nodes, coordinator.as_deref())?;
        (Some(security), Some(token))
    };
    let spec = ClusterSpec {
        nodes,
        etcd,
        coordinator,
        data_dir: dir,
        workload,
        initial_balance: 1000,
        bin_dir: bin_dir()?,
        security,
    };
    let mut cluster = LocalCluster::start(&spec).await?;
    if let Err(e) = cluster.wait_ready(Duration::from_secs(30)).await {
        cluster.stop(Duration::from_secs(5)).await;
        return Err(e);
    }
    std::fs::write(&addresses, serde_json::to_vec_pretty(&cluster.addresses)?)?;
    eprintln!(
        "cluster up: coordinator {}, {} nodes; web console {}://{}/; addresses in {}; logs in {}. Ctrl-C stops it.",
        cluster.addresses.coordinator,
        nodes,
        if spec.security.is_some() {
            "https"
        } else {
            "http"
        },
        cluster.addresses.coordinator_metrics,
        addresses.display(),
        spec.data_dir.join("logs").display()
    );
    if let (Some(security), Some(token)) = (&spec.security, &token) {
        eprintln!(
            "{}",
            access(
                "mutual TLS and bearer tokens are on (--insecure turns them off); to call the cluster:",
                &cluster.addresses.coordinator,
                &cluster.addresses.coordinator_metrics,
                security,
                token
            )
        );
    }
    let mut ticker = tokio::time::interval(Duration::from_millis(500));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let code = loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break ExitCode::SUCCESS,
            _ = term.recv() => break ExitCode::SUCCESS,
            _ = ticker.tick() => {
                let exited = cluster.exited();
                if !exited.is_empty() {
                    eprintln!("error: {}", exited.join("; "));
                    break ExitCode::FAILURE;
                }
            }
        }
    };
    cluster.stop(Duration::from_secs(5)).await;
    Ok(code)
}

/// Money in a snapshot of banks: recorded balances plus recorded transfers in flight.
fn money(snapshot: &pb::Snapshot) -> anyhow::Result<(u64, u64)> {
    let mut balances = 0;
    let mut in_flight = 0;
    for node in &snapshot.nodes {
        let state: BankState = serde_json::from_slice(&node.local_state).map_err(|e| {
            anyhow::anyhow!("{}: local state is not a bank state: {e}", node.node_id)
        })?;
        balances += state.balance;
        for channel in &node.channel_states {
            for message in &channel.messages {
                in_flight += TransferPayload::decode(&message.payload)?.amount;
            }
        }
    }
    Ok((balances, in_flight))
}

pub(crate) async fn demo(
    nodes: usize,
    workload: f64,
    coordinator: Option<String>,
    dir: Option<PathBuf>,
    insecure: bool,
    stay: bool,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(nodes >= 2, "the demo needs at least 2 nodes");
    let temporary = dir.is_none();
    let data_dir = dir
        .unwrap_or_else(|| std::env::temp_dir().join(format!("cairn-demo-{}", std::process::id())));
    let initial_balance = 1000;
    let (security, token) = if insecure {
        outln!("{INSECURE}");
        (None, None)
    } else {
        let (security, token) = secure_files(&data_dir, nodes, coordinator.as_deref())?;
        (Some(security), Some(token))
    };
    let spec = ClusterSpec {
        nodes,
        etcd: Vec::new(),
        coordinator,
        data_dir: data_dir.clone(),
        workload,
        initial_balance,
        bin_dir: bin_dir()?,
        security,
    };
    outln!(
        "starting a local cluster: 1 coordinator (embedded store), {nodes} node daemons, {nodes} banks at {workload} transfers/s each{}",
        if insecure {
            ""
        } else {
            "; mutual TLS and bearer tokens on (--insecure turns them off)"
        }
    );
    let cluster = LocalCluster::start(&spec).await?;
    let result = demo_story(&cluster, initial_balance * nodes as u64, token.as_deref()).await;
    if stay && result.is_ok() {
        outln!(
            "the cluster keeps running (--stay): open the web console at {}://{}/ ; Ctrl-C stops it.",
            if insecure { "http" } else { "https" },
            cluster.addresses.coordinator_metrics
        );
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    cluster.stop(Duration::from_secs(5)).await;
    if temporary && result.is_ok() {
        let _ = std::fs::remove_dir_all(&data_dir);
    } else {
        outln!("data and logs kept in {}", data_dir.display());
    }
    result
}

/// `token`: the admin token of a secure cluster (whose TLS is the cluster's).
async fn demo_story(
    cluster: &LocalCluster,
    total: u64,
    token: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let address = &cluster.addresses.coordinator;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut client = loop {
        match CoordinatorClient::connect_with(address, token, cluster.client_tls()).await {
            Ok(c) => break c,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("coordinator not up yet: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    cluster.wait_ready(Duration::from_secs(30)).await?;
    let scheme = if token.is_some() { "https" } else { "http" };
    outln!(
        "web console: {scheme}://{}/ (snapshots as they happen; --stay keeps the cluster up after the table)",
        cluster.addresses.coordinator_metrics
    );
    if let (Some(security), Some(token)) = (&cluster.addresses.security, token) {
        outln!(
            "{}",
            access(
                "to call the cluster while the demo runs (--dir keeps the files):",
                address,
                &cluster.addresses.coordinator_metrics,
                security,
                token
            )
        );
    }
    // Let the workload run for a moment so that messages are in flight.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut rows = Vec::new();
    let mut all_good = true;
    for mode in [Mode::ChandyLamport, Mode::Unaligned, Mode::Aligned] {
        let id = client
            .start_snapshot(pb::StartSnapshotRequest {
                mode: mode.pb() as i32,
                timeout_ms: 20_000,
                ..Default::default()
            })
            .await?;
        let snapshot = wait_for(&mut client, id, true).await?;
        let completed = snapshot.status == pb::SnapshotStatus::Completed as i32;
        let (adds_up, money_text) = match money(&snapshot) {
            Ok((balances, in_flight)) if completed => {
                let ok = balances + in_flight == total;
                (
                    ok,
                    format!(
                        "{balances} + {in_flight} = {} of {total}",
                        balances + in_flight
                    ),
                )
            }
            Ok(_) => (false, "-".into()),
            Err(e) => (false, e.to_string()),
        };
        all_good &= completed && adds_up;
        let row = snapshot_row(&snapshot);
        rows.push(vec![
            row[0].clone(),
            row[1].clone(),
            row[3].clone(),
            row[4].clone(),
            row[5].clone(),
            format!("{} ({money_text})", if adds_up { "yes" } else { "NO" }),
            row[6].clone(),
        ]);
    }
    outln!();
    table(
        &[
            "ID",
            "MODE",
            "DURATION",
            "NODES",
            "IN-FLIGHT",
            "MONEY ADDS UP",
            "VERDICT",
        ],
        rows,
    );
    outln!();
    if all_good {
        outln!("every snapshot completed, verified as a consistent cut, and the money adds up.");
        Ok(ExitCode::SUCCESS)
    } else {
        outln!(
            "FAILED: a snapshot did not complete, or its money does not add up (logs in {}).",
            cluster.addresses.data_dir.join("logs").display()
        );
        Ok(ExitCode::FAILURE)
    }
}
