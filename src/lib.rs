//! shmbridge: zero-copy tensor exchange between a simulator ("engine") and a learner
//! ("client") on the same machine, through a POSIX shared-memory region with sequence
//! counters driving a lock-step loop.
//!
//! Modules follow the data path: [`layout`] (the header, data only) → [`control`] (the
//! live control block, typed) and [`sync`] (counters and waiting) → [`device`] (where
//! bytes live: host memory, CUDA IPC or Vulkan external memory, behind one backend seam)
//! → [`region`] (the shm object) → [`tensor`] (typed views) → [`engine`] and [`client`]
//! (the two public faces), and [`observer`] (read-only watchers of a live region, 1.7)
//! → [`envs`] (reference engines). The library's system calls are in `os` (and the socket
//! calls of fd passing in [`fdpass`]; `os`'s module doc says what else stays outside).
//! The wire format is documented in `docs/protocol.md`; how to add a device backend in
//! `docs/backends.md`.
//!
//! # Layers
//!
//! Each module imports only modules of its own layer or below (layer 1 is the bottom),
//! and no two files import each other in a circle: `scripts/layers.py` checks both.
//!
//! - layer 1: error
//! - layer 2: os, process, fdpass
//! - layer 3: primitive, launch
//! - layer 4: sync
//! - layer 5: layout
//! - layer 6: control, ring, wire
//! - layer 7: device
//! - layer 8: region
//! - layer 9: shard, tensor, stream
//! - layer 10: command, actions, batch
//! - layer 11: client, engine, observer
//! - layer 12: envs
//! - layer 13: cli
//! - layer 14: python, fuzzing

#[cfg(not(all(target_os = "linux", target_endian = "little")))]
compile_error!("shmbridge needs Linux (futex, /dev/shm) on a little-endian CPU");

pub mod actions;
pub mod batch;
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
// Under cfg(loom) (the `loom` feature) the atomics are loom's, which work only inside a
// model: the unit tests (`#[cfg(all(test, not(loom)))]` in every module) are left out of
// that build, which compiles and runs the models alone.
#[cfg(all(test, loom))]
mod loom_tests;
pub mod observer;
mod os;
mod primitive;
#[cfg(feature = "python")]
mod python;
pub mod region;
pub mod ring;
pub mod shard;
pub mod stream;
pub mod sync;
pub mod tensor;
pub mod wire;

/// The unit tests' region namespace, as the integration tests' (tests/common/mod.rs):
/// `<given or t>_<pid>`, set before `main`, while the process has one thread, and swept
/// when the process exits.
#[cfg(all(test, not(loom)))]
mod test_namespace {
    #[used]
    #[link_section = ".init_array"]
    static OWN_NAMESPACE: extern "C" fn() = own_namespace;
    extern "C" fn own_namespace() {
        let env = crate::region::NAMESPACE_ENV;
        let outer = std::env::var(env).unwrap_or_default();
        let outer = if outer.is_empty() { "t" } else { &outer };
        std::env::set_var(env, format!("{outer}_{}", std::process::id()));
    }
    #[used]
    #[link_section = ".fini_array"]
    static SWEEP_OWN_NAMESPACE: extern "C" fn() = sweep_own_namespace;
    extern "C" fn sweep_own_namespace() {
        let _ = crate::region::sweep();
    }
}

pub use client::{AttachOptions, Client};
pub use command::{CommandError, CommandHandler, Reply, ResetRequest};
pub use engine::{Engine, EngineSpec};
pub use error::{Error, Peer, Result};
pub use layout::{DType, Direction, Layout, Location, TensorId, TensorInfo, TensorKey, TensorSpec};
pub use observer::Observer;
pub use sync::WaitPolicy;
pub use tensor::{Element, Tensors};

/// Liveness helpers for tools and tests.
pub mod process {
    pub use crate::os::{current_pid, process_alive, process_start_time};
}
