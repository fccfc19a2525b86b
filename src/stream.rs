//! Trajectory streams (protocol 1.11): many producers, one consumer or a consumer group,
//! records of named fields written in place and read in place. `docs/stream.md` is the
//! API's guide, `docs/protocol.md` §10 the bytes.
//!
//! A stream is its own shm object, created by its first consumer ([`Consumer::create`],
//! rank 0): a header (the schema, sizes, the consumers' doorbell, the rank table) and one
//! **lane** per producer, a byte ring whose `head` only its producer moves. A producer
//! ([`Producer::attach`]) claims a free lane (or one whose producer is dead),
//! [`Producer::reserve`]s a record (waiting for space up to a deadline, then
//! [`Error::Full`]), writes its fields in place and commits ([`Reservation::commit`]):
//! one Release store of `head`. Consumers ([`Consumer::pop`], [`Consumer::pop_batch`])
//! claim whole records (a compare-and-swap on the record's first word, so each goes to
//! exactly one rank), read them in place, and release them ([`Record`]'s drop); the lane's
//! `tail` then moves over the released prefix, and the producer reuses the space.
//!
//! The protocol's steps are functions of [`Lane`] and [`Group`], views of the live words
//! that the loom models (`loom_tests`) build over heap memory, as this module builds them
//! over the mapping.

use std::fs::File;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

use crate::error::{Error, Peer, PidNamespace, Result};
use crate::layout::stream::{
    check_word0, decode_record, lap_of, max_record, Spans, StreamLayout, Word0, KIND_PAD,
    KIND_RECORD, MAX_FIELDS, OFF_DOORBELL, OFF_FULL_WAITS, OFF_LOST, OFF_RANKS_TABLE,
    RANK_ENTRY_SIZE, RECORD_FIXED, STATE_CLAIMED, STATE_LOST, STATE_READY, STATE_RELEASED,
    STREAM_HEADER_SIZE,
};
pub use crate::layout::stream::{Count, Field, Schema, StreamSpec};
use crate::layout::DType;
use crate::os;
use crate::primitive::{self, fence, low_half, AtomicU32, AtomicU64, Ordering};
use crate::region;
use crate::sync::{self, Backoff, Doorbell, SharedSeq, WaitPolicy};
use crate::tensor::Element;

/// A lane's control words (256 bytes before its data; docs/protocol.md §10.3). The
/// producer's line first, then the consumers'.
#[repr(C, align(64))]
#[derive(Default)]
pub(crate) struct LaneCtrl {
    /// Bytes committed (monotonic): stored Release by the lane's producer only.
    pub(crate) head: AtomicU64,
    /// The producer, for stats and messages: `pid | (start_time as u32) << 32`; 0 free.
    /// Who owns the lane is told by its lock ([`LANE_LOCK`]).
    pub(crate) owner: AtomicU64,
    /// Bumped at each claim of the lane: a record carries the one of its producer.
    pub(crate) generation: AtomicU64,
    pub(crate) committed: AtomicU64,
    pub(crate) committed_bytes: AtomicU64,
    _p0: [u64; 3],
    /// Bytes claimed by consumers (monotonic; any rank moves it over claimed records).
    pub(crate) read: AtomicU64,
    /// Bytes released (monotonic; `tail <= read <= head`): the producer sleeps on its low
    /// half when the lane is full.
    pub(crate) tail: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) lost: AtomicU64,
    pub(crate) producer_waiting: AtomicU32,
    _p1: [u32; 7],
    _p2: [u64; 16],
}

const _: () = assert!(std::mem::size_of::<LaneCtrl>() == 256);
const _: () = assert!(std::mem::offset_of!(LaneCtrl, read) == 64);
const _: () = assert!(std::mem::offset_of!(LaneCtrl, producer_waiting) == 96);

/// A rank's entry in the rank table (64 bytes).
#[repr(C, align(64))]
#[derive(Default)]
pub(crate) struct RankCtrl {
    /// `pid | (start_time as u32) << 32` of the process serving the rank, for stats and
    /// messages; 0 never. Whether it lives is told by its lock ([`RANK_LOCK`]).
    pub(crate) owner: AtomicU64,
    /// 0 never served, [`RANK_LIVE`] or [`RANK_CLOSED`].
    pub(crate) state: AtomicU32,
    /// The rank sleeps on the doorbell (its waiter flag).
    pub(crate) waiting: AtomicU32,
    pub(crate) popped: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) lost: AtomicU64,
    /// The lane and position this rank is examining ([`hazard_word`]; 0: none): the
    /// lane's producer does not rewrite the bytes there (nor after them) while the rank
    /// reads them as a record's first word (docs/protocol.md §10.4, hazards).
    pub(crate) hazard: AtomicU64,
    _p: [u64; 2],
}

const _: () = assert!(std::mem::size_of::<RankCtrl>() == RANK_ENTRY_SIZE);
const _: () = assert!(std::mem::offset_of!(RankCtrl, hazard) == 40);

/// The byte of the stream file whose OFD write lock rank `k`'s consumer holds (`+ k`)
/// while it, or a record it popped, lives; and lane `i`'s producer (`LANE_LOCK + i`).
/// The kernel drops a lock when its holder ends, however it ends, and a lock is seen
/// across PID namespaces: the liveness of ranks and producers is told by these locks,
/// never by a pid.
pub const RANK_LOCK: u64 = 1 << 40;
pub const LANE_LOCK: u64 = (1 << 40) + 1024;

/// A rank's hazard word: 0 none, else `lane << 54 | (position / 8 + 1)` (positions
/// below 2^57 bytes of a lane's life).
const HAZARD_LANE_SHIFT: u32 = 54;
const HAZARD_POS_MASK: u64 = (1 << HAZARD_LANE_SHIFT) - 1;

fn hazard_word(lane: u32, pos: u64) -> u64 {
    (lane as u64) << HAZARD_LANE_SHIFT | ((pos / 8 + 1) & HAZARD_POS_MASK)
}

pub(crate) const RANK_LIVE: u32 = 1;
pub(crate) const RANK_CLOSED: u32 = 2;

/// One lane: its control words and its data (`capacity` bytes, a power of two, 8-aligned).
#[derive(Clone, Copy)]
pub(crate) struct Lane<'a> {
    pub(crate) ctrl: &'a LaneCtrl,
    pub(crate) data: *mut u8,
    pub(crate) capacity: u64,
    pub(crate) index: u32,
    /// The rank table: the ranks' hazard positions, which `tail` never passes.
    pub(crate) ranks: &'a [RankCtrl],
}

/// The consumer group's words: the doorbell the ranks sleep on, the rank table, the
/// stream-wide stats.
#[derive(Clone, Copy)]
pub(crate) struct Group<'a> {
    pub(crate) doorbell: &'a AtomicU32,
    pub(crate) ranks: &'a [RankCtrl],
    pub(crate) full_waits: &'a AtomicU64,
    pub(crate) lost: &'a AtomicU64,
}

/// A record claimed by a rank: where, and its first word as claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim {
    pub(crate) pos: u64,
    pub(crate) word0: Word0,
}

impl<'a> Lane<'a> {
    fn bad(&self, detail: impl Into<String>) -> Error {
        Error::BadRecord {
            lane: self.index,
            detail: detail.into(),
        }
    }

    /// The first word of the record at position `pos` (8-aligned).
    fn word0(&self, pos: u64) -> &'a AtomicU64 {
        debug_assert!(pos % 8 == 0);
        // SAFETY: `pos % capacity + 8 <= capacity` (positions are 8-aligned: every
        // caller checks the cursor it starts from, and steps by lengths checked to be
        // multiples of 8; the capacity is a multiple of 8), `data` is 8-aligned and
        // `capacity` bytes long for
        // 'a; every access to a record's first word is atomic (this one), by the
        // producer and every consumer.
        unsafe { &*(self.data.add((pos % self.capacity) as usize) as *const AtomicU64) }
    }

    /// The bytes `pos..pos + len` of the lane (not crossing its end: checked by callers).
    fn bytes(&self, pos: u64, len: usize) -> *mut u8 {
        debug_assert!(pos % self.capacity + len as u64 <= self.capacity);
        // SAFETY: inside the data area, as said above.
        unsafe { self.data.add((pos % self.capacity) as usize) }
    }

    /// The consumers' side of a claim: the next record of this lane not yet claimed,
    /// claimed for `rank` (a compare-and-swap on its first word: exactly one rank gets
    /// it), with `read` moved past it and past any pad. `None` when the lane holds no
    /// unclaimed record. `BadRecord` for bytes that break the rules.
    pub(crate) fn try_claim(&self, rank: u8, header_len: usize) -> Result<Option<Claim>> {
        let got = self.try_claim_guarded(rank, header_len);
        self.unguard(Some(rank));
        got
    }

    /// Publishes `pos` as the position rank `rank` examines (`None`: the lane's producer,
    /// which rewrites nothing while it examines), then says whether `tail` is still at
    /// or before it. Dekker with the producer's room (`Lane::room_limit`): it loads
    /// `tail`, then the hazards, both SeqCst. If it did not see this hazard, it loaded
    /// `tail` before our load of `tail` (in the single total order), so whatever `tail`
    /// it saw we see too, or a later one: `tail <= pos` here means the producer's room
    /// never covered `pos`'s bytes, and from now on it sees the hazard.
    fn guard(&self, rank: Option<u8>, pos: u64) -> bool {
        if let Some(r) = rank.and_then(|k| self.ranks.get(k as usize)) {
            primitive::store(&r.hazard, hazard_word(self.index, pos), Ordering::SeqCst);
        }
        // The fences make the Dekker hold also where SeqCst accesses alone are modelled
        // as AcqRel (loom), and pair with the one in `room_limit`.
        fence(Ordering::SeqCst);
        primitive::load(&self.ctrl.tail, Ordering::SeqCst) <= pos
    }

    fn unguard(&self, rank: Option<u8>) {
        if let Some(r) = rank.and_then(|k| self.ranks.get(k as usize)) {
            primitive::store(&r.hazard, 0, Ordering::SeqCst);
            // A producer held back by the hazard sleeps on `tail` (Dekker as in
            // `advance_tail`): wake it.
            fence(Ordering::SeqCst);
            if primitive::load(&self.ctrl.producer_waiting, Ordering::Relaxed) != 0 {
                primitive::futex_wake_all(low_half(&self.ctrl.tail));
            }
        }
    }

    fn try_claim_guarded(&self, rank: u8, header_len: usize) -> Result<Option<Claim>> {
        let c = self.ctrl;
        loop {
            let r = primitive::load(&c.read, Ordering::Acquire);
            let h = primitive::load(&c.head, Ordering::Acquire);
            if r == h {
                return Ok(None);
            }
            if r > h || h - r > self.capacity || r % 8 != 0 || h % 8 != 0 {
                if self.moved(&c.read, r) {
                    continue;
                }
                return Err(self.bad(format!(
                    "read cursor {r} against head {h} (a lane apart at most, both 8-aligned)"
                )));
            }
            #[cfg(all(test, not(loom)))]
            race_tests::after_cursors();
            // The bytes at `r` are a record's first word only while `tail` has not passed
            // `r` (the producer then rewrites them, possibly with a later record's
            // payload): publish `r`, so that they stay as they are, and check `tail`.
            if !self.guard(Some(rank), r) {
                // `tail` passed `r`: another rank claimed and released it meanwhile (then
                // `read` moved on), or the lane is corrupt (`tail` never passes `read`).
                if self.moved(&c.read, r) {
                    continue;
                }
                return Err(self.bad(format!("tail past the read cursor {r}")));
            }
            let w = Word0::unpack(primitive::load(self.word0(r), Ordering::Acquire));
            if let Err(detail) = check_word0(w, r, h, self.capacity, header_len) {
                // A position claimed and passed meanwhile: look again.
                if self.moved(&c.read, r) {
                    continue;
                }
                return Err(self.bad(detail));
            }
            let next = r + w.len as u64;
            if w.kind == KIND_RECORD && w.state == STATE_READY {
                let mine = w.with_state(STATE_CLAIMED, rank);
                let won = primitive::compare_exchange(
                    self.word0(r),
                    w.pack(),
                    mine.pack(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                if won.is_err() {
                    continue;
                }
                // Whoever sees the record claimed moves `read` on (below), so a rank that
                // stops here leaves no hole.
                let _ = primitive::compare_exchange(
                    &c.read,
                    r,
                    next,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                );
                return Ok(Some(Claim {
                    pos: r,
                    word0: mine,
                }));
            }
            // A pad, or a record another rank claimed: help `read` past it.
            let _ =
                primitive::compare_exchange(&c.read, r, next, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    /// The lowest position whose bytes the producer must not rewrite: `tail`, or a
    /// lower position a rank examines (its hazard). Loads `tail` then the hazards,
    /// SeqCst (the other side of [`Lane::guard`]).
    pub(crate) fn room_limit(&self) -> u64 {
        let mut low = primitive::load(&self.ctrl.tail, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        for r in self.ranks {
            let hz = primitive::load(&r.hazard, Ordering::SeqCst);
            if hz != 0 && hz >> HAZARD_LANE_SHIFT == self.index as u64 {
                low = low.min(((hz & HAZARD_POS_MASK) - 1) * 8);
            }
        }
        low
    }

    /// Whether cursor `word` has moved from `seen`. A read-modify-write, which reads the
    /// latest value: a plain load may still give `seen` after the bytes it guarded were
    /// overwritten (the producer's first-word store is Relaxed: seeing it orders nothing),
    /// which would make a stale position look like a corrupt record.
    fn moved(&self, word: &AtomicU64, seen: u64) -> bool {
        primitive::fetch_add(word, 0, Ordering::AcqRel) != seen
    }

    /// Releases a claim of `rank`: the record's state becomes released (Release: every
    /// read of its bytes happens before), then `tail` moves over the released prefix.
    /// `false` when the record was no longer this rank's (released as lost meanwhile).
    pub(crate) fn release(&self, claim: Claim) -> bool {
        let done = claim.word0.with_state(STATE_RELEASED, claim.word0.rank);
        let ok = primitive::compare_exchange(
            self.word0(claim.pos),
            claim.word0.pack(),
            done.pack(),
            Ordering::AcqRel,
            Ordering::Relaxed,
        )
        .is_ok();
        if ok {
            primitive::fetch_add(&self.ctrl.released, 1, Ordering::Relaxed);
        }
        self.advance_tail();
        ok
    }

    /// Moves `tail` over every released record, lost record and pad at its front (any
    /// rank, any producer may call it: each step is a compare-and-swap of `tail`), and
    /// wakes the producer if it sleeps for space.
    pub(crate) fn advance_tail(&self) {
        let c = self.ctrl;
        let mut moved = false;
        // Two ranks releasing neighbours at once: each stored its release, then looks at
        // the other's record (Dekker: with a SeqCst fence on both sides, at least one of
        // them sees both releases and moves `tail` over both).
        fence(Ordering::SeqCst);
        loop {
            let t = primitive::load(&c.tail, Ordering::Acquire);
            let r = primitive::load(&c.read, Ordering::Acquire);
            // A misaligned cursor is corrupt: the next claim says so; nothing moves.
            if t >= r || t % 8 != 0 {
                break;
            }
            let w = Word0::unpack(primitive::load(self.word0(t), Ordering::Acquire));
            let len = w.len as u64;
            let sane = w.lap == lap_of(t, self.capacity)
                && len >= 8
                && len % 8 == 0
                && t % self.capacity + len <= self.capacity
                && t.checked_add(len).is_some_and(|e| e <= r);
            let done = w.kind == KIND_PAD
                || (w.kind == KIND_RECORD && matches!(w.state, STATE_RELEASED | STATE_LOST));
            if sane && !done {
                break;
            }
            if !sane {
                // Overwritten since `t` was read: `tail` moved on.
                if self.moved(&c.tail, t) {
                    continue;
                }
                break;
            }
            if primitive::compare_exchange(&c.tail, t, t + len, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                moved = true;
            }
        }
        if moved {
            // Dekker with the producer's wait (sync::wait_on): it stores its flag, fences,
            // loads `tail`; we stored `tail`, fence, load its flag.
            fence(Ordering::SeqCst);
            if primitive::load(&c.producer_waiting, Ordering::Relaxed) != 0 {
                primitive::futex_wake_all(low_half(&c.tail));
            }
        }
    }

    /// Marks lost every record between `tail` and `read` that a rank `dead` says is dead
    /// claimed and never released; returns how many. Then moves `tail`. `me`: the rank
    /// that walks (its hazard guards the walk: `tail` may move past the bytes it reads,
    /// but the producer does not rewrite them), or `None` for the lane's producer.
    pub(crate) fn reap(
        &self,
        me: Option<u8>,
        group: &Group<'_>,
        dead: &mut dyn FnMut(u8) -> bool,
    ) -> u64 {
        let c = self.ctrl;
        let mut t = primitive::load(&c.tail, Ordering::Acquire);
        while !self.guard(me, t) {
            t = primitive::load(&c.tail, Ordering::Acquire);
        }
        let r = primitive::load(&c.read, Ordering::Acquire);
        let mut lost = 0;
        while t < r && t % 8 == 0 {
            let w = Word0::unpack(primitive::load(self.word0(t), Ordering::Acquire));
            let len = w.len as u64;
            let sane = w.lap == lap_of(t, self.capacity)
                && len >= 8
                && len % 8 == 0
                && t % self.capacity + len <= self.capacity
                && t.checked_add(len).is_some_and(|e| e <= r);
            if !sane {
                break;
            }
            if w.kind == KIND_RECORD && w.state == STATE_CLAIMED && dead(w.rank) {
                let gone = w.with_state(STATE_LOST, w.rank);
                let ok = primitive::compare_exchange(
                    self.word0(t),
                    w.pack(),
                    gone.pack(),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                );
                if ok.is_ok() {
                    lost += 1;
                    primitive::fetch_add(&c.lost, 1, Ordering::Relaxed);
                    primitive::fetch_add(group.lost, 1, Ordering::Relaxed);
                    if let Some(rk) = group.ranks.get(w.rank as usize) {
                        primitive::fetch_add(&rk.lost, 1, Ordering::Relaxed);
                    }
                }
            }
            t += len;
        }
        self.unguard(me);
        self.advance_tail();
        lost
    }
}

impl Lane<'_> {
    /// A claimed record's fields, checked against `schema`, its sequence number and its
    /// producer's generation.
    pub(crate) fn decode(&self, schema: &Schema, claim: Claim) -> Result<(Spans, u64, u64)> {
        let hl = schema.record_header_len();
        let p = self.bytes(claim.pos, claim.word0.len as usize);
        primitive::reading(p.wrapping_add(8), hl - 8);
        let mut words = [0u8; RECORD_FIXED + 4 * MAX_FIELDS];
        // SAFETY: `p + 8 .. p + hl` is inside the record (check_word0: len >= hl, not
        // crossing the lane's end), which is committed (`head` past it, Acquire) and
        // claimed by this rank: the producer does not write it until it is released.
        unsafe { std::ptr::copy_nonoverlapping(p.add(8), words.as_mut_ptr().add(8), hl - 8) };
        let spans = decode_record(schema, &words[..hl], claim.word0.len)
            .map_err(|detail| self.bad(format!("record at {}: {detail}", claim.pos)))?;
        let word = |at: usize| u64::from_le_bytes(words[at..at + 8].try_into().expect("8 bytes"));
        Ok((spans, word(8), word(16)))
    }

    /// Field `(offset, count)` of the record at `pos`: its first byte.
    pub(crate) fn field_ptr(&self, pos: u64, len: u32, offset: u32) -> *mut u8 {
        self.bytes(pos, len as usize).wrapping_add(offset as usize)
    }
}

impl Group<'_> {
    /// What a rank sleeps on: the doorbell, with its own waiter flag.
    pub(crate) fn bell_of(&self, rank: usize) -> Doorbell<'_> {
        Doorbell {
            bell: self.doorbell,
            engine_waiting: &self.ranks[rank].waiting,
            action_seq: None,
        }
    }

    /// Rings the doorbell after a commit: one more on it (Release), and a wake if any
    /// rank's flag says it sleeps (`sync::post_all`'s Dekker, one flag per rank).
    pub(crate) fn ring(&self) {
        sync::post_all(&self.bell_of(0), 0, self.ranks.iter().map(|r| &r.waiting));
    }
}

/// The producer's side of a reserve and commit, on its lane (its own state: the head it
/// has committed to and its next sequence number).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pending {
    /// Where the record starts (after any pad).
    pub(crate) pos: u64,
    /// `head` once committed.
    pub(crate) end: u64,
    pub(crate) spans: Spans,
}

impl Lane<'_> {
    /// Writes the record's header (and a pad before it, when it would cross the lane's
    /// end) into unpublished space from `head`, which must be free (the caller waited).
    /// Nothing is visible until [`Lane::commit`].
    pub(crate) fn write_header(
        &self,
        head: u64,
        spans: Spans,
        schema_vars: &[u32],
        seq: u64,
        generation: u64,
        header_len: usize,
    ) -> Pending {
        let len = spans.len() as u64;
        let at = head % self.capacity;
        let pad = if self.capacity - at < len {
            self.capacity - at
        } else {
            0
        };
        if pad > 0 {
            let w = Word0 {
                len: pad as u32,
                kind: KIND_PAD,
                state: STATE_RELEASED,
                rank: 0,
                lap: lap_of(head, self.capacity),
            };
            primitive::writing(self.bytes(head, 8), 8);
            primitive::store(self.word0(head), w.pack(), Ordering::Relaxed);
        }
        let pos = head + pad;
        let p = self.bytes(pos, len as usize);
        primitive::writing(p, len as usize);
        let mut words = [0u8; RECORD_FIXED + 4 * MAX_FIELDS];
        words[8..16].copy_from_slice(&seq.to_le_bytes());
        words[16..24].copy_from_slice(&generation.to_le_bytes());
        for (i, n) in schema_vars.iter().enumerate() {
            words[RECORD_FIXED + 4 * i..][..4].copy_from_slice(&n.to_le_bytes());
        }
        // SAFETY: `p + 8 .. p + header_len` lies inside the record's span, which is free
        // space of the lane (tail passed it) that only this producer writes; readers look
        // at it only after `head` passes it (Release in `commit`).
        unsafe { std::ptr::copy_nonoverlapping(words.as_ptr().add(8), p.add(8), header_len - 8) };
        let w = Word0 {
            len: len as u32,
            kind: KIND_RECORD,
            state: STATE_READY,
            rank: 0,
            lap: lap_of(pos, self.capacity),
        };
        primitive::store(self.word0(pos), w.pack(), Ordering::Relaxed);
        Pending {
            pos,
            end: pos + len,
            spans,
        }
    }

    /// Publishes a written record: `head` (Release), then the lane's counters, then the
    /// consumers' doorbell.
    pub(crate) fn commit(&self, pending: &Pending, head_before: u64, group: &Group<'_>) {
        let c = self.ctrl;
        primitive::store(&c.head, pending.end, Ordering::Release);
        let n = primitive::load(&c.committed, Ordering::Relaxed);
        primitive::store(&c.committed, n + 1, Ordering::Relaxed);
        let b = primitive::load(&c.committed_bytes, Ordering::Relaxed);
        primitive::store(
            &c.committed_bytes,
            b + (pending.end - head_before),
            Ordering::Relaxed,
        );
        group.ring();
    }

    /// What the producer sleeps on while its lane is full.
    pub(crate) fn tail_seq(&self) -> SharedSeq<'_> {
        SharedSeq {
            counter: &self.ctrl.tail,
            low: low_half(&self.ctrl.tail),
            waiting: &self.ctrl.producer_waiting,
        }
    }

    /// Waits until `need` bytes from `head` are free (`tail` far enough), up to
    /// `timeout` (`Timeout` then): at once if they are, else `full` is called once and
    /// the producer sleeps on `tail` with its waiter flag, `check` between slices. A
    /// `tail` past `head` is `BadRecord`.
    pub(crate) fn wait_room(
        &self,
        head: u64,
        need: u64,
        policy: WaitPolicy,
        timeout: Duration,
        full: impl FnOnce(),
        check: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        let fits = |_: Ordering| -> Option<Result<()>> {
            // `tail`, or a rank's hazard below it (the bytes it examines stay).
            let t = self.room_limit();
            if t > head {
                return Some(Err(self.bad(format!("tail {t} past head {head}"))));
            }
            match head.checked_add(need) {
                Some(end) => (end - t <= self.capacity).then_some(Ok(())),
                None => Some(Err(self.bad(format!("head {head} + {need} overflows")))),
            }
        };
        if let Some(r) = fits(Ordering::Acquire) {
            return r;
        }
        full();
        sync::wait_until(
            &self.tail_seq(),
            fits,
            policy,
            timeout,
            "room in the stream's lane",
            check,
        )?
    }

    /// The room a record of `len` bytes needs from `head`: itself and a pad before it
    /// when it would cross the lane's end.
    pub(crate) fn needed(&self, head: u64, len: u64) -> u64 {
        let at = head % self.capacity;
        if self.capacity - at < len {
            self.capacity - at + len
        } else {
            len
        }
    }
}

// ---- The mapping ----

/// A mapped stream: its file (with the consumers' shared `flock`, if a consumer's), the
/// mapping, the validated layout.
struct Map {
    name: String,
    file: File,
    map: MmapRaw,
    layout: StreamLayout,
    /// (device, inode), to unlink only this object.
    identity: (u64, u64),
    /// The creator unlinks the name when it drops.
    owner: bool,
    pid: u32,
    /// The rank this mapping's consumer serves (its lock is this file's own, which a
    /// lock query through the same file does not see).
    rank: Option<u8>,
    /// Taken while this mapping's description holds a reaper's shared lock on a rank.
    reaping: Mutex<()>,
    /// The file's size once [`Map::check_size`] found it shorter than the mapping, else
    /// [`NOT_SHRUNK`]. The bytes past the end are gone for good: every later pop, reserve,
    /// commit, release, stats and drop sees it (one load) and touches nothing.
    shrunk_to: std::sync::atomic::AtomicU64,
}

/// [`Map::shrunk_to`] of a file not found shrunk.
const NOT_SHRUNK: u64 = u64::MAX;

// SAFETY: the mapping is shared memory whose words are accessed atomically and whose
// record bytes are handed out by the protocol (one writer before `head`, readers after);
// the raw pointer in `MmapRaw` is what keeps it from being Send/Sync by default.
unsafe impl Send for Map {}
// SAFETY: as above.
unsafe impl Sync for Map {}

impl Drop for Map {
    fn drop(&mut self) {
        self.unlink_if_owner();
        os::release_held(&self.file);
    }
}

impl Map {
    /// The creator's unlink of the stream's name (only this object of that name): when
    /// the creating consumer drops, even while views of records keep the mapping.
    fn unlink_if_owner(&self) {
        if self.owner && self.pid == os::current_pid() {
            if let Ok(Some(id)) = os::name_identity(&self.name) {
                if id == self.identity {
                    let _ = os::shm_unlink(&self.name);
                }
            }
        }
    }

    fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// `RegionTooSmall` if the stream's file is now shorter than this mapping: a process
    /// of the user truncated it, and touching the bytes past its end would SIGBUS. One
    /// `fstat`: called before each sleep of a wait (pops, reserves on a full lane), by
    /// `stats` and by the drops, never per record. A truncation between this check and
    /// an access of the mapping still faults (a tmpfs file cannot be sealed against
    /// shrinking). Once found, the answer sticks ([`Map::known_shrunk`]).
    fn check_size(&self) -> Result<()> {
        self.known_shrunk()?;
        // In a forked child the descriptor points at /dev/null (its fork handler), whose
        // size says nothing of the stream's file: only the flag is looked at there.
        if self.pid != os::current_pid() {
            return Ok(());
        }
        let (size, _, _) = os::file_identity(&self.file)?;
        if size < self.layout.file_size {
            self.shrunk_to
                .store(size, std::sync::atomic::Ordering::Relaxed);
            return Err(self.too_small(size));
        }
        Ok(())
    }

    /// `RegionTooSmall` if an earlier [`Map::check_size`] found the file truncated: one
    /// load, no system call, so the per-record paths can afford it.
    fn known_shrunk(&self) -> Result<()> {
        match self.shrunk_to.load(std::sync::atomic::Ordering::Relaxed) {
            NOT_SHRUNK => Ok(()),
            size => Err(self.too_small(size)),
        }
    }

    fn too_small(&self, actual: u64) -> Error {
        Error::RegionTooSmall {
            needed: self.layout.file_size,
            actual,
        }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: `off + 4 <= STREAM_HEADER_SIZE <= len`, 4-aligned (constant offsets);
        // the mapping lives as long as `self`; shared words are accessed atomically.
        unsafe { &*(self.base().add(off) as *const AtomicU32) }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: as `u32_at`, 8-aligned.
        unsafe { &*(self.base().add(off) as *const AtomicU64) }
    }

    fn group(&self) -> Group<'_> {
        // SAFETY: the rank table is `ranks` entries of 64 bytes from OFF_RANKS_TABLE,
        // inside the header (validated: ranks <= MAX_RANKS); 64-aligned; atomics only.
        let ranks = unsafe {
            std::slice::from_raw_parts(
                self.base().add(OFF_RANKS_TABLE) as *const RankCtrl,
                self.layout.ranks as usize,
            )
        };
        Group {
            doorbell: self.u32_at(OFF_DOORBELL),
            ranks,
            full_waits: self.u64_at(OFF_FULL_WAITS),
            lost: self.u64_at(OFF_LOST),
        }
    }

    fn lane(&self, i: u32) -> Lane<'_> {
        assert!(i < self.layout.lanes);
        let off = self.layout.lane_offset(i) as usize;
        // SAFETY: lane `i` lies inside the mapping (the layout was validated against the
        // file's size, the mapping is `file_size` long); its control block is 64-aligned
        // (header and stride are multiples of 64); its data follow for `capacity` bytes.
        unsafe {
            Lane {
                ctrl: &*(self.base().add(off) as *const LaneCtrl),
                data: self.base().add(off + std::mem::size_of::<LaneCtrl>()),
                capacity: self.layout.lane_capacity,
                index: i,
                ranks: self.group().ranks,
            }
        }
    }

    /// Opens stream `name` and waits (up to `timeout`) for its magic; validates it.
    fn open(name: &str, timeout: Duration) -> Result<Map> {
        let name = region::canonical_name(name)?;
        let deadline = Instant::now().checked_add(timeout);
        let mut backoff = Backoff::default();
        let file = os::shm_open(&name, true)?;
        let (bytes, size) = loop {
            let (size, _, _) = os::file_identity(&file)?;
            let mut b = vec![0u8; STREAM_HEADER_SIZE as usize];
            let n = os::read_at(&file, 0, &mut b)
                .map_err(|e| Error::io(format!("reading '{name}'"), e))?;
            b.truncate(n);
            if crate::layout::stream::stream_published(&b) {
                break (b, size);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                if n >= 8 && !crate::layout::stream::is_stream(&b) {
                    return Err(Error::BadMagic {
                        name,
                        found: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
                    });
                }
                return Err(Error::Timeout {
                    waited: timeout,
                    what: "the stream's creator to publish its header",
                });
            }
            backoff.snooze();
        };
        let layout = StreamLayout::validate(&name, &bytes, size)?;
        let map = os::map_shared(&file, layout.file_size as usize, os::MapAccess::ReadWrite)
            .map_err(|e| Error::io(format!("mmap '{name}'"), e))?;
        let (_, dev, ino) = os::file_identity(&file)?;
        os::hold_in_parent_only(&file);
        Ok(Map {
            name,
            file,
            map,
            layout,
            identity: (dev, ino),
            owner: false,
            pid: os::current_pid(),
            rank: None,
            reaping: Mutex::new(()),
            shrunk_to: NOT_SHRUNK.into(),
        })
    }

    /// Whether rank `k`'s consumer (or a record it popped) lives: its lock is held (the
    /// write lock: a reaper's brief shared hold is no consumer).
    fn rank_held(&self, k: u8) -> bool {
        // A failed query counts as alive: never release a live rank's records.
        self.rank == Some(k)
            || os::byte_holder(&self.file, RANK_LOCK + k as u64)
                .map_or(true, |h| h == os::ByteHolder::Writer)
    }

    /// Whether the stream's consumers can still take records: `Ok` while a rank is live;
    /// `PeerDied` (a live rank's lock is gone and no rank lives) or `PeerClosed`
    /// otherwise. `probe`: look at the locks, else only at the states.
    fn consumers(&self, probe: bool) -> Result<()> {
        let mut dead = None;
        for (k, r) in self.group().ranks.iter().enumerate() {
            if primitive::load(&r.state, Ordering::Acquire) != RANK_LIVE {
                continue;
            }
            if !probe || self.rank_held(k as u8) {
                return Ok(());
            }
            dead = Some(primitive::load(&r.owner, Ordering::Acquire) as u32);
        }
        Err(match dead {
            Some(pid) => Error::PeerDied {
                peer: Peer::Client,
                pid,
                pid_ns: PidNamespace::This,
                hint: "the stream's consumer died: its records will not be read",
            },
            None => Error::PeerClosed { peer: Peer::Client },
        })
    }

    /// Clears rank `k`'s hazard if the rank's process is gone. The reaper holds a shared
    /// lock on the rank's byte meanwhile (through this mapping's description, not the
    /// consumer's or producer's own): it is granted only while no process holds the rank
    /// (its holder is gone), and while it is held no process can take the rank over (that
    /// takes the write lock; `Consumer::attach` waits for it). So the hazard cleared is
    /// the dead process's, never one a new holder of the rank published (the same lane
    /// and position make the same word: a compare-and-swap alone could not tell them
    /// apart).
    fn clear_dead_hazard(&self, k: u8, r: &RankCtrl) {
        // In a forked child the descriptor points at /dev/null, whose locks say nothing.
        if self.pid != os::current_pid() {
            return;
        }
        // The reapers of one mapping take turns: the description's shared lock is one,
        // however many of its threads take it, and the first to let go would end it.
        let _turn = self.reaping.lock().unwrap_or_else(|e| e.into_inner());
        let byte = RANK_LOCK + k as u64;
        if !os::try_share_byte(&self.file, byte).unwrap_or(false) {
            return;
        }
        #[cfg(all(test, not(loom)))]
        race_tests::after_rank_verdict(k);
        let hz = primitive::load(&r.hazard, Ordering::Acquire);
        if hz != 0 {
            let _ =
                primitive::compare_exchange(&r.hazard, hz, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
        // An unlock of a byte this description holds does not fail; if it did, the rank
        // could not be taken over while this mapping lives.
        let _ = os::unlock_byte(&self.file, byte);
    }

    /// Whether rank `k` was served by a process that is gone (live or closed: a closed
    /// rank's process may still hold records it popped, until it dies).
    fn rank_dead(&self, k: u8) -> bool {
        let Some(r) = self.group().ranks.get(k as usize) else {
            return false;
        };
        primitive::load(&r.state, Ordering::Acquire) != 0 && !self.rank_held(k)
    }

    /// Releases, as lost, the records that dead ranks claimed and never released, in
    /// every lane (or in `only`); returns how many.
    fn reap(&self, only: Option<u32>) -> u64 {
        let g = self.group();
        // A dead rank's hazard would hold the producer back for good: clear it.
        for (k, r) in g.ranks.iter().enumerate() {
            let k = k as u8;
            if self.rank != Some(k)
                && primitive::load(&r.hazard, Ordering::Acquire) != 0
                && primitive::load(&r.state, Ordering::Acquire) != 0
            {
                self.clear_dead_hazard(k, r);
            }
        }
        let lanes = match only {
            Some(i) => i..i + 1,
            None => 0..self.layout.lanes,
        };
        lanes
            .map(|i| {
                #[cfg(all(test, not(loom)))]
                race_tests::before_lane_reap(i);
                // Each lane's verdicts are its own, taken after that lane's `read` is
                // loaded: a rank taken over meanwhile claimed its new records after its
                // lock was taken, so none of them lies below that `read`.
                let mut verdicts = [None::<bool>; 256];
                let mut dead =
                    |k: u8| *verdicts[k as usize].get_or_insert_with(|| self.rank_dead(k));
                self.lane(i).reap(self.rank, &g, &mut dead)
            })
            .sum()
    }
}

/// The descriptor a consumer's or producer's locks live on (the consumers' shared
/// `flock`, a rank's or a lane's OFD lock): an open file description of its own, never
/// mapped, and registered so that a child forked from this process does not keep it (its
/// copy points at /dev/null). The locks go when it drops (the consumer or producer
/// closes, or its process ends), whatever mappings (views) still live.
struct LockFd(File);

impl LockFd {
    fn of(file: &File) -> Result<LockFd> {
        let f = os::reopen(file)?;
        os::hold_in_parent_only(&f);
        Ok(LockFd(f))
    }
}

impl Drop for LockFd {
    fn drop(&mut self) {
        os::release_held(&self.0);
    }
}

/// Takes rank `rank`'s lock (the write lock on its byte) for a consumer attaching: whoever
/// holds it serves the rank (or still holds records it popped): `AlreadyAttached`. A
/// reaper clearing a dead rank's hazard holds it shared for a load and a
/// compare-and-swap (`Map::clear_dead_hazard`): that is waited for, up to `timeout` from
/// `started` but at least [`REAPER_GRACE`], then `Timeout`.
fn take_rank(
    locks: &LockFd,
    m: &Map,
    rank: u32,
    started: Instant,
    timeout: Duration,
) -> Result<()> {
    let byte = RANK_LOCK + rank as u64;
    let deadline = started.checked_add(timeout.max(REAPER_GRACE));
    let mut backoff = Backoff::default();
    loop {
        if os::try_lock_byte(&locks.0, byte)? {
            return Ok(());
        }
        match os::byte_holder(&locks.0, byte)? {
            os::ByteHolder::Writer => {
                return Err(Error::AlreadyAttached {
                    name: m.name.clone(),
                    pid: primitive::load(&m.group().ranks[rank as usize].owner, Ordering::Acquire)
                        as u32,
                    pid_ns: PidNamespace::This,
                })
            }
            // Let go between the two calls: take it now.
            os::ByteHolder::Free => continue,
            os::ByteHolder::Readers => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(Error::Timeout {
                        waited: started.elapsed(),
                        what: "a process clearing the dead rank's hazard to let the rank go",
                    });
                }
                #[cfg(all(test, not(loom)))]
                race_tests::attach_waits();
                backoff.snooze();
            }
        }
    }
}

/// The least a consumer attaching waits for a reaper's brief hold of its rank, whatever
/// its timeout (the hold lasts a load and a compare-and-swap, unless its process stops).
const REAPER_GRACE: Duration = Duration::from_millis(100);

/// `OutOfOrder` in a process forked from the one that made the handle: the lane or the
/// rank is the parent's (its locks stayed there).
fn not_forked(pid: u32) -> Result<()> {
    if pid == os::current_pid() {
        return Ok(());
    }
    Err(Error::OutOfOrder(
        "a stream handle used in a process forked from the one that made it",
    ))
}

/// This process as an owner word: `pid | (start_time as u32) << 32`.
fn me() -> Result<u64> {
    let pid = os::current_pid();
    let start = os::process_start_time(pid)
        .ok_or_else(|| Error::io("reading /proc/self/stat", std::io::ErrorKind::NotFound))?;
    Ok(pid as u64 | ((start as u32 as u64) << 32))
}

// ---- Consumers ----

/// A consumer: one rank of the stream's consumer group (rank 0 creates the stream).
/// Records popped are [`Record`]s, views into the lane valid until released (dropped).
pub struct Consumer {
    map: Arc<Map>,
    rank: u8,
    next_lane: std::sync::atomic::AtomicU32,
    policy: WaitPolicy,
    /// Set once a record broke the rules: every later pop gives this error.
    broken: Mutex<Option<(u32, String)>>,
    /// The rank's locks: they live while this consumer or a record it popped lives
    /// (never with a mapping alone).
    locks: Arc<LockFd>,
    /// Pops (and reaps) of this consumer from several threads take turns: the rank has
    /// one hazard word.
    turn: Mutex<()>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("name", &self.map.name)
            .field("rank", &self.rank)
            .finish()
    }
}

impl Consumer {
    /// Creates stream `name` (canonical as region names are: its namespace; `O_EXCL`,
    /// mode 0600) of `spec` and serves its rank 0. The stream's name is removed when this
    /// consumer drops (other ranks and producers keep their mappings).
    pub fn create(name: &str, spec: &StreamSpec) -> Result<Consumer> {
        let layout = StreamLayout::of(spec)?;
        let name = region::canonical_name(name)?;
        let file = os::shm_create(&name)?;
        struct Unlink<'a>(&'a str);
        impl Drop for Unlink<'_> {
            fn drop(&mut self) {
                let _ = os::shm_unlink(self.0);
            }
        }
        let guard = Unlink(&name);
        // The consumers' lock first: a sweep never takes a stream while one is held.
        let locks = LockFd::of(&file)?;
        os::lock_shared(&locks.0)?;
        os::reserve(&file, &name, layout.file_size)?;
        let map = os::map_shared(&file, layout.file_size as usize, os::MapAccess::Prefaulted)
            .map_err(|e| Error::io(format!("mmap '{name}'"), e))?;
        let bytes = layout.header_bytes();
        // SAFETY: the mapping is `file_size >= STREAM_HEADER_SIZE` bytes; nobody trusts
        // the object before its magic, which is still 0.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), map.as_mut_ptr(), bytes.len()) };
        let (_, dev, ino) = os::file_identity(&file)?;
        os::hold_in_parent_only(&file);
        let m = Map {
            name: name.clone(),
            file,
            map,
            layout,
            identity: (dev, ino),
            owner: true,
            pid: os::current_pid(),
            rank: Some(0),
            reaping: Mutex::new(()),
            shrunk_to: NOT_SHRUNK.into(),
        };
        if !os::try_lock_byte(&locks.0, RANK_LOCK)? {
            // Someone of this user opened the new file first and took the byte.
            return Err(Error::NameInUse {
                name: m.name.clone(),
            });
        }
        std::mem::forget(guard);
        let r0 = &m.group().ranks[0];
        primitive::store(&r0.owner, me()?, Ordering::Relaxed);
        primitive::store(&r0.state, RANK_LIVE, Ordering::Relaxed);
        // Publish: everything above happens-before a reader's Acquire of the magic.
        primitive::store(
            m.u64_at(0),
            crate::layout::stream::STREAM_MAGIC,
            Ordering::Release,
        );
        Ok(Consumer::new(m, 0, locks))
    }

    /// Serves rank `rank` of stream `name`'s group, waiting up to `timeout` for the
    /// stream to be published. A rank a live process serves is `AlreadyAttached`; one
    /// whose process died is taken over, its unreleased records released as lost first.
    pub fn attach(name: &str, rank: u32, timeout: Duration) -> Result<Consumer> {
        let started = Instant::now();
        let m = Map::open(name, timeout)?;
        if rank >= m.layout.ranks {
            return Err(Error::InvalidHeader {
                field: "ranks",
                reason: format!("rank {rank} of a group of {}", m.layout.ranks),
            });
        }
        let locks = LockFd::of(&m.file)?;
        os::lock_shared(&locks.0)?;
        let mine = me()?;
        let g = m.group();
        let entry = &g.ranks[rank as usize];
        take_rank(&locks, &m, rank, started, timeout)?;
        let served_before = primitive::load(&entry.state, Ordering::Acquire) != 0;
        primitive::store(&entry.owner, mine, Ordering::Release);
        if served_before {
            // A gone process's claims carry this rank: release them as lost before the
            // rank is live again (afterwards they would look like ours). Its hazard goes
            // first; no reaper clears ours while we hold the rank (`Map::reap`).
            primitive::store(&entry.hazard, 0, Ordering::Release);
            let gr = m.group();
            let mut dead = |k: u8| k as u32 == rank;
            for i in 0..m.layout.lanes {
                m.lane(i).reap(Some(rank as u8), &gr, &mut dead);
            }
        }
        primitive::store(&entry.state, RANK_LIVE, Ordering::Release);
        Ok(Consumer::new(m, rank as u8, locks))
    }

    fn new(mut map: Map, rank: u8, locks: LockFd) -> Consumer {
        map.rank = Some(rank);
        Consumer {
            map: Arc::new(map),
            locks: Arc::new(locks),
            rank,
            next_lane: Default::default(),
            policy: WaitPolicy::default(),
            broken: Mutex::new(None),
            turn: Mutex::new(()),
        }
    }

    pub fn name(&self) -> &str {
        &self.map.name
    }
    pub fn rank(&self) -> u32 {
        self.rank as u32
    }
    pub fn schema(&self) -> &Schema {
        &self.map.layout.schema
    }
    pub fn layout(&self) -> &StreamLayout {
        &self.map.layout
    }
    /// How pops wait (spin, then sleep): [`WaitPolicy::default`] unless set.
    pub fn set_wait_policy(&mut self, policy: WaitPolicy) {
        self.policy = policy;
    }

    /// Takes the next record of any lane (lanes in turn, so one busy producer cannot
    /// starve the others), without waiting. `None` when every lane is empty.
    pub fn try_pop(&self) -> Result<Option<Record>> {
        not_forked(self.map.pid)?;
        self.map.known_shrunk()?;
        let _turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((lane, detail)) = self.broken.lock().expect("not poisoned").clone() {
            return Err(Error::BadRecord { lane, detail });
        }
        let lanes = self.map.layout.lanes;
        let start = self.next_lane.load(Ordering::Relaxed) % lanes;
        let hl = self.map.layout.schema.record_header_len();
        for k in 0..lanes {
            let i = (start + k) % lanes;
            let lane = self.map.lane(i);
            let claimed = lane.try_claim(self.rank, hl).and_then(|c| match c {
                None => Ok(None),
                Some(claim) => self.decode(lane, claim).map(Some).inspect_err(|_| {
                    // Its counts break the rules: give its room back (nobody else could
                    // take it) before the consumer refuses every later pop.
                    lane.release(claim);
                }),
            });
            match claimed {
                Ok(None) => continue,
                Ok(Some(rec)) => {
                    self.next_lane.store((i + 1) % lanes, Ordering::Relaxed);
                    primitive::fetch_add(
                        &self.map.group().ranks[self.rank as usize].popped,
                        1,
                        Ordering::Relaxed,
                    );
                    return Ok(Some(rec));
                }
                Err(e) => {
                    if let Error::BadRecord { lane, detail } = &e {
                        *self.broken.lock().expect("not poisoned") = Some((*lane, detail.clone()));
                    }
                    return Err(e);
                }
            }
        }
        Ok(None)
    }

    /// The fields of a claimed record, checked against the schema.
    fn decode(&self, lane: Lane<'_>, claim: Claim) -> Result<Record> {
        let (spans, seq, producer) = lane.decode(&self.map.layout.schema, claim)?;
        Ok(Record {
            map: self.map.clone(),
            _locks: self.locks.clone(),
            lane: lane.index,
            claim,
            spans,
            seq,
            producer,
            released: false,
        })
    }

    /// Waits up to `timeout` for a record (`Ok(None)` once it passed). Between sleeps it
    /// releases, as lost, records that dead ranks claimed (§ the dead-rank rule).
    pub fn pop(&self, timeout: Duration) -> Result<Option<Record>> {
        let g = self.map.group();
        let bell = g.bell_of(self.rank as usize);
        let got = sync::wait_until(
            &bell,
            |_| match self.try_pop() {
                Ok(None) => None,
                other => Some(other),
            },
            self.policy,
            timeout,
            "a record",
            || {
                // Before the first sleep and after each slice, before the mapping is
                // touched again: a file truncated meanwhile is `RegionTooSmall`.
                self.map.check_size()?;
                let _turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
                self.map.reap(None);
                Ok(())
            },
        );
        match got {
            Ok(r) => r,
            Err(Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Up to `max_records` records: waits up to `timeout` for the first, then takes what
    /// is there without waiting. Empty once `timeout` passed with none.
    pub fn pop_batch(&self, max_records: usize, timeout: Duration) -> Result<Vec<Record>> {
        let mut out = Vec::new();
        if max_records == 0 {
            return Ok(out);
        }
        match self.pop(timeout)? {
            Some(r) => out.push(r),
            None => return Ok(out),
        }
        while out.len() < max_records {
            match self.try_pop()? {
                Some(r) => out.push(r),
                None => break,
            }
        }
        Ok(out)
    }

    /// Marks this rank closed (producers of a group with no live rank left get
    /// `PeerClosed`). Records still held stay valid until dropped.
    pub fn close(self) {}

    /// The stream's flow metrics (`RegionTooSmall` once the file was found truncated).
    pub fn stats(&self) -> Result<StreamStats> {
        self.map.check_size()?;
        Ok(StreamStats::of(&self.map))
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        // A truncated file's words are gone: nothing to mark (and touching them faults).
        if self.map.pid == os::current_pid() && self.map.check_size().is_ok() {
            let r = &self.map.group().ranks[self.rank as usize];
            primitive::store(&r.state, RANK_CLOSED, Ordering::Release);
            // Producers waiting for space look at the ranks between slices.
        }
        self.map.unlink_if_owner();
    }
}

/// A record claimed by a consumer: its fields are views into the lane, valid until the
/// record is released ([`Record::release`], or dropped).
pub struct Record {
    map: Arc<Map>,
    /// The rank's locks: a closed rank's records stay its own while they live.
    _locks: Arc<LockFd>,
    lane: u32,
    claim: Claim,
    spans: Spans,
    seq: u64,
    producer: u64,
    released: bool,
}

impl std::fmt::Debug for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Record")
            .field("lane", &self.lane)
            .field("seq", &self.seq)
            .field("len", &self.claim.word0.len)
            .finish()
    }
}

impl Record {
    /// The lane (producer slot) it came from.
    pub fn lane(&self) -> u32 {
        self.lane
    }
    /// Its producer's sequence number (0, 1, 2, ... per producer attach).
    pub fn seq(&self) -> u64 {
        self.seq
    }
    /// Its producer's lane generation: tells two producers of one lane apart.
    pub fn producer(&self) -> u64 {
        self.producer
    }
    /// Bytes the record takes in its lane.
    pub fn len(&self) -> usize {
        self.claim.word0.len as usize
    }
    pub fn is_empty(&self) -> bool {
        false
    }
    /// Element count of field `i` (`InvalidTensor` past the schema).
    pub fn count(&self, i: usize) -> Result<usize> {
        Ok(self.span(i)?.1 as usize)
    }

    fn span(&self, i: usize) -> Result<(u32, u32)> {
        if i >= self.spans.count() {
            return Err(Error::InvalidTensor {
                tensor: format!("field {i}"),
                reason: format!("the schema has {} fields", self.spans.count()),
            });
        }
        Ok(self.spans.field(i))
    }

    /// `RegionTooSmall` once the stream's file was found truncated (one load): the
    /// record's bytes are gone, and no new view of them may be made.
    pub fn check_mapped(&self) -> Result<()> {
        self.map.known_shrunk()
    }

    /// Field `i`: its address, element count and dtype (for DLPack).
    pub fn field_raw(&self, i: usize) -> Result<(*const u8, usize, DType)> {
        self.map.known_shrunk()?;
        let (off, n) = self.span(i)?;
        let dtype = self.map.layout.schema.fields()[i].dtype;
        let lane = self.map.lane(self.lane);
        let p = lane.field_ptr(self.claim.pos, self.claim.word0.len, off);
        Ok((p, n as usize, dtype))
    }

    /// Field `i`'s bytes.
    pub fn bytes(&self, i: usize) -> Result<&[u8]> {
        let (p, n, dtype) = self.field_raw(i)?;
        let len = n * dtype.size();
        primitive::reading(p, len);
        // SAFETY: decode_record placed the field inside the record, committed and
        // claimed by this rank: nobody writes it until this record is released, which
        // needs `self` (by value or dropped), so not while the borrow lives.
        Ok(unsafe { std::slice::from_raw_parts(p, len) })
    }

    /// Field `i` as elements of `T` (one of the types of its dtype, as for tensors):
    /// `DTypeMismatch` otherwise.
    pub fn field<T: Element>(&self, i: usize) -> Result<&[T]> {
        let b = self.bytes(i)?;
        check_element::<T>(&self.map.layout.schema, i)?;
        Ok(bytemuck::cast_slice(b))
    }

    /// Releases the record: its space goes back to the producer.
    pub fn release(mut self) {
        self.release_now();
    }

    fn release_now(&mut self) {
        // In a child forked from the consumer's process the record is still the parent's;
        // in a file found truncated its words are gone.
        if self.map.pid != os::current_pid() || self.map.known_shrunk().is_err() {
            self.released = true;
            return;
        }
        if !std::mem::replace(&mut self.released, true) {
            let lane = self.map.lane(self.lane);
            if lane.release(self.claim) {
                let r = &self.map.group().ranks[self.claim.word0.rank as usize];
                primitive::fetch_add(&r.released, 1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        self.release_now();
    }
}

/// `DTypeMismatch` unless `T` views field `i`'s dtype (`i` is in the schema).
fn check_element<T: Element>(schema: &Schema, i: usize) -> Result<()> {
    let f = &schema.fields()[i];
    if T::DTYPES.contains(&f.dtype) {
        return Ok(());
    }
    Err(Error::DTypeMismatch {
        tensor: f.name.clone(),
        requested: T::NAME,
        actual: f.dtype.name(),
    })
}

// ---- Producers ----

struct ProducerState {
    head: u64,
    seq: u64,
    pending: bool,
}

struct ProducerInner {
    map: Arc<Map>,
    lane: u32,
    generation: u64,
    owner: u64,
    policy: WaitPolicy,
    /// The lane's lock, until the producer closes (`None` then: an open reservation's
    /// commit publishes nothing).
    locks: Mutex<Option<LockFd>>,
    state: Mutex<ProducerState>,
}

/// A producer: the one writer of a lane of a stream.
pub struct Producer(Arc<ProducerInner>);

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("name", &self.0.map.name)
            .field("lane", &self.0.lane)
            .finish()
    }
}

impl Producer {
    /// Attaches to stream `name` (waiting up to `timeout` for it to be published) and
    /// claims a lane: a free one, or one whose producer died (its committed records are
    /// still delivered; what it had reserved was never visible). `schema`, if given, must
    /// be the stream's (`SchemaMismatch`). `NoFreeLane` when every lane has a live
    /// producer.
    pub fn attach(name: &str, schema: Option<&Schema>, timeout: Duration) -> Result<Producer> {
        let map = Map::open(name, timeout)?;
        if let Some(s) = schema {
            if *s != map.layout.schema {
                return Err(Error::SchemaMismatch {
                    stream: map.name.clone(),
                    theirs: map.layout.schema.to_string(),
                    ours: s.to_string(),
                });
            }
        }
        let mine = me()?;
        let locks = LockFd::of(&map.file)?;
        for i in 0..map.layout.lanes {
            let lane = map.lane(i);
            // The lane's lock: free, or let go by a producer that ended (the next one
            // goes on from its `head`).
            if !os::try_lock_byte(&locks.0, LANE_LOCK + i as u64)? {
                continue;
            }
            primitive::store(&lane.ctrl.owner, mine, Ordering::Release);
            let generation = primitive::fetch_add(&lane.ctrl.generation, 1, Ordering::AcqRel) + 1;
            let head = primitive::load(&lane.ctrl.head, Ordering::Acquire);
            let tail = primitive::load(&lane.ctrl.tail, Ordering::Acquire);
            if tail > head || head - tail > lane.capacity || head % 8 != 0 {
                primitive::store(&lane.ctrl.owner, 0, Ordering::Release);
                // Dropping `locks` lets the lane go.
                return Err(lane.bad(format!("tail {tail} against head {head}")));
            }
            if tail % 8 != 0 {
                primitive::store(&lane.ctrl.owner, 0, Ordering::Release);
                return Err(lane.bad(format!("tail {tail} not 8-aligned")));
            }
            return Ok(Producer(Arc::new(ProducerInner {
                lane: i,
                generation,
                owner: mine,
                policy: WaitPolicy::default(),
                locks: Mutex::new(Some(locks)),
                state: Mutex::new(ProducerState {
                    head,
                    seq: 0,
                    pending: false,
                }),
                map: Arc::new(map),
            })));
        }
        Err(Error::NoFreeLane {
            stream: map.name.clone(),
            lanes: map.layout.lanes,
        })
    }

    pub fn name(&self) -> &str {
        &self.0.map.name
    }
    pub fn lane(&self) -> u32 {
        self.0.lane
    }
    pub fn schema(&self) -> &Schema {
        &self.0.map.layout.schema
    }
    /// The largest record a lane holds, in bytes: half the lane.
    pub fn max_record(&self) -> u64 {
        max_record(self.0.map.layout.lane_capacity)
    }
    /// How a full lane is waited for: [`WaitPolicy::default`] unless set.
    pub fn set_wait_policy(&mut self, policy: WaitPolicy) {
        if let Some(inner) = Arc::get_mut(&mut self.0) {
            inner.policy = policy;
        }
    }

    /// Reserves a record whose variable fields have `lengths` elements (one per variable
    /// field, schema order), waiting up to `timeout` for room: `Full` after it,
    /// `PeerDied`/`PeerClosed` when no consumer is left (seen within a sleep slice),
    /// `RecordTooLarge` for a record larger than a lane, `InvalidTensor` for a wrong
    /// number of lengths, `OutOfOrder` while another reservation of this producer is
    /// open. The fields are written in place; nothing is visible before
    /// [`Reservation::commit`], and a reservation dropped uncommitted leaves nothing.
    pub fn reserve(&self, lengths: &[u32], timeout: Duration) -> Result<Reservation> {
        self.reserve_counted(lengths, timeout, true)
    }

    /// Reserves, copies `fields` (each field's bytes, schema order, native byte order)
    /// into place and commits: one record, whose variable lengths follow from the sizes
    /// ([`Schema::lengths_of`]). Returns its sequence number. Errors as
    /// [`Producer::reserve`], and `InvalidTensor` for sizes that fit no record of the
    /// schema (nothing is reserved then).
    pub fn push(&self, fields: &[&[u8]], timeout: Duration) -> Result<u64> {
        let sizes: Vec<usize> = fields.iter().map(|f| f.len()).collect();
        let lengths = self.0.map.layout.schema.lengths_of(&sizes)?;
        let mut res = self.reserve(&lengths, timeout)?;
        res.write_fields(fields)?;
        let seq = res.seq();
        res.commit();
        Ok(seq)
    }

    /// [`Producer::reserve`]; a full lane counts in `full_waits` only when `count_full`
    /// (a caller that waits in several slices counts its first).
    pub(crate) fn reserve_counted(
        &self,
        lengths: &[u32],
        timeout: Duration,
        count_full: bool,
    ) -> Result<Reservation> {
        let inner = &self.0;
        let map = &inner.map;
        let spans = map
            .layout
            .schema
            .spans(lengths, max_record(map.layout.lane_capacity))?;
        not_forked(map.pid)?;
        map.known_shrunk()?;
        map.consumers(false)?;
        let mut st = inner.state.lock().expect("not poisoned");
        if st.pending {
            return Err(Error::OutOfOrder(
                "a reservation of this producer is still open",
            ));
        }
        let lane = map.lane(inner.lane);
        let head = st.head;
        let need = lane.needed(head, spans.len() as u64);
        let waited = lane.wait_room(
            head,
            need,
            inner.policy,
            timeout,
            || {
                if count_full {
                    primitive::fetch_add(map.group().full_waits, 1, Ordering::Relaxed);
                }
            },
            || {
                // Before the first sleep and after each slice, as the consumer's pop.
                map.check_size()?;
                map.reap(Some(inner.lane));
                map.consumers(true)
            },
        );
        match waited {
            Ok(()) => {}
            Err(Error::Timeout { waited, .. }) => {
                let t = primitive::load(&lane.ctrl.tail, Ordering::Acquire);
                return Err(Error::Full {
                    lane: inner.lane,
                    needed: need,
                    free: lane.capacity.saturating_sub(head.saturating_sub(t)),
                    waited,
                });
            }
            Err(e) => return Err(e),
        }
        let vars: Vec<u32> = lengths.to_vec();
        let pending = lane.write_header(
            head,
            spans,
            &vars,
            st.seq,
            inner.generation,
            map.layout.schema.record_header_len(),
        );
        st.pending = true;
        Ok(Reservation {
            producer: inner.clone(),
            head,
            pending,
            done: false,
        })
    }

    /// The stream's flow metrics (`RegionTooSmall` once the file was found truncated).
    pub fn stats(&self) -> Result<StreamStats> {
        self.0.map.check_size()?;
        Ok(StreamStats::of(&self.0.map))
    }
}

impl Drop for Producer {
    /// Frees the lane, even while views (a [`Mapping`]) or an open reservation live: that
    /// reservation's commit then publishes nothing.
    fn drop(&mut self) {
        let inner = &self.0;
        // Taken under the state lock: a commit in flight finishes first, a later one
        // sees the lane gone.
        let _st = inner.state.lock().unwrap_or_else(|e| e.into_inner());
        if inner.map.pid == os::current_pid() && inner.map.check_size().is_ok() {
            let lane = inner.map.lane(inner.lane);
            let _ = primitive::compare_exchange(
                &lane.ctrl.owner,
                inner.owner,
                0,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
        inner.locks.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// A reserved record: its fields are this producer's to write until [`commit`]; dropped
/// uncommitted, it leaves nothing behind.
///
/// [`commit`]: Reservation::commit
pub struct Reservation {
    producer: Arc<ProducerInner>,
    head: u64,
    pending: Pending,
    done: bool,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("lane", &self.producer.lane)
            .field("pos", &self.pending.pos)
            .field("len", &self.pending.spans.len())
            .finish()
    }
}

impl Reservation {
    /// The producer's sequence number of this record.
    pub fn seq(&self) -> u64 {
        self.producer.state.lock().expect("not poisoned").seq
    }

    /// Field `i`: its address, element count and dtype.
    pub fn field_raw(&mut self, i: usize) -> Result<(*mut u8, usize, DType)> {
        let map = &self.producer.map;
        map.known_shrunk()?;
        if i >= self.pending.spans.count() {
            return Err(Error::InvalidTensor {
                tensor: format!("field {i}"),
                reason: format!("the schema has {} fields", self.pending.spans.count()),
            });
        }
        let (off, n) = self.pending.spans.field(i);
        let lane = map.lane(self.producer.lane);
        let p = lane.field_ptr(self.pending.pos, self.pending.spans.len(), off);
        Ok((p, n as usize, map.layout.schema.fields()[i].dtype))
    }

    /// Field `i`'s bytes, to write.
    pub fn bytes_mut(&mut self, i: usize) -> Result<&mut [u8]> {
        let (p, n, dtype) = self.field_raw(i)?;
        // SAFETY: the field lies inside the reserved record (Schema::spans), free space
        // of this producer's lane that nobody reads before the commit; `&mut self` makes
        // the borrow exclusive, and the commit consumes `self`.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, n * dtype.size()) })
    }

    /// Field `i` as elements of `T` (one of the types of its dtype): `DTypeMismatch`
    /// otherwise.
    pub fn field_mut<T: Element>(&mut self, i: usize) -> Result<&mut [T]> {
        let map = self.producer.map.clone();
        let b = self.bytes_mut(i)?;
        check_element::<T>(&map.layout.schema, i)?;
        Ok(bytemuck::cast_slice_mut(b))
    }

    /// Copies `fields` (each field's bytes, schema order) into the record: each must be
    /// exactly its field's size in this reservation (`InvalidTensor` otherwise, before
    /// anything is copied).
    pub fn write_fields(&mut self, fields: &[&[u8]]) -> Result<()> {
        let spans = &self.pending.spans;
        let schema = self.producer.map.layout.schema.fields();
        let sizes_fit = fields.len() == spans.count()
            && fields
                .iter()
                .zip(schema)
                .enumerate()
                .all(|(i, (src, f))| src.len() == spans.field(i).1 as usize * f.dtype.size());
        if !sizes_fit {
            return Err(Error::InvalidTensor {
                tensor: "<fields>".into(),
                reason: "the fields' sizes are not those reserved".into(),
            });
        }
        for (i, src) in fields.iter().enumerate() {
            self.bytes_mut(i)?.copy_from_slice(src);
        }
        Ok(())
    }

    /// Publishes the record (one Release store of the lane's `head`) and wakes a
    /// sleeping consumer.
    /// Nothing is published when the producer was closed meanwhile, in a process forked
    /// from the producer's (the lane is not this one's), or once the stream's file was
    /// found truncated (`RegionTooSmall`: its words are gone).
    pub fn commit(mut self) {
        let p = &self.producer;
        let map = &p.map;
        let mut st = p.state.lock().unwrap_or_else(|e| e.into_inner());
        let held = p.locks.lock().unwrap_or_else(|e| e.into_inner()).is_some();
        if !held || map.pid != os::current_pid() || map.known_shrunk().is_err() {
            st.pending = false;
            self.done = true;
            return;
        }
        let lane = map.lane(p.lane);
        lane.commit(&self.pending, self.head, &map.group());
        st.head = self.pending.end;
        st.seq += 1;
        st.pending = false;
        self.done = true;
    }

    /// Drops the record: nothing was published.
    pub fn abort(self) {}
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.done {
            self.producer.state.lock().expect("not poisoned").pending = false;
        }
    }
}

// ---- Views handed to other owners ----

/// Keeps a stream's mapping in this process alive, for views of its records handed to
/// other owners (the Python layer's NumPy and DLPack views): the memory stays mapped
/// while a `Mapping` lives, even after the consumer or producer that gave it dropped.
#[derive(Clone)]
pub struct Mapping(Arc<Map>);

impl Mapping {
    /// The first byte of the mapping (the stream header's) and the mapping's length: the
    /// addresses of [`Record::field_raw`] and [`Reservation::field_raw`] lie inside.
    pub fn span(&self) -> (*mut u8, usize) {
        (self.0.base(), self.0.layout.file_size as usize)
    }

    /// The stream's validated layout (where each lane's data start).
    pub fn layout(&self) -> &StreamLayout {
        &self.0.layout
    }
}

impl Consumer {
    /// A handle that keeps this stream's mapping alive ([`Mapping`]).
    pub fn mapping(&self) -> Mapping {
        Mapping(self.map.clone())
    }
}

impl Producer {
    /// A handle that keeps this stream's mapping alive ([`Mapping`]).
    pub fn mapping(&self) -> Mapping {
        Mapping(self.0.map.clone())
    }
}

// ---- Flow metrics ----

/// One lane's flow metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaneStats {
    /// The producer's pid, 0 when free.
    pub producer_pid: u32,
    pub records_committed: u64,
    pub bytes_committed: u64,
    pub records_released: u64,
    pub records_lost: u64,
    /// Bytes between `tail` and `head`: committed and not yet released.
    pub bytes_in_use: u64,
}

/// One rank's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankStats {
    pub pid: u32,
    /// 0 never attached, 1 live, 2 closed.
    pub state: u32,
    pub popped: u64,
    pub released: u64,
    /// Its records released by others after it died.
    pub lost: u64,
}

/// A stream's flow metrics, read from its live words.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamStats {
    pub lanes: Vec<LaneStats>,
    pub ranks: Vec<RankStats>,
    /// Records committed and not yet released or lost.
    pub depth: u64,
    pub bytes_in_use: u64,
    /// Reserves that found their lane full and waited.
    pub full_waits: u64,
    /// Records that dead ranks claimed and survivors released.
    pub records_lost: u64,
}

impl StreamStats {
    /// Read through the mapping (a consumer's or producer's, checked not truncated).
    fn of(map: &Map) -> StreamStats {
        let ld = |w: &AtomicU64| primitive::load(w, Ordering::Relaxed);
        let g = map.group();
        let lanes: Vec<LaneStats> = (0..map.layout.lanes)
            .map(|i| {
                let c = map.lane(i).ctrl;
                LaneStats {
                    producer_pid: ld(&c.owner) as u32,
                    records_committed: ld(&c.committed),
                    bytes_committed: ld(&c.committed_bytes),
                    records_released: ld(&c.released),
                    records_lost: ld(&c.lost),
                    bytes_in_use: ld(&c.head).saturating_sub(ld(&c.tail)),
                }
            })
            .collect();
        let ranks = g
            .ranks
            .iter()
            .map(|r| RankStats {
                pid: ld(&r.owner) as u32,
                state: primitive::load(&r.state, Ordering::Relaxed),
                popped: ld(&r.popped),
                released: ld(&r.released),
                lost: ld(&r.lost),
            })
            .collect();
        StreamStats::from_parts(lanes, ranks, ld(g.full_waits), ld(g.lost))
    }

    fn from_parts(
        lanes: Vec<LaneStats>,
        ranks: Vec<RankStats>,
        full_waits: u64,
        records_lost: u64,
    ) -> StreamStats {
        StreamStats {
            depth: lanes
                .iter()
                .map(|l| {
                    l.records_committed
                        .saturating_sub(l.records_released.saturating_add(l.records_lost))
                })
                .fold(0u64, u64::saturating_add),
            bytes_in_use: lanes
                .iter()
                .map(|l| l.bytes_in_use)
                .fold(0u64, u64::saturating_add),
            lanes,
            ranks,
            full_waits,
            records_lost,
        }
    }

    /// Read from the file with `pread` (an observer's: the stream is never mapped, so a
    /// file truncated meanwhile is `RegionTooSmall`, never a SIGBUS): the header page
    /// (the rank table and the stream-wide words) in one read, then each lane's control
    /// words in one read each.
    fn read(name: &str, file: &File, layout: &StreamLayout, header: &[u8]) -> Result<StreamStats> {
        let u64_in = |b: &[u8], at: usize| {
            b.get(at..at + 8)
                .map_or(0, |w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        };
        let u32_in = |b: &[u8], at: usize| {
            b.get(at..at + 4)
                .map_or(0, |w| u32::from_le_bytes(w.try_into().expect("4 bytes")))
        };
        const CTRL_READ: usize = std::mem::offset_of!(LaneCtrl, producer_waiting);
        let mut ctrl = [0u8; CTRL_READ];
        let mut lanes = Vec::with_capacity(layout.lanes as usize);
        for i in 0..layout.lanes {
            let n = os::read_at(file, layout.lane_offset(i), &mut ctrl)
                .map_err(|e| Error::io(format!("reading '{name}'"), e))?;
            if n < CTRL_READ {
                let (actual, _, _) = os::file_identity(file)?;
                return Err(Error::RegionTooSmall {
                    needed: layout.file_size,
                    actual,
                });
            }
            let w = |field: usize| u64_in(&ctrl, field);
            lanes.push(LaneStats {
                producer_pid: w(std::mem::offset_of!(LaneCtrl, owner)) as u32,
                records_committed: w(std::mem::offset_of!(LaneCtrl, committed)),
                bytes_committed: w(std::mem::offset_of!(LaneCtrl, committed_bytes)),
                records_released: w(std::mem::offset_of!(LaneCtrl, released)),
                records_lost: w(std::mem::offset_of!(LaneCtrl, lost)),
                bytes_in_use: w(std::mem::offset_of!(LaneCtrl, head))
                    .saturating_sub(w(std::mem::offset_of!(LaneCtrl, tail))),
            });
        }
        let ranks = (0..layout.ranks as usize)
            .map(|k| {
                let at = OFF_RANKS_TABLE + k * RANK_ENTRY_SIZE;
                RankStats {
                    pid: u64_in(header, at + std::mem::offset_of!(RankCtrl, owner)) as u32,
                    state: u32_in(header, at + std::mem::offset_of!(RankCtrl, state)),
                    popped: u64_in(header, at + std::mem::offset_of!(RankCtrl, popped)),
                    released: u64_in(header, at + std::mem::offset_of!(RankCtrl, released)),
                    lost: u64_in(header, at + std::mem::offset_of!(RankCtrl, lost)),
                }
            })
            .collect();
        Ok(StreamStats::from_parts(
            lanes,
            ranks,
            u64_in(header, OFF_FULL_WAITS),
            u64_in(header, OFF_LOST),
        ))
    }
}

/// The flow metrics of stream `name`, for an observer: the file is opened read-only and
/// read with `pread`, never mapped (a stream truncated meanwhile is `RegionTooSmall`,
/// never a SIGBUS); nothing is written, no lane or rank is taken. A stream not yet
/// published is `Timeout`; a file under the name that is no stream, `BadMagic`.
pub fn stats(name: &str) -> Result<StreamStats> {
    let name = region::canonical_name(name)?;
    let file = os::shm_open(&name, false)?;
    let (size, _, _) = os::file_identity(&file)?;
    let mut header = vec![0u8; STREAM_HEADER_SIZE as usize];
    let n = os::read_at(&file, 0, &mut header)
        .map_err(|e| Error::io(format!("reading '{name}'"), e))?;
    header.truncate(n);
    if !crate::layout::stream::stream_published(&header) {
        if n >= 8 && !crate::layout::stream::is_stream(&header) {
            return Err(Error::BadMagic {
                name,
                found: u64::from_le_bytes(header[..8].try_into().expect("8 bytes")),
            });
        }
        return Err(Error::Timeout {
            waited: Duration::ZERO,
            what: "the stream's creator to publish its header",
        });
    }
    let layout = StreamLayout::validate(&name, &header, size)?;
    StreamStats::read(&name, &file, &layout, &header)
}

/// The names of the streams of this process's region namespace (`SHMBRIDGE_NAMESPACE`)
/// in /dev/shm, sorted: every name whose header (read with `pread`) carries a stream's
/// tag, published or not. Names that cannot be read are left out.
pub fn names() -> Result<Vec<String>> {
    Ok(region::list_names()?
        .into_iter()
        .filter(|n| {
            region::read_header_bytes(n)
                .is_ok_and(|(bytes, _)| crate::layout::stream::is_stream(&bytes))
        })
        .collect())
}

#[cfg(all(test, not(loom)))]
#[path = "stream_race_tests.rs"]
mod race_tests;
