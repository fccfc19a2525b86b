//! The step of one revision against another's: the harness `scripts/bench-ab.sh` builds
//! against a base revision and against the working tree, then runs alternately.
//!
//! It uses only calls every revision since protocol 1.1 has (`Engine::create`,
//! `publish`, `wait_actions`, `Client::attach`, `io`, `step`, the `shmbridge engine`
//! CLI), so the script can copy this file into an older checkout and build it there.
//!
//! * `step_ab time ENGINE_EXE STEPS`: starts `ENGINE_EXE engine --env null --num-envs 1
//!   --obs-dim 16 --act-dim 1 --sparse` (the `roundtrip/null_64B` case of
//!   `benches/roundtrip.rs`), attaches with the default (spinning) policy, makes 2,000
//!   warm-up steps, then STEPS steps timed in batches of 100 (write `actions[0]`, `step`,
//!   read the first and last `obs`), and prints the batch means (ns per step) on one line.
//! * `step_ab count STEPS`: engine and client in this one thread, every wait already
//!   satisfied when it starts (below), for an instruction count under
//!   `valgrind --tool=callgrind`: no spin, no sleep, so the count per step is exact and
//!   the same on a busy machine as on an idle one.
//! * `step_ab cost STEPS`: the loop of `count`, timed: the nanoseconds of one step's code
//!   alone (no cache line crosses to another core, no wait), one figure per run of STEPS
//!   steps, on one line. A busy machine only adds time: the smallest of several runs is
//!   the figure that survives noise.
//! * `step_ab report BASE_FILE HEAD_FILE`: reads the `time` lines of each side (one line
//!   per round, rounds in the order run) and prints medians, p99s and ratios.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use shmbridge::layout::{offsets, DType, Direction};
use shmbridge::{AttachOptions, Client, Engine, EngineSpec};

const BATCH: usize = 100;
const WARMUP: usize = 2_000;
const TIMEOUT: Duration = Duration::from_secs(10);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage =
        "usage: step_ab time ENGINE_EXE STEPS | count STEPS | cost STEPS | report BASE HEAD";
    let code = match args.get(1).map(String::as_str) {
        Some("time") if args.len() == 4 => time(&args[2], parse(&args[3])),
        Some("count") if args.len() == 3 => count(parse(&args[2]) as u64).map(|_| ()),
        Some("cost") if args.len() == 3 => {
            let steps = parse(&args[2]) as u64;
            count(steps)
                .map(|elapsed| println!("{:.1}", elapsed.as_nanos() as f64 / steps.max(1) as f64))
        }
        Some("report") if args.len() == 4 => report(&args[2], &args[3]),
        _ => Err(usage.to_string()),
    };
    if let Err(e) = code {
        eprintln!("step_ab: {e}");
        std::process::exit(1);
    }
}

fn parse(s: &str) -> usize {
    s.parse().unwrap_or_else(|_| {
        eprintln!("step_ab: not a count: {s}");
        std::process::exit(2)
    })
}

fn time(engine_exe: &str, steps: usize) -> Result<(), String> {
    let mut child = Command::new(engine_exe)
        .args([
            "engine",
            "--env",
            "null",
            "--num-envs",
            "1",
            "--obs-dim",
            "16",
        ])
        .args(["--act-dim", "1", "--sparse"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {engine_exe}: {e}"))?;
    let mut name = String::new();
    let stdout = child.stdout.take().expect("piped");
    let _ = BufReader::new(stdout).read_line(&mut name);
    let result = time_steps(name.trim(), steps);
    // The engine exits when its client closes (`time_steps` dropped it); if the attach
    // failed it may still wait for one.
    let t0 = Instant::now();
    while child.try_wait().ok().flatten().is_none() {
        if t0.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let means = result?;
    let line: Vec<String> = means.iter().map(|m| format!("{m:.1}")).collect();
    println!("{}", line.join(" "));
    Ok(())
}

fn time_steps(name: &str, steps: usize) -> Result<Vec<f64>, String> {
    let mut client = Client::attach(name, AttachOptions::default())
        .map_err(|e| format!("attaching to {name:?}: {e}"))?;
    let layout = client.layout();
    let actions = layout.id("actions").map_err(|e| e.to_string())?;
    let obs = layout.id("obs").map_err(|e| e.to_string())?;
    let mut n: u64 = 0;
    let mut step = |client: &mut Client| -> Result<(), String> {
        n += 1;
        client
            .tensors()
            .write::<f32>(actions)
            .map_err(|e| e.to_string())?[0] = (n & 0xFFFFF) as f32;
        client.step(TIMEOUT).map_err(|e| e.to_string())?;
        let mut io = client.tensors();
        let o = io.read::<f32>(obs).map_err(|e| e.to_string())?;
        std::hint::black_box(o[0]);
        std::hint::black_box(o[o.len() - 1]);
        Ok(())
    };
    for _ in 0..WARMUP {
        step(&mut client)?;
    }
    let mut means = Vec::with_capacity(steps / BATCH);
    for _ in 0..(steps / BATCH).max(1) {
        let t0 = Instant::now();
        for _ in 0..BATCH {
            step(&mut client)?;
        }
        means.push(t0.elapsed().as_nanos() as f64 / BATCH as f64);
    }
    client.close();
    Ok(means)
}

/// Engine and client of one region in this thread. The harness stores `action_seq = n`
/// itself first (a plain store of the value the client's `step` then posts again), so
/// the engine's `wait_actions` finds action n at its first look; the engine publishes
/// frame n, and the client's `step` finds frame n at its first look. Every call on the
/// step path runs in full, once, with no wait.
fn count(steps: u64) -> Result<Duration, String> {
    let spec = EngineSpec::new("null", 1)
        .tensor("obs", DType::F32, &[1, 16], Direction::EngineToClient)
        .tensor("actions", DType::F32, &[1, 1], Direction::ClientToEngine);
    let mut engine = Engine::create(spec).map_err(|e| e.to_string())?;
    engine.publish().map_err(|e| e.to_string())?;
    let mut client =
        Client::attach(engine.name(), AttachOptions::default()).map_err(|e| e.to_string())?;
    let layout = client.layout();
    let actions = layout.id("actions").map_err(|e| e.to_string())?;
    let obs = layout.id("obs").map_err(|e| e.to_string())?;
    let obs_offset = layout.tensor("obs").map_err(|e| e.to_string())?.1.offset as usize;
    let obs_addr = client.tensors().address(obs).map_err(|e| e.to_string())?;
    // SAFETY: `obs_addr` is `obs_offset` bytes into the client's mapping of the region,
    // whose control block starts the mapping; `action_seq` is an 8-aligned u64 of the
    // control block, accessed only atomically by every side, and the mapping outlives
    // `client`, which this function closes last.
    let action_seq = unsafe {
        let base = obs_addr.sub(obs_offset);
        &*(base.add(offsets::ACTION_SEQ) as *const AtomicU64)
    };
    let t0 = Instant::now();
    for n in 1..=steps {
        action_seq.store(n, Ordering::Release);
        let a = engine.wait_actions(TIMEOUT).map_err(|e| e.to_string())?;
        {
            let mut io = engine.tensors();
            let act = io.read::<f32>(actions).map_err(|e| e.to_string())?[0];
            let o = io.write::<f32>(obs).map_err(|e| e.to_string())?;
            o[0] = act;
            let last = o.len() - 1;
            o[last] = a as f32;
        }
        engine.publish().map_err(|e| e.to_string())?;
        client
            .tensors()
            .write::<f32>(actions)
            .map_err(|e| e.to_string())?[0] = (n & 0xFFFFF) as f32;
        client.step(TIMEOUT).map_err(|e| e.to_string())?;
        let mut io = client.tensors();
        let o = io.read::<f32>(obs).map_err(|e| e.to_string())?;
        if o[o.len() - 1] != n as f32 {
            return Err(format!(
                "step {n}: the frame is not the one for this action"
            ));
        }
    }
    let elapsed = t0.elapsed();
    client.close();
    engine.close();
    Ok(elapsed)
}

/// Nearest-rank percentile of sorted data.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    percentile(&s, 50.0)
}

fn read_rounds(path: &str) -> Result<Vec<Vec<f64>>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.split_whitespace()
                .map(|x| x.parse::<f64>().map_err(|e| format!("{path}: {x}: {e}")))
                .collect()
        })
        .collect()
}

fn report(base_path: &str, head_path: &str) -> Result<(), String> {
    let base = read_rounds(base_path)?;
    let head = read_rounds(head_path)?;
    if base.is_empty() || head.is_empty() {
        return Err("no rounds to report".into());
    }
    let all = |rounds: &[Vec<f64>]| {
        let mut v: Vec<f64> = rounds.iter().flatten().copied().collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let (b, h) = (all(&base), all(&head));
    // Each round ran base and head back to back: their ratio is the least disturbed by a
    // machine whose speed drifts between rounds.
    let paired: Vec<f64> = base
        .iter()
        .zip(&head)
        .map(|(rb, rh)| median(rh) / median(rb))
        .collect();
    let mut paired_sorted = paired.clone();
    paired_sorted.sort_by(f64::total_cmp);
    println!("| side | median ns/step | p99 ns/step | best round median | rounds | batches |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (label, rounds, all) in [("base", &base, &b), ("head", &head, &h)] {
        let best = rounds.iter().map(|r| median(r)).fold(f64::MAX, f64::min);
        println!(
            "| {label} | {:.1} | {:.1} | {:.1} | {} | {} |",
            percentile(all, 50.0),
            percentile(all, 99.0),
            best,
            rounds.len(),
            all.len()
        );
    }
    println!();
    println!(
        "head/base: median {:.3}, p99 {:.3}; per-round ratios median {:.3} (min {:.3}, max {:.3}, \
         {} of {} rounds faster)",
        percentile(&h, 50.0) / percentile(&b, 50.0),
        percentile(&h, 99.0) / percentile(&b, 99.0),
        percentile(&paired_sorted, 50.0),
        paired_sorted[0],
        paired_sorted[paired_sorted.len() - 1],
        paired.iter().filter(|&&r| r < 1.0).count(),
        paired.len()
    );
    Ok(())
}
