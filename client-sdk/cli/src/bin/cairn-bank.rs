//! `cairn-bank`: the example application. See `cairn-bank --help`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use cairn_cli::bank::{self, BankConfig};
use cairn_rpc::server as cli;
use clap::Parser;

/// The cairn example application: a bank that holds a balance and moves money to the
/// banks beside the other nodes as cairn messages. Serves cairn.bank.v1.Bank
/// (Transfer, GetBalance) with health and reflection, so grpcurl works.
///
/// Every flag can also be set by the environment variable shown.
#[derive(Debug, Parser)]
#[command(name = "cairn-bank", version = cairn_rpc::version::VERSION, max_term_width = 100)]
struct Args {
    /// The application address of the node daemon beside this bank.
    #[arg(long, env = "CAIRN_NODE_ADDR", default_value = "127.0.0.1:7200")]
    node: String,
    /// Address the Bank service listens on.
    #[arg(long, env = "CAIRN_BANK_LISTEN", default_value = "127.0.0.1:7300")]
    listen: SocketAddr,
    /// The balance this bank starts with.
    #[arg(long, env = "CAIRN_INITIAL_BALANCE", default_value_t = 1000)]
    initial_balance: u64,
    /// Random transfers per second to random peers (0: none).
    #[arg(long, env = "CAIRN_WORKLOAD", default_value_t = 0.0)]
    workload: f64,
    /// Largest random transfer of the workload.
    #[arg(long, env = "CAIRN_MAX_AMOUNT", default_value_t = 10)]
    max_amount: u64,
    /// How long to keep trying to reach the daemon at start (e.g. 30s).
    #[arg(long, env = "CAIRN_CONNECT_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    connect_timeout: Duration,
    /// Write every transfer this bank applies (credits) to the `ledger` table of this
    /// PostgreSQL database, exactly once through crashes and restores: a two-phase commit
    /// per snapshot (the server needs max_prepared_transactions > 0, and the user must be
    /// able to create tables). A URL (postgres://user:password@host:port/database) or
    /// libpq's key=value form; the connection is not encrypted (use a local server or
    /// sslmode=disable over a trusted network).
    #[arg(long, env = "CAIRN_LEDGER", value_name = "URL", hide_env_values = true)]
    ledger: Option<String>,
    /// With --ledger: how many snapshots' transactions may be pre-committed and not yet
    /// committed (prepared transactions held on the server) before a cut carries its
    /// transfers in the bank's state instead, until a snapshot completes. The server's
    /// max_prepared_transactions should be at least the banks writing to it times one more
    /// than this; a full server makes cuts carry too, so it never stalls snapshots.
    #[arg(
        long,
        env = "CAIRN_LEDGER_MAX_PENDING",
        value_name = "N",
        default_value_t = cairn_sdk::sink::DEFAULT_MAX_PENDING as u64,
        value_parser = clap::value_parser!(u64).range(1..=cairn_sdk::sink::MAX_PENDING as u64)
    )]
    ledger_max_pending: u64,
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "CAIRN_LOG", default_value = "info")]
    log: String,
    #[command(flatten)]
    tls: cli::tls::TlsArgs,
}

fn main() -> ExitCode {
    let args: Args = match cli::parse_or_exit() {
        Ok(args) => args,
        Err(code) => return code,
    };
    if !(args.workload >= 0.0 && args.workload.is_finite()) || args.max_amount == 0 {
        return cli::usage_error(
            "--workload must be a non-negative number and --max-amount positive",
        );
    }
    if let Some(url) = &args.ledger
        && let Err(e) = url.parse::<cairn_sdk::tokio_postgres::Config>()
    {
        // Not the string itself: it may hold a password.
        return cli::usage_error(format!(
            "--ledger is not a PostgreSQL connection string (postgres://user:password@host:port/database): {e}"
        ));
    }
    cli::init_logging(&args.log, false);
    // The bank is part of its node: it holds the node's certificate, which the daemon's
    // application port (TLS when the daemon has --tls-*) requires.
    let tls = match args.tls.load_daemon() {
        Ok(tls) => tls,
        Err(e) => return cli::usage_error(&e),
    };
    if tls.is_none() {
        tracing::warn!(
            "no --tls-cert/--tls-key/--tls-ca: the session with the daemon and the Bank port \
             are unencrypted and unauthenticated"
        );
    }
    let Ok(runtime) = tokio::runtime::Runtime::new() else {
        eprintln!("error: cannot start the runtime");
        return ExitCode::FAILURE;
    };
    runtime.block_on(async {
        let listener = match cli::bind(args.listen, "--listen").await {
            Ok(l) => l,
            Err(code) => return code,
        };
        let shutdown = cli::shutdown_on_signal();
        // The certificate, key, CA and CRL are re-read when they change, as the daemons do.
        if let Some(tls) = &tls {
            cli::tls::watch(tls, &cli::tls::TlsMetrics::default(), shutdown.clone());
        }
        let config = BankConfig {
            node_address: args.node,
            initial_balance: args.initial_balance,
            workload_rate: args.workload,
            max_amount: args.max_amount,
            connect_timeout: args.connect_timeout,
            tls,
            ledger: args.ledger,
            ledger_max_pending: usize::try_from(args.ledger_max_pending)
                .expect("at most MAX_PENDING"),
        };
        match bank::run(config, listener, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!("{e:#}");
                ExitCode::FAILURE
            }
        }
    })
}
