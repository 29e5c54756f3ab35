//! Membership, as the coordinator's task carries it out: a registration's session is held
//! until the engine admits it (its records stored), and the engine's membership role
//! ([`cairn_core::coordinator`]) decides everything else — one live process per node id,
//! the epoch a node is to be in, sessions that end or go silent, removals, what nodes and
//! `ListNodes` are told.

use cairn_core::NodeId;
use cairn_core::control::{Membership, Registration};
use cairn_core::coordinator::{Answer, Input};

use super::{NodeTx, State};
use crate::error::Error;

impl State {
    pub(super) async fn register(
        &mut self,
        registration: Registration,
        session: u64,
        tx: NodeTx,
    ) -> Result<Membership, Error> {
        if !self.leadership.valid() {
            return Err(Error::ShuttingDown);
        }
        let (highest, floor) = (registration.highest_snapshot_id, self.engine.id_floor());
        if highest > floor.saturating_add(1_000_000)
            && highest <= cairn_core::coordinator::MAX_REPORTED
        {
            tracing::error!(node = %registration.node, reported = highest, floor, "a daemon reports a snapshot id far above any known: ids continue above it");
        }
        if registration.epoch > self.engine.epoch()
            && registration.epoch <= cairn_core::coordinator::MAX_REPORTED
        {
            tracing::error!(
                node = %registration.node,
                node_epoch = registration.epoch,
                epoch = self.engine.epoch(),
                "a daemon is in a later epoch than the metadata store says (lost metadata?): \
                 raising the cluster's epoch"
            );
        }
        let token = self.token();
        // Its session is held until the engine admits it (`Action::Admit`).
        self.registering.insert(token, (session, tx));
        let input = Input::Register {
            token,
            registration,
            session,
        };
        let answers = self.drive(input).await;
        self.registering.remove(&token);
        let result = answers.into_iter().find_map(|(told, answer)| match answer {
            Answer::Registered(result) if told == token => Some(result),
            _ => None,
        });
        match result {
            // A term that ended meanwhile sent the node nothing (`Registered` included).
            Some(Ok(_)) if !self.leadership.valid() => Err(Error::ShuttingDown),
            Some(result) => result.map_err(|refusal| self.refused(refusal)),
            None => Err(super::snapshots::unanswered("Register")),
        }
    }

    /// Takes a node that is down off the roster and out of the topology: snapshots in
    /// flight fail (planned over it), and every member is told its new membership (its
    /// daemon drops the channels to and from the node).
    pub(super) async fn remove_node(&mut self, node: NodeId) -> Result<Membership, Error> {
        let token = self.token();
        let answers = self.drive(Input::RemoveNode { token, node }).await;
        let result = answers.into_iter().find_map(|(told, answer)| match answer {
            Answer::Removed(result) if told == token => Some(result),
            _ => None,
        });
        match result {
            Some(result) => result.map_err(|refusal| self.refused(refusal)),
            None => Err(super::snapshots::unanswered("RemoveNode")),
        }
    }
}
