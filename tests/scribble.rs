//! A hostile peer of the same user scribbles random bytes over a live region (the control
//! block, the tensor table, the command rings and their counters, the tensor data, or
//! anywhere) while a client steps, resets, calls, pings and attaches again. The client
//! runs in a child process and must end normally, having seen typed errors only: never
//! SIGSEGV, SIGBUS, an abort, a panic or a hang. The engine (`shmbridge engine`), `ls`
//! and `inspect` of the scribbled region must not crash either, and nothing may be left
//! in /dev/shm under the region's name.
//!
//! Seeded: `SHMBRIDGE_SCRIBBLE_ROUNDS` rounds per area (default 2), seeds 0, 1, ...; a
//! failure names its area and seed. The counts of what the clients saw are printed.

mod common;

use std::collections::BTreeMap;
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use common::peer::{self, say, PeerProc};
use common::{shm_exists, BIN};
use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg32;
use shmbridge::layout::CONTROL_SIZE;
use shmbridge::region::Region;
use shmbridge::{AttachOptions, Client, Error};

/// Each client call's timeout: scribbled counters make some calls wait for ever.
const SHORT: Duration = Duration::from_millis(50);
/// Operations per client session.
const OPS: u32 = 256;
/// The client gives up on its session after this many errors in a row.
const GIVE_UP: u32 = 8;

// ---- The client peer ----

/// One operation of the client's mix; `Ok` carries nothing, errors are typed.
fn operate(client: &mut Client, name: &str, i: u32, in_flight: &mut bool) -> Result<(), Error> {
    match i % 8 {
        0..=3 => {
            if *in_flight {
                client.wait_frame(SHORT)?;
            } else {
                let r = client.step(SHORT);
                *in_flight = matches!(r, Err(Error::Timeout { .. }));
                r?;
            }
            *in_flight = false;
            let obs = client.tensors().read::<f32>("obs")?;
            std::hint::black_box(obs.iter().sum::<f32>());
            Ok(())
        }
        4 => client.reset(None, &[], SHORT).map(|_| ()),
        5 => client
            .call_method("echo", &[("k", "v")], b"payload", SHORT)
            .map(|_| ()),
        6 => client.ping(b"ping", SHORT).map(|_| ()),
        // A second attach reads the scribbled header and table afresh.
        _ => Client::attach(name, AttachOptions::default().timeout(SHORT)).map(Client::close),
    }
}

fn scribble_client(name: &str) {
    let mut seen: BTreeMap<String, u32> = BTreeMap::new();
    let mut note = |r: &Result<(), Error>| -> bool {
        let key = match r {
            Ok(()) => "ok".to_string(),
            Err(e) => format!("{:?}", e.kind()),
        };
        *seen.entry(key).or_default() += 1;
        r.is_ok()
    };
    let attached = Client::attach(name, AttachOptions::default().timeout(peer::HANG));
    say("attached");
    if let Ok(mut client) = attached {
        let (mut in_flight, mut failing) = (false, 0);
        for i in 0..OPS {
            if i % 16 == 0 {
                say(&format!("op {i}"));
            }
            let r = operate(&mut client, name, i, &mut in_flight);
            failing = if note(&r) { 0 } else { failing + 1 };
            if failing >= GIVE_UP {
                break;
            }
        }
    } else if let Err(e) = attached {
        note(&Err(e));
    }
    let summary: Vec<String> = seen.iter().map(|(k, n)| format!("{k}={n}")).collect();
    say(&format!("done {}", summary.join(" ")));
}

/// Not a test: the client process of the scribble test (role `client NAME`).
#[test]
#[ignore = "a peer process the scribble test starts itself"]
fn scribble_peer() {
    let Some(role) = peer::role() else {
        return;
    };
    match role.split_whitespace().collect::<Vec<_>>()[..] {
        ["client", name] => scribble_client(name),
        _ => panic!("bad role {role:?}"),
    }
}

// ---- The scribbler ----

/// Where the bytes go.
#[derive(Debug, Clone, Copy)]
enum Area {
    Control,
    Table,
    /// The ring data and the ring counters and waiter flags of the control block.
    Rings,
    Tensors,
    Anywhere,
}

const AREAS: [Area; 5] = [
    Area::Control,
    Area::Table,
    Area::Rings,
    Area::Tensors,
    Area::Anywhere,
];

/// The byte ranges of `area` in the region `name`.
fn spans(area: Area, name: &str) -> Vec<std::ops::Range<usize>> {
    let h = Region::open_read_only(name).expect("map").header();
    let header = h.header_size as usize;
    let rings_end = (h.e2c_ring_offset + h.e2c_ring_capacity) as usize;
    let size = h.region_size as usize;
    match area {
        Area::Control => vec![0..CONTROL_SIZE],
        Area::Table => vec![CONTROL_SIZE..header],
        Area::Rings => vec![512..896, h.c2e_ring_offset as usize..rings_end],
        Area::Tensors => vec![rings_end..size],
        Area::Anywhere => vec![0..size],
    }
}

/// The region's file, mapped shared and writable, as a hostile process of the same user
/// would.
struct Scribbler {
    map: memmap2::MmapRaw,
    rng: Pcg32,
    spans: Vec<std::ops::Range<usize>>,
}

impl Scribbler {
    fn new(name: &str, area: Area, seed: u64) -> Scribbler {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/dev/shm/{name}"))
            .expect("open the region file");
        let map = memmap2::MmapRaw::map_raw(&file).expect("map the region file");
        Scribbler {
            map,
            rng: Pcg32::seed_from_u64(seed),
            spans: spans(area, name),
        }
    }

    /// Writes 1 to 8 random bytes at random places of the area.
    fn burst(&mut self) {
        for _ in 0..self.rng.random_range(1..=8) {
            let span = &self.spans[self.rng.random_range(0..self.spans.len())];
            let at = self.rng.random_range(span.clone());
            assert!(at < self.map.len());
            // SAFETY: `at` is inside the mapping, which lives as long as `self`; the
            // other processes only access this memory atomically or as plain bytes they
            // validate, and a byte-wide atomic store is what a hostile peer could do.
            let byte = unsafe { &*(self.map.as_mut_ptr().add(at) as *const AtomicU8) };
            byte.store(self.rng.random(), Ordering::Relaxed);
        }
    }
}

/// A process ended by itself or by the signal we sent (`allowed`), not by a crash or a
/// panic. Returns what was wrong.
fn ended_well(
    what: &str,
    status: Option<ExitStatus>,
    stderr: &str,
    allowed: &[i32],
) -> Option<String> {
    use std::os::unix::process::ExitStatusExt;
    let Some(status) = status else {
        return Some(format!("{what} hung"));
    };
    if stderr.contains("panicked") {
        return Some(format!("{what} panicked: {stderr}"));
    }
    match (status.code(), status.signal()) {
        (Some(0 | 1), _) => None,
        (Some(code), _) if allowed.contains(&(code - 128)) => None,
        (_, Some(sig)) if allowed.contains(&sig) => None,
        _ => Some(format!("{what} ended {status}: {stderr}")),
    }
}

/// One session: an engine, a client, bytes scribbled over `area` every 16 client
/// operations. Returns the client's counts, or what went wrong.
fn round(area: Area, seed: u64) -> Result<String, String> {
    let mut engine = PeerProc::spawn(
        Command::new(BIN),
        "",
        &[
            "engine",
            "--env",
            "null",
            "--num-envs",
            "8",
            "--obs-dim",
            "4",
            "--act-dim",
            "2",
        ],
    );
    let name = engine.line();
    let mut scribbler = Scribbler::new(&name, area, seed);
    let mut client = PeerProc::start("scribble_peer", &format!("client {name}"));
    client.expect("attached");
    let summary = loop {
        match client.lines.recv_timeout(peer::HANG) {
            Ok(line) if line.contains("PEER op ") => scribbler.burst(),
            Ok(line) if line.contains("PEER done") => {
                break line
                    .split_once("done")
                    .map_or("", |(_, s)| s)
                    .trim()
                    .to_string()
            }
            Ok(_) => {}
            Err(_) => return Err(format!("{area:?} seed {seed}: the client hung or died")),
        }
    };
    drop(scribbler);
    let mut problems = Vec::new();
    let status = client.wait_end();
    problems.extend(ended_well("the client", status, &client.stderr(), &[]));
    // Status 1 with a message is a typed error: `ls` and `inspect` may refuse the
    // region, never crash on it.
    for args in [vec!["ls"], vec!["inspect", name.as_str()]] {
        let out = Command::new(BIN).args(&args).output().expect("run the CLI");
        let err = String::from_utf8_lossy(&out.stderr);
        problems.extend(ended_well(
            &format!("`{}`", args[0]),
            Some(out.status),
            &err,
            &[],
        ));
    }
    // The engine may have stopped on a typed error already; else SIGTERM stops it.
    if engine.running() {
        common::signal(engine.pid(), rustix::process::Signal::TERM);
    }
    let status = engine.wait_end();
    problems.extend(ended_well("the engine", status, &engine.stderr(), &[15]));
    if shm_exists(&name) {
        problems.push(format!("{name} left in /dev/shm"));
    }
    if problems.is_empty() {
        Ok(summary)
    } else {
        Err(format!("{area:?} seed {seed}: {}", problems.join("; ")))
    }
}

#[test]
fn scribbled_live_regions_give_typed_errors_only() {
    let rounds: u64 = std::env::var("SHMBRIDGE_SCRIBBLE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let mut failures = Vec::new();
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    for area in AREAS {
        for seed in 0..rounds {
            match round(area, seed) {
                Ok(summary) => {
                    for kv in summary.split_whitespace() {
                        if let Some((k, n)) = kv.split_once('=') {
                            *seen.entry(k.to_string()).or_default() += n.parse().unwrap_or(0);
                        }
                    }
                }
                Err(problem) => failures.push(problem),
            }
        }
    }
    eprintln!(
        "scribble: {} sessions ({rounds} per area); what the clients saw: {seen:?}",
        rounds * AREAS.len() as u64
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
