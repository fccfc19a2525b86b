//! Builder and validation, against each other.

use super::*;
use crate::device::Device;
use crate::error::Error;

fn standard() -> HeaderBuilder {
    HeaderBuilder::new(
        "test",
        4,
        &[
            TensorSpec::new("obs", DType::F32, &[4, 3], Direction::EngineToClient),
            TensorSpec::new("actions", DType::I64, &[4, 1], Direction::ClientToEngine),
            TensorSpec::new("big", DType::U8, &[2, 84, 84, 3], Direction::EngineToClient),
        ],
        4096,
    )
    .unwrap()
}

fn published(b: &HeaderBuilder) -> Vec<u8> {
    let mut bytes = b.bytes();
    bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
    bytes
}

#[test]
fn builder_output_validates() {
    let b = standard();
    let l = validate("r", &published(&b), b.header.region_size).unwrap();
    assert_eq!(l.tensors, b.tensors);
    assert_eq!(l.engine_kind, "test");
    for t in &l.tensors {
        assert_eq!(t.offset % DATA_ALIGN, 0);
        assert!(t.offset >= l.header_size);
        if t.nbytes >= PAGE {
            assert_eq!(t.offset % PAGE, 0);
        }
    }
}

#[test]
fn unpublished_magic_is_bad_magic() {
    let b = standard();
    let err = validate("r", &b.bytes(), b.header.region_size).unwrap_err();
    assert!(matches!(err, Error::BadMagic { found: 0, .. }), "{err}");
}

#[test]
fn dtype_codes_round_trip() {
    for d in DType::ALL {
        let (c, b) = d.dlpack();
        assert_eq!(DType::from_dlpack(c, b, 1), Some(d));
        assert_eq!(DType::parse(d.name()), Some(d));
        assert_eq!(d.size() * 8, b as usize);
    }
    assert_eq!(DType::from_dlpack(DL_FLOAT, 32, 2), None);
}

#[test]
fn bad_specs_are_rejected() {
    let t = |shape: &[u64]| TensorSpec::new("x", DType::F32, shape, Direction::EngineToClient);
    assert!(HeaderBuilder::new("k", 0, &[t(&[1])], 0).is_err());
    assert!(HeaderBuilder::new("k", 1, &[], 0).is_err());
    assert!(HeaderBuilder::new("k", 1, &[t(&[])], 0).is_err());
    assert!(HeaderBuilder::new("k", 1, &[t(&[0, 3])], 0).is_err());
    assert!(HeaderBuilder::new("k", 1, &[t(&[u64::MAX, 2])], 0).is_err());
    assert!(HeaderBuilder::new("k", 1, &[t(&[1; 9])], 0).is_err());
    assert!(HeaderBuilder::new("k", 1, &[t(&[1]), t(&[2])], 0).is_err());
    let long = "x".repeat(NAME_LEN);
    assert!(HeaderBuilder::new(&long, 1, &[t(&[1])], 0).is_err());
    assert!(HeaderBuilder::new("k", 1, &[t(&[1])], 100).is_err());
    assert!(HeaderBuilder::new("k", 1, &[t(&[1])], 32).is_err());
}

#[test]
fn cuda_tensors_share_one_allocation() {
    let mut b = HeaderBuilder::new(
        "gpu",
        4,
        &[
            TensorSpec::new("obs", DType::F32, &[4, 3], Direction::EngineToClient)
                .on(Device::cuda(1)),
            TensorSpec::new("actions", DType::I64, &[4, 1], Direction::ClientToEngine)
                .on(Device::cuda(1)),
            TensorSpec::new("host", DType::U8, &[5], Direction::EngineToClient),
        ],
        0,
    )
    .unwrap();
    assert_eq!(
        b.cuda_alloc,
        Some((1, CUDA_EXPORT_GRANULARITY)),
        "its own 2 MiB block"
    );
    assert_eq!((b.tensors[0].offset, b.tensors[1].offset), (0, 256));
    assert_eq!(b.tensors[2].location(), Location::Host);
    assert!(b.tensors[2].offset >= b.header.header_size as u64);
    // Not exported yet: a reader rejects it (no handle).
    assert!(validate("r", &published(&b), b.header.region_size).is_err());
    b.set_cuda_export([1; 64], [2; 16], [3; 64]);
    let l = validate("r", &published(&b), b.header.region_size).unwrap();
    assert_eq!(l.tensors, b.tensors);
    // 1.5: a CUDA region tags its close acknowledgements; its hash keeps 1.2-1.4
    // clients (which would acknowledge untagged) out.
    assert_eq!(l.version, (1, 5));
    assert_eq!(b.header.layout_hash, LAYOUT_HASH_CUDA_SESSIONS);
    assert_eq!(
        LAYOUT_HASH_CUDA_SESSIONS, 0x1899_948B_5E67_EEF5,
        "docs/protocol.md §3.3"
    );
    let mut as_1_4_reads_it = b.header;
    as_1_4_reads_it.magic = MAGIC;
    as_1_4_reads_it.version_minor = 4; // a 1.4 reader expects LAYOUT_HASH whatever the minor
    assert!(matches!(
        check_identity("r", &as_1_4_reads_it),
        Err(Error::LayoutMismatch { .. })
    ));
    assert!(l.has_cuda());
    assert_eq!(l.engine_event_handle, Some([3; 64]));
    let c = l.tensors[1].cuda.unwrap();
    let Device::Cuda(dev) = l.tensors[1].device else {
        panic!("on CUDA: {:?}", l.tensors[1].device)
    };
    assert_eq!((dev.ordinal, c.alloc_size), (1, CUDA_EXPORT_GRANULARITY));
    assert_eq!((dev.uuid, c.ipc_mem_handle), ([2; 16], [1; 64]));
    // Two devices in one engine are refused.
    let two = [
        TensorSpec::new("a", DType::F32, &[1], Direction::EngineToClient).on(Device::cuda(0)),
        TensorSpec::new("b", DType::F32, &[1], Direction::EngineToClient).on(Device::cuda(1)),
    ];
    assert!(matches!(
        HeaderBuilder::new("k", 1, &two, 0),
        Err(Error::InvalidSpec(_))
    ));
    let neg =
        [TensorSpec::new("a", DType::F32, &[1], Direction::EngineToClient).on(Device::cuda(-1))];
    assert!(HeaderBuilder::new("k", 1, &neg, 0).is_err());
}

/// The 1.9 words: a CUDA entry shared by fd carries `CUDA_FLAG_FD` and no IPC
/// handle, in a header of minor 9; every other combination is refused, naming why.
#[test]
fn cuda_entries_say_how_their_allocation_is_shared() {
    let specs = [
        TensorSpec::new("obs", DType::F32, &[4, 3], Direction::EngineToClient).on(Device::cuda(0)),
        TensorSpec::new("actions", DType::I64, &[4, 1], Direction::ClientToEngine)
            .on(Device::cuda(0)),
    ];
    let mut b = HeaderBuilder::new("gpu", 4, &specs, 0).unwrap();
    // The size cuMemCreate got: the tensors' bytes rounded up to the granularity.
    b.set_cuda_fd_export([2; 16], 2 << 20);
    let l = validate("r", &published(&b), b.header.region_size).unwrap();
    assert_eq!(l.tensors, b.tensors);
    assert_eq!(l.version, (1, VERSION_MINOR_CUDA_FD));
    for (t, d) in l.tensors.iter().zip(&b.descs) {
        let c = t.cuda.unwrap();
        assert_eq!((c.sharing, c.ipc_mem_handle), (CudaSharing::Fd, [0; 64]));
        assert_eq!((c.alloc_size, d.export_size), (2 << 20, 2 << 20));
    }
    // Ordered on the host: no engine event written, none read.
    assert_eq!(b.header.engine_event_handle, [0; 64]);
    assert_eq!(l.engine_event_handle, None);
    // An IPC table still needs its event.
    let mut no_event = HeaderBuilder::new("gpu", 4, &specs, 0).unwrap();
    no_event.set_cuda_export([1; 64], [2; 16], [0; 64]);
    assert!(matches!(
        validate("r", &published(&no_event), no_event.header.region_size),
        Err(Error::InvalidHeader {
            field: "engine_event_handle",
            ..
        })
    ));
    assert_eq!(b.descs[0].flags, CUDA_FLAG_FD);
    // Legacy exports are IPC, flags 0, as before.
    let mut ipc = HeaderBuilder::new("gpu", 4, &specs, 0).unwrap();
    ipc.set_cuda_export([1; 64], [2; 16], [3; 64]);
    let l = validate("r", &published(&ipc), ipc.header.region_size).unwrap();
    assert_eq!(l.tensors[0].cuda.unwrap().sharing, CudaSharing::Ipc);
    assert_eq!(ipc.descs[0].flags, 0);
    let refused = |edit: &dyn Fn(&mut HeaderBuilder), why: &str| {
        let mut h = HeaderBuilder::new("gpu", 4, &specs, 0).unwrap();
        h.set_cuda_fd_export([2; 16], h.cuda_alloc.unwrap().1);
        edit(&mut h);
        match validate("r", &published(&h), h.header.region_size) {
            Err(e @ Error::InvalidTensor { .. }) => {
                assert!(e.to_string().contains(why), "{why}: {e}")
            }
            other => panic!("{why}: {other:?}"),
        }
    };
    refused(&|h| h.header.version_minor = 8, "needs 1.9");
    refused(&|h| h.header.version_minor = 5, "needs 1.9");
    refused(
        &|h| h.descs[1].ipc_mem_handle[7] = 1,
        "also names an IPC memory handle",
    );
    refused(
        &|h| h.descs[0].flags = CUDA_FLAG_FD | 2,
        "unknown CUDA flags",
    );
    refused(&|h| h.descs[0].flags = 0x80, "unknown CUDA flags");
    refused(&|h| h.descs[0].flags = 0, "without an IPC memory handle");
}

/// `export_size` of CUDA memory shared by fd (the size a client maps), from a hostile
/// engine: at least each tensor's end (as for IPC), the same in every entry (one
/// allocation, one fd), and at most the cap of the tensors' end (the next power of two,
/// at least 2 MiB); each refusal names the rule, before anything is imported. IPC
/// entries keep their own sizes (a foreign engine may use several allocations).
#[test]
fn export_sizes_of_memory_shared_by_fd_are_one_bounded_size() {
    let specs = [
        TensorSpec::new("obs", DType::F32, &[4, 3], Direction::EngineToClient).on(Device::cuda(0)),
        TensorSpec::new("actions", DType::I64, &[4, 1], Direction::ClientToEngine)
            .on(Device::cuda(0)),
        TensorSpec::new("reward", DType::F32, &[4], Direction::EngineToClient),
    ];
    let made = |size: u64, edit: &dyn Fn(&mut HeaderBuilder)| {
        let mut h = HeaderBuilder::new("gpu", 4, &specs, 0).unwrap();
        h.set_cuda_fd_export([2; 16], size);
        edit(&mut h);
        validate("r", &published(&h), h.header.region_size)
    };
    let refused = |size: u64, edit: &dyn Fn(&mut HeaderBuilder), tensor: &str, why: &str| match made(
        size, edit,
    ) {
        Err(Error::InvalidTensor { tensor: t, reason }) => {
            assert_eq!(t, tensor, "{why}: {reason}");
            assert!(reason.contains(why), "{why}: {reason}");
        }
        other => panic!("{why}: {other:?}"),
    };
    // The tensors end at byte 256 + 32 (actions at 256): the cap is 2 MiB.
    assert_eq!(cuda_fd_export_cap(288), CUDA_EXPORT_GRANULARITY);
    for size in [288, 4096, 2 << 20] {
        let l = made(size, &|_| {}).unwrap_or_else(|e| panic!("{size}: {e}"));
        assert_eq!(l.tensors[1].cuda.unwrap().alloc_size, size);
    }
    // Below a tensor's end.
    refused(
        287,
        &|_| {},
        "actions",
        "lies outside its 287-byte allocation",
    );
    // Above the cap: one byte more, and an absurd size.
    refused((2 << 20) + 1, &|_| {}, "obs", "is more than 2097152");
    refused(u64::MAX, &|_| {}, "obs", "is more than 2097152");
    // Two sizes for the one allocation, each one valid on its own.
    refused(
        2 << 20,
        &|h| h.descs[1].export_size = 4096,
        "actions",
        "differs from the 2097152 of 'obs'",
    );
    // The cap follows the tensors: past 2 MiB, the next power of two.
    assert_eq!(cuda_fd_export_cap((2 << 20) + 1), 4 << 20);
    assert_eq!(cuda_fd_export_cap(3 << 30), 4 << 30);
    assert_eq!(cuda_fd_export_cap(u64::MAX), u64::MAX);
    // IPC entries: unchanged, their sizes are checked against the driver's mapping.
    let mut ipc = HeaderBuilder::new("gpu", 4, &specs, 0).unwrap();
    ipc.set_cuda_export([1; 64], [2; 16], [3; 64]);
    ipc.descs[0].export_size = 1 << 40;
    assert!(validate("r", &published(&ipc), ipc.header.region_size).is_ok());
}

#[test]
fn host_only_layouts_are_what_1_1_wrote() {
    // A host-only 1.3 header differs from a 1.1 one only in `version_minor`: every
    // 1.2 and 1.3 field is zero, so 1.1 readers (which ignore the minor) read it
    // unchanged.
    let b = standard();
    let h = &b.header;
    assert_eq!(h.version_minor, 3);
    assert_eq!(h.client_cuda_state, 0);
    assert!(h.engine_event_handle.iter().all(|&x| x == 0));
    assert!(h.client_event_handle.iter().all(|&x| x == 0));
    assert_eq!(b.cuda_alloc, None);
    for d in &b.descs {
        assert_eq!((d.location, d.device_ordinal, d.export_size), (0, 0, 0));
        assert!(d.ipc_mem_handle.iter().all(|&x| x == 0));
        assert!(d.device_uuid.iter().all(|&x| x == 0));
        assert!(d.driver_uuid.iter().all(|&x| x == 0));
        assert_eq!((d.flags, d.export_memory_type), (0, 0));
    }
    assert_eq!(LAYOUT_HASH, 0x1A78_E44F_F49A_C1E5);
}

#[test]
fn vulkan_tensors_round_trip_and_need_1_3() {
    use super::vulkan::{SemaphoreKind, VulkanExport};
    let memfd = |n| {
        let fd = rustix::fs::memfd_create(n, rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 1 << 16).unwrap();
        fd
    };
    let export = VulkanExport {
        alloc_size: 1 << 16,
        offset: 128,
        memory_type_index: 3,
        dedicated: true,
        device_uuid: [7; 16],
        driver_uuid: [8; 16],
    };
    let specs = [
        TensorSpec::new("obs", DType::F32, &[2, 3], Direction::EngineToClient),
        TensorSpec::vulkan_import("rgb", DType::U8, &[2, 8, 8, 4], memfd("m"), export)
            .with_semaphore(memfd("s"), SemaphoreKind::Timeline),
    ];
    let b = HeaderBuilder::new("k", 2, &specs, 0).unwrap();
    assert_eq!(b.vulkan.len(), 1);
    let d = &b.descs[1];
    assert_eq!((d.location, d.flags, d.offset), (2, 0b111, 128));
    assert_eq!((d.export_size, d.export_memory_type), (1 << 16, 3));
    assert_eq!((d.device_uuid, d.driver_uuid), ([7; 16], [8; 16]));
    let l = validate("r", &published(&b), b.header.region_size).unwrap();
    assert_eq!(l.tensors, b.tensors);
    assert_eq!(crate::device::vulkan::fd_count(&l), 2);
    // 1.6: Vulkan fds over the socket file, with proofs; the 1.5 control block.
    assert_eq!(l.version, (1, VERSION_MINOR_FD_HELLO));
    assert_eq!(b.header.layout_hash, LAYOUT_HASH_CUDA_SESSIONS);
    // The same bytes under a 1.2 header are refused.
    let mut old = published(&b);
    old[10..12].copy_from_slice(&2u16.to_le_bytes());
    old[24..32].copy_from_slice(&LAYOUT_HASH.to_le_bytes());
    assert!(matches!(
        validate("r", &old, b.header.region_size),
        Err(Error::InvalidTensor { .. })
    ));
    // A binary semaphore: refused by the builder, and by validation when a header says
    // so (flags bit 1 without bit 2).
    let binary = [
        TensorSpec::vulkan_import("rgb", DType::U8, &[2, 8, 8, 4], memfd("m"), export)
            .with_semaphore(memfd("s"), SemaphoreKind::Binary),
    ];
    assert!(matches!(
        HeaderBuilder::new("k", 2, &binary, 0),
        Err(Error::InvalidSpec(m)) if m.contains("timeline")
    ));
    let mut b = b;
    b.descs[1].flags = 0b011;
    assert!(matches!(
        validate("r", &published(&b), b.header.region_size),
        Err(Error::InvalidTensor { reason, .. }) if reason.contains("binary semaphore")
    ));
    // A span past the declared memory is refused by the builder.
    let too_far = VulkanExport {
        offset: 1 << 16,
        ..export
    };
    let spec = [TensorSpec::vulkan_import(
        "rgb",
        DType::U8,
        &[64],
        memfd("x"),
        too_far,
    )];
    assert!(matches!(
        HeaderBuilder::new("k", 1, &spec, 0),
        Err(Error::InvalidSpec(_))
    ));
    // An all-zero device UUID, which a client refuses, is refused by the builder.
    let anonymous = VulkanExport {
        device_uuid: [0; 16],
        ..export
    };
    let spec = [TensorSpec::vulkan_import(
        "rgb",
        DType::U8,
        &[64],
        memfd("z"),
        anonymous,
    )];
    assert!(matches!(
        HeaderBuilder::new("k", 1, &spec, 0),
        Err(Error::InvalidSpec(m)) if m.contains("device UUID is all zero")
    ));
}

/// The kernel says what an fd is: one that no driver exports (a pipe, a socket, a
/// directory, a terminal, /dev/null, a named file, an O_PATH descriptor) is refused before
/// it could reach a client, as is a memfd smaller than the declared allocation; a memfd
/// (lavapipe's exports are memfds) and an anonymous inode (a timerfd here, as a DRM sync
/// object or a dma-buf would be) pass, as does a semaphore memfd of any size.
#[test]
fn exported_fds_the_kernel_can_tell_are_wrong_are_refused() {
    use super::vulkan::{SemaphoreKind, VulkanExport};
    use std::os::fd::OwnedFd;
    let export = VulkanExport {
        alloc_size: 1 << 16,
        offset: 0,
        memory_type_index: 0,
        dedicated: false,
        device_uuid: [7; 16],
        driver_uuid: [8; 16],
    };
    let memfd = |size: u64| {
        let fd = rustix::fs::memfd_create("m", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, size).unwrap();
        fd
    };
    let build = |memory: OwnedFd, semaphore: Option<OwnedFd>| {
        let mut t = TensorSpec::vulkan_import("rgb", DType::U8, &[1 << 16], memory, export);
        if let Some(s) = semaphore {
            t = t.with_semaphore(s, SemaphoreKind::Timeline);
        }
        HeaderBuilder::new("k", 1, &[t], 0).map(|_| ())
    };
    let refused = |r: crate::error::Result<()>, words: &str| match r {
        Err(Error::InvalidSpec(m)) => assert!(m.contains(words), "{words}: {m}"),
        r => panic!("{words}: expected InvalidSpec, got {r:?}"),
    };
    // A pipe: a child's stdout.
    let pipe = || {
        let mut child = std::process::Command::new("true")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = OwnedFd::from(child.stdout.take().unwrap());
        child.wait().unwrap();
        out
    };
    refused(build(pipe(), None), "memory fd is a pipe");
    let (socket, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    refused(build(socket.into(), None), "memory fd is a socket");
    let dir = std::fs::File::open("/").unwrap();
    refused(build(dir.into(), None), "memory fd is a directory");
    let null = std::fs::File::open("/dev/null").unwrap();
    refused(build(null.into(), None), "memory devices");
    let path = rustix::fs::open("/", rustix::fs::OFlags::PATH, rustix::fs::Mode::empty()).unwrap();
    refused(build(path, None), "O_PATH");
    let named = std::env::temp_dir().join(format!("shmbridge-fd-kind-{}", std::process::id()));
    let file = std::fs::File::create(&named).unwrap();
    file.set_len(1 << 16).unwrap();
    std::fs::remove_file(&named).unwrap();
    // Unlinked now: a file with no name is what a memfd-less driver hands out.
    build(file.into(), None).unwrap();
    let file = std::fs::File::open("/proc/self/exe").unwrap();
    refused(build(file.into(), None), "a file with a name");
    if let Ok(tty) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/ptmx")
    {
        refused(build(tty.into(), None), "a terminal");
    }
    refused(build(memfd(4096), None), "holds 4096 bytes, fewer than");
    refused(
        build(memfd(1 << 16), Some(pipe())),
        "semaphore fd is a pipe",
    );
    // What may be legitimate passes.
    build(memfd(1 << 16), None).unwrap();
    build(memfd(1 << 20), Some(memfd(0))).unwrap();
    let anonymous = || {
        use rustix::time::{timerfd_create, TimerfdClockId, TimerfdFlags};
        timerfd_create(TimerfdClockId::Monotonic, TimerfdFlags::CLOEXEC).unwrap()
    };
    build(memfd(1 << 16), Some(anonymous())).unwrap();
    build(anonymous(), None).unwrap();
}
