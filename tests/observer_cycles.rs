//! A thousand observer attach/detach cycles leave this process's descriptors, mappings
//! and memory flat. Alone in its test binary: the counts are the whole process's, which
//! other tests running in parallel threads would change.

mod common;

use std::time::{Duration, Instant};

use shmbridge::observer::Observer;

const T: Duration = Duration::from_secs(30);

/// Descriptors, mappings and resident memory of this process.
fn footprint() -> (usize, usize, u64) {
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let maps = std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count();
    let rss = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
        .unwrap();
    (fds, maps, rss)
}

#[test]
fn a_thousand_attach_and_detach_cycles_leave_fds_and_memory_flat() {
    let engine = common::EngineProc::start(&["--env", "null", "--num-envs", "64"]);
    let cycle = || {
        let observer = Observer::attach(&engine.name, T).unwrap();
        let picks = [observer.pick("obs", 0..64).unwrap()];
        let mut out = observer.buffers(&picks).unwrap();
        observer.read(&picks, &mut out, T).unwrap();
        observer.stats(T).unwrap();
    };
    // Warm up: the allocator's and the test harness's first-use growth.
    for _ in 0..50 {
        cycle();
    }
    let before = footprint();
    let start = Instant::now();
    for _ in 0..1000 {
        cycle();
    }
    let after = footprint();
    eprintln!(
        "1000 cycles in {:.2} s: fds {} -> {}, mappings {} -> {}, VmRSS {} -> {} kB",
        start.elapsed().as_secs_f64(),
        before.0,
        after.0,
        before.1,
        after.1,
        before.2,
        after.2
    );
    assert_eq!(after.0, before.0, "descriptors");
    assert_eq!(after.1, before.1, "mappings");
    // A leak of one page a cycle would be 4000 kB.
    assert!(
        after.2 <= before.2 + 512,
        "VmRSS {} -> {} kB",
        before.2,
        after.2
    );
}
