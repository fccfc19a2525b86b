//! Death is judged by locks, never by a pid alone, and a sweep removes only the object it
//! judged: a `gc` loop against regions created, killed and created again under the same
//! names loses no live region and causes no spurious `NameInUse`; a client in another PID
//! namespace (whose pids mean other processes) steps and closes normally.

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use shmbridge::layout::{HeaderBuilder, MAGIC};
use shmbridge::{region, DType, Engine, EngineSpec, Error, TensorSpec};

const WORKERS: usize = 3;
const ROUNDS: usize = 300;
const GCS: usize = 1;

/// What a dead engine leaves: a published header, no lock held.
fn plant_dead_region(name: &str, header: &[u8]) -> bool {
    use std::io::Write;
    match std::fs::File::create_new(format!("/dev/shm/{name}")) {
        Ok(mut f) => {
            f.write_all(header).unwrap();
            true
        }
        // Not yet removed by whoever closed the previous engine's name: skip a round.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
        Err(e) => panic!("{e}"),
    }
}

/// Each worker, under its own name: leave a dead engine's region there, then create a
/// live engine under the same name (which must remove the dead one, not fail with
/// `NameInUse`), check while it lives that the name still names its region, close it.
/// Meanwhile two threads `gc` in a loop. Before the fix the sweep let go of the lock
/// before it unlinked by name: it removed live regions created meanwhile, and an engine
/// whose start found the name locked by a sweep got `NameInUse`.
#[test]
fn a_gc_loop_loses_no_live_region_and_reused_names_are_never_in_use() {
    let b = HeaderBuilder::new(
        "dead",
        1,
        &[TensorSpec::new(
            "obs",
            DType::F32,
            &[1, 4],
            shmbridge::Direction::EngineToClient,
        )],
        4096,
    )
    .unwrap();
    let mut header = b.bytes();
    header.resize(b.header.region_size as usize, 0);
    header[..8].copy_from_slice(&MAGIC.to_le_bytes());
    let header = Arc::new(header);
    let done = Arc::new(AtomicBool::new(false));
    let sweeps = Arc::new(AtomicU64::new(0));
    let gcs: Vec<_> = (0..GCS)
        .map(|_| {
            let (done, sweeps) = (Arc::clone(&done), Arc::clone(&sweeps));
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    region::sweep().unwrap();
                    sweeps.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let (lost, in_use, served) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let (header, lost, in_use, served) = (
                Arc::clone(&header),
                Arc::clone(&lost),
                Arc::clone(&in_use),
                Arc::clone(&served),
            );
            std::thread::spawn(move || {
                let name = common::ns_name(&format!("reused-{w}"));
                let path = format!("/dev/shm/{name}");
                let spec = EngineSpec::standard("live", 1, 4, 1, DType::F32).name(&name);
                for _ in 0..ROUNDS {
                    plant_dead_region(&name, &header);
                    let engine = match Engine::create(spec.clone()) {
                        Ok(e) => e,
                        Err(Error::NameInUse { .. }) => {
                            in_use.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        Err(e) => panic!("{e}"),
                    };
                    served.fetch_add(1, Ordering::Relaxed);
                    let mine = engine.map_again().unwrap().identity();
                    for _ in 0..20 {
                        let now = std::fs::symlink_metadata(&path)
                            .ok()
                            .map(|m| std::os::unix::fs::MetadataExt::ino(&m));
                        if now != Some(mine.1) {
                            lost.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        std::thread::yield_now();
                    }
                    drop(engine);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    done.store(true, Ordering::Relaxed);
    for g in gcs {
        g.join().unwrap();
    }
    let (lost, in_use, served) = (
        lost.load(Ordering::Relaxed),
        in_use.load(Ordering::Relaxed),
        served.load(Ordering::Relaxed),
    );
    eprintln!(
        "{served} live regions, {} sweeps: {lost} lost, {in_use} NameInUse",
        sweeps.load(Ordering::Relaxed)
    );
    assert_eq!((lost, in_use), (0, 0), "of {served} live regions");
    let prefix = common::prefix();
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A client in its own PID namespace (`unshare -p -f --mount-proc`: its /proc shows
/// only itself, and it is pid 1 there) attaches to an engine outside, steps and closes.
/// Before the fix the client found no live process under the engine's pid, reported the
/// engine dead and removed its region.
#[test]
fn a_client_in_another_pid_namespace_steps_and_closes() {
    if !common::is_root() {
        eprintln!("SKIPPED: a client in another PID namespace needs root (unshare -p)");
        return;
    }
    let engine = common::EngineProc::start(&["--env", "null", "--num-envs", "2", "--blocking"]);
    let out = Command::new("unshare")
        .args(["-p", "-f", "--mount-proc", common::BIN, "client"])
        .arg(&engine.name)
        .args(["--steps", "200", "--blocking"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{}: {stderr}", out.status);
    assert!(String::from_utf8_lossy(&out.stdout).contains("200 steps"));
    let name = engine.name.clone();
    let (status, err) = engine.finish();
    assert!(status.success(), "engine: {err}");
    assert!(err.contains("client closed after 200 steps"), "{err}");
    assert!(!common::shm_exists(&name));
}

#[test]
fn client_lock_bytes_are_distinct_and_in_range() {
    let mut seen = std::collections::HashSet::new();
    for pid in [1u32, 2, 1000, u32::MAX] {
        for start in [0u64, 1, 12345, u64::MAX] {
            let b = region::client_lock_byte(pid, start);
            assert!((1 << 61..1 << 62).contains(&b), "{b}");
            assert!(seen.insert(b), "({pid}, {start})");
        }
    }
}
