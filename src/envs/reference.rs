//! What a reference engine is to the registry ([`super::registry`]): a [`Reference`]
//! (its name, what it is, its own options type read from the flags every front door
//! shares, how it is built on the host), a [`CudaReference`] where it also steps on a
//! CUDA device, and the [`Entry`] either is made into. Each engine implements these in
//! its own file (the CUDA form beside its kernels, `gpu.rs`); the registry lists them.

use super::vec_env::{EnvOptions, VecEnv};
use crate::device::{self, Device};
use crate::engine::EngineSpec;
use crate::error::{Error, Result};

/// A reference engine, as the registry knows it.
pub trait Reference {
    /// Its name (`--env`, `launch(env=...)`, the spec's `kind`).
    const NAME: &'static str;
    /// One line on what it serves (`shmbridge engine --help`).
    const DESCRIPTION: &'static str;
    /// The options it takes, read from the flags every front door shares.
    type Options;
    /// Its options among `flags` (those that do not apply to it are ignored).
    fn options(flags: &EnvOptions) -> Self::Options;
    /// The spec it serves in host memory, without building it (its state is about as
    /// large as its region, which is reserved first).
    fn spec(num_envs: u32, options: &Self::Options) -> Result<EngineSpec>;
    /// Builds it in host memory.
    fn build(num_envs: u32, options: &Self::Options) -> Result<Box<dyn VecEnv>>;
}

/// A reference engine that also steps on a CUDA device (`--device cuda`): implemented
/// beside its kernels (`gpu.rs`), so an engine's own file needs no device code.
pub trait CudaReference: Reference {
    /// Builds it on CUDA device `ordinal`.
    fn build_on_cuda(
        num_envs: u32,
        options: &Self::Options,
        ordinal: i32,
    ) -> Result<Box<dyn VecEnv>>;
}

/// A [`Reference`] with its options type erased: what [`REFERENCE_ENGINES`] holds.
#[derive(Clone, Copy)]
pub struct Entry {
    pub name: &'static str,
    pub description: &'static str,
    spec: fn(u32, &EnvOptions) -> Result<EngineSpec>,
    build: fn(u32, &EnvOptions) -> Result<Box<dyn VecEnv>>,
    build_on_cuda: fn(u32, &EnvOptions, i32) -> Result<Box<dyn VecEnv>>,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Entry {
    /// The entry of reference engine `R`, which steps on the host only.
    pub const fn of<R: Reference>() -> Entry {
        Entry {
            name: R::NAME,
            description: R::DESCRIPTION,
            spec: |n, flags| R::spec(n, &R::options(flags)),
            build: |n, flags| R::build(n, &R::options(flags)),
            // `CudaUnavailable`, so that `--device auto` falls back to host memory.
            build_on_cuda: |_, _, _| {
                Err(Error::CudaUnavailable {
                    reason: format!("{} steps on the host only (--device cpu)", R::NAME),
                })
            },
        }
    }

    /// The entry of reference engine `R`, which steps on the host or on CUDA.
    pub const fn with_cuda<R: CudaReference>() -> Entry {
        Entry {
            build_on_cuda: |n, flags, ordinal| R::build_on_cuda(n, &R::options(flags), ordinal),
            ..Entry::of::<R>()
        }
    }

    /// The spec it serves in host memory with `options`, without building it.
    pub fn host_spec(&self, num_envs: u32, options: &EnvOptions) -> Result<EngineSpec> {
        (self.spec)(num_envs, options)
    }

    /// Builds it on `device`: host memory, or a CUDA device (without the `cuda` feature,
    /// `CudaUnavailable`). A reference engine steps on the host or on CUDA; only its
    /// image goes to Vulkan (`--image-device vulkan`).
    pub fn build_on(
        &self,
        num_envs: u32,
        options: &EnvOptions,
        device: Device,
    ) -> Result<Box<dyn VecEnv>> {
        match device {
            Device::Host => (self.build)(num_envs, options),
            Device::Cuda(c) => {
                device::built_for(device::Location::Cuda)?;
                (self.build_on_cuda)(num_envs, options, c.ordinal)
            }
            // Any other device (not a `Device` arm of its own: a new backend adds none here).
            _ => Err(Error::InvalidSpec(
                "a reference env steps on the host or on CUDA; only its image goes to Vulkan \
                 (--image-device vulkan)"
                    .into(),
            )),
        }
    }
}

#[cfg(all(test, not(loom), feature = "cuda"))]
mod tests {
    use super::*;

    /// A host-only engine asked to step on CUDA answers `CudaUnavailable`, the error
    /// `device="auto"` falls back to host memory on, not `InvalidSpec` (which would end
    /// an `auto` start on a machine where CUDA works).
    #[test]
    fn a_host_only_engine_on_cuda_is_cuda_unavailable() {
        let cuda = Device::Cuda(crate::device::CudaDevice {
            ordinal: 0,
            uuid: [0; 16],
        });
        let entry = crate::envs::registry::find("pixels").unwrap();
        match entry.build_on(1, &EnvOptions::default(), cuda) {
            Ok(_) => panic!("pixels built on CUDA"),
            Err(Error::CudaUnavailable { reason }) => {
                assert!(reason.contains("pixels steps on the host only"), "{reason}")
            }
            Err(e) => panic!("not CudaUnavailable: {e}"),
        }
    }
}
