//! What cairn stores, in the forms it is stored in: the metadata records (JSON, in etcd or
//! the embedded store), the embedded store's files, and a part's manifest in the blob
//! store; and the conversions between the records, the domain and the wire. Every reader
//! here takes bytes it did not write in this process, so each is fuzzed
//! ([`crate::fuzzing`]).

pub mod convert;
pub mod log;
pub mod manifest;
pub mod records;
