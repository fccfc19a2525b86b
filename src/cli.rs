//! The `shmbridge` command line: serve a reference engine, drive it with a random-policy
//! client, and list, inspect or clean up regions. One implementation for every front
//! door: the `shmbridge` binary (`src/bin/shmbridge.rs`) and the Python package's
//! `shmbridge` command and `python -m shmbridge` both call [`run`].

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use rand::RngExt;
use rand_pcg::Pcg32;

use crate::client::Interrupt;
use crate::control::{ClientState, EngineState};
use crate::device::{CudaSharingRequest, DeviceRequest};
use crate::envs::{self, EnvOptions};
use crate::layout::{self, Header};
use crate::region;
use crate::{AttachOptions, Client, DType, Error, WaitPolicy};

/// Exit status of a run stopped by its [`Invocation::interrupt`] (as for SIGINT).
pub const INTERRUPTED: u8 = 130;

/// What the CLI needs from the program that runs it.
#[derive(Default, Clone)]
pub struct Invocation {
    /// The command that runs this same CLI (program, then leading arguments):
    /// `client --launch` starts its `engine` with it. `None`: this executable.
    pub self_command: Option<Vec<OsString>>,
    /// Consulted while `client` steps (between steps, and in its waits) and stops it
    /// with its error. The binary has none: SIGINT ends it. The Python package checks
    /// for signals here, as its interpreter keeps SIGINT to itself.
    pub interrupt: Option<Interrupt>,
}

/// Parses `args` (the program name first) as [`run`] would, and runs nothing: `Err` with
/// the parser's message (bounds of every number, the image shape, the spin budget). What
/// a launcher checks before it starts a process.
pub fn check_args<I, T>(args: I) -> std::result::Result<(), String>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match Cli::try_parse_from(args) {
        Ok(_) => Ok(()),
        // The first line says what is wrong; the rest is usage and a pointer to --help.
        Err(e) => {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or_default();
            Err(first.strip_prefix("error: ").unwrap_or(first).to_string())
        }
    }
}

/// Parses `args` (the program name first, as `std::env::args_os` gives them) and runs
/// the command; returns the exit status. Errors are reported on stderr
/// (`shmbridge: error: ...`); `--help` and `--version` print on stdout.
pub fn run<I, T>(args: I, invocation: &Invocation) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(2);
        }
    };
    let result = match cli.command {
        Cmd::Engine(a) => run_engine(a),
        Cmd::Client(a) => run_client(a, invocation),
        Cmd::Ls => run_ls(),
        Cmd::Inspect { name } => run_inspect(&name),
        Cmd::Gc => run_gc(),
        Cmd::View { .. } => {
            // Reached only where the Python package is not in front (the bare binary):
            // its `shmbridge` command routes `view` to `shmbridge.view` before this parser.
            eprintln!(
                "shmbridge: view is served by the Python package: pip install 'shmbridge[view]', \
                 then run `shmbridge view NAME` (or `python -m shmbridge view NAME`)"
            );
            return 2;
        }
    };
    match result {
        Ok(()) => 0,
        Err(Error::Interrupted) => INTERRUPTED,
        Err(e) => {
            eprintln!("shmbridge: error: {e}");
            1
        }
    }
}

#[derive(Parser)]
#[command(
    name = "shmbridge",
    version,
    about = "Zero-copy shared-memory bridge between a simulator and a learner"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve a reference engine: prints the region name on stdout, then serves until the
    /// client closes.
    Engine(EngineArgs),
    /// Attach (or launch an engine and attach) and step it with a random policy; prints
    /// steps/s and, for cartpole, the mean episode return.
    Client(ClientArgs),
    /// List the regions of this region namespace (SHMBRIDGE_NAMESPACE; unset: all).
    Ls,
    /// Print a region's whole header and tensor table.
    Inspect { name: String },
    /// Remove the regions of this region namespace whose engine is dead.
    Gc,
    /// Serve a page on 127.0.0.1 that shows a running engine live: its frames, episode
    /// returns and step rate, read-only (the Python package's `shmbridge view NAME`;
    /// needs `pip install 'shmbridge[view]'`; `shmbridge view --help` lists its options).
    View {
        /// The region name, then the viewer's options.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

#[derive(Args, Clone)]
struct EngineArgs {
    /// Reference env (`envs::REFERENCE_ENGINES`, listed by `reference_envs_help`).
    #[arg(long, default_value = "cartpole", help = reference_envs_help())]
    env: String,
    #[arg(long, default_value_t = 256)]
    num_envs: u32,
    /// Region name (default: random).
    #[arg(long)]
    name: Option<String>,
    /// null: observation size per env, in f32 elements.
    #[arg(long)]
    obs_dim: Option<u64>,
    /// null: action size per env, in f32 elements.
    #[arg(long)]
    act_dim: Option<u64>,
    /// null: write only the first and last element of each tensor per step.
    #[arg(long)]
    sparse: bool,
    /// null: also serve `rgb`, u8 of shape (num_envs, H, W, C), e.g. 84x84x3. pixels: the
    /// frame shape, HxWxC with C 4 (RGBA), 3 (RGB) or 1 (grey) (default 84x84x4).
    #[arg(long, value_name = "HxWxC", value_parser = parse_image)]
    image: Option<[u64; 3]>,
    /// pixels: frames per env in `rgb` (num_envs, K, H, W, C), oldest first; a new
    /// episode's stack holds only its own frames (default 2).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..=16))]
    frame_stack: Option<u32>,
    /// Where `rgb` lives: host (in the region, with the other tensors; null's default)
    /// or vulkan (exported Vulkan memory the client imports; needs the `vulkan` feature
    /// and a Vulkan driver; pixels' default, drawn by its compute shader).
    #[arg(long, value_parser = ["host", "vulkan"])]
    image_device: Option<String>,
    /// mujoco/<Task>: threads that step a shard's envs, each a contiguous slice (default 1).
    #[arg(long, value_name = "T", value_parser = clap::value_parser!(u32).range(1..=i64::from(envs::MAX_THREADS)))]
    threads: Option<u32>,
    /// mujoco/<Task>: serve `rgb`, uint8 (num_envs, H, W, 3): each env's view through
    /// this named camera of the model, rendered by MuJoCo (docs/mujoco.md).
    #[arg(long, value_name = "NAME")]
    camera: Option<String>,
    /// mujoco/<Task>: the camera's image size (default 84x84).
    #[arg(long, value_name = "HxW", value_parser = parse_camera_size)]
    camera_size: Option<[u64; 2]>,
    /// mujoco/<Task>: also serve `depth`, float32 (num_envs, H, W): the camera's depth
    /// image in metres, as mujoco.Renderer's depth rendering gives it (docs/mujoco.md).
    #[arg(long)]
    camera_depth: bool,
    /// mujoco/raw: the MJCF file to serve as a task (observation qpos, qvel and
    /// sensordata; reward 0; action ctrl; docs/mujoco.md).
    #[arg(long, value_name = "PATH")]
    model: Option<String>,
    /// mujoco/raw: a shared library exporting shmbridge_mujoco_reward, called after each
    /// env's step for its reward and termination (docs/mujoco.md).
    #[arg(long, value_name = "PATH")]
    reward_lib: Option<String>,
    /// mujoco/<Task>: truncate episodes after this many steps (default 1000).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_episode_steps: Option<u32>,
    /// cartpole, pixels: seed of the per-env random streams.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    wait: WaitArgs,
    /// Give up after this many seconds without an action from the client.
    #[arg(long, default_value = "3600", value_parser = parse_seconds)]
    idle_timeout: Duration,
    /// Where the tensors live: cpu, cuda, cuda:N, or auto (CUDA device 0 when usable,
    /// else host memory; the choice is logged on stderr).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: DeviceRequest,
    /// How CUDA tensors are shared (protocol 1.9): ipc (CUDA IPC handles: a learner in
    /// this PID namespace), fd (the allocation's file descriptor over the region's fd
    /// socket: also a learner in another container), or auto (fd in a container where
    /// the GPU can, else ipc).
    #[arg(long, default_value = "auto", value_parser = CudaSharingRequest::parse)]
    cuda_sharing: CudaSharingRequest,
    /// Serve shard k of a region split over K processes (protocol 1.4), e.g. 0/4: shard
    /// 0 creates the region named by --name, the others join it; every shard is started
    /// with the same --env, --num-envs and options. Host memory only.
    #[arg(long, value_name = "k/K", value_parser = parse_shard, default_value = "0/1")]
    shard: (u32, u32),
}

/// `--env`'s help: every entry of the registry of reference engines, with what it is.
fn reference_envs_help() -> String {
    let entries: Vec<String> = envs::REFERENCE_ENGINES
        .iter()
        .map(|e| format!("{} ({})", e.name, e.description))
        .collect();
    format!("Reference env: {}", entries.join("; "))
}

fn parse_shard(text: &str) -> Result<(u32, u32), String> {
    let bad = || format!("'{text}': expected k/K with 0 <= k < K, e.g. 0/4");
    let (k, count) = text.split_once('/').ok_or_else(bad)?;
    let (k, count): (u32, u32) = (
        k.trim().parse().map_err(|_| bad())?,
        count.trim().parse().map_err(|_| bad())?,
    );
    if count == 0 || k >= count {
        return Err(bad());
    }
    Ok((k, count))
}

#[derive(Args, Clone)]
struct WaitArgs {
    /// Spin budget in microseconds before sleeping (fractions allowed). Default: 100,
    /// grown up to 2000 while the waits of the last steps were that long; a value given
    /// here is kept as given.
    #[arg(long, value_parser = parse_micros)]
    spin_us: Option<f64>,
    /// Never spin: sleep at once (lowest CPU use).
    #[arg(long)]
    blocking: bool,
}

impl WaitArgs {
    fn policy(&self) -> WaitPolicy {
        match (self.blocking, self.spin_us) {
            (true, _) => WaitPolicy::BLOCKING,
            (false, None) => WaitPolicy::default(),
            // `parse_micros` keeps it finite and non-negative; `spinning` caps it.
            (false, Some(us)) => {
                WaitPolicy::spinning(Duration::try_from_secs_f64(us / 1e6).unwrap_or(Duration::MAX))
            }
        }
    }
}

#[derive(Args)]
struct ClientArgs {
    /// Region to attach to; omit with --launch.
    name: Option<String>,
    /// Launch this reference env as a child process and attach to it.
    #[arg(long)]
    launch: Option<String>,
    #[arg(long, default_value_t = 256)]
    num_envs: u32,
    #[arg(long, default_value_t = 100_000)]
    steps: u64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seconds to wait for each frame.
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    timeout: Duration,
    #[command(flatten)]
    wait: WaitArgs,
}

fn parse_device(text: &str) -> Result<DeviceRequest, String> {
    DeviceRequest::parse(text).map_err(|e| e.to_string())
}

/// A non-negative number of seconds (a negative or NaN one would panic `Duration`).
fn parse_seconds(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text.parse().map_err(|e| format!("{e}"))?;
    if seconds.is_nan() || seconds < 0.0 {
        return Err(format!("{text}: expected a non-negative number of seconds"));
    }
    Ok(Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX))
}

/// A non-negative, finite number of microseconds.
fn parse_micros(text: &str) -> Result<f64, String> {
    let micros: f64 = text.parse().map_err(|e| format!("{e}"))?;
    if !micros.is_finite() || micros < 0.0 {
        return Err(format!(
            "{text}: expected a non-negative number of microseconds"
        ));
    }
    Ok(micros)
}

fn parse_image(text: &str) -> Result<[u64; 3], String> {
    envs::parse_image_shape(text).map_err(|e| e.to_string())
}

fn parse_camera_size(text: &str) -> Result<[u64; 2], String> {
    envs::parse_camera_size(text).map_err(|e| e.to_string())
}

fn run_engine(a: EngineArgs) -> Result<(), Error> {
    let steps = envs::run_reference(&envs::ReferenceEngine {
        env: a.env,
        num_envs: a.num_envs,
        name: a.name,
        options: EnvOptions {
            obs_dim: a.obs_dim,
            act_dim: a.act_dim,
            sparse: a.sparse,
            seed: a.seed,
            image: a.image,
            frame_stack: a.frame_stack,
            threads: a.threads,
            camera: a.camera,
            camera_size: a.camera_size,
            camera_depth: a.camera_depth,
            model: a.model,
            reward_lib: a.reward_lib,
            max_episode_steps: a.max_episode_steps,
            image_device: a.image_device.as_deref().map(|d| match d {
                "vulkan" => crate::device::Device::Vulkan(crate::device::VulkanDevice::ANY),
                _ => crate::device::Device::Host,
            }),
            first_env: 0,
        },
        policy: a.wait.policy(),
        idle_timeout: a.idle_timeout,
        device: a.device,
        cuda_sharing: a.cuda_sharing,
        shard: a.shard,
    })?;
    eprintln!("shmbridge: client closed after {steps} steps");
    Ok(())
}

/// Starts `shmbridge engine` as a child (with `self_command`, else this executable) and
/// reads the region name it prints.
fn launch(
    self_command: Option<&[OsString]>,
    env: &str,
    num_envs: u32,
    seed: u64,
    wait: &WaitArgs,
) -> Result<(std::process::Child, String), Error> {
    let mut cmd = match self_command {
        Some([program, args @ ..]) => {
            let mut cmd = Command::new(program);
            cmd.args(args);
            cmd
        }
        _ => Command::new(std::env::current_exe().map_err(|e| Error::Io {
            context: "finding the shmbridge binary".into(),
            source: e,
        })?),
    };
    cmd.args([
        "engine",
        "--env",
        env,
        "--num-envs",
        &num_envs.to_string(),
        "--seed",
        &seed.to_string(),
    ]);
    if let Some(us) = wait.spin_us {
        cmd.args(["--spin-us", &us.to_string()]);
    }
    if wait.blocking {
        cmd.arg("--blocking");
    }
    cmd.stdout(Stdio::piped());
    // The one spawning path: the engine gets SIGTERM if this client dies (or dies
    // before it starts), so no engine outlives it.
    let mut child = crate::launch::spawn_engine(cmd, false)?;
    let mut line = String::new();
    let stdout = child.stdout.take().expect("piped");
    let read = BufReader::new(stdout).read_line(&mut line);
    let name = line.trim();
    let failure = match read {
        // End of its output: it exited (or closed stdout) without serving. Its stderr is
        // this process's, so its own reason is printed just above.
        Ok(0) => {
            let how = match child.wait() {
                Ok(status) if status.code().is_some() => {
                    format!("exited before serving ({status}); its error is above")
                }
                Ok(status) => format!("was killed before serving ({status})"),
                Err(e) => format!("ended before serving (its status unknown: {e})"),
            };
            std::io::Error::other(how)
        }
        Ok(_) if name.is_empty() => {
            std::io::Error::other("printed an empty line where its region name belongs")
        }
        Ok(_) => return Ok((child, name.to_string())),
        Err(e) => e,
    };
    // Still running (an empty line, a read error): stopped and reaped, not left behind.
    if child.try_wait().map_or(true, |s| s.is_none()) {
        crate::os::terminate(child.id());
        let _ = child.wait();
    }
    Err(Error::io("the launched engine", failure))
}

fn run_client(a: ClientArgs, invocation: &Invocation) -> Result<(), Error> {
    let (child, name) = match (&a.launch, &a.name) {
        (Some(env), None) => {
            let self_command = invocation.self_command.as_deref();
            let (c, n) = launch(self_command, env, a.num_envs, a.seed, &a.wait)?;
            (Some(c), n)
        }
        (None, Some(n)) => (None, n.clone()),
        _ => {
            return Err(Error::InvalidSpec(
                "give a region name or --launch ENV, not both".into(),
            ))
        }
    };
    let options = AttachOptions::default()
        .policy(a.wait.policy())
        .interrupt(invocation.interrupt.clone());
    let mut client = match Client::attach(&name, options) {
        Ok(c) => c,
        Err(e) => {
            // A launched engine would otherwise serve no one until its idle timeout:
            // SIGTERM (it closes and removes its region), then reap it.
            if let Some(mut c) = child {
                crate::os::terminate(c.id());
                let _ = c.wait();
            }
            return Err(e);
        }
    };
    let result = drive(&mut client, &a, invocation.interrupt.as_ref());
    // Also after an error or an interrupt: a launched engine exits once the client
    // closes, and is waited for.
    client.close();
    if let Some(mut c) = child {
        let _ = c.wait();
    }
    print!("{}", result?);
    Ok(())
}

/// How often, at most, the stepping loop consults the interrupt hook: a step that
/// completes on the fast path never does.
const INTERRUPT_CHECK: Duration = Duration::from_millis(50);

/// Steps `client` `a.steps` times with random actions; returns the report to print.
fn drive(
    client: &mut Client,
    a: &ClientArgs,
    interrupt: Option<&Interrupt>,
) -> Result<String, Error> {
    // The header is the engine's word: every tensor this loop indexes per env must agree
    // with its num_envs, and the per-env returns are allocated fallibly.
    let layout = client.layout();
    let n = client.num_envs();
    let kind = layout.engine_kind.clone();
    let act = layout.per_env_tensor("actions", None)?.clone();
    for name in ["rewards", "terminated", "truncated"] {
        layout.per_env_tensor(name, Some(1))?;
    }
    let mut running: Vec<f64> = Vec::new();
    running
        .try_reserve_exact(n)
        .map_err(|_| Error::InvalidSpec(format!("no memory for the returns of {n} envs")))?;
    running.resize(n, 0.0);
    let mut rng = Pcg32::new(a.seed ^ 0x5eed, 1);
    let (mut episodes, mut return_sum) = (0u64, 0f64);
    let timeout = a.timeout;
    let t0 = Instant::now();
    let mut checked = t0;
    for _ in 0..a.steps {
        if let Some(interrupt) = interrupt {
            if checked.elapsed() >= INTERRUPT_CHECK {
                interrupt()?;
                checked = Instant::now();
            }
        }
        {
            let mut io = client.tensors();
            match act.dtype {
                DType::I64 => io
                    .write::<i64>("actions")?
                    .iter_mut()
                    .for_each(|x| *x = rng.random_range(0..2)),
                DType::F32 => io
                    .write::<f32>("actions")?
                    .iter_mut()
                    .for_each(|x| *x = rng.random_range(-1.0..1.0)),
                other => {
                    return Err(Error::InvalidSpec(format!(
                        "random policy: actions of dtype {other}"
                    )))
                }
            }
        }
        client.step(timeout)?;
        let mut io = client.tensors();
        let rewards = io.read::<f32>("rewards")?;
        let term = io.read::<u8>("terminated")?;
        let trunc = io.read::<u8>("truncated")?;
        let dones = term.iter().zip(trunc).map(|(&a, &b)| a != 0 || b != 0);
        for ((ret, &r), done) in running.iter_mut().zip(rewards).zip(dones) {
            *ret += f64::from(r);
            if done {
                episodes += 1;
                return_sum += *ret;
                *ret = 0.0;
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let mut report = format!(
        "{kind}: {} steps x {n} envs in {secs:.2} s: {:.0} steps/s, {:.0} env-steps/s\n",
        a.steps,
        a.steps as f64 / secs,
        a.steps as f64 * n as f64 / secs
    );
    if episodes > 0 {
        report += &format!(
            "random policy: {episodes} episodes, mean return {:.1}\n",
            return_sum / episodes as f64
        );
    }
    Ok(report)
}

/// A region's header as `ls` and `inspect` show it, read with `pread` (a file that
/// shrinks meanwhile is a short read, never a SIGBUS), and its validation.
fn describe(name: &str) -> Result<(Header, Result<layout::Layout, Error>), Error> {
    let (h, l, _) = describe_with_bytes(name)?;
    Ok((h, l))
}

/// A header, its validation, and the bytes they were read from.
type Described = (Header, Result<layout::Layout, Error>, Vec<u8>);

/// [`describe`], with the header bytes it read.
fn describe_with_bytes(name: &str) -> Result<Described, Error> {
    let (bytes, size) = region::read_header_bytes(name)?;
    let h = layout::read_header(&bytes)?;
    let l = layout::validate(name, &bytes, size);
    Ok((h, l, bytes))
}

/// A little-endian word of `N` bytes at `offset` of the header bytes `inspect` read, if
/// they reach that far.
fn word<const N: usize>(bytes: &[u8], offset: usize) -> Option<[u8; N]> {
    bytes.get(offset..offset.checked_add(N)?)?.try_into().ok()
}

/// `text` as a terminal shows it safely: control characters (a newline, an escape
/// sequence's ESC), Unicode's bidirectional overrides and backslashes escaped
/// (`\n`, `\u{1b}`, `\\`). Names in /dev/shm are anyone's to choose: one with a newline
/// would forge a line of `gc`'s report, one with escape sequences would drive the
/// terminal of whoever runs `ls`.
fn shown(text: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| {
        c.is_control()
            || c == '\\'
            || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !text.chars().any(unsafe_char) {
        return text.into();
    }
    text.chars()
        .map(|c| match c {
            c if unsafe_char(c) => c.escape_default().to_string(),
            c => c.to_string(),
        })
        .collect::<String>()
        .into()
}

fn run_ls() -> Result<(), Error> {
    println!(
        "{:<45} {:>8} {:>8} {:<8} {:<9} {:>8} {:<10} tensors",
        "name", "engine", "client", "state", "client", "num_envs", "kind"
    );
    for name in region::list_names()? {
        // A trajectory stream (1.11) beside the regions: its own line.
        if let Some(line) = stream_line(&name) {
            println!("{}", shown(&line));
            continue;
        }
        match describe(&name) {
            Ok((h, Ok(l))) => {
                // `gc` removes a region whose engine no longer holds its lock.
                let state = match region::engine_alive(&name) {
                    Ok(false) => "dead",
                    _ => EngineState::from_code(h.engine_state).name(),
                };
                let tensors: Vec<String> = l
                    .tensors
                    .iter()
                    .map(|t| format!("{}{:?}:{}", t.name, t.shape, t.dtype))
                    .collect();
                let line = format!(
                    "{:<45} {:>8} {:>8} {:<8} {:<9} {:>8} {:<10} {}",
                    name,
                    h.engine_pid,
                    h.client_pid,
                    state,
                    ClientState::from_code(h.client_state).name(),
                    h.num_envs,
                    l.engine_kind,
                    tensors.join(" ")
                );
                println!("{}", shown(&line));
            }
            Ok((_, Err(e))) | Err(e) => {
                println!("{}", shown(&format!("{name:<45} (unreadable: {e})")))
            }
        }
    }
    Ok(())
}

/// `ls`'s line for `name` if it is a stream: its consumers, its lanes, the records
/// waiting and its schema. `None` for anything else.
fn stream_line(name: &str) -> Option<String> {
    let (bytes, size) = region::read_header_bytes(name).ok()?;
    if !layout::stream::is_stream(&bytes) {
        return None;
    }
    let what = match layout::stream::StreamLayout::validate(name, &bytes, size) {
        Err(e) => format!("(unreadable: {e})"),
        Ok(l) => match crate::stream::stats(name) {
            Err(e) => format!("(unreadable: {e})"),
            Ok(s) => {
                let live = s.ranks.iter().filter(|r| r.state == 1).count();
                let producers = s.lanes.iter().filter(|l| l.producer_pid != 0).count();
                format!(
                    "stream: {live}/{} ranks, {producers}/{} producers, {} records waiting ({} bytes), {} full waits, {} lost; {}",
                    l.ranks, l.lanes, s.depth, s.bytes_in_use, s.full_waits, s.records_lost, l.schema
                )
            }
        },
    };
    Some(format!("{name:<45} {what}"))
}

fn run_inspect(name: &str) -> Result<(), Error> {
    let name = region::canonical_name(name)?;
    let (h, l, bytes) = describe_with_bytes(&name)?;
    println!("region        {name}");
    println!(
        "magic         {:#018x} ({})",
        h.magic,
        if h.magic == layout::MAGIC {
            "ok"
        } else {
            "BAD"
        }
    );
    // A region's `version_minor` is the oldest minor whose bytes it is (an unsharded host
    // region is written as 1.3 by every later engine, docs/protocol.md §8); the protocol
    // is what this shmbridge speaks, and the region's own when its 1.7 flag is set.
    println!(
        "version       {}.{} (the header's bytes{})",
        h.version_major,
        h.version_minor,
        if h.flags & layout::FLAG_OBSERVABLE != 0 {
            format!(
                "; written by a protocol {}.{}+ engine: observable",
                layout::VERSION_MAJOR,
                layout::VERSION_MINOR_OBSERVERS
            )
        } else {
            String::new()
        }
    );
    println!(
        "protocol      {}.{} (this shmbridge {})",
        layout::VERSION_MAJOR,
        layout::VERSION_MINOR,
        env!("CARGO_PKG_VERSION")
    );
    println!(
        "layout_hash   {:#018x} ({})",
        h.layout_hash,
        if h.layout_hash == layout::layout_hash_for(h.shard_count, h.version_minor) {
            "ok"
        } else {
            "differs"
        }
    );
    println!("header_size   {}", h.header_size);
    println!("region_size   {}", h.region_size);
    println!("num_envs      {}", h.num_envs);
    println!("tensor_count  {}", h.tensor_count);
    println!(
        "engine        pid {} start {} state {}",
        h.engine_pid,
        h.engine_start_time,
        EngineState::from_code(h.engine_state).name()
    );
    println!(
        "client        pid {} start {} state {}",
        h.client_pid,
        h.client_start_time,
        ClientState::from_code(h.client_state).name()
    );
    println!(
        "c2e ring      offset {} capacity {} head {} tail {} waiting consumer {} producer {}",
        h.c2e_ring_offset,
        h.c2e_ring_capacity,
        h.c2e_head,
        h.c2e_tail,
        h.c2e_consumer_waiting,
        h.c2e_producer_waiting
    );
    println!(
        "e2c ring      offset {} capacity {} head {} tail {} waiting consumer {} producer {}",
        h.e2c_ring_offset,
        h.e2c_ring_capacity,
        h.e2c_head,
        h.e2c_tail,
        h.e2c_consumer_waiting,
        h.e2c_producer_waiting
    );
    println!("doorbell      {}", h.engine_doorbell);
    println!("action_seq    {}", h.action_seq);
    println!("frame_seq     {}", h.frame_seq);
    println!(
        "waiting       engine {} client {}",
        h.engine_waiting, h.client_waiting
    );
    match l {
        Ok(l) => {
            println!("engine kind   {}", l.engine_kind);
            if l.is_sharded() {
                // 1.4: each shard's live words, as of the `pread` above (the shard table
                // is part of the header): never through a mapping, which a file
                // shrinking meanwhile would turn into a SIGBUS.
                for s in &l.shards {
                    let w = &s.words;
                    let u32_at = |o| word::<4>(&bytes, o).map(u32::from_le_bytes);
                    let u64_at = |o| word::<8>(&bytes, o).map(u64::from_le_bytes);
                    let text = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
                    // 1.10: the shard's own action (an asynchronous client's), pending
                    // while above its frame_seq.
                    let action = if l.shard_actions {
                        format!(" action_seq {}", text(u64_at(w.action_seq)))
                    } else {
                        String::new()
                    };
                    println!(
                        "shard {:<7} envs {}..{} pid {} start {} state {} frame_seq {}{action}",
                        s.index,
                        s.env_start,
                        s.env_start + s.env_count,
                        text(u32_at(w.pid).map(u64::from)),
                        text(u64_at(w.start_time)),
                        u32_at(w.state).map_or("?", |c| EngineState::from_code(c).name()),
                        text(u64_at(w.frame_seq)),
                    );
                }
            }
            println!(
                "{:<16} {:<6} {:<20} {:<15} {:<6} {:>10} {:>10}",
                "tensor", "dtype", "shape", "direction", "where", "offset", "bytes"
            );
            for t in &l.tensors {
                println!(
                    "{:<16} {:<6} {:<20} {:<15} {:<6} {:>10} {:>10}",
                    t.name,
                    t.dtype.name(),
                    format!("{:?}", t.shape),
                    t.direction.arrow(),
                    t.location().name(),
                    t.offset,
                    t.nbytes
                );
                if let Some(line) = t.export_fields() {
                    println!("{:<16} {line}", "");
                }
            }
        }
        Err(e) => println!("validation    FAILED: {e}"),
    }
    Ok(())
}

fn run_gc() -> Result<(), Error> {
    let swept = region::sweep_report()?;
    for s in &swept {
        let what = if s.removed() { "removed" } else { "left" };
        println!(
            "{}",
            shown(&format!("{what:<8} {:<45} {}", s.name, s.verdict))
        );
    }
    let removed = swept.iter().filter(|s| s.removed()).count();
    let sockets = swept
        .iter()
        .filter(|s| s.verdict == region::Verdict::OrphanSocket)
        .count();
    let and_sockets = match sockets {
        0 => String::new(),
        n => format!(" (and {n} fd socket(s) whose region was gone)"),
    };
    println!(
        "{} stale region(s) removed{and_sockets}, {} left",
        removed - sockets,
        swept.len() - removed
    );
    Ok(())
}
