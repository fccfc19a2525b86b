//! Asynchronous batches against lock-step on a synthetic env whose step time is heavy-
//! tailed: N envs in K shards (threads, each with its own mapping, as processes have);
//! each shard's step takes a Pareto-distributed time (shape 1.5, minimum 50 µs, capped at
//! 20 ms), spent asleep, so the figure measures how long the learner waits for slow
//! shards, not how the shards share this machine's cores. Prints env-steps per second for
//! lock-step (every step waits for the slowest shard) and for batches of B envs.
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

fn main() {
    let arg = |i: usize, d: u64| std::env::args().nth(i).map_or(d, |a| a.parse().unwrap());
    let (n, k, steps) = (arg(1, 64) as u32, arg(2, 4) as u32, arg(3, 2000));
    println!("N = {n}, K = {k}, {steps} batches of each kind; step time Pareto(1.5), ≥ 50 µs, ≤ 20 ms, per shard");
    let (mut client, threads) = start(n, k, 1);
    let t = Instant::now();
    for _ in 0..steps {
        client.step(T).unwrap();
    }
    let lock_step = (steps * u64::from(n)) as f64 / t.elapsed().as_secs_f64();
    client.close();
    threads.into_iter().for_each(|t| t.join().unwrap());
    println!("lock-step           {lock_step:>10.0} env-steps/s");
    for b in [n / 2, n / 4] {
        if b == 0 || b % (n / k) != 0 {
            continue;
        }
        let (mut client, threads) = start(n, k, 1);
        client
            .async_reset(b as usize, &[], T)
            .unwrap_or_else(|e| panic!("{e}"));
        let t = Instant::now();
        // Batches of b envs: as many env-steps as lock-step took in total.
        let batches = steps * u64::from(n) / u64::from(b);
        for _ in 0..batches {
            let ids = client.recv(T).unwrap().to_vec();
            client.send(&ids).unwrap();
        }
        let rate = (batches * u64::from(b)) as f64 / t.elapsed().as_secs_f64();
        client.close();
        threads.into_iter().for_each(|t| t.join().unwrap());
        println!(
            "async B = {b:<3}       {rate:>10.0} env-steps/s  ({:.2}× lock-step)",
            rate / lock_step
        );
    }
}
