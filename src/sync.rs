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

/// How a side waits for its peer. Whatever the policy, a waiter spins and yields only
/// while every runnable thread of the machine has a core ([`crate::os::core_free`]);
/// otherwise it sleeps on the futex at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitPolicy {
    /// Busy-wait (PAUSE) this long before yielding. Zero: never spin.
    pub spin: Duration,
    /// Then `sched_yield` this many times before sleeping on the futex.
    pub yields: u32,
    /// Spin longer than `spin`, up to this, when this side's recent waits were that long
    /// ([`SpinGauge`]): a peer whose step takes a few hundred microseconds is then met
    /// spinning instead of with a futex wake-up each step (tens of microseconds on a VM).
    /// Zero: `spin` is the budget, whatever the waits.
    pub spin_up_to: Duration,
}

impl WaitPolicy {
    /// Spin for `spin` (at most [`WaitPolicy::MAX_SPIN`]), then 16 yields, then sleep: a
    /// fixed budget, as given.
    pub const fn spinning(spin: Duration) -> Self {
        let spin = if spin.as_nanos() > WaitPolicy::MAX_SPIN.as_nanos() {
            WaitPolicy::MAX_SPIN
        } else {
            spin
        };
        WaitPolicy {
            spin,
            yields: 16,
            spin_up_to: Duration::ZERO,
        }
    }
    /// The longest spin budget: a spinning wait checks neither its deadline nor its peer,
    /// so spinning longer than a sleep slice would only delay both.
    pub const MAX_SPIN: Duration = SLICE;
    /// Sleep at once: lowest CPU use (laptops), a few microseconds more per wake-up.
    pub const BLOCKING: WaitPolicy = WaitPolicy {
        spin: Duration::ZERO,
        yields: 0,
        spin_up_to: Duration::ZERO,
    };
    /// Default spin budget: covers a fast engine step without sleeping, and costs at most
    /// this much CPU per wait when the peer is slow.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);
    /// How far the default policy's budget grows to cover the recent waits: a wake-up
    /// (tens of microseconds) is a tenth of a step this short or shorter. Longer steps
    /// are waited for asleep after [`WaitPolicy::DEFAULT_SPIN`], as before.
    pub const DEFAULT_SPIN_UP_TO: Duration = Duration::from_millis(2);

    /// The default for `processes` busy processes taking turns (a sharded region's K
    /// shards and its client): spin only while each can have a core of its own, else
    /// sleep on the futex at once. A spinning waiter on an oversubscribed machine holds
    /// the core the process it waits for needs (measured on 2 cores: 2 shards and a
    /// client spinning took 3-4x longer per step than the same sleeping on the futex).
    pub fn for_processes(processes: usize) -> WaitPolicy {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if processes <= cores {
            WaitPolicy::default()
        } else {
            WaitPolicy::BLOCKING
        }
    }

    /// What a side of a sharded region (`shards` engines) uses when it was given the
    /// default policy: [`WaitPolicy::for_processes`] of the shards and the client. Any
    /// other policy is kept as given (to spin on an oversubscribed machine anyway, give a
    /// budget: [`WaitPolicy::spinning`]); an unsharded region keeps the default.
    pub fn adapted_to_shards(self, shards: usize) -> WaitPolicy {
        if shards > 1 && self == WaitPolicy::default() {
            WaitPolicy::for_processes(shards + 1)
        } else {
            self
        }
    }
}

impl Default for WaitPolicy {
    /// Spin [`WaitPolicy::DEFAULT_SPIN`], or up to [`WaitPolicy::DEFAULT_SPIN_UP_TO`]
    /// to cover the recent waits; 16 yields; then sleep.
    fn default() -> Self {
        WaitPolicy {
            spin_up_to: WaitPolicy::DEFAULT_SPIN_UP_TO,
            ..WaitPolicy::spinning(WaitPolicy::DEFAULT_SPIN)
        }
    }
}

/// What one side has seen of its recent waits (a moving average of how long they took),
/// to size its spin: [`SpinGauge::budget`]. The client keeps one for its frames, the
/// engine one for its actions.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SpinGauge {
    /// Moving average (weight 1/8 per wait) of the waits' lengths, in nanoseconds.
    typical_ns: u64,
}

impl SpinGauge {
    /// The spin budget of the next wait under `policy`: its `spin`, or, when the waits
    /// lately took longer but at most half of `spin_up_to`, twice their average (a wait
    /// a little longer than usual is still met spinning). Past that the peer is slow
    /// enough that a wake-up costs little beside its step: back to `spin`.
    #[inline]
    pub fn budget(&self, policy: WaitPolicy) -> Duration {
        let want = self.typical_ns.saturating_mul(2);
        if policy.spin.is_zero() || want <= policy.spin.as_nanos() as u64 {
            return policy.spin;
        }
        if want <= policy.spin_up_to.as_nanos() as u64 {
            Duration::from_nanos(want)
        } else {
            policy.spin
        }
    }

    /// A wait ended after `waited` (zero: at the first look). One outlier moves the
    /// average by an eighth of itself at most, and at most by a quarter of the largest
    /// budget.
    #[inline]
    pub fn record(&mut self, waited: Duration) {
        let cap = 4 * WaitPolicy::DEFAULT_SPIN_UP_TO.as_nanos() as u64;
        let sample = (waited.as_nanos() as u64).min(cap);
        self.typical_ns = self.typical_ns - self.typical_ns / 8 + sample / 8;
    }

    /// [`SpinGauge::record`] of a wait answered at its first look: for a fast peer the
    /// average is zero and stays so, without a store.
    #[inline]
    pub(crate) fn record_at_once(&mut self) {
        let t = self.typical_ns;
        if t != 0 {
            self.typical_ns = t - t.div_ceil(8);
        }
    }
}

/// Polling for rare events (a header being published, an engine becoming ready): yield
/// for the first polls, then sleep 1 ms between polls, so a slow peer costs no CPU.
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    polls: u32,
}

impl Backoff {
    /// Whether the next snooze sleeps (the yields are over): a poller consults its
    /// interrupt hook only then, at most once a millisecond.
    pub(crate) fn sleeps(&self) -> bool {
        self.polls >= 63
    }

    pub(crate) fn snooze(&mut self) {
        self.polls = self.polls.saturating_add(1);
        if self.polls < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Polls `done` until it says so (yielding, then sleeping 1 ms between polls:
/// [`Backoff`]), for a wait with no word to sleep on (a CUDA stream, queried). Before each
/// sleep `check` runs (a dead peer, an interrupt: its error ends the wait; at most once a
/// millisecond, as the other pollers do), and once `timeout` has passed the wait ends
/// with `Timeout { what }`. `done`'s error ends it too.
pub(crate) fn poll_until(
    timeout: Duration,
    what: &'static str,
    mut done: impl FnMut() -> Result<bool>,
    check: &dyn Fn() -> Result<()>,
) -> Result<()> {
    let start = Instant::now();
    let mut backoff = Backoff::default();
    loop {
        if done()? {
            return Ok(());
        }
        if backoff.sleeps() {
            check()?;
        }
        if start.elapsed() >= timeout {
            return Err(Error::Timeout {
                waited: timeout,
                what,
            });
        }
        backoff.snooze();
    }
}

/// While spinning, yield the CPU this often (see `wait_until`).
pub const SPIN_YIELD_EVERY: Duration = Duration::from_micros(10);

/// Longest single futex sleep: the latency bound for noticing a dead peer or a deadline.
pub const SLICE: Duration = Duration::from_millis(10);

/// The yields after the spin stop once the wait has lasted its spin budget and this
/// much more, however many were planned: on a contended CPU one `sched_yield` can cost a
/// whole scheduler slice (milliseconds, more with many runnable tasks), and the peer's
/// liveness is checked only after the yields. Idle, 16 yields take about 20 µs.
pub const YIELD_TIME: Duration = Duration::from_micros(100);

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

/// Rings `bell` if its waiter sleeps: one more on the counter (Release) and a wake. For a
/// word that only wakes (a sharded region's frame bell, 1.10: each shard rings it after
/// posting its own frame, so an asynchronous client sleeps on one word for any shard's
/// frame). Call it after a [`post`], whose fence orders the flag's load after the post:
/// a waiter that set its flag before that fence is woken (or sees the bell moved); one
/// that sets it after sees the post when it looks again.
#[inline]
pub fn ring_if_waiting(bell: &SharedSeq<'_>) {
    if bell.waiter_sleeps() {
        primitive::fetch_add(bell.counter, 1, Ordering::Release);
        bell.unpark();
    }
}

/// Posts through the doorbell to the engine processes of a sharded region (1.4): each
/// sleeps on the one doorbell with a waiter flag of its own, so the poster looks at
/// every flag after its fence, and one wake reaches every sleeper. Dekker as in
/// [`post`], once per flag: a shard that stored its flag before the fence is seen here;
/// one that stores it after sees the new doorbell and does not sleep.
#[inline]
pub fn post_all<'a>(
    bell: &Doorbell<'a>,
    value: u64,
    flags: impl IntoIterator<Item = &'a AtomicU32>,
) {
    bell.store(value);
    fence(Ordering::SeqCst);
    if flags
        .into_iter()
        .any(|f| primitive::load(f, Ordering::Relaxed) != 0)
    {
        bell.unpark();
    }
}

/// What a wait keeps, or a series of waits under one timeout (an engine answering
/// commands between two looks at its action, a client waiting for one shard after
/// another): when it began, read from the clock only once a wait is not answered within
/// its first spins (a wait answered at once reads no clock at all), and the side's
/// [`SpinGauge`], which sizes the spin and learns from each wait (a fresh one, as
/// `default()` has, gives the policy's own budget).
#[derive(Debug, Default, Clone, Copy)]
pub struct WaitTrack {
    start: Option<Instant>,
    gauge: SpinGauge,
}

impl WaitTrack {
    /// A wait of a side whose recent waits `gauge` describes; take it back with
    /// [`WaitTrack::gauge`] once the wait is over.
    #[inline]
    pub fn learning(gauge: SpinGauge) -> WaitTrack {
        WaitTrack { start: None, gauge }
    }

    /// The gauge, with this wait's length learnt.
    #[inline]
    pub fn gauge(&self) -> SpinGauge {
        self.gauge
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
    wait_for_from(
        seq,
        target,
        policy,
        timeout,
        &mut WaitTrack::default(),
        what,
        check_peer,
    )
}

/// [`wait_for`] with the timeout counted from the start of `track` (set by this wait if
/// unset), and the spin budget of its gauge.
#[inline]
pub fn wait_for_from<S: SeqWord>(
    seq: &S,
    target: u64,
    policy: WaitPolicy,
    timeout: Duration,
    track: &mut WaitTrack,
    what: &'static str,
    check_peer: impl FnMut() -> Result<()>,
) -> Result<u64> {
    wait_until_from(
        seq,
        |order| {
            let v = seq.load(order);
            (v >= target).then_some(v)
        },
        policy,
        timeout,
        track,
        what,
        check_peer,
    )
}

/// Spins until `seq` is at least `target`, for at most `spin` counted from `*started`
/// (set here, by the first clock read, once 64 looks did not see the value; several
/// words share one budget through it): the value seen, or `None`. No yield, no sleep, no
/// look at the peer: the caller waits the usual way ([`wait_for_from`]) after a `None`.
/// For a caller that holds something others want while it waits (the Python binding's
/// GIL), so it keeps it only while a fast peer answers.
#[inline]
pub fn spin_briefly<S: SeqWord>(
    seq: &S,
    target: u64,
    spin: Duration,
    started: &mut Option<Instant>,
) -> Option<u64> {
    let v = seq.load(Ordering::Acquire);
    if v >= target {
        return Some(v);
    }
    if spin.is_zero() {
        return None;
    }
    let mut i: u32 = 0;
    loop {
        std::hint::spin_loop();
        let v = seq.load(Ordering::Acquire);
        if v >= target {
            return Some(v);
        }
        i = i.wrapping_add(1);
        if i % 64 == 0 {
            let t = match *started {
                Some(t) => t,
                None => {
                    // As in `wait_on`: no spinning where the peer may need this core.
                    if !primitive::core_free() {
                        return None;
                    }
                    *started.insert(Instant::now())
                }
            };
            if t.elapsed() >= spin {
                return None;
            }
        }
    }
}

/// Waits until `ready` returns `Some`, sleeping on `seq`'s futex word. Whoever makes
/// `ready` true must store (Release), fence (SeqCst), then wake `seq`'s word if its waiter
/// flag is set: [`post`] does that for the counter itself; another producer (a command
/// ring) does the same with its own store. `ready` is called with the ordering to use for
/// its loads.
#[inline]
pub fn wait_until<S: SeqWord, R>(
    seq: &S,
    ready: impl FnMut(Ordering) -> Option<R>,
    policy: WaitPolicy,
    timeout: Duration,
    what: &'static str,
    check_peer: impl FnMut() -> Result<()>,
) -> Result<R> {
    wait_until_from(
        seq,
        ready,
        policy,
        timeout,
        &mut WaitTrack::default(),
        what,
        check_peer,
    )
}

/// [`wait_until`] with the timeout counted from the start of `track` (set by this wait if
/// unset), and the spin budget of its gauge. The first look is made here, inline in the
/// caller: the step path of a fast peer ends there, without a call.
#[inline]
pub fn wait_until_from<S: SeqWord, R>(
    seq: &S,
    mut ready: impl FnMut(Ordering) -> Option<R>,
    policy: WaitPolicy,
    timeout: Duration,
    track: &mut WaitTrack,
    what: &'static str,
    check_peer: impl FnMut() -> Result<()>,
) -> Result<R> {
    if let Some(r) = ready(Ordering::Acquire) {
        track.gauge.record_at_once();
        return Ok(r);
    }
    wait_on(seq, ready, policy, timeout, track, what, check_peer)
}

/// The rest of a wait, past its first look: spin, yield, sleep.
#[inline(never)]
fn wait_on<S: SeqWord, R>(
    seq: &S,
    mut ready: impl FnMut(Ordering) -> Option<R>,
    policy: WaitPolicy,
    timeout: Duration,
    track: &mut WaitTrack,
    what: &'static str,
    mut check_peer: impl FnMut() -> Result<()>,
) -> Result<R> {
    let spin = track.gauge.budget(policy);
    // The clock is read only once the first 64 turns have not seen the value: a fast
    // peer answers before that, and a clock read (~25 ns) would be most of its cost.
    let mut start: Option<Instant> = None;
    // Spinning (and yielding) pays only while every runnable thread has a core: on a busy
    // machine the waiter would hold the core its peer needs. Looked at once the first 64
    // turns have not seen the value (a fast peer never gets here).
    let mut core_free = true;
    if !spin.is_zero() {
        let mut i: u32 = 0;
        let mut next_yield = SPIN_YIELD_EVERY;
        loop {
            std::hint::spin_loop();
            if let Some(r) = ready(Ordering::Acquire) {
                track
                    .gauge
                    .record(start.map_or(Duration::ZERO, |t| t.elapsed()));
                return Ok(r);
            }
            i = i.wrapping_add(1);
            if i % 64 == 0 {
                let spent = match start {
                    Some(t) => t.elapsed(),
                    None => {
                        let now = Instant::now();
                        start = Some(now);
                        // The series' timeout counts from its first clock read, also
                        // when this wait is answered while it spins.
                        track.start.get_or_insert(now);
                        core_free = primitive::core_free();
                        Duration::ZERO
                    }
                };
                if spent >= spin || !core_free {
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
    let series_start = *track.start.get_or_insert(start);
    let yield_until = spin.saturating_add(YIELD_TIME);
    for _ in 0..if core_free { policy.yields } else { 0 } {
        std::thread::yield_now();
        if let Some(r) = ready(Ordering::Acquire) {
            track.gauge.record(start.elapsed());
            return Ok(r);
        }
        if start.elapsed() >= yield_until {
            break;
        }
    }
    let deadline = series_start.checked_add(timeout);
    check_peer()?;
    loop {
        seq.set_waiting(true);
        fence(Ordering::SeqCst);
        // The futex compares against the word as it is now: any post after this load
        // either changes the word (the kernel returns at once) or sees the flag and wakes.
        let word = seq.load(Ordering::Acquire);
        if let Some(r) = ready(Ordering::Acquire) {
            seq.set_waiting(false);
            track.gauge.record(start.elapsed());
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
        let slice = remaining.min(SLICE);
        seq.park(word as u32, slice);
        // The slice ran out with no post: look at the peer before touching the mapping
        // again, so that a region truncated while we slept (even below its first page)
        // is `RegionTooSmall` here, not a SIGBUS at the flag store below. A post's wake
        // goes straight on, for the price of one clock read.
        let slept_out = now.elapsed() >= slice;
        if slept_out {
            if let Err(e) = check_peer() {
                if !matches!(e, Error::RegionTooSmall { .. }) {
                    seq.set_waiting(false);
                }
                return Err(e);
            }
        }
        seq.set_waiting(false);
        if let Some(r) = ready(Ordering::Acquire) {
            track.gauge.record(start.elapsed());
            return Ok(r);
        }
        if !slept_out {
            check_peer()?;
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A counter alone, for a spin that never sleeps.
    struct Counter(AtomicU64);

    impl SeqWord for Counter {
        fn load(&self, order: Ordering) -> u64 {
            self.0.load(order)
        }
        fn set_waiting(&self, _: bool) {}
        fn park(&self, _: u32, _: Duration) {}
    }

    #[test]
    fn a_brief_spin_sees_the_counter_or_gives_up_within_one_budget() {
        let c = Counter(AtomicU64::new(5));
        let mut started = None;
        // There already: seen at the first look, without a clock read.
        assert_eq!(spin_briefly(&c, 5, Duration::ZERO, &mut started), Some(5));
        assert_eq!(
            spin_briefly(&c, 3, Duration::from_secs(30), &mut started),
            Some(5)
        );
        assert_eq!(started, None);
        // Not there and no budget: one look.
        assert_eq!(spin_briefly(&c, 6, Duration::ZERO, &mut started), None);
        assert_eq!(started, None);
        // Never raised: the spin gives up (its budget spent, or the machine busy).
        assert_eq!(
            spin_briefly(&c, 6, Duration::from_micros(50), &mut started),
            None
        );
        // A budget shared by several words: once spent, the next gives up too.
        if let Some(t) = started {
            assert_eq!(
                spin_briefly(&c, 6, Duration::from_micros(50), &mut started),
                None
            );
            assert_eq!(started, Some(t), "the budget's clock was restarted");
        }
        // Raised by another thread: a spin sees it (each try spins at most 30 s; on a busy
        // machine a try may give up at once, and the next looks again).
        std::thread::scope(|s| {
            s.spawn(|| c.0.store(6, Ordering::Release));
            let seen = loop {
                if let Some(v) = spin_briefly(&c, 6, Duration::from_secs(30), &mut None) {
                    break v;
                }
            };
            assert_eq!(seen, 6);
        });
    }

    /// The host-side bound of a drain that may never finish (a CUDA stream waiting on a
    /// semaphore nobody signals): never done, it ends with `Timeout` once the timeout
    /// passed (0 here: after one poll); with no timeout, a failing check (the engine
    /// died) ends it at the first sleep, after the 64 polls that only yield; done on the
    /// third poll, it ends then; an error polling ends it.
    #[test]
    fn a_polled_wait_is_bounded_by_its_timeout_and_its_check() {
        use std::cell::Cell;
        let (polls, checks) = (Cell::new(0), Cell::new(0));
        let never = || {
            polls.set(polls.get() + 1);
            Ok(false)
        };
        let fine = || {
            checks.set(checks.get() + 1);
            Ok(())
        };
        let r = poll_until(Duration::ZERO, "a stream", never, &fine);
        assert!(
            matches!(
                r,
                Err(Error::Timeout {
                    what: "a stream",
                    ..
                })
            ),
            "{r:?}"
        );
        assert_eq!((polls.get(), checks.get()), (1, 0));
        let dead = || {
            Err(Error::PeerDied {
                peer: crate::error::Peer::Engine,
                pid: 7,
                pid_ns: crate::error::PidNamespace::This,
                hint: "",
            })
        };
        polls.set(0);
        let r = poll_until(Duration::MAX, "a stream", never, &dead);
        assert!(matches!(r, Err(Error::PeerDied { pid: 7, .. })), "{r:?}");
        assert_eq!(polls.get(), 64);
        polls.set(0);
        let third = || {
            polls.set(polls.get() + 1);
            Ok(polls.get() == 3)
        };
        poll_until(Duration::MAX, "a stream", third, &fine).unwrap();
        assert_eq!(polls.get(), 3);
        let failing = || {
            Err(Error::Cuda {
                call: "cuStreamQuery",
                detail: "x".into(),
            })
        };
        let r = poll_until(Duration::MAX, "a stream", failing, &fine);
        assert!(matches!(r, Err(Error::Cuda { .. })), "{r:?}");
    }

    fn settled(waits: Duration) -> SpinGauge {
        let mut g = SpinGauge::default();
        for _ in 0..200 {
            g.record(waits);
        }
        g
    }

    #[test]
    fn the_default_budget_grows_to_cover_waits_up_to_half_its_cap() {
        let policy = WaitPolicy::default();
        assert_eq!(
            SpinGauge::default().budget(policy),
            WaitPolicy::DEFAULT_SPIN
        );
        // Waits answered at once, or within half the base budget: the base budget.
        assert_eq!(
            settled(Duration::ZERO).budget(policy),
            WaitPolicy::DEFAULT_SPIN
        );
        assert_eq!(
            settled(Duration::from_micros(40)).budget(policy),
            WaitPolicy::DEFAULT_SPIN
        );
        // Waits of 150 µs (a CartPole shard of 16 envs): about twice that.
        let b = settled(Duration::from_micros(150)).budget(policy);
        assert!(
            b >= Duration::from_micros(290) && b <= Duration::from_micros(300),
            "{b:?}"
        );
        // Waits of 1 ms: 2 ms, the cap.
        let b = settled(Duration::from_millis(1)).budget(policy);
        assert!(
            b > Duration::from_micros(1900) && b <= WaitPolicy::DEFAULT_SPIN_UP_TO,
            "{b:?}"
        );
        // Waits longer than half the cap: the peer is slow, a wake-up is cheap beside
        // its step: back to the base budget.
        assert_eq!(
            settled(Duration::from_millis(3)).budget(policy),
            WaitPolicy::DEFAULT_SPIN
        );
    }

    #[test]
    fn a_given_or_blocking_policy_keeps_its_budget() {
        let g = settled(Duration::from_micros(500));
        let given = WaitPolicy::spinning(Duration::from_micros(100));
        assert_ne!(given, WaitPolicy::default());
        assert_eq!(g.budget(given), Duration::from_micros(100));
        assert_eq!(g.budget(WaitPolicy::BLOCKING), Duration::ZERO);
    }

    #[test]
    fn one_long_wait_moves_the_budget_by_a_bounded_step() {
        let policy = WaitPolicy::default();
        let mut g = settled(Duration::from_micros(150));
        let before = g.budget(policy);
        g.record(Duration::from_secs(60)); // one wait for a learner busy elsewhere
        let after = g.budget(policy);
        // The sample is capped at 4x the largest budget: the average moves by at most
        // an eighth of that (1 ms), so the budget falls back to the base one for a few
        // waits, then comes back.
        assert_eq!(after, WaitPolicy::DEFAULT_SPIN);
        for _ in 0..40 {
            g.record(Duration::from_micros(150));
        }
        let back = g.budget(policy);
        assert!(
            back >= before && back <= before + before / 25,
            "{before:?} {back:?}"
        );
    }

    #[test]
    fn waits_answered_at_once_bring_the_budget_back_to_the_base_one() {
        let policy = WaitPolicy::default();
        let mut g = settled(Duration::from_micros(500));
        assert_eq!(g.budget(policy), Duration::from_micros(1000));
        for _ in 0..400 {
            g.record_at_once();
        }
        assert_eq!(g, SpinGauge::default(), "the average reaches zero");
        assert_eq!(g.budget(policy), WaitPolicy::DEFAULT_SPIN);
    }
}
