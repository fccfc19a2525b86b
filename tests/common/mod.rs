//! Helpers shared by the integration tests: run the real `shmbridge` binary as an engine,
//! look in /dev/shm, read bytes back, draw test inputs, replay stored inputs.
#![allow(dead_code)]

pub mod peer;
pub mod stream;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub const BIN: &str = env!("CARGO_BIN_EXE_shmbridge");

/// Each test process names its regions in a namespace of its own (docs/protocol.md 1.1):
/// `SHMBRIDGE_NAMESPACE` becomes the one it was given (or `t`) + `_<pid>`, set before
/// `main` (an `.init_array` entry), while the process has one thread; the engines it
/// starts inherit it. Under cargo-nextest (scripts/test.sh) a process runs one test, so no
/// test's engine start, `ls` or `gc` sees another test's regions, nor another run's; plain
/// `cargo test` runs a file's tests in one process, one namespace. When the process exits
/// (`.fini_array`), it sweeps that namespace: the regions of the engines its tests killed,
/// which no later engine start of the namespace would remove.
#[used]
#[link_section = ".init_array"]
static PROCESS_NAMESPACE: extern "C" fn() = set_process_namespace;
extern "C" fn set_process_namespace() {
    let outer = std::env::var(shmbridge::region::NAMESPACE_ENV).unwrap_or_default();
    let outer = if outer.is_empty() { "t" } else { &outer };
    let ns = format!("{outer}_{}", std::process::id());
    std::env::set_var(shmbridge::region::NAMESPACE_ENV, ns);
}
#[used]
#[link_section = ".fini_array"]
static SWEEP_PROCESS_NAMESPACE: extern "C" fn() = sweep_process_namespace;
extern "C" fn sweep_process_namespace() {
    let _ = shmbridge::region::sweep();
}

thread_local! {
    /// This thread's region namespace, once it asked for one ([`own_namespace`]).
    static THREAD_NAMESPACE: std::cell::RefCell<Option<ThreadNamespace>> =
        const { std::cell::RefCell::new(None) };
}

/// A test's own region namespace; when the test's thread ends, `shmbridge gc` sweeps it
/// (the regions of the engines the test killed).
struct ThreadNamespace(String);

impl Drop for ThreadNamespace {
    fn drop(&mut self) {
        let _ = Command::new(BIN)
            .arg("gc")
            .env(shmbridge::region::NAMESPACE_ENV, &self.0)
            .output();
    }
}

/// From now on, the processes this thread (a test) starts and the names [`ns_name`] makes
/// are in a region namespace of the test's own, `<this process's>_<n>`, swept when the
/// thread ends: plain `cargo test` runs a file's tests as threads of one process, in one
/// namespace, where one test's `gc` or engine start would see another's regions (under
/// cargo-nextest a process runs one test). What the test does in this process
/// (`Engine::create`) stays in the process's namespace.
pub fn own_namespace() {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let ns = ThreadNamespace(format!("{}_{n}", process_namespace()));
    THREAD_NAMESPACE.with(|t| *t.borrow_mut() = Some(ns));
}

fn process_namespace() -> String {
    shmbridge::region::namespace()
        .unwrap()
        .expect("set before main")
}

/// The region namespace of what this thread starts: its own ([`own_namespace`]) or the
/// process's.
pub fn namespace() -> String {
    THREAD_NAMESPACE
        .with(|t| t.borrow().as_ref().map(|ns| ns.0.clone()))
        .unwrap_or_else(process_namespace)
}

/// `command` with this thread's region namespace ([`namespace`]) in its environment.
pub fn in_namespace(mut command: Command) -> Command {
    command.env(shmbridge::region::NAMESPACE_ENV, namespace());
    command
}

/// The prefix of this thread's region names: `shmbridge-<namespace>-`.
pub fn prefix() -> String {
    format!("{}{}-", shmbridge::region::PREFIX, namespace())
}

/// `short` as a region name of this thread's namespace (`shmbridge-<namespace>-short`).
pub fn ns_name(short: &str) -> String {
    format!("{}{short}", prefix())
}

/// `command` with SIGINT and SIGQUIT at their default actions, as for a program a
/// terminal runs in the foreground (what the tests that press Ctrl-C model): a test
/// runner started in the background of a non-interactive shell ignores them, and an
/// ignored signal stays ignored across `exec`.
pub fn foreground(mut command: Command) -> Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec only `signal`, which is async-signal-safe, runs.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGQUIT, libc::SIG_DFL);
            Ok(())
        });
    }
    command
}

/// An engine child process; killed and reaped on drop if still running.
pub struct EngineProc {
    pub child: Child,
    pub name: String,
}

impl EngineProc {
    /// Starts `shmbridge engine ARGS...` and reads the region name it prints once frame 0
    /// is published; the engine's stderr in the panic message if it does not serve.
    pub fn start(args: &[&str]) -> EngineProc {
        let mut child = foreground(in_namespace(Command::new(BIN)))
            .arg("engine")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn shmbridge engine");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("read region name");
        let name = line.trim().to_string();
        if name.is_empty() {
            let out = child.wait_with_output().expect("wait engine");
            panic!(
                "engine {args:?} did not serve ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(name.starts_with("shmbridge-"), "engine printed {line:?}");
        EngineProc { child, name }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the engine to exit and returns its status and stderr.
    pub fn finish(mut self) -> (std::process::ExitStatus, String) {
        let status = self.child.wait().expect("wait engine");
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        std::mem::forget(self);
        (status, err)
    }
}

impl Drop for EngineProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the region (or any shm object) `name` lives: `/dev/shm/NAME`.
pub fn shm_path(name: &str) -> PathBuf {
    Path::new("/dev/shm").join(name)
}

/// Whether `/dev/shm/NAME` exists, as anything: a link counts, even one that leads
/// nowhere.
pub fn shm_exists(name: &str) -> bool {
    shm_path(name).symlink_metadata().is_ok()
}

/// Neither the region `name` nor its fd socket (`<name>.fd`, 1.6) is left in /dev/shm.
pub fn region_gone(name: &str) -> bool {
    let socket = shmbridge::region::socket_path(name).unwrap();
    !shm_exists(name) && !shmbridge::fdpass::socket_file_exists(&socket)
}

/// `b` as native-endian `f32`s (a whole number of them).
pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// splitmix64: a test's stream of actions and masks, the same wherever it is replayed.
pub fn next_random(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Every stored input in the crate's folder `dir` (its notes, `*.md`, left out), as
/// `(file name, bytes)`; fails the test when there is none.
pub fn stored_inputs(dir: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut inputs = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        inputs.push((name, std::fs::read(&path).unwrap()));
    }
    assert!(!inputs.is_empty(), "no inputs in {}", dir.display());
    inputs
}

pub fn signal(pid: u32, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("pid");
    rustix::process::kill_process(pid, sig).expect("kill");
}

/// Set in a test re-run by [`private_shm`]: this process has its own `/dev/shm`.
const PRIVATE_SHM_ENV: &str = "SHMBRIDGE_TEST_PRIVATE_SHM";

/// Whether this process runs as root (mount namespaces, other uids, other PID
/// namespaces need it).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Runs the test `test` (this test binary's name for it) again in a private mount
/// namespace with a fresh tmpfs of `size` (`mount -o size=`, e.g. "8m") on `/dev/shm`,
/// so a test that fills, sweeps or `gc`s `/dev/shm` touches no one else's regions.
/// Returns `true` in that re-run (run the body), `false` in the caller, which has
/// asserted the re-run's success (or printed why it skipped: it needs root).
pub fn private_shm(test: &str, size: &str) -> bool {
    if std::env::var_os(PRIVATE_SHM_ENV).is_some() {
        return true;
    }
    if !is_root() {
        eprintln!("SKIPPED {test}: a private /dev/shm needs root (unshare -m, mount)");
        return false;
    }
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs -o size={size},mode=1777 shmbridge-test /dev/shm && exec \"$0\" \"$@\""
        ))
        .arg(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(PRIVATE_SHM_ENV, "1")
        .output()
        .expect("run unshare");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{test} in a private /dev/shm ({}):\n{stdout}\n{stderr}",
        out.status
    );
    eprint!("{stderr}");
    false
}

/// Sets `path`'s access and modification times to 1 s after the epoch: a file older than
/// any grace period (the sweep leaves younger unpublished files alone).
pub fn make_old(path: impl AsRef<Path>) {
    let t = rustix::fs::Timespec {
        tv_sec: 1,
        tv_nsec: 0,
    };
    let times = rustix::fs::Timestamps {
        last_access: t,
        last_modification: t,
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path.as_ref(),
        &times,
        rustix::fs::AtFlags::empty(),
    )
    .expect("utimensat");
}

/// What no run of the CLI may end with: a panic, an abort on a failed allocation, a
/// backtrace, or death by a signal. `what` names the run in the failure message.
#[allow(dead_code)]
pub fn assert_no_crash(what: &str, out: &std::process::Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "panicked",
        "RUST_BACKTRACE",
        "memory allocation of",
        "stack backtrace",
    ] {
        assert!(!stderr.contains(needle), "{what}: {needle}:\n{stderr}");
    }
    assert!(
        out.status.code().is_some(),
        "{what} died of a signal ({}):\n{stderr}",
        out.status
    );
}

#[cfg(feature = "cuda")]
/// The bytes of the client's CUDA tensor `name` in the current frame (or after the last
/// command reply): a stream waits on the engine's publication (its event; nothing for
/// memory shared by fd, ordered on the host), copies the tensor from the client's import
/// into a buffer of its own, and the bytes are read from there. Whichever way the engine
/// shares its memory (`cuda_sharing` auto may take fd where the engine runs in a
/// container).
pub fn fetch(client: &shmbridge::Client, name: &str) -> Vec<u8> {
    use shmbridge::device::cuda::driver::{DeviceAllocation, Stream};
    let cuda = client.backend().as_cuda().unwrap();
    let s = Stream::create(cuda.context()).unwrap();
    cuda.wait_frame_on(&s).unwrap();
    let (_, t) = client.layout().tensor(name).unwrap();
    let local = DeviceAllocation::new(cuda.context(), t.nbytes as usize).unwrap();
    // SAFETY: both spans are `t.nbytes` long: the client's tensor (its import, span
    // checked at attach) and `local`; ordered after the engine's publication on `s`.
    unsafe {
        s.copy_dtod(
            local.ptr(),
            client.device_ptr(name).unwrap(),
            t.nbytes as usize,
        )
    }
    .unwrap();
    s.synchronize().unwrap();
    let mut out = vec![0u8; t.nbytes as usize];
    local.read(0, &mut out).unwrap();
    out
}

/// Returns once thread `tid` of this process is asleep in a futex wait (its `wchan`): a
/// waiter that checks before it parks has checked and parked, so what the test does now
/// happens while it sleeps, not between its last check and its next access.
pub fn until_asleep(tid: i32) {
    let wchan = format!("/proc/self/task/{tid}/wchan");
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !std::fs::read_to_string(&wchan)
        .unwrap_or_default()
        .contains("futex")
    {
        assert!(
            std::time::Instant::now() < give_up,
            "thread {tid} never slept"
        );
        std::thread::yield_now();
    }
}
