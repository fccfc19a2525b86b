//! Header v1: the byte layout of a region's header and tensor table, and its validation.
//!
//! Pure: no I/O, no unsafe. The engine builds a header with [`HeaderBuilder`]; a client
//! copies the header out of shared memory and runs [`validate`] on the copy before it
//! trusts any field (the engine could scribble on the live header afterwards; the client
//! only ever uses its validated snapshot). `docs/protocol.md` documents every byte here.

use bytemuck::{Pod, Zeroable};
use std::mem::{offset_of, size_of};

use crate::error::{Error, Result};

/// `b"SHMBRIDG"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SHMBRIDG");
pub const VERSION_MAJOR: u16 = 1;
/// 1.1: command rings (control words in cache lines 8-13, data after the table) and the
/// engine doorbell. 1.2: CUDA tensors (`location = 1`): IPC handles in the tensor table,
/// the two interprocess events and the client's CUDA state in the control block.
pub const VERSION_MINOR: u16 = 2;

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

/// The live fields' values (states, `client_cuda_state`) are typed in
/// [`crate::control`], which encodes them as the `u32` codes `docs/protocol.md` lists.
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
    pub flags: u64,
    pub _reserved0: u64,
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
    /// engine ([`crate::control::DeviceImport`]); the engine frees exported memory only when it is not
    /// `OPEN` (or the client died).
    pub client_cuda_state: u32,
    pub _reserved1: [u8; 28],
    // Cache line 2: where the command rings' data lie (1.1; zero in 1.0 or without rings).
    pub c2e_ring_offset: u64,
    pub c2e_ring_capacity: u64,
    pub e2c_ring_offset: u64,
    pub e2c_ring_capacity: u64,
    pub _reserved2: [u8; 32],
    // Cache line 3: what the engine is, NUL-padded UTF-8 ("cartpole", "null", ...).
    pub engine_kind: [u8; NAME_LEN],
    pub _reserved3: [u8; 32],
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
    /// [`Direction`] as u8.
    pub direction: u8,
    /// [`Location`] as u8.
    pub location: u8,
    pub flags: u8,
    pub device_ordinal: i32,
    pub _reserved0: u32,
    /// Entries past `ndim` are zero.
    pub shape: [u64; MAX_NDIM],
    /// Byte strides; v1 requires C-contiguous. Entries past `ndim` are zero.
    pub strides: [i64; MAX_NDIM],
    /// Host: byte offset of the data in the region. CUDA: offset from the IPC base.
    pub offset: u64,
    pub nbytes: u64,
    /// CUDA (1.2): IPC memory handle of the allocation's base; `offset` is the tensor's
    /// byte offset from that base.
    pub ipc_mem_handle: [u8; 64],
    /// CUDA IPC event handle (reserved: 1.2 puts one event per direction in the control
    /// block).
    pub ipc_event_handle: [u8; 64],
    /// Size of the exported allocation: CUDA (1.2), the `cuMemAlloc` size behind
    /// `ipc_mem_handle`; Vulkan (reserved), the allocation size.
    pub export_size: u64,
    /// Vulkan memory type (reserved).
    pub export_memory_type: u32,
    pub _reserved1: u32,
    /// CUDA (1.2): the device's UUID (`cuDeviceGetUuid`), so a client whose
    /// `CUDA_VISIBLE_DEVICES` numbers devices differently finds the same one; all zero =
    /// unknown, use `device_ordinal`.
    pub device_uuid: [u8; 16],
    pub _reserved2: [u8; 32],
}

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
const _: () = assert!(offset_of!(Header, engine_event_handle) == 896);
const _: () = assert!(offset_of!(Header, client_event_handle) == 960);
const _: () = assert!(offset_of!(TensorDesc, device_uuid) == 336);

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

/// FNV-1a over the sizes and offsets of every field: two builds that agree on the
/// version but not on the layout are caught at attach.
pub const LAYOUT_HASH: u64 = {
    let words: [usize; 24] = [
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
    ];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
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
};

/// Element types, with their DLPack codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F16,
    BF16,
    F32,
    F64,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    /// One byte per element, 0 or 1 (DLPack `kDLBool`, 8 bits).
    Bool,
}

pub const DL_INT: u8 = 0;
pub const DL_UINT: u8 = 1;
pub const DL_FLOAT: u8 = 2;
pub const DL_BFLOAT: u8 = 4;
pub const DL_BOOL: u8 = 6;

impl DType {
    pub const ALL: [DType; 13] = [
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::Bool,
    ];

    /// (DLPack type code, bits).
    pub const fn dlpack(self) -> (u8, u8) {
        match self {
            DType::F16 => (DL_FLOAT, 16),
            DType::BF16 => (DL_BFLOAT, 16),
            DType::F32 => (DL_FLOAT, 32),
            DType::F64 => (DL_FLOAT, 64),
            DType::I8 => (DL_INT, 8),
            DType::I16 => (DL_INT, 16),
            DType::I32 => (DL_INT, 32),
            DType::I64 => (DL_INT, 64),
            DType::U8 => (DL_UINT, 8),
            DType::U16 => (DL_UINT, 16),
            DType::U32 => (DL_UINT, 32),
            DType::U64 => (DL_UINT, 64),
            DType::Bool => (DL_BOOL, 8),
        }
    }

    pub fn from_dlpack(code: u8, bits: u8, lanes: u16) -> Option<DType> {
        if lanes != 1 {
            return None;
        }
        DType::ALL.into_iter().find(|d| d.dlpack() == (code, bits))
    }

    pub const fn size(self) -> usize {
        self.dlpack().1 as usize / 8
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::Bool => "bool",
        }
    }

    pub fn parse(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Who writes a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Direction {
    /// Observations, rewards, dones, images.
    EngineToClient = 0,
    /// Actions, reset mask.
    ClientToEngine = 1,
}

impl Direction {
    pub fn from_u8(v: u8) -> Option<Direction> {
        match v {
            0 => Some(Direction::EngineToClient),
            1 => Some(Direction::ClientToEngine),
            _ => None,
        }
    }
    pub fn writer(self) -> crate::error::Peer {
        match self {
            Direction::EngineToClient => crate::error::Peer::Engine,
            Direction::ClientToEngine => crate::error::Peer::Client,
        }
    }
    pub fn arrow(self) -> &'static str {
        match self {
            Direction::EngineToClient => "engine->client",
            Direction::ClientToEngine => "client->engine",
        }
    }
}

/// Where a tensor's bytes live. v1 serves `Host` only; the others are reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Location {
    Host = 0,
    Cuda = 1,
    Vulkan = 2,
}

impl Location {
    pub fn name(self) -> &'static str {
        match self {
            Location::Host => "host",
            Location::Cuda => "cuda",
            Location::Vulkan => "vulkan",
        }
    }
}

/// A validated tensor-table entry, owned by the process that validated it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub direction: Direction,
    pub location: Location,
    /// Host: byte offset of the data in the region. CUDA: byte offset from the base of
    /// the exported allocation ([`CudaPlacement::ipc_mem_handle`]).
    pub offset: u64,
    pub nbytes: u64,
    /// Where a CUDA tensor's allocation is (`location == Cuda` only).
    pub cuda: Option<CudaPlacement>,
}

/// The CUDA fields of a tensor-table entry (1.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaPlacement {
    /// The engine's ordinal of the device.
    pub device_ordinal: i32,
    /// The device's UUID; all zero = unknown.
    pub device_uuid: [u8; 16],
    /// IPC handle of the allocation's base (the engine fills it in after allocating).
    pub ipc_mem_handle: [u8; 64],
    /// Size of that allocation (`offset + nbytes <= alloc_size`).
    pub alloc_size: u64,
}

impl TensorInfo {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
    /// C-contiguous byte strides.
    pub fn strides(&self) -> Vec<i64> {
        contiguous_strides(&self.shape, self.dtype.size() as u64)
    }
}

fn contiguous_strides(shape: &[u64], itemsize: u64) -> Vec<i64> {
    let mut strides = vec![0i64; shape.len()];
    let mut acc = itemsize;
    for i in (0..shape.len()).rev() {
        strides[i] = acc as i64;
        acc = acc.saturating_mul(shape[i]);
    }
    strides
}

/// A validated header: everything a client needs, copied out of shared memory.
#[derive(Debug, Clone)]
pub struct Layout {
    pub version: (u16, u16),
    pub header_size: u64,
    pub region_size: u64,
    pub num_envs: u32,
    pub engine_pid: u32,
    pub engine_start_time: u64,
    pub engine_kind: String,
    pub tensors: Vec<TensorInfo>,
    /// The command rings (protocol ≥ 1.1 with non-zero capacity).
    pub rings: Option<Rings>,
    /// 1.2: the engine's interprocess event handle, present iff a tensor is on CUDA.
    pub engine_event_handle: Option<[u8; 64]>,
}

impl Layout {
    /// Whether any tensor lives on a CUDA device.
    pub fn has_cuda(&self) -> bool {
        self.tensors.iter().any(|t| t.location == Location::Cuda)
    }
}

/// Where the two command rings' data lie in the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rings {
    /// Client→engine ring: (byte offset, capacity).
    pub c2e: (u64, u64),
    /// Engine→client ring: (byte offset, capacity).
    pub e2c: (u64, u64),
}

/// Default capacity of each command ring.
pub const DEFAULT_RING_CAPACITY: u64 = 512 * 1024;
/// Smallest ring capacity accepted.
pub const MIN_RING_CAPACITY: u64 = 64;

/// A tensor resolved once by name ([`Layout::id`]), for hot loops that should not compare
/// strings every step. Only valid for the layout (engine or client) that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorId(usize);

impl TensorId {
    pub fn index(self) -> usize {
        self.0
    }
}

/// Something that names a tensor: its name, or a [`TensorId`].
pub trait TensorKey {
    fn resolve<'l>(&self, layout: &'l Layout) -> Result<(usize, &'l TensorInfo)>;
}

impl TensorKey for &str {
    #[inline]
    fn resolve<'l>(&self, layout: &'l Layout) -> Result<(usize, &'l TensorInfo)> {
        layout.tensor(self)
    }
}

impl TensorKey for TensorId {
    #[inline]
    fn resolve<'l>(&self, layout: &'l Layout) -> Result<(usize, &'l TensorInfo)> {
        layout
            .tensors
            .get(self.0)
            .map(|t| (self.0, t))
            .ok_or_else(|| Error::NoSuchTensor {
                name: format!("#{}", self.0),
                available: layout.tensor_names(),
            })
    }
}

impl Layout {
    /// Resolves a tensor name once.
    pub fn id(&self, name: &str) -> Result<TensorId> {
        Ok(TensorId(self.tensor(name)?.0))
    }

    pub fn tensor(&self, name: &str) -> Result<(usize, &TensorInfo)> {
        self.tensors
            .iter()
            .enumerate()
            .find(|(_, t)| t.name == name)
            .ok_or_else(|| Error::NoSuchTensor {
                name: name.to_string(),
                available: self.tensor_names(),
            })
    }
    pub fn tensor_names(&self) -> String {
        self.tensors
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What the engine asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub direction: Direction,
    /// `Host` (default) or `Cuda(ordinal)`; Vulkan is not served yet.
    pub device: crate::cuda::Device,
}

impl TensorSpec {
    pub fn new(name: &str, dtype: DType, shape: &[u64], direction: Direction) -> Self {
        TensorSpec {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            direction,
            device: crate::cuda::Device::Host,
        }
    }

    /// The same tensor on `device`.
    pub fn on(mut self, device: crate::cuda::Device) -> Self {
        self.device = device;
        self
    }
}

fn align_up(v: u64, a: u64) -> Option<u64> {
    Some(v.checked_add(a - 1)? / a * a)
}

fn read_name(field: &'static str, bytes: &[u8; NAME_LEN]) -> Result<String> {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(NAME_LEN);
    if bytes[end..].iter().any(|&b| b != 0) {
        return Err(Error::InvalidHeader {
            field,
            reason: "bytes after the terminating NUL".into(),
        });
    }
    std::str::from_utf8(&bytes[..end])
        .map(str::to_string)
        .map_err(|_| Error::InvalidHeader {
            field,
            reason: "not UTF-8".into(),
        })
}

fn write_name(name: &str) -> [u8; NAME_LEN] {
    let mut out = [0u8; NAME_LEN];
    out[..name.len()].copy_from_slice(name.as_bytes());
    out
}

fn check_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.len() >= NAME_LEN || name.as_bytes().contains(&0) {
        return Err(Error::InvalidSpec(format!(
            "{what} '{name}' must be 1..{} bytes of UTF-8 without NUL",
            NAME_LEN - 1
        )));
    }
    Ok(())
}

/// Builds a header and tensor table from an engine's spec: assigns aligned data offsets
/// and computes the region size. Rejects bad specs before anything is created.
#[derive(Debug, Clone)]
pub struct HeaderBuilder {
    pub header: Header,
    pub descs: Vec<TensorDesc>,
    pub tensors: Vec<TensorInfo>,
    pub rings: Option<Rings>,
    /// 1.2: the one device allocation holding every CUDA tensor: (device ordinal, size
    /// in bytes). The engine allocates it, then calls [`HeaderBuilder::set_cuda_export`].
    pub cuda_alloc: Option<(i32, u64)>,
}

impl HeaderBuilder {
    /// Fills in the CUDA export (1.2) once the engine allocated [`Self::cuda_alloc`]:
    /// the allocation's IPC handle and device UUID in every CUDA entry, and the engine's
    /// event handle in the control block. Nothing happens without CUDA tensors.
    pub fn set_cuda_export(
        &mut self,
        ipc_mem_handle: [u8; 64],
        device_uuid: [u8; 16],
        engine_event_handle: [u8; 64],
    ) {
        if self.cuda_alloc.is_none() {
            return;
        }
        for (d, t) in self.descs.iter_mut().zip(self.tensors.iter_mut()) {
            if let Some(c) = t.cuda.as_mut() {
                d.ipc_mem_handle = ipc_mem_handle;
                d.device_uuid = device_uuid;
                c.ipc_mem_handle = ipc_mem_handle;
                c.device_uuid = device_uuid;
            }
        }
        self.header.engine_event_handle = engine_event_handle;
    }

    /// `ring_capacity`: bytes of each command ring, a power of two ≥ 64, or 0 for none.
    pub fn new(
        engine_kind: &str,
        num_envs: u32,
        specs: &[TensorSpec],
        ring_capacity: u64,
    ) -> Result<Self> {
        check_name("engine kind", engine_kind)?;
        if num_envs == 0 {
            return Err(Error::InvalidSpec("num_envs must be at least 1".into()));
        }
        if specs.is_empty() || specs.len() > MAX_TENSORS {
            return Err(Error::InvalidSpec(format!(
                "an engine declares 1..={MAX_TENSORS} tensors, not {}",
                specs.len()
            )));
        }
        let table_end = (CONTROL_SIZE + specs.len() * DESC_SIZE) as u64;
        let header_size = align_up(table_end, PAGE).expect("small");
        let mut cursor = header_size;
        let rings = if ring_capacity == 0 {
            None
        } else {
            if !ring_capacity.is_power_of_two()
                || !(MIN_RING_CAPACITY..=(1 << 40)).contains(&ring_capacity)
            {
                return Err(Error::InvalidSpec(format!(
                    "ring capacity {ring_capacity} must be a power of two between {MIN_RING_CAPACITY} and 2^40 (or 0: no command channel)"
                )));
            }
            let c2e = align_up(cursor, PAGE).expect("small");
            let e2c = align_up(c2e + ring_capacity, PAGE).expect("small");
            cursor = e2c + ring_capacity;
            Some(Rings {
                c2e: (c2e, ring_capacity),
                e2c: (e2c, ring_capacity),
            })
        };
        let mut descs = Vec::with_capacity(specs.len());
        let mut tensors = Vec::with_capacity(specs.len());
        let mut cuda_device: Option<i32> = None;
        let mut cuda_cursor: u64 = 0;
        for (i, s) in specs.iter().enumerate() {
            check_name("tensor name", &s.name)?;
            if specs[..i].iter().any(|o| o.name == s.name) {
                return Err(Error::InvalidSpec(format!(
                    "tensor '{}' declared twice",
                    s.name
                )));
            }
            if s.shape.is_empty() || s.shape.len() > MAX_NDIM {
                return Err(Error::InvalidSpec(format!(
                    "tensor '{}' has {} dimensions; 1..={MAX_NDIM} are supported",
                    s.name,
                    s.shape.len()
                )));
            }
            if s.shape.contains(&0) {
                return Err(Error::InvalidSpec(format!(
                    "tensor '{}' has a zero-sized dimension {:?}",
                    s.name, s.shape
                )));
            }
            let nbytes = s
                .shape
                .iter()
                .try_fold(s.dtype.size() as u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= isize::MAX as u64)
                .ok_or_else(|| {
                    Error::InvalidSpec(format!(
                        "tensor '{}' shape {:?} is too large",
                        s.name, s.shape
                    ))
                })?;
            let (offset, location, cuda) = match s.device {
                crate::cuda::Device::Host => {
                    let align = if nbytes >= PAGE { PAGE } else { DATA_ALIGN };
                    let offset = align_up(cursor, align)
                        .ok_or_else(|| Error::InvalidSpec("region too large".into()))?;
                    cursor = offset
                        .checked_add(nbytes)
                        .ok_or_else(|| Error::InvalidSpec("region too large".into()))?;
                    (offset, Location::Host, None)
                }
                crate::cuda::Device::Cuda(ordinal) => {
                    if ordinal < 0 {
                        return Err(Error::InvalidSpec(format!(
                            "tensor '{}': CUDA device ordinal {ordinal} < 0",
                            s.name
                        )));
                    }
                    if cuda_device.is_some_and(|o| o != ordinal) {
                        return Err(Error::InvalidSpec(format!(
                            "tensor '{}' is on cuda:{ordinal} but an earlier one is on \
                             cuda:{}: protocol 1.2 serves one CUDA device per engine",
                            s.name,
                            cuda_device.unwrap_or(0)
                        )));
                    }
                    cuda_device = Some(ordinal);
                    let too_large = || Error::InvalidSpec("CUDA tensors too large".into());
                    let offset = align_up(cuda_cursor, CUDA_ALIGN).ok_or_else(too_large)?;
                    cuda_cursor = offset.checked_add(nbytes).ok_or_else(too_large)?;
                    let placement = CudaPlacement {
                        device_ordinal: ordinal,
                        device_uuid: [0; 16],
                        ipc_mem_handle: [0; 64],
                        alloc_size: 0, // set below, once every tensor is placed
                    };
                    (offset, Location::Cuda, Some(placement))
                }
            };
            let (code, bits) = s.dtype.dlpack();
            let mut d = TensorDesc::zeroed();
            d.name = write_name(&s.name);
            d.dtype_code = code;
            d.dtype_bits = bits;
            d.dtype_lanes = 1;
            d.ndim = s.shape.len() as u8;
            d.direction = s.direction as u8;
            d.location = location as u8;
            if let Some(c) = &cuda {
                d.device_ordinal = c.device_ordinal;
            }
            d.shape[..s.shape.len()].copy_from_slice(&s.shape);
            let strides = contiguous_strides(&s.shape, s.dtype.size() as u64);
            d.strides[..strides.len()].copy_from_slice(&strides);
            d.offset = offset;
            d.nbytes = nbytes;
            descs.push(d);
            tensors.push(TensorInfo {
                name: s.name.clone(),
                dtype: s.dtype,
                shape: s.shape.clone(),
                direction: s.direction,
                location,
                offset,
                nbytes,
                cuda,
            });
        }
        let cuda_alloc = match cuda_device {
            None => None,
            Some(ordinal) => {
                let size = align_up(cuda_cursor.max(1), CUDA_EXPORT_GRANULARITY)
                    .filter(|&n| n <= isize::MAX as u64)
                    .ok_or_else(|| Error::InvalidSpec("CUDA tensors too large".into()))?;
                for (d, t) in descs.iter_mut().zip(tensors.iter_mut()) {
                    if let Some(c) = t.cuda.as_mut() {
                        c.alloc_size = size;
                        d.export_size = size;
                    }
                }
                Some((ordinal, size))
            }
        };
        let region_size = align_up(cursor, PAGE)
            .filter(|&n| n <= isize::MAX as u64)
            .ok_or_else(|| Error::InvalidSpec("region too large".into()))?;
        let mut h = Header::zeroed();
        // `magic` stays zero here: the region publishes it last.
        h.version_major = VERSION_MAJOR;
        h.version_minor = VERSION_MINOR;
        h.header_size = header_size as u32;
        h.region_size = region_size;
        h.layout_hash = LAYOUT_HASH;
        h.num_envs = num_envs;
        h.tensor_count = specs.len() as u32;
        h.table_offset = CONTROL_SIZE as u32;
        h.desc_size = DESC_SIZE as u32;
        h.engine_kind = write_name(engine_kind);
        if let Some(r) = rings {
            h.c2e_ring_offset = r.c2e.0;
            h.c2e_ring_capacity = r.c2e.1;
            h.e2c_ring_offset = r.e2c.0;
            h.e2c_ring_capacity = r.e2c.1;
        }
        Ok(HeaderBuilder {
            header: h,
            descs,
            tensors,
            rings,
            cuda_alloc,
        })
    }

    /// Header and table bytes, `header_size` long, magic still zero.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.header.header_size as usize];
        out[..CONTROL_SIZE].copy_from_slice(bytemuck::bytes_of(&self.header));
        for (i, d) in self.descs.iter().enumerate() {
            let at = CONTROL_SIZE + i * DESC_SIZE;
            out[at..at + DESC_SIZE].copy_from_slice(bytemuck::bytes_of(d));
        }
        out
    }
}

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

/// Checks identity fields only: magic, version, layout hash.
pub fn check_identity(name: &str, h: &Header) -> Result<()> {
    if h.magic != MAGIC {
        return Err(Error::BadMagic {
            name: name.to_string(),
            found: h.magic,
        });
    }
    if h.version_major != VERSION_MAJOR {
        return Err(Error::VersionMismatch {
            ours_major: VERSION_MAJOR,
            ours_minor: VERSION_MINOR,
            theirs_major: h.version_major,
            theirs_minor: h.version_minor,
        });
    }
    if h.layout_hash != LAYOUT_HASH {
        return Err(Error::LayoutMismatch {
            ours: LAYOUT_HASH,
            theirs: h.layout_hash,
        });
    }
    Ok(())
}

/// Validates a header snapshot (`bytes`: at least the header, copied out of the region)
/// against the region's actual size. Every offset, length and product is checked with
/// overflow-checked arithmetic; nothing here can panic or index out of bounds.
pub fn validate(name: &str, bytes: &[u8], actual_region_size: u64) -> Result<Layout> {
    let h = read_header(bytes)?;
    check_identity(name, &h)?;
    let bad = |field: &'static str, reason: String| Error::InvalidHeader { field, reason };
    if h.table_offset as usize != CONTROL_SIZE {
        return Err(bad(
            "table_offset",
            format!("{} (expected {CONTROL_SIZE})", h.table_offset),
        ));
    }
    if h.desc_size as usize != DESC_SIZE {
        return Err(bad(
            "desc_size",
            format!("{} (expected {DESC_SIZE})", h.desc_size),
        ));
    }
    let count = h.tensor_count as usize;
    if count == 0 || count > MAX_TENSORS {
        return Err(bad(
            "tensor_count",
            format!("{count} (expected 1..={MAX_TENSORS})"),
        ));
    }
    if h.num_envs == 0 {
        return Err(bad("num_envs", "0".into()));
    }
    let table_end = (CONTROL_SIZE + count * DESC_SIZE) as u64;
    let header_size = h.header_size as u64;
    if header_size < table_end {
        return Err(bad(
            "header_size",
            format!("{header_size} is smaller than the tensor table's end {table_end}"),
        ));
    }
    if h.region_size < header_size {
        return Err(bad(
            "region_size",
            format!(
                "{} is smaller than header_size {header_size}",
                h.region_size
            ),
        ));
    }
    if actual_region_size < h.region_size {
        return Err(Error::RegionTooSmall {
            needed: h.region_size,
            actual: actual_region_size,
        });
    }
    if (bytes.len() as u64) < table_end {
        return Err(Error::RegionTooSmall {
            needed: table_end,
            actual: bytes.len() as u64,
        });
    }
    let engine_kind = read_name("engine_kind", &h.engine_kind)?;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(count);
    for i in 0..count {
        let at = CONTROL_SIZE + i * DESC_SIZE;
        let d: TensorDesc = bytemuck::pod_read_unaligned(&bytes[at..at + DESC_SIZE]);
        tensors.push(validate_desc(
            &d,
            h.version_minor,
            h.region_size,
            header_size,
        )?);
        let t = tensors.last().expect("pushed");
        if tensors[..i].iter().any(|o| o.name == t.name) {
            return Err(Error::InvalidTensor {
                tensor: t.name.clone(),
                reason: "name appears twice in the table".into(),
            });
        }
    }
    let rings = validate_rings(&h, header_size)?;
    let has_cuda = tensors.iter().any(|t| t.location == Location::Cuda);
    let engine_event_handle = if has_cuda {
        if h.engine_event_handle.iter().all(|&b| b == 0) {
            return Err(bad(
                "engine_event_handle",
                "all zero, but tensors live on CUDA (the engine must export its event)".into(),
            ));
        }
        Some(h.engine_event_handle)
    } else {
        None
    };
    // Host tensors and rings must not overlap: views of two of them are handed out at
    // once. (CUDA tensors live in their own allocation; validate_desc bounds them.)
    let mut spans: Vec<(u64, u64, &str)> = tensors
        .iter()
        .filter(|t| t.location == Location::Host)
        .map(|t| (t.offset, t.offset + t.nbytes, t.name.as_str()))
        .collect();
    if let Some(r) = rings {
        spans.push((r.c2e.0, r.c2e.0 + r.c2e.1, "<c2e ring>"));
        spans.push((r.e2c.0, r.e2c.0 + r.e2c.1, "<e2c ring>"));
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::InvalidTensor {
                tensor: w[1].2.to_string(),
                reason: format!("overlaps tensor '{}'", w[0].2),
            });
        }
    }
    Ok(Layout {
        version: (h.version_major, h.version_minor),
        header_size,
        region_size: h.region_size,
        num_envs: h.num_envs,
        engine_pid: h.engine_pid,
        engine_start_time: h.engine_start_time,
        engine_kind,
        tensors,
        rings,
        engine_event_handle,
    })
}

/// The rings of a 1.1+ header: each capacity a power of two ≥ 64 (or both 0: none), each
/// data area page-aligned, after the header and inside the region. A 1.0 header has none.
fn validate_rings(h: &Header, header_size: u64) -> Result<Option<Rings>> {
    if h.version_minor < 1 {
        return Ok(None);
    }
    let (c2e, e2c) = (
        (h.c2e_ring_offset, h.c2e_ring_capacity),
        (h.e2c_ring_offset, h.e2c_ring_capacity),
    );
    if c2e.1 == 0 && e2c.1 == 0 {
        return Ok(None);
    }
    for (field, (offset, cap)) in [("c2e ring", c2e), ("e2c ring", e2c)] {
        let bad = |reason: String| Error::InvalidHeader { field, reason };
        if !cap.is_power_of_two() || cap < MIN_RING_CAPACITY {
            return Err(bad(format!(
                "capacity {cap} is not a power of two ≥ {MIN_RING_CAPACITY}"
            )));
        }
        if offset % PAGE != 0 || offset < header_size {
            return Err(bad(format!(
                "offset {offset} is not page-aligned after the header"
            )));
        }
        if offset
            .checked_add(cap)
            .is_none_or(|end| end > h.region_size)
        {
            return Err(bad(format!(
                "{offset} + {cap} lies outside the region ({} bytes)",
                h.region_size
            )));
        }
    }
    Ok(Some(Rings { c2e, e2c }))
}

fn validate_desc(
    d: &TensorDesc,
    version_minor: u16,
    region_size: u64,
    header_size: u64,
) -> Result<TensorInfo> {
    let name = read_name("tensor name", &d.name)?;
    if name.is_empty() {
        return Err(Error::InvalidHeader {
            field: "tensor name",
            reason: "empty".into(),
        });
    }
    let invalid = |reason: String| Error::InvalidTensor {
        tensor: name.clone(),
        reason,
    };
    let dtype = DType::from_dlpack(d.dtype_code, d.dtype_bits, d.dtype_lanes).ok_or_else(|| {
        invalid(format!(
            "unsupported dtype (code {}, bits {}, lanes {})",
            d.dtype_code, d.dtype_bits, d.dtype_lanes
        ))
    })?;
    let ndim = d.ndim as usize;
    if ndim == 0 || ndim > MAX_NDIM {
        return Err(invalid(format!("ndim {ndim} (expected 1..={MAX_NDIM})")));
    }
    if d.shape[ndim..].iter().any(|&s| s != 0) || d.strides[ndim..].iter().any(|&s| s != 0) {
        return Err(invalid("shape or strides non-zero past ndim".into()));
    }
    let direction = Direction::from_u8(d.direction)
        .ok_or_else(|| invalid(format!("direction {}", d.direction)))?;
    let location = match d.location {
        0 => Location::Host,
        1 if version_minor >= 2 => Location::Cuda,
        1 => {
            return Err(invalid(format!(
                "location cuda in a protocol 1.{version_minor} header (CUDA tensors need 1.2)"
            )))
        }
        2 => {
            return Err(invalid(
                "location vulkan is not served by protocol 1.x yet".into(),
            ))
        }
        other => return Err(invalid(format!("location {other}"))),
    };
    let shape = d.shape[..ndim].to_vec();
    if shape.contains(&0) {
        return Err(invalid(format!("zero-sized dimension in {shape:?}")));
    }
    let expected = shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &s| acc.checked_mul(s))
        .filter(|&n| n <= isize::MAX as u64)
        .ok_or_else(|| invalid(format!("shape {shape:?} overflows")))?;
    if d.nbytes != expected {
        return Err(invalid(format!(
            "nbytes {} does not match shape {shape:?} x {} bytes = {expected}",
            d.nbytes,
            dtype.size()
        )));
    }
    let strides = contiguous_strides(&shape, dtype.size() as u64);
    if d.strides[..ndim] != strides[..] {
        return Err(invalid(format!(
            "strides {:?} are not C-contiguous {strides:?} (required in 1.0)",
            &d.strides[..ndim]
        )));
    }
    if d.offset % DATA_ALIGN != 0 {
        return Err(invalid(format!(
            "offset {} is not {DATA_ALIGN}-byte aligned",
            d.offset
        )));
    }
    let end = d.offset.checked_add(d.nbytes);
    let cuda = if location == Location::Cuda {
        if d.device_ordinal < 0 {
            return Err(invalid(format!(
                "CUDA device ordinal {} < 0",
                d.device_ordinal
            )));
        }
        if d.ipc_mem_handle.iter().all(|&b| b == 0) {
            return Err(invalid("CUDA tensor without an IPC memory handle".into()));
        }
        if d.export_size == 0 || end.is_none_or(|e| e > d.export_size) {
            return Err(invalid(format!(
                "CUDA span {} + {} lies outside its {}-byte allocation",
                d.offset, d.nbytes, d.export_size
            )));
        }
        Some(CudaPlacement {
            device_ordinal: d.device_ordinal,
            device_uuid: d.device_uuid,
            ipc_mem_handle: d.ipc_mem_handle,
            alloc_size: d.export_size,
        })
    } else {
        if d.offset < header_size || end.is_none_or(|e| e > region_size) {
            return Err(Error::TensorOutOfBounds {
                tensor: name,
                offset: d.offset,
                len: d.nbytes,
                region_size,
            });
        }
        None
    };
    Ok(TensorInfo {
        name,
        dtype,
        shape,
        direction,
        location,
        offset: d.offset,
        nbytes: d.nbytes,
        cuda,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn standard() -> HeaderBuilder {
        HeaderBuilder::new(
            "test",
            4,
            &[
                TensorSpec::new("obs", DType::F32, &[4, 3], Direction::EngineToClient),
                TensorSpec::new("actions", DType::I64, &[4, 1], Direction::ClientToEngine),
                TensorSpec::new("big", DType::U8, &[2, 84, 84, 3], Direction::EngineToClient),
            ],
            4096,
        )
        .unwrap()
    }

    fn published(b: &HeaderBuilder) -> Vec<u8> {
        let mut bytes = b.bytes();
        bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
        bytes
    }

    #[test]
    fn builder_output_validates() {
        let b = standard();
        let l = validate("r", &published(&b), b.header.region_size).unwrap();
        assert_eq!(l.tensors, b.tensors);
        assert_eq!(l.engine_kind, "test");
        for t in &l.tensors {
            assert_eq!(t.offset % DATA_ALIGN, 0);
            assert!(t.offset >= l.header_size);
            if t.nbytes >= PAGE {
                assert_eq!(t.offset % PAGE, 0);
            }
        }
    }

    #[test]
    fn unpublished_magic_is_bad_magic() {
        let b = standard();
        let err = validate("r", &b.bytes(), b.header.region_size).unwrap_err();
        assert!(matches!(err, Error::BadMagic { found: 0, .. }), "{err}");
    }

    #[test]
    fn dtype_codes_round_trip() {
        for d in DType::ALL {
            let (c, b) = d.dlpack();
            assert_eq!(DType::from_dlpack(c, b, 1), Some(d));
            assert_eq!(DType::parse(d.name()), Some(d));
            assert_eq!(d.size() * 8, b as usize);
        }
        assert_eq!(DType::from_dlpack(DL_FLOAT, 32, 2), None);
    }

    #[test]
    fn bad_specs_are_rejected() {
        let t = |shape: &[u64]| TensorSpec::new("x", DType::F32, shape, Direction::EngineToClient);
        assert!(HeaderBuilder::new("k", 0, &[t(&[1])], 0).is_err());
        assert!(HeaderBuilder::new("k", 1, &[], 0).is_err());
        assert!(HeaderBuilder::new("k", 1, &[t(&[])], 0).is_err());
        assert!(HeaderBuilder::new("k", 1, &[t(&[0, 3])], 0).is_err());
        assert!(HeaderBuilder::new("k", 1, &[t(&[u64::MAX, 2])], 0).is_err());
        assert!(HeaderBuilder::new("k", 1, &[t(&[1; 9])], 0).is_err());
        assert!(HeaderBuilder::new("k", 1, &[t(&[1]), t(&[2])], 0).is_err());
        let long = "x".repeat(NAME_LEN);
        assert!(HeaderBuilder::new(&long, 1, &[t(&[1])], 0).is_err());
        assert!(HeaderBuilder::new("k", 1, &[t(&[1])], 100).is_err());
        assert!(HeaderBuilder::new("k", 1, &[t(&[1])], 32).is_err());
    }

    #[test]
    fn cuda_tensors_share_one_allocation() {
        use crate::cuda::Device;
        let mut b = HeaderBuilder::new(
            "gpu",
            4,
            &[
                TensorSpec::new("obs", DType::F32, &[4, 3], Direction::EngineToClient)
                    .on(Device::Cuda(1)),
                TensorSpec::new("actions", DType::I64, &[4, 1], Direction::ClientToEngine)
                    .on(Device::Cuda(1)),
                TensorSpec::new("host", DType::U8, &[5], Direction::EngineToClient),
            ],
            0,
        )
        .unwrap();
        assert_eq!(
            b.cuda_alloc,
            Some((1, CUDA_EXPORT_GRANULARITY)),
            "its own 2 MiB block"
        );
        assert_eq!((b.tensors[0].offset, b.tensors[1].offset), (0, 256));
        assert_eq!(b.tensors[2].location, Location::Host);
        assert!(b.tensors[2].offset >= b.header.header_size as u64);
        // Not exported yet: a reader rejects it (no handle).
        assert!(validate("r", &published(&b), b.header.region_size).is_err());
        b.set_cuda_export([1; 64], [2; 16], [3; 64]);
        let l = validate("r", &published(&b), b.header.region_size).unwrap();
        assert_eq!(l.tensors, b.tensors);
        assert_eq!(l.version, (1, 2));
        assert!(l.has_cuda());
        assert_eq!(l.engine_event_handle, Some([3; 64]));
        let c = l.tensors[1].cuda.unwrap();
        assert_eq!(
            (c.device_ordinal, c.alloc_size),
            (1, CUDA_EXPORT_GRANULARITY)
        );
        assert_eq!((c.device_uuid, c.ipc_mem_handle), ([2; 16], [1; 64]));
        // Two devices in one engine are refused.
        let two = [
            TensorSpec::new("a", DType::F32, &[1], Direction::EngineToClient).on(Device::Cuda(0)),
            TensorSpec::new("b", DType::F32, &[1], Direction::EngineToClient).on(Device::Cuda(1)),
        ];
        assert!(matches!(
            HeaderBuilder::new("k", 1, &two, 0),
            Err(Error::InvalidSpec(_))
        ));
        let neg = [
            TensorSpec::new("a", DType::F32, &[1], Direction::EngineToClient).on(Device::Cuda(-1)),
        ];
        assert!(HeaderBuilder::new("k", 1, &neg, 0).is_err());
    }

    #[test]
    fn host_only_layouts_are_what_1_1_wrote() {
        // A host-only 1.2 header differs from a 1.1 one only in `version_minor`: every
        // 1.2 field is zero, so 1.1 readers (which ignore the minor) read it unchanged.
        let b = standard();
        let h = &b.header;
        assert_eq!(h.version_minor, 2);
        assert_eq!(h.client_cuda_state, 0);
        assert!(h.engine_event_handle.iter().all(|&x| x == 0));
        assert!(h.client_event_handle.iter().all(|&x| x == 0));
        assert_eq!(b.cuda_alloc, None);
        for d in &b.descs {
            assert_eq!((d.location, d.device_ordinal, d.export_size), (0, 0, 0));
            assert!(d.ipc_mem_handle.iter().all(|&x| x == 0));
            assert!(d.device_uuid.iter().all(|&x| x == 0));
        }
        assert_eq!(LAYOUT_HASH, 0x1A78_E44F_F49A_C1E5);
    }
}
