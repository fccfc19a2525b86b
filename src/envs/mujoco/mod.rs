//! `mujoco/<Task>`: a native MuJoCo engine (the `mujoco` feature; docs/mujoco.md). One
//! MJCF model, N `mjData`, stepped in this process through MuJoCo 3.17's C API
//! (`mujoco-rs`), with Gymnasium's `-v5` tasks ([`tasks`]): same model files (read at run
//! time from the installed `gymnasium` package), frame skip, observations, rewards,
//! terminations, truncation at 1000 steps and reset noise. Reset noise comes from each
//! env's own NumPy generator ([`numpy_random`]), env `i` seeded with `seed + first_env +
//! i` as Gymnasium seeds it: the same seed gives Gymnasium's initial states (HalfCheetah's
//! and Ant's normal velocities excepted: docs/mujoco.md).
//!
//! Tensors: `obs [N, obs_dim] f32` (Gymnasium's observation, as f32), `actions [N, nu]
//! f32` (the controls, `ctrl`; MuJoCo clamps them to `ctrlrange`, the reward's control
//! cost uses them as given, as Gymnasium does), `rewards`, `terminated`, `truncated`,
//! `reset_mask`, and `final_obs` (the observation before an autoreset, as `cartpole`).
//! Autoreset in the same step, like `cartpole`. `EnvOptions::threads` (`--threads`,
//! `launch(..., threads=T)`): T threads per step (the engine's own and a pool of T - 1
//! started with the engine and kept for its life), each stepping a contiguous run of
//! envs and writing only its rows; the ended episodes are recorded after they are done.
//!
//! `mujoco/raw` serves any MJCF file (`EnvOptions::model`) as a task ([`tasks::RAW`]):
//! observation `qpos`, `qvel`, `sensordata`, reward 0, action `ctrl`, truncation at
//! `EnvOptions::max_episode_steps` (default 1000; the Gymnasium tasks take it too).
//!
//! Commands (`client.call`): `model_info` (sizes, timestep, frame skip, the names of
//! bodies, joints, actuators, sensors and cameras and each joint's, sensor's and camera's
//! size), `get_state(env)`, `set_state(env, qpos, qvel[, act][, time])` and
//! `set_control(env, ctrl)` (comma-separated numbers, written with
//! Rust's shortest round-trip formatting, so a get/set pair is exact), and `Reset`
//! (seeded as `cartpole`). `env` is the region's env index; a shard answers for its own.

pub mod camera;
pub mod numpy_random;
mod reward;
pub mod tasks;

use std::path::PathBuf;
use std::sync::Arc;

use mujoco_rs::wrappers::{MjData, MjModel, MjtJoint, MjtObjBase};

use self::camera::Camera;
use self::numpy_random::NumpyRandom;
use self::reward::{RewardFn, RewardLib};
use self::tasks::{Position, ResetNoise, State, Task};
use super::vec_env::{EnvOptions, VecEnv, MAX_CAMERA_SIDE, MAX_THREADS};
use crate::command::{arg, CommandError, CommandHandler, Reply, ResetRequest};
use crate::device::compute::ShaderTarget;
use crate::engine::EngineSpec;
use crate::error::{Error, Result};
use crate::layout::{DType, Direction};
use crate::tensor::Tensors;

/// The variable naming the folder of Gymnasium's MuJoCo model files
/// (`.../gymnasium/envs/mujoco/assets`). `python -m shmbridge engine` sets it from the
/// installed `gymnasium` package when it is not set.
pub const ASSETS_VAR: &str = "SHMBRIDGE_MUJOCO_ASSETS";

use self::tasks::Data;
pub use self::tasks::PREFIX;

/// One env: its MuJoCo data, episode counters and noise stream.
struct Env {
    data: Data,
    steps: u32,
    episode_return: f64,
    rng: NumpyRandom,
}

impl Env {
    /// Gymnasium's `reset`: `mj_resetData`, then `qpos0`/zero velocities plus the task's
    /// noise, then `mj_forward`.
    fn reset(&mut self, task: &Task) {
        self.data.reset();
        self.steps = 0;
        self.episode_return = 0.0;
        let (rng, data) = (&mut self.rng, &mut self.data);
        let scale = match task.noise {
            ResetNoise::None => {
                data.forward();
                return;
            }
            ResetNoise::Uniform(s) | ResetNoise::UniformNormal(s) => s,
        };
        for q in data.qpos_mut() {
            *q += rng.uniform(-scale, scale);
        }
        for v in data.qvel_mut() {
            *v += match task.noise {
                ResetNoise::Uniform(s) => rng.uniform(-s, s),
                ResetNoise::UniformNormal(s) => s * standard_normal(rng),
                ResetNoise::None => 0.0,
            };
        }
        data.forward();
    }

    fn observe(&self, task: &Task, out: &mut [f32]) {
        task.observe(&self.state(), out);
    }

    fn state(&self) -> State<'_> {
        let d = &self.data;
        State {
            qpos: d.qpos(),
            qvel: d.qvel(),
            cinert: d.cinert(),
            cvel: d.cvel(),
            qfrc_actuator: d.qfrc_actuator(),
            cfrc_ext: d.cfrc_ext(),
            sensordata: d.sensordata(),
        }
    }

    /// The x position whose change the task rewards.
    fn x_position(&self, task: &Task) -> f64 {
        let d = &self.data;
        match task.position {
            Position::None => 0.0,
            Position::Qpos0 => d.qpos()[0],
            Position::Body(b) => d.xpos()[b][0],
            Position::MassCenter => {
                let mass = d.model().body_mass();
                let moment: f64 = mass.iter().zip(d.xipos()).map(|(m, p)| m * p[0]).sum();
                moment / mass.iter().sum::<f64>()
            }
        }
    }
}

/// The registry's entries ([`super::registry::REFERENCE_ENGINES`]): one type per task,
/// named `mujoco/<Task>`, whose options are the flags every front door shares (the seed,
/// the slice, `threads`).
macro_rules! references {
    ($($ty:ident => $name:literal: $description:expr),* $(,)?) => {$(
        #[doc = concat!("`", $name, "` as a reference engine.")]
        pub struct $ty;

        impl super::reference::Reference for $ty {
            const NAME: &'static str = $name;
            const DESCRIPTION: &'static str = $description;
            type Options = EnvOptions;
            fn options(flags: &EnvOptions) -> EnvOptions {
                flags.clone()
            }
            fn spec(num_envs: u32, options: &EnvOptions) -> Result<EngineSpec> {
                spec($name, num_envs, options)
            }
            fn build(num_envs: u32, options: &EnvOptions) -> Result<Box<dyn VecEnv>> {
                Ok(Box::new(MujocoEnv::new($name, num_envs, options)?))
            }
        }
    )*};
}

/// What `--help` says of a Gymnasium task.
macro_rules! gymnasium_task {
    () => {
        "Gymnasium's MuJoCo task of that name, stepped natively (docs/mujoco.md)"
    };
}

references! {
    HalfCheetah => "mujoco/HalfCheetah-v5": gymnasium_task!(),
    InvertedPendulum => "mujoco/InvertedPendulum-v5": gymnasium_task!(),
    Hopper => "mujoco/Hopper-v5": gymnasium_task!(),
    Walker2d => "mujoco/Walker2d-v5": gymnasium_task!(),
    Ant => "mujoco/Ant-v5": gymnasium_task!(),
    Humanoid => "mujoco/Humanoid-v5": gymnasium_task!(),
    Raw => "mujoco/raw": "any MJCF file (--model PATH): qpos, qvel, sensordata; reward 0 (docs/mujoco.md)",
}

pub struct MujocoEnv {
    task: Task,
    model: Arc<MjModel>,
    envs: Vec<Env>,
    first_env: u32,
    obs_dim: usize,
    nu: usize,
    /// `timestep * frame_skip`, Gymnasium's `dt`.
    dt: f64,
    /// Threads stepping the envs, each a contiguous run of them.
    threads: usize,
    /// The `threads - 1` threads that step all but the first run (`None` with one
    /// thread), started once: a step hands them work, it starts no thread.
    pool: Option<rayon::ThreadPool>,
    /// `--camera`: what was asked, and its renderer.
    camera: Option<(CameraSpec, Camera)>,
    /// `--reward-lib` (`mujoco/raw`): the user's reward function.
    reward: Option<RewardLib>,
}

/// The default camera image size, `[H, W]`.
pub const DEFAULT_CAMERA_SIZE: [u64; 2] = [84, 84];

/// The camera a task serves (`--camera NAME --camera-size HxW [--camera-depth]`).
#[derive(Debug, Clone)]
struct CameraSpec {
    name: String,
    /// `[H, W]`.
    size: [u64; 2],
    /// `depth`, `float32 [N, H, W]`, as well as `rgb`.
    depth: bool,
}

/// The camera asked for in `options`, checked against `model`, and its id.
/// `camera_size` or `camera_depth` without `camera`, or a side outside
/// `1..=MAX_CAMERA_SIDE`, is refused.
fn camera_of(
    task: &Task,
    model: &MjModel,
    options: &EnvOptions,
) -> Result<Option<(CameraSpec, usize)>> {
    match (&options.camera, options.camera_size) {
        (None, None) if !options.camera_depth => Ok(None),
        (None, _) => Err(Error::InvalidSpec(format!(
            "{PREFIX}{}: a camera size or depth without --camera NAME",
            task.id
        ))),
        (Some(name), size) => {
            let size = size.unwrap_or(DEFAULT_CAMERA_SIZE);
            if !size.iter().all(|side| (1..=MAX_CAMERA_SIDE).contains(side)) {
                return Err(Error::InvalidSpec(format!(
                    "{PREFIX}{}: camera size {}x{}: each side in 1..={MAX_CAMERA_SIDE}",
                    task.id, size[0], size[1]
                )));
            }
            let id = camera::camera_id(model, task.id, name)?;
            let spec = CameraSpec {
                name: name.clone(),
                size,
                depth: options.camera_depth,
            };
            Ok(Some((spec, id)))
        }
    }
}

/// The task of engine `name` (`mujoco/HalfCheetah-v5`, `mujoco/raw`), truncated at
/// `options.max_episode_steps` where given, or `InvalidSpec` listing them. Also refuses
/// what the CLI's parser refuses (every face builds through here): `max_episode_steps`
/// 0, `threads` outside `1..=MAX_THREADS`.
fn task_of(name: &str, options: &EnvOptions) -> Result<Task> {
    if options.reward_lib.is_some() && name != format!("{PREFIX}{}", tasks::RAW.id) {
        return Err(Error::InvalidSpec(format!(
            "{name}: --reward-lib is for {PREFIX}{} (a task of Gymnasium's computes its own reward)",
            tasks::RAW.id
        )));
    }
    if options.max_episode_steps == Some(0) {
        return Err(Error::InvalidSpec(format!(
            "{name}: max_episode_steps must be at least 1"
        )));
    }
    if let Some(t) = options.threads.filter(|t| !(1..=MAX_THREADS).contains(t)) {
        return Err(Error::InvalidSpec(format!(
            "{name}: threads {t}: expected 1..={MAX_THREADS}"
        )));
    }
    let task = name
        .strip_prefix(PREFIX)
        .and_then(|id| match id {
            "raw" => Some(&tasks::RAW),
            id => tasks::task(id),
        })
        .ok_or_else(|| {
            let known: Vec<String> = tasks::TASKS
                .iter()
                .chain([&tasks::RAW])
                .map(|t| format!("{PREFIX}{}", t.id))
                .collect();
            Error::InvalidSpec(format!(
                "unknown MuJoCo env '{name}' (native MuJoCo envs: {})",
                known.join(", ")
            ))
        })?;
    Ok(Task {
        max_steps: options.max_episode_steps.unwrap_or(task.max_steps),
        ..*task
    })
}

/// Loads the model of `task`: `mujoco/raw`'s from `options.model`, a Gymnasium task's
/// from Gymnasium's assets folder ([`ASSETS_VAR`]).
fn load_model(task: &Task, options: &EnvOptions) -> Result<MjModel> {
    if task.id == tasks::RAW.id {
        let path = options.model.as_ref().ok_or_else(|| {
            Error::InvalidSpec(format!(
                "{PREFIX}raw: no model file (--model PATH, launch(..., model=PATH))"
            ))
        })?;
        return load_model_file(task, std::path::Path::new(path));
    }
    let dir = std::env::var_os(ASSETS_VAR).ok_or_else(|| {
        Error::InvalidSpec(format!(
            "{PREFIX}{}: {ASSETS_VAR} is not set: it names Gymnasium's MuJoCo assets folder \
             (python -m shmbridge engine and launch() set it where gymnasium is installed)",
            task.id
        ))
    })?;
    load_model_from(task, &PathBuf::from(dir))
}

/// Loads `task`'s model file from `dir` and checks that it has what the task reads (a
/// file there may be another model than Gymnasium's): the positions, bodies and
/// velocities the task indexes.
fn load_model_from(task: &Task, dir: &std::path::Path) -> Result<MjModel> {
    load_model_file(task, &dir.join(task.xml))
}

/// Turns off MuJoCo's log file, once per process: its default handler appends every
/// warning (a deprecated model attribute, a client's NaN control: one per env and
/// episode) to `MUJOCO_LOG.TXT` in the working folder, which is the caller's; warnings
/// still go to stderr.
fn quiet_log_file() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use mujoco_rs::wrappers::{log_config, set_log_config};
        // SAFETY: MuJoCo is used only through models this crate loads, each after this
        // call: a thread loading one meanwhile waits on `ONCE`, so no other thread is in
        // MuJoCo while its global log configuration is written.
        unsafe { set_log_config(log_config().with_logto_file(false)) }
    });
}

/// Loads `task`'s model from file `path`; refuses one without what the task reads; runs
/// its initial state forward once.
fn load_model_file(task: &Task, path: &std::path::Path) -> Result<MjModel> {
    let bad = |what: String| {
        Error::InvalidSpec(format!("{PREFIX}{}: {}: {what}", task.id, path.display()))
    };
    if !path.is_file() {
        return Err(bad(match task.id == tasks::RAW.id {
            true => "no such model file".into(),
            false => "no such model file (is gymnasium[mujoco] >= 1.0 installed?)".into(),
        }));
    }
    quiet_log_file();
    let model = MjModel::from_xml(path).map_err(|e| bad(format!("loading: {e}")))?;
    let m = model.ffi();
    let (nq, nv, nu, nbody) = (
        m.nq as usize,
        m.nv as usize,
        m.nu as usize,
        m.nbody as usize,
    );
    let (need_nq, need_nbody) = task.needs();
    if nq < need_nq || nv == 0 || nbody < need_nbody || nu == 0 {
        return Err(bad(format!(
            "not the task's model: nq {nq}, nv {nv}, nu {nu}, nbody {nbody}; the task reads \
             at least {need_nq} positions, {need_nbody} bodies, one velocity and one actuator"
        )));
    }
    // One `mj_forward` of the initial state, as each env's first: a model whose arena
    // (`<size memory>`) overflows there ends the process inside MuJoCo (`mju_error`
    // exits), here before any region exists (`spec` runs first) rather than after.
    let mut scratch = MjData::try_new(&model)
        .map_err(|e| bad(format!("MuJoCo could not allocate its state: {e}")))?;
    scratch.forward();
    drop(scratch);
    Ok(model)
}

/// The spec of engine `name` with `num_envs` envs (loads the model, builds no env).
pub fn spec(name: &str, num_envs: u32, options: &EnvOptions) -> Result<EngineSpec> {
    let task = task_of(name, options)?;
    let model = load_model(&task, options)?;
    let camera = camera_of(&task, &model, options)?.map(|(camera, _)| camera);
    Ok(spec_of(&task, &model, num_envs, camera.as_ref()))
}

fn spec_of(task: &Task, model: &MjModel, num_envs: u32, camera: Option<&CameraSpec>) -> EngineSpec {
    let m = model.ffi();
    let (nq, nv, nu) = (m.nq as usize, m.nv as usize, m.nu as usize);
    let obs_dim = task.obs_dim(nq, nv, m.nbody as usize, m.nsensordata as usize) as u64;
    let ranges = model.actuator_ctrlrange();
    let limited = model.actuator_ctrllimited();
    // An actuator without `ctrlrange` has the range [0, 0] and is not limited: its bounds
    // are the whole line (MuJoCo clamps only limited controls).
    let bound = |k: usize| {
        ranges
            .iter()
            .zip(limited.iter())
            .map(|(r, &on)| match (on, k) {
                (true, _) => format!("{}", r[k] as f32),
                (false, 0) => "-inf".to_string(),
                (false, _) => "inf".to_string(),
            })
            .collect::<Vec<_>>()
            .join(",")
    };
    let n = u64::from(num_envs);
    let spec = EngineSpec::standard(
        &format!("{PREFIX}{}", task.id),
        num_envs,
        obs_dim,
        nu as u64,
        DType::F32,
    )
    .metadata("env_id", task.id)
    .metadata("autoreset_mode", "same-step")
    .metadata("action_space", "box")
    .metadata("action_low", &bound(0))
    .metadata("action_high", &bound(1))
    .metadata("max_episode_steps", &task.max_steps.to_string())
    .metadata("final_obs", "final_obs")
    .tensor(
        "final_obs",
        DType::F32,
        &[n, obs_dim],
        Direction::EngineToClient,
    );
    let Some(camera) = camera else {
        return spec;
    };
    let [h, w] = camera.size;
    let spec = spec.metadata("camera", &camera.name).tensor(
        "rgb",
        DType::U8,
        &[n, h, w, 3],
        Direction::EngineToClient,
    );
    match camera.depth {
        false => spec,
        true => spec.tensor("depth", DType::F32, &[n, h, w], Direction::EngineToClient),
    }
}

impl MujocoEnv {
    /// `num_envs` envs of engine `name`, env `i` seeded with `seed + first_env + i`.
    pub fn new(name: &str, num_envs: u32, options: &EnvOptions) -> Result<Self> {
        #[cfg(all(test, not(loom)))]
        ENVS_BUILT.with(|n| n.set(n.get() + num_envs));
        let task = task_of(name, options)?;
        let mut model = load_model(&task, options)?;
        let camera = camera_of(&task, &model, options)?;
        if let Some((camera, _)) = &camera {
            camera::fit_offscreen(&mut model, camera.size);
        }
        let camera = match camera {
            Some((camera, id)) => {
                let renderer = Camera::new(&model, task.id, id, camera.size, camera.depth)?;
                Some((camera, renderer))
            }
            None => None,
        };
        let reward = match &options.reward_lib {
            Some(path) => Some(RewardLib::load(path)?),
            None => None,
        };
        let model = Arc::new(model);
        let m = model.ffi();
        let (nq, nv, nu) = (m.nq as usize, m.nv as usize, m.nu as usize);
        let obs_dim = task.obs_dim(nq, nv, m.nbody as usize, m.nsensordata as usize);
        let dt = m.opt.timestep * f64::from(task.frame_skip);
        let mut envs = Vec::new();
        envs.try_reserve_exact(num_envs as usize)
            .map_err(|_| Error::InvalidSpec(format!("{name}: no memory for {num_envs} envs")))?;
        let seed = options.seed.wrapping_add(u64::from(options.first_env));
        for i in 0..u64::from(num_envs) {
            let data = MjData::try_new(Arc::clone(&model)).map_err(|e| {
                Error::InvalidSpec(format!("{name}: MuJoCo could not allocate env {i}: {e}"))
            })?;
            envs.push(Env {
                data,
                steps: 0,
                episode_return: 0.0,
                rng: NumpyRandom::new(seed.wrapping_add(i)),
            });
        }
        let threads = (options.threads.unwrap_or(1).max(1) as usize).min(envs.len().max(1));
        let pool = match threads {
            1 => None,
            t => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(t - 1)
                    .thread_name(|k| format!("mujoco-step-{}", k + 1))
                    .build()
                    .map_err(|e| {
                        Error::InvalidSpec(format!("{name}: cannot start {t} step threads: {e}"))
                    })?,
            ),
        };
        let mut env = MujocoEnv {
            task,
            model,
            envs,
            first_env: options.first_env,
            obs_dim,
            nu,
            dt,
            threads,
            pool,
            camera,
            reward,
        };
        for i in 0..num_envs as usize {
            env.reset_one(i);
        }
        Ok(env)
    }

    fn reset_one(&mut self, i: usize) {
        self.envs[i].reset(&self.task);
    }

    fn observe(&self, i: usize, out: &mut [f32]) {
        self.envs[i].observe(&self.task, out);
    }

    fn write_all_obs(&mut self, io: &mut Tensors<'_>) -> Result<()> {
        let d = self.obs_dim;
        for name in ["obs", "final_obs"] {
            let out = io.write::<f32>(name)?;
            for (i, o) in out.chunks_exact_mut(d).enumerate() {
                self.observe(i, o);
            }
        }
        self.render(io, 0..self.envs.len())
    }

    /// The camera's view of envs `range` into their rows of `rgb` (and `depth` where
    /// asked; nothing without a camera). With `rgb` in Vulkan memory the library
    /// exported (`--image-device vulkan`), OpenGL writes the frames there when it can
    /// import it, else they go through the engine's mapping of it.
    fn render(&mut self, io: &mut Tensors<'_>, range: std::ops::Range<usize>) -> Result<()> {
        let Some((spec, camera)) = &mut self.camera else {
            return Ok(());
        };
        let (f, p) = (camera.frame_len(), camera.depth_len());
        let vulkan = io
            .engine_backend()
            .ok()
            .and_then(|engine| ShaderTarget::of(engine, io.id("rgb").ok()?.index()).ok());
        let on_gl = match vulkan {
            Some(target) => camera.use_vulkan_memory(target, (self.envs.len() * f) as u64)?,
            None => false,
        };
        let rgb = match on_gl {
            true => &mut [][..],
            false => io.write::<u8>("rgb")?,
        };
        let depth = match spec.depth {
            true => io.write::<f32>("depth")?,
            false => &mut [][..],
        };
        for i in range {
            let no_row = |name| Error::InvalidSpec(format!("{name} has no row for env {i}"));
            let row = match on_gl {
                true => &mut [][..],
                false => rgb
                    .get_mut(i * f..(i + 1) * f)
                    .ok_or_else(|| no_row("rgb"))?,
            };
            let depth_row = depth
                .get_mut(i * p..(i + 1) * p)
                .ok_or_else(|| no_row("depth"))?;
            camera.render(&mut self.envs[i].data, row, (i * f) as u64, depth_row)?;
        }
        camera.finish()
    }

    /// The local index of region env `env`, or a bad request.
    fn local(&self, args: &[(String, String)]) -> Result<usize, CommandError> {
        let env: u32 = arg(args, "env")?;
        let n = self.envs.len() as u32;
        env.checked_sub(self.first_env)
            .filter(|&i| i < n)
            .map(|i| i as usize)
            .ok_or_else(|| {
                CommandError::bad_request(format!(
                    "env {env} is not served here (envs {}..{})",
                    self.first_env,
                    self.first_env + n
                ))
            })
    }

    fn model_info(&self) -> Reply {
        let m = self.model.ffi();
        let names = |kind: MjtObjBase, count: i64| {
            (0..count.max(0) as usize)
                .map(|id| self.model.id_to_name(kind, id).unwrap_or("").to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let sizes = [
            ("nq", m.nq),
            ("nv", m.nv),
            ("nu", m.nu),
            ("na", m.na),
            ("nbody", m.nbody),
            ("njnt", m.njnt),
            ("nsensor", m.nsensor),
            ("nsensordata", m.nsensordata),
            ("ncam", m.ncam),
        ];
        let mut args: Vec<(String, String)> = sizes
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        args.extend([
            ("timestep".into(), m.opt.timestep.to_string()),
            ("frame_skip".into(), self.task.frame_skip.to_string()),
            ("bodies".into(), names(MjtObjBase::mjOBJ_BODY, m.nbody)),
            ("joints".into(), names(MjtObjBase::mjOBJ_JOINT, m.njnt)),
            ("actuators".into(), names(MjtObjBase::mjOBJ_ACTUATOR, m.nu)),
            ("sensors".into(), names(MjtObjBase::mjOBJ_SENSOR, m.nsensor)),
            ("cameras".into(), names(MjtObjBase::mjOBJ_CAMERA, m.ncam)),
        ]);
        // Each object's size: a joint's positions and velocities (free 7 and 6, ball 4
        // and 3, slide and hinge 1), a sensor's outputs, a camera's resolution (WxH).
        let widths = |pick: fn(&MjtJoint) -> usize| {
            list(self.model.jnt_type().iter().map(|t| pick(t).to_string()))
        };
        args.extend([
            ("joint_qpos_sizes".into(), widths(|t| joint_widths(*t).0)),
            ("joint_qvel_sizes".into(), widths(|t| joint_widths(*t).1)),
            (
                "sensor_sizes".into(),
                list(self.model.sensor_dim().iter().map(|d| d.to_string())),
            ),
            (
                "camera_sizes".into(),
                list(
                    self.model
                        .cam_resolution()
                        .iter()
                        .map(|[w, h]| format!("{w}x{h}")),
                ),
            ),
        ]);
        if let Some((_, camera)) = &self.camera {
            // Who writes the frames: `host` (the CPU, into the region or the engine's
            // mapping of `rgb`'s Vulkan memory, with why not OpenGL) or `opengl`.
            args.push(("camera_frames".into(), camera.frames_path()));
        }
        Reply::args(args)
    }

    fn get_state(&self, i: usize) -> Reply {
        let data = &self.envs[i].data;
        Reply::args(vec![
            ("qpos".into(), join(data.qpos())),
            ("qvel".into(), join(data.qvel())),
            ("act".into(), join(data.act())),
            ("ctrl".into(), join(data.ctrl())),
            ("time".into(), data.ffi().time.to_string()),
        ])
    }

    /// `set_control`: the env's `ctrl` (`nu` numbers, checked before any is written),
    /// then `mj_forward` (what reads `ctrl`: actuator forces, activations' rates) and its
    /// `obs`/`final_obs` rows rewritten. The next step sets `ctrl` to its action, as
    /// Gymnasium's `do_simulation` does: a control set here holds until then.
    fn set_control(
        &mut self,
        io: &mut Tensors<'_>,
        i: usize,
        args: &[(String, String)],
    ) -> Result<(), CommandError> {
        let ctrl = numbers(args, "ctrl", self.model.ffi().nu)?.ok_or_else(|| missing("ctrl"))?;
        let data = &mut self.envs[i].data;
        data.ctrl_mut().copy_from_slice(&ctrl);
        data.forward();
        self.write_obs_row(io, i)
    }

    /// Env `i`'s observation into its `obs` and `final_obs` rows (and its camera's view
    /// into `rgb`).
    fn write_obs_row(&mut self, io: &mut Tensors<'_>, i: usize) -> Result<(), CommandError> {
        let d = self.obs_dim;
        for name in ["obs", "final_obs"] {
            let out = io.write::<f32>(name).map_err(CommandError::engine)?;
            self.observe(i, &mut out[i * d..(i + 1) * d]);
        }
        self.render(io, i..i + 1).map_err(CommandError::engine)
    }

    /// Gymnasium's `set_state` (and `act`, `time` where given): the values, checked
    /// (lengths, finite) before any is written, then `mj_forward`; the env's observation
    /// is rewritten in `obs` and `final_obs`. Its episode goes on (steps and return kept).
    fn set_state(
        &mut self,
        io: &mut Tensors<'_>,
        i: usize,
        args: &[(String, String)],
    ) -> Result<(), CommandError> {
        let m = self.model.ffi();
        let qpos = numbers(args, "qpos", m.nq)?.ok_or_else(|| missing("qpos"))?;
        let qvel = numbers(args, "qvel", m.nv)?.ok_or_else(|| missing("qvel"))?;
        let act = numbers(args, "act", m.na)?;
        let time = match args.iter().any(|(k, _)| k == "time") {
            true => Some(finite(arg::<f64>(args, "time")?, "time")?),
            false => None,
        };
        let data = &mut self.envs[i].data;
        data.qpos_mut().copy_from_slice(&qpos);
        data.qvel_mut().copy_from_slice(&qvel);
        if let Some(act) = act {
            data.act_mut().copy_from_slice(&act);
        }
        if let Some(t) = time {
            // SAFETY: `time` is a plain f64 of mjData that no wrapper invariant covers.
            unsafe { data.ffi_mut().time = t };
        }
        data.forward();
        self.write_obs_row(io, i)
    }
}

/// The widths in `qpos` and `qvel` of a joint of type `t`.
fn joint_widths(t: MjtJoint) -> (usize, usize) {
    match t {
        MjtJoint::mjJNT_FREE => (7, 6),
        MjtJoint::mjJNT_BALL => (4, 3),
        _ => (1, 1),
    }
}

fn list(items: impl Iterator<Item = String>) -> String {
    items.collect::<Vec<_>>().join(",")
}

fn missing(key: &str) -> CommandError {
    CommandError::bad_request(format!("missing argument '{key}'"))
}

/// MuJoCo's `mjMAXVAL`: a state past it makes `mj_step` warn and reset the env.
const MAX_VALUE: f64 = 1e10;

/// `v` if finite and within [`MAX_VALUE`], else a bad request.
fn finite(v: f64, key: &str) -> Result<f64, CommandError> {
    if v.is_finite() && v.abs() <= MAX_VALUE {
        Ok(v)
    } else {
        Err(CommandError::bad_request(format!(
            "{key}: {v} is not a finite number within ±{MAX_VALUE:e} (MuJoCo's mjMAXVAL)"
        )))
    }
}

/// Argument `key` as `len` comma-separated finite numbers (`None` if absent).
fn numbers(
    args: &[(String, String)],
    key: &str,
    len: i64,
) -> Result<Option<Vec<f64>>, CommandError> {
    let Some((_, text)) = args.iter().find(|(k, _)| k == key) else {
        return Ok(None);
    };
    let values: Vec<f64> = if text.trim().is_empty() {
        Vec::new()
    } else {
        text.split(',')
            .map(|v| {
                let v: f64 = v
                    .trim()
                    .parse()
                    .map_err(|_| CommandError::bad_request(format!("{key}: cannot parse '{v}'")))?;
                finite(v, key)
            })
            .collect::<Result<_, _>>()?
    };
    if values.len() != len.max(0) as usize {
        return Err(CommandError::bad_request(format!(
            "{key}: {} numbers, the model has {len}",
            values.len()
        )));
    }
    Ok(Some(values))
}

fn join(values: &[f64]) -> String {
    list(values.iter().map(|v| v.to_string()))
}

/// A standard normal sample (Box-Muller, not NumPy's ziggurat: docs/mujoco.md).
fn standard_normal(rng: &mut NumpyRandom) -> f64 {
    let u1: f64 = 1.0 - rng.next_f64(); // (0, 1]: ln is finite
    let u2: f64 = rng.next_f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

impl VecEnv for MujocoEnv {
    fn spec(&self) -> EngineSpec {
        spec_of(
            &self.task,
            &self.model,
            self.envs.len() as u32,
            self.camera.as_ref().map(|(camera, _)| camera),
        )
    }

    fn reset_all(&mut self, io: &mut Tensors<'_>) -> Result<()> {
        self.write_all_obs(io)
    }

    fn step(&mut self, _seq: u64, io: &mut Tensors<'_>) -> Result<()> {
        let (d, nu) = (self.obs_dim, self.nu);
        let all = Slice {
            actions: io.read::<f32>("actions")?,
            reset_mask: io.read::<u8>("reset_mask")?,
            rewards: io.write::<f32>("rewards")?,
            terminated: io.write::<u8>("terminated")?,
            truncated: io.write::<u8>("truncated")?,
            final_obs: io.write::<f32>("final_obs")?,
            obs: io.write::<f32>("obs")?,
        };
        let stepper = Stepper {
            task: self.task,
            dt: self.dt,
            obs_dim: d,
            nu,
            reward: self.reward.as_ref().map(RewardLib::function),
            first_env: self.first_env as usize,
        };
        let n = self.envs.len();
        let per = n.div_ceil(self.threads.clamp(1, n.max(1)));
        let ended: Vec<(usize, f64, u64)> = match &self.pool {
            Some(pool) if per < n => {
                // Contiguous slices, one per thread; each writes only its own rows. The
                // first runs here, the others on the pool; their results are kept in
                // order, so the episodes are recorded as one thread records them.
                let runs = self.envs.chunks_mut(per).zip(all.split(per, d, nu));
                let mut ended: Vec<Result<Vec<(usize, f64, u64)>>> = Vec::new();
                ended.resize_with(n.div_ceil(per), || Ok(Vec::new()));
                pool.in_place_scope(|scope| {
                    let mut jobs = runs.zip(ended.iter_mut()).enumerate();
                    let here = jobs.next();
                    for (k, ((envs, slice), out)) in jobs {
                        scope.spawn(move |_| *out = stepper.step(envs, slice, k * per));
                    }
                    if let Some((_, ((envs, slice), out))) = here {
                        *out = stepper.step(envs, slice, 0);
                    }
                });
                let ended: Result<Vec<_>> = ended.into_iter().collect();
                ended?.into_iter().flatten().collect()
            }
            _ => stepper.step(&mut self.envs, all, 0)?,
        };
        for (i, ret, len) in ended {
            io.episode_ended(i, ret, len)?;
        }
        // The camera's view of every env's state, as served in `obs` (after an autoreset:
        // the new episode's), on this thread: the renderer's GL context is current here.
        self.render(io, 0..n)
    }
}

/// The rows of the step's tensors for a run of envs.
struct Slice<'a> {
    actions: &'a [f32],
    reset_mask: &'a [u8],
    rewards: &'a mut [f32],
    terminated: &'a mut [u8],
    truncated: &'a mut [u8],
    final_obs: &'a mut [f32],
    obs: &'a mut [f32],
}

impl<'a> Slice<'a> {
    /// Split into runs of `per` envs (`d` observation and `nu` action elements each).
    fn split(self, per: usize, d: usize, nu: usize) -> Vec<Slice<'a>> {
        let mut rewards = self.rewards.chunks_mut(per);
        let mut terminated = self.terminated.chunks_mut(per);
        let mut truncated = self.truncated.chunks_mut(per);
        let mut final_obs = self.final_obs.chunks_mut(per * d);
        let mut obs = self.obs.chunks_mut(per * d);
        self.actions
            .chunks(per * nu)
            .zip(self.reset_mask.chunks(per))
            .filter_map(|(actions, reset_mask)| {
                Some(Slice {
                    actions,
                    reset_mask,
                    rewards: rewards.next()?,
                    terminated: terminated.next()?,
                    truncated: truncated.next()?,
                    final_obs: final_obs.next()?,
                    obs: obs.next()?,
                })
            })
            .collect()
    }
}

/// What a step of any run of envs needs to know (copied to each thread).
#[derive(Clone, Copy)]
struct Stepper {
    task: Task,
    dt: f64,
    obs_dim: usize,
    nu: usize,
    /// `--reward-lib`: the reward and termination of each step instead of the task's
    /// (the function of `MujocoEnv::reward`, alive while a step runs).
    reward: Option<RewardFn>,
    /// The region's index of this engine's (shard's) env 0: what the callback is told.
    first_env: usize,
}

impl Stepper {
    /// Steps `envs` (the region's envs `first..`) with their rows of `io`; returns the
    /// episodes that ended: `(env, return, length)`, env the engine's index; or the
    /// reward callback's error.
    fn step(
        &self,
        envs: &mut [Env],
        io: Slice<'_>,
        first: usize,
    ) -> Result<Vec<(usize, f64, u64)>> {
        let (d, nu, task) = (self.obs_dim, self.nu, &self.task);
        let mut ended = Vec::new();
        for (i, env) in envs.iter_mut().enumerate() {
            let obs_i = &mut io.obs[i * d..(i + 1) * d];
            let final_i = &mut io.final_obs[i * d..(i + 1) * d];
            if io.reset_mask[i] != 0 {
                env.reset(task);
                io.rewards[i] = 0.0;
                io.terminated[i] = 0;
                io.truncated[i] = 0;
                env.observe(task, obs_i);
                final_i.copy_from_slice(obs_i);
                continue;
            }
            let action = &io.actions[i * nu..(i + 1) * nu];
            let x_before = env.x_position(task);
            for (c, a) in env.data.ctrl_mut().iter_mut().zip(action) {
                *c = f64::from(*a);
            }
            for _ in 0..task.frame_skip {
                env.data.step();
            }
            env.data.rne_post_constraint();
            let x_after = env.x_position(task);
            let (reward, term) = match self.reward {
                // SAFETY: `f` is the function of `MujocoEnv::reward`, which outlives the
                // step that made this `Stepper`.
                Some(f) => unsafe {
                    reward::reward_of(f, &env.data, (self.first_env + first + i) as u32, action)?
                },
                None => task.outcome(x_before, x_after, self.dt, action, &env.state()),
            };
            env.steps += 1;
            env.episode_return += reward;
            let trunc = env.steps >= task.max_steps;
            io.rewards[i] = reward as f32;
            io.terminated[i] = term as u8;
            io.truncated[i] = trunc as u8;
            env.observe(task, final_i);
            if term || trunc {
                ended.push((first + i, env.episode_return, u64::from(env.steps)));
                env.reset(task);
                env.observe(task, obs_i);
            } else {
                obs_i.copy_from_slice(final_i);
            }
        }
        Ok(ended)
    }
}

impl CommandHandler for MujocoEnv {
    /// `Reset`: the listed envs (all if none), reseeded where seeds are given.
    fn reset(&mut self, io: &mut Tensors<'_>, req: &ResetRequest) -> Result<(), CommandError> {
        let (ids, seeds) = req.plan(self.envs.len() as u32)?;
        for (k, &i) in ids.iter().enumerate() {
            if let Some(seeds) = &seeds {
                self.envs[i as usize].rng = NumpyRandom::new(seeds[k]);
            }
            self.reset_one(i as usize);
        }
        self.write_all_obs(io).map_err(CommandError::engine)
    }

    fn call(
        &mut self,
        io: &mut Tensors<'_>,
        method: &str,
        args: &[(String, String)],
        _payload: &[u8],
    ) -> Result<Reply, CommandError> {
        match method {
            "model_info" => Ok(self.model_info()),
            "get_state" => Ok(self.get_state(self.local(args)?)),
            "set_state" => {
                let i = self.local(args)?;
                self.set_state(io, i, args)?;
                Ok(Reply::args(Vec::new()))
            }
            "set_control" => {
                let i = self.local(args)?;
                self.set_control(io, i, args)?;
                Ok(Reply::args(Vec::new()))
            }
            other => Err(CommandError::unknown_method(
                other,
                &["model_info", "get_state", "set_state", "set_control"],
            )),
        }
    }
}

#[cfg(all(test, not(loom)))]
thread_local! {
    /// The envs [`MujocoEnv::new`] built on this thread (what the runner's tests count).
    pub(crate) static ENVS_BUILT: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Writes a model file for the tests, `<temp>/shmbridge-mujoco-<pid>-<tag>.xml`: a body
/// per actuator on a slide joint with a motor, a camera `c`, and `extra` inside `<mujoco>`.
#[cfg(all(test, not(loom)))]
pub(crate) fn test_model(tag: &str, actuators: usize, extra: &str) -> PathBuf {
    let bodies: String = (0..actuators)
        .map(|i| {
            format!(
                r#"<body pos="{i} 0 0"><joint name="j{i}" type="slide"/><geom size="0.1"/></body>"#
            )
        })
        .collect();
    let motors: String = (0..actuators)
        .map(|i| format!(r#"<motor joint="j{i}"/>"#))
        .collect();
    let path =
        std::env::temp_dir().join(format!("shmbridge-mujoco-{}-{tag}.xml", std::process::id()));
    std::fs::write(
        &path,
        format!(
            r#"<mujoco>{extra}<worldbody><camera name="c" pos="0 -3 0" xyaxes="1 0 0 0 0 1"/>{bodies}</worldbody><actuator>{motors}</actuator></mujoco>"#
        ),
    )
    .unwrap();
    path
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// The Rust face refuses what the CLI and Python refuse: a camera side outside
    /// 1..=4096, `max_episode_steps` 0, `threads` outside 1..=256.
    #[test]
    fn options_out_of_range_are_refused() {
        let model = test_model("ranges", 1, "");
        let with = |f: &dyn Fn(&mut EnvOptions)| {
            let mut options = EnvOptions {
                model: Some(model.to_string_lossy().into_owned()),
                ..Default::default()
            };
            f(&mut options);
            options
        };
        assert!(spec("mujoco/raw", 1, &with(&|_| ())).is_ok());
        for size in [[5000, 5000], [0, 84], [84, 0], [1 << 32, 1 << 32]] {
            let options = with(&|o| {
                o.camera = Some("c".into());
                o.camera_size = Some(size);
            });
            let e = spec("mujoco/raw", 1, &options).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidSpec(m) if m.contains("camera size")),
                "{size:?}: {e}"
            );
        }
        let e = spec("mujoco/raw", 1, &with(&|o| o.max_episode_steps = Some(0))).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidSpec(m) if m.contains("max_episode_steps")),
            "{e}"
        );
        for threads in [0, 257] {
            let options = with(&|o| o.threads = Some(threads));
            let e = MujocoEnv::new("mujoco/raw", 1, &options)
                .err()
                .expect("refused");
            assert!(
                matches!(&e, Error::InvalidSpec(m) if m.contains("threads")),
                "{threads}: {e}"
            );
        }
        std::fs::remove_file(&model).unwrap();
    }

    /// `camera_depth` adds `depth`, `float32 [N, H, W]`, next to `rgb`; without a camera
    /// it is refused, as a camera size is.
    #[test]
    fn camera_depth_adds_a_depth_tensor_and_needs_a_camera() {
        let model = test_model("depth", 1, "");
        let options = EnvOptions {
            model: Some(model.to_string_lossy().into_owned()),
            camera: Some("c".into()),
            camera_size: Some([6, 10]),
            camera_depth: true,
            ..Default::default()
        };
        let spec = spec("mujoco/raw", 3, &options).unwrap();
        let shape = |name: &str| {
            let t = spec.tensors.iter().find(|t| t.name == name).expect(name);
            (t.dtype, t.shape.clone())
        };
        assert_eq!(shape("rgb"), (DType::U8, vec![3, 6, 10, 3]));
        assert_eq!(shape("depth"), (DType::F32, vec![3, 6, 10]));
        let without = super::spec(
            "mujoco/raw",
            3,
            &EnvOptions {
                camera_depth: false,
                ..options.clone()
            },
        )
        .unwrap();
        assert!(without.tensors.iter().all(|t| t.name != "depth"));
        let e = super::spec(
            "mujoco/raw",
            3,
            &EnvOptions {
                camera: None,
                camera_size: None,
                ..options
            },
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidSpec(m) if m.contains("without --camera")),
            "{e}"
        );
        std::fs::remove_file(&model).unwrap();
    }

    /// A model file that is not the task's (one slide joint) is refused, not indexed past
    /// its end.
    #[test]
    fn a_model_without_what_the_task_reads_is_refused() {
        let dir = std::env::temp_dir().join(format!("shmbridge-mujoco-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("hopper.xml"),
            r#"<mujoco><worldbody><body><joint name="j" type="slide"/><geom size="0.1"/></body></worldbody>
               <actuator><motor joint="j"/></actuator></mujoco>"#,
        )
        .unwrap();
        let hopper = tasks::task("Hopper-v5").unwrap();
        let e = load_model_from(hopper, &dir).unwrap_err();
        assert!(e.to_string().contains("not the task's model"), "{e}");
        let e = load_model_from(tasks::task("Ant-v5").unwrap(), &dir).unwrap_err();
        assert!(e.to_string().contains("no such model file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// MuJoCo's warnings (here the deprecated `settotalmass`, which Gymnasium's
    /// half_cheetah.xml uses) go to stderr only: no `MUJOCO_LOG.TXT` grows in the working
    /// folder.
    #[test]
    fn warnings_write_no_log_file_in_the_working_folder() {
        let dir = std::env::temp_dir().join(format!("shmbridge-mujoco-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("model.xml");
        std::fs::write(
            &model,
            r#"<mujoco><compiler settotalmass="2"/><worldbody><body><joint name="j" type="slide"/><geom size="0.1"/></body></worldbody>
               <actuator><motor joint="j"/></actuator></mujoco>"#,
        )
        .unwrap();
        let log = std::env::current_dir().unwrap().join("MUJOCO_LOG.TXT");
        let size = || std::fs::metadata(&log).map_or(0, |m| m.len());
        let before = size();
        load_model_file(&tasks::RAW, &model).unwrap();
        assert_eq!(size(), before, "{} grew", log.display());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `max_episode_steps` sets any task's truncation; `mujoco/raw` is listed among the
    /// known names and refused without a model file.
    #[test]
    fn max_episode_steps_sets_the_truncation_and_raw_needs_a_model() {
        let options = EnvOptions {
            max_episode_steps: Some(5),
            ..Default::default()
        };
        assert_eq!(task_of("mujoco/Hopper-v5", &options).unwrap().max_steps, 5);
        let hopper = task_of("mujoco/Hopper-v5", &EnvOptions::default()).unwrap();
        assert_eq!(hopper.max_steps, 1000);
        let raw = task_of("mujoco/raw", &EnvOptions::default()).unwrap();
        assert_eq!(raw.max_steps, tasks::RAW_MAX_STEPS);
        let e = load_model(&raw, &EnvOptions::default()).unwrap_err();
        assert!(e.to_string().contains("no model file"), "{e}");
        let e = task_of("mujoco/Nope-v0", &options).unwrap_err();
        assert!(e.to_string().contains("mujoco/raw"), "{e}");
    }
}
