"""``python -m shmbridge.bench learners``: each learning library's own parallel env against
the same library on shmbridge, env-steps/s inside the library's own collection loop, side
by side in one run.

Workloads: Gymnasium's ``CartPole-v1`` and ``HalfCheetah-v5`` at ``--envs`` (default 16
and 64) environments. Per library, two contenders, each collecting through the library's
own loop:

* **sb3**: PPO's ``collect_rollouts`` (its ``MlpPolicy`` acting, the rollout buffer
  filled: what ``learn`` does between updates) on SB3's ``SubprocVecEnv`` (one process per
  env, started with ``fork``: ``forkserver``'s workers would each import torch) against
  ``SB3VecEnv`` over ``launch_gym`` shards;
* **torchrl**: a ``Collector`` with a random policy (``frames_per_batch`` = one block) on
  ``GymEnv(env_id, num_envs=N)`` (TorchRL over Gymnasium's ``AsyncVectorEnv``, one process
  per env) against ``TorchRLEnv`` over the shards;
* **skrl**: the wrapper's ``step(actions)`` with random actions, as skrl's trainers call it,
  on ``wrap_env(gymnasium.vector.AsyncVectorEnv(...))`` against ``SkrlEnv`` over the shards.

shmbridge runs the envs in ``--shards`` (default 2) shard processes. Both contenders of a
case are started first, then ``--rounds`` (default 3) rounds alternate them (the order
swapped every round), each timing one block of ``--steps`` vector steps (default 64
CartPole, 16 HalfCheetah); the table gives the median over the rounds of each block's
env-steps/s and their ratio. Writes DIR/learners.md and DIR/learners.json with ``--out``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List

import numpy as np

from .report import fmt_rate, log, machine_description, machine_header, markdown_table, publish

LIBRARIES = ("sb3", "torchrl", "skrl")


class Contender:
    """One parallel env and its library's loop: ``block(steps)`` runs ``steps`` vector
    steps of it and returns the seconds they took."""

    def __init__(self, label: str, num_envs: int, start: Callable[[], Any], run: Callable[[Any, int], None],
                 close: Callable[[Any], None]) -> None:
        self.label, self.num_envs = label, num_envs
        self._run, self._close = run, close
        self.state = start()
        self.rates: List[float] = []

    def block(self, steps: int) -> float:
        t0 = time.perf_counter()
        self._run(self.state, steps)
        seconds = time.perf_counter() - t0
        self.rates.append(steps * self.num_envs / seconds)
        return seconds

    def close(self) -> None:
        self._close(self.state)


def _sb3(env_id: str, n: int, shards: int) -> List[Contender]:
    import gymnasium
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import SubprocVecEnv

    import shmbridge
    from shmbridge.integrations.sb3 import SB3VecEnv

    def start(make_env: Callable[[], Any]) -> Callable[[], Any]:
        def go() -> Any:
            env = make_env()
            model = PPO("MlpPolicy", env, n_steps=8, device="cpu", seed=0)
            _, callback = model._setup_learn(total_timesteps=1 << 40)  # resets the env, as learn does
            return model, callback

        return go

    def run(state: Any, steps: int) -> None:
        from stable_baselines3.common.buffers import RolloutBuffer

        model, callback = state
        buffer = RolloutBuffer(steps, model.observation_space, model.action_space, device="cpu",
                               gamma=model.gamma, gae_lambda=model.gae_lambda, n_envs=model.n_envs)
        model.collect_rollouts(model.env, callback, buffer, n_rollout_steps=steps)

    def own() -> Any:
        return SubprocVecEnv([lambda: gymnasium.make(env_id) for _ in range(n)], start_method="fork")

    def ours() -> Any:
        return SB3VecEnv(client=shmbridge.launch_gym(env_id, n, shards, seed=0), close_client=True)

    return [Contender("SubprocVecEnv", n, start(own), run, lambda s: s[0].env.close()),
            Contender(f"shmbridge K={shards}", n, start(ours), run, lambda s: s[0].env.close())]


def _torchrl(env_id: str, n: int, shards: int) -> List[Contender]:
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv

    import shmbridge
    from shmbridge.integrations.torchrl import TorchRLEnv

    def start(make_env: Callable[[], Any]) -> Callable[[], Any]:
        def go() -> Any:
            env = make_env()
            env.set_seed(0)
            return {"env": env, "steps": None, "it": None}

        return go

    def run(state: Dict[str, Any], steps: int) -> None:
        if state["steps"] != steps:  # one collector per block size (its batch)
            if state["it"] is not None:
                state["collector"].shutdown(close_env=False)
            state["collector"] = Collector(state["env"], None, frames_per_batch=steps * n, total_frames=-1)
            state["it"], state["steps"] = iter(state["collector"]), steps
        next(state["it"])

    def close(state: Dict[str, Any]) -> None:
        if state["it"] is not None:
            state["collector"].shutdown(close_env=False)
        state["env"].close()

    def own() -> Any:
        return GymEnv(env_id, num_envs=n)

    def ours() -> Any:
        return TorchRLEnv(client=shmbridge.launch_gym(env_id, n, shards, seed=0), close_client=True)

    return [Contender("GymEnv(num_envs)", n, start(own), run, close),
            Contender(f"shmbridge K={shards}", n, start(ours), run, close)]


def _skrl(env_id: str, n: int, shards: int) -> List[Contender]:
    import gymnasium
    import torch
    from skrl.envs.wrappers.torch import wrap_env

    import shmbridge
    from shmbridge.integrations.skrl import SkrlEnv

    def start(make_env: Callable[[], Any]) -> Callable[[], Any]:
        def go() -> Any:
            env = make_env()
            env.reset()
            space = env.action_space
            space.seed(0)
            bank = [torch.as_tensor(np.stack([space.sample() for _ in range(n)])).reshape(n, -1) for _ in range(16)]
            return env, bank

        return go

    def run(state: Any, steps: int) -> None:
        env, bank = state
        for k in range(steps):
            env.step(bank[k % len(bank)])

    def own() -> Any:
        return wrap_env(gymnasium.vector.AsyncVectorEnv([lambda: gymnasium.make(env_id) for _ in range(n)]),
                        wrapper="gymnasium")

    def ours() -> Any:
        return SkrlEnv(client=shmbridge.launch_gym(env_id, n, shards, seed=0), close_client=True)

    return [Contender("wrap_env(AsyncVectorEnv)", n, start(own), run, lambda s: s[0].close()),
            Contender(f"shmbridge K={shards}", n, start(ours), run, lambda s: s[0].close())]


MAKERS = {"sb3": _sb3, "torchrl": _torchrl, "skrl": _skrl}


def main(args: Any) -> int:
    quick = args.quick
    envs_list = [int(x) for x in (args.envs or ("4" if quick else "16,64")).split(",")]
    workloads = [w for w in (args.workloads or "CartPole-v1,HalfCheetah-v5").split(",") if w]
    libraries = [x for x in (args.libraries or ",".join(LIBRARIES)).split(",") if x]
    unknown = sorted(set(libraries) - set(LIBRARIES))
    if unknown:
        log(f"bench learners: unknown libraries {unknown}; pick from {', '.join(LIBRARIES)}")
        return 2
    rounds = args.rounds or (2 if quick else 3)
    shards = args.shards
    machine = machine_description()
    rows: List[Dict[str, Any]] = []
    for library in libraries:
        for env_id in workloads:
            for n in envs_list:
                steps = args.steps or (4 if quick else (64 if env_id == "CartPole-v1" else 16))
                print(f"learners: {library} {env_id} N={n}: starting", flush=True)
                contenders: List[Contender] = []
                try:
                    contenders = MAKERS[library](env_id, n, shards)
                    for c in contenders:  # warm-up, not kept
                        c.block(max(1, steps // 4))
                        c.rates.clear()
                    for r in range(rounds):
                        for c in (contenders if r % 2 == 0 else contenders[::-1]):
                            c.block(steps)
                finally:
                    for c in contenders:
                        c.close()
                own, ours = contenders
                row = dict(library=library, env_id=env_id, num_envs=n, steps=steps, own=own.label,
                           ours=ours.label, own_rates=own.rates, ours_rates=ours.rates,
                           own_median=float(np.median(own.rates)), ours_median=float(np.median(ours.rates)))
                row["ratio"] = row["ours_median"] / row["own_median"]
                rows.append(row)
                print(f"  {own.label} {fmt_rate(row['own_median'])}/s, {ours.label} "
                      f"{fmt_rate(row['ours_median'])}/s: {row['ratio']:.2f}x", flush=True)

    header = ["library", "workload", "N", "library's own parallel env", "env-steps/s",
              "on shmbridge", "env-steps/s", "shmbridge ÷ own"]
    body = [[r["library"], r["env_id"], str(r["num_envs"]), r["own"], fmt_rate(r["own_median"]),
             r["ours"], fmt_rate(r["ours_median"]), f"{r['ratio']:.2f}×"] for r in rows]
    load_end = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = ["# shmbridge in the learning libraries' collection loops", "",
             f"Command: `{args.command_line}`", ""]
    lines += machine_header(machine, [f"- Load average at the end: {load_end}"])
    lines += ["", f"Median over {rounds} alternated rounds of each block's env-steps/s "
                  "(a block: one collection of `steps` vector steps).", "",
              markdown_table(header, body, "llrlrlrr"), ""]
    publish("learners", "\n".join(lines) + "\n", args.out,
            dict(machine=machine, load_average_end=os.getloadavg(), rounds=rounds, shards=shards, rows=rows))
    return 0
