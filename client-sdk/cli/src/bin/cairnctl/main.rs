//! `cairnctl`: the command line of cairn. See `cairnctl --help`.

//!
//! This file holds the command line's root (the global flags and the command groups), the
//! dispatch to each group's module, and how errors become exit codes. The groups:
//! [`snapshot`], [`restore`], [`policy`], [`cluster`] (`cluster up`, `demo`), [`health`]
//! (`nodes`, `status`, `health`); [`output`] prints tables and JSON.

/// `print!` to stdout that ends the program quietly (exit 0) when stdout is a pipe closed
/// by its reader (`cairnctl … | head -1`), as `ls | head` does, instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!($($arg)*))
    };
}

/// `println!`, as [`out!`].
macro_rules! outln {
    () => {
        $crate::output::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod certs;
mod cluster;
mod health;
mod hints;
mod output;
mod policy;
mod restore;
mod snapshot;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use cairn_rpc::server as cli;
use clap::{Parser, Subcommand};

use crate::output::Output;

/// Drive a cairn cluster: start, watch, inspect and delete snapshots, list nodes, show and
/// change the snapshot schedule, run a local cluster, or run the whole demo.
///
/// Every flag can also be set by the environment variable shown.
#[derive(Debug, Parser)]
#[command(name = "cairnctl", version = cairn_rpc::version::VERSION)]
struct Cli {
    /// The coordinator's address (HOST:PORT), or its replicas' as a comma-separated list
    /// (at most 16): cairnctl asks each in turn whether it leads, goes to the leader a
    /// follower names, and waits up to 10 s for an election before it settles for a
    /// follower (reads work there; writes fail with UNAVAILABLE, naming the leader)
    /// [default: 127.0.0.1:7000]. For `cluster up` and `demo`, the one address the
    /// coordinator they start listens on [default: a free loopback port].
    #[arg(
        long,
        global = true,
        env = "CAIRN_COORDINATOR",
        value_name = "ADDRESS[,ADDRESS...]"
    )]
    coordinator: Option<String>,
    /// A bearer token sent on every call to the coordinator (one its --auth-tokens file
    /// lists; `cairnctl auth token` makes one). A flag shows in `ps` and the shell's
    /// history: prefer --token-file. Without TLS (--tls-ca) the token travels in clear text,
    /// and cairnctl warns when the coordinator is not on loopback.
    #[arg(
        long,
        global = true,
        env = "CAIRN_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file"
    )]
    token: Option<String>,
    /// A file holding the bearer token to send (one token; surrounding whitespace and a
    /// final newline are ignored), so that the token never appears on a command line or in
    /// `ps`. Conflicts with --token.
    #[arg(long, global = true, env = "CAIRN_TOKEN_FILE", value_name = "FILE")]
    token_file: Option<PathBuf>,
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
enum NodesCommand {
    /// List the nodes: address, connected, incarnation, application (the default).
    List,
    /// Remove a node whose daemon is down for good (a scale-down, a machine retired): every
    /// daemon drops its channels to and from it, and later snapshots span the rest. Refused
    /// while its daemon is connected (stop it first; a daemon stopped with
    /// --leave-on-shutdown removes itself) or while a restore runs. A removed node that comes
    /// back joins as a new member. Needs the admin role.
    Remove {
        /// The node's id.
        node: String,
    },
    /// One daemon's own account (NodeAdmin/GetNodeStatus on its peer port, not through the
    /// coordinator): its epoch, inbox, snapshots in flight, the application's delivery
    /// window, and per channel what is queued, held and why, markers, credits. README
    /// "Fault injection" defines each field. Needs the viewer role.
    Status {
        /// The daemon's peer address (HOST:PORT, its --peer-listen / --advertise).
        address: String,
    },
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start, inspect, watch, abort or delete snapshots.
    #[command(subcommand)]
    Snapshot(snapshot::SnapshotCommand),
    /// List the cluster's nodes (`cairnctl nodes`), or remove one that is down.
    Nodes {
        #[command(subcommand)]
        command: Option<NodesCommand>,
    },
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
    /// Print a completion script for SHELL to stdout. Bash: `cairnctl completion bash >
    /// ~/.local/share/bash-completion/completions/cairnctl`; zsh: `cairnctl completion zsh >
    /// "${fpath[1]}/_cairnctl"`; fish: `cairnctl completion fish >
    /// ~/.config/fish/completions/cairnctl.fish`.
    Completion {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
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
        /// Keep the cluster running after the table, until Ctrl-C, to look around: the
        /// web console (its URL is printed), cairnctl, grpcurl.
        #[arg(long)]
        stay: bool,
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

/// A client of the leading coordinator among `address` (one or a comma-separated list),
/// sending `--token` if given (with one warning line if it goes in clear text beyond this
/// machine).
pub(crate) async fn connect(
    address: &str,
) -> Result<cairn_sdk::CoordinatorClient, cairn_sdk::Error> {
    let token = TOKEN.get().and_then(|t| t.as_deref());
    if token.is_some() && tls().is_none() && !address.split(',').all(|a| is_loopback(a.trim())) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            eprintln!(
                "warning: no TLS (--tls-ca): the bearer token travels in clear text to \
                 {address}, where anyone on the path can read and reuse it"
            );
        });
    }
    cairn_sdk::CoordinatorClient::connect_with(address, token, tls()).await
}

/// The `--token` (or `--token-file`) of this run, if any.
pub(crate) fn token() -> Option<&'static str> {
    TOKEN.get().and_then(|t| t.as_deref())
}

/// Whether `address` (HOST:PORT) is on this machine: a loopback (or unspecified) IP, or
/// `localhost`.
fn is_loopback(address: &str) -> bool {
    let host = cairn_sdk::tls::host_of(address);
    match host.parse::<std::net::IpAddr>() {
        // 0.0.0.0 and :: dial this machine.
        Ok(ip) => ip.is_loopback() || ip.is_unspecified(),
        Err(_) => {
            let host = host.trim_end_matches('.').to_ascii_lowercase();
            host == "localhost" || host.ends_with(".localhost")
        }
    }
}

/// The token of `--token-file`: the file's one word.
fn read_token_file(path: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--token-file {}: {e}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(format!(
            "--token-file {}: the file holds no token",
            path.display()
        ));
    }
    if token.split_whitespace().nth(1).is_some() {
        return Err(format!(
            "--token-file {}: the file must hold one token (it holds several words)",
            path.display()
        ));
    }
    Ok(token.to_owned())
}

fn main() -> ExitCode {
    let mut cli: Cli = match cli::parse_or_exit() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let local = matches!(cli.command, Command::Cluster(_) | Command::Demo { .. });
    if local && cli.coordinator.as_deref().is_some_and(|c| c.contains(',')) {
        return cli::usage_error(
            "--coordinator: `cluster up` and `demo` start one coordinator, which listens on one \
             address (HOST:PORT), not a list",
        );
    }
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
    if !local
        && !matches!(
            cli.command,
            Command::Certs(_) | Command::Auth(_) | Command::Completion { .. }
        )
    {
        match cli.tls.load_client() {
            Ok(tls) => {
                let _ = TLS.set(tls);
            }
            Err(e) => return cli::usage_error(e),
        }
        if let Some(path) = &cli.token_file {
            match read_token_file(path) {
                Ok(token) => cli.token = Some(token),
                Err(e) => return cli::usage_error(e),
            }
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
                    // A follower refusing a write names the leader.
                    why.push_str(&cairn_sdk::error::leader_note(status));
                    // A TLS failure first says what it means (an expired certificate, ...).
                    match cairn_sdk::tls::explain(status) {
                        Some(tls) => eprintln!(
                            "error: {tls}: {}{why} ({:?})",
                            status.message(),
                            status.code()
                        ),
                        None => eprintln!("error: {}{why} ({:?})", status.message(), status.code()),
                    }
                    if let Some(hint) = hints::for_status(status.code(), &why, tls().is_some()) {
                        eprintln!("{hint}");
                    }
                }
                None => {
                    eprintln!("error: {e:#}");
                    if let Some(cairn_sdk::Error::Connect { address, reason }) = e.downcast_ref()
                        && let Some(hint) = hints::for_connect(address, reason, tls().is_some())
                    {
                        eprintln!("{hint}");
                    }
                }
            }
            ExitCode::FAILURE
        }
    }
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
        Command::Nodes { command: None }
        | Command::Nodes {
            command: Some(NodesCommand::List),
        } => health::nodes(coordinator, cli.output).await,
        Command::Nodes {
            command: Some(NodesCommand::Remove { node }),
        } => health::remove_node(coordinator, node, cli.output).await,
        Command::Nodes {
            command: Some(NodesCommand::Status { address }),
        } => health::node_status(&address, cli.output).await,
        Command::Auth(AuthCommand::Token { role, name }) => {
            let (token, line) = cli::auth::new_token(role, name.as_deref());
            match cli.output {
                Output::Json => outln!(
                    "{}",
                    serde_json::json!({ "token": token, "role": role.as_str(), "line": line })
                ),
                _ => {
                    outln!("token: {token}");
                    outln!("add this line to the --auth-tokens file:");
                    outln!("{line}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Certs(command) => certs::certs(command),
        Command::Completion { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(
                shell,
                &mut <Cli as clap::CommandFactory>::command(),
                "cairnctl",
                &mut script,
            );
            out!("{}", String::from_utf8_lossy(&script));
            Ok(ExitCode::SUCCESS)
        }
        Command::Cluster(command) => cluster::cluster(command, listen).await,
        Command::Demo {
            nodes,
            workload,
            dir,
            insecure,
            stay,
        } => cluster::demo(nodes, workload, listen, dir, insecure, stay).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_addresses() {
        for address in [
            "127.0.0.1:7000",
            "[::1]:7000",
            "localhost:7000",
            "LOCALHOST",
            "a.localhost:1",
            "0.0.0.0:7000",
        ] {
            assert!(is_loopback(address), "{address}");
        }
        for address in ["10.0.0.5:7000", "coordinator:7000", "[2001:db8::1]:7000"] {
            assert!(!is_loopback(address), "{address}");
        }
    }

    #[test]
    fn a_token_file_holds_one_token() {
        let dir = std::env::temp_dir().join(format!("cairnctl-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "  5f0ce1\n").unwrap();
        assert_eq!(read_token_file(&file).unwrap(), "5f0ce1");
        std::fs::write(&file, "\n \n").unwrap();
        assert!(
            read_token_file(&file)
                .unwrap_err()
                .contains("holds no token")
        );
        std::fs::write(&file, "a b\n").unwrap();
        assert!(read_token_file(&file).unwrap_err().contains("one token"));
        assert!(
            read_token_file(&dir.join("missing"))
                .unwrap_err()
                .contains("--token-file")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_server_that_closes_a_plaintext_connection_gets_the_tls_hint() {
        // A TLS server closes a plaintext client's connection without a word; so does this.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                drop(tcp);
            }
        });
        let e = cairn_sdk::CoordinatorClient::connect(&address)
            .await
            .err()
            .unwrap();
        let cairn_sdk::Error::Connect { reason, .. } = &e else {
            panic!("{e:?}")
        };
        let hint = hints::for_connect(&address, reason, false).unwrap_or_default();
        assert!(hint.contains("--tls-ca"), "{reason}: {hint}");
        // Nothing listening: where to point cairnctl, not TLS.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let nobody = closed.local_addr().unwrap().to_string();
        drop(closed);
        let e = cairn_sdk::CoordinatorClient::connect(&nobody)
            .await
            .err()
            .unwrap();
        let cairn_sdk::Error::Connect { reason, .. } = &e else {
            panic!("{e:?}")
        };
        let hint = hints::for_connect(&nobody, reason, false).unwrap_or_default();
        assert!(
            hint.contains(&format!("nothing answers at {nobody}")) && !hint.contains("--tls-ca"),
            "{reason}: {hint}"
        );
    }

    #[test]
    fn token_and_token_file_conflict() {
        let e = Cli::try_parse_from(["cairnctl", "--token", "t", "--token-file", "f", "nodes"])
            .unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
        let cli = Cli::try_parse_from(["cairnctl", "--token-file", "f", "nodes"]).unwrap();
        assert_eq!(cli.token_file.as_deref(), Some(std::path::Path::new("f")));
    }
}
