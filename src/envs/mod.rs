//! Reference engines: `null` (the transport floor and the integrity check) and
//! `cartpole` (Gymnasium CartPole-v1 dynamics, vectorised), and the loop that serves one.
//! With the `cuda` feature, `gpu` has both on a CUDA device (`--device cuda`).

pub mod cartpole;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod kernels;
pub mod null;
pub mod pixels;

use std::time::Duration;

use crate::command::{CommandError, CommandHandler, Reply, ResetRequest};
use crate::device::{Device, DeviceRequest};
use crate::engine::{Engine, EngineSpec};
use crate::error::{Error, Peer, Result};
use crate::tensor::Tensors;

/// A vectorised environment an [`Engine`] can serve. Its [`CommandHandler`] answers
/// `Reset` and its engine-defined methods.
///
/// An env whose spec puts tensors on a CUDA device steps on the GPU through the same
/// `Tensors`: `Tensors::engine_device` gives the engine's CUDA side and stream to launch on (ordered
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
    env.reset_all(&mut engine.io())?;
    engine.publish()?;
    on_ready(engine.name());
    loop {
        match engine.wait_actions_with(idle_timeout, &mut EnvCommands(env)) {
            Ok(seq) => {
                env.step(seq, &mut engine.io())?;
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

/// Builds a reference env by name (host memory).
pub fn by_name(name: &str, num_envs: u32, options: &EnvOptions) -> Result<Box<dyn VecEnv>> {
    match name {
        "null" => Ok(Box::new(
            null_env(num_envs, options)?.with_first_env(options.first_env),
        )),
        "cartpole" => Ok(Box::new(cartpole::CartPole::new(
            num_envs,
            options.seed.wrapping_add(u64::from(options.first_env)),
        )?)),
        "pixels" => Ok(Box::new(pixels::Pixels::new(
            num_envs,
            options.seed,
            options.image,
        )?)),
        other => Err(unknown_env(other)),
    }
}

/// The spec the host env `name` serves, without building the env: its state is about
/// as large as its region, so [`run_reference`] reserves the region first, and a size
/// that does not fit /dev/shm is `NoSpace` before any of that memory is touched.
pub fn host_spec(name: &str, num_envs: u32, options: &EnvOptions) -> Result<EngineSpec> {
    match name {
        "null" => Ok(null_env(num_envs, options)?.spec()),
        "cartpole" => Ok(cartpole::spec(num_envs)),
        "pixels" => pixels::spec(num_envs, options.image),
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
        #[cfg(feature = "cuda")]
        Device::Cuda(c) => gpu::by_name(name, num_envs, options, c.ordinal),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::device::cuda::unavailable_without_feature()),
        Device::Vulkan(_) => Err(Error::InvalidSpec(
            "a reference env steps on the host or on CUDA; only its image goes to Vulkan \
             (--image-device vulkan)"
                .into(),
        )),
    }
}

/// The `null` env `options` describe (its configuration; the GPU `null` serves the same).
fn null_env(num_envs: u32, options: &EnvOptions) -> Result<null::NullEnv> {
    let env = null::NullEnv::new(
        num_envs,
        options.obs_dim.unwrap_or(16),
        options.act_dim.unwrap_or(1),
        options.sparse,
    )?;
    match options.image {
        Some(shape) => env.with_image(shape),
        None => Ok(env),
    }
}

fn unknown_env(name: &str) -> Error {
    Error::InvalidSpec(format!(
        "unknown env '{name}' (reference envs: null, cartpole, pixels)"
    ))
}

/// Options of the reference envs (each uses the ones that apply to it).
#[derive(Debug, Clone, Default)]
pub struct EnvOptions {
    pub obs_dim: Option<u64>,
    pub act_dim: Option<u64>,
    /// `null`: write the pattern to the first and last element of each tensor only.
    pub sparse: bool,
    pub seed: u64,
    /// `null`: also serve an `rgb` u8 tensor of shape `(num_envs, h, w, c)`.
    pub image: Option<[u64; 3]>,
    /// Where `rgb` lives: `Host` (default: with the env's other tensors) or
    /// `Device::Vulkan(VulkanDevice::ANY)` (1.3: a buffer the library allocates and
    /// exports, mapped on the engine's CPU, path a).
    pub image_device: Option<Device>,
    /// The envs built are the region's `first_env..` (a shard's slice, 1.4): `cartpole`
    /// seeds env `e` of the slice with `seed + first_env + e`, `null` writes the pattern
    /// at the region's element indices, so a sharded region holds what one engine would.
    pub first_env: u32,
}

/// Parses an image shape written `HxWxC` (e.g. `84x84x3`).
pub fn parse_image_shape(text: &str) -> Result<[u64; 3]> {
    let bad = || {
        Error::InvalidSpec(format!(
            "image shape '{text}': expected HxWxC with positive integers, e.g. 84x84x3"
        ))
    };
    let dims: Vec<u64> = text
        .split('x')
        .map(|d| d.trim().parse::<u64>().map_err(|_| bad()))
        .collect::<Result<_>>()?;
    match dims[..] {
        [h, w, c] if h > 0 && w > 0 && c > 0 => Ok([h, w, c]),
        _ => Err(bad()),
    }
}

/// A reference engine to serve: what `shmbridge engine` and Python's `launch()` run.
#[derive(Debug, Clone)]
pub struct ReferenceEngine {
    pub env: String,
    pub num_envs: u32,
    /// Region name; random if `None`.
    pub name: Option<String>,
    pub options: EnvOptions,
    pub policy: crate::sync::WaitPolicy,
    /// Give up after this long without an action.
    pub idle_timeout: Duration,
    /// Where the env's tensors live: `Host` (the CPU engines), `Cuda` (the `envs::gpu`
    /// engines: every tensor on the device, stepped by the kernels of `kernels/`; needs
    /// the `cuda` feature and a usable device), or `Auto` (CUDA device 0 when usable,
    /// else host).
    pub device: DeviceRequest,
    /// `(k, K)`: serve shard `k` of a region split over `K` processes (1.4). Shard 0
    /// creates the region (named by `name`, required when `K > 1`); the others join it.
    pub shard: (u32, u32),
}

/// Creates the engine, prints the region name on stdout once frame 0 is published, and
/// serves until the client closes; returns the number of steps served. SIGINT/SIGTERM
/// close the region and remove its name before the process exits, so nothing is left in
/// /dev/shm and the client sees `PeerClosed`.
pub fn run_reference(r: &ReferenceEngine) -> Result<u64> {
    if r.shard.1 > 1 {
        return run_reference_shard(r);
    }
    let mut choice = crate::device::resolve(r.device)?;
    // The env before the engine: it is dropped after it, once the engine's close has
    // synchronized the stream its kernels ran on.
    let serving = |spec: EngineSpec| {
        let mut spec = spec.policy(r.policy);
        if let Some(d @ Device::Vulkan(_)) = r.options.image_device {
            spec = spec.place("rgb", d);
        }
        if let Some(n) = &r.name {
            spec = spec.name(n);
        }
        spec
    };
    let build = |device| -> Result<(Box<dyn VecEnv>, Engine)> {
        if device == Device::Host {
            // The region (reserved in /dev/shm) before the env's state, which is as large.
            let engine = Engine::create(serving(host_spec(&r.env, r.num_envs, &r.options)?))?;
            let env = by_name(&r.env, r.num_envs, &r.options)?;
            return Ok((env, engine));
        }
        let env = by_name_on(&r.env, r.num_envs, &r.options, device)?;
        let engine = Engine::create(serving(env.spec()))?;
        Ok((env, engine))
    };
    let (mut env, mut engine) = match build(choice.device) {
        // `auto` with a usable driver but no usable GPU engine (NVRTC missing, a kernel
        // that does not load, no memory): host memory, saying why.
        Err(e @ (Error::CudaUnavailable { .. } | Error::Cuda { .. }))
            if r.device == DeviceRequest::Auto && choice.device != Device::Host =>
        {
            choice.device = Device::Host;
            choice.reason = format!("falling back to host memory: {e}");
            build(choice.device)?
        }
        other => other?,
    };
    if r.device != DeviceRequest::Host {
        eprintln!("{}", choice.log_line());
    }
    close_on_signal(engine.map_again()?, None);
    serve_printing_name(&mut engine, env.as_mut(), r.idle_timeout)
}

/// One shard of a reference engine (1.4): shard 0 creates the region from the whole
/// env's spec and serves its slice; the others join by name. Each steps an env of its
/// slice's size, built as the slice of the whole (`EnvOptions::first_env`). Host only.
fn run_reference_shard(r: &ReferenceEngine) -> Result<u64> {
    let (k, count) = r.shard;
    let Some(name) = &r.name else {
        return Err(Error::InvalidSpec(
            "a sharded engine needs --name: the shards find the region by it".into(),
        ));
    };
    if k >= count {
        return Err(Error::InvalidSpec(format!(
            "shard {k}/{count}: k must be below K"
        )));
    }
    if r.device != DeviceRequest::Host || r.options.image_device.is_some() {
        return Err(Error::InvalidSpec(
            "sharded engines serve host memory only (--device cpu, no --image-device)".into(),
        ));
    }
    let (first_env, envs) = crate::layout::env_slice(r.num_envs, count.min(r.num_envs), k);
    let options = EnvOptions {
        first_env,
        ..r.options.clone()
    };
    let mut env = by_name(&r.env, envs, &options)?;
    let mut engine = if k == 0 {
        let whole = by_name(&r.env, r.num_envs, &r.options)?;
        let spec = whole.spec().policy(r.policy).name(name).shards(count);
        Engine::create(spec)?
    } else {
        let options = crate::engine::JoinOptions {
            policy: r.policy,
            metadata: env.spec().metadata,
            ..Default::default()
        };
        Engine::join(name, k, options)?
    };
    if engine.num_envs() != envs as usize {
        return Err(Error::InvalidSpec(format!(
            "shard {k} of '{name}' serves {} envs, this engine was built for {envs}: start every shard with the same --num-envs",
            engine.num_envs()
        )));
    }
    close_on_signal(engine.map_again()?, (k > 0).then_some(k));
    serve_printing_name(&mut engine, env.as_mut(), r.idle_timeout)
}

/// [`serve`], printing the region name on stdout once frame 0 is published (what a
/// launcher waits for); returns the steps served.
fn serve_printing_name(engine: &mut Engine, env: &mut dyn VecEnv, idle: Duration) -> Result<u64> {
    let ServeEnd::ClientClosed { steps } = serve(engine, env, idle, |name| {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{name}");
        let _ = out.flush();
    })?;
    Ok(steps)
}

/// On SIGINT/SIGTERM: close the region this engine serves (`own`, a second mapping of
/// it, never re-opened by name: the name may be another engine's by now) and remove its
/// name if still its own (the creator), or mark a joined shard closed (the name is the
/// creator's), so the client sees `PeerClosed` / `ShardClosed`; then exit.
fn close_on_signal(own: crate::region::Region, joined_shard: Option<u32>) {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) else {
        return;
    };
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            match joined_shard {
                None => own.close_and_remove(),
                Some(k) => {
                    let _ = own.close_shard(k);
                }
            }
            // `_exit`, not `exit`: the main thread may be ending too (its client closed
            // once it saw the region closed) and running the exit handlers and drops
            // (a Vulkan device's destruction) that `exit` would run again here at the
            // same time: the engine died of SIGSEGV. The region is closed and removed;
            // what is left, the kernel frees.
            // SAFETY: ends the process at once; nothing here depends on what it skips.
            unsafe { libc::_exit(128 + sig) };
        }
    });
}
