#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = cairn_blob::Manifest::parse(data);
});
