//! The Rust API with engine and client in one process (two threads): states, errors,
//! misuse, cleanup.

mod common;

use std::time::Duration;

use shmbridge::error::ErrorKind;
use shmbridge::region;
use shmbridge::{AttachOptions, Client, DType, Direction, Engine, EngineSpec, Error, Peer};

const T: Duration = Duration::from_secs(30);

fn spec() -> EngineSpec {
    EngineSpec::standard("api", 2, 3, 1, DType::F32).tensor(
        "rgb",
        DType::U8,
        &[2, 4, 4, 3],
        Direction::EngineToClient,
    )
}

fn ready_engine() -> Engine {
    let mut e = Engine::create(spec()).unwrap();
    e.tensor_mut::<f32>("obs").unwrap().fill(7.0);
    assert_eq!(e.publish().unwrap(), 0);
    e
}

#[test]
fn frame_zero_then_lock_step_in_two_threads() {
    let mut engine = ready_engine();
    let name = engine.name().to_string();
    let mut client = Client::attach(&name, AttachOptions::default()).unwrap();
    assert_eq!(client.tensor::<f32>("obs").unwrap(), &[7.0; 6]);
    assert_eq!(
        client.layout().tensor("rgb").unwrap().1.shape,
        vec![2, 4, 4, 3]
    );
    let server = std::thread::spawn(move || loop {
        match engine.wait_actions(T) {
            Ok(n) => {
                let a = engine.tensor::<f32>("actions").unwrap()[0];
                let mut io = engine.tensors();
                io.write::<f32>("obs").unwrap().fill(a + n as f32);
                io.write::<u8>("rgb").unwrap().fill(n as u8);
                engine.publish().unwrap();
            }
            Err(Error::PeerClosed { peer: Peer::Client }) => return engine.frame(),
            Err(e) => panic!("{e}"),
        }
    });
    for n in 1..=1000u64 {
        client.tensor_mut::<f32>("actions").unwrap()[0] = 0.5;
        assert_eq!(client.step(T).unwrap(), n);
        assert_eq!(client.tensor::<f32>("obs").unwrap()[5], 0.5 + n as f32);
        assert_eq!(client.tensor::<u8>("rgb").unwrap()[95], n as u8);
    }
    client.close();
    assert_eq!(server.join().unwrap(), 1000);
    assert!(!common::shm_exists(&name));
}

#[test]
fn engine_close_is_peer_closed_for_the_client() {
    let engine = ready_engine();
    let mut client = Client::attach(engine.name(), AttachOptions::default()).unwrap();
    engine.close();
    let e = client.step(T).unwrap_err();
    assert!(matches!(e, Error::PeerClosed { peer: Peer::Engine }), "{e}");
}

#[test]
fn engine_close_wakes_a_sleeping_client() {
    let engine = ready_engine();
    let name = engine.name().to_string();
    let mut client = Client::attach(
        &name,
        AttachOptions::default().policy(shmbridge::WaitPolicy::BLOCKING),
    )
    .unwrap();
    let waiter = std::thread::spawn(move || client.step(Duration::from_secs(600)));
    let probe = region::Region::open_read_only(&name).unwrap();
    while probe.header().client_waiting == 0 {
        std::thread::yield_now();
    }
    engine.close();
    let e = waiter.join().unwrap().unwrap_err();
    assert!(matches!(e, Error::PeerClosed { peer: Peer::Engine }), "{e}");
}

#[test]
fn client_close_is_peer_closed_for_the_engine() {
    let mut engine = ready_engine();
    let client = Client::attach(engine.name(), AttachOptions::default()).unwrap();
    client.close();
    let e = engine.wait_actions(T).unwrap_err();
    assert!(matches!(e, Error::PeerClosed { peer: Peer::Client }), "{e}");
}

#[test]
fn timeout_then_wait_frame_finishes_the_step() {
    let mut engine = ready_engine();
    let mut client = Client::attach(engine.name(), AttachOptions::default()).unwrap();
    let e = client.step(Duration::from_millis(20)).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    // The step is still in flight: a new one is refused until its frame arrives.
    assert!(matches!(client.step(T).unwrap_err(), Error::OutOfOrder(_)));
    assert_eq!(engine.wait_actions(T).unwrap(), 1);
    engine.publish().unwrap();
    assert_eq!(client.wait_frame(T).unwrap(), 1);
    let e = engine.wait_actions(Duration::from_millis(20)).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
}

#[test]
fn engine_misuse_is_out_of_order() {
    let mut engine = Engine::create(spec()).unwrap();
    assert!(matches!(
        engine.wait_actions(T).unwrap_err(),
        Error::OutOfOrder(_)
    ));
    engine.publish().unwrap();
    assert!(matches!(
        engine.publish().unwrap_err(),
        Error::OutOfOrder(_)
    ));
}

#[test]
fn tensor_access_is_checked() {
    let mut engine = ready_engine();
    let mut client = Client::attach(engine.name(), AttachOptions::default()).unwrap();
    assert!(matches!(
        client.tensor_mut::<f32>("obs").unwrap_err(),
        Error::WrongDirection {
            writer: Peer::Engine,
            ..
        }
    ));
    assert!(matches!(
        engine.tensor_mut::<f32>("actions").unwrap_err(),
        Error::WrongDirection {
            writer: Peer::Client,
            ..
        }
    ));
    assert!(matches!(
        client.tensor::<f64>("obs").unwrap_err(),
        Error::DTypeMismatch { actual: "f32", .. }
    ));
    let e = client.tensor::<f32>("nope").unwrap_err();
    assert!(
        matches!(&e, Error::NoSuchTensor { available, .. } if available.contains("rgb")),
        "{e}"
    );
    let mut io = engine.tensors();
    let _obs = io.write::<f32>("obs").unwrap();
    assert!(matches!(
        io.write::<f32>("obs").unwrap_err(),
        Error::AlreadyBorrowed { .. }
    ));
    assert!(matches!(
        io.read::<f32>("obs").unwrap_err(),
        Error::AlreadyBorrowed { .. }
    ));
    // bool tensors are viewed as u8.
    assert_eq!(io.read::<u8>("terminated").unwrap().len(), 2);
}

/// A client's views have no engine backend, whatever the device (host memory here):
/// asking them for it is a neutral error, not a CUDA one. Device addresses they do give,
/// as the client does: none for a host tensor.
#[test]
fn a_clients_views_have_no_engine_backend_and_give_the_clients_device_addresses() {
    let mut engine = ready_engine();
    assert!(
        engine.tensors().engine_backend().is_ok(),
        "an engine's views have one"
    );
    let mut client = Client::attach(engine.name(), AttachOptions::default()).unwrap();
    let io = client.tensors();
    let e = match io.engine_backend() {
        Ok(_) => panic!("a client's views gave the engine's backend"),
        Err(e) => e,
    };
    assert!(matches!(e, Error::NoDeviceSide(_)), "{e}");
    assert_eq!(e.kind(), ErrorKind::NoDeviceSide);
    assert!(e.to_string().contains("only an engine's views"), "{e}");
    let from_views = io.device_ptr("obs").unwrap_err();
    let from_client = client.device_ptr("obs").unwrap_err();
    assert!(
        matches!(&from_views, Error::NotOnHost { tensor, .. } if tensor == "obs"),
        "{from_views}"
    );
    assert_eq!(from_views.to_string(), from_client.to_string());
}

#[test]
fn names_and_specs_are_checked_before_anything_is_created() {
    let name = format!("api-fixed-{}", std::process::id());
    let a = Engine::create(spec().name(&name)).unwrap();
    let e = Engine::create(spec().name(&name)).unwrap_err();
    assert!(matches!(e, Error::NameInUse { .. }), "{e}");
    drop(a);
    assert!(!common::shm_exists(&format!("shmbridge-{name}")));
    assert!(matches!(
        Engine::create(spec().name("bad/name")).unwrap_err(),
        Error::InvalidName { .. }
    ));
    assert!(matches!(
        Engine::create(EngineSpec::new("x", 1)).unwrap_err(),
        Error::InvalidSpec(_)
    ));
    let e = Client::attach("shmbridge-does-not-exist", AttachOptions::default()).unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
}

#[test]
fn attach_waits_for_frame_zero() {
    let mut engine = Engine::create(spec()).unwrap();
    let e = Client::attach(
        engine.name(),
        AttachOptions::default().timeout(Duration::from_millis(20)),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    engine.publish().unwrap();
    // The client that gave up released its slot: the next one attaches.
    let client = Client::attach(engine.name(), AttachOptions::default()).unwrap();
    assert_eq!(client.frame(), 0);
}

/// The engine reads the attached client's identity and event handle seqlock-style; a
/// host-only client publishes no handle (all zero), and none is read once it closed.
#[test]
fn client_event_handle_is_read_from_the_header() {
    let engine = ready_engine();
    assert_eq!(engine.client_event(), None, "no client yet");
    let client = Client::attach(engine.name(), AttachOptions::default()).unwrap();
    let seen = engine.client_event().expect("attached");
    let me = shmbridge::process::current_pid();
    assert_eq!(seen.pid, me);
    assert_eq!(
        Some(seen.start_time),
        shmbridge::process::process_start_time(me)
    );
    assert_eq!(seen.handle, [0; 64], "host-only layout: no client event");
    client.close();
    assert_eq!(engine.client_event(), None, "closed");
    assert_eq!(
        engine.close_reporting(),
        shmbridge::device::DeviceRelease::NothingHeld
    );
}

/// `EngineSpec::tensor_on` / `place` declare CUDA tensors; creating such an engine where
/// CUDA is unusable (this machine: no driver, or a build without `cuda`) is a typed
/// `CudaUnavailable` with the reason, and leaves no region behind.
#[test]
fn cuda_specs_are_declared_and_refused_without_a_driver() {
    use shmbridge::device::Device;
    let cuda_spec = EngineSpec::new("api-cuda", 2)
        .tensor_on(
            "obs",
            DType::F32,
            &[2, 4],
            Direction::EngineToClient,
            Device::cuda(0),
        )
        .tensor("actions", DType::F32, &[2, 1], Direction::ClientToEngine)
        .place("actions", Device::cuda(0))
        .name("shmbridge-api-cuda-refused");
    assert!(cuda_spec
        .tensors
        .iter()
        .all(|t| t.device == Device::cuda(0)));
    if shmbridge::device::probe().is_ok() {
        eprintln!("SKIPPED: CUDA is usable here; tests/cuda.rs covers the GPU path");
        return;
    }
    let e = Engine::create(cuda_spec).unwrap_err();
    assert!(
        matches!(&e, Error::CudaUnavailable { reason } if !reason.is_empty()),
        "{e}"
    );
    assert!(!common::shm_exists("shmbridge-api-cuda-refused"));
    // Host-only specs are untouched by `place` of an unknown name.
    let host = spec().place("nope", Device::cuda(0));
    assert!(host.tensors.iter().all(|t| t.device == Device::Host));
}

/// An interrupt hook ends every wait of an attach: for an engine that never publishes
/// frame 0, and for a region whose header is never published (an engine stuck before
/// its magic). Before the fix both waited for the whole timeout (30 s here).
#[test]
fn attach_waits_end_at_the_interrupt_hook() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    // The hook lets a few polls pass, then stops the wait, as a Ctrl-C would.
    let hook = || {
        let calls = Arc::new(AtomicU32::new(0));
        let seen = Arc::clone(&calls);
        let hook: shmbridge::client::Interrupt = Arc::new(move || {
            if seen.fetch_add(1, Ordering::Relaxed) >= 3 {
                Err(Error::Interrupted)
            } else {
                Ok(())
            }
        });
        (
            AttachOptions::default().timeout(T).interrupt(Some(hook)),
            calls,
        )
    };
    let unpublished = Engine::create(spec()).unwrap();
    let (options, calls) = hook();
    assert!(matches!(
        Client::attach(unpublished.name(), options),
        Err(Error::Interrupted)
    ));
    assert!(calls.load(Ordering::Relaxed) > 3);
    // A region file with no header yet: zeroed, its "engine" holding the lock.
    let name = format!("shmbridge-api-unpublished-{}", std::process::id());
    let path = common::shm_path(&name);
    let file = std::fs::File::create_new(&path).unwrap();
    file.set_len(4096).unwrap();
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let (options, _) = hook();
    let attached = Client::attach(&name, options);
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(attached, Err(Error::Interrupted)), "{attached:?}");
}

/// After a wait reported its client's end, the next wait waits for a new client (and its
/// action) rather than reporting the end again at once; `wait_for_client` blocks until
/// one attaches. Before the fix every later wait failed at once with `PeerClosed`.
#[test]
fn an_engine_serves_one_client_after_another_without_spinning() {
    let mut engine = ready_engine();
    let name = engine.name().to_string();
    Client::attach(&name, AttachOptions::default())
        .unwrap()
        .close();
    assert!(matches!(
        engine.wait_actions(T),
        Err(Error::PeerClosed { peer: Peer::Client })
    ));
    assert!(matches!(
        engine.wait_actions(Duration::from_millis(100)),
        Err(Error::Timeout { .. })
    ));
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut c = Client::attach(&name, AttachOptions::default()).unwrap();
            c.step(T).unwrap();
        });
        assert_eq!(engine.wait_actions(T).unwrap(), 1);
        engine.publish().unwrap();
    });
    assert!(matches!(
        engine.wait_actions(T),
        Err(Error::PeerClosed { peer: Peer::Client })
    ));
    let (attached_tx, attached_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let name = &name;
        s.spawn(move || {
            let c = Client::attach(name, AttachOptions::default()).unwrap();
            attached_tx.send(()).unwrap();
            let _ = release_rx.recv();
            c.close();
        });
        engine.wait_for_client(T).unwrap();
        assert!(engine.client_attached());
        attached_rx.recv().unwrap();
        release_tx.send(()).unwrap();
    });
    assert!(matches!(
        engine.wait_for_client(Duration::from_millis(100)),
        Err(Error::Timeout { .. })
    ));
}
