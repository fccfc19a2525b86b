//! The reference engines on a CUDA device (`shmbridge engine --device cuda`; without the
//! `cuda` feature they are `CudaUnavailable`): `null` and `cartpole` with every tensor in
//! the engine's exported device
//! allocation, stepped entirely on the GPU by the kernels of `kernels/` (compiled by NVRTC
//! when the env is built, before the engine's region exists).
//!
//! They are [`VecEnv`]s like the CPU engines, serve the same tensors (names, dtypes,
//! shapes, metadata: the CPU engines' specs, placed on the device) and are served by the
//! same [`serve`](super::serve) loop. What they need from the engine comes through the
//! `&mut Tensors` every step and command gets: the stream of [`Tensors::engine_backend`]
//! ([`EngineBackend::stream`](crate::device::EngineBackend::stream)) and
//! [`Tensors::device_ptr`]. Their kernels and their own state (cartpole's f64 states, step
//! counts and generators, in device memory the env owns; it is not exported) come from
//! [`crate::device::compute`].
//!
//! Ordering is by the engine's one stream: `wait_actions` queues the wait on the client's
//! event, then [`VecEnv::step`] queues the kernels, then `publish` records the engine's
//! event and only then posts `frame_seq`. A `Reset` command's kernels are queued before the
//! engine records its event and pushes the reply. Host arrays (seeds) are uploaded only
//! after that stream drained, into a buffer no queued kernel reads any more.
//!
//! Drop order: the engine goes first (its close synchronizes its stream), so no queued
//! kernel uses an env's memory after it is freed; `run_reference` creates the env first,
//! hence drops it last.

use super::kernels::{self, ResetUpload, BLOCK};
use super::reference::CudaReference;
use super::vec_env::VecEnv;
use super::{cartpole, null};
use crate::command::{CommandError, CommandHandler, Reply, ResetRequest};
use crate::device::compute::{Arg, CudaKernels, DeviceMemory};
use crate::device::{Device, StreamRef};
use crate::engine::EngineSpec;
use crate::error::{Error, Result};
use crate::layout::TensorId;
use crate::tensor::Tensors;

/// Compiles one of the kernel files with NVRTC ([`kernels::COMPILE_OPTIONS`]) for device
/// `ordinal` and loads it there.
fn load(ordinal: i32, file: &str, source: &str) -> Result<CudaKernels> {
    CudaKernels::build(ordinal, file, source, kernels::COMPILE_OPTIONS)
}

/// `spec` with every tensor on CUDA device `ordinal`.
fn on_device(mut spec: EngineSpec, ordinal: i32) -> EngineSpec {
    for t in &mut spec.tensors {
        t.device = Device::cuda(ordinal);
    }
    spec
}

/// The engine's stream, where a frame's (or a command's) kernels go: a stream of the
/// env's device, whose tensors the engine placed there.
fn stream<'a>(io: &Tensors<'a>) -> Result<StreamRef<'a>> {
    io.engine_backend()?
        .stream()
        .ok_or_else(|| Error::CudaUnavailable {
            reason: "these engine views have no CUDA side: the engine has no CUDA tensors".into(),
        })
}

/// A tensor's device address and element count.
fn device_tensor(io: &Tensors<'_>, id: TensorId) -> Result<(u64, u64)> {
    let t = io.info(id)?;
    Ok((io.device_ptr(id)?, t.nbytes / t.dtype.size() as u64))
}

// ---------------------------------------------------------------------------------------
// null

/// `null` on the GPU (kernels/null.cu): the pattern of [`null::pattern`] in `obs` (and of
/// [`null::pattern_u8`] in `rgb`), `rewards[e] = actions[e, 0]`, sparse mode included.
#[derive(Debug)]
pub struct GpuNull {
    cfg: null::NullEnv,
    ordinal: i32,
    module: CudaKernels,
    /// Resolved by `reset_all`.
    ids: Option<NullIds>,
}

#[derive(Debug, Clone, Copy)]
struct NullIds {
    obs: TensorId,
    actions: TensorId,
    rewards: TensorId,
    rgb: Option<TensorId>,
}

impl CudaReference for null::NullEnv {
    fn build_on_cuda(
        num_envs: u32,
        options: &null::NullOptions,
        ordinal: i32,
    ) -> Result<Box<dyn VecEnv>> {
        let cfg = null::NullEnv::configured(num_envs, options)?;
        Ok(Box::new(GpuNull::new(cfg, ordinal)?))
    }
}

impl GpuNull {
    /// The GPU version of `cfg` (its sizes, sparse mode and image) on device `ordinal`.
    pub fn new(cfg: null::NullEnv, ordinal: i32) -> Result<GpuNull> {
        let module = load(ordinal, "null.cu", kernels::NULL_CU)?;
        Ok(GpuNull {
            cfg,
            ordinal,
            module,
            ids: None,
        })
    }

    /// Queues frame `seq`: `obs` and `rgb` get its pattern; `rewards` the actions' first
    /// column when `rewards` (steps, not frame 0 or a reset). Sparse: the first and last
    /// elements only.
    fn frame(&self, io: &Tensors<'_>, seq: u64, rewards: bool) -> Result<()> {
        let ids = self
            .ids
            .ok_or(Error::OutOfOrder("null: step() before reset()"))?;
        let s = stream(io)?;
        let (obs, n) = device_tensor(io, ids.obs)?;
        let (rgb, rgb_n) = match ids.rgb {
            Some(id) => device_tensor(io, id)?,
            None => (0, 0),
        };
        let (act, rew) = if rewards {
            (io.device_ptr(ids.actions)?, io.device_ptr(ids.rewards)?)
        } else {
            (0, 0)
        };
        let num_envs = u64::from(self.cfg.num_envs);
        let act_dim = self.cfg.act_dim;
        if self.cfg.sparse {
            // SAFETY: `s` is the engine's stream, on this env's device (`stream`).
            // null_sparse(float*, u64, u8*, u64, u64, const float*, u64, float*,
            // u64). `obs` holds n ≥ 1 f32, `rgb` rgb_n ≥ 1 bytes or is 0 (skipped),
            // `actions` is [num_envs, act_dim] f32 and `rewards` [num_envs] f32 or 0
            // (skipped): the engine's tensors, alive while it is.
            return unsafe {
                self.module.launch(
                    "null_sparse",
                    s,
                    1,
                    1,
                    &[
                        Arg::Ptr(obs),
                        Arg::U64(n),
                        Arg::Ptr(rgb),
                        Arg::U64(rgb_n),
                        Arg::U64(seq),
                        Arg::Ptr(act),
                        Arg::U64(act_dim),
                        Arg::Ptr(rew),
                        Arg::U64(num_envs),
                    ],
                )
            };
        }
        let threads = kernels::launch_threads(n);
        if rewards {
            // SAFETY: `s` is the engine's stream, on this env's device (`stream`).
            // null_step(float*, u64, u64, const float*, u64, float*, u64); `obs`
            // holds n f32, `actions` num_envs × act_dim f32, `rewards` num_envs f32 (the
            // engine's tensors); grid-stride loops stay below n and num_envs.
            unsafe {
                self.module.launch(
                    "null_step",
                    s,
                    threads,
                    BLOCK,
                    &[
                        Arg::Ptr(obs),
                        Arg::U64(n),
                        Arg::U64(seq),
                        Arg::Ptr(act),
                        Arg::U64(act_dim),
                        Arg::Ptr(rew),
                        Arg::U64(num_envs),
                    ],
                )
            }?;
        } else {
            // SAFETY: `s` is the engine's stream, on this env's device (`stream`).
            // null_fill(float*, u64, u64); `obs` holds n f32.
            unsafe {
                self.module.launch(
                    "null_fill",
                    s,
                    threads,
                    BLOCK,
                    &[Arg::Ptr(obs), Arg::U64(n), Arg::U64(seq)],
                )
            }?;
        }
        if ids.rgb.is_some() {
            // SAFETY: `s` is the engine's stream, on this env's device (`stream`).
            // null_fill_u8(u8*, u64, u64); `rgb` holds rgb_n bytes.
            unsafe {
                self.module.launch(
                    "null_fill_u8",
                    s,
                    kernels::launch_threads(rgb_n),
                    BLOCK,
                    &[Arg::Ptr(rgb), Arg::U64(rgb_n), Arg::U64(seq)],
                )
            }?;
        }
        Ok(())
    }
}

impl VecEnv for GpuNull {
    fn spec(&self) -> EngineSpec {
        on_device(self.cfg.spec(), self.ordinal)
    }

    fn reset_all(&mut self, io: &mut Tensors<'_>) -> Result<()> {
        self.ids = Some(NullIds {
            obs: io.id("obs")?,
            actions: io.id("actions")?,
            rewards: io.id("rewards")?,
            rgb: match self.cfg.image {
                Some(_) => Some(io.id("rgb")?),
                None => None,
            },
        });
        self.frame(io, 0, false)
    }

    fn step(&mut self, seq: u64, io: &mut Tensors<'_>) -> Result<()> {
        self.frame(io, seq, true)
    }
}

impl CommandHandler for GpuNull {
    /// `Reset` of every env at once (frame 0's pattern), as the CPU `null`.
    fn reset(&mut self, io: &mut Tensors<'_>, req: &ResetRequest) -> Result<(), CommandError> {
        null::check_reset(req)?;
        self.reset_all(io).map_err(CommandError::engine)
    }

    fn call(
        &mut self,
        _io: &mut Tensors<'_>,
        method: &str,
        args: &[(String, String)],
        payload: &[u8],
    ) -> Result<Reply, CommandError> {
        null::call_method(method, args, payload)
    }
}

// ---------------------------------------------------------------------------------------
// cartpole

/// Byte offsets of a GPU cartpole's state arrays in its own allocation, for `n` envs:
/// f64 states `[n, 4]`, u64 generator states `[n]`, u64 increments `[n]`, u32 step counts
/// `[n]` (each 8-byte aligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateLayout {
    pub state: u64,
    pub rng_state: u64,
    pub rng_inc: u64,
    pub steps: u64,
    pub size: u64,
}

impl StateLayout {
    pub fn new(num_envs: u32) -> StateLayout {
        let n = u64::from(num_envs); // ≤ 2^32: every product below fits u64
        StateLayout {
            state: 0,
            rng_state: 32 * n,
            rng_inc: 40 * n,
            steps: 48 * n,
            size: 52 * n,
        }
    }
}

/// `cartpole` on the GPU (kernels/cartpole.cu): the CPU engine's dynamics, seeds, resets,
/// autoreset, `final_obs`, `reset_mask` and `set_pole_length`, one thread per env, state
/// in f64.
#[derive(Debug)]
pub struct GpuCartPole {
    num_envs: u32,
    seed: u64,
    ordinal: i32,
    length: f64,
    /// Whether frame 0 seeded the generators yet.
    seeded: bool,
    ids: Option<CartIds>,
    // Drop order: the module, then the uploads and the state.
    module: CudaKernels,
    /// Host arrays of the last seeding or reset (grown as needed).
    upload: Option<DeviceMemory>,
    state: DeviceMemory,
    layout: StateLayout,
}

#[derive(Debug, Clone, Copy)]
struct CartIds {
    obs: TensorId,
    actions: TensorId,
    rewards: TensorId,
    terminated: TensorId,
    truncated: TensorId,
    reset_mask: TensorId,
    final_obs: TensorId,
}

impl CudaReference for cartpole::CartPole {
    fn build_on_cuda(
        num_envs: u32,
        options: &cartpole::CartPoleOptions,
        ordinal: i32,
    ) -> Result<Box<dyn VecEnv>> {
        Ok(Box::new(GpuCartPole::new(num_envs, options.seed, ordinal)?))
    }
}

impl GpuCartPole {
    /// `num_envs` envs on device `ordinal`; env `e`'s stream is seeded with `seed + e`
    /// (wrapping) as `CartPole::new` does. The initial states are drawn in `reset_all`
    /// (frame 0), on the engine's stream.
    pub fn new(num_envs: u32, seed: u64, ordinal: i32) -> Result<GpuCartPole> {
        if num_envs == 0 {
            return Err(Error::InvalidSpec("cartpole: num_envs must be ≥ 1".into()));
        }
        let module = load(ordinal, "cartpole.cu", kernels::CARTPOLE_CU)?;
        let layout = StateLayout::new(num_envs);
        let size = usize::try_from(layout.size).map_err(|_| {
            Error::InvalidSpec(format!("cartpole: {num_envs} envs do not fit in memory"))
        })?;
        let state = module.alloc(size)?;
        Ok(GpuCartPole {
            num_envs,
            seed,
            ordinal,
            length: cartpole::LENGTH,
            seeded: false,
            ids: None,
            module,
            upload: None,
            state,
            layout,
        })
    }

    /// Device addresses of (states, step counts, generator states, increments).
    fn state_ptrs(&self) -> [u64; 4] {
        let base = self.state.ptr();
        [
            base + self.layout.state,
            base + self.layout.steps,
            base + self.layout.rng_state,
            base + self.layout.rng_inc,
        ]
    }

    /// Uploads `bytes` for the kernels queued next on `stream`; returns their device
    /// address (0 for none). Waits for `stream` first: no kernel queued earlier still
    /// reads the previous upload when it is overwritten or freed.
    fn upload(&mut self, stream: StreamRef<'_>, bytes: &[u8]) -> Result<u64> {
        if bytes.is_empty() {
            return Ok(0);
        }
        self.module.synchronize(stream)?;
        let upload = match self.upload.take() {
            Some(u) if u.size() >= bytes.len() => u,
            _ => self.module.alloc(bytes.len())?,
        };
        // Synchronous (complete on the device on return), after the stream drained.
        upload.write(0, bytes)?;
        let ptr = upload.ptr();
        self.upload = Some(upload);
        Ok(ptr)
    }

    /// Queues a reset of `ids` in list order (duplicates allowed), each listing first
    /// giving the env the generator of `Pcg32::seed_from_u64(seeds[k])` when `seeds` is
    /// given (one per listing, all ids < num_envs: as `ResetRequest::plan` gives them),
    /// then rewrites every env's `obs` and `final_obs` from its state: what the CPU
    /// engine's `Reset` does. Linear in the listing and the envs.
    fn queue_reset(&mut self, io: &Tensors<'_>, ids: &[u32], seeds: Option<&[u64]>) -> Result<()> {
        let t = self
            .ids
            .ok_or(Error::OutOfOrder("cartpole: reset before frame 0"))?;
        let s = stream(io)?;
        let up = ResetUpload::new(ids, seeds);
        let base = self.upload(s, &up.bytes)?;
        let [state, steps, rng_state, rng_inc] = self.state_ptrs();
        if up.n > 0 {
            let n = u32::try_from(up.n)
                .map_err(|_| Error::InvalidSpec(format!("{} envs to reset", up.n)))?;
            let at = |offset: usize| Arg::Ptr(base + offset as u64);
            // SAFETY: `s` is the engine's stream, on this env's device (`stream`).
            // cartpole_reset_listed(double*, u32*, u64*, u64*, const u32*, const
            // u64*, u64, const u64*, const u64*, u32): the state arrays hold num_envs
            // entries each (StateLayout); the upload holds n distinct ids < num_envs, n
            // counts and, when seeded, n generator states and increments (ResetUpload).
            // One thread per listed env: no two threads touch the same env.
            unsafe {
                self.module.launch(
                    "cartpole_reset_listed",
                    s,
                    n,
                    BLOCK,
                    &[
                        Arg::Ptr(state),
                        Arg::Ptr(steps),
                        Arg::Ptr(rng_state),
                        Arg::Ptr(rng_inc),
                        at(0),
                        at(up.counts_at),
                        Arg::U64(up.n as u64),
                        at(up.states_at),
                        at(up.incs_at),
                        Arg::U32(u32::from(up.seeded)),
                    ],
                )
            }?;
        }
        // SAFETY: `s` is the engine's stream, on this env's device (`stream`).
        // cartpole_write_obs(const double*, float*, float*, u64): num_envs states;
        // obs and final_obs are the engine's [num_envs, 4] f32 tensors. Queued after the
        // resets on the same stream.
        unsafe {
            self.module.launch(
                "cartpole_write_obs",
                s,
                self.num_envs,
                BLOCK,
                &[
                    Arg::Ptr(state),
                    Arg::Ptr(io.device_ptr(t.obs)?),
                    Arg::Ptr(io.device_ptr(t.final_obs)?),
                    Arg::U64(u64::from(self.num_envs)),
                ],
            )
        }
    }
}

impl VecEnv for GpuCartPole {
    fn spec(&self) -> EngineSpec {
        on_device(cartpole::spec(self.num_envs), self.ordinal)
    }

    /// The first call seeds and draws every env (frame 0); later ones rewrite `obs` and
    /// `final_obs` from the current states, as the CPU engine's `reset_all` does.
    fn reset_all(&mut self, io: &mut Tensors<'_>) -> Result<()> {
        let t = CartIds {
            obs: io.id("obs")?,
            actions: io.id("actions")?,
            rewards: io.id("rewards")?,
            terminated: io.id("terminated")?,
            truncated: io.id("truncated")?,
            reset_mask: io.id("reset_mask")?,
            final_obs: io.id("final_obs")?,
        };
        self.ids = Some(t);
        if self.seeded {
            return self.queue_reset(io, &[], None);
        }
        // Frame 0: env e's stream is Pcg32::seed_from_u64(seed + e) and its first state
        // is drawn from it, as CartPole::new does.
        let all: Vec<u32> = (0..self.num_envs).collect();
        let seeds: Vec<u64> = (0..u64::from(self.num_envs))
            .map(|e| self.seed.wrapping_add(e))
            .collect();
        self.queue_reset(io, &all, Some(&seeds))?;
        self.seeded = true;
        Ok(())
    }

    fn step(&mut self, _seq: u64, io: &mut Tensors<'_>) -> Result<()> {
        let t = self
            .ids
            .ok_or(Error::OutOfOrder("cartpole: step() before reset()"))?;
        let s = stream(io)?;
        let [state, steps, rng_state, rng_inc] = self.state_ptrs();
        let p = |id| io.device_ptr(id).map(Arg::Ptr);
        // SAFETY: `s` is the engine's stream, on this env's device (`stream`).
        // cartpole_step(double*, u32*, u64*, const u64*, const i64*, const u8*,
        // float*, float*, u8*, u8*, float*, double, u64): num_envs entries in each state
        // array; actions [num_envs, 1] i64, reset_mask/terminated/truncated [num_envs]
        // bool, rewards [num_envs] f32, obs/final_obs [num_envs, 4] f32: the engine's
        // tensors (the cartpole spec). The stream waited on the client's event before
        // this (wait_actions), so actions and reset_mask are complete.
        unsafe {
            self.module.launch(
                "cartpole_step",
                s,
                self.num_envs,
                BLOCK,
                &[
                    Arg::Ptr(state),
                    Arg::Ptr(steps),
                    Arg::Ptr(rng_state),
                    Arg::Ptr(rng_inc),
                    p(t.actions)?,
                    p(t.reset_mask)?,
                    p(t.obs)?,
                    p(t.rewards)?,
                    p(t.terminated)?,
                    p(t.truncated)?,
                    p(t.final_obs)?,
                    Arg::F64(self.length),
                    Arg::U64(u64::from(self.num_envs)),
                ],
            )
        }
    }
}

impl CommandHandler for GpuCartPole {
    /// `Reset`: the listed envs (all if none), reseeded as the CPU engine does.
    fn reset(&mut self, io: &mut Tensors<'_>, req: &ResetRequest) -> Result<(), CommandError> {
        let (ids, seeds) = req.plan(self.num_envs)?;
        self.queue_reset(io, &ids, seeds.as_deref())
            .map_err(CommandError::engine)
    }

    fn call(
        &mut self,
        _io: &mut Tensors<'_>,
        method: &str,
        args: &[(String, String)],
        _payload: &[u8],
    ) -> Result<Reply, CommandError> {
        cartpole::call_method(&mut self.length, method, args)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn state_arrays_are_aligned_and_disjoint() {
        for n in [1u32, 3, 64, 4096, u32::MAX] {
            let l = StateLayout::new(n);
            let n = u64::from(n);
            let spans = [
                (l.state, 32 * n),
                (l.rng_state, 8 * n),
                (l.rng_inc, 8 * n),
                (l.steps, 4 * n),
            ];
            let mut end = 0;
            for (at, len) in spans {
                assert_eq!(at % 8, 0, "{l:?}");
                assert_eq!(at, end, "packed in order: {l:?}");
                end = at + len;
            }
            assert_eq!(end, l.size);
        }
    }

    #[test]
    fn specs_are_the_cpu_specs_on_the_device() {
        let on = on_device(cartpole::spec(8), 1);
        let host = cartpole::spec(8);
        assert_eq!(on.metadata, host.metadata);
        assert_eq!(on.kind, host.kind);
        assert_eq!(on.tensors.len(), host.tensors.len());
        for (a, b) in on.tensors.iter().zip(&host.tensors) {
            assert_eq!(
                (&a.name, a.dtype, &a.shape, a.direction),
                (&b.name, b.dtype, &b.shape, b.direction)
            );
            assert_eq!(a.device, Device::cuda(1), "{}", a.name);
            assert_eq!(b.device, Device::Host);
        }
    }

    fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_ne_bytes(b[at..at + 8].try_into().unwrap())
    }

    /// kernels/cartpole.cu's `cartpole_reset_listed` on the host, reading the upload as
    /// the kernel does (one "thread" per listed env).
    fn reset_listed_mirror(states: &mut [[f64; 4]], rngs: &mut [(u64, u64)], up: &ResetUpload) {
        use crate::envs::kernels::mirror::uniform;
        for k in 0..up.n {
            let e = u32::from_ne_bytes(up.bytes[4 * k..4 * k + 4].try_into().unwrap()) as usize;
            if up.seeded {
                rngs[e] = (
                    u64_at(&up.bytes, up.states_at + 8 * k),
                    u64_at(&up.bytes, up.incs_at + 8 * k),
                );
            }
            for _ in 0..u64_at(&up.bytes, up.counts_at + 8 * k) {
                let (st, inc) = &mut rngs[e];
                states[e] = std::array::from_fn(|_| uniform(st, *inc, -0.05, 0.05));
            }
        }
    }

    /// The GPU cartpole's seeding and reset scheme (host: `ResetRequest::plan`, `ResetUpload`;
    /// kernel: `cartpole_reset_listed`, mirrored above) gives bit for bit the CPU engine's
    /// states: at frame 0 and after `Reset` commands, duplicates and every seed form
    /// included.
    #[test]
    fn the_kernels_reset_scheme_gives_the_cpu_states() {
        let (n, seed) = (9u32, u64::MAX - 3); // the seeds wrap
        let mut cpu = cartpole::CartPole::new(n, seed).unwrap();
        let mut states = vec![[0.0; 4]; n as usize];
        let mut rngs = vec![(0, 0); n as usize];
        let all: Vec<u32> = (0..n).collect();
        let seeds: Vec<u64> = (0..u64::from(n)).map(|e| seed.wrapping_add(e)).collect();
        reset_listed_mirror(
            &mut states,
            &mut rngs,
            &ResetUpload::new(&all, Some(&seeds)),
        );
        let bits =
            |s: &[[f64; 4]]| -> Vec<[u64; 4]> { s.iter().map(|v| v.map(f64::to_bits)).collect() };
        assert_eq!(bits(&states), bits(cpu.states()), "frame 0");
        let mut engine = crate::Engine::create(cartpole::spec(n)).unwrap();
        let req = |env_ids: Option<Vec<u32>>, seeds: Vec<u64>| ResetRequest {
            env_ids,
            seeds,
            options: Vec::new(),
        };
        for r in [
            req(Some(vec![3, 1, 3, 0]), vec![11, 12, 13, 14]),
            req(Some(vec![2, 2, 8, 2]), vec![]),
            req(None, vec![99]),
            req(Some(vec![5, 5]), vec![u64::MAX]),
            req(None, vec![]),
            req(Some(vec![]), vec![4]),
        ] {
            CommandHandler::reset(&mut cpu, &mut engine.tensors(), &r).unwrap();
            let (ids, seeds) = r.plan(n).unwrap();
            reset_listed_mirror(
                &mut states,
                &mut rngs,
                &ResetUpload::new(&ids, seeds.as_deref()),
            );
            assert_eq!(bits(&states), bits(cpu.states()), "{r:?}");
        }
    }

    /// Without a usable driver (CI), building a GPU env is a typed error, never a panic.
    #[test]
    fn building_without_cuda_is_a_typed_error() {
        if crate::device::probe().is_ok() {
            eprintln!("SKIPPED building_without_cuda_is_a_typed_error: CUDA is usable here");
            return;
        }
        let cuda = Device::Cuda(crate::device::CudaDevice {
            ordinal: 0,
            uuid: [0; 16],
        });
        let build = |env| match crate::envs::by_name_on(env, 4, &Default::default(), cuda) {
            Ok(_) => panic!("{env} built without CUDA"),
            Err(e) => e,
        };
        for env in ["null", "cartpole"] {
            let e = build(env);
            assert!(matches!(e, Error::CudaUnavailable { .. }), "{env}: {e}");
        }
        let e = build("nope");
        assert!(matches!(e, Error::InvalidSpec(_)), "{e}");
    }
}
