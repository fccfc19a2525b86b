//! A small machine: a `/dev/shm` too small for the region (Docker's default is 64 MB) is a
//! typed error naming the sizes and the remedy, never a SIGBUS, and leaves nothing
//! behind. Each test runs in its own tmpfs (`common::private_shm`, root only).

mod common;

use std::process::Command;

use shmbridge::{DType, Engine, EngineSpec, Error};

/// Entries of this test's private `/dev/shm`.
fn shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

/// The reproduction: a 21.7 MB region in an 8 MB tmpfs. Before the fix the engine
/// died of SIGBUS writing its first frame.
#[test]
fn an_engine_larger_than_dev_shm_exits_with_a_typed_error() {
    if !common::private_shm(
        "an_engine_larger_than_dev_shm_exits_with_a_typed_error",
        "8m",
    ) {
        return;
    }
    let out = Command::new(common::BIN)
        .args(["engine", "--env", "null", "--num-envs", "1024"])
        .args(["--obs-dim", "4", "--act-dim", "1", "--image", "84x84x3"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{} {stderr}", out.status);
    assert!(stderr.contains("no room in /dev/shm"), "{stderr}");
    assert!(stderr.contains("--shm-size"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.stdout.is_empty(), "it printed a region name");
    assert_eq!(shm_entries(), Vec::<String>::new());
}

fn spec(name: &str, bytes: u64) -> EngineSpec {
    EngineSpec::new("big", 1)
        .name(name)
        .tensor(
            "obs",
            DType::U8,
            &[1, bytes],
            shmbridge::Direction::EngineToClient,
        )
        .tensor(
            "actions",
            DType::F32,
            &[1, 1],
            shmbridge::Direction::ClientToEngine,
        )
}

/// In-process: the second of two 5 MB regions does not fit an 8 MB tmpfs. Its creation
/// is `NoSpace` with the sizes, its name is gone, and the first region is still served.
#[test]
fn a_region_that_does_not_fit_is_no_space_and_leaves_nothing() {
    if !common::private_shm(
        "a_region_that_does_not_fit_is_no_space_and_leaves_nothing",
        "8m",
    ) {
        return;
    }
    let mut first = Engine::create(spec("first", 5 << 20)).unwrap();
    first.tensor_mut::<u8>("obs").unwrap().fill(7);
    match Engine::create(spec("second", 5 << 20)) {
        Err(Error::NoSpace {
            name,
            needed,
            free,
            total,
        }) => {
            assert_eq!(name, common::ns_name("second"));
            assert!(needed > 5 << 20 && free < needed && total == 8 << 20);
        }
        other => panic!("expected NoSpace, got {other:?}"),
    }
    assert_eq!(shm_entries(), vec![common::ns_name("first")]);
    assert!(first.tensor::<u8>("obs").unwrap().iter().all(|&b| b == 7));
    first.close();
    assert_eq!(shm_entries(), Vec::<String>::new());
}
