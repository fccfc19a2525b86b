//! The contract every device backend passes: the same cases, instantiated once per
//! backend by `contract!` (at the end of this file), against a real `shmbridge engine`
//! process serving the `null` env with its image tensor `rgb` in that backend's memory, and
//! a client in this process:
//! - publish and import: every frame's bytes arrive whole, frame after frame;
//! - zero copy: the client's view is the engine's memory (the region, or the imported
//!   device memory), not a copy;
//! - release ordering: the engine reads the actions written before each step (its rewards
//!   echo them), and the client reads the frame published for that step, every time;
//! - peer death mid-frame: the engine killed after the client posted its action and before
//!   the frame: the wait ends in `PeerDied`, and the client's close leaves nothing;
//! - a region that shrinks under the client: `RegionTooSmall`, never a crash, and it sticks;
//! - fork: a child forked from the client's process drops its copy of the client; the
//!   parent's session (region, imports) goes on.
//!
//! A backend is a `Backend`: the engine's arguments that put `rgb` in its memory, how the
//! client reads those bytes and writes its actions, and what "zero copy" means for it. A
//! backend that cannot run here (no Vulkan driver, no GPU) prints `SKIPPED <why>` and
//! passes. A new backend adds its `Backend` and one `contract!` line.

mod common;

use std::time::Duration;

use common::{region_gone, shm_path, EngineProc};
use shmbridge::envs::null::pattern_u8;
use shmbridge::{AttachOptions, Client, Error};

const T: Duration = Duration::from_secs(30);
/// The image the engine renders: 16x16, 4 channels (`rgb`, u8).
const IMAGE: &str = "16x16x4";
const NUM_ENVS: usize = 4;
const ACT_DIM: usize = 2;

trait Backend {
    /// Why this backend cannot run here, or `None`.
    fn unavailable() -> Option<String>;
    /// `shmbridge engine` arguments that put the `null` engine's `rgb` in this backend's
    /// memory.
    fn engine_args() -> Vec<&'static str>;
    /// The bytes of the client's view of `rgb` in the current frame.
    fn read_rgb(client: &mut Client) -> Vec<u8>;
    /// Writes every element of the client's `actions` as `value`, then steps (waiting at
    /// most `timeout` for the frame).
    fn step_within(client: &mut Client, value: f32, timeout: Duration) -> Result<u64, Error>;
    /// Asserts that the client's view of `rgb` is the engine's memory, not a copy (in the
    /// memory this backend maps or imports); returns its address, which the case checks
    /// is the same at the next frame.
    fn assert_zero_copy(client: &mut Client, region: &str) -> u64;
    /// [`Backend::step_within`] the usual timeout.
    fn step_with_actions(client: &mut Client, value: f32) -> Result<u64, Error> {
        Self::step_within(client, value, T)
    }
}

fn skipped<B: Backend>(case: &str) -> bool {
    match B::unavailable() {
        Some(why) => {
            eprintln!("SKIPPED {case}: {why}");
            true
        }
        None => false,
    }
}

fn start<B: Backend>() -> (EngineProc, Client) {
    let num_envs = NUM_ENVS.to_string();
    let act_dim = ACT_DIM.to_string();
    let mut args = vec![
        "--env",
        "null",
        "--num-envs",
        &num_envs,
        "--act-dim",
        &act_dim,
        "--obs-dim",
        "256",
        "--image",
        IMAGE,
        "--blocking",
    ];
    args.extend(B::engine_args());
    let engine = EngineProc::start(&args);
    let client = Client::attach(&engine.name, AttachOptions::default().timeout(T)).unwrap();
    (engine, client)
}

fn assert_frame<B: Backend>(client: &mut Client, seq: u64) {
    let bytes = B::read_rgb(client);
    assert!(!bytes.is_empty());
    for (i, b) in bytes.iter().enumerate() {
        assert_eq!(*b, pattern_u8(seq, i as u64), "frame {seq}, byte {i}");
    }
}

fn finish(client: Client, engine: EngineProc) {
    let name = engine.name.clone();
    client.close();
    let (status, stderr) = engine.finish();
    assert!(status.success(), "{status}: {stderr}");
    assert!(region_gone(&name), "{name} or its socket left");
}

fn publish_and_import<B: Backend>() {
    if skipped::<B>("publish_and_import") {
        return;
    }
    let (engine, mut client) = start::<B>();
    assert_frame::<B>(&mut client, 0);
    for seq in 1..=20 {
        assert_eq!(B::step_with_actions(&mut client, 0.0).unwrap(), seq);
        assert_frame::<B>(&mut client, seq);
    }
    finish(client, engine);
}

fn zero_copy<B: Backend>() {
    if skipped::<B>("zero_copy") {
        return;
    }
    let (engine, mut client) = start::<B>();
    let first = B::assert_zero_copy(&mut client, &engine.name);
    B::step_with_actions(&mut client, 0.0).unwrap();
    assert_eq!(B::assert_zero_copy(&mut client, &engine.name), first);
    finish(client, engine);
}

fn release_ordering<B: Backend>() {
    if skipped::<B>("release_ordering") {
        return;
    }
    let (engine, mut client) = start::<B>();
    for seq in 1..=200u64 {
        let value = seq as f32 * 0.5;
        assert_eq!(B::step_with_actions(&mut client, value).unwrap(), seq);
        // The engine's rewards echo the first action of each env (host memory in every
        // backend's `null` engine but CUDA's, whose rewards are read like its frame).
        assert_frame::<B>(&mut client, seq);
        let rewards = rewards::<B>(&mut client);
        assert_eq!(rewards, vec![value; NUM_ENVS], "frame {seq}");
    }
    finish(client, engine);
}

/// The client's `rewards` of the current frame.
fn rewards<B: Backend>(client: &mut Client) -> Vec<f32> {
    let t = client.layout().tensor("rewards").unwrap().1.clone();
    if t.location() == shmbridge::Location::Cuda {
        #[cfg(feature = "cuda")]
        return common::f32s(&cuda_backend::fetch(client, "rewards"));
    }
    client.tensors().read::<f32>("rewards").unwrap().to_vec()
}

fn peer_death_mid_frame<B: Backend>() {
    if skipped::<B>("peer_death_mid_frame") {
        return;
    }
    let (engine, mut client) = start::<B>();
    let name = engine.name.clone();
    B::step_with_actions(&mut client, 1.0).unwrap();
    // The engine stopped: the client's next action is posted and its frame never comes.
    common::signal(engine.pid(), rustix::process::Signal::STOP);
    match B::step_within(&mut client, 2.0, Duration::from_millis(100)) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("a stopped engine's frame: expected Timeout, got {other:?}"),
    }
    common::signal(engine.pid(), rustix::process::Signal::KILL);
    let (status, _) = engine.finish();
    assert!(!status.success());
    match client.wait_frame(T) {
        Err(Error::PeerDied { .. }) => {}
        other => panic!("the engine killed mid-frame: expected PeerDied, got {other:?}"),
    }
    client.close();
    assert!(
        region_gone(&name),
        "the client left the dead engine's {name}"
    );
}

fn region_shrinks<B: Backend>() {
    if skipped::<B>("region_shrinks") {
        return;
    }
    let (engine, mut client) = start::<B>();
    B::step_with_actions(&mut client, 1.0).unwrap();
    // The engine stopped, so that only the client meets the shrunk region.
    common::signal(engine.pid(), rustix::process::Signal::STOP);
    let path = shm_path(&engine.name);
    let mapped = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4096)
        .unwrap();
    // The step alone: writing the actions would touch the shrunk mapping (SIGBUS, as any
    // access of a truncated file's pages; the library's own accesses check first).
    for what in ["step", "step again"] {
        match client.step(T) {
            Err(Error::RegionTooSmall { needed, actual }) => {
                assert_eq!((needed, actual), (mapped, 4096), "{what}")
            }
            other => panic!("{what} in a shrunk region: expected RegionTooSmall, got {other:?}"),
        }
    }
    common::signal(engine.pid(), rustix::process::Signal::KILL);
    let _ = engine.finish();
    drop(client);
    let _ = std::fs::remove_file(&path);
}

fn fork<B: Backend>() {
    if skipped::<B>("fork") {
        return;
    }
    let (engine, mut client) = start::<B>();
    B::step_with_actions(&mut client, 1.0).unwrap();
    // SAFETY: the child only drops its copy of the client (system calls and frees;
    // glibc's fork keeps malloc usable in the child) and exits without running anything
    // else.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        drop(client);
        // SAFETY: ends the child without unwinding into the test harness.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    assert!(common::shm_exists(&engine.name));
    for seq in 2..=5 {
        assert_eq!(B::step_with_actions(&mut client, 3.0).unwrap(), seq);
        assert_frame::<B>(&mut client, seq);
    }
    finish(client, engine);
}

/// One `#[test]` per case for backend `$backend` (a `Backend`), in module `$module`.
macro_rules! contract {
    ($module:ident, $backend:ty) => {
        mod $module {
            #[test]
            fn publish_and_import() {
                super::publish_and_import::<$backend>()
            }
            #[test]
            fn zero_copy() {
                super::zero_copy::<$backend>()
            }
            #[test]
            fn release_ordering() {
                super::release_ordering::<$backend>()
            }
            #[test]
            fn peer_death_mid_frame() {
                super::peer_death_mid_frame::<$backend>()
            }
            #[test]
            fn region_shrinks() {
                super::region_shrinks::<$backend>()
            }
            #[test]
            fn fork() {
                super::fork::<$backend>()
            }
        }
    };
}

// ---- Host memory: the tensors live in the region ----

struct Host;

/// Whether `addr` lies in this process's mapping of `/dev/shm/<region>`.
fn in_mapping_of(addr: usize, region: &str) -> bool {
    let path = shm_path(region);
    let path = path.to_str().unwrap();
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.ends_with(path))
        .any(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (lo, hi) = range.split_once('-').unwrap();
            let lo = usize::from_str_radix(lo, 16).unwrap();
            let hi = usize::from_str_radix(hi, 16).unwrap();
            (lo..hi).contains(&addr)
        })
}

fn host_read_rgb(client: &mut Client) -> Vec<u8> {
    client.tensors().read::<u8>("rgb").unwrap().to_vec()
}

fn host_step_within(client: &mut Client, value: f32, timeout: Duration) -> Result<u64, Error> {
    client.tensor_mut::<f32>("actions")?.fill(value);
    client.step(timeout)
}

impl Backend for Host {
    fn unavailable() -> Option<String> {
        None
    }
    fn engine_args() -> Vec<&'static str> {
        vec![]
    }
    fn read_rgb(client: &mut Client) -> Vec<u8> {
        host_read_rgb(client)
    }
    fn step_within(client: &mut Client, value: f32, timeout: Duration) -> Result<u64, Error> {
        host_step_within(client, value, timeout)
    }
    fn assert_zero_copy(client: &mut Client, region: &str) -> u64 {
        let addr = client.tensors().address("rgb").unwrap() as usize;
        assert!(
            in_mapping_of(addr, region),
            "rgb at {addr:#x} is not in the region's mapping"
        );
        assert_eq!(
            client.dlpack_device("rgb").unwrap(),
            (shmbridge::device::DL_CPU, 0)
        );
        addr as u64
    }
}

contract!(host, super::Host);

// ---- Vulkan: the engine's exported memory, imported into the client's own device ----

#[cfg(feature = "vulkan")]
struct Vulkan;

#[cfg(feature = "vulkan")]
impl Backend for Vulkan {
    fn unavailable() -> Option<String> {
        use shmbridge::device::vulkan::vk::Context;
        match Context::open(shmbridge::device::VulkanDevice::ANY) {
            Ok(_) => None,
            Err(Error::VulkanUnavailable { reason }) => Some(reason),
            Err(e) => panic!("probing Vulkan gave {e}, not VulkanUnavailable"),
        }
    }
    fn engine_args() -> Vec<&'static str> {
        vec!["--image-device", "vulkan"]
    }
    fn read_rgb(client: &mut Client) -> Vec<u8> {
        host_read_rgb(client)
    }
    fn step_within(client: &mut Client, value: f32, timeout: Duration) -> Result<u64, Error> {
        host_step_within(client, value, timeout)
    }
    fn assert_zero_copy(client: &mut Client, region: &str) -> u64 {
        let rgb = client.layout().id("rgb").unwrap();
        assert_eq!(
            client.layout().tensors[rgb.index()].location(),
            shmbridge::Location::Vulkan
        );
        let ptr = client.device_ptr(rgb).unwrap();
        let mut io = client.tensors();
        // The view is the mapping of the imported memory, not the region, not a copy.
        assert_eq!(io.address(rgb).unwrap() as u64, ptr);
        assert_eq!(io.read::<u8>(rgb).unwrap().as_ptr() as u64, ptr);
        assert!(!in_mapping_of(ptr as usize, region));
        ptr
    }
}

#[cfg(feature = "vulkan")]
contract!(vulkan, super::Vulkan);

// ---- CUDA: the engine's allocation, shared by IPC handle or by file descriptor ----

#[cfg(feature = "cuda")]
mod cuda_backend {
    use shmbridge::device::cuda::driver::{DeviceAllocation, Driver, PrimaryContext, Stream};
    use shmbridge::device::cuda::kernel;
    use shmbridge::{Client, Error};
    use std::time::Duration;

    /// `Cuda<false>` shares the engine's allocation by CUDA IPC handle, `Cuda<true>` by
    /// its file descriptor over the region's fd socket (1.9): the same contract.
    pub struct Cuda<const FD: bool>;

    pub use crate::common::fetch;

    impl<const FD: bool> super::Backend for Cuda<FD> {
        fn unavailable() -> Option<String> {
            let d = match Driver::get() {
                Ok(d) => d,
                Err(e) => return Some(e.to_string()),
            };
            if let Err(e) = PrimaryContext::retain(d, 0) {
                return Some(e.to_string());
            }
            // The `null` engine on CUDA compiles its kernels with NVRTC.
            match kernel::compile(d, "empty.cu", "extern \"C\" __global__ void k() {}", &[]) {
                Ok(_) => None,
                Err(e @ Error::CudaUnavailable { .. }) => Some(e.to_string()),
                Err(e) => panic!("{e}"),
            }
        }
        fn engine_args() -> Vec<&'static str> {
            let sharing = if FD { "fd" } else { "ipc" };
            vec!["--device", "cuda", "--cuda-sharing", sharing]
        }
        fn read_rgb(client: &mut Client) -> Vec<u8> {
            fetch(client, "rgb")
        }
        fn step_within(client: &mut Client, value: f32, timeout: Duration) -> Result<u64, Error> {
            let (_, t) = client.layout().tensor("actions").unwrap();
            let bytes: Vec<u8> = std::iter::repeat_n(value, t.nbytes as usize / 4)
                .flat_map(f32::to_le_bytes)
                .collect();
            let context = client.backend().as_cuda().unwrap().context().clone();
            let stream = Stream::create(&context).unwrap();
            let staging = DeviceAllocation::new(&context, bytes.len()).unwrap();
            staging.write(0, &bytes).unwrap();
            let dst = client.device_ptr("actions").unwrap();
            // SAFETY: `dst` is the client's `actions` tensor of `bytes.len()` bytes and the
            // source our staging buffer, which lives until the stream is synchronized below.
            unsafe { stream.copy_dtod(dst, staging.ptr(), bytes.len()).unwrap() };
            let seq = client.step_on(&stream, timeout);
            stream.synchronize().unwrap();
            seq
        }
        fn assert_zero_copy(client: &mut Client, _region: &str) -> u64 {
            let t = client.layout().tensor("rgb").unwrap().1.clone();
            assert_eq!(t.location(), shmbridge::Location::Cuda);
            let i = "rgb";
            // The engine's allocation opened once, in this process's device memory.
            let ptr = client.device_ptr(i).unwrap();
            assert_ne!(ptr, 0);
            assert_eq!(
                client.dlpack_device(i).unwrap().0,
                shmbridge::device::DL_CUDA
            );
            ptr
        }
    }
}

#[cfg(feature = "cuda")]
contract!(cuda, super::cuda_backend::Cuda<false>);
#[cfg(feature = "cuda")]
contract!(cuda_fd, super::cuda_backend::Cuda<true>);
