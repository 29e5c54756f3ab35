//! A snapshot's requests in the coordinator's task: the checks of the roles not yet in
//! the engine (the restore fence, the roster), then the engine decides (`drive.rs` carries
//! out what it decided); watching and reading a snapshot.

use std::collections::BTreeMap;
use std::time::Duration;

use cairn_core::control::NodeReport;
use cairn_core::coordinator::{Answer, Input, StartInput};
use cairn_core::{NodeId, SnapshotId, StartRequest};

use super::{State, WatchTx};
use crate::error::Error;
use crate::store::{SnapshotRecord, SnapshotStatus};

impl State {
    pub(super) async fn node_event(&mut self, node: NodeId, id: SnapshotId, report: NodeReport) {
        self.drive(Input::Report { node, id, report }).await;
    }

    pub(super) async fn start(
        &mut self,
        request: StartRequest,
        timeout: Duration,
        labels: BTreeMap<String, String>,
        request_id: String,
    ) -> Result<SnapshotId, Error> {
        let token = self.token();
        let start = StartInput {
            request,
            timeout,
            labels,
            term: self.leadership.term(),
            request_id,
        };
        let input = Input::Start { token, start };
        for (told, answer) in self.drive(input).await {
            if let (true, Answer::Started(result)) = (told == token, answer) {
                return result.map_err(|refusal| self.refused(refusal));
            }
        }
        Err(unanswered("StartSnapshot"))
    }

    pub(super) async fn abort(
        &mut self,
        id: SnapshotId,
        reason: String,
    ) -> Result<SnapshotRecord, Error> {
        let token = self.token();
        for (told, answer) in self.drive(Input::Abort { token, id, reason }).await {
            if let (true, Answer::Aborted(result)) = (told == token, answer) {
                return match result {
                    Ok(record) => Ok(*record),
                    Err(cairn_core::coordinator::Refusal::NotInFlight(id)) => {
                        Err(self.not_in_flight(id).await)
                    }
                    Err(refusal) => Err(self.refused(refusal)),
                };
            }
        }
        Err(unanswered("AbortSnapshot"))
    }

    pub(super) async fn watch(&mut self, id: SnapshotId, tx: WatchTx) -> Result<(), Error> {
        let record = match self.engine.live_record(id) {
            Some(r) => r,
            None => self
                .get_record(id)
                .await?
                .ok_or(Error::SnapshotNotFound(id))?,
        };
        let in_progress = record.status == SnapshotStatus::InProgress;
        let _ = tx.try_send(Ok(std::sync::Arc::new(record)));
        if in_progress {
            self.watchers.entry(id).or_default().push(tx);
        }
        Ok(())
    }

    pub(super) async fn put_record(&self, record: &SnapshotRecord) -> Result<(), Error> {
        self.meta.put_snapshot(record).await
    }

    pub(super) async fn get_record(&self, id: SnapshotId) -> Result<Option<SnapshotRecord>, Error> {
        self.meta.snapshot(id).await
    }
}

/// A request the engine did not answer: a bug, said as one rather than a hang.
pub(super) fn unanswered(rpc: &'static str) -> Error {
    tracing::error!("the coordinator's engine did not answer a {rpc} (a bug)");
    Error::Unanswered(rpc)
}
