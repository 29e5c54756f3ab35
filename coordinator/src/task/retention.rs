//! Deleting snapshots, as the coordinator's task carries it out for the engine
//! (`cairn_core::coordinator`, `retention.rs`, which decides what is deleted and when a
//! collection runs): a user's deletion handed over with its record looked up, the answer
//! sent once the collection after it came back, and the garbage collection itself, run on
//! a task of its own whose result comes back as [`Msg::Collected`].

use std::collections::BTreeSet;
use std::time::Duration;

use cairn_blob::BlobStore;
use cairn_core::SnapshotId;
use cairn_core::coordinator::{Input, Refusal, Token};
use tokio::sync::oneshot;

use super::{Msg, State};
use crate::error::Error;
use crate::leader::election::Leadership;
use crate::store::Metadata;

/// How long garbage collection waits for uploads in progress before it skips a round.
const GC_WAIT: Duration = Duration::from_secs(2);

/// The answer a `DeleteSnapshot` waits for: the bytes freed.
pub(super) type DeleteReply = oneshot::Sender<Result<u64, Error>>;

impl State {
    /// Deletes snapshot `id` (see `Coordinator/DeleteSnapshot`); `reply` is answered with
    /// the bytes the garbage collection that follows freed, once it ran off this task.
    pub(super) async fn delete(&mut self, id: SnapshotId, reply: DeleteReply) {
        let exists = match self.get_record(id).await {
            Ok(record) => record.is_some(),
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let token = self.token();
        self.delete_replies.insert(token, reply);
        let input = Input::Delete {
            token,
            snapshot: id,
            exists,
        };
        self.drive(input).await;
    }

    /// Sends the answer to the deletion of `token`.
    pub(super) fn answer_delete(&mut self, token: Token, result: Result<u64, Refusal<Error>>) {
        if let Some(reply) = self.delete_replies.remove(&token) {
            let _ = reply.send(result.map_err(|refusal| self.refused(refusal)));
        }
    }

    /// Removes chunks no stored part refers to, on a task of its own (a stalled blob store
    /// must not stall this one). A collection finds no hold on the store taken since it
    /// was decided on here ([`BlobStore::exclusive_since`]), or skips.
    pub(super) fn collect_off_task(&self) {
        let since = self.blobs.holds_taken();
        let (meta, blobs) = (self.meta.clone(), self.blobs.clone());
        let (leadership, grace, tx) = (
            self.leadership.clone(),
            self.settings.gc_grace,
            self.self_tx.clone(),
        );
        tokio::spawn(async move {
            let result = collect(&meta, &blobs, &leadership, grace, since).await;
            let _ = tx.send(Msg::Collected { result }).await;
        });
    }
}

/// One garbage collection, off the coordinator's task: every chunk no stored part refers
/// to, older than `grace`, is deleted while the term holds.
async fn collect(
    meta: &Metadata,
    blobs: &BlobStore,
    leadership: &Leadership,
    grace: Duration,
    since: u64,
) -> Result<u64, Error> {
    // Deleting is the one thing the store's fence cannot guard: ask etcd first that the
    // term holds, then check the term before each removal (a watch on the election key
    // ends it within milliseconds of a revoked lease).
    meta.kv().still_leads().await?;
    // No upload or HasChunks answer in progress while it runs, and none since it was
    // decided on (with no snapshot in flight): what they vouch for is in a record before the
    // list below, or they wait for the collection to end.
    let Some(exclusive) = blobs.exclusive_since(GC_WAIT, since).await else {
        tracing::info!("garbage collection skipped: uploads in progress or begun since");
        return Ok(0);
    };
    let mut referenced = BTreeSet::new();
    // Every part, strictly: a chunk that only an unreadable part (or manifest) refers to
    // must not go, so one that cannot be read stops the collection.
    for part in meta.all_parts().await? {
        if let Some(reference) = &part.manifest {
            referenced.insert(reference.sha256.clone());
        }
        let manifest = crate::parts::manifest_of(blobs, &part).await?;
        referenced.extend(manifest.local_state.chunks);
        referenced.extend(manifest.channel_states.chunks);
    }
    blobs
        .collect_garbage(&exclusive, &referenced, grace, || leadership.valid())
        .await
        .map_err(|e| Error::Blob(e.to_string()))
}
