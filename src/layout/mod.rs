//! Header v1: the byte layout of a region's header and tensor table, and its validation.
//!
//! Pure data: no I/O, no unsafe, nothing from the device backends (only the plain
//! [`Device`] type a tensor's placement is). The engine builds a
//! header with [`HeaderBuilder`]; a client copies the header out of shared memory and runs
//! [`validate`] on the copy before it trusts any field (the engine could scribble on the
//! live header afterwards; the client only ever uses its validated snapshot). The live
//! fields are read and written through [`crate::control`]. `docs/protocol.md` documents
//! every byte here.
//!
//! Files: `header.rs` (constants, the control block and table entry structs, the live
//! fields' offsets, the layout hash, the identity checks), `dtype.rs` (element types),
//! `tensor.rs` (tensor specs, validated entries, the validated layout), `builder.rs`
//! (spec → header bytes), `validate.rs` (header bytes → [`Layout`]), `shard.rs` (1.4: the shard table, the env
//! split, the table's checks).

mod builder;
mod dtype;
mod header;
mod shard;
mod tensor;
mod validate;

pub use crate::device::location::{Device, Location};
pub use builder::HeaderBuilder;
pub use dtype::{DType, DL_BFLOAT, DL_BOOL, DL_FLOAT, DL_INT, DL_UINT};
pub use header::*;
pub use shard::{
    check_shardable, env_slice, ShardEntry, ShardInfo, ShardWords, MAX_SHARDS, SHARD_ENTRY_SIZE,
};
pub use tensor::{
    CudaExport, Direction, Layout, Rings, TensorId, TensorInfo, TensorKey, TensorSpec, VulkanTable,
    DEFAULT_RING_CAPACITY, MIN_RING_CAPACITY,
};
pub use validate::validate;

#[cfg(test)]
mod tests;
