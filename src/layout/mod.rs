//! Header v1: the byte layout of a region's header and tensor table, and its validation.
//!
//! Pure data: no I/O, no unsafe, and nothing of the crate above [`crate::error`]. Where a
//! tensor lives ([`Device`], [`Location`]) and what an engine hands over for a Vulkan
//! tensor ([`VulkanSource`]) are vocabulary of the table, so they are here; the backends
//! that serve them (`crate::device`) build on this module, never the other way round. The
//! engine builds a header with [`HeaderBuilder`]; a client copies the header out of shared
//! memory and runs [`validate`] on the copy before it trusts any field (the engine could
//! scribble on the live header afterwards; the client only ever uses its validated
//! snapshot). The live fields are read and written through `crate::control`.
//! `docs/protocol.md` documents every byte here.
//!
//! Files, each importing only those listed before it: `location.rs` (where a tensor
//! lives), `vulkan.rs` (a Vulkan tensor's export), `dtype.rs` (element types), `header.rs`
//! (constants, the control block and table entry structs, the live fields' offsets, the
//! layout hash), `tensor.rs` (tensor specs, validated entries, the ring placement),
//! `shard.rs` (1.4: the shard table, its layout hash, the env split, the table's checks),
//! `stats.rs` (1.7: the stats area after the tensors, one block per shard, and its check),
//! `validated.rs` (the validated [`Layout`] and the keys naming its tensors), `builder.rs`
//! (spec → header bytes), `validate.rs` (header bytes → [`Layout`], the identity checks).

mod builder;
mod dtype;
mod header;
pub mod location;
mod shard;
mod stats;
pub mod stream;
mod tensor;
mod validate;
mod validated;
pub mod vulkan;

pub use builder::HeaderBuilder;
pub use dtype::{DType, DL_BFLOAT, DL_BOOL, DL_FLOAT, DL_INT, DL_UINT};
pub use header::*;
pub use location::{
    uuid_hex, CudaDevice, Device, Location, VulkanDevice, DL_CPU, DL_CUDA, DL_VULKAN,
};
pub use shard::{
    check_shardable, env_slice, layout_hash_for, ShardEntry, ShardInfo, ShardWords,
    LAYOUT_HASH_SHARDED, MAX_SHARDS, SHARD_ENTRY_SIZE,
};
pub use stats::{
    stats_offsets, EpisodeEntry, StatsArea, StatsBlock, RECENT_EPISODES, STATS_BLOCK_SIZE,
};
pub use tensor::{
    CudaExport, CudaSharing, Direction, Rings, TensorInfo, TensorSpec, VulkanTable,
    DEFAULT_RING_CAPACITY, MIN_RING_CAPACITY,
};
pub use validate::{check_cuda_fd_export, check_identity, cuda_fd_export_cap, validate};
pub use validated::{Layout, TensorId, TensorKey};
pub use vulkan::{SemaphoreKind, SharedFd, VulkanExport, VulkanSource};

#[cfg(all(test, not(loom)))]
mod tests;
