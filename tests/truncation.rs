//! A region file that shrinks (anyone with the owner's rights can truncate it): `ls` and
//! `inspect` read headers with `pread` and never die of SIGBUS; a client turns a region
//! truncated under it into `RegionTooSmall` before it sleeps, instead of waiting (or
//! faulting). Each test names its regions in its own region namespace (tests/common).

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

/// A sharded region's header (1.4: a shard table with each shard's live words), and its
/// size.
fn sharded_region_bytes() -> (Vec<u8>, u64) {
    let specs = [
        TensorSpec::new("obs", DType::F32, &[4, 64], Direction::EngineToClient),
        TensorSpec::new("actions", DType::F32, &[4, 1], Direction::ClientToEngine),
    ];
    let b = HeaderBuilder::sharded("shrinking", 4, &specs, 4096, 2).unwrap();
    let mut bytes = b.bytes();
    bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
    (bytes, b.header.region_size)
}

/// `inspect` of a sharded region reads each shard's live words with `pread`, as it reads
/// the rest of the header: it never maps the region. Shown where mapping is impossible:
/// a region file grown to 1 TiB (sparse), inspected under a 1 GiB address-space cap.
/// Before the fix `inspect` mapped the whole file to read the shard words (and a file
/// shrinking after that mapping killed it with SIGBUS): here it failed to map.
#[test]
fn inspect_reads_the_shard_words_without_mapping_the_region() {
    let name = &common::ns_name("sharded-big");
    let path = format!("/dev/shm/{name}");
    let (header, _) = sharded_region_bytes();
    let file = std::fs::File::create_new(&path).unwrap();
    file.write_all_at(&header, 0).unwrap();
    file.set_len(1 << 40).unwrap();
    let out = Command::new("sh")
        .args(["-c", "ulimit -v 1048576 && exec \"$0\" inspect \"$1\""])
        .arg(common::BIN)
        .arg(name)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}: {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for shard in [
        "shard 0       envs 0..2 pid 0",
        "shard 1       envs 2..4 pid 0",
    ] {
        assert!(stdout.contains(shard), "{shard:?} not in:\n{stdout}");
    }
    std::fs::remove_file(&path).unwrap();
}

/// Before the fix `ls` and `inspect` mapped the file at the size they saw, and a
/// truncation before they copied the header killed them with SIGBUS: with the file
/// shrinking and growing back in a loop, that happened within a few runs.
#[test]
fn ls_and_inspect_survive_a_region_that_shrinks_while_they_read() {
    for (name, (header, size)) in [
        ("shrinking", region_bytes()),
        ("shrinking-sharded", sharded_region_bytes()),
    ] {
        shrink_while_reading(&common::ns_name(name), header, size);
    }
}

/// Runs `inspect` and `ls` 200 times each while the region file `name` flips between its
/// full `size` (with `header` written) and nothing.
fn shrink_while_reading(name: &str, header: Vec<u8>, size: u64) {
    let path = format!("/dev/shm/{name}");
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
    truncate_to(&path, 4096);
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
    let engine = common::EngineProc::start(&["--env", "null", "--num-envs", "4"]);
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    client.step(Duration::from_secs(30)).unwrap();
    common::signal(engine.pid(), rustix::process::Signal::STOP);
    let path = format!("/dev/shm/{}", engine.name);
    truncate_to(&path, 0);
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

fn truncate_to(path: &str, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

/// A client asleep in `step` (blocking policy, the engine stopped) while the file is
/// truncated to nothing: the step ends with `RegionTooSmall` when its sleep slice runs
/// out, and so does the next one; dropping the client touches nothing. Before, the
/// waiter cleared its flag in the vanished control block on waking: SIGBUS.
#[test]
fn a_client_asleep_in_step_survives_truncation_to_nothing() {
    let engine = common::EngineProc::start(&["--env", "null", "--num-envs", "4", "--blocking"]);
    let options = AttachOptions::default().policy(shmbridge::WaitPolicy::BLOCKING);
    let mut client = Client::attach(&engine.name, options).unwrap();
    client.step(Duration::from_secs(30)).unwrap();
    common::signal(engine.pid(), rustix::process::Signal::STOP);
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let stepping = std::thread::spawn(move || {
        tid_tx
            .send(rustix::thread::gettid().as_raw_nonzero().get())
            .unwrap();
        let result = client.step(Duration::from_secs(60));
        (client, result)
    });
    common::until_asleep(tid_rx.recv().unwrap());
    let path = format!("/dev/shm/{}", engine.name);
    truncate_to(&path, 0);
    let (mut client, result) = stepping.join().unwrap();
    assert!(
        matches!(result, Err(Error::RegionTooSmall { actual: 0, .. })),
        "{result:?}"
    );
    let again = client.step(Duration::from_secs(30));
    assert!(
        matches!(again, Err(Error::RegionTooSmall { actual: 0, .. })),
        "{again:?}"
    );
    drop(client);
    common::signal(engine.pid(), rustix::process::Signal::KILL);
    let _ = engine.finish();
    let _ = std::fs::remove_file(&path);
}

/// An engine asleep in `wait_actions` (blocking policy, its client idle) while the file
/// is truncated to nothing: `RegionTooSmall`, and again from every later wait and
/// command poll; dropping the engine touches nothing and removes the name. Before, the
/// wake-up faulted, and so did a later wait or the drop.
#[test]
fn an_engine_asleep_in_wait_actions_survives_truncation_to_nothing() {
    let mut spec = shmbridge::EngineSpec::standard("shrinking", 4, 3, 1, DType::F32);
    spec.policy = shmbridge::WaitPolicy::BLOCKING;
    let mut engine = shmbridge::Engine::create(spec).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let path = format!("/dev/shm/{name}");
    let client = Client::attach(&name, AttachOptions::default()).unwrap();
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let waiting = std::thread::spawn(move || {
        tid_tx
            .send(rustix::thread::gettid().as_raw_nonzero().get())
            .unwrap();
        let result = engine.wait_actions(Duration::from_secs(60));
        (engine, result)
    });
    common::until_asleep(tid_rx.recv().unwrap());
    truncate_to(&path, 0);
    let (mut engine, result) = waiting.join().unwrap();
    assert!(
        matches!(result, Err(Error::RegionTooSmall { actual: 0, .. })),
        "{result:?}"
    );
    let again = [
        (
            "wait_actions",
            engine.wait_actions(Duration::from_secs(30)).map(|_| ()),
        ),
        (
            "poll_commands",
            engine
                .poll_commands(&mut shmbridge::command::BuiltinsOnly)
                .map(|_| ()),
        ),
        (
            "wait_for_client",
            engine.wait_for_client(Duration::from_secs(30)),
        ),
        ("publish", engine.publish().map(|_| ())),
    ];
    for (what, r) in again {
        assert!(
            matches!(r, Err(Error::RegionTooSmall { actual: 0, .. })),
            "{what}: {r:?}"
        );
    }
    drop(client);
    drop(engine);
    assert!(
        !std::path::Path::new(&path).exists(),
        "the engine removes its name"
    );
}
