"""Gymnasium's `AsyncVectorEnv` on CartPole-v1: the vectorised env most PyTorch PPO code
starts from, one worker process per env, observations through shared memory.

Made as Gymnasium's documentation recommends, `gymnasium.make_vec("CartPole-v1",
num_envs=N, vectorization_mode="async")`, with its defaults (`shared_memory=True`,
`copy=True`, next-step autoreset). Each step passes a pre-drawn random action batch to
`envs.step(actions)` and touches the first and last element of what comes back. Set
against shmbridge's `cartpole` engine (the same dynamics) at the same num_envs."""

from __future__ import annotations

import time
from typing import List

import numpy as np

from .common import Peer, PeerError, Workload


class AsyncVectorEnvPeer(Peer):
    key = "gym-async"
    label = "Gymnasium AsyncVectorEnv(CartPole-v1)"
    needs = ("gymnasium",)

    def __init__(self, num_envs: int):
        super().__init__(Workload("cartpole", "", num_envs, (4,), "float32", 1))
        self.envs = None
        self.bank = np.random.default_rng(0).integers(0, 2, size=(1024, num_envs), dtype=np.int64)

    def start(self) -> None:
        import gymnasium as gym

        self.envs = gym.make_vec("CartPole-v1", num_envs=self.wl.num_envs, vectorization_mode="async")
        self.envs.reset(seed=0)

    def run(self, n: int, out: List[int]) -> None:
        step = self.envs.step
        bank = self.bank
        m = len(bank)
        pc = time.perf_counter_ns
        app = out.append
        k = self.k
        o = None
        for _ in range(n):
            k += 1
            actions = bank[k % m]
            t0 = pc()
            o, r, te, tr, _info = step(actions)
            o[0, 0]; o[-1, -1]; r[0]; r[-1]; te[0]; te[-1]; tr[0]; tr[-1]  # noqa: E702,B018
            app(pc() - t0)
        self.k = k
        self.last_obs = o

    def check(self) -> None:
        o = getattr(self, "last_obs", None)
        if o is None or o.shape != (self.wl.num_envs, 4) or not np.isfinite(o).all():
            raise PeerError(f"{self.label}: unexpected observations {o!r}")

    def close(self) -> None:
        if self.envs is not None:
            self.envs.close()
            self.envs = None
