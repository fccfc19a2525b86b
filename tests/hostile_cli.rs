//! `shmbridge client` distrusts the header: a `num_envs` that disagrees with the tensors
//! is a typed error, not an index out of bounds, and per-env memory it cannot get is a
//! typed error, not an abort.

mod common;

use std::process::Command;
use std::time::Duration;

use shmbridge::layout::{Header, HeaderBuilder, MAGIC};
use shmbridge::{DType, Engine, EngineSpec, Error, Peer};

/// A live engine of 4 envs whose header then claims 1000: before the fix the client
/// stepped it and indexed `rewards` past its 4 elements (a panic).
#[test]
fn a_num_envs_that_disagrees_with_the_tensors_is_refused() {
    let mut engine = Engine::create(EngineSpec::standard("liar", 4, 3, 1, DType::F32)).unwrap();
    engine.publish().unwrap();
    let header = engine.map_again().unwrap();
    let at = std::mem::offset_of!(Header, num_envs);
    // SAFETY: `at` is a u32 field inside the control block of a live mapping, 4-aligned;
    // no client has attached yet, so nothing reads it concurrently.
    unsafe { (header.ptr().add(at) as *mut u32).write(1000) };
    let name = engine.name().to_string();
    let served = std::thread::spawn(move || loop {
        match engine.wait_actions(Duration::from_secs(60)) {
            Ok(_) => {
                engine.publish().unwrap();
            }
            Err(Error::PeerClosed { peer: Peer::Client }) => return,
            Err(e) => panic!("{e}"),
        }
    });
    let out = Command::new(common::BIN)
        .args(["client", &name, "--steps", "3"])
        .output()
        .unwrap();
    common::assert_no_crash("shmbridge client", &out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("num_envs 1000"), "{stderr}");
    served.join().unwrap();
}

/// A header of 2^32 - 1 envs whose tensors agree (a sparse file of about 60 GB, never
/// touched): the client's per-env returns would take 32 GiB. Under an 80 GiB address
/// space cap the mapping fits and they do not: a typed error (before the fix, an abort
/// on the failed allocation).
#[test]
fn per_env_memory_the_client_cannot_get_is_a_typed_error() {
    let n = u32::MAX;
    let b = HeaderBuilder::new(
        "huge",
        n,
        &EngineSpec::standard("huge", n, 1, 1, DType::F32).tensors,
        4096,
    )
    .unwrap();
    let mut bytes = b.bytes();
    let h: &mut Header = bytemuck::from_bytes_mut(&mut bytes[..std::mem::size_of::<Header>()]);
    h.magic = MAGIC;
    h.engine_state = 1; // ready
    let name = common::ns_name("huge");
    let path = common::shm_path(&name);
    std::fs::write(&path, &bytes).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(b.header.region_size).unwrap();
    // Its "engine" lives: it holds the region's lock.
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let out = Command::new("sh")
        .args([
            "-c",
            "ulimit -v 83886080 && exec \"$0\" \"$@\"",
            common::BIN,
        ])
        .args(["client", &name, "--steps", "1", "--timeout", "1"])
        .output()
        .unwrap();
    common::assert_no_crash("shmbridge client", &out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no memory for the returns"), "{stderr}");
    std::fs::remove_file(path).unwrap();
}
