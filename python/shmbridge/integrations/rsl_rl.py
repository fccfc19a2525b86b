"""rsl_rl (the PPO behind Isaac Lab) on a shmbridge engine: ``RslRlVecEnv``, an
``rsl_rl.env.VecEnv``.

    from rsl_rl.runners import OnPolicyRunner
    from shmbridge.integrations.rsl_rl import RslRlVecEnv

    env = RslRlVecEnv(client=shmbridge.launch_gym("Pendulum-v1", num_envs=64))
    OnPolicyRunner(env, train_cfg, device="cpu").learn(100)

This module imports without rsl_rl; ``RslRlVecEnv`` needs it (``pip install
'shmbridge[rsl_rl]'``: an ``ImportError`` says so otherwise). Written against rsl_rl 5's
``VecEnv`` (observations as a TensorDict of groups).

* **Observations**: ``get_observations()`` and ``step`` give a TensorDict with one group,
  ``"policy"`` (what rsl_rl's ``obs_groups`` fall back to for the actor and the critic),
  ``[num_envs, *obs_shape]`` on the engine's device (``cpu``, or ``cuda:N`` for an
  engine that exports CUDA memory: the learner then never touches the host).
* **Shared memory**: ``RslRlVecEnv.shared`` holds the region's tensors themselves
  (``obs``, ``rewards``, ``terminated``, ``truncated``: their ``data_ptr()`` is the
  client's tensors' address); actions are written straight into the region's action
  tensor (clipped to the engine's bounds where it has finite ones: a Gaussian policy's
  samples are unbounded). ``step`` returns the rewards as the region's tensor (rsl_rl
  uses them before the next step) and one copy of the observations: rsl_rl's PPO keeps
  the observations of ``act`` and stores them only after the next ``env.step`` (on
  the same device that copy is one device-side clone). ``copy=False`` returns the
  region's observation tensor itself, for loops that use each step before the next
  (playing a trained policy).
* **Episodes**: ``dones = terminated | truncated``; ``extras["time_outs"]`` the envs cut
  by the time limit, which rsl_rl bootstraps. A finished env's observation is its next
  episode's first: ``cartpole``-style engines reset in that step; under next-step
  autoreset (``launch_gym``'s default) or none the finished envs are reset here, in the
  same ``step``. ``episode_length_buf`` counts each env's steps (rsl_rl's
  ``init_at_random_ep_len`` may set it; it is bookkeeping here: the engine truncates
  episodes itself), ``max_episode_length`` is the engine's limit.
* **Actions**: a ``Box`` engine's (rsl_rl's Gaussian or Beta policies), or a
  ``Discrete(n)`` engine's (``cartpole``): ``num_actions`` is then 1, the action being
  the index of one of ``n`` choices, which rsl_rl (its distributions are continuous)
  samples with this module's ``CategoricalDistribution``, an rsl_rl ``Distribution``:
  ``"distribution_cfg": {"class_name":
  "shmbridge.integrations.rsl_rl:CategoricalDistribution", "num_categories": n}``.
  Other action spaces are refused with ``ValueError``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from . import lazy_classes, require

__all__ = ["RslRlVecEnv", "CategoricalDistribution"]

EXTRA = "rsl_rl"


def _make_class() -> type:
    rsl_env = require("rsl_rl.env", EXTRA, "shmbridge.integrations.rsl_rl.RslRlVecEnv")
    import numpy as np
    import torch
    from gymnasium import spaces
    from tensordict import TensorDict

    from ..gym import ShmVectorEnv
    from ._torch import TorchFrames

    class RslRlVecEnv(rsl_env.VecEnv):
        """An rsl_rl ``VecEnv`` whose environments run in a shmbridge engine (see the
        module's docstring).

        Args:
            env: the reference engine to launch; ignored with ``client``.
            num_envs: number of environments to launch; with ``client``, ``None`` or the
                client's.
            client: a :class:`shmbridge.Client` to use instead of launching.
            seed: resets the envs with seeds ``seed + i`` (and starts a launched engine);
                ``None``: the envs start from the engine's current frame.
            copy: ``step`` returns a copy of the observations (default) or the region's
                tensor.
            clip_actions: clip actions to the engine's finite bounds (default ``True``).
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
            self._vec = vec = ShmVectorEnv(
                env, num_envs, client=client, seed=seed, copy=False, close_client=close_client,
                timeout=timeout, **launch_args,
            )
            try:
                self._setup(vec, copy, clip_actions)
                if seed is not None:
                    vec.reset()  # env i's first episode seeded with seed + i
                # else: the engine's current frame (a fresh engine's first) is where it starts
            except BaseException:
                vec.close()
                raise

        def _setup(self, vec: ShmVectorEnv, copy: bool, clip_actions: bool) -> None:
            act = vec.single_action_space
            if not isinstance(act, (spaces.Box, spaces.Discrete)):
                raise ValueError(
                    f"engine {vec.client.engine_kind!r} has actions {act}: rsl_rl's policies are "
                    "continuous (Gaussian, Beta), or categorical (CategoricalDistribution) for a "
                    "Discrete action space"
                )
            self._frames = frames = TorchFrames(vec, clip_actions)
            self.num_envs = n = vec.num_envs
            # A Discrete engine's action is one index (a float from rsl_rl's policy).
            self.num_actions = int(np.prod(act.shape, dtype=np.int64)) if isinstance(act, spaces.Box) else 1
            self.device = frames.device
            self.max_episode_length = vec.max_episode_steps if vec.max_episode_steps is not None else 2**31 - 1
            self.episode_length_buf = torch.zeros(n, dtype=torch.long, device=self.device)
            self.cfg: Dict[str, Any] = {"engine": vec.client.engine_kind, "num_envs": n, **vec.schema.get("metadata", {})}
            self._copy = bool(copy)
            self.shared = TensorDict(frames.shared(), batch_size=[n], device=self.device)

        @property
        def client(self) -> Any:
            """The shmbridge client (its tensors, ``call``, ``ping``, ...)."""
            return self._vec.client

        def _observations(self) -> Any:
            obs = self._frames.obs
            return TensorDict({"policy": obs.clone() if self._copy else obs}, batch_size=[self.num_envs], device=self.device)

        def get_observations(self) -> Any:
            return self._observations()

        def step(self, actions: Any) -> Any:
            frames = self._frames
            frames.step(actions)
            terminated, truncated, rewards = frames.terminated, frames.truncated, frames.rewards
            dones = terminated | truncated
            time_outs = truncated & ~terminated
            self.episode_length_buf += 1
            if bool(dones.any()):
                self.episode_length_buf[dones] = 0
                if not frames.same_step:
                    # Next-step or no autoreset: the engine left them as they ended.
                    # (A copy of the rewards: an engine's reset may rewrite the frame.)
                    rewards = rewards.clone()
                    frames.reset(dones.nonzero().flatten().tolist())
            return self._observations(), rewards, dones, {"time_outs": time_outs}

        def close(self) -> None:
            self._vec.close()

        def __repr__(self) -> str:
            return f"RslRlVecEnv(engine={self._vec.schema.get('engine_kind')!r}, num_envs={self.num_envs}, device={self.device})"

    return RslRlVecEnv


def _make_distribution() -> type:
    distribution = require(
        "rsl_rl.modules.distribution", EXTRA, "shmbridge.integrations.rsl_rl.CategoricalDistribution"
    )
    import torch
    from torch import nn
    from torch.distributions import Categorical

    class _Argmax(nn.Module):
        def forward(self, logits: torch.Tensor) -> torch.Tensor:
            return logits.argmax(-1, keepdim=True).to(logits.dtype)

    class CategoricalDistribution(distribution.Distribution):
        """A categorical distribution for rsl_rl's models (an rsl_rl ``Distribution``):
        the model's ``num_categories`` outputs are the logits; an output (``output_dim``
        must be 1) is the index of the choice, as a float ``[..., 1]``, what rsl_rl's
        storage and ``RslRlVecEnv.step`` take for a ``Discrete`` engine."""

        def __init__(self, output_dim: int, num_categories: int) -> None:
            if output_dim != 1:
                raise ValueError(f"CategoricalDistribution samples one index: output_dim is {output_dim}, not 1")
            super().__init__(output_dim)
            self.num_categories = int(num_categories)
            self._distribution: Optional[Categorical] = None

        def update(self, mlp_output: torch.Tensor) -> None:
            self._distribution = Categorical(logits=mlp_output, validate_args=False)

        def sample(self) -> torch.Tensor:
            return self._distribution.sample().unsqueeze(-1).to(self._distribution.logits.dtype)

        def deterministic_output(self, mlp_output: torch.Tensor) -> torch.Tensor:
            return _Argmax()(mlp_output)

        def as_deterministic_output_module(self) -> nn.Module:
            return _Argmax()

        @property
        def input_dim(self) -> int:
            return self.num_categories

        @property
        def mean(self) -> torch.Tensor:
            """The expected index (for rsl_rl's logging)."""
            p = self._distribution.probs
            return (p * torch.arange(self.num_categories, dtype=p.dtype, device=p.device)).sum(-1, keepdim=True)

        @property
        def std(self) -> torch.Tensor:
            """The index's standard deviation (for rsl_rl's logging)."""
            p = self._distribution.probs
            i = torch.arange(self.num_categories, dtype=p.dtype, device=p.device)
            return ((p * i * i).sum(-1, keepdim=True) - self.mean**2).clamp_min(0).sqrt()

        @property
        def entropy(self) -> torch.Tensor:
            return self._distribution.entropy()

        @property
        def params(self) -> Tuple[torch.Tensor, ...]:
            return (self._distribution.logits,)

        def log_prob(self, outputs: torch.Tensor) -> torch.Tensor:
            return self._distribution.log_prob(outputs.squeeze(-1).long())

        def kl_divergence(self, old_params: Tuple[torch.Tensor, ...], new_params: Tuple[torch.Tensor, ...]) -> torch.Tensor:
            return torch.distributions.kl_divergence(
                Categorical(logits=old_params[0]), Categorical(logits=new_params[0])
            )

    return CategoricalDistribution


__getattr__ = lazy_classes(__name__, {"RslRlVecEnv": _make_class, "CategoricalDistribution": _make_distribution})
