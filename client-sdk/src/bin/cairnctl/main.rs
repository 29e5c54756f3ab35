//! `cairnctl`: the command line of cairn. See `cairnctl --help`.

//!
//! This file holds the command line's root (the global flags and the command groups), the
//! dispatch to each group's module, and how errors become exit codes. The groups:
//! [`snapshot`], [`restore`], [`policy`], [`cluster`] (`cluster up`, `demo`), [`health`]
//! (`nodes`, `status`, `health`); [`output`] prints tables and JSON.

mod certs;
mod cluster;
mod health;
mod output;
mod policy;
mod restore;
mod snapshot;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use cairn_sdk::cli;
use clap::{Parser, Subcommand};

use crate::output::Output;

/// Drive a cairn cluster: start, watch, inspect and delete snapshots, list nodes, show and
/// change the snapshot schedule, run a local cluster, or run the whole demo.
///
/// Every flag can also be set by the environment variable shown.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    /// The coordinator's address [default: 127.0.0.1:7000]. For `cluster up` and `demo`,
    /// the address the coordinator they start listens on [default: a free loopback port].
    #[arg(long, global = true, env = "CAIRN_COORDINATOR")]
    coordinator: Option<String>,
    /// A bearer token sent on every call to the coordinator (one its --auth-tokens file
    /// lists; `cairnctl auth token` makes one).
    #[arg(long, global = true, env = "CAIRN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// TLS to the coordinator: --tls-ca alone checks its certificate; with --tls-cert and
    /// --tls-key, this client presents a certificate too (a coordinator with TLS flags
    /// requires one). Also used by `cairnctl health`.
    #[command(flatten)]
    tls: cli::tls::TlsArgs,
    /// Output format.
    #[arg(long, short, global = true, env = "CAIRN_OUTPUT", value_enum, default_value_t = Output::Table)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start, inspect, watch, abort or delete snapshots.
    #[command(subcommand)]
    Snapshot(snapshot::SnapshotCommand),
    /// List the registered node daemons.
    Nodes,
    /// Show or change the snapshot schedule (interval, mode, pause, jitter, tolerated
    /// failures, freshness threshold).
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
    /// The cluster at a glance: members, snapshots in progress, the newest completed one
    /// and its age, the schedule and freshness.
    Status,
    /// Show restore operations (start one with `cairnctl snapshot restore ID`).
    #[command(subcommand)]
    Restore(restore::RestoreCommand),
    /// Ask any cairn server (coordinator, node daemon, bank) for its gRPC health; exits 0
    /// only when it answers SERVING. For container healthchecks and probes.
    Health {
        /// The server's address (HOST:PORT).
        address: String,
        /// The service to ask about; empty: the server as a whole.
        #[arg(long, default_value = "")]
        service: String,
        /// How long to wait for an answer.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
    /// Certificates for mutual TLS (`certs init`: a development CA and every certificate).
    #[command(subcommand)]
    Certs(certs::CertsCommand),
    /// Bearer tokens for a coordinator's or daemon's --auth-tokens file.
    #[command(subcommand)]
    Auth(AuthCommand),
    /// Run a local cluster (a coordinator, N node daemons, N bank apps) on loopback.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// The whole story: a local cluster on the embedded store, a bank workload, one snapshot
    /// in each mode while transfers run, and a table of results. Exits 0 only if every
    /// snapshot verified and the money adds up. The cluster runs mutual TLS and bearer
    /// tokens (its CA, certificates and admin token in DIR/tls) unless --insecure.
    Demo {
        /// Nodes in the cluster.
        #[arg(long, env = "CAIRN_NODES", default_value_t = 3)]
        nodes: usize,
        /// Random transfers per second per bank.
        #[arg(long, env = "CAIRN_WORKLOAD", default_value_t = 200.0)]
        workload: f64,
        /// Directory for the cluster's data and logs (default: a temporary one, removed after).
        #[arg(long, env = "CAIRN_DIR")]
        dir: Option<PathBuf>,
        /// Run the cluster plaintext and without tokens (one warning line). Without it, the
        /// coordinator's port, each daemon's peer and application ports, the banks and
        /// /metrics serve mutual TLS (each bank presents its node's certificate), the
        /// coordinator and NodeAdmin
        /// want a role, and cairnctl calls them with an admin certificate and token it made
        /// for the run.
        #[arg(long)]
        insecure: bool,
    },
}

#[derive(Debug, Subcommand)]
enum AuthCommand {
    /// Print a new random token and the line that admits it, to add to the tokens file
    /// (`ROLE SHA256HEX [NAME]`; the file keeps only the token's SHA-256).
    Token {
        /// The token's role: viewer, operator or admin.
        #[arg(long)]
        role: cli::auth::Role,
        /// A name for the token, kept in the file for people and logs.
        #[arg(long)]
        name: Option<String>,
    },
}

/// The `--token` every coordinator client of this run sends.
static TOKEN: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// The `--tls-*` of this run (none: plaintext).
static TLS: std::sync::OnceLock<Option<cairn_sdk::tls::Tls>> = std::sync::OnceLock::new();

/// The `--tls-*` of this run, if any.
pub(crate) fn tls() -> Option<&'static cairn_sdk::tls::Tls> {
    TLS.get().and_then(Option::as_ref)
}

/// A client of the coordinator at `address`, sending `--token` if given.
pub(crate) async fn connect(
    address: &str,
) -> Result<cairn_sdk::CoordinatorClient, cairn_sdk::Error> {
    let token = TOKEN.get().and_then(|t| t.as_deref());
    cairn_sdk::CoordinatorClient::connect_with(address, token, tls()).await
}

fn main() -> ExitCode {
    let cli: Cli = match cli::parse_or_exit() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let local = matches!(cli.command, Command::Cluster(_) | Command::Demo { .. });
    // A flag given on the command line, not a variable (the `export CAIRN_TLS_…` that
    // `cluster up` prints stays harmless for the next `cluster up`).
    let flag = |value: &Option<PathBuf>, variable: &str| {
        value
            .as_ref()
            .is_some_and(|v| std::env::var_os(variable).as_deref() != Some(v.as_os_str()))
    };
    if local
        && (flag(&cli.tls.tls_cert, "CAIRN_TLS_CERT")
            || flag(&cli.tls.tls_key, "CAIRN_TLS_KEY")
            || flag(&cli.tls.tls_ca, "CAIRN_TLS_CA"))
    {
        return cli::usage_error(
            "--tls-cert/--tls-key/--tls-ca are for the commands that call a coordinator or \
             a server; `cluster up` and `demo` make their own CA and certificates in their \
             directory (or run plaintext with --insecure)",
        );
    }
    // `certs` and `auth` call no server, and the local cluster uses its own certificates:
    // their TLS flags (or variables) are not read.
    if !local && !matches!(cli.command, Command::Certs(_) | Command::Auth(_)) {
        match cli.tls.load_client() {
            Ok(tls) => {
                let _ = TLS.set(tls);
            }
            Err(e) => return cli::usage_error(e),
        }
    }
    cli::init_logging(
        &std::env::var("CAIRN_LOG").unwrap_or_else(|_| "warn".into()),
        false,
    );
    let Ok(runtime) = tokio::runtime::Runtime::new() else {
        eprintln!("error: cannot start the runtime");
        return ExitCode::FAILURE;
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            // A refusal from a server reads as its reason and its gRPC code.
            match e.downcast_ref::<tonic::Status>() {
                Some(status) => {
                    // A failed connection (no TLS, or a refused certificate) carries why.
                    let mut why = String::new();
                    let mut source = std::error::Error::source(status);
                    while let Some(cause) = source {
                        why.push_str(&format!(": {cause}"));
                        source = cause.source();
                    }
                    // A TLS failure first says what it means (an expired certificate, ...).
                    match cairn_sdk::tls::explain(status) {
                        Some(tls) => eprintln!(
                            "error: {tls}: {}{why} ({:?})",
                            status.message(),
                            status.code()
                        ),
                        None => eprintln!("error: {}{why} ({:?})", status.message(), status.code()),
                    }
                    if let Some(hint) = plaintext_hint(&why) {
                        eprintln!("{hint}");
                    }
                }
                None => eprintln!("error: {e:#}"),
            }
            ExitCode::FAILURE
        }
    }
}

/// A hint when a plaintext connection failed after it was made (`why`: the transport
/// error's causes): a server with TLS closes plaintext connections without a word, as a
/// secure local cluster does.
fn plaintext_hint(why: &str) -> Option<&'static str> {
    let connection_lost = why.contains("transport error")
        && !why.contains("tcp connect error")
        && !why.contains("Connection refused");
    (tls().is_none() && connection_lost).then_some(
        "hint: no --tls-ca was given and the server closed the connection: it probably serves \
         TLS (as `cairnctl cluster up` and `demo` start it unless --insecure); give --tls-ca, \
         --tls-cert, --tls-key and --token, or the CAIRN_TLS_* and CAIRN_TOKEN lines `cluster \
         up` printed",
    )
}

/// The coordinator the commands that talk to one use.
const DEFAULT_COORDINATOR: &str = "127.0.0.1:7000";

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    // `cluster up` and `demo` start a coordinator: given, it listens there.
    let listen = cli.coordinator.clone();
    let _ = TOKEN.set(cli.token.clone());
    let coordinator = cli.coordinator.as_deref().unwrap_or(DEFAULT_COORDINATOR);
    match cli.command {
        Command::Snapshot(command) => snapshot::snapshot(coordinator, cli.output, command).await,
        Command::Policy(command) => policy::policy(coordinator, cli.output, command).await,
        Command::Status => health::status(coordinator, cli.output).await,
        Command::Restore(command) => restore::restore(coordinator, cli.output, command).await,
        Command::Health {
            address,
            service,
            timeout,
        } => health::health(&address, &service, timeout).await,
        Command::Nodes => health::nodes(coordinator, cli.output).await,
        Command::Auth(AuthCommand::Token { role, name }) => {
            let (token, line) = cli::auth::new_token(role, name.as_deref());
            match cli.output {
                Output::Json => println!(
                    "{}",
                    serde_json::json!({ "token": token, "role": role.as_str(), "line": line })
                ),
                _ => {
                    println!("token: {token}");
                    println!("add this line to the --auth-tokens file:");
                    println!("{line}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Certs(command) => certs::certs(command),
        Command::Cluster(command) => cluster::cluster(command, listen).await,
        Command::Demo {
            nodes,
            workload,
            dir,
            insecure,
        } => cluster::demo(nodes, workload, listen, dir, insecure).await,
    }
}
