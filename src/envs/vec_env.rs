//! What every reference env is ([`VecEnv`]), the options they take ([`EnvOptions`]), and
//! the loop that serves one with an [`Engine`] ([`serve`]).

use std::time::Duration;

use crate::command::{CommandError, CommandHandler, Reply, ResetRequest};
use crate::device::Device;
use crate::engine::{Engine, EngineSpec};
use crate::error::{Error, Peer, Result};
use crate::tensor::Tensors;

/// A vectorised environment an [`Engine`] can serve. Its [`CommandHandler`] answers
/// `Reset` and its engine-defined methods.
///
/// An env whose spec puts tensors on a CUDA device steps on the GPU through the same
/// `Tensors`: `Tensors::engine_backend` gives the engine's backend and the stream to launch on (ordered
/// after the wait on the client's event and before the engine's event record) and
/// `Tensors::device_ptr` the tensors' device addresses (`envs::gpu`).
pub trait VecEnv: CommandHandler {
    /// The tensors it needs (the engine is created from this).
    fn spec(&self) -> EngineSpec;
    /// Writes the reset observations of every env (frame 0).
    fn reset_all(&mut self, io: &mut Tensors<'_>) -> Result<()>;
    /// Applies `reset_mask`, steps every env with the client's actions and writes frame `seq`.
    fn step(&mut self, seq: u64, io: &mut Tensors<'_>) -> Result<()>;
}

/// Hands a `dyn VecEnv` to the engine's dispatch as its `dyn CommandHandler` (trait
/// upcasting needs Rust 1.86; the crate supports 1.82).
pub struct EnvCommands<'e>(pub &'e mut dyn VecEnv);

impl CommandHandler for EnvCommands<'_> {
    fn reset(&mut self, io: &mut Tensors<'_>, req: &ResetRequest) -> Result<(), CommandError> {
        CommandHandler::reset(self.0, io, req)
    }
    fn call(
        &mut self,
        io: &mut Tensors<'_>,
        method: &str,
        args: &[(String, String)],
        payload: &[u8],
    ) -> Result<Reply, CommandError> {
        CommandHandler::call(self.0, io, method, args, payload)
    }
}

/// How a [`serve`] loop ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServeEnd {
    /// The client closed after this many steps.
    ClientClosed { steps: u64 },
}

/// Publishes frame 0, calls `on_ready` with the region name, then answers every action
/// with one frame until the client closes. `idle_timeout` bounds each wait for an action
/// (the first one included).
pub fn serve(
    engine: &mut Engine,
    env: &mut dyn VecEnv,
    idle_timeout: Duration,
    on_ready: impl FnOnce(&str),
) -> Result<ServeEnd> {
    env.reset_all(&mut engine.tensors())?;
    engine.publish()?;
    on_ready(engine.name());
    loop {
        match engine.wait_actions_with(idle_timeout, &mut EnvCommands(env)) {
            Ok(seq) => {
                env.step(seq, &mut engine.tensors())?;
                engine.publish()?;
            }
            Err(Error::PeerClosed { peer: Peer::Client }) => {
                return Ok(ServeEnd::ClientClosed {
                    steps: engine.frame(),
                })
            }
            Err(e) => return Err(e),
        }
    }
}

/// The flags every front door shares (the CLI's `engine` options, `launch()`'s keyword
/// arguments): each reference engine reads its own options from them
/// ([`Reference::options`](super::Reference::options)) and ignores the others.
#[derive(Debug, Clone, Default)]
pub struct EnvOptions {
    pub obs_dim: Option<u64>,
    pub act_dim: Option<u64>,
    /// `null`: write the pattern to the first and last element of each tensor only.
    pub sparse: bool,
    pub seed: u64,
    /// `null`: also serve an `rgb` u8 tensor of shape `(num_envs, h, w, c)`.
    pub image: Option<[u64; 3]>,
    /// `pixels`: the frames per env in `rgb` (default `pixels::DEFAULT_STACK`).
    pub frame_stack: Option<u32>,
    /// `mujoco/<Task>`: threads stepping the envs (default 1).
    pub threads: Option<u32>,
    /// `mujoco/<Task>`: the named camera of the model whose view of each env is served in
    /// `rgb`, `uint8 [N, H, W, 3]` (docs/mujoco.md).
    pub camera: Option<String>,
    /// `mujoco/<Task>`: the camera's image size `[H, W]` (default 84x84).
    pub camera_size: Option<[u64; 2]>,
    /// `mujoco/<Task>`: also serve the camera's depth image in `depth`, `float32
    /// [N, H, W]`, the distance in metres (docs/mujoco.md).
    pub camera_depth: bool,
    /// `mujoco/raw`: the MJCF file served as a task (docs/mujoco.md).
    pub model: Option<String>,
    /// `mujoco/raw`: a shared library whose `shmbridge_mujoco_reward` gives each step's
    /// reward and termination (docs/mujoco.md).
    pub reward_lib: Option<String>,
    /// `mujoco/<Task>`: the steps after which an episode is truncated (default: the
    /// task's, 1000).
    pub max_episode_steps: Option<u32>,
    /// Where `rgb` lives: `Host` (with the env's other tensors; `null`'s default) or
    /// `Device::Vulkan(VulkanDevice::ANY)` (1.3: a buffer the library allocates and
    /// exports, mapped on the engine's CPU, path a; `pixels`' default).
    pub image_device: Option<Device>,
    /// The envs built are the region's `first_env..` (a shard's slice, 1.4): `cartpole`
    /// and `pixels` seed env `e` of the slice with `seed + first_env + e`, `null` writes
    /// the pattern at the region's element indices, so a sharded region holds what one
    /// engine would.
    pub first_env: u32,
}

/// Parses an image shape written `HxWxC` (e.g. `84x84x3`).
pub fn parse_image_shape(text: &str) -> Result<[u64; 3]> {
    let bad = || {
        Error::InvalidSpec(format!(
            "image shape '{text}': expected HxWxC with positive integers, e.g. 84x84x3"
        ))
    };
    match sides(text).ok_or_else(bad)?[..] {
        [h, w, c] if h > 0 && w > 0 && c > 0 => Ok([h, w, c]),
        _ => Err(bad()),
    }
}

/// The largest side of a `mujoco/<Task>` camera image.
pub const MAX_CAMERA_SIDE: u64 = 4096;

/// The most threads a `mujoco/<Task>` engine steps with (`EnvOptions::threads`).
pub const MAX_THREADS: u32 = 256;

/// Parses a camera image size written `HxW` (e.g. `84x84`), each side in
/// `1..=MAX_CAMERA_SIDE`.
pub fn parse_camera_size(text: &str) -> Result<[u64; 2]> {
    let side = 1..=MAX_CAMERA_SIDE;
    match sides(text).as_deref() {
        Some(&[h, w]) if side.contains(&h) && side.contains(&w) => Ok([h, w]),
        _ => Err(Error::InvalidSpec(format!(
            "camera size '{text}': expected HxW with integers in 1..={MAX_CAMERA_SIDE}, e.g. 84x84"
        ))),
    }
}

/// The integers of `text` separated by `x`, or `None` if one is not.
fn sides(text: &str) -> Option<Vec<u64>> {
    text.split('x')
        .map(|d| d.trim().parse::<u64>().ok())
        .collect()
}
