//! The Vulkan backend (protocol 1.3, `docs/protocol.md` §3.6): frames an engine rendered
//! with Vulkan, shared as external memory. The engine's memory is either allocated here
//! (path a: a linear exportable buffer) or exported by the engine's own renderer (path
//! b); either way the tensor table describes it and the fds travel over the region's
//! Unix socket ([`crate::fdpass`]) when a client attaches. The client imports them into
//! a Vulkan device of its own and maps them on the CPU.
//!
//! - [`export`]: what a spec hands over (the layout's `vulkan` module, re-exported);
//! - `vk` (the `vulkan` feature): all Vulkan FFI, through ash with the loader opened at
//!   run time, so a machine without `libvulkan.so.1` gets `VulkanUnavailable`;
//! - `engine`, `client`: the two backends (`client` imports into a Vulkan device of its
//!   own with `vulkan`, or into the device of an [`FdImporter`](crate::device::FdImporter)
//!   the seam hands it, [`crate::device::fd_importer`]; a build with neither refuses
//!   Vulkan tensors).

use crate::error::Error;
use crate::layout::{Layout, Location};

pub mod client;
#[cfg(feature = "vulkan")]
pub mod compute;
#[cfg(feature = "vulkan")]
pub mod engine;
/// What a spec hands over for a Vulkan tensor: layout vocabulary
/// ([`crate::layout::vulkan`]), re-exported here beside the backend that serves it.
pub mod export {
    pub use crate::layout::vulkan::*;
}
#[cfg(feature = "vulkan")]
pub mod vk;

/// Which importer a client asks for: a request, defined with the others.
pub use crate::device::request::VulkanImporter;

/// The error every Vulkan path gives in a build without the `vulkan` feature.
pub fn unavailable_without_feature() -> Error {
    Error::VulkanUnavailable {
        reason: "this shmbridge was built without the `vulkan` feature (rebuild with \
                 `--features vulkan`; the Python wheel has it)"
            .into(),
    }
}

/// How many fds the engine sends for `layout`, in the documented order: for each Vulkan
/// tensor in table order, its memory fd, then its semaphore fd if it has one.
pub fn fd_count(layout: &Layout) -> usize {
    layout
        .tensors
        .iter()
        .filter(|t| t.location() == Location::Vulkan)
        .map(|t| 1 + usize::from(t.vulkan.is_some_and(|v| v.semaphore.is_some())))
        .sum()
}
