//! Round-trip latency: the hardware floor next to the real transport.
//!
//! Three measurements, each a pair of processes in lock step:
//!
//! * `floor`: a raw atomic ping-pong. Two `AtomicU64` on adjacent 64-byte lines of a
//!   shared page (the same spacing as `action_seq` / `frame_seq` in the header); this
//!   process bumps `ping` and spins until a partner process echoes it on `pong`. The page
//!   is a shmbridge region made with [`Engine::create`] (so it is flock-protected,
//!   swept and unlinked like any other); the partner is this bench binary re-executed
//!   with `SHMBRIDGE_BENCH_PARTNER=floor:<region>`, attached with [`Client::attach`].
//! * `roundtrip/null_64B`: `shmbridge engine --env null --num-envs 1 --obs-dim 16
//!   --act-dim 1 --sparse` and a [`Client`]: write `actions[0]`, `step()`, read the first
//!   and last `obs` element.
//! * `roundtrip/null_4096x100`: the same with 4096 envs × 100 obs (1.6 MB) and 12 actions
//!   per env. Sparse mode: the engine touches two elements per tensor, so this shows
//!   whether the cost depends on the payload size (it should not: zero copy).
//!
//! * `c_engine/null_64B`, `c_engine/null_4096x100`: the same two, served by the `null`
//!   engine written in C against the C ABI (`examples/c/null_engine.c`), when
//!   `SHMBRIDGE_BENCH_C_ENGINE` names its executable (`scripts/bench-c.sh` builds it
//!   against the release `libshmbridge.so` and sets it): the C path's cost next to the
//!   Rust engine's, in the same run.
//!
//! After criterion, a summary of its own: interleaved rounds of the three, each timed
//! with `Instant` around batches of 100 round trips; median and p99 of the batch means
//! (per round trip) and the ratios, as a markdown table on stdout.
//!
//! `cargo bench --bench roundtrip`. `SHMBRIDGE_BENCH_QUICK=1` (or `-- --quick`, or
//! `cargo test --benches`) makes it short, for a smoke test. `SHMBRIDGE_BENCH_SUMMARY=0`
//! skips the summary.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::Criterion;
use shmbridge::envs::null::pattern;
use shmbridge::layout::{DType, Direction};
use shmbridge::{AttachOptions, Client, Engine, EngineSpec, TensorId};

const PARTNER_VAR: &str = "SHMBRIDGE_BENCH_PARTNER";
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for a child to get ready or to exit before giving up on it.
const CHILD_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle spins between liveness checks of the other process (a few ms to ~100 ms).
const LIVENESS_SPINS: u64 = 1 << 20;
/// Round trips per timed batch in the summary.
const BATCH: usize = 100;
/// Interleaved rounds in the summary (QUICK: 5). Many short rounds sample a drifting
/// machine (a VM whose vCPUs the host moves around) more evenly than a few long ones.
const ROUNDS: usize = 20;
const QUICK_ROUNDS: usize = 5;

fn main() {
    // A re-executed partner must never reach criterion.
    if let Ok(spec) = std::env::var(PARTNER_VAR) {
        std::process::exit(partner_main(&spec));
    }

    let args: Vec<String> = std::env::args().collect();
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let quick_env = std::env::var("SHMBRIDGE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    // `cargo bench` passes --bench; without it (cargo test --benches) criterion runs each
    // benchmark once as a test, and the summary should be as short.
    let test_mode = !has("--bench") || has("--test");
    let quick = quick_env || has("--quick") || test_mode;

    let mut c = Criterion::default();
    c = if quick_env {
        c.warm_up_time(Duration::from_millis(200))
            .measurement_time(Duration::from_millis(500))
            .sample_size(10)
            .nresamples(10_000)
    } else {
        c.warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3))
            .sample_size(50)
    };
    let mut c = c.configure_from_args();
    run_criterion(&mut c);
    c.final_summary();

    let summary = std::env::var("SHMBRIDGE_BENCH_SUMMARY").map_or(true, |v| v != "0");
    if summary && !has("--list") && !args.iter().any(|a| a.starts_with("--profile-time")) {
        run_summary(quick);
    }
}

// ---------------------------------------------------------------------------------------
// The floor: raw atomic ping-pong between two processes.

/// The 64-byte tensors of the floor page, each on its own cache line. `req` and `resp`
/// carry one data word each way in the `floor_data` variant.
const FLOOR_LINES: [&str; 6] = ["ping", "pong", "stop", "ready", "req", "resp"];

/// Views the first 8 bytes of a tensor as an `AtomicU64` that lives as long as `owner`.
///
/// # Safety
/// `addr` must come from `owner.tensors().address(..)` of a tensor of at least 8 bytes (the
/// engine or client that owns the mapping), and no Rust slice of that tensor may be made
/// while the returned reference lives.
unsafe fn atomic_at<O>(_owner: &O, addr: *const u8) -> &AtomicU64 {
    // SAFETY: per the contract, `addr` points into the owner's live, writable shared
    // mapping; tensor offsets are 64-byte aligned (DATA_ALIGN), enough for AtomicU64, and
    // the tensor holds at least 8 bytes. The mapping lives as long as `owner`, which the
    // returned borrow cannot outlive. Both processes touch these words only through
    // atomics, and nothing in this process makes a slice of them.
    unsafe { &*(addr as *const AtomicU64) }
}

/// The parent's side of the floor: a region it owns and a partner process.
struct Floor {
    engine: Option<Engine>,
    partner: Option<Child>,
    ping: *const AtomicU64,
    pong: *const AtomicU64,
    stop: *const AtomicU64,
    req: *const AtomicU64,
    resp: *const AtomicU64,
    /// Also move one data word each way (a cache line per direction, as a real step
    /// moves its actions and observations).
    data: bool,
    seq: u64,
}

impl Floor {
    fn start(data: bool) -> Floor {
        let mut spec = EngineSpec::new("bench-floor", 1);
        for line in FLOOR_LINES {
            spec = spec.tensor(line, DType::U64, &[8], Direction::EngineToClient);
        }
        let mut engine = Engine::create(spec).expect("creating the floor page");
        // Frame 0 marks the region ready, so the partner's attach returns at once.
        engine.publish().expect("publishing the floor page");
        let [ping, pong, stop, ready, req, resp] = FLOOR_LINES.map(|n| {
            let addr = engine.tensors().address(n).expect("floor tensor");
            // SAFETY: `addr` is from `engine.tensors().address` of a 64-byte tensor; no slice
            // of the floor tensors is ever made. The reference is turned into a raw
            // pointer that `Floor` only dereferences while it holds `engine` (below).
            unsafe { atomic_at(&engine, addr) as *const AtomicU64 }
        });
        let exe = std::env::current_exe().expect("finding the bench binary");
        let mut partner = Command::new(exe)
            .env(
                PARTNER_VAR,
                format!(
                    "{}:{}",
                    if data { "floordata" } else { "floor" },
                    engine.name()
                ),
            )
            .stdin(Stdio::null())
            .spawn()
            .expect("starting the floor partner");
        let t0 = Instant::now();
        // SAFETY: `ready` points into `engine`'s mapping, which lives until this function
        // returns it inside the `Floor` or drops it.
        while unsafe { &*ready }.load(Ordering::Acquire) == 0 {
            if let Ok(Some(status)) = partner.try_wait() {
                panic!("the floor partner exited before it was ready: {status}");
            }
            if t0.elapsed() > CHILD_TIMEOUT {
                let _ = partner.kill();
                let _ = partner.wait();
                panic!("the floor partner was not ready after {CHILD_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Floor {
            engine: Some(engine),
            partner: Some(partner),
            ping,
            pong,
            stop,
            req,
            resp,
            data,
            seq: 0,
        }
    }

    /// One round trip.
    #[inline]
    fn round_trip(&mut self) {
        // SAFETY: the pointers point into `self.engine`'s mapping, which is alive while
        // `self` is (it is only dropped in `finish`, after the last use).
        let (ping, pong, req, resp) =
            unsafe { (&*self.ping, &*self.pong, &*self.req, &*self.resp) };
        self.seq += 1;
        let seq = self.seq;
        if self.data {
            req.store(seq, Ordering::Relaxed);
        }
        ping.store(seq, Ordering::Release);
        let mut spins: u64 = 0;
        while pong.load(Ordering::Acquire) != seq {
            std::hint::spin_loop();
            spins += 1;
            if spins % (LIVENESS_SPINS * 16) == 0 {
                self.check_partner();
            }
        }
        if self.data {
            std::hint::black_box(resp.load(Ordering::Relaxed));
        }
    }

    #[cold]
    fn check_partner(&mut self) {
        let partner = self.partner.as_mut().expect("partner running");
        if let Ok(Some(status)) = partner.try_wait() {
            panic!("the floor partner died mid-measurement: {status}");
        }
    }

    /// Whether the last round trip came back whole (outside the timed part).
    fn check(&self) -> bool {
        // SAFETY: as in `round_trip`.
        let (pong, resp) = unsafe { (&*self.pong, &*self.resp) };
        pong.load(Ordering::Acquire) == self.seq
            && (!self.data || resp.load(Ordering::Acquire) == self.seq)
    }

    /// Stops the partner, waits for it, then removes the page.
    fn finish(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        if let Some(mut partner) = self.partner.take() {
            // SAFETY: the engine (mapping) is still held; it is dropped below.
            unsafe { &*self.stop }.store(1, Ordering::Release);
            if !wait_child(&mut partner, CHILD_TIMEOUT) {
                eprintln!("bench: the floor partner did not stop; killing it");
                let _ = partner.kill();
                let _ = partner.wait();
            }
        }
        // Dropping the engine closes the region and unlinks its name.
        drop(self.engine.take());
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        self.shut();
    }
}

/// The partner process: attach to the floor page and echo `ping` on `pong` until told to
/// stop or the parent (the page's engine) dies.
fn partner_floor(name: &str, data: bool) -> Result<(), String> {
    let mut client =
        Client::attach(name, AttachOptions::default()).map_err(|e| format!("attach: {e}"))?;
    let mut addrs = [std::ptr::null::<u8>(); 6];
    for (a, n) in addrs.iter_mut().zip(FLOOR_LINES) {
        *a = client.tensors().address(n).map_err(|e| e.to_string())?;
    }
    let (parent_pid, parent_start) = (
        client.layout().engine_pid,
        client.layout().engine_start_time,
    );
    // SAFETY: each address is from `client.tensors().address` of a 64-byte tensor, and this
    // process never makes a slice of the floor tensors.
    let [ping, pong, stop, ready, req, resp] = addrs.map(|a| unsafe { atomic_at(&client, a) });
    ready.store(1, Ordering::Release);
    let mut last = pong.load(Ordering::Relaxed);
    let mut idle: u64 = 0;
    loop {
        let p = ping.load(Ordering::Acquire);
        if p != last {
            if data {
                resp.store(req.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            pong.store(p, Ordering::Release);
            last = p;
            continue;
        }
        std::hint::spin_loop();
        idle += 1;
        // Bounded: every 2^20 idle spins, look for the stop flag and the parent's life.
        if idle % LIVENESS_SPINS == 0 {
            if stop.load(Ordering::Acquire) != 0 {
                return Ok(());
            }
            if !shmbridge::process::process_alive(parent_pid, parent_start) {
                return Err(format!("parent {parent_pid} died"));
            }
        }
    }
}

fn partner_main(spec: &str) -> i32 {
    let result = match spec.split_once(':') {
        Some(("floor", name)) => partner_floor(name, false),
        Some(("floordata", name)) => partner_floor(name, true),
        _ => Err(format!("unknown {PARTNER_VAR}={spec:?}")),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("bench partner: {e}");
            1
        }
    }
}

// ---------------------------------------------------------------------------------------
// The real transport: a `shmbridge engine --env null` child and a client.

struct NullCase {
    label: &'static str,
    num_envs: u32,
    obs_dim: u64,
    act_dim: u64,
}

const NULL_64B: NullCase = NullCase {
    label: "null_64B",
    num_envs: 1,
    obs_dim: 16,
    act_dim: 1,
};
const NULL_4096X100: NullCase = NullCase {
    label: "null_4096x100",
    num_envs: 4096,
    obs_dim: 100,
    act_dim: 12,
};

struct NullBench {
    client: Option<Client>,
    child: Option<Child>,
    _stdout: Option<BufReader<ChildStdout>>,
    name: String,
    count: u64,
    last_action: f32,
    /// `actions` and `obs`, resolved once.
    ids: Option<(TensorId, TensorId)>,
}

/// The C `null` engine's executable, if the run includes it.
fn c_engine() -> Option<std::path::PathBuf> {
    std::env::var_os("SHMBRIDGE_BENCH_C_ENGINE")
        .filter(|p| !p.is_empty())
        .map(Into::into)
}

impl NullBench {
    /// Starts the `null` engine: the Rust one (`shmbridge engine --env null`), or the C
    /// one at `c_engine`.
    fn start(case: &NullCase, c_engine: Option<&std::path::Path>) -> NullBench {
        let mut command = match c_engine {
            Some(path) => Command::new(path),
            None => {
                let mut c = Command::new(env!("CARGO_BIN_EXE_shmbridge"));
                c.args(["engine", "--env", "null"]);
                c
            }
        };
        let mut child = command
            .arg("--num-envs")
            .arg(case.num_envs.to_string())
            .arg("--obs-dim")
            .arg(case.obs_dim.to_string())
            .arg("--act-dim")
            .arg(case.act_dim.to_string())
            .arg("--sparse")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            // It says "client closed after N steps" there; shown only if it fails.
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the null engine");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        let _ = stdout.read_line(&mut line);
        let name = line.trim().to_string();
        if name.is_empty() {
            let status = child.wait();
            panic!(
                "the engine exited before serving ({status:?}): {}",
                child_stderr(&mut child)
            );
        }
        let mut bench = NullBench {
            client: None,
            child: Some(child),
            _stdout: Some(stdout),
            name,
            count: 0,
            last_action: 0.0,
            ids: None,
        };
        // On failure, dropping `bench` stops the engine and removes its region.
        let client = Client::attach(&bench.name, AttachOptions::default())
            .unwrap_or_else(|e| panic!("attaching to {}: {e}", bench.name));
        let layout = client.layout();
        bench.ids = Some((layout.id("actions").unwrap(), layout.id("obs").unwrap()));
        bench.client = Some(client);
        bench
    }

    /// One round trip: write an action, step, read the first and last observation.
    #[inline]
    fn round_trip(&mut self) {
        let client = self.client.as_mut().expect("attached");
        let (actions, obs) = self.ids.expect("attached");
        self.count += 1;
        let action = (self.count & 0xF_FFFF) as f32; // exact in f32
        client.tensors().write::<f32>(actions).expect("actions")[0] = action;
        client.step(STEP_TIMEOUT).expect("step");
        let mut io = client.tensors();
        let obs = io.read::<f32>(obs).expect("obs");
        std::hint::black_box(obs[0]);
        std::hint::black_box(obs[obs.len() - 1]);
        self.last_action = action;
    }

    /// Whether the frame now held is the one for the last action (outside the timed part).
    fn check(&mut self) -> bool {
        let action = self.last_action;
        let client = self.client.as_mut().expect("attached");
        let frame = client.frame();
        let mut io = client.tensors();
        let obs = io.read::<f32>("obs").expect("obs");
        let rewards = io.read::<f32>("rewards").expect("rewards");
        let last = obs.len() - 1;
        obs[0] == pattern(frame, 0)
            && obs[last] == pattern(frame, last as u64)
            && rewards[0] == action
    }

    /// Closes the client and waits for the engine, which then removes its region.
    fn finish(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        if let Some(client) = self.client.take() {
            client.close();
        }
        if let Some(mut child) = self.child.take() {
            if !wait_child(&mut child, CHILD_TIMEOUT) {
                eprintln!("bench: engine {} did not exit; sending SIGTERM", self.name);
                let _ = rustix::process::kill_process(
                    rustix::process::Pid::from_child(&child),
                    rustix::process::Signal::TERM,
                );
                if !wait_child(&mut child, CHILD_TIMEOUT) {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
            match child.try_wait() {
                Ok(Some(s)) if s.success() => {}
                other => eprintln!(
                    "bench: engine {} ended with {other:?}: {}",
                    self.name,
                    child_stderr(&mut child)
                ),
            }
        }
        // The engine unlinks its region on exit; make sure, whatever happened.
        if std::path::Path::new("/dev/shm").join(&self.name).exists() {
            eprintln!("bench: region {} was left behind; removing it", self.name);
            let _ = rustix::shm::unlink(self.name.as_str());
        }
    }
}

impl Drop for NullBench {
    fn drop(&mut self) {
        self.shut();
    }
}

/// Waits up to `timeout` for `child` to exit; whether it did.
fn wait_child(child: &mut Child, timeout: Duration) -> bool {
    let t0 = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return true,
            Ok(None) if t0.elapsed() < timeout => std::thread::sleep(Duration::from_millis(1)),
            _ => return false,
        }
    }
}

fn child_stderr(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s.trim().to_string()
}

// ---------------------------------------------------------------------------------------
// Criterion.

fn run_criterion(c: &mut Criterion) {
    // Each pair starts on the first call of its routine, so a filter or `--list` that
    // skips a benchmark starts no process for it.
    for (label, data) in [("floor", false), ("floor_data", true)] {
        let mut floor: Option<Floor> = None;
        c.bench_function(label, |b| {
            let floor = floor.get_or_insert_with(|| Floor::start(data));
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                for _ in 0..iters {
                    floor.round_trip();
                }
                t0.elapsed()
            })
        });
        if let Some(floor) = floor.take() {
            assert!(floor.check(), "{label}: pong does not echo the last ping");
            floor.finish();
        }
    }
    let c_path = c_engine();
    let engines = [("roundtrip", None), ("c_engine", c_path.as_deref())];
    for (group_name, engine) in engines {
        if group_name == "c_engine" && engine.is_none() {
            continue;
        }
        null_group(c, group_name, engine);
    }
}

fn null_group(c: &mut Criterion, group_name: &str, engine: Option<&std::path::Path>) {
    let mut group = c.benchmark_group(group_name);
    for case in [&NULL_64B, &NULL_4096X100] {
        let mut bench: Option<NullBench> = None;
        group.bench_function(case.label, |b| {
            let bench = bench.get_or_insert_with(|| NullBench::start(case, engine));
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                for _ in 0..iters {
                    bench.round_trip();
                }
                t0.elapsed()
            })
        });
        if let Some(mut bench) = bench.take() {
            assert!(
                bench.check(),
                "{}: the frame does not match the action",
                case.label
            );
            bench.finish();
        }
    }
    group.finish();
}

// ---------------------------------------------------------------------------------------
// The summary: interleaved rounds, batch-timed, as a markdown table.

/// One of the cases, started fresh for each round.
enum Pair {
    Floor(Box<Floor>),
    Null(NullBench),
}

impl Pair {
    fn start(which: usize) -> Pair {
        match which {
            0 => Pair::Floor(Box::new(Floor::start(false))),
            1 => Pair::Floor(Box::new(Floor::start(true))),
            2 => Pair::Null(NullBench::start(&NULL_64B, None)),
            3 => Pair::Null(NullBench::start(&NULL_4096X100, None)),
            4 => Pair::Null(NullBench::start(&NULL_64B, c_engine().as_deref())),
            _ => Pair::Null(NullBench::start(&NULL_4096X100, c_engine().as_deref())),
        }
    }
    #[inline]
    fn round_trip(&mut self) {
        match self {
            Pair::Floor(f) => f.round_trip(),
            Pair::Null(n) => n.round_trip(),
        }
    }
    fn check(&mut self) -> bool {
        match self {
            Pair::Floor(f) => f.check(),
            Pair::Null(n) => n.check(),
        }
    }
    fn finish(self) {
        match self {
            Pair::Floor(f) => (*f).finish(),
            Pair::Null(n) => n.finish(),
        }
    }
}

const NAMES: [&str; 6] = [
    "floor",
    "floor_data",
    "roundtrip/null_64B",
    "roundtrip/null_4096x100",
    "c_engine/null_64B",
    "c_engine/null_4096x100",
];
const CASES: usize = NAMES.len();

/// Nearest-rank percentile of sorted data.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The 1-minute load average, as the kernel prints it.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

fn run_summary(quick: bool) {
    let total: usize = if quick { 10_000 } else { 200_000 };
    let warmup: usize = if quick { 1_000 } else { 10_000 };
    let rounds = if quick { QUICK_ROUNDS } else { ROUNDS };
    let batches_per_round = (total / BATCH / rounds).max(1);
    // A starved machine (fewer than two idle CPUs) can make a spinning round trip take a
    // scheduler tick (ms): cap each case's share of a round so the summary still ends.
    let budget = if quick {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(3)
    };
    let mut truncated = [0usize; CASES];
    // Batch means (ns per round trip) per case, and each round's median.
    let mut means: [Vec<f64>; CASES] = Default::default();
    let mut round_medians: [Vec<f64>; CASES] = Default::default();
    let load_before = loadavg();
    let t_all = Instant::now();
    // The C engine's cases only when the run has its executable.
    let active: Vec<usize> = (0..CASES)
        .filter(|&i| i < 4 || c_engine().is_some())
        .collect();
    for round in 0..rounds {
        // Rotate the order as well, so no case always runs first after a spawn.
        for k in 0..active.len() {
            let which = active[(round + k) % active.len()];
            let mut pair = Pair::start(which);
            let t_round = Instant::now();
            for i in 0..warmup {
                pair.round_trip();
                if i % BATCH == 0 && t_round.elapsed() > budget / 4 {
                    break;
                }
            }
            let deadline = Instant::now() + budget;
            let mut this_round = Vec::with_capacity(batches_per_round);
            for _ in 0..batches_per_round {
                if Instant::now() > deadline {
                    truncated[which] += 1;
                    break;
                }
                let t0 = Instant::now();
                for _ in 0..BATCH {
                    pair.round_trip();
                }
                let ns = t0.elapsed().as_nanos() as f64 / BATCH as f64;
                assert!(pair.check(), "{}: wrong frame after a batch", NAMES[which]);
                this_round.push(ns);
            }
            means[which].extend_from_slice(&this_round);
            this_round.sort_by(f64::total_cmp);
            round_medians[which].push(percentile(&this_round, 50.0));
            pair.finish();
        }
    }
    let elapsed = t_all.elapsed();

    let mut med = [0.0; CASES];
    let mut p99 = [0.0; CASES];
    for &i in &active {
        means[i].sort_by(f64::total_cmp);
        med[i] = percentile(&means[i], 50.0);
        p99[i] = percentile(&means[i], 99.0);
    }
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = loadavg();
    println!();
    println!("## shmbridge round trip (bench summary)");
    println!();
    println!(
        "Up to {} round trips each, in {rounds} interleaved rounds (order rotated, pair \
         restarted each round, up to {warmup} warm-up round trips per round, at most {:.1} s \
         per case per round); timed with `Instant` around batches of {BATCH}: median and \
         p99 over all batch means, per round trip. \
         {cpus} CPUs, load average {load_before} before / {load} after{}; summary took {:.1} s.",
        batches_per_round * BATCH * rounds,
        budget.as_secs_f64(),
        if quick { ", QUICK mode" } else { "" },
        elapsed.as_secs_f64()
    );
    if med[0] > 5_000.0 || p99[0] > 50_000.0 {
        println!();
        println!(
            "**Warning:** the floor's spinning pair did not run side by side (median {:.0} ns, \
             p99 {:.0} ns per round trip): fewer than two idle CPUs? These numbers then \
             measure the scheduler, not the transport.",
            med[0], p99[0]
        );
    }
    println!();
    println!("| bench | median ns/RT | p99 ns/RT | round medians min..max ns | RTs timed |");
    println!("|---|---:|---:|---:|---:|");
    for &i in &active {
        let (lo, hi) = round_medians[i]
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        println!(
            "| {} | {:.1} | {:.1} | {:.1}..{:.1} | {}{} |",
            NAMES[i],
            med[i],
            p99[i],
            lo,
            hi,
            means[i].len() * BATCH,
            if truncated[i] > 0 {
                format!(" (time cap hit in {} rounds)", truncated[i])
            } else {
                String::new()
            }
        );
    }
    println!();
    println!("| ratio | of medians | of p99s |");
    println!("|---|---:|---:|");
    let ratio = |label: &str, a: usize, b: usize| {
        println!(
            "| {label} | {:.3} | {:.2} |",
            med[a] / med[b],
            p99[a] / p99[b]
        );
    };
    ratio("null_64B / floor", 2, 0);
    ratio("null_64B / floor_data", 2, 1);
    ratio("null_4096x100 / null_64B", 3, 2);
    if active.len() == CASES {
        ratio("C engine / Rust engine, null_64B", 4, 2);
        ratio("C engine / Rust engine, null_4096x100", 5, 3);
        ratio("C engine null_64B / floor", 4, 0);
    } else {
        println!();
        println!("(The C engine's cases were not run: `bash scripts/bench-c.sh` runs them.)");
    }
}
