//! Vulkan tensors (protocol 1.3) on a real Vulkan driver (lavapipe in CI): frames
//! exported by an engine reach the client through fds passed over the region's socket,
//! imported into the client's own Vulkan device and mapped, with no copy. Every test
//! skips with the reason where no Vulkan loader or driver is present.
#![cfg(feature = "vulkan")]

mod common;

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use common::{region_gone, shm_exists, EngineProc};
use shmbridge::device::vulkan::export::VulkanExport;
use shmbridge::device::vulkan::vk::{Context, ExportedBuffer};
use shmbridge::device::{VulkanDevice, DL_CPU};
use shmbridge::envs::null::pattern_u8;
use shmbridge::envs::pixels::{render_reference, DrawParams, FrameShape, StackUpdate};
use shmbridge::fdpass;
use shmbridge::layout::TensorSpec;
use shmbridge::region;
use shmbridge::{AttachOptions, Client, DType, Direction, Engine, EngineSpec, Error};

const T: Duration = Duration::from_secs(30);

/// The tests count this process's fds: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A Vulkan device of this process, or `None` (with the reason printed) where there is
/// no loader or driver.
fn vulkan() -> Option<std::sync::Arc<Context>> {
    match Context::open(VulkanDevice::ANY) {
        Ok(c) => Some(c),
        Err(Error::VulkanUnavailable { reason }) => {
            eprintln!("SKIPPED: {reason}");
            None
        }
        Err(e) => panic!("probing Vulkan gave {e}, not VulkanUnavailable"),
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn engine_frames_reach_the_client_through_its_mapping() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let engine = EngineProc::start(&[
        "--env",
        "null",
        "--num-envs",
        "4",
        "--obs-dim",
        "4",
        "--image",
        "8x8x4",
        "--image-device",
        "vulkan",
        "--blocking",
    ]);
    let name = engine.name.clone();
    assert!(fdpass::socket_file_exists(
        &region::socket_path(&name).unwrap()
    ));
    // `inspect` prints the table's Vulkan fields.
    let inspect = std::process::Command::new(common::BIN)
        .args(["inspect", &name])
        .output()
        .unwrap();
    let inspect = String::from_utf8_lossy(&inspect.stdout);
    let ids = vulkan().unwrap().ids();
    let want = format!(
        "vulkan device_uuid {} driver_uuid {} alloc_size ",
        shmbridge::device::location::uuid_hex(&ids.device_uuid),
        shmbridge::device::location::uuid_hex(&ids.driver_uuid)
    );
    assert!(inspect.contains(&want), "{want:?} not in:\n{inspect}");
    assert!(
        inspect.contains("dedicated yes semaphore none"),
        "{inspect}"
    );
    let mut c = Client::attach(&name, AttachOptions::default()).unwrap();
    let rgb = c.layout().id("rgb").unwrap();
    let info = c.layout().tensors[rgb.index()].clone();
    assert_eq!(info.location().name(), "vulkan");
    assert!(info.vulkan.unwrap().alloc_size >= info.nbytes);
    assert_eq!(c.dlpack_device(rgb).unwrap(), (DL_CPU, 0));
    let reason = c
        .backend()
        .as_vulkan()
        .unwrap()
        .importer_reason()
        .to_string();
    assert!(reason.contains("Vulkan importer"), "{reason}");
    let ptr = c.device_ptr(rgb).unwrap();
    for step in 0..=50u64 {
        if step > 0 {
            c.tensor_mut::<f32>("actions").unwrap().fill(step as f32);
            assert_eq!(c.step(T).unwrap(), step);
        }
        let mut io = c.tensors();
        // No client-side copy: the view is the mapping of the engine's memory.
        assert_eq!(io.address(rgb).unwrap() as u64, ptr);
        // The views give the client's device address, as the client does.
        assert_eq!(io.device_ptr(rgb).unwrap(), ptr);
        let bytes = io.read::<u8>(rgb).unwrap();
        assert_eq!(bytes.as_ptr() as u64, ptr);
        for (i, b) in bytes.iter().enumerate() {
            assert_eq!(*b, pattern_u8(step, i as u64), "step {step} byte {i}");
        }
    }
    c.close();
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
    assert!(region_gone(&name));
}

/// The engine's own renderer (here a test-side Vulkan device) exported the memory.
fn renderer_export(
    ctx: &std::sync::Arc<Context>,
    nbytes: u64,
) -> (ExportedBuffer, OwnedFd, VulkanExport) {
    let buffer = ExportedBuffer::allocate(ctx, nbytes).unwrap();
    let fd = buffer.fd().as_fd().try_clone_to_owned().unwrap();
    let t = buffer.table();
    let ids = ctx.ids();
    let export = VulkanExport {
        alloc_size: t.alloc_size,
        offset: 0,
        memory_type_index: t.memory_type_index,
        dedicated: t.dedicated,
        device_uuid: ids.device_uuid,
        driver_uuid: ids.driver_uuid,
    };
    (buffer, fd, export)
}

fn spec_with(tensor: TensorSpec) -> EngineSpec {
    let mut spec =
        EngineSpec::new("render", 1).tensor("obs", DType::F32, &[1, 4], Direction::EngineToClient);
    spec.tensors.push(tensor);
    spec
}

#[test]
fn memory_the_renderer_exported_is_imported_without_a_copy() {
    let _serial = serial();
    let Some(ctx) = vulkan() else { return };
    let (buffer, fd, export) = renderer_export(&ctx, 4096);
    let mapped = buffer.mapped().expect("lavapipe memory is host-visible");
    let mut engine = Engine::create(spec_with(TensorSpec::vulkan_import(
        "frame",
        DType::U8,
        &[64, 64],
        fd,
        export,
    )))
    .unwrap();
    let name = engine.name().to_string();
    engine.publish().unwrap();
    let mut c = Client::attach(&name, AttachOptions::default()).unwrap();
    // The renderer writes through its own mapping; the client sees the bytes in its.
    for round in 0..3u8 {
        // SAFETY: 4096 mapped bytes of the test's own buffer.
        unsafe { std::ptr::write_bytes(mapped.as_ptr(), 7 + round, 4096) };
        let ptr = c.device_ptr("frame").unwrap();
        let view = c.tensor::<u8>("frame").unwrap();
        assert_eq!(view.as_ptr() as u64, ptr);
        assert_ne!(
            view.as_ptr(),
            mapped.as_ptr() as *const u8,
            "the client's own mapping"
        );
        assert!(view.iter().all(|&b| b == 7 + round));
    }
    c.close();
    engine.close();
    drop(buffer);
    assert!(region_gone(&name));
}

#[test]
fn fds_do_not_grow_over_200_attach_close_cycles() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let spec = EngineSpec::new("render", 2)
        .tensor("obs", DType::F32, &[2, 4], Direction::EngineToClient)
        .tensor_on(
            "rgb",
            DType::U8,
            &[2, 16, 16, 4],
            Direction::EngineToClient,
            shmbridge::device::Device::Vulkan(VulkanDevice::ANY),
        );
    let mut engine = Engine::create(spec).unwrap();
    let name = engine.name().to_string();
    engine.tensors().write::<u8>("rgb").unwrap().fill(42);
    engine.publish().unwrap();
    // Warm up (the loader and driver open what they keep for the process).
    Client::attach(&name, AttachOptions::default())
        .unwrap()
        .close();
    let before = open_fds();
    for _ in 0..200 {
        let mut c = Client::attach(&name, AttachOptions::default()).unwrap();
        assert!(c.tensor::<u8>("rgb").unwrap().iter().all(|&b| b == 42));
        c.close();
    }
    assert_eq!(
        open_fds(),
        before,
        "fds leaked over 200 attach/close cycles"
    );
    engine.close();
    assert!(region_gone(&name));
}

#[test]
fn an_fd_smaller_than_declared_is_a_typed_error() {
    let _serial = serial();
    let Some(ctx) = vulkan() else { return };
    // The engine checks the size it sees (a memfd's) at creation: the fd shrinks after.
    let fd = rustix::fs::memfd_create("short", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, 1 << 20).unwrap();
    let ids = ctx.ids();
    let export = VulkanExport {
        alloc_size: 1 << 20,
        offset: 0,
        memory_type_index: 0,
        dedicated: false,
        device_uuid: ids.device_uuid,
        driver_uuid: ids.driver_uuid,
    };
    let before = open_fds();
    let shrink = fd.try_clone().unwrap();
    let mut engine = Engine::create(spec_with(TensorSpec::vulkan_import(
        "frame",
        DType::U8,
        &[1 << 20],
        fd,
        export,
    )))
    .unwrap();
    rustix::fs::ftruncate(&shrink, 4096).unwrap();
    drop(shrink);
    let name = engine.name().to_string();
    engine.publish().unwrap();
    let e = Client::attach(&name, AttachOptions::default()).unwrap_err();
    match &e {
        Error::InvalidTensor { tensor, reason } => {
            assert_eq!(tensor, "frame");
            assert!(reason.contains("4096"), "{reason}");
        }
        e => panic!("expected InvalidTensor, got {e}"),
    }
    engine.close();
    assert!(region_gone(&name));
    // The memfd (owned by the spec, then the engine) and the client's copy are closed.
    assert_eq!(open_fds(), before - 1);
}

#[test]
fn a_device_uuid_nobody_has_is_a_typed_error() {
    let _serial = serial();
    let Some(ctx) = vulkan() else { return };
    let (buffer, fd, mut export) = renderer_export(&ctx, 4096);
    export.device_uuid = [0xab; 16];
    let mut engine = Engine::create(spec_with(TensorSpec::vulkan_import(
        "frame",
        DType::U8,
        &[4096],
        fd,
        export,
    )))
    .unwrap();
    let name = engine.name().to_string();
    engine.publish().unwrap();
    match Client::attach(&name, AttachOptions::default()).unwrap_err() {
        Error::VulkanUnavailable { reason } => {
            assert!(reason.contains("abababab"), "{reason}")
        }
        e => panic!("expected VulkanUnavailable, got {e}"),
    }
    engine.close();
    drop(buffer);
    assert!(region_gone(&name));
}

/// Run as `nobody` by the next test: connects to the region's socket as another user.
#[test]
fn child_connect_as_other_user() {
    let Ok(name) = std::env::var("SHMBRIDGE_TEST_FD_SOCKET") else {
        return;
    };
    let path = region::socket_path(&name).unwrap();
    let proof = rustix::fs::memfd_create("proof", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    match fdpass::request(&name, &path, proof.as_fd(), 1, T) {
        Err(Error::PermissionDenied { .. }) => println!("REFUSED: PermissionDenied"),
        other => println!("NOT REFUSED: {other:?}"),
    }
}

#[test]
fn a_peer_of_another_user_gets_no_fd() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    if fdpass::euid() != 0 {
        eprintln!("SKIPPED: dropping to another user needs root");
        return;
    }
    if std::process::Command::new("setpriv")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED: setpriv (util-linux) is not installed");
        return;
    }
    let spec = EngineSpec::new("render", 1)
        .tensor("obs", DType::F32, &[1, 4], Direction::EngineToClient)
        .tensor_on(
            "rgb",
            DType::U8,
            &[1, 8, 8, 4],
            Direction::EngineToClient,
            shmbridge::device::Device::Vulkan(VulkanDevice::ANY),
        );
    let mut engine = Engine::create(spec).unwrap();
    let name = engine.name().to_string();
    engine.publish().unwrap();
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_connect_as_other_user",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SHMBRIDGE_TEST_FD_SOCKET", &name)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("REFUSED: PermissionDenied"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The engine still serves its own client.
    let c = Client::attach(&name, AttachOptions::default()).unwrap();
    c.close();
    engine.close();
    assert!(region_gone(&name));
}

/// The client's CPU copy of a `pixels` engine's stacks, advanced frame by frame by the
/// reference renderer from the observations the client reads and the stack updates it
/// can tell from its own flags (what it reset, what ended).
struct ReferenceStacks {
    num_envs: u32,
    shape: FrameShape,
    stacks: Vec<u8>,
}

impl ReferenceStacks {
    fn new(c: &Client) -> ReferenceStacks {
        let rgb = c.layout().id("rgb").unwrap();
        let s = &c.layout().tensors[rgb.index()].shape;
        assert_eq!(s.len(), 5, "rgb is [N, K, H, W, C]: {s:?}");
        let shape = FrameShape {
            height: s[2] as u32,
            width: s[3] as u32,
            channels: s[4] as u32,
            stack: s[1] as u32,
        };
        let bytes = (s[0] * s[1] * s[2] * s[3] * s[4]) as usize;
        ReferenceStacks {
            num_envs: s[0] as u32,
            shape,
            stacks: vec![0; bytes],
        }
    }

    /// Draws `obs` into the stacks as `updates` say; returns them.
    fn advance(&mut self, obs: &[f32], updates: &[StackUpdate]) -> &[u8] {
        let mut params = DrawParams::new(self.num_envs, self.shape);
        params.set_states(obs, updates);
        render_reference(&params, &mut self.stacks).unwrap();
        &self.stacks
    }

    /// The updates of a step: an env reset by the mask or done this step restarts.
    fn after_step(c: &mut Client) -> Vec<StackUpdate> {
        let mut io = c.tensors();
        let mask = io.read::<u8>("reset_mask").unwrap();
        let term = io.read::<u8>("terminated").unwrap();
        let trunc = io.read::<u8>("truncated").unwrap();
        (0..mask.len())
            .map(|i| {
                if mask[i] != 0 || term[i] != 0 || trunc[i] != 0 {
                    StackUpdate::Restart
                } else {
                    StackUpdate::Push
                }
            })
            .collect()
    }
}

/// The stacks the `pixels` engine drew (its shader, or the host renderer), read through
/// the client's view, against the CPU reference advanced with the observations the
/// client read in the same frame. Every env that restarted holds one frame in all slots.
fn pixels_frame_matches_reference(
    c: &mut Client,
    ptr: u64,
    reference: &mut ReferenceStacks,
    updates: &[StackUpdate],
    what: &str,
) -> Vec<u8> {
    let mut io = c.tensors();
    let obs = io.read::<f32>("obs").unwrap().to_vec();
    let rgb = io.read::<u8>("rgb").unwrap();
    // No client-side copy.
    assert_eq!(rgb.as_ptr() as u64, ptr, "{what}");
    let s = reference.shape;
    let want = reference.advance(&obs, updates);
    let (h, w, ch, k) = (
        s.height as usize,
        s.width as usize,
        s.channels as usize,
        s.stack as usize,
    );
    if rgb != want {
        let i = rgb.iter().zip(want).position(|(a, b)| a != b).unwrap();
        let px = i / ch;
        panic!(
            "{what}: byte {i} (env {}, slot {}, y {}, x {}, channel {}) is {}, the CPU \
             reference {}",
            px / (k * h * w),
            (px / (h * w)) % k,
            (px / w) % h,
            px % w,
            i % ch,
            rgb[i],
            want[i]
        );
    }
    let frame = h * w * ch;
    for (e, u) in updates.iter().enumerate() {
        if *u == StackUpdate::Restart {
            let stack = &rgb[e * k * frame..(e + 1) * k * frame];
            assert!(
                stack.chunks_exact(frame).all(|f| f == &stack[..frame]),
                "{what}: env {e} restarted, its stack holds other frames"
            );
        }
    }
    rgb.to_vec()
}

/// 200 steps of a `pixels` engine with resets through the mask, autoresets and `Reset`
/// commands: every stack equals the CPU reference's, byte for byte.
fn pixels_stacks_equal_the_cpu_reference(image: &str, stack: &str, image_device: &str) {
    // An odd size, so that rows and envs do not line up with workgroups.
    let engine = EngineProc::start(&[
        "--env",
        "pixels",
        "--num-envs",
        "6",
        "--image",
        image,
        "--frame-stack",
        stack,
        "--image-device",
        image_device,
        "--seed",
        "11",
        "--blocking",
    ]);
    let name = engine.name.clone();
    let mut c = Client::attach(&name, AttachOptions::default()).unwrap();
    let rgb = c.layout().id("rgb").unwrap();
    let shape = c.layout().tensors[rgb.index()].shape.clone();
    let dims: Vec<u64> = image.split('x').map(|d| d.parse().unwrap()).collect();
    let want = [6, stack.parse().unwrap(), dims[0], dims[1], dims[2]];
    assert_eq!(shape, want);
    assert_eq!(c.dlpack_device(rgb).unwrap(), (DL_CPU, 0));
    let ptr = c.tensors().address("rgb").unwrap() as u64;
    let mut reference = ReferenceStacks::new(&c);
    let all = |u| vec![u; 6];
    let mut previous = pixels_frame_matches_reference(
        &mut c,
        ptr,
        &mut reference,
        &all(StackUpdate::Restart),
        "frame 0",
    );
    let (mut resets, mut ended) = (0, 0);
    for step in 1..=200u64 {
        {
            let mut io = c.tensors();
            // Push every env the same way for 6 steps, then the other way: the poles
            // swing and the carts travel (and episodes end).
            let push = (step / 6) % 2;
            io.write::<i64>("actions")
                .unwrap()
                .iter_mut()
                .enumerate()
                .for_each(|(i, a)| *a = ((push + i as u64) % 2) as i64);
            // Every 25 steps env 2 is reset through the mask.
            let mask = io.write::<u8>("reset_mask").unwrap();
            mask.fill(0);
            if step % 25 == 0 {
                mask[2] = 1;
                resets += 1;
            }
        }
        assert_eq!(c.step(T).unwrap(), step);
        let updates = ReferenceStacks::after_step(&mut c);
        ended += updates
            .iter()
            .filter(|&&u| u == StackUpdate::Restart)
            .count();
        let frame = pixels_frame_matches_reference(
            &mut c,
            ptr,
            &mut reference,
            &updates,
            &format!("step {step}"),
        );
        assert_ne!(
            frame, previous,
            "step {step}: the frame did not change with the state"
        );
        previous = frame;
        // Every 40 steps a reset command with seeds re-renders the listed envs; the
        // others' stacks stay.
        if step % 40 == 0 {
            c.reset(Some(&[0, 5]), &[step, step + 1], T).unwrap();
            resets += 2;
            let mut updates = all(StackUpdate::Keep);
            updates[0] = StackUpdate::Restart;
            updates[5] = StackUpdate::Restart;
            let frame = pixels_frame_matches_reference(
                &mut c,
                ptr,
                &mut reference,
                &updates,
                &format!("reset after {step}"),
            );
            assert_ne!(
                frame, previous,
                "reset after {step}: the frame did not change"
            );
            previous = frame;
        }
    }
    assert_eq!(resets, 8 + 2 * 5);
    assert!(
        ended > resets / 2 + 6,
        "episodes ended by themselves too: {ended}"
    );
    c.close();
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
    assert!(region_gone(&name));
}

#[test]
fn pixels_frames_equal_the_cpu_reference_over_200_steps_with_resets() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    pixels_stacks_equal_the_cpu_reference("37x53x4", "3", "vulkan");
}

#[test]
fn pixels_grey_and_rgb_stacks_equal_the_cpu_reference() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    pixels_stacks_equal_the_cpu_reference("30x46x1", "4", "vulkan");
    pixels_stacks_equal_the_cpu_reference("20x28x3", "1", "vulkan");
    // Large enough that the shader's float estimate of a pixel's row is corrected.
    pixels_stacks_equal_the_cpu_reference("84x84x3", "2", "vulkan");
}

/// The host path draws the same stacks into the region's shared memory (no Vulkan
/// needed).
#[test]
fn pixels_on_the_host_equal_the_cpu_reference() {
    let _serial = serial();
    pixels_stacks_equal_the_cpu_reference("37x53x4", "3", "host");
    pixels_stacks_equal_the_cpu_reference("30x46x1", "2", "host");
}

/// On a machine whose Vulkan device is a CUDA device (an NVIDIA GPU and its Vulkan
/// driver): the CUDA importer's frames are the engine's memory (kDLCUDA, one device
/// address throughout) and equal the CPU reference. Skips with the reason elsewhere
/// (lavapipe memory cannot be imported into CUDA).
#[cfg(feature = "cuda")]
#[test]
fn cuda_importer_frames_equal_the_cpu_reference() {
    use shmbridge::device::location::DL_CUDA;
    use shmbridge::device::vulkan::VulkanImporter;
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let engine = EngineProc::start(&[
        "--env",
        "pixels",
        "--num-envs",
        "4",
        "--image",
        "21x30x4",
        "--seed",
        "3",
        "--blocking",
    ]);
    let options = AttachOptions::default().importer(VulkanImporter::Cuda);
    let mut c = match Client::attach(&engine.name, options) {
        Ok(c) => c,
        Err(Error::CudaUnavailable { reason }) => {
            eprintln!("SKIPPED cuda_importer_frames_equal_the_cpu_reference: {reason}");
            // The engine waits for a client: stop it the way that removes its region.
            common::signal(engine.pid(), rustix::process::Signal::TERM);
            let _ = engine.finish();
            return;
        }
        Err(e) => panic!("attaching with the CUDA importer: {e}"),
    };
    let rgb = c.layout().id("rgb").unwrap();
    let info = c.layout().tensors[rgb.index()].clone();
    let vk = c.backend().as_vulkan().unwrap();
    assert!(vk.imports_into_device(), "{}", vk.importer_reason());
    assert_eq!(c.dlpack_device(rgb).unwrap().0, DL_CUDA);
    let ptr = c.device_ptr(rgb).unwrap();
    let mut frame = vec![0u8; info.nbytes as usize];
    let mut reference = ReferenceStacks::new(&c);
    for step in 0..=60u64 {
        let updates = if step > 0 {
            c.tensor_mut::<i64>("actions")
                .unwrap()
                .fill((step / 5 % 2) as i64);
            c.step(T).unwrap();
            ReferenceStacks::after_step(&mut c)
        } else {
            vec![StackUpdate::Restart; 4]
        };
        assert_eq!(c.device_ptr(rgb).unwrap(), ptr, "the import is not re-made");
        assert_eq!(
            c.tensors().device_ptr(rgb).unwrap(),
            ptr,
            "the views' address"
        );
        let obs = c.tensor::<f32>("obs").unwrap().to_vec();
        c.backend()
            .as_vulkan()
            .unwrap()
            .read_tensor(rgb.index(), &info, &mut frame)
            .unwrap();
        let want = reference.advance(&obs, &updates);
        assert!(
            frame == want,
            "step {step}: the CUDA import differs from the reference"
        );
    }
    c.close();
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
}

/// Path (b) with a semaphore: its fd rides after the memory fd (an empty memfd stands in
/// for it: lavapipe cannot export semaphores). Were the order wrong, the client would
/// import the empty fd as the memory and fail its size check. The CPU importer closes
/// the semaphore fd: none leaks over 50 attaches, and the table says timeline.
#[test]
fn a_semaphore_fd_follows_its_memory_and_the_cpu_importer_closes_it() {
    use shmbridge::device::vulkan::export::SemaphoreKind;
    let _serial = serial();
    let Some(ctx) = vulkan() else { return };
    let (buffer, fd, export) = renderer_export(&ctx, 4096);
    let mapped = buffer.mapped().expect("lavapipe memory is host-visible");
    // SAFETY: 4096 mapped bytes of the test's own buffer.
    unsafe { std::ptr::write_bytes(mapped.as_ptr(), 9, 4096) };
    let semaphore = rustix::fs::memfd_create("semaphore", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let tensor = TensorSpec::vulkan_import("frame", DType::U8, &[64, 64], fd, export)
        .with_semaphore(semaphore, SemaphoreKind::Timeline);
    let mut engine = Engine::create(spec_with(tensor)).unwrap();
    let name = engine.name().to_string();
    engine.publish_signaled(Some(0)).unwrap();
    let inspect = std::process::Command::new(common::BIN)
        .args(["inspect", &name])
        .output()
        .unwrap();
    let inspect = String::from_utf8_lossy(&inspect.stdout);
    assert!(inspect.contains("semaphore timeline"), "{inspect}");
    Client::attach(&name, AttachOptions::default())
        .unwrap()
        .close();
    let before = open_fds();
    for _ in 0..50 {
        let mut c = Client::attach(&name, AttachOptions::default()).unwrap();
        assert!(c.tensor::<u8>("frame").unwrap().iter().all(|&b| b == 9));
        c.close();
    }
    assert_eq!(open_fds(), before, "fds leaked over 50 attach/close cycles");
    engine.close();
    drop(buffer);
    assert!(region_gone(&name));
}

/// `shmbridge engine` arguments of a one-env `null` engine whose 8x8x4 `rgb` is
/// exported Vulkan memory.
const SMALL_VULKAN_ENGINE: [&str; 11] = [
    "--env",
    "null",
    "--num-envs",
    "1",
    "--obs-dim",
    "4",
    "--image",
    "8x8x4",
    "--image-device",
    "vulkan",
    "--blocking",
];

/// A spec whose `rgb` the library allocates on the Vulkan device (path a).
fn allocated_spec() -> EngineSpec {
    EngineSpec::new("render", 1)
        .tensor("obs", DType::F32, &[1, 4], Direction::EngineToClient)
        .tensor_on(
            "rgb",
            DType::U8,
            &[1, 8, 8, 4],
            Direction::EngineToClient,
            shmbridge::device::Device::Vulkan(VulkanDevice::ANY),
        )
}

/// A same-user impostor takes the socket file's path from a live engine and says hello
/// with a descriptor of the region as its "proof". The client refuses before it shows
/// its own proof or takes any fd: a typed error naming who answered; the impostor never
/// receives a request, and no fd of the impostor's stays open. Before the fix (1.6) the
/// client sent its request, with its proof, before it had checked who answered (the
/// impostor read it), and before 1.6 (an abstract socket, no proof) a squatter on the
/// socket's name was answered: its memory was imported.
#[test]
fn an_impostor_on_the_socket_is_refused_and_nothing_is_imported() {
    let _serial = serial();
    let Some(ctx) = vulkan() else { return };
    let mut engine = Engine::create(allocated_spec()).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let path = region::socket_path(&name).unwrap();
    // Warm up (the loader and driver open what they keep for the process).
    Client::attach(&name, AttachOptions::default())
        .unwrap()
        .close();
    let theirs = ExportedBuffer::allocate(&ctx, 4096).unwrap();
    let own_region = std::fs::File::options()
        .read(true)
        .write(true)
        .open(format!("/dev/shm/{name}"))
        .unwrap();
    assert!(fdpass::untrusted_closed(common::peer::HANG));
    let before = open_fds();
    std::fs::remove_file(&path).unwrap();
    let impostor = fdpass::Listener::bind(&path).unwrap();
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            let conn = impostor.accept().unwrap();
            conn.hello(fdpass::ReplyStatus::Ok, Some(own_region.as_fd()), 1)
                .unwrap();
            // The client hangs up without a word: its proof never reaches the impostor.
            let request = conn.read_request();
            let fd = theirs.fd();
            let _ = conn.reply(fdpass::ReplyStatus::Ok, &[fd.as_fd()]);
            request.map(|_| ())
        });
        match Client::attach(&name, AttachOptions::default()) {
            Err(Error::Protocol { detail, .. }) => {
                assert!(detail.contains("is not the engine of region"), "{detail}");
                assert!(
                    detail.contains("did not show it its proof, and took no fd"),
                    "{detail}"
                );
            }
            Err(e) => panic!("expected Protocol, got {e}"),
            Ok(_) => panic!("the client took the impostor's fds"),
        }
        let request = server.join().unwrap();
        assert!(
            request.is_err(),
            "the client sent its request (and its proof) to the impostor"
        );
    });
    drop(impostor);
    // The listener's fd went with it; everything the client received was closed.
    assert!(fdpass::untrusted_closed(common::peer::HANG));
    assert_eq!(open_fds(), before, "an fd of the impostor's stayed open");
    // The engine's close removes what is at its socket's path (this user's socket).
    engine.close();
    drop(theirs);
    assert!(region_gone(&name));
}

/// A socket left at the path of a name the engine takes (this user's: an engine of that
/// name that died) is replaced; another user's file there is left, and the engine refused
/// with a typed error, leaving nothing behind.
#[test]
fn a_squatter_on_the_socket_path_is_replaced_or_refuses_the_engine() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let name = format!("shmbridge-squat-{}", std::process::id());
    let path = region::socket_path(&name).unwrap();
    let squatter = fdpass::Listener::bind(&path).unwrap();
    let mut engine = Engine::create(allocated_spec().name(&name)).unwrap();
    engine.publish().unwrap();
    let mut c = Client::attach(&name, AttachOptions::default()).unwrap();
    assert_eq!(c.tensor::<u8>("rgb").unwrap().len(), 256);
    c.close();
    engine.close();
    drop(squatter);
    assert!(region_gone(&name));
    if fdpass::euid() != 0 {
        eprintln!("SKIPPED (second half): another user's file needs root");
        return;
    }
    std::fs::write(&path, b"someone else's").unwrap();
    rustix::fs::chown(
        path.as_str(),
        Some(rustix::process::Uid::from_raw(65534)),
        None,
    )
    .unwrap();
    let e = Engine::create(allocated_spec().name(&name)).unwrap_err();
    assert!(e.to_string().contains(&path), "{e}");
    assert!(!shm_exists(&name), "the region was left");
    assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
    std::fs::remove_file(&path).unwrap();
}

/// A same-user process that opens the region cannot pass for its attached client on the
/// fd socket: the client holds the client's proof byte from before it claims the slot
/// until it closes, so nobody else can lock that byte and hand it over. Before 1.6 the
/// client locked its byte only during its own exchange: anyone could take it in between
/// and the engine sent that process every fd.
#[test]
fn a_process_of_the_same_user_cannot_take_the_attached_clients_proof() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let mut engine = Engine::create(allocated_spec()).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let path = region::socket_path(&name).unwrap();
    let client = Client::attach(&name, AttachOptions::default()).unwrap();
    let impostor = open_region(&name);
    // The lock the impostor would prove with: refused while the client is attached.
    assert!(
        !ofd_lock(&impostor, CLIENT_PROOF_BYTE),
        "another descriptor took the attached client's proof byte"
    );
    // And its descriptor, handed over anyway, gets no fd.
    match fdpass::request(&name, &path, impostor.as_fd(), 1, T) {
        Err(Error::Protocol { detail, .. }) => assert!(detail.contains("refused"), "{detail}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    client.close();
    engine.close();
    assert!(region_gone(&name));
}

/// The client's proof byte (1.8): one byte for the slot, `2^62 + 1`.
const CLIENT_PROOF_BYTE: u64 = (1 << 62) + 1;

/// The region file of `name`, opened anew (an open file description of its own).
fn open_region(name: &str) -> std::fs::File {
    std::fs::File::options()
        .read(true)
        .write(true)
        .open(format!("/dev/shm/{name}"))
        .unwrap()
}

/// Takes an OFD write lock on byte `byte` of `file`; whether it was free.
fn ofd_lock(file: &std::fs::File, byte: u64) -> bool {
    // SAFETY: flock is plain data; all zeroes is a valid value.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = libc::F_WRLCK as _;
    lock.l_whence = libc::SEEK_SET as _;
    lock.l_start = byte as libc::off_t;
    lock.l_len = 1;
    // SAFETY: a valid descriptor and a flock the call reads and writes, for its duration.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut lock) == 0 }
}

/// What 1.6 took as a client's proof byte: a public function of the pid and start time
/// the client slot records.
fn proof_byte_of_1_6(pid: u32, start: u64) -> u64 {
    shmbridge::control::client_lock_byte(pid, start) + (1 << 61) + 1
}

/// The attack on 1.6's proof: a third process of the learner's user writes its own pid
/// and start time into the client slot, takes the two lock bytes derived from them (a
/// public function of pid and start time), asks the fd socket, and writes the learner's
/// identity back. It gets no fd: the engine asks for the one byte the attached learner
/// holds, whatever the slot says. The learner goes on as before. Before the fix the
/// third process got status 0, the engine's proof and every memory fd.
#[test]
fn a_process_writing_itself_into_the_client_slot_gets_no_fd() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let engine = EngineProc::start(&SMALL_VULKAN_ENGINE);
    let name = engine.name.clone();
    let mut client = Client::attach(&name, AttachOptions::default()).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "scenario_steal_the_fds",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SHMBRIDGE_TEST_SCENARIO", "scenario_steal_the_fds")
        .env("SHMBRIDGE_TEST_REGION", &name)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("SCENARIO DONE"),
        "{text}"
    );
    assert!(text.contains("REFUSED"), "{text}");
    assert!(!text.contains("STOLE"), "{text}");
    // The learner is unaffected: its slot as it wrote it, its frames the engine's.
    let region = open_region(&name);
    assert_eq!(
        slot_identity(&region),
        (std::process::id(), own_start_time())
    );
    for step in 1..=3u64 {
        client
            .tensor_mut::<f32>("actions")
            .unwrap()
            .fill(step as f32);
        assert_eq!(client.step(T).unwrap(), step);
        let rgb = client.tensor::<u8>("rgb").unwrap();
        for (i, b) in rgb.iter().enumerate() {
            assert_eq!(*b, pattern_u8(step, i as u64), "step {step} byte {i}");
        }
    }
    client.close();
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
    assert!(region_gone(&name));
}

/// The client slot's `(client_pid, client_start_time)`, read from the file.
fn slot_identity(region: &std::fs::File) -> (u32, u64) {
    use shmbridge::layout::offsets::{CLIENT_PID, CLIENT_START_TIME};
    let (mut pid, mut start) = ([0u8; 4], [0u8; 8]);
    rustix::io::pread(region, &mut pid, CLIENT_PID as u64).unwrap();
    rustix::io::pread(region, &mut start, CLIENT_START_TIME as u64).unwrap();
    (u32::from_le_bytes(pid), u64::from_le_bytes(start))
}

fn write_slot_identity(region: &std::fs::File, (pid, start): (u32, u64)) {
    use shmbridge::layout::offsets::{CLIENT_PID, CLIENT_START_TIME};
    rustix::io::pwrite(region, &pid.to_le_bytes(), CLIENT_PID as u64).unwrap();
    rustix::io::pwrite(region, &start.to_le_bytes(), CLIENT_START_TIME as u64).unwrap();
}

#[test]
#[ignore = "a scenario, run in a process of its own by a_process_writing_itself_into_the_client_slot_gets_no_fd"]
fn scenario_steal_the_fds() {
    if !scenario("scenario_steal_the_fds") {
        return;
    }
    let name = std::env::var("SHMBRIDGE_TEST_REGION").unwrap();
    let path = region::socket_path(&name).unwrap();
    let region = open_region(&name);
    let learner = slot_identity(&region);
    let me = (std::process::id(), own_start_time());
    write_slot_identity(&region, me);
    // Both bytes 1.6 derived from the slot, each on a description of its own.
    assert!(ofd_lock(
        &region,
        shmbridge::control::client_lock_byte(me.0, me.1)
    ));
    let proof = open_region(&name);
    assert!(ofd_lock(&proof, proof_byte_of_1_6(me.0, me.1)));
    // And the one byte of 1.8, which the learner holds.
    if ofd_lock(&proof, CLIENT_PROOF_BYTE) {
        println!("the learner's proof byte was free");
    }
    let got = fdpass::request(&name, &path, proof.as_fd(), 1, T);
    write_slot_identity(&region, learner);
    match got {
        Ok(answer) => println!("STOLE {} fds", answer.fds.len()),
        Err(Error::Protocol { detail, .. }) if detail.contains("refused") => {
            println!("REFUSED: {detail}")
        }
        Err(e) => println!("OTHER: {e}"),
    }
    println!("SCENARIO DONE");
}

/// A process of the learner's user holds the client's proof byte before the learner
/// attaches (without attaching itself): the attach fails with an error that says another
/// process gets in the way, not one that blames this client or the engine; once it lets
/// go, the attach succeeds. Before the fix (1.6, where the byte was derived from the
/// learner's pid and start time) the attach failed with "the client broke the protocol".
#[test]
fn a_process_holding_the_client_proof_fails_the_attach_naming_it() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let mut engine = Engine::create(allocated_spec()).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let me = (std::process::id(), own_start_time());
    let squatter = open_region(&name);
    assert!(ofd_lock(&squatter, CLIENT_PROOF_BYTE));
    let legacy = open_region(&name);
    assert!(ofd_lock(&legacy, proof_byte_of_1_6(me.0, me.1)));
    match Client::attach(&name, AttachOptions::default()) {
        Err(Error::Io { context, source }) => {
            assert!(context.contains(&name), "{context}");
            let why = source.to_string();
            assert!(why.contains("getting in the way"), "{why}");
            assert!(why.contains("neither this client nor the engine"), "{why}");
        }
        Err(e) => panic!("expected the interference error, got {e:?}"),
        Ok(_) => panic!("attached without the client's proof"),
    }
    drop(squatter);
    let mut c = Client::attach(&name, AttachOptions::default()).unwrap();
    assert_eq!(c.tensor::<u8>("rgb").unwrap().len(), 256);
    // A second client while the first is attached: as ever, `AlreadyAttached`.
    match Client::attach(&name, AttachOptions::default()) {
        Err(Error::AlreadyAttached { pid, .. }) => assert_eq!(pid, me.0),
        other => panic!("expected AlreadyAttached, got {other:?}"),
    }
    c.close();
    // Closed, it let go of the proof: the next attach takes it.
    Client::attach(&name, AttachOptions::default())
        .unwrap()
        .close();
    engine.close();
    assert!(region_gone(&name));
}

/// A flood of same-user connections that say nothing (each greeted, none answering)
/// while a client attaches: the attach succeeds within its usual timeout. Before the fix
/// one thread served one peer at a time, 2 s each, behind a queue of 16: the attach
/// waited behind the flood and timed out.
#[test]
fn a_flood_of_silent_connections_does_not_keep_a_client_out() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let engine = EngineProc::start(&SMALL_VULKAN_ENGINE);
    let name = engine.name.clone();
    let path = region::socket_path(&name).unwrap();
    let addr = rustix::net::SocketAddrUnix::new(path.as_str()).unwrap();
    let mut silent = Vec::new();
    let deadline = std::time::Instant::now() + common::peer::HANG;
    while silent.len() < 100 {
        let fd = rustix::net::socket_with(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
            None,
        )
        .unwrap();
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => silent.push(fd),
            // The queue is full: the server has not taken the last ones yet.
            Err(rustix::io::Errno::AGAIN) => std::thread::yield_now(),
            Err(e) => panic!("connect: {e}"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} connections in {:?}",
            silent.len(),
            common::peer::HANG
        );
    }
    let c = Client::attach(&name, AttachOptions::default());
    assert!(c.is_ok(), "{:?}", c.err());
    c.unwrap().close();
    drop(silent);
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
    assert!(region_gone(&name));
}

/// This process's start time (field 22 of /proc/self/stat), as a client records it.
fn own_start_time() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let after = stat.rsplit(')').next().unwrap();
    after.split_whitespace().nth(19).unwrap().parse().unwrap()
}

/// Any local process of the engine's user can connect to its socket: one refused
/// connection after another must not fill the engine's log (a learner often keeps it in
/// a file). Before the fix each refusal was a line: 300 connections, 300 lines.
#[test]
fn refused_connections_are_summarised_not_logged_one_by_one() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let engine = EngineProc::start(&SMALL_VULKAN_ENGINE);
    let name = engine.name.clone();
    let path = region::socket_path(&name).unwrap();
    let not_a_proof = rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    for _ in 0..300 {
        match fdpass::request(&name, &path, not_a_proof.as_fd(), 1, T) {
            Err(Error::Protocol { detail, .. }) => assert!(detail.contains("refused"), "{detail}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    Client::attach(&name, AttachOptions::default())
        .unwrap()
        .close();
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
    let refusals: Vec<&str> = err.lines().filter(|l| l.contains("refused")).collect();
    assert!(
        (1..=3).contains(&refusals.len()),
        "{} lines about 300 refusals:\n{err}",
        refusals.len()
    );
    assert!(err.contains("299 more time(s)"), "{err}");
    assert!(region_gone(&name));
}

/// The engine's fd server thread of a CLI engine, if it runs, and where it waits
/// (`/proc/PID/task/TID/wchan`).
fn fd_server_thread(pid: u32) -> Option<String> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let task = task.ok()?.path();
        let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        if comm.trim() == "shmbridge-fds" {
            return Some(std::fs::read_to_string(task.join("wchan")).unwrap_or_default());
        }
    }
    None
}

/// The engine runs out of fds while a client connects: its server waits it out (the
/// connection stays queued) and serves again once an fd is free. Before the fix the
/// thread ended at the first EMFILE while the socket went on listening, and every later
/// attach waited for a reply until its timeout.
#[test]
fn an_engine_out_of_fds_serves_again_once_it_has_some() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let engine = EngineProc::start(&SMALL_VULKAN_ENGINE);
    let name = engine.name.clone();
    let pid = engine.pid();
    // Its fd limit at its lowest free fd: every lower one is taken, so the next fd it
    // opens is EMFILE. (It may still be closing an fd of its start-up: looked at again
    // until the lowest free fd is the same before and after the limit is set.)
    let lowest_free = || {
        let used: std::collections::HashSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        (0..).find(|n| !used.contains(n)).unwrap()
    };
    let target = rustix::process::Pid::from_raw(pid as i32);
    let nofile = rustix::process::Resource::Nofile;
    let max = rustix::process::getrlimit(nofile).maximum;
    let old = rustix::process::getrlimit(nofile);
    loop {
        let free = lowest_free();
        let limited = rustix::process::Rlimit {
            current: Some(free),
            maximum: max,
        };
        rustix::process::prlimit(target, nofile, limited).unwrap();
        if lowest_free() == free {
            break;
        }
    }
    // A connection at the limit. A thread blocked in `accept` took its fd number before
    // the limit came down, so this one is accepted, but the fd of its request cannot be
    // received: refused as unreadable. The next `accept` fails (EMFILE).
    let path = region::socket_path(&name).unwrap();
    let proof = rustix::fs::memfd_create("p", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let got = fdpass::request(&name, &path, proof.as_fd(), 1, Duration::from_millis(200));
    assert!(
        matches!(&got, Err(Error::Protocol { detail, .. }) if detail.contains("request unreadable"))
            || matches!(got, Err(Error::Timeout { .. })),
        "{got:?}"
    );
    // The thread failed to accept and waits it out (asleep between tries), alive.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match fd_server_thread(pid) {
            None => panic!("the fd server thread ended"),
            Some(wchan) if wchan.contains("nanosleep") => break,
            Some(_) => {}
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the server never backed off"
        );
        std::thread::yield_now();
    }
    rustix::process::prlimit(target, nofile, old).unwrap();
    let c = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
    c.close();
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
    assert!(region_gone(&name));
}

/// A child forked from a process with a Vulkan engine and client drops both: nothing
/// happens to the parent's session (its socket still serves, its client still reads),
/// and the child exits at once. Before the fix the child's drops called the driver (it
/// hung in lavapipe) and shut the listening socket it shares with its parent.
#[test]
fn a_forked_child_dropping_a_vulkan_engine_and_client_leaves_them_to_the_parent() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let mut engine = Engine::create(allocated_spec()).unwrap();
    engine.tensors().write::<u8>("rgb").unwrap().fill(5);
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let mut client = Client::attach(&name, AttachOptions::default()).unwrap();
    // SAFETY: the child only drops the two values and exits (system calls and frees;
    // glibc keeps malloc usable after fork); the other tests of this binary wait on
    // SERIAL, which this one holds.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        drop(client);
        drop(engine);
        // SAFETY: ends the child without unwinding into the test harness.
        unsafe { libc::_exit(0) };
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut status = 0;
    // SAFETY: polls the child forked above without blocking.
    while unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == 0 {
        if std::time::Instant::now() > deadline {
            // SAFETY: the child forked above; reaped right after.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            panic!("the child hung dropping its copies");
        }
        std::thread::yield_now();
    }
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    assert!(client.tensor::<u8>("rgb").unwrap().iter().all(|&b| b == 5));
    client.close();
    // The socket still serves: a new client gets the fds.
    let mut again = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
    assert!(again.tensor::<u8>("rgb").unwrap().iter().all(|&b| b == 5));
    again.close();
    engine.close();
    assert!(region_gone(&name));
}

/// Runs `scenario` (a test of this binary, ignored when run by hand) in a process of its
/// own and returns how it ended and what it printed: for scenarios that may end in a
/// signal (SIGBUS) before their fix.
fn in_own_process(scenario: &str) -> (std::process::ExitStatus, String) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            scenario,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SHMBRIDGE_TEST_SCENARIO", scenario)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

/// Runs `scenario` in a process of its own (where Vulkan is here) and asserts it ended
/// well, all done.
fn passes_in_own_process(scenario: &str) {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let (status, text) = in_own_process(scenario);
    assert!(
        status.success() && text.contains("SCENARIO DONE"),
        "{status}:\n{text}"
    );
}

fn scenario(name: &str) -> bool {
    std::env::var("SHMBRIDGE_TEST_SCENARIO").is_ok_and(|s| s == name)
}

/// Memory the engine's renderer exported as a file that can shrink (a memfd without
/// `F_SEAL_SHRINK`, holding what the driver needs to import it) is truncated by a
/// process of the same user after the client imported it. The client's next wait checks
/// it as it checks the region: a typed error that sticks, and no view of the tensor
/// touches the mapping again. Before the fix the client read past the file's end:
/// SIGBUS. (lavapipe's own exports are sealed against shrinking: they cannot be
/// truncated at all.)
#[test]
#[ignore = "a scenario, run in a process of its own by imported_memory_that_shrinks_is_a_typed_error"]
fn scenario_imported_memory_shrinks() {
    if !scenario("scenario_imported_memory_shrinks") {
        return;
    }
    let ctx = vulkan().unwrap();
    let real = ExportedBuffer::allocate(&ctx, 1 << 16).unwrap();
    let sealed = real.fd();
    assert!(
        rustix::fs::ftruncate(&sealed, 0).is_err(),
        "lavapipe's export is sealed"
    );
    let table = real.table();
    let size = fdpass::fd_size(sealed.as_fd()).unwrap();
    let mut bytes = vec![0u8; size as usize];
    rustix::io::pread(&sealed, &mut bytes, 0).unwrap();
    // The same bytes in a memfd that is not sealed: the driver imports it.
    let memfd = rustix::fs::memfd_create("frame", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&memfd, size).unwrap();
    rustix::io::pwrite(&memfd, &bytes, 0).unwrap();
    let truncator = memfd.try_clone().unwrap();
    let ids = ctx.ids();
    let export = VulkanExport {
        alloc_size: table.alloc_size,
        offset: 0,
        memory_type_index: table.memory_type_index,
        dedicated: table.dedicated,
        device_uuid: ids.device_uuid,
        driver_uuid: ids.driver_uuid,
    };
    let tensor = TensorSpec::vulkan_import("frame", DType::U8, &[1 << 16], memfd, export);
    let mut engine = Engine::create(spec_with(tensor)).unwrap();
    engine.publish().unwrap();
    let mut c = Client::attach(engine.name(), AttachOptions::default()).unwrap();
    assert_eq!(c.tensor::<u8>("frame").unwrap()[60_000], 0);
    rustix::fs::ftruncate(&truncator, 0).unwrap();
    // The engine does not answer: the step waits, and checks before it sleeps.
    let shrank = |e: &Error| matches!(e, Error::InvalidTensor { tensor, reason } if tensor == "frame" && reason.contains("shrank to 0 bytes"));
    let e = c.step(Duration::from_millis(50)).unwrap_err();
    assert!(shrank(&e), "{e}");
    let e = c.tensor::<u8>("frame").unwrap_err();
    assert!(shrank(&e), "{e}");
    assert!(c.device_ptr("frame").is_err());
    let e = c.wait_frame(Duration::from_millis(50)).unwrap_err();
    assert!(shrank(&e), "{e}");
    c.close();
    let name = engine.name().to_string();
    engine.close();
    assert!(region_gone(&name));
    println!("SCENARIO DONE");
}

#[test]
fn imported_memory_that_shrinks_is_a_typed_error() {
    passes_in_own_process("scenario_imported_memory_shrinks");
}

/// A process holding the fd of memory a client imported rewrites the driver's
/// bookkeeping bytes in it (lavapipe's header, before the memory's first byte: the size
/// it unmaps when the memory is freed) while the client is attached, as a process that
/// answered the client on the fd socket with memory of its own can. The client's close
/// leaves that import unfreed, says so, and lives. Before the fix the driver unmapped
/// what the rewritten header said and the client died of SIGSEGV in `vkFreeMemory`.
#[test]
#[ignore = "a scenario, run in a process of its own by rewritten_driver_bookkeeping_never_crashes_the_client"]
fn scenario_rewritten_bookkeeping() {
    if !scenario("scenario_rewritten_bookkeeping") {
        return;
    }
    let ctx = vulkan().unwrap();
    let (buffer, fd, export) = renderer_export(&ctx, 4096);
    let mut engine = Engine::create(spec_with(TensorSpec::vulkan_import(
        "frame",
        DType::U8,
        &[64, 64],
        fd,
        export,
    )))
    .unwrap();
    let name = engine.name().to_string();
    engine.publish().unwrap();
    let mut c = Client::attach(&name, AttachOptions::default()).unwrap();
    assert_eq!(c.tensor::<u8>("frame").unwrap().len(), 4096);
    let theirs = buffer.fd();
    let mut original = [0u8; 8];
    rustix::io::pread(&theirs, &mut original, 0).unwrap();
    // A size whose unmapping reaches the libraries mapped above the memory.
    rustix::io::pwrite(&theirs, &100_000_000_000u64.to_le_bytes(), 0).unwrap();
    c.close();
    // Put back for the renderer's own free (the engine's side, which trusts its memory).
    rustix::io::pwrite(&theirs, &original, 0).unwrap();
    engine.close();
    drop(buffer);
    assert!(region_gone(&name));
    println!("SCENARIO DONE");
}

#[test]
fn rewritten_driver_bookkeeping_never_crashes_the_client() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let (status, text) = in_own_process("scenario_rewritten_bookkeeping");
    assert!(
        status.success() && text.contains("SCENARIO DONE"),
        "{status}:\n{text}"
    );
    assert!(
        text.contains("left unfreed until this process exits"),
        "{text}"
    );
}

/// The region of a Vulkan engine is truncated while the engine waits: `RegionTooSmall`.
/// The fd server then refuses connections without reading the control block, the
/// engine's drop stops it and removes the socket file and the name, and the name can be
/// taken again in the same process. Before the fix the server was leaked, running, with
/// its mapping: a connection killed the process with SIGBUS, and the name stayed bound.
#[test]
#[ignore = "a scenario, run in a process of its own by a_truncated_vulkan_engine_closes_its_socket"]
fn scenario_truncated_vulkan_engine() {
    if !scenario("scenario_truncated_vulkan_engine") {
        return;
    }
    vulkan().unwrap();
    let mut engine = Engine::create(allocated_spec()).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let path = region::socket_path(&name).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiting = std::thread::spawn(move || {
        tx.send(rustix::thread::gettid().as_raw_nonzero().get())
            .unwrap();
        let got = engine.wait_actions(T);
        (engine, got)
    });
    let tid = rx.recv().unwrap();
    // Asleep in its futex: the truncation happens while it sleeps.
    let wchan = format!("/proc/self/task/{tid}/wchan");
    while !std::fs::read_to_string(&wchan)
        .unwrap_or_default()
        .contains("futex")
    {
        std::thread::yield_now();
    }
    std::fs::File::options()
        .write(true)
        .open(format!("/dev/shm/{name}"))
        .unwrap()
        .set_len(0)
        .unwrap();
    let (engine, got) = waiting.join().unwrap();
    assert!(matches!(got, Err(Error::RegionTooSmall { .. })), "{got:?}");
    let proof = rustix::fs::memfd_create("p", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    // The server still runs: it refuses (closing) without touching the mapping.
    let got = fdpass::request(&name, &path, proof.as_fd(), 1, T);
    assert!(matches!(got, Err(Error::PeerClosed { .. })), "{got:?}");
    drop(engine);
    assert!(region_gone(&name));
    assert!(
        fd_server_thread(std::process::id()).is_none(),
        "the fd server was left running"
    );
    let got = fdpass::request(&name, &path, proof.as_fd(), 1, T);
    assert!(matches!(got, Err(Error::Protocol { .. })), "{got:?}");
    let again = Engine::create(allocated_spec().name(&name)).unwrap();
    again.close();
    assert!(region_gone(&name));
    println!("SCENARIO DONE");
}

#[test]
fn a_truncated_vulkan_engine_closes_its_socket() {
    passes_in_own_process("scenario_truncated_vulkan_engine");
}

/// SIGINT to a CLI engine with Vulkan tensors while its client steps: the signal's
/// thread closes the region, the client sees `PeerClosed` and closes, and the engine
/// ends with 128 + 2, every time. Before the fix the signal's thread ran the process's
/// exit handlers while the main thread, seeing its client close, returned from `main`
/// and destroyed its Vulkan device: the engine died of SIGSEGV about one run in five.
#[test]
fn a_vulkan_engine_stopped_by_sigint_never_crashes() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    for round in 0..100 {
        let mut engine = EngineProc::start(&[
            "--env",
            "null",
            "--num-envs",
            "2",
            "--obs-dim",
            "4",
            "--image",
            "4x4x4",
            "--image-device",
            "vulkan",
            "--blocking",
        ]);
        let name = engine.name.clone();
        let mut c = Client::attach(&name, AttachOptions::default().timeout(T)).unwrap();
        c.step(T).unwrap();
        common::signal(engine.pid(), rustix::process::Signal::INT);
        let e = loop {
            if let Err(e) = c.step(T) {
                break e;
            }
        };
        assert!(matches!(e, Error::PeerClosed { .. }), "round {round}: {e}");
        c.close();
        let status = engine.child.wait().unwrap();
        let (_, err) = engine.finish();
        assert_eq!(status.code(), Some(130), "round {round}: {status}: {err}");
        assert!(region_gone(&name), "round {round}");
    }
}

/// Memory the driver cannot import (a memfd it did not make, as an impostor or a broken
/// engine may send): a typed error, and the process goes on. lavapipe closes the fd of
/// a failed import (against the Vulkan rule): before the fix the client closed it again
/// and Rust aborted the process ("owned file descriptor already closed").
#[test]
fn memory_the_driver_refuses_is_a_typed_error_not_an_abort() {
    let _serial = serial();
    let Some(ctx) = vulkan() else { return };
    let real = ExportedBuffer::allocate(&ctx, 4096).unwrap();
    let table = real.table();
    let foreign = rustix::fs::memfd_create("foreign", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&foreign, table.alloc_size).unwrap();
    match shmbridge::device::vulkan::vk::ImportedMemory::import(&ctx, foreign, &table, "frame") {
        Err(Error::InvalidTensor { tensor, reason }) => {
            assert_eq!(tensor, "frame");
            assert!(
                reason.contains("importing the engine's memory fd failed"),
                "{reason}"
            );
        }
        Err(e) => panic!("expected InvalidTensor, got {e}"),
        Ok(_) => panic!("the driver imported a memfd it did not make"),
    }
}

/// A child forked from a Vulkan engine's process, still running when the engine closes,
/// does not keep the engine's listening socket: it is released in children, as the
/// region's descriptors are. Before the fix the child held it (the socket stayed open,
/// bound to the region's path, for as long as the child lived).
#[test]
fn a_forked_child_does_not_keep_the_engine_socket() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let mut engine = Engine::create(allocated_spec()).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let path = region::socket_path(&name).unwrap();
    let bound = || {
        std::fs::read_to_string("/proc/net/unix")
            .unwrap()
            .lines()
            .any(|l| l.split_whitespace().last() == Some(path.as_str()))
    };
    assert!(bound());
    let (read_end, write_end) = std::os::unix::net::UnixStream::pair().unwrap();
    // SAFETY: the child only waits for the pipe to close and exits (system calls).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        drop(write_end);
        let mut byte = [0u8; 1];
        let _ = std::io::Read::read(&mut &read_end, &mut byte);
        // SAFETY: ends the child without unwinding into the test harness.
        unsafe { libc::_exit(0) };
    }
    drop(read_end);
    engine.close();
    let kept = bound();
    drop(write_end);
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(!kept, "the forked child kept the engine's socket");
    assert!(region_gone(&name));
}

/// Path (b) with a timeline semaphore, served with `publish_signaled`: each frame's value
/// must be its number (`next_frame`); a wrong value, or none (plain `publish` too),
/// publishes nothing (the right
/// value then still publishes that frame, which a second publish of one action could
/// not). An empty memfd stands in for the semaphore (lavapipe cannot export one).
#[test]
fn a_renderer_with_a_semaphore_publishes_each_frames_number() {
    use shmbridge::device::vulkan::export::SemaphoreKind;
    let _serial = serial();
    let Some(ctx) = vulkan() else { return };
    let (buffer, fd, export) = renderer_export(&ctx, 4096);
    let semaphore = rustix::fs::memfd_create("semaphore", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let tensor = TensorSpec::vulkan_import("frame", DType::U8, &[64, 64], fd, export)
        .with_semaphore(semaphore, SemaphoreKind::Timeline);
    let mut engine = Engine::create(spec_with(tensor)).unwrap();
    let name = engine.name().to_string();
    let refused = |r: Result<u64, Error>, words: &str| match r {
        Err(Error::InvalidSpec(m)) => assert!(m.contains(words), "{m}"),
        r => panic!("expected InvalidSpec, got {r:?}"),
    };
    assert_eq!(engine.next_frame(), 0);
    refused(engine.publish(), "has a timeline semaphore");
    refused(engine.publish_signaled(None), "has a timeline semaphore");
    refused(engine.publish_signaled(Some(1)), "with 1 for frame 0");
    assert_eq!(engine.publish_signaled(Some(0)).unwrap(), 0);
    let client = std::thread::spawn(move || {
        let mut c = Client::attach(&name, AttachOptions::default()).unwrap();
        let frames: Vec<u64> = (0..3).map(|_| c.step(T).unwrap()).collect();
        c.close();
        frames
    });
    for n in 1..=3u64 {
        assert_eq!(engine.wait_actions(T).unwrap(), n);
        assert_eq!(engine.next_frame(), n);
        refused(
            engine.publish_signaled(Some(n + 1)),
            "signal each frame's number",
        );
        refused(
            engine.publish_signaled(Some(n - 1)),
            "signal each frame's number",
        );
        refused(engine.publish_signaled(None), "has a timeline semaphore");
        refused(engine.publish(), "has a timeline semaphore");
        assert_eq!(engine.publish_signaled(Some(n)).unwrap(), n);
    }
    assert_eq!(client.join().unwrap(), vec![1, 2, 3]);
    let name = engine.name().to_string();
    engine.close();
    drop(buffer);
    assert!(region_gone(&name));
}

/// An attach with no time limit (`Duration::MAX`; Python's `timeout=float('inf')`, C's
/// `SHMB_FOREVER`) is served. Before the fix the exchange's deadline became "now" (a
/// deadline past what an `Instant` holds fell back to the start), and the attach failed
/// at once with a timeout waiting for the engine's reply.
#[test]
fn an_attach_with_no_time_limit_is_served() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let mut engine = Engine::create(allocated_spec()).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let c = Client::attach(&name, AttachOptions::default().timeout(Duration::MAX));
    match c {
        Ok(mut c) => {
            assert_eq!(c.tensor::<u8>("rgb").unwrap().len(), 256);
            c.close();
        }
        Err(e) => panic!("an attach with no time limit failed: {e:?}"),
    }
    engine.close();
    assert!(region_gone(&name));
}

/// A TCP socket on loopback whose last close blocks for an hour: `SO_LINGER` {on,
/// 3600 s} and unsent data its peer (returned: kept open, never read) has no room for.
fn lingering_socket() -> (OwnedFd, std::net::TcpStream) {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut sender = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (receiver, _) = listener.accept().unwrap();
    sender.set_nonblocking(true).unwrap();
    let chunk = [7u8; 1 << 16];
    loop {
        match sender.write(&chunk) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("write: {e}"),
        }
    }
    rustix::net::sockopt::set_socket_linger(&sender, Some(Duration::from_secs(3600))).unwrap();
    (OwnedFd::from(sender), receiver)
}

/// Connects to the fd socket at `path`, takes the hello, and sends a request carrying
/// `fd` as its proof, then closes this process's copy of `fd` (the engine's is then the
/// last). The connection, to read the reply on (within [`T`]).
fn request_with(path: &str, fd: OwnedFd) -> OwnedFd {
    use rustix::net::{
        AddressFamily, RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
        SendFlags, SocketAddrUnix, SocketFlags, SocketType,
    };
    use std::io::{IoSlice, IoSliceMut};
    use std::mem::MaybeUninit;
    let conn = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    rustix::net::connect(&conn, &SocketAddrUnix::new(path).unwrap()).unwrap();
    rustix::net::sockopt::set_socket_timeout(&conn, rustix::net::sockopt::Timeout::Recv, Some(T))
        .unwrap();
    let mut hello = [0u8; fdpass::MESSAGE_SIZE];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    rustix::net::recvmsg(
        &conn,
        &mut [IoSliceMut::new(&mut hello)],
        &mut control,
        RecvFlags::WAITALL | RecvFlags::CMSG_CLOEXEC,
    )
    .unwrap();
    // The engine's proof: closed with the buffer's drain.
    control.drain().for_each(drop);
    assert_eq!(&hello[..4], &fdpass::HELLO_MAGIC);
    let mut request = [0u8; fdpass::MESSAGE_SIZE];
    request[..4].copy_from_slice(&fdpass::REQUEST_MAGIC);
    request[4] = fdpass::MESSAGE_VERSION;
    let fds = [fd.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
    rustix::net::sendmsg(
        &conn,
        &[IoSlice::new(&request)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .unwrap();
    drop(fd);
    conn
}

/// A same-user peer sends, as its proof, a TCP socket whose close blocks for an hour
/// (`SO_LINGER` and unsent data), and closes its own copy. The engine's fd server refuses
/// it at once and goes on serving: the next client attaches. Before the fix the server
/// closed the socket on its own thread, after judging it and before replying: its thread
/// (and any `Engine::close`, which joins it) waited out the linger time, and the refusal
/// and every later attach timed out.
#[test]
fn a_lingering_socket_sent_as_a_proof_never_stalls_the_engine() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let engine = EngineProc::start(&SMALL_VULKAN_ENGINE);
    let name = engine.name.clone();
    let path = region::socket_path(&name).unwrap();
    let (lingering, _unread) = lingering_socket();
    let conn = request_with(&path, lingering);
    let mut reply = [0u8; fdpass::MESSAGE_SIZE];
    match rustix::net::recv(&conn, &mut reply, rustix::net::RecvFlags::WAITALL) {
        Ok((n, _)) => assert_eq!(n, fdpass::MESSAGE_SIZE, "{reply:02x?}"),
        Err(e) => panic!("no reply to a request with a lingering socket in {T:?}: {e}"),
    }
    assert_eq!(&reply[..4], &fdpass::REPLY_MAGIC);
    assert_eq!(reply[5], fdpass::ReplyStatus::NotTheClient as u8);
    let c = Client::attach(&name, AttachOptions::default());
    assert!(c.is_ok(), "{:?}", c.err());
    c.unwrap().close();
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
    assert!(region_gone(&name));
}

/// An impostor on the socket's path says hello with a TCP socket whose close blocks for
/// an hour as its "proof", and closes its own copy. The client refuses it (not the
/// region's file) and returns: it never waits on the close of a descriptor a process not
/// found to be the engine sent. Before the fix the client closed it on its own thread,
/// and the attach returned only after the linger time.
#[test]
fn an_impostors_lingering_socket_never_stalls_the_attach() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let mut engine = Engine::create(allocated_spec()).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let path = region::socket_path(&name).unwrap();
    std::fs::remove_file(&path).unwrap();
    let impostor = fdpass::Listener::bind(&path).unwrap();
    let (lingering, _unread) = lingering_socket();
    let server = std::thread::spawn(move || {
        let conn = impostor.accept().unwrap();
        conn.hello(fdpass::ReplyStatus::Ok, Some(lingering.as_fd()), 1)
            .unwrap();
        drop(lingering);
        // The client hangs up without a word.
        let _ = conn.read_request();
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let n = name.clone();
    std::thread::spawn(move || {
        let _ = tx.send(Client::attach(&n, AttachOptions::default()).map(|c| c.close()));
    });
    match rx.recv_timeout(common::peer::HANG) {
        Ok(Err(Error::Protocol { detail, .. })) => {
            assert!(detail.contains("is not the engine of region"), "{detail}")
        }
        Ok(other) => panic!("expected Protocol, got {other:?}"),
        Err(_) => panic!("the attach hung on the close of the impostor's socket"),
    }
    server.join().unwrap();
    engine.close();
    assert!(region_gone(&name));
}

/// Sets an OFD lock of `l_type` on byte `byte` through `fd`; whether the kernel took it.
fn ofd_set(fd: impl AsFd, byte: u64, l_type: libc::c_int) -> bool {
    // SAFETY: flock is plain data; all zeroes is a valid value.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = l_type as _;
    lock.l_whence = libc::SEEK_SET as _;
    lock.l_start = byte as libc::off_t;
    lock.l_len = 1;
    // SAFETY: a valid descriptor and a flock the call reads, for its duration.
    unsafe { libc::fcntl(fd.as_fd().as_raw_fd(), libc::F_OFD_SETLK, &mut lock) == 0 }
}

/// The engine's proof byte (1.6): `2^62`.
const ENGINE_PROOF_BYTE: u64 = 1 << 62;

/// Every peer of the engine's user receives the engine's proof description in the hello,
/// and may change its locks, which outlive the peer: release the engine's byte, or lock
/// the client's proof byte, through it. Either is put right: at the next connection (the
/// engine's server takes its byte back and drops every other lock of that description
/// before each hello), and within a second without one. Before the fix either change
/// lasted as long as the engine: every later attach failed, blaming the engine ("nobody
/// holds the lock") or another process of this user.
#[test]
fn locks_changed_through_the_engines_proof_are_put_right() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let mut engine = Engine::create(allocated_spec()).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let path = region::socket_path(&name).unwrap();
    for (byte, l_type) in [
        (ENGINE_PROOF_BYTE, libc::F_UNLCK),
        (CLIENT_PROOF_BYTE, libc::F_WRLCK),
    ] {
        // The engine's description, as any peer of this user gets it.
        let exchange = fdpass::open_exchange(&name, &path, 1, T).unwrap();
        assert!(ofd_set(&exchange.proof, byte, l_type));
        drop(exchange);
        // The next peer's hello: the description holds the engine's byte alone again.
        drop(fdpass::open_exchange(&name, &path, 1, T).unwrap());
        let c = Client::attach(&name, AttachOptions::default());
        assert!(c.is_ok(), "after {l_type} on {byte}: {:?}", c.err());
        c.unwrap().close();
    }
    // With no connection in between: the server looks at least every second.
    let exchange = fdpass::open_exchange(&name, &path, 1, T).unwrap();
    assert!(ofd_set(&exchange.proof, CLIENT_PROOF_BYTE, libc::F_WRLCK));
    drop(exchange);
    let probe = open_region(&name);
    let deadline = std::time::Instant::now() + common::peer::HANG;
    while !ofd_lock(&probe, CLIENT_PROOF_BYTE) {
        assert!(
            std::time::Instant::now() < deadline,
            "the client's proof byte stayed locked through the engine's description"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(probe);
    let c = Client::attach(&name, AttachOptions::default());
    assert!(c.is_ok(), "{:?}", c.err());
    c.unwrap().close();
    engine.close();
    assert!(region_gone(&name));
}

/// Connects `n` silent same-user connections to the fd socket at `path` (waiting for
/// room in its queue): once they are all in, the server accepted and greeted at least
/// `n - 65` of them (its queue holds 64 and one), each after every connection before.
fn flood(path: &str, n: usize) -> Vec<OwnedFd> {
    let addr = rustix::net::SocketAddrUnix::new(path).unwrap();
    let mut silent = Vec::new();
    let deadline = std::time::Instant::now() + common::peer::HANG;
    while silent.len() < n {
        let fd = rustix::net::socket_with(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
            None,
        )
        .unwrap();
        match rustix::net::connect(&fd, &addr) {
            Ok(()) => silent.push(fd),
            Err(rustix::io::Errno::AGAIN) => std::thread::yield_now(),
            Err(e) => panic!("connect: {e}"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} connections",
            silent.len()
        );
    }
    silent
}

/// A peer greeted, then dropped by the server to make room for a flood of newer ones
/// before it sent its request, gets the refusal the docs promise (status 4: a typed
/// `Protocol` error saying its request was not read), not an `Io` error. Made certain:
/// after the peer's hello, `3 * MAX_PEERS` more connections get in, so more than
/// `MAX_PEERS` were greeted after it. Before the fix the request's send found the
/// connection closed and the exchange ended with `Io("sendmsg: Broken pipe")`, the
/// queued refusal unread.
#[test]
fn a_peer_dropped_to_make_room_gets_a_typed_refusal() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let mut engine = Engine::create(allocated_spec()).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let path = region::socket_path(&name).unwrap();
    let not_a_proof = open_region(&name);
    let exchange = fdpass::open_exchange(&name, &path, 1, T).unwrap();
    let silent = flood(&path, 3 * fdpass::MAX_PEERS);
    match exchange.request(not_a_proof.as_fd()) {
        Err(Error::Protocol { detail, .. }) => {
            assert!(detail.contains("request unreadable or late"), "{detail}")
        }
        other => panic!("expected the typed refusal of status 4, got {other:?}"),
    }
    drop(silent);
    engine.close();
    assert!(region_gone(&name));
}

/// An exchange whose peer was dropped to make room (as above) is asked again on a new
/// connection, and the server's checks run again on it: the second time the engine
/// judges the request (here: not the attached client's proof). A client attaching
/// through such a flood is served the same way.
#[test]
fn an_exchange_dropped_to_make_room_is_asked_again() {
    let _serial = serial();
    if vulkan().is_none() {
        return;
    }
    let mut engine = Engine::create(allocated_spec()).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let path = region::socket_path(&name).unwrap();
    let not_a_proof = open_region(&name);
    let mut silent = Vec::new();
    let mut checks = 0;
    let got = fdpass::exchange(&name, &path, 1, T, not_a_proof.as_fd(), &mut |_| {
        checks += 1;
        if checks == 1 {
            silent = flood(&path, 3 * fdpass::MAX_PEERS);
        }
        Ok(())
    });
    match got {
        Err(Error::Protocol { detail, .. }) => {
            assert!(detail.contains("not the attached client"), "{detail}")
        }
        other => panic!("expected the engine's judgement, got {other:?}"),
    }
    assert_eq!(checks, 2, "the exchange was not asked again");
    drop(silent);
    let c = Client::attach(&name, AttachOptions::default());
    assert!(c.is_ok(), "{:?}", c.err());
    c.unwrap().close();
    engine.close();
    assert!(region_gone(&name));
}
