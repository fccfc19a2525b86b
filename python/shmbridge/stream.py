"""Trajectory streams: many producer processes, one consumer (or a consumer group), records
of named fields written and read in place in shared memory (docs/stream.md).

    import shmbridge.stream

    # The trainer creates the stream and consumes it.
    consumer = shmbridge.stream.create(schema={
        "tokens": "int32[*]", "logprobs": "float32[*]", "score": "float64",
        "instance_id": "bytes", "meta": "bytes"})

    # Each generator process attaches a producer ...
    producer = shmbridge.stream.attach(consumer.name)
    with producer.reserve(tokens=n, logprobs=n, instance_id=8, meta=len(meta)) as r:
        r["tokens"][:] = token_ids          # writable NumPy views into the stream
        r["logprobs"][:] = logprobs
        r["score"][0] = 0.5
        r["instance_id"][:] = np.frombuffer(b"task-017", np.uint8)
        r["meta"][:] = np.frombuffer(meta, np.uint8)
    # ... committed whole on leaving the block (aborted, invisible, on an exception);
    # or in one call: producer.push(tokens=..., logprobs=..., score=0.5, instance_id=b"...", meta=b"{}")

    # ... and the trainer pops records as read-only views, valid until released.
    with consumer.pop_batch(64, timeout=1.0) as batch:
        tokens, lengths = batch.to_padded("tokens")   # a padded copy and the lengths
        for rec in batch:
            t = torch.from_dlpack(rec["tokens"])       # zero copy

A schema is a dict of field name to ``"dtype[count]"`` (``*``: a length per record,
chosen at reserve; ``"float64"`` alone: one element; ``"bytes"``: ``uint8[*]``), or the
same as one string (``"tokens: int32[*], score: float64"``). Records and reservations
hand out NumPy views (``rec["tokens"]``; DLPack through NumPy's ``__dlpack__``, so
``torch.from_dlpack`` works); views are the default, padded copies are asked for
(``Batch.to_padded``, ``Batch.pad``); a bfloat16 field's view is uint16 (the raw bits:
NumPy has no bfloat16). A record's views are valid until it is released
(``release()``, the end of its ``with`` block, or its garbage collection): after that
its space goes back to its producer, which overwrites it; using the record itself then
raises ``ClosedError``, and views taken from it before must not be used. A reservation's
views are the producer's to write until ``commit()`` or ``abort()``.

Errors are the classes of :mod:`shmbridge.errors`: ``FullError`` (the lane stayed full
for the whole ``timeout`` of a reserve; nothing written), ``ClientDiedError`` /
``ClientClosedError`` (the producer's consumers are gone), ``ProtocolError`` (a record
broke the stream's rules: the stream is unusable), ``NotFoundError``, ``TimeoutError``
(attach), ``RecordTooLargeError``, ``AlreadyAttachedError`` (every lane taken, or a rank
served), ``LayoutMismatchError`` (a producer's schema is not the stream's).
"""

from __future__ import annotations

import operator
import secrets
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _native
from .errors import ClosedError

__all__ = ["create", "attach", "attach_consumer", "stats", "names", "schema_text",
           "Consumer", "Producer", "Record", "Reservation", "Batch"]

Schema = Union[str, Mapping[str, Any]]


def schema_text(schema: Schema) -> str:
    """The stream schema ``schema`` as the core parses it (``"name: dtype[count], ..."``).

    A dict maps each field name to ``"dtype[count]"`` or ``"dtype[*]"`` (a string),
    ``"bytes"`` (``uint8[*]``), a NumPy dtype (one element), or ``(dtype, count)`` with
    ``count`` None for a variable length. A string is taken as it is."""
    if isinstance(schema, str):
        return schema
    parts = []
    for name, spec in dict(schema).items():
        if isinstance(spec, str):
            text = "uint8[*]" if spec.strip() == "bytes" else spec.strip()
        elif isinstance(spec, tuple) and len(spec) == 2:
            dtype, count = spec
            text = f"{np.dtype(dtype).name}[{'*' if count is None else int(count)}]"
        else:
            text = f"{np.dtype(spec).name}[1]"
        parts.append(f"{name}: {text}")
    return ", ".join(parts)


def _numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a field: its own, or, for bfloat16 (which NumPy lacks), uint16
    holding the raw bits (``torch.from_dlpack(view).view(torch.bfloat16)``)."""
    return np.dtype("uint16" if name == "bfloat16" else name)


class _Fields:
    """A stream's fields as NumPy sees them: names, dtypes, fixed counts (None:
    variable), and the views of a record's fields given their spans in a memory."""

    __slots__ = ("names", "dtypes", "sizes", "counts", "index", "variable", "bfloat16", "pick")

    def __init__(self, fields: Iterable[Tuple[str, str, Optional[int]]]):
        fields = list(fields)
        self.names = [f[0] for f in fields]
        self.dtypes = [_numpy_dtype(f[1]) for f in fields]
        self.sizes = [d.itemsize for d in self.dtypes]
        self.counts = [f[2] for f in fields]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.variable = [f[0] for f in fields if f[2] is None]
        self.bfloat16 = [f[0] for f in fields if f[1] == "bfloat16"]
        # Every field's value of a dict, in order, as a tuple (one C call).
        getter = operator.itemgetter(*self.names)
        self.pick = getter if len(self.names) > 1 else lambda d: (getter(d),)

    def position(self, name: str) -> int:
        try:
            return self.index[name]
        except KeyError:
            raise KeyError(f"no field {name!r}: the stream's fields are {', '.join(self.names)}") from None

    def typed(self, memory: np.ndarray) -> List[np.ndarray]:
        """``memory`` seen as each field's dtype (one array per field, shared among
        fields of one dtype): a field's view is then one slice of it."""
        by_dtype: Dict[np.dtype, np.ndarray] = {}
        for d in self.dtypes:
            if d not in by_dtype:
                by_dtype[d] = memory[:memory.nbytes - memory.nbytes % d.itemsize].view(d)
        return [by_dtype[d] for d in self.dtypes]

    def view(self, memory: np.ndarray, typed: List[np.ndarray], spans: List[Tuple[int, int]],
             i: int) -> np.ndarray:
        offset, count = spans[i]
        size = self.sizes[i]
        if offset % size == 0:  # always, fields being aligned to their dtype: one slice
            start = offset // size
            return typed[i][start:start + count]
        return memory[offset:offset + count * size].view(self.dtypes[i])

    def describe(self) -> Dict[str, Tuple[np.dtype, Optional[int]]]:
        return {n: (d, c) for n, d, c in zip(self.names, self.dtypes, self.counts)}


def _bfloat16_bits(value: Any) -> Any:
    """A value for a bfloat16 field as the bits the field holds: a uint16 array (or a
    bfloat16 tensor) is bits already; anything else is numbers, rounded to the nearest
    bfloat16 (ties to even; NaN stays NaN)."""
    dtype = str(getattr(value, "dtype", ""))
    if dtype in ("uint16", "torch.bfloat16"):
        return value
    single = np.ascontiguousarray(value, dtype=np.float32).reshape(-1)
    bits = single.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[np.isnan(single)] = 0x7FC0
    return rounded


def _memory(native_memory: Any, writable: bool) -> np.ndarray:
    """The uint8 array over a stream's memory (its capsule keeps the mapping alive)."""
    array = np.from_dlpack(native_memory)
    if not writable:
        array.flags.writeable = False
    return array


# ---------------------------------------------------------------------------------------
# Consuming


#: One record popped from a stream: ``rec["tokens"]`` is a read-only NumPy view of the
#: field in shared memory (a new view each time, no copy), valid until the record is
#: released (``release()``, the end of a ``with`` block, or garbage collection); after
#: that using the record raises ``ClosedError``. ``rec.bytes(name)`` copies a field's
#: bytes; ``length(name)``, ``address(name)``, ``fields()``, ``keys()``; ``lane`` (the
#: producer's slot), ``seq`` (its sequence number: 0, 1, 2 ... per producer),
#: ``producer`` (the lane's generation: tells two producers of one lane apart). The
#: class is the core's (no Python layer per record).
Record = _native.StreamRecord


class Batch(list):
    """The records of one ``pop_batch``: a list of :class:`Record` (views), released
    together by ``release()`` or the end of a ``with`` block. ``to_padded(name)`` and
    ``pad(...)`` copy fields into padded arrays (with the lengths), for a trainer that
    wants one tensor per field."""

    def __init__(self, records: Iterable[Record], fields: Any):
        super().__init__(records)
        self._fields = fields

    def to_padded(self, name: str, value: Any = 0) -> Tuple[np.ndarray, np.ndarray]:
        """Field ``name`` of every record, copied into one ``[len(batch), longest]``
        array (``value`` after each record's end), and the lengths (int64)."""
        i = self._fields.position(name)
        views = [r[name] for r in self]
        lengths = np.fromiter((len(v) for v in views), dtype=np.int64, count=len(views))
        width = int(lengths.max()) if len(views) else 0
        out = np.full((len(views), width), value, dtype=self._fields.dtypes[i])
        for row, v in zip(out, views):
            row[:len(v)] = v
        return out, lengths

    def pad(self, *names: str, value: Any = 0) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        """``to_padded`` of each field named (default: every field), by name."""
        return {n: self.to_padded(n, value) for n in (names or self._fields.names)}

    def release(self) -> None:
        for r in self:
            r.release()

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class Consumer:
    """One rank of a stream's consumer group: ``pop``, ``pop_batch``, ``stats``. The rank
    that created the stream removes its name when it closes (other ranks and producers
    keep their mappings). A context manager: closes on leaving."""

    def __init__(self, native: Any):
        self._native = native
        self._fields = _Fields(native.fields)
        self._memory = _memory(native.memory, writable=False)
        self._typed = self._fields.typed(self._memory)
        native.use_views(self._typed)
        self._last: Optional[Tuple[float, List[int]]] = None

    @property
    def name(self) -> str:
        """The stream's name (what producers ``attach``)."""
        return self._native.name

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def schema(self) -> str:
        return self._native.schema

    @property
    def fields(self) -> Dict[str, Tuple[np.dtype, Optional[int]]]:
        """Each field's dtype and fixed count (None: variable), in order."""
        return self._fields.describe()

    def _check(self) -> None:
        if self._native.closed:
            raise ClosedError("this stream consumer is closed")

    def pop(self, timeout: Optional[float] = None) -> Optional[Record]:
        """The next record (lanes taken in turn), waiting up to ``timeout`` seconds
        (None: no limit; Ctrl-C interrupts); None once ``timeout`` passed with none."""
        self._check()
        return self._native.pop(timeout)

    def pop_batch(self, max_records: int, timeout: Optional[float] = None) -> Batch:
        """Up to ``max_records`` records: waits up to ``timeout`` for the first, then
        takes what is there without waiting. Empty once ``timeout`` passed with none."""
        self._check()
        return Batch(self._native.pop_batch(max_records, timeout), self._fields)

    def stats(self) -> Dict[str, Any]:
        """Flow metrics: ``depth`` (records committed, not yet released or lost),
        ``bytes_in_use``, ``full_waits``, ``records_lost`` (to dead ranks), and per lane
        (``lanes``) its producer's pid, records and bytes committed, released, lost,
        bytes in use and ``records_per_s`` (committed per second since this consumer's
        previous ``stats()``; None the first time); per rank (``ranks``) its pid, state,
        records popped, released and lost."""
        self._check()
        s = self._native.stats()
        now = time.monotonic()
        committed = [lane["records_committed"] for lane in s["lanes"]]
        for k, lane in enumerate(s["lanes"]):
            rate = None
            if self._last is not None and now > self._last[0]:
                rate = (committed[k] - self._last[1][k]) / (now - self._last[0])
            lane["records_per_s"] = rate
        self._last = (now, committed)
        return s

    def close(self) -> None:
        """Marks this rank closed: producers get ``ClientClosedError`` once no rank is
        live. Records still held stay valid until released."""
        self._native.close()

    @property
    def closed(self) -> bool:
        return self._native.closed

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<shmbridge.stream.Consumer {self.name!r} rank {self.rank}: {self.schema}>"


# ---------------------------------------------------------------------------------------
# Producing


class Reservation:
    """A record reserved in the producer's lane: ``r["tokens"]`` is a writable NumPy view
    of the field, the producer's to write until ``commit()`` (the record becomes visible
    whole) or ``abort()`` (nothing is). A context manager: commits on leaving the block,
    aborts on an exception."""

    __slots__ = ("_native", "_fields", "_memory", "_typed", "_spans")

    def __init__(self, native: Any, fields: Any, memory: np.ndarray, typed: List[np.ndarray]):
        self._native = native
        self._fields = fields
        self._memory = memory
        self._typed = typed
        self._spans = native.spans

    def __getitem__(self, name: str) -> np.ndarray:
        if self._native.done:
            raise ClosedError("this reservation was committed or aborted")
        return self._fields.view(self._memory, self._typed, self._spans, self._fields.position(name))

    def __setitem__(self, name: str, value: Any) -> None:
        """Writes field ``name``: an array (or list, or number) of its length; bytes or a
        str (UTF-8) for a uint8 field."""
        view = self[name]
        if isinstance(value, str):
            value = value.encode()
        if isinstance(value, (bytes, bytearray, memoryview)):
            value = np.frombuffer(value, dtype=np.uint8).view(view.dtype)
        view[...] = value

    @property
    def seq(self) -> int:
        return self._native.seq

    @property
    def done(self) -> bool:
        return self._native.done

    def commit(self) -> None:
        self._native.commit()

    def abort(self) -> None:
        self._native.abort()

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._native.done:
            return
        if exc_type is None:
            self._native.commit()
        else:
            self._native.abort()


class Producer:
    """The writer of one lane of a stream: ``reserve`` + ``commit`` (or ``push``).
    Closing frees the lane (an open reservation is aborted). A context manager."""

    def __init__(self, native: Any):
        self._native = native
        self._fields = _Fields(native.fields)
        self._memory = _memory(native.memory, writable=True)
        self._typed = self._fields.typed(self._memory)

    @property
    def name(self) -> str:
        return self._native.name

    @property
    def lane(self) -> int:
        return self._native.lane

    @property
    def schema(self) -> str:
        return self._native.schema

    @property
    def fields(self) -> Dict[str, Tuple[np.dtype, Optional[int]]]:
        return self._fields.describe()

    @property
    def max_record(self) -> int:
        """The largest record the lane takes, in bytes (half the lane)."""
        return self._native.max_record

    def _lengths(self, lengths: Mapping[str, int]) -> List[int]:
        variable = self._fields.variable
        if len(lengths) == len(variable):  # the usual call: each variable field, nothing else
            try:
                return [lengths[n] for n in variable]
            except KeyError:
                pass
        unknown = [n for n in lengths if n not in self._fields.index]
        if unknown:
            raise TypeError(f"no field {', '.join(map(repr, unknown))}: the stream's fields are "
                            f"{', '.join(self._fields.names)}")
        missing = [n for n in self._fields.variable if n not in lengths]
        if missing:
            raise TypeError(f"reserve needs the length of {', '.join(map(repr, missing))} "
                            f"(the variable fields: {', '.join(self._fields.variable)})")
        for n, v in lengths.items():
            c = self._fields.counts[self._fields.index[n]]
            if c is not None and v != c:
                raise ValueError(f"field {n!r} has a fixed count of {c}, not {v}")
        return [lengths[n] for n in self._fields.variable]

    def reserve(self, timeout: Optional[float] = 10.0, **lengths: int) -> Reservation:
        """Reserves a record whose variable fields have the lengths given
        (``reserve(tokens=n, meta=m)``: one per variable field; fixed ones need none),
        waiting up to ``timeout`` seconds (None: no limit) for room in the lane:
        ``FullError`` after it, ``ClientDiedError``/``ClientClosedError`` when no
        consumer is left, ``RecordTooLargeError`` past the lane's size."""
        if self._native.closed:
            raise ClosedError("this stream producer is closed")
        native = self._native.reserve(self._lengths(lengths), timeout)
        return Reservation(native, self._fields, self._memory, self._typed)

    def push(self, timeout: Optional[float] = 10.0, **fields: Any) -> int:
        """Reserves, writes every field given and commits: one record, in one call into
        the core (the fastest way to send a record whose fields are already arrays).
        Each field is an array or tensor of its dtype (copied as it is when it is
        C-contiguous on the host; anything else, a list or another dtype, is converted by
        ``numpy.array`` first), a number for a one-element field, or bytes /
        a str (UTF-8) for a uint8 field; its length is the record's length of that field.
        Every field must be given. A bfloat16 field takes its raw bits as a uint16 array
        (or a bfloat16 tensor) and anything else as numbers, rounded to the nearest
        bfloat16. Returns the record's sequence number; a value that fits no record of
        the schema raises before anything is reserved."""
        names = self._fields.names
        try:
            values = self._fields.pick(fields)
        except KeyError:
            missing = [n for n in names if n not in fields]
            raise TypeError(f"push needs every field: {', '.join(map(repr, missing))} missing") from None
        if len(fields) != len(names):
            unknown = [n for n in fields if n not in self._fields.index]
            raise TypeError(f"no field {', '.join(map(repr, unknown))}: the stream's fields are {', '.join(names)}")
        if self._fields.bfloat16:
            values = [_bfloat16_bits(v) if n in self._fields.bfloat16 else v for n, v in zip(names, values)]
        return self._native.push(values, timeout)

    def stats(self) -> Dict[str, Any]:
        """The stream's flow metrics (as :meth:`Consumer.stats`, without rates)."""
        if self._native.closed:
            raise ClosedError("this stream producer is closed")
        return self._native.stats()

    def close(self) -> None:
        self._native.close()

    @property
    def closed(self) -> bool:
        return self._native.closed

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<shmbridge.stream.Producer {self.name!r} lane {self.lane}: {self.schema}>"


# ---------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return 1 << max(6, (int(n) - 1).bit_length())


def create(name: Optional[str] = None, schema: Schema = "", capacity: int = 1 << 20, lanes: int = 16,
           ranks: int = 1, spin_us: Optional[float] = None, blocking: bool = False) -> Consumer:
    """Creates a stream and returns its consumer (rank 0 of ``ranks``).

    ``name``: None for a fresh random one (``consumer.name`` says it); names are in the
    region namespace (``SHMBRIDGE_NAMESPACE``). ``schema``: see :func:`schema_text`.
    ``capacity``: bytes of each lane (each producer's buffer; a record takes at most
    half of it), rounded up to a power of two. ``lanes``: the most producers at once (1 to 1024).
    ``ranks``: consumers of the group (1 to 16), each record to exactly one; ranks
    1.. join with :func:`attach_consumer`. A pop with nothing to take spins ``spin_us``
    microseconds (default: the core's default policy, ``WaitPolicy::default``) before it sleeps;
    ``blocking=True`` never spins (many producers on few cores: leave them the CPU)."""
    if name is None:
        name = f"stream-{secrets.token_hex(8)}"
    text = schema_text(schema)
    return Consumer(_native.StreamConsumer.create(name, text, lanes, _pow2(capacity), ranks, spin_us, blocking))


def attach(name: str, timeout: float = 5.0, schema: Optional[Schema] = None, spin_us: Optional[float] = None,
           blocking: bool = False) -> Producer:
    """A producer of stream ``name``: waits up to ``timeout`` seconds for the stream and
    claims a lane (a free one, or one whose producer died). ``schema``, if given, must be
    the stream's (``LayoutMismatchError``). ``spin_us``, ``blocking``: how a full lane is
    waited for (as :func:`create`'s pops)."""
    text = None if schema is None else schema_text(schema)
    return Producer(_native.StreamProducer.attach(name, timeout, text, spin_us, blocking))


def attach_consumer(name: str, rank: int, timeout: float = 5.0, spin_us: Optional[float] = None,
                    blocking: bool = False) -> Consumer:
    """Serves rank ``rank`` of stream ``name``'s consumer group (a rank whose process
    died is taken over; its unreleased records are released as lost first). ``spin_us``,
    ``blocking``: as :func:`create`."""
    return Consumer(_native.StreamConsumer.attach(name, rank, timeout, spin_us, blocking))


def stats(name: str) -> Dict[str, Any]:
    """Stream ``name``'s flow metrics, for an observer: read from the file (never mapped,
    so a stream truncated meanwhile raises ``RegionTooSmallError``, never kills the
    caller), nothing written, no lane or rank taken."""
    return _native.stream_stats(name)


def names() -> List[str]:
    """The names of the streams of this process's region namespace
    (``SHMBRIDGE_NAMESPACE``), sorted (``shmbridge view`` shows each)."""
    return _native.stream_names()
