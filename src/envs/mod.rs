//! Reference engines: `null` (the transport floor and the integrity check), `cartpole`
//! (Gymnasium CartPole-v1 dynamics, vectorised) and `pixels` (cartpole drawn into a stack
//! of frames per env by a Vulkan compute shader, 1.3, or on the host); `gpu` has `null`
//! and `cartpole` on a CUDA device (`--device cuda`), stepped by the kernels of
//! [`kernels`].
//!
//! Files: `vec_env.rs` (what an env is, the flags the front doors share, the loop that
//! serves one), `reference.rs` (what a reference engine is: `Reference`, `CudaReference`, `Entry`),
//! `registry.rs` (the one registry of reference engines: every lookup by name goes
//! through it; a new engine is its file, an `impl Reference` and one entry),
//! `runner.rs` (the process that serves one: signals, the name on stdout, shards), and
//! one file per env. Device code goes through
//! [`crate::device::compute`], so no file here depends on a build feature: without
//! `cuda` or `vulkan`, the envs that need them are `CudaUnavailable` or
//! `VulkanUnavailable` at run time.

pub mod cartpole;
pub mod gpu;
pub mod kernels;
#[cfg(feature = "mujoco")]
pub mod mujoco;
pub mod null;
pub mod pixels;
mod reference;
mod registry;
mod runner;
mod vec_env;

pub use registry::{
    by_name, by_name_on, find, host_spec, CudaReference, Entry, Reference, REFERENCE_ENGINES,
};
pub use runner::{run_reference, ReferenceEngine};
pub use vec_env::{
    parse_camera_size, parse_image_shape, serve, EnvCommands, EnvOptions, ServeEnd, VecEnv,
    MAX_CAMERA_SIDE, MAX_THREADS,
};
