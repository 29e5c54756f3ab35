//! The cluster's metadata, typed: each record is read and written through one method here,
//! which knows its key and its JSON. A record that does not parse is an error naming its
//! key (`CorruptRecord`, DATA_LOSS) where one record is asked for; listings skip such
//! records with a warning, so one bad record does not hide the others.

use std::sync::Arc;

use cairn_core::SnapshotId;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{
    AnyKv, Keys, Kv, MemberRecord, PartRecord, PolicyRecord, RemovedRecord, RestoreRecord,
    RosterRecord, SnapshotRecord,
};
use crate::error::Error;

/// Typed access to one cluster's metadata.
#[derive(Clone)]
pub struct Metadata {
    kv: Arc<AnyKv>,
    keys: Keys,
}

/// How a record is written: the stored JSON stays as it always was.
#[derive(Clone, Copy)]
enum Layout {
    Pretty,
    Compact,
}

fn encode<T: Serialize>(record: &T, layout: Layout) -> Vec<u8> {
    match layout {
        Layout::Pretty => serde_json::to_vec_pretty(record),
        Layout::Compact => serde_json::to_vec(record),
    }
    .expect("records are plain data")
}

fn decode<T: DeserializeOwned>(key: &str, value: &[u8]) -> Result<T, Error> {
    serde_json::from_slice(value).map_err(|e| Error::CorruptRecord {
        key: key.to_owned(),
        why: e.to_string(),
    })
}

impl Metadata {
    /// Metadata of `keys`' cluster in `kv`.
    pub fn new(kv: Arc<AnyKv>, keys: Keys) -> Self {
        Self { kv, keys }
    }

    /// The store underneath (for its health).
    pub fn kv(&self) -> &Arc<AnyKv> {
        &self.kv
    }

    async fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, Error> {
        match self.kv.get(key).await? {
            Some(value) => decode(key, &value).map(Some),
            None => Ok(None),
        }
    }

    async fn list<T: DeserializeOwned>(&self, prefix: &str) -> Result<Vec<T>, Error> {
        let mut out = Vec::new();
        for (key, value) in self.kv.list(prefix).await? {
            match decode(&key, &value) {
                Ok(record) => out.push(record),
                Err(e) => tracing::warn!("skipping a record: {e}"),
            }
        }
        Ok(out)
    }

    async fn put<T: Serialize>(&self, key: &str, record: &T, layout: Layout) -> Result<(), Error> {
        Ok(self.kv.put(key, encode(record, layout)).await?)
    }

    /// Snapshot `id`'s record.
    pub async fn snapshot(&self, id: SnapshotId) -> Result<Option<SnapshotRecord>, Error> {
        self.get(&self.keys.snapshot(id.0)).await
    }

    /// Every snapshot record, in id order.
    pub async fn snapshots(&self) -> Result<Vec<SnapshotRecord>, Error> {
        self.list(&self.keys.snapshots()).await
    }

    /// Stores a snapshot record.
    pub async fn put_snapshot(&self, record: &SnapshotRecord) -> Result<(), Error> {
        self.put(&self.keys.snapshot(record.id), record, Layout::Pretty)
            .await
    }

    /// Removes snapshot `id`: its parts, then its record.
    pub async fn delete_snapshot(&self, id: SnapshotId) -> Result<(), Error> {
        self.kv.delete_prefix(&self.keys.parts(id.0)).await?;
        Ok(self.kv.delete(&self.keys.snapshot(id.0)).await?)
    }

    /// Snapshot `id`'s parts; a part that does not parse is an error naming its key.
    pub async fn parts(&self, id: SnapshotId) -> Result<Vec<PartRecord>, Error> {
        let mut parts = Vec::new();
        for (key, value) in self.kv.list(&self.keys.parts(id.0)).await? {
            parts.push(decode(&key, &value)?);
        }
        Ok(parts)
    }

    /// Every part of every snapshot; one that does not parse is an error naming its key
    /// (garbage collection must not run past a part it cannot read).
    pub async fn all_parts(&self) -> Result<Vec<PartRecord>, Error> {
        let mut parts = Vec::new();
        for (key, value) in self.kv.list(&self.keys.all_parts()).await? {
            parts.push(decode(&key, &value)?);
        }
        Ok(parts)
    }

    /// Stores node `part.node`'s part of snapshot `id`.
    pub async fn put_part(&self, id: SnapshotId, part: &PartRecord) -> Result<(), Error> {
        self.put(&self.keys.part(id.0, &part.node), part, Layout::Pretty)
            .await
    }

    /// Takes the next value of the snapshot id counter (the last id handed out + 1).
    pub async fn take_snapshot_id(&self) -> Result<SnapshotId, Error> {
        self.kv
            .fetch_increment(&self.keys.next_id())
            .await?
            .checked_add(1)
            .map(SnapshotId)
            .ok_or(Error::CounterExhausted("snapshot id"))
    }

    /// Sets the snapshot id counter to `id` (the last id handed out).
    pub async fn set_last_snapshot_id(&self, id: SnapshotId) -> Result<(), Error> {
        Ok(self
            .kv
            .put(&self.keys.next_id(), id.0.to_string().into_bytes())
            .await?)
    }

    /// Every node of the roster (unparsable ones skipped).
    pub async fn roster(&self) -> Result<Vec<RosterRecord>, Error> {
        self.list(&self.keys.roster()).await
    }

    /// Stores a node of the roster.
    pub async fn put_roster(&self, record: &RosterRecord) -> Result<(), Error> {
        self.put(
            &self.keys.roster_node(&record.node),
            record,
            Layout::Compact,
        )
        .await
    }

    /// Removes a node: its tombstone first, then its roster record. A crash between the two
    /// leaves both; at start the roster record wins (the removal did not happen: its caller
    /// saw no success, and `RemoveNode` again finishes it).
    pub async fn remove_node(&self, record: &RemovedRecord) -> Result<(), Error> {
        self.put(
            &self.keys.removed_node(&record.node),
            record,
            Layout::Compact,
        )
        .await?;
        Ok(self.kv.delete(&self.keys.roster_node(&record.node)).await?)
    }

    /// Every node removed and not back (unparsable ones skipped).
    pub async fn removed(&self) -> Result<Vec<RemovedRecord>, Error> {
        self.list(&self.keys.removed()).await
    }

    /// A removed node is back: its tombstone goes.
    pub async fn delete_removed(&self, node: &str) -> Result<(), Error> {
        Ok(self.kv.delete(&self.keys.removed_node(node)).await?)
    }

    /// Stores a connected member, for as long as this coordinator lives.
    pub async fn put_member(&self, record: &MemberRecord) -> Result<(), Error> {
        let value = encode(record, Layout::Compact);
        Ok(self
            .kv
            .put_ephemeral(&self.keys.member(&record.node), value)
            .await?)
    }

    /// Every connected member, as the leader stored them (unparsable ones skipped).
    pub async fn members(&self) -> Result<Vec<MemberRecord>, Error> {
        self.list(&self.keys.members()).await
    }

    /// Removes a member.
    pub async fn delete_member(&self, node: &str) -> Result<(), Error> {
        Ok(self.kv.delete(&self.keys.member(node)).await?)
    }

    /// The stored policy's raw bytes (its reader decides what an unreadable one means).
    pub async fn policy_bytes(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(self.kv.get(&self.keys.policy()).await?)
    }

    /// Stores the policy.
    pub async fn put_policy(&self, record: &PolicyRecord) -> Result<(), Error> {
        self.put(&self.keys.policy(), record, Layout::Pretty).await
    }

    /// Allocates the next epoch number.
    pub async fn allocate_epoch(&self) -> Result<u64, Error> {
        self.kv
            .fetch_increment(&self.keys.epoch())
            .await?
            .checked_add(1)
            .ok_or(Error::CounterExhausted("epoch"))
    }

    /// Raises the epoch counter to `epoch`.
    pub async fn set_epoch_counter(&self, epoch: u64) -> Result<(), Error> {
        Ok(self
            .kv
            .put(&self.keys.epoch(), epoch.to_string().into_bytes())
            .await?)
    }

    /// The restore that fenced `epoch`.
    pub async fn restore(&self, epoch: u64) -> Result<Option<RestoreRecord>, Error> {
        self.get(&self.keys.restore(epoch)).await
    }

    /// Every restore record, oldest first (unparsable ones skipped).
    pub async fn restores(&self) -> Result<Vec<RestoreRecord>, Error> {
        self.list(&self.keys.restores()).await
    }

    /// Stores a restore record.
    pub async fn put_restore(&self, record: &RestoreRecord) -> Result<(), Error> {
        self.put(&self.keys.restore(record.epoch), record, Layout::Pretty)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryKv;

    /// The stored JSON is what it always was: pretty for snapshots, compact for the roster.
    #[tokio::test]
    async fn records_are_stored_as_before() {
        let kv = Arc::new(AnyKv::Memory(MemoryKv::default()));
        let meta = Metadata::new(kv.clone(), Keys::new("c"));
        let snapshot = crate::store::sample_snapshot(7);
        meta.put_snapshot(&snapshot).await.unwrap();
        let raw = kv
            .get("/cairn/c/snapshots/00000000000000000007")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(raw, serde_json::to_vec_pretty(&snapshot).unwrap());
        assert!(
            String::from_utf8(raw)
                .unwrap()
                .contains("\"status\": \"COMPLETED\"")
        );
        let roster = RosterRecord {
            node: "n1".into(),
            address: "h:1".into(),
            joined_at_ms: 9,
            incarnation: 2,
        };
        meta.put_roster(&roster).await.unwrap();
        let raw = kv.get("/cairn/c/roster/n1").await.unwrap().unwrap();
        assert_eq!(
            String::from_utf8(raw).unwrap(),
            r#"{"node":"n1","address":"h:1","joined_at_ms":9,"incarnation":2}"#
        );
        assert_eq!(
            meta.snapshot(SnapshotId(7)).await.unwrap().unwrap(),
            snapshot
        );
        // A record that does not parse is named by its key.
        kv.put("/cairn/c/snapshots/00000000000000000008", b"{".to_vec())
            .await
            .unwrap();
        let err = meta.snapshot(SnapshotId(8)).await.unwrap_err();
        assert!(
            err.to_string().contains("snapshots/00000000000000000008"),
            "{err}"
        );
        assert_eq!(meta.snapshots().await.unwrap().len(), 1, "listing skips it");
    }
}
