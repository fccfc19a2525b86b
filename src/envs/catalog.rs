//! The reference envs by name: on the host ([`by_name`]), on a device ([`by_name_on`]),
//! and the spec a host env serves without building it ([`host_spec`]).

use super::vec_env::{unknown_env, EnvOptions, VecEnv};
use super::{cartpole, gpu, null, pixels};
use crate::device::{self, Device};
use crate::engine::EngineSpec;
use crate::error::{Error, Result};

/// Builds a reference env by name (host memory).
pub fn by_name(name: &str, num_envs: u32, options: &EnvOptions) -> Result<Box<dyn VecEnv>> {
    match name {
        "null" => Ok(Box::new(
            null::NullEnv::configured(num_envs, options)?.with_first_env(options.first_env),
        )),
        "cartpole" => Ok(Box::new(cartpole::CartPole::new(
            num_envs,
            options.seed.wrapping_add(u64::from(options.first_env)),
        )?)),
        "pixels" => Ok(Box::new(pixels::Pixels::new(
            num_envs,
            options.seed,
            options.image,
            options.frame_stack,
            pixels_device(options),
        )?)),
        other if other.starts_with("mujoco/") => mujoco_env(other, num_envs, options),
        other => Err(unknown_env(other)),
    }
}

/// `mujoco/<Task>` (the `mujoco` feature, src/envs/mujoco/).
#[cfg(feature = "mujoco")]
fn mujoco_env(name: &str, num_envs: u32, options: &EnvOptions) -> Result<Box<dyn VecEnv>> {
    Ok(Box::new(super::mujoco::MujocoEnv::new(
        name, num_envs, options,
    )?))
}

#[cfg(not(feature = "mujoco"))]
fn mujoco_env(name: &str, _: u32, _: &EnvOptions) -> Result<Box<dyn VecEnv>> {
    Err(no_mujoco(name))
}

/// A MuJoCo env asked of a build without the `mujoco` feature.
#[cfg(not(feature = "mujoco"))]
fn no_mujoco(name: &str) -> Error {
    Error::InvalidSpec(format!(
        "'{name}': this shmbridge was built without the `mujoco` feature (docs/mujoco.md)"
    ))
}

/// The spec the host env `name` serves, without building the env: its state is about
/// as large as its region, so [`run_reference`](super::run_reference) reserves the region first, and a size
/// that does not fit /dev/shm is `NoSpace` before any of that memory is touched.
pub fn host_spec(name: &str, num_envs: u32, options: &EnvOptions) -> Result<EngineSpec> {
    match name {
        "null" => Ok(null::NullEnv::configured(num_envs, options)?.spec()),
        "cartpole" => Ok(cartpole::spec(num_envs)),
        "pixels" => pixels::spec(
            num_envs,
            options.image,
            options.frame_stack,
            pixels_device(options),
        ),
        #[cfg(feature = "mujoco")]
        other if other.starts_with("mujoco/") => super::mujoco::spec(other, num_envs),
        #[cfg(not(feature = "mujoco"))]
        other if other.starts_with("mujoco/") => Err(no_mujoco(other)),
        other => Err(unknown_env(other)),
    }
}

/// Builds a reference env by name on `device`: host memory ([`by_name`]) or a CUDA device
/// (`gpu::by_name`; without the `cuda` feature, `CudaUnavailable`).
pub fn by_name_on(
    name: &str,
    num_envs: u32,
    options: &EnvOptions,
    device: Device,
) -> Result<Box<dyn VecEnv>> {
    match device {
        Device::Host => by_name(name, num_envs, options),
        Device::Cuda(c) => {
            device::built_for(device::Location::Cuda)?;
            gpu::by_name(name, num_envs, options, c.ordinal)
        }
        Device::Vulkan(_) => Err(Error::InvalidSpec(
            "a reference env steps on the host or on CUDA; only its image goes to Vulkan \
             (--image-device vulkan)"
                .into(),
        )),
    }
}

/// Where `pixels` draws its frames: Vulkan memory unless `image_device` says host.
fn pixels_device(options: &EnvOptions) -> Device {
    match options.image_device {
        Some(Device::Host) => Device::Host,
        _ => Device::Vulkan(device::VulkanDevice::ANY),
    }
}
