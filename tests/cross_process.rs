//! The real engine binary in one process, a client in this one.

mod common;

use std::time::Duration;

use common::{shm_exists, EngineProc};
use shmbridge::envs::null::{pattern, pattern_u8};
use shmbridge::{AttachOptions, Client, Error, Peer};

const T: Duration = Duration::from_secs(30);

#[test]
fn null_engine_frames_follow_actions() {
    let engine = EngineProc::start(&[
        "--env",
        "null",
        "--num-envs",
        "8",
        "--obs-dim",
        "5",
        "--act-dim",
        "2",
    ]);
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    assert_eq!(client.num_envs(), 8);
    assert_eq!(client.layout().engine_kind, "null");
    // Frame 0 holds the reset pattern as soon as attach returns.
    assert_eq!(client.frame(), 0);
    let obs0: Vec<f32> = client.tensor::<f32>("obs").unwrap().to_vec();
    assert_eq!(obs0, (0..40).map(|k| pattern(0, k)).collect::<Vec<_>>());
    for n in 1..=500u64 {
        {
            let actions = client.tensor_mut::<f32>("actions").unwrap();
            for (i, a) in actions.iter_mut().enumerate() {
                *a = (n * 100 + i as u64) as f32;
            }
        }
        assert_eq!(client.step(T).unwrap(), n);
        let mut io = client.tensors();
        let obs = io.read::<f32>("obs").unwrap();
        assert!(
            obs.iter()
                .enumerate()
                .all(|(k, &v)| v == pattern(n, k as u64)),
            "step {n}"
        );
        let rewards = io.read::<f32>("rewards").unwrap();
        for (i, &r) in rewards.iter().enumerate() {
            assert_eq!(
                r,
                (n * 100 + 2 * i as u64) as f32,
                "reward echo of env {i} at step {n}"
            );
        }
    }
    let name = engine.name.clone();
    client.close();
    let (status, stderr) = engine.finish();
    assert!(status.success(), "engine exit {status:?}: {stderr}");
    assert!(stderr.contains("client closed after 500 steps"), "{stderr}");
    assert!(!shm_exists(&name), "engine left {name} behind");
}

#[test]
fn null_engine_serves_an_image_tensor() {
    let engine = EngineProc::start(&[
        "--env",
        "null",
        "--num-envs",
        "3",
        "--obs-dim",
        "1",
        "--image",
        "5x4x3",
    ]);
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    let rgb = client
        .layout()
        .tensors
        .iter()
        .find(|t| t.name == "rgb")
        .cloned();
    let rgb = rgb.expect("rgb tensor");
    assert_eq!(rgb.shape, vec![3, 5, 4, 3]);
    for n in 1..=20u64 {
        assert_eq!(client.step(T).unwrap(), n);
        let mut io = client.tensors();
        let bytes = io.read::<u8>("rgb").unwrap();
        assert_eq!(bytes.len(), 3 * 5 * 4 * 3);
        assert!(
            bytes
                .iter()
                .enumerate()
                .all(|(k, &v)| v == pattern_u8(n, k as u64)),
            "step {n}"
        );
    }
    client.close();
    let (status, stderr) = engine.finish();
    assert!(status.success(), "engine exit {status:?}: {stderr}");
}

#[test]
fn cartpole_engine_steps_resets_and_is_seeded() {
    let frame0 = |seed: &str| {
        let engine = EngineProc::start(&["--env", "cartpole", "--num-envs", "16", "--seed", seed]);
        let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
        let obs = client.tensor::<f32>("obs").unwrap().to_vec();
        (engine, client, obs)
    };
    let (e1, c1, a) = frame0("3");
    let (e2, c2, b) = frame0("3");
    let (e3, c3, c) = frame0("4");
    assert_eq!(a, b, "same seed, same initial observations");
    assert_ne!(a, c, "another seed, other observations");
    assert!(a.iter().all(|v| v.abs() <= 0.05));
    drop((c2, c3, e2, e3));

    // Push right until every env has ended once: each ends by termination (within ~60
    // steps) with reward 1, and its next observation is a fresh start.
    let mut client = c1;
    let mut ended = [false; 16];
    let mut steps = 0;
    while !ended.iter().all(|&e| e) {
        client.tensor_mut::<i64>("actions").unwrap().fill(1);
        client.step(T).unwrap();
        steps += 1;
        assert!(steps < 200, "pushing right must topple every pole");
        let mut io = client.tensors();
        let rewards = io.read::<f32>("rewards").unwrap();
        let term = io.read::<u8>("terminated").unwrap();
        let trunc = io.read::<u8>("truncated").unwrap();
        let obs = io.read::<f32>("obs").unwrap();
        let last = io.read::<f32>("final_obs").unwrap();
        for i in 0..16 {
            assert_eq!(rewards[i], 1.0);
            assert_eq!(trunc[i], 0);
            let row = i * 4..i * 4 + 4;
            if term[i] == 1 {
                ended[i] = true;
                assert!(
                    obs[row.clone()].iter().all(|v| v.abs() <= 0.05),
                    "autoreset"
                );
                // final_obs keeps the terminal state: the cart past 2.4 or the pole
                // past 12 degrees.
                let (x, theta) = (last[i * 4], last[i * 4 + 2]);
                assert!(
                    x.abs() > 2.4 || theta.abs() > 0.2094,
                    "final_obs {:?}",
                    &last[row]
                );
            } else {
                assert_eq!(obs[row.clone()], last[row], "final_obs of a running env");
            }
        }
    }
    // reset_mask: env 0 is reset, gets reward 0 and no flags; the others step.
    client.tensor_mut::<u8>("reset_mask").unwrap()[0] = 1;
    client.step(T).unwrap();
    {
        let mut io = client.tensors();
        assert_eq!(io.read::<f32>("rewards").unwrap()[0], 0.0);
        assert_eq!(io.read::<f32>("rewards").unwrap()[1], 1.0);
        assert!(io.read::<f32>("obs").unwrap()[..4]
            .iter()
            .all(|v| v.abs() <= 0.05));
    }
    let name = e1.name.clone();
    client.close();
    assert!(e1.finish().0.success());
    assert!(!shm_exists(&name));
}

#[test]
fn second_client_is_refused_while_first_is_attached() {
    let engine = EngineProc::start(&["--env", "null", "--num-envs", "1"]);
    let first = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    let err = Client::attach(&engine.name, AttachOptions::default()).unwrap_err();
    assert!(
        matches!(err, Error::AlreadyAttached { pid, .. } if pid == std::process::id()),
        "{err}"
    );
    drop(first);
    assert!(engine.finish().0.success());
}

#[test]
fn engine_terminated_by_signal_removes_its_region() {
    let engine = EngineProc::start(&["--env", "null", "--num-envs", "1"]);
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    client.step(T).unwrap();
    common::signal(engine.pid(), rustix::process::Signal::TERM);
    let name = engine.name.clone();
    let (status, _) = engine.finish();
    assert!(!status.success());
    assert!(!shm_exists(&name));
    let err = client.step(T).unwrap_err();
    assert!(
        matches!(
            err,
            Error::PeerDied {
                peer: Peer::Engine,
                ..
            } | Error::PeerClosed { peer: Peer::Engine }
        ),
        "{err}"
    );
}
