//! A peer killed with SIGKILL is reported as `PeerDied`, promptly, never as a hang.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{shm_exists, signal, EngineProc, BIN};
use rustix::process::Signal;
use shmbridge::region::Region;
use shmbridge::{AttachOptions, Client, Engine, Error, Peer};

#[test]
fn engine_killed_while_client_waits() {
    common::own_namespace();
    let engine = EngineProc::start(&["--env", "null", "--num-envs", "2"]);
    let name = engine.name.clone();
    let mut client = Client::attach(&name, AttachOptions::default()).unwrap();
    client.step(Duration::from_secs(30)).unwrap();
    // Freeze the engine so the next step cannot be answered, and let the client wait.
    signal(engine.pid(), Signal::STOP);
    let waiter = std::thread::spawn(move || {
        let r = client.step(Duration::from_secs(60));
        (r, Instant::now())
    });
    // The client is asleep on the futex once it raises its waiter flag.
    let probe = Region::open_read_only(&name).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while probe.header().client_waiting == 0 {
        assert!(Instant::now() < deadline, "client never went to sleep");
        std::thread::yield_now();
    }
    let killed = Instant::now();
    signal(engine.pid(), Signal::KILL);
    let (result, returned) = waiter.join().unwrap();
    let err = result.unwrap_err();
    assert!(
        matches!(
            err,
            Error::PeerDied {
                peer: Peer::Engine,
                ..
            }
        ),
        "{err}"
    );
    eprintln!("PeerDied {:?} after SIGKILL", returned - killed);
    drop(probe);
    let _ = engine.finish();
    assert!(
        !shm_exists(&name),
        "the client removes a dead engine's region"
    );
}

#[test]
fn client_killed_while_engine_waits() {
    let spec = shmbridge::EngineSpec::standard("test", 1, 4, 1, shmbridge::DType::F32);
    let mut engine = Engine::create(spec).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let mut client = Command::new(BIN)
        .args(["client", &name, "--steps", "1000000000"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Serve a few steps so the client is attached and running, then kill it.
    for _ in 0..100 {
        engine.wait_actions(Duration::from_secs(30)).unwrap();
        engine.publish().unwrap();
    }
    client.kill().unwrap();
    let killed = Instant::now();
    // The client may have posted one more action before it died: answer it, then the
    // next wait must report the death.
    let mut answered = 0;
    let err = loop {
        match engine.wait_actions(Duration::from_secs(60)) {
            Ok(_) => {
                answered += 1;
                assert!(answered <= 1, "a dead client cannot post twice");
                engine.publish().unwrap();
            }
            Err(e) => break e,
        }
    };
    let seen = killed.elapsed();
    assert!(
        matches!(
            err,
            Error::PeerDied {
                peer: Peer::Client,
                ..
            }
        ),
        "{err}"
    );
    eprintln!("PeerDied {seen:?} after SIGKILL");
    let _ = client.wait();
    drop(engine);
    assert!(!shm_exists(&name));
}

#[test]
fn attach_to_dead_engine_is_peer_died_and_cleans_up() {
    common::own_namespace();
    let engine = EngineProc::start(&["--env", "null", "--num-envs", "1"]);
    let name = engine.name.clone();
    signal(engine.pid(), Signal::KILL);
    let _ = engine.finish();
    let err = Client::attach(&name, AttachOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::PeerDied {
                peer: Peer::Engine,
                ..
            }
        ),
        "{err}"
    );
    assert!(!shm_exists(&name));
}
