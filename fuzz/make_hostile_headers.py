#!/usr/bin/env python3
"""Writes the hand-made hostile headers of tests/hostile_headers/ (`reject-*.bin`).

Each is an input of the `layout_header` fuzz target (src/fuzzing.rs, `header`): in edit
mode, one byte picking a valid base header, then 13-byte edits
`[op, tensor, element, kind, anchor, value: u64 LE]`. The op, anchor and base numbers
below follow the tables in src/fuzzing.rs (`HEADER_FIELDS`, `DESC_FIELDS`, ...,
`anchor`, `header_bases`). Run from anywhere: python3 fuzz/make_hostile_headers.py
"""
import pathlib
import struct

# Bases (header_bases): 0 host + rings (obs f32[4,3], actions i64[4,1],
# frames u8[2,84,84,3], done bool[4]), 1 host, 2 CUDA obs/actions + host reward + rings,
# 3 CUDA only, 4 64 tensors + rings, 5 1.0 header, 6 1.1 header + rings, 7 three shards
# over 6 envs (obs f32[6,3], actions i64[6,1], frames u8[6,84,84,3]) + rings, 8 the same
# without rings, 9 the mixed base 2 with its CUDA memory shared by fd (1.9, export_size 2 MiB).
HOST_RINGS, HOST, MIXED, CUDA, WIDE, V1_0, V1_1, SHARDS_RINGS, SHARDS, CUDA_FD = range(10)

(MAGIC, VERSION_MAJOR, VERSION_MINOR, HEADER_SIZE, REGION_SIZE, LAYOUT_HASH, NUM_ENVS,
 TENSOR_COUNT, TABLE_OFFSET, DESC_SIZE, C2E_OFFSET, C2E_CAPACITY, E2C_OFFSET,
 E2C_CAPACITY, ENGINE_KIND, ENGINE_EVENT_HANDLE, DTYPE_CODE, DTYPE_BITS, DTYPE_LANES,
 NDIM, DIRECTION, LOCATION, FLAGS, DEVICE_ORDINAL, OFFSET, NBYTES, EXPORT_SIZE,
 EXPORT_MEMORY_TYPE, NAME, SHAPE, STRIDES, IPC_MEM_HANDLE, DEVICE_UUID, RESHAPE,
 ACTUAL_SIZE, TRUNCATE, COPY_DESC, SHARD_HEADER, SHARD_ENTRY, STATS) = range(40)
# Elements of SHARD_HEADER and SHARD_ENTRY (fuzzing::SHARD_HEADER_FIELDS, SHARD_ENTRY_FIELDS).
SHARD_COUNT, SHARD_TABLE_OFFSET = range(2)
ENV_START, ENV_COUNT, SHARD_C2E, SHARD_E2C, SHARD_STATE = range(5)
# Elements of STATS (fuzzing::STATS_FIELDS, 1.7).
STATS_FLAGS, STATS_OFFSET = range(2)

# Value kinds and anchors (fuzzing::anchor).
SET, ADD, FROM, BELOW = range(4)
A_REGION_SIZE, A_HEADER_SIZE, A_TABLE_END, A_ACTUAL, A_C2E, A_C2E_END, A_E2C = 1, 2, 3, 4, 5, 6, 7


def a_offset(t):
    return 12 + 16 * t


def a_export_size(t):
    return 15 + 16 * t


U64 = (1 << 64) - 1


def edit(op, value=0, tensor=0, element=0, kind=SET, anchor=0):
    return struct.pack("<5BQ", op, tensor, element, kind, anchor, value & U64)


def edits(base, *records):
    return bytes([base << 1 | 1]) + b"".join(records)


LAYOUT_HASH_CUDA_SESSIONS = 0x1899948B5E67EEF5


def a_end(t):
    return 13 + 16 * t


MIB2 = 2 << 20


def fd_entry(minor=9, flags=1, export_size=MIB2):
    """The host base's tensor 0 on CUDA, shared by fd (flags), no IPC handle, in a header
    of `minor` with the session hash and an engine event handle; `export_size` 2 MiB, the
    most a client takes for tensors that end below it (the cap)."""
    return [edit(LOCATION, 1), edit(EXPORT_SIZE, export_size), edit(FLAGS, flags), edit(VERSION_MINOR, minor),
            edit(LAYOUT_HASH, LAYOUT_HASH_CUDA_SESSIONS), edit(ENGINE_EVENT_HANDLE, 7, element=3)]


def name(tensor, text):
    raw = text.encode().ljust(32, b"\0")
    return [edit(NAME, raw[i], tensor=tensor, element=i) for i in range(32)]


CASES = {
    # Identity and sizes.
    "empty": b"",
    "raw-shorter-than-control-block": bytes([0]) + struct.pack("<Q", 1 << 20) + b"SHMBRIDG" * 12,
    "wrong-magic": edits(HOST, edit(MAGIC, 0)),
    "wrong-major-version": edits(HOST, edit(VERSION_MAJOR, 2)),
    "wrong-layout-hash": edits(HOST, edit(LAYOUT_HASH, 1, kind=ADD)),
    "table-offset": edits(HOST, edit(TABLE_OFFSET, 1024 + 64)),
    "desc-size": edits(HOST, edit(DESC_SIZE, 256)),
    "tensor-count-zero": edits(HOST, edit(TENSOR_COUNT, 0)),
    "tensor-count-65": edits(WIDE, edit(TENSOR_COUNT, 65)),
    "tensor-count-above-header-size": edits(HOST, edit(TENSOR_COUNT, 10)),
    "num-envs-zero": edits(HOST, edit(NUM_ENVS, 0)),
    "header-size-below-table": edits(HOST, edit(HEADER_SIZE, 1, kind=BELOW, anchor=A_TABLE_END)),
    "region-size-below-header": edits(HOST, edit(REGION_SIZE, 1, kind=BELOW, anchor=A_HEADER_SIZE)),
    "region-larger-than-mapped": edits(HOST, edit(ACTUAL_SIZE, 1, kind=BELOW, anchor=A_REGION_SIZE)),
    "snapshot-cut-inside-table": edits(HOST, edit(TRUNCATE, 1, kind=BELOW, anchor=A_TABLE_END)),
    "engine-kind-not-utf8": edits(HOST, edit(ENGINE_KIND, 0xC3, element=0), edit(ENGINE_KIND, 0x28, element=1)),
    # Entries.
    "tensor-name-not-utf8": edits(HOST, edit(NAME, 0xFF, tensor=1, element=0)),
    "tensor-name-after-nul": edits(HOST, edit(NAME, ord("x"), tensor=0, element=20)),
    "tensor-name-empty": edits(HOST, *name(0, "")),
    "tensor-names-twice": edits(HOST, *name(1, "obs")),
    "dtype-unknown": edits(HOST, edit(DTYPE_BITS, 24)),
    "dtype-lanes": edits(HOST, edit(DTYPE_LANES, 4)),
    "ndim-zero": edits(HOST, edit(NDIM, 0, tensor=2), edit(RESHAPE, tensor=2)),
    "ndim-255": edits(HOST, edit(NDIM, 255, tensor=2)),
    "shape-past-ndim": edits(HOST, edit(SHAPE, 1, tensor=0, element=5)),
    "direction-2": edits(HOST, edit(DIRECTION, 2)),
    "location-vulkan": edits(HOST, edit(LOCATION, 2)),
    "location-unknown": edits(HOST, edit(LOCATION, 200)),
    "zero-dimension": edits(HOST, edit(SHAPE, 0, tensor=2, element=1), edit(RESHAPE, tensor=2)),
    # 4 x 2^62 x 3 bytes overflows; RESHAPE stores the wrapped product as nbytes.
    "shape-product-overflows": edits(HOST, edit(SHAPE, 1 << 62, tensor=0), edit(RESHAPE, tensor=0)),
    # (2 + 2^60) x 84 x 84 x 3 wraps to exactly the old nbytes (42336).
    "shape-product-wraps-to-nbytes": edits(HOST, edit(SHAPE, 2 + (1 << 60), tensor=2), edit(RESHAPE, tensor=2)),
    "shape-product-above-isize": edits(HOST, edit(SHAPE, 1 << 61, tensor=2, element=0),
                                       edit(SHAPE, 1, tensor=2, element=1), edit(SHAPE, 1, tensor=2, element=2),
                                       edit(SHAPE, 4, tensor=2, element=3), edit(RESHAPE, tensor=2)),
    "nbytes-mismatch": edits(HOST, edit(NBYTES, 64, tensor=1, kind=ADD)),
    "strides-not-contiguous": edits(HOST, edit(STRIDES, 4, tensor=0, element=0, kind=ADD)),
    "offset-unaligned": edits(HOST, edit(OFFSET, 8, tensor=1, kind=ADD)),
    "offset-overflows": edits(HOST, edit(OFFSET, U64 - 63, tensor=2)),
    # frames (42336 bytes) at 2^64 - 4096: offset + nbytes wraps to 38240, inside the region.
    "offset-wraps-into-region": edits(HOST, edit(OFFSET, 4096, tensor=2, kind=BELOW, anchor=0)),
    "tensor-past-region": edits(HOST, edit(OFFSET, 0, tensor=3, kind=FROM, anchor=A_REGION_SIZE)),
    "tensor-in-control-block": edits(HOST, edit(OFFSET, 0, tensor=0)),
    "tensor-in-table": edits(HOST, edit(OFFSET, 1024 + 64, tensor=0)),
    "tensors-overlap": edits(HOST, edit(OFFSET, 0, tensor=1, kind=FROM, anchor=a_offset(0))),
    "entry-copied": edits(HOST, edit(COPY_DESC, tensor=3, anchor=2)),
    # Rings.
    "rings-overlap": edits(HOST_RINGS, edit(E2C_OFFSET, 0, kind=FROM, anchor=A_C2E)),
    "ring-in-header": edits(HOST_RINGS, edit(C2E_OFFSET, 0)),
    "ring-offset-unaligned": edits(HOST_RINGS, edit(C2E_OFFSET, 64, kind=ADD)),
    "ring-offset-overflows": edits(HOST_RINGS, edit(E2C_OFFSET, U64 & ~4095)),
    "ring-past-region": edits(HOST_RINGS, edit(E2C_CAPACITY, 1 << 40)),
    "ring-capacity-not-power-of-two": edits(HOST_RINGS, edit(C2E_CAPACITY, 100)),
    "ring-capacity-below-64": edits(HOST_RINGS, edit(C2E_CAPACITY, 32)),
    "one-ring-only": edits(HOST_RINGS, edit(E2C_CAPACITY, 0)),
    "ring-over-tensor": edits(HOST_RINGS, edit(OFFSET, 0, tensor=0, kind=FROM, anchor=A_E2C)),
    # CUDA entries.
    "cuda-in-1-1-header": edits(MIXED, edit(VERSION_MINOR, 1)),
    "cuda-negative-ordinal": edits(CUDA, edit(DEVICE_ORDINAL, 0xFFFF_FFFF, tensor=1)),
    "cuda-past-allocation": edits(CUDA, edit(OFFSET, 0, tensor=1, kind=FROM, anchor=a_export_size(1))),
    "cuda-offset-overflows": edits(CUDA, edit(OFFSET, U64 - 255, tensor=0)),
    "cuda-export-size-zero": edits(CUDA, edit(EXPORT_SIZE, 0, tensor=0)),
    "cuda-without-ipc-handle": edits(HOST, edit(LOCATION, 1), edit(EXPORT_SIZE, U64)),
    "cuda-without-event-handle": edits(HOST, edit(LOCATION, 1), edit(EXPORT_SIZE, U64),
                                       edit(IPC_MEM_HANDLE, 7, element=3)),
    # CUDA memory shared by fd (1.9 draft): flags bit 0, no IPC handle, minor 9. fd_entry()
    # makes the host base's first tensor a valid one (tests/hostile_headers.rs checks that
    # it is accepted); each case breaks one rule.
    "cuda-fd-flag-in-1-5-header": edits(HOST, *fd_entry(minor=5)),
    "cuda-fd-flag-in-1-8-header": edits(HOST, *fd_entry(minor=8)),
    "cuda-fd-and-unknown-flags": edits(HOST, *fd_entry(flags=0x81)),
    "cuda-ipc-in-1-9-header-without-handle": edits(HOST, *fd_entry(flags=0)),
    "cuda-fd-with-ipc-handle": edits(CUDA, edit(VERSION_MINOR, 9), edit(FLAGS, 1, tensor=0),
                                     edit(FLAGS, 1, tensor=1)),
    "cuda-unknown-flags": edits(CUDA, edit(VERSION_MINOR, 9), edit(FLAGS, 2, tensor=1)),
    # export_size of memory shared by fd (the size a client maps): below the tensor's end,
    # above the cap (the next power of two of the tensors' end, at least 2 MiB: one byte
    # more, and 2^64 - 1), and two sizes for the one allocation (tensor 1 shared by fd too,
    # 1 MiB: valid alone).
    "cuda-fd-export-size-below-tensor": edits(HOST, *fd_entry(),
                                              edit(EXPORT_SIZE, 1, kind=BELOW, anchor=a_end(0))),
    "cuda-fd-export-size-above-cap": edits(HOST, *fd_entry(export_size=MIB2 + 1)),
    "cuda-fd-export-size-absurd": edits(HOST, *fd_entry(export_size=U64)),
    "cuda-fd-export-sizes-differ": edits(HOST, *fd_entry(), edit(LOCATION, 1, tensor=1), edit(FLAGS, 1, tensor=1),
                                         edit(EXPORT_SIZE, MIB2 // 2, tensor=1)),
    # Shards (1.4).
    "shards-in-1-3-header": edits(SHARDS, edit(VERSION_MINOR, 3)),
    "shards-unsharded-layout-hash": edits(SHARDS, edit(LAYOUT_HASH, 0x1A78E44FF49AC1E5)),
    "shard-count-one": edits(SHARDS, edit(SHARD_HEADER, 1, element=SHARD_COUNT)),
    "shard-count-above-num-envs": edits(SHARDS, edit(NUM_ENVS, 2)),
    "shard-count-65": edits(SHARDS, edit(SHARD_HEADER, 65, element=SHARD_COUNT)),
    # 6 entries end at 2176 + 6 x 512 = 5248, past the 4096-byte header.
    "shard-count-past-header": edits(SHARDS, edit(SHARD_HEADER, 6, element=SHARD_COUNT)),
    "shard-table-offset-moved": edits(SHARDS, edit(SHARD_HEADER, 64, element=SHARD_TABLE_OFFSET, kind=ADD)),
    "shard-table-offset-without-shards": edits(HOST, edit(SHARD_HEADER, 1408, element=SHARD_TABLE_OFFSET)),
    "shard-table-cut-from-snapshot": edits(SHARDS, edit(TRUNCATE, 1, kind=BELOW, anchor=A_HEADER_SIZE),
                                           edit(TRUNCATE, 3000)),
    "shard-slices-gap": edits(SHARDS, edit(SHARD_ENTRY, 1, tensor=1, element=ENV_START, kind=ADD)),
    "shard-slice-empty": edits(SHARDS, edit(SHARD_ENTRY, 0, tensor=2, element=ENV_COUNT)),
    "shard-slices-short": edits(SHARDS, edit(SHARD_ENTRY, U64, tensor=2, element=ENV_COUNT, kind=ADD)),
    "shard-slice-past-num-envs": edits(SHARDS, edit(SHARD_ENTRY, 1, tensor=2, element=ENV_COUNT, kind=ADD)),
    "shard-slice-wraps": edits(SHARDS, edit(SHARD_ENTRY, 0xFFFF_FFFF, tensor=2, element=ENV_COUNT)),
    "shard-ring-in-header": edits(SHARDS_RINGS, edit(SHARD_ENTRY, 0, tensor=1, element=SHARD_C2E)),
    "shard-ring-unaligned": edits(SHARDS_RINGS, edit(SHARD_ENTRY, 64, tensor=2, element=SHARD_E2C, kind=ADD)),
    "shard-ring-past-region": edits(SHARDS_RINGS, edit(SHARD_ENTRY, 0, tensor=2, element=SHARD_E2C,
                                                       kind=FROM, anchor=A_REGION_SIZE)),
    "shard-rings-overlap": edits(SHARDS_RINGS, edit(SHARD_ENTRY, 0, tensor=2, element=SHARD_C2E,
                                                    kind=FROM, anchor=A_C2E)),
    "shard-ring-over-tensor": edits(SHARDS_RINGS, edit(SHARD_ENTRY, 0, tensor=1, element=SHARD_E2C,
                                                       kind=FROM, anchor=a_offset(2))),
    "shard-zero-rings-differ": edits(SHARDS_RINGS, edit(C2E_OFFSET, 4096, kind=ADD)),
    "shard-rings-without-region-rings": edits(SHARDS, edit(SHARD_ENTRY, 1 << 20, tensor=1, element=SHARD_C2E)),
    "sharded-tensor-without-env-axis": edits(SHARDS, edit(SHAPE, 3, tensor=1, element=0), edit(RESHAPE, tensor=1)),
    "sharded-cuda-tensor": edits(SHARDS, edit(LOCATION, 1), edit(EXPORT_SIZE, U64),
                                 edit(IPC_MEM_HANDLE, 7, element=3)),
    # The stats area (1.7).
    "stats-offset-unaligned": edits(HOST, edit(STATS, 64, element=STATS_OFFSET, kind=ADD)),
    "stats-in-header": edits(HOST, edit(STATS, 0, element=STATS_OFFSET)),
    "stats-past-region": edits(HOST, edit(STATS, 0, element=STATS_OFFSET, kind=FROM, anchor=A_REGION_SIZE)),
    "stats-offset-wraps": edits(HOST, edit(STATS, U64 - 4095, element=STATS_OFFSET)),
    "stats-over-tensor": edits(HOST_RINGS, edit(STATS, 0, element=STATS_OFFSET, kind=FROM, anchor=a_offset(2))),
    "stats-over-ring": edits(HOST_RINGS, edit(STATS, 0, element=STATS_OFFSET, kind=FROM, anchor=A_E2C)),
    # Three shards, three blocks of 512 bytes, from a page that region_size cuts 1024 in.
    "stats-blocks-past-region": edits(SHARDS, edit(REGION_SIZE, 3072, kind=BELOW, anchor=A_REGION_SIZE)),
}

if __name__ == "__main__":
    out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "hostile_headers"
    out.mkdir(exist_ok=True)
    for case, data in CASES.items():
        (out / f"reject-{case}.bin").write_bytes(data)
    print(f"{len(CASES)} inputs in {out}")
