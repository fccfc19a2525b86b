//! Replays every input in `fuzz/regressions/` (crashes the fuzzer found, once fixed, and
//! seed inputs) through the fuzz target's code, so a fixed bug stays fixed.

mod common;

#[test]
fn replay_fuzz_regressions() {
    for (_, data) in common::stored_inputs("fuzz/regressions") {
        shmbridge::fuzzing::ring_reader(&data);
    }
}

/// The `stream_record` target's seeds and hostile lanes (`fuzz/stream_regressions/`,
/// written by `fuzz/make_hostile_streams.py`), and any crash it finds once fixed.
#[test]
fn replay_stream_regressions() {
    let inputs = common::stored_inputs("fuzz/stream_regressions");
    assert!(inputs.len() >= 13, "{} inputs", inputs.len());
    for (name, data) in inputs {
        let got = shmbridge::fuzzing::stream_reader(&data);
        if name.starts_with("seed-") {
            assert!(matches!(got, Ok(n) if n >= 1), "{name}: {got:?}");
        } else {
            // Hostile: a typed error, the stream unusable, nothing read out of bounds.
            assert!(
                matches!(got, Err(shmbridge::Error::BadRecord { .. })),
                "{name}: {got:?}"
            );
        }
    }
}
