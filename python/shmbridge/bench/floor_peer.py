"""The Python floor: a raw sequence-counter ping-pong on a shared page, no library.

Two u64 counters on separate 64-byte lines of a `multiprocessing.shared_memory` page
(the spacing of shmbridge's `action_seq` / `frame_seq`): the client writes its action,
bumps `ping` and spins until the server echoes it on `pong`; the server spins on `ping`
and echoes it. The tensors sit in the same region, where the client touches them as it
does with every other transport; the server writes nothing but `pong`. What is left is
what any Python lock-step transport must pay: the interpreter's loads and stores and the
cache line moving between two cores."""

from __future__ import annotations

import time
from multiprocessing import shared_memory
from typing import Any, List

import numpy as np

from .common import (
    POLL_CHECK_EVERY,
    SERVER_CHECK_EVERY,
    PeerError,
    PollingPeer,
    ServerProcess,
    Workload,
    action_value,
    busy_server_loop,
)

PING, PONG = 0, 8  # u64 indices: byte offsets 0 and 64
PAGE = 4096


def _layout(wl: Workload):
    """(name, dtype, count, byte offset) of each tensor after the counter page."""
    out, off = [], PAGE
    for name, dtype, count in (("actions", "float32", wl.act_size), ("obs", wl.obs_dtype, wl.obs_size),
                               ("rewards", "float32", wl.num_envs), ("terminated", "bool", wl.num_envs),
                               ("truncated", "bool", wl.num_envs)):
        out.append((name, dtype, count, off))
        off += (count * np.dtype(dtype).itemsize + 63) // 64 * 64
    return out, (off + PAGE - 1) // PAGE * PAGE


def attach(name: str) -> shared_memory.SharedMemory:
    """Opens the segment the bench created. The server is a child spawned by the bench,
    so it shares the bench's resource tracker: its registration is the bench's own, which
    `unlink()` in the bench removes."""
    return shared_memory.SharedMemory(name=name)


def free(shm: shared_memory.SharedMemory) -> None:
    """Closes and unlinks a segment the bench created."""
    try:
        shm.close()
    except BufferError:
        pass  # a view is still alive somewhere: the mapping goes with the process
    shm.unlink()


def serve(ctl: Any, shm_name: str) -> None:
    shm = attach(shm_name)
    w = shm.buf.cast("Q")
    ctl.send(("ready", None))

    def active() -> None:
        poll = ctl.poll
        last = w[PONG]
        idle = 0
        while True:
            p = w[PING]
            if p != last:
                w[PONG] = p
                last = p
                continue
            idle += 1
            if idle >= SERVER_CHECK_EVERY:
                idle = 0
                if poll():
                    return

    try:
        busy_server_loop(ctl, active)
    finally:
        w.release()
        shm.close()


class FloorPeer(PollingPeer):
    key = "floor"
    label = "raw seq-counter ping-pong (Python floor)"

    def __init__(self, wl: Workload, touch: bool = True):
        super().__init__(wl)
        self.shm = None
        # False: the counters alone (`bench step`'s floor), no action written and no
        # tensor read.
        self.touch = touch

    def launch(self) -> None:
        layout, size = _layout(self.wl)
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.words = self.shm.buf.cast("Q")
        self.words[PING] = self.words[PONG] = 0
        self.views = {}
        for name, dtype, count, off in layout:
            arr = np.ndarray((count,), dtype=dtype, buffer=self.shm.buf, offset=off)
            self.views[name] = memoryview(arr)
        self.server = ServerProcess(serve, self.shm.name, name=f"floor-{self.wl.key}")

    def start(self) -> None:
        self.server.wait_ready()

    def run(self, n: int, out: List[int]) -> None:
        w = self.words
        v = self.views
        a, o, r, te, tr = v["actions"], v["obs"], v["rewards"], v["terminated"], v["truncated"]
        pc = time.perf_counter_ns
        app = out.append
        k = self.k
        for _ in range(n):
            k += 1
            x = action_value(k)
            t0 = pc()
            a[0] = x
            w[PING] = k
            i = 0
            while w[PONG] != k:
                i += 1
                if i >= POLL_CHECK_EVERY:
                    i = 0
                    self._stalled(t0)
            o[0]; o[-1]; r[0]; r[-1]; te[0]; te[-1]; tr[0]; tr[-1]  # noqa: E702,B018
            app(pc() - t0)
        self.k = k

    def step_once(self) -> None:
        """One round trip, untimed (the caller times it)."""
        w = self.words
        k = self.k + 1
        if self.touch:
            self.views["actions"][0] = action_value(k)
        w[PING] = k
        i = 0
        while w[PONG] != k:
            i += 1
            if i >= POLL_CHECK_EVERY:
                i = 0
                self._stalled(time.perf_counter_ns())
        self.k = k

    def check(self) -> None:
        if self.words[PONG] != self.k:
            raise PeerError(f"{self.label}: pong {self.words[PONG]} after ping {self.k}")

    def close(self) -> None:
        super().close()
        if self.shm is not None:
            self.views = {}
            self.words.release()
            free(self.shm)
            self.shm = None
