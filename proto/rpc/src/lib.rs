//! cairn's gRPC edge: the tonic services and clients of the `.proto` files under
//! `proto/cairn/` (their messages are `cairn-proto`'s, re-exported here so one path names
//! both), what every cairn server bounds, server reflection, TLS from PEM files for servers
//! and clients, and — feature `server` — the runtime both daemons (and cairnctl's and the
//! bank's servers) share: flags, logging, bearer tokens and roles, certificate identities,
//! the TLS accept loop and the `/metrics` endpoint.
//!
//! An application links this crate through `cairn-sdk`, without `server`: no clap,
//! tracing-subscriber, humantime or prometheus-client in its tree.
//!
//! # Layout
//!
//! - [`v1`]: package `cairn.v1` — the services `Peer` (node to node channels), `App` (the
//!   application session), `NodeAdmin` and `Coordinator`, their clients, and (re-exported)
//!   every message.
//! - [`bank::v1`]: package `cairn.bank.v1` — the example application's `Bank` service.
//! - [`reflection`]: the reflection services (v1 and v1alpha) every cairn server adds, so
//!   `grpcurl` works with no proto files.
//! - [`limits`]: the message sizes, stalls and HTTP/2 settings every cairn server bounds.
//! - [`tls`]: TLS from PEM files (a CA, an identity) for servers and clients.
//! - [`leader`]: how a highly available coordinator names its leader, and what an
//!   address may be.
//! - `server` (feature `server`): the daemons' runtime — start-up (flags,
//!   logging, signals), `server::auth` (tokens, roles, the RPC-to-role table), `server::identity`,
//!   `server::tls` (the accept loop, reloads) and `server::metrics` (`/metrics`).

/// Package `cairn.v1`: its services and clients, and its messages (cairn-proto's).
#[allow(missing_docs, clippy::large_enum_variant)]
pub mod v1 {
    pub use cairn_proto::v1::*;
    tonic::include_proto!("cairn.v1");
}

/// Package `cairn.bank`.
pub mod bank {
    /// Package `cairn.bank.v1`: the `Bank` service and client, and its messages.
    #[allow(missing_docs)]
    pub mod v1 {
        pub use cairn_proto::bank::v1::*;
        tonic::include_proto!("cairn.bank.v1");
    }
}

/// What the programs say of their build (`--version`, `cairn_build_info`).
pub mod version {
    /// The release (the workspace's version).
    pub const RELEASE: &str = env!("CARGO_PKG_VERSION");
    /// The git revision built from (12 hex digits), or `unknown` (see the build script).
    pub const REVISION: &str = env!("CAIRN_GIT_REVISION");
    /// `--version`'s text after the program's name: `0.1.0 (git 0123456789ab)`.
    pub const VERSION: &str = concat!(
        env!("CARGO_PKG_VERSION"),
        " (git ",
        env!("CAIRN_GIT_REVISION"),
        ")"
    );
}

pub mod leader;
pub mod limits;
#[cfg(feature = "server")]
pub mod server;
pub mod tls;

/// Server reflection for every cairn server, in both `grpc.reflection.v1` and `v1alpha`
/// (grpcurl 1.8 asks v1alpha). Each server lists only what it serves: the services it is
/// given, `grpc.health.v1.Health` and reflection itself.
pub mod reflection {
    use tonic_reflection::server::{Builder, Error};

    /// The services of `cairn.v1` a coordinator serves.
    pub const COORDINATOR: &[&str] = &["cairn.v1.Coordinator"];
    /// The services of a daemon's peer port.
    pub const PEER_PORT: &[&str] = &["cairn.v1.Peer", "cairn.v1.NodeAdmin"];
    /// The services of a daemon's application port.
    pub const APP_PORT: &[&str] = &["cairn.v1.App"];
    /// The services of the example bank.
    pub const BANK: &[&str] = &["cairn.bank.v1.Bank"];

    fn builder(services: &[&str]) -> Builder<'static> {
        let mut builder = Builder::configure()
            .register_encoded_file_descriptor_set(cairn_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name("grpc.health.v1.Health")
            .with_service_name("grpc.reflection.v1.ServerReflection")
            .with_service_name("grpc.reflection.v1alpha.ServerReflection");
        for service in services {
            builder = builder.with_service_name(*service);
        }
        builder
    }

    /// The `grpc.reflection.v1` service of a server serving `services`.
    pub fn v1(
        services: &[&str],
    ) -> Result<
        tonic_reflection::server::v1::ServerReflectionServer<
            impl tonic_reflection::server::v1::ServerReflection,
        >,
        Error,
    > {
        builder(services).build_v1()
    }

    /// The `grpc.reflection.v1alpha` service of a server serving `services`.
    pub fn v1alpha(
        services: &[&str],
    ) -> Result<
        tonic_reflection::server::v1alpha::ServerReflectionServer<
            impl tonic_reflection::server::v1alpha::ServerReflection,
        >,
        Error,
    > {
        builder(services).build_v1alpha()
    }
}
