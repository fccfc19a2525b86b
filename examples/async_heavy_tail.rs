//! Asynchronous batches against lock-step on a synthetic env whose step time is heavy-
//! tailed: N envs in K shards (threads, each with its own mapping, as processes have);
//! each shard's step takes a Pareto-distributed time (shape 1.5, minimum 50 µs, capped at
//! 20 ms), spent asleep, so the figure measures how long the learner waits for slow
//! shards, not how the shards share this machine's cores. Prints env-steps per second for
//! lock-step (every step waits for the slowest shard) and for batches of B envs, and the
//! learner's idle time: the time spent inside the one call that waits for frames
//! (`step` in lock-step, `recv` with batches; `send` does not wait), timed around each
//! call, per batch and per env step (that time over the batch's envs: N in lock-step, B
//! with batches), median and p99 over the batches, and the share of the run's wall time
//! it makes up (this learner does nothing between batches), as markdown rows.
//!
//!   cargo run --release --example async_heavy_tail [N] [K] [STEPS]
use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg32;
use shmbridge::command::{CommandError, CommandHandler, ResetRequest};
use shmbridge::engine::JoinOptions;
use shmbridge::{AttachOptions, Client, DType, Direction, Engine, EngineSpec, Error, Tensors};

const T: Duration = Duration::from_secs(60);

/// Takes `async_reset`'s reset (the synthetic env has no state).
struct Resets;

impl CommandHandler for Resets {
    fn reset(&mut self, _: &mut Tensors<'_>, _: &ResetRequest) -> Result<(), CommandError> {
        Ok(())
    }
}

fn serve(mut engine: Engine, seed: u64) {
    let mut rng = Pcg32::seed_from_u64(seed);
    engine.publish().unwrap();
    loop {
        match engine.wait_actions_with(T, &mut Resets) {
            Ok(_) => {
                let u: f64 = rng.random_range(1e-9..1.0);
                let us = (50.0 / u.powf(1.0 / 1.5)).min(20_000.0);
                std::thread::sleep(Duration::from_micros(us as u64));
                engine.publish().unwrap();
            }
            Err(Error::PeerClosed { .. }) => return,
            Err(e) => panic!("{e}"),
        }
    }
}

fn start(n: u32, k: u32, seed: u64) -> (Client, Vec<std::thread::JoinHandle<()>>) {
    let spec = EngineSpec::new("heavy-tail", n)
        .tensor("obs", DType::F32, &[n as u64, 4], Direction::EngineToClient)
        .tensor(
            "actions",
            DType::F32,
            &[n as u64],
            Direction::ClientToEngine,
        )
        .shards(k);
    let creator = Engine::create(spec).unwrap();
    let name = creator.name().to_string();
    let mut threads = vec![std::thread::spawn(move || serve(creator, seed))];
    for s in 1..k {
        let name = name.clone();
        threads.push(std::thread::spawn(move || {
            serve(
                Engine::join(&name, s, JoinOptions::default()).unwrap(),
                seed + u64::from(s),
            )
        }));
    }
    let client = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
    (client, threads)
}

/// One mode's run: its batches' waits (seconds) and its wall time.
struct Run {
    batch: u32,
    waits: Vec<f64>,
    wall: f64,
}

impl Run {
    fn rate(&self) -> f64 {
        (self.waits.len() as f64) * f64::from(self.batch) / self.wall
    }

    /// Nearest-rank percentile `p` (0..=100) of the waits, per batch.
    fn wait(&self, p: f64) -> f64 {
        let mut w = self.waits.clone();
        w.sort_by(f64::total_cmp);
        let rank = ((p / 100.0) * w.len() as f64).ceil() as usize;
        w[rank.clamp(1, w.len()) - 1]
    }

    fn row(&self, mode: &str, lock_step: f64) {
        let (median, p99) = (self.wait(50.0), self.wait(99.0));
        let per_env = |s: f64| s * 1e9 / f64::from(self.batch);
        println!(
            "| {mode} | {:.0} | {:.2}× | {:.1} | {:.1} | {:.0} | {:.0} | {:.1} % |",
            self.rate(),
            self.rate() / lock_step,
            median * 1e6,
            p99 * 1e6,
            per_env(median),
            per_env(p99),
            100.0 * self.waits.iter().sum::<f64>() / self.wall,
        );
    }
}

/// `batches` batches of `b` envs (`None`: lock-step `step`s of all N), each call that
/// waits for frames timed.
fn run(n: u32, k: u32, b: Option<u32>, batches: u64) -> Run {
    let (mut client, threads) = start(n, k, 1);
    let mut waits = Vec::with_capacity(batches as usize);
    if let Some(b) = b {
        client
            .async_reset(b as usize, &[], T)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let t = Instant::now();
    for _ in 0..batches {
        let w = Instant::now();
        match b {
            None => {
                client.step(T).unwrap();
                waits.push(w.elapsed().as_secs_f64());
            }
            Some(_) => {
                let ids = client.recv(T).unwrap().to_vec();
                waits.push(w.elapsed().as_secs_f64());
                client.send(&ids).unwrap();
            }
        }
    }
    let wall = t.elapsed().as_secs_f64();
    client.close();
    threads.into_iter().for_each(|t| t.join().unwrap());
    Run {
        batch: b.unwrap_or(n),
        waits,
        wall,
    }
}

fn main() {
    let arg = |i: usize, d: u64| std::env::args().nth(i).map_or(d, |a| a.parse().unwrap());
    let (n, k, steps) = (arg(1, 64) as u32, arg(2, 4) as u32, arg(3, 2000));
    println!(
        "N = {n}, K = {k}: {steps} lock-step steps, and as many env-steps in batches of B (STEPS·N/B batches); step time Pareto(1.5), ≥ 50 µs, ≤ 20 ms, per shard"
    );
    println!("idle: the learner's time in step (lock-step) or recv (batches), per batch and per env step");
    println!(
        "| mode | env-steps/s | ÷ lock-step | idle µs/batch, median | p99 | idle ns/env-step, median | p99 | idle share of wall |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let lock_step = run(n, k, None, steps);
    lock_step.row("lock-step", lock_step.rate());
    for b in [n / 2, n / 4] {
        if b == 0 || b % (n / k) != 0 {
            continue;
        }
        // Batches of b envs: as many env-steps as lock-step took in total.
        let batched = run(n, k, Some(b), steps * u64::from(n) / u64::from(b));
        batched.row(&format!("async B = {b}"), lock_step.rate());
    }
}
