//! Generates the tonic services and clients of `cairn/**/*.proto` (the `.proto` files live
//! in cairn-proto, one folder up) with a vendored `protoc`. The messages are cairn-proto's:
//! every `cairn.*` package is an extern path, so prost generates no message here.
//!
//! It also names the git revision the programs are built from (`--version`,
//! `cairn_build_info`): `CAIRN_GIT_REVISION` if set (a build without the checkout, as a
//! container image's), else `git rev-parse`, else `unknown`; it runs again when the
//! checkout's HEAD moves.

use std::path::PathBuf;
use std::process::Command;

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
    println!("cargo:rerun-if-env-changed=CAIRN_GIT_REVISION");
    let revision = std::env::var("CAIRN_GIT_REVISION")
        .ok()
        .map(|r| r.trim().to_owned())
        .filter(|r| !r.is_empty())
        .or_else(git_revision)
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=CAIRN_GIT_REVISION={revision}");
    Ok(())
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn git_revision() -> Option<String> {
    let dir = PathBuf::from(git(&["rev-parse", "--git-dir"])?);
    // HEAD, the branch it names, and the packed refs: whichever moves with a commit.
    let mut watched = vec![dir.join("HEAD"), dir.join("packed-refs")];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(dir.join(branch));
    }
    for path in watched.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    git(&["rev-parse", "--short=12", "HEAD"])
}
