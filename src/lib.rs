//! shmbridge: zero-copy tensor exchange between a simulator ("engine") and a learner
//! ("client") on the same machine, through a POSIX shared-memory region with sequence
//! counters driving a lock-step loop.
//!
//! Modules follow the data path: [`layout`] (the header, data only) → [`region`] (the shm
//! object) → [`control`] (the live control block, typed) → [`sync`] (counters and
//! waiting) → [`tensor`] (typed views) and [`device`] (where bytes live: host or CUDA,
//! behind one backend seam) → [`engine`] and [`client`] (the two public faces) →
//! [`envs`] (reference engines). All system calls are in `os`. The wire format is
//! documented in `docs/protocol.md`.

#[cfg(not(all(target_os = "linux", target_endian = "little")))]
compile_error!("shmbridge needs Linux (futex, /dev/shm) on a little-endian CPU");

pub mod actions;
pub mod cli;
pub mod client;
pub mod command;
pub mod control;
pub mod device;
pub mod engine;
pub mod envs;
pub mod error;
pub mod fdpass;
#[doc(hidden)]
pub mod fuzzing;
pub mod launch;
pub mod layout;
#[cfg(all(test, loom))]
mod loom_tests;
mod os;
mod primitive;
#[cfg(feature = "python")]
mod python;
pub mod region;
pub mod ring;
pub mod shard;
pub mod sync;
pub mod tensor;
pub mod wire;

pub use client::{AttachOptions, Client};
pub use command::{CommandError, CommandHandler, Reply, ResetRequest};
pub use engine::{Engine, EngineSpec};
pub use error::{Error, Peer, Result};
pub use layout::{DType, Direction, Layout, Location, TensorId, TensorInfo, TensorKey, TensorSpec};
pub use sync::WaitPolicy;
pub use tensor::{Element, Tensors};

/// Liveness helpers for tools and tests.
pub mod process {
    pub use crate::os::{current_pid, process_alive, process_start_time};
}
