//! Header and tensor-table validation on arbitrary bytes: a raw hostile snapshot with a
//! claimed region size, or a valid header from `HeaderBuilder` with field-aware edits.
//! Whatever validation accepts must hold what a client relies on (checked in
//! `shmbridge::fuzzing::check_layout`). Run: `bash scripts/fuzz.sh 60 layout_header`
//! (or `cargo +nightly fuzz run layout_header`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = shmbridge::fuzzing::header(data);
});
