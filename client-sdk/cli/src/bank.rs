//! `cairn-bank`, the example application: a bank whose money moves between nodes as
//! cairn messages, so that a snapshot's consistency is easy to see — the recorded
//! balances plus the recorded money in flight must equal the money there is.
//!
//! State: JSON `{"balance": N, "line": L, "sent": {..}, "received": {..}}`. A transfer's
//! payload: JSON `{"amount": N, "line": L, "id": I}`. The sender is debited at once, in
//! the same critical section that queues the message, and the state is recorded in a
//! critical section too, so a transfer is either wholly before the cut (debited and sent)
//! or wholly after it.
//!
//! Every transfer carries an id: the sender's line (a random number drawn when a bank
//! starts with a fresh balance, kept through restores) and a count per receiver (1, 2, …).
//! The state records, per peer, the last id sent and the last id received, so a snapshot
//! shows exactly which transfers it holds in flight (those after the receiver's last and up
//! to the sender's last), and a receiver sees a duplicate or a gap at once: it counts and
//! logs both at ERROR (`duplicate_transfers`, `skipped_transfers` in `GetBalance`).
//!
//! A delivered transfer is applied only if its payload decodes and the credit does not
//! overflow the balance; otherwise it is logged at ERROR, counted (`rejected_transfers` in
//! `GetBalance`) and not applied — never wrapped, never silently dropped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cairn_rpc::bank::v1 as pb;
use cairn_rpc::{limits, reflection};
use rand::Rng;
use rand::seq::IteratorRandom;
use tokio::net::TcpListener;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use cairn_sdk::Error;
use cairn_sdk::session::{AppEvent, AppSender, AppSession, AttachOptions};

mod ledger;
mod state;

pub use ledger::{Ledger, LedgerCut, Row as LedgerRow};
use ledger::{open_ledger, restore_ledger};
pub use state::{BankState, Order, Received, Rejected, TransferPayload};

/// Streams one connection may have open at once on the bank's port (its calls are unary).
const BANK_STREAMS: u32 = 64;

/// How a bank runs.
#[derive(Debug, Clone)]
pub struct BankConfig {
    /// Its node daemon's application address (`host:port`).
    pub node_address: String,
    /// The balance it starts with.
    pub initial_balance: u64,
    /// Random transfers per second to random peers; 0 for none.
    pub workload_rate: f64,
    /// Largest random transfer.
    pub max_amount: u64,
    /// How long to keep trying to reach the daemon at start.
    pub connect_timeout: Duration,
    /// Mutual TLS (the node's certificate): for the session with the daemon, and on the
    /// bank's own port (clients present a certificate of the CA). Serving TLS needs the
    /// SDK's `cli` feature.
    pub tls: Option<cairn_rpc::tls::Tls>,
    /// Write every applied transfer to this PostgreSQL database's `ledger` table, exactly
    /// once (see [`Ledger`]).
    pub ledger: Option<String>,
    /// With a ledger, the most transactions pending before cuts carry (see
    /// [`TwoPhaseCommitSink::with_max_pending`](cairn_sdk::sink::TwoPhaseCommitSink::with_max_pending)).
    pub ledger_max_pending: usize,
}

struct Bank {
    node_id: String,
    state: Mutex<BankState>,
    sender: AppSender,
    /// The snapshot last restored; 0 if none.
    restored: AtomicU64,
    /// Delivered transfers refused: malformed, or overflowing the balance.
    rejected: AtomicU64,
    /// Delivered transfers whose id was at or below the last applied.
    duplicates: AtomicU64,
    /// Transfer ids skipped.
    skipped: AtomicU64,
    /// Random transfers per second; 0 pauses them.
    rate: tokio::sync::watch::Sender<f64>,
    /// Held by the workload while it makes a transfer.
    workload_busy: tokio::sync::Mutex<()>,
}

impl Bank {
    /// Debits and queues the message in one critical section.
    async fn transfer(&self, to: &str, amount: u64) -> Result<u64, Status> {
        if amount == 0 {
            return Err(Status::invalid_argument("amount must be positive"));
        }
        if !self.sender.peers().contains(to) {
            return Err(Status::not_found(format!(
                "`{to}` is not a peer of {} (peers: {})",
                self.node_id,
                self.sender
                    .peers()
                    .iter()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let permit = self.sender.reserve().await.map_err(unavailable)?;
        let mut state = self.state.lock().await;
        if state.balance < amount {
            return Err(Status::failed_precondition(format!(
                "insufficient funds: balance {} < amount {amount}",
                state.balance
            )));
        }
        let id = state.sent.get(to).copied().unwrap_or(0).saturating_add(1);
        let payload = TransferPayload {
            amount,
            line: state.line,
            id,
        };
        permit.send(to, payload.encode()).map_err(unavailable)?;
        state.sent.insert(to.to_owned(), id);
        state.balance -= amount;
        Ok(state.balance)
    }

    async fn balance(&self) -> u64 {
        self.state.lock().await.balance
    }
}

/// Adds `k` to a counter without wrapping (a hostile id may claim any gap); the new count.
fn saturating_add(counter: &AtomicU64, k: u64) -> u64 {
    let previous = counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            Some(n.saturating_add(k))
        })
        .unwrap_or_else(|n| n);
    previous.saturating_add(k)
}

fn unavailable(e: Error) -> Status {
    Status::unavailable(format!("node daemon: {e}"))
}

struct BankService(Arc<Bank>);

#[tonic::async_trait]
impl pb::bank_server::Bank for BankService {
    async fn transfer(
        &self,
        request: Request<pb::TransferRequest>,
    ) -> Result<Response<pb::TransferResponse>, Status> {
        let request = request.into_inner();
        let balance = self.0.transfer(&request.to, request.amount).await?;
        if request.wait_queued {
            // Not UNAVAILABLE: a client would retry, and the transfer is already made.
            self.0.sender.flushed().await.map_err(|e| {
                Status::aborted(format!(
                    "the transfer was made (balance now {balance}) but its queueing at the \
                     node daemon is not confirmed: {e}; do not retry it"
                ))
            })?;
        }
        Ok(Response::new(pb::TransferResponse { balance }))
    }

    async fn get_balance(
        &self,
        _request: Request<pb::GetBalanceRequest>,
    ) -> Result<Response<pb::GetBalanceResponse>, Status> {
        let state = self.0.state.lock().await.clone();
        Ok(Response::new(pb::GetBalanceResponse {
            node_id: self.0.node_id.clone(),
            balance: state.balance,
            state_json: String::from_utf8(serde_json::to_vec(&state).expect("plain struct"))
                .expect("JSON is UTF-8"),
            duplicate_transfers: self.0.duplicates.load(Ordering::Relaxed),
            skipped_transfers: self.0.skipped.load(Ordering::Relaxed),
            peers: self.0.sender.peers().into_iter().collect(),
            restored_snapshot: self.0.restored.load(Ordering::Relaxed),
            rejected_transfers: self.0.rejected.load(Ordering::Relaxed),
        }))
    }

    async fn set_workload(
        &self,
        request: Request<pb::SetWorkloadRequest>,
    ) -> Result<Response<pb::SetWorkloadResponse>, Status> {
        let rate = request.into_inner().rate;
        if !rate.is_finite() || rate < 0.0 {
            return Err(Status::invalid_argument(format!(
                "rate must be a number of transfers per second, 0 or more; got {rate}"
            )));
        }
        let previous_rate = self.0.rate.send_replace(rate);
        // A transfer of the old rate under way ends before the answer.
        drop(self.0.workload_busy.lock().await);
        tracing::info!(rate, previous_rate, "workload changed");
        Ok(Response::new(pb::SetWorkloadResponse { previous_rate }))
    }
}

/// Connects to the daemon, retrying until `timeout`. With a ledger, it follows the
/// snapshots' ends from the oldest the coordinator keeps (a completion of a snapshot the
/// sink holds nothing of commits nothing).
async fn connect(config: &BankConfig) -> Result<AppSession, Error> {
    let deadline = tokio::time::Instant::now() + config.connect_timeout;
    let mut delay = Duration::from_millis(50);
    let options = AttachOptions {
        snapshot_outcomes_after: config.ledger.as_ref().map(|_| 0),
    };
    loop {
        match AppSession::attach(
            &config.node_address,
            "cairn-bank",
            config.tls.as_ref(),
            options.clone(),
        )
        .await
        {
            Ok(session) => return Ok(session),
            Err(e) if e.is_retryable() && tokio::time::Instant::now() + delay < deadline => {
                tracing::debug!("daemon not ready ({e}); retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Runs a bank on `listener` until `shutdown`, or until its daemon session ends.
pub async fn run(
    config: BankConfig,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut session = connect(&config).await?;
    let mut ledger = match &config.ledger {
        Some(url) => Some(
            open_ledger(
                url,
                &session,
                config.connect_timeout,
                config.ledger_max_pending,
            )
            .await?,
        ),
        None => None,
    };
    let bank = Arc::new(Bank {
        node_id: session.node_id().to_owned(),
        state: Mutex::new(BankState::fresh(config.initial_balance)),
        sender: session.sender(),
        restored: AtomicU64::new(0),
        rejected: AtomicU64::new(0),
        duplicates: AtomicU64::new(0),
        skipped: AtomicU64::new(0),
        rate: tokio::sync::watch::Sender::new(config.workload_rate),
        workload_busy: tokio::sync::Mutex::new(()),
    });
    let addr: SocketAddr = listener.local_addr()?;
    tracing::info!(node = %bank.node_id, %addr, balance = config.initial_balance, "bank serving");

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<pb::bank_server::BankServer<BankService>>()
        .await;
    let server = limits::server(BANK_STREAMS);
    // On TLS connections, the roles of cairn's table: GetBalance for a viewer's
    // certificate, Transfer and SetWorkload for an operator's (a node's certificate has no
    // role); plaintext connections are let through (no TLS, no identity).
    let server = server
        .layer(cairn_rpc::server::auth::Auth::open().layer(session.cluster(), config.tls.as_ref()));
    let server = server
        .layer(limits::MessageLimits::new(limits::CONTROL_MESSAGE))
        .add_service(health_service)
        .add_service(reflection::v1(reflection::BANK)?)
        .add_service(reflection::v1alpha(reflection::BANK)?)
        .add_service(pb::bank_server::BankServer::new(BankService(bank.clone())));
    let server = tokio::spawn(cairn_rpc::server::tls::serve(
        server,
        listener,
        config.tls.clone(),
        cairn_rpc::server::tls::TlsMetrics::default(),
        shutdown.clone(),
    ));
    tokio::spawn(workload(bank.clone(), config.clone(), shutdown.clone()));

    let result = loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            event = session.next_event() => event,
        };
        match event {
            Ok(Some(AppEvent::Message { from, payload })) => {
                let received = bank.state.lock().await.receive(&from, &payload);
                // The ledger names a transfer by its id: one without (made by hand) or
                // delivered twice (already written) is not written.
                if let (Ok(Order::Next | Order::NewLine | Order::Skipped(_)), Some(ledger)) =
                    (&received, ledger.as_mut())
                    && let Ok(transfer) = TransferPayload::decode(&payload)
                {
                    ledger.applied(&from, &transfer);
                }
                match received {
                    Ok(Order::Next | Order::Untracked) => {}
                    Ok(Order::NewLine) => {
                        tracing::info!(%from, "transfers of a new line of the sender");
                    }
                    Ok(Order::Duplicate) => {
                        let n = bank.duplicates.fetch_add(1, Ordering::Relaxed) + 1;
                        tracing::error!(%from, duplicates = n, "a transfer delivered twice (applied)");
                    }
                    Ok(Order::Skipped(k)) => {
                        let n = saturating_add(&bank.skipped, k);
                        tracing::error!(%from, skipped = k, total = n, "transfers never delivered before a later one");
                    }
                    Err(e) => {
                        let rejected = bank.rejected.fetch_add(1, Ordering::Relaxed) + 1;
                        tracing::error!(%from, rejected, "transfer rejected, not applied: {e}");
                    }
                }
            }
            Ok(Some(AppEvent::RecordState { snapshot_id })) => {
                // Held across the ledger's pre-commit: no transfer falls between the cut
                // and the state.
                let mut state = bank.state.lock().await;
                if let Some(ledger) = ledger.as_mut() {
                    match ledger.cut(snapshot_id).await {
                        Ok(cut) => {
                            state.ledger_pending = cut.pending;
                            state.ledger_open = cut.open;
                        }
                        Err(e) => {
                            // Not answered: the snapshot fails, and a later cut writes
                            // these transfers.
                            tracing::warn!(
                                snapshot_id,
                                "ledger pre-commit failed, state not recorded: {e}"
                            );
                            continue;
                        }
                    }
                }
                let bytes = serde_json::to_vec(&*state).expect("plain struct");
                bank.sender.state_recorded(snapshot_id, bytes.into())?;
                tracing::debug!(snapshot_id, balance = state.balance, "state recorded");
            }
            Ok(Some(AppEvent::Restore {
                restore_id,
                snapshot_id,
                state,
            })) => match serde_json::from_slice::<BankState>(&state) {
                Ok(s) => {
                    // The balance and the acknowledgement in one critical section: no
                    // transfer decided on the old balance can follow the acknowledgement.
                    let mut state = bank.state.lock().await;
                    if let Some(ledger) = ledger.as_mut()
                        && let Err(e) = restore_ledger(ledger, snapshot_id, &s).await
                    {
                        // The session would acknowledge the restore at the next event: the
                        // bank stops instead, and the restore fails (a new bank process is
                        // restored again).
                        break Err(anyhow::anyhow!(
                            "cannot restore the ledger for snapshot {snapshot_id}: {e:#}"
                        ));
                    }
                    let balance = s.balance;
                    *state = s;
                    bank.sender.restore_applied(&restore_id)?;
                    bank.restored.store(snapshot_id, Ordering::Relaxed);
                    tracing::info!(snapshot_id, balance, "restored");
                }
                Err(e) => tracing::error!(snapshot_id, "cannot restore a malformed state: {e}"),
            },
            // The bank's state is small: it takes restores whole (no `restore_in_pieces`).
            Ok(Some(AppEvent::RestorePiece { .. } | AppEvent::RestoreAborted { .. })) => {}
            // With a ledger: commit what the completed snapshot covers (a failure is
            // tried again at the next completion). An abort leaves its transaction pending.
            Ok(Some(AppEvent::SnapshotCompleted { snapshot_id })) => {
                if let Some(ledger) = ledger.as_mut()
                    && let Err(e) = ledger.completed(snapshot_id).await
                {
                    tracing::warn!(snapshot_id, pending = ?ledger.pending(), "ledger commit failed (tried again at the next completion): {e}");
                }
            }
            Ok(Some(AppEvent::SnapshotAborted { .. })) => {}
            Ok(None) => break Err(anyhow::anyhow!("the node daemon closed the session")),
            Err(e) => break Err(anyhow::anyhow!("session with the node daemon failed: {e}")),
        }
    };
    shutdown.cancel();
    let _ = server.await;
    result
}

/// Random transfers to random peers at the bank's rate (`SetWorkload` changes it; 0
/// pauses).
async fn workload(bank: Arc<Bank>, config: BankConfig, shutdown: CancellationToken) {
    let mut rates = bank.rate.subscribe();
    let mut tick: Option<tokio::time::Interval> = None;
    loop {
        let rate = *rates.borrow_and_update();
        if rate <= 0.0 {
            tick = None;
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = rates.changed() => if changed.is_err() { return },
            }
            continue;
        }
        let interval = tick.get_or_insert_with(|| {
            let mut t = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = rates.changed() => {
                if changed.is_err() {
                    return;
                }
                tick = None;
                continue;
            }
            _ = interval.tick() => {}
        }
        // Held through the transfer, so that `SetWorkload` returns only once no transfer of
        // the old rate is under way.
        let _busy = bank.workload_busy.lock().await;
        if *bank.rate.borrow() <= 0.0 {
            continue;
        }
        let balance = bank.balance().await;
        if balance == 0 {
            continue;
        }
        let (to, amount) = {
            let mut rng = rand::rng();
            // No peer yet: the coordinator has not named any member but this one.
            let Some(to) = bank.sender.peers().iter().choose(&mut rng).cloned() else {
                continue;
            };
            (
                to,
                rng.random_range(1..=config.max_amount.min(balance).max(1)),
            )
        };
        match bank.transfer(&to, amount).await {
            Ok(_) => {}
            Err(status) if status.code() == tonic::Code::FailedPrecondition => {}
            Err(status) => {
                tracing::warn!("workload transfer failed: {}", status.message());
                return;
            }
        }
    }
}
