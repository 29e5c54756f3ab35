//! A channel's frames as they go on the wire: batches of runs and markers.

use cairn_rpc::v1 as pb;

use crate::node_loop::OutFrame;
use cairn_proto::convert::plan_to_pb;

/// Most payload bytes in one `FrameBatch`.
const BATCH_BYTES: usize = 1 << 20;

/// Packs numbered frames into batches: consecutive messages as one blob plus lengths,
/// markers between them, at most `BATCH_BYTES` of payload per batch.
pub(super) fn batches(frames: Vec<(u64, OutFrame)>, epoch: u64) -> Vec<pb::PeerFrame> {
    let mut out = Vec::new();
    let mut iter = frames.into_iter().peekable();
    while let Some(&(first_seq, _)) = iter.peek() {
        let mut batch = pb::FrameBatch {
            first_seq,
            frames: Vec::new(),
            epoch,
        };
        let mut bytes = 0;
        while bytes < BATCH_BYTES {
            match iter.peek() {
                None => break,
                Some((_, OutFrame::Marker(_))) => {
                    let Some((_, OutFrame::Marker(plan))) = iter.next() else {
                        unreachable!()
                    };
                    batch.frames.push(pb::Frame {
                        kind: Some(pb::frame::Kind::Marker(pb::Marker {
                            plan: Some(plan_to_pb(&plan, epoch)),
                        })),
                    });
                }
                Some((_, OutFrame::Data(_))) => {
                    let mut runs = cairn_proto::runs::RunBuilder::default();
                    while let Some((_, OutFrame::Data(p))) = iter.peek() {
                        if bytes > 0 && bytes + p.len() > BATCH_BYTES {
                            break;
                        }
                        bytes += p.len();
                        runs.push((), p.clone());
                        iter.next();
                    }
                    for ((), payloads, lengths) in runs.finish() {
                        batch.frames.push(pb::Frame {
                            kind: Some(pb::frame::Kind::Data(pb::DataRun { payloads, lengths })),
                        });
                    }
                    if matches!(iter.peek(), Some((_, OutFrame::Data(_)))) {
                        break; // full: the rest goes into the next batch
                    }
                }
            }
        }
        out.push(pb::PeerFrame {
            kind: Some(pb::peer_frame::Kind::Batch(batch)),
        });
    }
    out
}
