"""TorchRL on a shmbridge engine: ``TorchRLEnv``, a ``torchrl.envs.EnvBase`` whose batch
is the engine's envs.

    from torchrl.envs.utils import check_env_specs
    from shmbridge.integrations.torchrl import TorchRLEnv

    env = TorchRLEnv("cartpole", num_envs=64, seed=0)    # or TorchRLEnv(client=...)
    check_env_specs(env)
    rollout = env.rollout(100)                           # [64, 100]

This module imports without TorchRL; ``TorchRLEnv`` needs it (``pip install
'shmbridge[torchrl]'``: an ``ImportError`` says so otherwise).

* **Specs** come from the engine's schema (through :class:`shmbridge.gym.ShmVectorEnv`,
  which the adapter is built on): ``observation`` (a ``Bounded`` spec where the engine
  gives finite bounds, else ``Unbounded``), ``action`` (``Categorical`` for an engine with
  metadata ``action_space=discrete:n``, shape ``[N]``, else ``Bounded``/``Unbounded``), ``reward``
  ``[N, 1]``, and ``done``/``terminated``/``truncated`` ``[N, 1]`` bools; batch size
  ``[N]``, device the engine's (``cpu``, or ``cuda:N`` for an engine that exports CUDA
  memory).
* **Shared memory**: ``TorchRLEnv.shared`` is a TensorDict whose ``observation``,
  ``reward``, ``terminated`` and ``truncated`` entries *are* the region's tensors (their
  ``data_ptr()`` is the client's tensors' address), overwritten in place by each step;
  ``action`` is written straight into the region's action tensor. ``step`` returns one
  copy of them, as TorchRL's own ``ParallelEnv`` does with its shared buffers, because
  TorchRL keeps what ``step`` returns (``rollout`` and the collectors stack the steps at
  the end of a batch); ``copy=False`` returns the shared entries themselves, zero copies,
  for loops that consume each step before the next (anything that keeps them sees them
  change).
* **Autoreset and partial resets**: TorchRL resets finished envs itself, through
  ``reset`` with a ``"_reset"`` mask (``step_and_maybe_reset``, the collectors).
  ``_reset`` resets just the masked envs with one engine ``reset`` of their ids. The
  ``next`` observation of a finished env is its episode's last (the engine's
  ``final_obs`` under same-step autoreset); an engine that already reset those envs in
  that step (``cartpole``) is not asked again: their current observation is their new
  episode's first.
* **Seeds**: ``set_seed(s)`` seeds env ``i`` with ``s + i`` at the next full reset (the
  constructor's ``seed`` serves the first).
"""

from __future__ import annotations

from typing import Any, Optional

from . import lazy_class, require

__all__ = ["TorchRLEnv"]

EXTRA = "torchrl"


def _make_class() -> type:
    envs = require("torchrl.envs", EXTRA, "shmbridge.integrations.torchrl.TorchRLEnv")
    import numpy as np
    import torch
    from gymnasium import spaces
    from tensordict import TensorDict
    from torchrl.data import Bounded, Categorical, Composite, Unbounded

    from ..gym import ShmVectorEnv
    from ._torch import TorchFrames

    def box_spec(space: Any, n: int, device: Any) -> Any:
        dtype = getattr(torch, np.dtype(space.dtype).name)
        shape = (n, *space.shape)
        low, high = np.asarray(space.low), np.asarray(space.high)
        if np.isfinite(low).all() and np.isfinite(high).all():
            low_t = torch.as_tensor(np.broadcast_to(low, space.shape).copy()).to(dtype).expand(shape)
            high_t = torch.as_tensor(np.broadcast_to(high, space.shape).copy()).to(dtype).expand(shape)
            return Bounded(low=low_t.clone(), high=high_t.clone(), shape=shape, dtype=dtype, device=device)
        return Unbounded(shape=shape, dtype=dtype, device=device)

    class TorchRLEnv(envs.EnvBase):
        """A TorchRL ``EnvBase`` whose environments run in a shmbridge engine (see the
        module's docstring).

        Args:
            env: the reference engine to launch (``"cartpole"``, ...); ignored with ``client``.
            num_envs: number of environments to launch (default 256, ``launch``'s); with
                ``client``, ``None`` or the client's.
            client: a :class:`shmbridge.Client` to use instead of launching.
            seed: used by the first full reset without a seed (and to start a launched
                engine).
            copy: ``step``/``reset`` return copies (default) or the shared entries.
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
            close_client: Optional[bool] = None,
            timeout: Optional[float] = None,
            **launch_args: Any,
        ) -> None:
            vec = ShmVectorEnv(
                env, num_envs, client=client, seed=seed, copy=False, close_client=close_client,
                timeout=timeout, **launch_args,
            )
            try:
                device = torch.device(vec.client.device)
                super().__init__(device=device, batch_size=[vec.num_envs])
                self._setup(vec, device, copy)
            except BaseException:
                vec.close()
                raise

        def _setup(self, vec: ShmVectorEnv, device: Any, copy: bool) -> None:
            self._vec = vec
            self._copy = bool(copy)
            n = vec.num_envs
            # TorchRL's own specs bound the actions: no clipping here.
            self._frames = frames = TorchFrames(vec, clip_actions=False)
            self._obs = frames.obs
            # [N] -> [N, 1]: views, the same memory.
            self._reward = frames.rewards.unsqueeze(-1)
            self._terminated = frames.terminated.unsqueeze(-1)
            self._truncated = frames.truncated.unsqueeze(-1)
            #: The envs the engine has reset in the last step (same-step autoreset).
            self._fresh: Optional[Any] = None
            #: The seed of ``set_seed``, for the next full reset.
            self._seed: Optional[int] = None

            self.shared = TensorDict(
                {
                    "observation": self._obs,
                    "reward": self._reward,
                    "terminated": self._terminated,
                    "truncated": self._truncated,
                },
                batch_size=[n],
                device=device,
            )

            self.observation_spec = Composite(
                observation=box_spec(vec.single_observation_space, n, device), shape=(n,), device=device
            )
            act = vec.single_action_space
            if isinstance(act, spaces.Discrete):
                # One index per env (a [N] spec, as TorchRL's Categorical policies
                # sample), whether the engine's tensor is [N] or [N, 1].
                self.action_spec = Categorical(int(act.n), shape=(n,), dtype=frames.actions.dtype, device=device)
            else:
                self.action_spec = box_spec(act, n, device)
            self.reward_spec = Unbounded(shape=(n, 1), dtype=self._reward.dtype, device=device)
            flag = Categorical(2, shape=(n, 1), dtype=torch.bool, device=device)
            self.done_spec = Composite(
                done=flag.clone(), terminated=flag.clone(), truncated=flag.clone(), shape=(n,), device=device
            )

        @property
        def client(self) -> Any:
            """The shmbridge client (its tensors, ``call``, ``ping``, ...)."""
            return self._vec.client

        def _set_seed(self, seed: Optional[int]) -> None:
            if seed is not None:
                ShmVectorEnv._check_seed(seed)
            self._seed = seed

        def _reset(self, tensordict: Any = None, **kwargs: Any) -> Any:
            vec, n = self._vec, self.batch_size[0]
            mask = None if tensordict is None else tensordict.get("_reset", None)
            if mask is None or bool(mask.all()):
                # (The constructor's seed, pending in vec, serves the first reset without one.)
                vec.reset(seed=self._seed)
                self._seed = None
            else:
                wanted = mask.reshape(n)
                fresh = self._fresh
                if fresh is not None:
                    wanted = wanted & ~fresh  # the engine reset these in the last step
                self._frames.reset(wanted.nonzero().flatten().tolist())
            self._fresh = None
            zeros = torch.zeros_like(self._terminated)
            obs = self._obs.clone() if self._copy else self._obs
            return TensorDict(
                {"observation": obs, "done": zeros, "terminated": zeros.clone(), "truncated": zeros.clone()},
                batch_size=self.batch_size,
                device=self.device,
            )

        def _step(self, tensordict: Any) -> Any:
            frames = self._frames
            frames.step(tensordict.get("action"))
            done = self._terminated | self._truncated
            obs = self._obs
            if frames.same_step:
                self._fresh = done.reshape(-1)
                if frames.final is not None and bool(done.any()):
                    # The finished episodes' last observations (a new tensor).
                    obs = torch.where(done, frames.final, obs)
            out = TensorDict(
                {
                    "observation": obs,
                    "reward": self._reward,
                    "terminated": self._terminated,
                    "truncated": self._truncated,
                    "done": done,
                },
                batch_size=self.batch_size,
                device=self.device,
            )
            return out.clone() if self._copy else out

        def close(self, *, raise_if_closed: bool = True) -> None:
            self._vec.close()
            super().close(raise_if_closed=raise_if_closed)

        def __repr__(self) -> str:
            return f"TorchRLEnv(engine={self._vec.schema.get('engine_kind')!r}, num_envs={self.batch_size[0]}, device={self.device})"

    return TorchRLEnv


__getattr__ = lazy_class(__name__, "TorchRLEnv", _make_class)
