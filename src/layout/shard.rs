//! Shards (1.4): the bytes of the shard table, how a builder splits the env axis and
//! places each shard's rings, and the checks a reader runs on the table.
//!
//! A sharded region is served by K ≥ 2 engine processes. Each owns a contiguous slice of
//! the env axis of every tensor and one 512-byte entry of the shard table, which follows
//! the tensor table: its own `frame_seq`, waiter flags, liveness slot and command-ring
//! words, on cache lines of their own. An unsharded region has no table (`shard_count`
//! 0): its one shard lives in the control block, byte for byte as in 1.3.

use bytemuck::{Pod, Zeroable};
use std::mem::{offset_of, size_of};

use super::header::*;
use super::location::Location;
use super::tensor::{Rings, TensorInfo};
use crate::error::{Error, Result};

/// The layout hash of a sharded region (1.4): [`LAYOUT_HASH`] continued over the shard
/// fields. A reader that does not know shards compares against [`LAYOUT_HASH`] and so
/// refuses a sharded region (`LayoutMismatch`) instead of stepping one shard of it.
pub const LAYOUT_HASH_SHARDED: u64 = {
    fnv1a(
        LAYOUT_HASH,
        &[
            offset_of!(Header, shard_count),
            offset_of!(Header, shard_table_offset),
            size_of::<ShardEntry>(),
            offset_of!(ShardEntry, frame_seq),
            offset_of!(ShardEntry, engine_waiting),
            offset_of!(ShardEntry, state),
            offset_of!(ShardEntry, env_start),
            offset_of!(ShardEntry, c2e_ring_offset),
            offset_of!(ShardEntry, client_waiting),
            offset_of!(ShardEntry, c2e_head),
        ],
    )
};

/// The layout hash a header with `shard_count` shards and `version_minor` carries.
pub const fn layout_hash_for(shard_count: u32, version_minor: u16) -> u64 {
    if shard_count != 0 {
        LAYOUT_HASH_SHARDED
    } else if version_minor >= VERSION_MINOR_CUDA_SESSIONS {
        LAYOUT_HASH_CUDA_SESSIONS
    } else {
        LAYOUT_HASH
    }
}

/// Size of one shard-table entry: eight cache lines.
pub const SHARD_ENTRY_SIZE: usize = 512;
/// Most shards one region can have.
pub const MAX_SHARDS: usize = 64;

/// One shard-table entry. Line 0 is written by the shard (its counter, waiter flag and
/// liveness slot) and, once before `magic`, by the creator (env range, ring offsets);
/// line 1 by the client; lines 2..8 are the shard's command-ring words, laid out as the
/// control block's lines 8..14.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Debug)]
pub struct ShardEntry {
    /// live, shard: last frame this shard published.
    pub frame_seq: u64,
    /// live, shard: 1 while it sleeps on the control block's `engine_doorbell`.
    pub engine_waiting: u32,
    /// live, shard: an `engine_state` code (`crate::control::EngineState`).
    pub state: u32,
    /// live, shard: pid of the process serving it (written while joining).
    pub pid: u32,
    pub _pad0: u32,
    /// live, shard: that process's start time (`/proc/PID/stat` field 22).
    pub start_time: u64,
    /// First env of the slice.
    pub env_start: u32,
    /// Envs in the slice (≥ 1).
    pub env_count: u32,
    /// Where this shard's client→engine / engine→client ring data lie (0 without rings;
    /// the capacities are the control block's).
    pub c2e_ring_offset: u64,
    pub e2c_ring_offset: u64,
    /// live, client (1.10, [`super::FLAG_SHARD_ACTIONS`]): the last action posted to this
    /// shard alone (0 until then); the shard's action is the larger of this and the
    /// control block's `action_seq`. `_reserved0` (0) before.
    pub action_seq: u64,
    /// live, client: 1 while the client sleeps on this shard's `frame_seq`.
    pub client_waiting: u32,
    pub _pad_cw: [u8; 60],
    pub c2e_head: u64,
    pub _pad_c2e_head: [u8; 56],
    pub c2e_tail: u64,
    pub _pad_c2e_tail: [u8; 56],
    pub e2c_head: u64,
    pub _pad_e2c_head: [u8; 56],
    pub e2c_tail: u64,
    pub _pad_e2c_tail: [u8; 56],
    pub c2e_consumer_waiting: u32,
    pub c2e_producer_waiting: u32,
    pub _pad_c2e_flags: [u8; 56],
    pub e2c_consumer_waiting: u32,
    pub e2c_producer_waiting: u32,
    pub _pad_e2c_flags: [u8; 56],
}

const _: () = assert!(size_of::<ShardEntry>() == SHARD_ENTRY_SIZE);
const _: () = assert!(offset_of!(ShardEntry, client_waiting) == 64);
const _: () = assert!(offset_of!(ShardEntry, c2e_head) == 128);
const _: () = assert!(offset_of!(ShardEntry, e2c_consumer_waiting) == 448);

/// Byte offsets of the live words of a shard, absolute in the region: in the control
/// block for an unsharded region, in the shard's table entry otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardWords {
    pub frame_seq: usize,
    /// The shard's own action counter (1.10; the control block's `action_seq` for an
    /// unsharded region).
    pub action_seq: usize,
    pub engine_waiting: usize,
    pub client_waiting: usize,
    /// The shard's state word (`engine_state` for an unsharded region).
    pub state: usize,
    pub pid: usize,
    pub start_time: usize,
    pub c2e_head: usize,
    pub c2e_tail: usize,
    pub e2c_head: usize,
    pub e2c_tail: usize,
    pub c2e_consumer_waiting: usize,
    pub c2e_producer_waiting: usize,
    pub e2c_consumer_waiting: usize,
    pub e2c_producer_waiting: usize,
}

impl ShardWords {
    /// The one shard of an unsharded region: the control block's own words.
    pub const CONTROL_BLOCK: ShardWords = ShardWords {
        frame_seq: offsets::FRAME_SEQ,
        action_seq: offsets::ACTION_SEQ,
        engine_waiting: offsets::ENGINE_WAITING,
        client_waiting: offsets::CLIENT_WAITING,
        state: offsets::ENGINE_STATE,
        pid: offsets::ENGINE_PID,
        start_time: offsets::ENGINE_START_TIME,
        c2e_head: offsets::C2E_HEAD,
        c2e_tail: offsets::C2E_TAIL,
        e2c_head: offsets::E2C_HEAD,
        e2c_tail: offsets::E2C_TAIL,
        c2e_consumer_waiting: offsets::C2E_CONSUMER_WAITING,
        c2e_producer_waiting: offsets::C2E_PRODUCER_WAITING,
        e2c_consumer_waiting: offsets::E2C_CONSUMER_WAITING,
        e2c_producer_waiting: offsets::E2C_PRODUCER_WAITING,
    };

    /// Entry `index` of a table at `table`.
    pub const fn entry(table: usize, index: usize) -> ShardWords {
        let b = table + index * SHARD_ENTRY_SIZE;
        ShardWords {
            frame_seq: b + offset_of!(ShardEntry, frame_seq),
            action_seq: b + offset_of!(ShardEntry, action_seq),
            engine_waiting: b + offset_of!(ShardEntry, engine_waiting),
            client_waiting: b + offset_of!(ShardEntry, client_waiting),
            state: b + offset_of!(ShardEntry, state),
            pid: b + offset_of!(ShardEntry, pid),
            start_time: b + offset_of!(ShardEntry, start_time),
            c2e_head: b + offset_of!(ShardEntry, c2e_head),
            c2e_tail: b + offset_of!(ShardEntry, c2e_tail),
            e2c_head: b + offset_of!(ShardEntry, e2c_head),
            e2c_tail: b + offset_of!(ShardEntry, e2c_tail),
            c2e_consumer_waiting: b + offset_of!(ShardEntry, c2e_consumer_waiting),
            c2e_producer_waiting: b + offset_of!(ShardEntry, c2e_producer_waiting),
            e2c_consumer_waiting: b + offset_of!(ShardEntry, e2c_consumer_waiting),
            e2c_producer_waiting: b + offset_of!(ShardEntry, e2c_producer_waiting),
        }
    }

    /// One past the last byte any word of this shard occupies.
    pub fn end(&self) -> usize {
        [
            self.c2e_tail,
            self.e2c_tail,
            self.e2c_producer_waiting,
            self.frame_seq,
            self.action_seq,
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
            + 8
    }
}

/// One shard as a validated layout describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardInfo {
    pub index: u32,
    /// First env of the slice and how many.
    pub env_start: u32,
    pub env_count: u32,
    /// This shard's command rings (the region's rings for an unsharded one).
    pub rings: Option<Rings>,
    /// Where its live words are.
    pub words: ShardWords,
}

impl ShardInfo {
    /// Envs `start..end` of this shard.
    pub fn envs(&self) -> std::ops::Range<u32> {
        self.env_start..self.env_start + self.env_count
    }
}

/// Env slice of shard `k` of `count` over `num_envs` envs: contiguous, sizes differing
/// by at most one (the first `num_envs % count` shards get one more).
pub fn env_slice(num_envs: u32, count: u32, k: u32) -> (u32, u32) {
    let (q, r) = (num_envs / count, num_envs % count);
    let start = k * q + k.min(r);
    (start, q + u32::from(k < r))
}

/// Checks a spec can be sharded `count` ways: `2..=MAX_SHARDS` shards, at most one per
/// env, every tensor on the host with the env axis first.
pub fn check_shardable(num_envs: u32, count: u32, tensors: &[TensorInfo]) -> Result<()> {
    if count < 2 || count as usize > MAX_SHARDS || count > num_envs {
        return Err(Error::InvalidSpec(format!(
            "{count} shards over {num_envs} envs: a sharded region has 2..={MAX_SHARDS} shards and at least one env per shard"
        )));
    }
    for t in tensors {
        if t.location() != Location::Host {
            return Err(Error::InvalidSpec(format!(
                "tensor '{}' is on {}: sharded regions serve host tensors only (protocol 1.4)",
                t.name,
                t.location().name()
            )));
        }
        if t.shape.first() != Some(&u64::from(num_envs)) {
            return Err(Error::InvalidSpec(format!(
                "tensor '{}' has shape {:?}: in a sharded region every tensor's first axis is the {num_envs} envs",
                t.name, t.shape
            )));
        }
    }
    Ok(())
}

/// The table a builder writes: env slices and, with rings, two page-aligned rings per
/// shard from `cursor` on. Returns the entries and the new cursor.
pub(super) fn build_table(
    num_envs: u32,
    count: u32,
    ring_capacity: u64,
    mut cursor: u64,
) -> (Vec<ShardEntry>, u64) {
    let mut entries = Vec::with_capacity(count as usize);
    for k in 0..count {
        let mut e = ShardEntry::zeroed();
        (e.env_start, e.env_count) = env_slice(num_envs, count, k);
        if ring_capacity > 0 {
            e.c2e_ring_offset = cursor.next_multiple_of(PAGE);
            e.e2c_ring_offset = (e.c2e_ring_offset + ring_capacity).next_multiple_of(PAGE);
            cursor = e.e2c_ring_offset + ring_capacity;
        }
        entries.push(e);
    }
    (entries, cursor)
}

/// Where the shard table of a header with `tensor_count` tensors starts.
pub const fn table_offset(tensor_count: usize) -> usize {
    CONTROL_SIZE + tensor_count * DESC_SIZE
}

/// The shards of a validated header (`bytes`: the snapshot): one in the control block
/// when `shard_count` is 0, else the checked table. Rings are checked for alignment and
/// bounds here; overlaps with tensors are checked by the caller.
pub(super) fn validate_table(
    h: &Header,
    bytes: &[u8],
    header_size: u64,
    control_rings: Option<Rings>,
    tensors: &[TensorInfo],
) -> Result<Vec<ShardInfo>> {
    let bad = |field: &'static str, reason: String| Error::InvalidHeader { field, reason };
    let count = h.shard_count as usize;
    if count == 0 {
        if h.shard_table_offset != 0 {
            return Err(bad(
                "shard_table_offset",
                format!("{} without shards", h.shard_table_offset),
            ));
        }
        return Ok(vec![ShardInfo {
            index: 0,
            env_start: 0,
            env_count: h.num_envs,
            rings: control_rings,
            words: ShardWords::CONTROL_BLOCK,
        }]);
    }
    if h.version_minor < 4 {
        return Err(bad(
            "shard_count",
            format!(
                "{count} in a protocol 1.{} header (shards need 1.4)",
                h.version_minor
            ),
        ));
    }
    if !(2..=MAX_SHARDS).contains(&count) || count as u64 > u64::from(h.num_envs) {
        return Err(bad(
            "shard_count",
            format!(
                "{count} (expected 2..={MAX_SHARDS}, at most num_envs = {})",
                h.num_envs
            ),
        ));
    }
    let table = h.shard_table_offset as usize;
    let expected = table_offset(h.tensor_count as usize);
    if table != expected {
        return Err(bad(
            "shard_table_offset",
            format!("{table} (expected {expected}, right after the tensor table)"),
        ));
    }
    let end = table + count * SHARD_ENTRY_SIZE;
    if end as u64 > header_size {
        return Err(bad(
            "header_size",
            format!("{header_size} is smaller than the shard table's end {end}"),
        ));
    }
    if bytes.len() < end {
        return Err(Error::RegionTooSmall {
            needed: end as u64,
            actual: bytes.len() as u64,
        });
    }
    for t in tensors {
        if t.location() != Location::Host || t.shape.first() != Some(&u64::from(h.num_envs)) {
            return Err(Error::InvalidTensor {
                tensor: t.name.clone(),
                reason: format!(
                    "in a sharded region every tensor is on the host with the {} envs first (shape {:?}, {})",
                    h.num_envs,
                    t.shape,
                    t.location().name()
                ),
            });
        }
    }
    let mut shards = Vec::with_capacity(count);
    let mut next_env = 0u32;
    for k in 0..count {
        let at = table + k * SHARD_ENTRY_SIZE;
        let e: ShardEntry = bytemuck::pod_read_unaligned(&bytes[at..at + SHARD_ENTRY_SIZE]);
        if e.env_start != next_env || e.env_count == 0 {
            return Err(bad(
                "shard table",
                format!(
                    "shard {k} serves envs {}+{} (expected a non-empty slice from {next_env})",
                    e.env_start, e.env_count
                ),
            ));
        }
        next_env = e
            .env_start
            .checked_add(e.env_count)
            .filter(|&n| n <= h.num_envs)
            .ok_or_else(|| {
                bad(
                    "shard table",
                    format!("shard {k}'s envs pass num_envs {}", h.num_envs),
                )
            })?;
        let rings = match control_rings {
            None if e.c2e_ring_offset == 0 && e.e2c_ring_offset == 0 => None,
            None => {
                return Err(bad(
                    "shard table",
                    format!("shard {k} has ring offsets but the region has no rings"),
                ))
            }
            Some(r) => {
                let rings = Rings {
                    c2e: (e.c2e_ring_offset, r.c2e.1),
                    e2c: (e.e2c_ring_offset, r.e2c.1),
                };
                for (offset, cap) in [rings.c2e, rings.e2c] {
                    if offset % PAGE != 0
                        || offset < header_size
                        || offset.checked_add(cap).is_none_or(|x| x > h.region_size)
                    {
                        return Err(bad(
                            "shard table",
                            format!(
                                "shard {k}'s ring at {offset} (+{cap}) does not lie page-aligned inside the region, after the header"
                            ),
                        ));
                    }
                }
                if k == 0 && rings != r {
                    return Err(bad(
                        "shard table",
                        "shard 0's rings differ from the control block's".into(),
                    ));
                }
                Some(rings)
            }
        };
        shards.push(ShardInfo {
            index: k as u32,
            env_start: e.env_start,
            env_count: e.env_count,
            rings,
            words: ShardWords::entry(table, k),
        });
    }
    if next_env != h.num_envs {
        return Err(bad(
            "shard table",
            format!("the shards serve {next_env} of {} envs", h.num_envs),
        ));
    }
    Ok(shards)
}
