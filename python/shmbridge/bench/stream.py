"""`python -m shmbridge.bench stream`: many producer processes streaming variable-length
records to one consumer, through each contender, side by side in one run.

A record is what an LLM-RL environment worker hands its trainer: ``tokens`` (int32[L]),
``logprobs`` (float32[L]), ``score`` (float64), ``instance_id`` (bytes) and ``meta``
(bytes, JSON), with L = 512 or 4096 tokens. 1, 4 and 16 producer processes (spawned) each
send their share of the records as fast as the transport takes them; the consumer (this
process) receives them all and checks every one.

The contenders:

- ``shmbridge``: :mod:`shmbridge.stream`, each record sent with ``push`` (one call: the
  core copies the fields into the producer's lane and commits); the consumer pops
  read-only views and releases them, when this build has it.
- ``shmbridge-reserve``: the same stream, each record reserved, written in place (a slice
  assignment per field) and committed.
- ``pr-slots``: the design of the shared-memory trajectory buffer proposed to Atropos,
  re-implemented here from its description: one ``multiprocessing.shared_memory`` segment,
  a control block whose read and write indices every writer and the reader update with
  plain ``struct`` writes (no atomics, no lock), fixed slots of 4096 tokens (and 4096
  logprobs), the write refused when full, every record copied out with ``tolist()``. Its
  writers retry a refused write (else all but a buffer's worth of each run would be
  dropped by design); the retries are counted.
- ``mp-queue``: ``multiprocessing.Queue`` (pickled records; bounded to the same number of
  records as the slots).
- ``http-json``: HTTP/JSON over aiohttp (the baseline the shared-memory buffer replaced):
  each producer POSTs each record as JSON (token ids and logprobs as lists) over one
  keep-alive session; the consumer's aiohttp server parses it.

Checking: each producer draws its arrays from a bank of 16 per producer (seeded by its id)
and starts ``meta`` with a fixed binary header (``HEAD``: its id ``p``, the record's
sequence number ``s``, the time the record was handed over), then JSON (fixed per bank
entry: what a worker's metadata looks like); ``instance_id`` is ``p{p}-s{s}`` and
``score`` is ``p + s / 2``. The consumer rebuilds every producer's bank from the same seeds
before the run and compares each record it receives with what record ``(p, s)`` must be,
byte for byte (``tobytes() ==``: a copy and a memcmp, no checksum to compute): a record
whose header does not parse or names no producer, or whose tokens, logprobs, score,
instance_id or JSON differ in any byte, is **torn**; a ``(p, s)`` seen before is
**duplicated**; a record a producer's transport accepted and the consumer never received
intact is **lost**; a producer's records received out of their order are counted as
reordered (in the JSON). The check runs in the consumer's loop for every contender, as
does turning a record into NumPy arrays where the transport delivers lists (what a
trainer does before batching): records/s is the rate of intact records into a consumer
that has checked them.

Latency is from the producer's stamp to the consumer holding the record: stamped just
before ``commit()`` (shmbridge-reserve: after any wait for room), before ``push()``
(shmbridge: before its wait for room), before the index update (pr-slots; its meta is then
written last), before ``put()`` (mp-queue) and before encoding the JSON body (http-json),
on CLOCK_MONOTONIC, which all processes share.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import os
import secrets
import struct
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .common import START_TIMEOUT_S
from .report import fmt_rate, fmt_ratio, fmt_time, log, machine_description, machine_header, markdown_table
from .report import publish, run_mode

#: Arrays per producer's bank: a tear between two records is seen unless both drew the
#: same bank entry (records 16 apart of one producer) for the part that tore.
BANK = 16
#: How long a writer retries a refused write (pr-slots: full) before it gives the record up.
WRITE_DEADLINE_S = 30.0
#: How long the consumer waits for a whole case before calling it stuck.
CASE_TIMEOUT_S = 600.0

CONTENDERS = ("shmbridge", "shmbridge-reserve", "pr-slots", "mp-queue", "http-json")
#: The contenders that are shmbridge's stream (one consumer, two ways to produce).
OURS = ("shmbridge", "shmbridge-reserve")
LABELS = {
    "shmbridge": "shmbridge stream (push)",
    "shmbridge-reserve": "shmbridge stream (reserve, write in place)",
    "pr-slots": "PR design (fixed slots, plain indices)",
    "mp-queue": "multiprocessing.Queue",
    "http-json": "HTTP/JSON (aiohttp)",
}
NEEDS = {"http-json": ("aiohttp",)}
REFERENCE = "pr-slots"


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# ---------------------------------------------------------------------------------------
# Records


#: The start of every record's ``meta``: producer id, sequence number, the stamp
#: (CLOCK_MONOTONIC ns); the record's JSON follows it.
HEAD = struct.Struct("<IIQ")


class Content:
    """What producer ``p`` sends: its bank of arrays and each record's other fields. The
    consumer builds the same (the same seeds) to know what each record must hold."""

    def __init__(self, p: int, tokens: int):
        rng = np.random.default_rng(1_000 + p)
        self.p = p
        self.tokens = [rng.integers(0, 151_000, tokens, dtype=np.int32) for _ in range(BANK)]
        self.logprobs = [(-rng.exponential(1.0, tokens)).astype(np.float32) for _ in range(BANK)]
        # What the consumer compares with, byte for byte.
        self.token_bytes = [t.tobytes() for t in self.tokens]
        self.logprob_bytes = [lp.tobytes() for lp in self.logprobs]
        # meta's JSON, after its header: fixed per bank entry.
        self.metas = [json.dumps({"env": "bench-stream", "worker": p, "bank": k, "group": k % 4,
                                  "sampling": {"temperature": 1.0, "top_p": 0.95}}).encode()
                      for k in range(BANK)]
        self.meta_arrays = [np.frombuffer(m, np.uint8) for m in self.metas]
        self._lists: Optional[Tuple[list, list]] = None

    @property
    def token_lists(self) -> List[list]:
        """The bank as lists, for the transports whose producers hold lists."""
        return self._as_lists()[0]

    @property
    def logprob_lists(self) -> List[list]:
        return self._as_lists()[1]

    def _as_lists(self) -> Tuple[list, list]:
        if self._lists is None:
            self._lists = ([t.tolist() for t in self.tokens], [lp.tolist() for lp in self.logprobs])
        return self._lists

    def record(self, s: int) -> Tuple[int, float, bytes, bytes]:
        """``(bank index, score, instance_id, meta's JSON)`` of record ``s``."""
        k = s % BANK
        return k, self.p + s * 0.5, b"p%d-s%d" % (self.p, s), self.metas[k]

    def head(self, s: int) -> bytes:
        """Record ``s``'s meta header, stamped now."""
        return HEAD.pack(self.p, s, now_ns())

    def meta(self, s: int) -> bytes:
        """Record ``s``'s whole meta, stamped now."""
        return HEAD.pack(self.p, s, now_ns()) + self.metas[s % BANK]


@dataclass
class Tally:
    """The consumer's check of every record it receives."""

    producers: int
    tokens: int
    received: int = 0
    intact: int = 0
    torn: int = 0
    duplicated: int = 0
    reordered: int = 0
    nbytes: int = 0
    t_last: int = 0
    latencies: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seen: List[set] = [set() for _ in range(self.producers)]
        self.last = [-1] * self.producers
        # Every producer's content, rebuilt from its seed (before the run starts).
        self.expected = [Content(p, self.tokens) for p in range(self.producers)]

    def add(self, tokens: np.ndarray, logprobs: np.ndarray, score: float, iid: bytes, meta: bytes,
            t_pop: int) -> None:
        self.received += 1
        self.t_last = t_pop
        try:
            p, s, t = HEAD.unpack_from(meta)
            c = self.expected[p]
            k = s % BANK
            # Every byte of the record against what record (p, s) must be.
            ok = (iid == b"p%d-s%d" % (p, s) and score == p + s * 0.5 and meta[HEAD.size:] == c.metas[k]
                  and tokens.dtype == np.int32 and logprobs.dtype == np.float32
                  and tokens.tobytes() == c.token_bytes[k] and logprobs.tobytes() == c.logprob_bytes[k])
        except (struct.error, IndexError, ValueError, TypeError, AttributeError, BufferError):
            ok = False
        if not ok:
            self.torn += 1
            return
        seen = self.seen[p]
        if s in seen:
            self.duplicated += 1
            return
        seen.add(s)
        last = self.last[p]
        if s < last:
            self.reordered += 1
        else:
            self.last[p] = s
        self.intact += 1
        self.nbytes += tokens.nbytes + logprobs.nbytes + 8 + len(iid) + len(meta)
        self.latencies.append(t_pop - t)


# ---------------------------------------------------------------------------------------
# Contenders. The consumer side is a class (open, consume, close); the producer side is a
# function run in each producer process: ``write(spec, content, n, results) -> (sent,
# retries)``.


@dataclass(frozen=True)
class Case:
    tokens: int
    producers: int
    per_producer: int
    slots: int
    blocking: bool = False  # shmbridge's waits never spin

    @property
    def records(self) -> int:
        return self.producers * self.per_producer


class Consumer:
    key = "?"

    def open(self, case: Case, ctx: Any) -> Any:
        """Creates the transport; returns what a producer needs to reach it (picklable)."""
        raise NotImplementedError

    def consume(self, tally: Tally, done: Callable[[], bool], deadline: float) -> None:
        """Receives records into ``tally`` until ``done()`` (every producer finished) and
        nothing is left; raises TimeoutError past ``deadline`` (time.monotonic)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def _past(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError("the consumer did not get every producer's records in time")


# --- the PR's design, re-implemented -----------------------------------------------------
#
# Control block at offset 0: magic (4 s), version, read index, write index, slot count,
# tokens per slot (u32 each). Each slot: score (f64), token count (i32), instance_id
# (64 s), repetition id (i32), meta (256 s), tokens (i32 x 4096), logprobs (f32 x 4096).

PR_CONTROL = struct.Struct("<4sIIIII")
PR_INDICES = struct.Struct("<II")
PR_INDICES_AT = 8
PR_MAGIC = b"ATRP"
PR_ENTRY = 4096
PR_ID_LEN = 64
PR_META_LEN = 256
PR_HEAD = struct.Struct(f"<di{PR_ID_LEN}si")
PR_META_AT = PR_HEAD.size
PR_TOKENS_AT = PR_META_AT + PR_META_LEN
PR_SLOT = PR_TOKENS_AT + PR_ENTRY * 8


class PrSlots:
    """One end of the re-implemented buffer (``create`` on the consumer's side)."""

    def __init__(self, name: str, slots: int = 0, create: bool = False):
        from multiprocessing import shared_memory

        if create:
            self.shm = shared_memory.SharedMemory(name=name, create=True,
                                                  size=PR_CONTROL.size + slots * PR_SLOT)
            PR_CONTROL.pack_into(self.shm.buf, 0, PR_MAGIC, 1, 0, 0, slots, PR_ENTRY)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
        self.buf = self.shm.buf

    def _control(self) -> Tuple[int, int, int, int]:
        magic, _version, read, write, size, entry = PR_CONTROL.unpack_from(self.buf, 0)
        if magic != PR_MAGIC:
            raise ValueError("bad magic")
        return read, write, size, entry

    def _slot(self, i: int) -> int:
        return PR_CONTROL.size + i * PR_SLOT

    def write(self, content: Content, s: int) -> bool:
        """Writes record ``s``; False when the buffer looks full (the record is not written)."""
        read, write, size, entry = self._control()
        nxt = (write + 1) % size
        if nxt == read:
            return False
        k, score, iid, meta = content.record(s)
        off = self._slot(write)
        tokens = content.tokens[k]
        n = min(len(tokens), entry)
        PR_HEAD.pack_into(self.buf, off, score, n, iid, 0)
        at = off + PR_TOKENS_AT
        np.ndarray((entry,), np.int32, self.buf, at)[:n] = tokens[:n]
        np.ndarray((entry,), np.float32, self.buf, at + entry * 4)[:n] = content.logprobs[k][:n]
        struct.pack_into(f"{PR_META_LEN}s", self.buf, off + PR_META_AT, content.head(s) + meta)
        PR_INDICES.pack_into(self.buf, PR_INDICES_AT, read, nxt)  # both indices, as read above
        return True

    def read(self) -> Optional[Tuple[list, list, float, bytes, bytes]]:
        read, write, size, entry = self._control()
        if read == write:
            return None
        off = self._slot(read)
        score, n, iid, _rep = PR_HEAD.unpack_from(self.buf, off)
        n = max(0, min(n, entry))
        meta = bytes(self.buf[off + PR_META_AT:off + PR_META_AT + PR_META_LEN]).rstrip(b"\0")
        at = off + PR_TOKENS_AT
        tokens = np.ndarray((n,), np.int32, self.buf, at).tolist()
        logprobs = np.ndarray((n,), np.float32, self.buf, at + entry * 4).tolist()
        PR_INDICES.pack_into(self.buf, PR_INDICES_AT, (read + 1) % size, write)
        return tokens, logprobs, score, iid.rstrip(b"\0"), meta

    def close(self) -> None:
        self.buf = None
        self.shm.close()


class PrSlotsConsumer(Consumer):
    key = "pr-slots"

    def open(self, case: Case, ctx: Any) -> Any:
        name = f"shmbridge-bench-stream-{os.getpid()}-{secrets.token_hex(4)}"
        self.ring = PrSlots(name, case.slots, create=True)
        return name

    def consume(self, tally: Tally, done: Callable[[], bool], deadline: float) -> None:
        ring, polls = self.ring, 0
        while True:
            rec = ring.read()
            if rec is None:
                polls += 1
                if polls % 256 == 0:
                    _past(deadline)
                    if done() and ring.read() is None:
                        return  # no writer left, and nothing in the buffer
                os.sched_yield()
                continue
            t_pop = now_ns()
            tokens, logprobs, score, iid, meta = rec
            tally.add(np.array(tokens, np.int32), np.array(logprobs, np.float32), score, iid, meta, t_pop)

    def close(self) -> None:
        name = self.ring.shm.name
        self.ring.close()
        from multiprocessing import shared_memory

        shared_memory.SharedMemory(name=name).unlink()


def write_pr_slots(spec: Any, content: Content, n: int, results: Any) -> Tuple[int, int]:
    ring = PrSlots(spec)
    sent = retries = 0
    try:
        for s in range(n):
            give_up = None
            while not ring.write(content, s):
                retries += 1
                give_up = give_up or time.monotonic() + WRITE_DEADLINE_S
                if time.monotonic() > give_up:
                    break  # dropped: counted as not sent
                os.sched_yield()
            else:
                sent += 1
    finally:
        ring.close()
    return sent, retries


# --- multiprocessing.Queue ---------------------------------------------------------------


class QueueConsumer(Consumer):
    key = "mp-queue"

    def open(self, case: Case, ctx: Any) -> Any:
        self.q = ctx.Queue(maxsize=case.slots)
        self.producers = case.producers
        return self.q

    def consume(self, tally: Tally, done: Callable[[], bool], deadline: float) -> None:
        import queue

        ended = 0
        while ended < self.producers:
            try:
                rec = self.q.get(timeout=0.1)
            except queue.Empty:
                _past(deadline)
                continue
            if rec is None:
                ended += 1
                continue
            t_pop = now_ns()
            tally.add(rec["tokens"], rec["logprobs"], rec["score"], rec["instance_id"], rec["meta"], t_pop)

    def close(self) -> None:
        self.q.close()
        self.q.join_thread()


def write_queue(q: Any, content: Content, n: int, results: Any) -> Tuple[int, int]:
    for s in range(n):
        k, score, iid, meta = content.record(s)
        q.put({"tokens": content.tokens[k], "logprobs": content.logprobs[k], "score": score,
               "instance_id": iid, "meta": content.head(s) + meta})
    q.put(None)
    q.close()
    q.join_thread()  # every record is in the pipe before the producer says it is done
    return n, 0


# --- HTTP/JSON over aiohttp --------------------------------------------------------------


class HttpConsumer(Consumer):
    key = "http-json"

    def open(self, case: Case, ctx: Any) -> Any:
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        self.tally: Optional[Tally] = None

        async def handle(request: Any) -> Any:
            body = await request.json()
            t_pop = now_ns()
            self.tally.add(np.array(body["tokens"], np.int32), np.array(body["logprobs"], np.float32),
                           float(body["score"]), body["instance_id"].encode(), body["meta"].encode("latin-1"), t_pop)
            return web.Response(status=204)

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/trajectory", handle)
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # the port the OS chose
        return f"http://127.0.0.1:{port}/trajectory"

    def consume(self, tally: Tally, done: Callable[[], bool], deadline: float) -> None:
        self.tally = tally

        async def wait() -> None:
            # Each producer awaits every POST's answer: once all are done, all is received.
            while not done():
                _past(deadline)
                await asyncio.sleep(0.005)

        self.loop.run_until_complete(wait())

    def close(self) -> None:
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()


def write_http(url: Any, content: Content, n: int, results: Any) -> Tuple[int, int]:
    import aiohttp

    async def post_all() -> int:
        async with aiohttp.ClientSession() as session:
            for s in range(n):
                k, score, iid, meta = content.record(s)
                # meta's binary header travels as latin-1 text (one character a byte).
                body = json.dumps({"tokens": content.token_lists[k], "logprobs": content.logprob_lists[k],
                                   "score": score, "instance_id": iid.decode(),
                                   "meta": (content.head(s) + meta).decode("latin-1")})
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    if r.status != 204:
                        raise RuntimeError(f"POST answered {r.status}")
        return n

    return asyncio.run(post_all()), 0


# --- shmbridge's stream ------------------------------------------------------------------


def shmbridge_stream_missing() -> Optional[str]:
    try:
        import shmbridge.stream  # noqa: F401
    except ImportError as e:
        return f"shmbridge.stream is not in this build ({e})"
    return None


SCHEMA = {"tokens": "int32[*]", "logprobs": "float32[*]", "score": "float64", "instance_id": "bytes",
          "meta": "bytes"}


class ShmbridgeConsumer(Consumer):
    key = "shmbridge"

    def open(self, case: Case, ctx: Any) -> Any:
        import shmbridge.stream

        # The PR design's bytes, shared among the lanes (a power of two each, at least
        # room for a few records).
        total = case.slots * PR_SLOT
        per_lane = 1 << max(0, (total // case.producers).bit_length() - 1)
        per_lane = max(per_lane, 1 << (4 * (case.tokens * 8 + 512)).bit_length())
        self.stream = shmbridge.stream.create(schema=SCHEMA, capacity=per_lane, lanes=case.producers,
                                              blocking=case.blocking)
        return self.stream.name, case.blocking

    def consume(self, tally: Tally, done: Callable[[], bool], deadline: float) -> None:
        stream = self.stream
        while True:
            batch = stream.pop_batch(64, timeout=0.05)
            if not batch:
                _past(deadline)
                if done() and not stream.pop_batch(64, timeout=0):
                    return  # every producer finished, and nothing is left
                continue
            t_pop = now_ns()
            for rec in batch:
                tally.add(rec["tokens"], rec["logprobs"], float(rec["score"][0]), rec.bytes("instance_id"),
                          rec.bytes("meta"), t_pop)
            batch.release()

    def close(self) -> None:
        self.stream.close()


def write_shmbridge(spec: Any, content: Content, n: int, results: Any) -> Tuple[int, int]:
    import shmbridge.stream

    name, blocking = spec
    head, p = HEAD, content.p
    with shmbridge.stream.attach(name, timeout=START_TIMEOUT_S, blocking=blocking) as producer:
        push = producer.push
        for s in range(n):
            k, score, iid, meta = content.record(s)
            # One call: the core copies each field into the lane and commits; meta is
            # stamped just before it.
            push(WRITE_DEADLINE_S, tokens=content.tokens[k], logprobs=content.logprobs[k], score=score,
                 instance_id=iid, meta=head.pack(p, s, now_ns()) + meta)
    return n, 0


def write_shmbridge_reserve(spec: Any, content: Content, n: int, results: Any) -> Tuple[int, int]:
    import shmbridge.stream

    name, blocking = spec
    tokens = len(content.tokens[0])
    head, p, h = HEAD, content.p, HEAD.size
    with shmbridge.stream.attach(name, timeout=START_TIMEOUT_S, blocking=blocking) as producer:
        for s in range(n):
            k, score, iid, meta = content.record(s)
            with producer.reserve(timeout=WRITE_DEADLINE_S, tokens=tokens, logprobs=tokens, instance_id=len(iid),
                                  meta=h + len(meta)) as r:
                r["tokens"][:] = content.tokens[k]
                r["logprobs"][:] = content.logprobs[k]
                r["score"][0] = score
                r["instance_id"].data[:] = iid
                m = r["meta"]
                m[h:] = content.meta_arrays[k]
                head.pack_into(m, 0, p, s, now_ns())  # stamped last, just before the commit
    return n, 0


class ShmbridgeReserveConsumer(ShmbridgeConsumer):
    key = "shmbridge-reserve"


CONSUMERS: Dict[str, Callable[[], Consumer]] = {
    "shmbridge": ShmbridgeConsumer,
    "shmbridge-reserve": ShmbridgeReserveConsumer,
    "pr-slots": PrSlotsConsumer,
    "mp-queue": QueueConsumer,
    "http-json": HttpConsumer,
}
WRITERS: Dict[str, Callable[[Any, Content, int, Any], Tuple[int, int]]] = {
    "shmbridge": write_shmbridge,
    "shmbridge-reserve": write_shmbridge_reserve,
    "pr-slots": write_pr_slots,
    "mp-queue": write_queue,
    "http-json": write_http,
}


def _producer(key: str, spec: Any, p: int, n: int, tokens: int, go: Any, results: Any) -> None:
    """A producer process: builds its bank, says it is ready, waits for the start, sends
    ``n`` records, says how many the transport accepted."""
    try:
        content = Content(p, tokens)
        results.put(("ready", p))
        go.wait()
        sent, retries = WRITERS[key](spec, content, n, results)
        results.put(("done", p, sent, retries))
    except BaseException:  # noqa: BLE001 - reported to the bench, which fails the case
        results.put(("error", p, traceback.format_exc()))


# ---------------------------------------------------------------------------------------
# Running


class CaseError(RuntimeError):
    pass


@dataclass
class Measured:
    """One case of one contender, over the rounds."""

    rates: List[float] = field(default_factory=list)
    gbps: List[float] = field(default_factory=list)
    latencies: List[int] = field(default_factory=list)
    sent: int = 0
    received: int = 0
    intact: int = 0
    lost: int = 0
    torn: int = 0
    duplicated: int = 0
    reordered: int = 0
    retries: int = 0
    failed: Optional[str] = None
    skipped: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        d = {k: getattr(self, k) for k in ("sent", "received", "intact", "lost", "torn", "duplicated",
                                            "reordered", "retries", "failed", "skipped")}
        d["records_per_s"] = self.rates
        d["gb_per_s"] = self.gbps
        if self.rates:
            d["median_records_per_s"] = float(np.median(self.rates))
            d["median_gb_per_s"] = float(np.median(self.gbps))
        if self.latencies:
            lat = np.asarray(self.latencies, dtype=np.float64)
            d["latency_p50_ns"] = float(np.percentile(lat, 50))
            d["latency_p99_ns"] = float(np.percentile(lat, 99))
        return d


def run_case(key: str, case: Case) -> Tuple[Tally, int, int, int]:
    """One round of one case: ``(tally, sent, retries, elapsed_ns)``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    go = ctx.Event()
    consumer = CONSUMERS[key]()
    spec = consumer.open(case, ctx)
    procs = []
    try:
        for p in range(case.producers):
            proc = ctx.Process(target=_producer, args=(key, spec, p, case.per_producer, case.tokens, go, results),
                               name=f"stream-producer-{p}", daemon=True)
            proc.start()
            procs.append(proc)
        state = {"ready": 0, "done": 0, "sent": 0, "retries": 0}

        def drain(block: float) -> None:
            import queue

            try:
                msg = results.get(timeout=block) if block else results.get_nowait()
            except queue.Empty:
                for proc in procs:
                    if proc.exitcode not in (None, 0):
                        raise CaseError(f"{proc.name} exited with status {proc.exitcode}")
                return
            if msg[0] == "error":
                raise CaseError(f"producer {msg[1]} failed:\n{msg[2]}")
            state[msg[0]] += 1
            if msg[0] == "done":
                state["sent"] += msg[2]
                state["retries"] += msg[3]

        start_by = time.monotonic() + START_TIMEOUT_S
        while state["ready"] < case.producers:
            if time.monotonic() > start_by:
                raise CaseError("producers not ready in time")
            drain(0.05)
        tally = Tally(case.producers, case.tokens)

        def done() -> bool:
            drain(0)
            return state["done"] == case.producers

        t0 = now_ns()
        go.set()
        deadline = time.monotonic() + CASE_TIMEOUT_S
        consumer.consume(tally, done, deadline)
        while state["done"] < case.producers:  # a consumer that counted end markers
            _past(deadline)
            drain(0.05)
        for proc in procs:
            proc.join(START_TIMEOUT_S)
        return tally, state["sent"], state["retries"], max(1, tally.t_last - t0)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        consumer.close()


def main(args: Any) -> int:
    quick = args.quick
    rounds = args.rounds or (1 if quick else 3)
    records = args.records or (64 if quick else 20_000)
    try:
        sizes = [int(x) for x in args.tokens.split(",") if x.strip()]
        producer_counts = [int(x) for x in args.producers.split(",") if x.strip()]
        if not sizes or not producer_counts or min(sizes + producer_counts) <= 0 or max(sizes) > PR_ENTRY:
            raise ValueError
    except ValueError:
        log(f"bench stream: --tokens {args.tokens} --producers {args.producers}: expected comma-separated "
            f"positive integers, tokens at most {PR_ENTRY}")
        return 2
    keys = [k.strip() for k in args.contenders.split(",")] if args.contenders else list(CONTENDERS)
    for k in keys:
        if k not in CONTENDERS:
            log(f"bench stream: unknown contender {k!r}: choose from {', '.join(CONTENDERS)}")
            return 2
    skipped: Dict[str, str] = {}
    for k in keys:
        missing = [m for m in NEEDS.get(k, ()) if not _importable(m)]
        if missing:
            skipped[k] = f"skipped: {', '.join(missing)} not installed"
        elif k in OURS:
            why = shmbridge_stream_missing()
            if why:
                skipped[k] = f"skipped: {why}"
    machine = machine_description()
    t_start = time.monotonic()
    cases = [Case(t, pc, max(1, math.ceil(records / pc)), args.slots, args.blocking)
             for t in sizes for pc in producer_counts]
    results: Dict[Tuple[int, int], Dict[str, Measured]] = {(c.tokens, c.producers): {} for c in cases}
    for c in cases:
        for k in keys:
            results[(c.tokens, c.producers)][k] = Measured(skipped=skipped.get(k))
    live = [k for k in keys if k not in skipped]
    for r in range(rounds):
        for c in cases:
            order = live[r % len(live):] + live[:r % len(live)] if live else []
            for k in order:
                m = results[(c.tokens, c.producers)][k]
                if m.failed:
                    continue
                log(f"stream: round {r + 1}/{rounds}, {c.tokens} tokens, {c.producers} producers, {k}")
                try:
                    tally, sent, retries, elapsed = run_case(k, c)
                except (CaseError, TimeoutError, OSError) as e:
                    m.failed = str(e)
                    log(f"stream: {k} failed: {e}")
                    continue
                m.rates.append(tally.intact * 1e9 / elapsed)
                m.gbps.append(tally.nbytes / elapsed)
                m.latencies += tally.latencies
                m.sent += sent
                m.received += tally.received
                m.intact += tally.intact
                m.lost += sent - tally.intact
                m.torn += tally.torn
                m.duplicated += tally.duplicated
                m.reordered += tally.reordered
                m.retries += retries
    elapsed_s = time.monotonic() - t_start

    text, doc = report(results, keys, cases, rounds, records, args.command_line, quick, machine, elapsed_s)
    publish("stream", text, args.out, doc=doc)
    bad = [k for (t, pc), row in results.items() for k, m in row.items() if m.failed]
    ours = [m for row in results.values() for k, m in row.items() if k in OURS and not m.skipped]
    if bad or any(m.lost or m.torn or m.duplicated or m.reordered for m in ours):
        return 1
    return 0


def _importable(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


def report(results: Dict[Tuple[int, int], Dict[str, Measured]], keys: Sequence[str], cases: Sequence[Case],
           rounds: int, records: int, command: str, quick: bool, machine: Dict[str, Any],
           elapsed_s: float) -> Tuple[str, Dict[str, Any]]:
    lines = [
        "## Trajectory stream: many producers, one consumer",
        "",
        f"Command: `{command}` ({run_mode(quick)}; about {records:,} records per case and round, "
        f"{rounds} interleaved round{'s' if rounds > 1 else ''}, {cases[0].slots} slots of buffer; "
        f"shmbridge {'blocking (never spins)' if cases[0].blocking else 'with its default wait policy'}; "
        f"{elapsed_s:.1f} s in all)",
        "",
        *machine_header(machine),
    ]
    header = ["producers", "transport", "records/s", "GB/s", "latency p50", "latency p99", "lost", "torn",
              "duplicated", "records/s ÷ PR design"]
    doc: Dict[str, Any] = {"machine": machine, "rounds": rounds, "cases": []}
    for tokens in sorted({c.tokens for c in cases}):
        rows = []
        for c in [c for c in cases if c.tokens == tokens]:
            row = results[(c.tokens, c.producers)]
            ref = row.get(REFERENCE)
            ref_rate = float(np.median(ref.rates)) if ref is not None and ref.rates else None
            for k in keys:
                m = row[k]
                doc["cases"].append({"tokens": c.tokens, "producers": c.producers, "records": c.records,
                                     "contender": k, "label": LABELS[k], **m.to_dict()})
                if m.skipped or m.failed:
                    rows.append([str(c.producers), LABELS[k], m.skipped or f"failed: {m.failed.splitlines()[0]}",
                                 *[""] * 7])
                    continue
                rate = float(np.median(m.rates))
                lat = np.asarray(m.latencies, dtype=np.float64)
                p50 = fmt_time(float(np.percentile(lat, 50))) if lat.size else "–"
                p99 = fmt_time(float(np.percentile(lat, 99))) if lat.size else "–"
                ratio = fmt_ratio(rate / ref_rate) if ref_rate else "–"
                rows.append([str(c.producers), LABELS[k], fmt_rate(rate), f"{float(np.median(m.gbps)):.3g}",
                             p50, p99, f"{m.lost:,}", f"{m.torn:,}", f"{m.duplicated:,}", ratio])
        lines += ["", f"### Records of {tokens} tokens", "",
                  markdown_table(header, rows, "llrrrrrrrr")]
    lines += [
        "",
        "records/s: intact records per second into a consumer that checks each one (every byte against the "
        "record its producer and sequence number name, rebuilt from the producer's seed; lists turned into "
        "arrays where the transport delivers lists), "
        "median over the rounds; GB/s: their payload bytes. Latency: from the producer's stamp (just before "
        "`push()`, commit after reserve, the index update, `put()`, or encoding the POST) to the consumer holding the record, over "
        "every intact record of every round; producers send as fast as the transport takes records, so it "
        "includes the time a record waits in a full buffer. lost: accepted by the transport, never received intact; torn: "
        "received with any byte not that of the record its header names; duplicated: received twice. "
        "Counts are totals over the rounds.",
        "",
        "PR design: its writers retry a write refused as full "
        f"({sum(m.retries for row in results.values() for k, m in row.items() if k == 'pr-slots'):,} retries "
        "in this run); its read and write indices are updated by every writer and the reader with plain "
        "struct writes, which is where its records are lost, torn and duplicated.",
        "",
        "Target: shmbridge ≥ 10× the PR design with 0 lost, torn or duplicated records. Reported, not asserted "
        "(the exit status is 1 only when shmbridge loses, tears, duplicates or reorders a record, or a case fails).",
    ]
    return "\n".join(lines) + "\n", doc
