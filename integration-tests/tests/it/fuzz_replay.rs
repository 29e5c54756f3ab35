//! The fuzz targets on the stable toolchain (issue 20): every input of `fuzz/corpus/TARGET`
//! and every past crash kept in `fuzz/regressions/TARGET` goes through the target's function
//! again, and so do a few thousand seeded mutations of them — none may panic. The fuzzers
//! themselves (`fuzz/`, cargo-fuzz, `-s none` on stable) run in scripts/test.sh.

use std::path::{Path, PathBuf};

/// A fuzz target's function.
type Target = fn(&[u8]);

/// Every target: its name under `fuzz/` and the function its `fuzz_targets/NAME.rs` calls.
const TARGETS: &[(&str, Target)] = &[
    ("peer_frames", cairn_proto::fuzzing::peer_frames),
    ("app_messages", cairn_proto::fuzzing::app_messages),
    ("upload_chunk", cairn_proto::fuzzing::upload_chunk),
    ("manifest", cairn_proto::fuzzing::manifest),
    ("records", cairn_proto::fuzzing::records),
    ("store_log", cairn_proto::fuzzing::store_log),
    ("topology", cairn_proto::fuzzing::topology),
    ("tokens", cairn_proto::fuzzing::tokens),
    ("policy", cairn_proto::fuzzing::policy),
];

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The files of `dir` (none if it is missing), sorted.
fn inputs(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != ".keep"))
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    out.sort();
    out
}

/// A small seeded generator (xorshift), so that a failure names an input to reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// `input` changed a little: bytes flipped, cut, repeated or inserted.
fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        match rng.below(4) {
            0 if !out.is_empty() => {
                let at = rng.below(out.len());
                out[at] ^= 1 << rng.below(8);
            }
            1 if !out.is_empty() => out.truncate(rng.below(out.len())),
            2 if !out.is_empty() => {
                let at = rng.below(out.len());
                let piece = out[at..].to_vec();
                out.extend_from_slice(&piece[..piece.len().min(64)]);
            }
            _ => {
                let at = rng.below(out.len() + 1);
                out.insert(at, rng.next() as u8);
            }
        }
    }
    out
}

#[test]
fn every_fuzz_target_survives_its_corpus_its_past_crashes_and_their_mutations() {
    let dir = fuzz_dir();
    let listed: Vec<String> = std::fs::read_dir(dir.join("fuzz_targets"))
        .expect("fuzz/fuzz_targets")
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_suffix(".rs").map(str::to_owned)
        })
        .collect();
    let mut names: Vec<&str> = TARGETS.iter().map(|(n, _)| *n).collect();
    names.sort_unstable();
    let mut listed_sorted: Vec<&str> = listed.iter().map(String::as_str).collect();
    listed_sorted.sort_unstable();
    assert_eq!(
        names, listed_sorted,
        "every fuzz target is replayed here, and only those"
    );
    for (name, target) in TARGETS {
        let corpus = inputs(&dir.join("corpus").join(name));
        assert!(
            !corpus.is_empty(),
            "fuzz/corpus/{name} is empty: seed it (cargo fuzz run -s none {name})"
        );
        let crashes = inputs(&dir.join("regressions").join(name));
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for (path, input) in corpus.iter().chain(&crashes) {
            let run = std::panic::catch_unwind(|| target(input));
            assert!(run.is_ok(), "{name} panicked on {}", path.display());
            for round in 0..200 {
                let mutated = mutate(&mut rng, input);
                let run = std::panic::catch_unwind(|| target(&mutated));
                assert!(
                    run.is_ok(),
                    "{name} panicked on mutation {round} of {}: {mutated:?}",
                    path.display()
                );
            }
        }
    }
}
