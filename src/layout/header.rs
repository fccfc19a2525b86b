//! The bytes of a region's control block and tensor table: constants, the two `#[repr(C)]`
//! structs, the offsets of the live fields, the layout hash, and the identity checks.
//! `docs/protocol.md` documents every byte here.

use bytemuck::{Pod, Zeroable};
use std::mem::{offset_of, size_of};

use crate::error::{Error, Result};

/// `b"SHMBRIDG"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SHMBRIDG");
pub const VERSION_MAJOR: u16 = 1;
/// 1.1: command rings (control words in cache lines 8-13, data after the table) and the
/// engine doorbell. 1.2: CUDA tensors (`location = 1`): IPC handles in the tensor table,
/// the two interprocess events and the client's CUDA state in the control block. 1.3:
/// Vulkan tensors (`location = 2`): exported memory described in the tensor table, its
/// fds passed over the region's Unix socket. 1.4: shards (`shard_count`,
/// `shard_table_offset` and the shard table after the tensor table): K engine processes
/// serve one region. An unsharded region uses nothing of 1.4 and is written as 1.3,
/// byte for byte. 1.5: per-session close acknowledgement of CUDA imports: a session tag
/// in `client_cuda_state`, and the sessions that ended holding imports
/// (`client_cuda_ended`, `client_cuda_overflow`); only a region with CUDA tensors is
/// written as 1.5 (with [`LAYOUT_HASH_CUDA_SESSIONS`], which earlier clients refuse).
/// 1.6: the Vulkan fds travel over a socket file beside the region (`<name>.fd`, which
/// reaches across network namespaces), and both sides prove who they are with a
/// descriptor holding a lock on the region (the engine's [`crate::control::ENGINE_PROOF_BYTE`],
/// the client's proof byte): only a region with Vulkan tensors is written as 1.6 (with
/// the layout hash of 1.5, which 1.2-1.4 clients refuse).
/// 1.7: read-only observers: a stats area after the tensors (`stats_offset`), the
/// engine's write sequence in it, and its byte-0 lock, all told by [`FLAG_OBSERVABLE`]
/// in `flags`; `version_minor` is written as before (3, 4, 5 or 6), so every earlier
/// client reads a 1.7 region as it read the same region from a 1.6 engine.
/// 1.8: the fd socket's exchange (§3.6) starts with the engine's hello carrying its
/// proof, which the client checks before it sends its own; the client's proof is a lock
/// on one fixed byte ([`crate::control::CLIENT_PROOF_BYTE`]) instead of one derived from
/// the pid and start time in the client slot. Only a region with Vulkan tensors is
/// written as 1.8 (with the layout hash of 1.5): a 1.6 or 1.7 client reads its header as
/// before, and is refused on the socket (its messages are of version 2).
/// 1.9: a CUDA entry may say, by [`CUDA_FLAG_FD`], that its allocation is shared by file
/// descriptor over the fd socket (§3.5.1), its frames ordered on the host; only a region
/// whose engine shares its CUDA memory that way is written as 1.9 (the layout hash of
/// 1.5). Every other region is written as before, byte for byte.
/// 1.10: a sharded region's shards also take actions posted to their own entry
/// (`action_seq`, formerly `_reserved0`) and ring the control block's `frame_seq` after
/// publishing while the client's flag on it is up: asynchronous batches. Told by
/// [`FLAG_SHARD_ACTIONS`]; `version_minor` is written as before.
/// 1.11: trajectory streams, shm objects of their own (`layout::stream`, protocol §10);
/// regions are written as before, byte for byte.
pub const VERSION_MINOR: u16 = 11;
/// What the builder writes for an unsharded region without CUDA tensors: the bytes of 1.3.
pub const VERSION_MINOR_UNSHARDED: u16 = 3;
/// What the builder writes for a sharded region (1.4).
pub const VERSION_MINOR_SHARDED: u16 = 4;
/// What the builder writes for a region with CUDA tensors (1.5), and the lowest minor
/// whose clients tag their close acknowledgement.
pub const VERSION_MINOR_CUDA_SESSIONS: u16 = 5;
/// The lowest minor whose engines serve their Vulkan fds over the socket file with
/// proofs (1.6).
pub const VERSION_MINOR_FD_SOCKET: u16 = 6;
/// What the builder writes for a region with Vulkan tensors (1.8), and the lowest minor
/// whose engines say hello with their proof first and ask for the fixed client proof
/// byte: the only Vulkan engines a client of this version takes fds from.
pub const VERSION_MINOR_FD_HELLO: u16 = 8;
/// The lowest minor whose CUDA entries may say, by [`CUDA_FLAG_FD`], that their memory is
/// shared by file descriptor instead of an IPC handle (1.9), and what the builder writes
/// for such a region. Below it, a CUDA entry's `flags` must be 0.
pub const VERSION_MINOR_CUDA_FD: u16 = 9;
/// 1.7: what the builder writes in `version_minor` does not change for the stats area
/// (earlier readers ignore it entirely, and a 1.5 or 1.6 reader expects the CUDA-session
/// hash of every region of minor 5 or more): its presence is told by [`FLAG_OBSERVABLE`].
pub const VERSION_MINOR_OBSERVERS: u16 = 7;
/// The lowest minor whose shard processes take actions posted to their own entry and ring
/// the frame bell (1.10, [`FLAG_SHARD_ACTIONS`]): what asynchronous batches ask of every
/// shard (`Client::async_reset` asks each one's protocol with a `Hello`).
pub const VERSION_MINOR_SHARD_ACTIONS: u16 = 10;
/// The minor that added trajectory streams (1.11): a stream header's `version_minor`.
pub const VERSION_MINOR_STREAMS: u16 = 11;
/// `Header::flags` bit 0 (1.7): the region has a stats area at `stats_offset`, and its
/// engine (each shard) writes engine→client tensors only inside a step (after a release
/// fence that follows its load of the action) or inside an odd `write_seq` of its
/// block, and holds an OFD write lock on byte 0 of the region file (shard `k`: byte
/// `k`), so that read-only observers can copy consistent frames and judge its liveness
/// without taking any lock themselves.
pub const FLAG_OBSERVABLE: u64 = 1;
/// `Header::flags` bit 1 (1.10): a sharded region whose shards take an action posted to
/// their own entry's `action_seq` as well as the control block's (the larger of the two
/// is the action), so a client may step some shards and not others (asynchronous
/// batches, `Client::recv`/`Client::send`). Written by the builder of every sharded
/// region; `version_minor` is not raised (as for 1.7): earlier clients never write the
/// entry word (it was `_reserved0`, zero) and step every shard through the control
/// block's, as before.
pub const FLAG_SHARD_ACTIONS: u64 = 2;
/// Entries of `client_cuda_ended` (1.5): 2 in bytes 160..192, 2 in 224..256.
pub const CUDA_ENDED_SLOTS: usize = 4;

/// Size of the control block at offset 0; the tensor table follows it.
pub const CONTROL_SIZE: usize = 1024;
pub const DESC_SIZE: usize = 384;
pub const MAX_TENSORS: usize = 64;
pub const MAX_NDIM: usize = 8;
pub const NAME_LEN: usize = 32;
/// Host tensor data offsets are multiples of this (a cache line; DLPack wants ≥ 64).
pub const DATA_ALIGN: u64 = 64;
/// The Rust engine places CUDA tensors at multiples of this in their allocation
/// (`cudaMalloc`'s own alignment); readers require only [`DATA_ALIGN`].
pub const CUDA_ALIGN: u64 = 256;
/// Size granularity of an exported CUDA allocation: the driver may sub-allocate smaller
/// `cuMemAlloc` blocks from a shared 2 MiB block, and an IPC handle shares the whole
/// block, so the export is rounded up to 2 MiB (the CUDA guide's advice for IPC): it is
/// its own block, and nothing else of the engine's is exposed through it.
pub const CUDA_EXPORT_GRANULARITY: u64 = 2 << 20;
/// Tensors at least this large start on a page boundary.
pub const PAGE: u64 = 4096;

/// The control block: the first 1024 bytes of every region.
///
/// Fields marked *live* are accessed atomically in the mapping at their offsets (see
/// [`offsets`]); in a snapshot they are just the values seen when it was taken.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Debug)]
pub struct Header {
    // Cache line 0: identity, written once before `magic` is published.
    pub magic: u64,
    pub version_major: u16,
    pub version_minor: u16,
    /// Control block + tensor table, rounded up to a page; tensor data starts here or later.
    pub header_size: u32,
    pub region_size: u64,
    pub layout_hash: u64,
    pub num_envs: u32,
    pub tensor_count: u32,
    pub table_offset: u32,
    pub desc_size: u32,
    /// Bit 0 ([`FLAG_OBSERVABLE`], 1.7): the region has a stats area at `stats_offset`
    /// and its engine keeps the words observers read by. Bit 1
    /// ([`FLAG_SHARD_ACTIONS`], 1.10): each shard also takes actions from its entry's
    /// `action_seq`. Other bits 0.
    pub flags: u64,
    /// 1.4: engine processes serving the region; 0 = unsharded (one engine, whose words
    /// are the control block's own).
    pub shard_count: u32,
    /// 1.4: where the shard table starts (right after the tensor table); 0 unsharded.
    pub shard_table_offset: u32,
    // Cache line 1: processes.
    pub engine_pid: u32,
    /// live
    pub engine_state: u32,
    /// Start time of the engine process in clock ticks after boot (/proc/PID/stat field 22):
    /// with the pid, it tells a dead engine from a reused pid.
    pub engine_start_time: u64,
    /// live
    pub client_pid: u32,
    /// live
    pub client_state: u32,
    /// live
    pub client_start_time: u64,
    /// live (1.2), client: whether the attached client holds CUDA IPC handles of this
    /// engine ([`crate::control::DeviceImport`], which types this and the states); the
    /// engine frees exported memory only when it is not `OPEN` (or the client died).
    /// 1.5: bits 0..8 the state, bits 8..32 the session tag the client took at attach
    /// ([`crate::control::CudaWord`]).
    pub client_cuda_state: u32,
    /// live (1.5), clients: nonzero once a session that ended holding imports could not
    /// be recorded in `client_cuda_ended` (all in use by live processes): the engine then
    /// never frees its exported memory.
    pub client_cuda_overflow: u32,
    /// 1.7: where the stats area lies ([`FLAG_OBSERVABLE`] set): page-aligned, after
    /// every tensor; 0 otherwise. Written once before `magic`.
    pub stats_offset: u64,
    pub _reserved1: [u8; 16],
    // Cache line 2: where the command rings' data lie (1.1; zero in 1.0 or without rings).
    pub c2e_ring_offset: u64,
    pub c2e_ring_capacity: u64,
    pub e2c_ring_offset: u64,
    pub e2c_ring_capacity: u64,
    /// live (1.5), clients: entries 0 and 1 of `client_cuda_ended`, each two words:
    /// `pid << 32 | tag` (0 = free) and the process's start time. A claiming client
    /// records there the session it follows when that one is still `OPEN` and its
    /// process lives; that process clears the entry once it closed its last import.
    pub client_cuda_ended_a: [u64; 4],
    // Cache line 3: what the engine is, NUL-padded UTF-8 ("cartpole", "null", ...).
    pub engine_kind: [u8; NAME_LEN],
    /// live (1.5), clients: entries 2 and 3 of `client_cuda_ended`.
    pub client_cuda_ended_b: [u64; 4],
    // Cache lines 4..8: the sequence counters and waiter flags, one line each.
    /// live: last action number the client posted.
    pub action_seq: u64,
    /// live (1.1): bumped by the client after every action post and every command it
    /// pushes; the engine sleeps on this word, so one futex wakes it for either.
    pub engine_doorbell: u32,
    pub _pad_action: [u8; 52],
    /// live: last frame number the engine published.
    pub frame_seq: u64,
    pub _pad_frame: [u8; 56],
    /// live: 1 while the engine sleeps (1.1: on `engine_doorbell`; 1.0: on `action_seq`).
    pub engine_waiting: u32,
    pub _pad_ew: [u8; 60],
    /// live: 1 while the client sleeps on `frame_seq`.
    pub client_waiting: u32,
    pub _pad_cw: [u8; 60],
    // Cache lines 8..14 (1.1): command rings. Head = bytes ever written by the producer,
    // tail = bytes ever consumed; each on its own line.
    /// live: client→engine ring head (client writes).
    pub c2e_head: u64,
    pub _pad_c2e_head: [u8; 56],
    /// live: client→engine ring tail (engine writes).
    pub c2e_tail: u64,
    pub _pad_c2e_tail: [u8; 56],
    /// live: engine→client ring head (engine writes).
    pub e2c_head: u64,
    pub _pad_e2c_head: [u8; 56],
    /// live: engine→client ring tail (client writes).
    pub e2c_tail: u64,
    pub _pad_e2c_tail: [u8; 56],
    /// live: 1 while a c2e consumer sleeps in `Ring::pop` on the head (the engine's
    /// dispatch sleeps on the doorbell instead) / the client sleeps on room (the tail).
    pub c2e_consumer_waiting: u32,
    pub c2e_producer_waiting: u32,
    pub _pad_c2e_flags: [u8; 56],
    /// live: 1 while the client sleeps on the e2c head / the engine sleeps on its tail.
    pub e2c_consumer_waiting: u32,
    pub e2c_producer_waiting: u32,
    pub _pad_e2c_flags: [u8; 56],
    // Cache lines 14..16 (1.2): CUDA interprocess event handles; all zero without CUDA
    // tensors.
    /// The engine's event (`cuIpcGetEventHandle`), recorded after its kernels, before
    /// every `frame_seq` store. Written once before `magic`.
    pub engine_event_handle: [u8; 64],
    /// live (1.2), client: the client's event, recorded after its writes of CUDA
    /// client→engine tensors, before every `action_seq` store. Written while claiming
    /// the slot, published by the Release store of `client_state = ATTACHED`.
    pub client_event_handle: [u8; 64],
}

/// One tensor-table entry.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Debug)]
pub struct TensorDesc {
    /// NUL-padded UTF-8.
    pub name: [u8; NAME_LEN],
    /// DLPack `DLDataTypeCode`.
    pub dtype_code: u8,
    pub dtype_bits: u8,
    pub dtype_lanes: u16,
    pub ndim: u8,
    /// [`Direction`](super::Direction) as u8.
    pub direction: u8,
    /// [`Location`](super::Location) as u8.
    pub location: u8,
    /// Vulkan (1.3): [`VK_FLAG_DEDICATED`], [`VK_FLAG_SEMAPHORE`], [`VK_FLAG_TIMELINE`].
    /// CUDA (1.9): [`CUDA_FLAG_FD`]. Zero for host tensors.
    pub flags: u8,
    pub device_ordinal: i32,
    pub _reserved0: u32,
    /// Entries past `ndim` are zero.
    pub shape: [u64; MAX_NDIM],
    /// Byte strides; v1 requires C-contiguous. Entries past `ndim` are zero.
    pub strides: [i64; MAX_NDIM],
    /// Host: byte offset of the data in the region. CUDA: offset from the IPC base.
    /// Vulkan: offset in the exported memory.
    pub offset: u64,
    pub nbytes: u64,
    /// CUDA (1.2): IPC memory handle of the allocation's base; `offset` is the tensor's
    /// byte offset from that base.
    pub ipc_mem_handle: [u8; 64],
    /// CUDA IPC event handle (reserved: 1.2 puts one event per direction in the control
    /// block).
    pub ipc_event_handle: [u8; 64],
    /// Size of the exported allocation: CUDA (1.2), the `cuMemAlloc` size behind
    /// `ipc_mem_handle`; Vulkan (1.3), the exported memory's `allocationSize`.
    pub export_size: u64,
    /// Vulkan (1.3): the exported memory's `memoryTypeIndex` on the engine's device.
    pub export_memory_type: u32,
    pub _reserved1: u32,
    /// CUDA (1.2): the device's UUID (`cuDeviceGetUuid`), so a client whose
    /// `CUDA_VISIBLE_DEVICES` numbers devices differently finds the same one; all zero =
    /// unknown, use `device_ordinal`. Vulkan (1.3): `deviceUUID` of the exporting device.
    pub device_uuid: [u8; 16],
    /// Vulkan (1.3): `driverUUID` of the exporting device.
    pub driver_uuid: [u8; 16],
    pub _reserved2: [u8; 16],
}

/// `TensorDesc::flags` of a Vulkan tensor: the memory is a dedicated allocation.
pub const VK_FLAG_DEDICATED: u8 = 1;
/// `TensorDesc::flags` of a Vulkan tensor: a semaphore fd follows its memory fd.
pub const VK_FLAG_SEMAPHORE: u8 = 2;
/// `TensorDesc::flags` of a Vulkan tensor: that semaphore is a timeline semaphore.
pub const VK_FLAG_TIMELINE: u8 = 4;

/// `TensorDesc::flags` of a CUDA tensor (1.9): its allocation was made with
/// `cuMemCreate` (POSIX fd handles) and is shared by file descriptor over the region's fd
/// socket, which crosses PID namespaces; `ipc_mem_handle` is then all zero. Without it,
/// the allocation is shared by `ipc_mem_handle` (CUDA IPC, one PID namespace).
pub const CUDA_FLAG_FD: u8 = 1;

const _: () = assert!(size_of::<Header>() == CONTROL_SIZE);
const _: () = assert!(size_of::<TensorDesc>() == DESC_SIZE);
const _: () = assert!(offset_of!(Header, action_seq) == 256);
const _: () = assert!(offset_of!(Header, frame_seq) == 320);
const _: () = assert!(offset_of!(Header, engine_waiting) == 384);
const _: () = assert!(offset_of!(Header, client_waiting) == 448);
const _: () = assert!(offset_of!(Header, engine_doorbell) == 264);
const _: () = assert!(offset_of!(Header, c2e_head) == 512);
const _: () = assert!(offset_of!(Header, c2e_tail) == 576);
const _: () = assert!(offset_of!(Header, e2c_head) == 640);
const _: () = assert!(offset_of!(Header, e2c_tail) == 704);
const _: () = assert!(offset_of!(Header, c2e_consumer_waiting) == 768);
const _: () = assert!(offset_of!(Header, e2c_consumer_waiting) == 832);
const _: () = assert!(offset_of!(Header, client_cuda_state) == 96);
const _: () = assert!(offset_of!(Header, client_cuda_overflow) == 100);
const _: () = assert!(offset_of!(Header, stats_offset) == 104);
const _: () = assert!(offset_of!(Header, flags) == 48);
const _: () = assert!(offset_of!(Header, client_cuda_ended_a) == 160);
const _: () = assert!(offset_of!(Header, client_cuda_ended_b) == 224);
const _: () = assert!(offset_of!(Header, engine_event_handle) == 896);
const _: () = assert!(offset_of!(Header, client_event_handle) == 960);
const _: () = assert!(offset_of!(TensorDesc, device_uuid) == 336);
const _: () = assert!(offset_of!(Header, shard_count) == 56);
const _: () = assert!(offset_of!(Header, shard_table_offset) == 60);
const _: () = assert!(offset_of!(TensorDesc, driver_uuid) == 352);

/// Byte offsets of the live fields, for atomic access in the mapping.
pub mod offsets {
    use super::Header;
    use std::mem::offset_of;
    pub const MAGIC: usize = offset_of!(Header, magic);
    pub const ENGINE_PID: usize = offset_of!(Header, engine_pid);
    pub const ENGINE_STATE: usize = offset_of!(Header, engine_state);
    pub const ENGINE_START_TIME: usize = offset_of!(Header, engine_start_time);
    pub const CLIENT_PID: usize = offset_of!(Header, client_pid);
    pub const CLIENT_STATE: usize = offset_of!(Header, client_state);
    pub const CLIENT_START_TIME: usize = offset_of!(Header, client_start_time);
    pub const ACTION_SEQ: usize = offset_of!(Header, action_seq);
    pub const FRAME_SEQ: usize = offset_of!(Header, frame_seq);
    pub const ENGINE_WAITING: usize = offset_of!(Header, engine_waiting);
    pub const CLIENT_WAITING: usize = offset_of!(Header, client_waiting);
    pub const ENGINE_DOORBELL: usize = offset_of!(Header, engine_doorbell);
    pub const C2E_HEAD: usize = offset_of!(Header, c2e_head);
    pub const C2E_TAIL: usize = offset_of!(Header, c2e_tail);
    pub const E2C_HEAD: usize = offset_of!(Header, e2c_head);
    pub const E2C_TAIL: usize = offset_of!(Header, e2c_tail);
    pub const C2E_CONSUMER_WAITING: usize = offset_of!(Header, c2e_consumer_waiting);
    pub const C2E_PRODUCER_WAITING: usize = offset_of!(Header, c2e_producer_waiting);
    pub const E2C_CONSUMER_WAITING: usize = offset_of!(Header, e2c_consumer_waiting);
    pub const E2C_PRODUCER_WAITING: usize = offset_of!(Header, e2c_producer_waiting);
    pub const CLIENT_CUDA_STATE: usize = offset_of!(Header, client_cuda_state);
    pub const CLIENT_EVENT_HANDLE: usize = offset_of!(Header, client_event_handle);
    pub const CLIENT_CUDA_OVERFLOW: usize = offset_of!(Header, client_cuda_overflow);
    /// Entry `i` of `client_cuda_ended` (1.5): its `pid << 32 | tag` word; the start
    /// time follows it.
    pub const CLIENT_CUDA_ENDED: [usize; super::CUDA_ENDED_SLOTS] = [
        offset_of!(Header, client_cuda_ended_a),
        offset_of!(Header, client_cuda_ended_a) + 16,
        offset_of!(Header, client_cuda_ended_b),
        offset_of!(Header, client_cuda_ended_b) + 16,
    ];
}

/// The attached client's identity and CUDA event handle (1.2), as the engine reads them
/// from the control block (`client_pid`, `client_start_time`, `client_event_handle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientEventHandle {
    pub pid: u32,
    pub start_time: u64,
    /// All zero: the client published none (a host-only layout).
    pub handle: [u8; 64],
}

pub(super) const fn fnv1a(h: u64, words: &[usize]) -> u64 {
    let mut h = h;
    let mut i = 0;
    while i < words.len() {
        let bytes = (words[i] as u64).to_le_bytes();
        let mut j = 0;
        while j < 8 {
            h ^= bytes[j] as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
            j += 1;
        }
        i += 1;
    }
    h
}

/// FNV-1a over the sizes and offsets of every field: two builds that agree on the
/// version but not on the layout are caught at attach.
pub const LAYOUT_HASH: u64 = fnv1a(
    0xcbf2_9ce4_8422_2325,
    &[
        size_of::<Header>(),
        offset_of!(Header, header_size),
        offset_of!(Header, region_size),
        offset_of!(Header, num_envs),
        offset_of!(Header, tensor_count),
        offset_of!(Header, engine_pid),
        offset_of!(Header, client_pid),
        offset_of!(Header, c2e_ring_offset),
        offset_of!(Header, engine_kind),
        offset_of!(Header, action_seq),
        offset_of!(Header, frame_seq),
        offset_of!(Header, engine_waiting),
        offset_of!(Header, client_waiting),
        size_of::<TensorDesc>(),
        offset_of!(TensorDesc, dtype_code),
        offset_of!(TensorDesc, ndim),
        offset_of!(TensorDesc, device_ordinal),
        offset_of!(TensorDesc, shape),
        offset_of!(TensorDesc, strides),
        offset_of!(TensorDesc, offset),
        offset_of!(TensorDesc, nbytes),
        offset_of!(TensorDesc, ipc_mem_handle),
        offset_of!(TensorDesc, export_size),
        MAX_NDIM,
    ],
);

/// The layout hash of an unsharded region of minor 5 or more (1.5: a region with CUDA
/// tensors): [`LAYOUT_HASH`] continued over the session fields. A 1.2-1.4 client, which
/// would acknowledge without a session tag (and could so mark a later client's session
/// released), compares against [`LAYOUT_HASH`] and refuses it (`LayoutMismatch`).
pub const LAYOUT_HASH_CUDA_SESSIONS: u64 = fnv1a(
    LAYOUT_HASH,
    &[
        offset_of!(Header, client_cuda_state),
        offset_of!(Header, client_cuda_overflow),
        offset_of!(Header, client_cuda_ended_a),
        offset_of!(Header, client_cuda_ended_b),
        16,
        CUDA_ENDED_SLOTS,
    ],
);

/// Reads the control block from (a copy of) the first bytes of a region.
pub fn read_header(bytes: &[u8]) -> Result<Header> {
    if bytes.len() < CONTROL_SIZE {
        return Err(Error::RegionTooSmall {
            needed: CONTROL_SIZE as u64,
            actual: bytes.len() as u64,
        });
    }
    Ok(bytemuck::pod_read_unaligned(&bytes[..CONTROL_SIZE]))
}
