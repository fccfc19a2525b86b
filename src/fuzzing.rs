//! Entry points shared by the fuzz targets (`fuzz/`) and the regression tests that replay
//! their findings (`tests/fuzz_regressions.rs`, `tests/hostile_headers.rs`). Not a stable
//! API.

use std::mem::offset_of;
use std::sync::OnceLock;

use crate::device::Device;
use crate::error::{Error, Peer, Result};
use crate::layout::layout_hash_for;
use crate::layout::{
    self, DType, Direction, Header, HeaderBuilder, Layout, TensorDesc, TensorSpec, CONTROL_SIZE,
    DATA_ALIGN, DESC_SIZE, LAYOUT_HASH_SHARDED, MAGIC, MAX_NDIM, MAX_SHARDS, MAX_TENSORS,
    MIN_RING_CAPACITY, NAME_LEN, PAGE, SHARD_ENTRY_SIZE, VERSION_MAJOR,
};
use crate::layout::{CudaSharing, ShardEntry, ShardWords, CUDA_FLAG_FD, VERSION_MINOR_CUDA_FD};
use crate::ring::HeapRing;
use crate::wire::Envelope;

/// Capacity of the ring the fuzzer drives.
pub const FUZZ_RING: u64 = 1024;

/// Interprets `data` as a hostile ring state and reads it the way a peer would: the first
/// 16 bytes are the head and tail counters (little-endian u64), the rest is the ring's
/// buffer. Pops records until the ring is empty or reports an error, decodes each as an
/// envelope, and also decodes the whole input as an envelope. Must never panic, read out
/// of bounds or loop forever; the invariants it checks panic (for the fuzzer) if broken.
pub fn ring_reader(data: &[u8]) {
    let _ = Envelope::decode(data);
    if data.len() < 16 {
        return;
    }
    let head = u64::from_le_bytes(data[..8].try_into().expect("8 bytes"));
    let tail = u64::from_le_bytes(data[8..16].try_into().expect("8 bytes"));
    let heap = HeapRing::new(FUZZ_RING).expect("valid capacity");
    heap.set_raw(head, tail, &data[16..]);
    let ring = heap.ring(Peer::Client);
    let mut record = Vec::new();
    // Each successful pop consumes ≥ 8 bytes of at most one capacity's worth.
    for _ in 0..=(FUZZ_RING / 8) {
        match ring.try_pop(&mut record) {
            Ok(true) => {
                assert!(record.len() as u64 <= ring.max_record());
                if let Ok(env) = Envelope::decode(&record) {
                    // Whatever decodes re-encodes to an envelope that decodes the same.
                    let again =
                        Envelope::decode(&env.encode()).expect("re-encoded envelope decodes");
                    assert_eq!(again, env);
                }
            }
            Ok(false) | Err(_) => return,
        }
    }
    panic!("ring yielded more records than it can hold");
}

// ---- Header and tensor-table validation (the `layout_header` target) ----

/// Size of one edit of a [`header`] input in edit mode.
pub const EDIT_SIZE: usize = 13;
/// Edits past this many are ignored (keeps one execution short).
const MAX_EDITS: usize = 64;

/// Runs [`layout::validate`] on a hostile header the way a client does and checks what it
/// accepts with [`check_layout`]. Returns the validation's result (tests assert that
/// hand-made hostile inputs are rejected). The first byte picks how the rest is read:
///
/// - even, raw: the next 8 bytes are the region's actual size (u64 LE, zero-padded if
///   short), the rest is the header snapshot.
/// - odd, edits: `data[0] >> 1` picks a valid header made by [`HeaderBuilder`] (one of
///   [`header_bases`], modulo their number); the rest is a list of [`EDIT_SIZE`]-byte
///   edits applied to it (see [`apply_edit`]), then the result is validated against the
///   (possibly edited) actual size. With no edits the base must validate to exactly what
///   the builder placed.
///
/// Must never panic or read out of bounds; the checks panic (for the fuzzer) if broken.
pub fn header(data: &[u8]) -> Result<Layout> {
    let Some((&mode, rest)) = data.split_first() else {
        return validate_checked(&[], 0);
    };
    if mode % 2 == 0 {
        let n = rest.len().min(8);
        let mut size = [0u8; 8];
        size[..n].copy_from_slice(&rest[..n]);
        return validate_checked(&rest[n..], u64::from_le_bytes(size));
    }
    let bases = header_bases();
    let base = &bases[usize::from(mode >> 1) % bases.len()];
    let mut bytes = base.bytes.clone();
    let mut actual = base.builder.header.region_size;
    let edits = rest.chunks_exact(EDIT_SIZE).take(MAX_EDITS);
    let unedited = edits.len() == 0;
    for e in edits {
        apply_edit(
            &mut bytes,
            &mut actual,
            e.try_into().expect("EDIT_SIZE bytes"),
        );
    }
    let result = validate_checked(&bytes, actual);
    if unedited {
        let l = result.as_ref().unwrap_or_else(|e| {
            panic!(
                "the builder's header '{}' does not validate: {e}",
                base.what
            )
        });
        assert_eq!(l.tensors, base.builder.tensors, "{}", base.what);
        assert_eq!(l.rings, base.builder.rings, "{}", base.what);
        assert_eq!(l.shards, base.builder.shards(), "{}", base.what);
        assert_eq!(
            l.region_size, base.builder.header.region_size,
            "{}",
            base.what
        );
    }
    result
}

fn validate_checked(bytes: &[u8], actual_region_size: u64) -> Result<Layout> {
    let result = layout::validate("fuzz", bytes, actual_region_size);
    match &result {
        Ok(l) => check_layout(l, bytes, actual_region_size),
        // Error messages quote hostile names and numbers: formatting must not panic.
        Err(e) => drop(e.to_string()),
    }
    result
}

/// What a client relies on in a layout that [`layout::validate`] accepted from `bytes`
/// against a region of `actual_region_size` bytes (docs/protocol.md §4). Panics if any
/// of it is broken.
pub fn check_layout(l: &Layout, bytes: &[u8], actual_region_size: u64) {
    let h = layout::read_header(bytes).expect("accepted, so a control block long");
    assert_eq!(h.magic, MAGIC);
    assert_eq!(l.version, (VERSION_MAJOR, h.version_minor));
    assert_eq!((l.num_envs, l.engine_pid), (h.num_envs, h.engine_pid));
    assert!(l.num_envs >= 1);
    assert_name(&l.engine_kind, &h.engine_kind, false);

    // The region: header, then data, all inside what is mapped.
    let count = l.tensors.len();
    assert!((1..=MAX_TENSORS).contains(&count));
    assert_eq!(count, h.tensor_count as usize);
    let table_end = (CONTROL_SIZE + count * DESC_SIZE) as u64;
    assert!(
        bytes.len() as u64 >= table_end,
        "the table lies in the snapshot"
    );
    assert_eq!(l.header_size, u64::from(h.header_size));
    assert!(table_end <= l.header_size && l.header_size <= l.region_size);
    assert!(l.region_size <= actual_region_size);

    // Host spans (tensors and rings) lie after the header, inside the region, and are
    // pairwise disjoint: a client hands out views of all of them at once.
    let mut spans: Vec<(u64, u64)> = Vec::with_capacity(count + 2);
    for (i, t) in l.tensors.iter().enumerate() {
        let at = CONTROL_SIZE + i * DESC_SIZE;
        let d: TensorDesc = bytemuck::pod_read_unaligned(&bytes[at..at + DESC_SIZE]);
        assert_name(&t.name, &d.name, true);
        assert!(
            !l.tensors[..i].iter().any(|o| o.name == t.name),
            "name '{}' twice",
            t.name
        );
        // What was accepted is what the table says.
        assert_eq!((t.offset, t.nbytes), (d.offset, d.nbytes));
        assert_eq!(usize::from(d.ndim), t.shape.len());
        assert_eq!(t.shape[..], d.shape[..t.shape.len()]);
        assert_eq!(
            DType::from_dlpack(d.dtype_code, d.dtype_bits, d.dtype_lanes),
            Some(t.dtype)
        );
        assert_eq!(Direction::from_u8(d.direction), Some(t.direction));
        assert_eq!(d.location, t.location().code());

        // The shape: 1..=8 non-zero dimensions whose product times the item size is
        // nbytes without overflow, and C-contiguous strides that fit an isize.
        assert!((1..=MAX_NDIM).contains(&t.shape.len()));
        assert!(!t.shape.contains(&0));
        let product = t
            .shape
            .iter()
            .try_fold(t.dtype.size() as u64, |acc, &s| acc.checked_mul(s));
        assert_eq!(product, Some(t.nbytes), "nbytes of '{}'", t.name);
        assert!(t.nbytes <= isize::MAX as u64);
        assert_eq!(t.numel().checked_mul(t.dtype.size() as u64), Some(t.nbytes));
        let strides = t.strides();
        assert_eq!(strides[..], d.strides[..strides.len()]);
        assert!(strides.iter().all(|&s| s > 0));
        assert_eq!(strides.last().copied(), Some(t.dtype.size() as i64));
        assert_eq!(t.offset % DATA_ALIGN, 0);

        let end = t.offset.checked_add(t.nbytes);
        match (t.device, &t.cuda) {
            _ if t.vulkan.is_some() != matches!(t.device, Device::Vulkan(_)) => {
                panic!("'{}': Vulkan table fields on a {} tensor", t.name, t.device)
            }
            (Device::Host, None) => {
                let end = end.expect("host span overflows");
                assert!(t.offset >= l.header_size, "'{}' inside the header", t.name);
                assert!(end <= l.region_size, "'{}' past the region", t.name);
                spans.push((t.offset, end));
            }
            (Device::Cuda(dev), Some(c)) => {
                assert!(
                    l.version.1 >= 2,
                    "CUDA tensor in a 1.{} header",
                    l.version.1
                );
                assert!(dev.ordinal >= 0);
                match c.sharing {
                    CudaSharing::Ipc => {
                        assert!(c.ipc_mem_handle.iter().any(|&b| b != 0));
                        assert_eq!(d.flags, 0, "'{}': flags of an IPC entry", t.name);
                    }
                    CudaSharing::Fd => {
                        assert!(
                            l.version.1 >= VERSION_MINOR_CUDA_FD,
                            "fd sharing before 1.9"
                        );
                        assert_eq!(c.ipc_mem_handle, [0; 64], "'{}': fd and handle", t.name);
                        assert_eq!(d.flags, CUDA_FLAG_FD, "'{}': flags", t.name);
                    }
                }
                assert!(
                    end.is_some_and(|e| e <= c.alloc_size),
                    "'{}' past its allocation",
                    t.name
                );
                assert_eq!(
                    (dev.ordinal, dev.uuid, c.ipc_mem_handle, c.alloc_size),
                    (
                        d.device_ordinal,
                        d.device_uuid,
                        d.ipc_mem_handle,
                        d.export_size
                    )
                );
            }
            (Device::Vulkan(v), None) => {
                assert!(
                    l.version.1 >= 3,
                    "Vulkan tensor in a 1.{} header",
                    l.version.1
                );
                let vk = t
                    .vulkan
                    .unwrap_or_else(|| panic!("'{}': Vulkan without its table fields", t.name));
                assert!(
                    end.is_some_and(|e| e <= vk.alloc_size),
                    "'{}' past its memory",
                    t.name
                );
                assert_eq!(
                    (
                        v.device_uuid,
                        v.driver_uuid,
                        vk.alloc_size,
                        vk.memory_type_index
                    ),
                    (
                        d.device_uuid,
                        d.driver_uuid,
                        d.export_size,
                        d.export_memory_type
                    )
                );
            }
            other => panic!("'{}': location and placement disagree: {other:?}", t.name),
        }
    }
    // Memory shared by fd (1.9): one allocation, so one size, and at most the cap of the
    // tensors' furthest end.
    let fd: Vec<_> = l
        .tensors
        .iter()
        .filter_map(|t| {
            t.cuda
                .filter(|c| c.sharing == CudaSharing::Fd)
                .map(|c| (t, c))
        })
        .collect();
    if let Some((_, first)) = fd.first() {
        let end = fd
            .iter()
            .map(|(t, _)| t.offset.saturating_add(t.nbytes))
            .max()
            .unwrap_or(0);
        assert!(fd.iter().all(|(_, c)| c.alloc_size == first.alloc_size));
        assert!(first.alloc_size <= layout::cuda_fd_export_cap(end));
    }
    // The engine's event handle: present (non-zero) exactly when a tensor is on CUDA and
    // shared by IPC handle (1.9: memory shared by fd is ordered on the host, no event).
    let ipc = l
        .tensors
        .iter()
        .any(|t| t.cuda.is_some_and(|c| c.sharing == CudaSharing::Ipc));
    match l.engine_event_handle {
        Some(handle) => {
            assert!(ipc);
            assert_eq!(handle, h.engine_event_handle);
            assert!(handle.iter().any(|&b| b != 0));
        }
        None => assert!(!ipc),
    }
    check_shards(l, &h, &mut spans);
    // 1.7: the stats area, exactly when flags bit 0 says so: one block per shard,
    // page-aligned, after the header, inside the region, apart from every other span.
    match l.stats {
        Some(a) => {
            assert_ne!(h.flags & layout::FLAG_OBSERVABLE, 0);
            assert_eq!(a.offset, h.stats_offset);
            assert_eq!(a.blocks as usize, l.shards.len());
            assert_eq!(a.offset % PAGE, 0);
            assert!(
                a.offset >= l.header_size,
                "the stats area inside the header"
            );
            let end = a.offset.checked_add(a.len()).expect("stats area overflows");
            assert!(end <= l.region_size, "the stats area past the region");
            spans.push((a.offset, end));
        }
        None => assert_eq!(h.flags & layout::FLAG_OBSERVABLE, 0),
    }
    if let Some(r) = l.rings {
        assert!(l.version.1 >= 1, "rings in a 1.0 header");
        assert_eq!(
            (r.c2e, r.e2c),
            (
                (h.c2e_ring_offset, h.c2e_ring_capacity),
                (h.e2c_ring_offset, h.e2c_ring_capacity)
            )
        );
        push_ring_spans(l, r, "the region", &mut spans);
    } else if l.version.1 >= 1 {
        assert_eq!((h.c2e_ring_capacity, h.e2c_ring_capacity), (0, 0));
    }
    for (i, a) in spans.iter().enumerate() {
        for b in &spans[..i] {
            assert!(a.1 <= b.0 || b.1 <= a.0, "spans {a:?} and {b:?} overlap");
        }
    }

    // The actual size only bounds the region: the same header validates against exactly
    // its region size, and is refused against one byte less.
    let exact = layout::validate("fuzz", bytes, l.region_size).expect("valid at its own size");
    assert_eq!(exact.tensors, l.tensors);
    assert!(matches!(
        layout::validate("fuzz", bytes, l.region_size - 1),
        Err(Error::RegionTooSmall { .. })
    ));
}

/// Checks a pair of accepted rings of `whose` (power-of-two capacities, page-aligned,
/// after the header, inside the region) and adds their spans to `spans`.
fn push_ring_spans(l: &Layout, r: layout::Rings, whose: &str, spans: &mut Vec<(u64, u64)>) {
    for (offset, capacity) in [r.c2e, r.e2c] {
        assert!(capacity.is_power_of_two() && capacity >= MIN_RING_CAPACITY);
        assert_eq!(offset % PAGE, 0);
        assert!(offset >= l.header_size, "{whose}: ring inside the header");
        let end = offset.checked_add(capacity).expect("ring span overflows");
        assert!(end <= l.region_size, "{whose}: ring past the region");
        spans.push((offset, end));
    }
}

/// The shards of an accepted layout (1.4): one in the control block, covering every
/// env, when `shard_count` is 0; else the table's entries: contiguous non-empty slices
/// covering every env, their words inside the header, every tensor on the host with the
/// env axis first, and every shard's rings after the header, inside the region (pushed
/// onto `spans` for the overlap check; shard 0's are the control block's, pushed there).
fn check_shards(l: &Layout, h: &Header, spans: &mut Vec<(u64, u64)>) {
    if h.shard_count == 0 {
        assert_eq!(l.shards.len(), 1);
        let s = l.shards[0];
        assert_eq!((s.index, s.env_start, s.env_count), (0, 0, l.num_envs));
        assert_eq!(s.words, ShardWords::CONTROL_BLOCK);
        assert_eq!(s.rings, l.rings);
        assert_eq!(h.layout_hash, layout_hash_for(0, h.version_minor));
        return;
    }
    assert!(l.version.1 >= 4, "shards in a 1.{} header", l.version.1);
    assert_eq!(h.layout_hash, LAYOUT_HASH_SHARDED);
    assert_eq!(l.shards.len(), h.shard_count as usize);
    assert!((2..=MAX_SHARDS).contains(&l.shards.len()));
    let mut next = 0;
    for (k, s) in l.shards.iter().enumerate() {
        assert_eq!(s.index as usize, k);
        assert_eq!(s.env_start, next, "shard {k} starts where the last ended");
        assert!(s.env_count >= 1);
        next = s.env_start + s.env_count;
        assert!(
            s.words.end() as u64 <= l.header_size,
            "shard {k}'s words in the header"
        );
        assert_eq!(s.rings.is_some(), l.rings.is_some());
        if let (Some(r), true) = (s.rings, k > 0) {
            push_ring_spans(l, r, &format!("shard {k}"), spans);
        } else if k == 0 {
            assert_eq!(s.rings, l.rings, "shard 0's rings are the control block's");
        }
        // The narrowed views a shard hands out stay inside its tensors.
        let slice = l.narrowed(s);
        for (t, whole) in slice.tensors.iter().zip(&l.tensors) {
            assert!(t.offset >= whole.offset);
            assert!(t.offset + t.nbytes <= whole.offset + whole.nbytes);
        }
    }
    assert_eq!(next, l.num_envs, "the shards cover every env");
    for t in &l.tensors {
        assert_eq!(t.device, Device::Host);
        assert_eq!(t.shape[0], u64::from(l.num_envs));
    }
}

/// A validated name: non-empty for tensors, at most NAME_LEN bytes, no NUL, and the
/// table's bytes up to their first NUL.
fn assert_name(name: &str, raw: &[u8; NAME_LEN], tensor: bool) {
    assert!(!tensor || !name.is_empty(), "empty tensor name");
    assert!(name.len() <= NAME_LEN && !name.contains('\0'));
    assert_eq!(name.as_bytes(), &raw[..name.len()]);
    assert!(raw[name.len()..].iter().all(|&b| b == 0));
}

/// A valid header the edit mode starts from.
pub struct HeaderBase {
    pub what: &'static str,
    pub builder: HeaderBuilder,
    /// The builder's bytes with `magic` published, as a client snapshots them.
    pub bytes: Vec<u8>,
}

/// The headers edit mode starts from: host and CUDA layouts, with and without rings, the
/// largest table, 1.0 / 1.1 headers, sharded ones and (1.9) CUDA memory shared by fd.
/// New bases go last: a stored input's first byte picks its base modulo their number.
pub fn header_bases() -> &'static [HeaderBase] {
    static BASES: OnceLock<Vec<HeaderBase>> = OnceLock::new();
    BASES.get_or_init(|| {
        let e2c = Direction::EngineToClient;
        let c2e = Direction::ClientToEngine;
        let host = [
            TensorSpec::new("obs", DType::F32, &[4, 3], e2c),
            TensorSpec::new("actions", DType::I64, &[4, 1], c2e),
            TensorSpec::new("frames", DType::U8, &[2, 84, 84, 3], e2c),
            TensorSpec::new("done", DType::Bool, &[4], e2c),
        ];
        let cuda = Device::cuda(0);
        let mixed = [
            TensorSpec::new("obs", DType::F16, &[4, 3], e2c).on(cuda),
            TensorSpec::new("actions", DType::I32, &[4], c2e).on(cuda),
            TensorSpec::new("reward", DType::F64, &[4], e2c),
        ];
        let all_cuda = [
            TensorSpec::new("obs", DType::BF16, &[8, 2, 2], e2c).on(cuda),
            TensorSpec::new("actions", DType::U16, &[8, 1], c2e).on(cuda),
        ];
        let widest: Vec<TensorSpec> = (0..MAX_TENSORS)
            .map(|i| {
                let shape: Vec<u64> = (0..=i % MAX_NDIM).map(|k| (k % 3 + 1) as u64).collect();
                let dir = if i % 2 == 0 { e2c } else { c2e };
                TensorSpec::new(
                    &format!("t{i}"),
                    DType::ALL[i % DType::ALL.len()],
                    &shape,
                    dir,
                )
            })
            .collect();
        let build = |what, kind, specs: &[TensorSpec], ring, minor: Option<u16>| {
            let mut builder = HeaderBuilder::new(kind, 2, specs, ring).expect("a valid spec");
            builder.set_cuda_export([0xC1; 64], [0x0D; 16], [0xE7; 64]);
            if let Some(minor) = minor {
                builder.header.version_minor = minor;
            }
            let mut bytes = builder.bytes();
            bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
            HeaderBase {
                what,
                builder,
                bytes,
            }
        };
        // 1.4: three shards over 6 envs, every tensor with the env axis first.
        let sharded = |what, ring| {
            let specs = [
                TensorSpec::new("obs", DType::F32, &[6, 3], e2c),
                TensorSpec::new("actions", DType::I64, &[6, 1], c2e),
                TensorSpec::new("frames", DType::U8, &[6, 84, 84, 3], e2c),
            ];
            let builder =
                HeaderBuilder::sharded("shards", 6, &specs, ring, 3).expect("a valid spec");
            let mut bytes = builder.bytes();
            bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
            HeaderBase {
                what,
                builder,
                bytes,
            }
        };
        // 1.9: the CUDA memory of the mixed base shared by fd (its size as `cuMemCreate`
        // gets it on a 2 MiB-granular device).
        let shared_by_fd = {
            let mut base = build("cuda shared by fd", "gpu", &mixed, 64, None);
            let size = base.builder.cuda_alloc.expect("CUDA tensors").1;
            base.builder.set_cuda_fd_export([0x0D; 16], size);
            base.bytes = base.builder.bytes();
            base.bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
            base
        };
        vec![
            build("host with rings", "host", &host, 4096, None),
            build("host without rings", "host", &host, 0, None),
            build("cuda and host with rings", "gpu", &mixed, 64, None),
            build("cuda without rings", "gpu", &all_cuda, 0, None),
            build("64 tensors with rings", "wide", &widest, 128, None),
            build("1.0 header", "old", &host, 0, Some(0)),
            build("1.1 header with rings", "rings", &host, 1024, Some(1)),
            sharded("3 shards with rings", 4096),
            sharded("3 shards without rings", 0),
            shared_by_fd,
        ]
    })
}

/// Valid inputs of [`header`], for the fuzzer's corpus: each base as a raw snapshot and
/// as an edit-mode input with no edits. (file name, bytes)
pub fn header_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds = Vec::new();
    for (i, base) in header_bases().iter().enumerate() {
        let mut raw = vec![0u8];
        raw.extend_from_slice(&base.builder.header.region_size.to_le_bytes());
        raw.extend_from_slice(&base.bytes);
        seeds.push((format!("raw-{i}.bin"), raw));
        seeds.push((format!("edit-{i}.bin"), vec![(i as u8) << 1 | 1]));
    }
    seeds
}

/// A field of the control block: (byte offset, width); byte arrays by element.
const HEADER_FIELDS: [(usize, usize); 14] = [
    (offset_of!(Header, magic), 8),
    (offset_of!(Header, version_major), 2),
    (offset_of!(Header, version_minor), 2),
    (offset_of!(Header, header_size), 4),
    (offset_of!(Header, region_size), 8),
    (offset_of!(Header, layout_hash), 8),
    (offset_of!(Header, num_envs), 4),
    (offset_of!(Header, tensor_count), 4),
    (offset_of!(Header, table_offset), 4),
    (offset_of!(Header, desc_size), 4),
    (offset_of!(Header, c2e_ring_offset), 8),
    (offset_of!(Header, c2e_ring_capacity), 8),
    (offset_of!(Header, e2c_ring_offset), 8),
    (offset_of!(Header, e2c_ring_capacity), 8),
];
/// Byte arrays of the control block: (byte offset, length).
const HEADER_ARRAYS: [(usize, usize); 2] = [
    (offset_of!(Header, engine_kind), NAME_LEN),
    (offset_of!(Header, engine_event_handle), 64),
];
/// A field of a tensor-table entry: (byte offset, width); `shape` and `strides` by element.
const DESC_FIELDS: [(usize, usize); 12] = [
    (offset_of!(TensorDesc, dtype_code), 1),
    (offset_of!(TensorDesc, dtype_bits), 1),
    (offset_of!(TensorDesc, dtype_lanes), 2),
    (offset_of!(TensorDesc, ndim), 1),
    (offset_of!(TensorDesc, direction), 1),
    (offset_of!(TensorDesc, location), 1),
    (offset_of!(TensorDesc, flags), 1),
    (offset_of!(TensorDesc, device_ordinal), 4),
    (offset_of!(TensorDesc, offset), 8),
    (offset_of!(TensorDesc, nbytes), 8),
    (offset_of!(TensorDesc, export_size), 8),
    (offset_of!(TensorDesc, export_memory_type), 4),
];
/// Arrays of a tensor-table entry: (byte offset, element width, length).
const DESC_ARRAYS: [(usize, usize, usize); 5] = [
    (offset_of!(TensorDesc, name), 1, NAME_LEN),
    (offset_of!(TensorDesc, shape), 8, MAX_NDIM),
    (offset_of!(TensorDesc, strides), 8, MAX_NDIM),
    (offset_of!(TensorDesc, ipc_mem_handle), 1, 64),
    (offset_of!(TensorDesc, device_uuid), 1, 16),
];
/// Operations past the field writes.
const OP_RESHAPE: usize =
    HEADER_FIELDS.len() + HEADER_ARRAYS.len() + DESC_FIELDS.len() + DESC_ARRAYS.len();
const OP_ACTUAL_SIZE: usize = OP_RESHAPE + 1;
const OP_TRUNCATE: usize = OP_ACTUAL_SIZE + 1;
const OP_COPY_DESC: usize = OP_TRUNCATE + 1;
/// 1.4: a field of the header's shard words ([`SHARD_HEADER_FIELDS`], by `element`).
const OP_SHARD_HEADER: usize = OP_COPY_DESC + 1;
/// 1.4: a field of shard-table entry `tensor` ([`SHARD_ENTRY_FIELDS`], by `element`).
const OP_SHARD_ENTRY: usize = OP_SHARD_HEADER + 1;
/// 1.7: a field of the header's stats words ([`STATS_FIELDS`], by `element`).
const OP_STATS: usize = OP_SHARD_ENTRY + 1;
const OPS: usize = OP_STATS + 1;

/// The header's stats fields (1.7): (byte offset, width).
const STATS_FIELDS: [(usize, usize); 2] = [
    (offset_of!(Header, flags), 8),
    (offset_of!(Header, stats_offset), 8),
];

/// The header's shard fields (1.4): (byte offset, width).
const SHARD_HEADER_FIELDS: [(usize, usize); 2] = [
    (offset_of!(Header, shard_count), 4),
    (offset_of!(Header, shard_table_offset), 4),
];
/// The fields of a shard-table entry a creator writes (1.4): (byte offset, width).
const SHARD_ENTRY_FIELDS: [(usize, usize); 5] = [
    (offset_of!(ShardEntry, env_start), 4),
    (offset_of!(ShardEntry, env_count), 4),
    (offset_of!(ShardEntry, c2e_ring_offset), 8),
    (offset_of!(ShardEntry, e2c_ring_offset), 8),
    (offset_of!(ShardEntry, state), 4),
];

/// Applies one edit `[op, tensor, element, kind, anchor, value: u64 LE]` to a header
/// snapshot and the region's actual size. `op` (modulo the number of operations) picks
/// a header field, a field of entry `tensor` (modulo the entries in `bytes`), element
/// `element` of an array, or: recompute entry `tensor`'s nbytes and strides from its
/// shape and dtype (so that a new shape stays consistent and validation gets past it);
/// set the actual size; truncate the snapshot to `value` bytes; copy entry `anchor` over
/// entry `tensor`. The value written is, by `kind % 4`: `value`; the field's current
/// value + `value`; an anchor + `value`; an anchor − `value` (wrapping; the anchors are
/// sizes and span ends of the header, see [`anchor`]). Fields outside `bytes` are skipped.
pub fn apply_edit(bytes: &mut Vec<u8>, actual: &mut u64, edit: &[u8; EDIT_SIZE]) {
    let [op, tensor, element, kind, anchor_id, ..] = *edit;
    let raw = u64::from_le_bytes(edit[5..].try_into().expect("8 bytes"));
    let (op, element) = (usize::from(op) % OPS, usize::from(element));
    let descs = bytes.len().saturating_sub(CONTROL_SIZE) / DESC_SIZE;
    let desc = |i: usize| CONTROL_SIZE + (i % descs.max(1)) * DESC_SIZE;
    let tensor = desc(usize::from(tensor));
    let value = |bytes: &[u8], current: u64| match kind % 4 {
        0 => raw,
        1 => current.wrapping_add(raw),
        2 => anchor(bytes, *actual, anchor_id).wrapping_add(raw),
        _ => anchor(bytes, *actual, anchor_id).wrapping_sub(raw),
    };
    let (at, width) = match op {
        _ if op < HEADER_FIELDS.len() => HEADER_FIELDS[op],
        _ if op < HEADER_FIELDS.len() + HEADER_ARRAYS.len() => {
            let (at, len) = HEADER_ARRAYS[op - HEADER_FIELDS.len()];
            (at + element % len, 1)
        }
        _ if op < HEADER_FIELDS.len() + HEADER_ARRAYS.len() + DESC_FIELDS.len() => {
            let (at, width) = DESC_FIELDS[op - HEADER_FIELDS.len() - HEADER_ARRAYS.len()];
            (tensor + at, width)
        }
        OP_RESHAPE => return reshape(bytes, tensor),
        OP_ACTUAL_SIZE => {
            *actual = value(bytes, *actual);
            return;
        }
        OP_TRUNCATE => {
            let len = bytes.len() as u64;
            bytes.truncate(value(bytes, len).min(len) as usize);
            return;
        }
        OP_COPY_DESC => {
            let from = desc(usize::from(anchor_id));
            if from + DESC_SIZE <= bytes.len() && tensor + DESC_SIZE <= bytes.len() {
                bytes.copy_within(from..from + DESC_SIZE, tensor);
            }
            return;
        }
        OP_SHARD_HEADER => SHARD_HEADER_FIELDS[element % SHARD_HEADER_FIELDS.len()],
        OP_STATS => STATS_FIELDS[element % STATS_FIELDS.len()],
        OP_SHARD_ENTRY => {
            // Entry `tensor` of the table the header points at (its count, at least 1).
            let h =
                |field: (usize, usize)| bytes.get(field.0..field.0 + field.1).map_or(0, read_le);
            let count = h(SHARD_HEADER_FIELDS[0]).max(1);
            let table = h(SHARD_HEADER_FIELDS[1]) as usize;
            let entry = table + (usize::from(edit[1]) % count as usize) * SHARD_ENTRY_SIZE;
            let (at, width) = SHARD_ENTRY_FIELDS[element % SHARD_ENTRY_FIELDS.len()];
            (entry + at, width)
        }
        _ => {
            let arrays = HEADER_FIELDS.len() + HEADER_ARRAYS.len() + DESC_FIELDS.len();
            let (at, width, len) = DESC_ARRAYS[op - arrays];
            (tensor + at + element % len * width, width)
        }
    };
    if at + width <= bytes.len() {
        let current = read_le(&bytes[at..at + width]);
        let new = value(bytes, current).to_le_bytes();
        bytes[at..at + width].copy_from_slice(&new[..width]);
    }
}

/// Values an edit can be relative to, `id % 16`: 0, region_size, header_size, the table's
/// end, the actual size, each ring's offset and end, u64::MAX, i64::MAX, a page; and of
/// entry `id / 16`: offset, end (offset + nbytes), nbytes, export_size, shape[0].
fn anchor(bytes: &[u8], actual: u64, id: u8) -> u64 {
    let at = |offset: usize, width: usize| bytes.get(offset..offset + width).map_or(0, read_le);
    let h = |field: usize| at(HEADER_FIELDS[field].0, HEADER_FIELDS[field].1);
    let descs = bytes.len().saturating_sub(CONTROL_SIZE) / DESC_SIZE;
    let desc = CONTROL_SIZE + usize::from(id / 16) % descs.max(1) * DESC_SIZE;
    let d = |field: usize| at(desc + field, 8);
    match id % 16 {
        0 => 0,
        1 => h(4),
        2 => h(3),
        3 => (CONTROL_SIZE as u64).wrapping_add(h(7).wrapping_mul(DESC_SIZE as u64)),
        4 => actual,
        5 => h(10),
        6 => h(10).wrapping_add(h(11)),
        7 => h(12),
        8 => h(12).wrapping_add(h(13)),
        9 => u64::MAX,
        10 => i64::MAX as u64,
        11 => PAGE,
        12 => d(offset_of!(TensorDesc, offset)),
        13 => d(offset_of!(TensorDesc, offset)).wrapping_add(d(offset_of!(TensorDesc, nbytes))),
        14 => d(offset_of!(TensorDesc, nbytes)),
        _ => d(offset_of!(TensorDesc, export_size)),
    }
}

/// Makes entry `at`'s nbytes and strides agree with its dtype and shape (wrapping, so
/// overflow is left for validation to find), zeroing shape and strides past ndim.
fn reshape(bytes: &mut [u8], at: usize) {
    let Some(entry) = bytes.get_mut(at..at + DESC_SIZE) else {
        return;
    };
    let mut d: TensorDesc = bytemuck::pod_read_unaligned(entry);
    let ndim = usize::from(d.ndim).min(MAX_NDIM);
    let item = u64::from(d.dtype_bits / 8);
    d.shape[ndim..].fill(0);
    d.strides[ndim..].fill(0);
    let mut acc = item;
    for k in (0..ndim).rev() {
        d.strides[k] = acc as i64;
        acc = acc.wrapping_mul(d.shape[k]);
    }
    d.nbytes = acc;
    entry.copy_from_slice(bytemuck::bytes_of(&d));
}

fn read_le(b: &[u8]) -> u64 {
    let mut v = [0u8; 8];
    v[..b.len()].copy_from_slice(b);
    u64::from_le_bytes(v)
}

// ---- Trajectory streams (the `stream_record` target) ----

/// Capacity of the lane the stream fuzzer drives.
pub const FUZZ_LANE: u64 = 256;

/// Reads hostile stream bytes the way a consumer does. The first byte picks how the rest
/// is read: even, a lane: three little-endian u64 (`head`, `read`, `tail`, zero-padded if
/// short), then the lane's 256 bytes of data (zero-padded), under the schema
/// `tokens: int32[*], score: float64[1], meta: uint8[*]`; every record is claimed,
/// decoded, its fields read, and released, until the lane is empty or an error. Odd: a
/// stream header, validated against its own length. Must never panic, read out of bounds
/// or loop forever; the checks panic (for the fuzzer) if what was accepted breaks the
/// rules. Returns how many records were read whole, or the error that ended the reading.
pub fn stream_reader(data: &[u8]) -> Result<u64> {
    use crate::layout::stream::{Schema, StreamLayout};
    use crate::stream::{Group, Lane, LaneCtrl, RankCtrl};
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
    let Some((&mode, rest)) = data.split_first() else {
        return Ok(0);
    };
    if mode % 2 == 1 {
        let l = StreamLayout::validate("fuzz", rest, rest.len() as u64)?;
        assert!(l.file_size <= rest.len() as u64);
        assert!(l.lanes >= 1 && l.lane_capacity.is_power_of_two());
        return Ok(0);
    }
    let word = |i: usize| {
        let mut b = [0u8; 8];
        let from = rest.get(8 * i..).unwrap_or(&[]);
        let n = from.len().min(8);
        b[..n].copy_from_slice(&from[..n]);
        u64::from_le_bytes(b)
    };
    let ctrl = LaneCtrl::default();
    ctrl.head.store(word(0), Ordering::Relaxed);
    ctrl.read.store(word(1), Ordering::Relaxed);
    ctrl.tail.store(word(2), Ordering::Relaxed);
    // u64s: the data area 8-aligned, as in a stream file.
    let mut lane_data = vec![0u64; (FUZZ_LANE / 8) as usize];
    let bytes = rest.get(24..).unwrap_or(&[]);
    let n = bytes.len().min(FUZZ_LANE as usize);
    bytemuck::cast_slice_mut::<u64, u8>(&mut lane_data)[..n].copy_from_slice(&bytes[..n]);
    let ranks = [RankCtrl::default()];
    let lane = Lane {
        ctrl: &ctrl,
        data: lane_data.as_mut_ptr().cast(),
        capacity: FUZZ_LANE,
        index: 0,
        ranks: &ranks,
    };
    let (doorbell, full, lost) = (AtomicU32::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let group = Group {
        doorbell: &doorbell,
        ranks: &ranks,
        full_waits: &full,
        lost: &lost,
    };
    let schema = Schema::parse("tokens: int32[*], score: float64[1], meta: uint8[*]")
        .expect("a valid schema");
    let hl = schema.record_header_len();
    // Error messages quote hostile numbers: formatting them must not panic.
    let fail = |e: Error| {
        drop(e.to_string());
        Err(e)
    };
    // Each claim moves `read` by at least 8 bytes of at most one lane's worth.
    for records in 0..=(FUZZ_LANE / 8) {
        let claim = match lane.try_claim(0, hl) {
            Ok(Some(c)) => c,
            Ok(None) => return Ok(records),
            Err(e) => return fail(e),
        };
        let len = claim.word0.len as u64;
        assert!(
            claim.pos % FUZZ_LANE + len <= FUZZ_LANE,
            "a record across the end"
        );
        match lane.decode(&schema, claim) {
            Ok((spans, _, _)) => {
                assert_eq!(spans.len() as u64, len);
                let mut sum = 0u64;
                for (i, f) in schema.fields().iter().enumerate() {
                    let (off, count) = spans.field(i);
                    let end = off as u64 + count as u64 * f.dtype.size() as u64;
                    assert!(end <= len, "field {i} past its record");
                    let p = lane.field_ptr(claim.pos, claim.word0.len, off);
                    // SAFETY: checked just above to lie inside the record, which lies
                    // inside the lane's data (asserted before).
                    let field =
                        unsafe { std::slice::from_raw_parts(p, count as usize * f.dtype.size()) };
                    sum = field.iter().fold(sum, |s, &b| s.wrapping_add(b as u64));
                }
                std::hint::black_box(sum);
            }
            Err(e) => return fail(e),
        }
        lane.release(claim);
        let _ = lane.reap(Some(0), &group, &mut |_| true);
    }
    panic!("the lane yielded more records than it can hold");
}
