//! Hostile regions: files in /dev/shm with broken headers. Attaching to each gives the
//! right typed error, never a panic or an out-of-bounds read; random corruption of a
//! valid header never panics the validator.

mod common;

use std::time::Duration;

use bytemuck::Zeroable;
use proptest::prelude::*;
use shmbridge::layout::{self, HeaderBuilder, TensorDesc, CONTROL_SIZE, DESC_SIZE, MAGIC};
use shmbridge::{AttachOptions, Client, DType, Direction, Error, TensorSpec};

fn valid_region() -> Vec<u8> {
    let b = HeaderBuilder::new(
        "hostile",
        4,
        &[
            TensorSpec::new("obs", DType::F32, &[4, 8], Direction::EngineToClient),
            TensorSpec::new("actions", DType::F32, &[4, 2], Direction::ClientToEngine),
        ],
        4096,
    )
    .unwrap();
    let mut bytes = b.bytes();
    bytes.resize(b.header.region_size as usize, 0);
    bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
    bytes
}

fn header_mut(bytes: &mut [u8]) -> &mut layout::Header {
    bytemuck::from_bytes_mut(&mut bytes[..CONTROL_SIZE])
}

fn desc_mut(bytes: &mut [u8], i: usize) -> &mut TensorDesc {
    let at = CONTROL_SIZE + i * DESC_SIZE;
    bytemuck::from_bytes_mut(&mut bytes[at..at + DESC_SIZE])
}

/// Writes `bytes` as a region file, attaches to it, removes it, returns the error.
fn attach_to(tag: &str, bytes: &[u8]) -> Error {
    attach_to_and_read(tag, bytes).0
}

/// [`attach_to`], and the region's bytes after the attempt.
fn attach_to_and_read(tag: &str, bytes: &[u8]) -> (Error, Vec<u8>) {
    let name = format!("shmbridge-hostile-{tag}-{}", std::process::id());
    let path = format!("/dev/shm/{name}");
    std::fs::write(&path, bytes).unwrap();
    let r = Client::attach(
        &name,
        AttachOptions::default().timeout(Duration::from_millis(50)),
    );
    let after = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    match r {
        Ok(_) => panic!("{tag}: attach succeeded on a hostile region"),
        Err(e) => (e, after),
    }
}

#[test]
fn wrong_magic() {
    let mut b = valid_region();
    b[..8].copy_from_slice(b"NOTSHMBR");
    let e = attach_to("magic", &b);
    assert!(
        matches!(e, Error::BadMagic { found, .. } if found == u64::from_le_bytes(*b"NOTSHMBR")),
        "{e}"
    );
}

#[test]
fn wrong_major_version_names_both() {
    let mut b = valid_region();
    header_mut(&mut b).version_major = 7;
    header_mut(&mut b).version_minor = 3;
    let e = attach_to("version", &b);
    assert!(
        matches!(
            e,
            Error::VersionMismatch {
                ours_major: 1,
                theirs_major: 7,
                theirs_minor: 3,
                ..
            }
        ),
        "{e}"
    );
    let msg = e.to_string();
    let ours = format!("{}.{}", layout::VERSION_MAJOR, layout::VERSION_MINOR);
    assert!(msg.contains(&ours) && msg.contains("7.3"), "{msg}");
}

#[test]
fn wrong_layout_hash() {
    let mut b = valid_region();
    header_mut(&mut b).layout_hash ^= 1;
    assert!(matches!(
        attach_to("hash", &b),
        Error::LayoutMismatch { .. }
    ));
}

#[test]
fn file_shorter_than_the_control_block() {
    let b = valid_region();
    let e = attach_to("trunc-ctl", &b[..100]);
    assert!(
        matches!(e, Error::RegionTooSmall { needed, actual: 100 } if needed == CONTROL_SIZE as u64),
        "{e}"
    );
    let e = attach_to("empty", &[]);
    assert!(matches!(e, Error::RegionTooSmall { actual: 0, .. }), "{e}");
}

#[test]
fn file_shorter_than_region_size() {
    let b = valid_region();
    let e = attach_to("trunc-data", &b[..4096 + 64]);
    assert!(
        matches!(e, Error::RegionTooSmall { actual: 4160, .. }),
        "{e}"
    );
}

#[test]
fn tensor_offset_past_the_end() {
    let mut b = valid_region();
    let size = header_mut(&mut b).region_size;
    desc_mut(&mut b, 1).offset = size;
    let e = attach_to("offset", &b);
    assert!(
        matches!(&e, Error::TensorOutOfBounds { tensor, .. } if tensor == "actions"),
        "{e}"
    );
}

#[test]
fn tensor_offset_plus_length_overflows() {
    let mut b = valid_region();
    desc_mut(&mut b, 0).offset = u64::MAX - 63;
    let e = attach_to("offset-overflow", &b);
    assert!(matches!(e, Error::TensorOutOfBounds { .. }), "{e}");
}

#[test]
fn tensor_inside_the_header() {
    let mut b = valid_region();
    desc_mut(&mut b, 0).offset = 0;
    assert!(matches!(
        attach_to("in-header", &b),
        Error::TensorOutOfBounds { .. }
    ));
}

#[test]
fn shape_product_overflows() {
    let mut b = valid_region();
    let d = desc_mut(&mut b, 0);
    d.shape[0] = 1 << 40;
    d.shape[1] = 1 << 40;
    let e = attach_to("shape", &b);
    assert!(
        matches!(&e, Error::InvalidTensor { reason, .. } if reason.contains("overflows")),
        "{e}"
    );
}

#[test]
fn nbytes_disagrees_with_shape() {
    let mut b = valid_region();
    desc_mut(&mut b, 0).nbytes *= 2;
    assert!(matches!(
        attach_to("nbytes", &b),
        Error::InvalidTensor { .. }
    ));
}

#[test]
fn overlapping_tensors() {
    let mut b = valid_region();
    let off = desc_mut(&mut b, 0).offset;
    desc_mut(&mut b, 1).offset = off;
    let e = attach_to("overlap", &b);
    assert!(
        matches!(&e, Error::InvalidTensor { reason, .. } if reason.contains("overlaps")),
        "{e}"
    );
}

#[test]
fn too_many_tensors_and_bad_fields() {
    let mut b = valid_region();
    header_mut(&mut b).tensor_count = 1_000_000;
    assert!(matches!(
        attach_to("count", &b),
        Error::InvalidHeader {
            field: "tensor_count",
            ..
        }
    ));

    let mut b = valid_region();
    header_mut(&mut b).header_size = 16;
    assert!(matches!(
        attach_to("hsize", &b),
        Error::InvalidHeader {
            field: "header_size",
            ..
        }
    ));

    let mut b = valid_region();
    desc_mut(&mut b, 0).name = [0xff; 32];
    assert!(matches!(attach_to("name", &b), Error::InvalidHeader { .. }));

    let mut b = valid_region();
    desc_mut(&mut b, 0).dtype_code = 9;
    assert!(matches!(
        attach_to("dtype", &b),
        Error::InvalidTensor { .. }
    ));

    let mut b = valid_region();
    desc_mut(&mut b, 0).ndim = 9;
    assert!(matches!(attach_to("ndim", &b), Error::InvalidTensor { .. }));

    let mut b = valid_region();
    desc_mut(&mut b, 0).location = 2;
    let e = attach_to("vulkan", &b);
    assert!(
        matches!(&e, Error::InvalidTensor { reason, .. } if reason.contains("vulkan")),
        "{e}"
    );

    let mut b = valid_region();
    *desc_mut(&mut b, 1) = TensorDesc::zeroed();
    assert!(matches!(
        attach_to("zero-desc", &b),
        Error::InvalidHeader { .. }
    ));
}

#[test]
fn hostile_rings() {
    let mut b = valid_region();
    header_mut(&mut b).c2e_ring_capacity = 1000;
    let e = attach_to("ring-cap", &b);
    assert!(
        matches!(
            e,
            Error::InvalidHeader {
                field: "c2e ring",
                ..
            }
        ),
        "{e}"
    );

    let mut b = valid_region();
    let size = header_mut(&mut b).region_size;
    header_mut(&mut b).e2c_ring_offset = size;
    let e = attach_to("ring-end", &b);
    assert!(
        matches!(
            e,
            Error::InvalidHeader {
                field: "e2c ring",
                ..
            }
        ),
        "{e}"
    );

    let mut b = valid_region();
    header_mut(&mut b).e2c_ring_offset = u64::MAX - 4095;
    assert!(matches!(
        attach_to("ring-overflow", &b),
        Error::InvalidHeader { .. }
    ));

    let mut b = valid_region();
    let obs = desc_mut(&mut b, 0).offset;
    header_mut(&mut b).c2e_ring_offset = obs & !4095;
    let e = attach_to("ring-overlap", &b);
    assert!(
        matches!(&e, Error::InvalidTensor { reason, .. } if reason.contains("overlaps")),
        "{e}"
    );

    let mut b = valid_region();
    header_mut(&mut b).c2e_ring_offset = 0;
    assert!(matches!(
        attach_to("ring-in-header", &b),
        Error::InvalidHeader { .. }
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Any corruption of any header byte, and any truncation: `validate` returns, it never
    /// panics, and whatever it accepts lies inside the region.
    #[test]
    fn validate_never_panics(
        edits in proptest::collection::vec((0usize..CONTROL_SIZE + 2 * DESC_SIZE, any::<u8>()), 1..16),
        cut in proptest::option::of(0usize..8192),
    ) {
        let mut b = valid_region();
        for (at, v) in edits {
            b[at] = v;
        }
        let size = cut.map_or(b.len(), |c| c.min(b.len()));
        if let Ok(l) = layout::validate("p", &b[..size], size as u64) {
            for t in &l.tensors {
                prop_assert!(t.offset + t.nbytes <= size as u64);
                prop_assert!(t.offset >= l.header_size);
            }
        }
    }
}

/// This process's start time (`/proc/self/stat` field 22), as an engine records its own.
fn my_start_time() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    after.split(' ').nth(19).unwrap().parse().unwrap()
}

/// Turns tensor 0 of a valid region into a well-formed CUDA (1.2) entry, of an engine
/// this PID namespace shows (this process).
fn cuda_region() -> Vec<u8> {
    let mut b = valid_region();
    header_mut(&mut b).engine_pid = std::process::id();
    header_mut(&mut b).engine_start_time = my_start_time();
    let d = desc_mut(&mut b, 0);
    d.location = 1;
    d.device_ordinal = 0;
    d.offset = 0;
    d.ipc_mem_handle = [7; 64];
    d.export_size = 256;
    header_mut(&mut b).engine_event_handle = [9; 64];
    b
}

#[test]
fn cuda_entries_are_checked() {
    // Well formed: validates (pure) ...
    let b = cuda_region();
    let l = layout::validate("r", &b, b.len() as u64).unwrap();
    let t = &l.tensors[0];
    assert_eq!(t.location(), shmbridge::Location::Cuda);
    let c = t.cuda.unwrap();
    assert_eq!((c.ipc_mem_handle, c.alloc_size), ([7; 64], 256));
    assert_eq!(l.engine_event_handle, Some([9; 64]));
    // ... but attaching is a typed CudaUnavailable where CUDA is unusable (a build
    // without the feature, or no driver), never a panic or a host view of device bytes.
    let e = attach_to("cuda-ok", &b);
    assert!(
        matches!(&e, Error::CudaUnavailable { reason } if reason.contains("'obs'")),
        "{e}"
    );

    type Breaker = fn(&mut Vec<u8>);
    let cases: [(&str, Breaker, &str); 6] = [
        ("minor-1", |b| header_mut(b).version_minor = 1, "need 1.2"),
        (
            "no-handle",
            |b| desc_mut(b, 0).ipc_mem_handle = [0; 64],
            "IPC memory handle",
        ),
        (
            "past-alloc",
            |b| desc_mut(b, 0).offset = 192,
            "outside its 256-byte",
        ),
        (
            "no-alloc",
            |b| desc_mut(b, 0).export_size = 0,
            "outside its 0-byte",
        ),
        (
            "overflow",
            |b| desc_mut(b, 0).offset = u64::MAX - 63,
            "outside its",
        ),
        (
            "ordinal",
            |b| desc_mut(b, 0).device_ordinal = -1,
            "ordinal -1",
        ),
    ];
    for (tag, breakit, want) in cases {
        let mut b = cuda_region();
        breakit(&mut b);
        let e = attach_to(tag, &b);
        assert!(
            matches!(&e, Error::InvalidTensor { reason, .. } if reason.contains(want)),
            "{tag}: {e}"
        );
    }
    let mut b = cuda_region();
    header_mut(&mut b).engine_event_handle = [0; 64];
    let e = attach_to("no-event", &b);
    assert!(
        matches!(
            &e,
            Error::InvalidHeader {
                field: "engine_event_handle",
                ..
            }
        ),
        "{e}"
    );
}

/// The CUDA path is chosen at attach, before the driver is probed or the slot claimed:
/// IPC handles of an engine this PID namespace does not show (another container) are
/// refused with the reason, before the claim. Memory shared by fd (1.9) is validated
/// wherever the engine is (no engine event needed: ordered on the host) and taken the fd
/// path: without a usable driver it is `CudaUnavailable` before the claim; with one, the
/// claim is made and the fd asked of the engine's socket, which this hand-made region
/// has none of (a typed error, and the slot let go).
#[test]
fn cuda_sharing_is_chosen_before_the_claim() {
    let claimed = |b: &[u8]| {
        let h: &layout::Header = bytemuck::from_bytes(&b[..CONTROL_SIZE]);
        h.client_state != 0 || h.client_pid != 0
    };
    // The engine recorded as this pid with another start time: not this namespace's.
    let mut b = cuda_region();
    header_mut(&mut b).engine_start_time += 1;
    let (e, after) = attach_to_and_read("cuda-other-pidns", &b);
    assert!(
        matches!(&e, Error::CudaUnavailable { reason }
            if reason.contains("'obs'") && reason.contains("do not cross PID namespaces")),
        "{e}"
    );
    assert!(!claimed(&after), "the slot was claimed");
    // Shared by fd (1.9): flags bit 0, no IPC handle, no engine event, wherever the
    // engine is.
    let gpu = shmbridge::device::probe().is_ok();
    for other_namespace in [false, true] {
        let mut b = cuda_region();
        header_mut(&mut b).engine_start_time += u64::from(other_namespace);
        header_mut(&mut b).version_minor = 9;
        header_mut(&mut b).layout_hash = layout::LAYOUT_HASH_CUDA_SESSIONS;
        header_mut(&mut b).engine_event_handle = [0; 64];
        let d = desc_mut(&mut b, 0);
        d.flags = layout::CUDA_FLAG_FD;
        d.ipc_mem_handle = [0; 64];
        let l = layout::validate("r", &b, b.len() as u64).unwrap();
        assert_eq!(l.tensors[0].cuda.unwrap().sharing, layout::CudaSharing::Fd);
        assert_eq!(l.engine_event_handle, None);
        let (e, after) = attach_to_and_read("cuda-fd", &b);
        if gpu {
            assert!(
                matches!(
                    &e,
                    Error::Io { .. } | Error::Protocol { .. } | Error::CudaUnavailable { .. }
                ),
                "{e}"
            );
        } else {
            assert!(
                matches!(&e, Error::CudaUnavailable { reason } if reason.contains("'obs'")),
                "{e}"
            );
            assert!(!claimed(&after), "the slot was claimed");
        }
    }
}

#[test]
fn engine_with_cuda_tensors_is_refused_with_a_reason() {
    use shmbridge::device::Device;
    let spec = shmbridge::EngineSpec::new("cuda-test", 2).tensor(
        "obs",
        DType::F32,
        &[2, 4],
        Direction::EngineToClient,
    );
    let mut spec = spec;
    spec.tensors[0] = spec.tensors[0].clone().on(Device::cuda(0));
    let e = shmbridge::Engine::create(spec).unwrap_err();
    assert!(matches!(e, Error::CudaUnavailable { .. }), "{e}");
}

/// A client refused for CUDA reasons (no `cuda` feature, no driver, no device) leaves
/// the region as it found it: no claimed slot, no event handle, no CUDA state.
#[test]
fn cuda_refusal_leaves_no_trace_in_the_region() {
    if shmbridge::device::probe().is_ok() {
        eprintln!("SKIPPED: CUDA is usable here; tests/cuda.rs covers the GPU path");
        return;
    }
    let b = cuda_region();
    let name = format!("shmbridge-hostile-cuda-trace-{}", std::process::id());
    let path = format!("/dev/shm/{name}");
    std::fs::write(&path, &b).unwrap();
    let r = Client::attach(
        &name,
        AttachOptions::default().timeout(Duration::from_millis(50)),
    );
    let after = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let e = r.unwrap_err();
    assert!(
        matches!(&e, Error::CudaUnavailable { reason } if reason.contains("'obs'")),
        "{e}"
    );
    assert_eq!(after, b, "the region is unchanged");
    let h: &layout::Header = bytemuck::from_bytes(&after[..CONTROL_SIZE]);
    assert_eq!((h.client_state, h.client_cuda_state), (0, 0));
    assert_eq!(h.client_event_handle, [0; 64]);
}
