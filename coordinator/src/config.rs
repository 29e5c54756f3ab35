//! The coordinator's configuration.

use std::path::PathBuf;
use std::time::Duration;

/// Everything a coordinator needs to run.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// The cluster's name; nodes of another cluster are refused.
    pub cluster: String,
    /// etcd endpoints; empty for the embedded metadata store.
    pub etcd: Vec<String>,
    /// Where the embedded store's file and the blob directory live.
    pub data_dir: PathBuf,
    /// The timeout of a snapshot that names none.
    pub default_timeout: Duration,
    /// Most snapshots in flight at once.
    pub max_concurrent: usize,
    /// Completed snapshots kept; 0 keeps all.
    pub retention: usize,
    /// How long shutdown waits for the coordinator's task.
    pub grace_period: Duration,
}

impl CoordinatorConfig {
    /// Defaults for everything but the cluster and the data directory.
    pub fn new(cluster: impl Into<String>, data_dir: impl Into<PathBuf>) -> Self {
        Self {
            cluster: cluster.into(),
            etcd: Vec::new(),
            data_dir: data_dir.into(),
            default_timeout: Duration::from_secs(30),
            max_concurrent: 4,
            retention: 0,
            grace_period: Duration::from_secs(5),
        }
    }
}
