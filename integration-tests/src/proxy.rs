//! A TCP proxy for tests that can cut every connection through it at once, as a flaky
//! network would.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

/// Forwards connections to a target; [`CuttingProxy::cut`] breaks them all.
pub struct CuttingProxy {
    /// Where to connect instead of the target.
    pub addr: SocketAddr,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
    accept: JoinHandle<()>,
}

impl CuttingProxy {
    /// A proxy on `127.0.0.1:0` in front of `target`.
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let connections: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let registry = connections.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                registry
                    .lock()
                    .expect("not poisoned")
                    .push(task.abort_handle());
            }
        });
        Ok(Self {
            addr,
            connections,
            accept,
        })
    }

    /// Breaks every open connection; returns how many there were.
    pub fn cut(&self) -> usize {
        let mut connections = self.connections.lock().expect("not poisoned");
        let n = connections.iter().filter(|c| !c.is_finished()).count();
        for c in connections.drain(..) {
            c.abort();
        }
        n
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// What [`LossyProxy`] loses once its trigger passes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// The request reaches the server (and is applied); every answer on that connection is
    /// held for the hold time, then the connection is cut: the answer is lost.
    Answer,
    /// The request, and everything after it on that connection, is held for the hold time,
    /// then the connection is cut: the request never reaches the server.
    Request,
    /// The request, and everything after it on that connection, is held for the hold time,
    /// then delivered (even if the client gave up and closed meanwhile): the request
    /// reaches the server late, after the client's timeout.
    Delay,
}

struct Armed {
    pattern: Vec<u8>,
    loss: Loss,
    hold: std::time::Duration,
}

/// A TCP proxy that forwards everything until a client sends bytes containing an armed
/// pattern (a request that writes a record, say); then, once, it loses that request or its
/// answer ([`Loss`]) as a network or a paused server would: held past the client's timeout,
/// then the connection cut. The proxy knows nothing of the protocol: the pattern is
/// matched in the raw bytes (HTTP/2 without TLS or compression carries values as they are).
pub struct LossyProxy {
    /// Where to connect instead of the target.
    pub addr: SocketAddr,
    armed: Arc<Mutex<Option<Armed>>>,
    fired: Arc<std::sync::atomic::AtomicUsize>,
    accept: JoinHandle<()>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
}

impl LossyProxy {
    /// A proxy on `127.0.0.1:0` in front of `target`, not armed.
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let armed: Arc<Mutex<Option<Armed>>> = Arc::default();
        let fired = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let connections: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let (a, f, registry) = (armed.clone(), fired.clone(), connections.clone());
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let (armed, fired) = (a.clone(), f.clone());
                let task = tokio::spawn(async move {
                    if let Ok(outbound) = TcpStream::connect(target).await {
                        relay(inbound, outbound, armed, fired).await;
                    }
                });
                let mut held = registry.lock().expect("not poisoned");
                held.retain(|c| !c.is_finished());
                held.push(task.abort_handle());
            }
        });
        Ok(Self {
            addr,
            armed,
            fired,
            accept,
            connections,
        })
    }

    /// Loses, once, the next request containing `pattern` (or its answer), holding it for
    /// `hold` before cutting its connection.
    pub fn arm(&self, pattern: &[u8], loss: Loss, hold: std::time::Duration) {
        *self.armed.lock().expect("not poisoned") = Some(Armed {
            pattern: pattern.to_vec(),
            loss,
            hold,
        });
    }

    /// How many times it fired.
    pub fn fired(&self) -> usize {
        self.fired.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for LossyProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for c in self.connections.lock().expect("not poisoned").drain(..) {
            c.abort();
        }
    }
}

/// Relays one connection until either side closes, or, once the trigger fired on it,
/// until its hold time has passed (then both sides are dropped: cut).
async fn relay(
    inbound: TcpStream,
    outbound: TcpStream,
    armed: Arc<Mutex<Option<Armed>>>,
    fired: Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicU8, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const OPEN: u8 = 0;
    const HOLD_UP: u8 = 1;
    const HOLD_DOWN: u8 = 2;
    const DELAY_UP: u8 = 3;
    let (mut client_read, mut client_write) = inbound.into_split();
    let (mut server_read, mut server_write) = outbound.into_split();
    let state = Arc::new(AtomicU8::new(OPEN));
    let (cut_tx, cut_rx) = tokio::sync::oneshot::channel::<std::time::Duration>();
    let up_state = state.clone();
    let up = async move {
        let mut cut_tx = Some(cut_tx);
        let mut tail: Vec<u8> = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        // Loss::Delay: what is held, and until when.
        let mut delayed: Vec<u8> = Vec::new();
        let mut deliver_at: Option<tokio::time::Instant> = None;
        let mut closed = false;
        loop {
            let wake = deliver_at.unwrap_or_else(tokio::time::Instant::now);
            let n = tokio::select! {
                read = client_read.read(&mut buf), if !closed => match read {
                    Ok(0) | Err(_) => {
                        closed = true;
                        if deliver_at.is_none() {
                            return;
                        }
                        continue;
                    }
                    Ok(n) => n,
                },
                () = tokio::time::sleep_until(wake), if deliver_at.is_some() => {
                    deliver_at = None;
                    up_state.store(OPEN, Ordering::SeqCst);
                    if server_write.write_all(&delayed).await.is_err() || closed {
                        // Delivered; the client is gone: let the server answer into the void
                        // for a moment before the connection goes.
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                        return;
                    }
                    delayed = Vec::new();
                    continue;
                }
            };
            let chunk = &buf[..n];
            if up_state.load(Ordering::SeqCst) == OPEN {
                let mut armed_now = armed.lock().expect("not poisoned");
                if let Some(a) = armed_now.as_ref() {
                    let mut window = std::mem::take(&mut tail);
                    window.extend_from_slice(chunk);
                    if window.windows(a.pattern.len()).any(|w| w == a.pattern) {
                        let a = armed_now.take().expect("armed");
                        fired.fetch_add(1, Ordering::SeqCst);
                        match a.loss {
                            Loss::Answer | Loss::Request => {
                                let held = if a.loss == Loss::Answer {
                                    HOLD_DOWN
                                } else {
                                    HOLD_UP
                                };
                                up_state.store(held, Ordering::SeqCst);
                                if let Some(tx) = cut_tx.take() {
                                    let _ = tx.send(a.hold);
                                }
                            }
                            Loss::Delay => {
                                up_state.store(DELAY_UP, Ordering::SeqCst);
                                deliver_at = Some(tokio::time::Instant::now() + a.hold);
                            }
                        }
                    } else {
                        let keep = a.pattern.len().saturating_sub(1).min(window.len());
                        tail = window[window.len() - keep..].to_vec();
                    }
                }
            }
            match up_state.load(Ordering::SeqCst) {
                HOLD_UP => continue, // held, then lost with the connection
                DELAY_UP => {
                    delayed.extend_from_slice(chunk);
                    continue;
                }
                _ => {}
            }
            if server_write.write_all(chunk).await.is_err() {
                return;
            }
        }
    };
    let down_state = state.clone();
    let down = async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut client_gone = false;
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if down_state.load(Ordering::SeqCst) == HOLD_DOWN || client_gone {
                continue; // held, then lost with the connection
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                // A request still being delayed is delivered all the same (the relay ends
                // when `up` has delivered it); the answers go nowhere.
                if down_state.load(Ordering::SeqCst) != DELAY_UP {
                    return;
                }
                client_gone = true;
            }
        }
    };
    let cut = async move {
        match cut_rx.await {
            Ok(hold) => tokio::time::sleep(hold).await,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        () = up => {}
        () = down => {}
        () = cut => {}
    }
}
