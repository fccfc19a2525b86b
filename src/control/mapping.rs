//! What a device backend holds of the region it serves, instead of the region itself.

use super::block::Control;
use crate::error::Result;

/// A mapping of a region, as a device backend needs it: the live control words, a
/// second mapping of its own that stays valid however long the backend keeps it (a
/// lease that acknowledges after its client closed, the thread that serves Vulkan fds),
/// and whether this process made the mapping (a child forked from it must leave the
/// region to its parent). `crate::region::Region` provides it.
pub trait ControlMapping: Send + Sync + std::fmt::Debug {
    /// The typed view of the live control block.
    fn control(&self) -> Control<'_>;

    /// Whether this process made this mapping (false in a child forked after it was
    /// made).
    fn made_here(&self) -> bool;

    /// Maps the same region a second time, through its open descriptor (not its name,
    /// which another engine may have taken meanwhile); dropping it only unmaps.
    fn map_again(&self) -> Result<Box<dyn ControlMapping>>;
}
