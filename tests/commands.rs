//! The command channel across processes: built-ins, Reset with seeds, engine-defined
//! methods, errors, and calls interleaved with steps.

mod common;

use std::time::Duration;

use common::{signal, EngineProc};
use rustix::process::Signal;
use shmbridge::envs::null::pattern;
use shmbridge::wire::{code, Body, Method};
use shmbridge::{AttachOptions, Client, DType, Direction, Error};

const T: Duration = Duration::from_secs(30);

fn attach(e: &EngineProc) -> Client {
    Client::attach(&e.name, AttachOptions::default()).unwrap()
}

#[test]
fn ping_hello_schema_close() {
    let engine = EngineProc::start(&["--env", "cartpole", "--num-envs", "8"]);
    let mut c = attach(&engine);
    assert_eq!(c.ping(b"abc", T).unwrap(), b"abc");
    assert_eq!(c.ping(&[], T).unwrap(), b"");
    let welcome = c
        .call(
            Method::Hello,
            Body::Hello {
                protocol_major: 1,
                protocol_minor: 1,
                pid: std::process::id(),
                client_name: "test".into(),
            },
            vec![],
            vec![],
            T,
        )
        .unwrap();
    match welcome.body {
        Body::Welcome {
            protocol_major,
            protocol_minor,
            engine_pid,
            engine_kind,
        } => {
            assert_eq!(
                (protocol_major, protocol_minor),
                (1, shmbridge::layout::VERSION_MINOR)
            );
            assert_eq!(engine_pid, engine.pid());
            assert_eq!(engine_kind, "cartpole");
        }
        other => panic!("{other:?}"),
    }
    match c.schema(T).unwrap() {
        Body::Schema {
            num_envs,
            engine_kind,
            tensors,
            metadata,
        } => {
            assert_eq!(num_envs, 8);
            assert_eq!(engine_kind, "cartpole");
            let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
            assert_eq!(
                names,
                [
                    "obs",
                    "actions",
                    "rewards",
                    "terminated",
                    "truncated",
                    "reset_mask",
                    "final_obs"
                ]
            );
            assert_eq!(tensors[0].shape, vec![8, 4]);
            assert_eq!(tensors[0].dtype, DType::F32);
            assert_eq!(tensors[1].dtype, DType::I64);
            assert_eq!(tensors[1].direction, Direction::ClientToEngine);
            let meta = |k: &str| {
                metadata
                    .iter()
                    .find(|(key, _)| key == k)
                    .map(|(_, v)| v.clone())
            };
            assert_eq!(meta("autoreset_mode").as_deref(), Some("same-step"));
            assert_eq!(meta("action_space").as_deref(), Some("discrete:2"));
        }
        other => panic!("{other:?}"),
    }
    let closed = c
        .call(Method::Close, Body::Close, vec![], vec![], T)
        .unwrap();
    assert!(matches!(closed.body, Body::Close));
    drop(c);
    assert!(engine.finish().0.success());
}

#[test]
fn reset_with_seeds_is_reproducible_and_selective() {
    let engine = EngineProc::start(&["--env", "cartpole", "--num-envs", "6"]);
    let mut c = attach(&engine);
    let obs = |c: &mut Client| c.tensor::<f32>("obs").unwrap().to_vec();
    c.reset(None, &[42], T).unwrap();
    let a = obs(&mut c);
    c.tensor_mut::<i64>("actions").unwrap().fill(1);
    c.step(T).unwrap();
    assert_ne!(obs(&mut c), a);
    assert_eq!(
        c.reset(None, &[42], T).unwrap(),
        1,
        "a reset consumes no action"
    );
    assert_eq!(obs(&mut c), a, "same seed, same initial observations");
    c.reset(None, &[43], T).unwrap();
    assert_ne!(obs(&mut c), a, "another seed, others");
    // One seed per env.
    c.reset(None, &[1, 2, 3, 4, 5, 6], T).unwrap();
    let per_env = obs(&mut c);
    c.reset(None, &[1], T).unwrap();
    assert_eq!(
        obs(&mut c),
        per_env,
        "seed s for the list = seeds s, s+1, ... per env"
    );
    // Only envs 1 and 4.
    c.step(T).unwrap();
    let before = obs(&mut c);
    c.reset(Some(&[1, 4]), &[42], T).unwrap();
    let after = obs(&mut c);
    for env in 0..6 {
        let (b, a2) = (&before[env * 4..env * 4 + 4], &after[env * 4..env * 4 + 4]);
        if env == 1 || env == 4 {
            assert!(a2.iter().all(|v| v.abs() <= 0.05));
        } else {
            assert_eq!(a2, b, "env {env} was not asked to reset");
        }
    }
    // Bad requests are error replies, and the engine carries on.
    let e = c.reset(Some(&[9]), &[], T).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                code: code::BAD_REQUEST,
                ..
            }
        ),
        "{e}"
    );
    let e = c.reset(None, &[1, 2], T).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                code: code::BAD_REQUEST,
                ..
            }
        ),
        "{e}"
    );
    c.step(T).unwrap();
}

#[test]
fn engine_defined_methods() {
    // Two engines, same seed; one gets a longer pole: same actions, other trajectories.
    let a = EngineProc::start(&["--env", "cartpole", "--num-envs", "4", "--seed", "7"]);
    let b = EngineProc::start(&["--env", "cartpole", "--num-envs", "4", "--seed", "7"]);
    let (mut ca, mut cb) = (attach(&a), attach(&b));
    let reply = cb
        .call_method("set_pole_length", &[("length", "2.0")], &[], T)
        .unwrap();
    assert_eq!(
        reply.args,
        vec![("previous".to_string(), "0.5".to_string())]
    );
    for c in [&mut ca, &mut cb] {
        c.tensor_mut::<i64>("actions").unwrap().fill(1);
        for _ in 0..5 {
            c.step(T).unwrap();
        }
    }
    assert_ne!(
        ca.tensor::<f32>("obs").unwrap(),
        cb.tensor::<f32>("obs").unwrap()
    );
    let e = ca
        .call_method("set_pole_length", &[("length", "-1")], &[], T)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                code: code::BAD_REQUEST,
                ..
            }
        ),
        "{e}"
    );
    let e = ca.call_method("set_pole_length", &[], &[], T).unwrap_err();
    assert!(
        matches!(&e, Error::Remote { code: code::BAD_REQUEST, message, .. } if message.contains("length")),
        "{e}"
    );
    let e = ca.call_method("fly", &[], &[], T).unwrap_err();
    assert!(
        matches!(&e, Error::Remote { code: code::UNKNOWN_METHOD, message, .. } if message.contains("set_pole_length")),
        "{e}"
    );

    // null: echo, with a large payload.
    let n = EngineProc::start(&["--env", "null", "--num-envs", "1"]);
    let mut cn = attach(&n);
    let payload: Vec<u8> = (0..64 * 1024).map(|i| (i * 7) as u8).collect();
    let reply = cn
        .call_method("echo", &[("k", "v"), ("x", "1")], &payload, T)
        .unwrap();
    assert_eq!(
        reply.args,
        vec![("k".into(), "v".into()), ("x".into(), "1".into())]
    );
    assert_eq!(reply.payload, payload);
    let e = cn.reset(Some(&[0]), &[], T).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                code: code::UNSUPPORTED,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn calls_interleaved_with_steps() {
    let engine = EngineProc::start(&["--env", "null", "--num-envs", "4", "--obs-dim", "3"]);
    let mut c = attach(&engine);
    for n in 1..=2000u64 {
        c.tensor_mut::<f32>("actions").unwrap()[0] = n as f32;
        assert_eq!(c.step(T).unwrap(), n);
        {
            let mut io = c.tensors();
            let obs = io.read::<f32>("obs").unwrap();
            assert!(obs
                .iter()
                .enumerate()
                .all(|(k, &v)| v == pattern(n, k as u64)));
            assert_eq!(io.read::<f32>("rewards").unwrap()[0], n as f32);
        }
        let tag = n.to_le_bytes();
        match n % 3 {
            0 => assert_eq!(c.ping(&tag, T).unwrap(), tag),
            1 => assert_eq!(c.call_method("echo", &[], &tag, T).unwrap().payload, tag),
            _ => {}
        }
    }
}

#[test]
fn oversized_request_is_refused_before_sending() {
    let engine = EngineProc::start(&["--env", "null", "--num-envs", "1"]);
    let mut c = attach(&engine);
    let huge = vec![0u8; 600 * 1024];
    let e = c.call_method("echo", &[], &huge, T).unwrap_err();
    assert!(matches!(e, Error::RecordTooLarge { .. }), "{e}");
    assert_eq!(c.ping(b"still fine", T).unwrap(), b"still fine");
}

#[test]
fn late_reply_to_a_timed_out_call_is_dropped() {
    let engine = EngineProc::start(&["--env", "null", "--num-envs", "1"]);
    let mut c = attach(&engine);
    signal(engine.pid(), Signal::STOP);
    let e = c.ping(b"first", Duration::from_millis(50)).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    signal(engine.pid(), Signal::CONT);
    // The engine answers "first" now; this call must get its own reply.
    assert_eq!(c.ping(b"second", T).unwrap(), b"second");
    c.step(T).unwrap();
}

#[test]
fn interrupt_hook_stops_a_waiting_call_and_is_consulted_only_per_sleep_slice() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    let engine = EngineProc::start(&["--env", "null", "--num-envs", "1"]);
    let mut c = attach(&engine);
    let calls = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&calls);
    // Lets the wait sleep twice, then interrupts it.
    c.set_interrupt(Some(Arc::new(move || {
        if seen.fetch_add(1, Ordering::SeqCst) >= 2 {
            Err(Error::Interrupted)
        } else {
            Ok(())
        }
    })));
    signal(engine.pid(), Signal::STOP);
    let e = c.ping(b"first", T).unwrap_err();
    assert!(matches!(e, Error::Interrupted), "{e}");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    signal(engine.pid(), Signal::CONT);
    calls.store(0, Ordering::SeqCst);
    // From here the hook only counts: a wait reaches its sleep (and the hook) whenever
    // the engine is descheduled, and on a busy machine, where waiters do not spin, at
    // every wait the engine does not answer within a few microseconds.
    let counted = Arc::clone(&calls);
    c.set_interrupt(Some(Arc::new(move || {
        counted.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })));
    // The late reply to "first" is dropped; "second" gets its own. The hook runs at
    // sleep slices only, not per spin: at most about once per wait here.
    assert_eq!(c.ping(b"second", T).unwrap(), b"second");
    for _ in 0..100 {
        c.step(T).unwrap();
    }
    assert!(calls.load(Ordering::SeqCst) <= 101);
    c.set_interrupt(None);
    c.step(T).unwrap();
}

#[test]
fn malformed_request_is_refused_before_sending() {
    let engine = EngineProc::start(&["--env", "cartpole", "--num-envs", "4"]);
    let mut c = attach(&engine);
    // Two seeds for three envs: not "none, one, or one per env".
    let e = c.reset(Some(&[0, 1, 2]), &[1, 2], T).unwrap_err();
    assert!(matches!(e, Error::BadMessage(_)), "{e}");
    assert_eq!(c.ping(b"ok", T).unwrap(), b"ok");
}

#[test]
fn reply_too_large_for_the_ring_is_an_error_reply_not_a_dead_engine() {
    let engine = EngineProc::start(&["--env", "null", "--num-envs", "1"]);
    let mut c = attach(&engine);
    // Fits the request ring, but the echoed reply is a few bytes longer than a request.
    let payload = vec![1u8; 512 * 1024 - 72];
    match c.call_method("echo", &[], &payload, T) {
        Err(Error::Remote {
            code: code::ENGINE_ERROR,
            message,
            ..
        }) => {
            assert!(message.contains("does not fit"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.ping(b"alive", T).unwrap(), b"alive");
    c.step(T).unwrap();
}
