#!/usr/bin/env python3
"""Writes the seed and hostile inputs of the `stream_record` fuzz target into
fuzz/stream_regressions/ (replayed by tests/fuzz_regressions.rs): a mode byte (0: a lane),
`head`, `read`, `tail` (u64 LE), then the 256 bytes of a lane under the schema
`tokens: int32[*], score: float64[1], meta: uint8[*]` (docs/protocol.md §10.4)."""

import struct
from pathlib import Path

CAP = 256
RECORD, PAD = 1, 2


def word0(length, kind, pos, state=0, rank=0):
    lap = (pos // CAP) & 0xFFFF
    return length | (kind << 32) | (state << 36) | (rank << 40) | (lap << 48)


def r8(n):
    return (n + 7) // 8 * 8


def record(pos, seq, tokens, meta, length=None, counts=None):
    n, m = len(tokens), len(meta)
    size = 32 + r8(4 * n) + 8 + r8(m)
    length = size if length is None else length
    c = counts if counts is not None else (n, m)
    b = struct.pack("<QQQII", word0(length, RECORD, pos), seq, 1, *c)
    b += struct.pack(f"<{n}i", *tokens).ljust(r8(4 * n), b"\0")
    b += struct.pack("<d", float(seq))
    b += bytes(meta).ljust(r8(m), b"\0")
    return b


def lane(head, read, tail, parts):
    data = bytearray(CAP)
    for at, b in parts:
        data[at % CAP:at % CAP + len(b)] = b
    return bytes([0]) + struct.pack("<QQQ", head, read, tail) + bytes(data)


def main():
    out = Path(__file__).parent / "stream_regressions"
    out.mkdir(exist_ok=True)
    r0 = record(0, 0, [1, 2, 3], b"ab")
    r1 = record(len(r0), 1, list(range(10)), b"xyz")
    two = len(r0) + len(r1)
    cases = {
        "seed-two-records": lane(two, 0, 0, [(0, r0), (len(r0), r1)]),
        # Wrapped: head at 200 of lap 0, a pad to 256, a record at 256 (lap 1).
        "seed-wrapped": lane(256 + 64, 200, 200, [
            (200, struct.pack("<Q", word0(56, PAD, 200, state=2))),
            (256, record(256, 5, [7] * 4, b"m" * 3)),
        ]),
        "corrupt-length": lane(two, 0, 0, [(0, record(0, 0, [1], b"", length=4096))]),
        "length-not-aligned": lane(64, 0, 0, [(0, record(0, 0, [1], b"", length=52))]),
        "counts-too-large": lane(64, 0, 0, [(0, record(0, 0, [1], b"", counts=(0xFFFFFFFF, 3)))]),
        "counts-short": lane(80, 0, 0, [(0, record(0, 0, [1] * 8, b"", counts=(1, 0)))]),
        "pad-short": lane(256 + 64, 200, 200, [
            (200, struct.pack("<Q", word0(16, PAD, 200, state=2))),
        ]),
        "wrong-lap": lane(two, 0, 0, [(0, struct.pack("<Q", word0(len(r0), RECORD, 256)) + r0[8:])]),
        "head-far-ahead": lane(1 << 40, 0, 0, [(0, r0)]),
        "read-past-head": lane(64, 128, 0, [(0, r0)]),
        "record-past-head": lane(len(r0) - 8, 0, 0, [(0, r0)]),
        "across-the-end": lane(256 + 64, 224, 224, [(224, record(224, 0, [1] * 8, b""))]),
        "unknown-kind": lane(64, 0, 0, [(0, struct.pack("<Q", word0(64, 9, 0)))]),
        # Found by the fuzzer (misaligned-cursor.bin): a cursor that is no multiple of 8
        # would make the record's first word a misaligned atomic.
        "misaligned-read": lane(64, 4, 0, [(0, r0)]),
    }
    for name, data in cases.items():
        (out / f"{name}.bin").write_bytes(data)
    print(f"{len(cases)} inputs in {out}")


if __name__ == "__main__":
    main()
