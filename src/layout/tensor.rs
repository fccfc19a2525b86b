//! What a tensor is: the engine's request ([`TensorSpec`]), a validated table entry
//! ([`TensorInfo`]) and the validated header as a whole ([`Layout`]).

use std::os::fd::OwnedFd;

use super::dtype::DType;
use crate::device::location::{Device, Location, VulkanDevice};
use crate::device::vulkan::export::{SemaphoreKind, SharedFd, VulkanExport, VulkanSource};
use crate::error::{Error, Result};

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

/// A validated tensor-table entry, owned by the process that validated it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub direction: Direction,
    /// Where the bytes live (for CUDA: the engine's ordinal and the device's UUID).
    pub device: Device,
    /// Host: byte offset of the data in the region. CUDA: byte offset from the base of
    /// the exported allocation ([`CudaExport::ipc_mem_handle`]).
    pub offset: u64,
    pub nbytes: u64,
    /// The exported allocation a CUDA tensor lies in (`device` on CUDA only).
    pub cuda: Option<CudaExport>,
    /// The exported memory a Vulkan tensor lies in (`device` on Vulkan only, 1.3).
    pub vulkan: Option<VulkanTable>,
}

/// What the tensor table says of a Vulkan tensor's memory (1.3); its fd (and semaphore
/// fd) come over the region's socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VulkanTable {
    /// `allocationSize` of the exported memory (`offset + nbytes <= alloc_size`).
    pub alloc_size: u64,
    /// `memoryTypeIndex` on the exporting device.
    pub memory_type_index: u32,
    /// A dedicated allocation: importers import it dedicated.
    pub dedicated: bool,
    /// An exported semaphore follows the memory fd on the socket.
    pub semaphore: Option<SemaphoreKind>,
}

/// The export of a CUDA tensor's allocation (1.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaExport {
    /// IPC handle of the allocation's base (the engine fills it in after allocating).
    pub ipc_mem_handle: [u8; 64],
    /// Size of that allocation (`offset + nbytes <= alloc_size`).
    pub alloc_size: u64,
}

impl TensorInfo {
    /// Which kind of memory the bytes are in (the table's `location` byte).
    pub fn location(&self) -> Location {
        self.device.location()
    }
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
    /// C-contiguous byte strides.
    pub fn strides(&self) -> Vec<i64> {
        contiguous_strides(&self.shape, self.dtype.size() as u64)
    }
}

pub(super) fn contiguous_strides(shape: &[u64], itemsize: u64) -> Vec<i64> {
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
    /// 1.4: the engine processes serving the region, in env order; one (in the control
    /// block) for an unsharded region.
    pub shards: Vec<super::ShardInfo>,
}

impl Layout {
    /// Whether more than one engine process serves the region (1.4).
    pub fn is_sharded(&self) -> bool {
        self.shards.len() > 1
    }

    /// The shard that serves env `env`.
    pub fn shard_of(&self, env: u32) -> Option<&super::ShardInfo> {
        self.shards.iter().find(|s| s.envs().contains(&env))
    }

    /// This layout as shard `shard` sees it: every tensor narrowed to the shard's envs
    /// (its rows of the env axis, in place), `num_envs` the slice's, `rings` the shard's.
    pub fn narrowed(&self, shard: &super::ShardInfo) -> Layout {
        let mut out = self.clone();
        if !self.is_sharded() {
            return out;
        }
        for t in &mut out.tensors {
            // Sharded layouts have the env axis first on every (host) tensor: checked by
            // the builder and by validation.
            let row = t.nbytes / u64::from(self.num_envs);
            t.offset += row * u64::from(shard.env_start);
            t.nbytes = row * u64::from(shard.env_count);
            t.shape[0] = u64::from(shard.env_count);
        }
        out.num_envs = shard.env_count;
        out.rings = shard.rings;
        out.shards = vec![*shard];
        out
    }
    /// Whether any tensor lives on a CUDA device.
    pub fn has_cuda(&self) -> bool {
        self.tensors.iter().any(|t| t.location() == Location::Cuda)
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

    /// The per-env tensor `name`: its first dimension must be the header's `num_envs`,
    /// and, if `per_env` is given, each env must have that many elements (`Some(1)`:
    /// shape `[num_envs]`). `InvalidTensor` otherwise: a header whose `num_envs`
    /// disagrees with its tensors is not indexed by either.
    pub fn per_env_tensor(&self, name: &str, per_env: Option<u64>) -> Result<&TensorInfo> {
        let (_, t) = self.tensor(name)?;
        let elements: u64 = t.shape.iter().product();
        let n = u64::from(self.num_envs);
        let fits =
            t.shape.first() == Some(&n) && per_env.is_none_or(|k| elements == n.saturating_mul(k));
        if !fits {
            return Err(Error::InvalidTensor {
                tensor: name.to_string(),
                reason: format!(
                    "shape {:?} does not hold {} per env for the header's num_envs {n}",
                    t.shape,
                    per_env.map_or("a row".to_string(), |k| format!("{k} element(s)"))
                ),
            });
        }
        Ok(t)
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
    /// `Host` (default), a CUDA device (by ordinal) or a Vulkan device (1.3).
    pub device: Device,
    /// A Vulkan tensor's memory: allocated by the library (`None` = `Allocate`), or
    /// exported by the engine's renderer ([`TensorSpec::vulkan_import`]).
    pub vulkan: Option<VulkanSource>,
}

impl TensorSpec {
    pub fn new(name: &str, dtype: DType, shape: &[u64], direction: Direction) -> Self {
        TensorSpec {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            direction,
            device: Device::Host,
            vulkan: None,
        }
    }

    /// An engine→client tensor in memory the engine's own renderer exported (path b):
    /// `memory` is the `vkGetMemoryFdKHR` (`OPAQUE_FD`) fd, owned from here on (closed
    /// when the engine closes), `export` says where the tensor lies in it and on which
    /// device. Add a semaphore with [`TensorSpec::with_semaphore`].
    pub fn vulkan_import(
        name: &str,
        dtype: DType,
        shape: &[u64],
        memory: OwnedFd,
        export: VulkanExport,
    ) -> Self {
        let device = Device::Vulkan(VulkanDevice {
            device_uuid: export.device_uuid,
            driver_uuid: export.driver_uuid,
        });
        let mut spec = TensorSpec::new(name, dtype, shape, Direction::EngineToClient).on(device);
        spec.vulkan = Some(VulkanSource::Import {
            memory: SharedFd::new(memory),
            export,
            semaphore: None,
        });
        spec
    }

    /// Adds the timeline semaphore the renderer signals with value `frame` when frame
    /// `frame` (≥ 1) in this tensor's memory is written (`vkGetSemaphoreFdKHR`,
    /// `OPAQUE_FD`): sent to the client after the memory fd; a CUDA importer waits on it
    /// on the consumer's stream. `SemaphoreKind::Binary` makes `Engine::create` fail with
    /// `InvalidSpec` (1.3 shares timeline semaphores only). No effect on a tensor not made
    /// by [`TensorSpec::vulkan_import`].
    pub fn with_semaphore(mut self, fd: OwnedFd, kind: SemaphoreKind) -> Self {
        if let Some(VulkanSource::Import { semaphore, .. }) = &mut self.vulkan {
            *semaphore = Some((SharedFd::new(fd), kind));
        }
        self
    }

    /// The same tensor on `device`.
    pub fn on(mut self, device: Device) -> Self {
        self.device = device;
        self
    }
}
