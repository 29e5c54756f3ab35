//! The coordinator's task driven directly, on the in-memory metadata store: its messages
//! in, what it stores and what it tells nodes out — no gRPC, no processes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cairn_core::control::{Membership, NodeCommand as Command, NodeReport, Registration};
use cairn_core::schedule::Policy;
use cairn_core::{
    ChannelId, IncomingCut, LocalReport, NodeId, NodePart, OutgoingCut, SnapshotId, SnapshotMode,
    StartRequest,
};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::{Msg, PartSizes, Settings, State};
use crate::error::Error;
use crate::store::{
    AnyKv, ChunkList, Keys, MemoryKv, Metadata, PartRecord, RestoreStatus, SnapshotStatus,
};
use cairn_blob::BlobStore;

type Session = mpsc::Receiver<Result<super::ToNode, Status>>;

struct Harness {
    tx: mpsc::Sender<Msg>,
    meta: Metadata,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    dir: std::path::PathBuf,
    sessions: u64,
}

impl Harness {
    async fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "cairn-state-test-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        let args = cairn_blob::BlobArgs {
            blob_store: Some(cairn_blob::Location::Dir(dir.clone())),
            ..Default::default()
        };
        let blobs = BlobStore::open(&args, None, true).await.unwrap();
        let meta = Metadata::new(Arc::new(AnyKv::Memory(MemoryKv::default())), Keys::new("t"));
        let (health, _) = tonic_health::server::health_reporter();
        let (tx, rx) = mpsc::channel(64);
        let settings = Settings {
            cluster: "t".into(),
            retention: 0,
            gc_grace: Duration::ZERO,
            remove_after: None,
            topology: None,
            policy: Policy::default(),
            auto_restore: false,
            restore_timeout: Duration::from_secs(60),
            leadership: crate::leader::election::Leadership::forever(),
        };
        let mut state = State::new(
            crate::metrics::CoordinatorMetrics::default(),
            settings,
            meta.clone(),
            blobs,
            4,
            tx.clone(),
            health,
        );
        state.recover().await.unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(state.run(rx, stop.clone()));
        Self {
            tx,
            meta,
            stop,
            task,
            dir,
            sessions: 0,
        }
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Msg) -> T {
        let (reply, answer) = oneshot::channel();
        self.tx.send(make(reply)).await.unwrap();
        answer.await.unwrap()
    }

    async fn register_as(
        &mut self,
        node: &str,
        incarnation: u64,
        highest_snapshot_id: u64,
    ) -> Result<Session, Error> {
        self.sessions += 1;
        let session = self.sessions;
        let (tx, mut rx) = mpsc::channel(64);
        let registration = Registration {
            cluster: "t".into(),
            node: node.into(),
            address: format!("{node}:1"),
            incarnation,
            highest_snapshot_id,
            ..Default::default()
        };
        self.ask(|reply| Msg::Register {
            registration,
            session,
            tx,
            reply,
        })
        .await?;
        let first = rx.recv().await.unwrap().unwrap();
        assert!(matches!(first.command, Command::Registered(_)));
        Ok(rx)
    }

    /// Stores a part without bytes for each of `nodes` (the service stores the real ones).
    async fn store_empty_parts(&self, id: u64, nodes: &[&str]) {
        for node in nodes {
            let part = PartRecord {
                node: (*node).into(),
                incarnation: 1,
                incoming: Vec::new(),
                outgoing: Vec::new(),
                manifest: None,
                local_state_bytes: 0,
                local_state: ChunkList::default(),
                channel_states: ChunkList::default(),
                recorded_messages: 0,
                bytes_new: 0,
                bytes_reused: 0,
                epoch: 0,
                applied_restore_id: String::new(),
                recorded_channels: Vec::new(),
            };
            self.meta.put_part(SnapshotId(id), &part).await.unwrap();
        }
    }

    async fn register(&mut self, node: &str) -> Session {
        self.register_as(node, 1, 0).await.unwrap()
    }

    async fn start_snapshot(&self) -> Result<u64, Error> {
        let request = StartRequest {
            mode: SnapshotMode::ChandyLamport,
            initiators: Default::default(),
            alignment_timeout: None,
        };
        self.ask(|reply| Msg::Start {
            request,
            timeout: Duration::from_secs(30),
            labels: BTreeMap::new(),
            request_id: String::new(),
            reply,
        })
        .await
        .map(|id| id.0)
    }

    /// Node `node`'s part of snapshot `id` in a two-node mesh with nothing in flight.
    async fn part(&self, id: u64, node: &str, other: &str) {
        self.part_sized(id, node, other, PartSizes::default()).await;
    }

    /// As [`Self::part`], weighing `sizes`.
    async fn part_sized(&self, id: u64, node: &str, other: &str, sizes: PartSizes) {
        let report = LocalReport {
            id: SnapshotId(id),
            node: NodeId::new(node),
            incoming: BTreeMap::from([(
                ChannelId::new(other, node),
                IncomingCut {
                    delivered: 0,
                    marker_at: 0,
                },
            )]),
            outgoing: BTreeMap::from([(
                ChannelId::new(node, other),
                OutgoingCut {
                    sent: 0,
                    marker_at: 0,
                },
            )]),
        };
        let part = NodePart {
            report,
            recorded: BTreeMap::new(),
        };
        self.tx
            .send(Msg::PartStored {
                part,
                sizes,
                epoch: 0,
                applied_restore_id: String::new(),
            })
            .await
            .unwrap();
    }

    /// The snapshot's stored record once it has ended.
    async fn ended(&self, id: u64) -> crate::store::SnapshotRecord {
        for _ in 0..1000 {
            if self
                .ask(|reply| Msg::Live {
                    id: SnapshotId(id),
                    reply,
                })
                .await
                .is_none()
            {
                return self.meta.snapshot(SnapshotId(id)).await.unwrap().unwrap();
            }
            tokio::task::yield_now().await;
        }
        panic!("snapshot {id} did not end");
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn rand_suffix() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::time::SystemTime::now())
}

/// The next command a node's session gets (anything but membership updates).
async fn command(session: &mut Session) -> Command {
    loop {
        let next = tokio::time::timeout(Duration::from_secs(5), session.recv())
            .await
            .expect("a command")
            .unwrap()
            .unwrap();
        match next.command {
            // Membership updates and the snapshots' ends for the applications.
            Command::Membership(_) | Command::Outcomes(_) => continue,
            other => return other,
        }
    }
}

#[tokio::test]
async fn a_started_snapshot_completes_when_every_part_is_stored() {
    let mut h = Harness::start().await;
    let mut a = h.register("a").await;
    let _b = h.register("b").await;
    let id = h.start_snapshot().await.unwrap();
    assert_eq!(id, 1);
    let Command::Initiate(plan) = command(&mut a).await else {
        panic!("the initiator is told to initiate")
    };
    assert_eq!(plan.id, SnapshotId(1));
    h.part(id, "a", "b").await;
    h.part(id, "b", "a").await;
    let record = h.ended(id).await;
    assert_eq!(record.status, SnapshotStatus::Completed, "{record:?}");
    assert!(record.verdict.unwrap().consistent);
    h.stop().await;
}

/// The stored timeline: started, each node's state recorded and part stored once (a
/// repeated report adds nothing), verified, ended; a node's failure is named in it.
#[tokio::test]
async fn a_snapshot_keeps_its_timeline_once_per_node_and_step() {
    use crate::store::EventKind::*;
    let mut h = Harness::start().await;
    let _a = h.register("a").await;
    let _b = h.register("b").await;
    let id = h.start_snapshot().await.unwrap();
    for node in ["a", "b", "a"] {
        let report = NodeReport::StateRecorded(Default::default());
        h.tx.send(Msg::NodeEvent {
            node: NodeId::new(node),
            id: SnapshotId(id),
            report,
        })
        .await
        .unwrap();
    }
    // a's part stored twice: the second replaces the first, sizes and event.
    let sized = |bytes_new| PartSizes {
        bytes_new,
        bytes_reused: 1,
        local_state_bytes: 3,
        recorded_messages: 0,
    };
    h.part_sized(id, "a", "b", sized(100)).await;
    h.part_sized(id, "a", "b", sized(7)).await;
    h.part_sized(id, "b", "a", sized(5)).await;
    let record = h.ended(id).await;
    assert_eq!((record.bytes_new, record.bytes_reused), (12, 2));
    let steps: Vec<_> = record
        .events
        .iter()
        .map(|e| (e.kind, e.node.as_str()))
        .collect();
    assert_eq!(
        steps,
        [
            (Started, ""),
            (StateRecorded, "a"),
            (StateRecorded, "b"),
            (PartStored, "a"),
            (PartStored, "b"),
            (Verified, ""),
            (Ended, ""),
        ]
    );
    assert!(record.events.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
    assert_eq!(record.events.last().unwrap().detail, "COMPLETED");
    let stored: u64 = record.events.iter().map(|e| e.bytes_new).sum();
    assert_eq!(stored, record.bytes_new);

    let id = h.start_snapshot().await.unwrap();
    let reason = cairn_core::FailureReason::NoApplication(NodeId::new("b"));
    for _ in 0..2 {
        let report = NodeReport::Failed(reason.clone());
        h.tx.send(Msg::NodeEvent {
            node: NodeId::new("b"),
            id: SnapshotId(id),
            report,
        })
        .await
        .unwrap();
    }
    let record = h.ended(id).await;
    let steps: Vec<_> = record.events.iter().map(|e| e.kind).collect();
    assert_eq!(steps, [Started, NodeFailed, Ended]);
    assert!(record.events[1].detail.contains("b"), "{:?}", record.events);
    assert!(
        record.events[2].detail.starts_with("FAILED: "),
        "{:?}",
        record.events
    );
    h.stop().await;
}

#[tokio::test]
async fn a_failure_reported_by_a_node_fails_the_snapshot_and_aborts_it_everywhere() {
    let mut h = Harness::start().await;
    let _a = h.register("a").await;
    let mut b = h.register("b").await;
    let id = h.start_snapshot().await.unwrap();
    let reason = cairn_core::FailureReason::NoApplication(NodeId::new("b"));
    let report = NodeReport::Failed(reason.clone());
    h.tx.send(Msg::NodeEvent {
        node: NodeId::new("b"),
        id: SnapshotId(id),
        report,
    })
    .await
    .unwrap();
    let record = h.ended(id).await;
    assert_eq!(record.status, SnapshotStatus::Failed);
    assert_eq!(record.failure.unwrap().kind, "NO_APPLICATION");
    let Command::Abort { snapshot, .. } = command(&mut b).await else {
        panic!("nodes are told to drop it")
    };
    assert_eq!(snapshot, SnapshotId(id));
    h.stop().await;
}

#[tokio::test]
async fn an_abort_ends_the_snapshot_as_aborted_and_a_second_one_is_refused() {
    let mut h = Harness::start().await;
    let _a = h.register("a").await;
    let _b = h.register("b").await;
    let id = h.start_snapshot().await.unwrap();
    let aborted = h
        .ask(|reply| Msg::Abort {
            id: SnapshotId(id),
            reason: "enough".into(),
            reply,
        })
        .await
        .unwrap();
    assert_eq!(aborted.status, SnapshotStatus::Aborted);
    let again = h
        .ask(|reply| Msg::Abort {
            id: SnapshotId(id),
            reason: String::new(),
            reply,
        })
        .await
        .unwrap_err();
    assert!(matches!(again, Error::AlreadyEnded { .. }), "{again:?}");
    h.stop().await;
}

#[tokio::test]
async fn a_restore_fences_snapshots_until_every_node_applied_it() {
    let mut h = Harness::start().await;
    let mut a = h.register("a").await;
    let mut b = h.register("b").await;
    let id = h.start_snapshot().await.unwrap();
    h.part(id, "a", "b").await;
    h.part(id, "b", "a").await;
    assert_eq!(h.ended(id).await.status, SnapshotStatus::Completed);
    h.store_empty_parts(id, &["a", "b"]).await;
    let op = h
        .ask(|reply| Msg::Restore {
            snapshot_id: SnapshotId(id),
            if_epoch: None,
            reply,
        })
        .await
        .unwrap();
    assert_eq!((op.id.as_str(), op.epoch), ("restore-1", 1));
    for session in [&mut a, &mut b] {
        let restore = loop {
            match command(session).await {
                Command::Restore(restore) => break restore,
                Command::Initiate(_) => continue, // the snapshot taken before
                other => panic!("every node is told to restore, not {other:?}"),
            }
        };
        assert_eq!(restore.epoch, 1);
    }
    let fenced = h.start_snapshot().await.unwrap_err();
    assert!(fenced.to_string().contains("restore-1"), "{fenced}");
    // Deleting the snapshot being restored is refused too.
    let refused = h
        .ask(|reply| Msg::Delete {
            id: SnapshotId(id),
            reply,
        })
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("restore-1"), "{refused}");
    for node in ["a", "b"] {
        h.tx.send(Msg::RestoreApplied {
            node: NodeId::new(node),
            restore_id: "restore-1".into(),
        })
        .await
        .unwrap();
    }
    let next = h.start_snapshot().await.unwrap();
    assert_eq!(next, 2);
    let stored = h.meta.restore(1).await.unwrap().unwrap();
    assert_eq!(stored.status, RestoreStatus::Done);
    h.stop().await;
}

#[tokio::test]
async fn a_node_joining_fails_the_snapshot_in_flight() {
    let mut h = Harness::start().await;
    let _a = h.register("a").await;
    let _b = h.register("b").await;
    let id = h.start_snapshot().await.unwrap();
    let _c = h.register("c").await;
    let record = h.ended(id).await;
    assert_eq!(record.status, SnapshotStatus::Failed);
    let failure = record.failure.unwrap();
    assert_eq!(failure.kind, "MEMBERSHIP_CHANGED");
    assert!(
        failure.message.contains("node c joined"),
        "{}",
        failure.message
    );
    h.stop().await;
}

#[tokio::test]
async fn a_second_daemon_for_a_connected_id_is_refused_and_ids_stay_above_what_daemons_saw() {
    let mut h = Harness::start().await;
    let _a = h.register_as("a", 1, 41).await.unwrap();
    let refused = h.register_as("a", 2, 0).await.unwrap_err();
    assert!(
        refused.to_string().contains("held by a connected daemon"),
        "{refused}"
    );
    let _b = h.register("b").await;
    assert_eq!(h.start_snapshot().await.unwrap(), 42);
    h.stop().await;
}

#[tokio::test]
async fn a_watcher_and_a_reader_see_the_progress_the_tracker_has() {
    let mut h = Harness::start().await;
    let _a = h.register("a").await;
    let _b = h.register("b").await;
    let id = h.start_snapshot().await.unwrap();
    let report = NodeReport::StateRecorded(Default::default());
    h.tx.send(Msg::NodeEvent {
        node: NodeId::new("a"),
        id: SnapshotId(id),
        report,
    })
    .await
    .unwrap();
    let (tx, mut rx) = mpsc::channel(8);
    h.ask(|reply| Msg::Watch {
        id: SnapshotId(id),
        tx,
        reply,
    })
    .await
    .unwrap();
    let first = rx.recv().await.unwrap().unwrap();
    assert_eq!(first.recorded, vec!["a".to_owned()], "{first:?}");
    let live = h
        .ask(|reply| Msg::Live {
            id: SnapshotId(id),
            reply,
        })
        .await
        .unwrap();
    assert_eq!(live.recorded, vec!["a".to_owned()]);
    assert!(live.reported.is_empty());
    h.part(id, "b", "a").await;
    let next = rx.recv().await.unwrap().unwrap();
    assert_eq!(next.reported, vec!["b".to_owned()], "{next:?}");
    h.stop().await;
}

/// The first membership update a node's session gets that `holds`.
async fn membership(session: &mut Session, holds: impl Fn(&Membership) -> bool) -> Membership {
    loop {
        let next = tokio::time::timeout(Duration::from_secs(5), session.recv())
            .await
            .expect("a membership")
            .unwrap()
            .unwrap();
        if let Command::Membership(m) = next.command
            && holds(&m)
        {
            return m;
        }
    }
}

/// Removing a node: refused while it is connected or for a node not on the roster; once it
/// is gone its tombstone is stored and memberships name it; the removed process may not
/// register again, and a new process joins as a new member (the tombstone goes).
#[tokio::test]
async fn a_removed_node_is_named_in_memberships_and_only_a_new_process_may_return() {
    let mut h = Harness::start().await;
    let mut a = h.register("a").await;
    let _b = h.register("b").await; // session 2, incarnation 1
    let remove = |node: &str| {
        let node = NodeId::new(node);
        move |reply| Msg::RemoveNode { node, reply }
    };
    let err = h.ask(remove("b")).await.unwrap_err();
    assert!(matches!(err, Error::StillConnected { .. }), "{err}");
    let err = h.ask(remove("z")).await.unwrap_err();
    assert!(matches!(err, Error::NotAMember(_)), "{err}");

    h.tx.send(Msg::SessionEnded {
        node: NodeId::new("b"),
        session: 2,
    })
    .await
    .unwrap();
    // The others hear it is down.
    membership(&mut a, |m| {
        m.nodes
            .iter()
            .any(|n| n.node.as_str() == "b" && !n.connected)
    })
    .await;
    let left = h.ask(remove("b")).await.unwrap();
    assert_eq!(left.nodes.len(), 1);
    let told = membership(&mut a, |m| !m.removed.is_empty()).await;
    assert_eq!(told.removed, [NodeId::new("b")]);
    assert!(told.nodes.iter().all(|n| n.node.as_str() != "b"));
    assert_eq!(h.meta.removed().await.unwrap().len(), 1);

    let refused = h.register_as("b", 1, 0).await.unwrap_err();
    assert!(matches!(refused, Error::Removed(_)), "{refused}");
    let _b2 = h.register_as("b", 2, 0).await.unwrap();
    let joined = membership(&mut a, |m| m.nodes.iter().any(|n| n.node.as_str() == "b")).await;
    assert!(joined.removed.is_empty(), "{joined:?}");
    assert!(h.meta.removed().await.unwrap().is_empty());
    h.stop().await;
}

/// A node that restarts after applying the restore under way is not restored alone again
/// (its previous process went on from the restored state with the others): the restore
/// fails, naming it, and the cluster stays fenced until a restore brings every node back.
/// Found by a nemesis run: restored alone, the node reused transfer ids its previous process
/// had already sent to a node that applied.
#[tokio::test]
async fn a_node_restarted_after_applying_a_restore_fails_it_instead_of_being_restored_alone() {
    let mut h = Harness::start().await;
    let mut a = h.register("a").await;
    let mut b = h.register("b").await;
    let id = h.start_snapshot().await.unwrap();
    h.part(id, "a", "b").await;
    h.part(id, "b", "a").await;
    assert_eq!(h.ended(id).await.status, SnapshotStatus::Completed);
    h.store_empty_parts(id, &["a", "b"]).await;
    h.ask(|reply| Msg::Restore {
        snapshot_id: SnapshotId(id),
        if_epoch: None,
        reply,
    })
    .await
    .unwrap();
    for session in [&mut a, &mut b] {
        loop {
            match command(session).await {
                Command::Restore(_) => break,
                Command::Initiate(_) => continue,
                other => panic!("every node is told to restore, not {other:?}"),
            }
        }
    }
    // a applies, then its process dies and a new one registers.
    h.tx.send(Msg::RestoreApplied {
        node: NodeId::new("a"),
        restore_id: "restore-1".into(),
    })
    .await
    .unwrap();
    h.tx.send(Msg::SessionEnded {
        node: NodeId::new("a"),
        session: 1,
    })
    .await
    .unwrap();
    let _a2 = h.register_as("a", 2, 0).await.unwrap();
    let stored = h.meta.restore(1).await.unwrap().unwrap();
    assert_eq!(stored.status, RestoreStatus::Failed);
    let why = stored.failure.unwrap_or_default();
    assert!(why.contains("node a restarted after applying"), "{why}");
    // b applying now finishes nothing, and snapshots stay fenced.
    h.tx.send(Msg::RestoreApplied {
        node: NodeId::new("b"),
        restore_id: "restore-1".into(),
    })
    .await
    .unwrap();
    let fenced = h.start_snapshot().await.unwrap_err();
    assert!(fenced.to_string().contains("restore-1"), "{fenced}");
    h.stop().await;
}
