//! Replays every input in `fuzz/regressions/` (crashes the fuzzer found, once fixed, and
//! seed inputs) through the fuzz target's code, so a fixed bug stays fixed.

#[test]
fn replay_fuzz_regressions() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("fuzz/regressions") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            continue;
        }
        let data = std::fs::read(&path).unwrap();
        shmbridge::fuzzing::ring_reader(&data);
        n += 1;
    }
    assert!(n > 0, "no inputs in {}", dir.display());
}
