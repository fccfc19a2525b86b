//! Command channel: `Ping` round trip across processes (a client here, the `null` engine
//! binary in a child process), and one-way throughput of 64 B and 64 KiB records through
//! one ring (a producer and a consumer thread on a ring in ordinary memory: the same
//! cache-line traffic as two processes, without a second binary).
//!
//! `cargo bench --bench commands`; `SHMBRIDGE_BENCH_QUICK=1` for a smoke run. After
//! criterion it prints a summary measured by its own loop: Ping median and p99 over
//! individually timed calls, and records/s and GB/s per record size.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use shmbridge::ring::HeapRing;
use shmbridge::{AttachOptions, Client, Peer, WaitPolicy};

const T: Duration = Duration::from_secs(10);

struct PingPair {
    child: Child,
    client: Option<Client>,
}

impl PingPair {
    fn start() -> PingPair {
        let mut child = Command::new(env!("CARGO_BIN_EXE_shmbridge"))
            .args(["engine", "--env", "null", "--num-envs", "1"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("engine");
        let mut name = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut name)
            .unwrap();
        let client = Client::attach(name.trim(), AttachOptions::default()).expect("attach");
        PingPair {
            child,
            client: Some(client),
        }
    }
    fn ping(&mut self) {
        let c = self.client.as_mut().unwrap();
        std::hint::black_box(c.ping(&[], T).expect("ping"));
    }
}

impl Drop for PingPair {
    fn drop(&mut self) {
        drop(self.client.take()); // the engine exits when its client closes
        let _ = self.child.wait();
    }
}

/// Pushes `n` records of `size` bytes from one thread and pops them in another; returns
/// the elapsed time. Every record is checked on arrival (length and a tag byte).
fn one_way(heap: &HeapRing, size: usize, n: u64) -> Duration {
    let policy = WaitPolicy::default();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            let ring = heap.ring(Peer::Client);
            let mut rec = vec![0u8; size];
            for i in 0..n {
                rec[0] = i as u8;
                ring.push(&rec, policy, T, || Ok(())).expect("push");
            }
        });
        let ring = heap.ring(Peer::Client);
        let mut out = Vec::with_capacity(size);
        for i in 0..n {
            ring.pop(&mut out, policy, T, || Ok(())).expect("pop");
            assert!(out.len() == size && out[0] == i as u8, "record {i} mangled");
        }
    });
    t0.elapsed()
}

fn main() {
    let quick = std::env::var("SHMBRIDGE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let mut c = if quick {
        Criterion::default()
            .warm_up_time(Duration::from_millis(200))
            .measurement_time(Duration::from_millis(500))
            .sample_size(10)
    } else {
        Criterion::default()
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3))
    }
    .configure_from_args();

    let mut pair = PingPair::start();
    c.bench_function("command/ping_roundtrip", |b| b.iter(|| pair.ping()));
    let heap = HeapRing::new(shmbridge::layout::DEFAULT_RING_CAPACITY).unwrap();
    let mut group = c.benchmark_group("command/one_way");
    for size in [64usize, 64 * 1024] {
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_function(format!("{size}B"), |b| {
            b.iter_custom(|iters| one_way(&heap, size, iters))
        });
    }
    group.finish();
    c.final_summary();

    // Own summary: individually timed pings, interleaved with the throughput runs.
    let (pings, rounds) = if quick { (2_000, 2) } else { (20_000, 5) };
    let mut lat = Vec::with_capacity(pings * rounds);
    let mut tput: [Vec<f64>; 2] = Default::default();
    for _ in 0..rounds {
        for _ in 0..pings / 10 {
            pair.ping();
        }
        for _ in 0..pings {
            let t = Instant::now();
            pair.ping();
            lat.push(t.elapsed().as_nanos() as f64);
        }
        for (k, (size, n)) in [
            (64usize, if quick { 100_000 } else { 2_000_000 }),
            (65536, if quick { 2_000 } else { 40_000 }),
        ]
        .into_iter()
        .enumerate()
        {
            let secs = one_way(&heap, size, n).as_secs_f64();
            tput[k].push(n as f64 / secs);
        }
    }
    drop(pair);
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| lat[((p / 100.0 * lat.len() as f64) as usize).min(lat.len() - 1)];
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!();
    println!(
        "## command channel (bench summary{})",
        if quick { ", QUICK mode" } else { "" }
    );
    println!();
    println!("| measure | median | p99 | samples |");
    println!("|---|---:|---:|---:|");
    println!(
        "| Ping round trip across processes | {:.2} µs | {:.2} µs | {} |",
        pct(50.0) / 1e3,
        pct(99.0) / 1e3,
        lat.len()
    );
    println!();
    println!("| one-way records | records/s (median of {rounds} runs) | GB/s |");
    println!("|---|---:|---:|");
    for (k, size) in [64u64, 65536].into_iter().enumerate() {
        let r = med(&mut tput[k]);
        println!(
            "| {size} B | {:.2} M | {:.2} |",
            r / 1e6,
            r * size as f64 / 1e9
        );
    }
}
