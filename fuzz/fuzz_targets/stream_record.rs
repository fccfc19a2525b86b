//! A stream consumer on arbitrary bytes: a hostile lane (cursors and data) claimed,
//! decoded and released record by record, or a hostile stream header validated. Run:
//! `bash scripts/fuzz.sh [seconds] stream_record` (or `cargo +nightly fuzz run stream_record`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = shmbridge::fuzzing::stream_reader(data);
});
