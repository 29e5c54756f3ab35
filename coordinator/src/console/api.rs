//! `/api/v1/…`: each route answers with the message its gRPC method returns, in the
//! protobuf JSON mapping (what `grpcurl` prints).

use super::*;

/// A message as the API's JSON.
fn json<T: serde::Serialize>(value: &T) -> Response {
    match serde_json::to_string(value) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => Failure {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("cannot encode the answer: {e}"),
        }
        .json(),
    }
}

/// The API's answer: the message as JSON, or the failure as JSON.
fn answer<T: serde::Serialize>(result: Result<T, Failure>) -> Response {
    match result {
        Ok(value) => json(&value),
        Err(failure) => failure.json(),
    }
}

pub(super) async fn api_snapshots(
    State(c): State<Arc<Console>>,
    caller: Caller,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Response {
    answer(async { c.list_snapshots(&caller, &query(q)?).await }.await)
}

pub(super) async fn api_snapshot(
    State(c): State<Arc<Console>>,
    caller: Caller,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<SnapshotQuery>, QueryRejection>,
) -> Response {
    answer(
        async {
            let id = path(id)?;
            if query(q)?.include_data {
                return Err(Failure::bad(
                    "include_data: the API returns no states or recorded messages (they may be \
                 large); stream them with ReadSnapshotData (cairnctl snapshot export)"
                        .into(),
                ));
            }
            c.get_snapshot(&caller, &id, false).await
        }
        .await,
    )
}

pub(super) async fn api_restores(
    State(c): State<Arc<Console>>,
    caller: Caller,
    q: Result<Query<RestoresQuery>, QueryRejection>,
) -> Response {
    answer(
        async {
            let limit = query(q)?.limit;
            c.list_restores(&caller, limit).await
        }
        .await,
    )
}

pub(super) async fn api_restore(
    State(c): State<Arc<Console>>,
    caller: Caller,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<NoQuery>, QueryRejection>,
) -> Response {
    answer(
        async {
            let id = path(id)?;
            query(q)?;
            c.allow(&caller, "/cairn.v1.Coordinator/GetRestore")?;
            let request = pb::GetRestoreRequest {
                restore_id: restore_id(&id)?,
            };
            Ok(c.service
                .get_restore(Request::new(request))
                .await?
                .into_inner())
        }
        .await,
    )
}

pub(super) async fn api_nodes(
    State(c): State<Arc<Console>>,
    caller: Caller,
    q: Result<Query<NoQuery>, QueryRejection>,
) -> Response {
    answer(
        async {
            query(q)?;
            c.list_nodes(&caller).await
        }
        .await,
    )
}

pub(super) async fn api_policy(
    State(c): State<Arc<Console>>,
    caller: Caller,
    q: Result<Query<NoQuery>, QueryRejection>,
) -> Response {
    answer(
        async {
            query(q)?;
            c.get_policy(&caller).await
        }
        .await,
    )
}

pub(super) async fn api_leadership(
    State(c): State<Arc<Console>>,
    caller: Caller,
    q: Result<Query<NoQuery>, QueryRejection>,
) -> Response {
    answer(
        async {
            query(q)?;
            c.get_leadership(&caller).await
        }
        .await,
    )
}
