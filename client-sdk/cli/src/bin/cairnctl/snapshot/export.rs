//! `cairnctl snapshot export`: a snapshot's data streamed into files, node by node, each
//! written aside and moved into place at its end.

use super::*;

/// One node's files being written: aside, under `DIR/.NODE.partial`, until its `End`.
struct NodeFiles {
    partial: std::path::PathBuf,
    state: std::fs::File,
    channels: std::fs::File,
    state_bytes: u64,
    messages: u64,
}

/// Streams snapshot `id`'s data into `dir` (see `SnapshotCommand::Export`); returns each
/// node's totals. On an error, the node being written leaves nothing behind.
pub(super) async fn export(
    client: &mut CoordinatorClient,
    id: u64,
    dir: &std::path::Path,
    node: Option<&str>,
) -> anyhow::Result<Vec<(String, pb::NodeDataEnd)>> {
    use anyhow::Context;
    use prost::Message;
    use std::io::Write;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // The nodes whose data must arrive, each with its `End` and the totals it says.
    let mut expected: std::collections::BTreeSet<String> = client
        .get_snapshot(id, false)
        .await?
        .nodes
        .into_iter()
        .map(|n| n.node_id)
        .filter(|n| node.is_none_or(|only| only == n))
        .collect();
    let mut data = client.read_snapshot_data(id, node).await?;
    let mut done = Vec::new();
    let mut current: Option<(String, NodeFiles)> = None;
    let result = async {
        while let Some(piece) = data.message().await? {
            let name = piece.node_id.clone();
            // A node id names a directory: nothing that could leave `dir`.
            anyhow::ensure!(
                !name.is_empty()
                    && name != "."
                    && name != ".."
                    && !name.contains(['/', '\\', '\0'])
                    && !name.starts_with('.'),
                "the coordinator sent data of a node named {name:?}, which is not a file name"
            );
            if current.as_ref().is_none_or(|(n, _)| *n != name) {
                anyhow::ensure!(
                    current.is_none(),
                    "node {name}'s data began before the previous node's ended"
                );
                let target = dir.join(&name);
                anyhow::ensure!(
                    !target.exists(),
                    "{} exists: export into an empty directory, or remove it",
                    target.display()
                );
                let partial = dir.join(format!(".{name}.partial"));
                let _ = std::fs::remove_dir_all(&partial);
                std::fs::create_dir_all(&partial)
                    .with_context(|| format!("cannot create {}", partial.display()))?;
                let files = NodeFiles {
                    state: std::fs::File::create(partial.join("state"))?,
                    channels: std::fs::File::create(partial.join("channels.pb"))?,
                    partial,
                    state_bytes: 0,
                    messages: 0,
                };
                current = Some((name.clone(), files));
            }
            let (_, files) = current.as_mut().expect("set above");
            match piece.kind {
                Some(pb::snapshot_data::Kind::LocalState(bytes)) => {
                    files.state.write_all(&bytes)?;
                    files.state_bytes += bytes.len() as u64;
                }
                Some(pb::snapshot_data::Kind::ChannelState(state)) => {
                    files
                        .channels
                        .write_all(&state.encode_length_delimited_to_vec())?;
                    files.messages += state.messages.len() as u64;
                }
                Some(pb::snapshot_data::Kind::End(end)) => {
                    let (name, files) = current.take().expect("set above");
                    anyhow::ensure!(
                        (files.state_bytes, files.messages)
                            == (end.local_state_bytes, end.recorded_messages),
                        "node {name}: received {} bytes of state and {} messages, the coordinator \
                         says {} and {}",
                        files.state_bytes,
                        files.messages,
                        end.local_state_bytes,
                        end.recorded_messages
                    );
                    anyhow::ensure!(
                        expected.remove(&name),
                        "node {name}'s data came twice or unasked"
                    );
                    files.state.sync_all()?;
                    files.channels.sync_all()?;
                    std::fs::rename(&files.partial, dir.join(&name)).with_context(|| {
                        format!("cannot move {} into place", files.partial.display())
                    })?;
                    done.push((name, end));
                }
                None => {}
            }
        }
        anyhow::ensure!(
            current.is_none(),
            "the stream ended before a node's data did"
        );
        anyhow::ensure!(
            expected.is_empty(),
            "the stream ended without the data of {}",
            expected.iter().cloned().collect::<Vec<_>>().join(", ")
        );
        Ok(())
    }
    .await;
    if let Some((_, files)) = current {
        let _ = std::fs::remove_dir_all(&files.partial);
    }
    result.map(|()| done)
}
