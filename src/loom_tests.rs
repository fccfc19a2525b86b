//! Models of the real handshakes, run under every interleaving loom explores (see
//! `scripts/test.sh` for the command). The control words are std atomics, as in a region,
//! handed to `primitive::model`, which makes every operation of the real code on them
//! loom's; `low` is the counter's own low half, as in a region. The futex sleeps until
//! woken, with no slices, so a lost wake-up is a deadlock loom reports; only the
//! liveness model lets slices run out.
//!
//! Here, not in `sync`, because the doorbell model drives a real ring too: `ring` builds
//! on `sync`, and the models build on both.
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Peer};
use crate::primitive::model::{self, check};
use crate::primitive::{self, low_half, AtomicU32, AtomicU64, Ordering};
use crate::ring::HeapRing;
use crate::sync::*;

/// The words of the lock-step loop, as the control block holds them.
#[derive(Default)]
struct Control {
    action_seq: AtomicU64,
    frame_seq: AtomicU64,
    engine_waiting: AtomicU32,
    client_waiting: AtomicU32,
    doorbell: AtomicU32,
    engine_state: AtomicU32,
    /// What the client writes before each action and the engine reads after it.
    actions: Tensor,
    /// What the engine writes before each frame and the client reads after it.
    observations: Tensor,
}

/// A tensor's bytes, as plain memory that the counters hand from one side to the other.
#[derive(Default)]
struct Tensor(std::cell::UnsafeCell<u64>);

// SAFETY: the two sides take turns on a tensor as the lock-step protocol orders them;
// each access is announced to the model's loom cells first, so one that the protocol
// does not order after the other side's fails the model.
unsafe impl Sync for Tensor {}

impl Tensor {
    fn write(&self, value: u64) {
        primitive::writing(self.0.get().cast(), 8);
        // SAFETY: see `impl Sync`; the model has checked this access.
        unsafe { *self.0.get() = value }
    }
    fn read(&self) -> u64 {
        primitive::reading(self.0.get().cast(), 8);
        // SAFETY: see `impl Sync`; the model has checked this access.
        unsafe { *self.0.get() }
    }
}

const CLOSED: u32 = 1;

type Engine = loom::thread::JoinHandle<()>;

impl Control {
    fn new() -> Arc<Control> {
        let c = Arc::new(Control::default());
        model::track_u64(&c.action_seq);
        model::track_u64(&c.frame_seq);
        model::track_u32(&c.engine_waiting);
        model::track_u32(&c.client_waiting);
        model::track_u32(&c.doorbell);
        model::track_u32(&c.engine_state);
        for t in [&c.actions, &c.observations] {
            model::track_bytes(t.0.get().cast(), 8);
        }
        c
    }

    /// What the client waits on (as `Client::seqs`).
    fn frame(&self) -> SharedSeq<'_> {
        SharedSeq {
            counter: &self.frame_seq,
            low: low_half(&self.frame_seq),
            waiting: &self.client_waiting,
        }
    }

    /// What the engine sleeps on (as `Doorbell::of`); with the action counter, what the
    /// client posts an action through (as `Client::post_and_wait`).
    fn doorbell(&self, action: bool) -> Doorbell<'_> {
        Doorbell {
            bell: &self.doorbell,
            engine_waiting: &self.engine_waiting,
            action_seq: action.then_some(&self.action_seq),
        }
    }

    /// Runs `f` on the control words in a new model thread (the engine's side).
    fn spawn(self: &Arc<Self>, f: impl FnOnce(&Control) + Send + 'static) -> Engine {
        let c = self.clone();
        loom::thread::spawn(move || f(&c))
    }

    /// The client's wait for frame `n`.
    fn wait_frame(&self, n: u64) -> u64 {
        let ok = || Ok(());
        wait_for(
            &self.frame(),
            n,
            WaitPolicy::BLOCKING,
            Duration::MAX,
            "frame",
            ok,
        )
        .unwrap()
    }

    /// The engine's wait for action `n`.
    fn wait_action(&self, n: u64) -> u64 {
        wait_until(
            &self.doorbell(false),
            |order| {
                let a = primitive::load(&self.action_seq, order);
                (a >= n).then_some(a)
            },
            WaitPolicy::BLOCKING,
            Duration::MAX,
            "action",
            || Ok(()),
        )
        .unwrap()
    }
}

fn waiting_flags_down(c: &Control) {
    assert_eq!(primitive::load(&c.engine_waiting, Ordering::Relaxed), 0);
    assert_eq!(primitive::load(&c.client_waiting, Ordering::Relaxed), 0);
}

#[test]
fn post_wakes_the_waiter() {
    // One counter: the poster stores and wakes, the waiter sleeps on the low half.
    check("sync::post_wakes_the_waiter", || {
        let c = Control::new();
        let engine = c.spawn(|c| post(&c.frame(), 1));
        assert_eq!(c.wait_frame(1), 1);
        engine.join().unwrap();
        waiting_flags_down(&c);
    });
}

#[test]
fn lock_step_two_rounds() {
    // The protocol 1.1 loop: the client writes the actions and posts them through the
    // doorbell, the engine sleeps on the doorbell, reads them, writes the observations
    // and posts a frame. A frame for each action, never more, never fewer, and each
    // side reads the other's tensor only after it was written, and writes its own only
    // after the other has read it.
    check("sync::lock_step_two_rounds", || {
        let c = Control::new();
        let engine = c.spawn(|c| {
            for n in 1..=2u64 {
                assert_eq!(c.wait_action(n), n);
                assert_eq!(c.actions.read(), n);
                c.observations.write(100 + n);
                post(&c.frame(), n);
            }
        });
        for n in 1..=2u64 {
            c.actions.write(n);
            post(&c.doorbell(true), n);
            assert_eq!(c.wait_frame(n), n);
            assert_eq!(c.observations.read(), 100 + n);
        }
        engine.join().unwrap();
        waiting_flags_down(&c);
    });
}

#[test]
fn doorbell_wakes_the_engine_for_a_command_and_an_action() {
    // The client pushes a command into the real ring and rings the bell
    // (`command::ring_doorbell`), then posts an action through the bell. The engine,
    // asleep on the bell with nothing but the ring and the action counter to look at
    // (as `Engine` waits), must see both: the command intact, the action once.
    check("sync::doorbell_wakes_for_a_command_and_an_action", || {
        let c = Control::new();
        let ring = Arc::new(HeapRing::new(64).unwrap());
        ring.track_in_model();
        let client = {
            let (c, ring) = (c.clone(), ring.clone());
            loom::thread::spawn(move || {
                let r = ring.ring(Peer::Client);
                r.push(b"reset", WaitPolicy::BLOCKING, Duration::MAX, || Ok(()))
                    .unwrap();
                crate::command::ring_doorbell(&c.doorbell(false), [&c.engine_waiting]);
                post(&c.doorbell(true), 1);
            })
        };
        let r = ring.ring(Peer::Client);
        let (mut action, mut command) = (None, None);
        while action.is_none() || command.is_none() {
            let woke = wait_until(
                &c.doorbell(false),
                |order| {
                    let a = primitive::load(&c.action_seq, order);
                    if action.is_none() && a >= 1 {
                        Some(Some(a))
                    } else if !r.is_empty() {
                        Some(None)
                    } else {
                        None
                    }
                },
                WaitPolicy::BLOCKING,
                Duration::MAX,
                "action or command",
                || Ok(()),
            )
            .unwrap();
            match woke {
                Some(a) => action = Some(a),
                None => {
                    let mut out = Vec::new();
                    assert!(r.try_pop(&mut out).unwrap());
                    assert!(command.replace(out).is_none(), "one command, popped twice");
                }
            }
        }
        assert_eq!(action, Some(1));
        assert_eq!(command.as_deref(), Some(&b"reset"[..]));
        client.join().unwrap();
        assert!(r.is_empty());
        waiting_flags_down(&c);
    });
}

#[test]
fn a_closing_peer_ends_the_wait() {
    // The engine closes while the client waits for a frame: it stores its state, then
    // wakes the frame word (as `Engine::shut`). A wake that comes before the client
    // sleeps is lost by design: the client notices at the end of its slice, when it
    // checks the peer. So here slices run out, and the wait must end with the peer's
    // error, the waiter flag down.
    check("sync::a_closing_peer_ends_the_wait", || {
        model::let_slices_expire();
        let c = Control::new();
        let engine = c.spawn(|c| {
            primitive::store(&c.engine_state, CLOSED, Ordering::SeqCst);
            primitive::futex_wake_all(low_half(&c.frame_seq));
        });
        let mut checks = 0;
        let seen = wait_for(
            &c.frame(),
            1,
            WaitPolicy::BLOCKING,
            Duration::MAX,
            "f",
            || {
                checks += 1;
                if primitive::load(&c.engine_state, Ordering::Acquire) == CLOSED {
                    return Err(Error::PeerClosed { peer: Peer::Engine });
                }
                Ok(())
            },
        );
        assert!(
            matches!(seen, Err(Error::PeerClosed { peer: Peer::Engine })),
            "{seen:?}"
        );
        assert!(checks >= 1);
        engine.join().unwrap();
        waiting_flags_down(&c);
    });
}

#[test]
fn a_passed_deadline_times_out_after_checking_the_peer() {
    // A zero timeout: the wait reaches its deadline branch without sleeping. It returns
    // the posted value or a timeout, and before a timeout it checks the peer once more.
    check("sync::a_passed_deadline_times_out", || {
        let c = Control::new();
        let engine = c.spawn(|c| post(&c.frame(), 1));
        let mut checks = 0;
        let seen = wait_for(
            &c.frame(),
            1,
            WaitPolicy::BLOCKING,
            Duration::ZERO,
            "f",
            || {
                checks += 1;
                Ok(())
            },
        );
        match seen {
            Ok(v) => assert_eq!(v, 1),
            Err(Error::Timeout { waited, what }) => {
                assert_eq!((waited, what), (Duration::ZERO, "f"));
                assert_eq!(checks, 2, "a check before the loop, one before the timeout");
            }
            Err(e) => panic!("{e:?}"),
        }
        engine.join().unwrap();
        waiting_flags_down(&c);
    });
}

/// The words of a sharded region (1.4): one action counter and doorbell, and per shard a
/// frame counter, its own waiter flag on the doorbell, the client's waiter flag on its
/// frame, and its slice of the observations.
#[derive(Default)]
struct Shard {
    frame_seq: AtomicU64,
    engine_waiting: AtomicU32,
    client_waiting: AtomicU32,
    observations: Tensor,
}

impl Shard {
    fn frame(&self) -> SharedSeq<'_> {
        SharedSeq {
            counter: &self.frame_seq,
            low: low_half(&self.frame_seq),
            waiting: &self.client_waiting,
        }
    }
}

#[derive(Default)]
struct Sharded {
    action_seq: AtomicU64,
    doorbell: AtomicU32,
    actions: Tensor,
    shards: [Shard; 2],
}

impl Sharded {
    fn new() -> Arc<Sharded> {
        let c = Arc::new(Sharded::default());
        model::track_u64(&c.action_seq);
        model::track_u32(&c.doorbell);
        model::track_bytes(c.actions.0.get().cast(), 8);
        for s in &c.shards {
            model::track_u64(&s.frame_seq);
            model::track_u32(&s.engine_waiting);
            model::track_u32(&s.client_waiting);
            model::track_bytes(s.observations.0.get().cast(), 8);
        }
        c
    }

    /// The doorbell as shard `k` sleeps on it (as `ShardSlot::doorbell`), or as the client
    /// posts an action through it.
    fn doorbell(&self, k: usize, action: bool) -> Doorbell<'_> {
        Doorbell {
            bell: &self.doorbell,
            engine_waiting: &self.shards[k].engine_waiting,
            action_seq: action.then_some(&self.action_seq),
        }
    }
}

#[test]
fn every_shard_wakes_for_one_action_and_the_client_waits_for_all() {
    // Two shards asleep on the one doorbell, each with its own flag; the client posts one
    // action (`post_all`, as `Client::post_and_wait` for a sharded region) and waits for
    // both frames in turn (as `Client::wait_shard_frames`). Neither shard may miss the
    // wake-up, each reads the actions only after they were written, and the client reads
    // each slice only after its shard wrote it.
    check("sync::shards_one_action_all_frames", || {
        let c = Sharded::new();
        let shards: Vec<_> = (0..2)
            .map(|k| {
                let c = c.clone();
                loom::thread::spawn(move || {
                    let a = wait_until(
                        &c.doorbell(k, false),
                        |order| {
                            let a = primitive::load(&c.action_seq, order);
                            (a >= 1).then_some(a)
                        },
                        WaitPolicy::BLOCKING,
                        Duration::MAX,
                        "action",
                        || Ok(()),
                    )
                    .unwrap();
                    assert_eq!(a, 1);
                    assert_eq!(c.actions.read(), 7);
                    c.shards[k].observations.write(10 + k as u64);
                    post(&c.shards[k].frame(), 1);
                })
            })
            .collect();
        c.actions.write(7);
        post_all(
            &c.doorbell(0, true),
            1,
            c.shards.iter().map(|s| &s.engine_waiting),
        );
        for (k, s) in c.shards.iter().enumerate() {
            let seen = wait_for(
                &s.frame(),
                1,
                WaitPolicy::BLOCKING,
                Duration::MAX,
                "frame",
                || Ok(()),
            )
            .unwrap();
            assert_eq!(seen, 1);
            assert_eq!(s.observations.read(), 10 + k as u64);
        }
        for t in shards {
            t.join().unwrap();
        }
        for s in &c.shards {
            assert_eq!(primitive::load(&s.engine_waiting, Ordering::Relaxed), 0);
            assert_eq!(primitive::load(&s.client_waiting, Ordering::Relaxed), 0);
        }
    });
}

#[test]
fn a_command_wakes_the_shard_it_is_for() {
    // Shard 1 asleep on the one doorbell with its own flag, waiting for a request in its
    // ring (as `Engine::wait_actions`); the client pushes one there and rings the bell
    // (`command::ring_doorbell` over every shard's flag, as `Client::call_shards` for a
    // sharded region). The shard must wake for it: looking only at the doorbell's base
    // flag (shard 0's) would leave it asleep, a deadlock here.
    check("command::ring_doorbell_wakes_the_shard", || {
        let c = Sharded::new();
        let ring = Arc::new(HeapRing::new(64).unwrap());
        ring.track_in_model();
        let shard = {
            let (c, ring) = (c.clone(), ring.clone());
            loom::thread::spawn(move || {
                let r = ring.ring(Peer::Client);
                wait_until(
                    &c.doorbell(1, false),
                    |_| (!r.is_empty()).then_some(()),
                    WaitPolicy::BLOCKING,
                    Duration::MAX,
                    "a command",
                    || Ok(()),
                )
                .unwrap();
                let mut out = Vec::new();
                assert!(r.try_pop(&mut out).unwrap());
                assert_eq!(out, b"reset");
            })
        };
        let r = ring.ring(Peer::Client);
        r.push(b"reset", WaitPolicy::BLOCKING, Duration::MAX, || Ok(()))
            .unwrap();
        crate::command::ring_doorbell(
            &c.doorbell(0, false),
            c.shards.iter().map(|s| &s.engine_waiting),
        );
        shard.join().unwrap();
        assert_eq!(
            primitive::load(&c.shards[1].engine_waiting, Ordering::Relaxed),
            0
        );
    });
}

// ---- Asynchronous batches (1.10): shards stepped one at a time ----

/// A sharded region's words as asynchronous batches use them: per shard its own action
/// counter beside the region's (which this client never posts), its frame, its flag on
/// the doorbell, its slices of the actions and observations; the control block's
/// `frame_seq` and `client_waiting` as the frame bell.
#[derive(Default)]
struct AsyncShard {
    action_seq: AtomicU64,
    frame_seq: AtomicU64,
    engine_waiting: AtomicU32,
    client_waiting: AtomicU32,
    actions: Tensor,
    observations: Tensor,
}

#[derive(Default)]
struct AsyncRegion {
    action_seq: AtomicU64,
    doorbell: AtomicU32,
    bell: AtomicU64,
    bell_waiting: AtomicU32,
    shards: [AsyncShard; 2],
}

impl AsyncRegion {
    fn new() -> Arc<AsyncRegion> {
        let c = Arc::new(AsyncRegion::default());
        model::track_u64(&c.action_seq);
        model::track_u32(&c.doorbell);
        model::track_u64(&c.bell);
        model::track_u32(&c.bell_waiting);
        for s in &c.shards {
            model::track_u64(&s.action_seq);
            model::track_u64(&s.frame_seq);
            model::track_u32(&s.engine_waiting);
            model::track_u32(&s.client_waiting);
            for t in [&s.actions, &s.observations] {
                model::track_bytes(t.0.get().cast(), 8);
            }
        }
        c
    }

    /// The frame bell, as `Client::recv` sleeps on it and a shard rings it.
    fn bell(&self) -> SharedSeq<'_> {
        SharedSeq {
            counter: &self.bell,
            low: low_half(&self.bell),
            waiting: &self.bell_waiting,
        }
    }

    fn frame(&self, k: usize) -> SharedSeq<'_> {
        let s = &self.shards[k];
        SharedSeq {
            counter: &s.frame_seq,
            low: low_half(&s.frame_seq),
            waiting: &s.client_waiting,
        }
    }

    /// Shard `k` serving `steps` actions, as `Engine::wait_actions` (its action: the
    /// larger of the region's and its own) and `Engine::publish` (its frame, then the
    /// bell) do: observation `10·k + action`.
    fn serve(&self, k: usize, steps: u64) {
        let s = &self.shards[k];
        for target in 1..=steps {
            let a = wait_until(
                &Doorbell {
                    bell: &self.doorbell,
                    engine_waiting: &s.engine_waiting,
                    action_seq: None,
                },
                |order| {
                    let a = primitive::load(&self.action_seq, order)
                        .max(primitive::load(&s.action_seq, order));
                    (a >= target).then_some(a)
                },
                WaitPolicy::BLOCKING,
                Duration::MAX,
                "action",
                || Ok(()),
            )
            .unwrap();
            assert_eq!(a, target, "shard {k}: one action at a time");
            assert_eq!(s.actions.read(), 100 + target, "shard {k}: its own action");
            s.observations.write(10 * k as u64 + target);
            post(&self.frame(k), target);
            ring_if_waiting(&self.bell());
        }
    }

    /// `Client::recv` with one shard per batch: waits on the bell until a stepping shard
    /// has its frame, hands out the one posted first.
    fn recv(&self, ready: &mut crate::batch::ReadySet) -> usize {
        let (_, k) = wait_until(
            &self.bell(),
            |order| {
                ready
                    .stepping()
                    .filter(|&(k, posted)| {
                        primitive::load(&self.shards[k].frame_seq, order) >= posted
                    })
                    .map(|(k, _)| (ready.sent(k), k))
                    .min()
            },
            WaitPolicy::BLOCKING,
            Duration::MAX,
            "a batch",
            || Ok(()),
        )
        .unwrap();
        ready.hand_out(k).unwrap();
        k
    }

    /// `Client::send` of shard `k`'s envs: its actions, its own counter, the doorbell.
    fn send(&self, ready: &mut crate::batch::ReadySet, k: usize) {
        assert_eq!(ready.check_send(&[k as u32]).unwrap(), [k]);
        let a = ready.post(k).unwrap();
        self.shards[k].actions.write(100 + a);
        primitive::store(&self.shards[k].action_seq, a, Ordering::Release);
        post_all(
            &Doorbell {
                bell: &self.doorbell,
                engine_waiting: &self.shards[k].engine_waiting,
                action_seq: None,
            },
            0,
            [&self.shards[k].engine_waiting],
        );
    }
}

#[test]
fn asynchronous_batches_step_each_shard_once_per_action_and_hand_out_each_frame_once() {
    // Two shards of one env each, batches of one shard. The client hands out both
    // reset frames, sends both shards an action, then takes their frames in whichever
    // order they come: it sleeps on the frame bell, which neither shard may fail to ring
    // (a lost wake-up is a deadlock the model reports). Each shard steps exactly once,
    // reads only its own action after it was written (the cells), and the client reads
    // each observation after its shard wrote it, each shard's frame once.
    check("sync::async_batches_one_shard_at_a_time", || {
        let c = AsyncRegion::new();
        let engines: Vec<_> = (0..2)
            .map(|k| {
                let c = c.clone();
                loom::thread::spawn(move || c.serve(k, 1))
            })
            .collect();
        let mut ready = crate::batch::ReadySet::new([(0..1, 0), (1..2, 0)]);
        let first = c.recv(&mut ready);
        c.send(&mut ready, first);
        let second = c.recv(&mut ready);
        assert_ne!(first, second, "a held shard is not handed out again");
        c.send(&mut ready, second);
        let mut got = [c.recv(&mut ready), c.recv(&mut ready)];
        assert_ne!(got[0], got[1], "each frame handed out once");
        for k in got {
            assert_eq!(c.shards[k].observations.read(), 10 * k as u64 + 1);
        }
        got.sort();
        assert_eq!(got, [0, 1]);
        assert_eq!(ready.stepping_count(), 0);
        for t in engines {
            t.join().unwrap();
        }
        assert_eq!(
            primitive::load(&c.action_seq, Ordering::Relaxed),
            0,
            "untouched"
        );
        assert_eq!(primitive::load(&c.bell_waiting, Ordering::Relaxed), 0);
    });
}

// ---- Observers (1.7): the step counters and the write sequence of a stats block ----
//
// The observer models sweep where the observer starts: after `k` of the client's and
// engines' steps, for every `k`, told by a counter they bump Relaxed (a schedule, not a
// synchronisation: it orders nothing the models check). Loom's DPOR keeps one last
// access per word, and the engine loads each word of its block before storing it, so
// without the sweep it would not put the observer's first load after every one of the
// engine's stores.

/// A stats block as the real [`crate::control::Stats`] view reads and writes it: its 64
/// words, every one tracked, in a 64-byte aligned block as in a region.
#[repr(C, align(64))]
struct StatsWords([AtomicU64; 64]);

impl StatsWords {
    fn new() -> Arc<StatsWords> {
        let w = Arc::new(StatsWords(std::array::from_fn(|_| AtomicU64::new(0))));
        for word in &w.0 {
            model::track_u64(word);
        }
        w
    }

    fn view(&self) -> crate::control::Stats<'_> {
        let base = std::ptr::NonNull::from(&self.0[0]).cast::<u8>();
        // SAFETY: 64 words, 512 bytes, 64-aligned, living as long as the borrow; every
        // access goes through `primitive` (loom's atomics in this build).
        unsafe { crate::control::Stats::new(base) }
    }
}

/// Engine→client data an observer copies: plain words in the real region, loom atomics
/// accessed Relaxed here (a racy copy is what the seqlock must catch).
struct Data([AtomicU64; 2]);

impl Data {
    fn new() -> Arc<Data> {
        let d = Arc::new(Data([AtomicU64::new(0), AtomicU64::new(0)]));
        for word in &d.0 {
            model::track_u64(word);
        }
        d
    }
    fn write(&self, value: u64) {
        for word in &self.0 {
            primitive::store(word, value, Ordering::Relaxed);
        }
    }
    fn copy(&self) -> [u64; 2] {
        [0, 1].map(|i| primitive::load(&self.0[i], Ordering::Relaxed))
    }
}

/// How far the engines of a model got: the schedule the observer waits for.
struct Progress(AtomicU64);

impl Progress {
    fn new() -> Arc<Progress> {
        let p = Arc::new(Progress(AtomicU64::new(0)));
        model::track_u64(&p.0);
        p
    }
    /// An engine finished one more step.
    fn step(&self) {
        primitive::fetch_add(&self.0, 1, Ordering::Relaxed);
    }
    /// The observer starts once `k` steps are done.
    fn wait(&self, k: u64) {
        while primitive::load(&self.0, Ordering::Relaxed) < k {
            loom::thread::yield_now();
        }
    }
}

/// The client posts action 1 (as `post` does: a Release store, and a wake-up of nobody),
/// counts it as a step of the schedule, then starts the engines of the model, `f(i)` in
/// thread `i`, and waits for them. Starting them after the post stands in for their
/// wait (whose Acquire load would see it): an engine learns of the action no earlier,
/// and the observer, which must not rely on any of it, gets no edge from it.
fn post_then_engines(
    c: &Arc<Control>,
    progress: &Arc<Progress>,
    engines: usize,
    f: impl Fn(usize, &Control) + Send + Sync + 'static,
) -> loom::thread::JoinHandle<()> {
    let (c, progress) = (c.clone(), progress.clone());
    loom::thread::spawn(move || {
        post(&c.doorbell(true), 1);
        progress.step();
        let f = Arc::new(f);
        let threads: Vec<_> = (0..engines)
            .map(|i| {
                let (c, f) = (c.clone(), f.clone());
                loom::thread::spawn(move || f(i, &c))
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    })
}

/// The observer's try at copying `data` (as `Observer::try_read`): its frame and words.
fn copy_between_writes(
    c: &Control,
    s: &crate::control::Stats<'_>,
    data: &Data,
) -> Option<(u64, [u64; 2])> {
    let Ok(copied) = crate::control::read_between_writes(
        &[s.write_seq()],
        &c.action_seq,
        &[],
        &[&c.frame_seq],
        |frame| (frame, data.copy()),
    );
    copied
}

/// What `Engine::wait_actions` does once its wait saw action 1.
fn see_action(c: &Control) {
    assert_eq!(primitive::load(&c.action_seq, Ordering::Acquire), 1);
    crate::control::step_writes_begin();
}

#[test]
fn an_observer_accepts_only_whole_frames_across_a_step() {
    // The client posts action 1; the engine, as `Engine` does, sees it
    // (`step_writes_begin`), writes the frame and posts `frame_seq` (as `publish`). An
    // observer reading meanwhile (`read_between_writes`, as `Observer::try_read`), from
    // each step of the schedule on, may fail, but whatever it accepts is one whole frame
    // with its number: frame 0 (0, 0) or frame 1 (1, 1).
    for k in 0..=3 {
        check(
            &format!("observer::whole_frames_step, from step {k}"),
            move || {
                let c = Control::new();
                let stats = StatsWords::new();
                let data = Data::new();
                let progress = Progress::new();
                let client = {
                    let (data, progress) = (data.clone(), progress.clone());
                    post_then_engines(&c, &progress.clone(), 1, move |_, c| {
                        see_action(c);
                        data.write(1);
                        progress.step();
                        post(&c.frame(), 1);
                        progress.step();
                    })
                };
                let s = stats.view();
                progress.wait(k);
                let read = || copy_between_writes(&c, &s, &data);
                if let Some((frame, [a, b])) = read() {
                    assert_eq!(a, b, "a torn copy was accepted (frame {frame})");
                    assert_eq!(a, frame, "frame {frame} with data {a}");
                }
                client.join().unwrap();
                assert_eq!(
                    read(),
                    Some((1, [1, 1])),
                    "nothing writes any more: accepted"
                );
            },
        );
    }
}

#[test]
fn an_observer_accepts_only_whole_frames_across_a_reset() {
    // Between steps the engine answers a reset, which rewrites the data with both
    // counters unchanged, bracketed by the write sequence as `answer_one` brackets a
    // handler; the counters alone could not tell a reader that it raced it. What the
    // observer accepts is the frame (0, 0) or the reset's (100, 100), both at frame 0.
    for k in 0..=3 {
        check(
            &format!("observer::whole_frames_reset, from step {k}"),
            move || {
                let c = Control::new();
                let stats = StatsWords::new();
                let data = Data::new();
                let progress = Progress::new();
                let engine = {
                    let (stats, data, progress) = (stats.clone(), data.clone(), progress.clone());
                    loom::thread::spawn(move || {
                        let s = stats.view();
                        assert!(s.begin_write());
                        progress.step();
                        data.write(100);
                        progress.step();
                        s.end_write();
                        progress.step();
                    })
                };
                let s = stats.view();
                progress.wait(k);
                let read = || copy_between_writes(&c, &s, &data);
                if let Some((frame, [a, b])) = read() {
                    assert_eq!(a, b, "a torn copy was accepted");
                    assert!(
                        frame == 0 && (a == 0 || a == 100),
                        "frame {frame} with data {a}"
                    );
                }
                engine.join().unwrap();
                assert_eq!(
                    read(),
                    Some((0, [100, 100])),
                    "nothing writes any more: accepted"
                );
            },
        );
    }
}

#[test]
fn episode_totals_are_read_whole() {
    // Two episodes recorded by `record_episode`: the first while a write window is open
    // (as a command's handler could record one), the second outside it (episodes have their own sequence, which `record_episode`
    // brackets itself). An observer reading by that sequence accepts only totals that
    // match whole episodes: none, the first, or both.
    for k in 0..=4 {
        check(
            &format!("observer::episode_totals_whole, from step {k}"),
            move || {
                let stats = StatsWords::new();
                let progress = Progress::new();
                let engine = {
                    let (stats, progress) = (stats.clone(), progress.clone());
                    loom::thread::spawn(move || {
                        let s = stats.view();
                        s.begin_write();
                        progress.step();
                        s.record_episode(0, 2.0, 2);
                        progress.step();
                        s.end_write();
                        progress.step();
                        s.record_episode(1, 3.0, 3);
                        progress.step();
                    })
                };
                let s = stats.view();
                let words = &stats.0;
                progress.wait(k);
                let Ok(seen) = crate::control::read_consistent(&[s.stats_seq()], || {
                    [1, 2, 3].map(|i| primitive::load(&words[i], Ordering::Relaxed))
                });
                if let Some([episodes, return_bits, lengths]) = seen {
                    let whole = match episodes {
                        0 => (return_bits, lengths) == (0, 0),
                        1 => (f64::from_bits(return_bits), lengths) == (2.0, 2),
                        2 => (f64::from_bits(return_bits), lengths) == (5.0, 5),
                        _ => false,
                    };
                    assert!(
                        whole,
                        "{episodes} episodes, return bits {return_bits:#x}, {lengths} steps"
                    );
                }
                engine.join().unwrap();
            },
        );
    }
}

#[test]
fn an_observer_of_two_shards_accepts_one_frame_of_both() {
    // The client posts action 1; two shards step their slices of it (each as `Engine`
    // does: `step_writes_begin`, write, post its own frame counter). The observer checks
    // the action against both frame counters and both write sequences (as
    // `Observer::try_read`). What it accepts is frame 0 or frame 1 of both slices, never
    // one slice of each.
    for k in 0..=3 {
        check(
            &format!("observer::two_shards_one_frame, from step {k}"),
            move || {
                let c = Control::new();
                let shards = [StatsWords::new(), StatsWords::new()];
                let words: Arc<[AtomicU64; 4]> =
                    Arc::new(std::array::from_fn(|_| AtomicU64::new(0)));
                for w in words.iter() {
                    model::track_u64(w);
                }
                // words[i]: shard i's frame counter; words[2 + i]: its slice of the data.
                let progress = Progress::new();
                let client = {
                    let (words, progress) = (words.clone(), progress.clone());
                    post_then_engines(&c, &progress.clone(), 2, move |i, c| {
                        see_action(c);
                        primitive::store(&words[2 + i], 1, Ordering::Relaxed);
                        primitive::store(&words[i], 1, Ordering::Release);
                        progress.step();
                    })
                };
                let views = [shards[0].view(), shards[1].view()];
                progress.wait(k);
                let seqs = [views[0].write_seq(), views[1].write_seq()];
                let Ok(seen) = crate::control::read_between_writes(
                    &seqs,
                    &c.action_seq,
                    &[],
                    &[&words[0], &words[1]],
                    |frame| {
                        let slices = [2, 3].map(|i| primitive::load(&words[i], Ordering::Relaxed));
                        (frame, slices)
                    },
                );
                if let Some((frame, slices)) = seen {
                    assert_eq!(slices, [frame; 2], "frame {frame}");
                }
                client.join().unwrap();
            },
        );
    }
}

// ---- Trajectory streams (1.11): lanes, claims, releases ----

mod streams {
    use super::*;
    use crate::layout::stream::Schema;
    use crate::stream::{Claim, Group, Lane, LaneCtrl, RankCtrl};

    const CAP: u64 = 128;

    /// A stream's live words on the heap, as a stream file holds them: lanes (control
    /// words and `CAP` bytes of data each), the doorbell, the rank table, the stats.
    struct HeapStream {
        ctrls: Vec<LaneCtrl>,
        data: Vec<Box<[AtomicU64]>>,
        doorbell: AtomicU32,
        ranks: Vec<RankCtrl>,
        full_waits: AtomicU64,
        lost: AtomicU64,
        schema: Schema,
    }

    // SAFETY: the data areas are written and read as the stream protocol orders them, each
    // access announced to the model first (primitive::writing/reading); the rest are
    // atomics.
    unsafe impl Sync for HeapStream {}
    // SAFETY: as above.
    unsafe impl Send for HeapStream {}

    impl HeapStream {
        fn new(lanes: usize, ranks: usize) -> Arc<HeapStream> {
            let s = Arc::new(HeapStream {
                ctrls: (0..lanes).map(|_| LaneCtrl::default()).collect(),
                data: (0..lanes)
                    .map(|_| (0..CAP / 8).map(|_| AtomicU64::new(0)).collect())
                    .collect(),
                doorbell: AtomicU32::new(0),
                ranks: (0..ranks).map(|_| RankCtrl::default()).collect(),
                full_waits: AtomicU64::new(0),
                lost: AtomicU64::new(0),
                schema: Schema::parse("data: uint8[*]").unwrap(),
            });
            for c in &s.ctrls {
                for w in [
                    &c.head,
                    &c.owner,
                    &c.generation,
                    &c.committed,
                    &c.committed_bytes,
                    &c.read,
                    &c.tail,
                    &c.released,
                    &c.lost,
                ] {
                    model::track_u64(w);
                }
                model::track_u32(&c.producer_waiting);
            }
            for d in &s.data {
                for w in d.iter() {
                    model::track_u64(w);
                }
                model::track_bytes(d.as_ptr().cast(), CAP as usize);
            }
            model::track_u32(&s.doorbell);
            for r in &s.ranks {
                model::track_u64(&r.owner);
                model::track_u32(&r.state);
                model::track_u32(&r.waiting);
                model::track_u64(&r.lost);
                model::track_u64(&r.hazard);
            }
            model::track_u64(&s.full_waits);
            model::track_u64(&s.lost);
            s
        }

        fn lane(&self, i: usize) -> Lane<'_> {
            Lane {
                ctrl: &self.ctrls[i],
                data: self.data[i].as_ptr() as *mut u8,
                capacity: CAP,
                index: i as u32,
                ranks: &self.ranks,
            }
        }

        fn group(&self) -> Group<'_> {
            Group {
                doorbell: &self.doorbell,
                ranks: &self.ranks,
                full_waits: &self.full_waits,
                lost: &self.lost,
            }
        }

        /// What `Producer::reserve` does: waits for room from `head`, writes the record's
        /// header and `payload`; returns the pending record. Not yet visible.
        fn reserve(
            &self,
            lane: usize,
            head: u64,
            payload: &[u8],
            seq: u64,
        ) -> crate::stream::Pending {
            let l = self.lane(lane);
            let n = payload.len() as u32;
            let spans = self.schema.spans(&[n], CAP / 2).unwrap();
            let need = l.needed(head, spans.len() as u64);
            l.wait_room(
                head,
                need,
                WaitPolicy::BLOCKING,
                Duration::MAX,
                || {},
                || Ok(()),
            )
            .unwrap();
            let p = l.write_header(head, spans, &[n], seq, 1, self.schema.record_header_len());
            let (off, _) = spans.field(0);
            let dst = l.field_ptr(p.pos, spans.len(), off);
            // SAFETY: the field lies inside the reserved record (announced as written by
            // write_header), which nobody reads before the commit.
            unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), dst, payload.len()) };
            p
        }

        /// Reserve and commit: returns the new head.
        fn produce(&self, lane: usize, head: u64, payload: &[u8], seq: u64) -> u64 {
            let p = self.reserve(lane, head, payload, seq);
            self.lane(lane).commit(&p, head, &self.group());
            p.end
        }

        /// One pass over the lanes as `Consumer::try_pop` makes it.
        fn try_claim(&self, rank: u8) -> Option<(usize, Claim)> {
            let hl = self.schema.record_header_len();
            (0..self.ctrls.len())
                .find_map(|i| self.lane(i).try_claim(rank, hl).unwrap().map(|c| (i, c)))
        }

        /// What `Consumer::pop` does: sleeps on the doorbell until a lane has a record,
        /// claims it, reads it (its sequence number and payload).
        fn pop(&self, rank: u8) -> (usize, Claim, u64, Vec<u8>) {
            let g = self.group();
            let (lane, claim) = wait_until(
                &g.bell_of(rank as usize),
                |_| self.try_claim(rank),
                WaitPolicy::BLOCKING,
                Duration::MAX,
                "a record",
                || Ok(()),
            )
            .unwrap();
            let (seq, data) = self.read(lane, claim);
            (lane, claim, seq, data)
        }

        fn read(&self, lane: usize, claim: Claim) -> (u64, Vec<u8>) {
            let l = self.lane(lane);
            let (spans, seq, _) = l.decode(&self.schema, claim).unwrap();
            let (off, n) = spans.field(0);
            let src = l.field_ptr(claim.pos, spans.len(), off);
            primitive::reading(src, n as usize);
            let mut out = vec![0u8; n as usize];
            // SAFETY: inside the claimed, committed record (decode checked it).
            unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), n as usize) };
            (seq, out)
        }

        fn drained(&self, lane: usize) {
            let c = &self.ctrls[lane];
            let head = primitive::load(&c.head, Ordering::Relaxed);
            assert_eq!(primitive::load(&c.read, Ordering::Relaxed), head);
            assert_eq!(primitive::load(&c.tail, Ordering::Relaxed), head);
            assert_eq!(primitive::load(&c.producer_waiting, Ordering::Relaxed), 0);
        }
    }

    #[test]
    fn two_producers_one_consumer() {
        // Two producers, a lane each, commit a record each while the consumer sleeps on
        // the doorbell: it must wake for both, read each whole (its bytes written before
        // the commit's Release), and release them.
        check("stream::two_producers_one_consumer", || {
            let s = HeapStream::new(2, 1);
            let producers: Vec<_> = (0..2)
                .map(|i| {
                    let s = s.clone();
                    loom::thread::spawn(move || {
                        s.produce(i, 0, &[10 + i as u8; 3], 0);
                    })
                })
                .collect();
            let mut seen = [false; 2];
            for _ in 0..2 {
                let (lane, claim, seq, data) = s.pop(0);
                assert_eq!((seq, &data[..]), (0, &[10 + lane as u8; 3][..]));
                assert!(!std::mem::replace(&mut seen[lane], true), "popped twice");
                assert!(s.lane(lane).release(claim));
            }
            for p in producers {
                p.join().unwrap();
            }
            s.drained(0);
            s.drained(1);
            assert_eq!(primitive::load(&s.ranks[0].waiting, Ordering::Relaxed), 0);
        });
    }

    #[test]
    fn wrap_around_waits_for_room() {
        // A 128-byte lane: records of 32, 64 and 64 bytes. The third does not fit before
        // the lane's end: a pad, then the record at the start, over the first two's room,
        // so the producer sleeps on `tail` until the consumer released both. The consumer
        // reads each only after it was written, and the producer writes over the first
        // two only after the consumer read them.
        check("stream::wrap_around_waits_for_room", || {
            let s = HeapStream::new(1, 1);
            let producer = {
                let s = s.clone();
                loom::thread::spawn(move || {
                    let mut head = 0;
                    for (k, n) in [0usize, 32, 32].into_iter().enumerate() {
                        head = s.produce(0, head, &vec![k as u8 + 1; n], k as u64);
                    }
                    assert_eq!(head, 128 + 64);
                })
            };
            for (k, n) in [0usize, 32, 32].into_iter().enumerate() {
                let (_, claim, seq, data) = s.pop(0);
                assert_eq!((seq, data), (k as u64, vec![k as u8 + 1; n]));
                assert_eq!(claim.pos, [0, 32, 128][k]);
                assert!(s.lane(0).release(claim));
            }
            producer.join().unwrap();
            s.drained(0);
        });
    }

    #[test]
    fn a_producer_stopped_between_reserve_and_commit() {
        // The producer commits record 0, then reserves and writes record 1 and stops
        // (killed) before its commit. The consumer, racing it, sees record 0 whole and
        // never record 1; the lane's next producer starts from `head` and its record
        // arrives where record 1 would have.
        check(
            "stream::a_producer_stopped_between_reserve_and_commit",
            || {
                let s = HeapStream::new(1, 1);
                let producer = {
                    let s = s.clone();
                    loom::thread::spawn(move || {
                        let head = s.produce(0, 0, &[], 0);
                        s.reserve(0, head, &[9; 8], 1);
                    })
                };
                let (_, claim, seq, data) = s.pop(0);
                assert_eq!((seq, data.len()), (0, 0));
                assert!(s.lane(0).release(claim));
                producer.join().unwrap();
                assert!(s.try_claim(0).is_none(), "an uncommitted record was seen");
                // The next producer of the lane (taken over).
                let head = primitive::load(&s.ctrls[0].head, Ordering::Acquire);
                assert_eq!(head, 32);
                s.produce(0, head, &[7; 8], 0);
                let (_, claim, seq, data) = s.pop(0);
                assert_eq!((claim.pos, seq, data), (32, 0, vec![7; 8]));
                assert!(s.lane(0).release(claim));
                s.drained(0);
            },
        );
    }

    #[test]
    fn two_ranks_race_on_claim_release_and_tail() {
        // Two records committed; two ranks claim and release concurrently (each record
        // to exactly one rank; either may move `tail` over the other's release), while
        // the producer waits for room for a third that needs the first record's room
        // back and writes over it (a rank looking at a stale position must not take the
        // new record for a corrupt one).
        // Two preemptions find the fault this model was written for (a stale position
        // taken for a corrupt record); three take a minute.
        model::check_bounded(
            "stream::two_ranks_race_on_claim_release_and_tail",
            2,
            || {
                let s = HeapStream::new(1, 2);
                let mut head = 0;
                for k in 0..2 {
                    head = s.produce(0, head, &[0; 32], k);
                }
                let ranks: Vec<_> = (0..2u8)
                    .map(|rank| {
                        let s = s.clone();
                        loom::thread::spawn(move || {
                            // One claim each: with two records committed, each rank gets one.
                            let (lane, claim) = s.try_claim(rank).expect("a record for each");
                            let (seq, _) = s.read(lane, claim);
                            assert!(s.lane(lane).release(claim));
                            seq
                        })
                    })
                    .collect();
                // A third record: 64 bytes at 128 needs `tail` at 64 at least.
                let producer = {
                    let s = s.clone();
                    loom::thread::spawn(move || s.produce(0, head, &[0; 32], 2))
                };
                let mut all: Vec<u64> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
                assert_eq!(producer.join().unwrap(), 192);
                all.sort();
                assert_eq!(all, [0, 1]);
                let (_, claim) = s.try_claim(0).expect("the third record");
                assert!(s.lane(0).release(claim));
                s.drained(0);
            },
        );
    }

    #[test]
    fn two_ranks_release_neighbours() {
        // Each rank holds one of two neighbouring records and releases it at the same
        // time as the other: whichever looks last must see both releases and move `tail`
        // over both (the SeqCst fence in `advance_tail`), or the lane would keep their
        // room for ever.
        check("stream::two_ranks_release_neighbours", || {
            let s = HeapStream::new(1, 2);
            let mut head = 0;
            for k in 0..2 {
                head = s.produce(0, head, &[], k);
            }
            let claims: Vec<Claim> = (0..2u8).map(|r| s.try_claim(r).unwrap().1).collect();
            let ranks: Vec<_> = claims
                .into_iter()
                .map(|claim| {
                    let s = s.clone();
                    loom::thread::spawn(move || assert!(s.lane(0).release(claim)))
                })
                .collect();
            for r in ranks {
                r.join().unwrap();
            }
            assert_eq!(primitive::load(&s.ctrls[0].tail, Ordering::Relaxed), head);
        });
    }

    #[test]
    fn a_dead_ranks_claim_is_released_as_lost() {
        // Rank 1 claims a record and dies holding it; rank 0 claims the next. The
        // producer, waiting for room the dead rank's record holds, releases it as lost
        // (its liveness check between slices) while rank 0 releases its own: the
        // producer's record fits, `tail` passes both, exactly one loss is counted.
        check("stream::a_dead_ranks_claim_is_released_as_lost", || {
            model::let_slices_expire();
            let s = HeapStream::new(1, 2);
            let mut head = 0;
            for k in 0..2 {
                head = s.produce(0, head, &[0; 32], k);
            }
            let (_, dead) = s.try_claim(1).unwrap();
            assert_eq!(dead.pos, 0);
            let rank0 = {
                let s = s.clone();
                loom::thread::spawn(move || {
                    let (lane, claim) = s.try_claim(0).unwrap();
                    assert!(s.lane(lane).release(claim));
                })
            };
            let l = s.lane(0);
            // A third record of 64 bytes needs the dead rank's record's room.
            let need = l.needed(head, 64);
            let g = s.group();
            l.wait_room(
                head,
                need,
                WaitPolicy::BLOCKING,
                Duration::MAX,
                || {},
                || {
                    l.reap(None, &g, &mut |k| k == 1);
                    Ok(())
                },
            )
            .unwrap();
            rank0.join().unwrap();
            assert!(!l.release(dead), "a lost record released again");
            assert_eq!(primitive::load(&s.lost, Ordering::Relaxed), 1);
            assert_eq!(primitive::load(&s.ctrls[0].tail, Ordering::Relaxed), 128);
        });
    }

    #[test]
    fn a_stale_examiner_never_reads_a_later_payload_as_a_record() {
        // Lap 0 holds R0 [0,32), R1 [32,96), R2 [96,128); rank 0 holds R0. Rank 1 looks
        // for a record while rank 0 takes the next one, releases both and the producer
        // writes R3 at 128, whose payload (at lane offsets 32..64) reads as a ready
        // record of lap 0 at offset 32. Rank 1 may have loaded `read = 32` before all
        // that: the word it then examines is the cell R3's payload is written to. It
        // must claim R1 or R2 (never a word of R3's payload), and R3 must keep its bytes.
        check(
            "stream::a_stale_examiner_never_reads_a_later_payload_as_a_record",
            || {
                use crate::layout::stream::{Word0, KIND_RECORD, STATE_READY};
                let s = HeapStream::new(1, 2);
                let mut head = 0;
                for (k, n) in [0usize, 32, 0].into_iter().enumerate() {
                    head = s.produce(0, head, &vec![0u8; n], k as u64);
                }
                assert_eq!(head, 128);
                let (_, r0) = s.try_claim(0).unwrap();
                let fake = Word0 {
                    len: 32,
                    kind: KIND_RECORD,
                    state: STATE_READY,
                    rank: 0,
                    lap: 0,
                }
                .pack();
                let mut payload = [0u8; 32];
                payload[..8].copy_from_slice(&fake.to_le_bytes());
                let rank1 = {
                    let s = s.clone();
                    loom::thread::spawn(move || {
                        let (_, c) = s.try_claim(1).expect("R1 or R2 is there");
                        assert!([32, 96].contains(&c.pos), "claimed position {}", c.pos);
                        let (seq, _) = s.read(0, c);
                        assert_eq!(seq, if c.pos == 32 { 1 } else { 2 }, "seq at {}", c.pos);
                        assert!(s.lane(0).release(c));
                    })
                };
                let l = s.lane(0);
                let (_, c) = s.try_claim(0).expect("R1 or R2 is there");
                assert!(l.release(c));
                assert!(l.release(r0));
                let p3 = s.reserve(0, head, &payload, 3);
                assert_eq!(p3.pos, 128);
                // The model's cells are not the bytes written through pointers: the
                // payload's first word, at lane offset 32, is also stored into the cell a
                // first word is read from there, as one memory holds both in a stream file.
                primitive::store(&s.data[0][4], fake, Ordering::Relaxed);
                l.commit(&p3, head, &s.group());
                rank1.join().unwrap();
                let (_, r3) = s.try_claim(0).expect("R3");
                assert_eq!(r3.pos, 128);
                assert_eq!(s.read(0, r3), (3, payload.to_vec()));
                assert_eq!(
                    primitive::load(&s.data[0][4], Ordering::Relaxed),
                    fake,
                    "a claim was written into R3's payload"
                );
            },
        );
    }
}
