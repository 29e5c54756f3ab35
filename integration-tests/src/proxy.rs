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
