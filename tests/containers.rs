//! Engine and learner in two containers of one node: each in PID, network and mount
//! namespaces of its own (`unshare --pid --fork --net --mount-proc`), sharing only
//! /dev/shm, as Docker's `--ipc=container:ENGINE` or a Kubernetes pod whose containers
//! mount one memory-backed emptyDir at /dev/shm (`docs/deployment.md`). Every test runs
//! each side in its own namespaces, or one side here and the other in namespaces of its
//! own: the host path (steps, resets, calls), shards, the Vulkan export with the CPU
//! importer, death either way, `ls` and `gc` from either side, Ctrl-C. Each skips with
//! the reason where the namespaces cannot be made (not root).

mod common;

use std::path::Path;
use std::time::Duration;

use common::peer::{self, block, say, PeerProc};
use common::{region_gone, shm_exists, BIN};
use rustix::process::Signal;
use shmbridge::envs::null::{pattern, pattern_u8};
use shmbridge::error::PidNamespace;
use shmbridge::{AttachOptions, Client, DType, Engine, EngineSpec, Error};

const T: Duration = Duration::from_secs(30);

/// Why the namespaces cannot be made here (printed as the skip reason), or `None`.
fn unavailable() -> bool {
    match peer::namespaces_unavailable() {
        Some(why) => {
            eprintln!("SKIPPED: {why}");
            true
        }
        None => false,
    }
}

/// Whether a Vulkan driver is here (lavapipe in CI); `Err(why)` if not.
fn vulkan() -> Result<(), String> {
    #[cfg(feature = "vulkan")]
    {
        match shmbridge::device::vulkan::vk::Context::open(shmbridge::device::VulkanDevice::ANY) {
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }
    #[cfg(not(feature = "vulkan"))]
    {
        Err("this build has no `vulkan` feature".into())
    }
}

/// `shmbridge engine ARGS` in namespaces of its own; returns it and the region name it
/// printed.
fn isolated_engine(args: &[&str]) -> (PeerProc, String) {
    let mut all = vec!["engine"];
    all.extend_from_slice(args);
    let mut engine = PeerProc::spawn_isolated(Path::new(BIN), "", &all);
    let name = engine.line();
    assert!(name.starts_with("shmbridge-"), "engine printed {name:?}");
    (engine, name)
}

/// Runs the `shmbridge` CLI with `args`, in namespaces of its own or here.
fn cli(isolated: bool, args: &[&str]) -> std::process::Output {
    let cmd = if isolated {
        peer::isolated(BIN)
    } else {
        std::process::Command::new(BIN)
    };
    common::in_namespace(cmd).args(args).output().unwrap()
}

/// Steps a `null` engine's region `steps` times checking every observation, resets it
/// with a seed, calls its `echo`, on every shard; as a client does from anywhere.
fn drive_null(c: &mut Client, steps: u64) -> Result<(), Error> {
    let obs_len = c.layout().tensors[c.layout().id("obs")?.index()].nbytes / 4;
    for _ in 0..steps {
        c.tensor_mut::<f32>("actions")?.fill(1.0);
        let frame = c.step(T)?;
        let obs = c.tensor::<f32>("obs")?;
        for (i, v) in obs.iter().enumerate().take(obs_len as usize) {
            assert_eq!(*v, pattern(frame, i as u64), "frame {frame} element {i}");
        }
    }
    c.reset(None, &[], T)?;
    let replies = c.call_method_all("echo", &[("k", "v")], b"payload", T)?;
    assert_eq!(replies.len(), c.shards().len());
    for r in replies {
        assert_eq!(r.payload, b"payload");
    }
    Ok(())
}

// ---- Peers: this test binary run again, inside namespaces of its own ----

/// Not a test: a client run by the tests below in namespaces of its own, with its role
/// (`null NAME STEPS`, `vulkan NAME STEPS`, `hold NAME`).
#[test]
#[ignore = "a peer process the container tests start themselves"]
fn container_peer() {
    let Some(role) = peer::role() else {
        return;
    };
    let words: Vec<&str> = role.split_whitespace().collect();
    let attach = |name| Client::attach(name, AttachOptions::default().timeout(T));
    match words[..] {
        ["null", name, steps] => {
            let mut c = attach(name).expect("attach");
            drive_null(&mut c, steps.parse().unwrap()).expect("drive");
            c.close();
            say("done");
        }
        ["vulkan", name, steps] => {
            let mut c = attach(name).expect("attach");
            let rgb = c.layout().id("rgb").unwrap();
            let address = c.device_ptr(rgb).unwrap();
            for _ in 0..steps.parse::<u64>().unwrap() {
                let frame = c.step(T).expect("step");
                let bytes = c.tensor::<u8>("rgb").unwrap();
                // The view is the mapping of the engine's memory: no copy.
                assert_eq!(bytes.as_ptr() as u64, address);
                for (i, b) in bytes.iter().enumerate() {
                    assert_eq!(*b, pattern_u8(frame, i as u64), "frame {frame} byte {i}");
                }
            }
            c.close();
            say("done");
        }
        ["hold", name] => {
            let _c = attach(name).expect("attach");
            say("attached");
            block();
        }
        _ => panic!("bad role {role:?}"),
    }
}

fn isolated_client(role: &str) -> PeerProc {
    PeerProc::start_in(peer::Isolation::Namespaces, "container_peer", role)
}

/// Waits for a peer to say `done` and end well.
fn finished(mut p: PeerProc, what: &str) {
    p.expect("done");
    let status = p.wait_end().expect("the peer ended");
    assert!(status.success(), "{what}: {status}: {}", p.stderr_at_end());
}

/// Waits for a CLI engine in namespaces of its own to end, and returns what it said.
fn engine_ended(mut engine: PeerProc) -> String {
    let status = engine.wait_end().expect("the engine ended");
    let err = engine.stderr_at_end();
    assert!(status.success(), "engine: {status}: {err}");
    err
}

// ---- The host path ----

/// A CLI engine in namespaces of its own, a client here: steps (every observation
/// checked), a seeded reset, an engine-defined call; the engine ends when the client
/// closes, and removes its region.
#[test]
fn a_client_here_drives_an_engine_in_other_namespaces() {
    if unavailable() {
        return;
    }
    let (engine, name) = isolated_engine(&["--env", "null", "--num-envs", "4", "--blocking"]);
    let mut c = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
    drive_null(&mut c, 200).unwrap();
    c.close();
    assert!(engine_ended(engine).contains("client closed after 200 steps"));
    assert!(region_gone(&name));
}

/// The other way round: an engine here, a client in namespaces of its own.
#[test]
fn a_client_in_other_namespaces_drives_an_engine_here() {
    if unavailable() {
        return;
    }
    let engine = common::EngineProc::start(&["--env", "null", "--num-envs", "4", "--blocking"]);
    let name = engine.name.clone();
    finished(isolated_client(&format!("null {name} 200")), "client");
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
    assert!(err.contains("client closed after 200 steps"), "{err}");
    assert!(region_gone(&name));
}

/// Two containers: engine and client each in namespaces of their own (siblings: neither
/// sees the other's processes).
#[test]
fn engine_and_client_in_two_sibling_namespaces() {
    if unavailable() {
        return;
    }
    let (engine, name) = isolated_engine(&["--env", "null", "--num-envs", "4", "--blocking"]);
    finished(isolated_client(&format!("null {name} 200")), "client");
    assert!(engine_ended(engine).contains("client closed after 200 steps"));
    assert!(region_gone(&name));
}

/// A sharded region: shard 0 and shard 1 each in namespaces of their own, the client in
/// a third: every step, reset and call reaches both shards.
#[test]
fn shards_and_client_in_three_sibling_namespaces() {
    if unavailable() {
        return;
    }
    let name = format!("shmbridge-containers-shards-{}", std::process::id());
    let shard = |k: &str| {
        let args = [
            "--env",
            "null",
            "--num-envs",
            "6",
            "--name",
            &name,
            "--shard",
            k,
            "--blocking",
        ];
        isolated_engine(&args).0
    };
    let (first, second) = (shard("0/2"), shard("1/2"));
    finished(isolated_client(&format!("null {name} 100")), "client");
    for s in [first, second] {
        let said = engine_ended(s);
        assert!(said.contains("client closed after 100 steps"), "{said}");
    }
    assert!(region_gone(&name));
}

// ---- The Vulkan export ----

/// A Vulkan engine (lavapipe) in namespaces of its own, clients in namespaces of their
/// own and here: each gets the fds over the socket file in /dev/shm (an abstract socket
/// would not have crossed the network namespaces), proves it is the attached client
/// from another PID namespace, checks the engine's proof, and reads every frame through
/// its own mapping of the engine's memory.
#[test]
fn vulkan_frames_cross_the_namespaces() {
    if unavailable() {
        return;
    }
    if let Err(why) = vulkan() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let args = [
        "--env",
        "null",
        "--num-envs",
        "2",
        "--obs-dim",
        "4",
        "--image",
        "8x8x4",
        "--image-device",
        "vulkan",
        "--blocking",
    ];
    // Engine and client in sibling namespaces.
    let (engine, name) = isolated_engine(&args);
    finished(isolated_client(&format!("vulkan {name} 50")), "client");
    assert!(engine_ended(engine).contains("client closed after 50 steps"));
    assert!(region_gone(&name));
    // The engine in namespaces of its own, the client here.
    let (engine, name) = isolated_engine(&args);
    let mut c = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
    let address = c.device_ptr("rgb").unwrap();
    for _ in 0..20 {
        let frame = c.step(T).unwrap();
        let bytes = c.tensor::<u8>("rgb").unwrap();
        assert_eq!(bytes.as_ptr() as u64, address);
        assert!(bytes
            .iter()
            .enumerate()
            .all(|(i, b)| *b == pattern_u8(frame, i as u64)));
    }
    c.close();
    assert!(engine_ended(engine).contains("client closed after 20 steps"));
    assert!(region_gone(&name));
}

// ---- Death, either way, and the messages that name the dead ----

/// The engine (in namespaces of its own) dies while a client here steps: the client's
/// error says the engine died, naming its pid as one of another PID namespace, and the
/// region is removed. Before the fix it said "the engine (pid 2) died", a pid that names
/// another process (or none) here.
#[test]
fn an_engine_dying_in_other_namespaces_is_named_as_such() {
    if unavailable() {
        return;
    }
    let (mut engine, name) = isolated_engine(&["--env", "null", "--num-envs", "4", "--blocking"]);
    let mut c = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
    c.step(T).unwrap();
    engine.fault(peer::Fault::Kill);
    let e = c.step(T).unwrap_err();
    match &e {
        Error::PeerDied { pid_ns, .. } => assert_eq!(*pid_ns, PidNamespace::Other, "{e}"),
        other => panic!("expected the engine's death, got {other}"),
    }
    assert!(e.to_string().contains("in another PID namespace"), "{e}");
    assert!(region_gone(&name));
}

/// A client in namespaces of its own dies while the engine here waits for it: the
/// engine's error names it as a process of another PID namespace, and the engine serves
/// a new client.
#[test]
fn a_client_dying_in_other_namespaces_is_named_as_such() {
    if unavailable() {
        return;
    }
    let mut engine =
        Engine::create(EngineSpec::standard("containers", 2, 3, 1, DType::F32)).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let mut client = isolated_client(&format!("hold {name}"));
    client.expect("attached");
    // The engine looks at its client while it waits (it sleeps between looks): alive,
    // by its lock, though this PID namespace does not show it.
    assert!(matches!(
        engine.wait_actions(Duration::from_millis(50)),
        Err(Error::Timeout { .. })
    ));
    client.fault(peer::Fault::Kill);
    let e = engine.wait_actions(T).unwrap_err();
    match &e {
        Error::PeerDied { pid_ns, pid, .. } => {
            assert_eq!(*pid_ns, PidNamespace::Other, "{e}");
            assert_ne!(*pid, client.pid(), "the pid it recorded, not ours");
        }
        other => panic!("expected the client's death, got {other}"),
    }
    assert!(e.to_string().contains("in another PID namespace"), "{e}");
    // A new client, here.
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut c = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
            c.step(T).unwrap();
            c.close();
        });
        engine.wait_for_client(T).unwrap();
        engine.wait_actions(T).unwrap();
        engine.publish().unwrap();
        assert!(matches!(
            engine.wait_actions(T),
            Err(Error::PeerClosed { .. })
        ));
    });
    engine.close();
    assert!(region_gone(&name));
}

// ---- ls and gc from either side ----

/// `ls` and `gc` run in other namespaces than a live engine's see it alive (its lock,
/// not its pid, which names nothing there) and leave it; once it is dead, `gc` from
/// there removes its region and its fd socket.
#[test]
fn ls_and_gc_from_other_namespaces_judge_by_the_lock() {
    if unavailable() {
        return;
    }
    common::own_namespace();
    let vulkan = vulkan().is_ok();
    let mut args = vec!["--env", "null", "--num-envs", "2", "--blocking"];
    if vulkan {
        args.extend(["--image", "4x4x4", "--image-device", "vulkan"]);
    }
    let (mut engine, name) = isolated_engine(&args);
    for isolated in [true, false] {
        let ls = cli(isolated, &["ls"]);
        let ls = String::from_utf8_lossy(&ls.stdout);
        let line = ls
            .lines()
            .find(|l| l.starts_with(&name))
            .unwrap_or_default();
        assert!(line.contains(" ready "), "ls (isolated {isolated}):\n{ls}");
        let gc = cli(isolated, &["gc"]);
        let gc = String::from_utf8_lossy(&gc.stdout);
        let line = gc.lines().find(|l| l.contains(&name)).unwrap_or_default();
        assert!(
            line.starts_with("left") && line.contains("its engine is alive"),
            "gc (isolated {isolated}):\n{gc}"
        );
        assert!(shm_exists(&name));
    }
    // A client here sees it alive too, and steps; it stays attached while the engine is
    // killed (its close would end the engine, which would remove its region).
    let mut c = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
    c.step(T).unwrap();
    engine.fault(peer::Fault::Kill);
    engine.wait_end();
    let gc = cli(true, &["gc"]);
    let gc = String::from_utf8_lossy(&gc.stdout);
    let line = gc.lines().find(|l| l.contains(&name)).unwrap_or_default();
    assert!(
        line.starts_with("removed") && line.contains("its engine is dead"),
        "{gc}"
    );
    assert!(region_gone(&name), "gc left the region or its socket");
    assert!(matches!(c.step(T), Err(Error::PeerDied { .. })));
}

// ---- Ctrl-C ----

/// SIGINT (Ctrl-C) to a CLI client in namespaces of its own: it closes (exit 130) and
/// its engine, here, ends normally. SIGINT to a CLI engine in namespaces of its own
/// (with Vulkan tensors where lavapipe is installed): it closes its region, the client
/// here gets `PeerClosed`, and neither the region nor its socket file is left.
#[test]
fn ctrl_c_on_either_side_closes_cleanly() {
    if unavailable() {
        return;
    }
    let engine = common::EngineProc::start(&["--env", "null", "--num-envs", "2", "--blocking"]);
    let name = engine.name.clone();
    let args = [
        "client",
        name.as_str(),
        "--steps",
        "1000000000",
        "--blocking",
    ];
    let mut client = PeerProc::spawn_isolated(Path::new(BIN), "", &args);
    // It steps: wait until the engine has answered some of its actions.
    let probe = shmbridge::region::Region::open_read_only(&name).unwrap();
    let deadline = std::time::Instant::now() + T;
    while probe.header().frame_seq < 10 {
        assert!(
            std::time::Instant::now() < deadline,
            "the client never stepped"
        );
        std::thread::yield_now();
    }
    drop(probe);
    // The Rust CLI has no SIGINT handler: Ctrl-C ends it (a Python learner closes
    // first: tests/python/test_containers.py). Its engine learns of its death within a
    // sleep slice, says so, and ends.
    common::signal(client.pid(), Signal::INT);
    let status = client.wait_end().expect("the client ended");
    assert_eq!(status.code(), Some(128 + 2), "{}", client.stderr_at_end());
    let (status, err) = engine.finish();
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("the client (pid") && err.contains(") died"),
        "{err}"
    );
    assert!(region_gone(&name));

    let vulkan = vulkan().is_ok();
    let mut args = vec!["--env", "null", "--num-envs", "2", "--blocking"];
    if vulkan {
        args.extend(["--image", "4x4x4", "--image-device", "vulkan"]);
    }
    let (engine, name) = isolated_engine(&args);
    let mut c = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
    c.step(T).unwrap();
    common::signal(engine.pid(), Signal::INT);
    let e = loop {
        match c.step(T) {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert!(matches!(e, Error::PeerClosed { .. }), "{e}");
    c.close();
    let mut engine = engine;
    let status = engine.wait_end().expect("the engine ended");
    assert_eq!(status.code(), Some(128 + 2), "{}", engine.stderr_at_end());
    assert!(region_gone(&name), "the region or its socket was left");
}
