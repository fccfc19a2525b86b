"""skrl on a shmbridge engine: ``SkrlEnv``, a ``skrl.envs.wrappers.torch.Wrapper`` (what
``skrl.envs.wrappers.torch.wrap_env`` returns for the environments it knows), which skrl's
agents and trainers take.

    from skrl.trainers.torch import SequentialTrainer
    from shmbridge.integrations.skrl import SkrlEnv

    env = SkrlEnv("cartpole", num_envs=16, seed=0)       # or SkrlEnv(client=...)
    SequentialTrainer(env=env, agents=agent, cfg={"timesteps": 10_000}).train()

This module imports without skrl; ``SkrlEnv`` needs it (``pip install 'shmbridge[skrl]'``:
an ``ImportError`` says so otherwise).

* ``observation_space``/``action_space`` are one env's (as skrl's wrappers of vectorized
  environments give them), from the engine's schema; ``state_space`` is ``None`` and
  ``state()`` returns ``None``; ``num_envs``, ``num_agents`` (1), ``device`` (the
  engine's: ``cpu``, or ``cuda:N`` for an engine that exports CUDA memory).
* ``step(actions)`` writes the actions straight into the region's action tensor (clipped
  to the engine's finite bounds for a ``Box``, as skrl's Isaac Lab wrapper leaves to the
  environment) and returns ``(obs, rewards, terminated, truncated, infos)``: rewards and
  flags ``[N, 1]`` views of the region (skrl records them before the next step), the
  observations one copy (skrl's trainers hold the previous and the next observations at
  once, which one view cannot be; ``copy=False`` returns the region's tensor for loops
  that use each step before the next). ``SkrlEnv.shared`` holds the region's tensors
  themselves (their ``data_ptr()`` is the client's tensors' address).
* **Autoreset** as skrl expects of vectorized environments (its trainers never reset
  them after the first ``reset()``): a finished env's observation is its next episode's
  first. Engines that reset in the same step do it themselves; under next-step autoreset
  (``launch_gym``'s default) or none the finished envs are reset here, in the same
  ``step``. ``reset()`` resets all envs (the constructor's ``seed`` seeds the first,
  env ``i`` with ``seed + i``) the first time, and afterwards returns the current
  observations, as skrl's wrappers of vectorized environments do.
* ``render()`` does nothing (the engines render nothing for skrl); ``close()`` closes the
  env (and the client if it owns it: see :class:`shmbridge.gym.ShmVectorEnv`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from . import lazy_class, require

__all__ = ["SkrlEnv"]

EXTRA = "skrl"


def _make_class() -> type:
    wrappers = require("skrl.envs.wrappers.torch", EXTRA, "shmbridge.integrations.skrl.SkrlEnv")

    from ..gym import ShmVectorEnv
    from ._torch import TorchFrames

    class SkrlEnv(wrappers.Wrapper):
        """An skrl environment wrapper whose environments run in a shmbridge engine (see
        the module's docstring).

        Args:
            env: the reference engine to launch (``"cartpole"``, ...); ignored with ``client``.
            num_envs: number of environments to launch; with ``client``, ``None`` or the
                client's.
            client: a :class:`shmbridge.Client` to use instead of launching.
            seed: seeds the first ``reset()`` (and starts a launched engine).
            copy: ``step`` returns a copy of the observations (default) or the region's tensor.
            clip_actions: clip ``Box`` actions to the engine's finite bounds (default ``True``).
            close_client, timeout, **launch_args: as :class:`shmbridge.gym.ShmVectorEnv`'s.
        """

        def __init__(
            self,
            env: str = "cartpole",
            num_envs: Optional[int] = None,
            *,
            client: Any = None,
            seed: Optional[int] = None,
            copy: bool = True,
            clip_actions: bool = True,
            close_client: Optional[bool] = None,
            timeout: Optional[float] = None,
            **launch_args: Any,
        ) -> None:
            vec = ShmVectorEnv(
                env, num_envs, client=client, seed=seed, copy=False, close_client=close_client,
                timeout=timeout, **launch_args,
            )
            try:
                self._frames = frames = TorchFrames(vec, clip_actions)
                super().__init__(vec)
                self._device = frames.device
            except BaseException:
                vec.close()
                raise
            self._vec = vec
            self._copy = bool(copy)
            self._reset_once = False
            self.shared: Dict[str, Any] = frames.shared()

        @property
        def client(self) -> Any:
            """The shmbridge client (its tensors, ``call``, ``ping``, ...)."""
            return self._vec.client

        @property
        def num_envs(self) -> int:
            return self._vec.num_envs

        @property
        def observation_space(self) -> Any:
            return self._vec.single_observation_space

        @property
        def action_space(self) -> Any:
            return self._vec.single_action_space

        def _obs(self) -> Any:
            obs = self._frames.obs
            return obs.clone() if self._copy else obs

        def reset(self) -> Tuple[Any, Dict[str, Any]]:
            if not self._reset_once:
                self._vec.reset()
                self._reset_once = True
            return self._obs(), {}

        def step(self, actions: Any) -> Tuple[Any, Any, Any, Any, Dict[str, Any]]:
            frames = self._frames
            frames.step(actions)
            rewards, terminated, truncated = frames.rewards, frames.terminated, frames.truncated
            dones = terminated | truncated
            if not frames.same_step and bool(dones.any()):
                # Next-step or no autoreset: the engine left them as they ended. (Copies
                # of the frame's other tensors: an engine's reset may rewrite them.)
                rewards, terminated, truncated = rewards.clone(), terminated.clone(), truncated.clone()
                frames.reset(dones.nonzero().flatten().tolist())
            return (
                self._obs(),
                rewards.unsqueeze(-1),
                terminated.unsqueeze(-1),
                truncated.unsqueeze(-1),
                {},
            )

        def state(self) -> None:
            return None

        def render(self, *args: Any, **kwargs: Any) -> None:
            return None

        def close(self) -> None:
            self._vec.close()

        def __repr__(self) -> str:
            return f"SkrlEnv(engine={self._vec.schema.get('engine_kind')!r}, num_envs={self.num_envs}, device={self.device})"

    return SkrlEnv


__getattr__ = lazy_class(__name__, "SkrlEnv", _make_class)
