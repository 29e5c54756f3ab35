//! A client of the coordinator's `cairn.v1.Coordinator` service.

use std::time::Duration;

use cairn_rpc::v1 as pb;
use tonic::Code;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

pub use cairn_rpc::leader::{
    LEADER_METADATA, LEADER_SERVICE, MAX_ADDRESS_LEN, check_address, leader_in,
};

use crate::error::{Error, leader_of, with_causes};

/// How many times [`CoordinatorClient::start_snapshot`] asks, with one request id, while
/// the answer is lost to a leader change.
pub const START_ATTEMPTS: u32 = 4;

/// A fresh request id for `StartSnapshot`: 128 random bits as a UUID (version 4).
pub fn new_request_id() -> String {
    let mut bytes: [u8; 16] = rand::random();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// A connection to the coordinator — to the leading replica of a highly available one
/// ([`connect_with`](Self::connect_with)): the typed entry point of scripts and
/// `cairnctl`.
#[derive(Clone)]
pub struct CoordinatorClient {
    inner: pb::coordinator_client::CoordinatorClient<TokenChannel>,
    /// The replica called.
    address: String,
    /// Every replica given, in order.
    addresses: Vec<String>,
    bearer: BearerToken,
    tls: Option<crate::tls::Tls>,
}

/// A channel that adds `authorization: Bearer <token>` to every call, when it has a token.
pub type TokenChannel = InterceptedService<Channel, BearerToken>;

/// Adds `authorization: Bearer <token>` to every request (nothing without a token). The
/// value is marked sensitive: its `Debug` (and so any log of the request's metadata)
/// shows `Sensitive`, never the token.
#[derive(Clone, Debug, Default)]
pub struct BearerToken(Option<AsciiMetadataValue>);

impl BearerToken {
    /// The header of `token`; an error if it cannot be a header value.
    pub fn new(token: Option<&str>) -> Result<Self, Error> {
        match token {
            None => Ok(Self(None)),
            Some(token) => MetadataValue::try_from(format!("Bearer {}", token.trim()))
                .map(|mut v: AsciiMetadataValue| {
                    v.set_sensitive(true);
                    Self(Some(v))
                })
                .map_err(|_| Error::Connect {
                    address: String::new(),
                    reason: "the token holds characters a header cannot carry".into(),
                }),
        }
    }
}

impl Interceptor for BearerToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

impl CoordinatorClient {
    /// Connects to the coordinator at `address`: one `HOST:PORT`, or the replicas of a
    /// highly available coordinator as a comma-separated list (see
    /// [`connect_with`](Self::connect_with) for how the leader is found).
    pub async fn connect(address: &str) -> Result<Self, Error> {
        Self::connect_with_token(address, None).await
    }

    /// As [`connect`](Self::connect), sending `token` as a bearer token on every call
    /// (`--auth-tokens` on the coordinator; `None`: no token).
    pub async fn connect_with_token(address: &str, token: Option<&str>) -> Result<Self, Error> {
        Self::connect_with(address, token, None).await
    }

    /// Connects to the leading coordinator among `address` — one `HOST:PORT` or a
    /// comma-separated list of at most [`MAX_ADDRESSES`] — sending `token` as a bearer
    /// token on every call, over TLS with `tls`: a replica's certificate is checked against
    /// the CA for the host it is dialed at, and this client's identity, if any, is
    /// presented as the client certificate (a coordinator with `--tls-*` flags requires
    /// one).
    ///
    /// Each address is asked in turn, through the gRPC health service, whether it leads
    /// ([`LEADER_SERVICE`]); the first that does is used. A follower that names the leader
    /// ([`LEADER_METADATA`]) has that address asked next, even if the list lacks it. A
    /// coordinator that does not know the service (one of before high availability, or on
    /// the embedded store) counts as the leader. While none leads (an election) the list is
    /// asked again for up to [`ELECTION_WAIT`]; then the first replica that answered is
    /// used: reads work there, writes fail with UNAVAILABLE. Nothing reachable: an
    /// [`Error::Connect`] naming each address and why.
    pub async fn connect_with(
        address: &str,
        token: Option<&str>,
        tls: Option<&crate::tls::Tls>,
    ) -> Result<Self, Error> {
        let addresses = parse_addresses(address)?;
        let bearer = BearerToken::new(token).map_err(|e| match e {
            Error::Connect { reason, .. } => Error::Connect {
                address: address.to_owned(),
                reason,
            },
            other => other,
        })?;
        let (address, channel) = find_leader(&addresses, tls, ELECTION_WAIT).await?;
        Ok(Self {
            inner: raw_client(channel, bearer.clone()),
            address,
            addresses,
            bearer,
            tls: tls.cloned(),
        })
    }

    /// The address of the replica this client calls (the leader when it was found).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Finds the leader again (as [`connect_with`](Self::connect_with) does, over the same
    /// addresses) and calls it from now on; for after a call failed with UNAVAILABLE
    /// because leadership moved ([`Error::leader`]). Clones made before keep their
    /// connection. On failure the client keeps the one it had.
    pub async fn reconnect_to_leader(&mut self) -> Result<(), Error> {
        self.reconnect(None).await
    }

    /// [`reconnect_to_leader`](Self::reconnect_to_leader), asking `hint` (the leader a
    /// follower named) first.
    async fn reconnect(&mut self, hint: Option<&str>) -> Result<(), Error> {
        let mut candidates: Vec<String> = hint.map(str::to_owned).into_iter().collect();
        candidates.extend(
            self.addresses
                .iter()
                .filter(|a| Some(a.as_str()) != hint)
                .cloned(),
        );
        let (address, channel) = find_leader(&candidates, self.tls.as_ref(), ELECTION_WAIT).await?;
        tracing::debug!("coordinator: now calling {address}");
        self.inner = raw_client(channel, self.bearer.clone());
        self.address = address;
        Ok(())
    }

    /// Starts a snapshot; returns its id.
    ///
    /// The request carries a request id (a fresh random one when `request.request_id` is
    /// empty), which makes it idempotent: when the answer is lost — UNAVAILABLE (the
    /// replica's term ended, or no leader was known) or ABORTED (the leader's term ended
    /// while it handled the call: the snapshot may have started) — the client finds the
    /// leader again ([`reconnect_to_leader`](Self::reconnect_to_leader)) and asks again
    /// with the same request id, up to [`START_ATTEMPTS`] times; a start that did happen
    /// answers its snapshot's id, so a retry never starts a second snapshot.
    pub async fn start_snapshot(
        &mut self,
        mut request: pb::StartSnapshotRequest,
    ) -> Result<u64, Error> {
        if request.request_id.is_empty() {
            request.request_id = new_request_id();
        }
        let mut attempt = 1;
        loop {
            let status = match self.inner.start_snapshot(request.clone()).await {
                Ok(response) => return Ok(response.into_inner().snapshot_id),
                Err(status) => status,
            };
            let lost = matches!(status.code(), Code::Unavailable | Code::Aborted);
            if !lost || attempt >= START_ATTEMPTS {
                return Err(Error::Rpc(status));
            }
            attempt += 1;
            let leader = leader_of(&status);
            tracing::debug!(
                request_id = request.request_id,
                "{}: {status}; asking the leader again (attempt {attempt} of {START_ATTEMPTS})",
                self.address
            );
            self.reconnect(leader.as_deref()).await?;
        }
    }

    /// A snapshot's metadata, optionally with its data. The data of a completed snapshot is
    /// read with [`Self::read_snapshot_data`], in pieces (states larger than a gRPC message
    /// can be read), and gathered here in memory.
    pub async fn get_snapshot(
        &mut self,
        snapshot_id: u64,
        include_data: bool,
    ) -> Result<pb::Snapshot, Error> {
        let request = pb::GetSnapshotRequest {
            snapshot_id,
            include_data: false,
        };
        let mut snapshot = self.inner.get_snapshot(request).await?.into_inner();
        if !include_data {
            return Ok(snapshot);
        }
        if snapshot.status != pb::SnapshotStatus::Completed as i32 {
            // A snapshot that did not complete: whatever parts it stored, in one message.
            let request = pb::GetSnapshotRequest {
                snapshot_id,
                include_data: true,
            };
            return Ok(self.inner.get_snapshot(request).await?.into_inner());
        }
        let mut data = self.read_snapshot_data(snapshot_id, None).await?;
        let mut states: std::collections::BTreeMap<String, bytes::BytesMut> = Default::default();
        let mut ended = std::collections::BTreeSet::new();
        while let Some(piece) = data.message().await? {
            let Some(node) = snapshot
                .nodes
                .iter_mut()
                .find(|n| n.node_id == piece.node_id)
            else {
                continue;
            };
            match piece.kind {
                Some(pb::snapshot_data::Kind::LocalState(bytes)) => states
                    .entry(piece.node_id)
                    .or_default()
                    .extend_from_slice(&bytes),
                Some(pb::snapshot_data::Kind::ChannelState(state)) => {
                    match node
                        .channel_states
                        .last_mut()
                        .filter(|last| last.channel == state.channel)
                    {
                        Some(last) => last.messages.extend(state.messages),
                        None => node.channel_states.push(state),
                    }
                }
                Some(pb::snapshot_data::Kind::End(_)) => {
                    ended.insert(piece.node_id);
                }
                None => {}
            }
        }
        for node in &mut snapshot.nodes {
            // A stream that ended without a node's `End` was cut short: not the data.
            if !ended.contains(&node.node_id) {
                return Err(Error::Rpc(tonic::Status::data_loss(format!(
                    "the data of node {} ended before its end marker",
                    node.node_id
                ))));
            }
            node.local_state = states.remove(&node.node_id).unwrap_or_default().freeze();
        }
        Ok(snapshot)
    }

    /// A completed snapshot's data as a stream of pieces: per node (only `node`, if given)
    /// its local state chunk by chunk, then its recorded messages channel by channel, then
    /// an `End` with the totals. Every chunk is checked against its SHA-256 by the
    /// coordinator as it is read; a bad one ends the stream with DATA_LOSS naming it.
    pub async fn read_snapshot_data(
        &mut self,
        snapshot_id: u64,
        node: Option<&str>,
    ) -> Result<tonic::Streaming<pb::SnapshotData>, Error> {
        let request = pb::ReadSnapshotDataRequest {
            snapshot_id,
            node_id: node.unwrap_or_default().to_owned(),
        };
        Ok(self.inner.read_snapshot_data(request).await?.into_inner())
    }

    /// The coordinator replicas, which one leads and its term (any replica answers).
    pub async fn get_leadership(&mut self) -> Result<pb::Leadership, Error> {
        Ok(self
            .inner
            .get_leadership(pb::GetLeadershipRequest {})
            .await?
            .into_inner())
    }

    /// The generated client, for every other call.
    pub fn raw(&mut self) -> &mut pb::coordinator_client::CoordinatorClient<TokenChannel> {
        &mut self.inner
    }
}

/// The generated client over `channel`. Answers may be large: a snapshot with its data, a
/// piece of recorded messages (up to ~1 MiB plus one message of at most 16 MiB).
fn raw_client(
    channel: Channel,
    bearer: BearerToken,
) -> pb::coordinator_client::CoordinatorClient<TokenChannel> {
    pb::coordinator_client::CoordinatorClient::with_interceptor(channel, bearer)
        .max_decoding_message_size(64 << 20)
}

/// The most addresses a coordinator list may hold.
pub const MAX_ADDRESSES: usize = 16;

/// How long connecting waits for a replica to lead while every reachable one follows (an
/// election), before it settles for a follower.
pub const ELECTION_WAIT: Duration = Duration::from_secs(10);

/// How long one replica has to accept a connection and answer the health check.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The addresses of `list` (`HOST:PORT`, comma-separated; spaces around entries are
/// ignored), in order, each checked by [`check_address`]. An empty entry, more than
/// [`MAX_ADDRESSES`] or a malformed address is an [`Error::Connect`] saying which.
pub fn parse_addresses(list: &str) -> Result<Vec<String>, Error> {
    let error = |reason: String| Error::Connect {
        address: list.to_owned(),
        reason,
    };
    let addresses: Vec<String> = list.split(',').map(|a| a.trim().to_owned()).collect();
    if addresses.len() > MAX_ADDRESSES {
        return Err(error(format!(
            "{} addresses; at most {MAX_ADDRESSES} coordinator replicas may be listed",
            addresses.len()
        )));
    }
    for (i, address) in addresses.iter().enumerate() {
        if address.is_empty() {
            return Err(error(if addresses.len() == 1 {
                "no address (HOST:PORT, or a comma-separated list of them)".into()
            } else {
                format!("entry {} of the list is empty", i + 1)
            }));
        }
        check_address(address).map_err(|why| error(format!("`{address}` {why}")))?;
    }
    Ok(addresses)
}

/// What one replica said when asked whether it leads.
enum Probe {
    /// It leads, or does not know [`LEADER_SERVICE`] (it predates leadership).
    Leader(Channel),
    /// It answers but follows; the leader it named, if any.
    Follower(Channel, Option<String>),
    /// Nothing usable answered: why.
    Unreachable(String),
}

/// Connects to `address` and asks it whether it leads, within [`PROBE_TIMEOUT`]. With TLS
/// the certificate must name `DNS:coordinator`, as the daemons check it, whatever address
/// is dialed: a node's certificate also names `IP:127.0.0.1` and `localhost`, so checking
/// the dialed host would take a node for the coordinator on loopback; and a replica
/// advertises an address (a pod IP) its certificate need not name.
async fn probe(address: &str, tls: Option<&crate::tls::Tls>) -> Probe {
    let ask = async {
        let endpoint = crate::tls::endpoint_for(address, COORDINATOR_NAME, tls);
        let channel = endpoint
            .map_err(|e| with_causes(&e))?
            .connect()
            .await
            .map_err(|e| with_causes(&e))?;
        let request = HealthCheckRequest {
            service: LEADER_SERVICE.to_owned(),
        };
        Ok::<_, String>(
            match HealthClient::new(channel.clone()).check(request).await {
                Ok(answer) if answer.get_ref().status() == ServingStatus::Serving => {
                    Probe::Leader(channel)
                }
                Ok(answer) => Probe::Follower(channel, leader_in(answer.metadata())),
                Err(status) if status.code() == Code::NotFound => Probe::Leader(channel),
                // No health service at all: a coordinator older still.
                Err(status) if status.code() == Code::Unimplemented => Probe::Leader(channel),
                Err(status) => Probe::Unreachable(match std::error::Error::source(&status) {
                    Some(cause) => format!("the health check failed: {}", with_causes(cause)),
                    None => format!(
                        "the health check failed: {:?}: {}",
                        status.code(),
                        status.message()
                    ),
                }),
            },
        )
    };
    match tokio::time::timeout(PROBE_TIMEOUT, ask).await {
        Ok(Ok(probe)) => probe,
        Ok(Err(reason)) => Probe::Unreachable(reason),
        Err(_) => Probe::Unreachable(format!("no answer within {PROBE_TIMEOUT:?}")),
    }
}

/// The leader among `candidates` (tried in order), or, once no replica has led for `wait`,
/// the first that answered. See [`CoordinatorClient::connect_with`].
async fn find_leader(
    candidates: &[String],
    tls: Option<&crate::tls::Tls>,
    wait: Duration,
) -> Result<(String, Channel), Error> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut pause = Duration::from_millis(100);
    loop {
        let (follower, unreachable) = match ask_each(candidates, tls).await {
            Ok(leader) => return Ok(leader),
            Err(round) => round,
        };
        let Some((address, channel)) = follower else {
            // Nothing answered: no election to wait for.
            let reason = match unreachable.as_slice() {
                [(_, why)] if candidates.len() == 1 => why.clone(),
                _ => unreachable
                    .iter()
                    .map(|(address, why)| format!("{address}: {why}"))
                    .collect::<Vec<_>>()
                    .join("; "),
            };
            return Err(Error::Connect {
                address: candidates.join(","),
                reason,
            });
        };
        if tokio::time::Instant::now() + pause >= deadline {
            tracing::warn!(
                "no coordinator replica leads after {wait:?} (an election?); using {address}, \
                 which follows: reads work, writes fail with UNAVAILABLE"
            );
            return Ok((address, channel));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// The name every coordinator replica's certificate carries (`DNS:coordinator`).
const COORDINATOR_NAME: &str = "coordinator";

/// A replica that answered but does not lead, and the replicas that did not answer.
type NoLeader = (Option<(String, Channel)>, Vec<(String, String)>);

/// One pass over `candidates`: the leader, or else the first replica that answered and why
/// each other did not. A leader a follower names is asked at once (each named one once).
async fn ask_each(
    candidates: &[String],
    tls: Option<&crate::tls::Tls>,
) -> Result<(String, Channel), NoLeader> {
    let mut follower = None;
    let mut unreachable = Vec::new();
    // The addresses asked in this pass, so that a named leader is asked once.
    let mut asked: Vec<String> = Vec::new();
    for address in candidates {
        asked.push(address.clone());
        match probe(address, tls).await {
            Probe::Leader(channel) => return Ok((address.clone(), channel)),
            Probe::Follower(channel, hint) => {
                if let Some(hint) = hint
                    && !asked.contains(&hint)
                {
                    asked.push(hint.clone());
                    if let Probe::Leader(channel) = probe(&hint, tls).await {
                        return Ok((hint, channel));
                    }
                    tracing::debug!("{address} names {hint} the leader, which does not lead");
                }
                follower.get_or_insert((address.clone(), channel));
            }
            Probe::Unreachable(why) => unreachable.push((address.clone(), why)),
        }
    }
    Err((follower, unreachable))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::metadata::MetadataMap;

    #[test]
    fn the_token_never_shows_in_debug() {
        let mut bearer = BearerToken::new(Some(" s3cr3t-token\n")).unwrap();
        assert!(!format!("{bearer:?}").contains("s3cr3t"), "{bearer:?}");
        let request = bearer.call(tonic::Request::new(())).unwrap();
        let value = request.metadata().get("authorization").unwrap();
        assert!(value.is_sensitive());
        assert_eq!(value.to_str().unwrap(), "Bearer s3cr3t-token");
        assert!(!format!("{request:?}").contains("s3cr3t"), "{request:?}");
        assert!(!format!("{:?}", request.metadata().clone().into_headers()).contains("s3cr3t"));
        assert!(BearerToken::new(Some("bad\ntoken")).is_err());
    }

    #[test]
    fn address_lists() {
        assert_eq!(
            parse_addresses("127.0.0.1:7000").unwrap(),
            ["127.0.0.1:7000"]
        );
        assert_eq!(
            parse_addresses("a:1, b.example:7000 ,[::1]:7000").unwrap(),
            ["a:1", "b.example:7000", "[::1]:7000"]
        );
        let reason = |list: &str| match parse_addresses(list).unwrap_err() {
            Error::Connect { address, reason } => {
                assert_eq!(address, list);
                reason
            }
            other => panic!("{other:?}"),
        };
        assert!(reason("").contains("no address"), "{}", reason(""));
        assert!(reason("a:1,,b:2").contains("entry 2 of the list is empty"));
        assert!(reason("a:1,").contains("entry 2 of the list is empty"));
        assert!(reason("a:1,b").contains("`b` has no port (HOST:PORT)"));
        let many = vec!["h:1"; MAX_ADDRESSES + 1].join(",");
        assert!(reason(&many).contains("at most 16"), "{}", reason(&many));
        assert_eq!(
            parse_addresses(&vec!["h:1"; MAX_ADDRESSES].join(","))
                .unwrap()
                .len(),
            MAX_ADDRESSES
        );
        let e = parse_addresses("a:1,b").unwrap_err().to_string();
        assert_eq!(e, "cannot connect to a:1,b: `b` has no port (HOST:PORT)");
    }

    #[test]
    fn addresses_and_hints_are_checked() {
        for good in [
            "127.0.0.1:7000",
            "coordinator-0.cairn.svc.cluster.local:7000",
            "my_host:1",
            "[::1]:65535",
            "[fe80::1]:7000",
        ] {
            assert_eq!(check_address(good), Ok(()), "{good}");
        }
        let long = format!("{}:7000", "a".repeat(MAX_ADDRESS_LEN));
        for (bad, why) in [
            ("host", "has no port"),
            ("host:", "has no port"),
            ("host:http", "has no port"),
            ("host:0", "outside 1-65535"),
            ("host:65536", "outside 1-65535"),
            (":7000", "no valid host"),
            ("::1", "without brackets"),
            ("fe80::1:7000", "without brackets"),
            ("[::1:7000", "no valid host"),
            ("[]:7000", "no valid host"),
            ("a b:7000", "printable"),
            ("h\u{e9}:7000", "printable"),
            ("evil.example/x:7000", "no valid host"),
            ("user@host:7000", "no valid host"),
            ("http://host:7000", "is a URL"),
            ("x:y:7000", "no valid host"),
            (long.as_str(), "longer than 255"),
        ] {
            let e = check_address(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }

        let mut metadata = MetadataMap::new();
        assert_eq!(leader_in(&metadata), None);
        metadata.insert(LEADER_METADATA, "10.0.0.2:7000".parse().unwrap());
        assert_eq!(leader_in(&metadata).as_deref(), Some("10.0.0.2:7000"));
        for bad in ["", "10.0.0.2", "a b:7000", "x/y:1", &long] {
            metadata.insert(LEADER_METADATA, bad.parse().unwrap());
            assert_eq!(leader_in(&metadata), None, "{bad}");
        }
    }

    #[test]
    fn an_unavailable_follower_names_the_leader() {
        let mut status = tonic::Status::unavailable("this replica follows");
        status
            .metadata_mut()
            .insert(LEADER_METADATA, "10.0.0.2:7000".parse().unwrap());
        let error = Error::from(status.clone());
        assert_eq!(error.leader().as_deref(), Some("10.0.0.2:7000"));
        assert!(
            error
                .to_string()
                .ends_with("this replica follows; the leader is 10.0.0.2:7000 (Unavailable)"),
            "{error}"
        );
        // Another code, or a bad hint: no leader.
        let mut other = tonic::Status::failed_precondition("no");
        *other.metadata_mut() = status.metadata().clone();
        assert_eq!(Error::from(other).leader(), None);
        status
            .metadata_mut()
            .insert(LEADER_METADATA, "nonsense".parse().unwrap());
        let error = Error::from(status);
        assert_eq!(error.leader(), None);
        assert!(!error.to_string().contains("leader is"), "{error}");
        // A message that names the leader already is not repeated.
        let mut status = tonic::Status::unavailable(
            "this coordinator (c2:7000) is a follower: the leader is c1:7000 (term 41); writes \
             and node sessions go there",
        );
        status
            .metadata_mut()
            .insert(LEADER_METADATA, "c1:7000".parse().unwrap());
        let error = Error::from(status);
        assert_eq!(error.leader().as_deref(), Some("c1:7000"));
        assert_eq!(error.to_string().matches("c1:7000").count(), 1, "{error}");
    }

    /// A coordinator replica as its health service shows it.
    mod fake {
        use std::sync::{Arc, Mutex};

        use tonic_health::pb::health_server::{Health, HealthServer};
        use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

        use super::super::*;

        /// What `Check("cairn.v1.Leader")` answers, and the leader it names.
        #[derive(Clone, Default)]
        pub(super) struct Replica(Arc<Mutex<(Option<ServingStatus>, Option<String>)>>);

        impl Replica {
            /// `None`: NOT_FOUND (a coordinator without leadership).
            pub(super) fn set(&self, status: Option<ServingStatus>, leader: Option<&str>) {
                *self.0.lock().unwrap() = (status, leader.map(str::to_owned));
            }
        }

        #[tonic::async_trait]
        impl Health for Replica {
            async fn check(
                &self,
                request: tonic::Request<HealthCheckRequest>,
            ) -> Result<tonic::Response<HealthCheckResponse>, tonic::Status> {
                assert_eq!(request.get_ref().service, LEADER_SERVICE);
                let (status, leader) = self.0.lock().unwrap().clone();
                let mut response = match status {
                    Some(status) => tonic::Response::new(HealthCheckResponse {
                        status: status as i32,
                    }),
                    None => return Err(tonic::Status::not_found("service not registered")),
                };
                if let Some(leader) = leader {
                    response
                        .metadata_mut()
                        .insert(LEADER_METADATA, leader.parse().unwrap());
                }
                Ok(response)
            }

            type WatchStream = tokio_stream::Empty<Result<HealthCheckResponse, tonic::Status>>;

            async fn watch(
                &self,
                _: tonic::Request<HealthCheckRequest>,
            ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
                Err(tonic::Status::unimplemented("watch"))
            }
        }

        /// Serves `replica` on a loopback port; its address.
        pub(super) async fn serve(replica: Replica) -> String {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let address = listener.local_addr().unwrap().to_string();
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(HealthServer::new(replica))
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
            );
            address
        }

        /// An address nothing listens on.
        pub(super) async fn dead() -> String {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            listener.local_addr().unwrap().to_string()
        }

        /// A replica answering `status`, naming `leader`; its address.
        pub(super) async fn replica(
            status: Option<ServingStatus>,
            leader: Option<&str>,
        ) -> (Replica, String) {
            let replica = Replica::default();
            replica.set(status, leader);
            let address = serve(replica.clone()).await;
            (replica, address)
        }
    }

    const SERVING: Option<ServingStatus> = Some(ServingStatus::Serving);
    const NOT_SERVING: Option<ServingStatus> = Some(ServingStatus::NotServing);

    #[tokio::test]
    async fn the_leader_is_found_in_the_list_or_through_a_hint() {
        let dead = fake::dead().await;
        let (_, follower) = fake::replica(NOT_SERVING, None).await;
        let (_, leader) = fake::replica(SERVING, None).await;
        let list = format!("{dead},{follower},{leader}");
        let client = CoordinatorClient::connect(&list).await.unwrap();
        assert_eq!(client.address(), leader);

        // A follower names the leader, which the list lacks.
        let (_, hinting) = fake::replica(NOT_SERVING, Some(&leader)).await;
        let client = CoordinatorClient::connect(&format!("{dead},{hinting}"))
            .await
            .unwrap();
        assert_eq!(client.address(), leader);

        // A coordinator that does not know cairn.v1.Leader leads (the real health service,
        // with nothing registered, answers NOT_FOUND).
        let (_, older) = fake::replica(None, None).await;
        let client = CoordinatorClient::connect(&older).await.unwrap();
        assert_eq!(client.address(), older);
        let (_, health) = tonic_health::server::health_reporter();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let real = listener.local_addr().unwrap().to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let client = CoordinatorClient::connect(&real).await.unwrap();
        assert_eq!(client.address(), real);
    }

    #[tokio::test]
    async fn without_a_leader_the_first_that_answers_is_used_after_the_wait() {
        let dead = fake::dead().await;
        let (_, first) = fake::replica(NOT_SERVING, None).await;
        // A stale hint: the named replica does not lead either.
        let (_, second) = fake::replica(NOT_SERVING, Some(&first)).await;
        let candidates = [dead, first.clone(), second];
        let started = std::time::Instant::now();
        let (address, _) = find_leader(&candidates, None, Duration::from_millis(500))
            .await
            .unwrap();
        assert_eq!(address, first);
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn nothing_reachable_fails_at_once_naming_each() {
        let (a, b) = (fake::dead().await, fake::dead().await);
        let started = std::time::Instant::now();
        let e = CoordinatorClient::connect(&format!("{a},{b}"))
            .await
            .err()
            .unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        let Error::Connect { address, reason } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(address, &format!("{a},{b}"));
        assert!(reason.starts_with(&format!("{a}: ")), "{reason}");
        assert!(reason.contains(&format!("; {b}: ")), "{reason}");
        // One address: the reason as before, without the address again.
        let e = CoordinatorClient::connect(&a).await.err().unwrap();
        assert!(
            e.to_string()
                .starts_with(&format!("cannot connect to {a}: "))
                && !e.to_string().contains(&format!("{a}: {a}")),
            "{e}"
        );
    }

    #[tokio::test]
    async fn reconnecting_follows_the_leadership() {
        let (a, a_address) = fake::replica(SERVING, None).await;
        let (b, b_address) = fake::replica(NOT_SERVING, Some(&a_address)).await;
        let mut client = CoordinatorClient::connect(&a_address).await.unwrap();
        assert_eq!(client.address(), a_address);
        // b takes over; a names it.
        b.set(SERVING, None);
        a.set(NOT_SERVING, Some(&b_address));
        client.reconnect_to_leader().await.unwrap();
        assert_eq!(client.address(), b_address);
        // A hint is asked first.
        a.set(SERVING, None);
        b.set(NOT_SERVING, Some(&a_address));
        client.reconnect(Some(&a_address)).await.unwrap();
        assert_eq!(client.address(), a_address);
    }
}
