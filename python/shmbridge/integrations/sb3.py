"""Stable-Baselines3 on a shmbridge engine: ``SB3VecEnv``, a
``stable_baselines3.common.vec_env.VecEnv``.

    from stable_baselines3 import PPO
    from shmbridge.integrations.sb3 import SB3VecEnv

    env = SB3VecEnv("cartpole", num_envs=8, seed=0)       # or SB3VecEnv(client=...)
    PPO("MlpPolicy", env).learn(50_000)

This module imports without Stable-Baselines3; ``SB3VecEnv`` needs it (``pip install
'shmbridge[sb3]'``: an ``ImportError`` says so otherwise).

It is :class:`shmbridge.gym.ShmVectorEnv` underneath (same arguments, spaces from the
engine's schema, seeding and action checks), with SB3's conventions on top:

* ``step_wait`` returns ``(obs, rewards, dones, infos)``: fresh arrays (SB3 keeps the
  previous observations across a step, so views of the shared memory would not do),
  ``dones = terminated | truncated``, and ``infos`` a list of one dict per env.
* **Autoreset** as SB3 expects: a finished env's observation is already its next
  episode's first, and ``infos[i]["terminal_observation"]`` holds its last one;
  ``infos[i]["TimeLimit.truncated"]`` (truncated and not terminated: in every env's infos
  every step, as SB3's own vector envs set it) tells SB3's algorithms to bootstrap from
  it. An engine that resets in the same step (``cartpole``) gives
  the last observations in its ``final_obs`` tensor; under next-step autoreset
  (``launch_gym``'s default) or none, the finished envs are reset here, in the same
  ``step_wait``, with one ``reset`` of just those envs. An engine that resets in the same
  step without ``final_obs`` gives no ``terminal_observation`` (warned once).
* ``reset()`` returns the observations only, using the seeds of ``seed(s)`` (env ``i``
  gets ``s + i``) once, as SB3's own vector envs do; ``reset_infos`` are ``{}``. The
  constructor's ``seed`` serves the first ``reset()`` without one.
* ``env_method(name, **kwargs)`` calls the engine-defined method ``name`` through the
  command channel (``client.call``; ``cartpole`` has ``set_pole_length(length=...)``):
  keyword arguments only (sent as strings), and since an engine method acts on all the
  envs an engine process serves, ``indices`` must cover whole shards (all envs for an
  unsharded engine); the list holds, per index, its shard's reply.
  ``get_attr(name)``: ``render_mode``, ``observation_space``/``action_space`` (one env's),
  ``max_episode_steps``, ``autoreset_mode``, or any key of the engine's metadata (a
  string); anything else raises ``AttributeError``. ``set_attr`` is refused (engines have
  no attributes to set: use an engine method). ``env_is_wrapped`` is ``False`` throughout.
* ``render_mode="rgb_array"`` needs an engine that serves an ``rgb`` tensor (``uint8``,
  ``[num_envs, H, W, C]``, or ``[num_envs, frames, H, W, C]``: the last frame is shown);
  ``render()`` then tiles the envs' frames, ``get_images()`` gives each env's.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

from . import lazy_class, require

__all__ = ["SB3VecEnv"]

EXTRA = "sb3"


def _make_class() -> type:
    vec_env = require("stable_baselines3.common.vec_env", EXTRA, "shmbridge.integrations.sb3.SB3VecEnv")
    import numpy as np
    from gymnasium.vector import AutoresetMode

    from ..gym import ShmVectorEnv

    class SB3VecEnv(vec_env.VecEnv):
        """A Stable-Baselines3 ``VecEnv`` whose environments run in a shmbridge engine
        (see the module's docstring).

        Args:
            env: the reference engine to launch (``"cartpole"``, ...); ignored with ``client``.
            num_envs: number of environments to launch (default 256, ``launch``'s); with
                ``client``, ``None`` or the client's.
            client: a :class:`shmbridge.Client` to use instead of launching (``launch_gym``
                shards, ``attach(name)``).
            seed: used by the first ``reset()`` without seeds (and to start a launched
                engine).
            render_mode: ``None`` or ``"rgb_array"`` (the engine's ``rgb`` tensor).
            close_client, timeout, max_episode_steps, **launch_args: as
                :class:`shmbridge.gym.ShmVectorEnv`'s.
        """

        def __init__(
            self,
            env: str = "cartpole",
            num_envs: Optional[int] = None,
            *,
            client: Any = None,
            seed: Optional[int] = None,
            render_mode: Optional[str] = None,
            close_client: Optional[bool] = None,
            timeout: Optional[float] = None,
            max_episode_steps: Optional[int] = None,
            **launch_args: Any,
        ) -> None:
            if render_mode not in (None, "rgb_array"):
                raise ValueError(f"render_mode={render_mode!r}: None or 'rgb_array'")
            self._vec = vec = ShmVectorEnv(
                env,
                num_envs,
                client=client,
                seed=seed,
                copy=True,
                close_client=close_client,
                timeout=timeout,
                max_episode_steps=max_episode_steps,
                **launch_args,
            )
            try:
                self._setup(vec, render_mode)
            except BaseException:
                vec.close()
                raise
            super().__init__(vec.num_envs, vec.single_observation_space, vec.single_action_space)

        def _setup(self, vec: ShmVectorEnv, render_mode: Optional[str]) -> None:
            self._render_mode = render_mode
            self._rgb = None
            if render_mode is not None:
                if "rgb" not in vec.client:
                    raise ValueError(
                        f"render_mode='rgb_array' but engine {vec.client.engine_kind!r} serves no 'rgb' tensor"
                    )
                rgb = vec.client["rgb"]
                if rgb.dtype != "uint8" or rgb.ndim not in (4, 5):
                    raise ValueError(
                        f"the engine's 'rgb' tensor is {rgb.dtype} {rgb.shape}: expected uint8 "
                        "[num_envs, H, W, C] or [num_envs, frames, H, W, C]"
                    )
                self._rgb = rgb
            mode = vec.metadata["autoreset_mode"]
            # Where the finished episodes' last observations come from.
            self._same_step = mode is AutoresetMode.SAME_STEP
            if self._same_step and vec._final_view is None:
                warnings.warn(
                    f"engine {vec.client.engine_kind!r} resets envs in the step they finish but serves "
                    "no final observations: infos carry no 'terminal_observation'",
                    stacklevel=3,
                )
            self._attrs: Dict[str, Any] = {
                "render_mode": render_mode,
                "observation_space": vec.single_observation_space,
                "action_space": vec.single_action_space,
                "max_episode_steps": vec.max_episode_steps,
                "autoreset_mode": mode,
            }
            self._actions: Any = None

        @property
        def client(self) -> Any:
            """The shmbridge client (its tensors, ``call``, ``ping``, ...)."""
            return self._vec.client

        @property
        def schema(self) -> Dict[str, Any]:
            return self._vec.schema

        # --- reset and step --------------------------------------------------------------

        def reset(self) -> Any:
            seeds = None if all(s is None for s in self._seeds) else list(self._seeds)
            if any(self._options):
                raise ValueError(f"unsupported reset options {self._options}: the engines take none")
            obs, _ = self._vec.reset(seed=seeds)
            self._reset_seeds()
            self._reset_options()
            self.reset_infos = [{} for _ in range(self.num_envs)]
            self._actions = None
            return obs

        def step_async(self, actions: Any) -> None:
            self._actions = actions

        def step_wait(self) -> Any:
            actions, self._actions = self._actions, None
            if actions is None:
                raise RuntimeError("step_wait() without step_async()")
            vec = self._vec
            obs, rewards, terminated, truncated, vinfos = vec.step(actions)
            dones = terminated | truncated
            # As SB3's own vector envs: the flag in every env's infos, every step.
            infos: List[Dict[str, Any]] = [
                {"TimeLimit.truncated": cut} for cut in (truncated & ~terminated).tolist()
            ]
            ids = np.flatnonzero(dones)
            if ids.size:
                if self._same_step:
                    finals = vinfos.get("final_obs")
                else:
                    # The engine has not reset them (next-step or no autoreset): do it now,
                    # and keep what it returned as their last observations.
                    finals = obs
                    obs, _ = vec.reset(options={"reset_mask": dones})
                if finals is not None:
                    for i in ids:
                        infos[i]["terminal_observation"] = np.array(finals[i])
            return obs, rewards, dones, infos

        def close(self) -> None:
            self._vec.close()

        # --- attributes and methods ------------------------------------------------------

        def get_attr(self, attr_name: str, indices: Any = None) -> List[Any]:
            n = len(list(self._get_indices(indices)))
            if attr_name in self._attrs:
                return [self._attrs[attr_name]] * n
            meta = self._vec.schema.get("metadata", {})
            if attr_name in meta:
                return [meta[attr_name]] * n
            raise AttributeError(
                f"the envs of engine {self.client.engine_kind!r} have no attribute {attr_name!r} "
                f"(they have {sorted(self._attrs)} and the engine's metadata {sorted(meta)})"
            )

        def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
            raise AttributeError(
                f"cannot set {attr_name!r}: the envs of a shmbridge engine have no attributes to set; "
                "call an engine-defined method with env_method instead"
            )

        def env_method(self, method_name: str, *method_args: Any, indices: Any = None, **method_kwargs: Any) -> List[Any]:
            if method_args:
                raise TypeError(
                    f"env_method({method_name!r}): engine methods take keyword arguments only "
                    "(sent as strings through the command channel)"
                )
            wanted = [int(i) for i in self._get_indices(indices)]
            for i in wanted:
                if not 0 <= i < self.num_envs:
                    raise IndexError(f"env index {i} outside 0..{self.num_envs}")
            shards = self.client.shards
            replies: Dict[int, Any] = {}
            chosen = set(wanted)
            for k, (start, end) in enumerate(shards):
                envs = set(range(start, end))
                if not envs & chosen:
                    continue
                if not envs <= chosen:
                    raise ValueError(
                        f"env_method({method_name!r}, indices={indices!r}): an engine method acts on every "
                        f"env of an engine process, and envs {start}..{end} share one; "
                        "give indices that cover whole shards (None: all envs)"
                    )
                shard = k if len(shards) > 1 else None
                replies[k] = self.client.call(method_name, shard=shard, **method_kwargs)
            owner = {i: k for k, (start, end) in enumerate(shards) for i in range(start, end)}
            return [replies[owner[i]] for i in wanted]

        def env_is_wrapped(self, wrapper_class: type, indices: Any = None) -> List[bool]:
            return [False] * len(list(self._get_indices(indices)))

        # --- rendering -------------------------------------------------------------------

        def get_images(self) -> List[Any]:
            """Each env's current frame (a copy of the ``rgb`` tensor's row; the last frame
            of a stack), or ``[None] * num_envs`` without ``render_mode="rgb_array"``."""
            if self._rgb is None:
                return [None] * self.num_envs
            frames = np.asarray(self._rgb)
            if frames.ndim == 5:
                frames = frames[:, -1]
            return [np.array(f) for f in frames]

        def __repr__(self) -> str:
            return f"SB3VecEnv({self._vec!r})"

    return SB3VecEnv


__getattr__ = lazy_class(__name__, "SB3VecEnv", _make_class)
