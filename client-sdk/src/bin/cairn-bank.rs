//! `cairn-bank`: the example application. See `cairn-bank --help`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use cairn_sdk::bank::{self, BankConfig};
use clap::Parser;
use tokio_util::sync::CancellationToken;

/// The cairn example application: a bank that holds a balance and moves money to the
/// banks beside the other nodes as cairn messages. Serves cairn.bank.v1.Bank
/// (Transfer, GetBalance) with health and reflection, so grpcurl works.
///
/// Every flag can also be set by the environment variable shown.
#[derive(Debug, Parser)]
#[command(version, max_term_width = 100)]
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
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "CAIRN_LOG", default_value = "info")]
    log: String,
}

const EX_USAGE: u8 = 64;

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if e.use_stderr() => {
            let _ = e.print();
            return ExitCode::from(EX_USAGE);
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    if !(args.workload >= 0.0 && args.workload.is_finite()) || args.max_amount == 0 {
        eprintln!("error: --workload must be a non-negative number and --max-amount positive");
        return ExitCode::from(EX_USAGE);
    }
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let Ok(runtime) = tokio::runtime::Runtime::new() else {
        eprintln!("error: cannot start the runtime");
        return ExitCode::FAILURE;
    };
    runtime.block_on(async {
        let listener = match tokio::net::TcpListener::bind(args.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("error: cannot listen on {} (--listen): {e}", args.listen);
                return ExitCode::from(EX_USAGE);
            }
        };
        let shutdown = CancellationToken::new();
        let signal = shutdown.clone();
        tokio::spawn(async move {
            use tokio::signal::unix::{SignalKind, signal as unix_signal};
            if let (Ok(mut term), Ok(mut int)) = (
                unix_signal(SignalKind::terminate()),
                unix_signal(SignalKind::interrupt()),
            ) {
                tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
                signal.cancel();
            }
        });
        let config = BankConfig {
            node_address: args.node,
            initial_balance: args.initial_balance,
            workload_rate: args.workload,
            max_amount: args.max_amount,
            connect_timeout: args.connect_timeout,
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
