//! `cairnctl snapshot restore` and `cairnctl restore`: rolling the cluster back to a
//! snapshot, and the restore operations.

use std::process::ExitCode;
use std::time::Duration;

use cairn_proto::v1 as pb;
use cairn_sdk::CoordinatorClient;
use clap::Subcommand;

use crate::output::{Output, print_json, table};

#[derive(Debug, Subcommand)]
pub(crate) enum RestoreCommand {
    /// Show one restore operation.
    Get {
        /// Its id (restore-N).
        id: String,
    },
    /// List restore operations, newest first.
    List {
        /// At most this many.
        #[arg(long, env = "CAIRN_LIMIT", default_value_t = 20)]
        limit: u32,
    },
}

fn status(r: &pb::RestoreOperation) -> &'static str {
    if r.done {
        "DONE"
    } else if r.failure.is_some() {
        "FAILED"
    } else {
        "IN_PROGRESS"
    }
}

fn row(r: &pb::RestoreOperation) -> Vec<String> {
    vec![
        r.restore_id.clone(),
        r.snapshot_id.to_string(),
        r.epoch.to_string(),
        status(r).to_owned(),
        format!("{}/{}", r.applied.len(), r.nodes.len()),
        r.requested_by.clone(),
        r.failure
            .as_ref()
            .map(|f| f.message.clone())
            .unwrap_or_default(),
    ]
}

const HEADER: [&str; 7] = [
    "RESTORE", "SNAPSHOT", "EPOCH", "STATUS", "APPLIED", "BY", "FAILURE",
];

fn print(r: &pb::RestoreOperation, output: Output) -> anyhow::Result<()> {
    match output {
        Output::Json => print_json(r)?,
        Output::Table => table(&HEADER, [row(r)]),
    }
    Ok(())
}

/// `cairnctl snapshot restore ID`: starts the restore and, unless told not to, follows it
/// until every node applied its state (exit 0) or it failed (exit 1).
pub(crate) async fn restore_snapshot(
    client: &mut CoordinatorClient,
    output: Output,
    request: pb::RestoreSnapshotRequest,
    wait: bool,
    timeout: Duration,
) -> anyhow::Result<ExitCode> {
    let id = request.snapshot_id;
    let mut op = client.raw().restore_snapshot(request).await?.into_inner();
    if !wait {
        print(&op, output)?;
        return Ok(ExitCode::SUCCESS);
    }
    if output == Output::Table {
        eprintln!(
            "{} started: snapshot {id}, epoch {}; waiting for {} node(s) to apply their state",
            op.restore_id,
            op.epoch,
            op.nodes.len()
        );
    }
    let deadline = tokio::time::Instant::now() + timeout;
    while status(&op) == "IN_PROGRESS" {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{} still in progress after {timeout:?} (applied: {})",
            op.restore_id,
            op.applied.join(", ")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        op = client
            .raw()
            .get_restore(pb::GetRestoreRequest {
                restore_id: op.restore_id.clone(),
            })
            .await?
            .into_inner();
    }
    print(&op, output)?;
    Ok(if op.done {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

pub(crate) async fn restore(
    coordinator: &str,
    output: Output,
    command: RestoreCommand,
) -> anyhow::Result<ExitCode> {
    let mut client = crate::connect(coordinator).await?;
    match command {
        RestoreCommand::Get { id } => {
            let op = client
                .raw()
                .get_restore(pb::GetRestoreRequest { restore_id: id })
                .await?
                .into_inner();
            print(&op, output)?;
        }
        RestoreCommand::List { limit } => {
            let list = client
                .raw()
                .list_restores(pb::ListRestoresRequest { limit })
                .await?
                .into_inner();
            match output {
                Output::Json => print_json(&list)?,
                Output::Table => table(&HEADER, list.restores.iter().map(row)),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
