//! The pure transport of sharded regions (protocol 1.4): `null` engines, K = 1 (an
//! unsharded region: one engine), 2 and 4 shard processes, one Rust client, under three
//! wait policies on both sides: `default` (what a user gets: it spins 100 µs while the
//! shards and the client fit the cores, else sleeps on the futex at once,
//! `WaitPolicy::adapted_to_shards`), `spin` (a 99 µs spin budget on every side whatever
//! the cores: what the default would do without adapting), `block` (the futex at once)
//! and `hybrid` (the shards spin 99 µs, the client sleeps on the futex at once). Each configuration's processes start once; the rounds
//! interleave them (a few hundred steps each), every step timed with `Instant`. Prints a
//! markdown table: median and p99 per step, env-steps/s (from the mean), and each row's
//! median over K = 1 with the same policy.
//!
//! `cargo bench --bench shards` (`-- --envs N`, default 64; `--obs-dim D`, default 16).
//! `SHMBRIDGE_BENCH_QUICK=1` makes it short, for a smoke run. Idle configurations sleep
//! on their futex (after their spin budget), so they do not disturb the one measured.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shmbridge::envs::null::pattern;
use shmbridge::{AttachOptions, Client, WaitPolicy};

const BIN: &str = env!("CARGO_BIN_EXE_shmbridge");
const T: Duration = Duration::from_secs(30);

struct Config {
    shards: u32,
    policy: &'static str,
    procs: Vec<Child>,
    client: Client,
    times: Vec<f64>,
}

fn start(shards: u32, policy: &'static str, envs: u32, obs_dim: u32) -> Config {
    let name = format!("bench-shards-{}-{shards}-{policy}", std::process::id());
    let mut procs = Vec::new();
    let mut region = String::new();
    for k in 0..shards {
        let mut cmd = Command::new(BIN);
        cmd.args(["engine", "--env", "null", "--num-envs", &envs.to_string()]);
        cmd.args(["--obs-dim", &obs_dim.to_string(), "--name", &name]);
        if shards > 1 {
            cmd.args(["--shard", &format!("{k}/{shards}")]);
        }
        match policy {
            "block" => {
                cmd.arg("--blocking");
            }
            "spin" | "hybrid" => {
                cmd.args(["--spin-us", "99"]);
            }
            _ => {}
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn shmbridge engine");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("read the region name");
        region = line.trim().to_string();
        assert!(region.starts_with("shmbridge-"), "engine printed {line:?}");
        procs.push(child);
    }
    let wait = match policy {
        "block" | "hybrid" => WaitPolicy::BLOCKING,
        "spin" => WaitPolicy::spinning(Duration::from_micros(99)),
        _ => WaitPolicy::default(),
    };
    let client = Client::attach(&region, AttachOptions::default().policy(wait)).expect("attach");
    Config {
        shards,
        policy,
        procs,
        client,
        times: Vec::new(),
    }
}

impl Config {
    fn run(&mut self, steps: usize) {
        for _ in 0..steps {
            let t = Instant::now();
            let n = self.client.step(T).expect("step");
            self.times.push(t.elapsed().as_secs_f64());
            // The frame is whole: first and last element of obs hold this step's pattern.
            let obs = self.client.tensor::<f32>("obs").expect("obs");
            let last = obs.len() - 1;
            assert_eq!(obs[0], pattern(n, 0));
            assert_eq!(obs[last], pattern(n, last as u64));
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn arg(args: &[String], flag: &str, default: u32) -> u32 {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = std::env::var("SHMBRIDGE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0")
        || !args.iter().any(|a| a == "--bench");
    let envs = arg(&args, "--envs", 64);
    let obs_dim = arg(&args, "--obs-dim", 16);
    let (rounds, steps) = if quick { (2, 50) } else { (20, 500) };
    let mut configs: Vec<Config> = Vec::new();
    for policy in ["default", "spin", "block", "hybrid"] {
        for shards in [1, 2, 4] {
            configs.push(start(shards, policy, envs, obs_dim));
        }
    }
    for c in &mut configs {
        c.run(steps / 5); // warm-up, not kept
        c.times.clear();
    }
    for _ in 0..rounds {
        for c in &mut configs {
            c.run(steps);
        }
    }
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "\n### null shards: {envs} envs x {obs_dim} f32, {cores} cores, {rounds} interleaved rounds of {steps} steps{}\n",
        if quick { " (QUICK)" } else { "" }
    );
    println!("| policy | K | median µs/step | p99 µs/step | env-steps/s | median / K=1 |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut base = 0.0;
    for c in &mut configs {
        c.times.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
        let median = percentile(&c.times, 0.5);
        let p99 = percentile(&c.times, 0.99);
        let mean = c.times.iter().sum::<f64>() / c.times.len() as f64;
        if c.shards == 1 {
            base = median;
        }
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.0} | {:.2} |",
            c.policy,
            c.shards,
            median * 1e6,
            p99 * 1e6,
            f64::from(envs) / mean,
            median / base
        );
    }
    for c in configs {
        let Config {
            client, mut procs, ..
        } = c;
        client.close();
        for p in &mut procs {
            let _ = p.wait();
        }
    }
}
