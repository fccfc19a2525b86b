"""shmbridge.stream from Python: records written in place by producers and read in place
by a consumer, zero copy both ways; several producer processes; backpressure; a producer
killed between reserve and commit; consumers that close or die."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest

import shmbridge
import shmbridge.stream as st
from conftest import wait_exited

LLM = {"tokens": "int32[*]", "logprobs": "float32[*]", "score": "float64", "instance_id": "bytes", "meta": "bytes"}


def _mapped_ranges(path: str) -> list:
    """``(start, end, file offset)`` of this process's mappings of ``path`` (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == path:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, int(parts[2], 16)))
    return out


def _file_offset(address: int, nbytes: int, ranges: list) -> int:
    """Where ``address .. address + nbytes`` lies in the mapped file (it must lie in one
    of ``ranges``)."""
    for lo, hi, offset in ranges:
        if lo <= address and address + nbytes <= hi:
            return address - lo + offset
    raise AssertionError(f"{address:#x}+{nbytes} is not in the stream's mappings {ranges}")


def test_views_are_the_shared_memory_both_ways():
    torch = pytest.importorskip("torch")
    with st.create(schema=LLM, capacity=1 << 16, lanes=2) as c, st.attach(c.name) as p:
        ranges = _mapped_ranges(f"/dev/shm/{c.name}")
        assert len(ranges) >= 2, "the consumer and the producer each map the stream"
        with p.reserve(tokens=100, logprobs=100, instance_id=4, meta=2) as r:
            tokens = r["tokens"]
            assert tokens.flags.writeable and tokens.dtype == np.int32 and tokens.shape == (100,)
            # The producer writes the shared memory itself: its view lies in the stream.
            written = _file_offset(tokens.ctypes.data, tokens.nbytes, ranges)
            tokens[:] = np.arange(100)
            r["logprobs"][:] = -0.5
            r["score"] = 2.5
            r["instance_id"] = b"ab12"
            r["meta"] = b"{}"
        rec = c.pop(timeout=5)
        assert rec is not None
        for name in LLM:
            view = rec[name]
            assert not view.flags.writeable and not view.flags.owndata
            assert view.ctypes.data == rec.address(name)  # the address the core reports
            _file_offset(view.ctypes.data, view.nbytes, ranges)
        # The consumer reads the very bytes the producer wrote: the same place in the file.
        assert _file_offset(rec["tokens"].ctypes.data, 400, ranges) == written
        t = torch.from_dlpack(rec["tokens"])
        assert t.data_ptr() == rec.address("tokens")
        assert t.tolist() == list(range(100))
        assert rec["score"][0] == 2.5 and rec.bytes("instance_id") == b"ab12"
        with pytest.raises(ValueError):
            rec["tokens"][0] = 1  # read-only
        rec.release()
        with pytest.raises(shmbridge.ClosedError):
            rec["tokens"]


def test_every_field_dtype_round_trips():
    dtypes = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
              "uint32", "uint64", "bool"]
    schema = {f"v_{d}": f"{d}[*]" for d in dtypes}
    schema.update({"fixed3": "float32[3]", "one": "int64", "bf16": "bfloat16[*]"})
    rng = np.random.default_rng(7)
    values = {}
    for d in dtypes:
        n = int(rng.integers(0, 40))
        if d == "bool":
            values[f"v_{d}"] = rng.integers(0, 2, n).astype(bool)
        elif d.startswith("float"):
            values[f"v_{d}"] = rng.standard_normal(n).astype(d)
        else:
            info = np.iinfo(d)
            values[f"v_{d}"] = rng.integers(info.min, info.max, n, dtype=d, endpoint=True)
    values["fixed3"] = np.array([1.5, -2.0, 3.25], np.float32)
    values["one"] = np.array([-(2 ** 62)], np.int64)
    values["bf16"] = np.array([0x3F80, 0xC000, 0x7F80], np.uint16)  # 1.0, -2.0, inf as bits
    with st.create(schema=schema, capacity=1 << 14, lanes=1) as c, st.attach(c.name, schema=schema) as p:
        assert p.push(**values) == 0
        assert p.push(**values) == 1
        for seq in (0, 1):
            with c.pop(timeout=5) as rec:
                assert rec.seq == seq and rec.lane == p.lane
                for name, want in values.items():
                    got = rec[name]
                    assert got.dtype == want.dtype, name
                    np.testing.assert_array_equal(got, want, err_msg=name)
                    assert rec.length(name) == len(want)
    torch = pytest.importorskip("torch")
    with st.create(schema={"x": "bfloat16[*]"}, capacity=256, lanes=1) as c, st.attach(c.name) as p:
        p.push(x=np.array([0x3F80, 0xC000], np.uint16))
        with c.pop(timeout=5) as rec:
            assert torch.from_dlpack(rec["x"]).view(torch.bfloat16).tolist() == [1.0, -2.0]


def test_push_copies_each_kind_of_value_or_writes_nothing():
    schema = {"tokens": "int32[*]", "logprobs": "float32[*]", "score": "float64", "fixed2": "int64[2]",
              "meta": "bytes"}
    torch = pytest.importorskip("torch")
    tokens = np.arange(10, dtype=np.int32)
    with st.create(schema=schema, capacity=1 << 14, lanes=1) as c, st.attach(c.name) as p:
        sent = [
            # arrays of the field's dtype, a float, bytes: copied as they are
            dict(tokens=tokens, logprobs=np.linspace(0, 1, 10, dtype=np.float32), score=0.25,
                 fixed2=np.array([1, 2]), meta=b"{}"),
            # other dtypes, lists, a strided view, NumPy scalars, a str: converted as NumPy does
            dict(tokens=[1, 2, 3], logprobs=np.arange(6, dtype=np.float64)[::2], score=np.float32(1.5),
                 fixed2=(3, 4), meta="é"),
            # torch tensors (DLPack), an int for a float field, a bytearray
            dict(tokens=torch.arange(4, dtype=torch.int32), logprobs=torch.ones(2), score=7,
                 fixed2=torch.tensor([5, 6]), meta=bytearray(b"ab")),
            # empty variable fields
            dict(tokens=np.zeros(0, np.int32), logprobs=[], score=0.0, fixed2=[0, 0], meta=b""),
        ]
        for i, fields in enumerate(sent):
            assert p.push(**fields) == i
        for fields in sent:
            with c.pop(timeout=5) as rec:
                for name, value in fields.items():
                    if name == "meta":
                        want = value.encode() if isinstance(value, str) else bytes(value)
                        assert rec.bytes("meta") == want
                        continue
                    want = np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value)
                    np.testing.assert_array_equal(rec[name], want.astype(rec[name].dtype).reshape(-1), err_msg=name)
        # Values that fit no record of the schema: refused before anything is reserved.
        good = sent[0]
        for bad, error in [
            (dict(good, fixed2=np.array([1, 2, 3])), shmbridge.InvalidTensorError),  # a fixed count of 2
            (dict(good, score=np.zeros(2)), shmbridge.InvalidTensorError),
            (dict(good, tokens=["a"]), ValueError),  # NumPy cannot make int32 of it
            (dict(good, tokens=np.zeros(1 << 14, np.int32)), shmbridge.RecordTooLargeError),
        ]:
            with pytest.raises(error):
                p.push(**bad)
        with pytest.raises(TypeError, match="missing"):
            p.push(tokens=tokens)
        with pytest.raises(TypeError, match="no field 'nope'"):
            p.push(**good, nope=1)
        assert c.pop(timeout=0) is None
        assert p.stats()["lanes"][p.lane]["records_committed"] == len(sent)
        # The record's views are slices of the consumer's memory, each access a new view.
        p.push(**good)
        with c.pop(timeout=5) as rec:
            a, b = rec["tokens"], rec["tokens"]
            assert a is not b and a.ctypes.data == b.ctypes.data == rec.address("tokens")
            assert rec.length("tokens") == 10 and rec.keys() == list(schema) and len(rec) == len(schema)
            assert set(rec.fields()) == set(schema)
            with pytest.raises(KeyError, match="no field 'nope'"):
                rec["nope"]
            assert "tokens[10]" in repr(rec)
        assert rec.released and "released" in repr(rec)
        for use in (lambda: rec["tokens"], lambda: rec.bytes("meta"), lambda: rec.address("score")):
            with pytest.raises(shmbridge.ClosedError):
                use()


def test_push_converts_arrays_numpy_will_not_export():
    # NumPy refuses a plain DLPack export of a read-only array (a popped record's view,
    # np.frombuffer of bytes) and of a byte-swapped one: push converts them as it does
    # any other value.
    with st.create(schema={"x": "int32[*]", "y": "float32[2]"}, capacity=1 << 14, lanes=1) as c, \
            st.attach(c.name) as p:
        p.push(x=np.arange(5, dtype=np.int32), y=[0.5, 1.5])
        with c.pop(timeout=5) as rec:
            assert not rec["x"].flags.writeable
            p.push(x=rec["x"], y=rec["y"])  # forwarded as it was popped
        swapped = np.arange(3, dtype=">i4")
        p.push(x=swapped, y=np.frombuffer(np.array([2.5, 3.5], np.float32).tobytes(), np.float32))
        for want_x, want_y in [(range(5), [0.5, 1.5]), (range(3), [2.5, 3.5])]:
            with c.pop(timeout=5) as rec:
                assert rec["x"].tolist() == list(want_x) and rec["y"].tolist() == want_y


def test_push_of_floats_to_a_bfloat16_field_writes_their_bfloat16_bits():
    with st.create(schema={"b": "bfloat16[*]"}, capacity=1 << 12, lanes=1) as c, st.attach(c.name) as p:
        p.push(b=[1.5, -2.0])
        p.push(b=np.array([1.5, -2.0], np.float32))
        # Rounded to the nearest bfloat16, ties to even; NaN stays NaN, infinities stay.
        p.push(b=np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, np.nan, -np.inf, 3.4e38], np.float64))
        p.push(b=np.array([0x3F80, 0x7F80], np.uint16))  # uint16: the raw bits, as they are
        for want in ([0x3FC0, 0xC000], [0x3FC0, 0xC000], [0x3F80, 0x3F82, 0x7FC0, 0xFF80, 0x7F80],
                     [0x3F80, 0x7F80]):
            with c.pop(timeout=5) as rec:
                assert rec["b"].tolist() == want


# A producer's push waits for room with the GIL released; meanwhile another thread
# resizes the torch tensor being pushed, which frees the memory its DLPack export
# pointed to (48 MiB: glibc unmaps it). The copy must not read the freed memory: the
# tensor is looked at again once the record is reserved, and its new size fits the
# reservation no more. Run in a child: before the fix it died of SIGSEGV.
_RESIZED_WHILE_WAITING = r"""
import os, threading
import numpy as np
import torch
import shmbridge
import shmbridge.stream as st

V = 48 << 20
with st.create(schema={"x": "uint8[*]"}, capacity=1 << 27, lanes=1) as c, st.attach(c.name) as p:
    filler = np.zeros(V, np.uint8)
    fillers = 0
    while True:
        try:
            p.push(timeout=0, x=filler)
            fillers += 1
        except shmbridge.FullError:
            break
    waits = p.stats()["full_waits"]
    t = torch.full((V,), 7, dtype=torch.uint8)
    box = {}

    def run():
        try:
            box["seq"] = p.push(timeout=60, x=t)
        except Exception as e:
            box["error"] = e

    th = threading.Thread(target=run)
    th.start()
    while p.stats()["full_waits"] == waits:  # the push waits for room, the GIL released
        os.sched_yield()
    t.resize_(2 * V)  # new storage; the old is freed
    for _ in range(fillers):
        with c.pop(timeout=5):
            pass
    th.join()
    assert isinstance(box.get("error"), shmbridge.InvalidTensorError), box
    assert c.pop(timeout=0) is None
print("ok")
"""


def test_a_tensor_resized_while_push_waits_is_not_read_after_free():
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-c", _RESIZED_WHILE_WAITING], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stdout, proc.stderr)


def test_a_record_of_a_stream_found_truncated_hands_out_no_view():
    # Once the consumer found the file truncated (here its stats, which look at the
    # size first), a record popped before gives RegionTooSmallError for each field
    # accessor, its views too (a view would SIGBUS at its first read; none is read).
    with st.create(schema={"x": "int32[*]"}, capacity=1 << 12, lanes=1) as c, st.attach(c.name) as p:
        p.push(x=np.arange(4, dtype=np.int32))
        rec = c.pop(timeout=5)
        os.truncate("/dev/shm/" + c.name, 0)
        with pytest.raises(shmbridge.errors.RegionTooSmallError):
            c.stats()
        for use in (lambda: rec.bytes("x"), lambda: rec.address("x"), lambda: rec["x"], rec.fields):
            with pytest.raises(shmbridge.errors.RegionTooSmallError):
                use()
        rec.release()


def test_reservation_commits_on_success_and_aborts_on_exception():
    with st.create(schema={"x": "int32[*]"}, capacity=1 << 12, lanes=1) as c, st.attach(c.name) as p:
        with pytest.raises(RuntimeError, match="generator failed"):
            with p.reserve(x=3) as r:
                r["x"] = [7, 7, 7]
                raise RuntimeError("generator failed")
        assert r.done
        assert c.pop(timeout=0) is None  # nothing of the aborted record is visible
        with p.reserve(x=2) as r:
            r["x"] = [1, 2]
        with pytest.raises(shmbridge.ClosedError):
            r["x"]
        r2 = p.reserve(x=1)
        r2.abort()
        with pytest.raises(shmbridge.OutOfOrderError):
            r2.commit()
        rec = c.pop(timeout=5)
        assert rec["x"].tolist() == [1, 2] and rec.seq == 0
        assert c.pop(timeout=0) is None
        with pytest.raises(TypeError, match="'x'"):
            p.reserve()
        with pytest.raises(TypeError, match="no field 'y'"):
            p.reserve(x=1, y=2)


def test_a_closed_producer_frees_its_lane_while_a_view_lives():
    with st.create(schema={"x": "int32[*]"}, capacity=1 << 12, lanes=1) as c:
        p = st.attach(c.name)
        r = p.reserve(x=4)
        view = r["x"]
        p.close()  # frees the lane; the open reservation publishes nothing
        with st.attach(c.name) as p2:  # the lane is free again, while `view` lives
            view[:] = 5  # still mapped
            try:
                r.commit()
            except shmbridge.ShmBridgeError:
                pass
            assert c.pop(timeout=0) is None
            with p2.reserve(x=1) as r2:
                r2["x"] = [9]
            assert c.pop(timeout=5)["x"].tolist() == [9]
        del view


def test_batches_pad_copies_and_release_together():
    schema = {"tokens": "int32[*]", "score": "float64"}
    with st.create(schema=schema, capacity=1 << 12, lanes=2, blocking=True) as c:
        with st.attach(c.name, blocking=True) as p:
            for n in (3, 1, 4):
                p.push(tokens=np.arange(n) + 1, score=float(n))
            batch = c.pop_batch(10, timeout=5)
            assert [len(r["tokens"]) for r in batch] == [3, 1, 4]
            padded, lengths = batch.to_padded("tokens", value=-1)
            assert padded.tolist() == [[1, 2, 3, -1], [1, -1, -1, -1], [1, 2, 3, 4]]
            assert lengths.tolist() == [3, 1, 4] and padded.flags.owndata
            scores, ones = batch.pad("score")["score"]
            assert scores.tolist() == [[3.0], [1.0], [4.0]] and ones.tolist() == [1, 1, 1]
            assert c.stats()["depth"] == 3
            observed = st.stats(c.name)  # an observer's read: the same words
            assert observed["depth"] == 3 and observed["lanes"][p.lane]["records_committed"] == 3
            assert "records_per_s" not in observed["lanes"][0]
            with batch:
                pass
            assert all(r.released for r in batch)
            s = c.stats()
            assert s["depth"] == 0 and s["lanes"][p.lane]["records_released"] == 3
            # Committed per second since the previous stats(): none since (the first had None).
            assert s["lanes"][p.lane]["records_per_s"] == 0.0
            assert s["lanes"][p.lane]["producer_pid"] == os.getpid()
            empty = c.pop_batch(5, timeout=0)
            assert len(empty) == 0 and empty.to_padded("tokens")[0].shape == (0, 0)


PRODUCER = r"""
import sys, zlib
import numpy as np
import shmbridge.stream as st
name, p, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(p)
with st.attach(name, timeout=30) as prod:
    for s in range(n):
        tokens = rng.integers(0, 50_000, int(rng.integers(1, 300)), dtype=np.int32)
        iid = f"p{p}-s{s}".encode()
        prod.push(timeout=60, tokens=tokens, score=float(s), instance_id=iid,
                  crc=zlib.crc32(tokens) ^ zlib.crc32(iid))
"""


def test_many_producer_processes_every_record_whole_once_in_order():
    schema = {"tokens": "int32[*]", "score": "float64", "instance_id": "bytes", "crc": "uint32"}
    producers, n = 4, 300
    with st.create(schema=schema, capacity=1 << 13, lanes=producers) as c:
        procs = [subprocess.Popen([sys.executable, "-c", PRODUCER, c.name, str(p), str(n)])
                 for p in range(producers)]
        try:
            last = {}
            seen = set()
            while len(seen) < producers * n:
                batch = c.pop_batch(64, timeout=60)
                assert len(batch), f"no record within 60 s; {len(seen)} received"
                with batch:
                    for rec in batch:
                        iid = rec.bytes("instance_id")
                        assert rec["crc"][0] == zlib.crc32(rec["tokens"]) ^ zlib.crc32(iid), iid
                        p, s = (int(x[1:]) for x in iid.decode().split("-"))
                        assert rec["score"][0] == s and (p, s) not in seen
                        seen.add((p, s))
                        # The core's per-producer sequence; one producer's records in
                        # order (a lane freed by a producer that ended serves another).
                        assert rec.seq == s
                        assert last.get(p, -1) == s - 1, "out of order"
                        last[p] = s
            for proc in procs:
                assert proc.wait(60) == 0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert c.pop(timeout=0) is None
        s = c.stats()
        assert sum(lane["records_committed"] for lane in s["lanes"]) == producers * n
        assert s["depth"] == 0


def test_full_lane_is_a_full_error_after_the_deadline_and_nothing_is_written():
    with st.create(schema={"x": "uint8[*]"}, capacity=1024, lanes=1) as c, st.attach(c.name) as p:
        assert p.max_record == 512  # half a lane
        pushed = 0
        with pytest.raises(shmbridge.FullError, match="full"):
            while True:
                p.push(timeout=0.05, x=bytes([pushed]) * 200)
                pushed += 1
        assert pushed >= 3
        before = c.stats()
        assert before["depth"] == pushed and before["full_waits"] == 1  # one reserve, however many slices
        # Nothing of the refused record: exactly the pushed ones, intact, in order.
        first = c.pop(timeout=5)
        assert first.bytes("x") == bytes([0]) * 200
        first.release()  # room again
        p.push(timeout=5, x=b"after")
        got = [c.pop(timeout=5) for _ in range(pushed)]
        assert [r.bytes("x")[:1] for r in got[:-1]] == [bytes([k]) for k in range(1, pushed)]
        assert got[-1].bytes("x") == b"after"
        with pytest.raises(shmbridge.RecordTooLargeError):
            p.reserve(x=4096)


KILLED_PRODUCER = r"""
import sys, os
import numpy as np
import shmbridge.stream as st
name, committed = sys.argv[1], int(sys.argv[2])
p = st.attach(name, timeout=30)
for s in range(committed):
    p.push(x=np.full(64, s, np.int64))
r = p.reserve(x=64)
r["x"][:32] = -1  # half written, never committed
print("reserved", flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.parametrize("round_", range(5))
def test_a_producer_killed_between_reserve_and_commit_leaves_nothing_torn(round_):
    committed = 2 + round_
    with st.create(schema={"x": "int64[*]"}, capacity=4096, lanes=1) as c:
        child = subprocess.Popen([sys.executable, "-c", KILLED_PRODUCER, c.name, str(committed)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "reserved"
            os.kill(child.pid, signal.SIGKILL)
            assert wait_exited(child.pid, 30)
        finally:
            child.kill()
            child.wait()
        got = []
        while (rec := c.pop(timeout=0.2)) is not None:
            with rec:
                got.append(rec["x"].copy())
        # The committed records, whole; nothing of the one in flight.
        assert [g.tolist() for g in got] == [[s] * 64 for s in range(committed)]
        # The only lane is taken over and the stream goes on, past the dead one's space.
        with st.attach(c.name) as p:
            for s in range(40):  # more than the lane holds at once
                p.push(timeout=5, x=np.full(64, 100 + s, np.int64))
                with c.pop(timeout=5) as rec:
                    assert rec["x"].tolist() == [100 + s] * 64 and rec.seq == s


def test_a_closed_consumer_is_a_typed_error_for_its_producers():
    c = st.create(schema={"x": "int32[*]"}, capacity=1024, lanes=1)
    p = st.attach(c.name)
    p.push(x=[1])
    p.push(x=[5, 6])
    view = c.pop(timeout=5)["x"]  # a view that outlives its record and the consumer
    c.close()
    # The creator's close removes the name at once; the view's memory stays mapped.
    assert not os.path.exists(f"/dev/shm/{c.name}")
    assert view.tolist() == [1]
    with pytest.raises(shmbridge.ClientClosedError):
        p.push(x=[2])
    with pytest.raises(shmbridge.ClosedError):
        c.pop(timeout=0)
    p.close()
    with pytest.raises(shmbridge.ClosedError):
        p.push(x=[3])


DYING_CONSUMER = r"""
import sys
import shmbridge.stream as st
c = st.create(schema={"x": "uint8[*]"}, capacity=1024, lanes=1)
print(c.name, flush=True)
sys.stdin.read()  # until killed
"""


def test_a_dead_consumer_is_a_typed_error_for_its_producers():
    child = subprocess.Popen([sys.executable, "-c", DYING_CONSUMER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        name = child.stdout.readline().strip()
        p = st.attach(name, timeout=30)
        os.kill(child.pid, signal.SIGKILL)
        assert wait_exited(child.pid, 30)
    finally:
        child.kill()
        child.wait()
    with p:
        # Its lane fills (nobody reads); waiting for room, the producer finds the
        # consumer dead: not FullError, however long it would wait.
        with pytest.raises(shmbridge.ClientDiedError) as e:
            for _ in range(100):
                p.push(timeout=60, x=b"z" * 200)
        assert e.value.pid == child.pid
    assert name in shmbridge.gc()  # the dead consumer's stream is swept


def test_a_consumer_group_gives_each_record_to_exactly_one_rank():
    with st.create(schema={"x": "int64"}, capacity=4096, lanes=2, ranks=2) as r0:
        with st.attach_consumer(r0.name, 1) as r1, st.attach(r0.name) as p:
            assert (r0.rank, r1.rank) == (0, 1)
            with pytest.raises(shmbridge.AlreadyAttachedError):
                st.attach_consumer(r0.name, 1)  # served by a live process
            for k in range(40):
                p.push(x=k)
            got = {0: [], 1: []}
            while True:
                popped = [(rank, c.pop(timeout=0)) for rank, c in ((0, r0), (1, r1))]
                if all(rec is None for _, rec in popped):
                    break
                for rank, rec in popped:
                    if rec is not None:
                        with rec:
                            got[rank].append(int(rec["x"][0]))
            assert sorted(got[0] + got[1]) == list(range(40))
            assert got[0] and got[1]  # both ranks took records
            ranks = r0.stats()["ranks"]
            assert [r["popped"] for r in ranks] == [len(got[0]), len(got[1])]


WAITER = r"""
import shmbridge, shmbridge.stream as st
c = st.create(schema={"x": "uint8[*]"}, capacity=1024, lanes=1)
p = st.attach(c.name)
try:
    print("pop", flush=True)
    c.pop(timeout=None)  # the stream is empty
    print("returned", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
while True:  # fill the lane
    try:
        p.push(timeout=0, x=b"f" * 200)
    except shmbridge.FullError:
        break
try:
    print("reserve", flush=True)
    p.reserve(timeout=None, x=200)  # the lane is full
    print("returned", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_interrupts_a_pop_and_a_reserve_that_wait_without_limit():
    child = subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE, text=True)
    try:
        for what in ("pop", "reserve"):
            assert child.stdout.readline().strip() == what
            child.send_signal(signal.SIGINT)
            assert child.stdout.readline().strip() == "interrupted", what
        assert child.wait(60) == 0
    finally:
        child.kill()
        child.wait()


def test_threads_pop_and_close_one_consumer_while_another_waits():
    with st.create(schema={"x": "int64"}, capacity=1024, lanes=1) as c, st.attach(c.name) as p:
        got = []
        waiter = threading.Thread(target=lambda: got.append(c.pop(timeout=60)))
        waiter.start()
        # The waiter sleeps in the core without the GIL; this thread pops meanwhile.
        assert [c.pop(timeout=0.05) for _ in range(5)] == [None] * 5
        p.push(x=7)
        waiter.join(60)
        assert not waiter.is_alive() and got[0]["x"].tolist() == [7]
        got[0].release()
        # A close while a pop waits without limit: the pop ends with ClosedError.
        def wait_forever():
            try:
                got.append(c.pop(timeout=None))
            except shmbridge.ClosedError as e:
                got.append(e)

        waiter = threading.Thread(target=wait_forever)
        waiter.start()
        c.close()
        waiter.join(60)
        assert not waiter.is_alive() and isinstance(got[1], shmbridge.ClosedError)


def test_schema_forms_and_mismatch():
    assert st.schema_text(LLM) == ("tokens: int32[*], logprobs: float32[*], score: float64, "
                                   "instance_id: uint8[*], meta: uint8[*]")
    assert st.schema_text({"a": np.float32, "b": ("int16", 4), "c": ("uint8", None)}) == \
        "a: float32[1], b: int16[4], c: uint8[*]"
    with st.create(schema="a: float32[*], b: int64", lanes=1, capacity=100) as c:
        assert c.fields == {"a": (np.dtype("float32"), None), "b": (np.dtype("int64"), 1)}
        assert c.schema == "a: float32[*], b: int64[1]"
        with pytest.raises(shmbridge.LayoutMismatchError):
            st.attach(c.name, schema={"a": "float32[*]"})
        with pytest.raises(ValueError, match="spin_us"):
            st.attach(c.name, spin_us=-1)
        with st.attach(c.name) as p:
            assert p.max_record == 64  # half a lane of 128: rounded up to a power of two
            with pytest.raises(shmbridge.AlreadyAttachedError):
                st.attach(c.name)  # its one lane is taken
    with pytest.raises(shmbridge.InvalidHeaderError):
        st.create(schema="a: complex64[*]")


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _example(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def test_example_llm_generators_to_a_batching_trainer():
    out = _example("stream_llm.py", "--workers", "3", "--records", "150", "--batch", "16", "--max-tokens", "300")
    assert out.startswith("trained on 150 trajectories") and "from 3 workers" in out, out


def test_example_actors_to_a_replay_buffer():
    pytest.importorskip("gymnasium")
    out = _example("stream_replay.py", "--actors", "2", "--transitions", "600", "--minibatch", "32")
    assert out.startswith("learned from 600 transitions of 2 actors (CartPole-v1)"), out
    assert "replay holds 600" in out, out


# A consumer asleep in pop and a producer asleep on a full lane while another process
# truncates the stream's file: each waiter is seen parked on the stream's own futex word
# (/proc/self/task/TID/syscall: futex on the doorbell, or on the lane's tail), then the
# file is cut. Run in a child: before the fix the waiter woke into the vanished words and
# the child died of SIGBUS.
_TRUNCATED_WAITERS = r"""
import os, platform, threading
import numpy as np
import shmbridge.stream as st
from shmbridge import errors

FUTEX = {"x86_64": 202, "aarch64": 98}[platform.machine()]

def file_offset(path, address):
    # Where `address` lies in `path`, through this process's mappings of it.
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == path:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= address < hi:
                    return address - lo + int(parts[2], 16)
    return None

def parked_on(tid, path, offset):
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:  # the thread ended
        return False
    return len(fields) > 1 and fields[0] == str(FUTEX) and file_offset(path, int(fields[1], 16)) == offset

def wait_parked(thread, box, path, offset):
    while "tid" not in box or not parked_on(box["tid"], path, offset):
        assert "got" not in box, box
        os.sched_yield()

def run(call, box):
    box["tid"] = threading.get_native_id()
    try:
        box["got"] = call()
    except Exception as e:
        box["got"] = e

c = st.create(schema="tokens: int32[*]", capacity=256, lanes=1, blocking=True)
path = "/dev/shm/" + c.name

# The consumer, asleep in pop on the doorbell (byte 1024 of the header).
box = {}
t = threading.Thread(target=run, args=(lambda: c.pop(timeout=60), box))
t.start()
wait_parked(t, box, path, 1024)
os.truncate(path, 0)
t.join()
assert isinstance(box["got"], errors.RegionTooSmallError), box
for again in (lambda: c.pop(timeout=60), lambda: c.pop_batch(4, timeout=60), c.stats):
    try:
        again()
        raise AssertionError("no error after the truncation")
    except errors.RegionTooSmallError:
        pass
c.close()
print("consumer ok")

# A producer, asleep on its full lane's tail (byte 72 of the lane's control words).
c = st.create(schema="tokens: int32[*]", capacity=256, lanes=1)
path = "/dev/shm/" + c.name
p = st.attach(c.name, blocking=True)
p.push(tokens=np.arange(20, dtype=np.int32))
p.push(tokens=np.arange(20, dtype=np.int32))
box = {}
t = threading.Thread(target=run, args=(lambda: p.push(timeout=60, tokens=np.arange(20, dtype=np.int32)), box))
t.start()
wait_parked(t, box, path, 4096 + 72)
os.truncate(path, 4096)
t.join()
assert isinstance(box["got"], errors.RegionTooSmallError), box
try:
    p.stats()
    raise AssertionError("no error after the truncation")
except errors.RegionTooSmallError:
    pass
p.close()
c.close()
print("producer ok")
"""


def test_waiters_of_a_stream_truncated_under_them_get_region_too_small_not_sigbus():
    proc = subprocess.run([sys.executable, "-c", _TRUNCATED_WAITERS], capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode != -signal.SIGBUS, f"died of SIGBUS: {proc.stdout}{proc.stderr[-4000:]}"
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.split() == ["consumer", "ok", "producer", "ok"]
