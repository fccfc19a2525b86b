//! The one registry of reference engines: [`REFERENCE_ENGINES`], each a [`Reference`]
//! (its name, what it is, its own options type, how it is built on the host and on a
//! CUDA device) made into an [`Entry`]. Every lookup by name goes through [`find`]: the
//! CLI's `engine --env`, the runner ([`run_reference`](super::run_reference), which
//! Python's `launch()` and `make_vec` start), and the catalog functions [`by_name`],
//! [`by_name_on`] and [`host_spec`]. A new reference engine is its file, one
//! `impl Reference`, and one line in [`REFERENCE_ENGINES`].

pub use super::reference::{CudaReference, Entry, Reference};
use super::vec_env::{EnvOptions, VecEnv};
use super::{cartpole, null, pixels};
use crate::device::Device;
use crate::engine::EngineSpec;
use crate::error::{Error, Result};

/// Every reference engine, in the order `--help` and errors list them.
pub const REFERENCE_ENGINES: &[Entry] = &[
    Entry::with_cuda::<null::NullEnv>(),
    Entry::with_cuda::<cartpole::CartPole>(),
    Entry::of::<pixels::Pixels>(),
    #[cfg(feature = "mujoco")]
    Entry::of::<super::mujoco::HalfCheetah>(),
    #[cfg(feature = "mujoco")]
    Entry::of::<super::mujoco::InvertedPendulum>(),
    #[cfg(feature = "mujoco")]
    Entry::of::<super::mujoco::Hopper>(),
    #[cfg(feature = "mujoco")]
    Entry::of::<super::mujoco::Walker2d>(),
    #[cfg(feature = "mujoco")]
    Entry::of::<super::mujoco::Ant>(),
    #[cfg(feature = "mujoco")]
    Entry::of::<super::mujoco::Humanoid>(),
    #[cfg(feature = "mujoco")]
    Entry::of::<super::mujoco::Raw>(),
];

/// What the names of the native MuJoCo engines (src/envs/mujoco/) start with: a build
/// without the `mujoco` feature has no entry of theirs and says why.
const MUJOCO_PREFIX: &str = "mujoco/";

/// The reference engine called `name`; `InvalidSpec` naming the known ones otherwise.
pub fn find(name: &str) -> Result<&'static Entry> {
    REFERENCE_ENGINES
        .iter()
        .find(|e| e.name == name)
        .ok_or_else(|| {
            if name.starts_with(MUJOCO_PREFIX) && !cfg!(feature = "mujoco") {
                return Error::InvalidSpec(format!(
                    "'{name}': this shmbridge was built without the `mujoco` feature \
                     (docs/mujoco.md)"
                ));
            }
            let known: Vec<&str> = REFERENCE_ENGINES.iter().map(|e| e.name).collect();
            Error::InvalidSpec(format!(
                "unknown env '{name}' (reference envs: {})",
                known.join(", ")
            ))
        })
}

/// Builds a reference env by name (host memory).
pub fn by_name(name: &str, num_envs: u32, options: &EnvOptions) -> Result<Box<dyn VecEnv>> {
    find(name)?.build_on(num_envs, options, Device::Host)
}

/// The spec the host env `name` serves, without building the env: its state is about
/// as large as its region, so [`run_reference`](super::run_reference) reserves the region first, and a size
/// that does not fit /dev/shm is `NoSpace` before any of that memory is touched.
pub fn host_spec(name: &str, num_envs: u32, options: &EnvOptions) -> Result<EngineSpec> {
    find(name)?.host_spec(num_envs, options)
}

/// Builds a reference env by name on `device` ([`Entry::build_on`]).
pub fn by_name_on(
    name: &str,
    num_envs: u32,
    options: &EnvOptions,
    device: Device,
) -> Result<Box<dyn VecEnv>> {
    find(name)?.build_on(num_envs, options, device)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::engine::Engine;

    /// Frame 0 of reference engine `name` with `num_envs` envs: its `obs` and its `rgb`
    /// (empty without one), per env in order.
    fn frame_0(name: &str, num_envs: u32, options: &EnvOptions) -> (Vec<f32>, Vec<u8>) {
        let mut env = by_name(name, num_envs, options).unwrap();
        let spec = env.spec();
        let has_rgb = spec.tensors.iter().any(|t| t.name == "rgb");
        let mut engine = Engine::create(spec).unwrap();
        env.reset_all(&mut engine.tensors()).unwrap();
        let mut io = engine.tensors();
        let obs = io.read::<f32>("obs").unwrap().to_vec();
        let rgb = match has_rgb {
            true => io.read::<u8>("rgb").unwrap().to_vec(),
            false => Vec::new(),
        };
        (obs, rgb)
    }

    /// What a sharded region relies on: every reference engine built as a slice
    /// (`EnvOptions::first_env`, one shard's envs) serves what the whole engine serves
    /// for those envs. `pixels` seeded every shard's envs from env 0's seed.
    #[test]
    fn every_engine_built_as_a_slice_serves_the_slice_of_the_whole() {
        // `mujoco/raw`'s model file (a pendulum with a sensor).
        let model = std::env::temp_dir().join(format!("shmbridge-raw-{}.xml", std::process::id()));
        std::fs::write(
            &model,
            r#"<mujoco><worldbody><body><joint name="j" type="hinge" ref="0.3"/>
               <geom size="0.1" pos="0 0 -0.5"/></body></worldbody>
               <actuator><motor joint="j"/></actuator><sensor><jointpos joint="j"/></sensor></mujoco>"#,
        )
        .unwrap();
        let options = EnvOptions {
            seed: 5,
            image: Some([8, 8, 1]),
            image_device: Some(Device::Host),
            model: Some(model.display().to_string()),
            ..Default::default()
        };
        for entry in REFERENCE_ENGINES {
            let (obs, rgb) = frame_0(entry.name, 4, &options);
            let slice = EnvOptions {
                first_env: 2,
                ..options.clone()
            };
            let (slice_obs, slice_rgb) = frame_0(entry.name, 2, &slice);
            assert_eq!(slice_obs[..], obs[obs.len() / 2..], "{}: obs", entry.name);
            assert_eq!(slice_rgb[..], rgb[rgb.len() / 2..], "{}: rgb", entry.name);
        }
        std::fs::remove_file(&model).unwrap();
    }
}
