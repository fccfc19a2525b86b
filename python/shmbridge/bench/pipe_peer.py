"""`multiprocessing.shared_memory` + `Pipe`: the pattern behind Gymnasium's
`AsyncVectorEnv(shared_memory=True)`, with one worker serving all envs.

As in Gymnasium's `_async_worker`: the parent sends `("step", actions)` through a duplex
`multiprocessing.Pipe` (the actions array is pickled); the worker steps, writes the
observations into shared memory (Gymnasium uses `ctx.Array`, the same kind of shared
mapping; here `multiprocessing.shared_memory`) and answers
`((None, rewards, terminated, truncated, info), True)` through the pipe. The parent reads
the observations in place from its view of the segment (no copy: Gymnasium's
`copy=False`)."""

from __future__ import annotations

import time
from multiprocessing import shared_memory
from typing import Any, List

import numpy as np

from .common import Peer, PeerError, ServerProcess, Workload, action_value
from .floor_peer import attach, free


def serve(ctl: Any, pipe: Any, wl_dict: dict, shm_name: str) -> None:
    wl = Workload.from_dict(wl_dict)
    shm = attach(shm_name)
    obs = np.ndarray((wl.obs_size,), dtype=wl.obs_dtype, buffer=shm.buf)
    last = wl.obs_size - 1
    rewards = np.zeros(wl.num_envs, np.float32)
    terminated = np.zeros(wl.num_envs, bool)
    truncated = np.zeros(wl.num_envs, bool)
    a_last = (wl.num_envs - 1) * wl.act_dim
    ctl.send(("ready", None))
    try:
        while True:
            command, data = pipe.recv()
            if command == "step":
                flat = data.reshape(-1)
                seq = int(flat[0])
                obs[0] = wl.obs_value(seq, 0)
                obs[last] = wl.obs_value(seq, last)
                rewards[0] = flat[0]
                rewards[-1] = flat[a_last]
                pipe.send(((None, rewards, terminated, truncated, {}), True))
            elif command == "close":
                pipe.send((None, True))
                break
    finally:
        del obs
        shm.close()


class PipePeer(Peer):
    key = "shm-pipe"
    label = "multiprocessing.shared_memory + Pipe"

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.shm = None

    def launch(self) -> None:
        wl = self.wl
        self.shm = shared_memory.SharedMemory(create=True, size=max(wl.obs_nbytes, 1))
        self.obs = np.ndarray((wl.obs_size,), dtype=wl.obs_dtype, buffer=self.shm.buf)
        self.obs_view = memoryview(self.obs)
        self.actions = np.zeros((wl.num_envs, wl.act_dim), np.float32)
        self.act = memoryview(self.actions.reshape(-1))
        self.server = ServerProcess(serve, wl.to_dict(), self.shm.name,
                                    name=f"shm-pipe-{wl.key}", extra_pipe=True)

    def start(self) -> None:
        self.server.wait_ready()
        self.pipe = self.server.data

    def run(self, n: int, out: List[int]) -> None:
        send, recv = self.pipe.send, self.pipe.recv
        actions, a, o = self.actions, self.act, self.obs_view
        pc = time.perf_counter_ns
        app = out.append
        k = self.k
        for _ in range(n):
            k += 1
            x = action_value(k)
            t0 = pc()
            a[0] = x
            send(("step", actions))
            (_, r, te, tr, _info), _ok = recv()
            o[0]; o[-1]; r[0]; r[-1]; te[0]; te[-1]; tr[0]; tr[-1]  # noqa: E702,B018
            app(pc() - t0)
        self.k = k
        self.last_rewards = r if n else None

    def check(self) -> None:
        want_r, want_o = action_value(self.k), self.wl.obs_value(int(action_value(self.k)), 0)
        r = getattr(self, "last_rewards", None)
        if r is None or r[0] != want_r or self.obs_view[0] != want_o:
            raise PeerError(f"{self.label}: rewards[0]={None if r is None else r[0]} "
                            f"obs[0]={self.obs_view[0]}, expected {want_r} and {want_o}")

    def close(self) -> None:
        if self.server is not None and self.server.proc.is_alive():
            try:
                self.pipe.send(("close", None))
                if self.pipe.poll(10):
                    self.pipe.recv()
            except (OSError, EOFError, AttributeError):
                pass
        super().close()
        if self.shm is not None:
            self.obs_view = None
            self.obs = None
            free(self.shm)
            self.shm = None
