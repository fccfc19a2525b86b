//! The live words of a stats block (1.7, `docs/protocol.md` §3.8): the engine's write
//! sequence, which brackets what it writes outside a step, and the episodes it saw end,
//! under a sequence of their own; and the rule by which read-only observers copy
//! engine→client tensors consistently while the engine runs.
//!
//! A step needs no word of its own: the engine writes engine→client tensors only between
//! the client's action `n` (`action_seq`) and its frame `n` (`frame_seq`), so the two
//! counters are a seqlock already (equal: no step under way). The engine's one duty is
//! [`step_writes_begin`] (a release fence, no instruction on x86) between seeing the
//! action and its first write. What it writes at other times, a command's handler (a
//! reset rewrites the observations with both counters unchanged), is bracketed by the
//! write sequence: odd while it writes. Each sequence is a seqlock with one writer (the
//! engine, or the block's shard); the stats sequence is odd while it records an episode.
//! [`Stats::begin_write`] stores the odd value and then issues a release fence, so a
//! reader that sees any byte written after it also sees the odd value when it looks
//! again; [`Stats::end_write`] stores the even value with Release. A reader
//! ([`read_between_writes`], [`read_consistent`]) loads the words (Acquire), copies,
//! issues an acquire fence and loads them again: unchanged (and no write open) means no
//! write overlapped the copy. The engine never waits for a reader and never reads what a
//! reader does (an observer maps the region read-only): per step it pays the fence only.
//!
//! Every access goes through [`crate::primitive`], so the loom models
//! (`src/loom_tests.rs`) run this very code.

use std::marker::PhantomData;
use std::ptr::NonNull;

use crate::layout::{stats_offsets as off, MAX_SHARDS, RECENT_EPISODES};
use crate::primitive::{self, fence, AtomicU64, Ordering};

/// A view of one stats block in a mapping.
#[derive(Clone, Copy)]
pub struct Stats<'a> {
    base: NonNull<u8>,
    _mapping: PhantomData<&'a [u8]>,
}

impl std::fmt::Debug for Stats<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stats")
            .field(
                "write_seq",
                &primitive::load(self.write_seq(), Ordering::Relaxed),
            )
            .finish_non_exhaustive()
    }
}

impl<'a> Stats<'a> {
    /// A view of the stats block at `base`.
    ///
    /// # Safety
    ///
    /// `base` is 8-byte aligned and points to at least
    /// [`STATS_BLOCK_SIZE`](crate::layout::STATS_BLOCK_SIZE) bytes of a mapping that
    /// stays mapped for `'a`, whose words every party accesses only atomically. A view
    /// of a read-only mapping is only ever loaded from (observers call no writing
    /// method).
    #[inline]
    pub(crate) unsafe fn new(base: NonNull<u8>) -> Stats<'a> {
        Stats {
            base,
            _mapping: PhantomData,
        }
    }

    #[inline]
    fn u64(&self, offset: usize) -> &'a AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= crate::layout::STATS_BLOCK_SIZE);
        // SAFETY: `new`'s contract: the block is 8-aligned, STATS_BLOCK_SIZE long and
        // mapped for `'a`; every offset used here is a constant 8-aligned word inside it.
        unsafe { &*(self.base.as_ptr().add(offset) as *const AtomicU64) }
    }

    /// The write sequence: odd while the engine writes engine→client tensors.
    #[inline]
    pub fn write_seq(&self) -> &'a AtomicU64 {
        self.u64(off::WRITE_SEQ)
    }

    /// The stats sequence: odd while the engine records an episode.
    #[inline]
    pub fn stats_seq(&self) -> &'a AtomicU64 {
        self.u64(off::STATS_SEQ)
    }

    /// Engine: about to write engine→client tensors outside a step (a command's
    /// handler). Opens a write window unless one is open; returns whether it opened one. The release fence after
    /// the odd store orders it before every later store of this thread: a reader whose
    /// copy saw one of them sees the odd value (or a later one) when it checks.
    #[inline]
    pub fn begin_write(&self) -> bool {
        let seq = self.write_seq();
        let s = primitive::load(seq, Ordering::Relaxed);
        if s & 1 == 1 {
            return false;
        }
        primitive::store(seq, s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        true
    }

    /// Engine: the writes are done (the command answered). Closes the open window, if any (Release: a reader that sees the even value sees
    /// every write made inside the window).
    #[inline]
    pub fn end_write(&self) {
        let seq = self.write_seq();
        let s = primitive::load(seq, Ordering::Relaxed);
        if s & 1 == 1 {
            primitive::store(seq, s.wrapping_add(1), Ordering::Release);
        }
    }

    /// Engine: env `env` (its index in the region) ended an episode of return
    /// `episode_return` after `length` steps. Bracketed by the stats sequence, not the
    /// write sequence: whenever it is called, readers of the totals see none or all of it.
    pub fn record_episode(&self, env: u32, episode_return: f64, length: u64) {
        let relaxed = Ordering::Relaxed;
        let seq = self.stats_seq();
        let s = primitive::load(seq, relaxed);
        primitive::store(seq, s.wrapping_add(1), relaxed);
        fence(Ordering::Release);
        let j = primitive::load(self.u64(off::EPISODES), relaxed);
        let entry = off::RECENT + (j % RECENT_EPISODES as u64) as usize * off::ENTRY;
        let length32 = u32::try_from(length).unwrap_or(u32::MAX);
        primitive::store(self.u64(entry), episode_return.to_bits(), relaxed);
        primitive::store(
            self.u64(entry + 8),
            u64::from(length32) | u64::from(env) << 32,
            relaxed,
        );
        let sum = f64::from_bits(primitive::load(self.u64(off::RETURN_SUM), relaxed));
        primitive::store(
            self.u64(off::RETURN_SUM),
            (sum + episode_return).to_bits(),
            relaxed,
        );
        let lengths = primitive::load(self.u64(off::LENGTH_SUM), relaxed);
        primitive::store(
            self.u64(off::LENGTH_SUM),
            lengths.wrapping_add(length),
            relaxed,
        );
        primitive::store(self.u64(off::EPISODES), j.wrapping_add(1), relaxed);
        primitive::store(seq, s.wrapping_add(2), Ordering::Release);
    }
}

/// Engine: it has seen the client's next action (an Acquire load of `action_seq`) and is
/// about to write that step's engine→client tensors. A release fence: every later store
/// of this thread is ordered after that load, so an observer whose copy saw one of them
/// sees the new `action_seq` when it checks again ([`read_between_writes`]). It compiles
/// to no instruction on x86; it is what the models check on weaker machines.
#[inline(always)]
pub fn step_writes_begin() {
    fence(Ordering::Release);
}

/// A sequence word as a reader loads it: an atomic of a mapping (the loom models, the
/// unit tests), or, for an observer, one `pread` of the region file, which fails
/// (`RegionTooSmall`) where a load through a mapping of a truncated file would be a
/// SIGBUS.
pub trait SeqWord {
    type Error;
    /// The word's value, loaded with `order` (Acquire or Relaxed).
    fn load(&self, order: Ordering) -> Result<u64, Self::Error>;
}

impl SeqWord for &AtomicU64 {
    type Error = std::convert::Infallible;
    #[inline]
    fn load(&self, order: Ordering) -> Result<u64, Self::Error> {
        Ok(primitive::load(*self, order))
    }
}

/// One attempt at copying engine→client tensors while no engine writes them: the
/// engines' write sequences `write_seqs` are even, and the frame every engine published
/// (`frame_seqs`) is the client's last action (`action_seq`), with no shard's own action
/// (`shard_actions`, 1.10: empty where the region has none) past it, so no step is under
/// way;
/// `read` copies, given that frame number; then nothing may have moved. `None` if an
/// engine was writing when it began or wrote while `read` ran (the caller tries again
/// later); else what `read` returned. `read` may see torn values, which are then thrown
/// away: it must not trust them (bounds, lengths) beyond copying. A word that cannot be
/// loaded is an error at once.
pub fn read_between_writes<W: SeqWord, T>(
    write_seqs: &[W],
    action_seq: W,
    shard_actions: &[W],
    frame_seqs: &[W],
    read: impl FnOnce(u64) -> T,
) -> Result<Option<T>, W::Error> {
    let mut before = [0u64; MAX_SHARDS];
    for (seen, seq) in before.iter_mut().zip(write_seqs) {
        *seen = seq.load(Ordering::Acquire)?;
        if *seen & 1 == 1 {
            return Ok(None);
        }
    }
    let action = action_seq.load(Ordering::Acquire)?;
    // A shard stepped on its own (an asynchronous client, 1.10) is not at `action`.
    for a in shard_actions {
        if a.load(Ordering::Acquire)? > action {
            return Ok(None);
        }
    }
    // Acquire: frame `action` published means all of its writes are seen.
    for f in frame_seqs {
        if f.load(Ordering::Acquire)? != action {
            return Ok(None);
        }
    }
    let value = read(action);
    // As in `read_consistent`. An engine that wrote a byte `read` saw had seen a later
    // action before it (`step_writes_begin` orders its stores after that load), so the
    // load of `action_seq` below sees that action or a later one.
    fence(Ordering::Acquire);
    if action_seq.load(Ordering::Relaxed)? != action {
        return Ok(None);
    }
    // The same for an action posted to one shard alone during the copy.
    for a in shard_actions {
        if a.load(Ordering::Relaxed)? > action {
            return Ok(None);
        }
    }
    for (seen, seq) in before.iter().zip(write_seqs) {
        if seq.load(Ordering::Relaxed)? != *seen {
            return Ok(None);
        }
    }
    Ok(Some(value))
}

/// One attempt at reading what the engines write under `seqs` (their blocks' stats
/// sequences, or write sequences), with none of them writing: `None` if one was
/// writing when it began, or wrote while `read` ran (the caller tries again later); else
/// what `read` returned. `read` may see torn values, which are then thrown away: it must
/// not trust them (bounds, lengths) beyond copying. A word that cannot be loaded is an
/// error at once.
pub fn read_consistent<W: SeqWord, T>(
    seqs: &[W],
    read: impl FnOnce() -> T,
) -> Result<Option<T>, W::Error> {
    let mut before = [0u64; MAX_SHARDS];
    for (seen, seq) in before.iter_mut().zip(seqs) {
        *seen = seq.load(Ordering::Acquire)?;
        if *seen & 1 == 1 {
            return Ok(None);
        }
    }
    let value = read();
    // Whatever `read` loaded is ordered before the loads below: a store after an odd
    // value that it saw makes them see that odd value or a later one.
    fence(Ordering::Acquire);
    for (seen, seq) in before.iter().zip(seqs) {
        if seq.load(Ordering::Relaxed)? != *seen {
            return Ok(None);
        }
    }
    Ok(Some(value))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::layout::{EpisodeEntry, StatsBlock, STATS_BLOCK_SIZE};

    #[repr(C, align(64))]
    struct Block([u8; STATS_BLOCK_SIZE]);

    fn view(b: &mut Block) -> Stats<'_> {
        // SAFETY: `b` is 64-aligned, STATS_BLOCK_SIZE long and outlives the view; only
        // the view touches it until it is read back.
        unsafe { Stats::new(NonNull::new(b.0.as_mut_ptr()).unwrap()) }
    }

    /// The methods write what `docs/protocol.md` §3.8 says, where it says.
    #[test]
    fn episodes_land_at_the_documented_words() {
        let mut b = Block([0; STATS_BLOCK_SIZE]);
        let s = view(&mut b);
        assert!(s.begin_write());
        assert!(!s.begin_write(), "already open");
        for k in 0..30u32 {
            s.record_episode(k, f64::from(k) + 0.5, u64::from(k) + 1);
        }
        s.end_write();
        s.end_write();
        let block: StatsBlock = bytemuck::pod_read_unaligned(&b.0);
        assert_eq!(
            block.write_seq, 2,
            "one window, opened once and closed once"
        );
        assert_eq!(block.episodes, 30);
        assert_eq!(block.length_sum, (1..=30).sum::<u64>());
        assert_eq!(
            block.return_sum,
            (0..30).map(|k| f64::from(k) + 0.5).sum::<f64>()
        );
        // Episode j is in entry j % 28: 28 and 29 overwrote 0 and 1.
        let entry = |env: u32| EpisodeEntry {
            episode_return: f64::from(env) + 0.5,
            length: env + 1,
            env,
        };
        assert_eq!(block.recent[0], entry(28));
        assert_eq!(block.recent[1], entry(29));
        assert_eq!(block.recent[27], entry(27));
    }

    #[test]
    fn episodes_and_frames_have_their_own_sequences() {
        let mut b = Block([0; STATS_BLOCK_SIZE]);
        let s = view(&mut b);
        s.record_episode(3, 1.0, 2);
        assert_eq!(primitive::load(s.write_seq(), Ordering::Relaxed), 0);
        assert_eq!(primitive::load(s.stats_seq(), Ordering::Relaxed), 2);
        s.begin_write();
        assert_eq!(
            read_consistent(&[s.write_seq()], || ()),
            Ok(None),
            "a window is open"
        );
        assert_eq!(
            read_consistent(&[s.stats_seq()], || 7),
            Ok(Some(7)),
            "not for the stats"
        );
        s.end_write();
        assert_eq!(read_consistent(&[s.write_seq()], || ()), Ok(Some(())));
    }

    /// A copy is taken only while every frame is the client's last action and no write
    /// window is open, and it is given that frame.
    #[test]
    fn a_copy_waits_for_the_step_and_the_commands() {
        let mut b = Block([0; STATS_BLOCK_SIZE]);
        let s = view(&mut b);
        let (action, frames) = (AtomicU64::new(7), [AtomicU64::new(7), AtomicU64::new(7)]);
        let frame_seqs = [&frames[0], &frames[1]];
        let copy = || {
            let Ok(copied) =
                read_between_writes(&[s.write_seq()], &action, &[], &frame_seqs, |f| f);
            copied
        };
        assert_eq!(copy(), Some(7));
        primitive::store(&action, 8, Ordering::Relaxed);
        assert_eq!(copy(), None, "action 8 posted, no shard published it");
        primitive::store(&frames[1], 8, Ordering::Relaxed);
        assert_eq!(copy(), None, "one shard published it");
        primitive::store(&frames[0], 8, Ordering::Relaxed);
        assert_eq!(copy(), Some(8));
        s.begin_write();
        assert_eq!(copy(), None, "a command's handler writes");
        s.end_write();
        let Ok(moved) = read_between_writes(&[s.write_seq()], &action, &[], &frame_seqs, |f| {
            primitive::store(&action, 9, Ordering::Relaxed);
            f
        });
        assert_eq!(moved, None, "the next action came during the copy");
    }
}
