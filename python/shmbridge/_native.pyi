"""Type stubs for the native module ``shmbridge._native`` (``src/python.rs``)."""

from __future__ import annotations

import subprocess
from types import TracebackType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union, final

import numpy as np

__all__ = [
    "Client",
    "Tensor",
    "run_engine",
    "list_regions",
    "gc",
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
        """Address of the first byte in this process (zero-copy views point here)."""
    @property
    def writable(self) -> bool:
        """True for tensors the client writes (actions, reset_mask)."""
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
    ) -> Client: ...
    def step(self, actions: Optional[Any] = None, timeout: Optional[float] = None) -> _StepResult:
        """Copies ``actions`` (if given) into the action tensor, sends it and waits for
        the frame; returns ``(obs, rewards, terminated, truncated)``, the same objects
        every time."""
    def reset(
        self,
        seed: Union[None, int, Sequence[int]] = None,
        env_ids: Optional[Sequence[int]] = None,
        timeout: float = 10.0,
    ) -> int: ...
    def call(
        self, method: str, *, payload: Optional[bytes] = None, timeout: float = 10.0, **kwargs: Any
    ) -> Dict[str, Union[str, bytes]]: ...
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
    def frame(self) -> int: ...
    def counters(self) -> Tuple[int, int]: ...
    @property
    def engine_process(self) -> Optional[subprocess.Popen[bytes]]: ...
    def _adopt_engine(self, process: Any, on_close: Callable[[], None]) -> None: ...

def run_engine(
    env: str = "cartpole",
    num_envs: int = 256,
    name: Optional[str] = None,
    obs_dim: Optional[int] = None,
    act_dim: Optional[int] = None,
    sparse: bool = False,
    seed: int = 0,
    spin_us: Optional[float] = None,
    blocking: bool = False,
    idle_timeout: float = 3600.0,
    image: Optional[str] = None,
) -> int:
    """Serves a reference engine until the client closes; returns the number of steps."""

def list_regions() -> List[str]: ...
def gc() -> List[str]: ...
def _error_classes() -> List[str]: ...
def _raise_timeout() -> BaseException: ...
