//! The engine's side of the header: from a spec to header and table bytes, each tensor
//! placed by its own device's rule.

use bytemuck::Zeroable;

use super::header::*;
use super::location::{Device, VulkanDevice};
use super::shard::{
    build_table, check_shardable, layout_hash_for, table_offset, ShardEntry, ShardInfo, ShardWords,
    SHARD_ENTRY_SIZE,
};
use super::stats::StatsArea;
use super::tensor::{
    contiguous_strides, CudaExport, CudaSharing, Direction, Rings, TensorInfo, TensorSpec,
    VulkanTable, MIN_RING_CAPACITY,
};
use std::os::fd::AsFd;

use super::vulkan::VulkanSource;
use crate::error::{Error, Result};

fn align_up(v: u64, a: u64) -> Option<u64> {
    Some(v.checked_add(a - 1)? / a * a)
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
    /// 1.3: the Vulkan tensors, by index in the table, and where their memory comes
    /// from. The engine's Vulkan backend allocates (path a) or takes over (path b) each,
    /// then calls [`HeaderBuilder::set_vulkan_export`].
    pub vulkan: Vec<(usize, VulkanSource)>,
    /// 1.4: the shard table (empty for an unsharded region), written after the tensor
    /// table at `header.shard_table_offset`.
    pub shard_entries: Vec<ShardEntry>,
    /// 1.7: the stats area after the tensors (one block per shard), which every region
    /// this builder writes has ([`FLAG_OBSERVABLE`]).
    pub stats: StatsArea,
}

impl HeaderBuilder {
    /// Fills in what the table says of Vulkan tensor `index` (1.3) once its memory
    /// exists: the device's UUIDs, the allocation size, memory type and flags. Nothing
    /// happens for an index that is not a Vulkan tensor.
    pub fn set_vulkan_export(&mut self, index: usize, device: VulkanDevice, table: VulkanTable) {
        let (Some(d), Some(t)) = (self.descs.get_mut(index), self.tensors.get_mut(index)) else {
            return;
        };
        if !matches!(t.device, Device::Vulkan(_)) {
            return;
        }
        d.device_uuid = device.device_uuid;
        d.driver_uuid = device.driver_uuid;
        d.export_size = table.alloc_size;
        d.export_memory_type = table.memory_type_index;
        d.flags = vulkan_flags(&table);
        t.device = Device::Vulkan(device);
        t.vulkan = Some(table);
    }

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
            if let (Some(c), Device::Cuda(dev)) = (t.cuda.as_mut(), &mut t.device) {
                d.ipc_mem_handle = ipc_mem_handle;
                d.device_uuid = device_uuid;
                c.ipc_mem_handle = ipc_mem_handle;
                dev.uuid = device_uuid;
            }
        }
        self.header.engine_event_handle = engine_event_handle;
    }

    /// Fills in a CUDA export shared by file descriptor (1.9) once the engine allocated
    /// [`Self::cuda_alloc`] with `cuMemCreate` (`alloc_size` bytes: the request rounded
    /// up to the device's granularity): [`CUDA_FLAG_FD`], the device UUID and
    /// `alloc_size` as `export_size` in every CUDA entry (their `ipc_mem_handle` stays
    /// zero: the fd travels over the region's socket), no engine event (frames are
    /// ordered on the host, §3.5.1: `engine_event_handle` stays zero), and
    /// `version_minor` 9. Nothing happens without CUDA tensors.
    pub fn set_cuda_fd_export(&mut self, device_uuid: [u8; 16], alloc_size: u64) {
        if self.cuda_alloc.is_none() {
            return;
        }
        self.set_cuda_export([0; 64], device_uuid, [0; 64]);
        for (d, t) in self.descs.iter_mut().zip(self.tensors.iter_mut()) {
            if let Some(c) = t.cuda.as_mut() {
                d.flags = CUDA_FLAG_FD;
                d.export_size = alloc_size;
                c.sharing = CudaSharing::Fd;
                c.alloc_size = alloc_size;
            }
        }
        self.header.version_minor = VERSION_MINOR_CUDA_FD;
    }

    /// `ring_capacity`: bytes of each command ring, a power of two ≥ 64, or 0 for none.
    pub fn new(
        engine_kind: &str,
        num_envs: u32,
        specs: &[TensorSpec],
        ring_capacity: u64,
    ) -> Result<Self> {
        Self::sharded(engine_kind, num_envs, specs, ring_capacity, 1)
    }

    /// As [`HeaderBuilder::new`], for a region served by `shards` engine processes
    /// (1.4): the env axis split into that many contiguous slices, each shard with its
    /// own table entry and rings. One shard is an ordinary (1.3) region.
    pub fn sharded(
        engine_kind: &str,
        num_envs: u32,
        specs: &[TensorSpec],
        ring_capacity: u64,
        shards: u32,
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
        let shard_count = if shards <= 1 { 0 } else { shards };
        let table_end =
            (table_offset(specs.len()) + shard_count as usize * SHARD_ENTRY_SIZE) as u64;
        let header_size = align_up(table_end, PAGE).expect("small");
        let mut cursor = header_size;
        if ring_capacity != 0
            && (!ring_capacity.is_power_of_two()
                || !(MIN_RING_CAPACITY..=(1 << 40)).contains(&ring_capacity))
        {
            return Err(Error::InvalidSpec(format!(
                "ring capacity {ring_capacity} must be a power of two between {MIN_RING_CAPACITY} and 2^40 (or 0: no command channel)"
            )));
        }
        let mut shard_entries = Vec::new();
        let rings = if ring_capacity == 0 {
            None
        } else if shard_count > 0 {
            // Each shard has its own pair; the control block names shard 0's.
            let (entries, end) = build_table(num_envs, shard_count, ring_capacity, cursor);
            cursor = end;
            let first = entries[0];
            shard_entries = entries;
            Some(Rings {
                c2e: (first.c2e_ring_offset, ring_capacity),
                e2c: (first.e2c_ring_offset, ring_capacity),
            })
        } else {
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
        let mut host = HostPlacement { cursor };
        let mut cuda = CudaPlacement::default();
        let mut vulkan = Vec::new();
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
            let mut vk_table = None;
            let (offset, export) = match s.device {
                Device::Host => (host.place(nbytes)?, None),
                Device::Cuda(dev) => {
                    let offset = cuda.place(&s.name, dev.ordinal, nbytes)?;
                    // The allocation's handle and size are set once every tensor is placed.
                    let export = CudaExport {
                        ipc_mem_handle: [0; 64],
                        sharing: CudaSharing::Ipc,
                        alloc_size: 0,
                    };
                    (offset, Some(export))
                }
                Device::Vulkan(_) => {
                    let (offset, table) = place_vulkan(s, nbytes)?;
                    vulkan.push((i, s.vulkan.clone().unwrap_or(VulkanSource::Allocate)));
                    vk_table = table;
                    (offset, None)
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
            d.location = s.device.location().code();
            d.device_ordinal = s.device.ordinal();
            d.shape[..s.shape.len()].copy_from_slice(&s.shape);
            let strides = contiguous_strides(&s.shape, s.dtype.size() as u64);
            d.strides[..strides.len()].copy_from_slice(&strides);
            d.offset = offset;
            d.nbytes = nbytes;
            if let (Some(t), Device::Vulkan(dev)) = (&vk_table, s.device) {
                d.device_uuid = dev.device_uuid;
                d.driver_uuid = dev.driver_uuid;
                d.export_size = t.alloc_size;
                d.export_memory_type = t.memory_type_index;
                d.flags = vulkan_flags(t);
            }
            descs.push(d);
            tensors.push(TensorInfo {
                name: s.name.clone(),
                dtype: s.dtype,
                shape: s.shape.clone(),
                direction: s.direction,
                device: s.device,
                offset,
                nbytes,
                cuda: export,
                vulkan: vk_table,
            });
        }
        let cuda_alloc = cuda.allocation()?;
        if cuda_alloc.is_some() && !vulkan.is_empty() {
            return Err(Error::InvalidSpec(
                "an engine serves CUDA tensors or Vulkan tensors, not both (protocol 1.3)".into(),
            ));
        }
        if let Some((_, size)) = cuda_alloc {
            for (d, t) in descs.iter_mut().zip(tensors.iter_mut()) {
                if let Some(c) = t.cuda.as_mut() {
                    c.alloc_size = size;
                    d.export_size = size;
                }
            }
        }
        if shard_count > 0 {
            check_shardable(num_envs, shard_count, &tensors)?;
            if shard_entries.is_empty() {
                shard_entries = build_table(num_envs, shard_count, 0, 0).0;
            }
        }
        // 1.7: the stats area after the last tensor, so that no tensor, ring or header
        // byte moves: an earlier client reads the same region as before, only larger.
        let (stats, region_size) = StatsArea::after(host.cursor, shard_count.max(1))
            .filter(|&(_, end)| end <= isize::MAX as u64)
            .ok_or_else(|| Error::InvalidSpec("region too large".into()))?;
        let mut h = Header::zeroed();
        // `magic` stays zero here: the region publishes it last.
        h.version_major = VERSION_MAJOR;
        h.version_minor = if shard_count > 0 {
            VERSION_MINOR_SHARDED
        } else if cuda_alloc.is_some() {
            VERSION_MINOR_CUDA_SESSIONS
        } else if !vulkan.is_empty() {
            VERSION_MINOR_FD_HELLO
        } else {
            VERSION_MINOR_UNSHARDED
        };
        h.header_size = header_size as u32;
        h.region_size = region_size;
        h.flags = if shard_count > 0 {
            FLAG_OBSERVABLE | FLAG_SHARD_ACTIONS
        } else {
            FLAG_OBSERVABLE
        };
        h.stats_offset = stats.offset;
        h.layout_hash = layout_hash_for(shard_count, h.version_minor);
        h.shard_count = shard_count;
        if shard_count > 0 {
            h.shard_table_offset = table_offset(specs.len()) as u32;
        }
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
            vulkan,
            shard_entries,
            stats,
        })
    }

    /// The shards as a validated layout lists them (one in the control block when
    /// unsharded).
    pub fn shards(&self) -> Vec<ShardInfo> {
        if self.shard_entries.is_empty() {
            return vec![ShardInfo {
                index: 0,
                env_start: 0,
                env_count: self.header.num_envs,
                rings: self.rings,
                words: ShardWords::CONTROL_BLOCK,
            }];
        }
        let table = self.header.shard_table_offset as usize;
        let cap = (self.header.c2e_ring_capacity, self.header.e2c_ring_capacity);
        self.shard_entries
            .iter()
            .enumerate()
            .map(|(k, e)| ShardInfo {
                index: k as u32,
                env_start: e.env_start,
                env_count: e.env_count,
                rings: self.rings.map(|_| Rings {
                    c2e: (e.c2e_ring_offset, cap.0),
                    e2c: (e.e2c_ring_offset, cap.1),
                }),
                words: ShardWords::entry(table, k),
            })
            .collect()
    }

    /// Header and table bytes, `header_size` long, magic still zero.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.header.header_size as usize];
        out[..CONTROL_SIZE].copy_from_slice(bytemuck::bytes_of(&self.header));
        for (i, d) in self.descs.iter().enumerate() {
            let at = CONTROL_SIZE + i * DESC_SIZE;
            out[at..at + DESC_SIZE].copy_from_slice(bytemuck::bytes_of(d));
        }
        let table = self.header.shard_table_offset as usize;
        for (k, e) in self.shard_entries.iter().enumerate() {
            let at = table + k * SHARD_ENTRY_SIZE;
            out[at..at + SHARD_ENTRY_SIZE].copy_from_slice(bytemuck::bytes_of(e));
        }
        out
    }
}

/// The `flags` byte of a Vulkan tensor's entry.
fn vulkan_flags(t: &VulkanTable) -> u8 {
    use super::vulkan::SemaphoreKind;
    let mut f = 0;
    if t.dedicated {
        f |= VK_FLAG_DEDICATED;
    }
    match t.semaphore {
        Some(SemaphoreKind::Timeline) => f |= VK_FLAG_SEMAPHORE | VK_FLAG_TIMELINE,
        Some(SemaphoreKind::Binary) => f |= VK_FLAG_SEMAPHORE,
        None => {}
    }
    f
}

/// A Vulkan tensor (1.3): engine→client, in its own exported memory. Path (a) puts it
/// at offset 0 of a buffer the backend allocates (the table is filled in then); path
/// (b) says where it lies in the renderer's memory, checked here.
fn place_vulkan(s: &TensorSpec, nbytes: u64) -> Result<(u64, Option<VulkanTable>)> {
    if s.direction != Direction::EngineToClient {
        return Err(Error::InvalidSpec(format!(
            "tensor '{}': Vulkan tensors are engine->client (rendered frames) in protocol 1.3",
            s.name
        )));
    }
    let Some(VulkanSource::Import {
        memory,
        export,
        semaphore,
    }) = &s.vulkan
    else {
        return Ok((0, None));
    };
    if let Some((_, super::vulkan::SemaphoreKind::Binary)) = semaphore {
        return Err(Error::InvalidSpec(format!(
            "tensor '{}': a binary semaphore cannot be shared (1.3 takes timeline semaphores: \
             a binary one needs exactly one wait per signal from every client, which a client \
             that maps the memory on the CPU cannot give; export a timeline semaphore, \
             Vulkan 1.2)",
            s.name
        )));
    }
    if export.device_uuid == [0; 16] {
        // A client refuses a table entry without one (and could not pick its device).
        return Err(Error::InvalidSpec(format!(
            "tensor '{}': the device UUID is all zero: pass the exporting device's \
             VkPhysicalDeviceIDProperties::deviceUUID",
            s.name
        )));
    }
    let end = export.offset.checked_add(nbytes);
    if export.offset % DATA_ALIGN != 0 || end.is_none_or(|e| e > export.alloc_size) {
        return Err(Error::InvalidSpec(format!(
            "tensor '{}': {} bytes at offset {} do not fit the exported {}-byte memory \
             (the offset must be a multiple of {DATA_ALIGN})",
            s.name, nbytes, export.offset, export.alloc_size
        )));
    }
    exported_fd_fits(&s.name, "memory", memory.as_fd(), Some(export.alloc_size))?;
    if let Some((fd, _)) = semaphore {
        exported_fd_fits(&s.name, "semaphore", fd.as_fd(), None)?;
    }
    let table = VulkanTable {
        alloc_size: export.alloc_size,
        memory_type_index: export.memory_type_index,
        dedicated: export.dedicated,
        semaphore: semaphore.as_ref().map(|(_, k)| *k),
    };
    Ok((export.offset, Some(table)))
}

/// What the kernel can tell of an fd said to be exported memory (`alloc_size` bytes) or a
/// semaphore (`None`) before it is forwarded to clients: its kind, and its size where
/// `st_size` means one (a regular file such as lavapipe's memfd, a dma-buf). A GPU
/// driver's opaque fd may be an anonymous inode or a device node with no size to check:
/// what it holds only the importing driver can tell (`docs/c-api.md`).
fn exported_fd_fits(
    tensor: &str,
    what: &str,
    fd: std::os::fd::BorrowedFd<'_>,
    alloc_size: Option<u64>,
) -> Result<()> {
    use crate::os::FdKind;
    let (kind, size) = crate::os::fd_kind(fd)?;
    let refused = match kind {
        FdKind::Other(k) => Some(k.to_string()),
        FdKind::CharDevice { terminal: true, .. } => Some("a terminal".into()),
        FdKind::CharDevice { memory: true, .. } => {
            Some("one of the kernel's memory devices (/dev/null, /dev/zero...)".into())
        }
        FdKind::File { named: true } => {
            Some("a file with a name in a filesystem (an exported object has none)".into())
        }
        FdKind::File { named: false } | FdKind::Anonymous | FdKind::CharDevice { .. } => None,
    };
    if let Some(k) = refused {
        return Err(Error::InvalidSpec(format!(
            "tensor '{tensor}': the {what} fd is {k}, not what vkGet{}FdKHR exports",
            if what == "memory" {
                "Memory"
            } else {
                "Semaphore"
            }
        )));
    }
    let sized = matches!(kind, FdKind::File { .. }) || (kind == FdKind::Anonymous && size > 0);
    match alloc_size {
        Some(need) if sized && size < need => Err(Error::InvalidSpec(format!(
            "tensor '{tensor}': the memory fd holds {size} bytes, fewer than the declared \
             allocation size {need}"
        ))),
        _ => Ok(()),
    }
}

/// Host tensors: in the region, after the header and the rings; cache-line aligned, and
/// page aligned from a page up.
struct HostPlacement {
    cursor: u64,
}

impl HostPlacement {
    fn place(&mut self, nbytes: u64) -> Result<u64> {
        let too_large = || Error::InvalidSpec("region too large".into());
        let align = if nbytes >= PAGE { PAGE } else { DATA_ALIGN };
        let offset = align_up(self.cursor, align).ok_or_else(too_large)?;
        self.cursor = offset.checked_add(nbytes).ok_or_else(too_large)?;
        Ok(offset)
    }
}

/// CUDA tensors (1.2): one exported allocation on one device per engine, each tensor at
/// a [`CUDA_ALIGN`] offset in it.
#[derive(Default)]
struct CudaPlacement {
    device: Option<i32>,
    cursor: u64,
}

impl CudaPlacement {
    fn place(&mut self, name: &str, ordinal: i32, nbytes: u64) -> Result<u64> {
        if ordinal < 0 {
            return Err(Error::InvalidSpec(format!(
                "tensor '{name}': CUDA device ordinal {ordinal} < 0"
            )));
        }
        if let Some(first) = self.device.filter(|&o| o != ordinal) {
            return Err(Error::InvalidSpec(format!(
                "tensor '{name}' is on cuda:{ordinal} but an earlier one is on \
                 cuda:{first}: protocol 1.2 serves one CUDA device per engine"
            )));
        }
        self.device = Some(ordinal);
        let too_large = || Error::InvalidSpec("CUDA tensors too large".into());
        let offset = align_up(self.cursor, CUDA_ALIGN).ok_or_else(too_large)?;
        self.cursor = offset.checked_add(nbytes).ok_or_else(too_large)?;
        Ok(offset)
    }

    /// `(ordinal, size)` of the allocation, rounded up to [`CUDA_EXPORT_GRANULARITY`];
    /// `None` without CUDA tensors.
    fn allocation(&self) -> Result<Option<(i32, u64)>> {
        let Some(ordinal) = self.device else {
            return Ok(None);
        };
        let size = align_up(self.cursor.max(1), CUDA_EXPORT_GRANULARITY)
            .filter(|&n| n <= isize::MAX as u64)
            .ok_or_else(|| Error::InvalidSpec("CUDA tensors too large".into()))?;
        Ok(Some((ordinal, size)))
    }
}
