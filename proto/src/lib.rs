//! The wire contract of cairn: the `.proto` files under `cairn/` and the code tonic and
//! prost generate from them.
//!
//! Every message and field is documented in the `.proto` files themselves; this crate
//! only includes what the build script generated. Payload fields are `bytes::Bytes`, so
//! messages travel from the wire to the application without being copied.
//!
//! # Layout
//!
//! - [`v1`]: package `cairn.v1` — `Peer` (node to node channels), `App` (the
//!   application session), `NodeAdmin`, `Coordinator`, and the shared types.
//! - [`bank::v1`]: package `cairn.bank.v1` — the example application's `Bank` service.
//! - [`FILE_DESCRIPTOR_SET`]: every file's descriptor, for server reflection.
//! - [`reflection`]: the reflection services (v1 and v1alpha) every cairn server adds, so
//!   `grpcurl` works with no proto files.
//! - [`limits`]: the message sizes, stalls and HTTP/2 settings every cairn server bounds.
//! - [`runs`]: payloads packed as runs (one blob plus lengths), large ones uncopied.
//! - [`convert`]: every conversion between these messages and `cairn-core`'s domain
//!   types, with the one [`ConvertError`](convert::ConvertError) a message that cannot
//!   become a domain value gives.

/// Package `cairn.v1`.
#[allow(missing_docs, clippy::large_enum_variant)]
pub mod v1 {
    tonic::include_proto!("cairn.v1");
    // serde in the protobuf JSON mapping (pbjson): field names in lowerCamelCase, enums
    // by name, 64-bit integers as strings, bytes in base64, defaults omitted.
    include!(concat!(env!("OUT_DIR"), "/cairn.v1.serde.rs"));
}

/// Package `cairn.bank`.
pub mod bank {
    /// Package `cairn.bank.v1`.
    #[allow(missing_docs)]
    pub mod v1 {
        tonic::include_proto!("cairn.bank.v1");
    }
}

/// The encoded `FileDescriptorSet` of every cairn `.proto` file, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/cairn_descriptor.bin"));

pub mod convert;
pub mod fuzzing;
pub mod limits;
pub mod runs;

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
            .register_encoded_file_descriptor_set(super::FILE_DESCRIPTOR_SET)
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
