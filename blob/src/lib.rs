//! The cairn blob store: snapshot data as content-defined chunks (FastCDC) named by their
//! sha256, and each part's chunk lists as a manifest object named the same way, kept in a
//! local directory (`file:///path`) or in S3-compatible object storage (`s3://bucket/prefix`,
//! through `object_store`). A snapshot stores only the chunks no earlier one stored, while
//! each snapshot still lists all of its chunks — no chain to replay. Every read is checked
//! against the object's name.

pub mod chunking;
pub mod location;
mod store;
#[cfg(test)]
mod tests;

pub use chunking::{Chunk, Chunker, MAX_CHUNK};
pub use location::{BlobArgs, Location};
pub use store::{
    BlobStore, ChunkList, ChunkWriter, Exclusive, Kind, Listed, MAX_MANIFEST, Manifest,
    ManifestRef, Stored, check_chunk, is_data_loss,
};
