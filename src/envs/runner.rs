//! The process that serves a reference engine (what `shmbridge engine` and Python's
//! `launch()` run): it builds the env and the engine (or joins a sharded region as one
//! shard), prints the region name once frame 0 is published, serves until the client
//! closes, and on SIGINT/SIGTERM closes the region (or its shard) before it exits.

use std::time::Duration;

use super::registry::{find, Entry};
use super::vec_env::{serve, EnvOptions, ServeEnd, VecEnv};
use crate::device::{CudaSharingRequest, Device, DeviceRequest};
use crate::engine::{Engine, EngineSpec};
use crate::error::{Error, Result};

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
    /// How CUDA tensors are shared ([`EngineSpec::cuda_sharing`]).
    pub cuda_sharing: CudaSharingRequest,
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
        let mut spec = spec.policy(r.policy).cuda_sharing(r.cuda_sharing);
        if let Some(d @ Device::Vulkan(_)) = r.options.image_device {
            spec = spec.place("rgb", d);
        }
        if let Some(n) = &r.name {
            spec = spec.name(n);
        }
        spec
    };
    let entry = find(&r.env)?;
    let build = |device| -> Result<(Box<dyn VecEnv>, Engine)> {
        if device == Device::Host {
            // The region (reserved in /dev/shm) before the env's state, which is as large.
            let engine = Engine::create(serving(entry.host_spec(r.num_envs, &r.options)?))?;
            let env = entry.build_on(r.num_envs, &r.options, device)?;
            return Ok((env, engine));
        }
        let env = entry.build_on(r.num_envs, &r.options, device)?;
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
    let signals = close_on_signal(engine.map_again()?, None);
    signals.after(serve_printing_name(
        &mut engine,
        env.as_mut(),
        r.idle_timeout,
        &r.env,
    ))
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
    let entry = find(&r.env)?;
    if r.device != DeviceRequest::Host || !serves_host_memory_only(entry, r)? {
        return Err(Error::InvalidSpec(
            "sharded engines serve host memory only (--device cpu, no --image-device vulkan; \
             pixels: --image-device host)"
                .into(),
        ));
    }
    let (first_env, envs) = crate::layout::env_slice(r.num_envs, count.min(r.num_envs), k);
    let options = EnvOptions {
        first_env,
        ..r.options.clone()
    };
    let mut env = entry.build_on(envs, &options, Device::Host)?;
    let mut engine = if k == 0 {
        Engine::create(shard_zero_spec(entry, r, name, count)?)?
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
    // Every shard builds its env from its own options (a model file, a task): one that
    // differs from the region's is refused (`serve_printing_name`).
    let who = format!("shard {k} of '{name}'");
    let signals = close_on_signal(engine.map_again()?, (k > 0).then_some(k));
    signals.after(serve_printing_name(
        &mut engine,
        env.as_mut(),
        r.idle_timeout,
        &who,
    ))
}

/// The spec of the region that shard 0 of `count` creates: the whole env's, `name`d,
/// without building the whole env (its state, threads and renderer beside the shard's).
fn shard_zero_spec(
    entry: &Entry,
    r: &ReferenceEngine,
    name: &str,
    count: u32,
) -> Result<EngineSpec> {
    let whole = entry.host_spec(r.num_envs, &r.options)?;
    Ok(whole.policy(r.policy).name(name).shards(count))
}

/// Whether a shard's env (`spec`, its envs only) has the region's tensors: the same
/// names, dtypes and per-env shapes (the first dimension is the envs).
fn same_tensors(
    spec: &EngineSpec,
    layout: &crate::layout::Layout,
) -> std::result::Result<(), String> {
    if spec.tensors.len() != layout.tensors.len() {
        return Err(format!(
            "{} tensors, the region has {}",
            spec.tensors.len(),
            layout.tensors.len()
        ));
    }
    for t in &spec.tensors {
        let Ok((_, have)) = layout.tensor(t.name.as_str()) else {
            return Err(format!("no tensor '{}' in the region", t.name));
        };
        if have.dtype != t.dtype || have.shape.get(1..) != t.shape.get(1..) {
            return Err(format!(
                "'{}' is {:?} {:?} per env here, {:?} {:?} in the region",
                t.name,
                t.dtype,
                t.shape.get(1..).unwrap_or_default(),
                have.dtype,
                have.shape.get(1..).unwrap_or_default()
            ));
        }
    }
    Ok(())
}

/// Whether `r`'s env, as its options place it, keeps every tensor in host memory (what
/// a sharded region serves): `pixels` draws into Vulkan memory unless `--image-device
/// host`, and `--image-device vulkan` moves any env's `rgb` there.
fn serves_host_memory_only(entry: &Entry, r: &ReferenceEngine) -> Result<bool> {
    let spec = entry.host_spec(r.num_envs, &r.options)?;
    let image_on_vulkan = matches!(r.options.image_device, Some(Device::Vulkan(_)));
    Ok(!image_on_vulkan && spec.tensors.iter().all(|t| t.device == Device::Host))
}

/// [`serve`], printing the region name on stdout once frame 0 is published (what a
/// launcher waits for); returns the steps served. An env (`who`) without the region's
/// tensors is refused first: it would write rows of another width into them and index
/// past their end. A shard's options may differ from the region's, and the host path
/// sizes the region from one load of a model file and builds the env from another.
fn serve_printing_name(
    engine: &mut Engine,
    env: &mut dyn VecEnv,
    idle: Duration,
    who: &str,
) -> Result<u64> {
    if let Err(why) = same_tensors(&env.spec(), engine.layout()) {
        return Err(Error::InvalidSpec(format!(
            "{who} does not serve the region's tensors ({why}): start every shard with the \
             same --env and options, and leave the model file unchanged while the engine starts"
        )));
    }
    let ServeEnd::ClientClosed { steps } = serve(engine, env, idle, |name| {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{name}");
        let _ = out.flush();
    })?;
    Ok(steps)
}

/// Orders the end of serving against a signal's handling: once a signal is being
/// handled, the process ends by that signal's status, never by the serving loop's own
/// end (the client that saw the region closed closes too, and the loop would report
/// "client closed" and exit 0 first).
struct SignalClose {
    /// Held by the signal's handler from the signal to `_exit`.
    handling: std::sync::Arc<std::sync::Mutex<()>>,
}

impl SignalClose {
    /// `result` of serving, unless a signal is being handled: then this waits for its
    /// handler, which ends the process.
    fn after<T>(self, result: Result<T>) -> Result<T> {
        drop(self.handling.lock().unwrap_or_else(|p| p.into_inner()));
        result
    }
}

/// On SIGINT/SIGTERM: close the region this engine serves (`own`, a second mapping of
/// it, never re-opened by name: the name may be another engine's by now) and remove its
/// name if still its own (the creator), or mark a joined shard closed (the name is the
/// creator's), so the client sees `PeerClosed` / `ShardClosed`; then exit with 128 + the
/// signal's number. Also once serving has ended (a signal during a slow close): the
/// region is removed before the process ends, never left behind. Serving's end goes
/// through [`SignalClose::after`].
fn close_on_signal(own: crate::region::Region, joined_shard: Option<u32>) -> SignalClose {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let handling = std::sync::Arc::new(std::sync::Mutex::new(()));
    let gate = SignalClose {
        handling: std::sync::Arc::clone(&handling),
    };
    let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) else {
        return gate;
    };
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            // Held until `_exit`: serving's end waits here rather than exit 0.
            let _handling = handling.lock().unwrap_or_else(|p| p.into_inner());
            match joined_shard {
                None => own.close_and_remove(),
                Some(k) => {
                    let _ = crate::shard::close_shard(&own, k);
                }
            }
            // `_exit`, not `exit`: the main thread may be ending too (its client closed
            // once it saw the region closed) and running the exit handlers and drops
            // (a Vulkan device's destruction) that `exit` would run again here at the
            // same time: the engine died of SIGSEGV. The region is closed and removed;
            // what is left, the kernel frees.
            crate::os::exit_now(128 + sig);
        }
    });
    gate
}

#[cfg(all(test, not(loom), feature = "mujoco"))]
mod tests {
    use super::*;
    use crate::envs::mujoco::{test_model, ENVS_BUILT};

    fn raw(model: &std::path::Path, num_envs: u32) -> ReferenceEngine {
        ReferenceEngine {
            env: "mujoco/raw".into(),
            num_envs,
            name: None,
            options: EnvOptions {
                model: Some(model.to_string_lossy().into_owned()),
                ..Default::default()
            },
            policy: Default::default(),
            idle_timeout: Duration::ZERO,
            device: DeviceRequest::Host,
            cuda_sharing: CudaSharingRequest::Auto,
            shard: (0, 1),
        }
    }

    /// Shard 0 reads the whole region's spec without building the whole env (N more
    /// MuJoCo states, a second thread pool, a second renderer).
    #[test]
    fn shard_zero_builds_no_whole_env_for_the_spec() {
        let model = test_model("shard-spec", 1, "");
        let r = raw(&model, 8);
        let entry = find(&r.env).unwrap();
        let before = ENVS_BUILT.with(|n| n.get());
        let spec = shard_zero_spec(entry, &r, "shard-spec", 2).unwrap();
        assert_eq!(
            ENVS_BUILT.with(|n| n.get()),
            before,
            "envs built for the spec"
        );
        assert_eq!(
            spec.tensors.iter().find(|t| t.name == "obs").unwrap().shape,
            [8, 2]
        );
        std::fs::remove_file(&model).unwrap();
    }

    /// An env whose tensors are not the region's (its model file changed between the
    /// region's spec and the env's build) is refused before serving, not indexed past
    /// the region's rows.
    #[test]
    fn an_env_that_does_not_match_the_region_is_refused() {
        let (a, b) = (test_model("match-a", 1, ""), test_model("match-b", 2, ""));
        let entry = find("mujoco/raw").unwrap();
        let mut engine = Engine::create(entry.host_spec(2, &raw(&a, 2).options).unwrap()).unwrap();
        let mut env = entry
            .build_on(2, &raw(&b, 2).options, Device::Host)
            .unwrap();
        let e = serve_printing_name(&mut engine, env.as_mut(), Duration::ZERO, "raw").unwrap_err();
        assert!(
            matches!(&e, Error::InvalidSpec(m) if m.contains("does not serve the region's tensors")),
            "{e}"
        );
        std::fs::remove_file(&a).unwrap();
        std::fs::remove_file(&b).unwrap();
    }
}
