//! Asynchronous batches over shards (protocol 1.10): `async_reset`, `recv`, `send`.
//! Shards are threads here (each with its own mapping and descriptor, as processes have),
//! or engine processes where one must die.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg32;
use shmbridge::command::{CommandError, CommandHandler, ResetRequest};
use shmbridge::engine::JoinOptions;
use shmbridge::{AttachOptions, Client, DType, Direction, Engine, EngineSpec, Error, Tensors};

use common::{signal, EngineProc};

const T: Duration = Duration::from_secs(20);

fn unique(tag: &str) -> String {
    format!("async-{tag}-{}", std::process::id())
}

fn spec(n: u32, shards: u32, name: &str) -> EngineSpec {
    EngineSpec::new("async-test", n)
        // Per env: the env's own step count, its id, the action it last took.
        .tensor("obs", DType::F32, &[n as u64, 3], Direction::EngineToClient)
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

/// Takes resets (which leave the step counts as they are).
struct Resets;

impl CommandHandler for Resets {
    fn reset(&mut self, _: &mut Tensors<'_>, _: &ResetRequest) -> Result<(), CommandError> {
        Ok(())
    }
}

/// Serves a shard until the client closes, each step after a random delay (0 to 2 ms,
/// its own seed: shards answer in an order nobody chose). Every env counts its steps;
/// returns those counts. With `more`, clients come in turn until it is cleared: then the
/// first client end (or a sibling's closure, for the shard that missed it) ends it.
fn serve_clients(mut engine: Engine, seed: u64, more: Option<Arc<AtomicBool>>) -> Vec<u64> {
    let mut rng = Pcg32::seed_from_u64(seed);
    let first = engine.shard().env_start;
    let n = engine.num_envs();
    let mut steps = vec![0u64; n];
    let write = |engine: &mut Engine, steps: &[u64]| {
        let actions: Vec<f32> = engine.tensor::<f32>("actions").unwrap().to_vec();
        let obs = engine.tensor_mut::<f32>("obs").unwrap();
        for e in 0..n {
            obs[3 * e] = steps[e] as f32;
            obs[3 * e + 1] = (first as usize + e) as f32;
            obs[3 * e + 2] = actions[e];
        }
        engine
            .tensor_mut::<f32>("rewards")
            .unwrap()
            .copy_from_slice(&actions);
    };
    write(&mut engine, &steps);
    engine.publish().unwrap();
    loop {
        match engine.wait_actions_with(T, &mut Resets) {
            Ok(_) => {
                // A delay, not a synchronisation: nothing waits for it to end.
                let us = if rng.random_range(0..5) == 0 {
                    rng.random_range(0..2000)
                } else {
                    rng.random_range(0..50)
                };
                std::thread::sleep(Duration::from_micros(us));
                for s in steps.iter_mut() {
                    *s += 1;
                }
                write(&mut engine, &steps);
                engine.publish().unwrap();
            }
            Err(Error::PeerClosed { .. }) => {
                if !more.as_ref().is_some_and(|m| m.load(Ordering::Acquire)) {
                    return steps;
                }
            }
            Err(Error::ShardClosed { .. })
                if more.as_ref().is_some_and(|m| !m.load(Ordering::Acquire)) =>
            {
                return steps
            }
            Err(e) => panic!("shard at env {first}: {e}"),
        }
    }
}

/// A region of `n` envs in `k` shards, each a thread serving with [`serve`].
fn start(tag: &str, n: u32, k: u32) -> (String, Vec<std::thread::JoinHandle<Vec<u64>>>) {
    start_for(tag, n, k, None)
}

/// [`start`], the shards serving clients in turn while `more` is set.
fn start_for(
    tag: &str,
    n: u32,
    k: u32,
    more: Option<Arc<AtomicBool>>,
) -> (String, Vec<std::thread::JoinHandle<Vec<u64>>>) {
    let creator = Engine::create(spec(n, k, &unique(tag))).unwrap();
    let region = creator.name().to_string();
    let m = more.clone();
    let mut threads = vec![std::thread::spawn(move || serve_clients(creator, 0, m))];
    for s in 1..k {
        let region = region.clone();
        let m = more.clone();
        threads.push(std::thread::spawn(move || {
            let joined = Engine::join(&region, s, JoinOptions::default()).unwrap();
            serve_clients(joined, u64::from(s), m)
        }));
    }
    (region, threads)
}

fn action_of(env: u32, step: u64) -> f32 {
    (u64::from(env) * 10_000 + step) as f32
}

#[test]
fn every_env_steps_once_per_action_sent_whatever_order_shards_answer() {
    let (n, k, b) = (12u32, 4u32, 6usize);
    let (region, threads) = start("stress", n, k);
    let mut client = Client::attach(&region, AttachOptions::default()).unwrap();
    let obs_base = client.tensor::<f32>("obs").unwrap().as_ptr() as usize;
    client.async_reset(b, &[], T).unwrap();
    // The client's own account: actions sent per env, and which envs it holds.
    let mut sent = vec![0u64; n as usize];
    let mut held = vec![false; n as usize];
    let mut orders = std::collections::HashSet::new();
    for round in 0..600 {
        let ids = client.recv(T).unwrap().to_vec();
        assert_eq!(ids.len(), b, "round {round}: a batch is batch_size envs");
        orders.insert(client.batch_shards().to_vec());
        // The batch's rows, read in place: the region's rows, not a copy.
        let starts: Vec<usize> = client
            .batch_shards()
            .iter()
            .map(|&s| client.shards()[s as usize].env_start as usize)
            .collect();
        let obs_rows = client.batch_rows::<f32>("obs").unwrap();
        for (rows, start) in obs_rows.iter().zip(starts) {
            assert_eq!(rows.as_ptr() as usize, obs_base + 3 * 4 * start);
        }
        let obs = obs_rows.concat();
        let rewards = client.batch_rows::<f32>("rewards").unwrap().concat();
        for (i, &e) in ids.iter().enumerate() {
            let e_ = e as usize;
            assert!(!held[e_], "round {round}: env {e} handed out twice");
            held[e_] = true;
            assert_eq!(obs[3 * i], sent[e_] as f32, "env {e}: one step per action");
            assert_eq!(obs[3 * i + 1], e as f32, "env {e}: its own row");
            if sent[e_] > 0 {
                let last = action_of(e, sent[e_] - 1);
                assert_eq!(obs[3 * i + 2], last, "env {e} took its own last action");
                assert_eq!(rewards[i], last, "env {e}'s reward");
            }
        }
        // Whole shards, contiguous envs each, in the order of batch_shards.
        let spans: Vec<u32> = client
            .batch_shards()
            .iter()
            .flat_map(|&s| client.shards()[s as usize].envs())
            .collect();
        assert_eq!(spans, ids);
        // Send in a shuffled order, sometimes split over two sends.
        let mut by_shard: Vec<Vec<u32>> = client
            .batch_shards()
            .iter()
            .map(|&s| client.shards()[s as usize].envs().rev().collect())
            .collect();
        if round % 2 == 1 {
            by_shard.reverse();
        }
        let mut actions = client.batch_rows_mut::<f32>("actions").unwrap();
        for (a, &e) in actions.iter_mut().flat_map(|r| r.iter_mut()).zip(&ids) {
            *a = action_of(e, sent[e as usize]);
        }
        if round % 3 == 0 && by_shard.len() > 1 {
            let rest = by_shard.split_off(1);
            client.send(&by_shard.concat()).unwrap();
            client.send(&rest.concat()).unwrap();
        } else {
            client.send(&by_shard.concat()).unwrap();
        }
        for &e in &ids {
            held[e as usize] = false;
            sent[e as usize] += 1;
        }
    }
    // Collect the frames still in flight, so every shard has answered every action.
    loop {
        match client.recv(T) {
            Ok(ids) => {
                let ids = ids.to_vec();
                let obs = client.batch_rows::<f32>("obs").unwrap().concat();
                for (i, e) in ids.into_iter().enumerate() {
                    assert_eq!(obs[3 * i], sent[e as usize] as f32);
                    held[e as usize] = true;
                }
            }
            Err(Error::OutOfOrder(_)) => break,
            Err(e) => panic!("{e}"),
        }
    }
    client.close();
    let counts: Vec<u64> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    assert_eq!(
        counts, sent,
        "each env stepped exactly once per action sent"
    );
    assert!(
        orders.len() > 1,
        "the shards answered in more than one order"
    );
}

#[test]
fn a_send_names_whole_received_shards_once_or_nothing_moves() {
    let (region, threads) = start("misuse", 8, 4);
    let mut client = Client::attach(&region, AttachOptions::default()).unwrap();
    // Not a multiple of the shard size (2), nor more than num_envs.
    for bad in [0, 3, 10] {
        assert!(matches!(
            client.async_reset(bad, &[], T),
            Err(Error::InvalidSpec(_))
        ));
    }
    assert!(matches!(client.recv(T), Err(Error::OutOfOrder(_))));
    client.async_reset(4, &[], T).unwrap();
    assert!(matches!(client.step(T), Err(Error::OutOfOrder(_))));
    let ids = client.recv(T).unwrap().to_vec();
    let shards = client.batch_shards().to_vec();
    assert_eq!((ids.len(), shards.len()), (4, 2));
    let other = (0..8).find(|e| !ids.contains(e)).unwrap();
    let not_in = |r: Result<(), Error>| match r {
        Err(Error::NotInBatch { env_id, .. }) => env_id,
        other => panic!("{other:?}"),
    };
    assert_eq!(not_in(client.send(&[other])), other, "not received");
    assert_eq!(
        not_in(client.send(&[ids[0], ids[1], ids[0]])),
        ids[0],
        "twice"
    );
    assert_eq!(not_in(client.send(&[ids[0]])), ids[1], "half a shard");
    let e = client.send(&[other]).unwrap_err();
    assert_eq!(e.kind(), shmbridge::error::ErrorKind::OutOfOrder);
    // The second recv takes the two shards not handed out; a third has none left.
    let more = client.recv(T).unwrap().to_vec();
    assert!(more.iter().all(|e| !ids.contains(e)));
    assert!(matches!(client.recv(T), Err(Error::OutOfOrder(_))));
    client.send(&ids[..2]).unwrap();
    assert_eq!(not_in(client.send(&ids[..2])), ids[0], "sent already");
    client.send(&ids[2..]).unwrap();
    client.send(&more).unwrap();
    // The frames of every action sent (a close does not wait for frames in flight).
    let mut back: Vec<u32> = (0..2)
        .flat_map(|_| client.recv(T).unwrap().to_vec())
        .collect();
    back.sort();
    assert_eq!(back, (0..8).collect::<Vec<u32>>());
    client.close();
    for t in threads {
        let steps = t.join().unwrap();
        assert_eq!(steps, vec![1, 1], "every env stepped once");
    }
}

#[test]
fn a_shard_dying_mid_batch_is_shard_died() {
    let name = unique("death");
    let args = |k: &str| {
        [
            "--env",
            "null",
            "--num-envs",
            "8",
            "--name",
            &name,
            "--shard",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("{k}/2")])
        .collect::<Vec<_>>()
    };
    let (a0, a1) = (args("0"), args("1"));
    let shard0 = EngineProc::start(&a0.iter().map(String::as_str).collect::<Vec<_>>());
    let shard1 = EngineProc::start(&a1.iter().map(String::as_str).collect::<Vec<_>>());
    let mut client = Client::attach(&shard0.name, AttachOptions::default()).unwrap();
    client.async_reset(4, &[], T).unwrap();
    let ids = client.recv(T).unwrap().to_vec();
    client.send(&ids).unwrap();
    signal(shard1.pid(), rustix::process::Signal::KILL);
    // Shard 0 may answer a few more batches before it notices its sibling is gone;
    // shard 1's frames never come: the wait ends naming it.
    let err = loop {
        match client.recv(T) {
            Ok(ids) => {
                let ids = ids.to_vec();
                if let Err(e) = client.send(&ids) {
                    break e;
                }
            }
            Err(e) => break e,
        }
    };
    match err {
        Error::ShardDied {
            shard: 1,
            env_start: 4,
            env_end: 8,
            pid,
            ..
        } => assert_eq!(pid, shard1.pid()),
        other => panic!("expected shard 1 (envs 4..8) dead, got {other}"),
    }
    client.close();
    let _ = shard0.finish();
    drop(shard1);
}

#[test]
fn an_unsharded_region_has_no_asynchronous_batches() {
    let mut engine = Engine::create(spec(4, 1, &unique("one"))).unwrap();
    engine.publish().unwrap();
    let mut client = Client::attach(engine.name(), AttachOptions::default()).unwrap();
    assert!(matches!(
        client.async_reset(4, &[], T),
        Err(Error::InvalidSpec(_))
    ));
    // And lock-step still works.
    client.tensor_mut::<f32>("actions").unwrap().fill(1.0);
    let t = std::thread::spawn(move || {
        engine.wait_actions(T).unwrap();
        engine.publish().unwrap();
        engine
    });
    assert_eq!(client.step(T).unwrap(), 1);
    drop(t.join().unwrap());
}

#[test]
fn a_client_after_an_asynchronous_one_steps_asynchronously_where_it_left_them() {
    let more = Arc::new(AtomicBool::new(true));
    let (region, threads) = start_for("second", 4, 2, Some(more.clone()));
    let mut first = Client::attach(&region, AttachOptions::default()).unwrap();
    first.async_reset(2, &[], T).unwrap();
    // Shard a steps twice, shard b never: they stand at frames 2 and 0.
    let a = first.recv(T).unwrap().to_vec();
    first.send(&a).unwrap();
    let again = loop {
        let ids = first.recv(T).unwrap().to_vec();
        if ids == a {
            break ids;
        }
    };
    first.send(&again).unwrap();
    assert_eq!(first.recv(T).unwrap(), &a[..], "the other shard is held");
    first.close();
    let mut second = Client::attach(&region, AttachOptions::default()).unwrap();
    // Lock-step cannot step shards at different frames; asynchronous batches can.
    let e = second.step(T).unwrap_err();
    assert!(
        matches!(e, Error::OutOfOrder(m) if m.contains("different frames")),
        "{e}"
    );
    second.async_reset(2, &[], T).unwrap();
    let mut got = [
        second.recv(T).unwrap().to_vec(),
        second.recv(T).unwrap().to_vec(),
    ];
    got.sort();
    assert_eq!(got, [vec![0, 1], vec![2, 3]]);
    let obs = second.tensor::<f32>("obs").unwrap();
    let frames: Vec<f32> = (0..4).map(|e| obs[3 * e]).collect();
    let b_first = a[0] == 2;
    let expected = if b_first {
        [0.0, 0.0, 2.0, 2.0]
    } else {
        [2.0, 2.0, 0.0, 0.0]
    };
    assert_eq!(
        frames, expected,
        "each shard where the first client left it"
    );
    second.send(&[0, 1, 2, 3]).unwrap();
    // Both frames back, so both steps are done before the close.
    let mut got = [
        second.recv(T).unwrap().to_vec(),
        second.recv(T).unwrap().to_vec(),
    ];
    got.sort();
    assert_eq!(got, [vec![0, 1], vec![2, 3]]);
    more.store(false, Ordering::Release);
    second.close();
    let steps: Vec<u64> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    // Shard a: twice for the first client, once for the second; the other once.
    let expected = if b_first { [1, 1, 3, 3] } else { [3, 3, 1, 1] };
    assert_eq!(steps, expected);
}

#[test]
fn an_observer_copies_nothing_while_a_shard_steps_on_its_own() {
    // Both shards at frame 0, the region's action 0: an observer copies. Then shard 0 is
    // sent an action and holds inside its step (after taking the action, before writing):
    // every frame still equals the region's action, but shard 0 is mid-step, so the
    // observer must not copy (it judges by the shard's own action as well).
    let creator = Engine::create(spec(4, 2, &unique("observer"))).unwrap();
    let region = creator.name().to_string();
    let (took, took_rx) = std::sync::mpsc::channel::<()>();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    let gated = std::thread::spawn(move || {
        let mut engine = creator;
        engine.publish().unwrap();
        loop {
            match engine.wait_actions_with(T, &mut Resets) {
                Ok(_) => {
                    took.send(()).unwrap();
                    go_rx.recv().unwrap();
                    engine.publish().unwrap();
                }
                Err(Error::PeerClosed { .. }) => return,
                Err(e) => panic!("{e}"),
            }
        }
    });
    let r = region.clone();
    let other = std::thread::spawn(move || {
        serve_clients(
            Engine::join(&r, 1, JoinOptions::default()).unwrap(),
            1,
            None,
        )
    });
    let mut client = Client::attach(&region, AttachOptions::default()).unwrap();
    let observer = shmbridge::Observer::attach(&region, T).unwrap();
    let picks = [observer.pick("obs", 0..4).unwrap()];
    let mut bufs = observer.buffers(&picks).unwrap();
    assert_eq!(observer.try_read(&picks, &mut bufs).unwrap(), Some(0));
    client.async_reset(2, &[], T).unwrap();
    // Both ready, both posted at 0: the lower shard first.
    let ids = client.recv(T).unwrap().to_vec();
    assert_eq!(ids, [0, 1]);
    client.send(&ids).unwrap();
    took_rx.recv().unwrap();
    assert_eq!(
        observer.try_read(&picks, &mut bufs).unwrap(),
        None,
        "shard 0 is inside its step"
    );
    go.send(()).unwrap();
    // Shard 1's reset frame, then shard 0's new one.
    assert_eq!(client.recv(T).unwrap(), &[2, 3]);
    assert_eq!(client.recv(T).unwrap(), &[0, 1]);
    client.close();
    gated.join().unwrap();
    other.join().unwrap();
}

#[test]
fn recv_hands_out_the_shard_posted_first_whatever_its_frame_number() {
    let creator = Engine::create(spec(4, 2, &unique("order"))).unwrap();
    let region = creator.name().to_string();
    let (tx, rx) = std::sync::mpsc::channel::<u32>();
    // Each shard tells the test when it published a stepped frame.
    let serve = |mut engine: Engine, tx: std::sync::mpsc::Sender<u32>| {
        let first = engine.shard().env_start;
        engine.publish().unwrap();
        loop {
            match engine.wait_actions_with(T, &mut Resets) {
                Ok(_) => {
                    engine.publish().unwrap();
                    tx.send(first).unwrap();
                }
                Err(Error::PeerClosed { .. }) => return,
                Err(e) => panic!("{e}"),
            }
        }
    };
    let (tx2, name) = (tx.clone(), region.clone());
    let threads = [
        std::thread::spawn(move || serve(creator, tx)),
        std::thread::spawn(move || {
            serve(Engine::join(&name, 1, JoinOptions::default()).unwrap(), tx2)
        }),
    ];
    let mut client = Client::attach(&region, AttachOptions::default()).unwrap();
    client.async_reset(2, &[], T).unwrap();
    // Shard `a` steps once; `b` is handed out at its reset frame: a owes 1, b 0.
    let a = client.recv(T).unwrap().to_vec();
    client.send(&a).unwrap();
    assert_eq!(rx.recv().unwrap(), a[0]);
    let b = client.recv(T).unwrap().to_vec();
    assert_ne!(a, b);
    assert_eq!(client.recv(T).unwrap(), &a[..]);
    // Now a (frame 2 next) is posted before b (frame 1 next); both frames arrive.
    client.send(&a).unwrap();
    client.send(&b).unwrap();
    let mut done = [rx.recv().unwrap(), rx.recv().unwrap()];
    done.sort();
    assert_eq!(done, [0, 2]);
    assert_eq!(
        client.recv(T).unwrap(),
        &a[..],
        "posted first, frame number higher"
    );
    assert_eq!(client.recv(T).unwrap(), &b[..]);
    client.close();
    for t in threads {
        t.join().unwrap();
    }
}

/// Resets, and `slow`, which returns once `gate` is opened (or dropped).
struct Gated {
    gate: std::sync::mpsc::Receiver<()>,
}

impl CommandHandler for Gated {
    fn reset(&mut self, _: &mut Tensors<'_>, _: &ResetRequest) -> Result<(), CommandError> {
        Ok(())
    }

    fn call(
        &mut self,
        _: &mut Tensors<'_>,
        method: &str,
        _: &[(String, String)],
        payload: &[u8],
    ) -> Result<shmbridge::command::Reply, CommandError> {
        if method == "slow" {
            let _ = self.gate.recv();
        }
        Ok(shmbridge::command::Reply {
            args: Vec::new(),
            payload: payload.to_vec(),
        })
    }
}

#[test]
fn a_call_right_after_a_send_to_its_shard_gets_its_reply() {
    let creator = Engine::create(spec(2, 2, &unique("callsend"))).unwrap();
    let region = creator.name().to_string();
    let serve = |mut engine: Engine, mut handler: Gated| {
        engine.publish().unwrap();
        loop {
            match engine.wait_actions_with(T, &mut handler) {
                Ok(_) => {
                    engine.publish().unwrap();
                }
                Err(Error::PeerClosed { .. }) => return,
                Err(e) => panic!("{e}"),
            }
        }
    };
    let (open, gate) = std::sync::mpsc::channel();
    let (_never, gate1) = std::sync::mpsc::channel();
    let name = region.clone();
    let threads = [
        std::thread::spawn(move || serve(creator, Gated { gate })),
        std::thread::spawn(move || {
            let joined = Engine::join(&name, 1, JoinOptions::default()).unwrap();
            serve(joined, Gated { gate: gate1 })
        }),
    ];
    let mut client = Client::attach(&region, AttachOptions::default()).unwrap();
    client.async_reset(1, &[], T).unwrap();
    let ids = loop {
        let ids = client.recv(T).unwrap().to_vec();
        if ids == [0u32] {
            break ids;
        }
        client.send(&ids).unwrap();
    };
    // Shard 0 is busy in `slow` until the gate opens: the call times out.
    let e = client
        .call_method_on(0, "slow", &[], b"late", Duration::from_millis(50))
        .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    // Its action, then a call, both posted while it is still busy: the gate opens once
    // the call waits (the hook runs at its first sleep, after the request went out).
    client.send(&ids).unwrap();
    let open = std::sync::Mutex::new(Some(open));
    client.set_interrupt(Some(Arc::new(move || {
        if let Some(open) = open.lock().unwrap().take() {
            open.send(()).unwrap();
        }
        Ok(())
    })));
    let reply = client.call_method_on(0, "fast", &[], b"mine", T).unwrap();
    assert_eq!(reply.payload, b"mine");
    client.set_interrupt(None);
    client.close();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn whole_tensor_views_wait_until_no_shard_steps_and_a_batch_has_its_rows() {
    let (n, k, b) = (8u32, 4u32, 4usize);
    let (region, threads) = start("rows", n, k);
    let mut client = Client::attach(&region, AttachOptions::default()).unwrap();
    client.async_reset(b, &[], T).unwrap();
    // Before any recv: every shard steps (its reset frame not handed out).
    assert!(matches!(
        client.tensor::<f32>("obs"),
        Err(Error::OutOfOrder(_))
    ));
    assert!(matches!(
        client.batch_rows::<f32>("obs"),
        Err(Error::OutOfOrder(_))
    ));
    let ids = client.recv(T).unwrap().to_vec();
    // Two shards held, two stepping: their engines write their rows of obs and read
    // theirs of actions now, so no view covers them.
    assert!(matches!(
        client.tensor::<f32>("obs"),
        Err(Error::OutOfOrder(_))
    ));
    assert!(matches!(
        client.tensor_mut::<f32>("actions"),
        Err(Error::OutOfOrder(_))
    ));
    assert!(matches!(
        client.tensors().read::<f32>("rewards"),
        Err(Error::OutOfOrder(_))
    ));
    // The batch's own rows: one slice per shard, in the order of the env ids.
    let obs = client.batch_rows::<f32>("obs").unwrap();
    assert_eq!(obs.len(), 2);
    let obs = obs.concat();
    assert_eq!(obs.len(), 3 * b);
    for (i, &e) in ids.iter().enumerate() {
        assert_eq!(obs[3 * i + 1], e as f32, "env {e}'s own row");
    }
    // Engine→client tensors are not the client's to write.
    assert!(matches!(
        client.batch_rows_mut::<f32>("obs"),
        Err(Error::WrongDirection { .. })
    ));
    let mut actions = client.batch_rows_mut::<f32>("actions").unwrap();
    assert_eq!(actions.iter().map(|r| r.len()).sum::<usize>(), b);
    for r in actions.iter_mut() {
        r.fill(7.0);
    }
    client.send(&ids).unwrap();
    // Sent: those rows are the engines' again.
    assert!(matches!(
        client.batch_rows::<f32>("obs"),
        Err(Error::OutOfOrder(_))
    ));
    // Every shard held: nothing steps, so whole tensors are viewable again.
    let mut got = vec![client.recv(T).unwrap().to_vec()];
    got.push(client.recv(T).unwrap().to_vec());
    let obs = client.tensor::<f32>("obs").unwrap();
    for &e in &ids {
        assert_eq!(
            obs[3 * e as usize + 2],
            7.0,
            "env {e} took the action written"
        );
    }
    client.close();
    for t in threads {
        t.join().unwrap();
    }
}

/// An action counter at `u64::MAX` (a corrupt or hostile peer's word) is refused at
/// attach, not taken for the client's own marker of shards at different frames.
#[test]
fn an_action_counter_at_its_maximum_is_refused_at_attach() {
    // Unsharded: the control block's `action_seq`.
    let mut engine = Engine::create(spec(4, 1, &unique("max1"))).unwrap();
    engine.publish().unwrap();
    let mapping = engine.map_again().unwrap();
    mapping
        .control()
        .action_seq()
        .counter
        .store(u64::MAX, Ordering::Release);
    let e = Client::attach(engine.name(), AttachOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }), "{e}");
    drop(engine);
    // Sharded (1.10): a shard entry's own `action_seq`.
    let mut creator = Engine::create(spec(4, 2, &unique("max2"))).unwrap();
    let mut joined = Engine::join(creator.name(), 1, JoinOptions::default()).unwrap();
    creator.publish().unwrap();
    joined.publish().unwrap();
    let mapping = creator.map_again().unwrap();
    let shard = *joined.shard();
    shmbridge::shard::ShardSlot::new(&mapping, &shard)
        .unwrap()
        .action_seq()
        .store(u64::MAX, Ordering::Release);
    let e = Client::attach(creator.name(), AttachOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }), "{e}");
}

/// A send to a region whose engine closed is refused up front, as a step is (`PeerClosed`):
/// no shard's own action moves.
#[test]
fn a_send_to_a_closed_engine_is_refused_before_anything_is_posted() {
    let mut creator = Engine::create(spec(4, 2, &unique("closed"))).unwrap();
    let mut joined = Engine::join(creator.name(), 1, JoinOptions::default()).unwrap();
    creator.publish().unwrap();
    joined.publish().unwrap();
    let mut client = Client::attach(creator.name(), AttachOptions::default()).unwrap();
    // The shards answer async_reset's requests (a Hello and a reset each), then stop
    // serving.
    let shards = std::thread::spawn(move || {
        let mut answered = 0;
        while answered < 4 {
            answered += creator.poll_commands(&mut Resets).unwrap();
            answered += joined.poll_commands(&mut Resets).unwrap();
        }
        (creator, joined)
    });
    client.async_reset(4, &[], T).unwrap();
    let (creator, joined) = shards.join().unwrap();
    let ids = client.recv(T).unwrap().to_vec();
    assert_eq!(ids, [0, 1, 2, 3]);
    let mapping = joined.map_again().unwrap();
    let shard_infos = [*creator.shard(), *joined.shard()];
    let words: Vec<_> = shard_infos
        .iter()
        .map(|s| shmbridge::shard::ShardSlot::new(&mapping, s).unwrap())
        .collect();
    creator.close();
    let peer_closed = |r: Result<(), Error>| {
        matches!(
            r,
            Err(Error::PeerClosed {
                peer: shmbridge::Peer::Engine
            })
        )
    };
    assert!(peer_closed(client.check_send(&ids)), "check_send");
    assert!(peer_closed(client.send(&ids)), "send");
    for w in &words {
        assert_eq!(w.action_seq().load(Ordering::Acquire), 0, "nothing posted");
    }
    client.close();
    drop(joined);
}

/// Answers the first request in `engine`'s command ring as a shard process of protocol
/// 1.`minor` would answer a `Hello`: with its own version (the engine itself would answer
/// with this library's).
fn answer_hello_as(engine: &Engine, minor: u16) {
    use shmbridge::ring::Ring;
    use shmbridge::wire::{Body, Envelope, Kind, Method};
    let region = engine.map_again().unwrap();
    let shard = *engine.shard();
    let slot = shmbridge::shard::ShardSlot::new(&region, &shard).unwrap();
    let rings = shard.rings.unwrap();
    // SAFETY: the offsets and capacities are those the validated layout gives this shard's
    // rings, inside `region`'s mapping, which outlives the rings; this thread is their only
    // user in this process (`engine` polls no commands meanwhile).
    let (c2e, e2c) = unsafe {
        (
            Ring::new(
                slot.c2e_ring(),
                region.ptr().add(rings.c2e.0 as usize),
                rings.c2e.1,
                shmbridge::Peer::Client,
            )
            .unwrap(),
            Ring::new(
                slot.e2c_ring(),
                region.ptr().add(rings.e2c.0 as usize),
                rings.e2c.1,
                shmbridge::Peer::Engine,
            )
            .unwrap(),
        )
    };
    let mut bytes = Vec::new();
    while !c2e.try_pop(&mut bytes).unwrap() {
        std::hint::spin_loop();
    }
    let request = Envelope::decode(&bytes).unwrap();
    assert_eq!(request.method, Method::Hello);
    let reply = Envelope {
        id: request.id,
        kind: Kind::Reply,
        method: Method::Hello,
        body: Body::Welcome {
            protocol_major: 1,
            protocol_minor: minor,
            engine_pid: std::process::id(),
            engine_kind: "async-test".into(),
        },
        args: Vec::new(),
        payload: Vec::new(),
        error: None,
    };
    assert!(e2c.try_push(&reply.encode()).unwrap());
}

/// A shard process before 1.10 joined to a 1.10 region would never take the actions sent
/// to its shard alone, and `recv` would wait for it until its timeout: `async_reset` asks
/// every shard its protocol first and refuses such a region, resetting nothing.
#[test]
fn async_reset_refuses_a_shard_process_before_shard_actions() {
    let mut creator = Engine::create(spec(4, 2, &unique("old-shard"))).unwrap();
    let mut joined = Engine::join(creator.name(), 1, JoinOptions::default()).unwrap();
    creator.publish().unwrap();
    joined.publish().unwrap();
    let mut client = Client::attach(creator.name(), AttachOptions::default()).unwrap();
    let shards = std::thread::spawn(move || {
        answer_hello_as(&joined, 9);
        let mut resets = Resets;
        // Shard 0 answers its Hello, and a reset if one came (none must).
        let mut answered = 0;
        while answered < 1 {
            answered += creator.poll_commands(&mut resets).unwrap();
        }
        (creator, joined)
    });
    let e = client.async_reset(4, &[], T).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidSpec(m) if m.contains("shard 1 (envs 2..4)") && m.contains("1.9")),
        "{e}"
    );
    let (_creator, _joined) = shards.join().unwrap();
    // Still a lock-step client, nothing reset or handed out.
    assert!(matches!(client.recv(T), Err(Error::OutOfOrder(_))));
}
