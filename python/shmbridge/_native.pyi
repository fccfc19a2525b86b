"""Type stubs for the native module ``shmbridge._native`` (``src/python/``)."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable, Dict, List, Literal, Optional, Protocol, Sequence, Tuple, Type, Union, final

import numpy as np

from ._batch import Batch
from ._process import EngineProcess

__all__ = [
    "Client",
    "Engine",
    "EngineSpec",
    "RawObserver",
    "StreamConsumer",
    "StreamMemory",
    "StreamProducer",
    "StreamRecord",
    "StreamReservation",
    "stream_stats",
    "stream_names",
    "Tensor",
    "cli",
    "cuda_available",
    "_cuda_status",
    "list_regions",
    "gc",
    "_spawn_engine",
    "_check_cli_args",
    "_error_classes",
    "_raise_timeout",
    "__version__",
    "PROTOCOL_VERSION",
]

__version__: str
PROTOCOL_VERSION: Tuple[int, int]

@final
class Tensor:
    """One tensor of the region, created once at attach; a view, never a copy."""

    def __dlpack__(
        self,
        *,
        stream: Optional[Any] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    def __array__(self, dtype: Optional[Any] = None, copy: Optional[bool] = None) -> np.ndarray: ...
    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str:
        """NumPy-style dtype name: "float32", "int64", "bool", ..."""
    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def ndim(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def data_ptr(self) -> int:
        """Address of the first byte in this process (zero-copy views point here): in
        the shared-memory mapping, or the device pointer of a CUDA tensor."""
    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
    @property
    def writable(self) -> bool:
        """True for the tensors this side writes (a client: actions, reset_mask; an
        engine: observations, rewards, dones)."""
    @property
    def direction(self) -> str: ...

_StepResult = Tuple[Tensor, Tensor, Tensor, Tensor]

@final
class Client:
    """A client attached to an engine. Use ``shmbridge.attach`` or ``shmbridge.launch``."""

    @staticmethod
    def attach(
        name: str,
        timeout: float = 10.0,
        spin_us: Optional[float] = None,
        blocking: bool = False,
        importer: str = "auto",
    ) -> Client: ...
    def step(
        self, actions: Optional[Any] = None, timeout: Optional[float] = None, stream: Optional[Any] = None
    ) -> _StepResult:
        """Copies ``actions`` (if given) into the action tensor, sends it and waits for
        the frame; returns ``(obs, rewards, terminated, truncated)``, the same objects
        every time. CUDA engines: ordered on ``stream`` (an int ``CUstream``, a
        ``torch.cuda.Stream``; default torch's current stream), which afterwards waits
        on the engine's event; ``actions`` must then be a CUDA tensor on the device.
        ``timeout`` bounds the whole step; ``NotPostedError`` (a ``TimeoutError``): the
        action was not sent (a CUDA stream of a Vulkan engine's tensors, or of CUDA
        memory shared by file descriptor, did not drain),
        nothing is in flight. A host step holds the GIL for about 10 µs while it looks
        for the frame (once only for a blocking client, or an engine served by a
        thread of this process), and releases it to wait longer."""
    def reset(
        self,
        seed: Union[None, int, Sequence[int]] = None,
        env_ids: Optional[Sequence[int]] = None,
        timeout: float = 10.0,
        stream: Optional[Any] = None,
    ) -> int: ...
    def async_reset(
        self,
        batch_size: Optional[int] = None,
        seed: Union[None, int, Sequence[int]] = None,
        timeout: float = 10.0,
    ) -> None:
        """Starts asynchronous batches (docs/async.md): resets every env and makes every
        shard ready; ``recv()`` then hands out ``batch_size`` envs (whole shards) at a time."""
    def recv(self, timeout: Optional[float] = None) -> Batch:
        """The next ``batch_size`` envs whose frames arrived, read in place:
        ``obs, rewards, terminated, truncated, env_ids = client.recv()``."""
    def send(self, actions: Optional[Any] = None, env_ids: Optional[Sequence[int]] = None) -> None:
        """Writes ``actions`` into rows ``env_ids`` (default: the last ``recv()``'s) of the
        action tensor and steps those shards. ``actions`` is checked as ``step``'s are:
        the action tensor's dtype (``TypeError``) and shape ``(len(env_ids), ...)``
        (``ValueError``), no cast or broadcast; nothing is written nor posted on error."""
    @property
    def batch_shards(self) -> List[int]: ...
    def call(
        self,
        method: str,
        *,
        payload: Optional[bytes] = None,
        timeout: float = 10.0,
        shard: Union[None, int, Literal["all"]] = None,
        **kwargs: Any,
    ) -> Union[Dict[str, Union[str, bytes]], List[Dict[str, Union[str, bytes]]]]:
        """A sharded engine: shard 0 answers, or shard ``shard``; ``"all"``: every
        shard, a list of replies in shard order."""
    @property
    def shards(self) -> List[Tuple[int, int]]:
        """``(start, end)`` of each shard's envs (one range for an unsharded engine)."""
    @property
    def shard_pids(self) -> List[int]: ...
    def schema(self, timeout: float = 10.0) -> Dict[str, Any]:
        """``{"num_envs", "engine_kind", "tensors": [{"name", "dtype", "shape",
        "direction", "location"}], "metadata": {str: str}}`` from the engine."""
    def ping(self, payload: Optional[bytes] = None, timeout: float = 10.0) -> bytes: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> Client: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
    def __getitem__(self, name: str, /) -> Tensor: ...
    def __contains__(self, name: str, /) -> bool: ...
    @property
    def obs(self) -> Tensor: ...
    @property
    def actions(self) -> Tensor: ...
    @property
    def rewards(self) -> Tensor: ...
    @property
    def terminated(self) -> Tensor: ...
    @property
    def truncated(self) -> Tensor: ...
    @property
    def reset_mask(self) -> Tensor: ...
    @property
    def tensors(self) -> Tuple[Tensor, ...]: ...
    @property
    def name(self) -> str: ...
    @property
    def num_envs(self) -> int: ...
    @property
    def engine_kind(self) -> str: ...
    @property
    def engine_pid(self) -> int: ...
    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``: where the engine's tensors live."""
    @property
    def importer(self) -> Optional[str]:
        """Which importer serves the engine's Vulkan tensors, and why; ``None`` when it
        has none."""
    @property
    def frame(self) -> int: ...
    def counters(self) -> Tuple[int, int]: ...
    @property
    def engine_process(self) -> Optional[EngineProcess]: ...
    def _adopt_engine(self, process: Any, on_close: Callable[[], None]) -> None: ...

class _CommandHandler(Protocol):
    """What ``Engine.wait_actions(handler=...)`` calls; both methods are optional.
    Raise ``NotImplementedError`` (unsupported), ``ValueError``/``TypeError``/``KeyError``
    (bad request) or anything else (engine error) to refuse; ``call`` may return
    ``NotImplemented`` for an unknown method."""

    def reset(self, env_ids: Optional[List[int]], seeds: List[int], options: Dict[str, str]) -> None: ...
    def call(
        self, method: str, args: Dict[str, str], payload: bytes
    ) -> Union[None, Dict[str, Any], bytes, Tuple[Dict[str, Any], bytes]]: ...

@final
class EngineSpec:
    """What an engine serves: kind, number of envs, tensors and metadata."""

    def __new__(
        cls, kind: str, num_envs: int, *, name: Optional[str] = None, ring_capacity: Optional[int] = None
    ) -> EngineSpec: ...
    @staticmethod
    def standard(
        kind: str,
        num_envs: int,
        obs_dim: int,
        act_dim: int,
        act_dtype: Any = None,
        *,
        name: Optional[str] = None,
    ) -> EngineSpec:
        """obs, actions, rewards, terminated, truncated, reset_mask."""
    def tensor(
        self,
        name: str,
        dtype: Any,
        shape: Sequence[int],
        direction: Literal["engine->client", "client->engine"] = "engine->client",
    ) -> EngineSpec: ...
    def metadata(self, key: str, value: Any) -> EngineSpec: ...
    def shards(self, count: int) -> EngineSpec:
        """Split the env axis over ``count`` processes (protocol 1.4): the engine made
        from this spec serves shard 0; the others ``Engine.join`` it."""
    @property
    def kind(self) -> str: ...
    @property
    def num_envs(self) -> int: ...
    @property
    def name(self) -> Optional[str]: ...
    @property
    def tensors(self) -> List[Tuple[str, str, Tuple[int, ...], str]]: ...

@final
class Engine:
    """Serves a region from Python: write engine->client views, ``publish()``,
    ``wait_actions()``, repeat."""

    def __new__(
        cls,
        spec: EngineSpec,
        *,
        spin_us: Optional[float] = None,
        blocking: bool = False,
        cuda_sharing: Literal["auto", "ipc", "fd"] = "auto",
    ) -> Engine: ...
    @staticmethod
    def join(
        name: str, shard: int, *, timeout: float = 10.0, spin_us: Optional[float] = None, blocking: bool = False
    ) -> Engine:
        """Serve shard ``shard`` of the sharded region ``name`` (its envs only)."""
    @property
    def shard(self) -> int: ...
    @property
    def shard_envs(self) -> Tuple[int, int]: ...
    def publish(self) -> int: ...
    def wait_actions(self, timeout: Optional[float] = None, handler: Optional[_CommandHandler] = None) -> int: ...
    def record_episode(self, env: int, episode_return: float, length: int) -> None:
        """Records a finished episode in the region's stats area (protocol 1.7), which
        observers read; call it between ``wait_actions()`` and ``publish()``."""
    def wait_for_client(self, timeout: Optional[float] = None) -> None: ...
    def poll_commands(self, handler: Optional[_CommandHandler] = None) -> int: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> Engine: ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def num_envs(self) -> int: ...
    @property
    def frame(self) -> int: ...
    @property
    def client_attached(self) -> bool: ...
    @property
    def dropped_replies(self) -> int: ...
    def __getitem__(self, name: str, /) -> Tensor: ...
    def __contains__(self, name: str, /) -> bool: ...
    @property
    def tensors(self) -> Tuple[Tensor, ...]: ...
    @property
    def obs(self) -> Tensor: ...
    @property
    def actions(self) -> Tensor: ...
    @property
    def rewards(self) -> Tensor: ...
    @property
    def terminated(self) -> Tensor: ...
    @property
    def truncated(self) -> Tensor: ...
    @property
    def reset_mask(self) -> Tensor: ...

@final
class RawObserver:
    """A read-only observer of a live region (protocol 1.7); ``shmbridge.observe()``
    wraps it."""

    @staticmethod
    def attach(name: str, timeout: float = 10.0) -> RawObserver: ...
    @property
    def name(self) -> str: ...
    @property
    def num_envs(self) -> int: ...
    @property
    def engine_kind(self) -> str: ...
    @property
    def engine_pid(self) -> int: ...
    @property
    def shards(self) -> List[Tuple[int, int]]: ...
    @property
    def tensors(self) -> List[Dict[str, Any]]:
        """``{"name", "dtype", "shape", "direction", "location"}`` of every tensor."""
    def frame(self) -> int: ...
    def check(self) -> None: ...
    def read(
        self,
        names: Sequence[str],
        env_start: Optional[int] = None,
        env_end: Optional[int] = None,
        timeout: Optional[float] = 1.0,
    ) -> Tuple[int, List[bytearray]]:
        """``(frame, [bytearray per name])``: rows ``env_start..env_end`` of each tensor,
        copied while no engine wrote."""
    def stats(self, timeout: Optional[float] = 1.0) -> Dict[str, Any]:
        """``{"frame", "episodes", "return_sum", "length_sum", "recent": [(shard,
        number, env, return, length)]}``."""
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...

@final
class StreamMemory:
    """A stream's bytes as one uint8 DLPack tensor (its capsule keeps the mapping alive):
    a consumer's whole stream, or a producer's lane."""

    def __dlpack__(
        self,
        *,
        stream: Optional[Any] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    @property
    def address(self) -> int: ...
    def __len__(self) -> int: ...

@final
class StreamRecord:
    """A popped record (``shmbridge.stream.Record``): ``rec["tokens"]`` is a read-only
    NumPy view of the field, valid until the record is released."""

    @property
    def spans(self) -> List[Tuple[int, int]]: ...
    @property
    def lane(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def producer(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def __getitem__(self, key: str, /) -> Any: ...
    def __len__(self) -> int: ...
    def fields(self) -> Dict[str, Any]: ...
    def bytes(self, name: str) -> bytes: ...
    def length(self, name: str) -> int: ...
    def address(self, name: str) -> int: ...
    def keys(self) -> List[str]: ...
    def release(self) -> None: ...
    def __enter__(self) -> StreamRecord: ...
    def __exit__(self, *exc: Any) -> None: ...

@final
class StreamConsumer:
    """One rank of a stream's consumer group (``shmbridge.stream.Consumer`` wraps it)."""

    @staticmethod
    def create(
        name: str,
        schema: str,
        lanes: int,
        lane_capacity: int,
        ranks: int,
        spin_us: Optional[float] = None,
        blocking: bool = False,
    ) -> StreamConsumer: ...
    @staticmethod
    def attach(
        name: str, rank: int, timeout: float, spin_us: Optional[float] = None, blocking: bool = False
    ) -> StreamConsumer: ...
    @property
    def name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def schema(self) -> str: ...
    @property
    def fields(self) -> List[Tuple[str, str, Optional[int]]]: ...
    @property
    def memory(self) -> StreamMemory: ...
    @property
    def closed(self) -> bool: ...
    def pop(self, timeout: Optional[float] = None) -> Optional[StreamRecord]: ...
    def pop_batch(self, max_records: int, timeout: Optional[float] = None) -> List[StreamRecord]: ...
    def use_views(self, typed: Sequence[Any]) -> None: ...
    def stats(self) -> Dict[str, Any]: ...
    def close(self) -> None: ...

@final
class StreamReservation:
    """A reserved record: ``spans`` (offset in the producer's memory, element count) per field."""

    @property
    def spans(self) -> List[Tuple[int, int]]: ...
    @property
    def seq(self) -> int: ...
    @property
    def done(self) -> bool: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...

@final
class StreamProducer:
    """The writer of one lane of a stream (``shmbridge.stream.Producer`` wraps it)."""

    @staticmethod
    def attach(
        name: str,
        timeout: float,
        schema: Optional[str] = None,
        spin_us: Optional[float] = None,
        blocking: bool = False,
    ) -> StreamProducer: ...
    @property
    def name(self) -> str: ...
    @property
    def lane(self) -> int: ...
    @property
    def schema(self) -> str: ...
    @property
    def fields(self) -> List[Tuple[str, str, Optional[int]]]: ...
    @property
    def max_record(self) -> int: ...
    @property
    def memory(self) -> StreamMemory: ...
    @property
    def closed(self) -> bool: ...
    def reserve(self, lengths: Sequence[int], timeout: Optional[float] = None) -> StreamReservation: ...
    def push(self, values: Sequence[Any], timeout: Optional[float] = None) -> int: ...
    def stats(self) -> Dict[str, Any]: ...
    def close(self) -> None: ...

def stream_stats(name: str) -> Dict[str, Any]: ...
def stream_names() -> List[str]: ...

def cli(argv: Sequence[str]) -> int:
    """Runs the ``shmbridge`` command line, the Rust binary's own (``engine``, ``client``,
    ``ls``, ``inspect``, ``gc``), on ``argv`` (the program name first); returns the exit
    status. Runs without the GIL; Ctrl-C stops ``client`` with ``KeyboardInterrupt``,
    and ``engine`` closes its region and ends the process (status 130)."""

def cuda_available() -> bool:
    """Whether CUDA tensors can be served and opened here; never raises. The reason is
    ``shmbridge.cuda_status()``'s."""
def _cuda_status() -> Tuple[bool, str]:
    """``(True, "driver ..., N device(s)")`` or ``(False, reason)``; never raises."""
def list_regions() -> List[str]: ...
def gc() -> List[str]: ...
def _spawn_engine(
    argv: Sequence[str], env: Optional[Sequence[Tuple[str, str]]], stderr_fd: int, stdin: bool = False
) -> Tuple[int, int, int]:
    """Starts an engine through the library's one spawning path (SIGTERM when this
    process dies; its own session); returns ``(pid, stdout_fd, stdin_fd)``."""
def _check_cli_args(argv: Sequence[str]) -> None:
    """``ValueError`` with the parser's message unless ``shmbridge <argv>`` parses."""
def _error_classes() -> List[str]: ...
def _raise_timeout() -> BaseException: ...
