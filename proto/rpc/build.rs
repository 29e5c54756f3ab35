//! Generates the tonic services and clients of `cairn/**/*.proto` (the `.proto` files live
//! in cairn-proto, one folder up) with a vendored `protoc`. The messages are cairn-proto's:
//! every `cairn.*` package is an extern path, so prost generates no message here.

const PROTOS: &[&str] = &[
    "../cairn/v1/types.proto",
    "../cairn/v1/peer.proto",
    "../cairn/v1/app.proto",
    "../cairn/v1/node_admin.proto",
    "../cairn/v1/coordinator.proto",
    "../cairn/bank/v1/bank.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // Rust 2024 marks set_var unsafe, and the workspace forbids unsafe code, so hand the
    // path over through the builder instead of the environment.
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure()
        .extern_path(".cairn.v1", "::cairn_proto::v1")
        .extern_path(".cairn.bank.v1", "::cairn_proto::bank::v1")
        .compile_with_config(config, PROTOS, &[".."])?;
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    Ok(())
}
