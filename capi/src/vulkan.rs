//! Tensors in Vulkan memory the engine's own renderer exported (protocol 1.3, path b;
//! the core's `TensorSpec::vulkan_import`), and the publish that says what its queue
//! signalled. The rules are the core's: this file copies C's arguments in and out.

use std::ffi::c_char;
use std::os::fd::{BorrowedFd, OwnedFd};

use shmbridge_core::device::vulkan::export::{SemaphoreKind, VulkanExport};
use shmbridge_core::layout::TensorSpec;

use crate::engine::{self, shmb_engine};
use crate::spec::{self, shmb_spec};
use crate::status::{guard, shmb_status, CResult, Fail};
use crate::types::{need, put};

/// What an engine's renderer exported for one tensor (`vkGetMemoryFdKHR`,
/// `VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT`), and what an importer must repeat:
/// the values the renderer passed to `vkAllocateMemory`, and its device's IDs.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct shmb_vulkan_export {
    /// `VkMemoryAllocateInfo::allocationSize` of the exported memory.
    pub alloc_size: u64,
    /// Byte offset of the tensor in that memory: a multiple of 64, and the tensor's
    /// bytes must end inside `alloc_size`.
    pub offset: u64,
    /// `VkMemoryAllocateInfo::memoryTypeIndex` on the exporting device.
    pub memory_type_index: u32,
    /// 1 if the memory is a dedicated allocation (`VkMemoryDedicatedAllocateInfo`, which
    /// an importer must then repeat), else 0.
    pub dedicated: u32,
    /// `VkPhysicalDeviceIDProperties::deviceUUID` of the exporting device (not all 0:
    /// a client opens the device with this UUID).
    pub device_uuid: [u8; 16],
    /// `VkPhysicalDeviceIDProperties::driverUUID` of the exporting device.
    pub driver_uuid: [u8; 16],
}

/// The kind of an exported semaphore (`VkSemaphoreTypeCreateInfo::semaphoreType`).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum shmb_semaphore_kind {
    /// A timeline semaphore (Vulkan 1.2): the renderer signals value `n` once frame `n`
    /// is written.
    SHMB_SEMAPHORE_TIMELINE = 0,
    /// A binary semaphore: refused by `shmb_engine_create` (`SHMB_INVALID_SPEC`), since
    /// each signal needs exactly one wait from whoever is attached, which a client that
    /// maps the memory on the CPU, or none at all, cannot give.
    SHMB_SEMAPHORE_BINARY = 1,
}

/// "No fd": the `semaphore_fd` of a tensor without a semaphore.
pub const SHMB_NO_FD: i32 = -1;

/// A copy of the caller's fd `fd` (`F_DUPFD_CLOEXEC`), owned by the library.
fn dup_fd(fd: i32, what: &str) -> CResult<OwnedFd> {
    if fd < 0 {
        return Err(Fail::invalid(format!(
            "`{what}` is {fd}, not a file descriptor"
        )));
    }
    // SAFETY: the caller's contract: an open fd of the caller's, for the call. A number
    // that is not open only makes `fcntl` fail (EBADF): nothing is read or written
    // through it here but the duplication.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    borrowed.try_clone_to_owned().map_err(|e| {
        Fail::invalid(format!(
            "`{what}` {fd} cannot be duplicated ({e}): pass an fd that is open in this \
             process (the one vkGetMemoryFdKHR or vkGetSemaphoreFdKHR returned)"
        ))
    })
}

fn kind_from(code: u32) -> CResult<SemaphoreKind> {
    match code {
        0 => Ok(SemaphoreKind::Timeline),
        1 => Ok(SemaphoreKind::Binary),
        _ => Err(Fail::invalid(format!(
            "semaphore kind {code} is not a shmb_semaphore_kind (0 or 1)"
        ))),
    }
}

/// Adds an engine→client tensor whose bytes lie in memory the engine's renderer
/// exported: `name`, `dtype` and `shape` as `shmb_spec_add_tensor`; `memory_fd` the fd
/// `vkGetMemoryFdKHR` (`OPAQUE_FD`) returned; `*exported` where the tensor lies in that
/// memory and on which device; `semaphore_fd` a timeline semaphore the renderer signals
/// (`vkGetSemaphoreFdKHR`, `OPAQUE_FD`), or `SHMB_NO_FD`, with its `semaphore_kind` (a
/// `shmb_semaphore_kind`; ignored without one). A client receives the fds over the
/// region's socket when it attaches and imports the memory into a device of its own.
///
/// Checked here: the pointers, `ndim`, `dtype`, that `dedicated` is 0 or 1, the kind,
/// and that each fd is open (else `SHMB_INVALID_ARGUMENT`). Checked by
/// `shmb_engine_create` (`SHMB_INVALID_SPEC`, nothing created): the tensor's bytes at
/// `offset` (a multiple of 64) end inside `alloc_size`, the device UUID is not all 0,
/// the semaphore is not binary, and what the kernel says of each fd (`fstat`): not a
/// socket, pipe, directory, terminal, block device, `/dev/null`-like memory device, file
/// with a name in a filesystem or `O_PATH` descriptor, and a memory fd with a size (a
/// memfd, a dma-buf) holds at least `alloc_size` bytes; a build without Vulkan support
/// answers `SHMB_VULKAN_UNAVAILABLE` there. What only the memory's importer can tell
/// (that the fd is memory of that type on that device, and its size where the kernel
/// shows none) is checked by each client as it attaches: a client refuses a lie with a
/// typed error (`SHMB_INVALID_TENSOR`).
///
/// Ownership: `memory_fd` and `semaphore_fd` stay the caller's. The library duplicates
/// each during this call (`F_DUPFD_CLOEXEC`) and closes its copies once the spec and
/// every engine created from it are closed; the caller closes its own whenever it likes,
/// at once if it has no other use for it. The memory must stay allocated (and be
/// rendered into) while an engine serves it: the copies keep the payload alive for
/// importers, not the renderer's `VkDeviceMemory`. `*exported` and the strings are copied.
#[no_mangle]
pub unsafe extern "C" fn shmb_spec_add_vulkan_export(
    spec: *mut shmb_spec,
    name: *const c_char,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    memory_fd: i32,
    exported: *const shmb_vulkan_export,
    semaphore_fd: i32,
    semaphore_kind: u32,
) -> shmb_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (name, dtype, shape) = unsafe { spec::tensor_args(name, dtype, shape, ndim)? };
        // SAFETY: NULL or a valid struct for the call, per the caller's contract.
        let e = unsafe { exported.as_ref() }.ok_or_else(|| Fail::null("exported"))?;
        let dedicated = match e.dedicated {
            0 => false,
            1 => true,
            d => {
                return Err(Fail::invalid(format!(
                    "tensor '{name}': exported->dedicated is {d}, expected 0 or 1"
                )))
            }
        };
        let semaphore = match semaphore_fd {
            SHMB_NO_FD => None,
            fd => Some((kind_from(semaphore_kind)?, fd)),
        };
        let export = VulkanExport {
            alloc_size: e.alloc_size,
            offset: e.offset,
            memory_type_index: e.memory_type_index,
            dedicated,
            device_uuid: e.device_uuid,
            driver_uuid: e.driver_uuid,
        };
        // The copies are made once the handle is known good, so a refusal holds none.
        spec::SPECS.with(spec::id(spec), |s| {
            let semaphore = match semaphore {
                Some((kind, fd)) => Some((dup_fd(fd, "semaphore_fd")?, kind)),
                None => None,
            };
            let memory = dup_fd(memory_fd, "memory_fd")?;
            let mut t = TensorSpec::vulkan_import(name, dtype, shape, memory, export);
            if let Some((fd, kind)) = semaphore {
                t = t.with_semaphore(fd, kind);
            }
            s.tensors.push(t);
            Ok(())
        })
    })
}

/// The number the next publish gives its frame (`*frame`): 0 before frame 0, then the
/// action `shmb_engine_wait_actions` last returned (frame `n` answers action `n`). The
/// value a renderer with a timeline semaphore signals for that frame.
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_next_frame(
    engine: *mut shmb_engine,
    frame: *mut u64,
) -> shmb_status {
    guard(|| {
        need(frame, "frame")?;
        let n = engine::with(engine, |h| Ok(h.side.next_frame()))?;
        // SAFETY: checked non-null; writable per the caller's contract.
        unsafe { put(frame, n, "frame") }
    })
}

/// Publishes a frame the engine's renderer wrote into memory it exported
/// (`shmb_spec_add_vulkan_export`) with a timeline semaphore: `signaled` is the value the
/// renderer's queue signals once the frame is written, which must be the frame's number
/// (`shmb_engine_next_frame`; frame 0 is the semaphore's initial value 0, signalled by
/// nothing). A client's CUDA importer waits for that value on its own stream before it
/// reads the frame. Otherwise as `shmb_engine_publish`, which an engine whose tensors
/// have no semaphore calls instead (its frames are ordered by the seq counters alone).
///
/// Either way, the device work that wrote the frame must be complete before the call
/// (wait for the submission's fence): a client that maps the memory on the CPU reads as
/// soon as the frame is published.
///
/// `SHMB_INVALID_SPEC`, and nothing published: `signaled` is not the frame's number, or
/// the engine's tensors have no semaphore. (`shmb_engine_publish` on an engine whose
/// tensors have one is `SHMB_INVALID_SPEC` too: a frame is never published without the
/// value a client waits for.)
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_publish_signaled(
    engine: *mut shmb_engine,
    signaled: u64,
    frame: *mut u64,
) -> shmb_status {
    guard(|| {
        let f = engine::with(engine, |h| Ok(h.side.publish_signaled(Some(signaled))?))?;
        if !frame.is_null() {
            // SAFETY: non-null; writable per the caller's contract.
            unsafe { frame.write(f) };
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::shmb_engine_create;
    use crate::spec::{shmb_spec_free, shmb_spec_new};
    use crate::status::shmb_status::*;
    use std::ffi::CStr;
    use std::os::fd::{AsRawFd, OwnedFd};

    const SHAPE: [u64; 2] = [16, 16];

    fn export() -> shmb_vulkan_export {
        shmb_vulkan_export {
            alloc_size: 4096,
            offset: 0,
            memory_type_index: 0,
            dedicated: 1,
            device_uuid: [5; 16],
            driver_uuid: [6; 16],
        }
    }

    /// A memfd standing in for exported memory (path b hands fds over; nothing here
    /// imports them), named so that its copies can be counted.
    fn memfd(name: &str) -> OwnedFd {
        let fd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        fd
    }

    /// Open fds of this process on the memfd called `name`: the caller's and the
    /// library's copies (by name, so tests running beside this one do not count).
    fn copies(name: &str) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target.to_string_lossy() == format!("/memfd:{name} (deleted)"))
            .count()
    }

    fn message() -> String {
        // SAFETY: the thread's NUL-terminated last error.
        unsafe { CStr::from_ptr(crate::shmb_last_error_message()) }
            .to_string_lossy()
            .into_owned()
    }

    fn new_spec() -> *mut shmb_spec {
        let mut spec = std::ptr::null_mut();
        // SAFETY: a valid string and out-pointer.
        assert_eq!(
            unsafe { shmb_spec_new(c"render".as_ptr(), 16, &mut spec) },
            SHMB_OK
        );
        spec
    }

    /// `shmb_spec_add_vulkan_export` of a 16×16 u8 `frame` with these arguments.
    fn add(
        spec: *mut shmb_spec,
        memory_fd: i32,
        exported: *const shmb_vulkan_export,
        semaphore_fd: i32,
        kind: u32,
    ) -> shmb_status {
        // SAFETY: valid strings and arrays; `exported` NULL or valid.
        unsafe {
            shmb_spec_add_vulkan_export(
                spec,
                c"frame".as_ptr(),
                8,
                SHAPE.as_ptr(),
                2,
                memory_fd,
                exported,
                semaphore_fd,
                kind,
            )
        }
    }

    #[test]
    fn bad_arguments_are_refused_and_nothing_is_kept() {
        let name = "capi-vk-arguments";
        let fd = memfd(name);
        let raw = fd.as_raw_fd();
        let spec = new_spec();
        let e = export();
        let refused = |status: shmb_status, words: &str| {
            assert_eq!(status, SHMB_INVALID_ARGUMENT, "{words}");
            assert!(message().contains(words), "{words}: {}", message());
        };
        refused(
            add(spec, raw, std::ptr::null(), SHMB_NO_FD, 0),
            "`exported` is NULL",
        );
        let undecided = shmb_vulkan_export { dedicated: 2, ..e };
        refused(add(spec, raw, &undecided, SHMB_NO_FD, 0), "dedicated is 2");
        refused(add(spec, -1, &e, SHMB_NO_FD, 0), "`memory_fd` is -1");
        refused(add(spec, raw, &e, raw, 7), "semaphore kind 7");
        refused(add(spec, raw, &e, -5, 0), "`semaphore_fd` is -5");
        // An fd number that is not open: EBADF, said as such.
        let closed = memfd("capi-vk-closed");
        let closed_raw = closed.as_raw_fd();
        drop(closed);
        assert_eq!(
            add(spec, closed_raw, &e, SHMB_NO_FD, 0),
            SHMB_INVALID_ARGUMENT
        );
        assert!(message().contains("cannot be duplicated"), "{}", message());
        // A semaphore fd that is not open: the memory fd is not kept either.
        assert_eq!(add(spec, raw, &e, closed_raw, 0), SHMB_INVALID_ARGUMENT);
        assert_eq!(copies(name), 1, "a refused call kept a copy");
        // A bad handle: no copy either.
        assert_eq!(
            add(0xdead_0001 as *mut shmb_spec, raw, &e, SHMB_NO_FD, 0),
            SHMB_INVALID_HANDLE
        );
        assert_eq!(copies(name), 1);
        // The spec holds no tensor.
        let held = spec::SPECS.with(spec::id(spec), |s| Ok(s.tensors.len()));
        assert_eq!(held.unwrap(), 0);
        assert_eq!(shmb_spec_free(spec), SHMB_OK);
    }

    /// Creates an engine from `spec`: its status, the message, and the engine (NULL on
    /// failure).
    fn create(spec: *mut shmb_spec) -> (shmb_status, String, *mut shmb_engine) {
        let mut engine = std::ptr::null_mut();
        // SAFETY: a live spec and a valid out-pointer.
        let status = unsafe { shmb_engine_create(spec, &mut engine) };
        (status, message(), engine)
    }

    #[test]
    fn the_cores_rules_refuse_the_engine_and_leave_nothing() {
        let name = "capi-vk-rules";
        let fd = memfd(name);
        let e = export();
        let cases: Vec<(shmb_vulkan_export, i32, &str)> = vec![
            (
                shmb_vulkan_export { offset: 32, ..e },
                SHMB_NO_FD,
                "multiple of 64",
            ),
            (
                shmb_vulkan_export { offset: 4096, ..e },
                SHMB_NO_FD,
                "do not fit",
            ),
            (
                shmb_vulkan_export {
                    alloc_size: 255,
                    ..e
                },
                SHMB_NO_FD,
                "do not fit",
            ),
            (
                shmb_vulkan_export {
                    device_uuid: [0; 16],
                    ..e
                },
                SHMB_NO_FD,
                "device UUID is all zero",
            ),
            (e, fd.as_raw_fd(), "binary semaphore"),
        ];
        for (exported, semaphore, words) in cases {
            let spec = new_spec();
            let kind = shmb_semaphore_kind::SHMB_SEMAPHORE_BINARY as u32;
            assert_eq!(
                add(spec, fd.as_raw_fd(), &exported, semaphore, kind),
                SHMB_OK
            );
            let (status, text, engine) = create(spec);
            assert_eq!(status, SHMB_INVALID_SPEC, "{words}: {text}");
            assert!(text.contains(words), "{words}: {text}");
            assert!(engine.is_null());
            assert_eq!(shmb_spec_free(spec), SHMB_OK);
        }
        assert_eq!(
            copies(name),
            1,
            "the library kept a copy of a refused spec's fd"
        );
    }

    /// An fd that is no exported memory (the stdin as a pipe or a terminal, a
    /// socket, /dev/null) or a memfd smaller than `alloc_size`: `SHMB_INVALID_SPEC` at
    /// creation, nothing created, no copy kept. Before, each was forwarded to clients.
    #[test]
    fn fds_the_kernel_can_tell_are_not_exported_memory_are_refused() {
        let pipe = {
            let mut child = std::process::Command::new("true")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let out = OwnedFd::from(child.stdout.take().unwrap());
            child.wait().unwrap();
            out
        };
        let (socket, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let null = std::fs::File::open("/dev/null").unwrap();
        let small = memfd("capi-vk-small");
        let big = shmb_vulkan_export {
            alloc_size: 8192,
            ..export()
        };
        let cases: Vec<(OwnedFd, shmb_vulkan_export, &str)> = vec![
            (pipe, export(), "memory fd is a pipe"),
            (socket.into(), export(), "memory fd is a socket"),
            (null.into(), export(), "memory devices"),
            (
                small,
                big,
                "holds 4096 bytes, fewer than the declared allocation size 8192",
            ),
        ];
        for (fd, exported, words) in cases {
            let spec = new_spec();
            assert_eq!(add(spec, fd.as_raw_fd(), &exported, SHMB_NO_FD, 0), SHMB_OK);
            let (status, text, engine) = create(spec);
            assert_eq!(status, SHMB_INVALID_SPEC, "{words}: {text}");
            assert!(text.contains(words), "{words}: {text}");
            assert!(engine.is_null());
            assert_eq!(shmb_spec_free(spec), SHMB_OK);
        }
        assert_eq!(
            copies("capi-vk-small"),
            0,
            "a copy of a refused fd was kept"
        );
    }

    #[cfg(not(feature = "vulkan"))]
    #[test]
    fn a_build_without_vulkan_says_so_at_creation() {
        let fd = memfd("capi-vk-unavailable");
        let spec = new_spec();
        assert_eq!(add(spec, fd.as_raw_fd(), &export(), SHMB_NO_FD, 0), SHMB_OK);
        let (status, text, engine) = create(spec);
        assert_eq!(status, SHMB_VULKAN_UNAVAILABLE, "{text}");
        assert!(text.contains("without the `vulkan` feature"), "{text}");
        assert!(engine.is_null());
        assert_eq!(shmb_spec_free(spec), SHMB_OK);
    }

    #[cfg(feature = "vulkan")]
    #[test]
    fn the_library_keeps_its_own_copy_until_the_engine_and_spec_are_gone() {
        let (memory, semaphore) = ("capi-vk-own-memory", "capi-vk-own-semaphore");
        let (m, s) = (memfd(memory), memfd(semaphore));
        let spec = new_spec();
        let timeline = shmb_semaphore_kind::SHMB_SEMAPHORE_TIMELINE as u32;
        assert_eq!(
            add(spec, m.as_raw_fd(), &export(), s.as_raw_fd(), timeline),
            SHMB_OK
        );
        assert_eq!((copies(memory), copies(semaphore)), (2, 2));
        // The caller closes its fds at once: the library's copies serve.
        drop((m, s));
        assert_eq!((copies(memory), copies(semaphore)), (1, 1));
        let (status, text, engine) = create(spec);
        assert_eq!(status, SHMB_OK, "{text}");
        assert_eq!(shmb_spec_free(spec), SHMB_OK);
        assert_eq!((copies(memory), copies(semaphore)), (1, 1), "the engine's");
        // The renderer writes the tensor, not the engine through the library.
        let (mut data, mut nbytes) = (std::ptr::null_mut(), 0usize);
        // SAFETY: a live engine, a valid name and out-pointers.
        let found = unsafe {
            crate::shmb_engine_tensor(engine, c"frame".as_ptr(), 0, &mut data, &mut nbytes)
        };
        assert_eq!(found, SHMB_NOT_ON_HOST, "{}", message());
        let mut name = std::ptr::null();
        // SAFETY: a live engine and a valid out-pointer.
        assert_eq!(
            unsafe { crate::shmb_engine_name(engine, &mut name) },
            SHMB_OK
        );
        // SAFETY: the engine's name, valid while it lives.
        let region = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        assert_eq!(crate::shmb_engine_close(engine), SHMB_OK);
        assert_eq!((copies(memory), copies(semaphore)), (0, 0));
        assert!(!std::path::Path::new(&format!("/dev/shm/{region}")).exists());
    }

    #[cfg(feature = "vulkan")]
    #[test]
    fn a_semaphore_value_is_checked_against_the_frames_number() {
        let spec = new_spec();
        let fd = memfd("capi-vk-signal");
        let timeline = shmb_semaphore_kind::SHMB_SEMAPHORE_TIMELINE as u32;
        let raw = fd.as_raw_fd();
        assert_eq!(add(spec, raw, &export(), raw, timeline), SHMB_OK);
        let (status, text, engine) = create(spec);
        assert_eq!(status, SHMB_OK, "{text}");
        let mut next = u64::MAX;
        // SAFETY: live handles and valid out-pointers, here and below.
        unsafe {
            assert_eq!(shmb_engine_next_frame(engine, &mut next), SHMB_OK);
            assert_eq!(next, 0);
            assert_eq!(
                shmb_engine_next_frame(engine, std::ptr::null_mut()),
                SHMB_INVALID_ARGUMENT
            );
        }
        let mut frame = u64::MAX;
        // SAFETY: as above.
        unsafe {
            // Without the value (plain publish), or with another: refused, nothing
            // published (frame 0 is still to come, and `*frame` is not written).
            assert_eq!(
                crate::shmb_engine_publish(engine, &mut frame),
                SHMB_INVALID_SPEC
            );
            assert!(
                message().contains("has a timeline semaphore"),
                "{}",
                message()
            );
            assert_eq!(frame, u64::MAX, "written on failure");
            assert_eq!(
                shmb_engine_publish_signaled(engine, 1, &mut frame),
                SHMB_INVALID_SPEC
            );
            assert!(message().contains("with 1 for frame 0"), "{}", message());
            assert_eq!(frame, u64::MAX, "written on failure");
            assert_eq!(shmb_engine_publish_signaled(engine, 0, &mut frame), SHMB_OK);
            assert_eq!(frame, 0);
        }
        assert_eq!(crate::shmb_engine_close(engine), SHMB_OK);
        assert_eq!(shmb_spec_free(spec), SHMB_OK);

        // An engine without a semaphore says nothing.
        let spec = new_spec();
        assert_eq!(add(spec, raw, &export(), SHMB_NO_FD, 0), SHMB_OK);
        let (status, text, engine) = create(spec);
        assert_eq!(status, SHMB_OK, "{text}");
        // SAFETY: as above.
        unsafe {
            assert_eq!(
                shmb_engine_publish_signaled(engine, 0, &mut frame),
                SHMB_INVALID_SPEC
            );
            assert!(message().contains("have no semaphore"), "{}", message());
            assert_eq!(crate::shmb_engine_publish(engine, &mut frame), SHMB_OK);
        }
        assert_eq!(crate::shmb_engine_close(engine), SHMB_OK);
        assert_eq!(shmb_spec_free(spec), SHMB_OK);
        assert_eq!(
            // SAFETY: a closed handle: refused, never dereferenced.
            unsafe { shmb_engine_publish_signaled(engine, 0, &mut frame) },
            SHMB_CLOSED
        );
    }
}
