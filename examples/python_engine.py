"""A simulator written in Python serving shmbridge: vectorised Pendulum (Gymnasium's
Pendulum-v1 dynamics) in NumPy.

    python examples/python_engine.py --num-envs 64        # serve; prints the region name
    python examples/python_engine.py --demo               # serve and drive it with a client

A learner attaches with ``shmbridge.attach(name)`` and sees ``obs`` (cos θ, sin θ, θ̇),
``actions`` (torque), ``rewards``, ``terminated``, ``truncated`` and ``reset_mask`` as
zero-copy tensors. A MuJoCo simulator plugs in the same way: write ``mjData`` batches into
the engine's views in ``step()`` and ``reset()``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Dict, List, Optional

import numpy as np

import shmbridge

MAX_SPEED, MAX_TORQUE, DT, MASS, LENGTH = 8.0, 2.0, 0.05, 1.0, 1.0
MAX_STEPS = 200


def pendulum_step(th, thdot, u, g):
    """One Pendulum-v1 step for every env: the new (θ, θ̇) and the reward."""
    u = np.clip(u, -MAX_TORQUE, MAX_TORQUE)
    angle = ((th + np.pi) % (2 * np.pi)) - np.pi
    cost = angle**2 + 0.1 * thdot**2 + 0.001 * u**2
    thdot = thdot + (3 * g / (2 * LENGTH) * np.sin(th) + 3.0 / (MASS * LENGTH**2) * u) * DT
    thdot = np.clip(thdot, -MAX_SPEED, MAX_SPEED)
    return th + thdot * DT, thdot, -cost


def observe(th, thdot):
    return np.stack([np.cos(th), np.sin(th), thdot], axis=-1).astype(np.float32)


class Pendulum:
    """The engine's state and its command handler (``reset``, and ``set_gravity``)."""

    def __init__(self, engine: shmbridge.Engine, seed: int, g: float = 10.0):
        n = engine.num_envs
        # Writable views of the shared tensors, made once: writing them is publishing.
        self.obs = np.from_dlpack(engine.obs)
        self.rewards = np.from_dlpack(engine.rewards)
        self.terminated = np.from_dlpack(engine.terminated)
        self.truncated = np.from_dlpack(engine.truncated)
        self.actions = np.from_dlpack(engine.actions)  # written by the client
        self.reset_mask = np.from_dlpack(engine.reset_mask)
        self.g = g
        self.th = np.zeros(n)
        self.thdot = np.zeros(n)
        self.t = np.zeros(n, dtype=np.int64)
        self.rngs = [np.random.default_rng(seed + i) for i in range(n)]
        self.reset_envs(range(n))

    def reset_envs(self, ids, seeds: Optional[List[int]] = None) -> None:
        for k, i in enumerate(ids):
            if seeds:
                self.rngs[i] = np.random.default_rng(seeds[k] if len(seeds) > 1 else seeds[0] + k)
            self.th[i] = self.rngs[i].uniform(-np.pi, np.pi)
            self.thdot[i] = self.rngs[i].uniform(-1.0, 1.0)
            self.t[i] = 0
        self.obs[:] = observe(self.th, self.thdot)

    def step(self) -> None:
        if self.reset_mask.any():
            self.reset_envs(np.flatnonzero(self.reset_mask))
        self.th, self.thdot, reward = pendulum_step(self.th, self.thdot, self.actions[:, 0], self.g)
        self.t += 1
        done = self.t >= MAX_STEPS
        self.rewards[:] = reward
        self.terminated[:] = False
        self.truncated[:] = done
        if done.any():  # same-step autoreset, like the reference engines
            self.reset_envs(np.flatnonzero(done))
        self.obs[:] = observe(self.th, self.thdot)

    # -- command handler ------------------------------------------------------------
    def reset(self, env_ids: Optional[List[int]], seeds: List[int], options: Dict[str, str]) -> None:
        ids = list(range(len(self.th))) if env_ids is None else env_ids
        if any(not 0 <= i < len(self.th) for i in ids):
            raise ValueError(f"env ids must be in [0, {len(self.th)})")
        self.reset_envs(ids, seeds)

    def call(self, method: str, args: Dict[str, str], payload: bytes):
        if method == "set_gravity":
            previous, self.g = self.g, float(args["g"])
            return {"previous": previous}
        return NotImplemented  # the client gets "unknown method"


def make_spec(num_envs: int) -> shmbridge.EngineSpec:
    return (
        shmbridge.EngineSpec.standard("pendulum", num_envs, obs_dim=3, act_dim=1, act_dtype="float32")
        .metadata("env_id", "Pendulum-v1")
        .metadata("autoreset_mode", "same-step")
        .metadata("observation_low", f"-1,-1,{-MAX_SPEED}")
        .metadata("observation_high", f"1,1,{MAX_SPEED}")
        .metadata("action_space", f"box:{-MAX_TORQUE}:{MAX_TORQUE}")
        .metadata("max_episode_steps", MAX_STEPS)
    )


def serve(num_envs: int, seed: int, idle_timeout: float, keep_serving: bool = False) -> int:
    with shmbridge.Engine(make_spec(num_envs)) as engine:
        sim = Pendulum(engine, seed)
        engine.publish()  # frame 0: the reset observations
        print(engine.name, flush=True)
        while True:
            try:
                engine.wait_actions(timeout=idle_timeout, handler=sim)
            except (shmbridge.ClientClosedError, shmbridge.ClientDiedError) as e:
                print(f"pendulum engine: {e}; served {engine.frame} steps", file=sys.stderr)
                if not keep_serving:
                    return 0
                # Sleeps until the next learner attaches (no polling), then serves it.
                try:
                    engine.wait_for_client(timeout=idle_timeout)
                except shmbridge.TimeoutError:
                    return 0
                continue
            sim.step()
            engine.publish()


def demo(num_envs: int, steps: int) -> int:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--num-envs", str(num_envs)], stdout=subprocess.PIPE, text=True
    )
    try:
        name = proc.stdout.readline().strip()
        with shmbridge.attach(name) as client:
            rng = np.random.default_rng(0)
            total = 0.0
            for _ in range(steps):
                _, rewards, _, _ = client.step(rng.uniform(-2, 2, (num_envs, 1)).astype(np.float32))
                total += float(np.asarray(rewards).mean())
            print(f"{steps} steps of {num_envs} pendulums; mean reward per step {total / steps:.3f}")
    finally:
        proc.wait(10)
    return proc.returncode


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-envs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-timeout", type=float, default=60.0, help="seconds without an action before giving up")
    p.add_argument("--keep-serving", action="store_true",
                   help="serve one client after another (until --idle-timeout passes without one)")
    p.add_argument("--demo", action="store_true", help="also run a random-policy client")
    p.add_argument("--steps", type=int, default=1000, help="--demo: steps to run")
    a = p.parse_args(argv)
    if a.demo:
        return demo(a.num_envs, a.steps)
    return serve(a.num_envs, a.seed, a.idle_timeout, a.keep_serving)


if __name__ == "__main__":
    sys.exit(main())
