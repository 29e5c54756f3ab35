//! `cairn.v1.NodeAdmin`: the daemon's status, snapshots started by hand (static
//! configurations only: a daemon with a coordinator refuses them), and this node's completed
//! parts.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cairn_core::SnapshotId;
use cairn_rpc::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::node_loop::{HoldFault, LoopMsg};
use crate::shared::Shared;
use cairn_proto::convert::{channel_from_pb, mode_from_pb, plan_to_pb};

/// Longest fault-injection delay per batch, in milliseconds: a batch already waiting when
/// the delay is removed still waits out its own, so this bounds how long a channel can be
/// wedged by one request.
pub(crate) const MAX_FAULT_DELAY_MS: u64 = 10_000;

/// The `NodeAdmin` service.
pub(crate) struct AdminService {
    pub loop_tx: mpsc::Sender<LoopMsg>,
    pub shared: Arc<Shared>,
    /// The daemon has a coordinator: snapshots start there, never here.
    pub coordinated: bool,
}

impl AdminService {
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> LoopMsg) -> Result<T, Status> {
        let (reply, answer) = oneshot::channel();
        self.loop_tx
            .send(make(reply))
            .await
            .map_err(|_| Error::ShuttingDown)?;
        Ok(answer.await.map_err(|_| Error::ShuttingDown)?)
    }
}

#[tonic::async_trait]
impl pb::node_admin_server::NodeAdmin for AdminService {
    async fn get_node_status(
        &self,
        _request: Request<pb::GetNodeStatusRequest>,
    ) -> Result<Response<pb::NodeStatus>, Status> {
        let status = self.ask(|reply| LoopMsg::Status { reply }).await?;
        Ok(Response::new(status))
    }

    async fn initiate_snapshot(
        &self,
        request: Request<pb::InitiateSnapshotRequest>,
    ) -> Result<Response<pb::InitiateSnapshotResponse>, Status> {
        if self.coordinated {
            return Err(Error::Coordinated.into());
        }
        let request = request.into_inner();
        if request.snapshot_id == 0 {
            return Err(Error::Malformed("snapshot_id must be positive".into()).into());
        }
        let mode = mode_from_pb(request.mode, Some(Default::default())).map_err(Error::from)?;
        let alignment_timeout = (request.alignment_timeout_ms > 0)
            .then(|| Duration::from_millis(request.alignment_timeout_ms));
        let plan = self
            .ask(|reply| LoopMsg::Initiate {
                id: SnapshotId(request.snapshot_id),
                mode,
                alignment_timeout,
                reply,
            })
            .await??;
        Ok(Response::new(pb::InitiateSnapshotResponse {
            plan: Some(plan_to_pb(&plan, 0)),
        }))
    }

    async fn get_local_snapshot(
        &self,
        request: Request<pb::GetLocalSnapshotRequest>,
    ) -> Result<Response<pb::LocalSnapshot>, Status> {
        let id = SnapshotId(request.into_inner().snapshot_id);
        let part = self.ask(|reply| LoopMsg::GetPart { id, reply }).await??;
        Ok(Response::new(pb::LocalSnapshot::from(&part)))
    }

    async fn inject_fault(
        &self,
        request: Request<pb::InjectFaultRequest>,
    ) -> Result<Response<pb::InjectFaultResponse>, Status> {
        use pb::inject_fault_request::Fault;
        if !self.shared.fault_injection {
            return Err(Error::FaultInjectionDisabled.into());
        }
        let request = request.into_inner();
        let channel = channel_from_pb(request.channel.as_ref()).map_err(Error::from)?;
        let me = &self.shared.node_id;
        let Some(handles) = self.shared.channel(&channel) else {
            return Err(Error::Unknown(format!("node {me} has no channel {channel}")).into());
        };
        let incoming = channel.to == *me;
        let invalid = |what: &str| -> Status { Error::Malformed(what.to_owned()).into() };
        let (reply, applied) = tokio::sync::oneshot::channel();
        let hold = |fault: HoldFault| LoopMsg::Fault {
            channel: channel.clone(),
            fault,
            reply,
        };
        let message = match request.fault {
            None => return Err(invalid("no fault given")),
            Some(Fault::Cut(_)) => {
                handles.faults.cut.notify_one();
                None
            }
            Some(Fault::Delay(delay)) if !incoming => {
                if delay.millis > MAX_FAULT_DELAY_MS {
                    return Err(invalid(&format!(
                        "delay.millis must be at most {MAX_FAULT_DELAY_MS} (a batch waits that \
                         long at most); got {}",
                        delay.millis
                    )));
                }
                handles
                    .faults
                    .delay_ms
                    .store(delay.millis, Ordering::Relaxed);
                None
            }
            // At the sender, resume undoes a delay (as `delay 0` does).
            Some(Fault::Resume(_)) if !incoming => {
                handles.faults.delay_ms.store(0, Ordering::Relaxed);
                None
            }
            Some(Fault::Delay(_)) => {
                return Err(invalid(&format!(
                    "delay {channel} at its sender, node {}",
                    channel.from
                )));
            }
            Some(_) if !incoming => {
                return Err(invalid(&format!(
                    "hold {channel} at its receiver, node {}",
                    channel.to
                )));
            }
            Some(Fault::Hold(_)) => Some(hold(HoldFault::Hold)),
            Some(Fault::Release(r)) => Some(hold(HoldFault::Release(r.frames))),
            Some(Fault::Resume(_)) => Some(hold(HoldFault::Resume)),
        };
        if let Some(message) = message {
            // Answered once the loop applied it: a status read after this shows it.
            self.loop_tx
                .send(message)
                .await
                .map_err(|_| Error::ShuttingDown)?;
            if !applied.await.map_err(|_| Error::ShuttingDown)? {
                return Err(Error::Unknown(format!("node {me} has no channel {channel}")).into());
            }
        }
        Ok(Response::new(pb::InjectFaultResponse {}))
    }
}
