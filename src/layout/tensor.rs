//! What a tensor is: the engine's request ([`TensorSpec`]) and a validated table entry
//! ([`TensorInfo`]), with what the table says of its device memory; and where the
//! command rings lie ([`Rings`]).

use std::os::fd::OwnedFd;

use super::dtype::DType;
use super::location::{Device, Location, VulkanDevice};
use super::vulkan::{SemaphoreKind, SharedFd, VulkanExport, VulkanSource};

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
    /// IPC handle of the allocation's base (the engine fills it in after allocating);
    /// all zero when the allocation is shared by fd.
    pub ipc_mem_handle: [u8; 64],
    /// How the allocation is shared (1.9: [`CudaSharing::Fd`] where the entry has
    /// `CUDA_FLAG_FD`).
    pub sharing: CudaSharing,
    /// Size of that allocation (`offset + nbytes <= alloc_size`).
    pub alloc_size: u64,
}

/// How an engine shares a CUDA allocation (the tensor table says which, per entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaSharing {
    /// CUDA IPC (1.2): `ipc_mem_handle`, opened with `cuIpcOpenMemHandle`. Works only
    /// between processes of one PID namespace.
    Ipc,
    /// A file descriptor of a `cuMemCreate` allocation passed over the region's fd
    /// socket and imported with `cuMemImportFromShareableHandle` (1.9). Works
    /// across PID namespaces (containers).
    Fd,
}

impl TensorInfo {
    /// Which kind of memory the bytes are in (the table's `location` byte).
    pub fn location(&self) -> Location {
        self.device.location()
    }

    /// The table's fields of a tensor outside the region, as one line (what `shmbridge
    /// inspect` prints under it); `None` in host memory.
    pub fn export_fields(&self) -> Option<String> {
        use super::location::uuid_hex;
        match self.device {
            Device::Host => None,
            Device::Cuda(c) => Some(format!(
                "cuda ordinal {} uuid {} alloc_size {}",
                c.ordinal,
                uuid_hex(&c.uuid),
                self.cuda.map_or(0, |e| e.alloc_size)
            )),
            Device::Vulkan(v) => {
                let table = self.vulkan?;
                let semaphore = match table.semaphore {
                    None => "none",
                    Some(SemaphoreKind::Timeline) => "timeline",
                    Some(SemaphoreKind::Binary) => "binary",
                };
                Some(format!(
                    "vulkan device_uuid {} driver_uuid {} alloc_size {} memory_type {} \
                     dedicated {} semaphore {semaphore}",
                    uuid_hex(&v.device_uuid),
                    uuid_hex(&v.driver_uuid),
                    table.alloc_size,
                    table.memory_type_index,
                    if table.dedicated { "yes" } else { "no" },
                ))
            }
        }
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
