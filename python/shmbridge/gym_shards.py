"""Any Gymnasium environment behind a sharded shmbridge engine (protocol 1.4).

    import shmbridge
    client = shmbridge.launch_gym("HalfCheetah-v5", num_envs=64, shards=4, seed=0)
    # or, as a Gymnasium vector env:
    import gymnasium as gym
    envs = gym.make_vec("shmbridge/HalfCheetah-v5", num_envs=64, shards=4, seed=0)

``launch_gym`` starts ``shards`` processes (``python -m shmbridge.gym_shards``). Shard 0
creates the region for all ``num_envs`` envs; shard ``k`` joins it and steps envs
``start_k .. end_k`` (contiguous slices, :func:`env_slice`) of the Gymnasium env, made
by ``gymnasium.make(env_id, **env_kwargs)`` or by calling ``env_fn()`` (pickled with
cloudpickle, as Gymnasium's ``AsyncVectorEnv`` sends it). Each writes its rows of the one
region in place: ``torch.from_dlpack(client.obs)`` is one contiguous ``[N, ...]`` tensor.

The region, as :class:`shmbridge.gym.ShmVectorEnv` reads it:

* ``obs`` ``[N, *obs_shape]`` of the observation space's dtype (a ``Box`` space; other
  spaces are refused); ``actions`` ``[N]`` int64 for ``Discrete`` (starting at 0) or
  ``[N, *shape]`` of a ``Box``'s dtype; ``rewards`` float64 ``[N]`` (as ``SyncVectorEnv``);
  ``terminated``/``truncated``/``reset_mask`` bool ``[N]``; ``final_obs`` like ``obs`` in
  same-step mode.
* metadata: ``env_id``, ``autoreset_mode``, ``observation_low``/``high`` and, for a
  ``Box``, ``action_low``/``high`` (up to 4096 elements), ``action_space``,
  ``max_episode_steps`` (from the env's spec).
* **autoreset** ``"next-step"`` (default, Gymnasium's default and ``SyncVectorEnv``'s):
  an env that finished returns its last observation with the flags; the next step resets
  it (reset observation, reward 0, flags clear) and ignores its action. ``"same-step"``:
  the env is reset in the step it finished; ``final_obs`` holds its last observation,
  which ``ShmVectorEnv`` returns in ``infos["final_obs"]`` (with ``final_info`` as ``{}``
  entries: per-env info dicts do not travel).
* **seeding** as ``SyncVectorEnv``: ``reset(seed=s)`` resets env ``i`` with seed ``s + i``
  (the client routes it to the shard owning env ``i``), so the same seeds give the same
  first observations and, for the same actions, the same trajectories. ``seed=`` of
  :func:`launch_gym` seeds frame 0 the same way (``None``: unseeded).
* ``reset_mask[i]`` set: env ``i`` is reset instead of stepped.

A shard that dies makes the next step raise :class:`shmbridge.EngineDiedError` naming the
shard and its envs (``e.shard``, ``e.envs``); the others stop by themselves (each checks its
siblings) and shard 0 removes the region. Closing the client stops every shard.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

# The launcher side lives with the other launchers (it starts this module's shards by
# name); re-exported here, where the region it makes is described.
from ._launch import EnvTarget, default_shards, launch_gym
from ._native import Engine, EngineSpec

__all__ = ["launch_gym", "env_slice", "make_vec", "default_shards"]

#: Bounds of larger spaces are not put into the schema (they would crowd the reply ring).
MAX_BOUNDS = 4096


def env_slice(num_envs: int, shards: int, k: int) -> Tuple[int, int]:
    """``(start, count)`` of shard ``k``'s envs: contiguous, sizes differing by at most
    one (the first ``num_envs % shards`` shards get one more), as the Rust core splits."""
    q, r = divmod(num_envs, shards)
    return k * q + min(k, r), q + (1 if k < r else 0)


def make_vec(
    env_id: EnvTarget,
    num_envs: int = 16,
    shards: Optional[int] = None,
    seed: Optional[int] = None,
    autoreset_mode: Optional[str] = None,
    copy: bool = True,
    render_mode: Optional[str] = None,
    native: bool = False,
    **kwargs: Any,
) -> Any:
    """A :class:`shmbridge.gym.ShmVectorEnv` over :func:`launch_gym` (what
    ``gymnasium.make_vec("shmbridge/<id>", num_envs=N, **kwargs)`` makes: Gymnasium hands
    a vector entry point the keyword arguments of ``make_vec`` (``shards``, ``seed``,
    ``autoreset_mode`` (default ``"next-step"``), ``copy``, ``spin_us``, ``blocking``,
    ``timeout``; the others go to ``gymnasium.make``), not ``vector_kwargs``).

    ``native=True``: over the native MuJoCo engine instead, ``launch("mujoco/<id>")``
    (docs/mujoco.md; a build with the cargo feature ``mujoco``): the task with Gymnasium's
    default arguments (no ``gymnasium.make`` arguments), same-step autoreset, ``threads``
    as well as ``shards``, and ``camera``/``camera_size``/``camera_depth`` (the frames in
    ``envs.client["rgb"]``, the depth images in ``envs.client["depth"]``)."""
    from .gym import ShmVectorEnv

    if render_mode is not None:
        raise ValueError(f"render_mode={render_mode!r}: shmbridge vector envs do not render")
    launch_keys = {"spin_us", "blocking", "timeout"}
    launch = {k: kwargs.pop(k) for k in list(kwargs) if k in launch_keys}
    if native:
        client = _launch_native(env_id, num_envs, shards, seed, autoreset_mode, launch, kwargs)
    else:
        client = launch_gym(
            env_id, num_envs, shards, seed=seed, autoreset_mode=autoreset_mode or "next-step", **launch, **kwargs
        )
    return ShmVectorEnv(client=client, close_client=True, seed=seed, copy=copy)


def _launch_native(
    env_id: EnvTarget, num_envs: int, shards: Optional[int], seed: Optional[int],
    autoreset_mode: Optional[str], launch_args: Dict[str, Any], kwargs: Dict[str, Any],
) -> Any:
    """``make_vec(..., native=True)``'s client: ``launch("mujoco/<env_id>")``, or
    ``TypeError``/``ValueError`` for what the native engine does not take."""
    from ._launch import launch

    if not isinstance(env_id, str):
        raise TypeError(f"native=True needs a Gymnasium id such as 'HalfCheetah-v5', not {type(env_id).__name__}")
    if autoreset_mode not in (None, "same-step"):
        raise ValueError(
            f"native=True: the native MuJoCo engine resets an env in the step it ends "
            f"(autoreset_mode='same-step'), not {autoreset_mode!r}"
        )
    native_args = {k: kwargs.pop(k) for k in ("threads", "camera", "camera_size", "camera_depth") if k in kwargs}
    if kwargs:
        raise TypeError(
            f"native=True takes no arguments of gymnasium.make ({sorted(kwargs)}): the native "
            f"engine runs {env_id} with Gymnasium's defaults"
        )
    engine_args: Dict[str, Any] = {k: v for k, v in (("seed", seed), *native_args.items()) if v is not None}
    return launch(f"mujoco/{env_id}", num_envs, shards=shards or 1, **launch_args, **engine_args)


# ---- the shard process ---------------------------------------------------------------


def _make(target: EnvTarget, kwargs: Dict[str, Any]) -> Any:
    if isinstance(target, str):
        import gymnasium

        return gymnasium.make(target, **kwargs)
    return target(**kwargs)


def _bounds(values: np.ndarray) -> str:
    return ",".join(repr(float(v)) for v in np.asarray(values, dtype=np.float64).ravel())


def _spec(name: str, num_envs: int, shards: int, env: Any, env_id: str, autoreset: str) -> EngineSpec:
    """The region of ``num_envs`` envs like ``env``: tensors and metadata from its spaces."""
    from gymnasium import spaces

    obs_space, act_space = env.observation_space, env.action_space
    if not isinstance(obs_space, spaces.Box):
        raise TypeError(f"{env_id}: observation space {obs_space} is not a Box (not served yet)")
    n = num_envs
    obs_shape = tuple(obs_space.shape)
    spec = EngineSpec("gymnasium", n, name=name).tensor("obs", obs_space.dtype, (n, *obs_shape))
    if isinstance(act_space, spaces.Discrete):
        if int(act_space.start) != 0:
            raise TypeError(f"{env_id}: Discrete action space starting at {act_space.start} (not served yet)")
        spec.tensor("actions", "int64", (n,), "client->engine")
        spec.metadata("action_space", f"discrete:{int(act_space.n)}")
    elif isinstance(act_space, spaces.Box):
        spec.tensor("actions", act_space.dtype, (n, *act_space.shape), "client->engine")
        spec.metadata("action_space", "box")
        if act_space.low.size <= MAX_BOUNDS:
            spec.metadata("action_low", _bounds(act_space.low))
            spec.metadata("action_high", _bounds(act_space.high))
    else:
        raise TypeError(f"{env_id}: action space {act_space} is neither Discrete nor Box (not served yet)")
    spec.tensor("rewards", "float64", (n,))
    spec.tensor("terminated", "bool", (n,))
    spec.tensor("truncated", "bool", (n,))
    spec.tensor("reset_mask", "bool", (n,), "client->engine")
    if autoreset == "same-step":
        spec.tensor("final_obs", obs_space.dtype, (n, *obs_shape))
        spec.metadata("final_obs", "final_obs")
    spec.metadata("env_id", env_id)
    spec.metadata("autoreset_mode", autoreset)
    if obs_space.low.size <= MAX_BOUNDS:
        spec.metadata("observation_low", _bounds(obs_space.low))
        spec.metadata("observation_high", _bounds(obs_space.high))
    limit = getattr(getattr(env, "spec", None), "max_episode_steps", None)
    if limit is not None:
        spec.metadata("max_episode_steps", str(int(limit)))
    return spec.shards(shards)


class _Shard:
    """Steps this shard's envs into its slice of the region's tensors."""

    def __init__(self, engine: Engine, envs: List[Any], autoreset: str) -> None:
        self.engine = engine
        self.envs = envs
        self.same_step = autoreset == "same-step"
        view = lambda name: np.from_dlpack(engine[name])  # noqa: E731 - zero-copy views
        self.obs, self.actions = view("obs"), view("actions")
        self.rewards, self.terminated, self.truncated = view("rewards"), view("terminated"), view("truncated")
        self.reset_mask = view("reset_mask")
        self.final_obs = view("final_obs") if self.same_step else None
        self.discrete = self.actions.ndim == 1
        self.pending = [False] * len(envs)
        # Each env's episode so far, recorded in the region's stats area when it ends
        # (what observers, `shmbridge view`, plot).
        self.returns = [0.0] * len(envs)
        self.lengths = [0] * len(envs)

    def reset_envs(self, ids: List[int], seeds: List[Optional[int]]) -> None:
        for j, s in zip(ids, seeds):
            o, _ = self.envs[j].reset(seed=s)
            self.obs[j] = o
            self.pending[j] = False
            self.returns[j], self.lengths[j] = 0.0, 0

    # The engine's command handler: Reset with local env ids and seeds (protocol §3.7).
    def reset(self, env_ids: Optional[List[int]], seeds: List[int], options: Dict[str, str]) -> None:
        ids = list(range(len(self.envs))) if env_ids is None else list(env_ids)
        if any(not 0 <= j < len(self.envs) for j in ids):
            raise ValueError(f"env ids {ids} outside this shard's {len(self.envs)} envs")
        if not seeds:
            per: List[Optional[int]] = [None] * len(ids)
        elif len(seeds) == 1:
            per = [seeds[0] + k for k in range(len(ids))]
        elif len(seeds) == len(ids):
            per = list(seeds)
        else:
            raise ValueError(f"{len(seeds)} seeds for {len(ids)} envs")
        self.reset_envs(ids, per)

    def step(self) -> None:
        # Per-env work is the env's own step; the shared tensors are read once and
        # written once per step (NumPy element access costs a microsecond per env).
        actions = self.actions.tolist() if self.discrete else list(self.actions.copy())
        mask = self.reset_mask.tolist()
        obs, rewards, term, trunc = [], [0.0] * len(self.envs), [False] * len(self.envs), [False] * len(self.envs)
        finals = [] if self.final_obs is not None else None
        for j, env in enumerate(self.envs):
            if mask[j] or self.pending[j]:
                o, _ = env.reset()
                self.pending[j] = False
                self.returns[j], self.lengths[j] = 0.0, 0
            else:
                o, r, te, tr, _ = env.step(actions[j])
                rewards[j], term[j], trunc[j] = r, te, tr
                self.returns[j] += float(r)
                self.lengths[j] += 1
                if te or tr:
                    self.engine.record_episode(j, self.returns[j], self.lengths[j])
                    self.returns[j], self.lengths[j] = 0.0, 0
                if self.same_step and (te or tr):
                    finals.append(o)
                    o, _ = env.reset()
                else:
                    self.pending[j] = bool(te or tr)
                    if finals is not None:
                        finals.append(o)
            if finals is not None and len(finals) <= j:
                finals.append(o)  # a reset env: its final observation is the new one
            obs.append(o)
        self.obs[...] = obs
        self.rewards[...] = rewards
        self.terminated[...] = term
        self.truncated[...] = trunc
        if finals is not None:
            self.final_obs[...] = finals


def _serve(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m shmbridge.gym_shards")
    p.add_argument("--name", required=True)
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--shards", type=int, required=True)
    p.add_argument("--num-envs", type=int, required=True)
    p.add_argument("--seed", type=int)
    p.add_argument("--autoreset", default="next-step")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--spin-us", type=float)
    p.add_argument("--blocking", action="store_true")
    a = p.parse_args(argv)
    import cloudpickle

    target, env_kwargs = cloudpickle.loads(sys.stdin.buffer.read())
    env_id = target if isinstance(target, str) else getattr(target, "__name__", "factory")
    start, count = env_slice(a.num_envs, a.shards, a.shard)
    envs = [_make(target, env_kwargs) for _ in range(count)]
    wait = {"spin_us": a.spin_us, "blocking": a.blocking}
    if a.shard == 0:
        engine = Engine(_spec(a.name, a.num_envs, a.shards, envs[0], env_id, a.autoreset), **wait)
    else:
        engine = Engine.join(a.name, a.shard, timeout=a.timeout, **wait)
    try:
        if engine.shard_envs != (start, start + count):
            raise RuntimeError(f"shard {a.shard} serves envs {engine.shard_envs}, built {start}..{start + count}")
        shard = _Shard(engine, envs, a.autoreset)
        seeds = [None if a.seed is None else a.seed + start + j for j in range(count)]
        shard.reset_envs(list(range(count)), seeds)
        engine.publish()
        print(engine.name, flush=True)
        from .errors import ClientClosedError, TimeoutError as WaitTimeout

        # A launcher that dies before its client attached leaves no client to watch:
        # between slices, a shard whose parent is gone (it was reparented) exits.
        parent = os.getppid()
        while True:
            try:
                engine.wait_actions(0.5, shard)
            except ClientClosedError:
                return 0
            except WaitTimeout:
                if os.getppid() != parent and not engine.client_attached:
                    print("shmbridge.gym_shards: the launcher exited before attaching", file=sys.stderr)
                    return 1
                continue
            shard.step()
            engine.publish()
    finally:
        engine.close()
        for env in envs:
            env.close()


if __name__ == "__main__":
    import signal

    # SIGTERM (the launcher stopping us) unwinds like an exit, so the engine closes and
    # shard 0 removes the region.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        sys.exit(_serve(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - one clear line for the launcher's error
        print(f"shmbridge.gym_shards: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
