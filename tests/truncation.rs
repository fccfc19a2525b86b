//! A region file that shrinks (anyone with the owner's rights can truncate it): `ls` and
//! `inspect` read headers with `pread` and never die of SIGBUS; a client turns a region
//! truncated under it into `RegionTooSmall` before it sleeps, instead of waiting (or
//! faulting). Each test runs in a private /dev/shm (root only).

mod common;

use std::os::unix::fs::FileExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shmbridge::layout::{HeaderBuilder, MAGIC};
use shmbridge::{AttachOptions, Client, DType, Direction, Error, TensorSpec};

/// Valid header bytes of a region with a 24 KiB tensor table (so the header reads span
/// several pages), the whole region's size.
fn region_bytes() -> (Vec<u8>, u64) {
    let specs: Vec<TensorSpec> = (0..64)
        .map(|i| {
            TensorSpec::new(
                &format!("t{i}"),
                DType::F32,
                &[4, 64],
                Direction::EngineToClient,
            )
        })
        .collect();
    let b = HeaderBuilder::new("shrinking", 4, &specs, 4096).unwrap();
    let mut bytes = b.bytes();
    bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
    (bytes, b.header.region_size)
}

/// Before the fix `ls` and `inspect` mapped the file at the size they saw, and a
/// truncation before they copied the header killed them with SIGBUS: with the file
/// shrinking and growing back in a loop, that happened within a few runs.
#[test]
fn ls_and_inspect_survive_a_region_that_shrinks_while_they_read() {
    if !common::private_shm(
        "ls_and_inspect_survive_a_region_that_shrinks_while_they_read",
        "64m",
    ) {
        return;
    }
    let name = "shmbridge-shrinking";
    let path = format!("/dev/shm/{name}");
    let (header, size) = region_bytes();
    let file = std::fs::File::create_new(&path).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let toggler = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                file.set_len(size).unwrap();
                file.write_all_at(&header, 0).unwrap();
                file.set_len(0).unwrap();
            }
        })
    };
    for round in 0..200 {
        for args in [vec!["inspect", name], vec!["ls"]] {
            let out = Command::new(common::BIN).args(&args).output().unwrap();
            assert!(
                out.status.code().is_some(),
                "round {round}: {args:?} died of a signal ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    toggler.join().unwrap();
    std::fs::remove_file(&path).unwrap();
}

/// An engine stopped (SIGSTOP) while its region is truncated to its first page: the
/// client's step ends with `RegionTooSmall` at its first sleep. Before the fix it slept
/// until the timeout (and a client touching the tensors would have died of SIGBUS).
#[test]
fn a_client_reports_a_region_truncated_under_it() {
    if !common::private_shm("a_client_reports_a_region_truncated_under_it", "64m") {
        return;
    }
    let engine = common::EngineProc::start(&[
        "--env",
        "null",
        "--num-envs",
        "4",
        "--obs-dim",
        "1024",
        "--blocking",
    ]);
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    client.step(Duration::from_secs(30)).unwrap();
    common::signal(engine.pid(), rustix::process::Signal::STOP);
    let path = format!("/dev/shm/{}", engine.name);
    let mapped = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4096)
        .unwrap();
    match client.step(Duration::from_secs(30)) {
        Err(Error::RegionTooSmall { needed, actual }) => {
            assert_eq!((needed, actual), (mapped, 4096))
        }
        other => panic!("expected RegionTooSmall, got {other:?}"),
    }
    // The answer sticks: the next step and a wait for the frame say the same (before,
    // the step said "call wait_frame() first", which cannot help).
    for (what, again) in [
        ("step", client.step(Duration::from_secs(30))),
        ("wait_frame", client.wait_frame(Duration::from_secs(30))),
    ] {
        match again {
            Err(Error::RegionTooSmall { needed, actual }) => {
                assert_eq!((needed, actual), (mapped, 4096), "{what}")
            }
            other => panic!("{what} after RegionTooSmall: {other:?}"),
        }
    }
    common::signal(engine.pid(), rustix::process::Signal::KILL);
    let _ = engine.finish();
    drop(client);
    let _ = std::fs::remove_file(&path);
}

/// Truncated to nothing, the control block and the rings are gone too: a command is
/// `RegionTooSmall` before it touches a ring, a step after it says the same, and dropping
/// the client touches nothing (before, all three died of SIGBUS: the drop at a Python
/// interpreter's exit too).
#[test]
fn a_client_of_a_region_truncated_to_nothing_errs_and_drops_cleanly() {
    if !common::private_shm(
        "a_client_of_a_region_truncated_to_nothing_errs_and_drops_cleanly",
        "64m",
    ) {
        return;
    }
    let engine = common::EngineProc::start(&["--env", "null", "--num-envs", "4"]);
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    client.step(Duration::from_secs(30)).unwrap();
    common::signal(engine.pid(), rustix::process::Signal::STOP);
    let path = format!("/dev/shm/{}", engine.name);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
    match client.ping(b"x", Duration::from_secs(30)) {
        Err(Error::RegionTooSmall { actual: 0, .. }) => {}
        other => panic!("expected RegionTooSmall, got {other:?}"),
    }
    // A step reads the control block before anything else: once a check has seen the
    // file empty, it says so instead of dying of SIGBUS on that read.
    match client.step(Duration::from_secs(30)) {
        Err(Error::RegionTooSmall { actual: 0, .. }) => {}
        other => panic!("step after RegionTooSmall: {other:?}"),
    }
    drop(client);
    common::signal(engine.pid(), rustix::process::Signal::KILL);
    let _ = engine.finish();
    let _ = std::fs::remove_file(&path);
}
