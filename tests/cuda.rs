//! GPU tests. Each one first checks that CUDA is usable (`shmbridge::cuda::probe`: the
//! `cuda` feature, a loadable driver, a device) and otherwise prints why and returns:
//! they pass vacuously on CPU-only machines (CI) and run for real on a GPU machine.
//! Run there with `cargo test --features cuda --test cuda -- --nocapture --test-threads=1`.
//!
//! Cross-process checks re-run this test binary as a child (`SHMBRIDGE_CUDA_CHILD`), since
//! a CUDA IPC handle cannot be opened in the process that exported it.

#![cfg(feature = "cuda")]

use std::process::Command;
use std::sync::Arc;

use shmbridge::cuda::driver::{self, DeviceAllocation, Driver, IpcEvent, PrimaryContext, Stream};

/// The driver and device 0's primary context, or `None` (after printing why).
fn gpu(test: &str) -> Option<(&'static Driver, Arc<PrimaryContext>)> {
    match Driver::get() {
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
        Ok(d) => Some((d, PrimaryContext::retain(d, 0).expect("device 0"))),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

/// Runs `child` in a fresh process of this test binary with `env`, returns its stdout.
fn run_child(child: &str, env: &[(&str, String)]) -> String {
    let exe = std::env::current_exe().unwrap();
    let mut c = Command::new(exe);
    c.args([child, "--exact", "--nocapture", "--test-threads=1"]);
    c.env("SHMBRIDGE_CUDA_CHILD", "1");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "child {child} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn is_child() -> bool {
    std::env::var_os("SHMBRIDGE_CUDA_CHILD").is_some()
}

#[test]
fn probe_reports_devices_or_why_not() {
    match shmbridge::cuda::probe() {
        Ok(info) => assert!(info.device_count >= 1),
        Err(e) => eprintln!("SKIPPED probe_reports_devices_or_why_not: {e}"),
    }
}

#[test]
fn allocation_round_trip_and_export() {
    let Some((_, ctx)) = gpu("allocation_round_trip_and_export") else {
        return;
    };
    let a = DeviceAllocation::new(&ctx, 4096).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
    a.write(0, &data).unwrap();
    let mut back = vec![0u8; 4096];
    a.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    assert!(a.read(4000, &mut back).is_err(), "span past the end");
    let h = a.ipc_handle().unwrap();
    assert!(h.iter().any(|&b| b != 0));
    // Opening our own export fails (driver rule), with an error, not a panic.
    assert!(driver::import_memory(&ctx, &h).is_err());
    let ev = IpcEvent::create(&ctx).unwrap();
    assert!(ev.handle().unwrap().iter().any(|&b| b != 0));
    let s = Stream::create(&ctx).unwrap();
    ev.record(&s).unwrap();
    ev.synchronize().unwrap();
}

/// Child side of `another_process_sees_the_bytes`: opens the handle, checks the bytes at
/// the offset after waiting on the parent's event, prints the opened base pointer.
#[test]
fn child_import_and_check() {
    if !is_child() {
        return;
    }
    let (_, ctx) = gpu("child").unwrap();
    let handle: [u8; 64] = unhex(&std::env::var("MEM").unwrap());
    let event: [u8; 64] = unhex(&std::env::var("EVENT").unwrap());
    let offset: u64 = std::env::var("OFFSET").unwrap().parse().unwrap();
    let ev = IpcEvent::open(&ctx, &event).unwrap();
    let s = Stream::create(&ctx).unwrap();
    s.wait(&ev).unwrap();
    s.synchronize().unwrap();
    let m = driver::import_memory(&ctx, &handle).unwrap();
    let again = driver::import_memory(&ctx, &handle).unwrap();
    assert!(Arc::ptr_eq(&m, &again), "one open per process and handle");
    assert_eq!(driver::import_counts(), (1, 0));
    let mut got = vec![0u8; 256];
    m.read(offset, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0xAB), "{got:?}");
    assert!(m.span(m.size() as u64, 1).is_err());
    drop((m, again));
    assert_eq!(driver::import_counts(), (1, 1), "closed exactly once");
    println!("CHILD-OK");
}

#[test]
fn another_process_sees_the_bytes() {
    if is_child() {
        return;
    }
    let Some((_, ctx)) = gpu("another_process_sees_the_bytes") else {
        return;
    };
    let a = DeviceAllocation::new(&ctx, 1 << 20).unwrap();
    let offset = 4096usize;
    a.write(offset, &[0xAB; 256]).unwrap();
    let ev = IpcEvent::create(&ctx).unwrap();
    let s = Stream::create(&ctx).unwrap();
    ev.record(&s).unwrap();
    let out = run_child(
        "child_import_and_check",
        &[
            ("MEM", hex(&a.ipc_handle().unwrap())),
            ("EVENT", hex(&ev.handle().unwrap())),
            ("OFFSET", offset.to_string()),
        ],
    );
    assert!(out.contains("CHILD-OK"), "{out}");
}

#[test]
fn kernels_compile_with_nvrtc_and_null_matches_the_cpu_pattern() {
    let Some((d, ctx)) = gpu("kernels_compile_with_nvrtc") else {
        return;
    };
    let modules = match shmbridge::cuda::kernels::load_all(d, &ctx) {
        Ok(m) => m,
        Err(e @ shmbridge::Error::CudaUnavailable { .. }) => {
            eprintln!("SKIPPED kernels: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let null = &modules.iter().find(|(f, _)| *f == "null.cu").unwrap().1;
    let n = 1000u64;
    let obs = DeviceAllocation::new(&ctx, n as usize * 4).unwrap();
    let s = Stream::create(&ctx).unwrap();
    use driver::Arg;
    // SAFETY: null_fill(float*, u64, u64); `obs` holds n floats.
    unsafe {
        null.launch(
            "null_fill",
            &s,
            n as u32,
            128,
            &[Arg::Ptr(obs.ptr()), Arg::U64(n), Arg::U64(7)],
        )
    }
    .unwrap();
    s.synchronize().unwrap();
    let mut bytes = vec![0u8; n as usize * 4];
    obs.read(0, &mut bytes).unwrap();
    for (i, c) in bytes.chunks_exact(4).enumerate() {
        let v = f32::from_le_bytes(c.try_into().unwrap());
        assert_eq!(
            v,
            shmbridge::envs::null::pattern(7, i as u64),
            "element {i}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Engine and Client over CUDA tensors (protocol 1.2): a `null`-like engine whose frames
// are written by kernels/null.cu, in a child process; the client in this process.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Stdio};
use std::time::{Duration, Instant};

use shmbridge::cuda::{CudaRelease, Device};
use shmbridge::{AttachOptions, Client, DType, Direction, Engine, EngineSpec, Error, Peer};

const ENVS: u64 = 64;
const OBS_DIM: u64 = 16;
const T: Duration = Duration::from_secs(30);

/// Child: serves a CUDA `null` engine named `$NAME` until a client closes and `$STOP`
/// exists (or it is killed). Prints `READY <name>` once frame 0 is published and
/// `RELEASE <Freed|Leaked|NoCuda>` after closing.
#[test]
fn child_cuda_engine() {
    if std::env::var("ROLE").ok().as_deref() != Some("engine") {
        return;
    }
    use std::io::Write;
    let (d, _ctx) = gpu("child engine").unwrap();
    let name = std::env::var("NAME").unwrap();
    let stop = std::path::PathBuf::from(std::env::var("STOP").unwrap());
    let spec = EngineSpec::new("cuda-null", ENVS as u32)
        .tensor_on(
            "obs",
            DType::F32,
            &[ENVS, OBS_DIM],
            Direction::EngineToClient,
            Device::Cuda(0),
        )
        .tensor_on(
            "actions",
            DType::F32,
            &[ENVS, 1],
            Direction::ClientToEngine,
            Device::Cuda(0),
        )
        .tensor_on(
            "rewards",
            DType::F32,
            &[ENVS],
            Direction::EngineToClient,
            Device::Cuda(0),
        )
        .name(&name);
    let mut engine = Engine::create(spec).unwrap();
    let cuda = engine.cuda().unwrap();
    let ptx = driver::compile(d, "null.cu", shmbridge::cuda::kernels::NULL_CU, &[]).unwrap();
    let module = driver::Module::load(cuda.context(), &ptx).unwrap();
    let (obs, actions, rewards) = (
        engine.cuda_ptr("obs").unwrap(),
        engine.cuda_ptr("actions").unwrap(),
        engine.cuda_ptr("rewards").unwrap(),
    );
    let n = ENVS * OBS_DIM;
    use driver::Arg;
    let frame = |engine: &Engine, seq: u64| {
        let s = engine.cuda().unwrap().stream().unwrap();
        // SAFETY: null_step(float*, u64, u64, const float*, u64, float*, u64); the
        // pointers are the engine's tensors of those sizes, alive until close.
        unsafe {
            module.launch(
                "null_step",
                s,
                n as u32,
                128,
                &[
                    Arg::Ptr(obs),
                    Arg::U64(n),
                    Arg::U64(seq),
                    Arg::Ptr(actions),
                    Arg::U64(1),
                    Arg::Ptr(rewards),
                    Arg::U64(ENVS),
                ],
            )
        }
        .unwrap();
    };
    frame(&engine, 0);
    engine.publish().unwrap();
    println!("READY {name}");
    std::io::stdout().flush().unwrap();
    'serve: loop {
        match engine.wait_actions(Duration::from_secs(120)) {
            Ok(seq) => {
                frame(&engine, seq);
                engine.publish().unwrap();
            }
            Err(Error::PeerClosed { .. }) | Err(Error::PeerDied { .. }) => {
                let deadline = Instant::now() + Duration::from_secs(120);
                loop {
                    if stop.exists() {
                        break 'serve;
                    }
                    if engine.client_attached() {
                        break;
                    }
                    assert!(Instant::now() < deadline, "no next client");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Err(e) => panic!("engine: {e}"),
        }
    }
    drop(module);
    println!("RELEASE {:?}", engine.close_reporting());
    std::io::stdout().flush().unwrap();
}

struct EngineChild {
    child: Child,
    out: BufReader<ChildStdout>,
    name: String,
    stop: std::path::PathBuf,
}

impl EngineChild {
    fn spawn(tag: &str) -> EngineChild {
        let name = format!("shmbridge-cuda-{tag}-{}", std::process::id());
        let stop = std::env::temp_dir().join(format!("{name}.stop"));
        let _ = std::fs::remove_file(&stop);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "child_cuda_engine",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("ROLE", "engine")
            .env("NAME", &name)
            .env("STOP", &stop)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "engine child ended");
            if line.trim() == format!("READY {name}") {
                break;
            }
        }
        EngineChild {
            child,
            out,
            name,
            stop,
        }
    }

    /// Tells the engine to stop once its client closed; returns its `RELEASE` line.
    fn finish(mut self) -> String {
        std::fs::write(&self.stop, b"").unwrap();
        let mut rest = String::new();
        let mut line = String::new();
        while self.out.read_line(&mut line).unwrap() > 0 {
            rest.push_str(&line);
            line.clear();
        }
        assert!(self.child.wait().unwrap().success(), "{rest}");
        let _ = std::fs::remove_file(&self.stop);
        rest.lines()
            .find(|l| l.starts_with("RELEASE "))
            .unwrap_or("")
            .to_string()
    }
}

/// Writes `actions` (host values) into the client's device tensor on `s`, steps with
/// the client event recorded on `s`, then reads the frame on another stream that waits
/// on the engine's event (no host or device-wide synchronize before the wait).
fn step_and_read(
    client: &mut Client,
    ctx: &Arc<PrimaryContext>,
    actions: &[f32],
) -> (u64, Vec<f32>, Vec<f32>) {
    let s = Stream::create(ctx).unwrap();
    let staging = DeviceAllocation::new(ctx, actions.len() * 4).unwrap();
    let bytes: Vec<u8> = actions.iter().flat_map(|a| a.to_le_bytes()).collect();
    staging.write(0, &bytes).unwrap();
    let act = client.cuda_ptr("actions").unwrap();
    // SAFETY: both spans are `bytes.len()` long: the client's actions tensor (ENVS f32)
    // and our staging buffer; neither is written by anyone else meanwhile.
    unsafe { s.copy_dtod(act, staging.ptr(), bytes.len()) }.unwrap();
    let seq = client.step_on(&s, T).unwrap();
    let reader = Stream::create(ctx).unwrap();
    client.cuda().unwrap().wait_frame_on(&reader).unwrap();
    let (obs_bytes, rew_bytes) = ((ENVS * OBS_DIM * 4) as usize, (ENVS * 4) as usize);
    let local = DeviceAllocation::new(ctx, obs_bytes + rew_bytes).unwrap();
    // SAFETY: copies the client's obs and rewards tensors (sizes from the layout) into
    // `local`, ordered after the engine's event on `reader`.
    unsafe {
        reader
            .copy_dtod(local.ptr(), client.cuda_ptr("obs").unwrap(), obs_bytes)
            .unwrap();
        reader
            .copy_dtod(
                local.ptr() + obs_bytes as u64,
                client.cuda_ptr("rewards").unwrap(),
                rew_bytes,
            )
            .unwrap();
    }
    reader.synchronize().unwrap();
    let mut host = vec![0u8; obs_bytes + rew_bytes];
    local.read(0, &mut host).unwrap();
    let f = |b: &[u8]| {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect::<Vec<f32>>()
    };
    (seq, f(&host[..obs_bytes]), f(&host[obs_bytes..]))
}

fn check_frame(seq: u64, obs: &[f32], rewards: &[f32], actions: &[f32]) {
    for (i, v) in obs.iter().enumerate() {
        assert_eq!(
            *v,
            shmbridge::envs::null::pattern(seq, i as u64),
            "obs[{i}]"
        );
    }
    assert_eq!(rewards, actions, "rewards = actions[:, 0]");
}

/// (a) the device pointer is the opened base + offset, (b) values after waiting on the
/// engine's event, (c) close acknowledgement, then the engine frees.
#[test]
fn cuda_engine_and_client_lock_step() {
    if is_child() || std::env::var_os("ROLE").is_some() {
        return;
    }
    let Some((_, ctx)) = gpu("cuda_engine_and_client_lock_step") else {
        return;
    };
    let (opens0, closes0) = driver::import_counts();
    let engine = EngineChild::spawn("lockstep");
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    assert!(client.layout().has_cuda());
    // (a)
    for name in ["obs", "actions", "rewards"] {
        let (_, t) = client.layout().tensor(name).unwrap();
        let placement = t.cuda.unwrap();
        let c = client.cuda().unwrap();
        let m = driver::import_memory(c.context(), &placement.ipc_mem_handle).unwrap();
        assert_eq!(
            client.cuda_ptr(name).unwrap(),
            m.base() + t.offset,
            "{name}"
        );
    }
    assert_eq!(
        driver::import_counts(),
        (opens0 + 1, closes0),
        "one open for the one allocation (run with --test-threads=1)"
    );
    assert!(matches!(
        client.tensor::<f32>("obs"),
        Err(Error::NotOnHost { .. })
    ));
    // (b)
    for k in 1..=50u64 {
        let actions: Vec<f32> = (0..ENVS).map(|e| (e * 1000 + k) as f32).collect();
        let (seq, obs, rewards) = step_and_read(&mut client, &ctx, &actions);
        assert_eq!(seq, k);
        check_frame(seq, &obs, &rewards, &actions);
    }
    // (c)
    client.close();
    assert_eq!(
        driver::import_counts(),
        (opens0 + 1, closes0 + 1),
        "closed exactly once"
    );
    let release = engine.finish();
    assert_eq!(release, format!("RELEASE {:?}", CudaRelease::Freed));
}

/// (d) 100 attach/step/close cycles leave device memory unchanged within one
/// allocation granularity (2 MiB).
#[test]
fn cuda_attach_close_cycles_do_not_leak() {
    if is_child() || std::env::var_os("ROLE").is_some() {
        return;
    }
    let Some((_, ctx)) = gpu("cuda_attach_close_cycles_do_not_leak") else {
        return;
    };
    let engine = EngineChild::spawn("cycles");
    let cycle = |k: u64| {
        let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
        let actions: Vec<f32> = (0..ENVS).map(|e| (e + k) as f32).collect();
        let (seq, obs, rewards) = step_and_read(&mut client, &ctx, &actions);
        check_frame(seq, &obs, &rewards, &actions);
        client.close();
    };
    cycle(0); // warm-up: lazily created driver state is not a leak
    let (free0, _) = ctx.mem_info().unwrap();
    let (opens0, closes0) = driver::import_counts();
    for k in 1..=100 {
        cycle(k);
    }
    let (free1, _) = ctx.mem_info().unwrap();
    let (opens1, closes1) = driver::import_counts();
    assert_eq!(opens1 - opens0, closes1 - closes0, "every open closed");
    let granularity = 2 << 20;
    assert!(
        free0.abs_diff(free1) <= granularity,
        "free device memory moved from {free0} to {free1}"
    );
    assert_eq!(engine.finish(), "RELEASE Freed");
}

/// (e) The engine is SIGKILLed while the client holds its pointers: the client's next
/// step is PeerDied, and closing it closes its handles without crashing.
#[test]
fn cuda_engine_killed_while_client_holds_pointers() {
    if is_child() || std::env::var_os("ROLE").is_some() {
        return;
    }
    let Some((_, ctx)) = gpu("cuda_engine_killed_while_client_holds_pointers") else {
        return;
    };
    let (opens0, closes0) = driver::import_counts();
    let mut engine = EngineChild::spawn("killed");
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    let actions: Vec<f32> = (0..ENVS).map(|e| e as f32).collect();
    let (seq, obs, rewards) = step_and_read(&mut client, &ctx, &actions);
    check_frame(seq, &obs, &rewards, &actions);
    let held = client.cuda_ptr("obs").unwrap();
    assert_ne!(held, 0);
    engine.child.kill().unwrap(); // SIGKILL
    engine.child.wait().unwrap();
    let e = client.step(T).unwrap_err();
    assert!(
        matches!(
            e,
            Error::PeerDied {
                peer: Peer::Engine,
                ..
            }
        ),
        "{e}"
    );
    client.close();
    assert_eq!(
        driver::import_counts(),
        (opens0 + 1, closes0 + 1),
        "the handle was closed exactly once after the exporter died"
    );
    let _ = std::fs::remove_file(&engine.stop);
}
