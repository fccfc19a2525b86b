//! Sharded regions (protocol 1.4): K engine processes (or threads, each with its own
//! mapping and descriptor, as processes have) serve one region; one client steps them all.

mod common;

use std::time::Duration;

use shmbridge::command::{CommandError, CommandHandler, Reply, ResetRequest};
use shmbridge::engine::JoinOptions;
use shmbridge::layout::{self, HeaderBuilder};
use shmbridge::{AttachOptions, Client, DType, Direction, Engine, EngineSpec, Error, Tensors};

use common::{shm_exists, signal, EngineProc};

const T: Duration = Duration::from_secs(10);

fn unique(tag: &str) -> String {
    format!(
        "shards-{tag}-{}-{}",
        std::process::id(),
        shmbridge::region::random_name().unwrap().len()
    )
}

/// `obs[e] = (frame, e)` for the envs of this engine's slice, as global env numbers; the
/// reward echoes the action.
fn write_frame(engine: &mut Engine, frame: u64) {
    let first = engine.shard().env_start as u64;
    let n = engine.num_envs();
    let actions: Vec<f32> = engine.tensor::<f32>("actions").unwrap().to_vec();
    assert_eq!(actions.len(), n, "the action view is the slice");
    let obs = engine.tensor_mut::<f32>("obs").unwrap();
    assert_eq!(obs.len(), n * 2, "the obs view is the slice");
    for e in 0..n {
        obs[2 * e] = frame as f32;
        obs[2 * e + 1] = (first + e as u64) as f32;
    }
    let rewards = engine.tensor_mut::<f32>("rewards").unwrap();
    rewards.copy_from_slice(&actions);
}

/// Records the resets and methods a shard is asked for.
#[derive(Default)]
struct Recorder {
    index: u32,
    resets: Vec<(Option<Vec<u32>>, Vec<u64>)>,
}

impl CommandHandler for Recorder {
    fn reset(&mut self, _io: &mut Tensors<'_>, req: &ResetRequest) -> Result<(), CommandError> {
        self.resets.push((req.env_ids.clone(), req.seeds.clone()));
        Ok(())
    }
    fn call(
        &mut self,
        _io: &mut Tensors<'_>,
        method: &str,
        _args: &[(String, String)],
        _payload: &[u8],
    ) -> Result<Reply, CommandError> {
        match method {
            "whoami" => Ok(Reply::args(vec![("shard".into(), self.index.to_string())])),
            other => Err(CommandError::unknown_method(other, &["whoami"])),
        }
    }
}

fn spec(n: u32, shards: u32, name: &str) -> EngineSpec {
    EngineSpec::new("sharded-test", n)
        .tensor("obs", DType::F32, &[n as u64, 2], Direction::EngineToClient)
        .tensor(
            "actions",
            DType::F32,
            &[n as u64],
            Direction::ClientToEngine,
        )
        .tensor(
            "rewards",
            DType::F32,
            &[n as u64],
            Direction::EngineToClient,
        )
        .name(name)
        .shards(shards)
}

/// Serves `engine` until the client closes; returns what its handler recorded.
fn serve(mut engine: Engine) -> Recorder {
    let mut rec = Recorder {
        index: engine.shard().index,
        ..Default::default()
    };
    write_frame(&mut engine, 0);
    engine.publish().unwrap();
    loop {
        match engine.wait_actions_with(T, &mut rec) {
            Ok(n) => {
                write_frame(&mut engine, n);
                engine.publish().unwrap();
            }
            Err(Error::PeerClosed { .. }) => return rec,
            Err(e) => panic!("shard {}: {e}", rec.index),
        }
    }
}

#[test]
fn one_shard_region_is_byte_identical_to_protocol_1_3() {
    // The golden files were written by the 1.3 builder (before shards existed) for the
    // same specs: an unsharded region must not have moved a byte. 1.7 adds the stats
    // area after the last tensor and says so in three fields an earlier reader ignores
    // or only bounds by: `flags` (bit 0), `stats_offset` (formerly reserved) and a
    // `region_size` one page longer. Every other byte is the golden one.
    let cartpole = EngineSpec::standard("cartpole", 4, 4, 1, DType::I64).tensor(
        "final_obs",
        DType::F32,
        &[4, 4],
        Direction::EngineToClient,
    );
    let null = EngineSpec::standard("null", 64, 16, 1, DType::F32).ring_capacity(0);
    for (file, spec) in [("cartpole-4.bin", cartpole), ("null-64-norings.bin", null)] {
        let golden = std::fs::read(format!(
            "{}/tests/golden/{file}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap();
        for shards in [1, 0] {
            let b = HeaderBuilder::sharded(
                &spec.kind,
                spec.num_envs,
                &spec.tensors,
                spec.ring_capacity,
                shards,
            )
            .unwrap();
            let mut bytes = b.bytes();
            let h = layout::read_header(&bytes).unwrap();
            let g = layout::read_header(&golden).unwrap();
            assert_eq!(h.flags, layout::FLAG_OBSERVABLE);
            assert_eq!(h.stats_offset, g.region_size, "right after the tensors");
            assert_eq!(h.region_size, g.region_size + 4096, "one block, one page");
            let mut header = h;
            header.flags = 0;
            header.stats_offset = 0;
            header.region_size = g.region_size;
            bytes[..layout::CONTROL_SIZE].copy_from_slice(bytemuck::bytes_of(&header));
            assert_eq!(bytes, golden, "{file}, {shards} shard(s)");
        }
    }
}

#[test]
fn a_1_3_reader_refuses_a_sharded_region() {
    // What a reader that knows nothing of shards checks first: the layout hash it has.
    let b = HeaderBuilder::sharded("t", 8, &spec(8, 2, "x").tensors, 4096, 2).unwrap();
    assert_eq!(b.header.version_minor, 4);
    assert_ne!(b.header.layout_hash, layout::LAYOUT_HASH);
    assert_eq!(b.header.layout_hash, layout::LAYOUT_HASH_SHARDED);
}

#[test]
fn the_env_axis_is_split_into_contiguous_slices() {
    let b = HeaderBuilder::sharded("t", 10, &spec(10, 4, "x").tensors, 4096, 4).unwrap();
    let slices: Vec<_> = b
        .shards()
        .iter()
        .map(|s| (s.env_start, s.env_count))
        .collect();
    assert_eq!(slices, vec![(0, 3), (3, 3), (6, 2), (8, 2)]);
    let mut bytes = b.bytes();
    bytes[..8].copy_from_slice(&layout::MAGIC.to_le_bytes());
    let l = layout::validate("x", &bytes, b.header.region_size).unwrap();
    assert_eq!(l.shards, b.shards());
    let obs = &l.tensors[0];
    let third = l.narrowed(&l.shards[2]);
    assert_eq!(third.num_envs, 2);
    assert_eq!(third.tensors[0].shape, vec![2, 2]);
    assert_eq!(
        third.tensors[0].offset,
        obs.offset + 6 * 2 * 4,
        "rows 6..8 of obs"
    );
    assert_eq!(third.tensors[0].nbytes, 2 * 2 * 4);
}

#[test]
fn sharding_refuses_what_cannot_be_split() {
    let too_many = HeaderBuilder::sharded("t", 2, &spec(2, 3, "x").tensors, 0, 3);
    assert!(
        matches!(too_many, Err(Error::InvalidSpec(_))),
        "{too_many:?}"
    );
    let scalar = EngineSpec::new("t", 4)
        .tensor("obs", DType::F32, &[4], Direction::EngineToClient)
        .tensor("global", DType::F32, &[1], Direction::EngineToClient);
    let r = HeaderBuilder::sharded("t", 4, &scalar.tensors, 0, 2);
    assert!(matches!(r, Err(Error::InvalidSpec(_))), "{r:?}");
}

#[test]
fn three_shards_step_one_contiguous_region_in_lock_step() {
    let name = unique("lockstep");
    let n = 7u32;
    let creator = Engine::create(spec(n, 3, &name)).unwrap();
    let region = creator.name().to_string();
    let mut threads = vec![std::thread::spawn(move || serve(creator))];
    for k in 1..3 {
        let region = region.clone();
        threads.push(std::thread::spawn(move || {
            serve(Engine::join(&region, k, JoinOptions::default()).unwrap())
        }));
    }
    let mut client = Client::attach(&region, AttachOptions::default()).unwrap();
    assert_eq!(client.num_envs(), n as usize);
    let spans: Vec<_> = client.shards().iter().map(|s| s.envs()).collect();
    assert_eq!(spans, vec![0..3, 3..5, 5..7]);
    // One obs tensor over every env, in the region, whichever shard writes a row.
    let obs_info = client.layout().tensor("obs").unwrap().1.clone();
    assert_eq!(obs_info.shape, vec![n as u64, 2]);
    for step in 0..300u64 {
        {
            let actions = client.tensor_mut::<f32>("actions").unwrap();
            for (e, a) in actions.iter_mut().enumerate() {
                *a = (step * 100 + e as u64) as f32;
            }
        }
        let frame = if step == 0 {
            0
        } else {
            client.step(T).unwrap()
        };
        assert_eq!(frame, step);
        let obs = client.tensor::<f32>("obs").unwrap();
        for e in 0..n as usize {
            assert_eq!(obs[2 * e], step as f32, "env {e} at step {step}");
            assert_eq!(obs[2 * e + 1], e as f32, "env {e} written by its own shard");
        }
        if step > 0 {
            let rewards = client.tensor::<f32>("rewards").unwrap();
            for (e, r) in rewards.iter().enumerate() {
                assert_eq!(*r, (step * 100 + e as u64) as f32, "reward of env {e}");
            }
        }
    }
    // Commands: resets routed to the owners, methods to one shard or all.
    client.reset(Some(&[6, 0, 4, 1]), &[100], T).unwrap();
    client.reset(None, &[7], T).unwrap();
    let all = client.call_method_all("whoami", &[], &[], T).unwrap();
    let who: Vec<_> = all.iter().map(|r| r.args[0].1.clone()).collect();
    assert_eq!(who, vec!["0", "1", "2"]);
    let one = client.call_method_on(2, "whoami", &[], &[], T).unwrap();
    assert_eq!(one.args[0].1, "2");
    let schema = client.schema(T).unwrap();
    match schema {
        shmbridge::wire::Body::Schema { num_envs, .. } => assert_eq!(num_envs, n),
        other => panic!("{other:?}"),
    }
    client.close();
    let recs: Vec<Recorder> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    // env 6 (list position 0) → shard 2 local 1 seed 100; env 0 (pos 1) → shard 0 local 0
    // seed 101; env 4 (pos 2) → shard 1 local 1 seed 102; env 1 (pos 3) → shard 0 local 1.
    assert_eq!(recs[0].resets[0], (Some(vec![0, 1]), vec![101, 103]));
    assert_eq!(recs[1].resets[0], (Some(vec![1]), vec![102]));
    assert_eq!(recs[2].resets[0], (Some(vec![1]), vec![100]));
    // Every env: one seed `s` becomes `s + env_start` per shard, so env e gets s + e.
    assert_eq!(recs[0].resets[1], (None, vec![7]));
    assert_eq!(recs[1].resets[1], (None, vec![10]));
    assert_eq!(recs[2].resets[1], (None, vec![12]));
    assert!(!shm_exists(&region), "the creator removed the region");
}

#[test]
fn a_shard_index_is_served_by_one_process_only() {
    let name = unique("taken");
    let creator = Engine::create(spec(4, 2, &name)).unwrap();
    let region = creator.name().to_string();
    let first = Engine::join(&region, 1, JoinOptions::default()).unwrap();
    let second = Engine::join(&region, 1, JoinOptions::default());
    assert!(
        matches!(second, Err(Error::ShardTaken { shard: 1, .. })),
        "{second:?}"
    );
    let zero = Engine::join(&region, 0, JoinOptions::default());
    assert!(
        matches!(zero, Err(Error::ShardTaken { shard: 0, .. })),
        "{zero:?}"
    );
    let out_of_range = Engine::join(&region, 2, JoinOptions::default());
    assert!(
        matches!(out_of_range, Err(Error::InvalidSpec(_))),
        "{out_of_range:?}"
    );
    drop(first);
    drop(creator);
    assert!(!shm_exists(&region));
}

#[test]
fn a_dead_shard_is_a_clear_error_naming_it_and_its_envs() {
    let name = unique("death");
    let args = |k: &str| {
        vec![
            "--env".to_string(),
            "null".into(),
            "--num-envs".into(),
            "8".into(),
            "--name".into(),
            name.clone(),
            "--shard".into(),
            format!("{k}/2"),
        ]
    };
    let a0 = args("0");
    let a1 = args("1");
    let shard0 = EngineProc::start(&a0.iter().map(String::as_str).collect::<Vec<_>>());
    let shard1 = EngineProc::start(&a1.iter().map(String::as_str).collect::<Vec<_>>());
    let region = shard0.name.clone();
    let mut client = Client::attach(&region, AttachOptions::default()).unwrap();
    // The null pattern over the region's flat index, whichever shard wrote it.
    for step in 1..=5u64 {
        assert_eq!(client.step(T).unwrap(), step);
        let obs = client.tensor::<f32>("obs").unwrap();
        for (i, v) in obs.iter().enumerate() {
            assert_eq!(
                *v,
                shmbridge::envs::null::pattern(step, i as u64),
                "element {i}"
            );
        }
    }
    signal(shard1.pid(), rustix::process::Signal::KILL);
    let err = client.step(T).unwrap_err();
    match err {
        Error::ShardDied {
            shard: 1,
            env_start: 4,
            env_end: 8,
            pid,
            pid_ns,
        } => {
            assert_eq!(pid, shard1.pid());
            assert_eq!(pid_ns, shmbridge::error::PidNamespace::This);
        }
        other => panic!("expected shard 1 (envs 4..8) dead, got {other}"),
    }
    // Shard 0 stops by itself, naming its dead sibling, and removes the region.
    let (status, stderr) = shard0.finish();
    assert!(!status.success());
    assert!(stderr.contains("shard 1"), "{stderr}");
    assert!(!shm_exists(&region), "nothing left in /dev/shm");
    client.close();
    drop(shard1);
}

#[test]
fn shards_stop_when_the_creator_dies() {
    let name = unique("creator");
    let a0 = [
        "--env",
        "null",
        "--num-envs",
        "4",
        "--name",
        &name,
        "--shard",
        "0/2",
    ];
    let shard0 = EngineProc::start(&a0);
    let a1 = [
        "--env",
        "null",
        "--num-envs",
        "4",
        "--name",
        &name,
        "--shard",
        "1/2",
    ];
    let shard1 = EngineProc::start(&a1);
    let region = shard0.name.clone();
    let client = Client::attach(&region, AttachOptions::default()).unwrap();
    signal(shard0.pid(), rustix::process::Signal::KILL);
    drop(shard0);
    // The joined shard notices the creator's lock is gone on its next slice and exits
    // with an error naming shard 0, rather than waiting for actions forever.
    let (status, stderr) = shard1.finish();
    assert!(!status.success());
    assert!(stderr.contains("shard 0"), "{stderr}");
    drop(client);
    let _ = shmbridge::region::sweep();
    assert!(!shm_exists(&region));
}

#[test]
fn a_second_client_attaches_after_the_first_closed() {
    // The shards keep serving across clients: the second one starts from the frame every
    // shard has published, not from the control block's (unused) frame counter.
    let name = unique("reattach");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let serve_clients =
        |mut engine: Engine, stop: std::sync::Arc<std::sync::atomic::AtomicBool>| {
            write_frame(&mut engine, 0);
            engine.publish().unwrap();
            let mut rec = Recorder::default();
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                match engine.wait_actions_with(Duration::from_millis(20), &mut rec) {
                    Ok(n) => {
                        write_frame(&mut engine, n);
                        engine.publish().unwrap();
                    }
                    Err(Error::PeerClosed { .. } | Error::Timeout { .. }) => {}
                    // Between clients a shard keeps checking its siblings: once the test
                    // stops, the one that stopped first has closed its shard.
                    Err(Error::ShardClosed { .. })
                        if stop.load(std::sync::atomic::Ordering::Acquire) =>
                    {
                        break
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        };
    let creator = Engine::create(spec(4, 2, &name)).unwrap();
    let region = creator.name().to_string();
    let joined = Engine::join(&region, 1, JoinOptions::default()).unwrap();
    let threads: Vec<_> = [creator, joined]
        .into_iter()
        .map(|e| {
            let stop = stop.clone();
            std::thread::spawn(move || serve_clients(e, stop))
        })
        .collect();
    for round in 0..2u64 {
        let mut client = Client::attach(&region, AttachOptions::default()).unwrap();
        assert_eq!(client.frame(), round * 3);
        for _ in 0..3 {
            let n = client.step(T).unwrap();
            assert_eq!(client.tensor::<f32>("obs").unwrap()[6], n as f32);
        }
        assert_eq!(client.counters(), ((round + 1) * 3, (round + 1) * 3));
        client.close();
    }
    stop.store(true, std::sync::atomic::Ordering::Release);
    for t in threads {
        t.join().unwrap();
    }
    assert!(!shm_exists(&region));
}

#[test]
fn inspect_lists_every_shard() {
    let name = unique("inspect");
    let a0 = [
        "--env",
        "cartpole",
        "--num-envs",
        "5",
        "--name",
        &name,
        "--shard",
        "0/2",
    ];
    let a1 = [
        "--env",
        "cartpole",
        "--num-envs",
        "5",
        "--name",
        &name,
        "--shard",
        "1/2",
    ];
    let (shard0, shard1) = (EngineProc::start(&a0), EngineProc::start(&a1));
    let out = std::process::Command::new(common::BIN)
        .args(["inspect", &shard0.name])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("version       1.4"), "{text}");
    for (k, envs, pid) in [(0, "0..3", shard0.pid()), (1, "3..5", shard1.pid())] {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("shard {k} ")))
            .unwrap_or_else(|| panic!("no line for shard {k}: {text}"));
        assert!(line.contains(&format!("envs {envs} pid {pid} ")), "{line}");
        // 1.10: each shard's own action word too (0: no asynchronous action pending).
        assert!(
            line.contains("state ready frame_seq 0 action_seq 0"),
            "{line}"
        );
    }
    let region = shard0.name.clone();
    let client = Client::attach(&region, AttachOptions::default()).unwrap();
    client.close();
    for e in [shard0, shard1] {
        let (status, stderr) = e.finish();
        assert!(status.success(), "{stderr}");
    }
    assert!(!shm_exists(&region));
}
