//! The client's side of the header: validation of untrusted bytes. Every offset, length
//! and product is checked with overflow-checked arithmetic; nothing here can panic or
//! index out of bounds.

use super::dtype::DType;
use super::header::*;
use super::location::{CudaDevice, Device, Location, VulkanDevice};
use super::shard::{layout_hash_for, table_offset, validate_table};
use super::stats::validate_area;
use super::tensor::{
    contiguous_strides, CudaExport, CudaSharing, Direction, Rings, TensorInfo, VulkanTable,
    MIN_RING_CAPACITY,
};
use super::validated::Layout;
use super::vulkan::SemaphoreKind;
use crate::error::{Error, Result};

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
    let table_end = table_offset(count) as u64;
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
    check_cuda_fd_export(&tensors)?;
    let rings = validate_rings(&h, header_size)?;
    let shards = validate_table(&h, bytes, header_size, rings, &tensors)?;
    let stats = validate_area(
        h.flags,
        h.stats_offset,
        h.shard_count,
        header_size,
        h.region_size,
    )?;
    // IPC tables only: memory shared by fd (1.9) is ordered on the host, and its
    // `engine_event_handle` (zero as written) is not read.
    let has_cuda = tensors
        .iter()
        .any(|t| t.cuda.is_some_and(|c| c.sharing == CudaSharing::Ipc));
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
        .filter(|t| t.location() == Location::Host)
        .map(|t| (t.offset, t.offset + t.nbytes, t.name.as_str()))
        .collect();
    // Every shard's rings (an unsharded region's one shard has the control block's).
    for r in shards.iter().filter_map(|s| s.rings) {
        spans.push((r.c2e.0, r.c2e.0 + r.c2e.1, "<c2e ring>"));
        spans.push((r.e2c.0, r.e2c.0 + r.e2c.1, "<e2c ring>"));
    }
    if let Some(a) = stats {
        spans.push((a.offset, a.offset + a.len(), "<stats area>"));
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
        shard_actions: h.shard_count > 0 && h.flags & FLAG_SHARD_ACTIONS != 0,
        shards,
        stats,
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
    let location = match Location::from_code(d.location) {
        Some(Location::Host) => Location::Host,
        Some(Location::Cuda) if version_minor >= 2 => Location::Cuda,
        Some(Location::Cuda) => {
            return Err(invalid(format!(
                "location cuda in a protocol 1.{version_minor} header (CUDA tensors need 1.2)"
            )))
        }
        Some(Location::Vulkan) if version_minor >= 3 => Location::Vulkan,
        Some(Location::Vulkan) => {
            return Err(invalid(format!(
                "location vulkan in a protocol 1.{version_minor} header (Vulkan tensors need 1.3)"
            )))
        }
        None => return Err(invalid(format!("location {}", d.location))),
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
    let mut vulkan = None;
    let (device, cuda) = if location == Location::Vulkan {
        let known = VK_FLAG_DEDICATED | VK_FLAG_SEMAPHORE | VK_FLAG_TIMELINE;
        if d.flags & !known != 0 {
            return Err(invalid(format!("unknown Vulkan flags {:#04x}", d.flags)));
        }
        let semaphore = match (
            d.flags & VK_FLAG_SEMAPHORE != 0,
            d.flags & VK_FLAG_TIMELINE != 0,
        ) {
            (true, true) => Some(SemaphoreKind::Timeline),
            (true, false) => {
                return Err(invalid(
                    "a binary semaphore (flags bit 1 without bit 2): 1.3 shares timeline \
                     semaphores only"
                        .into(),
                ))
            }
            (false, false) => None,
            (false, true) => return Err(invalid("timeline flag without a semaphore".into())),
        };
        if direction != Direction::EngineToClient {
            return Err(invalid(
                "location vulkan on a client->engine tensor (1.3: engine->client only)".into(),
            ));
        }
        if d.device_uuid == [0; 16] {
            return Err(invalid("location vulkan without a device UUID".into()));
        }
        if d.export_size == 0 || end.is_none_or(|e| e > d.export_size) {
            return Err(invalid(format!(
                "Vulkan span {} + {} lies outside its {}-byte memory",
                d.offset, d.nbytes, d.export_size
            )));
        }
        vulkan = Some(VulkanTable {
            alloc_size: d.export_size,
            memory_type_index: d.export_memory_type,
            dedicated: d.flags & VK_FLAG_DEDICATED != 0,
            semaphore,
        });
        let device = Device::Vulkan(VulkanDevice {
            device_uuid: d.device_uuid,
            driver_uuid: d.driver_uuid,
        });
        (device, None)
    } else if location == Location::Cuda {
        if d.device_ordinal < 0 {
            return Err(invalid(format!(
                "CUDA device ordinal {} < 0",
                d.device_ordinal
            )));
        }
        let sharing = cuda_sharing(d, version_minor).map_err(invalid)?;
        if d.export_size == 0 || end.is_none_or(|e| e > d.export_size) {
            return Err(invalid(format!(
                "CUDA span {} + {} lies outside its {}-byte allocation",
                d.offset, d.nbytes, d.export_size
            )));
        }
        let device = Device::Cuda(CudaDevice {
            ordinal: d.device_ordinal,
            uuid: d.device_uuid,
        });
        let export = CudaExport {
            ipc_mem_handle: d.ipc_mem_handle,
            sharing,
            alloc_size: d.export_size,
        };
        (device, Some(export))
    } else {
        if d.offset < header_size || end.is_none_or(|e| e > region_size) {
            return Err(Error::TensorOutOfBounds {
                tensor: name,
                offset: d.offset,
                len: d.nbytes,
                region_size,
            });
        }
        (Device::Host, None)
    };
    Ok(TensorInfo {
        name,
        dtype,
        shape,
        direction,
        device,
        offset: d.offset,
        nbytes: d.nbytes,
        cuda,
        vulkan,
    })
}

/// The most `export_size` may say for CUDA memory shared by fd whose tensors end at byte
/// `end` of the allocation: the next power of two ≥ `end`, and at least
/// [`CUDA_EXPORT_GRANULARITY`] (2 MiB). An engine allocates `end` rounded up to the
/// device's allocation granularity (`cuMemGetAllocationGranularity`, a power of two: 2 MiB
/// on NVIDIA's GPUs), which is never more than this; a client maps `export_size` bytes.
pub fn cuda_fd_export_cap(end: u64) -> u64 {
    end.checked_next_power_of_two()
        .unwrap_or(u64::MAX)
        .max(CUDA_EXPORT_GRANULARITY)
}

/// The `export_size` of CUDA memory shared by fd (1.9), across entries: one fd crosses the
/// socket, so every such entry names the same allocation, and says the same size; and
/// that size is at most [`cuda_fd_export_cap`] of the tensors' furthest end (an absurd
/// size is refused here, not handed to the driver to reserve and map). Each span lies
/// inside the size already ([`validate_desc`]). `InvalidTensor` naming the entry that
/// breaks it, before anything is imported. The engine checks its own table with it too.
pub fn check_cuda_fd_export(tensors: &[TensorInfo]) -> Result<()> {
    let mut fd = tensors.iter().filter_map(|t| {
        t.cuda
            .filter(|c| c.sharing == CudaSharing::Fd)
            .map(|c| (t, c.alloc_size))
    });
    let Some((first, size)) = fd.next() else {
        return Ok(());
    };
    let end_of = |t: &TensorInfo| t.offset.saturating_add(t.nbytes);
    let mut end = end_of(first);
    for (t, other) in fd {
        if other != size {
            return Err(Error::InvalidTensor {
                tensor: t.name.clone(),
                reason: format!(
                    "CUDA memory shared by fd: export_size {other} differs from the {size} of \
                     '{}' (one allocation, one fd: one size)",
                    first.name
                ),
            });
        }
        end = end.max(end_of(t));
    }
    let cap = cuda_fd_export_cap(end);
    if size > cap {
        return Err(Error::InvalidTensor {
            tensor: first.name.clone(),
            reason: format!(
                "CUDA memory shared by fd: export_size {size} is more than {cap}, the most an \
                 allocation of tensors ending at byte {end} takes"
            ),
        });
    }
    Ok(())
}

/// How a CUDA entry's allocation is shared, from its `flags` and `ipc_mem_handle`: an
/// IPC handle (no flag, a non-zero handle), or, from 1.9, a file descriptor
/// ([`CUDA_FLAG_FD`], the handle all zero). Anything else (another flag bit, the flag
/// before 1.9, both or neither) is refused with the reason.
fn cuda_sharing(d: &TensorDesc, version_minor: u16) -> std::result::Result<CudaSharing, String> {
    let has_handle = d.ipc_mem_handle.iter().any(|&b| b != 0);
    if d.flags & !CUDA_FLAG_FD != 0 {
        return Err(format!("unknown CUDA flags {:#04x}", d.flags));
    }
    if d.flags & CUDA_FLAG_FD == 0 {
        return match has_handle {
            true => Ok(CudaSharing::Ipc),
            false => Err("CUDA tensor without an IPC memory handle".into()),
        };
    }
    if version_minor < VERSION_MINOR_CUDA_FD {
        return Err(format!(
            "CUDA memory shared by fd (flags bit 0) in a protocol 1.{version_minor} header \
             (it needs 1.{VERSION_MINOR_CUDA_FD})"
        ));
    }
    if has_handle {
        return Err(
            "CUDA tensor shared by fd (flags bit 0) that also names an IPC memory handle".into(),
        );
    }
    Ok(CudaSharing::Fd)
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
    let ours = layout_hash_for(h.shard_count, h.version_minor);
    if h.layout_hash != ours {
        return Err(Error::LayoutMismatch {
            ours,
            theirs: h.layout_hash,
        });
    }
    Ok(())
}
