//! One million lock-step steps across processes, every one checked: the frame number, both
//! counters, every observation element against the pattern for that step (a torn or stale
//! frame would show), and the echo of this step's actions (a lost or doubled step would
//! show). Its own test binary, so it runs alone.

mod common;

use std::time::{Duration, Instant};

use common::{shm_exists, EngineProc};
use shmbridge::envs::null::pattern;
use shmbridge::{AttachOptions, Client};

const STEPS: u64 = 1_000_000;

#[test]
fn one_million_steps_every_step_checked() {
    let (envs, obs_dim) = (4u64, 4u64); // obs: 64 bytes
    let engine = EngineProc::start(&[
        "--env",
        "null",
        "--num-envs",
        &envs.to_string(),
        "--obs-dim",
        &obs_dim.to_string(),
        "--act-dim",
        "1",
    ]);
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    let t0 = Instant::now();
    for n in 1..=STEPS {
        {
            let actions = client.tensor_mut::<f32>("actions").unwrap();
            for (i, a) in actions.iter_mut().enumerate() {
                *a = ((n * 4 + i as u64) & 0xFF_FFFF) as f32;
            }
        }
        let frame = client.step(Duration::from_secs(30)).unwrap();
        assert_eq!(frame, n);
        let (action_seq, frame_seq) = client.counters();
        assert_eq!((action_seq, frame_seq), (n, n), "counters at step {n}");
        let mut io = client.tensors();
        let obs = io.read::<f32>("obs").unwrap();
        for (k, &v) in obs.iter().enumerate() {
            assert_eq!(v, pattern(n, k as u64), "obs[{k}] at step {n}");
        }
        let rewards = io.read::<f32>("rewards").unwrap();
        for (i, &r) in rewards.iter().enumerate() {
            assert_eq!(
                r,
                ((n * 4 + i as u64) & 0xFF_FFFF) as f32,
                "echo of env {i} at step {n}"
            );
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "{STEPS} checked steps in {secs:.2} s ({:.2} us/step)",
        secs * 1e6 / STEPS as f64
    );
    let name = engine.name.clone();
    client.close();
    let (status, stderr) = engine.finish();
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("client closed after {STEPS} steps")),
        "{stderr}"
    );
    assert!(!shm_exists(&name));
}

/// A sharded region (1.4) under the same checks: three `null` shard processes, one
/// client, 100 000 steps, every element of every frame checked against the pattern of
/// its step at its index in the whole region (each shard writes its own rows) and every
/// env's reward against this step's action, whichever shard owns the env.
#[test]
fn sharded_steps_every_step_checked() {
    const SHARDED_STEPS: u64 = 100_000;
    let name = format!("stress-shards-{}", std::process::id());
    let shard = |k: u32| {
        let spec = format!("{k}/3");
        EngineProc::start(&[
            "--env",
            "null",
            "--num-envs",
            "7",
            "--obs-dim",
            "3",
            "--name",
            &name,
            "--shard",
            &spec,
        ])
    };
    let engines = [shard(0), shard(1), shard(2)];
    let mut client = Client::attach(&engines[0].name, AttachOptions::default()).unwrap();
    assert_eq!(client.shards().len(), 3);
    let t0 = Instant::now();
    for n in 1..=SHARDED_STEPS {
        {
            let actions = client.tensor_mut::<f32>("actions").unwrap();
            for (i, a) in actions.iter_mut().enumerate() {
                *a = ((n * 8 + i as u64) & 0xFF_FFFF) as f32;
            }
        }
        assert_eq!(client.step(Duration::from_secs(30)).unwrap(), n);
        let mut io = client.tensors();
        let obs = io.read::<f32>("obs").unwrap();
        assert_eq!(obs.len(), 21);
        for (k, &v) in obs.iter().enumerate() {
            assert_eq!(v, pattern(n, k as u64), "obs[{k}] at step {n}");
        }
        let rewards = io.read::<f32>("rewards").unwrap();
        for (i, &r) in rewards.iter().enumerate() {
            assert_eq!(
                r,
                ((n * 8 + i as u64) & 0xFF_FFFF) as f32,
                "env {i} at step {n}"
            );
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "{SHARDED_STEPS} checked steps over 3 shards in {secs:.2} s ({:.2} us/step)",
        secs * 1e6 / SHARDED_STEPS as f64
    );
    let region = engines[0].name.clone();
    client.close();
    for e in engines {
        let (status, stderr) = e.finish();
        assert!(status.success(), "{stderr}");
    }
    assert!(!shm_exists(&region));
}
