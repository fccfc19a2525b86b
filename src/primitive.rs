//! The atomic operations, fences and futex calls of the synchronisation code ([`sync`],
//! [`ring`]), in one place, so that a `cfg(loom)` build (the `loom` feature) hands every one
//! of them to the model checker.
//!
//! The control words are `&AtomicU64`/`&AtomicU32` references into a shared mapping, and a
//! counter's futex word is its own low half (the same address, 4 bytes). Loom's atomics
//! cannot be laid over raw bytes, so what a loom build swaps is not the types but the
//! operations on them. Normally each function here *is* the std operation or the system
//! call (inlined: a release build is the same machine code). Under `cfg(loom)` each one
//! finds, by address, the loom atomic that stands for the word in the current execution
//! (see `model`), the fence is loom's, and the futex is modelled with loom's mutex and
//! condvar, keyed by address as the kernel's is: a wait on a counter's low half compares
//! the low 32 bits of the counter's loom atomic.
//!
//! [`sync`]: crate::sync
//! [`ring`]: crate::ring

pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use crate::os::{core_free, futex_wait, futex_wake_all};
#[cfg(loom)]
pub(crate) use loom::sync::atomic::fence;
#[cfg(loom)]
pub(crate) use model::{core_free, futex_wait, futex_wake_all};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::fence;

/// An atomic control word, as the synchronisation code loads, stores and bumps it.
pub(crate) trait Word {
    type Value: Copy;
    fn load_word(&self, order: Ordering) -> Self::Value;
    fn store_word(&self, value: Self::Value, order: Ordering);
    fn fetch_add_word(&self, value: Self::Value, order: Ordering) -> Self::Value;
    fn compare_exchange_word(
        &self,
        current: Self::Value,
        new: Self::Value,
        success: Ordering,
        failure: Ordering,
    ) -> Result<Self::Value, Self::Value>;
}

macro_rules! word {
    ($atomic:ty, $value:ty, $kind:ident) => {
        impl Word for $atomic {
            type Value = $value;
            #[cfg(not(loom))]
            #[inline(always)]
            fn load_word(&self, order: Ordering) -> $value {
                self.load(order)
            }
            #[cfg(not(loom))]
            #[inline(always)]
            fn store_word(&self, value: $value, order: Ordering) {
                self.store(value, order)
            }
            #[cfg(not(loom))]
            #[inline(always)]
            fn fetch_add_word(&self, value: $value, order: Ordering) -> $value {
                self.fetch_add(value, order)
            }
            #[cfg(not(loom))]
            #[inline(always)]
            fn compare_exchange_word(
                &self,
                current: $value,
                new: $value,
                success: Ordering,
                failure: Ordering,
            ) -> Result<$value, $value> {
                self.compare_exchange(current, new, success, failure)
            }
            #[cfg(loom)]
            fn compare_exchange_word(
                &self,
                current: $value,
                new: $value,
                success: Ordering,
                failure: Ordering,
            ) -> Result<$value, $value> {
                model::word(self.as_ptr() as usize)
                    .$kind()
                    .compare_exchange(current, new, success, failure)
            }
            #[cfg(loom)]
            fn load_word(&self, order: Ordering) -> $value {
                model::word(self.as_ptr() as usize).$kind().load(order)
            }
            #[cfg(loom)]
            fn store_word(&self, value: $value, order: Ordering) {
                model::word(self.as_ptr() as usize)
                    .$kind()
                    .store(value, order)
            }
            #[cfg(loom)]
            fn fetch_add_word(&self, value: $value, order: Ordering) -> $value {
                model::word(self.as_ptr() as usize)
                    .$kind()
                    .fetch_add(value, order)
            }
        }
    };
}

word!(AtomicU64, u64, u64);
word!(AtomicU32, u32, u32);

#[inline(always)]
pub(crate) fn load<W: Word>(word: &W, order: Ordering) -> W::Value {
    word.load_word(order)
}

#[inline(always)]
pub(crate) fn store<W: Word>(word: &W, value: W::Value, order: Ordering) {
    word.store_word(value, order)
}

/// A compare-and-swap: `Ok(previous)` if the word held `current` and now holds `new`,
/// else `Err(what it holds)`.
#[inline(always)]
pub(crate) fn compare_exchange<W: Word>(
    word: &W,
    current: W::Value,
    new: W::Value,
    success: Ordering,
    failure: Ordering,
) -> Result<W::Value, W::Value> {
    word.compare_exchange_word(current, new, success, failure)
}

#[inline(always)]
pub(crate) fn fetch_add<W: Word>(word: &W, value: W::Value, order: Ordering) -> W::Value {
    word.fetch_add_word(value, order)
}

/// `len` bytes of plain shared memory (a ring's data area) from `start` are about to be
/// read. Nothing to do but under `cfg(loom)`, where each byte is a loom cell: a read of
/// bytes whose last write does not happen before it fails the model.
#[inline(always)]
pub(crate) fn reading(start: *const u8, len: usize) {
    #[cfg(loom)]
    model::bytes(start, len, false);
    #[cfg(not(loom))]
    let _ = (start, len);
}

/// `len` bytes of a ring's data area from `start` are about to be written (see
/// [`reading`]).
#[inline(always)]
pub(crate) fn writing(start: *const u8, len: usize) {
    #[cfg(loom)]
    model::bytes(start, len, true);
    #[cfg(not(loom))]
    let _ = (start, len);
}

#[cfg(loom)]
pub(crate) mod model {
    //! The loom stand-ins, one set per execution. A model allocates its control words and
    //! ring as the real code does (std atomics, a heap ring), then, before spawning, tells
    //! this table about them ([`track_u64`], [`track_u32`], [`track_bytes`]); from then on
    //! every operation of `primitive` on them is loom's. An operation on a word the model
    //! did not track panics, as does a Rust load of a counter's low half (the real code
    //! hands the low half only to the futex).

    use std::collections::HashMap;
    use std::sync::Arc;
    use std::time::Duration;

    use loom::cell::UnsafeCell;
    use loom::sync::atomic::{AtomicU32, AtomicU64};
    use loom::sync::{Condvar, Mutex};

    use super::Ordering;

    enum Atomic {
        U64(AtomicU64),
        U32(AtomicU32),
    }

    /// One tracked word and its futex wait queue.
    pub(super) struct Slot {
        atomic: Atomic,
        /// The kernel's hash-bucket lock: taken by a waiter to compare the word and
        /// enqueue, and by a waker.
        queue: Mutex<()>,
        wake: Condvar,
    }

    #[derive(Default)]
    struct Table {
        // Plain std mutexes: loom runs one thread at a time and none is held across a
        // loom operation, so they are never contended and add no interleavings.
        words: std::sync::Mutex<HashMap<usize, Arc<Slot>>>,
        bytes: std::sync::Mutex<HashMap<usize, Arc<UnsafeCell<()>>>>,
        slices_expire: std::sync::atomic::AtomicBool,
    }

    loom::lazy_static! {
        static ref TABLE: Table = Table::default();
    }

    fn insert(addr: usize, atomic: Atomic) {
        let slot = Slot {
            atomic,
            queue: Mutex::new(()),
            wake: Condvar::new(),
        };
        let old = TABLE.words.lock().unwrap().insert(addr, Arc::new(slot));
        assert!(old.is_none(), "word at {addr:#x} tracked twice");
    }

    /// Tracks a 64-bit word, with its current value. Its low half is then its futex word.
    pub(crate) fn track_u64(word: &std::sync::atomic::AtomicU64) {
        let value = word.load(Ordering::Relaxed);
        insert(word.as_ptr() as usize, Atomic::U64(AtomicU64::new(value)));
    }

    /// Tracks a 32-bit word (a waiter flag, the doorbell), with its current value.
    pub(crate) fn track_u32(word: &std::sync::atomic::AtomicU32) {
        let value = word.load(Ordering::Relaxed);
        insert(word.as_ptr() as usize, Atomic::U32(AtomicU32::new(value)));
    }

    /// Tracks `len` bytes from `start` (a ring's data area), one loom cell per byte.
    pub(crate) fn track_bytes(start: *const u8, len: usize) {
        let mut bytes = TABLE.bytes.lock().unwrap();
        for addr in start as usize..start as usize + len {
            bytes.insert(addr, Arc::new(UnsafeCell::new(())));
        }
    }

    /// From now on in this execution, a futex wait that would sleep returns after the other
    /// threads have run instead, as when its slice runs out. For models of the liveness
    /// checks between slices; the others keep sleeps unbounded, so that a lost wake-up is
    /// a deadlock loom reports.
    pub(crate) fn let_slices_expire() {
        TABLE.slices_expire.store(true, Ordering::Relaxed);
    }

    /// The tracked word at `addr`.
    pub(super) fn word(addr: usize) -> Arc<Slot> {
        let slot = TABLE.words.lock().unwrap().get(&addr).cloned();
        slot.unwrap_or_else(|| panic!("word at {addr:#x} is not tracked by the model"))
    }

    impl Slot {
        pub(super) fn u64(&self) -> &AtomicU64 {
            match &self.atomic {
                Atomic::U64(a) => a,
                Atomic::U32(_) => panic!("a 64-bit access to a 32-bit word"),
            }
        }
        pub(super) fn u32(&self) -> &AtomicU32 {
            match &self.atomic {
                Atomic::U32(a) => a,
                Atomic::U64(_) => panic!("a 32-bit Rust access to half of a 64-bit word"),
            }
        }
    }

    /// The modelled `FUTEX_WAIT`: sleeps while the 32 bits at `word`'s address equal
    /// `expected` (the low half, for a 64-bit counter), until a wake on that address.
    /// Spurious returns are allowed by the real one; the callers re-check, so none are
    /// modelled.
    pub(crate) fn futex_wait(word: &std::sync::atomic::AtomicU32, expected: u32, _: Duration) {
        let slot = self::word(word.as_ptr() as usize);
        let queue = slot.queue.lock().unwrap();
        // The kernel reads the word after a full barrier, under the bucket lock.
        let now = match &slot.atomic {
            Atomic::U64(a) => a.load(Ordering::SeqCst) as u32,
            Atomic::U32(a) => a.load(Ordering::SeqCst),
        };
        if now != expected {
            return;
        }
        if TABLE.slices_expire.load(Ordering::Relaxed) {
            drop(queue);
            loom::thread::yield_now();
            return;
        }
        drop(slot.wake.wait(queue).unwrap());
    }

    /// The modelled `FUTEX_WAKE` of every waiter on `word`'s address.
    /// The models wait with the blocking policy: they never spin, so they never ask.
    pub(crate) fn core_free() -> bool {
        true
    }

    pub(crate) fn futex_wake_all(word: &std::sync::atomic::AtomicU32) {
        let slot = self::word(word.as_ptr() as usize);
        let _queue = slot.queue.lock().unwrap();
        slot.wake.notify_all();
    }

    pub(super) fn bytes(start: *const u8, len: usize, write: bool) {
        for addr in start as usize..start as usize + len {
            let cell = TABLE.bytes.lock().unwrap().get(&addr).cloned();
            let cell =
                cell.unwrap_or_else(|| panic!("byte at {addr:#x} is not tracked by the model"));
            if write {
                cell.with_mut(|_| ());
            } else {
                cell.with(|_| ());
            }
        }
    }

    /// [`check`] with at most `bound` preemptions per execution (fewer if
    /// `LOOM_MAX_PREEMPTIONS` says so): for a model of three busy threads, whose every
    /// interleaving at the usual bound takes minutes.
    #[cfg(test)]
    pub(crate) fn check_bounded(name: &str, bound: usize, f: impl Fn() + Sync + Send + 'static) {
        use std::sync::atomic::AtomicUsize;
        let runs = Arc::new(AtomicUsize::new(0));
        let start = std::time::Instant::now();
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(builder.preemption_bound.map_or(bound, |b| b.min(bound)));
        {
            let runs = runs.clone();
            builder.check(move || {
                runs.fetch_add(1, Ordering::Relaxed);
                f();
            });
        }
        eprintln!(
            "loom model {name} (at most {bound} preemptions): {} interleavings in {:.2} s",
            runs.load(Ordering::Relaxed),
            start.elapsed().as_secs_f64()
        );
    }

    /// Runs `f` under every interleaving loom explores, and prints how many there were and
    /// how long they took.
    #[cfg(test)]
    pub(crate) fn check(name: &str, f: impl Fn() + Sync + Send + 'static) {
        use std::sync::atomic::AtomicUsize;
        let runs = Arc::new(AtomicUsize::new(0));
        let start = std::time::Instant::now();
        {
            let runs = runs.clone();
            loom::model(move || {
                runs.fetch_add(1, Ordering::Relaxed);
                f();
            });
        }
        eprintln!(
            "loom model {name}: {} interleavings in {:.2} s",
            runs.load(Ordering::Relaxed),
            start.elapsed().as_secs_f64()
        );
    }
}

/// The low 32 bits of a counter, as the futex word for it.
pub(crate) fn low_half(word: &AtomicU64) -> &AtomicU32 {
    // SAFETY: an AtomicU64 is 8 bytes, 8-aligned, so its first 4 bytes are a valid,
    // aligned AtomicU32 for as long as the borrow; on little-endian targets (the only ones
    // the crate builds for) they are the low half. The result is only handed to the
    // kernel's futex calls (`SharedSeq::park`/`unpark`), never loaded from Rust, so Rust
    // code makes no mixed-size accesses; the kernel reads the word atomically.
    unsafe { &*(word as *const AtomicU64).cast::<AtomicU32>() }
}
