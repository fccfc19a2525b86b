//! `shmbridge`: serve a reference engine, drive it with a random-policy client, and list,
//! inspect or clean up regions.

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use rand::RngExt;
use rand_pcg::Pcg32;

use shmbridge::control::{ClientState, EngineState};
use shmbridge::device::DeviceRequest;
use shmbridge::envs::{self, EnvOptions};
use shmbridge::layout::{self, Header};
use shmbridge::region::{self, Region};
use shmbridge::{AttachOptions, Client, DType, Error, WaitPolicy};

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
    /// List live regions.
    Ls,
    /// Print a region's whole header and tensor table.
    Inspect { name: String },
    /// Remove regions whose engine is dead.
    Gc,
}

#[derive(Args, Clone)]
struct EngineArgs {
    /// Reference env: null or cartpole.
    #[arg(long, default_value = "cartpole")]
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
    /// null: also serve `rgb`, u8 of shape (num_envs, H, W, C), e.g. 84x84x3.
    #[arg(long, value_name = "HxWxC", value_parser = parse_image)]
    image: Option<[u64; 3]>,
    /// null: where `rgb` lives: host (with the other tensors) or vulkan (exported Vulkan
    /// memory the client imports; needs the `vulkan` feature and a Vulkan driver).
    #[arg(long, default_value = "host", value_parser = ["host", "vulkan"])]
    image_device: String,
    /// cartpole: seed of the per-env random streams.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    wait: WaitArgs,
    /// Give up after this many seconds without an action from the client.
    #[arg(long, default_value_t = 3600.0)]
    idle_timeout: f64,
    /// Where the tensors live: cpu, cuda, cuda:N, or auto (CUDA device 0 when usable,
    /// else host memory; the choice is logged on stderr).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: DeviceRequest,
}

#[derive(Args, Clone)]
struct WaitArgs {
    /// Spin budget in microseconds before sleeping.
    #[arg(long, default_value_t = WaitPolicy::DEFAULT_SPIN.as_micros() as u64)]
    spin_us: u64,
    /// Never spin: sleep at once (lowest CPU use).
    #[arg(long)]
    blocking: bool,
}

impl WaitArgs {
    fn policy(&self) -> WaitPolicy {
        if self.blocking {
            WaitPolicy::BLOCKING
        } else {
            WaitPolicy::spinning(Duration::from_micros(self.spin_us))
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
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    #[command(flatten)]
    wait: WaitArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Engine(a) => run_engine(a),
        Cmd::Client(a) => run_client(a),
        Cmd::Ls => run_ls(),
        Cmd::Inspect { name } => run_inspect(&name),
        Cmd::Gc => run_gc(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shmbridge: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parse_device(text: &str) -> Result<DeviceRequest, String> {
    DeviceRequest::parse(text).map_err(|e| e.to_string())
}

fn parse_image(text: &str) -> Result<[u64; 3], String> {
    envs::parse_image_shape(text).map_err(|e| e.to_string())
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
            image_device: (a.image_device == "vulkan").then_some(
                shmbridge::device::Device::Vulkan(shmbridge::device::VulkanDevice::ANY),
            ),
        },
        policy: a.wait.policy(),
        idle_timeout: Duration::from_secs_f64(a.idle_timeout),
        device: a.device,
    })?;
    eprintln!("shmbridge: client closed after {steps} steps");
    Ok(())
}

/// Starts `shmbridge engine` as a child and reads the region name it prints.
fn launch(
    env: &str,
    num_envs: u32,
    seed: u64,
    wait: &WaitArgs,
) -> Result<(std::process::Child, String), Error> {
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        context: "finding the shmbridge binary".into(),
        source: e,
    })?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "engine",
        "--env",
        env,
        "--num-envs",
        &num_envs.to_string(),
        "--seed",
        &seed.to_string(),
    ]);
    cmd.args(["--spin-us", &wait.spin_us.to_string()]);
    if wait.blocking {
        cmd.arg("--blocking");
    }
    let mut child = cmd.stdout(Stdio::piped()).spawn().map_err(|e| Error::Io {
        context: "starting the engine".into(),
        source: e,
    })?;
    let mut line = String::new();
    let stdout = child.stdout.take().expect("piped");
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| Error::Io {
            context: "reading the engine's region name".into(),
            source: e,
        })?;
    if line.trim().is_empty() {
        let status = child.wait().ok();
        return Err(Error::InvalidSpec(format!(
            "the engine exited before serving ({status:?})"
        )));
    }
    Ok((child, line.trim().to_string()))
}

fn run_client(a: ClientArgs) -> Result<(), Error> {
    let (child, name) = match (&a.launch, &a.name) {
        (Some(env), None) => {
            let (c, n) = launch(env, a.num_envs, a.seed, &a.wait)?;
            (Some(c), n)
        }
        (None, Some(n)) => (None, n.clone()),
        _ => {
            return Err(Error::InvalidSpec(
                "give a region name or --launch ENV, not both".into(),
            ))
        }
    };
    let mut client = Client::attach(&name, AttachOptions::default().policy(a.wait.policy()))?;
    let n = client.num_envs();
    let kind = client.layout().engine_kind.clone();
    let act = client.layout().tensor("actions")?.1.clone();
    let mut rng = Pcg32::new(a.seed ^ 0x5eed, 1);
    let mut running = vec![0f64; n];
    let (mut episodes, mut return_sum) = (0u64, 0f64);
    let timeout = Duration::from_secs_f64(a.timeout);
    let t0 = Instant::now();
    for _ in 0..a.steps {
        {
            let mut io = client.io();
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
        let mut io = client.io();
        let rewards = io.read::<f32>("rewards")?;
        let term = io.read::<u8>("terminated")?;
        let trunc = io.read::<u8>("truncated")?;
        for i in 0..n {
            running[i] += rewards[i] as f64;
            if term[i] != 0 || trunc[i] != 0 {
                episodes += 1;
                return_sum += running[i];
                running[i] = 0.0;
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    client.close();
    if let Some(mut c) = child {
        let _ = c.wait();
    }
    println!(
        "{kind}: {} steps x {n} envs in {secs:.2} s: {:.0} steps/s, {:.0} env-steps/s",
        a.steps,
        a.steps as f64 / secs,
        (a.steps * n as u64) as f64 / secs
    );
    if episodes > 0 {
        println!(
            "random policy: {episodes} episodes, mean return {:.1}",
            return_sum / episodes as f64
        );
    }
    Ok(())
}

fn describe(name: &str) -> Result<(Header, Result<layout::Layout, Error>), Error> {
    let r = Region::open_read_only(name)?;
    let snap = r.snapshot();
    let h = layout::read_header(&snap)?;
    let l = layout::validate(name, &snap, r.len() as u64);
    Ok((h, l))
}

fn run_ls() -> Result<(), Error> {
    println!(
        "{:<45} {:>8} {:>8} {:<8} {:<9} {:>8} {:<10} tensors",
        "name", "engine", "client", "state", "client", "num_envs", "kind"
    );
    for name in region::list_names()? {
        match describe(&name) {
            Ok((h, Ok(l))) => {
                let tensors: Vec<String> = l
                    .tensors
                    .iter()
                    .map(|t| format!("{}{:?}:{}", t.name, t.shape, t.dtype))
                    .collect();
                println!(
                    "{:<45} {:>8} {:>8} {:<8} {:<9} {:>8} {:<10} {}",
                    name,
                    h.engine_pid,
                    h.client_pid,
                    EngineState::from_code(h.engine_state).name(),
                    ClientState::from_code(h.client_state).name(),
                    h.num_envs,
                    l.engine_kind,
                    tensors.join(" ")
                );
            }
            Ok((_, Err(e))) | Err(e) => println!("{name:<45} (unreadable: {e})"),
        }
    }
    Ok(())
}

fn run_inspect(name: &str) -> Result<(), Error> {
    let name = region::canonical_name(name)?;
    let (h, l) = describe(&name)?;
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
    println!("version       {}.{}", h.version_major, h.version_minor);
    println!(
        "layout_hash   {:#018x} ({})",
        h.layout_hash,
        if h.layout_hash == layout::LAYOUT_HASH {
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
            }
        }
        Err(e) => println!("validation    FAILED: {e}"),
    }
    Ok(())
}

fn run_gc() -> Result<(), Error> {
    let removed = region::sweep()?;
    for n in &removed {
        println!("removed {n}");
    }
    println!("{} stale region(s) removed", removed.len());
    Ok(())
}
