//! A restored state's pieces, gathered into one event or handed on one by one.

use super::*;

/// A restored state's pieces as they come from the daemon: gathered into one
/// [`AppEvent::Restore`], or handed on as [`AppEvent::RestorePiece`]s (`in_pieces`).
#[derive(Default)]
pub(super) struct RestoreStaging {
    /// The restore whose pieces are coming: its id, and (unless in pieces) what came.
    pub(super) current: Option<(String, BytesMut)>,
    pub(super) in_pieces: bool,
}

impl RestoreStaging {
    /// Takes a piece; the events it makes go to `out`.
    pub(super) fn piece(&mut self, r: pb::Restore, out: &mut VecDeque<AppEvent>) {
        let mut staged = match self.current.take() {
            Some((id, staged)) if id == r.restore_id => staged,
            Some((id, _)) => {
                // A piece of another restore: the one before was superseded mid-way.
                if self.in_pieces {
                    out.push_back(AppEvent::RestoreAborted {
                        restore_id: id,
                        reason: format!("superseded by restore {}", r.restore_id),
                    });
                }
                BytesMut::new()
            }
            None => BytesMut::new(),
        };
        if self.in_pieces {
            if !r.last {
                self.current = Some((r.restore_id.clone(), staged));
            }
            out.push_back(AppEvent::RestorePiece {
                restore_id: r.restore_id,
                snapshot_id: r.snapshot_id,
                piece: r.chunk,
                last: r.last,
            });
            return;
        }
        staged.extend_from_slice(&r.chunk);
        if !r.last {
            self.current = Some((r.restore_id, staged));
            return;
        }
        out.push_back(AppEvent::Restore {
            restore_id: r.restore_id,
            snapshot_id: r.snapshot_id,
            state: staged.freeze(),
        });
    }

    /// The daemon aborted a restore whose pieces were coming: what came is dropped (and the
    /// application told, if it was handed pieces).
    pub(super) fn aborted(&mut self, a: pb::RestoreAborted, out: &mut VecDeque<AppEvent>) {
        if self
            .current
            .take_if(|(id, _)| *id == a.restore_id)
            .is_some()
            && self.in_pieces
        {
            out.push_back(AppEvent::RestoreAborted {
                restore_id: a.restore_id,
                reason: a.reason,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(id: &str, chunk: &'static str, last: bool) -> pb::Restore {
        pb::Restore {
            restore_id: id.into(),
            snapshot_id: 7,
            epoch: 1,
            chunk: Bytes::from_static(chunk.as_bytes()),
            last,
        }
    }

    fn aborted(id: &str) -> pb::RestoreAborted {
        pb::RestoreAborted {
            restore_id: id.into(),
            reason: "broke".into(),
        }
    }

    #[test]
    fn pieces_are_gathered_into_one_restore_and_a_broken_one_is_dropped() {
        let mut staging = RestoreStaging::default();
        let mut out = VecDeque::new();
        staging.piece(piece("r1", "ab", false), &mut out);
        staging.piece(piece("r1", "cd", false), &mut out);
        assert!(out.is_empty());
        staging.piece(piece("r1", "e", true), &mut out);
        assert_eq!(
            out.pop_front(),
            Some(AppEvent::Restore {
                restore_id: "r1".into(),
                snapshot_id: 7,
                state: Bytes::from("abcde"),
            })
        );
        // r2 breaks off; r3 superseded by r4 mid-way: neither is handed over, and r4 holds
        // none of their bytes.
        staging.piece(piece("r2", "xx", false), &mut out);
        staging.aborted(aborted("r2"), &mut out);
        staging.piece(piece("r3", "yy", false), &mut out);
        staging.piece(piece("r4", "z", true), &mut out);
        assert_eq!(
            Vec::from(out),
            [AppEvent::Restore {
                restore_id: "r4".into(),
                snapshot_id: 7,
                state: Bytes::from("z"),
            }]
        );
    }

    #[test]
    fn in_pieces_each_piece_is_handed_over_and_a_broken_restore_is_told() {
        let mut staging = RestoreStaging {
            in_pieces: true,
            ..Default::default()
        };
        let mut out = VecDeque::new();
        let handed = |id: &str, p: &'static str, last| AppEvent::RestorePiece {
            restore_id: id.into(),
            snapshot_id: 7,
            piece: Bytes::from_static(p.as_bytes()),
            last,
        };
        staging.piece(piece("r1", "ab", false), &mut out);
        staging.piece(piece("r1", "c", true), &mut out);
        staging.aborted(aborted("r1"), &mut out); // done already: nothing to abort
        staging.piece(piece("r2", "x", false), &mut out);
        staging.aborted(aborted("r2"), &mut out);
        staging.piece(piece("r3", "y", false), &mut out);
        staging.piece(piece("r4", "", true), &mut out);
        let abort = |id: &str, reason: &str| AppEvent::RestoreAborted {
            restore_id: id.into(),
            reason: reason.into(),
        };
        assert_eq!(
            Vec::from(out),
            [
                handed("r1", "ab", false),
                handed("r1", "c", true),
                handed("r2", "x", false),
                abort("r2", "broke"),
                handed("r3", "y", false),
                abort("r3", "superseded by restore r4"),
                handed("r4", "", true),
            ]
        );
    }
}
