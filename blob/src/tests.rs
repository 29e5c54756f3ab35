//! The store's rules on both back ends: a directory, and `object_store`'s in-memory store
//! standing in for S3 (the suite runs the same against a real S3 server).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::chunking::tests::pseudo_random;
use crate::{BlobArgs, BlobStore, Chunk, ChunkList, Location, MAX_CHUNK, Manifest, is_data_loss};

const WAIT: Duration = Duration::from_secs(5);

struct Backends {
    dir: std::path::PathBuf,
}

impl Backends {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("cairn-blob-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self { dir }
    }

    async fn both(&self) -> Vec<BlobStore> {
        let args = BlobArgs {
            blob_store: Some(Location::Dir(self.dir.clone())),
            ..Default::default()
        };
        let memory = Arc::new(object_store::memory::InMemory::new());
        vec![
            BlobStore::open(&args, None, true).await.unwrap(),
            BlobStore::over(memory, "cluster/a", true).await.unwrap(),
        ]
    }
}

impl Drop for Backends {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn store(blobs: &BlobStore, data: &[u8], piece: usize) -> crate::Stored {
    let mut writer = blobs.writer();
    for part in data.chunks(piece) {
        writer.write(part).await.unwrap();
    }
    writer.finish().await.unwrap()
}

#[tokio::test]
async fn a_small_change_stores_little_and_garbage_goes_only_when_old_and_unreferenced() {
    let backends = Backends::new("dedup");
    for blobs in backends.both().await {
        let at = blobs.location().to_owned();
        let mut data = pseudo_random(4 << 20, 7);
        let first = store(&blobs, &data, 100_000).await;
        assert_eq!(first.list.size, data.len() as u64, "{at}");
        assert_eq!(first.new, data.len() as u64, "{at}");
        // The same bytes in other pieces: the same chunks, nothing new.
        let again = store(&blobs, &data, 1 << 20).await;
        assert_eq!(again.list, first.list, "{at}");
        assert_eq!(again.new, 0, "{at}");
        // Change 1 % in one place: only the chunks it touches are new.
        for b in &mut data[2 << 20..(2 << 20) + 40_000] {
            *b = b.wrapping_add(1);
        }
        let changed = store(&blobs, &data, 65_536).await;
        assert!(
            changed.new <= 40_000 + 2 * u64::from(MAX_CHUNK),
            "{at}: stored {} of {}",
            changed.new,
            data.len()
        );
        assert_eq!(blobs.read(&changed.list).await.unwrap(), data, "{at}");
        let keep: BTreeSet<String> = changed.list.chunks.iter().cloned().collect();
        // A coordinator that no longer leads deletes nothing.
        let refused = blobs
            .collect_garbage(
                &blobs.exclusive(WAIT).await.unwrap(),
                &BTreeSet::new(),
                Duration::ZERO,
                || false,
            )
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("no longer leads"), "{refused}");
        // Within the grace period nothing goes, referenced or not.
        let kept = blobs
            .collect_garbage(
                &blobs.exclusive(WAIT).await.unwrap(),
                &keep,
                Duration::from_secs(3600),
                || true,
            )
            .await
            .unwrap();
        assert_eq!(kept, 0, "{at}");
        assert_eq!(blobs.read(&first.list).await.unwrap().len(), data.len());
        let freed = blobs
            .collect_garbage(
                &blobs.exclusive(WAIT).await.unwrap(),
                &keep,
                Duration::ZERO,
                || true,
            )
            .await
            .unwrap();
        assert!(freed > 0, "{at}");
        assert_eq!(blobs.read(&changed.list).await.unwrap(), data, "{at}");
        // The index forgot what went: storing the first version again writes it anew.
        let back = store(&blobs, &pseudo_random(4 << 20, 7), 100_000).await;
        assert_eq!(back.new, freed, "{at}");
    }
}

#[tokio::test]
async fn a_corrupt_or_missing_chunk_is_named_and_the_next_write_repairs_it() {
    let backends = Backends::new("bad");
    for blobs in backends.both().await {
        let at = blobs.location().to_owned();
        let data = pseudo_random(300_000, 11);
        let first = store(&blobs, &data, 50_000).await;
        let victim = first.list.chunks[0].clone();
        let good = blobs.read_chunk(&victim).await.unwrap();
        // Same size, other bytes: read and verify name the chunk as corrupt.
        let mut bad = good.to_vec();
        bad[0] ^= 0xff;
        blobs
            .tamper(crate::Kind::Chunk, &victim, Some(Bytes::from(bad)))
            .await
            .unwrap();
        let err = blobs.read(&first.list).await.unwrap_err();
        assert!(is_data_loss(&err), "{at}: {err}");
        assert!(err.to_string().contains(&victim), "{at}: {err}");
        assert!(blobs.verify(&first.list).await.is_err());
        // Found bad, forgotten: the next snapshot with these bytes rewrites the chunk.
        let again = store(&blobs, &data, 50_000).await;
        assert_eq!(
            again.new,
            good.len() as u64,
            "{at}: only the bad chunk is new"
        );
        assert_eq!(blobs.read(&again.list).await.unwrap(), data, "{at}");
        // Missing: named too.
        blobs
            .tamper(crate::Kind::Chunk, &victim, None)
            .await
            .unwrap();
        let err = blobs.read_chunk(&victim).await.unwrap_err();
        assert!(
            is_data_loss(&err) && err.to_string().contains("missing"),
            "{at}: {err}"
        );
        // An object larger than any chunk is refused without being read whole.
        blobs
            .tamper(
                crate::Kind::Chunk,
                &victim,
                Some(Bytes::from(vec![0u8; MAX_CHUNK as usize + 1])),
            )
            .await
            .unwrap();
        let err = blobs.read_chunk(&victim).await.unwrap_err();
        assert!(
            is_data_loss(&err) && err.to_string().contains("above"),
            "{at}: {err}"
        );
        // A name that is not a sha256 never reaches the store.
        assert!(blobs.read_chunk("../../etc/passwd").await.is_err());
        // A chunk a daemon says it wrote is confirmed only if it is there, at its size.
        let chunk = Chunk::new(Bytes::from_static(b"written by a daemon"));
        assert_eq!(
            blobs.confirm_chunk(&chunk.hash, 19).await.unwrap(),
            None,
            "{at}"
        );
        blobs.put_chunk(&chunk).await.unwrap();
        assert_eq!(
            blobs.confirm_chunk(&chunk.hash, 19).await.unwrap(),
            Some(false),
            "{at}"
        );
        assert_eq!(
            blobs.confirm_chunk(&chunk.hash, 20).await.unwrap(),
            None,
            "{at}: wrong size"
        );
    }
}

#[tokio::test]
async fn collection_waits_for_holders_and_a_manifest_past_the_limit_is_refused() {
    let backends = Backends::new("hold");
    for blobs in backends.both().await {
        let at = blobs.location().to_owned();
        let stored = store(&blobs, &pseudo_random(100_000, 3), 10_000).await;
        let hash: [u8; 32] = hex::decode(&stored.list.chunks[0])
            .unwrap()
            .try_into()
            .unwrap();
        // An upload in progress holds the store: collection does not run meanwhile.
        let held = blobs.hold().await;
        let skipped = blobs.exclusive(Duration::from_millis(50)).await;
        assert!(skipped.is_none(), "{at}");
        assert!(blobs.has(&hash), "{at}");
        drop(held);
        // A manifest past the limit is refused when written, not found unreadable later.
        let huge = Manifest {
            local_state: ChunkList {
                size: 1,
                chunks: vec!["a".repeat(64); (crate::MAX_MANIFEST / 64) as usize],
            },
            channel_states: ChunkList::default(),
        };
        let err = blobs.put_manifest(&huge).await.unwrap_err();
        assert!(err.to_string().contains("limit"), "{at}: {err}");
    }
}

#[tokio::test]
async fn a_manifest_larger_than_an_etcd_value_round_trips_and_is_checked() {
    let backends = Backends::new("manifest");
    for blobs in backends.both().await {
        let at = blobs.location().to_owned();
        // 30,000 chunks: ~2 MiB of names, over etcd's 1.5 MiB value limit.
        let names: Vec<String> = (0..30_000u32)
            .map(|i| crate::chunking::name_of(&i.to_le_bytes()))
            .collect();
        let manifest = Manifest {
            local_state: ChunkList {
                size: 30_000 << 15,
                chunks: names,
            },
            channel_states: ChunkList::default(),
        };
        let reference = blobs.put_manifest(&manifest).await.unwrap();
        assert!(reference.size > 3 << 19, "{at}: {}", reference.size);
        assert_eq!(
            blobs.read_manifest(&reference).await.unwrap(),
            manifest,
            "{at}"
        );
        // Stored twice: one object.
        assert_eq!(blobs.put_manifest(&manifest).await.unwrap(), reference);
        // A record naming other bytes, or a damaged object: refused, named.
        let mut wrong = reference.clone();
        wrong.size += 1;
        let err = blobs.read_manifest(&wrong).await.unwrap_err();
        assert!(
            is_data_loss(&err) && err.to_string().contains("corrupt"),
            "{at}: {err}"
        );
        blobs
            .tamper(
                crate::Kind::Manifest,
                &reference.sha256,
                Some(Bytes::from_static(b"{}")),
            )
            .await
            .unwrap();
        let err = blobs.read_manifest(&reference).await.unwrap_err();
        assert!(err.to_string().contains(&reference.sha256), "{at}: {err}");
        // A manifest in the store is an object GC sees.
        let listed = blobs.list(crate::Kind::Manifest).await.unwrap();
        assert_eq!(listed.len(), 1, "{at}");
    }
}
