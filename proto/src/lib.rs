//! The wire contract of cairn: the `.proto` files under `cairn/`, the prost messages
//! generated from them, and every conversion and decoder of bytes from outside. No tonic:
//! the services, clients and the server runtime are `cairn-rpc` (`proto/rpc/`), and the
//! fuzzers (`fuzz/`) depend on this crate alone.
//!
//! Every message and field is documented in the `.proto` files themselves. Payload fields
//! are `bytes::Bytes`, so messages travel from the wire to the application without being
//! copied.
//!
//! # Layout
//!
//! - [`v1`]: the messages of package `cairn.v1` — of `Peer` (node to node channels),
//!   `App` (the application session), `NodeAdmin`, `Coordinator`, and the shared types.
//! - [`bank::v1`]: the messages of package `cairn.bank.v1` (the example application).
//! - [`FILE_DESCRIPTOR_SET`]: every file's descriptor, for server reflection.
//! - [`runs`]: payloads packed as runs (one blob plus lengths), large ones uncopied.
//! - [`stored`]: the metadata records, the embedded store's files and a part's manifest,
//!   as stored, and their conversions to the domain and the wire.
//! - [`files`]: the text files the daemons read — a topology, a tokens file — and the
//!   roles a token or certificate grants.
//! - [`fuzzing`]: one entry point per decoder of bytes from outside, for `fuzz/`.
//! - [`convert`]: every conversion between these messages and `cairn-core`'s domain
//!   types, with the one [`ConvertError`](convert::ConvertError) a message that cannot
//!   become a domain value gives.

/// Package `cairn.v1`.
#[allow(missing_docs, clippy::large_enum_variant)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/cairn.v1.rs"));
    // serde in the protobuf JSON mapping (pbjson): field names in lowerCamelCase, enums
    // by name, 64-bit integers as strings, bytes in base64, defaults omitted.
    #[cfg(feature = "json")]
    include!(concat!(env!("OUT_DIR"), "/cairn.v1.serde.rs"));
}

/// Package `cairn.bank`.
pub mod bank {
    /// Package `cairn.bank.v1`.
    #[allow(missing_docs)]
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/cairn.bank.v1.rs"));
    }
}

/// The encoded `FileDescriptorSet` of every cairn `.proto` file, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/cairn_descriptor.bin"));

pub mod convert;
pub mod files;
pub mod fuzzing;
pub mod runs;
pub mod stored;
