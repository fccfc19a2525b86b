//! What a device backend holds of the region it serves, instead of the region itself.

use std::os::fd::BorrowedFd;

use super::block::Control;
use crate::error::Result;
use crate::os::HeldFd;

/// A mapping of a region, as a device backend needs it: the live control words, a
/// second mapping of its own that stays valid however long the backend keeps it (a
/// lease that acknowledges after its client closed, the thread that serves Vulkan fds),
/// whether this process made the mapping (a child forked from it must leave the region
/// to its parent), and the ownership proofs of 1.6 (a backend that hands out or fetches
/// fds outside the region proves who it is with them, and checks the peer's).
/// `crate::region::Region` provides it.
pub trait ControlMapping: Send + Sync + std::fmt::Debug {
    /// The typed view of the live control block.
    fn control(&self) -> Control<'_>;

    /// Whether this process made this mapping (false in a child forked after it was
    /// made).
    fn made_here(&self) -> bool;

    /// Maps the same region a second time, through its open descriptor (not its name,
    /// which another engine may have taken meanwhile); dropping it only unmaps. It keeps
    /// the engine's proof when this mapping has it.
    fn map_again(&self) -> Result<Box<dyn ControlMapping>>;

    /// The region's name (its fd socket's path, [`super::socket_path`], derives from it).
    fn name(&self) -> &str;

    /// `RegionTooSmall` once the region's file is shorter than the mapping (a process of
    /// this user truncated it): nothing of the control block may be read after that.
    fn check_size(&self) -> Result<()>;

    /// The engine's proof of owning the region: its own descriptor holding the lock on
    /// [`super::ENGINE_PROOF_BYTE`], what its fd socket hands the attached client. `None`
    /// but in the creator's own mappings.
    fn engine_proof(&self) -> Option<BorrowedFd<'_>>;

    /// The attached client's proof for one exchange on the fd socket: a `dup` of its
    /// descriptor holding the lock on [`super::CLIENT_PROOF_BYTE`], taken before it
    /// claimed the slot. Drop it once the exchange is over. `Err` when this mapping holds
    /// none (not a client's, or it closed).
    fn client_proof(&self) -> Result<HeldFd>;

    /// Whether `fd`, handed over by a peer, proves that its sender holds the lock on
    /// `byte` of this very region (same file, and the lock is that descriptor's).
    /// `Ok(Err(why not))` when it does not.
    fn proves(&self, fd: BorrowedFd<'_>, byte: u64) -> Result<std::result::Result<(), String>>;
}
