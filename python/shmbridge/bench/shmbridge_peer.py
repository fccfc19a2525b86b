"""shmbridge itself: the Python client against the reference `null` engine (sparse: the
engine writes the first and last element of each tensor), spin and blocking policies;
and the `cartpole` engine for the comparison with Gymnasium's AsyncVectorEnv."""

from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

import shmbridge

from .common import Peer, PeerError, Workload, action_value, pattern


def _flat(t: "shmbridge.Tensor") -> memoryview:
    """A flat memoryview of a tensor: zero copy, the mapped bytes themselves."""
    return memoryview(np.asarray(t).reshape(-1))


class ShmbridgePeer(Peer):
    key = "shmbridge-spin"
    label = "shmbridge (spin)"
    blocking_key = "shmbridge-blocking"
    blocking_label = "shmbridge (blocking)"

    def __init__(self, wl: Workload, blocking: bool = False):
        super().__init__(wl)
        self.blocking = blocking
        if blocking:
            self.key, self.label = self.blocking_key, self.blocking_label
        self.client: Optional[shmbridge.Client] = None

    def start(self) -> None:
        self.client = c = shmbridge.launch("null", blocking=self.blocking, **self.wl.shmbridge_kwargs())
        obs = c["rgb"] if self.wl.image else c.obs
        self.act = _flat(c.actions)
        self.views = [_flat(t) for t in (obs, c.rewards, c.terminated, c.truncated)]

    def run(self, n: int, out: List[int]) -> None:
        step = self.client.step
        a = self.act
        o, r, te, tr = self.views
        pc = time.perf_counter_ns
        app = out.append
        k = self.k
        for _ in range(n):
            k += 1
            v = action_value(k)
            t0 = pc()
            a[0] = v
            step()
            o[0]; o[-1]; r[0]; r[-1]; te[0]; te[-1]; tr[0]; tr[-1]  # noqa: E702,B018
            app(pc() - t0)
        self.k = k

    def check(self) -> None:
        c = self.client
        o, r = self.views[0], self.views[1]
        want_r, want_o = action_value(self.k), self.wl.obs_value(c.frame, 0)
        ok_o = {want_o}
        if self.wl.image:
            # src/envs/null.rs documents `rgb` as the pattern's low byte but writes
            # `pattern(seq, i) as u8` of an f32, which saturates at 255: accept both.
            ok_o.add(min(pattern(c.frame, 0), 255))
        if r[0] != want_r or o[0] not in ok_o:
            raise PeerError(f"{self.label}: frame {c.frame} has rewards[0]={r[0]} obs[0]={o[0]}, "
                            f"expected {want_r} and {want_o}")

    def close(self) -> None:
        if self.client is not None:
            self.views = []
            self.act = None
            self.client.close()
            self.client = None


class ShmbridgeCartPole(ShmbridgePeer):
    """The `cartpole` engine (CartPole-v1 dynamics, same-step autoreset), actions from a
    pre-drawn random bank, passed to `client.step(actions)` (one copy into the slot)."""

    key = "shmbridge-cartpole"
    label = "shmbridge `cartpole` engine (spin)"
    blocking_key = "shmbridge-cartpole-blocking"
    blocking_label = "shmbridge `cartpole` engine (blocking)"

    def __init__(self, num_envs: int, blocking: bool = False):
        super().__init__(Workload("cartpole", "", num_envs, (4,), "float32", 1), blocking)
        self.bank = np.random.default_rng(0).integers(0, 2, size=(1024, num_envs, 1), dtype=np.int64)

    def start(self) -> None:
        self.client = c = shmbridge.launch("cartpole", num_envs=self.wl.num_envs, seed=0,
                                           blocking=self.blocking)
        self.views = [_flat(t) for t in (c.obs, c.rewards, c.terminated, c.truncated)]

    def run(self, n: int, out: List[int]) -> None:
        step = self.client.step
        bank = self.bank
        m = len(bank)
        o, r, te, tr = self.views
        pc = time.perf_counter_ns
        app = out.append
        k = self.k
        for _ in range(n):
            k += 1
            actions = bank[k % m]
            t0 = pc()
            step(actions)
            o[0]; o[-1]; r[0]; r[-1]; te[0]; te[-1]; tr[0]; tr[-1]  # noqa: E702,B018
            app(pc() - t0)
        self.k = k

    def check(self) -> None:
        if self.client.frame != self.k:
            raise PeerError(f"{self.label}: frame {self.client.frame} after {self.k} steps")
