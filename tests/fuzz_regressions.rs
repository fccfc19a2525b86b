//! Replays every input in `fuzz/regressions/` (crashes the fuzzer found, once fixed, and
//! seed inputs) through the fuzz target's code, so a fixed bug stays fixed.

mod common;

#[test]
fn replay_fuzz_regressions() {
    for (_, data) in common::stored_inputs("fuzz/regressions") {
        shmbridge::fuzzing::ring_reader(&data);
    }
}
