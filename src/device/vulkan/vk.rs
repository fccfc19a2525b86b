//! The Vulkan layer (ash, loader opened at run time): one device of this process, the
//! exportable buffers of path (a), and the imports of the client's Vulkan importer. All
//! Vulkan FFI and its `unsafe` live here and in `compute.rs` (the compute shaders an
//! engine runs on this device, on top of this).

use std::os::fd::{AsFd, IntoRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use ash::vk;

use crate::error::{Error, Result};
use crate::layout::location::VulkanDevice;
use crate::layout::vulkan::SharedFd;
use crate::layout::VulkanTable;
use crate::os;

pub(super) fn call(call: &'static str) -> impl Fn(vk::Result) -> Error {
    move |e| Error::Vulkan {
        call,
        detail: format!("{e:?}"),
    }
}

fn unavailable(reason: String) -> Error {
    Error::VulkanUnavailable { reason }
}

fn hex(b: &[u8; 16]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

const OPAQUE_FD: vk::ExternalMemoryHandleTypeFlags = vk::ExternalMemoryHandleTypeFlags::OPAQUE_FD;

/// Preference among the devices that fit a request for any device: discrete GPU first,
/// the CPU driver last.
fn device_rank(t: vk::PhysicalDeviceType) -> u8 {
    match t {
        vk::PhysicalDeviceType::DISCRETE_GPU => 0,
        vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
        vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
        vk::PhysicalDeviceType::CPU => 4,
        _ => 3,
    }
}

/// A Vulkan device of this process that can export and import `OPAQUE_FD` memory, with
/// one queue.
pub struct Context {
    // Destroyed by hand in `Drop`, device before instance; the entry (the loader) last.
    instance: ash::Instance,
    device: ash::Device,
    memory_fd: ash::khr::external_memory_fd::Device,
    physical: vk::PhysicalDevice,
    queue_family: u32,
    queue: vk::Queue,
    ids: VulkanDevice,
    memory: vk::PhysicalDeviceMemoryProperties,
    cpu: bool,
    name: String,
    /// The process that made it: in a child forked from it the driver's state (its
    /// threads, its device files) is the parent's, so nothing made on this device is
    /// destroyed there (see [`Context::made_here`]).
    pid: u32,
    _entry: ash::Entry,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("vulkan::Context")
            .field("device", &self.name)
            .field("device_uuid", &hex(&self.ids.device_uuid))
            .finish_non_exhaustive()
    }
}

// SAFETY: Vulkan handles may be used from any thread; the calls made through `&Context`
// (map, allocate, free, queue wait) are externally synchronised by their owners
// (`ExportedBuffer`, `ImportedMemory`), and the queue is only waited on through
// `queue_wait_idle`, which the engine calls from its one stepping thread.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Loads the loader, creates a Vulkan 1.1 instance and a device with
    /// `VK_KHR_external_memory_fd`: the one whose UUIDs are `want`'s (all zero: any).
    /// `VulkanUnavailable` with the reason when there is no loader, no driver, or no such
    /// device.
    pub fn open(want: VulkanDevice) -> Result<Arc<Context>> {
        // SAFETY: loading the system's Vulkan loader runs its initialisers; it is the
        // library Vulkan applications load, and nothing else of it is called before
        // `load` succeeded.
        let entry = unsafe { ash::Entry::load() }
            .map_err(|e| unavailable(format!("no Vulkan loader (libvulkan.so.1): {e}")))?;
        // SAFETY: a valid entry; no pointers passed.
        let version = unsafe { entry.try_enumerate_instance_version() }
            .map_err(call("vkEnumerateInstanceVersion"))?
            .unwrap_or(vk::API_VERSION_1_0);
        if version < vk::API_VERSION_1_1 {
            return Err(unavailable(format!(
                "the Vulkan loader speaks {}.{}; external memory needs 1.1",
                vk::api_version_major(version),
                vk::api_version_minor(version)
            )));
        }
        let app = vk::ApplicationInfo::default()
            .application_name(c"shmbridge")
            .api_version(vk::API_VERSION_1_1);
        let info = vk::InstanceCreateInfo::default().application_info(&app);
        // SAFETY: `info` and what it points to live across the call.
        let instance = unsafe { entry.create_instance(&info, None) }.map_err(|e| {
            unavailable(format!(
                "no Vulkan driver: vkCreateInstance gave {e:?} (install an ICD, e.g. \
                 Debian's mesa-vulkan-drivers for the CPU driver lavapipe)"
            ))
        })?;
        match Self::with_instance(&entry, &instance, want) {
            Ok((physical, ids, cpu, name, queue_family)) => {
                Self::finish(entry, instance, physical, ids, cpu, name, queue_family)
            }
            Err(e) => {
                // SAFETY: nothing was created from the instance.
                unsafe { instance.destroy_instance(None) };
                Err(e)
            }
        }
    }

    /// Picks the physical device and its queue family.
    #[allow(clippy::type_complexity)]
    fn with_instance(
        _entry: &ash::Entry,
        instance: &ash::Instance,
        want: VulkanDevice,
    ) -> Result<(vk::PhysicalDevice, VulkanDevice, bool, String, u32)> {
        // SAFETY: a live instance.
        let physicals = unsafe { instance.enumerate_physical_devices() }
            .map_err(call("vkEnumeratePhysicalDevices"))?;
        let mut seen = Vec::new();
        // Any device that fits: a GPU before a CPU driver (a machine with an NVIDIA GPU
        // may have lavapipe installed too, and an old loader does not sort them).
        #[allow(clippy::type_complexity)]
        let mut best: Option<(u8, (vk::PhysicalDevice, VulkanDevice, bool, String, u32))> = None;
        for pd in physicals {
            let mut id = vk::PhysicalDeviceIDProperties::default();
            let mut props = vk::PhysicalDeviceProperties2::default().push_next(&mut id);
            // SAFETY: `pd` came from this instance; `props` chains `id` for the call.
            unsafe { instance.get_physical_device_properties2(pd, &mut props) };
            let p = props.properties;
            let name = p
                .device_name_as_c_str()
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
            let ids = VulkanDevice {
                device_uuid: id.device_uuid,
                driver_uuid: id.driver_uuid,
            };
            seen.push(format!(
                "{name} (device {}, driver {})",
                hex(&ids.device_uuid),
                hex(&ids.driver_uuid)
            ));
            if p.api_version < vk::API_VERSION_1_1 {
                continue;
            }
            if want.device_uuid != [0; 16] && want.device_uuid != ids.device_uuid {
                continue;
            }
            if want.driver_uuid != [0; 16] && want.driver_uuid != ids.driver_uuid {
                continue;
            }
            // SAFETY: `pd` came from this instance.
            let exts = unsafe { instance.enumerate_device_extension_properties(pd) }
                .map_err(call("vkEnumerateDeviceExtensionProperties"))?;
            let has_fd = exts
                .iter()
                .any(|e| e.extension_name_as_c_str() == Ok(ash::khr::external_memory_fd::NAME));
            if !has_fd {
                continue;
            }
            // SAFETY: `pd` came from this instance.
            let families = unsafe { instance.get_physical_device_queue_family_properties(pd) };
            let Some(family) = families
                .iter()
                .position(|f| {
                    f.queue_flags
                        .intersects(vk::QueueFlags::COMPUTE | vk::QueueFlags::GRAPHICS)
                })
                .or(if families.is_empty() { None } else { Some(0) })
            else {
                continue;
            };
            let cpu = p.device_type == vk::PhysicalDeviceType::CPU;
            let rank = device_rank(p.device_type);
            if best.as_ref().is_none_or(|b: &(u8, _)| rank < b.0) {
                best = Some((rank, (pd, ids, cpu, name, family as u32)));
            }
        }
        if let Some((_, found)) = best {
            return Ok(found);
        }
        let wanted = if want == VulkanDevice::ANY {
            "a device with VK_KHR_external_memory_fd".to_string()
        } else {
            format!(
                "the engine's device UUID {} (driver UUID {})",
                hex(&want.device_uuid),
                hex(&want.driver_uuid)
            )
        };
        Err(unavailable(format!(
            "no Vulkan device here has {wanted}; devices: [{}]",
            seen.join(", ")
        )))
    }

    /// The largest storage buffer a descriptor may cover and the largest allocation
    /// (`maxStorageBufferRange`, `maxMemoryAllocationSize`).
    pub fn storage_limits(&self) -> (u64, u64) {
        let mut maintenance3 = vk::PhysicalDeviceMaintenance3Properties::default();
        let mut props = vk::PhysicalDeviceProperties2::default().push_next(&mut maintenance3);
        // SAFETY: `physical` belongs to `instance`; `props` chains `maintenance3` (core in
        // 1.1) for the call.
        unsafe {
            self.instance
                .get_physical_device_properties2(self.physical, &mut props)
        };
        let range = u64::from(props.properties.limits.max_storage_buffer_range);
        (range, maintenance3.max_memory_allocation_size)
    }

    fn finish(
        entry: ash::Entry,
        instance: ash::Instance,
        physical: vk::PhysicalDevice,
        ids: VulkanDevice,
        cpu: bool,
        name: String,
        queue_family: u32,
    ) -> Result<Arc<Context>> {
        let priorities = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(queue_family)
            .queue_priorities(&priorities)];
        let exts = [ash::khr::external_memory_fd::NAME.as_ptr()];
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&exts);
        // SAFETY: `physical` belongs to `instance`; `info` and its arrays live across
        // the call; the extension is supported (checked when picking the device).
        let device = match unsafe { instance.create_device(physical, &info, None) } {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: nothing else was created from the instance.
                unsafe { instance.destroy_instance(None) };
                return Err(call("vkCreateDevice")(e));
            }
        };
        // SAFETY: the family was created with one queue.
        let queue = unsafe { device.get_device_queue(queue_family, 0) };
        // SAFETY: `physical` belongs to `instance`.
        let memory = unsafe { instance.get_physical_device_memory_properties(physical) };
        let memory_fd = ash::khr::external_memory_fd::Device::new(&instance, &device);
        Ok(Arc::new(Context {
            instance,
            device,
            memory_fd,
            physical,
            queue_family,
            queue,
            ids,
            memory,
            cpu,
            name,
            pid: crate::os::current_pid(),
            _entry: entry,
        }))
    }

    /// Whether this process made the device: `false` in a child forked after, where
    /// every object of it is left as it is when dropped (the child's exit frees its copy
    /// of the memory). Destroying them there would call the driver, whose threads the
    /// child does not have (lavapipe's queue thread: the child hung), and whose device
    /// files it shares with its parent (a GPU driver would free the parent's objects).
    pub fn made_here(&self) -> bool {
        self.pid == crate::os::current_pid()
    }

    /// The device's UUIDs.
    pub fn ids(&self) -> VulkanDevice {
        self.ids
    }

    /// The device's name (`VkPhysicalDeviceProperties::deviceName`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether it is a CPU device (lavapipe).
    pub fn is_cpu(&self) -> bool {
        self.cpu
    }

    /// The instance, for a renderer that records work on this device.
    pub fn instance(&self) -> &ash::Instance {
        &self.instance
    }

    /// The logical device, for a renderer that records work into the exported buffers.
    pub fn device(&self) -> &ash::Device {
        &self.device
    }

    pub fn physical_device(&self) -> vk::PhysicalDevice {
        self.physical
    }

    /// The queue family of [`Context::queue`].
    pub fn queue_family(&self) -> u32 {
        self.queue_family
    }

    /// The device's one queue: submit a frame's work here, and
    /// [`Engine::publish`](crate::Engine::publish) waits for it before `frame_seq` moves.
    pub fn queue(&self) -> vk::Queue {
        self.queue
    }

    /// `vkQueueWaitIdle`: every submitted frame's work is complete.
    pub fn queue_wait_idle(&self) -> Result<()> {
        // SAFETY: a queue of this device; the engine calls this from its stepping
        // thread, the one that submits to it.
        unsafe { self.device.queue_wait_idle(self.queue) }.map_err(call("vkQueueWaitIdle"))
    }

    fn memory_type(&self, index: u32) -> Option<vk::MemoryPropertyFlags> {
        (index < self.memory.memory_type_count)
            .then(|| self.memory.memory_types[index as usize].property_flags)
    }

    /// A buffer of `size` bytes, made for external `OPAQUE_FD` memory when `external`.
    fn buffer(&self, size: u64, external: bool) -> Result<vk::Buffer> {
        let mut external_info =
            vk::ExternalMemoryBufferCreateInfo::default().handle_types(OPAQUE_FD);
        let mut info = vk::BufferCreateInfo::default()
            .size(size)
            .usage(
                vk::BufferUsageFlags::TRANSFER_SRC
                    | vk::BufferUsageFlags::TRANSFER_DST
                    | vk::BufferUsageFlags::STORAGE_BUFFER,
            )
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        if external {
            info = info.push_next(&mut external_info);
        }
        // SAFETY: a live device; `info` and its chain live across the call.
        unsafe { self.device.create_buffer(&info, None) }.map_err(call("vkCreateBuffer"))
    }

    /// Maps all of `memory` (host-visible), checking that the pointer is 64-byte aligned.
    fn map(&self, memory: vk::DeviceMemory) -> Result<NonNull<u8>> {
        // SAFETY: `memory` is a live, unmapped, host-visible allocation of this device.
        let p = unsafe {
            self.device
                .map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty())
        }
        .map_err(call("vkMapMemory"))?;
        let p = NonNull::new(p as *mut u8).ok_or_else(|| Error::Vulkan {
            call: "vkMapMemory",
            detail: "returned a null pointer".into(),
        })?;
        if p.as_ptr() as usize % 64 != 0 {
            // SAFETY: mapped just above.
            unsafe { self.device.unmap_memory(memory) };
            return Err(Error::Vulkan {
                call: "vkMapMemory",
                detail: "the mapping is not 64-byte aligned".into(),
            });
        }
        Ok(p)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if !self.made_here() {
            return;
        }
        // SAFETY: every buffer and allocation holds an `Arc` of this context and was
        // destroyed before the last one dropped; nothing else uses the handles.
        unsafe {
            let _ = self.device.device_wait_idle();
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// A linear buffer bound to a dedicated allocation of its own, mapped when the memory is
/// host-visible; unmapped, destroyed and freed on drop (after the queue is idle).
pub(super) struct BoundBuffer {
    ctx: Arc<Context>,
    pub(super) buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    pub(super) mapped: Option<NonNull<u8>>,
    /// `allocationSize` (the buffer's size: its memory requirement, at least the size
    /// asked for).
    pub(super) size: u64,
    memory_type_index: u32,
}

impl BoundBuffer {
    /// At least `nbytes` in memory of the first type in `preference` the buffer can use,
    /// exportable as `OPAQUE_FD` (and dedicated) when `export`. The buffer's size is the
    /// allocation's, so that an importer that must repeat a dedicated allocation's buffer
    /// can; a driver whose requirement for that size grows again is refused.
    pub(super) fn allocate(
        ctx: &Arc<Context>,
        nbytes: u64,
        export: bool,
        preference: &[vk::MemoryPropertyFlags],
    ) -> Result<BoundBuffer> {
        let d = &ctx.device;
        let mut buffer = ctx.buffer(nbytes, export)?;
        // SAFETY: a live buffer of this device.
        let mut req = unsafe { d.get_buffer_memory_requirements(buffer) };
        if req.size != nbytes {
            // SAFETY: unused, unbound buffer.
            unsafe { d.destroy_buffer(buffer, None) };
            let size = req.size;
            buffer = ctx.buffer(size, export)?;
            // SAFETY: as above.
            req = unsafe { d.get_buffer_memory_requirements(buffer) };
            if export && req.size != size {
                // SAFETY: unused, unbound buffer.
                unsafe { d.destroy_buffer(buffer, None) };
                return Err(Error::Vulkan {
                    call: "vkGetBufferMemoryRequirements",
                    detail: "a buffer of the required size requires more again".into(),
                });
            }
        }
        let destroy = |buffer| {
            // SAFETY: an unbound buffer of this device, used by nothing.
            unsafe { d.destroy_buffer(buffer, None) }
        };
        let fits = |i: u32, want: vk::MemoryPropertyFlags| {
            req.memory_type_bits & (1 << i) != 0
                && ctx.memory.memory_types[i as usize]
                    .property_flags
                    .contains(want)
        };
        let Some(type_index) = preference
            .iter()
            .find_map(|&want| (0..ctx.memory.memory_type_count).find(|&i| fits(i, want)))
        else {
            destroy(buffer);
            return Err(Error::Vulkan {
                call: "vkAllocateMemory",
                detail: format!("no memory type of {} fits the buffer", ctx.name),
            });
        };
        // An export is a dedicated allocation, so that an importer can repeat it.
        let mut export_info = vk::ExportMemoryAllocateInfo::default().handle_types(OPAQUE_FD);
        let mut dedicated = vk::MemoryDedicatedAllocateInfo::default().buffer(buffer);
        let mut info = vk::MemoryAllocateInfo::default()
            .allocation_size(req.size)
            .memory_type_index(type_index);
        if export {
            info = info.push_next(&mut dedicated).push_next(&mut export_info);
        }
        // SAFETY: `info` and its chain live across the call; the buffer is this device's.
        let memory = match unsafe { d.allocate_memory(&info, None) } {
            Ok(m) => m,
            Err(e) => {
                destroy(buffer);
                return Err(call("vkAllocateMemory")(e));
            }
        };
        // From here `Drop` cleans up.
        let mut bound = BoundBuffer {
            ctx: ctx.clone(),
            buffer,
            memory,
            mapped: None,
            size: req.size,
            memory_type_index: type_index,
        };
        // SAFETY: the allocation fits the buffer's requirements (its size and type).
        unsafe { d.bind_buffer_memory(buffer, memory, 0) }.map_err(call("vkBindBufferMemory"))?;
        let host = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        if ctx
            .memory_type(type_index)
            .unwrap_or_default()
            .contains(host)
        {
            bound.mapped = Some(ctx.map(memory)?);
        }
        Ok(bound)
    }
}

impl Drop for BoundBuffer {
    fn drop(&mut self) {
        if !self.ctx.made_here() {
            return;
        }
        let d = &self.ctx.device;
        // SAFETY: the queue is idle (waited for here), so no submitted work uses the
        // buffer; the buffer and memory are ours, used by nothing else in this process.
        // An importer in another process holds its own reference to the payload.
        unsafe {
            let _ = d.queue_wait_idle(self.ctx.queue);
            if self.mapped.is_some() {
                d.unmap_memory(self.memory);
            }
            d.destroy_buffer(self.buffer, None);
            d.free_memory(self.memory, None);
        }
    }
}

pub(super) const HOST: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::from_raw(
    vk::MemoryPropertyFlags::HOST_VISIBLE.as_raw()
        | vk::MemoryPropertyFlags::HOST_COHERENT.as_raw(),
);

/// Bytes an exported allocation has past its tensor: Mesa's llvmpipe binds an OpenGL
/// buffer to imported memory (`glBufferStorageMemEXT`) only when the memory holds
/// `(LP_RASTER_BLOCK_SIZE - 1) * 4 * sizeof(float)` = 48 bytes past the buffer (it may
/// read that far), so a GL buffer over the whole tensor needs them (the MuJoCo camera's
/// frames, docs/mujoco.md).
pub const IMPORT_SLACK: u64 = 64;

/// Path (a): a linear buffer in a dedicated, exportable allocation, mapped when the
/// memory is host-visible, and its `OPAQUE_FD` export.
pub struct ExportedBuffer {
    bound: BoundBuffer,
    table: VulkanTable,
    fd: SharedFd,
}

impl std::fmt::Debug for ExportedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportedBuffer")
            .field("table", &self.table)
            .field("mapped", &self.bound.mapped.is_some())
            .finish_non_exhaustive()
    }
}

// SAFETY: the handles and the mapping are plain addresses valid in every thread; the
// owner (the engine backend) uses them from one thread at a time.
unsafe impl Send for ExportedBuffer {}
// SAFETY: as above; `&ExportedBuffer` hands out only copies of handles and the pointer.
unsafe impl Sync for ExportedBuffer {}

impl ExportedBuffer {
    /// Allocates at least `nbytes` (and [`IMPORT_SLACK`] more) in memory of the best
    /// type: device-local and host-visible, else host-visible (coherent), else
    /// device-local.
    pub fn allocate(ctx: &Arc<Context>, nbytes: u64) -> Result<ExportedBuffer> {
        let local = vk::MemoryPropertyFlags::DEVICE_LOCAL;
        let nbytes = nbytes.saturating_add(IMPORT_SLACK);
        let bound = BoundBuffer::allocate(ctx, nbytes, true, &[HOST | local, HOST, local])?;
        let get = vk::MemoryGetFdInfoKHR::default()
            .memory(bound.memory)
            .handle_type(OPAQUE_FD);
        // SAFETY: the memory was allocated exportable as OPAQUE_FD.
        let fd = match unsafe { ctx.memory_fd.get_memory_fd(&get) } {
            // Drivers do not set close-on-exec (lavapipe does not): a program this process
            // runs must not inherit the memory.
            // SAFETY: a new fd the driver hands over; we own it from here.
            Ok(fd) if fd >= 0 => SharedFd::new(unsafe { os::own_driver_fd(fd) }?),
            Ok(_) | Err(_) => {
                return Err(Error::Vulkan {
                    call: "vkGetMemoryFdKHR",
                    detail: "no fd".into(),
                })
            }
        };
        let table = VulkanTable {
            alloc_size: bound.size,
            memory_type_index: bound.memory_type_index,
            dedicated: true,
            semaphore: None,
        };
        Ok(ExportedBuffer { bound, table, fd })
    }

    pub fn buffer(&self) -> vk::Buffer {
        self.bound.buffer
    }

    pub fn memory(&self) -> vk::DeviceMemory {
        self.bound.memory
    }

    /// What the tensor table says of it.
    pub fn table(&self) -> VulkanTable {
        self.table
    }

    /// The host mapping (host-visible memory only).
    pub fn mapped(&self) -> Option<NonNull<u8>> {
        self.bound.mapped
    }

    /// The exported fd (sent to clients; each gets its own copy).
    pub fn fd(&self) -> SharedFd {
        self.fd.clone()
    }
}

/// The client's Vulkan import of one tensor's memory, mapped on the CPU.
pub struct ImportedMemory {
    ctx: Arc<Context>,
    buffer: Option<vk::Buffer>,
    memory: vk::DeviceMemory,
    mapped: NonNull<u8>,
    size: u64,
    /// The engine's fd, kept when it is a regular file (a memfd: the CPU driver's memory,
    /// or a renderer's own): its size is checked where the region's is when it may
    /// shrink ([`ImportedMemory::check_size`]), and its bookkeeping bytes before the
    /// memory is freed. `None` for driver fds whose size the kernel does not know.
    file: Option<OwnedFd>,
    /// Whether `file` may shrink (not sealed with `F_SEAL_SHRINK`; lavapipe's exports
    /// are).
    may_shrink: bool,
    /// The bytes of `file` before the memory's first byte as they were at import: the
    /// driver's bookkeeping (lavapipe's header, which it reads again in `vkFreeMemory` to
    /// unmap), which any process holding the fd can rewrite. Empty when the driver does
    /// not map the file itself (nothing to compare).
    bookkeeping: Vec<u8>,
}

/// The most bookkeeping bytes an import keeps to compare (lavapipe's are one page).
const MAX_BOOKKEEPING: u64 = 64 << 10;

impl std::fmt::Debug for ImportedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedMemory")
            .field("size", &self.size)
            .field("mapped", &self.mapped)
            .finish_non_exhaustive()
    }
}

// SAFETY: as for `ExportedBuffer`.
unsafe impl Send for ImportedMemory {}
// SAFETY: as for `ExportedBuffer`.
unsafe impl Sync for ImportedMemory {}

impl ImportedMemory {
    /// Imports `fd` (`OPAQUE_FD`, the engine's export of `table`) and maps it. The fd is
    /// untrusted: its size is checked first where the kernel knows it (a memfd: the CPU
    /// driver's memory), so that a mapping never reaches past the file (SIGBUS); its
    /// memory type must be host-visible and coherent on this device. Once mapped, where
    /// the driver mapped the file itself, the memory's bytes must lie inside the file
    /// (a file whose driver header says otherwise is refused before anything reads it),
    /// and the file's bytes before them (the driver's bookkeeping) are kept to compare
    /// at free ([`Drop`]). The driver owns the fd once the import succeeded; on any
    /// error it is closed here.
    pub fn import(
        ctx: &Arc<Context>,
        fd: OwnedFd,
        table: &VulkanTable,
        tensor: &str,
    ) -> Result<ImportedMemory> {
        let invalid = |reason: String| Error::InvalidTensor {
            tensor: tensor.to_string(),
            reason,
        };
        if let Some(size) = os::fd_size(fd.as_fd()) {
            if size < table.alloc_size {
                return Err(invalid(format!(
                    "the engine declares a {}-byte allocation; the fd it sent holds {size} bytes",
                    table.alloc_size
                )));
            }
        }
        let host = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        match ctx.memory_type(table.memory_type_index) {
            Some(f) if f.contains(host) => {}
            Some(_) => {
                return Err(Error::VulkanUnavailable {
                    reason: format!(
                        "tensor '{tensor}': memory type {} of {} is not host-visible and \
                         coherent, so it cannot be mapped on the CPU (import it into CUDA)",
                        table.memory_type_index, ctx.name
                    ),
                })
            }
            None => {
                return Err(invalid(format!(
                    "memory type {} does not exist on {}",
                    table.memory_type_index, ctx.name
                )))
            }
        }
        let d = &ctx.device;
        let buffer = if table.dedicated {
            Some(ctx.buffer(table.alloc_size, true)?)
        } else {
            None
        };
        let destroy = |b: Option<vk::Buffer>| {
            if let Some(b) = b {
                // SAFETY: an unbound buffer of this device, used by nothing.
                unsafe { d.destroy_buffer(b, None) }
            }
        };
        // The driver gets a copy of its own. It owns that copy once the import succeeded
        // (it closes it when the memory is freed); after a failed import it should have
        // left it to us, but lavapipe closes it then too, so a failed import leaves the
        // copy to the driver either way: at most one fd leaked per failed import, never
        // a second close of an fd number another thread may have reused meanwhile.
        let copy = os::dup_cloexec(&fd)?;
        let copy = copy.into_raw_fd();
        let mut import = vk::ImportMemoryFdInfoKHR::default()
            .handle_type(OPAQUE_FD)
            .fd(copy);
        let mut dedicated = vk::MemoryDedicatedAllocateInfo::default();
        if let Some(b) = buffer {
            dedicated = dedicated.buffer(b);
        }
        let mut info = vk::MemoryAllocateInfo::default()
            .allocation_size(table.alloc_size)
            .memory_type_index(table.memory_type_index)
            .push_next(&mut import);
        if buffer.is_some() {
            info = info.push_next(&mut dedicated);
        }
        // SAFETY: `info` and its chain live across the call; `copy` is an open fd the
        // driver takes over (see above).
        let memory = match unsafe { d.allocate_memory(&info, None) } {
            Ok(m) => m,
            Err(e) => {
                destroy(buffer);
                return Err(invalid(format!(
                    "importing the engine's memory fd failed ({e:?}): wrong size, type or device"
                )));
            }
        };
        let file = os::fd_size(fd.as_fd()).is_some().then_some(fd);
        let free = |m| {
            // SAFETY: an allocation of this device that nothing uses any more.
            unsafe { d.free_memory(m, None) }
        };
        if let Some(b) = buffer {
            // SAFETY: the buffer was made for this dedicated allocation.
            if let Err(e) = unsafe { d.bind_buffer_memory(b, memory, 0) } {
                destroy(buffer);
                free(memory);
                return Err(call("vkBindBufferMemory")(e));
            }
        }
        let mapped = match ctx.map(memory) {
            Ok(p) => p,
            Err(e) => {
                destroy(buffer);
                free(memory);
                return Err(e);
            }
        };
        let bookkeeping = match &file {
            Some(f) => match driver_bookkeeping(f.as_fd(), mapped, table.alloc_size) {
                Ok(bytes) => bytes,
                Err(why) => {
                    // SAFETY: mapped above; nothing read it.
                    unsafe { d.unmap_memory(memory) };
                    destroy(buffer);
                    free(memory);
                    return Err(invalid(why));
                }
            },
            None => Vec::new(),
        };
        Ok(ImportedMemory {
            ctx: ctx.clone(),
            buffer,
            memory,
            mapped,
            size: table.alloc_size,
            may_shrink: file.as_ref().is_some_and(|f| may_shrink(f.as_fd())),
            file,
            bookkeeping,
        })
    }

    /// Whether the driver's bookkeeping bytes of the file (`bookkeeping`) changed since
    /// the import: a process holding the memory's fd rewrote them, and the driver, which
    /// reads them to unmap the memory, would unmap what they now say (lavapipe died of
    /// SIGSEGV in `vkFreeMemory`).
    fn bookkeeping_changed(&self) -> bool {
        let Some(f) = self.file.as_ref().filter(|_| !self.bookkeeping.is_empty()) else {
            return false;
        };
        let mut now = vec![0u8; self.bookkeeping.len()];
        !matches!(os::read_at(f, 0, &mut now), Ok(n) if n == now.len()) || now != self.bookkeeping
    }

    /// `Err(size)` when the engine's memory is a file that is now shorter than the
    /// mapping (a same-user process truncated it): touching the mapping past its end
    /// would be a SIGBUS. Sealed memory (`F_SEAL_SHRINK`: lavapipe's) cannot shrink and
    /// is not looked at.
    pub fn check_size(&self) -> std::result::Result<(), u64> {
        match self
            .file
            .as_ref()
            .filter(|_| self.may_shrink)
            .and_then(|f| os::fd_size(f.as_fd()))
        {
            Some(now) if now < self.size => Err(now),
            _ => Ok(()),
        }
    }

    /// The size the import maps (the table's `alloc_size`).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The host address of `offset` in the mapping, if `offset + len` lies inside it.
    pub fn span(&self, offset: u64, len: u64) -> Option<NonNull<u8>> {
        let end = offset.checked_add(len)?;
        if end > self.size {
            return None;
        }
        // SAFETY: `offset <= size`: inside (or one past) the mapping of `size` bytes.
        NonNull::new(unsafe { self.mapped.as_ptr().add(offset as usize) })
    }
}

/// Where the driver mapped the regular file `fd` of an import whose memory of `size`
/// bytes it maps at `mapped`: the memory must lie inside the file (`InvalidTensor`'s
/// reason otherwise: a crafted driver header placed it past the file's end, where a read
/// is a SIGBUS), and the file's bytes before it (at most [`MAX_BOOKKEEPING`]) are the
/// driver's bookkeeping, returned to compare at free. Empty when the driver does not map
/// this file at `mapped` itself (a driver that copies, or another file).
fn driver_bookkeeping(
    fd: std::os::fd::BorrowedFd<'_>,
    mapped: NonNull<u8>,
    size: u64,
) -> std::result::Result<Vec<u8>, String> {
    let Ok((file_size, dev, ino)) = crate::os::file_identity(fd) else {
        return Ok(Vec::new());
    };
    let Some((at, mdev, mino)) = crate::os::mapped_file_at(mapped.as_ptr() as usize) else {
        return Ok(Vec::new());
    };
    if (mdev, mino) != (dev, ino) {
        return Ok(Vec::new());
    }
    if at.checked_add(size).is_none_or(|end| end > file_size) {
        return Err(format!(
            "the file behind its memory fd holds {file_size} bytes, and the driver maps the \
             memory's {size} bytes at its offset {at}: past its end (not memory the engine \
             exported as the table says)"
        ));
    }
    let mut bytes = vec![0u8; at.min(MAX_BOOKKEEPING) as usize];
    match os::read_at(fd, 0, &mut bytes) {
        Ok(n) if n == bytes.len() => Ok(bytes),
        _ => Err("its memory fd could not be read".into()),
    }
}

/// Whether the file behind `fd` may shrink under a mapping: a regular file (a memfd)
/// not sealed against it.
fn may_shrink(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    os::fd_size(fd).is_some() && !os::sealed_against_shrink(fd)
}

impl Drop for ImportedMemory {
    fn drop(&mut self) {
        if !self.ctx.made_here() {
            return;
        }
        // The file shrank under the import: the driver reads the memory it frees
        // (lavapipe reads its header) and would die of SIGBUS. The allocation is leaked,
        // and the device with it (destroying a device frees what is left on it): the
        // process's exit frees both.
        if self.check_size().is_err() {
            std::mem::forget(self.ctx.clone());
            return;
        }
        // The driver's bookkeeping bytes were rewritten by a process holding the fd: the
        // driver would unmap what they now say (lavapipe: SIGSEGV). Leaked the same way.
        if self.bookkeeping_changed() {
            eprintln!(
                "shmbridge: the driver's bookkeeping bytes of an imported Vulkan memory were \
                 changed by another process holding its fd: the import is left unfreed until \
                 this process exits (freeing it would crash the driver)"
            );
            std::mem::forget(self.ctx.clone());
            return;
        }
        let d = &self.ctx.device;
        // SAFETY: ours; nothing in this process uses the mapping any more: the Rust
        // client's views borrow the client, and every other view (a DLPack capsule)
        // holds the lease that owns this, which drops only after the last of them.
        unsafe {
            d.unmap_memory(self.memory);
            if let Some(b) = self.buffer {
                d.destroy_buffer(b, None);
            }
            d.free_memory(self.memory, None);
        }
    }
}
