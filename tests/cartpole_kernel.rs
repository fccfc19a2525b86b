//! The GPU cartpole's own kernel source (kernels/cartpole.cu), compiled for the host with
//! a C++ compiler through `tests/host_kernels/cuda_shim.h` and launched one "thread" at a
//! time as `src/envs/gpu.rs` launches it (`tests/host_kernels/cartpole_runner.cpp`), agrees
//! bit for bit with the CPU engine (`shmbridge engine --env cartpole`) for the same seed,
//! actions, `reset_mask`, `Reset` commands and `set_pole_length`: observations,
//! `final_obs`, rewards and the termination and truncation flags, across many episodes
//! ended at both thresholds (|x| > 2.4, |theta| > 12°) and at 500 steps.
//!
//! Compiled with `-ffp-contract=off`, the host counterpart of NVRTC's `--fmad=false`
//! (`envs::kernels::COMPILE_OPTIONS`): every multiply and add rounds on its own, as in the
//! Rust engine. So what this checks is the kernel's arithmetic in source order, its
//! constants and comparisons, its same-step autoreset and `final_obs`, and the reset
//! scheme (the host's `ResetUpload` plus the kernel's generator) against the CPU engine.
//! What it cannot check is the device's `sincos` (CUDA's is within 2 ulp, glibc's is
//! what the CPU engine uses): `tests/cuda.rs` compares the real GPU engine with a
//! tolerance for that. Without a C++ compiler it prints `SKIPPED` and returns.

mod common;

use common::{f32s, next_random};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use shmbridge::envs::kernels::ResetUpload;
use shmbridge::{AttachOptions, Client, ResetRequest};

const T: Duration = Duration::from_secs(10);

/// The runner built from the kernel source with `flags`, in `dir`; `None` (after printing
/// why) where there is no C++ compiler (`$CXX`, else `c++`).
fn build_runner(dir: &Path, flags: &[&str]) -> Option<PathBuf> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/host_kernels/cartpole_runner.cpp");
    let exe = dir.join("cartpole_runner");
    let out = match Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-Wall", "-Wextra"])
        .args(flags)
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("SKIPPED: no C++ compiler ({cxx}: {e})");
            return None;
        }
    };
    assert!(
        out.status.success(),
        "{cxx} {flags:?} {}: {}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}

/// One frame as the host reads it.
#[derive(Debug, Clone, PartialEq)]
struct Frame {
    obs: Vec<f32>,
    final_obs: Vec<f32>,
    rewards: Vec<f32>,
    terminated: Vec<u8>,
    truncated: Vec<u8>,
}

/// What the GPU engine would run for one operation, as the runner's input encodes it.
struct Input(Vec<u8>);

impl Input {
    fn u64(&mut self, v: u64) {
        self.0.extend(v.to_ne_bytes());
    }

    /// `GpuCartPole::queue_reset`: the upload, then its kernels.
    fn reset(&mut self, up: &ResetUpload) {
        self.u64(1);
        self.u64(up.bytes.len() as u64);
        self.0.extend(&up.bytes);
        for v in [up.n, up.counts_at, up.states_at, up.incs_at] {
            self.u64(v as u64);
        }
        self.u64(u64::from(up.seeded));
    }

    /// `GpuCartPole::step`.
    fn step(&mut self, actions: &[i64], mask: &[u8], length: f64) {
        self.u64(2);
        self.0.extend(actions.iter().flat_map(|a| a.to_ne_bytes()));
        self.0.extend(mask);
        self.0.extend(length.to_ne_bytes());
    }
}

/// Runs the runner on `input` (ended here); the frame after each operation.
fn run(exe: &Path, dir: &Path, mut input: Input, n: usize) -> Vec<Frame> {
    input.u64(0);
    let (inp, outp) = (dir.join("input"), dir.join("output"));
    std::fs::write(&inp, &input.0).unwrap();
    let out = Command::new(exe).arg(&inp).arg(&outp).output().unwrap();
    assert!(
        out.status.success(),
        "runner: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&outp).unwrap();
    let size = 4 * (4 * n) * 2 + 4 * n + 2 * n;
    assert_eq!(bytes.len() % size, 0);
    bytes
        .chunks_exact(size)
        .map(|f| {
            let (obs, f) = f.split_at(16 * n);
            let (final_obs, f) = f.split_at(16 * n);
            let (rewards, f) = f.split_at(4 * n);
            let (terminated, truncated) = f.split_at(n);
            Frame {
                obs: f32s(obs),
                final_obs: f32s(final_obs),
                rewards: f32s(rewards),
                terminated: terminated.to_vec(),
                truncated: truncated.to_vec(),
            }
        })
        .collect()
}

fn cpu_frame(client: &mut Client) -> Frame {
    let mut io = client.tensors();
    Frame {
        obs: io.read::<f32>("obs").unwrap().to_vec(),
        final_obs: io.read::<f32>("final_obs").unwrap().to_vec(),
        rewards: io.read::<f32>("rewards").unwrap().to_vec(),
        terminated: io.read::<u8>("terminated").unwrap().to_vec(),
        truncated: io.read::<u8>("truncated").unwrap().to_vec(),
    }
}

/// The first difference between two frames, bit for bit, naming the env.
fn first_difference(g: &Frame, c: &Frame, n: usize) -> Option<String> {
    for e in 0..n {
        let (ge, ce) = (4 * e..4 * e + 4, 4 * e..4 * e + 4);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let diffs = [
            ("terminated", g.terminated[e] != c.terminated[e]),
            ("truncated", g.truncated[e] != c.truncated[e]),
            ("rewards", g.rewards[e].to_bits() != c.rewards[e].to_bits()),
            ("obs", bits(&g.obs[ge.clone()]) != bits(&c.obs[ce.clone()])),
            (
                "final_obs",
                bits(&g.final_obs[ge.clone()]) != bits(&c.final_obs[ce.clone()]),
            ),
        ];
        if let Some((what, _)) = diffs.iter().find(|(_, d)| *d) {
            return Some(format!(
                "env {e}: {what} differ: kernel obs {:?} final_obs {:?} flags {:?}, CPU obs \
                 {:?} final_obs {:?} flags {:?}",
                &g.obs[ge.clone()],
                &g.final_obs[ge],
                (g.terminated[e], g.truncated[e]),
                &c.obs[ce.clone()],
                &c.final_obs[ce],
                (c.terminated[e], c.truncated[e]),
            ));
        }
    }
    None
}

/// Env `e`'s action: random for the first half of the envs (their episodes end at the
/// angle threshold within a few dozen steps); for the others a push that keeps the pole
/// up, from the frame's observation, with a lean of its own per env, so that the cart
/// drifts out at |x| > 2.4 or lasts the 500 steps (truncation).
fn action(e: usize, n: usize, obs: &[f32], rng: &mut u64) -> i64 {
    let r = next_random(rng);
    if e < n / 2 {
        return (r & 1) as i64;
    }
    let (theta, theta_dot) = (obs[4 * e + 2], obs[4 * e + 3]);
    let lean = [0.02, -0.03, 0.05, -0.08][e % 4];
    i64::from(theta + 0.5 * theta_dot + lean > 0.0)
}

#[test]
fn the_cartpole_kernel_on_the_host_matches_the_cpu_engine_bit_for_bit() {
    let dir =
        std::env::temp_dir().join(format!("shmbridge-cartpole-kernel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let Some(exe) = build_runner(&dir, &["-ffp-contract=off"]) else {
        return;
    };
    let (n, seed) = (256usize, u64::MAX - 100); // env seeds wrap
    let engine = common::EngineProc::start(&[
        "--env",
        "cartpole",
        "--num-envs",
        &n.to_string(),
        "--seed",
        &seed.to_string(),
    ]);
    let mut cpu = Client::attach(&engine.name, AttachOptions::default()).unwrap();

    // Frame 0 as `GpuCartPole::reset_all` queues it.
    let mut input = Input(Vec::new());
    input.u64(n as u64);
    let all: Vec<u32> = (0..n as u32).collect();
    let seeds: Vec<u64> = (0..n as u64).map(|e| seed.wrapping_add(e)).collect();
    input.reset(&ResetUpload::new(&all, Some(&seeds)));
    let mut want = vec![cpu_frame(&mut cpu)];

    let resets: [(u64, Option<Vec<u32>>, Vec<u64>); 4] = [
        (100, Some(vec![3, 1, 3, 200]), vec![11, 12, 13, 14]),
        (120, None, vec![123]),
        (450, Some(vec![2, 9, 9, 130]), vec![]),
        (1450, None, vec![]),
    ];
    let (mut rng, mut length) = (seed, 0.5f64);
    let (mut at_x, mut at_theta, mut truncations) = (0usize, 0usize, 0usize);
    for step in 1..=1500u64 {
        if step == 250 {
            let r = cpu
                .call_method("set_pole_length", &[("length", "0.7")], &[], T)
                .unwrap();
            assert_eq!(r.args, vec![("previous".into(), "0.5".into())]);
            length = 0.7;
        }
        if let Some((_, ids, seeds)) = resets.iter().find(|r| r.0 == step) {
            cpu.reset(ids.as_deref(), seeds, T).unwrap();
            let req = ResetRequest {
                env_ids: ids.clone(),
                seeds: seeds.clone(),
                options: Vec::new(),
            };
            let (ids, seeds) = req.plan(n as u32).unwrap();
            input.reset(&ResetUpload::new(&ids, seeds.as_deref()));
            want.push(cpu_frame(&mut cpu));
        }
        let obs = want.last().unwrap().obs.clone();
        let actions: Vec<i64> = (0..n).map(|e| action(e, n, &obs, &mut rng)).collect();
        // Masked resets for the random half only (the others' episodes run their course).
        let mask: Vec<u8> = (0..n)
            .map(|e| u8::from(next_random(&mut rng) % 97 == 0 && e < n / 2))
            .collect();
        {
            let mut io = cpu.tensors();
            io.write::<i64>("actions")
                .unwrap()
                .copy_from_slice(&actions);
            io.write::<u8>("reset_mask").unwrap().copy_from_slice(&mask);
        }
        cpu.step(T).unwrap();
        input.step(&actions, &mask, length);
        let f = cpu_frame(&mut cpu);
        for e in 0..n {
            if f.terminated[e] != 0 {
                let x = f.final_obs[4 * e];
                if x.abs() > 2.4 {
                    at_x += 1;
                } else {
                    at_theta += 1;
                }
            }
            truncations += usize::from(f.truncated[e] != 0);
        }
        want.push(f);
    }
    cpu.close();
    let (status, stderr) = engine.finish();
    assert!(status.success(), "{stderr}");

    let got = run(&exe, &dir, input, n);
    assert_eq!(got.len(), want.len(), "one frame per operation");
    for (k, (g, c)) in got.iter().zip(&want).enumerate() {
        if let Some(d) = first_difference(g, c, n) {
            panic!(
                "frame {k} of {}: the kernel and the CPU engine part: {d}",
                want.len()
            );
        }
    }
    eprintln!(
        "{} frames agree bit for bit; episodes ended at |x| > 2.4: {at_x}, at |theta| > 12°: \
         {at_theta}, truncated at 500 steps: {truncations}",
        want.len()
    );
    // The run reaches every way an episode ends, many times.
    assert!(
        at_x >= 20 && at_theta >= 1000 && truncations >= 20,
        "{at_x} {at_theta} {truncations}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
