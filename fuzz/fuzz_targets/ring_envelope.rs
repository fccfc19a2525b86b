//! The command-channel reader on arbitrary bytes: a hostile ring state (counters and
//! buffer) popped record by record, each record and the whole input decoded as an
//! envelope. Run: `bash scripts/fuzz.sh [seconds]` (or `cargo +nightly fuzz run ring_envelope`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    shmbridge::fuzzing::ring_reader(data);
});
