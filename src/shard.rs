//! The live side of shards (protocol 1.4): the words one shard of a region reads and
//! writes, and its liveness lock.
//!
//! [`crate::layout::ShardWords`] says where a shard's words are: the control block's own
//! for an unsharded region (so a one-shard region is the 1.3 protocol, unchanged), its
//! shard-table entry otherwise. [`ShardSlot`] turns them into atomics, as
//! [`crate::control::Control`] does for the control block. Liveness of shard `k` of a
//! sharded region is the open-file-description lock on byte `k` of the region file
//! ([`crate::os::try_lock_byte`]), held by the process serving it for its whole life:
//! the kernel drops it however that process ends, so "lock free" means "shard gone",
//! with no pid-reuse race. The pid and start time in the entry only name it in errors.

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::control::EngineState;
use crate::error::{Error, Result};
use crate::layout::{Layout, ShardInfo, ShardWords};
use crate::os;
use crate::region::Region;
use crate::ring::RingCtrl;
use crate::sync::{Doorbell, SharedSeq};

#[cold]
fn outside_the_mapping(shard: &ShardInfo) -> Error {
    Error::InvalidHeader {
        field: "shard table",
        reason: format!("shard {}'s words lie outside the mapping", shard.index),
    }
}

/// The live words of one shard in a mapping.
#[derive(Clone, Copy)]
pub struct ShardSlot<'a> {
    base: NonNull<u8>,
    /// Borrowed from the layout, not copied: the step path makes a slot every step.
    words: &'a ShardWords,
    _mapping: PhantomData<&'a [u8]>,
}

impl<'a> ShardSlot<'a> {
    /// The words of `shard` in `region`. A validated layout (or the builder, for the
    /// engine) puts every word inside the header, which lies inside the mapping; checked
    /// again here, so a slot can never reach past it.
    #[inline]
    pub fn new(region: &'a Region, shard: &'a ShardInfo) -> Result<ShardSlot<'a>> {
        let w = &shard.words;
        let aligned = (w.frame_seq
            | w.action_seq
            | w.start_time
            | w.c2e_head
            | w.c2e_tail
            | w.e2c_head
            | w.e2c_tail)
            % 8
            == 0;
        if !aligned || w.end() > region.len() {
            return Err(outside_the_mapping(shard));
        }
        Ok(ShardSlot {
            base: NonNull::new(region.ptr()).expect("a mapping is never at address 0"),
            words: w,
            _mapping: PhantomData,
        })
    }

    /// The slot of a shard whose words [`ShardSlot::new`] has checked against this same
    /// mapping before (the engine when it was made, the client when it attached): the
    /// step path makes a slot every step and skips the checks.
    ///
    /// # Safety
    /// `ShardSlot::new(region, shard)` must have returned `Ok` for this `region` and an
    /// equal `shard` (a region's mapping and its layout never change afterwards).
    #[inline]
    pub unsafe fn checked_before(region: &'a Region, shard: &'a ShardInfo) -> ShardSlot<'a> {
        ShardSlot {
            base: NonNull::new(region.ptr()).expect("a mapping is never at address 0"),
            words: &shard.words,
            _mapping: PhantomData,
        }
    }

    #[inline]
    fn u64(&self, offset: usize) -> &'a AtomicU64 {
        // SAFETY: `new` checked that every word of the slot is 8-aligned (u64 words) and
        // inside the mapping, which is page-aligned and outlives `'a`; both processes
        // access these words only atomically.
        unsafe { &*(self.base.as_ptr().add(offset) as *const AtomicU64) }
    }

    #[inline]
    fn u32(&self, offset: usize) -> &'a AtomicU32 {
        // SAFETY: as for `u64`: the u32 words sit at 4-aligned offsets of the entry (or
        // the control block) inside the checked span.
        unsafe { &*(self.base.as_ptr().add(offset) as *const AtomicU32) }
    }

    /// This shard's own action counter (1.10; an unsharded region's: the control
    /// block's `action_seq`).
    #[inline]
    pub fn action_seq(&self) -> &'a AtomicU64 {
        self.u64(self.words.action_seq)
    }

    /// This shard's `frame_seq`, with the client's waiter flag for it.
    #[inline]
    pub fn frame_seq(&self) -> SharedSeq<'a> {
        SharedSeq {
            counter: self.u64(self.words.frame_seq),
            // Little-endian: the low half of a u64 is its first four bytes.
            low: self.u32(self.words.frame_seq),
            waiting: self.u32(self.words.client_waiting),
        }
    }

    /// The region's one doorbell, as this shard sleeps on it (with its own flag).
    #[inline]
    pub fn doorbell(&self, region: &'a Region) -> Doorbell<'a> {
        Doorbell {
            engine_waiting: self.engine_waiting(),
            ..region.control().doorbell()
        }
    }

    /// 1 while this shard sleeps on the doorbell.
    #[inline]
    pub fn engine_waiting(&self) -> &'a AtomicU32 {
        self.u32(self.words.engine_waiting)
    }

    /// Control words of this shard's client→engine ring.
    #[inline]
    pub fn c2e_ring(&self) -> RingCtrl<'a> {
        let w = self.words;
        self.ring(
            w.c2e_head,
            w.c2e_tail,
            w.c2e_consumer_waiting,
            w.c2e_producer_waiting,
        )
    }

    /// Control words of this shard's engine→client ring.
    #[inline]
    pub fn e2c_ring(&self) -> RingCtrl<'a> {
        let w = self.words;
        self.ring(
            w.e2c_head,
            w.e2c_tail,
            w.e2c_consumer_waiting,
            w.e2c_producer_waiting,
        )
    }

    #[inline]
    fn ring(&self, head: usize, tail: usize, consumer: usize, producer: usize) -> RingCtrl<'a> {
        RingCtrl {
            head: self.u64(head),
            tail: self.u64(tail),
            head_low: self.u32(head),
            tail_low: self.u32(tail),
            consumer_waiting: self.u32(consumer),
            producer_waiting: self.u32(producer),
        }
    }

    /// Whether a request waits in this shard's client→engine ring.
    #[inline]
    pub fn request_pending(&self, order: Ordering) -> bool {
        let c2e = self.c2e_ring();
        c2e.head.load(order) != c2e.tail.load(Ordering::Relaxed)
    }

    /// A new client (the e2c consumer) discards replies left for an earlier one.
    pub fn discard_replies(&self) {
        let e2c = self.e2c_ring();
        e2c.tail
            .store(e2c.head.load(Ordering::Acquire), Ordering::Release);
    }

    /// The shard's state (an unsharded region's: `engine_state`).
    pub fn state(&self) -> EngineState {
        EngineState::from_code(self.u32(self.words.state).load(Ordering::Acquire))
    }

    /// Frame 0 of this shard's slice is published (Release: its bytes happen-before).
    pub fn set_ready(&self) {
        self.u32(self.words.state)
            .store(EngineState::Ready.code(), Ordering::Release);
    }

    /// Marks the shard closed (SeqCst) and wakes a client asleep on its frame, a reply or
    /// room for a request.
    pub fn close(&self) {
        self.u32(self.words.state)
            .store(EngineState::Closed.code(), Ordering::SeqCst);
        let w = self.words;
        // The control block's `frame_seq` too: an asynchronous client (1.10) sleeps on it
        // as the frame bell of every shard (an unsharded region's own frame word).
        let bell = crate::layout::offsets::FRAME_SEQ;
        for word in [w.frame_seq, w.e2c_head, w.c2e_tail, bell] {
            os::futex_wake_all(self.u32(word));
        }
    }

    /// Who serves the shard, as it wrote it when joining.
    pub fn identity(&self) -> (u32, u64) {
        (
            self.u32(self.words.pid).load(Ordering::Relaxed),
            self.u64(self.words.start_time).load(Ordering::Relaxed),
        )
    }

    /// Writes who serves the shard (relaxed: published by [`Self::set_ready`]).
    pub fn set_identity(&self, pid: u32, start_time: u64) {
        self.u64(self.words.start_time)
            .store(start_time, Ordering::Relaxed);
        self.u32(self.words.pid).store(pid, Ordering::Relaxed);
    }

    /// The last frame this shard published (Acquire).
    pub fn frame(&self) -> u64 {
        self.u64(self.words.frame_seq).load(Ordering::Acquire)
    }
}

/// Takes shard `index`'s liveness lock on `region`'s descriptor: `ShardTaken` when a
/// live process holds it.
pub fn lock_shard(region: &Region, index: u32) -> Result<()> {
    if os::try_lock_byte(region.file()?, u64::from(index))? {
        Ok(())
    } else {
        Err(Error::ShardTaken {
            name: region.name().to_string(),
            shard: index,
        })
    }
}

/// For a shard process exiting without its `Engine` value (a signal handler), on a
/// mapping of the region it joined: marks shard `shard` closed and wakes a waiting
/// client (it sees `ShardClosed`). The name stays: it is the creator's.
pub fn close_shard(region: &Region, shard: u32) -> Result<()> {
    let layout = crate::layout::validate(region.name(), &region.snapshot(), region.len() as u64)?;
    let info = layout.shards.get(shard as usize).ok_or_else(|| {
        Error::InvalidSpec(format!("region '{}' has no shard {shard}", region.name()))
    })?;
    ShardSlot::new(region, info)?.close();
    Ok(())
}

/// The client's check of every shard of a sharded region: `ShardClosed` for a shard that
/// closed, `ShardDied` for one whose lock is free after it had joined (it published
/// frame 0, or wrote who it is). Shards that have not joined yet are not errors. A shard
/// checking its siblings passes its own index as `me` (its own lock does not conflict
/// with itself, so it would look free).
pub fn check_shards(region: &Region, layout: &Layout, me: Option<u32>) -> Result<()> {
    check_shards_by(region.file()?, layout, me, |s| {
        let slot = ShardSlot::new(region, s)?;
        Ok((slot.state(), slot.identity().0))
    })
}

/// [`check_shards`], with each shard's state and pid read by `read` (an observer reads
/// them with `pread`, never through a mapping) and the locks asked on `file`.
pub fn check_shards_by(
    file: &std::fs::File,
    layout: &Layout,
    me: Option<u32>,
    read: impl Fn(&ShardInfo) -> Result<(EngineState, u32)>,
) -> Result<()> {
    // A death is reported before a closure: when one shard dies its siblings close in
    // turn (they check each other), and the death is what the user must hear about.
    let mut closed = None;
    for s in layout.shards.iter().filter(|s| Some(s.index) != me) {
        let (state, pid) = read(s)?;
        let envs = s.envs();
        let joined = state != EngineState::Starting || pid != 0;
        if joined && !os::byte_locked(file, u64::from(s.index))? && state != EngineState::Closed {
            return Err(Error::ShardDied {
                shard: s.index,
                pid,
                pid_ns: Default::default(),
                env_start: envs.start,
                env_end: envs.end,
            });
        }
        if state == EngineState::Closed && closed.is_none() {
            closed = Some(Error::ShardClosed {
                shard: s.index,
                env_start: envs.start,
                env_end: envs.end,
            });
        }
    }
    closed.map_or(Ok(()), Err)
}

/// What a `Reset` becomes on a sharded region: for each shard that owns a listed env,
/// `(shard, its env ids as its own, their seeds)`. `env_ids` `None` (every env) stays
/// `None` for every shard, with one seed `s` becoming `s + env_start` (so env `e` gets
/// `s + e`, as unsharded) and one seed per env sliced. A list is split by owner, list
/// order kept; one seed becomes one per listed env (`s + k` for the `k`-th), which the
/// engines take exactly as one seed spread over the list. An unsharded region: the
/// request unchanged, for shard 0.
pub fn route_reset(
    layout: &Layout,
    env_ids: Option<&[u32]>,
    seeds: &[u64],
) -> Result<Vec<(u32, Option<Vec<u32>>, Vec<u64>)>> {
    if !layout.is_sharded() {
        return Ok(vec![(0, env_ids.map(<[u32]>::to_vec), seeds.to_vec())]);
    }
    let bad = |m: String| Error::InvalidSpec(m);
    let listed = env_ids.map_or(layout.num_envs as usize, <[u32]>::len);
    if seeds.len() > 1 && seeds.len() != listed {
        return Err(bad(format!(
            "{} seeds for {listed} envs: give none, one, or one per env",
            seeds.len()
        )));
    }
    let Some(ids) = env_ids else {
        return Ok(layout
            .shards
            .iter()
            .map(|s| {
                let seeds = match seeds {
                    [] => Vec::new(),
                    [one] => vec![one.wrapping_add(u64::from(s.env_start))],
                    all => all[s.envs().start as usize..s.envs().end as usize].to_vec(),
                };
                (s.index, None, seeds)
            })
            .collect());
    };
    let mut plan: Vec<(u32, Option<Vec<u32>>, Vec<u64>)> = Vec::new();
    for (k, &e) in ids.iter().enumerate() {
        let s = layout.shard_of(e).ok_or_else(|| {
            bad(format!(
                "env id {e} is out of range (the region has {} envs)",
                layout.num_envs
            ))
        })?;
        let seed = match seeds {
            [] => None,
            [one] => Some(one.wrapping_add(k as u64)),
            all => Some(all[k]),
        };
        let at = match plan.iter().position(|(i, _, _)| *i == s.index) {
            Some(at) => at,
            None => {
                plan.push((s.index, Some(Vec::new()), Vec::new()));
                plan.len() - 1
            }
        };
        let entry = &mut plan[at];
        entry.1.as_mut().expect("lists only").push(e - s.env_start);
        entry.2.extend(seed);
    }
    plan.sort_by_key(|(i, _, _)| *i);
    Ok(plan)
}
