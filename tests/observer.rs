//! Read-only observers (protocol 1.7): every copy an observer accepts holds one frame
//! while the engine steps and answers resets; its episode totals are the ones the
//! client saw; it opens the region read-only, maps nothing, and nobody sees it; a dead,
//! closed or truncated region is a typed error, and a region cut during its copies never
//! kills it (a race run 200 times). (Attaching and detaching a thousand times:
//! `tests/observer_cycles.rs`, a process of its own.)

mod common;

use common::peer::{self, PeerProc};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use shmbridge::envs::cartpole::CartPole;
use shmbridge::envs::{serve, ServeEnd};
use shmbridge::error::ErrorKind;
use shmbridge::observer::Observer;
use shmbridge::region;
use shmbridge::{
    AttachOptions, Client, CommandError, CommandHandler, DType, Direction, Engine, EngineSpec,
    Error, Reply, ResetRequest, Tensors,
};

const T: Duration = Duration::from_secs(30);
/// Elements of the large tensor: 256 KiB, many pages, so a copy that overlapped a write
/// would mix two values.
const BIG: usize = 65_536;

fn spec() -> EngineSpec {
    EngineSpec::new("observed", 2)
        .tensor(
            "big",
            DType::U32,
            &[2, (BIG / 2) as u64],
            Direction::EngineToClient,
        )
        .tensor("tag", DType::U64, &[2], Direction::EngineToClient)
        .tensor("actions", DType::U32, &[2], Direction::ClientToEngine)
}

/// What the engine writes: every element of `big` one value (a step's: its frame
/// number; a reset's: a counter with the top bit set), `tag` the frame number at steps.
struct Writer {
    resets: u32,
}

impl Writer {
    fn step(io: &mut Tensors<'_>, frame: u64) {
        io.write::<u32>("big").unwrap().fill(frame as u32);
        io.write::<u64>("tag").unwrap().fill(frame);
    }
}

impl CommandHandler for Writer {
    fn reset(&mut self, io: &mut Tensors<'_>, _req: &ResetRequest) -> Result<(), CommandError> {
        self.resets += 1;
        io.write::<u32>("big")
            .map_err(CommandError::engine)?
            .fill(0x8000_0000 | self.resets);
        Ok(())
    }
    fn call(
        &mut self,
        _io: &mut Tensors<'_>,
        _m: &str,
        _a: &[(String, String)],
        _p: &[u8],
    ) -> Result<Reply, CommandError> {
        Ok(Reply::default())
    }
}

/// The observer's check of one accepted copy: `big` is one value, `tag` the frame the
/// copy says, and `big` holds that frame's value or a reset's made after it.
fn check_copy(frame: u64, big: &[u8], tag: &[u8]) -> Result<(), String> {
    let words: Vec<u32> = big
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let first = words[0];
    if let Some(i) = words.iter().position(|&w| w != first) {
        return Err(format!(
            "frame {frame}: torn copy, element 0 is {first:#x}, element {i} is {:#x}",
            words[i]
        ));
    }
    let tags: Vec<u64> = tag
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    if tags.iter().any(|&t| t != frame) {
        return Err(format!("frame {frame}: tag says {tags:?}"));
    }
    if first != frame as u32 && first & 0x8000_0000 == 0 {
        return Err(format!("frame {frame}: big holds {first}, another frame's"));
    }
    Ok(())
}

#[test]
fn every_accepted_copy_is_one_frame_while_the_engine_steps_and_resets() {
    let mut engine = Engine::create(spec()).unwrap();
    Writer::step(&mut engine.tensors(), 0);
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let serving = std::thread::spawn(move || {
        let mut writer = Writer { resets: 0 };
        loop {
            match engine.wait_actions_with(T, &mut writer) {
                Ok(n) => {
                    Writer::step(&mut engine.tensors(), n);
                    engine.publish().unwrap();
                }
                Err(Error::PeerClosed { .. }) => return writer.resets,
                Err(e) => panic!("engine: {e}"),
            }
        }
    });
    let observer = Observer::attach(&name, T).unwrap();
    let picks = [
        observer.pick("big", 0..2).unwrap(),
        observer.pick("tag", 0..2).unwrap(),
    ];
    // The client steps without pause and resets every 50 steps; every 64 steps it waits
    // until the observer accepted one more copy, so the run has a known number of them,
    // most taken while the engine works.
    let (accepted_tx, accepted) = mpsc::channel::<()>();
    let done = Arc::new(AtomicBool::new(false));
    let watching = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut out = observer.buffers(&picks).unwrap();
            let (mut good, mut torn, mut last) = (0u64, 0u64, 0u64);
            while !done.load(Ordering::Relaxed) {
                match observer.try_read(&picks, &mut out).unwrap() {
                    Some(frame) => {
                        check_copy(frame, &out[0], &out[1]).unwrap();
                        assert!(frame >= last, "frames went back: {last} then {frame}");
                        last = frame;
                        good += 1;
                        let _ = accepted_tx.send(());
                    }
                    None => torn += 1,
                }
            }
            (good, torn)
        })
    };
    let mut client = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
    let steps = 3_000u64;
    for n in 1..=steps {
        client.step(T).unwrap();
        if n % 50 == 0 {
            client.reset(None, &[], T).unwrap();
        }
        if n % 64 == 0 {
            accepted
                .recv_timeout(T)
                .expect("the observer accepted no copy");
        }
    }
    done.store(true, Ordering::Relaxed);
    let (good, torn) = watching.join().unwrap();
    client.close();
    let resets = serving.join().unwrap();
    assert_eq!(resets, (steps / 50) as u32);
    assert!(good >= steps / 64, "{good} copies accepted");
    eprintln!("{good} copies accepted and checked, {torn} thrown away as torn");
}

#[test]
fn episode_totals_are_what_the_client_saw() {
    let n = 16u32;
    let mut env = CartPole::new(n, 3).unwrap();
    let mut engine = Engine::create(shmbridge::envs::cartpole::spec(n)).unwrap();
    let name = engine.name().to_string();
    let (named_tx, named) = mpsc::channel();
    let serving = std::thread::spawn(move || {
        serve(&mut engine, &mut env, T, |name| {
            named_tx.send(name.to_string()).unwrap()
        })
        .unwrap()
    });
    assert_eq!(named.recv().unwrap(), name);
    let observer = Observer::attach(&name, T).unwrap();
    let before = observer.stats(T).unwrap();
    assert_eq!((before.episodes, before.frame), (0, 0));
    let mut client = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
    let mut lengths = vec![0u64; n as usize];
    let mut ended: Vec<(u32, u64)> = Vec::new();
    let mut seed = 5u64;
    for _ in 0..400 {
        for a in client.tensor_mut::<i64>("actions").unwrap() {
            *a = (common::next_random(&mut seed) & 1) as i64;
        }
        client.step(T).unwrap();
        let term = client.tensor::<u8>("terminated").unwrap().to_vec();
        let trunc = client.tensor::<u8>("truncated").unwrap().to_vec();
        for e in 0..n as usize {
            lengths[e] += 1;
            if term[e] != 0 || trunc[e] != 0 {
                ended.push((e as u32, lengths[e]));
                lengths[e] = 0;
            }
        }
    }
    let stats = observer.stats(T).unwrap();
    assert_eq!(stats.frame, 400);
    assert_eq!(stats.episodes, ended.len() as u64);
    assert!(
        stats.episodes > 28,
        "enough episodes to wrap the recent ones"
    );
    let total: u64 = ended.iter().map(|e| e.1).sum();
    assert_eq!(stats.length_sum, total);
    assert_eq!(stats.return_sum, total as f64, "reward 1 per step");
    // The recent episodes are the last 28 the client saw end, in order (the engine
    // records the envs of one step in env order, as the client scanned them).
    let recent: Vec<(u32, u64)> = stats
        .recent
        .iter()
        .map(|e| (e.env, u64::from(e.length)))
        .collect();
    assert_eq!(recent, ended[ended.len() - 28..]);
    assert_eq!(stats.recent.last().unwrap().number, stats.episodes - 1);
    client.close();
    assert_eq!(
        serving.join().unwrap(),
        ServeEnd::ClientClosed { steps: 400 }
    );
}

/// `/proc/self/fdinfo` flags of the observer's file and the permissions of its mappings
/// in `/proc/self/maps`.
fn open_mode_and_mapping(name: &str) -> (u32, Vec<String>) {
    let mut modes = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if target.to_string_lossy().ends_with(name) {
            let info = std::fs::read_to_string(format!(
                "/proc/self/fdinfo/{}",
                entry.file_name().to_string_lossy()
            ))
            .unwrap();
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .map(|f| u32::from_str_radix(f.trim(), 8).unwrap())
                .unwrap();
            modes.push(flags);
        }
    }
    assert_eq!(modes.len(), 1, "one descriptor of {name}: {modes:?}");
    let maps = std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.ends_with(name) || l.contains(&format!("{name} (deleted)")))
        .map(|l| l.split_whitespace().nth(1).unwrap().to_string())
        .collect();
    (modes[0], maps)
}

#[test]
fn an_observer_opens_read_only_and_nobody_sees_it() {
    // The engine in another process, so that this process's only descriptor and
    // mapping of the region are the observer's.
    let engine = common::EngineProc::start(&["--env", "null", "--num-envs", "4"]);
    let observer = Observer::attach(&engine.name, T).unwrap();
    let (flags, maps) = open_mode_and_mapping(&engine.name);
    assert_eq!(flags & libc_o_accmode(), 0, "O_RDONLY, flags {flags:o}");
    assert!(
        maps.is_empty(),
        "no mapping: every read is a pread ({maps:?})"
    );
    // Not the client: the slot stays free and a client attaches and steps.
    let (header, _) = region::read_header_bytes(&engine.name).unwrap();
    let h = shmbridge::layout::read_header(&header).unwrap();
    assert_eq!((h.client_state, h.client_pid), (0, 0));
    let mut client = Client::attach(&engine.name, AttachOptions::default().timeout(T)).unwrap();
    client.step(T).unwrap();
    // gc sees the live engine alone and leaves the region.
    let swept = region::sweep_report().unwrap();
    let seen = swept.iter().find(|s| s.name == engine.name).unwrap();
    assert_eq!(seen.verdict, region::Verdict::Alive);
    assert!(region::engine_alive(&engine.name).unwrap());
    assert_eq!(observer.frame().unwrap(), 1);
    observer.check().unwrap();
    drop(observer);
    client.close();
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
}

fn libc_o_accmode() -> u32 {
    0o3
}

#[test]
fn a_closed_engine_is_engine_closed_and_a_killed_one_engine_died() {
    // Closed: the engine process exits after its client closes.
    let engine = common::EngineProc::start(&["--env", "null", "--num-envs", "4"]);
    let observer = Observer::attach(&engine.name, T).unwrap();
    let client = Client::attach(&engine.name, AttachOptions::default().timeout(T)).unwrap();
    client.close();
    let _ = engine.finish();
    let got = observer.check().unwrap_err();
    assert_eq!(got.kind(), ErrorKind::EngineClosed, "{got}");
    let picks = [observer.pick("obs", 0..4).unwrap()];
    let got = observer
        .read(&picks, &mut observer.buffers(&picks).unwrap(), T)
        .unwrap_err();
    assert_eq!(got.kind(), ErrorKind::EngineClosed, "{got}");

    // Killed: nobody closed the region; its lock on byte 0 went with it.
    let mut engine = common::EngineProc::start(&["--env", "null", "--num-envs", "4"]);
    let name = engine.name.clone();
    let observer = Observer::attach(&name, T).unwrap();
    engine.child.kill().unwrap();
    engine.child.wait().unwrap();
    let got = observer.check().unwrap_err();
    assert_eq!(got.kind(), ErrorKind::EngineDied, "{got}");
    let got = observer.stats(T).unwrap_err();
    assert_eq!(got.kind(), ErrorKind::EngineDied, "{got}");
    // The observer removes nothing: the name is the client's or gc's to remove.
    assert!(common::shm_exists(&name));
    drop(observer);
    let swept = region::sweep_report().unwrap();
    assert!(swept.iter().any(|s| s.name == name && s.removed()));
}

#[test]
fn a_truncated_region_is_region_too_small_never_a_fault() {
    let engine =
        common::EngineProc::start(&["--env", "null", "--num-envs", "4", "--obs-dim", "4096"]);
    let observer = Observer::attach(&engine.name, T).unwrap();
    let picks = [observer.pick("obs", 0..4).unwrap()];
    let mut out = observer.buffers(&picks).unwrap();
    observer.read(&picks, &mut out, T).unwrap();
    // Someone with the owner's rights cuts the file to one page.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(common::shm_path(&engine.name))
        .unwrap();
    file.set_len(4096).unwrap();
    for got in [
        observer.read(&picks, &mut out, T).unwrap_err(),
        observer.stats(T).unwrap_err(),
        observer.check().unwrap_err(),
        observer.frame().unwrap_err(),
    ] {
        assert_eq!(got.kind(), ErrorKind::RegionTooSmall, "{got}");
    }
}

#[test]
fn observers_of_what_is_not_there_or_not_theirs_get_clear_errors() {
    let got = Observer::attach("shmbridge-no-such-region", T).unwrap_err();
    assert_eq!(got.kind(), ErrorKind::NotFound);
    let mut engine = Engine::create(spec()).unwrap();
    engine.publish().unwrap();
    let observer = Observer::attach(engine.name(), T).unwrap();
    let err = observer.pick("actions", 0..2).unwrap_err();
    assert!(err.to_string().contains("written by the client"), "{err}");
    let err = observer.pick("big", 1..3).unwrap_err();
    assert!(err.to_string().contains("envs 1..3"), "{err}");
    let err = observer.pick("nothing", 0..2).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NoSuchTensor);
    // One env's rows only.
    let picks = [observer.pick("big", 1..2).unwrap()];
    let mut out = observer.buffers(&picks).unwrap();
    assert_eq!(observer.read(&picks, &mut out, T).unwrap(), 0);
    assert_eq!(out[0].len(), BIG / 2 * 4);
}

#[test]
fn a_region_of_an_earlier_engine_is_refused_with_the_reason() {
    // What a 1.6 engine writes: no stats area, flags 0 (the 1.7 builder's bytes with
    // its three 1.7 fields put back).
    let b = shmbridge::layout::HeaderBuilder::new("old", 2, &spec().tensors, 0).unwrap();
    let mut h = b.header;
    h.flags = 0;
    h.stats_offset = 0;
    h.region_size = b.stats.offset;
    h.magic = shmbridge::layout::MAGIC;
    h.engine_state = 1;
    let mut bytes = b.bytes();
    bytes[..shmbridge::layout::CONTROL_SIZE].copy_from_slice(bytemuck::bytes_of(&h));
    bytes.resize(h.region_size as usize, 0);
    let name = format!("shmbridge-observer-old-{}", std::process::id());
    let path = common::shm_path(&name);
    std::fs::write(&path, &bytes).unwrap();
    let got = Observer::attach(&name, T).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(got.kind(), ErrorKind::InvalidHeader, "{got}");
    assert!(got.to_string().contains("predates observers"), "{got}");
}

/// The truncation race: an observer in a process of its own copies a 1 MiB tensor and
/// reads the stats in a loop while the region is cut under it, to one page (the tensor
/// and the stats block gone: the copy's `pread` comes up short) or by its last page (the
/// stats block), in turn, 200 times (an engine each: one whose region was cut ends).
/// Every run must end with `RegionTooSmall` (or the engine's end, which the cut brings
/// about), never a signal. Before every word came
/// from `pread`, the sequence words loaded through the mapping after a short copy, or
/// the stats block's, killed the observer with SIGBUS (in about one run in three).
#[test]
fn an_observer_racing_a_truncation_never_dies_of_a_signal() {
    let mut signals = Vec::new();
    for run in 0..200 {
        let engine =
            common::EngineProc::start(&["--env", "null", "--num-envs", "4", "--obs-dim", "65536"]);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(common::shm_path(&engine.name))
            .unwrap();
        let size = file.metadata().unwrap().len();
        let mut peer = PeerProc::start("observer_peer", &format!("truncated {}", engine.name));
        peer.expect("reading");
        let cut = if run % 2 == 0 { 4096 } else { size - 4096 };
        file.set_len(cut).unwrap();
        let status = peer
            .wait_end()
            .expect("the observer ends once the file is cut");
        if status.code().is_none() {
            signals.push((run, cut, status, peer.stderr_at_end()));
        } else {
            assert!(
                status.success(),
                "run {run}: {status}: {}",
                peer.stderr_at_end()
            );
        }
    }
    assert!(
        signals.is_empty(),
        "observers killed by a signal: {signals:?}"
    );
}

/// Not a test: the observer process of the truncation race (role `truncated NAME`).
/// Says `reading` after its first whole copy, then copies and reads the stats without
/// pause until an error; exits 0 on `RegionTooSmall` (or the engine's end), 1 on any
/// other.
#[test]
#[ignore = "a peer process the truncation race starts itself"]
fn observer_peer() {
    let Some(role) = peer::role() else {
        return;
    };
    let name = role
        .strip_prefix("truncated ")
        .expect("role truncated NAME");
    let observer = Observer::attach(name, T).expect("observe");
    let picks = [observer.pick("obs", 0..4).expect("pick")];
    let mut out = observer.buffers(&picks).expect("buffers");
    observer.read(&picks, &mut out, T).expect("a first copy");
    peer::say("reading");
    let err = loop {
        if let Err(e) = observer.try_read(&picks, &mut out) {
            break e;
        }
        if let Err(e) = observer.try_stats() {
            break e;
        }
    };
    eprintln!("observer: {err}");
    // The cut, or the engine's end, which the cut brings about (it checks its region's
    // size too) and which the observer may see first.
    let expected = [
        ErrorKind::RegionTooSmall,
        ErrorKind::EngineDied,
        ErrorKind::EngineClosed,
    ];
    std::process::exit(if expected.contains(&err.kind()) { 0 } else { 1 });
}
