//! What an engine hands over for a Vulkan tensor (1.3): memory the library allocates
//! (path a), or memory the engine's own renderer exported itself (path b), with an
//! optional semaphore. Plain data plus the fds, compiled in every build: the tensor table
//! describes it, the Vulkan backend in `crate::device` serves it.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

/// An fd shared by the clones of a spec, closed once, when the last clone drops.
#[derive(Clone)]
pub struct SharedFd(Arc<OwnedFd>);

impl SharedFd {
    pub fn new(fd: OwnedFd) -> SharedFd {
        SharedFd(Arc::new(fd))
    }
}

impl AsFd for SharedFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl PartialEq for SharedFd {
    /// The same open fd, not the same file.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for SharedFd {}

impl std::fmt::Debug for SharedFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fd {}", self.0.as_raw_fd())
    }
}

/// The kind of an exported semaphore (`VK_KHR_external_semaphore_fd`, `OPAQUE_FD`).
/// Protocol 1.3 shares timeline semaphores only: a binary one needs exactly one wait per
/// signal from whoever is attached, which a client mapping the memory on the CPU cannot
/// give (`docs/protocol.md` §3.6); an engine spec with one is `InvalidSpec`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SemaphoreKind {
    /// A timeline semaphore: the engine signals value `frame` (the `frame_seq` it then
    /// publishes); a consumer waits for that value.
    Timeline,
    /// A binary semaphore: refused (see above).
    Binary,
}

/// Memory an engine's renderer exported itself (`vkGetMemoryFdKHR`, `OPAQUE_FD`): where
/// the tensor lies in it and what an importer must repeat to import it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VulkanExport {
    /// `VkMemoryAllocateInfo::allocationSize` of the exported memory.
    pub alloc_size: u64,
    /// Byte offset of the tensor in that memory (a multiple of 64).
    pub offset: u64,
    /// `VkMemoryAllocateInfo::memoryTypeIndex` on the exporting device.
    pub memory_type_index: u32,
    /// Whether it was a dedicated allocation (`VkMemoryDedicatedAllocateInfo`): an
    /// importer must then import it dedicated too.
    pub dedicated: bool,
    /// `VkPhysicalDeviceIDProperties::deviceUUID` of the exporting device.
    pub device_uuid: [u8; 16],
    /// `VkPhysicalDeviceIDProperties::driverUUID`.
    pub driver_uuid: [u8; 16],
}

/// Where a Vulkan tensor's memory comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VulkanSource {
    /// Path (a): the library allocates a linear exportable buffer on the spec's device.
    Allocate,
    /// Path (b): the engine's renderer exported this memory (and maybe a semaphore).
    Import {
        memory: SharedFd,
        export: VulkanExport,
        semaphore: Option<(SharedFd, SemaphoreKind)>,
    },
}
