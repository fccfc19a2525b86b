//! Soak: `cargo run --release --example soak -- MINUTES` (or `bash scripts/soak.sh
//! [MINUTES]`). Random steps, resets, engine-defined calls, client re-attaches and engine
//! restarts, across processes, on `null` and `cartpole`, for MINUTES (default 1):
//!
//! - per env, a *stable* engine (this program run as `soak engine ...`, serving one
//!   client after another for the whole run) and a *churned* one (`shmbridge engine`,
//!   which ends with its client, restarted after each session; some sessions end by
//!   SIGTERM or SIGKILL while attached, and the client must then see `EngineClosed` or
//!   `EngineDied`);
//! - this process is the client of all four, closing and attaching again at random;
//! - every step is checked: `null` frames hold `pattern(frame, i)` and echo the actions;
//!   `cartpole` frames are compared bit for bit with the Rust reference engine run here
//!   in-process on the same seed, fed the same actions, reset masks, resets and calls;
//! - RSS (anonymous and total) and descriptor counts of this process and of the stable
//!   engines, and the number of the run's regions in /dev/shm, are sampled after a
//!   warm-up and at the end, in the same state (every client attached): descriptors and
//!   regions must be equal, anonymous RSS within 2 MiB; after shutdown no region and
//!   no child process may be left.
//!
//! Exits 0 and prints the figures, or 1 naming the first failure.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg32;
use shmbridge::envs::{self, null::pattern, EnvCommands, EnvOptions};
use shmbridge::{AttachOptions, Client, Engine, Error};

const NUM_ENVS: u32 = 16;
const OBS_DIM: u64 = 8;
const ACT_DIM: u64 = 2;
/// Every call's timeout: a healthy engine answers in microseconds.
const TIMEOUT: Duration = Duration::from_secs(10);
/// Anonymous memory a process may gain between the two samples.
const RSS_SLACK_KB: i64 = 2048;

type Fail = String;

fn fail<T>(what: impl Into<String>) -> Result<T, Fail> {
    Err(what.into())
}

fn shmbridge_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("own path");
    // target/<profile>/examples/soak -> target/<profile>/shmbridge
    exe.parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("shmbridge"))
        .expect("target directory")
}

// ---- The stable engine: serves one client after another until its stdin closes ----

fn stable_engine(env_name: &str, name: &str, seed: u64) -> Result<(), Fail> {
    let options = EnvOptions {
        obs_dim: Some(OBS_DIM),
        act_dim: Some(ACT_DIM),
        seed,
        ..EnvOptions::default()
    };
    let mut env = envs::by_name(env_name, NUM_ENVS, &options).map_err(|e| e.to_string())?;
    let mut engine = Engine::create(env.spec().name(name)).map_err(|e| e.to_string())?;
    env.reset_all(&mut engine.tensors())
        .map_err(|e| e.to_string())?;
    engine.publish().map_err(|e| e.to_string())?;
    println!("{}", engine.name());
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        flag.store(true, Ordering::Release);
    });
    while !stop.load(Ordering::Acquire) {
        match engine.wait_actions_with(Duration::from_millis(100), &mut EnvCommands(&mut *env)) {
            Ok(seq) => {
                env.step(seq, &mut engine.tensors())
                    .map_err(|e| e.to_string())?;
                engine.publish().map_err(|e| e.to_string())?;
            }
            Err(Error::Timeout { .. }) => {}
            // The client left: wait for the next one (or the end).
            Err(Error::PeerClosed { .. } | Error::PeerDied { .. }) => {
                while !engine.client_attached() && !stop.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Err(e) => return fail(format!("stable {env_name} engine: {e}")),
        }
    }
    Ok(())
}

// ---- Processes and their resources ----

/// An engine process: its name and the pipe we close to stop it (stable engines).
struct EngineProc {
    child: Child,
    name: String,
    _stdout: BufReader<ChildStdout>,
}

impl EngineProc {
    fn start(mut command: Command, quiet: bool) -> Result<EngineProc, Fail> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(if quiet {
                Stdio::null()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .map_err(|e| format!("start an engine: {e}"))?;
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        let mut name = String::new();
        let _ = out.read_line(&mut name);
        let name = name.trim().to_string();
        if name.is_empty() {
            let _ = child.kill();
            let _ = child.wait();
            return fail("an engine exited before serving");
        }
        Ok(EngineProc {
            child,
            name,
            _stdout: out,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn signal(&self, sig: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(self.pid() as i32).expect("pid");
        let _ = rustix::process::kill_process(pid, sig);
    }

    /// Ends it: closing stdin stops a stable engine; a churned one has ended with its
    /// client. Returns how it ended.
    fn finish(mut self) -> std::process::ExitStatus {
        drop(self.child.stdin.take());
        self.child.wait().expect("wait for an engine")
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Resources {
    rss_anon_kb: i64,
    rss_kb: i64,
    fds: usize,
    /// What each descriptor is, to name a leak.
    fd_targets: Vec<String>,
}

/// [`resources_now`], read until two readings agree on the descriptors (a reading can
/// catch one in passing).
fn resources(pid: &str) -> Resources {
    let mut last = resources_now(pid);
    for _ in 0..5 {
        let now = resources_now(pid);
        if now.fd_targets == last.fd_targets {
            return now;
        }
        last = now;
    }
    last
}

fn resources_now(pid: &str) -> Resources {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |key: &str| -> i64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1)
    };
    let mut targets: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| {
                    let target = std::fs::read_link(e.path()).unwrap_or_default();
                    format!("{}->{}", e.file_name().to_string_lossy(), target.display())
                })
                .collect()
        })
        .unwrap_or_default();
    targets.sort();
    Resources {
        rss_anon_kb: field("RssAnon:"),
        rss_kb: field("VmRSS:"),
        fds: targets.len(),
        fd_targets: targets,
    }
}

/// The run's regions in /dev/shm (their names start with `prefix`).
fn regions(prefix: &str) -> usize {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
                .count()
        })
        .unwrap_or(0)
}

// ---- The cartpole reference: the same engine, in this process ----

struct Reference {
    client: Client,
    server: std::thread::JoinHandle<Result<(), String>>,
}

impl Reference {
    fn start(name: String, seed: u64) -> Result<Reference, Fail> {
        let (tx, rx) = std::sync::mpsc::channel();
        let server = std::thread::spawn(move || -> Result<(), String> {
            let options = EnvOptions {
                seed,
                ..EnvOptions::default()
            };
            let mut env =
                envs::by_name("cartpole", NUM_ENVS, &options).map_err(|e| e.to_string())?;
            let mut engine = Engine::create(env.spec().name(&name)).map_err(|e| e.to_string())?;
            envs::serve(&mut engine, env.as_mut(), Duration::from_secs(3600), |n| {
                let _ = tx.send(n.to_string());
            })
            .map(|_| ())
            .map_err(|e| e.to_string())
        });
        let name = rx
            .recv_timeout(TIMEOUT)
            .map_err(|_| "the reference engine did not start".to_string())?;
        let client = Client::attach(&name, AttachOptions::default()).map_err(|e| e.to_string())?;
        Ok(Reference { client, server })
    }

    fn stop(self) -> Result<(), Fail> {
        self.client.close();
        self.server
            .join()
            .map_err(|_| "the reference engine panicked".to_string())?
            .map_err(|e| format!("the reference engine: {e}"))
    }
}

// ---- One engine under test and our client of it ----

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum EnvKind {
    Null,
    CartPole,
}

impl EnvKind {
    fn name(self) -> &'static str {
        match self {
            EnvKind::Null => "null",
            EnvKind::CartPole => "cartpole",
        }
    }
}

struct Pair {
    env: EnvKind,
    stable: bool,
    seed: u64,
    engine: EngineProc,
    client: Option<Client>,
    /// cartpole: the reference engine fed what the engine under test is fed.
    reference: Option<Reference>,
    pole_length: f64,
}

struct Soak {
    rng: Pcg32,
    prefix: String,
    serial: u64,
    counts: BTreeMap<&'static str, u64>,
}

impl Soak {
    fn count(&mut self, what: &'static str) {
        *self.counts.entry(what).or_default() += 1;
    }

    fn next_name(&mut self, what: &str) -> String {
        self.serial += 1;
        format!("{}{what}-{}", self.prefix, self.serial)
    }

    /// Starts an engine process; returns it and its seed.
    fn start_engine(&mut self, env: EnvKind, stable: bool) -> Result<(EngineProc, u64), Fail> {
        let seed = self.rng.random_range(0..1u64 << 32);
        let name = self.next_name(env.name());
        let command = if stable {
            let mut c = Command::new(std::env::current_exe().expect("own path"));
            c.args(["engine", env.name(), &name, &seed.to_string()]);
            c
        } else {
            let mut c = Command::new(shmbridge_bin());
            c.args([
                "engine",
                "--env",
                env.name(),
                "--num-envs",
                &NUM_ENVS.to_string(),
            ])
            .args([
                "--obs-dim",
                &OBS_DIM.to_string(),
                "--act-dim",
                &ACT_DIM.to_string(),
            ])
            .args(["--seed", &seed.to_string(), "--name", &name]);
            c
        };
        // The CLI says on stderr how each session ended: not worth a line each.
        Ok((EngineProc::start(command, !stable)?, seed))
    }

    fn start_pair(&mut self, env: EnvKind, stable: bool) -> Result<Pair, Fail> {
        let (engine, seed) = self.start_engine(env, stable)?;
        let mut pair = Pair {
            env,
            stable,
            seed,
            engine,
            client: None,
            reference: None,
            pole_length: envs::cartpole::LENGTH,
        };
        self.attach(&mut pair)?;
        Ok(pair)
    }

    /// Attaches our client; cartpole: and, for a fresh engine, a reference engine on the
    /// same seed (a stable engine keeps its reference across its clients: both stay at
    /// the same frame).
    fn attach(&mut self, pair: &mut Pair) -> Result<(), Fail> {
        let client = Client::attach(&pair.engine.name, AttachOptions::default())
            .map_err(|e| format!("attach {}: {e}", pair.engine.name))?;
        if pair.env == EnvKind::CartPole && pair.reference.is_none() {
            if client.frame() != 0 {
                return fail("a cartpole engine without its reference past frame 0");
            }
            let name = self.next_name("reference");
            pair.reference = Some(Reference::start(name, pair.seed)?);
        }
        pair.client = Some(client);
        self.count("attaches");
        Ok(())
    }

    fn step(&mut self, pair: &mut Pair) -> Result<(), Fail> {
        let client = pair.client.as_mut().expect("attached");
        match pair.env {
            EnvKind::Null => {
                let actions: Vec<f32> = (0..NUM_ENVS as u64 * ACT_DIM)
                    .map(|_| self.rng.random_range(-1.0..1.0))
                    .collect();
                client
                    .tensor_mut::<f32>("actions")
                    .map_err(|e| e.to_string())?
                    .copy_from_slice(&actions);
                let frame = client
                    .step(TIMEOUT)
                    .map_err(|e| format!("null step: {e}"))?;
                let mut io = client.tensors();
                let obs = io.read::<f32>("obs").map_err(|e| e.to_string())?;
                if let Some(i) = (0..obs.len()).find(|&i| obs[i] != pattern(frame, i as u64)) {
                    return fail(format!(
                        "null frame {frame}: obs[{i}] = {}, expected {}",
                        obs[i],
                        pattern(frame, i as u64)
                    ));
                }
                let rewards = io.read::<f32>("rewards").map_err(|e| e.to_string())?;
                if let Some(i) =
                    (0..rewards.len()).find(|&i| rewards[i] != actions[i * ACT_DIM as usize])
                {
                    return fail(format!(
                        "null frame {frame}: rewards[{i}] does not echo its action"
                    ));
                }
            }
            EnvKind::CartPole => {
                let actions: Vec<i64> =
                    (0..NUM_ENVS).map(|_| self.rng.random_range(0..2)).collect();
                let mask: Vec<u8> = (0..NUM_ENVS)
                    .map(|_| u8::from(self.rng.random_range(0..50) == 0))
                    .collect();
                let reference = &mut pair.reference.as_mut().expect("a reference").client;
                for c in [&mut *client, &mut *reference] {
                    c.tensor_mut::<i64>("actions")
                        .map_err(|e| e.to_string())?
                        .copy_from_slice(&actions);
                    c.tensor_mut::<u8>("reset_mask")
                        .map_err(|e| e.to_string())?
                        .copy_from_slice(&mask);
                }
                let frame = both(client, reference, "step", |c| c.step(TIMEOUT))?;
                same_frame(client, reference, frame)?;
            }
        }
        self.count("steps");
        Ok(())
    }

    fn reset(&mut self, pair: &mut Pair) -> Result<(), Fail> {
        let client = pair.client.as_mut().expect("attached");
        match pair.env {
            EnvKind::Null => {
                client
                    .reset(None, &[], TIMEOUT)
                    .map_err(|e| format!("null reset: {e}"))?;
                let obs = client.tensor::<f32>("obs").map_err(|e| e.to_string())?;
                if (0..obs.len()).any(|i| obs[i] != pattern(0, i as u64)) {
                    return fail("null reset: obs is not frame 0's pattern");
                }
            }
            EnvKind::CartPole => {
                let ids: Option<Vec<u32>> = self.rng.random::<bool>().then(|| {
                    (0..NUM_ENVS)
                        .filter(|_| self.rng.random::<bool>())
                        .collect()
                });
                let seeds: Vec<u64> = match self.rng.random_range(0..3) {
                    0 => vec![],
                    1 => vec![self.rng.random_range(0..1000)],
                    _ => (0..ids.as_ref().map_or(NUM_ENVS as usize, Vec::len))
                        .map(|_| self.rng.random_range(0..1000))
                        .collect(),
                };
                let reference = &mut pair.reference.as_mut().expect("a reference").client;
                let frame = both(client, reference, "reset", |c| {
                    c.reset(ids.as_deref(), &seeds, TIMEOUT)
                })?;
                same_frame(client, reference, frame)?;
            }
        }
        self.count("resets");
        Ok(())
    }

    fn call(&mut self, pair: &mut Pair) -> Result<(), Fail> {
        let client = pair.client.as_mut().expect("attached");
        match pair.env {
            EnvKind::Null => {
                let value = self.rng.random::<u64>().to_string();
                let payload: Vec<u8> = (0..self.rng.random_range(0..64))
                    .map(|_| self.rng.random())
                    .collect();
                let reply = client
                    .call_method("echo", &[("v", value.as_str())], &payload, TIMEOUT)
                    .map_err(|e| format!("null echo: {e}"))?;
                if reply.args != [("v".to_string(), value)] || reply.payload != payload {
                    return fail("null echo: the reply is not what was sent");
                }
            }
            EnvKind::CartPole => {
                let length = self.rng.random_range(0.4..0.6);
                let text = length.to_string();
                let reference = &mut pair.reference.as_mut().expect("a reference").client;
                let args = [("length", text.as_str())];
                let reply = both(client, reference, "set_pole_length", |c| {
                    c.call_method("set_pole_length", &args, &[], TIMEOUT)
                })?;
                let previous = pair.pole_length.to_string();
                if reply.args != [("previous".to_string(), previous)] {
                    return fail(format!("set_pole_length answered {:?}", reply.args));
                }
                pair.pole_length = length;
            }
        }
        self.count("calls");
        Ok(())
    }

    /// Closes our client and attaches again; a churned engine ends with its client, so
    /// it is replaced.
    fn reattach(&mut self, pair: &mut Pair) -> Result<(), Fail> {
        pair.client.take().expect("attached").close();
        if pair.stable {
            return self.attach(pair);
        }
        self.replace(pair, "closed")
    }

    /// A churned engine's session ends: `how` = "closed" (our client closed it), or the
    /// engine is sent SIGTERM or SIGKILL while attached and our next call must say so.
    fn replace(&mut self, pair: &mut Pair, how: &str) -> Result<(), Fail> {
        if let Some(client) = pair.client.as_mut() {
            let (sig, expected) = match how {
                "SIGTERM" => (rustix::process::Signal::TERM, "EngineClosed"),
                _ => (rustix::process::Signal::KILL, "EngineDied"),
            };
            pair.engine.signal(sig);
            let _ = pair.engine.child.wait();
            let got = client.step(TIMEOUT);
            match got {
                Err(e) if format!("{:?}", e.kind()) == expected => {}
                other => {
                    return fail(format!(
                        "after {how} the client got {other:?}, not {expected}"
                    ))
                }
            }
            pair.client.take().expect("attached").close();
            self.count(if how == "SIGTERM" {
                "engines terminated"
            } else {
                "engines killed"
            });
        }
        let (fresh, seed) = self.start_engine(pair.env, pair.stable)?;
        pair.seed = seed;
        let status = std::mem::replace(&mut pair.engine, fresh).finish();
        if how == "closed" && !status.success() {
            return fail(format!(
                "a churned engine ended {status} after its client closed"
            ));
        }
        if let Some(r) = pair.reference.take() {
            r.stop()?;
        }
        pair.pole_length = envs::cartpole::LENGTH;
        self.count("engine restarts");
        self.attach(pair)
    }
}

/// Does `op` on the engine under test's client, then on the reference's; returns the
/// first one's answer.
fn both<T>(
    client: &mut Client,
    reference: &mut Client,
    what: &str,
    mut op: impl FnMut(&mut Client) -> Result<T, Error>,
) -> Result<T, Fail> {
    let answer = op(client).map_err(|e| format!("cartpole {what}: {e}"))?;
    op(reference).map_err(|e| format!("reference {what}: {e}"))?;
    Ok(answer)
}

fn same_frame(client: &mut Client, reference: &mut Client, frame: u64) -> Result<(), Fail> {
    for t in ["obs", "rewards", "final_obs"] {
        let a = client.tensor::<f32>(t).map_err(|e| e.to_string())?.to_vec();
        let b = reference.tensor::<f32>(t).map_err(|e| e.to_string())?;
        if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
            return fail(format!(
                "cartpole frame {frame}: {t}[{i}] = {}, the reference has {}",
                a[i], b[i]
            ));
        }
    }
    for t in ["terminated", "truncated"] {
        let a = client.tensor::<u8>(t).map_err(|e| e.to_string())?.to_vec();
        if a != reference.tensor::<u8>(t).map_err(|e| e.to_string())? {
            return fail(format!(
                "cartpole frame {frame}: {t} differs from the reference"
            ));
        }
    }
    Ok(())
}

fn sample(pairs: &[Pair]) -> Vec<(String, Resources)> {
    let mut out = vec![("soak (the clients)".to_string(), resources("self"))];
    for p in pairs.iter().filter(|p| p.stable) {
        out.push((
            format!("stable {} engine", p.env.name()),
            resources(&p.engine.pid().to_string()),
        ));
    }
    out
}

fn run(minutes: f64) -> Result<(), Fail> {
    // In the region namespace of this run (SHMBRIDGE_NAMESPACE, which scripts/soak.sh
    // sets), where the engines' start-up sweeps remove what the killed ones left.
    let prefix = format!(
        "{}soak-{}-",
        shmbridge::region::namespace_prefix().map_err(|e| e.to_string())?,
        std::process::id()
    );
    let mut soak = Soak {
        rng: Pcg32::seed_from_u64(u64::from(std::process::id())),
        prefix: prefix.clone(),
        serial: 0,
        counts: BTreeMap::new(),
    };
    let total = Duration::from_secs_f64(minutes * 60.0);
    let warm_up = total / 10;
    let start = Instant::now();
    let mut pairs = Vec::new();
    for env in [EnvKind::Null, EnvKind::CartPole] {
        for stable in [true, false] {
            pairs.push(soak.start_pair(env, stable)?);
        }
    }
    let mut first: Option<(Vec<(String, Resources)>, usize)> = None;
    while start.elapsed() < total {
        if first.is_none() && start.elapsed() >= warm_up {
            first = Some((sample(&pairs), regions(&prefix)));
        }
        let i = soak.rng.random_range(0..pairs.len());
        let pair = &mut pairs[i];
        // Per 10 000 operations: steps, resets, calls, re-attaches; a churned engine is
        // also terminated or killed while attached.
        match soak.rng.random_range(0..10_000) {
            0..=9_699 => soak.step(pair)?,
            9_700..=9_819 => soak.reset(pair)?,
            9_820..=9_939 => soak.call(pair)?,
            9_940..=9_979 => soak.reattach(pair)?,
            _ if pair.stable => soak.reattach(pair)?,
            9_980..=9_989 => soak.replace(pair, "SIGTERM")?,
            _ => soak.replace(pair, "SIGKILL")?,
        }
    }
    let (before, regions_before) = first.ok_or("the run was too short to sample")?;
    let after = sample(&pairs);
    let regions_after = regions(&prefix);
    // Shut down: clients close, engines end (a stable one when its stdin closes).
    for mut p in pairs {
        if let Some(c) = p.client.take() {
            c.close();
        }
        if let Some(r) = p.reference.take() {
            r.stop()?;
        }
        let status = p.engine.finish();
        if !status.success() {
            return fail(format!(
                "a {} engine ended {status} at shutdown",
                p.env.name()
            ));
        }
    }
    let left = regions(&prefix);
    println!("soak: {minutes} min, {:?}", soak.counts);
    println!(
        "{:<28} {:>12} {:>12} {:>10} {:>10} {:>6} {:>6}",
        "process", "anon KiB 1", "anon KiB 2", "rss KiB 1", "rss KiB 2", "fds 1", "fds 2"
    );
    let mut problems = Vec::new();
    for ((who, a), (_, b)) in before.iter().zip(&after) {
        println!(
            "{who:<28} {:>12} {:>12} {:>10} {:>10} {:>6} {:>6}",
            a.rss_anon_kb, b.rss_anon_kb, a.rss_kb, b.rss_kb, a.fds, b.fds
        );
        if b.fds != a.fds {
            problems.push(format!(
                "{who}: {} descriptors, then {} ({:?}, then {:?})",
                a.fds, b.fds, a.fd_targets, b.fd_targets
            ));
        }
        if b.rss_anon_kb - a.rss_anon_kb > RSS_SLACK_KB {
            problems.push(format!(
                "{who}: anonymous RSS {} KiB, then {} KiB",
                a.rss_anon_kb, b.rss_anon_kb
            ));
        }
    }
    println!("regions of the run in /dev/shm: {regions_before} after the warm-up, {regions_after} at the end, {left} after shutdown");
    if regions_after != regions_before || left != 0 {
        problems.push("regions of the run were left in /dev/shm".into());
    }
    if problems.is_empty() {
        println!("soak: ok (flat: descriptors and regions equal, anonymous RSS within {RSS_SLACK_KB} KiB)");
        Ok(())
    } else {
        fail(problems.join("; "))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match &args[..] {
        [role, env, name, seed] if role == "engine" => {
            stable_engine(env, name, seed.parse().expect("seed"))
        }
        [] => run(1.0),
        [minutes] => run(minutes.parse().expect("minutes: a number")),
        _ => fail("usage: soak [MINUTES]"),
    };
    if let Err(e) = result {
        eprintln!("soak: FAILED: {e}");
        std::process::exit(1);
    }
}
