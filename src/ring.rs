//! A single-producer, single-consumer byte ring in shared memory: the transport of the
//! command channel (docs/protocol.md §6). Each direction has its own ring.
//!
//! Control words: `head` counts the bytes the producer has ever published, `tail` the bytes
//! the consumer has ever consumed; both only grow, both are multiples of 8, and
//! `0 <= head - tail <= capacity`. The byte at counter value `c` lives at data offset
//! `c mod capacity`. Records are `[u32 little-endian length L][L bytes][zero padding to a
//! multiple of 8]`, so one occupies [`record_size`]`(L)` bytes; because every record
//! starts at a multiple of 8 and the capacity is a multiple of 8, the length word never
//! straddles the end of the buffer, while the payload may wrap around it.
//!
//! Publishing and waiting reuse [`sync::post`] and [`sync::wait_for`]: the producer posts
//! `head` (the consumer sleeps on its low 32 bits), the consumer posts `tail` (a producer
//! facing a full ring sleeps on its low 32 bits). The data copies are ordered by the
//! Release store of one counter and the Acquire load of it on the other side.
//!
//! The reader never trusts the peer: the counters and every length word are validated
//! before a byte is read, and no index ever leaves `data[0..capacity]`; a bad state is an
//! [`Error::Protocol`] naming the peer, never a panic.

use std::cell::UnsafeCell;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use crate::error::{Error, Peer, Result};
use crate::primitive::{self, low_half, AtomicU32, AtomicU64, Ordering};
use crate::sync::{self, SharedSeq, WaitPolicy};

/// Bytes of the length word that starts every record.
pub const LEN_BYTES: u64 = 4;
/// Records start at counter values that are multiples of this.
pub const RECORD_ALIGN: u64 = 8;
/// Smallest ring capacity.
pub const MIN_CAPACITY: u64 = 64;
/// Alignment of a ring's data area.
pub const DATA_ALIGN: usize = 64;

/// What a producer waits for when the ring is full (for [`Error::Timeout`]).
const WHAT_SPACE: &str = "space in the command ring";
/// What a consumer waits for when the ring is empty (for [`Error::Timeout`]).
const WHAT_MESSAGE: &str = "a command-channel message";

/// Bytes a record with an `len`-byte payload occupies in a ring: `round_up(4 + len, 8)`.
#[inline]
pub const fn record_size(len: u32) -> u64 {
    (LEN_BYTES + len as u64 + (RECORD_ALIGN - 1)) & !(RECORD_ALIGN - 1)
}

/// The control words of one ring, each on its own cache line in the region's control block.
#[derive(Debug, Clone, Copy)]
pub struct RingCtrl<'a> {
    /// Total bytes ever published by the producer (monotonic, multiple of 8).
    pub head: &'a AtomicU64,
    /// Total bytes ever consumed by the consumer (monotonic, multiple of 8).
    pub tail: &'a AtomicU64,
    /// Low 32 bits of `head` (its first 4 bytes): the futex word the consumer sleeps on.
    pub head_low: &'a AtomicU32,
    /// Low 32 bits of `tail`: the futex word the producer sleeps on when the ring is full.
    pub tail_low: &'a AtomicU32,
    /// 1 while the consumer sleeps.
    pub consumer_waiting: &'a AtomicU32,
    /// 1 while the producer sleeps.
    pub producer_waiting: &'a AtomicU32,
}

/// One side's view of a ring. Either side may hold one; the producer calls the push
/// methods, the consumer the pop methods.
pub struct Ring<'a> {
    ctrl: RingCtrl<'a>,
    data: *mut u8,
    capacity: u64,
    /// Who pushes into this ring: the peer blamed for a corrupt record or head; the other
    /// side is blamed for a corrupt tail.
    producer: Peer,
    /// In-process exclusion of the two roles, for rings whose memory this process owns
    /// ([`HeapRing`]); `None` for rings in a region, where [`Ring::new`]'s contract holds.
    roles: Option<&'a Roles>,
}

// SAFETY: a `Ring` is a set of shared references to atomics (which are `Sync`) and a raw
// pointer to memory that is valid for `'a` and is only touched by raw-pointer copies that
// follow the SPSC protocol, whichever thread makes them: moving the handle to another
// thread changes nothing about who may push or pop (that is `Ring::new`'s contract, or
// enforced by the role locks of a `HeapRing`). It is deliberately not `Sync`: sharing one
// handle between threads is the easy way to get two producers.
unsafe impl Send for Ring<'_> {}

impl std::fmt::Debug for Ring<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("producer", &self.producer)
            .field("capacity", &self.capacity)
            .field("head", &primitive::load(self.ctrl.head, Ordering::Relaxed))
            .field("tail", &primitive::load(self.ctrl.tail, Ordering::Relaxed))
            .finish()
    }
}

/// What one attempt to push found.
enum Pushed {
    Done,
    /// Not enough free space: wait until the tail reaches this.
    Full {
        tail_target: u64,
    },
}

/// What one attempt to pop found.
enum Popped {
    Done,
    /// Nothing published: wait until the head passes this tail.
    Empty {
        tail: u64,
    },
}

/// Checks the capacity rules shared by [`Ring::new`] and [`HeapRing::new`].
fn check_capacity(capacity: u64) -> Result<()> {
    // A power of two ≥ 64 is a multiple of 8 (and of 64). The bound keeps every offset
    // and `2 * capacity` inside `usize`/`isize` for pointer arithmetic.
    if !capacity.is_power_of_two() || capacity < MIN_CAPACITY || capacity > isize::MAX as u64 / 2 {
        return Err(Error::InvalidHeader {
            field: "ring capacity",
            reason: format!(
                "{capacity} is not a power of two between {MIN_CAPACITY} and {}",
                isize::MAX as u64 / 2 + 1
            ),
        });
    }
    Ok(())
}

fn other(peer: Peer) -> Peer {
    match peer {
        Peer::Engine => Peer::Client,
        Peer::Client => Peer::Engine,
    }
}

impl<'a> Ring<'a> {
    /// A ring over `capacity` bytes at `data`, into which `producer` pushes.
    ///
    /// Checks that `capacity` is a power of two ≥ 64, that `data` is non-null and 64-byte
    /// aligned, and that `head_low`/`tail_low` are the first four bytes of `head`/`tail`
    /// (little-endian: their low halves); otherwise [`Error::InvalidHeader`].
    ///
    /// # Safety
    ///
    /// `data` points to `capacity` bytes of a live shared mapping that outlives `'a`, only
    /// accessed through rings. Within this process, at most one thread at a time pushes
    /// and at most one pops, over all `Ring` values built on these control words and data.
    /// (The peer process may write anything at any time: the ring validates what it reads
    /// and only touches the data area through raw-pointer copies.)
    pub unsafe fn new(
        ctrl: RingCtrl<'a>,
        data: *mut u8,
        capacity: u64,
        producer: Peer,
    ) -> Result<Ring<'a>> {
        check_capacity(capacity)?;
        if data.is_null() || (data as usize) % DATA_ALIGN != 0 {
            return Err(Error::InvalidHeader {
                field: "ring data offset",
                reason: format!("ring data at {data:p} is not {DATA_ALIGN}-byte aligned"),
            });
        }
        let low_of = |word: &AtomicU64, low: &AtomicU32| {
            std::ptr::eq(word.as_ptr().cast::<u8>(), low.as_ptr().cast::<u8>())
        };
        if !low_of(ctrl.head, ctrl.head_low) || !low_of(ctrl.tail, ctrl.tail_low) {
            return Err(Error::InvalidHeader {
                field: "ring control words",
                reason: "head_low/tail_low must be the low halves of head/tail".to_string(),
            });
        }
        Ok(Ring {
            ctrl,
            data,
            capacity,
            producer,
            roles: None,
        })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Who pushes into this ring.
    pub fn producer(&self) -> Peer {
        self.producer
    }

    /// Largest record payload that fits: `capacity - 4` (a 4-byte length word, then the
    /// payload, padded to 8: `round_up(4 + L, 8) <= capacity`), at most `u32::MAX`.
    pub fn max_record(&self) -> u64 {
        (self.capacity - LEN_BYTES).min(u32::MAX as u64)
    }

    /// Bytes published and not yet consumed (at most the capacity, whatever a peer wrote
    /// into the counters).
    pub fn queued(&self) -> u64 {
        let head = primitive::load(self.ctrl.head, Ordering::Acquire);
        let tail = primitive::load(self.ctrl.tail, Ordering::Acquire);
        head.wrapping_sub(tail).min(self.capacity)
    }

    /// Whether nothing is published and unconsumed.
    pub fn is_empty(&self) -> bool {
        primitive::load(self.ctrl.head, Ordering::Acquire)
            == primitive::load(self.ctrl.tail, Ordering::Acquire)
    }

    // ----- producer side -----

    /// Pushes one record if there is room for it now: `Ok(false)` if not (nothing is
    /// written). [`Error::RecordTooLarge`] if it could never fit.
    pub fn try_push(&self, record: &[u8]) -> Result<bool> {
        let size = self.size_of(record)?;
        Ok(matches!(self.push_once(record, size)?, Pushed::Done))
    }

    /// Pushes one record, waiting up to `timeout` for room; [`Error::Timeout`] after that.
    /// `check_peer` runs as in [`sync::wait_for`] (before sleeping, between slices).
    pub fn push(
        &self,
        record: &[u8],
        policy: WaitPolicy,
        timeout: Duration,
        mut check_peer: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        let size = self.size_of(record)?;
        let mut deadline = Deadline::new(timeout);
        loop {
            let target = match self.push_once(record, size)? {
                Pushed::Done => return Ok(()),
                Pushed::Full { tail_target } => tail_target,
            };
            let seq = self.tail_seq();
            let remaining = deadline.remaining();
            match sync::wait_for(&seq, target, policy, remaining, WHAT_SPACE, &mut check_peer) {
                Ok(_) => {}
                Err(e) => return Err(deadline.full_timeout(e)),
            }
        }
    }

    /// The bytes a record takes, or [`Error::RecordTooLarge`].
    fn size_of(&self, record: &[u8]) -> Result<u64> {
        let too_large = || Error::RecordTooLarge {
            len: record.len() as u64,
            capacity: self.capacity,
        };
        let len = u32::try_from(record.len()).map_err(|_| too_large())?;
        let size = record_size(len);
        if size > self.capacity {
            return Err(too_large());
        }
        Ok(size)
    }

    /// One attempt: validate the counters, write the record if it fits, publish it.
    fn push_once(&self, record: &[u8], size: u64) -> Result<Pushed> {
        let _role = RoleGuard::take(self.roles.map(|r| &r.push));
        // Own counter: no other writer (in-process ones are ordered by the role lock).
        let head = primitive::load(self.ctrl.head, Ordering::Relaxed);
        // Acquire: the consumer's copies out of the space it freed happen before our writes.
        let tail = primitive::load(self.ctrl.tail, Ordering::Acquire);
        let used = self.check_counters(head, tail, other(self.producer))?;
        let end = head.checked_add(size).ok_or_else(|| Error::Protocol {
            peer: other(self.producer),
            detail: format!("{}: head {head} is about to overflow", self.name()),
        })?;
        if self.capacity - used < size {
            // `used + size > capacity`, so `end > capacity + tail >= capacity`.
            return Ok(Pushed::Full {
                tail_target: end - self.capacity,
            });
        }
        let cap = self.capacity as usize;
        let pos = (head & (self.capacity - 1)) as usize;
        let len = record.len();
        let len_word = (len as u32).to_le_bytes();
        let pad = size as usize - LEN_BYTES as usize - len;
        // SAFETY: `pos` is `head mod capacity` with head (checked) and capacity multiples
        // of 8, so `pos <= capacity - 8` and the 4-byte word lies inside the data area.
        // The `size` bytes from `pos` (wrapping) are free space: `size <= capacity - used`,
        // and the consumer does not read past `head` until we publish below.
        unsafe {
            primitive::writing(self.data.add(pos), len_word.len());
            std::ptr::copy_nonoverlapping(len_word.as_ptr(), self.data.add(pos), len_word.len());
        }
        // SAFETY: `pos + 4 < capacity` (above) and `len + pad <= size <= capacity`, the
        // preconditions of `copy_in`/`zero`; `(pos + 4 + len) % capacity < capacity`.
        unsafe {
            self.copy_in(pos + LEN_BYTES as usize, record.as_ptr(), len);
            self.zero((pos + LEN_BYTES as usize + len) & (cap - 1), pad);
        }
        sync::post(&self.head_seq(), end);
        Ok(Pushed::Done)
    }

    // ----- consumer side -----

    /// Pops one record into `out` (cleared, then filled with the payload) if one is
    /// published: `Ok(false)` if the ring is empty. [`Error::Protocol`] if the ring's state
    /// is corrupt; nothing is consumed then. `out` is left as it was unless a record is
    /// popped.
    pub fn try_pop(&self, out: &mut Vec<u8>) -> Result<bool> {
        Ok(matches!(self.pop_once(out)?, Popped::Done))
    }

    /// Pops one record into `out`, waiting up to `timeout` for one; [`Error::Timeout`]
    /// after that. `check_peer` runs as in [`sync::wait_for`].
    pub fn pop(
        &self,
        out: &mut Vec<u8>,
        policy: WaitPolicy,
        timeout: Duration,
        mut check_peer: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        let mut deadline = Deadline::new(timeout);
        loop {
            let target = match self.pop_once(out)? {
                Popped::Done => return Ok(()),
                Popped::Empty { tail } => {
                    tail.checked_add(RECORD_ALIGN)
                        .ok_or_else(|| Error::Protocol {
                            peer: self.producer,
                            detail: format!("{}: tail {tail} is about to overflow", self.name()),
                        })?
                }
            };
            let seq = self.head_seq();
            let remaining = deadline.remaining();
            match sync::wait_for(
                &seq,
                target,
                policy,
                remaining,
                WHAT_MESSAGE,
                &mut check_peer,
            ) {
                Ok(_) => {}
                Err(e) => return Err(deadline.full_timeout(e)),
            }
        }
    }

    /// One attempt: validate the counters and the length word, copy the record out, free
    /// its space.
    fn pop_once(&self, out: &mut Vec<u8>) -> Result<Popped> {
        let _role = RoleGuard::take(self.roles.map(|r| &r.pop));
        // Acquire: the producer's writes of everything up to `head` happen before our reads.
        let head = primitive::load(self.ctrl.head, Ordering::Acquire);
        // Own counter.
        let tail = primitive::load(self.ctrl.tail, Ordering::Relaxed);
        let avail = self.check_counters(head, tail, self.producer)?;
        if avail == 0 {
            return Ok(Popped::Empty { tail });
        }
        let pos = (tail & (self.capacity - 1)) as usize;
        let mut len_word = [0u8; LEN_BYTES as usize];
        // SAFETY: `pos` is `tail mod capacity` with tail (checked) and capacity multiples
        // of 8, so `pos <= capacity - 8` and the 4 bytes lie inside the data area.
        unsafe {
            primitive::reading(self.data.add(pos), len_word.len());
            std::ptr::copy_nonoverlapping(
                self.data.add(pos),
                len_word.as_mut_ptr(),
                len_word.len(),
            );
        }
        let len = u32::from_le_bytes(len_word);
        let size = record_size(len);
        if size > self.capacity || size > avail {
            return Err(Error::Protocol {
                peer: self.producer,
                detail: format!(
                    "{}: corrupt record length {len} at tail {tail}: the record needs {size} \
                     bytes, {avail} are published, capacity {}",
                    self.name(),
                    self.capacity
                ),
            });
        }
        // `len < size <= capacity`, which fits `usize` (check_capacity).
        let len = len as usize;
        out.clear();
        out.reserve(len);
        // SAFETY: `pos + 4 < capacity` and `len <= capacity` (checked above), the
        // preconditions of `copy_out`; the record's bytes are published (`size <= avail`,
        // ordered by the Acquire load of head). `out` has room for `len` bytes after
        // `reserve`, and `copy_out` initialises all of them before `set_len`.
        unsafe {
            self.copy_out(pos + LEN_BYTES as usize, out.as_mut_ptr(), len);
            out.set_len(len);
        }
        // `tail + size <= head`: no overflow. Release (in `post`): our reads happen before
        // the producer reuses this space.
        sync::post(&self.tail_seq(), tail + size);
        Ok(Popped::Done)
    }

    // ----- shared -----

    /// Validates a (head, tail) pair; returns `head - tail`. `blame` is the side that
    /// must have corrupted it (the other side's counters, as seen by this side).
    fn check_counters(&self, head: u64, tail: u64, blame: Peer) -> Result<u64> {
        let bad = |what: String| {
            Err(Error::Protocol {
                peer: blame,
                detail: format!("{}: {what}", self.name()),
            })
        };
        if head % RECORD_ALIGN != 0 || tail % RECORD_ALIGN != 0 {
            return bad(format!(
                "counters not multiples of {RECORD_ALIGN} (head {head}, tail {tail})"
            ));
        }
        let Some(used) = head.checked_sub(tail) else {
            return bad(format!("head {head} is behind tail {tail}"));
        };
        if used > self.capacity {
            return bad(format!(
                "{used} bytes in flight (head {head}, tail {tail}), more than the capacity {}",
                self.capacity
            ));
        }
        Ok(used)
    }

    fn name(&self) -> &'static str {
        match self.producer {
            Peer::Client => "client-to-engine command ring",
            Peer::Engine => "engine-to-client command ring",
        }
    }

    /// The head counter, as the consumer waits on it and the producer posts it.
    fn head_seq(&self) -> SharedSeq<'a> {
        SharedSeq {
            counter: self.ctrl.head,
            low: self.ctrl.head_low,
            waiting: self.ctrl.consumer_waiting,
        }
    }

    /// The tail counter, as the producer waits on it and the consumer posts it.
    fn tail_seq(&self) -> SharedSeq<'a> {
        SharedSeq {
            counter: self.ctrl.tail,
            low: self.ctrl.tail_low,
            waiting: self.ctrl.producer_waiting,
        }
    }

    /// How `len` bytes from data offset `pos` split into the part before the end of the
    /// buffer and the part from its start.
    #[inline]
    fn split(&self, pos: usize, len: usize) -> (usize, usize) {
        let first = len.min(self.capacity as usize - pos);
        (first, len - first)
    }

    /// Copies `len` bytes from `src` into the data area from offset `pos`, wrapping.
    ///
    /// # Safety
    /// `pos < capacity`, `len <= capacity`, `src` readable for `len` bytes and not inside
    /// the data area, and the target bytes free space no one reads concurrently.
    unsafe fn copy_in(&self, pos: usize, src: *const u8, len: usize) {
        debug_assert!(pos < self.capacity as usize && len <= self.capacity as usize);
        let (first, second) = self.split(pos, len);
        // SAFETY: `pos + first <= capacity` and `second <= capacity`: both ranges lie in
        // the data area (the caller's contract); `src` is readable for `first + second`.
        unsafe {
            primitive::writing(self.data.add(pos), first);
            primitive::writing(self.data, second);
            std::ptr::copy_nonoverlapping(src, self.data.add(pos), first);
            std::ptr::copy_nonoverlapping(src.add(first), self.data, second);
        }
    }

    /// Zeroes `len` bytes of the data area from offset `pos`, wrapping.
    ///
    /// # Safety
    /// As for [`Ring::copy_in`].
    unsafe fn zero(&self, pos: usize, len: usize) {
        debug_assert!(pos < self.capacity as usize && len <= self.capacity as usize);
        let (first, second) = self.split(pos, len);
        // SAFETY: both ranges lie in the data area, as in `copy_in`.
        unsafe {
            primitive::writing(self.data.add(pos), first);
            primitive::writing(self.data, second);
            std::ptr::write_bytes(self.data.add(pos), 0, first);
            std::ptr::write_bytes(self.data, 0, second);
        }
    }

    /// Copies `len` bytes of the data area from offset `pos`, wrapping, to `dst`.
    ///
    /// # Safety
    /// `pos < capacity`, `len <= capacity`, `dst` writable for `len` bytes and not inside
    /// the data area, and the source bytes published to us.
    unsafe fn copy_out(&self, pos: usize, dst: *mut u8, len: usize) {
        debug_assert!(pos < self.capacity as usize && len <= self.capacity as usize);
        let (first, second) = self.split(pos, len);
        // SAFETY: both source ranges lie in the data area (the caller's contract); `dst`
        // is writable for `first + second` bytes.
        unsafe {
            primitive::reading(self.data.add(pos), first);
            primitive::reading(self.data, second);
            std::ptr::copy_nonoverlapping(self.data.add(pos), dst, first);
            std::ptr::copy_nonoverlapping(self.data, dst.add(first), second);
        }
    }
}

/// A `push`/`pop` deadline, with the clock read only once a wait is needed.
struct Deadline {
    timeout: Duration,
    /// `None`: not started; `Some(None)`: no deadline (`timeout` too large for `Instant`).
    at: Option<Option<Instant>>,
}

impl Deadline {
    fn new(timeout: Duration) -> Self {
        Deadline { timeout, at: None }
    }

    /// Time left for the next wait.
    fn remaining(&mut self) -> Duration {
        match *self
            .at
            .get_or_insert_with(|| Instant::now().checked_add(self.timeout))
        {
            None => self.timeout,
            Some(d) => d.saturating_duration_since(Instant::now()),
        }
    }

    /// A timeout reports the whole time waited, not the last slice of it.
    fn full_timeout(&self, e: Error) -> Error {
        match e {
            Error::Timeout { what, .. } => Error::Timeout {
                waited: self.timeout,
                what,
            },
            e => e,
        }
    }
}

/// In-process locks of a ring's producer and consumer roles.
#[derive(Debug, Default)]
struct Roles {
    push: AtomicBool,
    pop: AtomicBool,
}

/// Holds a role for one push or pop attempt (or nothing, for rings in a region).
struct RoleGuard<'a>(Option<&'a AtomicBool>);

impl<'a> RoleGuard<'a> {
    fn take(flag: Option<&'a AtomicBool>) -> Self {
        if let Some(flag) = flag {
            // Contended only when several threads share one role: they take turns.
            while flag
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                std::thread::yield_now();
            }
        }
        RoleGuard(flag)
    }
}

impl Drop for RoleGuard<'_> {
    fn drop(&mut self) {
        if let Some(flag) = self.0 {
            flag.store(false, Ordering::Release);
        }
    }
}

/// One control word on its own cache line.
#[repr(C, align(64))]
#[derive(Debug, Default)]
struct Line<T>(T);

/// 64 bytes of ring data, written through raw pointers from `&HeapRing`.
#[repr(C, align(64))]
struct Block(UnsafeCell<[u8; 64]>);

/// A ring in ordinary memory: control words and an aligned buffer, for tests, fuzzing and
/// benchmarks.
///
/// Any number of threads may share it and take [`Ring`]s from it: pushes (and pops) made
/// through them are serialised by in-process role locks, so a producer thread and a
/// consumer thread run concurrently, and two producers merely take turns.
pub struct HeapRing {
    head: Line<AtomicU64>,
    tail: Line<AtomicU64>,
    consumer_waiting: Line<AtomicU32>,
    producer_waiting: Line<AtomicU32>,
    roles: Roles,
    data: Box<[Block]>,
    capacity: u64,
}

// SAFETY: the control words are atomics. The data blocks are only accessed by raw-pointer
// copies in `Ring`'s push and pop attempts and in `set_raw`/`raw`, each under the role
// lock(s) it needs: a push writes only free space and a pop reads only published space,
// the two ordered by the head/tail Release stores and Acquire loads, so threads sharing a
// `HeapRing` never race on a byte.
unsafe impl Sync for HeapRing {}

impl std::fmt::Debug for HeapRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (head, tail) = self.counters();
        f.debug_struct("HeapRing")
            .field("capacity", &self.capacity)
            .field("head", &head)
            .field("tail", &tail)
            .finish()
    }
}

impl HeapRing {
    /// An empty ring of `capacity` bytes (a power of two ≥ 64), zero-filled.
    pub fn new(capacity: u64) -> Result<HeapRing> {
        check_capacity(capacity)?;
        let blocks = (capacity / DATA_ALIGN as u64) as usize;
        let mut data = Vec::new();
        data.try_reserve_exact(blocks).map_err(|_| {
            Error::io(
                format!("allocating a {capacity}-byte heap ring"),
                std::io::ErrorKind::OutOfMemory,
            )
        })?;
        data.extend((0..blocks).map(|_| Block(UnsafeCell::new([0; 64]))));
        Ok(HeapRing {
            head: Line::default(),
            tail: Line::default(),
            consumer_waiting: Line::default(),
            producer_waiting: Line::default(),
            roles: Roles::default(),
            data: data.into_boxed_slice(),
            capacity,
        })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// A handle on the ring; `producer` is the side pushing into it (named in errors).
    pub fn ring(&self, producer: Peer) -> Ring<'_> {
        Ring {
            ctrl: RingCtrl {
                head: &self.head.0,
                tail: &self.tail.0,
                head_low: low_half(&self.head.0),
                tail_low: low_half(&self.tail.0),
                consumer_waiting: &self.consumer_waiting.0,
                producer_waiting: &self.producer_waiting.0,
            },
            data: self.data_ptr(),
            // Checked by `new`.
            capacity: self.capacity,
            producer,
            roles: Some(&self.roles),
        }
    }

    /// Overwrite raw bytes and counters (fuzzing hostile states): the buffer becomes
    /// `data`, truncated or zero-filled to the capacity, and head and tail are set as
    /// given, valid or not. Waits for any push or pop in progress on another thread, and
    /// wakes any waiter.
    pub fn set_raw(&self, head: u64, tail: u64, data: &[u8]) {
        let _push = RoleGuard::take(Some(&self.roles.push));
        let _pop = RoleGuard::take(Some(&self.roles.pop));
        let cap = self.capacity as usize;
        let n = data.len().min(cap);
        let dst = self.data_ptr();
        // SAFETY: `dst` points to `capacity` bytes we own, all inside `UnsafeCell`s; `n`
        // and `cap - n` bytes from it stay inside them; `data` is a separate slice. Both
        // role locks are held, so no ring operation reads or writes the buffer meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), dst, n);
            std::ptr::write_bytes(dst.add(n), 0, cap - n);
        }
        let ring = self.ring(Peer::Engine);
        sync::post(&ring.tail_seq(), tail);
        sync::post(&ring.head_seq(), head);
    }

    /// The counters (head, tail) as they are now.
    pub fn counters(&self) -> (u64, u64) {
        (
            primitive::load(&self.head.0, Ordering::Acquire),
            primitive::load(&self.tail.0, Ordering::Acquire),
        )
    }

    /// A copy of the counters and the whole buffer (to check padding, or a fuzzer's
    /// invariants). Waits for any push or pop in progress on another thread.
    pub fn raw(&self) -> (u64, u64, Vec<u8>) {
        let _push = RoleGuard::take(Some(&self.roles.push));
        let _pop = RoleGuard::take(Some(&self.roles.pop));
        let cap = self.capacity as usize;
        let mut out = Vec::with_capacity(cap);
        // SAFETY: the buffer is `cap` bytes we own; `out` has room for `cap` bytes, all
        // initialised by the copy before `set_len`. Both role locks are held.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data_ptr(), out.as_mut_ptr(), cap);
            out.set_len(cap);
        }
        let (head, tail) = self.counters();
        (head, tail, out)
    }

    /// The buffer's first byte, with write permission over all `capacity` bytes (they are
    /// all inside `UnsafeCell`s).
    fn data_ptr(&self) -> *mut u8 {
        UnsafeCell::raw_get(self.data.as_ptr().cast::<UnsafeCell<[u8; 64]>>()).cast::<u8>()
    }
}

#[cfg(loom)]
impl HeapRing {
    /// Hands the control words and the data bytes, as they are now, to the model checker
    /// (`primitive::model`), before a model spawns its threads.
    pub(crate) fn track_in_model(&self) {
        use crate::primitive::model;
        model::track_u64(&self.head.0);
        model::track_u64(&self.tail.0);
        model::track_u32(&self.consumer_waiting.0);
        model::track_u32(&self.producer_waiting.0);
        model::track_bytes(self.data_ptr(), self.capacity as usize);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    const FOREVER: Duration = Duration::from_secs(60);

    fn ok() -> Result<()> {
        Ok(())
    }

    /// Deterministic bytes for record number `n` of length `len`.
    fn record(n: u64, len: usize) -> Vec<u8> {
        let mut x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ len as u64;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// xorshift64*, for sizes.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Size for record `n` of the stress tests: mostly small, sometimes up to the maximum.
    fn stress_len(rng: &mut Rng, max: u64) -> usize {
        (match rng.below(8) {
            0 => rng.below(max + 1),
            1 => max - rng.below(8).min(max),
            _ => rng.below(65),
        }) as usize
    }

    fn assert_protocol(r: Result<bool>, blame: Peer, needle: &str) {
        match r {
            Err(Error::Protocol { peer, detail }) => {
                assert_eq!(peer, blame, "{detail}");
                assert!(detail.contains(needle), "{detail:?} lacks {needle:?}");
            }
            other => panic!("expected a Protocol error about {needle:?}, got {other:?}"),
        }
    }

    fn ctrl_of(h: &HeapRing) -> RingCtrl<'_> {
        h.ring(Peer::Client).ctrl
    }

    #[test]
    fn new_checks_capacity_alignment_and_control_words() {
        for cap in [0, 8, 32, 63, 96, 100, 1000, 3 << 20, u64::MAX, 1 << 63] {
            assert!(HeapRing::new(cap).is_err(), "{cap}");
        }
        let h = HeapRing::new(128).unwrap();
        let data = h.data_ptr();
        for cap in [0, 32, 96] {
            // SAFETY: fails before anything is used.
            let r = unsafe { Ring::new(ctrl_of(&h), data, cap, Peer::Client) };
            assert!(
                matches!(
                    r,
                    Err(Error::InvalidHeader {
                        field: "ring capacity",
                        ..
                    })
                ),
                "{r:?}"
            );
        }
        // SAFETY: as above.
        let r = unsafe { Ring::new(ctrl_of(&h), data.wrapping_add(8), 64, Peer::Client) };
        assert!(matches!(
            r,
            Err(Error::InvalidHeader {
                field: "ring data offset",
                ..
            })
        ));
        // SAFETY: as above.
        let r = unsafe { Ring::new(ctrl_of(&h), std::ptr::null_mut(), 64, Peer::Client) };
        assert!(matches!(
            r,
            Err(Error::InvalidHeader {
                field: "ring data offset",
                ..
            })
        ));
        let stray = AtomicU32::new(0);
        let mut ctrl = ctrl_of(&h);
        ctrl.head_low = &stray;
        // SAFETY: as above.
        let r = unsafe { Ring::new(ctrl, data, 128, Peer::Client) };
        assert!(matches!(
            r,
            Err(Error::InvalidHeader {
                field: "ring control words",
                ..
            })
        ));
        // A correct one, used for real.
        // SAFETY: `data` is the 128-byte buffer of `h`, which outlives `r`; only this
        // thread uses it.
        let r = unsafe { Ring::new(ctrl_of(&h), data, 128, Peer::Client) }.unwrap();
        assert!(r.try_push(b"abc").unwrap());
        let mut out = Vec::new();
        assert!(r.try_pop(&mut out).unwrap());
        assert_eq!(out, b"abc");
    }

    #[test]
    fn max_record_is_the_largest_that_fits() {
        for cap in [64u64, 128, 256, 4096] {
            let h = HeapRing::new(cap).unwrap();
            let r = h.ring(Peer::Client);
            assert_eq!(r.max_record(), cap - 4);
            assert_eq!(record_size(r.max_record() as u32), cap);
            assert!(record_size(r.max_record() as u32 + 1) > cap);
        }
        assert_eq!(record_size(0), 8);
        assert_eq!(record_size(4), 8);
        assert_eq!(record_size(5), 16);
        assert_eq!(record_size(u32::MAX), (u32::MAX as u64 + 4 + 7) & !7);
    }

    #[test]
    fn round_trip_many_sizes() {
        for cap in [64u64, 256, 1024] {
            let h = HeapRing::new(cap).unwrap();
            let r = h.ring(Peer::Client);
            let mut out = vec![0xAA; 3];
            for len in 0..=r.max_record() as usize {
                let rec = record(len as u64, len);
                assert!(r.try_push(&rec).unwrap(), "cap {cap} len {len}");
                assert!(!r.is_empty());
                assert!(r.try_pop(&mut out).unwrap());
                assert_eq!(out, rec, "cap {cap} len {len}");
                assert!(r.is_empty());
                assert!(!r.try_pop(&mut out).unwrap());
            }
            let (head, tail) = h.counters();
            assert_eq!(head, tail);
            assert_eq!(head % 8, 0);
        }
    }

    #[test]
    fn wrap_around_at_every_offset() {
        let cap = 256u64;
        let h = HeapRing::new(cap).unwrap();
        let mut lens: Vec<usize> = (0..8).collect();
        // Up to 244: the record takes at most 248 bytes, leaving room for a second one.
        lens.extend([
            8, 9, 11, 15, 16, 17, 29, 60, 61, 63, 64, 65, 100, 127, 128, 200, 243, 244,
        ]);
        let mut out = Vec::new();
        for lap in [0u64, 1, 7, 1 << 30] {
            for s in (cap - 72..cap).step_by(8) {
                for &len in &lens {
                    // Put both counters at offset `s` of some lap, with garbage around.
                    let start = lap * cap + s;
                    h.set_raw(start, start, &[0xEE; 256]);
                    let r = h.ring(Peer::Engine);
                    let rec = record(start ^ len as u64, len);
                    assert!(r.try_push(&rec).unwrap());
                    // Followed by a second record, itself placed after the wrap.
                    let rec2 = record(len as u64, 3);
                    assert!(r.try_push(&rec2).unwrap());
                    assert!(r.try_pop(&mut out).unwrap());
                    assert_eq!(out, rec, "s {s} len {len} lap {lap}");
                    assert!(r.try_pop(&mut out).unwrap());
                    assert_eq!(out, rec2, "s {s} len {len} lap {lap}");
                    assert!(!r.try_pop(&mut out).unwrap());
                    let end = start + record_size(len as u32) + record_size(3);
                    assert_eq!(h.counters(), (end, end));
                }
            }
        }
    }

    #[test]
    fn records_are_laid_out_as_specified() {
        let cap = 64u64;
        let h = HeapRing::new(cap).unwrap();
        h.set_raw(48, 48, &[0xEE; 64]);
        let r = h.ring(Peer::Client);
        // 21 bytes from offset 48: length word at 48..52, payload 52..64 and 0..9, padding
        // 9..16 (zeroes): round_up(4 + 21, 8) = 32 bytes, head 48 + 32 = 80.
        let rec: Vec<u8> = (1..=21).collect();
        assert!(r.try_push(&rec).unwrap());
        let (head, tail, raw) = h.raw();
        assert_eq!((head, tail), (80, 48));
        assert_eq!(raw[48..52], 21u32.to_le_bytes());
        assert_eq!(raw[52..64], rec[..12]);
        assert_eq!(raw[0..9], rec[12..]);
        assert_eq!(raw[9..16], [0; 7]);
        assert!(raw[16..48].iter().all(|&b| b == 0xEE));
        // An empty record: a zero length word and four bytes of zero padding.
        assert!(r.try_push(&[]).unwrap());
        let (head, _, raw) = h.raw();
        assert_eq!(head, 88);
        assert_eq!(raw[16..24], [0; 8]);
    }

    #[test]
    fn full_ring_refuses_then_accepts_after_pop() {
        let h = HeapRing::new(64).unwrap();
        let r = h.ring(Peer::Client);
        // 7 records of 8 bytes (len 4) fill 56 of 64 bytes.
        for n in 0..7 {
            assert!(r.try_push(&record(n, 4)).unwrap());
        }
        // 9 bytes need 16: only 8 free.
        assert!(!r.try_push(&record(7, 9)).unwrap());
        assert_eq!(h.counters(), (56, 0));
        // 4 bytes need 8: fits exactly; now full.
        assert!(r.try_push(&record(7, 4)).unwrap());
        assert!(!r.try_push(&[]).unwrap());
        assert_eq!(h.counters(), (64, 0));
        let mut out = Vec::new();
        assert!(r.try_pop(&mut out).unwrap());
        assert_eq!(out, record(0, 4));
        assert!(r.try_push(&[]).unwrap());
        for n in 1..8 {
            assert!(r.try_pop(&mut out).unwrap());
            assert_eq!(out, record(n, 4));
        }
        assert!(r.try_pop(&mut out).unwrap());
        assert!(out.is_empty());
        assert!(r.is_empty());
    }

    #[test]
    fn push_times_out_when_full() {
        let h = HeapRing::new(64).unwrap();
        let r = h.ring(Peer::Client);
        assert!(r.try_push(&record(0, 60)).unwrap());
        for policy in [WaitPolicy::default(), WaitPolicy::BLOCKING] {
            let timeout = Duration::from_millis(30);
            let t0 = Instant::now();
            let e = r.push(b"x", policy, timeout, ok).unwrap_err();
            assert!(t0.elapsed() >= timeout);
            assert!(
                matches!(e, Error::Timeout { waited, what: WHAT_SPACE } if waited == timeout),
                "{e:?}"
            );
        }
        assert_eq!(h.counters(), (64, 0));
        assert_eq!(h.producer_waiting.0.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn pop_times_out_when_empty() {
        let h = HeapRing::new(64).unwrap();
        let r = h.ring(Peer::Engine);
        let mut out = Vec::new();
        let e = r
            .pop(
                &mut out,
                WaitPolicy::BLOCKING,
                Duration::from_millis(20),
                ok,
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Timeout {
                    what: WHAT_MESSAGE,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(h.consumer_waiting.0.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn check_peer_error_ends_the_wait() {
        let h = HeapRing::new(64).unwrap();
        let r = h.ring(Peer::Client);
        let closed = || Err(Error::PeerClosed { peer: Peer::Engine });
        let mut out = Vec::new();
        let e = r
            .pop(&mut out, WaitPolicy::BLOCKING, FOREVER, closed)
            .unwrap_err();
        assert!(
            matches!(e, Error::PeerClosed { peer: Peer::Engine }),
            "{e:?}"
        );
        assert!(r.try_push(&record(0, 60)).unwrap());
        let e = r
            .push(b"x", WaitPolicy::BLOCKING, FOREVER, closed)
            .unwrap_err();
        assert!(
            matches!(e, Error::PeerClosed { peer: Peer::Engine }),
            "{e:?}"
        );
        // Not consulted when no wait is needed.
        r.pop(&mut out, WaitPolicy::BLOCKING, FOREVER, closed)
            .unwrap();
        r.push(b"x", WaitPolicy::BLOCKING, FOREVER, closed).unwrap();
    }

    #[test]
    fn sleeping_sides_are_woken() {
        // Blocking policy: both sides go straight to the futex (a full ring for the
        // producer, an empty one for the consumer); every hand-off must complete, in order.
        let h = HeapRing::new(64).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                let r = h.ring(Peer::Client);
                for n in 0..200u64 {
                    r.push(&record(n, 60), WaitPolicy::BLOCKING, FOREVER, ok)
                        .unwrap();
                }
            });
            let r = h.ring(Peer::Client);
            let mut out = Vec::new();
            for n in 0..200u64 {
                r.pop(&mut out, WaitPolicy::BLOCKING, FOREVER, ok).unwrap();
                assert_eq!(out, record(n, 60));
            }
        });
        assert!(h.ring(Peer::Client).is_empty());
    }

    /// A producer thread pushes `count` records of varied sizes, a consumer thread pops
    /// them and checks every byte and the order.
    fn stress(cap: u64, count: u64, policy: WaitPolicy) {
        let h = HeapRing::new(cap).unwrap();
        let max = h.ring(Peer::Client).max_record();
        std::thread::scope(|s| {
            s.spawn(|| {
                let r = h.ring(Peer::Client);
                let mut rng = Rng(0x5EED);
                for n in 0..count {
                    let len = stress_len(&mut rng, max);
                    r.push(&record(n, len), policy, FOREVER, ok).unwrap();
                }
            });
            s.spawn(|| {
                let r = h.ring(Peer::Client);
                let mut rng = Rng(0x5EED);
                let mut out = Vec::new();
                for n in 0..count {
                    let len = stress_len(&mut rng, max);
                    r.pop(&mut out, policy, FOREVER, ok).unwrap();
                    assert_eq!(out.len(), len, "record {n}");
                    assert!(out == record(n, len), "record {n} differs");
                }
            });
        });
        let r = h.ring(Peer::Client);
        assert!(r.is_empty());
        let mut out = Vec::new();
        assert!(!r.try_pop(&mut out).unwrap());
    }

    #[test]
    fn stress_100k_records_in_order() {
        stress(1024, 100_000, WaitPolicy::default());
    }

    #[test]
    fn stress_blocking_policy() {
        stress(256, 20_000, WaitPolicy::BLOCKING);
    }

    #[test]
    fn producers_sharing_a_heap_ring_take_turns() {
        // Two producer threads on one ring: the role lock serialises them; each one's
        // records arrive whole and in its own order.
        let h = HeapRing::new(256).unwrap();
        let per = 5_000u64;
        std::thread::scope(|s| {
            for id in 0..2u64 {
                let h = &h;
                s.spawn(move || {
                    let r = h.ring(Peer::Client);
                    for n in 0..per {
                        let mut rec = record(n, (n % 40) as usize);
                        rec.splice(0..0, [id as u8, (n >> 8) as u8, n as u8]);
                        r.push(&rec, WaitPolicy::default(), FOREVER, ok).unwrap();
                    }
                });
            }
            let r = h.ring(Peer::Client);
            let mut next = [0u64; 2];
            let mut out = Vec::new();
            for _ in 0..2 * per {
                r.pop(&mut out, WaitPolicy::default(), FOREVER, ok).unwrap();
                let id = out[0] as usize;
                let n = next[id];
                assert_eq!(out[1..3], [(n >> 8) as u8, n as u8]);
                assert_eq!(out[3..], record(n, (n % 40) as usize));
                next[id] += 1;
            }
            assert_eq!(next, [per, per]);
        });
    }

    #[test]
    fn oversized_record_rejected_ring_unchanged() {
        let h = HeapRing::new(64).unwrap();
        h.set_raw(16, 8, &[0x11; 64]);
        let before = h.raw();
        let r = h.ring(Peer::Client);
        for len in [61usize, 62, 64, 65, 1000] {
            let rec = vec![0x22; len];
            let e = r.try_push(&rec).unwrap_err();
            assert!(
                matches!(e, Error::RecordTooLarge { len: l, capacity: 64 } if l == len as u64),
                "{e:?}"
            );
            let e = r.push(&rec, WaitPolicy::BLOCKING, FOREVER, ok).unwrap_err();
            assert!(matches!(e, Error::RecordTooLarge { .. }), "{e:?}");
            assert_eq!(h.raw(), before);
        }
        // The largest that fits is accepted once there is room.
        h.set_raw(16, 16, &[]);
        assert!(r.try_push(&[0x33; 60]).unwrap());
    }

    /// Puts the ring in a hostile state and checks that pops fail with a Protocol error
    /// blaming the producer, consume nothing, and read nothing out of bounds.
    fn hostile_pop(cap: u64, head: u64, tail: u64, data: &[u8], needle: &str) {
        let h = HeapRing::new(cap).unwrap();
        h.set_raw(head, tail, data);
        let r = h.ring(Peer::Engine);
        let mut out = vec![1, 2, 3];
        for _ in 0..2 {
            assert_protocol(r.try_pop(&mut out), Peer::Engine, needle);
        }
        let e = r
            .pop(&mut out, WaitPolicy::BLOCKING, FOREVER, ok)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Protocol {
                    peer: Peer::Engine,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(h.counters(), (head, tail));
    }

    fn len_at(cap: u64, pos: usize, len: u32) -> Vec<u8> {
        let mut d = vec![0u8; cap as usize];
        d[pos..pos + 4].copy_from_slice(&len.to_le_bytes());
        d
    }

    #[test]
    fn corrupt_head_behind_tail() {
        hostile_pop(64, 8, 16, &[], "behind");
        hostile_pop(64, 0, u64::MAX - 7, &[], "behind");
    }

    #[test]
    fn corrupt_more_than_capacity_in_flight() {
        hostile_pop(64, 72, 0, &[], "more than the capacity");
        hostile_pop(64, u64::MAX - 7, 0, &[], "more than the capacity");
    }

    #[test]
    fn corrupt_unaligned_counters() {
        hostile_pop(64, 12, 0, &len_at(64, 0, 0), "multiples of 8");
        hostile_pop(64, 16, 4, &len_at(64, 0, 0), "multiples of 8");
        hostile_pop(64, 1, 0, &[], "multiples of 8");
    }

    #[test]
    fn corrupt_length_beyond_published() {
        // 16 bytes published; the length word says 13 (needs 24).
        hostile_pop(64, 16, 0, &len_at(64, 0, 13), "corrupt record length 13");
        // Near the end of the buffer, wrapping: 16 bytes published, 13 need 24.
        hostile_pop(
            64,
            64 + 8,
            56,
            &len_at(64, 56, 13),
            "corrupt record length 13",
        );
        // 12 fits in 16: fine; the next record's length then exceeds what is left.
        let mut d = len_at(64, 0, 4);
        d[8..12].copy_from_slice(&9u32.to_le_bytes());
        let h = HeapRing::new(64).unwrap();
        h.set_raw(16, 0, &d);
        let r = h.ring(Peer::Engine);
        let mut out = Vec::new();
        assert!(r.try_pop(&mut out).unwrap());
        assert_eq!(out, [0; 4]);
        assert_protocol(r.try_pop(&mut out), Peer::Engine, "corrupt record length 9");
        assert_eq!(h.counters(), (16, 8));
    }

    #[test]
    fn corrupt_length_beyond_capacity() {
        // A full ring (64 bytes published) whose length word claims more than 64.
        hostile_pop(64, 64, 0, &len_at(64, 0, 61), "corrupt record length 61");
        hostile_pop(
            64,
            64 * 5 + 64,
            64 * 5,
            &len_at(64, 0, u32::MAX),
            "corrupt record length",
        );
        hostile_pop(
            64,
            64 + 56,
            56,
            &len_at(64, 56, 1 << 31),
            "corrupt record length",
        );
        // The largest legal record in a full ring is accepted.
        let h = HeapRing::new(64).unwrap();
        h.set_raw(64 + 56, 56, &len_at(64, 56, 60));
        let mut out = Vec::new();
        assert!(h.ring(Peer::Engine).try_pop(&mut out).unwrap());
        assert_eq!(out.len(), 60);
    }

    #[test]
    fn producer_rejects_corrupt_counters() {
        // The producer blames the consumer (the ring's other side).
        let h = HeapRing::new(64).unwrap();
        let r = h.ring(Peer::Engine);
        for (head, tail, needle) in [
            (8, 16, "behind"),
            (80, 8, "more than the capacity"),
            (8, 4, "multiples of 8"),
        ] {
            h.set_raw(head, tail, &[]);
            assert_protocol(r.try_push(b"abc"), Peer::Client, needle);
            let e = r
                .push(b"abc", WaitPolicy::BLOCKING, FOREVER, ok)
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Protocol {
                        peer: Peer::Client,
                        ..
                    }
                ),
                "{e:?}"
            );
            assert_eq!(h.counters(), (head, tail));
        }
    }

    #[test]
    fn counters_near_u64_max_do_not_panic() {
        let h = HeapRing::new(64).unwrap();
        let r = h.ring(Peer::Client);
        let top = u64::MAX - 7; // the largest multiple of 8
        h.set_raw(top, top, &[]);
        assert_protocol(r.try_push(b"abc"), Peer::Engine, "overflow");
        let mut out = Vec::new();
        assert!(!r.try_pop(&mut out).unwrap());
        let e = r
            .pop(&mut out, WaitPolicy::BLOCKING, FOREVER, ok)
            .unwrap_err();
        assert!(matches!(e, Error::Protocol { .. }), "{e:?}");
        // One last record below the top still goes through.
        h.set_raw(top - 8, top - 8, &[]);
        assert!(r.try_push(b"abc").unwrap());
        assert!(r.try_pop(&mut out).unwrap());
        assert_eq!(out, b"abc");
        assert_eq!(h.counters(), (top, top));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push(usize),
        Pop,
    }

    fn ops(cap: u64) -> impl Strategy<Value = Vec<Op>> {
        let c = cap as usize;
        let op = prop_oneof![
            6 => (0..3 * c / 4).prop_map(Op::Push),
            1 => (c - 8..c + 16).prop_map(Op::Push),
            6 => Just(Op::Pop),
        ];
        proptest::collection::vec(op, 0..200)
    }

    fn arb_case() -> impl Strategy<Value = (u64, u64, Vec<Op>)> {
        prop_oneof![Just(64u64), Just(256u64), Just(1024u64)]
            .prop_flat_map(|cap| (Just(cap), 0u64..1 << 40, ops(cap)))
    }

    proptest! {
        #[test]
        fn prop_records_round_trip_in_order((cap, start, ops) in arb_case()) {
            // Start both counters anywhere (a multiple of 8), so wraps fall everywhere.
            let start = start * 8;
            let h = HeapRing::new(cap).unwrap();
            h.set_raw(start, start, &[0x5A; 1024]);
            let r = h.ring(Peer::Client);
            let mut model: VecDeque<Vec<u8>> = VecDeque::new();
            let mut used = 0u64;
            let mut out = Vec::new();
            for (n, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Push(len) => {
                        let rec = record(n as u64, len);
                        let size = record_size(len as u32);
                        match r.try_push(&rec) {
                            Ok(true) => {
                                prop_assert!(used + size <= cap);
                                used += size;
                                model.push_back(rec);
                            }
                            Ok(false) => prop_assert!(size <= cap && used + size > cap),
                            Err(Error::RecordTooLarge { len: l, capacity }) => {
                                prop_assert!(size > cap);
                                prop_assert_eq!((l, capacity), (len as u64, cap));
                            }
                            Err(e) => prop_assert!(false, "{e:?}"),
                        }
                    }
                    Op::Pop => match model.pop_front() {
                        Some(rec) => {
                            prop_assert!(r.try_pop(&mut out).unwrap());
                            prop_assert_eq!(&out, &rec);
                            used -= record_size(rec.len() as u32);
                        }
                        None => prop_assert!(!r.try_pop(&mut out).unwrap()),
                    },
                }
                let (head, tail) = h.counters();
                prop_assert_eq!(head - tail, used);
            }
            while let Some(rec) = model.pop_front() {
                prop_assert!(r.try_pop(&mut out).unwrap());
                prop_assert_eq!(&out, &rec);
            }
            prop_assert!(r.is_empty());
        }

        #[test]
        fn prop_hostile_states_never_panic(
            cap in prop_oneof![Just(64u64), Just(128u64)],
            head in prop_oneof![(0u64..64).prop_map(|x| x * 8), 0u64..512, any::<u64>()],
            tail in prop_oneof![(0u64..64).prop_map(|x| x * 8), 0u64..512, any::<u64>()],
            data in proptest::collection::vec(any::<u8>(), 0..128),
        ) {
            // Whatever the state, a pop or push is Ok or a Protocol error (no panic, no
            // out-of-bounds read), and a successful pop returns at most capacity bytes.
            let h = HeapRing::new(cap).unwrap();
            h.set_raw(head, tail, &data);
            let r = h.ring(Peer::Engine);
            let mut out = Vec::new();
            for _ in 0..4 {
                match r.try_pop(&mut out) {
                    Ok(true) => prop_assert!(out.len() as u64 <= r.max_record()),
                    Ok(false) | Err(Error::Protocol { peer: Peer::Engine, .. }) => {}
                    Err(e) => prop_assert!(false, "{e:?}"),
                }
                match r.try_push(&data[..data.len().min(20)]) {
                    Ok(_) | Err(Error::Protocol { peer: Peer::Client, .. }) => {}
                    Err(e) => prop_assert!(false, "{e:?}"),
                }
            }
        }
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! A model of the real ring's head/tail protocol, run under every interleaving loom
    //! explores (see `scripts/test.sh` for the command). The heap ring's counters and
    //! waiter flags go through `primitive::model` as loom atomics, and each byte of its
    //! data area is a loom cell: a consumer that reads bytes the producer has not
    //! published, or a producer that overwrites bytes the consumer has not finished
    //! reading, fails the model (no happens-before between the accesses), as does a lost
    //! wake-up on a full or an empty ring (a deadlock: futex sleeps have no slices here).
    use std::sync::Arc;

    use super::*;
    use crate::primitive::model::check;

    /// Record `n` of `len` bytes: every byte names its record and its place in it.
    fn record(n: u8, len: usize) -> Vec<u8> {
        (0..len as u8).map(|i| n << 5 | i).collect()
    }

    #[test]
    fn records_cross_a_full_ring_and_its_wrap_intact_and_in_order() {
        // 64 bytes; records of 24, 32 and 16 bytes from offset 32: the second wraps around
        // the end (its length word at 56, its payload at 60..64 and 0..24), and the third
        // does not fit until the first is consumed, so the producer waits on the tail.
        // The counters start 32 bytes below 2^32, so the futex words (their low halves)
        // wrap to 0 during the run.
        const START: u64 = (1 << 32) - 32;
        let lens = [20usize, 28, 12];
        check("ring::records_cross_a_full_ring_and_its_wrap", move || {
            let heap = Arc::new(HeapRing::new(64).unwrap());
            heap.head.0.store(START, Ordering::Relaxed);
            heap.tail.0.store(START, Ordering::Relaxed);
            heap.track_in_model();
            let producer = {
                let heap = heap.clone();
                loom::thread::spawn(move || {
                    let ring = heap.ring(Peer::Client);
                    for (n, len) in lens.into_iter().enumerate() {
                        let rec = record(n as u8, len);
                        ring.push(&rec, WaitPolicy::BLOCKING, Duration::MAX, || Ok(()))
                            .unwrap();
                    }
                })
            };
            let ring = heap.ring(Peer::Client);
            let mut out = Vec::new();
            for (n, len) in lens.into_iter().enumerate() {
                ring.pop(&mut out, WaitPolicy::BLOCKING, Duration::MAX, || Ok(()))
                    .unwrap();
                assert_eq!(out, record(n as u8, len), "record {n}");
            }
            producer.join().unwrap();
            let total: u64 = lens.iter().map(|&l| record_size(l as u32)).sum();
            assert_eq!(heap.counters(), (START + total, START + total));
            for flag in [&heap.consumer_waiting.0, &heap.producer_waiting.0] {
                assert_eq!(primitive::load(flag, Ordering::Relaxed), 0);
            }
        });
    }
}
