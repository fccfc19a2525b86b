//! The stats area (1.7): one block per shard after the tensors, where each engine keeps
//! its write sequence (which brackets what it writes outside a step, for read-only
//! observers) and the episodes it saw end (what a sampling observer cannot compute). Where the area lies is in the header
//! (`stats_offset`, told by [`FLAG_OBSERVABLE`]); the live words are read and written
//! through `crate::control::Stats`.

use bytemuck::{Pod, Zeroable};
use std::mem::{offset_of, size_of};

use super::header::{FLAG_OBSERVABLE, PAGE};
use crate::error::{Error, Result};

/// Size of one block: eight cache lines.
pub const STATS_BLOCK_SIZE: usize = 512;
/// Finished episodes a block remembers one by one (the last ones; the sums count all).
pub const RECENT_EPISODES: usize = 28;

/// One finished episode, as a block remembers it.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Debug, PartialEq)]
pub struct EpisodeEntry {
    /// Sum of the episode's rewards.
    pub episode_return: f64,
    /// Steps it took.
    pub length: u32,
    /// The env (its index in the region) that played it.
    pub env: u32,
}

/// One block of the stats area: line 0 is the engine's (its write sequence, the episode
/// totals and their own sequence), lines 1..8 the last [`RECENT_EPISODES`] episodes,
/// episode number `j` (counting from 0) in entry `j % RECENT_EPISODES`. Written by one
/// engine process (the block's shard) only, every word with an atomic store.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Debug)]
pub struct StatsBlock {
    /// live: odd while the engine writes engine→client tensors outside a step (a
    /// command's handler), even otherwise; bumped by one at each edge.
    pub write_seq: u64,
    /// live: episodes that ended, ever.
    pub episodes: u64,
    /// live: sum of their returns (f64 bits).
    pub return_sum: f64,
    /// live: sum of their lengths.
    pub length_sum: u64,
    /// live: odd while the engine writes the episode words (`episodes` .. `recent`),
    /// even otherwise: they are read by this sequence alone, so a sampling reader gets
    /// them even while the engine steps back to back.
    pub stats_seq: u64,
    pub _reserved: [u64; 3],
    /// live: the last episodes.
    pub recent: [EpisodeEntry; RECENT_EPISODES],
}

const _: () = assert!(size_of::<EpisodeEntry>() == 16);
const _: () = assert!(size_of::<StatsBlock>() == STATS_BLOCK_SIZE);
const _: () = assert!(offset_of!(StatsBlock, recent) == 64);
const _: () = assert!(offset_of!(StatsBlock, stats_seq) == 32);

/// Byte offsets of a block's words, from the block's start.
pub mod stats_offsets {
    use super::StatsBlock;
    use std::mem::offset_of;
    pub const WRITE_SEQ: usize = offset_of!(StatsBlock, write_seq);
    pub const EPISODES: usize = offset_of!(StatsBlock, episodes);
    pub const RETURN_SUM: usize = offset_of!(StatsBlock, return_sum);
    pub const LENGTH_SUM: usize = offset_of!(StatsBlock, length_sum);
    pub const STATS_SEQ: usize = offset_of!(StatsBlock, stats_seq);
    pub const RECENT: usize = offset_of!(StatsBlock, recent);
    /// Size of one entry of `recent`: its return's bits, then `length | env << 32`.
    pub const ENTRY: usize = size_of::<super::EpisodeEntry>();
}

/// Where a region's stats area lies: `blocks` blocks (one per shard) from `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatsArea {
    pub offset: u64,
    pub blocks: u32,
}

impl StatsArea {
    /// Where the builder puts it: at the first page boundary from `cursor` (the end of
    /// the last host tensor). Returns the area and the region's end after it.
    pub(super) fn after(cursor: u64, blocks: u32) -> Option<(StatsArea, u64)> {
        let offset = cursor.checked_add(PAGE - 1)? / PAGE * PAGE;
        let area = StatsArea { offset, blocks };
        let end = offset.checked_add(area.len())?;
        Some((area, end.checked_add(PAGE - 1)? / PAGE * PAGE))
    }

    /// Bytes it spans.
    pub fn len(&self) -> u64 {
        u64::from(self.blocks) * STATS_BLOCK_SIZE as u64
    }

    pub fn is_empty(&self) -> bool {
        self.blocks == 0
    }

    /// Byte offset in the region of shard `shard`'s block.
    pub fn block(&self, shard: u32) -> u64 {
        self.offset + u64::from(shard) * STATS_BLOCK_SIZE as u64
    }
}

/// The reader's check of the stats area (after the tensors and rings, §4): present only
/// with [`FLAG_OBSERVABLE`]; then page-aligned, at or after the header, one block per
/// shard inside the region. Overlaps with tensors and rings are checked with theirs.
pub(super) fn validate_area(
    flags: u64,
    stats_offset: u64,
    shards: u32,
    header_size: u64,
    region_size: u64,
) -> Result<Option<StatsArea>> {
    if flags & FLAG_OBSERVABLE == 0 {
        return Ok(None);
    }
    let bad = |reason: String| Error::InvalidHeader {
        field: "stats_offset",
        reason,
    };
    let area = StatsArea {
        offset: stats_offset,
        blocks: shards.max(1),
    };
    if stats_offset % PAGE != 0 || stats_offset < header_size {
        return Err(bad(format!(
            "{stats_offset} is not a page boundary at or after header_size {header_size}"
        )));
    }
    match stats_offset.checked_add(area.len()) {
        Some(end) if end <= region_size => Ok(Some(area)),
        _ => Err(bad(format!(
            "{} blocks of {STATS_BLOCK_SIZE} bytes from {stats_offset} pass region_size {region_size}",
            area.blocks
        ))),
    }
}
