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
//! - `engine`, `client`: the two backends (`client` imports into CUDA with the `cuda`
//!   feature and into Vulkan with `vulkan`; a build with neither refuses Vulkan tensors).

use crate::error::Error;
use crate::layout::{Layout, Location};

#[cfg(any(feature = "cuda", feature = "vulkan"))]
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

/// How a client imports Vulkan tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VulkanImporter {
    /// CUDA when a CUDA device has the engine's Vulkan device UUID, else Vulkan.
    #[default]
    Auto,
    /// A Vulkan device of the client's own, mapped on the CPU (kDLCPU).
    Vulkan,
    /// CUDA external memory (kDLCUDA).
    Cuda,
}

impl VulkanImporter {
    /// `auto`, `vulkan` or `cuda` (case-insensitive, surrounding blanks ignored).
    /// Anything else is `InvalidSpec`.
    pub fn parse(s: &str) -> Result<VulkanImporter, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(VulkanImporter::Auto),
            "vulkan" => Ok(VulkanImporter::Vulkan),
            "cuda" => Ok(VulkanImporter::Cuda),
            _ => Err(Error::InvalidSpec(format!(
                "importer '{s}': expected auto, vulkan or cuda"
            ))),
        }
    }
}

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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn importer_names() {
        assert!(matches!(
            VulkanImporter::parse(" Auto "),
            Ok(VulkanImporter::Auto)
        ));
        assert!(matches!(
            VulkanImporter::parse("vulkan"),
            Ok(VulkanImporter::Vulkan)
        ));
        assert!(matches!(
            VulkanImporter::parse("CUDA"),
            Ok(VulkanImporter::Cuda)
        ));
        assert!(matches!(
            VulkanImporter::parse("cpu"),
            Err(Error::InvalidSpec(m)) if m.contains("auto, vulkan or cuda")
        ));
    }
}
