"""Off-policy RL through a trajectory stream: actor processes step their own Gymnasium
env and push each transition into shared memory; the learner drains the stream into a
replay buffer and samples minibatches from it for a (linear, TD(0)) Q-learning update.

    python examples/stream_replay.py                          # CartPole-v1, 4 actors
    python examples/stream_replay.py --env Acrobot-v1 --actors 8 --transitions 50000

A transition is ``obs`` and ``next_obs`` (float32, the env's observation size), ``action``
(int64), ``reward`` (float32), ``terminated`` and ``truncated`` (bool): fixed-size fields,
declared once from the env's spaces. Actors act epsilon-greedily on the weights the
learner last published (a small shared array the learner writes and actors read without
a lock: a half-updated one only perturbs their exploration), so the
stream carries experience one way and the policy flows back the other.
"""

from __future__ import annotations

import argparse
import sys
import time
from multiprocessing import shared_memory

import numpy as np

import shmbridge.stream


def schema_of(env_id: str) -> dict:
    import gymnasium as gym

    env = gym.make(env_id)
    obs_dim = int(np.prod(env.observation_space.shape))
    env.close()
    return {"obs": f"float32[{obs_dim}]", "action": "int64", "reward": "float32",
            "next_obs": f"float32[{obs_dim}]", "terminated": "bool", "truncated": "bool"}


def actor(name: str, env_id: str, index: int, count: int, weights_name: str, epsilon: float) -> None:
    """Steps env ``env_id`` ``count`` times, pushing every transition into stream ``name``."""
    import gymnasium as gym

    env = gym.make(env_id)
    rng = np.random.default_rng(index)
    shm = shared_memory.SharedMemory(name=weights_name)
    try:
        n_actions = int(env.action_space.n)
        obs_dim = int(np.prod(env.observation_space.shape))
        weights = np.ndarray((obs_dim + 1, n_actions), np.float32, shm.buf)
        obs, _ = env.reset(seed=index)
        with shmbridge.stream.attach(name, timeout=30) as producer:
            for _ in range(count):
                if rng.random() < epsilon:
                    action = int(rng.integers(n_actions))
                else:
                    action = int(np.argmax(np.append(obs, 1.0) @ weights))
                next_obs, reward, terminated, truncated, _ = env.step(action)
                with producer.reserve(timeout=60) as r:  # fixed-size fields: no lengths
                    r["obs"] = obs
                    r["action"] = action
                    r["reward"] = reward
                    r["next_obs"] = next_obs
                    r["terminated"] = terminated
                    r["truncated"] = truncated
                obs = next_obs
                if terminated or truncated:
                    obs, _ = env.reset()
    finally:
        del weights
        shm.close()
        env.close()


class Replay:
    """A ring buffer of transitions (the learner's own copy: replay re-reads them)."""

    def __init__(self, capacity: int, obs_dim: int):
        self.obs = np.zeros((capacity, obs_dim), np.float32)
        self.next_obs = np.zeros((capacity, obs_dim), np.float32)
        self.action = np.zeros(capacity, np.int64)
        self.reward = np.zeros(capacity, np.float32)
        self.done = np.zeros(capacity, bool)
        self.capacity, self.size, self.at = capacity, 0, 0

    def add(self, batch: "shmbridge.stream.Batch") -> None:
        """Copies a popped batch in (fixed-size fields: ``to_padded`` stacks them)."""
        n = len(batch)
        rows = (self.at + np.arange(n)) % self.capacity
        self.obs[rows] = batch.to_padded("obs")[0]
        self.next_obs[rows] = batch.to_padded("next_obs")[0]
        self.action[rows] = batch.to_padded("action")[0][:, 0]
        self.reward[rows] = batch.to_padded("reward")[0][:, 0]
        self.done[rows] = batch.to_padded("terminated")[0][:, 0]
        self.at = (self.at + n) % self.capacity
        self.size = min(self.capacity, self.size + n)

    def sample(self, rng: np.random.Generator, n: int):
        i = rng.integers(0, self.size, n)
        return self.obs[i], self.action[i], self.reward[i], self.next_obs[i], self.done[i]


def learn(args: argparse.Namespace) -> int:
    import multiprocessing as mp

    schema = schema_of(args.env)
    obs_dim = int(schema["obs"].split("[")[1].rstrip("]"))
    import gymnasium as gym

    n_actions = int(gym.make(args.env).action_space.n)
    per_actor = -(-args.transitions // args.actors)
    total = per_actor * args.actors
    rng = np.random.default_rng(0)
    weights_shm = shared_memory.SharedMemory(create=True, size=(obs_dim + 1) * n_actions * 4)
    try:
        weights = np.ndarray((obs_dim + 1, n_actions), np.float32, weights_shm.buf)
        weights[:] = 0
        replay = Replay(args.replay, obs_dim)
        with shmbridge.stream.create(schema=schema, capacity=1 << 14, lanes=args.actors) as stream:
            ctx = mp.get_context("spawn")
            actors = [ctx.Process(target=actor, args=(stream.name, args.env, k, per_actor, weights_shm.name,
                                                      args.epsilon)) for k in range(args.actors)]
            for a in actors:
                a.start()
            received = updates = 0
            td = float("nan")
            t0 = None  # from the first record (the workers start up before)
            try:
                while received < total:
                    with stream.pop_batch(256, timeout=60) as batch:
                        if not batch:
                            raise RuntimeError(f"no transition for 60 s ({received} of {total} received)")
                        t0 = t0 or time.monotonic()
                        replay.add(batch)
                    received += len(batch)
                    if replay.size >= args.minibatch:
                        # TD(0) on a linear Q: Q(s) = [s, 1] @ W.
                        o, a, r, o2, d = replay.sample(rng, args.minibatch)
                        x, x2 = np.c_[o, np.ones(len(o))], np.c_[o2, np.ones(len(o2))]
                        target = r + args.gamma * (~d) * (x2 @ weights).max(axis=1)
                        err = (x @ weights)[np.arange(len(a)), a] - target
                        grad = np.zeros_like(weights)
                        np.add.at(grad.T, a, err[:, None] * x)
                        weights -= (args.lr / len(a)) * grad  # published in place to the actors
                        td = float(np.abs(err).mean())
                        updates += 1
            finally:
                for a in actors:
                    a.join(60)
                    if a.is_alive():
                        a.kill()
            elapsed = time.monotonic() - t0
            failed = [a.exitcode for a in actors if a.exitcode != 0]
        del weights
    finally:
        weights_shm.close()
        weights_shm.unlink()
    print(f"learned from {received} transitions of {args.actors} actors ({args.env}) in {updates} updates, "
          f"{elapsed:.2f} s: {received / elapsed:,.0f} transitions/s; replay holds {replay.size}; "
          f"last |TD error| {td:.4f}")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="CartPole-v1", help="a Gymnasium env id with a Discrete action space")
    p.add_argument("--actors", type=int, default=4, help="actor processes (default 4)")
    p.add_argument("--transitions", type=int, default=20_000, help="transitions in all (default 20000)")
    p.add_argument("--replay", type=int, default=100_000, help="replay buffer size (default 100000)")
    p.add_argument("--minibatch", type=int, default=64, help="transitions per update (default 64)")
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epsilon", type=float, default=0.2, help="actors' exploration rate (default 0.2)")
    return learn(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
