//! Hostile headers and tensor tables through the `layout_header` fuzz target's code
//! (`shmbridge::fuzzing::header`): every input in `tests/hostile_headers/` (what the
//! fuzzer found, once fixed, and hand-made attacks) and the seeds of its corpus.

mod common;

use std::path::Path;

use shmbridge::fuzzing;

/// Inputs named `reject-*` are hand-made attacks and must be refused; the others (fuzzer
/// findings) may be accepted, but only as a layout that passes `check_layout`.
#[test]
fn replay_hostile_headers() {
    for (name, data) in common::stored_inputs("tests/hostile_headers") {
        let result = fuzzing::header(&data);
        if let (true, Ok(layout)) = (name.starts_with("reject-"), result) {
            panic!("{name} was accepted: {layout:?}");
        }
    }
}

/// The corpus seeds are valid headers (raw snapshots and unedited builder output) and
/// validate to what the builder placed. With `SHMBRIDGE_HEADER_CORPUS=DIR` they are also
/// written there (`scripts/fuzz.sh` seeds the fuzzer's corpus this way).
#[test]
fn corpus_seeds_are_valid_headers() {
    let seeds = fuzzing::header_seeds();
    for (name, data) in &seeds {
        let layout = fuzzing::header(data).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!layout.tensors.is_empty());
    }
    assert!(seeds.len() >= 2 * fuzzing::header_bases().len());
    if let Some(dir) = std::env::var_os("SHMBRIDGE_HEADER_CORPUS") {
        std::fs::create_dir_all(&dir).unwrap();
        for (name, data) in &seeds {
            std::fs::write(Path::new(&dir).join(name), data).unwrap();
        }
    }
}

/// The shard-table attacks (1.4) are refused for what they break, not by accident: each
/// error names the shard table or its fields, a shard's ring, the env axis, the layout
/// hash or the snapshot's size.
#[test]
fn shard_table_attacks_are_refused_for_what_they_break() {
    let mut n = 0;
    for (name, data) in common::stored_inputs("tests/hostile_headers") {
        if !(name.starts_with("reject-shard") || name.starts_with("reject-sharded")) {
            continue;
        }
        let err = fuzzing::header(&data).unwrap_err();
        let text = err.to_string();
        let why = [
            "shard",
            "envs first",
            "layout hash",
            "region too small",
            "ring",
            "overlaps",
        ];
        assert!(
            why.iter().any(|w| text.contains(w)),
            "{name}: refused for another reason: {text}"
        );
        n += 1;
    }
    assert!(n >= 20, "only {n} shard attacks");
}

/// The stats-area attacks (1.7) are refused for what they break: each error names the
/// stats area (its offset, or a span it overlaps).
#[test]
fn stats_area_attacks_are_refused_for_what_they_break() {
    let mut n = 0;
    for (name, data) in common::stored_inputs("tests/hostile_headers") {
        if !name.starts_with("reject-stats") {
            continue;
        }
        let text = fuzzing::header(&data).unwrap_err().to_string();
        assert!(
            text.contains("stats"),
            "{name}: refused for another reason: {text}"
        );
        n += 1;
    }
    assert_eq!(n, 7);
}

/// An edit-mode input of the `layout_header` target: `base`, then 13-byte edits (op,
/// tensor, element, kind 0 = set, anchor 0, value), as fuzz/make_hostile_headers.py
/// writes them.
fn edits(base: u8, records: &[(u8, u8, u8, u64)]) -> Vec<u8> {
    let mut out = vec![base << 1 | 1];
    for &(op, tensor, element, value) in records {
        out.extend_from_slice(&[op, tensor, element, 0, 0]);
        out.extend_from_slice(&value.to_le_bytes());
    }
    out
}

/// The CUDA sharing attacks (1.9 draft) are refused for what they break (the fd flag,
/// unknown flags, the IPC handle), while the same edits made consistent (minor 9, the
/// flag on both CUDA entries, no IPC handle) give an accepted layout shared by fd: the
/// refusals are not an accident of the edits.
#[test]
fn cuda_sharing_attacks_are_refused_for_what_they_break() {
    // Op numbers and the base of fuzz/make_hostile_headers.py, and its fd_entry(): the
    // host base's tensor 0 on CUDA, shared by fd, in a 1.9 header.
    const HOST: u8 = 1;
    let (version_minor, layout_hash, engine_event_handle) = (2u8, 5u8, 15u8);
    let (location, flags, export_size) = (21u8, 22u8, 26u8);
    let fd = [
        (location, 0, 0, 1),
        (export_size, 0, 0, 2 << 20),
        (flags, 0, 0, 1),
        (version_minor, 0, 0, 9),
        (
            layout_hash,
            0,
            0,
            shmbridge::layout::LAYOUT_HASH_CUDA_SESSIONS,
        ),
        (engine_event_handle, 0, 3, 7),
    ];
    let layout = fuzzing::header(&edits(HOST, &fd)).expect("a layout shared by fd");
    assert_eq!(layout.version, (1, 9));
    let c = layout.tensors[0].cuda.expect("on CUDA");
    assert_eq!(
        (c.sharing, c.ipc_mem_handle, c.alloc_size),
        (shmbridge::layout::CudaSharing::Fd, [0; 64], 2 << 20)
    );
    let mut n = 0;
    for (name, data) in common::stored_inputs("tests/hostile_headers") {
        if !(name.starts_with("reject-cuda-fd") || name.contains("flags") || name.contains("1-9"))
            || name.contains("export-size")
        {
            continue;
        }
        let text = fuzzing::header(&data).unwrap_err().to_string();
        let why = ["by fd", "CUDA flags", "IPC memory handle"];
        assert!(
            why.iter().any(|w| text.contains(w)),
            "{name}: refused for another reason: {text}"
        );
        n += 1;
    }
    assert_eq!(n, 6);
}

/// The `export_size` attacks on memory shared by fd are refused for the rule each breaks
/// (below a tensor's end, above the cap, two sizes for the one allocation), each on a
/// table that the same edits without the attack make valid
/// (`cuda_sharing_attacks_are_refused_for_what_they_break`).
#[test]
fn cuda_fd_export_size_attacks_are_refused_for_what_they_break() {
    let mut n = 0;
    for (name, data) in common::stored_inputs("tests/hostile_headers") {
        if !name.starts_with("reject-cuda-fd-export-size") {
            continue;
        }
        let text = fuzzing::header(&data).unwrap_err().to_string();
        let why = match name.as_str() {
            n if n.contains("below-tensor") => "lies outside its",
            n if n.contains("sizes-differ") => "export_size 1048576 differs from the 2097152",
            _ => "is more than 2097152",
        };
        assert!(
            text.contains(why),
            "{name}: refused for another reason: {text}"
        );
        n += 1;
    }
    assert_eq!(n, 4);
}
