//! GPU tests. Each one first checks that CUDA is usable (`shmbridge::device::probe`: the
//! `cuda` feature, a loadable driver, a device) and otherwise prints why and returns:
//! they pass vacuously on CPU-only machines (CI) and run for real on a GPU machine.
//! Run there with `cargo test --features cuda --test cuda -- --nocapture --test-threads=1`.
//! The kernel tests need only libnvrtc (no driver, no GPU): they run in CI, where
//! `SHMBRIDGE_REQUIRE_NVRTC=1` makes a missing libnvrtc a failure rather than a skip.
//!
//! Cross-process checks re-run this test binary as a child (`SHMBRIDGE_CUDA_CHILD`), since
//! a CUDA IPC handle cannot be opened in the process that exported it.

#![cfg(feature = "cuda")]

mod common;

use common::{f32s, fetch, next_random};
use std::process::Command;
use std::sync::Arc;

use shmbridge::device::cuda::driver::{
    self, DeviceAllocation, Driver, IpcEvent, PrimaryContext, Stream,
};
use shmbridge::device::cuda::kernel::{self, Arg, Module};

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

/// [`gpu`] for a test of the parent process: `None` (silently) in a child this binary
/// runs (`SHMBRIDGE_CUDA_CHILD`, or `ROLE` for the engine child), where it is not run.
fn parent_gpu(test: &str) -> Option<(&'static Driver, Arc<PrimaryContext>)> {
    if is_child() || std::env::var_os("ROLE").is_some() {
        return None;
    }
    gpu(test)
}

#[test]
fn probe_reports_devices_or_why_not() {
    match shmbridge::device::probe() {
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

// ---------------------------------------------------------------------------------------
// Memory shared by file descriptor (cuMemCreate with POSIX fd handles): the path that
// crosses PID namespaces, where CUDA IPC handles do not.

use shmbridge::device::cuda::driver::FdMemory;

/// [`parent_gpu`], and a device that shares memory by fd (else `None`, after printing
/// why: scripts/gpu-check.sh counts that as a failure).
fn fd_gpu(test: &str) -> Option<(&'static Driver, Arc<PrimaryContext>)> {
    let (d, ctx) = parent_gpu(test)?;
    match ctx.fd_sharing(d).expect("device attributes") {
        Ok(()) => Some((d, ctx)),
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}");
            None
        }
    }
}

/// Byte `i` of the pattern the fd tests write.
fn fd_pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 8)) as u8
}

#[test]
fn fd_memory_round_trip_and_export() {
    let Some((d, ctx)) = fd_gpu("fd_memory_round_trip_and_export") else {
        return;
    };
    let g = ctx.fd_granularity().unwrap();
    let m = FdMemory::allocate(d, &ctx, 1000).unwrap();
    assert!(m.size() >= 1000 && m.size() % g == 0, "{} / {g}", m.size());
    let mut back = vec![1u8; m.size()];
    m.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0), "zeroed");
    let data: Vec<u8> = (0..m.size()).map(fd_pattern).collect();
    m.write(0, &data).unwrap();
    m.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    assert!(m.read(1, &mut back).is_err(), "span past the end");
    assert_eq!(m.span(0, m.size() as u64), Some(m.ptr()));
    assert_eq!(m.span(1, m.size() as u64), None);
    let (a, b) = (m.export_fd().unwrap(), m.export_fd().unwrap());
    use std::os::fd::{AsFd, AsRawFd};
    assert_ne!(a.as_raw_fd(), b.as_raw_fd());
    for fd in [&a, &b] {
        let flags = rustix::io::fcntl_getfd(fd).unwrap();
        assert!(
            flags.contains(rustix::io::FdFlags::CLOEXEC),
            "close-on-exec"
        );
    }
    // The memory outlives the exporter's handle while an import holds it.
    let imported = FdMemory::import(d, &ctx, a.as_fd(), m.size() as u64).unwrap();
    drop((m, a, b));
    let mut again = vec![0u8; imported.size()];
    imported.read(0, &mut again).unwrap();
    assert_eq!(again, data, "the import keeps the allocation alive");
}

/// What is not the engine's allocation, or asks for more than it holds, is a typed
/// error before anything is mapped, never a panic.
#[test]
fn fd_import_refuses_impostors_and_oversized_spans() {
    let Some((d, ctx)) = fd_gpu("fd_import_refuses_impostors_and_oversized_spans") else {
        return;
    };
    use std::os::fd::AsFd;
    let g = ctx.fd_granularity().unwrap();
    let memfd = rustix::fs::memfd_create("impostor", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&memfd, g as u64).unwrap();
    match FdMemory::import(d, &ctx, memfd.as_fd(), g as u64) {
        Err(Error::Cuda { call, .. }) => assert_eq!(call, "cuMemImportFromShareableHandle"),
        other => panic!(
            "a memfd imported as CUDA memory: {:?}",
            other.map(|m| m.size())
        ),
    }
    let m = FdMemory::allocate(d, &ctx, g).unwrap();
    let fd = m.export_fd().unwrap();
    match FdMemory::import(d, &ctx, fd.as_fd(), 2 * g as u64) {
        Err(Error::Cuda { call, .. }) => assert_eq!(call, "cuMemMap"),
        other => panic!("mapped past the allocation: {:?}", other.map(|m| m.size())),
    }
    for size in [0, g as u64 - 1, g as u64 + 1] {
        assert!(
            matches!(
                FdMemory::import(d, &ctx, fd.as_fd(), size),
                Err(Error::InvalidSpec(_))
            ),
            "size {size}"
        );
    }
}

/// Child side of `fd_memory_crosses_processes_and_pid_namespaces`: imports the inherited
/// fd, checks the pattern, writes its marker, and prints its pid as it sees it.
#[test]
fn child_fd_import() {
    if std::env::var_os("SHMBRIDGE_FD_CHILD").is_none() {
        return;
    }
    let (d, ctx) = gpu("child_fd_import").unwrap();
    let raw: i32 = std::env::var("FD").unwrap().parse().unwrap();
    let size: u64 = std::env::var("SIZE").unwrap().parse().unwrap();
    // SAFETY: the parent left this fd open (without close-on-exec) for this process,
    // which owns it from here on.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    use std::os::fd::AsFd;
    let m = FdMemory::import(d, &ctx, fd.as_fd(), size).unwrap();
    drop(fd);
    let mut got = vec![0u8; m.size()];
    m.read(0, &mut got).unwrap();
    assert!(
        got[..got.len() - 4096]
            .iter()
            .enumerate()
            .all(|(i, &b)| b == fd_pattern(i)),
        "the parent's bytes"
    );
    m.write(m.size() - 4096, &[0x5A; 4096]).unwrap();
    println!("CHILD-FD-OK pid {}", std::process::id());
}

/// The engine's side exports an fd; a process that inherits it imports the same memory
/// and writes into it. Then again from a child in a PID namespace of its own (`unshare
/// --pid --fork --mount-proc`, with a user namespace where this is not root), as an
/// engine and a learner in two containers: where CUDA IPC handles fail, the fd works.
#[test]
fn fd_memory_crosses_processes_and_pid_namespaces() {
    let Some((d, ctx)) = fd_gpu("fd_memory_crosses_processes_and_pid_namespaces") else {
        return;
    };
    let m = FdMemory::allocate(d, &ctx, 1 << 20).unwrap();
    let data: Vec<u8> = (0..m.size() - 4096).map(fd_pattern).collect();
    m.write(0, &data).unwrap();
    let root = rustix::process::geteuid().is_root();
    for own_namespace in [false, true] {
        m.write(m.size() - 4096, &[0u8; 4096]).unwrap();
        let fd = m.export_fd().unwrap();
        // Inherited by the child (and by `unshare`, which keeps its fds open).
        rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::empty()).unwrap();
        let exe = std::env::current_exe().unwrap();
        let mut c = if own_namespace {
            let mut c = Command::new("unshare");
            if !root {
                c.args(["--user", "--map-root-user"]);
            }
            c.args(["--pid", "--fork", "--mount-proc", "--kill-child"]);
            c.arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        c.args([
            "child_fd_import",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ]);
        use std::os::fd::AsRawFd;
        c.env("SHMBRIDGE_FD_CHILD", "1")
            .env("SHMBRIDGE_CUDA_CHILD", "1")
            .env("FD", fd.as_raw_fd().to_string())
            .env("SIZE", m.size().to_string());
        let out = match c.output() {
            Ok(out) => out,
            Err(e) if own_namespace => {
                eprintln!(
                    "SKIPPED fd_memory_crosses_processes_and_pid_namespaces (PID namespace \
                     half): unshare: {e}"
                );
                return;
            }
            Err(e) => panic!("{e}"),
        };
        drop(fd);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("CHILD-FD-OK"),
            "child (own PID namespace: {own_namespace}) failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        if own_namespace {
            // The first process of a new PID namespace is its pid 1.
            assert!(stdout.contains("CHILD-FD-OK pid 1\n"), "{stdout}");
        }
        let mut marker = vec![0u8; 4096];
        m.read(m.size() - 4096, &mut marker).unwrap();
        assert!(
            marker.iter().all(|&b| b == 0x5A),
            "the child's write is seen here"
        );
    }
}

#[test]
fn kernels_compile_with_nvrtc_and_null_matches_the_cpu_pattern() {
    let Some((d, ctx)) = gpu("kernels_compile_with_nvrtc") else {
        return;
    };
    // Every embedded kernel file, compiled and loaded as a GPU engine does at start.
    let load_all = || -> Result<Vec<(&str, Module)>, Error> {
        shmbridge::envs::kernels::SOURCES
            .iter()
            .map(|(file, src, _)| {
                let options = shmbridge::envs::kernels::COMPILE_OPTIONS;
                Ok((*file, kernel::build(d, &ctx, file, src, options)?))
            })
            .collect()
    };
    let modules = match load_all() {
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

use shmbridge::device::{CudaSharingRequest, Device, DeviceRelease};
use shmbridge::{AttachOptions, Client, DType, Direction, Engine, EngineSpec, Error, Peer};

const ENVS: u64 = 64;
const OBS_DIM: u64 = 16;
const T: Duration = Duration::from_secs(30);

/// Child: serves a CUDA `null` engine named `$NAME` until a client closes and `$STOP`
/// exists (or it is killed), its memory shared as `$SHARING` says (`ipc` when unset).
/// Prints `READY <name>` once frame 0 is published and `RELEASE <Freed|Leaked|NothingHeld>`
/// after closing.
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
            Device::cuda(0),
        )
        .tensor_on(
            "actions",
            DType::F32,
            &[ENVS, 1],
            Direction::ClientToEngine,
            Device::cuda(0),
        )
        .tensor_on(
            "rewards",
            DType::F32,
            &[ENVS],
            Direction::EngineToClient,
            Device::cuda(0),
        )
        .name(&name)
        .cuda_sharing(
            CudaSharingRequest::parse(&std::env::var("SHARING").unwrap_or("ipc".into())).unwrap(),
        );
    let mut engine = Engine::create(spec).unwrap();
    let cuda = engine.backend().as_cuda().unwrap();
    // A cubin for this device first, as the GPU engines load their kernels.
    let module = kernel::build(
        d,
        cuda.context(),
        "null.cu",
        shmbridge::envs::kernels::NULL_CU,
        shmbridge::envs::kernels::COMPILE_OPTIONS,
    )
    .unwrap();
    let (obs, actions, rewards) = (
        engine.device_ptr("obs").unwrap(),
        engine.device_ptr("actions").unwrap(),
        engine.device_ptr("rewards").unwrap(),
    );
    let n = ENVS * OBS_DIM;
    let frame = |engine: &Engine, seq: u64| {
        let s = engine.backend().as_cuda().unwrap().stream().unwrap();
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
        EngineChild::spawn_sharing(tag, "ipc", false).unwrap()
    }

    /// An engine child sharing its memory as `sharing` says; with `own_namespace`, in a
    /// PID namespace of its own (`unshare --pid --fork --mount-proc`, as an engine in a
    /// container). `Err(why)` when that namespace cannot be made here.
    fn spawn_sharing(tag: &str, sharing: &str, own_namespace: bool) -> Result<EngineChild, String> {
        let name = format!("shmbridge-cuda-{tag}-{}", std::process::id());
        let stop = std::env::temp_dir().join(format!("{name}.stop"));
        let _ = std::fs::remove_file(&stop);
        let exe = std::env::current_exe().unwrap();
        let mut command = if own_namespace {
            let probe = Command::new("unshare")
                .args(["--pid", "--fork", "--mount-proc", "true"])
                .output()
                .map_err(|e| format!("unshare: {e}"))?;
            if !probe.status.success() {
                return Err(String::from_utf8_lossy(&probe.stderr).into_owned());
            }
            let mut c = Command::new("unshare");
            c.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
                .arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        let mut child = command
            .env("SHARING", sharing)
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
        Ok(EngineChild {
            child,
            out,
            name,
            stop,
        })
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
    let act = client.device_ptr("actions").unwrap();
    // SAFETY: both spans are `bytes.len()` long: the client's actions tensor (ENVS f32)
    // and our staging buffer; neither is written by anyone else meanwhile.
    unsafe { s.copy_dtod(act, staging.ptr(), bytes.len()) }.unwrap();
    let seq = client.step_on(&s, T).unwrap();
    let reader = Stream::create(ctx).unwrap();
    client
        .backend()
        .as_cuda()
        .unwrap()
        .wait_frame_on(&reader)
        .unwrap();
    let (obs_bytes, rew_bytes) = ((ENVS * OBS_DIM * 4) as usize, (ENVS * 4) as usize);
    let local = DeviceAllocation::new(ctx, obs_bytes + rew_bytes).unwrap();
    // SAFETY: copies the client's obs and rewards tensors (sizes from the layout) into
    // `local`, ordered after the engine's event on `reader`.
    unsafe {
        reader
            .copy_dtod(local.ptr(), client.device_ptr("obs").unwrap(), obs_bytes)
            .unwrap();
        reader
            .copy_dtod(
                local.ptr() + obs_bytes as u64,
                client.device_ptr("rewards").unwrap(),
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
    let Some((_, ctx)) = parent_gpu("cuda_engine_and_client_lock_step") else {
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
        let c = client.backend().as_cuda().unwrap();
        let m = driver::import_memory(c.context(), &placement.ipc_mem_handle).unwrap();
        assert_eq!(
            client.device_ptr(name).unwrap(),
            m.base() + t.offset,
            "{name}"
        );
    }
    // The views give the client's device address, as the client does.
    for name in ["obs", "actions", "rewards"] {
        let want = client.device_ptr(name).unwrap();
        assert_eq!(client.tensors().device_ptr(name).unwrap(), want, "{name}");
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
    assert_eq!(release, format!("RELEASE {:?}", DeviceRelease::Freed));
}

/// Memory shared by file descriptor (protocol 1.9): the engine allocates with
/// `cuMemCreate` and serves the fd over the region's socket, the client imports it
/// (`cuMemImportFromShareableHandle`, map, set access) and steps 50 frames, ordered on
/// the host; close frees on both sides. First with both in this PID namespace
/// (`cuda_sharing = "fd"`), then with the engine in a PID namespace of its own and
/// `cuda_sharing = "auto"` (which takes fd there), as an engine and a learner in two
/// containers: the table says fd, and the same frames arrive.
#[test]
fn cuda_fd_sharing_engine_and_client_lock_step_across_pid_namespaces() {
    let test = "cuda_fd_sharing_engine_and_client_lock_step_across_pid_namespaces";
    let Some((_, ctx)) = fd_gpu(test) else {
        return;
    };
    for (sharing, own_namespace) in [("fd", false), ("auto", true)] {
        let engine = match EngineChild::spawn_sharing("fd", sharing, own_namespace) {
            Ok(e) => e,
            Err(why) => {
                eprintln!("SKIPPED {test} (PID namespace half): {why}");
                return;
            }
        };
        let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
        assert_eq!(client.layout().version.1, 9, "a 1.9 region");
        assert_eq!(client.layout().engine_event_handle, None);
        for name in ["obs", "actions", "rewards"] {
            let (_, t) = client.layout().tensor(name).unwrap();
            let c = t.cuda.unwrap();
            assert_eq!(c.sharing, shmbridge::layout::CudaSharing::Fd, "{name}");
            assert_eq!(c.ipc_mem_handle, [0; 64]);
        }
        if own_namespace {
            // The first process of a new PID namespace is its pid 1.
            assert_eq!(client.layout().engine_pid, 1, "the engine's own namespace");
        }
        for k in 1..=50u64 {
            let actions: Vec<f32> = (0..ENVS).map(|e| (e * 1000 + k) as f32).collect();
            let (seq, obs, rewards) = step_and_read(&mut client, &ctx, &actions);
            assert_eq!(seq, k);
            check_frame(seq, &obs, &rewards, &actions);
        }
        client.close();
        let release = engine.finish();
        assert_eq!(release, format!("RELEASE {:?}", DeviceRelease::Freed));
    }
}

/// An engine in a PID namespace of its own that shares by IPC handle is refused by a
/// client here before the claim, naming the way out (`cuda_sharing "fd"`), instead of
/// failing in `cuIpcOpenMemHandle`.
#[test]
fn cuda_ipc_handles_of_an_engine_in_another_pid_namespace_are_refused_at_attach() {
    let test = "cuda_ipc_handles_of_an_engine_in_another_pid_namespace_are_refused_at_attach";
    let Some(_) = parent_gpu(test) else {
        return;
    };
    let engine = match EngineChild::spawn_sharing("ipc-pidns", "ipc", true) {
        Ok(e) => e,
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}");
            return;
        }
    };
    match Client::attach(&engine.name, AttachOptions::default()) {
        Err(Error::CudaUnavailable { reason }) => {
            assert!(reason.contains("do not cross PID namespaces"), "{reason}");
            assert!(reason.contains("cuda_sharing"), "{reason}");
        }
        Err(e) => panic!("expected CudaUnavailable, got {e}"),
        Ok(_) => panic!("IPC handles opened across PID namespaces"),
    }
    // A client that attaches and closes lets the engine end (it waits for one).
    let mut engine = engine;
    let _ = engine.child.kill();
    let _ = engine.child.wait();
}

/// (d) 100 attach/step/close cycles leave device memory unchanged within one
/// allocation granularity (2 MiB).
#[test]
fn cuda_attach_close_cycles_do_not_leak() {
    let Some((_, ctx)) = parent_gpu("cuda_attach_close_cycles_do_not_leak") else {
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
    let Some((_, ctx)) = parent_gpu("cuda_engine_killed_while_client_holds_pointers") else {
        return;
    };
    let (opens0, closes0) = driver::import_counts();
    let mut engine = EngineChild::spawn("killed");
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    let actions: Vec<f32> = (0..ENVS).map(|e| e as f32).collect();
    let (seq, obs, rewards) = step_and_read(&mut client, &ctx, &actions);
    check_frame(seq, &obs, &rewards, &actions);
    let held = client.device_ptr("obs").unwrap();
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

// ---------------------------------------------------------------------------------------
// The kernels' entry points, with NVRTC alone (no driver, no GPU needed).

/// Whether libnvrtc loads; when it does not, prints why `test` skips, or fails it where
/// `SHMBRIDGE_REQUIRE_NVRTC=1` (CI sets it: there the NVRTC wheel is on the loader path,
/// so a skip means the kernels went unchecked).
fn nvrtc_present(test: &str) -> bool {
    // SAFETY: only dlopen()s the candidate library names and drops the handles.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return true;
    }
    let why = "no libnvrtc on the loader path (LD_LIBRARY_PATH)";
    assert!(
        std::env::var_os("SHMBRIDGE_REQUIRE_NVRTC").is_none_or(|v| v != "1"),
        "{test}: {why}, and SHMBRIDGE_REQUIRE_NVRTC=1"
    );
    eprintln!("SKIPPED {test}: {why}");
    false
}

/// Compiles `src` with the kernels' options to `target`; fails the test on an error or
/// a warning (NVRTC's log is empty unless it warned).
fn compile_clean(file: &str, src: &str, target: kernel::Target) -> Vec<u8> {
    let out = kernel::compile_to(file, src, shmbridge::envs::kernels::COMPILE_OPTIONS, target)
        .unwrap_or_else(|e| panic!("{file} ({target:?}): {e}"));
    assert!(
        out.log.is_empty(),
        "{file} ({target:?}): NVRTC warned:\n{}",
        out.log
    );
    out.image
}

/// Each kernel compiles with NVRTC and its PTX entry takes the parameters the engines
/// launch it with (src/envs/gpu.rs: `Arg::Ptr`/`U64` are 8-byte `.u64`, `U32` `.u32`,
/// `F64` `.f64`). Needs only libnvrtc on the loader path (e.g. the
/// nvidia-cuda-nvrtc-cu12 wheel's lib folder in LD_LIBRARY_PATH).
#[test]
fn kernels_compile_and_take_the_launched_parameters() {
    if !nvrtc_present("kernels_compile_and_take_the_launched_parameters") {
        return;
    }
    let u = |n: usize| vec!["u64"; n];
    let cat = |parts: &[Vec<&'static str>]| parts.concat();
    let expected: &[(&str, Vec<&str>)] = &[
        ("null_fill", u(3)),
        ("null_fill_u8", u(3)),
        ("null_step", u(7)),
        ("null_sparse", u(9)),
        ("cartpole_reset_listed", cat(&[u(9), vec!["u32"]])),
        ("cartpole_write_obs", u(4)),
        ("cartpole_step", cat(&[u(11), vec!["f64"], u(1)])),
    ];
    use shmbridge::envs::kernels::SOURCES;
    let mut seen = 0;
    for (file, src, kernels) in SOURCES {
        let ptx = String::from_utf8(compile_clean(file, src, kernel::Target::Ptx)).unwrap();
        for k in *kernels {
            let start = ptx
                .find(&format!(".entry {k}("))
                .unwrap_or_else(|| panic!("{file}: no entry {k}"));
            let params = &ptx[start..start + ptx[start..].find(')').unwrap()];
            let types: Vec<&str> = params
                .split(".param .")
                .skip(1)
                .map(|p| p.split_whitespace().next().unwrap())
                .collect();
            let want = &expected.iter().find(|(n, _)| n == k).unwrap().1;
            assert_eq!(&types, want, "{file}: {k}");
            seen += 1;
        }
    }
    assert_eq!(seen, expected.len(), "every kernel checked");
}

/// NVRTC honours `--fmad=false` ([`COMPILE_OPTIONS`]) in kernels/cartpole.cu, so the GPU
/// rounds each multiply and add on its own as the CPU engine does: every f64 multiply,
/// add and subtract of its PTX carries `.rn` (which ptxas never fuses), and the only fused
/// multiply-adds are those of libdevice's `sincos` (called once, in `cartpole_step`): as
/// many as in a module that only calls it. Without the option NVRTC contracts the
/// dynamics and the reset draws, and this fails. Needs libnvrtc only, no GPU.
///
/// [`COMPILE_OPTIONS`]: shmbridge::envs::kernels::COMPILE_OPTIONS
#[test]
fn cartpole_kernels_compile_without_contracted_multiply_adds() {
    if !nvrtc_present("cartpole_kernels_compile_without_contracted_multiply_adds") {
        return;
    }
    use shmbridge::envs::kernels::{CARTPOLE_CU, COMPILE_OPTIONS};
    let ptx = |name: &str, src: &str| {
        let opts = cudarc::nvrtc::CompileOptions {
            name: Some(name.to_string()),
            options: COMPILE_OPTIONS.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(src, opts)
            .unwrap_or_else(|e| panic!("{name}: {e:?}"))
            .to_src()
    };
    let fmas = |ptx: &str| ptx.matches("fma.rn.f64").count();
    let sincos_only = ptx(
        "sincos.cu",
        "extern \"C\" __global__ void only_sincos(double *p) {\n\
         double s, c; sincos(p[0], &s, &c); p[1] = s; p[2] = c; }\n",
    );
    assert!(
        fmas(&sincos_only) > 0,
        "libdevice's sincos is a polynomial of fmas"
    );
    let cart = ptx("cartpole.cu", CARTPOLE_CU);
    assert_eq!(CARTPOLE_CU.matches("sincos(").count(), 1, "one sincos call");
    for op in ["mul.f64", "add.f64", "sub.f64"] {
        assert!(!cart.contains(op), "a contractable {op} (no .rn)");
    }
    assert_eq!(fmas(&cart), fmas(&sincos_only), "fmas beyond sincos'");
}

/// The kernels compile to machine code (a cubin, what a GPU engine loads first) for the
/// architectures of the GPUs this is meant for; an architecture NVRTC does not know is a
/// typed error (the engine then falls back to PTX). Needs libnvrtc only, no GPU.
#[test]
fn kernels_compile_to_cubins() {
    if !nvrtc_present("kernels_compile_to_cubins") {
        return;
    }
    use shmbridge::envs::kernels::SOURCES;
    for arch in [(8, 0), (8, 6), (9, 0)] {
        for (file, src, kernels) in SOURCES {
            let cubin = compile_clean(file, src, kernel::Target::Cubin(arch.0, arch.1));
            assert_eq!(&cubin[..4], b"\x7fELF", "{file}: a cubin is an ELF image");
            for k in *kernels {
                let name = k.as_bytes();
                assert!(
                    cubin.windows(name.len()).any(|w| w == name),
                    "{file}: the cubin names {k}"
                );
            }
        }
    }
    match kernel::compile_cubin("null.cu", shmbridge::envs::kernels::NULL_CU, &[], (1, 0)) {
        Err(Error::Cuda { call, detail }) => {
            assert_eq!(call, "nvrtcCompileProgram");
            assert!(detail.contains("sm_10"), "{detail}");
        }
        other => panic!("sm_10 compiled? {:?}", other.map(|c| c.len())),
    }
}

/// NVRTC's warnings come back in [`kernel::Compiled::log`] after a successful compile,
/// for PTX and for cubins alike: what lets the tests above fail on a warning.
#[test]
fn nvrtc_warnings_reach_the_log() {
    if !nvrtc_present("nvrtc_warnings_reach_the_log") {
        return;
    }
    let warns = "extern \"C\" __global__ void k(int *p) { int unused; p[0] = 1; }\n";
    for target in [kernel::Target::Ptx, kernel::Target::Cubin(8, 0)] {
        let out = kernel::compile_to("warns.cu", warns, &[], target).expect("compiles");
        assert!(!out.image.is_empty());
        assert!(out.log.contains("warning"), "{target:?}: log {:?}", out.log);
        assert!(out.log.contains("unused"), "{target:?}: log {:?}", out.log);
    }
    let clean = "extern \"C\" __global__ void k(int *p) { p[0] = 1; }\n";
    let out = kernel::compile_to("clean.cu", clean, &[], kernel::Target::Ptx).expect("compiles");
    assert_eq!(out.log, "", "no warning, an empty log");
    assert!(String::from_utf8(out.image).unwrap().contains(".entry k("));
}

// ---------------------------------------------------------------------------------------
// The GPU reference engines (`shmbridge engine --device cuda`, src/envs/gpu.rs), served by
// the real binary in a child process and compared with the CPU pattern and engines.

use shmbridge::envs::null::{pattern, pattern_u8};

/// Whether `shmbridge engine --device cuda` can run here: CUDA usable and NVRTC loadable.
fn gpu_engines(test: &str) -> bool {
    let Some((d, _ctx)) = parent_gpu(test) else {
        return false;
    };
    match kernel::compile(d, "empty.cu", "extern \"C\" __global__ void k() {}", &[]) {
        Ok(_) => true,
        Err(e @ Error::CudaUnavailable { .. }) => {
            eprintln!("SKIPPED {test}: {e}");
            false
        }
        Err(e) => panic!("{e}"),
    }
}

/// Closes the client and checks that the engine ended well and logged its device.
fn finish(client: Client, engine: common::EngineProc, device_line: &str) {
    client.close();
    let (status, stderr) = engine.finish();
    assert!(status.success(), "{status}: {stderr}");
    assert!(stderr.contains(device_line), "{stderr}");
}

/// Writes client→engine CUDA tensors from host bytes and steps: staged in a device
/// buffer, copied on a stream the client records its event on (`step_on`).
struct DeviceWriter {
    stream: Stream,
    staging: Option<DeviceAllocation>,
}

impl DeviceWriter {
    fn new(client: &Client) -> DeviceWriter {
        DeviceWriter {
            stream: Stream::create(client.backend().as_cuda().unwrap().context()).unwrap(),
            staging: None,
        }
    }

    fn step(&mut self, client: &mut Client, tensors: &[(&str, &[u8])]) -> u64 {
        // The previous step's copies are done before the staging buffer is rewritten.
        self.stream.synchronize().unwrap();
        let total: usize = tensors.iter().map(|(_, b)| b.len()).sum();
        if self.staging.as_ref().is_none_or(|s| s.size() < total) {
            self.staging = Some(
                DeviceAllocation::new(client.backend().as_cuda().unwrap().context(), total)
                    .unwrap(),
            );
        }
        let staging = self.staging.as_ref().unwrap();
        let mut at = 0;
        for (name, bytes) in tensors {
            let (_, t) = client.layout().tensor(name).unwrap();
            assert_eq!(t.nbytes as usize, bytes.len(), "{name}");
            staging.write(at, bytes).unwrap();
            let dst = client.device_ptr(*name).unwrap();
            // SAFETY: `dst` is the client's tensor of `bytes.len()` bytes and the source
            // a span of our staging buffer, alive until the next step synchronizes.
            unsafe {
                self.stream
                    .copy_dtod(dst, staging.ptr() + at as u64, bytes.len())
                    .unwrap()
            };
            at += bytes.len();
        }
        client.step_on(&self.stream, T).unwrap()
    }
}

/// Frame `seq` of a `null` engine (`n` obs elements, `rgb_n` image bytes), dense or
/// sparse, as the CPU engine writes it; `rewards` are the actions' first column.
fn check_null_frame(client: &Client, seq: u64, sparse: bool, rewards: Option<&[f32]>, what: &str) {
    let obs = f32s(&fetch(client, "obs"));
    let n = obs.len();
    for (i, v) in obs.iter().enumerate() {
        let want = if !sparse || i == 0 || i == n - 1 {
            pattern(seq, i as u64)
        } else {
            0.0
        };
        assert_eq!(*v, want, "{what}: obs[{i}] of frame {seq}");
    }
    if client.layout().tensor("rgb").is_ok() {
        let rgb = fetch(client, "rgb");
        let m = rgb.len();
        for (i, v) in rgb.iter().enumerate() {
            let want = if !sparse || i == 0 || i == m - 1 {
                pattern_u8(seq, i as u64)
            } else {
                0
            };
            assert_eq!(*v, want, "{what}: rgb[{i}] of frame {seq}");
        }
    }
    let got = f32s(&fetch(client, "rewards"));
    let last = got.len() - 1;
    for (e, r) in got.iter().enumerate() {
        let want = match rewards {
            Some(w) if !sparse || e == 0 || e == last => w[e],
            _ => 0.0,
        };
        assert_eq!(*r, want, "{what}: rewards[{e}] of frame {seq}");
    }
    for flag in ["terminated", "truncated"] {
        assert!(
            fetch(client, flag).iter().all(|&b| b == 0),
            "{what}: {flag}"
        );
    }
}

/// The GPU `null` engine's frames are the CPU pattern, for 4096×100 f32 observations,
/// 64×84×84×3 images and sparse mode; its commands answer as the CPU engine's.
#[test]
fn gpu_null_engine_serves_the_cpu_pattern() {
    if !gpu_engines("gpu_null_engine_serves_the_cpu_pattern") {
        return;
    }
    let configs: [(&[&str], bool); 3] = [
        (
            &["--num-envs", "4096", "--obs-dim", "100", "--act-dim", "3"],
            false,
        ),
        (&["--num-envs", "64", "--image", "84x84x3"], false),
        (
            &[
                "--num-envs",
                "7",
                "--obs-dim",
                "5",
                "--image",
                "2x3x1",
                "--sparse",
            ],
            true,
        ),
    ];
    for (args, sparse) in configs {
        let what = format!("{args:?}");
        let engine =
            common::EngineProc::start(&[&["--env", "null", "--device", "cuda"], args].concat());
        let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
        for t in &client.layout().tensors {
            assert_eq!(
                t.location(),
                shmbridge::Location::Cuda,
                "{what}: {}",
                t.name
            );
        }
        check_null_frame(&client, 0, sparse, None, &what);
        let (_, act) = client.layout().tensor("actions").unwrap();
        let (n, act_dim) = (act.shape[0] as usize, act.shape[1] as usize);
        let mut writer = DeviceWriter::new(&client);
        let mut firsts = Vec::new();
        for k in 1..=3u64 {
            let actions: Vec<f32> = (0..n * act_dim)
                .map(|i| (i as u64 * 7 + k * 1000) as f32)
                .collect();
            let bytes: Vec<u8> = actions.iter().flat_map(|a| a.to_ne_bytes()).collect();
            assert_eq!(writer.step(&mut client, &[("actions", &bytes)]), k);
            firsts = actions.iter().step_by(act_dim).copied().collect();
            check_null_frame(&client, k, sparse, Some(&firsts), &what);
        }
        // A bare Reset rewrites frame 0's pattern (rewards keep the last frame's values).
        assert_eq!(client.reset(None, &[], T).unwrap(), 3);
        check_null_frame(&client, 0, sparse, Some(&firsts), &format!("{what} reset"));
        let e = client.reset(Some(&[0]), &[], T).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Remote {
                    code: shmbridge::wire::code::UNSUPPORTED,
                    ..
                }
            ),
            "{what}: {e}"
        );
        let echoed = client
            .call_method("echo", &[("a", "b")], b"xyz", T)
            .unwrap();
        assert_eq!(echoed.payload, b"xyz");
        assert_eq!(echoed.args, vec![("a".into(), "b".into())]);
        finish(client, engine, "device cuda -> cuda:0");
    }
}

/// One frame of a cartpole engine, read on the host.
#[derive(Debug, Clone, PartialEq)]
struct CartFrame {
    obs: Vec<f32>,
    final_obs: Vec<f32>,
    rewards: Vec<f32>,
    terminated: Vec<u8>,
    truncated: Vec<u8>,
}

/// A GPU and a CPU cartpole engine with the same envs and seed, each with a client,
/// stepped with the same actions and `reset_mask`.
struct CartPair {
    gpu: Client,
    cpu: Client,
    engines: (common::EngineProc, common::EngineProc),
    writer: DeviceWriter,
}

impl CartPair {
    fn start(n: usize, seed: u64) -> CartPair {
        let (ns, ss) = (n.to_string(), seed.to_string());
        let args = ["--env", "cartpole", "--num-envs", &ns, "--seed", &ss];
        let g = common::EngineProc::start(&[&args[..], &["--device", "cuda"]].concat());
        let c = common::EngineProc::start(&args);
        let gpu = Client::attach(&g.name, AttachOptions::default()).unwrap();
        let cpu = Client::attach(&c.name, AttachOptions::default()).unwrap();
        assert!(gpu.layout().has_cuda() && !cpu.layout().has_cuda());
        let writer = DeviceWriter::new(&gpu);
        CartPair {
            gpu,
            cpu,
            engines: (g, c),
            writer,
        }
    }

    fn frames(&mut self) -> (CartFrame, CartFrame) {
        let g = &self.gpu;
        let gpu = CartFrame {
            obs: f32s(&fetch(g, "obs")),
            final_obs: f32s(&fetch(g, "final_obs")),
            rewards: f32s(&fetch(g, "rewards")),
            terminated: fetch(g, "terminated"),
            truncated: fetch(g, "truncated"),
        };
        let mut io = self.cpu.tensors();
        let cpu = CartFrame {
            obs: io.read::<f32>("obs").unwrap().to_vec(),
            final_obs: io.read::<f32>("final_obs").unwrap().to_vec(),
            rewards: io.read::<f32>("rewards").unwrap().to_vec(),
            terminated: io.read::<u8>("terminated").unwrap().to_vec(),
            truncated: io.read::<u8>("truncated").unwrap().to_vec(),
        };
        (gpu, cpu)
    }

    fn step(&mut self, actions: &[i64], mask: &[u8]) -> (CartFrame, CartFrame) {
        let act: Vec<u8> = actions.iter().flat_map(|a| a.to_ne_bytes()).collect();
        let g = self
            .writer
            .step(&mut self.gpu, &[("actions", &act), ("reset_mask", mask)]);
        {
            let mut io = self.cpu.tensors();
            io.write::<i64>("actions").unwrap().copy_from_slice(actions);
            io.write::<u8>("reset_mask").unwrap().copy_from_slice(mask);
        }
        let c = self.cpu.step(T).unwrap();
        assert_eq!(g, c, "frame numbers");
        self.frames()
    }

    /// The same `Reset` command on both; returns the frames after the replies.
    fn reset(&mut self, ids: Option<&[u32]>, seeds: &[u64]) -> (CartFrame, CartFrame) {
        let g = self.gpu.reset(ids, seeds, T).unwrap();
        let c = self.cpu.reset(ids, seeds, T).unwrap();
        assert_eq!(g, c, "ResetDone frames");
        self.frames()
    }

    fn finish(self) {
        let (g, c) = self.engines;
        finish(self.gpu, g, "device cuda -> cuda:0");
        self.cpu.close();
        let (status, stderr) = c.finish();
        assert!(status.success(), "{stderr}");
    }
}

/// Observations equal up to f32 rounding of f64 states that differ in the last bits
/// (the GPU's `sincos` is not glibc's): relative 1e-5, absolute 1e-6 near 0.
fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-5 * a.abs().max(b.abs()) + 1e-6
}

/// Compares env `e` of two frames: rewards and flags exactly, observations with
/// [`close`] (bit for bit when `exact`). `Err` when the flags differ: the episodes have
/// parted (a threshold crossed on one side only, from last-bit differences).
fn compare_env(
    g: &CartFrame,
    c: &CartFrame,
    e: usize,
    exact: bool,
    what: &str,
) -> std::result::Result<(), ()> {
    if (g.terminated[e], g.truncated[e]) != (c.terminated[e], c.truncated[e]) {
        return Err(());
    }
    assert_eq!(g.rewards[e], c.rewards[e], "{what}: rewards[{e}]");
    for k in 4 * e..4 * e + 4 {
        for (name, x, y) in [
            ("obs", g.obs[k], c.obs[k]),
            ("final_obs", g.final_obs[k], c.final_obs[k]),
        ] {
            if exact {
                assert_eq!(x.to_bits(), y.to_bits(), "{what}: {name}[{k}]: {x} vs {y}");
            } else {
                assert!(close(x, y), "{what}: {name}[{k}]: gpu {x} cpu {y}");
            }
        }
    }
    Ok(())
}

/// The GPU cartpole and the CPU cartpole, same seed, same actions and `reset_mask`, agree
/// for 600 steps: rewards and flags exactly, observations to f32 rounding, until an env's
/// flags first differ (then its episodes have parted: it is no longer compared, and this
/// must stay rare). `set_pole_length` applies on both from the next step.
#[test]
fn gpu_cartpole_agrees_with_the_cpu_cartpole() {
    if !gpu_engines("gpu_cartpole_agrees_with_the_cpu_cartpole") {
        return;
    }
    let (n, seed) = (256usize, 2024u64);
    let mut pair = CartPair::start(n, seed);
    let (g, c) = pair.frames();
    for e in 0..n {
        compare_env(&g, &c, e, true, "frame 0").expect("frame 0 has no flags");
    }
    let mut parted = vec![false; n];
    let (mut rng, mut finished) = (seed, 0usize);
    for step in 1..=600u64 {
        if step == 250 {
            for client in [&mut pair.gpu, &mut pair.cpu] {
                let r = client
                    .call_method("set_pole_length", &[("length", "0.7")], &[], T)
                    .unwrap();
                assert_eq!(r.args, vec![("previous".into(), "0.5".into())]);
            }
        }
        let actions: Vec<i64> = (0..n).map(|_| (next_random(&mut rng) & 1) as i64).collect();
        let mask: Vec<u8> = (0..n)
            .map(|_| u8::from(next_random(&mut rng) % 128 == 0))
            .collect();
        let (g, c) = pair.step(&actions, &mask);
        for (e, parted) in parted.iter_mut().enumerate() {
            if *parted {
                continue;
            }
            let what = format!("step {step}");
            if compare_env(&g, &c, e, false, &what).is_err() {
                eprintln!("env {e} parted at step {step}: flags differ");
                *parted = true;
            }
            finished += usize::from(c.terminated[e] != 0 || c.truncated[e] != 0);
        }
    }
    let parted = parted.iter().filter(|&&p| p).count();
    eprintln!("{finished} episodes finished in step; {parted} of {n} envs parted");
    assert!(
        finished > 1000,
        "random actions end many episodes: {finished}"
    );
    assert!(
        parted <= n / 50,
        "{parted} envs parted: more than last-bit noise"
    );
    pair.finish();
}

/// `Reset` commands (listed envs with one seed each, one seed for all, no seeds, and
/// duplicates) give the GPU engine the CPU engine's states, bit for bit for the reseeded
/// envs, and every env's `obs`/`final_obs` are rewritten as on the CPU.
#[test]
fn gpu_cartpole_reset_commands_give_the_cpu_states() {
    if !gpu_engines("gpu_cartpole_reset_commands_give_the_cpu_states") {
        return;
    }
    let n = 64usize;
    let mut pair = CartPair::start(n, 7);
    let mut rng = 99u64;
    for _ in 0..40 {
        let actions: Vec<i64> = (0..n).map(|_| (next_random(&mut rng) & 1) as i64).collect();
        pair.step(&actions, &vec![0; n]);
    }
    let resets: [(Option<&[u32]>, &[u64]); 5] = [
        (Some(&[3, 1, 3, 60]), &[11, 12, 13, 14]),
        (Some(&[5]), &[u64::MAX]),
        (None, &[123]),
        (Some(&[2, 9, 9]), &[]),
        (None, &[]),
    ];
    for (ids, seeds) in resets {
        let what = format!("reset({ids:?}, {seeds:?})");
        let (g, c) = pair.reset(ids, seeds);
        let reseeded = |e: usize| !seeds.is_empty() && ids.is_none_or(|l| l.contains(&(e as u32)));
        for e in 0..n {
            compare_env(&g, &c, e, reseeded(e), &what)
                .unwrap_or_else(|()| panic!("{what}: flags of env {e} differ"));
        }
        // The next step from the reset states agrees too.
        let actions: Vec<i64> = (0..n).map(|e| (e % 2) as i64).collect();
        let (g, c) = pair.step(&actions, &vec![0; n]);
        for e in 0..n {
            compare_env(&g, &c, e, false, &what)
                .unwrap_or_else(|()| panic!("{what}, next step: flags of env {e} differ"));
        }
    }
    let e = pair.gpu.reset(Some(&[64]), &[], T).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote {
                code: shmbridge::wire::code::BAD_REQUEST,
                ..
            }
        ),
        "{e}"
    );
    pair.finish();
}
