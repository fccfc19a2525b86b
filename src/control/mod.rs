//! The live control block: a typed view of the words both processes read and write in
//! the first [`CONTROL_SIZE`](crate::layout::CONTROL_SIZE) bytes of a region while it is
//! served.
//!
//! [`crate::layout`] says where each field lies; this module is the only place that
//! turns those offsets into atomics. Everything else asks for what it means: claim the
//! client slot, the sequence counters, the doorbell, the ring control words, the states,
//! and the wake-ups that go with closing (`block.rs`, the lock-step words); publish the
//! client's event handle and acknowledge the close of imported device memory
//! (`release.rs`, the words of a device session). The states are enums (`state.rs`),
//! encoded as the `u32` codes `docs/protocol.md` lists; a value a peer wrote that is no
//! known code is kept as `Unknown`, never a panic. [`ControlMapping`] (`mapping.rs`) is
//! what a device backend sees of a region: these words, a second mapping of them, and
//! the ownership proofs of 1.6 whose bytes and fd socket path `proof.rs` names.
//! [`Stats`] (`stats.rs`, 1.7) is a block of the stats area after the tensors: the
//! engine's write sequence and its episode totals; [`read_between_writes`] is how
//! observers copy frames by it and by the step counters.

mod block;
mod mapping;
mod proof;
mod release;
mod state;
mod stats;

pub use block::{Claim, Control};
pub use mapping::ControlMapping;
pub use proof::{
    client_lock_byte, socket_path, CLIENT_PROOF_BYTE, ENGINE_PROOF_BYTE, SOCKET_SUFFIX,
};
pub use release::{engine_may_free, CudaWord, DeviceImport, ReleaseAck};
pub use state::{ClientState, EngineState};
pub use stats::{read_between_writes, read_consistent, step_writes_begin, SeqWord, Stats};
