//! Generates the prost messages of `cairn/**/*.proto` (no services: those are cairn-rpc's)
//! with a vendored `protoc`, so a fresh machine builds with cargo alone; and their serde
//! impls in the protobuf JSON mapping (pbjson, feature `json`).

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "cairn/v1/types.proto",
    "cairn/v1/peer.proto",
    "cairn/v1/app.proto",
    "cairn/v1/node_admin.proto",
    "cairn/v1/coordinator.proto",
    "cairn/bank/v1/bank.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // Rust 2024 marks set_var unsafe, and the workspace forbids unsafe code, so hand the
    // path over through the builder instead of the environment.
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptors = out_dir.join("cairn_descriptor.bin");
    let mut config = prost_build::Config::new();
    config
        .protoc_executable(protoc)
        .bytes(["."])
        // As tonic-prost-build did when it generated them: clippy does not judge generated code.
        .type_attribute(".", "#[allow(clippy::all)]")
        .file_descriptor_set_path(&descriptors)
        .compile_protos(PROTOS, &["."])?;
    // serde impls in the protobuf JSON mapping (what grpcurl prints) for `cairn.v1`: the
    // coordinator's HTTP API answers with the very messages its gRPC methods return.
    #[cfg(feature = "json")]
    pbjson_build::Builder::new()
        .register_descriptors(&std::fs::read(&descriptors)?)?
        .build(&[".cairn.v1"])?;
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    Ok(())
}
