"""What every benchmark shares: workloads, statistics, and the server side of a peer (a
spawned process with a control pipe). How the figures are formatted and written out is
in :mod:`.report`."""

from __future__ import annotations

import math
import multiprocessing as mp
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

# How long a client waits for one round trip before it calls the peer stuck, and for a
# server to come up. Generous: the machine may be busy; nothing here should ever hang.
STEP_TIMEOUT_S = 60.0
START_TIMEOUT_S = 60.0
# Empty polls between two looks at the clock (client busy-waits) or at the control pipe
# (busy-polling servers, so that an idle server stops spinning promptly).
POLL_CHECK_EVERY = 1 << 14
SERVER_CHECK_EVERY = 1 << 10


def pattern(seq: int, index: Any) -> Any:
    """The `null` engine's observation value for flat element `index` of frame `seq`
    (src/envs/null.rs): every peer server writes the same values. `index`: an int (an
    int back), or a NumPy array of them (uint64 values back)."""
    if isinstance(index, np.ndarray):
        return (np.uint64(seq) * np.uint64(2_654_435_761) + index.astype(np.uint64)) & np.uint64(0xFFFFFF)
    return (seq * 2_654_435_761 + index) & 0xFFFFFF


# ---------------------------------------------------------------------------------------
# Workloads


@dataclass(frozen=True)
class Workload:
    """One lock-step exchange: `num_envs` observations of `obs_shape` (per env) and
    `act_dim` f32 actions per env, plus f32 rewards and bool terminated/truncated."""

    key: str
    label: str
    num_envs: int
    obs_shape: Tuple[int, ...]
    obs_dtype: str  # "float32" or "uint8"
    act_dim: int

    @property
    def obs_size(self) -> int:
        return self.num_envs * math.prod(self.obs_shape)

    @property
    def obs_nbytes(self) -> int:
        return self.obs_size * np.dtype(self.obs_dtype).itemsize

    @property
    def act_size(self) -> int:
        return self.num_envs * self.act_dim

    @property
    def image(self) -> bool:
        return self.obs_dtype == "uint8"

    def obs_value(self, seq: int, index: int) -> int:
        v = pattern(seq, index)
        return v & 0xFF if self.image else v

    def shmbridge_kwargs(self) -> Dict[str, Any]:
        """Arguments of `shmbridge.launch("null", ...)` for this workload (sparse: the
        engine writes the first and last element of each tensor, O(1) work per step)."""
        if self.image:
            h, w, c = self.obs_shape
            return dict(num_envs=self.num_envs, obs_dim=1, act_dim=self.act_dim,
                        sparse=True, image=f"{h}x{w}x{c}")
        (obs_dim,) = self.obs_shape
        return dict(num_envs=self.num_envs, obs_dim=obs_dim, act_dim=self.act_dim, sparse=True)

    def to_dict(self) -> Dict[str, Any]:
        return dict(key=self.key, label=self.label, num_envs=self.num_envs,
                    obs_shape=list(self.obs_shape), obs_dtype=self.obs_dtype,
                    act_dim=self.act_dim)

    @staticmethod
    def from_dict(d: Dict[str, Any]) -> "Workload":
        return Workload(d["key"], d["label"], d["num_envs"], tuple(d["obs_shape"]),
                        d["obs_dtype"], d["act_dim"])


OBS_64B = Workload("64B", "obs 64 B (16×1 f32)", 16, (1,), "float32", 1)
OBS_4096X100 = Workload("4096x100", "obs 4096×100 f32, actions 4096×12", 4096, (100,), "float32", 12)
IMAGES = Workload("images", "images 64×84×84×3 u8, actions 64×12", 64, (84, 84, 3), "uint8", 12)
WORKLOADS = {w.key: w for w in (OBS_64B, OBS_4096X100, IMAGES)}


# ---------------------------------------------------------------------------------------
# Statistics


def random_actions(space: Any, num_envs: int, count: int) -> np.ndarray:
    """`count` batches of random actions for `num_envs` envs of a Gymnasium `Discrete` or
    `Box` space, drawn once (seed 0): `[count, num_envs, *space.shape]` of its dtype
    (`Discrete`: int64 from `start`; `Box`: uniform in its bounds)."""
    rng = np.random.default_rng(0)
    if hasattr(space, "n"):
        start = int(getattr(space, "start", 0))
        return rng.integers(start, start + int(space.n), size=(count, num_envs), dtype=np.int64)
    low, high = np.asarray(space.low), np.asarray(space.high)
    return rng.uniform(low, high, size=(count, num_envs, *low.shape)).astype(space.dtype)


@dataclass
class Stats:
    n: int
    median_ns: float
    p99_ns: float
    mean_ns: float

    @property
    def steps_per_s(self) -> float:
        return 1e9 / self.mean_ns if self.mean_ns > 0 else float("inf")

    @staticmethod
    def of(samples: Sequence[int]) -> "Stats":
        a = np.asarray(samples, dtype=np.float64)
        if a.size == 0:
            raise ValueError("no samples")
        return Stats(int(a.size), float(np.median(a)), float(np.percentile(a, 99)), float(a.mean()))

    def to_dict(self) -> Dict[str, float]:
        return dict(n=self.n, median_ns=self.median_ns, p99_ns=self.p99_ns,
                    mean_ns=self.mean_ns, steps_per_s=self.steps_per_s)


# ---------------------------------------------------------------------------------------
# Peer servers: spawned processes, one control pipe each.
#
# The server function runs as `target(ctl, *args)` in a fresh interpreter (spawn). It
# sends ("ready", info) once it serves, then obeys the commands on `ctl`. Servers that
# busy-poll (iceoryx2, the floor) do so only between "run" and the next command, so an
# idle one sleeps in `ctl.recv()` and leaves the CPU to whoever is being measured.


def _server_entry(target: Callable[..., None], ctl: Any, args: Tuple[Any, ...]) -> None:
    try:
        target(ctl, *args)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the bench went away
    except BaseException:  # noqa: BLE001 - reported to the bench, which raises it
        try:
            ctl.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
        sys.exit(1)


class PeerError(RuntimeError):
    """A peer failed to start or stopped answering."""


class ServerProcess:
    """A peer's server in a spawned process, with a control pipe."""

    def __init__(self, target: Callable[..., None], *args: Any, name: str = "peer-server",
                 extra_pipe: bool = False):
        ctx = mp.get_context("spawn")
        self.ctl, child_ctl = ctx.Pipe()
        self.data = None
        child_data = None
        if extra_pipe:
            self.data, child_data = ctx.Pipe()
            args = (child_data,) + args
        self.proc = ctx.Process(target=_server_entry, args=(target, child_ctl, args),
                                name=name, daemon=True)
        self.proc.start()
        child_ctl.close()
        if child_data is not None:
            child_data.close()
        self.name = name
        self.info: Any = None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> Any:
        self.info = self._reply(timeout, "before it was ready", f"server not ready after {timeout} s")[1]
        return self.info

    def run(self) -> None:
        """A busy-polling server starts polling its transport."""
        self.ctl.send("run")

    def idle(self, timeout: float = START_TIMEOUT_S) -> None:
        """A busy-polling server stops polling; returns once it has (so that it spins no
        more while the next transport is measured)."""
        self.ctl.send("idle")
        self._reply(timeout, "while going idle", f"server did not go idle within {timeout} s")

    def _reply(self, timeout: float, when: str, late: str) -> Any:
        """The server's next message on the control pipe; PeerError if it exits first
        (`when`: what it was asked to do), takes longer than `timeout` (`late`), or sends
        an error."""
        deadline = time.monotonic() + timeout
        while not self.ctl.poll(0.05):
            if not self.proc.is_alive():
                raise PeerError(f"{self.name}: server exited with status {self.proc.exitcode} {when}")
            if time.monotonic() > deadline:
                raise PeerError(f"{self.name}: {late}")
        try:
            msg = self.ctl.recv()
        except EOFError:
            self.proc.join(5)
            raise PeerError(f"{self.name}: server exited with status {self.proc.exitcode} {when}") from None
        if msg[0] == "error":
            raise PeerError(f"{self.name}: server failed:\n{msg[1]}")
        return msg

    def check_alive(self) -> None:
        if self.ctl.poll():
            try:
                msg = self.ctl.recv()
            except EOFError:
                msg = None
            if isinstance(msg, tuple) and msg and msg[0] == "error":
                raise PeerError(f"{self.name}: server failed:\n{msg[1]}")
        if not self.proc.is_alive():
            raise PeerError(f"{self.name}: server died (exit status {self.proc.exitcode})")

    def stop(self, timeout: float = 10.0) -> None:
        try:
            self.ctl.send("stop")
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.ctl.close()
        if self.data is not None:
            self.data.close()


def busy_server_loop(ctl: Any, active: Callable[[], None]) -> None:
    """The control loop of a busy-polling server: sleeps in `ctl.recv()` until "run",
    then calls `active()`, which polls its transport until `ctl.poll()` says a command
    is waiting (it looks every SERVER_CHECK_EVERY empty polls); "idle" is acknowledged
    once polling has stopped; "stop" (or the bench closing the pipe) ends it."""
    while True:
        cmd = ctl.recv()
        if cmd == "stop":
            return
        if cmd == "run":
            active()
        elif cmd == "idle":
            ctl.send(("idle", None))


class Peer:
    """The client side of one transport for one workload. The bench calls `launch()` on
    every peer of a workload (spawning servers, which then start in parallel), `start()`
    (wait for the server, connect), then per block `begin()`, `run(n, out)`, `end()`,
    `check()`, and finally `close()`.

    `run` times each round trip on its own with `time.perf_counter_ns` and appends the
    nanoseconds to `out`. A round trip: write this step's action, send, wait for the
    frame, touch the first and last element of each tensor received (observations,
    rewards, terminated, truncated)."""

    key = "?"
    label = "?"
    needs: Tuple[str, ...] = ()  # Python packages the transport needs

    def __init__(self, wl: Workload):
        self.wl = wl
        self.k = 0  # steps sent so far
        self.server: Optional[ServerProcess] = None

    def launch(self) -> None:
        pass

    def start(self) -> None:
        pass

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass

    def run(self, n: int, out: List[int]) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raises if the last frame received was not the answer to the last action."""

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def _stalled(self, t0_ns: int) -> None:
        """Called from a busy-wait every POLL_CHECK_EVERY polls."""
        if self.server is not None:
            self.server.check_alive()
        if time.perf_counter_ns() - t0_ns > STEP_TIMEOUT_S * 1e9:
            raise PeerError(f"{self.label}: no answer within {STEP_TIMEOUT_S} s")


class PollingPeer(Peer):
    """A peer whose server busy-polls (`busy_server_loop`): it polls during this peer's
    blocks only, so that it leaves the CPU to the others."""

    def begin(self) -> None:
        self.server.run()

    def end(self) -> None:
        self.server.idle()


def action_value(k: int) -> float:
    """The action the client sends at step `k` (exact in f32); servers echo it as
    rewards[0], which `check()` verifies."""
    return float(k & 0xFFFFF)
