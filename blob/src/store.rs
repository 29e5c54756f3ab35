//! The blob store: chunks and part manifests, each an object named by the sha256 of its
//! bytes, in a local directory or an S3-compatible bucket.
//!
//! Integrity, as enforced here, on both back ends:
//! - objects are written create-only (S3: `If-None-Match: *`): concurrent writers of one
//!   chunk are harmless, and an object that already exists is checked before it is trusted
//!   (one whose bytes do not hash to its name is overwritten);
//! - in a directory a chunk is written to a temporary file, fully written, fsynced, renamed
//!   and its directory fsynced: a name never points at partial bytes, and a full disk is an
//!   error of the write, never an empty chunk;
//! - every read is checked against its name: a missing object or one whose bytes do not hash
//!   to its name is an error naming it ([`is_data_loss`]), never wrong bytes; a chunk found
//!   bad is forgotten by the index, so the next snapshot that has it stores it again.
//!
//! The coordinator keeps an index of the chunks stored (loaded by listing at start, kept as
//! it writes and collects): it answers a daemon's "which of these do you have" without a
//! request per chunk.

use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures_util::TryStreamExt;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::chunking::{Chunk, Chunker, MAX_CHUNK, digest, name_of, valid_name};
use crate::location::{BlobArgs, Location};
pub use cairn_proto::stored::manifest::{ChunkList, MAX_MANIFEST, Manifest, ManifestRef};

/// How long garbage collection lets one delete take, retries included.
const GC_DELETE_TIMEOUT: Duration = Duration::from_secs(5);

/// What storing some bytes did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    /// The chunks.
    pub list: ChunkList,
    /// Bytes written anew.
    pub new: u64,
    /// Bytes already present.
    pub reused: u64,
}

/// Whether a read failed because stored data is missing or corrupt (as opposed to an I/O
/// error that may pass): such errors are `DATA_LOSS` to a client.
pub fn is_data_loss(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::InvalidData
    )
}

/// What an object is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// A chunk of state or recorded messages.
    Chunk,
    /// A part's manifest.
    Manifest,
}

impl Kind {
    fn noun(self) -> &'static str {
        match self {
            Kind::Chunk => "chunk",
            Kind::Manifest => "manifest",
        }
    }
}

/// An object found by listing the store.
#[derive(Debug, Clone)]
pub struct Listed {
    /// Chunk or manifest.
    pub kind: Kind,
    /// Its name (sha256).
    pub name: String,
    /// Its size.
    pub size: u64,
    /// When it was last written, if the store says.
    pub modified: Option<SystemTime>,
}

#[derive(Debug)]
enum Backend {
    /// Chunks at `<dir>/<first two hex digits>/<sha256>`, manifests at
    /// `<dir>/manifests/<sha256>`.
    Dir(PathBuf),
    /// Chunks at `<prefix>/chunks/<sha256>`, manifests at `<prefix>/manifests/<sha256>`.
    Object {
        store: Arc<dyn ObjectStore>,
        prefix: String,
    },
}

/// Garbage collection's hold on the store ([`BlobStore::exclusive`]).
#[derive(Debug)]
pub struct Exclusive(#[allow(dead_code)] tokio::sync::OwnedRwLockWriteGuard<()>);

/// Chunk name → size, of every chunk known to be stored.
type Index = HashMap<[u8; 32], u32>;

/// The blob store (cheap to clone: clones share the back end and the index).
#[derive(Debug, Clone)]
pub struct BlobStore {
    backend: Arc<Backend>,
    location: String,
    /// The chunks known to be stored, with their sizes; `None` for a writer that keeps no
    /// index (a daemon).
    index: Option<Arc<Mutex<Index>>>,
    /// Held shared by whatever may name a chunk the index vouched for (an upload, a
    /// `HasChunks` answer) and exclusively by garbage collection: a chunk is never deleted
    /// between the index saying it is stored and the record naming it.
    guard: Arc<tokio::sync::RwLock<()>>,
    /// How many shared holds were ever taken ([`Self::holds_taken`]).
    holds: Arc<std::sync::atomic::AtomicU64>,
}

/// An error of the store named with what was being done.
fn error(kind: std::io::ErrorKind, message: String) -> std::io::Error {
    std::io::Error::new(kind, message)
}

fn from_object_store(doing: String, e: object_store::Error) -> std::io::Error {
    let kind = match e {
        object_store::Error::NotFound { .. } => std::io::ErrorKind::NotFound,
        object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. } => {
            std::io::ErrorKind::AlreadyExists
        }
        _ => std::io::ErrorKind::Other,
    };
    error(kind, format!("{doing}: {e}"))
}

impl BlobStore {
    /// Opens the store `args` names (`default_dir` when it names none), checking that it can
    /// be reached: a directory is created, a bucket is listed (wrong credentials or a missing
    /// bucket fail here, within the request timeouts, not at the first snapshot). With
    /// `index`, every chunk stored is listed into the index.
    pub async fn open(
        args: &BlobArgs,
        default_dir: Option<&Path>,
        index: bool,
    ) -> std::io::Result<Self> {
        let location = match (&args.blob_store, default_dir) {
            (Some(location), _) => location.clone(),
            (None, Some(dir)) => Location::Dir(dir.to_owned()),
            (None, None) => {
                return Err(error(
                    std::io::ErrorKind::InvalidInput,
                    "no blob store given (--blob-store)".into(),
                ));
            }
        };
        let store = match &location {
            Location::Dir(dir) => {
                tokio::fs::create_dir_all(dir).await.map_err(|e| {
                    error(e.kind(), format!("cannot create {}: {e}", dir.display()))
                })?;
                Self::with(Backend::Dir(dir.clone()), &location, index)
            }
            Location::S3 { bucket, prefix } => {
                let s3 = s3_store(args, bucket)?;
                Self::with(
                    Backend::Object {
                        store: Arc::new(s3),
                        prefix: prefix.clone(),
                    },
                    &location,
                    index,
                )
            }
        };
        store.check_reachable().await?;
        store.reload_index().await?;
        Ok(store)
    }

    /// A store over any `object_store` back end (tests use the in-memory one).
    pub async fn over(
        store: Arc<dyn ObjectStore>,
        prefix: &str,
        index: bool,
    ) -> std::io::Result<Self> {
        let location = Location::S3 {
            bucket: "object-store".into(),
            prefix: prefix.into(),
        };
        let blobs = Self::with(
            Backend::Object {
                store,
                prefix: prefix.into(),
            },
            &location,
            index,
        );
        blobs.reload_index().await?;
        Ok(blobs)
    }

    fn with(backend: Backend, location: &Location, index: bool) -> Self {
        Self {
            backend: Arc::new(backend),
            location: location.to_string(),
            index: index.then(Default::default),
            guard: Arc::default(),
            holds: Arc::default(),
        }
    }

    /// The store's URL, for logs and errors.
    pub fn location(&self) -> &str {
        &self.location
    }

    async fn check_reachable(&self) -> std::io::Result<()> {
        if let Backend::Object { store, prefix } = &*self.backend {
            let path = object_path(prefix, "chunks", None);
            store
                .list_with_delimiter(Some(&path))
                .await
                .map_err(|e| from_object_store(format!("cannot list {}", self.location), e))?;
        }
        Ok(())
    }

    /// Lists every chunk stored into the index, replacing what it held (nothing to do
    /// without an index).
    pub async fn reload_index(&self) -> std::io::Result<()> {
        let Some(index) = &self.index else {
            return Ok(());
        };
        let listed = self.list(Kind::Chunk).await?;
        {
            let mut index = index.lock().expect("index lock");
            index.clear();
            for object in listed {
                let hash = hex::decode(&object.name).map(<[u8; 32]>::try_from);
                if let (Ok(Ok(hash)), Ok(size)) = (hash, u32::try_from(object.size)) {
                    index.insert(hash, size);
                }
            }
        }
        Ok(())
    }

    /// Whether the index knows chunk `hash` to be stored (always false without an index).
    pub fn has(&self, hash: &[u8; 32]) -> bool {
        self.size_known(hash).is_some()
    }

    /// The size of chunk `name` (its SHA-256 in hex): from the index, else from the store;
    /// `None` if it is not stored.
    pub async fn chunk_size(&self, name: &str) -> std::io::Result<Option<u64>> {
        if let Ok(Ok(hash)) = hex::decode(name).map(<[u8; 32]>::try_from)
            && let Some(size) = self.size_known(&hash)
        {
            return Ok(Some(u64::from(size)));
        }
        self.size_of(Kind::Chunk, name).await
    }

    fn size_known(&self, hash: &[u8; 32]) -> Option<u32> {
        let index = self.index.as_ref()?;
        index.lock().expect("index lock").get(hash).copied()
    }

    /// The store to itself, for garbage collection: waits up to `wait` for the holders
    /// ([`Self::hold`]) to end and keeps new ones waiting while it is held; `None` if they
    /// did not end in time.
    pub async fn exclusive(&self, wait: Duration) -> Option<Exclusive> {
        tokio::time::timeout(wait, self.guard.clone().write_owned())
            .await
            .ok()
            .map(Exclusive)
    }

    /// A shared hold on the store against garbage collection, for as long as a chunk the
    /// index vouched for may still be named by a record being written.
    pub async fn hold(&self) -> tokio::sync::OwnedRwLockReadGuard<()> {
        self.holds.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.guard.clone().read_owned().await
    }

    /// How many holds ([`Self::hold`]) were ever asked for. Garbage collection decided on
    /// at one count and run at a later one may sweep a chunk a hold taken in between
    /// vouched for: [`Self::exclusive_since`] refuses it.
    pub fn holds_taken(&self) -> u64 {
        self.holds.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// As [`Self::exclusive`], for a collection decided on when [`Self::holds_taken`] was
    /// `since`: `None` also if a hold was asked for since (a snapshot began uploading, or
    /// asked which chunks are stored, after the collection was decided on).
    pub async fn exclusive_since(&self, wait: Duration, since: u64) -> Option<Exclusive> {
        let exclusive = self.exclusive(wait).await?;
        (self.holds_taken() == since).then_some(exclusive)
    }

    fn note(&self, hash: [u8; 32], size: usize) {
        if let (Some(index), Ok(size)) = (&self.index, u32::try_from(size)) {
            index.lock().expect("index lock").insert(hash, size);
        }
    }

    fn forget(&self, name: &str) {
        if let (Some(index), Ok(Ok(hash))) =
            (&self.index, hex::decode(name).map(<[u8; 32]>::try_from))
        {
            index.lock().expect("index lock").remove(&hash);
        }
    }

    /// Chunks known to the index.
    pub fn indexed(&self) -> usize {
        self.index
            .as_ref()
            .map_or(0, |index| index.lock().expect("index lock").len())
    }

    /// A writer that chunks a stream of bytes as they come, holding at most a few chunks.
    pub fn writer(&self) -> ChunkWriter<'_> {
        ChunkWriter {
            store: self,
            chunker: Chunker::new(),
            stored: Stored::default(),
        }
    }

    /// Stores one chunk unless it is stored already; returns whether it was new.
    pub async fn put_chunk(&self, chunk: &Chunk) -> std::io::Result<bool> {
        if self.has(&chunk.hash) {
            return Ok(false);
        }
        let name = chunk.name();
        let new = self.put(Kind::Chunk, &name, chunk.data.clone()).await?;
        self.note(chunk.hash, chunk.data.len());
        Ok(new)
    }

    /// Checks that chunk `hash` of `size` bytes is stored (the index knows it, or a daemon
    /// that writes to the store itself put it there) and indexes it: `Some(false)` known
    /// already, `Some(true)` found new in the store, `None` not there at that size.
    pub async fn confirm_chunk(&self, hash: &[u8; 32], size: u64) -> std::io::Result<Option<bool>> {
        if let Some(known) = self.size_known(hash) {
            return Ok((u64::from(known) == size).then_some(false));
        }
        let name = hex::encode(hash);
        match self.size_of(Kind::Chunk, &name).await? {
            Some(found) if found == size && size <= u64::from(MAX_CHUNK) => {
                self.note(*hash, size as usize);
                Ok(Some(true))
            }
            _ => Ok(None),
        }
    }

    /// Writes an object create-only; if it exists, checks its bytes and rewrites it only if
    /// they do not hash to its name. Returns whether it was written.
    async fn put(&self, kind: Kind, name: &str, data: Bytes) -> std::io::Result<bool> {
        match self.put_create(kind, name, data.clone()).await {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                match self.get(kind, name, data.len() as u64).await {
                    Ok(stored) if stored == data => Ok(false),
                    Ok(_) | Err(_) => {
                        tracing::warn!(
                            object = name,
                            kind = kind.noun(),
                            "a stored object is damaged: rewriting it"
                        );
                        self.put_overwrite(kind, name, data).await?;
                        Ok(true)
                    }
                }
            }
            Err(e) => Err(e),
        }
    }

    async fn put_create(&self, kind: Kind, name: &str, data: Bytes) -> std::io::Result<()> {
        match &*self.backend {
            Backend::Dir(dir) => {
                let path = dir_path(dir, kind, name);
                if tokio::fs::try_exists(&path).await.unwrap_or(false) {
                    return Err(error(
                        std::io::ErrorKind::AlreadyExists,
                        format!("{} {name} exists", kind.noun()),
                    ));
                }
                self.put_overwrite(kind, name, data).await
            }
            Backend::Object { store, prefix } => {
                let options = PutOptions {
                    mode: PutMode::Create,
                    ..Default::default()
                };
                store
                    .put_opts(
                        &object_path(prefix, dir_of(kind), Some(name)),
                        PutPayload::from(data),
                        options,
                    )
                    .await
                    .map(|_| ())
                    .map_err(|e| {
                        from_object_store(format!("cannot write {} {name}", kind.noun()), e)
                    })
            }
        }
    }

    async fn put_overwrite(&self, kind: Kind, name: &str, data: Bytes) -> std::io::Result<()> {
        match &*self.backend {
            Backend::Dir(dir) => {
                let path = dir_path(dir, kind, name);
                let name = name.to_owned();
                tokio::task::spawn_blocking(move || write_file(&path, kind, &name, &data))
                    .await
                    .map_err(std::io::Error::other)?
            }
            Backend::Object { store, prefix } => store
                .put(
                    &object_path(prefix, dir_of(kind), Some(name)),
                    PutPayload::from(data),
                )
                .await
                .map(|_| ())
                .map_err(|e| from_object_store(format!("cannot write {} {name}", kind.noun()), e)),
        }
    }

    /// The size of an object, `None` if there is none.
    async fn size_of(&self, kind: Kind, name: &str) -> std::io::Result<Option<u64>> {
        let found = match &*self.backend {
            Backend::Dir(dir) => tokio::fs::metadata(dir_path(dir, kind, name))
                .await
                .map(|m| m.len()),
            Backend::Object { store, prefix } => store
                .head(&object_path(prefix, dir_of(kind), Some(name)))
                .await
                .map(|m| m.size)
                .map_err(|e| from_object_store(format!("cannot look up {name}"), e)),
        };
        match found {
            Ok(size) => Ok(Some(size)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads an object of at most `max` bytes and checks that its bytes hash to its name.
    async fn get(&self, kind: Kind, name: &str, max: u64) -> std::io::Result<Bytes> {
        let noun = kind.noun();
        if !valid_name(name) {
            return Err(error(
                std::io::ErrorKind::InvalidData,
                format!("bad {noun} name `{}`", name.escape_debug()),
            ));
        }
        let missing_or = |e: std::io::Error| {
            if e.kind() == std::io::ErrorKind::NotFound {
                error(e.kind(), format!("{noun} {name} is missing"))
            } else {
                error(e.kind(), format!("cannot read {noun} {name}: {e}"))
            }
        };
        let too_large = |len: u64| {
            error(
                std::io::ErrorKind::InvalidData,
                format!("{noun} {name} is corrupt: {len} bytes, above the {max}-byte limit"),
            )
        };
        // A larger object than any of its kind is not one (and is not read into memory).
        let bytes = match &*self.backend {
            Backend::Dir(dir) => {
                let path = dir_path(dir, kind, name);
                let len = tokio::fs::metadata(&path).await.map_err(missing_or)?.len();
                if len > max {
                    return Err(too_large(len));
                }
                Bytes::from(tokio::fs::read(&path).await.map_err(missing_or)?)
            }
            Backend::Object { store, prefix } => {
                let path = object_path(prefix, dir_of(kind), Some(name));
                let result = store
                    .get(&path)
                    .await
                    .map_err(|e| missing_or(from_object_store(String::from("get"), e)))?;
                if result.meta.size > max {
                    return Err(too_large(result.meta.size));
                }
                result
                    .bytes()
                    .await
                    .map_err(|e| missing_or(from_object_store(String::from("get"), e)))?
            }
        };
        let actual = name_of(&bytes);
        if actual != name {
            return Err(error(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{noun} {name} is corrupt: its {} bytes hash to {actual}",
                    bytes.len()
                ),
            ));
        }
        Ok(bytes)
    }

    /// Reads one chunk (at most `MAX_CHUNK` bytes), checked against its name. A chunk found
    /// missing or corrupt is dropped from the index.
    pub async fn read_chunk(&self, name: &str) -> std::io::Result<Bytes> {
        let read = self.get(Kind::Chunk, name, u64::from(MAX_CHUNK)).await;
        if let Err(e) = &read
            && is_data_loss(e)
        {
            self.forget(name);
        }
        read
    }

    /// Reads back the bytes of `list`, every chunk checked.
    pub async fn read(&self, list: &ChunkList) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(usize::try_from(list.size).unwrap_or(0).min(1 << 30));
        for hash in &list.chunks {
            out.extend_from_slice(&self.read_chunk(hash).await?);
        }
        check_total(out.len() as u64, list)?;
        Ok(out)
    }

    /// Checks that every chunk of `list` exists and matches its name, and that they add
    /// up to the list's size; returns the bytes checked.
    /// Every chunk is read, past a bad one: each chunk found missing or corrupt is forgotten
    /// by the index (so later snapshots store it again); the error names the first and counts
    /// the rest.
    pub async fn verify(&self, list: &ChunkList) -> std::io::Result<u64> {
        let mut total = 0u64;
        let mut first: Option<std::io::Error> = None;
        let mut more = 0u64;
        for hash in &list.chunks {
            match self.read_chunk(hash).await {
                Ok(bytes) => total = total.saturating_add(bytes.len() as u64),
                Err(e) if first.is_none() => first = Some(e),
                Err(_) => more += 1,
            }
        }
        match first {
            Some(e) if more == 0 => Err(e),
            Some(e) => Err(error(
                e.kind(),
                format!("{e} (and {more} more chunks missing or corrupt)"),
            )),
            None => {
                check_total(total, list)?;
                Ok(total)
            }
        }
    }

    /// Stores a manifest (create-only, named by its sha256).
    /// A manifest above [`MAX_MANIFEST`] is refused (`InvalidInput`): it could not be read.
    pub async fn put_manifest(&self, manifest: &Manifest) -> std::io::Result<ManifestRef> {
        let bytes = Bytes::from(serde_json::to_vec(manifest).map_err(std::io::Error::other)?);
        if bytes.len() as u64 > MAX_MANIFEST {
            return Err(error(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "a manifest of {} chunks is {} bytes, above the {MAX_MANIFEST}-byte limit",
                    manifest.local_state.chunks.len() + manifest.channel_states.chunks.len(),
                    bytes.len()
                ),
            ));
        }
        let reference = ManifestRef {
            sha256: name_of(&bytes),
            size: bytes.len() as u64,
        };
        self.put(Kind::Manifest, &reference.sha256, bytes).await?;
        Ok(reference)
    }

    /// Reads a manifest, checked against its name and size, every chunk name checked.
    pub async fn read_manifest(&self, reference: &ManifestRef) -> std::io::Result<Manifest> {
        let bytes = self
            .get(Kind::Manifest, &reference.sha256, MAX_MANIFEST)
            .await?;
        let corrupt = |why: String| {
            error(
                std::io::ErrorKind::InvalidData,
                format!("manifest {} is corrupt: {why}", reference.sha256),
            )
        };
        if bytes.len() as u64 != reference.size {
            return Err(corrupt(format!(
                "{} bytes where its record says {}",
                bytes.len(),
                reference.size
            )));
        }
        Manifest::parse(&bytes).map_err(corrupt)
    }

    /// Every object of `kind` in the store.
    pub async fn list(&self, kind: Kind) -> std::io::Result<Vec<Listed>> {
        let listing =
            |e: object_store::Error| from_object_store(format!("cannot list {}", self.location), e);
        let mut out = Vec::new();
        match &*self.backend {
            Backend::Dir(dir) => {
                let dirs: Vec<PathBuf> = match kind {
                    Kind::Manifest => vec![dir.join("manifests")],
                    Kind::Chunk => {
                        let mut dirs = Vec::new();
                        let mut entries = match tokio::fs::read_dir(dir).await {
                            Ok(entries) => entries,
                            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
                            Err(e) => return Err(e),
                        };
                        while let Some(entry) = entries.next_entry().await? {
                            let name = entry.file_name().to_string_lossy().into_owned();
                            if name.len() == 2 && entry.file_type().await?.is_dir() {
                                dirs.push(entry.path());
                            }
                        }
                        dirs
                    }
                };
                for sub in dirs {
                    let mut files = match tokio::fs::read_dir(&sub).await {
                        Ok(files) => files,
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                        Err(e) => return Err(e),
                    };
                    while let Some(file) = files.next_entry().await? {
                        let name = file.file_name().to_string_lossy().into_owned();
                        if !valid_name(&name) {
                            continue; // temporary files of writes in progress
                        }
                        let meta = file.metadata().await?;
                        out.push(Listed {
                            kind,
                            name,
                            size: meta.len(),
                            modified: meta.modified().ok(),
                        });
                    }
                }
            }
            Backend::Object { store, prefix } => {
                let path = object_path(prefix, dir_of(kind), None);
                let mut stream = store.list(Some(&path));
                while let Some(meta) = stream.try_next().await.map_err(listing)? {
                    let Some(name) = meta.location.filename() else {
                        continue;
                    };
                    if !valid_name(name) {
                        continue;
                    }
                    let millis = meta.last_modified.timestamp_millis();
                    out.push(Listed {
                        kind,
                        name: name.to_owned(),
                        size: meta.size,
                        modified: u64::try_from(millis)
                            .ok()
                            .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms)),
                    });
                }
            }
        }
        Ok(out)
    }

    async fn delete(&self, kind: Kind, name: &str) -> std::io::Result<()> {
        match &*self.backend {
            Backend::Dir(dir) => match tokio::fs::remove_file(dir_path(dir, kind, name)).await {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
            Backend::Object { store, prefix } => store
                .delete(&object_path(prefix, dir_of(kind), Some(name)))
                .await
                .or_else(|e| match e {
                    object_store::Error::NotFound { .. } => Ok(()),
                    e => Err(from_object_store(format!("cannot delete {name}"), e)),
                }),
        }
    }

    /// Removes every chunk and manifest not in `referenced` and older than `grace` (a chunk
    /// a daemon wrote for a snapshot still uploading is in no record yet), while
    /// `may_delete()` holds (asked before each removal: a coordinator whose leadership ended
    /// deletes nothing more); returns the bytes freed.
    ///
    /// Runs under [`Self::exclusive`]: no upload or `HasChunks` answer is in progress, so
    /// `referenced` (read under it) is every chunk a record names or is about to.
    pub async fn collect_garbage(
        &self,
        _exclusive: &Exclusive,
        referenced: &BTreeSet<String>,
        grace: Duration,
        may_delete: impl Fn() -> bool,
    ) -> std::io::Result<u64> {
        let now = SystemTime::now();
        let mut freed = 0u64;
        for kind in [Kind::Manifest, Kind::Chunk] {
            for object in self.list(kind).await? {
                if referenced.contains(&object.name) {
                    continue;
                }
                // Unknown age counts as new.
                let old = object
                    .modified
                    .and_then(|m| now.duration_since(m).ok())
                    .is_some_and(|age| age >= grace);
                if !old {
                    continue;
                }
                if !may_delete() {
                    return Err(std::io::Error::other(
                        "stopped: this coordinator no longer leads",
                    ));
                }
                self.forget(&object.name);
                // Bounded, retries included: a coordinator whose term ends mid-collection
                // must not have a delete still on its way long after (the next leader may
                // reuse that chunk).
                tokio::time::timeout(GC_DELETE_TIMEOUT, self.delete(kind, &object.name))
                    .await
                    .map_err(|_| {
                        error(
                            std::io::ErrorKind::TimedOut,
                            format!(
                                "deleting {} {} took over {GC_DELETE_TIMEOUT:?}",
                                kind.noun(),
                                object.name
                            ),
                        )
                    })??;
                freed = freed.saturating_add(object.size);
            }
        }
        Ok(freed)
    }

    /// Damages or removes an object, for tests of what a reader does then.
    #[doc(hidden)]
    pub async fn tamper(&self, kind: Kind, name: &str, with: Option<Bytes>) -> std::io::Result<()> {
        match with {
            Some(bytes) => self.put_overwrite(kind, name, bytes).await,
            None => self.delete(kind, name).await,
        }
    }
}

fn check_total(total: u64, list: &ChunkList) -> std::io::Result<()> {
    if total != list.size {
        return Err(error(
            std::io::ErrorKind::InvalidData,
            format!(
                "the chunks hold {total} bytes where their list says {}",
                list.size
            ),
        ));
    }
    Ok(())
}

fn s3_store(args: &BlobArgs, bucket: &str) -> std::io::Result<object_store::aws::AmazonS3> {
    use object_store::{BackoffConfig, ClientOptions, RetryConfig};
    // Requests are bounded: an unreachable or silent server is an error within ~30 s, never
    // a hang; wrong credentials are refused at once (4xx is not retried).
    let options = ClientOptions::new()
        .with_timeout(Duration::from_secs(30))
        .with_connect_timeout(Duration::from_secs(5))
        .with_allow_http(args.s3_allow_http);
    let retry = RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            base: 2.0,
        },
        max_retries: 3,
        retry_timeout: Duration::from_secs(20),
    };
    let mut builder = object_store::aws::AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_region(&args.s3_region)
        .with_client_options(options)
        .with_retry(retry)
        .with_allow_http(args.s3_allow_http);
    if let Some(endpoint) = &args.s3_endpoint {
        builder = builder.with_endpoint(endpoint);
    }
    builder.build().map_err(|e| {
        // reqwest's TLS verifier needs the system's root certificates even for http://.
        let hint = if e.to_string().contains("builder error") {
            " (are the system's root certificates installed? e.g. apt-get install ca-certificates)"
        } else {
            ""
        };
        error(
            std::io::ErrorKind::InvalidInput,
            format!("cannot configure S3 for bucket {bucket}: {e}{hint}"),
        )
    })
}

fn dir_of(kind: Kind) -> &'static str {
    match kind {
        Kind::Chunk => "chunks",
        Kind::Manifest => "manifests",
    }
}

fn object_path(prefix: &str, dir: &str, name: Option<&str>) -> object_store::path::Path {
    let mut path = String::new();
    if !prefix.is_empty() {
        path.push_str(prefix);
        path.push('/');
    }
    path.push_str(dir);
    if let Some(name) = name {
        path.push('/');
        path.push_str(name);
    }
    object_store::path::Path::from(path)
}

fn dir_path(dir: &Path, kind: Kind, name: &str) -> PathBuf {
    match kind {
        Kind::Chunk => dir.join(&name[..2.min(name.len())]).join(name),
        Kind::Manifest => dir.join("manifests").join(name),
    }
}

/// Writes an object file durably: temporary file, every byte written, fsynced, renamed, the
/// directory fsynced. Concurrent writers of one object each use their own temporary file;
/// the renames (same content) may both win. On any error the temporary file is removed.
fn write_file(path: &Path, kind: Kind, name: &str, data: &[u8]) -> std::io::Result<()> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let noun = kind.noun();
    let dir = path.parent().expect("an object path has a directory");
    std::fs::create_dir_all(dir).map_err(|e| {
        error(
            e.kind(),
            format!("cannot create the directory of {noun} {name}: {e}"),
        )
    })?;
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        file.write_all(data)?;
        file.flush()?;
        file.sync_all()?;
        let len = file.metadata()?.len();
        if len != data.len() as u64 {
            return Err(std::io::Error::other(format!(
                "wrote {len} bytes of {}",
                data.len()
            )));
        }
        drop(file);
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(error(e.kind(), format!("cannot write {noun} {name}: {e}")));
    }
    Ok(())
}

/// Chunks bytes as they arrive and stores the chunks.
pub struct ChunkWriter<'a> {
    store: &'a BlobStore,
    chunker: Chunker,
    stored: Stored,
}

impl ChunkWriter<'_> {
    /// Adds bytes; stores every chunk that is certainly complete.
    pub async fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        for chunk in self.chunker.push(data) {
            self.put(&chunk).await?;
        }
        Ok(())
    }

    /// Adds a chunk cut elsewhere (a daemon's), already hashed.
    async fn put(&mut self, chunk: &Chunk) -> std::io::Result<()> {
        let size = chunk.data.len() as u64;
        if self.store.put_chunk(chunk).await? {
            self.stored.new += size;
        } else {
            self.stored.reused += size;
        }
        self.stored.list.size += size;
        self.stored.list.chunks.push(chunk.name());
        Ok(())
    }

    /// Stores the rest; returns the chunk list and what was new.
    pub async fn finish(mut self) -> std::io::Result<Stored> {
        let chunker = std::mem::take(&mut self.chunker);
        for chunk in chunker.finish() {
            self.put(&chunk).await?;
        }
        Ok(self.stored)
    }
}

/// Checks a chunk a daemon sent with its name and size: its bytes hash to the name.
pub fn check_chunk(hash: &[u8; 32], size: u64, data: &[u8]) -> Result<(), String> {
    if data.len() as u64 != size {
        return Err(format!(
            "chunk {} holds {} bytes where its size says {size}",
            hex::encode(hash),
            data.len()
        ));
    }
    if digest(data) != *hash {
        return Err(format!(
            "chunk {}'s bytes hash to {}",
            hex::encode(hash),
            name_of(data)
        ));
    }
    Ok(())
}
