//! The bytes of each part still uploading, for `WatchSnapshot`'s progress: what the
//! coordinator has received of a part (its state's chunks, new or found in the store, and
//! the recorded messages' payloads) before the part is stored. Kept beside the task, not in
//! it: a count the upload streams bump and the watchers read, never stored.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cairn_core::{NodeId, SnapshotId};

/// An upload: its snapshot, its node, and a number of its own (a daemon that uploads the
/// same part twice at once has two).
type Key = (SnapshotId, NodeId, u64);

/// Every upload in progress and its bytes so far.
#[derive(Debug, Clone, Default)]
pub(crate) struct Uploading {
    uploads: Arc<Mutex<BTreeMap<Key, u64>>>,
    next: Arc<AtomicU64>,
}

impl Uploading {
    /// Counts the upload of `node`'s part of snapshot `id` until the returned guard drops
    /// (the part stored, or the upload failed).
    pub(crate) fn start(&self, id: SnapshotId, node: NodeId) -> UploadCount {
        let key = (id, node, self.next.fetch_add(1, Ordering::Relaxed));
        self.lock().insert(key.clone(), 0);
        UploadCount {
            uploads: self.clone(),
            key,
        }
    }

    /// The bytes received so far of each part of `id` still uploading, by node (the
    /// larger of two uploads of one part).
    pub(crate) fn of(&self, id: SnapshotId) -> BTreeMap<NodeId, u64> {
        let mut by_node: BTreeMap<NodeId, u64> = BTreeMap::new();
        for ((_, node, _), bytes) in self
            .lock()
            .range((id, NodeId::new(""), 0)..)
            .take_while(|((of, _, _), _)| *of == id)
        {
            let n = by_node.entry(node.clone()).or_default();
            *n = (*n).max(*bytes);
        }
        by_node
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Key, u64>> {
        self.uploads.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One upload's count; it leaves [`Uploading`] when dropped.
#[derive(Debug)]
pub(crate) struct UploadCount {
    uploads: Uploading,
    key: Key,
}

impl UploadCount {
    /// `bytes` more received.
    pub(crate) fn add(&self, bytes: u64) {
        if let Some(n) = self.uploads.lock().get_mut(&self.key) {
            *n = n.saturating_add(bytes);
        }
    }
}

impl Drop for UploadCount {
    fn drop(&mut self) {
        self.uploads.lock().remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upload_counts_until_it_ends() {
        let uploads = Uploading::default();
        let a = uploads.start(SnapshotId(7), NodeId::new("a"));
        let b = uploads.start(SnapshotId(7), NodeId::new("b"));
        let other = uploads.start(SnapshotId(8), NodeId::new("a"));
        a.add(10);
        a.add(5);
        b.add(u64::MAX);
        b.add(1);
        other.add(3);
        let seen = uploads.of(SnapshotId(7));
        assert_eq!(seen.get(&NodeId::new("a")), Some(&15));
        assert_eq!(seen.get(&NodeId::new("b")), Some(&u64::MAX));
        assert_eq!(seen.len(), 2);
        // The same part uploading twice at once: each counts, the larger shows.
        let again = uploads.start(SnapshotId(7), NodeId::new("a"));
        again.add(4);
        assert_eq!(uploads.of(SnapshotId(7)).get(&NodeId::new("a")), Some(&15));
        drop(a);
        assert_eq!(uploads.of(SnapshotId(7)).get(&NodeId::new("a")), Some(&4));
        drop(again);
        assert_eq!(uploads.of(SnapshotId(7)).len(), 1);
        drop((b, other));
        assert!(uploads.of(SnapshotId(7)).is_empty() && uploads.of(SnapshotId(8)).is_empty());
    }
}
