//! Sequence counters and waiting.
//!
//! One side posts a counter (`action_seq` or `frame_seq`); the other waits for it to reach
//! a target. Waiting spins for a time budget, then yields a few times, then sleeps on a
//! futex on the counter's low 32 bits in slices, checking the deadline and the peer's
//! liveness between slices. The poster only makes the `FUTEX_WAKE` syscall when the
//! waiter flag says someone sleeps, so the hot loop makes no system call.
//!
//! No lost wake-up (Dekker): the waiter stores its flag, fences, loads the counter; the
//! poster stores the counter, fences, loads the flag. The two SeqCst fences order the
//! pairs, so at least one side sees the other's store. If the waiter saw the old value it sleeps with that value as
//! the futex's expected word: if the counter moved in between, the kernel returns at once.
//! `loom_tests` below checks this handshake under every interleaving.

use std::time::{Duration, Instant};

use crate::primitive::{self, fence, AtomicU32, AtomicU64, Ordering};

use crate::error::{Error, Result};

/// How a side waits for its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitPolicy {
    /// Busy-wait (PAUSE) this long before yielding. Zero: never spin.
    pub spin: Duration,
    /// Then `sched_yield` this many times before sleeping on the futex.
    pub yields: u32,
}

impl WaitPolicy {
    /// Spin for `spin`, then 16 yields, then sleep.
    pub const fn spinning(spin: Duration) -> Self {
        WaitPolicy { spin, yields: 16 }
    }
    /// Sleep at once: lowest CPU use (laptops), a few microseconds more per wake-up.
    pub const BLOCKING: WaitPolicy = WaitPolicy {
        spin: Duration::ZERO,
        yields: 0,
    };
    /// Default spin budget: covers a fast engine step without sleeping, and costs at most
    /// this much CPU per wait when the peer is slow.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);
}

impl Default for WaitPolicy {
    fn default() -> Self {
        WaitPolicy::spinning(WaitPolicy::DEFAULT_SPIN)
    }
}

/// Polling for rare events (a header being published, an engine becoming ready): yield
/// for the first polls, then sleep 1 ms between polls, so a slow peer costs no CPU.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    polls: u32,
}

impl Backoff {
    pub(crate) fn snooze(&mut self) {
        self.polls = self.polls.saturating_add(1);
        if self.polls < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// While spinning, yield the CPU this often (see `wait_until`).
pub const SPIN_YIELD_EVERY: Duration = Duration::from_micros(10);

/// Longest single futex sleep: the latency bound for noticing a dead peer or a deadline.
pub const SLICE: Duration = Duration::from_millis(10);

/// A counter another process posts, as the waiting side needs it.
pub trait SeqWord {
    fn load(&self, order: Ordering) -> u64;
    fn set_waiting(&self, waiting: bool);
    /// Sleep while the counter's low 32 bits equal `expected`, at most `slice`.
    fn park(&self, expected: u32, slice: Duration);
}

/// A counter as the posting side needs it.
pub trait SeqPost {
    fn store(&self, value: u64);
    fn waiter_sleeps(&self) -> bool;
    fn unpark(&self);
}

/// A counter and its waiter flag in a mapped region.
#[derive(Clone, Copy)]
pub struct SharedSeq<'a> {
    pub counter: &'a AtomicU64,
    /// The counter's low 32 bits: the futex word.
    pub low: &'a AtomicU32,
    pub waiting: &'a AtomicU32,
}

impl SeqWord for SharedSeq<'_> {
    #[inline]
    fn load(&self, order: Ordering) -> u64 {
        primitive::load(self.counter, order)
    }
    #[inline]
    fn set_waiting(&self, waiting: bool) {
        primitive::store(self.waiting, waiting as u32, Ordering::Relaxed);
    }
    fn park(&self, expected: u32, slice: Duration) {
        primitive::futex_wait(self.low, expected, slice);
    }
}

impl SeqPost for SharedSeq<'_> {
    #[inline]
    fn store(&self, value: u64) {
        primitive::store(self.counter, value, Ordering::Release);
    }
    #[inline]
    fn waiter_sleeps(&self) -> bool {
        primitive::load(self.waiting, Ordering::Relaxed) != 0
    }
    fn unpark(&self) {
        primitive::futex_wake_all(self.low);
    }
}

/// The engine's doorbell (protocol 1.1): the engine sleeps on this word while it waits
/// for an action *or* a command; the client bumps it after posting either, so one futex
/// wakes the engine for both and a post after the engine looked can never be missed (the
/// word it sleeps on has changed).
#[derive(Clone, Copy)]
pub struct Doorbell<'a> {
    pub bell: &'a AtomicU32,
    pub engine_waiting: &'a AtomicU32,
    /// The action counter, when posting an action; `None` for a command push.
    pub action_seq: Option<&'a AtomicU64>,
}

impl SeqPost for Doorbell<'_> {
    #[inline]
    fn store(&self, value: u64) {
        if let Some(a) = self.action_seq {
            primitive::store(a, value, Ordering::Release);
        }
        primitive::fetch_add(self.bell, 1, Ordering::Release);
    }
    #[inline]
    fn waiter_sleeps(&self) -> bool {
        primitive::load(self.engine_waiting, Ordering::Relaxed) != 0
    }
    fn unpark(&self) {
        primitive::futex_wake_all(self.bell);
    }
}

impl SeqWord for Doorbell<'_> {
    #[inline]
    fn load(&self, order: Ordering) -> u64 {
        primitive::load(self.bell, order) as u64
    }
    #[inline]
    fn set_waiting(&self, waiting: bool) {
        primitive::store(self.engine_waiting, waiting as u32, Ordering::Relaxed);
    }
    fn park(&self, expected: u32, slice: Duration) {
        primitive::futex_wait(self.bell, expected, slice);
    }
}

/// Publishes `value` and wakes the waiter if it sleeps.
#[inline]
pub fn post<S: SeqPost>(seq: &S, value: u64) {
    seq.store(value);
    fence(Ordering::SeqCst);
    if seq.waiter_sleeps() {
        seq.unpark();
    }
}

/// Waits until the counter is at least `target`; returns the value seen. `check_peer` runs
/// before each sleep and after each slice: it returns the error that ends the wait (peer
/// closed or dead). On timeout the peer is checked once more first, so a dead peer is
/// reported as dead, not as slow.
#[inline]
pub fn wait_for<S: SeqWord>(
    seq: &S,
    target: u64,
    policy: WaitPolicy,
    timeout: Duration,
    what: &'static str,
    check_peer: impl FnMut() -> Result<()>,
) -> Result<u64> {
    wait_until(
        seq,
        |order| {
            let v = seq.load(order);
            (v >= target).then_some(v)
        },
        policy,
        timeout,
        what,
        check_peer,
    )
}

/// Waits until `ready` returns `Some`, sleeping on `seq`'s futex word. Whoever makes
/// `ready` true must store (Release), fence (SeqCst), then wake `seq`'s word if its waiter
/// flag is set: [`post`] does that for the counter itself; another producer (a command
/// ring) does the same with its own store. `ready` is called with the ordering to use for
/// its loads.
pub fn wait_until<S: SeqWord, R>(
    seq: &S,
    mut ready: impl FnMut(Ordering) -> Option<R>,
    policy: WaitPolicy,
    timeout: Duration,
    what: &'static str,
    mut check_peer: impl FnMut() -> Result<()>,
) -> Result<R> {
    if let Some(r) = ready(Ordering::Acquire) {
        return Ok(r);
    }
    // The clock is read only once the first 64 turns have not seen the value: a fast
    // peer answers before that, and a clock read (~25 ns) would be most of its cost.
    let mut start: Option<Instant> = None;
    if !policy.spin.is_zero() {
        let mut i: u32 = 0;
        let mut next_yield = SPIN_YIELD_EVERY;
        loop {
            std::hint::spin_loop();
            if let Some(r) = ready(Ordering::Acquire) {
                return Ok(r);
            }
            i = i.wrapping_add(1);
            if i % 64 == 0 {
                let spent = start.get_or_insert_with(Instant::now).elapsed();
                if spent >= policy.spin {
                    break;
                }
                // On a busy machine the peer may need this very core to answer: let it
                // run. On an idle one this is a ~1 µs no-op a fast peer never reaches.
                if spent >= next_yield {
                    std::thread::yield_now();
                    next_yield = spent + SPIN_YIELD_EVERY;
                }
            }
        }
    }
    let start = start.unwrap_or_else(Instant::now);
    for _ in 0..policy.yields {
        std::thread::yield_now();
        if let Some(r) = ready(Ordering::Acquire) {
            return Ok(r);
        }
    }
    let deadline = start.checked_add(timeout);
    check_peer()?;
    loop {
        seq.set_waiting(true);
        fence(Ordering::SeqCst);
        // The futex compares against the word as it is now: any post after this load
        // either changes the word (the kernel returns at once) or sees the flag and wakes.
        let word = seq.load(Ordering::Acquire);
        if let Some(r) = ready(Ordering::Acquire) {
            seq.set_waiting(false);
            return Ok(r);
        }
        let now = Instant::now();
        let remaining = match deadline {
            Some(d) if now >= d => {
                seq.set_waiting(false);
                check_peer()?;
                return Err(Error::Timeout {
                    waited: timeout,
                    what,
                });
            }
            Some(d) => d - now,
            None => SLICE,
        };
        seq.park(word as u32, remaining.min(SLICE));
        seq.set_waiting(false);
        if let Some(r) = ready(Ordering::Acquire) {
            return Ok(r);
        }
        check_peer()?;
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! Models of the real handshakes, run under every interleaving loom explores (see
    //! `scripts/test.sh` for the command). The control words are std atomics, as in a region,
    //! handed to `primitive::model`, which makes every operation of the real code on them
    //! loom's; `low` is the counter's own low half, as in a region. The futex sleeps until
    //! woken, with no slices, so a lost wake-up is a deadlock loom reports; only the
    //! liveness model lets slices run out.
    use std::sync::Arc;

    use super::*;
    use crate::error::Peer;
    use crate::primitive::model::{self, check};
    use crate::ring::{low_half, HeapRing};

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
        // The client pushes a command into the real ring and rings the bell (as
        // `command::ring_doorbell`), then posts an action through the bell. The engine,
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
                    post(&c.doorbell(false), 0);
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
}
