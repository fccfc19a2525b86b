//! The client's Vulkan backend: one tensor object whatever imports the memory. It picks
//! the importer before the slot is claimed, receives the fds over the region's socket
//! at open, and imports each tensor's memory once.
//!
//! The importer: a Vulkan device of the client's own (the `vulkan` feature), which maps
//! host-visible memory and hands out host pointers (kDLCPU): no copy, the mapped bytes
//! are the engine's. CUDA (`VulkanImporter::Cuda`) is not served by this build: it
//! answers `CudaUnavailable` with the reason, and `Auto` says why it took Vulkan.

use std::any::Any;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use super::VulkanImporter;
use crate::device::backend::{ClientBackend, DeviceLease, DevicePlace, StreamRef};
use crate::device::location::{Device, Location, VulkanDevice, DL_CPU};
use crate::error::{Error, Result};
use crate::layout::{Layout, TensorInfo};
use crate::region::Region;

#[cfg(feature = "vulkan")]
use super::vk::{Context, ImportedMemory};

/// The client's Vulkan state: the importer's device, and each tensor's import.
pub struct ClientVulkan {
    name: String,
    timeout: Duration,
    /// Why this importer (for logs and `importer_reason`).
    reason: String,
    /// Each tensor's import, by tensor index; shared with every view handed out (the
    /// lease), so a view keeps its mapping after the client closed. `None` before open
    /// and after release. Each import holds the device it was made on.
    imports: Option<Arc<Imports>>,
    #[cfg(feature = "vulkan")]
    ctx: Arc<Context>,
}

/// The imports of a client's Vulkan tensors: the lease its views hold.
#[derive(Debug, Default)]
struct Imports {
    #[cfg(feature = "vulkan")]
    memories: Vec<Option<ImportedMemory>>,
}

impl Imports {
    fn host_ptr(&self, index: usize, t: &TensorInfo) -> Option<NonNull<u8>> {
        #[cfg(feature = "vulkan")]
        {
            self.memories.get(index)?.as_ref()?.span(t.offset, t.nbytes)
        }
        #[cfg(not(feature = "vulkan"))]
        {
            let _ = (index, t);
            None
        }
    }
}

impl DeviceLease for Imports {
    /// Mapped on the CPU: the engine published the frame only once its queue was idle,
    /// and the client reads it only after `frame_seq` moved; nothing to wait for.
    fn order_after_frame(&self, _: StreamRef<'_>) -> Result<()> {
        Ok(())
    }
}

impl std::fmt::Debug for ClientVulkan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientVulkan")
            .field("region", &self.name)
            .field("importer", &self.reason)
            .finish_non_exhaustive()
    }
}

/// The one device of the engine's Vulkan tensors (1.3 serves one per engine).
fn engine_device(layout: &Layout) -> Result<VulkanDevice> {
    let mut devices = layout.tensors.iter().filter_map(|t| match t.device {
        Device::Vulkan(v) => Some((t, v)),
        _ => None,
    });
    let Some((first, dev)) = devices.next() else {
        return Err(Error::InvalidSpec("no Vulkan tensor in the layout".into()));
    };
    if let Some((t, _)) = devices.find(|(_, v)| *v != dev) {
        return Err(Error::InvalidTensor {
            tensor: t.name.clone(),
            reason: format!("on another Vulkan device than '{}'", first.name),
        });
    }
    Ok(dev)
}

impl ClientVulkan {
    /// Before claiming the slot: picks the importer and opens its device (the one with
    /// the engine's UUIDs). Nothing in the region is touched.
    pub fn prepare(
        layout: &Layout,
        name: &str,
        importer: VulkanImporter,
        timeout: Duration,
    ) -> Result<ClientVulkan> {
        let dev = engine_device(layout)?;
        let cuda_reason = match importer {
            VulkanImporter::Cuda => {
                return Err(Error::CudaUnavailable {
                    reason: "importing Vulkan memory into CUDA is not served by this build".into(),
                })
            }
            VulkanImporter::Auto => {
                "CUDA import of Vulkan memory is not served by this build".to_string()
            }
            VulkanImporter::Vulkan => "requested".to_string(),
        };
        #[cfg(feature = "vulkan")]
        {
            let ctx = Context::open(dev)?;
            let reason = format!(
                "Vulkan importer on {} (host-mapped, kDLCPU): {cuda_reason}",
                ctx.name()
            );
            Ok(ClientVulkan {
                name: name.to_string(),
                timeout,
                reason,
                imports: None,
                ctx,
            })
        }
        #[cfg(not(feature = "vulkan"))]
        {
            let _ = (dev, name, timeout, cuda_reason);
            let reason = match super::unavailable_without_feature() {
                Error::VulkanUnavailable { reason } => reason,
                e => e.to_string(),
            };
            let first = layout
                .tensors
                .iter()
                .find(|t| t.location() == Location::Vulkan)
                .map_or("?", |t| t.name.as_str());
            Err(Error::VulkanUnavailable {
                reason: format!("tensor '{first}' lives in Vulkan memory: {reason}"),
            })
        }
    }

    /// Which importer serves this client, and why.
    pub fn importer_reason(&self) -> &str {
        &self.reason
    }

    /// Receives the fds (after the slot is claimed: the engine sends them only to its
    /// attached client) and imports each tensor's memory. Every fd received is owned
    /// here at once, so each is closed exactly once (by the driver after an import,
    /// else when dropped).
    fn import_all(&mut self, layout: &Layout, fds: Vec<OwnedFd>) -> Result<()> {
        let mut fds = fds.into_iter();
        #[cfg_attr(not(feature = "vulkan"), allow(unused_mut))]
        let mut imports = Imports::default();
        for (i, t) in layout.tensors.iter().enumerate() {
            let Some(table) = t.vulkan.filter(|_| t.location() == Location::Vulkan) else {
                continue;
            };
            let Some(memory) = fds.next() else {
                return Err(Error::Protocol {
                    peer: crate::error::Peer::Engine,
                    detail: "fewer fds than Vulkan tensors".into(),
                });
            };
            // The CPU importer reads host-visible memory after `frame_seq`, which the
            // engine bumps only once its frame is complete: a semaphore adds nothing
            // here, and is closed.
            if table.semaphore.is_some() {
                drop(fds.next());
            }
            #[cfg(feature = "vulkan")]
            {
                let m = ImportedMemory::import(&self.ctx, memory, &table, &t.name)?;
                if m.span(t.offset, t.nbytes).is_none() {
                    return Err(Error::InvalidTensor {
                        tensor: t.name.clone(),
                        reason: "the tensor lies outside its imported memory".into(),
                    });
                }
                if imports.memories.len() < layout.tensors.len() {
                    imports.memories.resize_with(layout.tensors.len(), || None);
                }
                imports.memories[i] = Some(m);
            }
            #[cfg(not(feature = "vulkan"))]
            {
                let _ = (i, memory);
            }
        }
        self.imports = Some(Arc::new(imports));
        Ok(())
    }
}

impl ClientBackend for ClientVulkan {
    fn event_handle(&self) -> Option<[u8; 64]> {
        None
    }

    fn open(&mut self, layout: &Layout) -> Result<()> {
        let fds = crate::fdpass::receive(&self.name, super::fd_count(layout), self.timeout)?;
        self.import_all(layout, fds)
    }

    fn before_post(&self, _: Option<StreamRef<'_>>) -> Result<()> {
        Ok(())
    }

    fn device_ptr(&self, index: usize, t: &TensorInfo) -> Result<u64> {
        self.host_ptr(index, t)
            .map(|p| p.as_ptr() as u64)
            .ok_or_else(|| Error::NotOnHost {
                tensor: t.name.clone(),
                location: t.location().name(),
            })
    }

    fn host_ptr(&self, index: usize, t: &TensorInfo) -> Option<NonNull<u8>> {
        self.imports.as_ref()?.host_ptr(index, t)
    }

    fn place(&self, index: usize, t: &TensorInfo) -> Result<Option<DevicePlace>> {
        if t.location() != Location::Vulkan {
            return Ok(None);
        }
        let imports = self
            .imports
            .as_ref()
            .ok_or(Error::Closed(crate::error::Peer::Client))?;
        let ptr = imports
            .host_ptr(index, t)
            .ok_or_else(|| Error::InvalidTensor {
                tensor: t.name.clone(),
                reason: "not imported".into(),
            })?;
        // Mapped on the CPU: host memory of this process, outside the region, held open
        // by the lease.
        Ok(Some(DevicePlace {
            ptr: ptr.as_ptr() as u64,
            device: Device::Host,
            lease: imports.clone(),
        }))
    }

    fn order_after_frame(&self, _: StreamRef<'_>) -> Result<()> {
        Ok(())
    }

    unsafe fn copy_into(&self, _: u64, _: u64, _: usize, _: StreamRef<'_>) -> Result<()> {
        Err(Error::OutOfOrder(
            "a device copy into a Vulkan client's tensors: they are engine->client only",
        ))
    }

    fn dlpack_device(&self, index: usize, t: &TensorInfo) -> (i32, i32) {
        match self.host_ptr(index, t) {
            Some(_) => (DL_CPU, 0),
            None => t.device.dlpack(),
        }
    }

    fn release(&mut self, _: &Region) {
        // The engine needs no acknowledgement: an import holds its own reference to the
        // memory, so each mapping goes when its last holder (this client or a view) does.
        self.imports = None;
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl dyn ClientBackend {
    /// The Vulkan side of a client of Vulkan tensors; `None` for any other backend.
    pub fn as_vulkan(&self) -> Option<&ClientVulkan> {
        self.as_any().downcast_ref()
    }
}
