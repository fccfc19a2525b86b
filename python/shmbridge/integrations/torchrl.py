"""TorchRL on a shmbridge engine: ``TorchRLEnv``, a ``torchrl.envs.EnvBase`` whose batch
is the engine's envs.

    from torchrl.envs.utils import check_env_specs
    from shmbridge.integrations.torchrl import TorchRLEnv

    env = TorchRLEnv("cartpole", num_envs=64, seed=0)    # or TorchRLEnv(client=...)
    check_env_specs(env)
    rollout = env.rollout(100)                           # [64, 100]

``ShmAsyncEnvPool``: TorchRL's ``AsyncEnvPool`` over asynchronous batches (a sharded
engine handing out whole shards; docs/async.md).

This module imports without TorchRL; ``TorchRLEnv`` and ``ShmAsyncEnvPool`` need it (``pip install
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

from . import lazy_classes, require

__all__ = ["ShmAsyncEnvPool", "TorchRLEnv"]

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




def _make_pool_class() -> type:
    envs = require("torchrl.envs", EXTRA, "shmbridge.integrations.torchrl.ShmAsyncEnvPool")
    import time

    import torch
    from tensordict import NonTensorStack, TensorDict
    from torchrl.data import NonTensor

    from ..errors import InvalidSpecError, OutOfOrderError
    from ..gym import ShmVectorEnv

    base = envs.AsyncEnvPool
    EnvBase = envs.EnvBase
    key = base._env_idx_key  # "env_index"

    #: The counters AsyncEnvPool's synchronous forms check, by what is in flight.
    counters = {"reset": "_current_reset", "step": "_current_step", "step_reset": "_current_step_reset"}

    def ids_of(value: Any) -> list:
        if isinstance(value, torch.Tensor):
            return [int(i) for i in value.reshape(-1).tolist()]
        if hasattr(value, "tolist"):
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            return [int(i) for i in value]
        return [int(value)]

    class ShmAsyncEnvPool(base):
        """TorchRL's ``AsyncEnvPool`` API over shmbridge's asynchronous batches
        (docs/async.md): ``num_envs`` envs served by ``shards`` engine processes, handed
        out ``batch_size`` envs (whole shards) at a time.

            pool = ShmAsyncEnvPool("cartpole", num_envs=16, shards=4, batch_size=8, seed=0)
            pool.async_reset_send()                 # resets every env
            td = pool.async_reset_recv()            # 8 envs, td["env_index"]: which
            pool.async_reset_recv()                 # the other 8: every reset received
            td["action"] = policy(td)["action"]
            pool.async_step_and_maybe_reset_send(td)        # exactly a handed-out batch
            out, root = pool.async_step_and_maybe_reset_recv()

        The mapping onto TorchRL's per-env contract:

        * a recv hands out whole batches, ``ceil(min_get / batch_size)`` of them
          (``min_get`` default 1: one batch; TorchRL's own pools return every env that
          is ready), rows sorted by env index and tagged ``"env_index"``; a ``max_get``
          below that many envs is refused (``NotImplementedError``): a batch is never
          split. ``timeout``: a :class:`shmbridge.errors.TimeoutError` (a
          ``TimeoutError``), the batches received before it kept for the next recv.
          A recv of more envs than are in flight: ``OutOfOrderError``.
        * a send takes the envs of whole handed-out batches (``env_index``, or the
          tensordict's ``"env_index"``), each once, in any order; anything else (envs not
          handed out, part of a batch, an env twice) raises
          :class:`shmbridge.errors.OutOfOrderError` before anything is written or posted.
          The per-env forms (an ``int`` ``env_index`` on a send or recv) raise
          ``NotImplementedError``.
        * resets are of every env at once (``async_reset``): ``async_reset_send`` of a
          subset raises ``NotImplementedError``; every env's reset must be received
          before the first step is sent, and a step and a step-and-maybe-reset are not
          in flight together (``OutOfOrderError``). ``step_and_maybe_reset`` needs an
          engine with same-step autoreset (``cartpole``): finished envs start their next
          episode in that step; ``next`` holds the finished episode's last observation.
        * ``num_envs`` must be a multiple of ``batch_size`` (``InvalidSpecError``), so
          that every env's reset is received in whole batches; the synchronous
          ``reset()``, ``step()``, ``step_and_maybe_reset()``, ``rollout()`` and
          TorchRL's ``Collector`` (every env at once) work over the pool.
          ``AsyncBatchedCollector`` builds a pool of its own from env factories and
          cannot take this one.

        Specs are :class:`TorchRLEnv`'s (batch ``[num_envs]``), plus ``"env_index"``.
        Results are copies by default (``copy=True``): TorchRL keeps them. With
        ``copy=False`` a recv whose rows are adjacent in the region returns the region's
        memory itself (views, valid until those envs' actions are sent); rows of
        several places are gathered (a copy). Actions are written straight into the
        region's action rows.

        Args:
            env, num_envs, shards, batch_size, **launch_args: as
                :func:`shmbridge.launch`'s (all but ``batch_size`` ignored with ``client``).
            seed: the first reset seeds env ``i`` with ``seed + i`` (``set_seed``: the
                next reset).
            client: a sharded :class:`shmbridge.Client` to use instead (it is
                ``async_reset`` here with ``batch_size``).
            copy: recvs return copies (default) or the region's rows.
            close_client: whether closing the pool closes the client (default: a
                launched one only).
        """

        def __init__(
            self,
            env: str = "cartpole",
            num_envs: int = 64,
            *,
            batch_size: int,
            shards: int = 2,
            client: Any = None,
            seed: Optional[int] = None,
            copy: bool = True,
            close_client: Optional[bool] = None,
            **launch_args: Any,
        ) -> None:
            owned = client is None
            if seed is not None:
                ShmVectorEnv._check_seed(seed)
            total = num_envs if owned else client.num_envs
            if batch_size < 1 or total % batch_size:
                raise InvalidSpecError(
                    f"ShmAsyncEnvPool needs num_envs ({total}) a multiple of batch_size "
                    f"({batch_size}): every env's reset is received in whole batches before a step"
                )
            if owned:
                from .._launch import launch

                client = launch(env, num_envs, shards=shards, batch_size=batch_size, **launch_args)
            torchrl_env = None
            try:
                if not owned:
                    client.async_reset(batch_size)
                torchrl_env = __getattr__("TorchRLEnv")(
                    client=client, copy=False, close_client=owned if close_client is None else close_client
                )
                output_spec = torchrl_env.output_spec.clone()
                input_spec = torchrl_env.input_spec.clone()
                input_spec["full_state_spec"].set(key, NonTensor(example_data=0, shape=input_spec.shape))
                self.__dict__["_output_spec"] = output_spec
                self.__dict__["_input_spec"] = input_spec
                EnvBase.__init__(self, device=torchrl_env.device, batch_size=torchrl_env.batch_size)
            except BaseException:
                if torchrl_env is not None:
                    torchrl_env.close(raise_if_closed=False)
                elif owned:
                    client.close()
                raise
            self._env = torchrl_env
            self._frames = torchrl_env._frames
            self._copy = bool(copy)
            #: The seed of the next reset (``set_seed``; the constructor's serves the
            #: first: the launch's own reset is not seeded once batches start).
            self._seed: Optional[int] = seed
            self.num_envs = torchrl_env.batch_size[0]
            self.batch_size_envs = int(batch_size)
            self.min_get = 1
            self.backend = "shmbridge"
            self.stack = "dense"
            self._stack_func = torch.stack  # (read by AsyncEnvPool.reset)
            self._busy: set = set()
            #: Handed-out batches whose actions are owed: frozenset of env ids.
            self._held: list = []
            #: Batches received from the client, not yet returned (a recv that timed out).
            self._ready: list = []
            #: What is in flight: "reset", "step" or "step_reset" (None: nothing).
            self._kind: Optional[str] = None
            #: The tensordicts sent with the envs in flight: env id -> (td, row).
            self._sent: dict = {}
            #: The reset the constructor started (launch, or async_reset) is in flight,
            #: unasked for: the first async_reset_send without a seed takes it.
            self._initial_reset = True
            self._current_step = self._current_step_reset = self._current_reset = 0
            self._closed = False

        # The specs are stored whole (EnvBase's), not stacked from child envs.
        full_action_spec = EnvBase.full_action_spec
        full_observation_spec = EnvBase.full_observation_spec
        full_reward_spec = EnvBase.full_reward_spec
        full_done_spec = EnvBase.full_done_spec
        full_state_spec = EnvBase.full_state_spec

        @property
        def client(self) -> Any:
            """The shmbridge client."""
            return self._env.client

        @property
        def env_batch_sizes(self) -> list:
            return [torch.Size([])] * self.num_envs

        def _get_child_specs(self) -> list:
            raise NotImplementedError("ShmAsyncEnvPool has no child envs")

        def _setup(self) -> None:
            raise NotImplementedError("ShmAsyncEnvPool has no child envs")

        def _set_seed(self, seed: Optional[int]) -> None:
            if seed is not None:
                ShmVectorEnv._check_seed(seed)
            self._seed = seed

        # -- bookkeeping ---------------------------------------------------------------

        def _send_ids(self, tensordict: Any, env_index: Any) -> list:
            if isinstance(env_index, int):
                raise NotImplementedError(
                    "per-env sends (an int env_index) are not supported: shmbridge hands out "
                    "whole batches; send the actions of a whole handed-out batch"
                )
            if env_index is None:
                if tensordict is None or key not in tensordict.keys():
                    raise OutOfOrderError(f"a send needs env_index or the tensordict's {key!r}")
                return ids_of(tensordict.get(key))
            return ids_of(env_index)

        def _check_held(self, ids: list) -> list:
            """The held batches ``ids`` make up exactly, or ``OutOfOrderError``."""
            wanted = set(ids)
            if not ids:
                raise OutOfOrderError("a send of no envs: send the envs of a handed-out batch")
            if len(wanted) != len(ids):
                raise OutOfOrderError(f"env_index {ids} names an env twice: nothing was sent")
            batches = [b for b in self._held if b & wanted]
            covered = set().union(*batches) if batches else set()
            if covered != wanted:
                missing = sorted(wanted - covered)
                if missing:
                    why = f"envs {missing} were not handed out by a recv (or their actions were sent)"
                else:
                    why = f"a batch's envs {sorted(covered - wanted)} are missing: send whole batches"
                raise OutOfOrderError(f"send of envs {sorted(wanted)}: {why}; nothing was sent")
            return batches

        def _post(self, kind: str, tensordict: Any, env_index: Any) -> None:
            ids = self._send_ids(tensordict, env_index)
            batches = self._check_held(ids)
            if self._kind not in (None, kind):
                raise OutOfOrderError(
                    f"a {kind} send while a {self._kind} is in flight: receive those envs first "
                    "(every env's reset before the first step); nothing was sent"
                )
            if kind == "step_reset" and not self._frames.same_step:
                raise NotImplementedError(
                    "step_and_maybe_reset needs an engine that resets finished envs in the step "
                    "(same-step autoreset): asynchronous batches have no per-env reset"
                )
            frames = self._frames
            n = len(ids)
            action = tensordict.get("action").reshape((n, *frames.actions.shape[1:]))
            rows = torch.as_tensor(ids, dtype=torch.long, device=frames.actions.device)
            frames.actions[rows] = action.to(device=frames.actions.device, dtype=frames.actions.dtype)
            self.client.send(None, ids)
            for b in batches:
                self._held.remove(b)
            sent = tensordict.exclude("next", key)
            for row, i in enumerate(ids):
                self._sent[i] = (sent, row)
            self._busy.update(ids)
            self._kind = kind
            setattr(self, counters[kind], getattr(self, counters[kind]) + n)

        def _recv(self, kind: str, min_get: Any, env_index: Any, max_get: Any, timeout: Any) -> list:
            """Hands out whole batches of envs in flight for ``kind``: their sorted ids."""
            if env_index is not None:
                raise NotImplementedError(
                    "per-env recvs (env_index) are not supported: shmbridge hands out whole "
                    "batches; recv without env_index"
                )
            b = self.batch_size_envs
            min_get = self.min_get if min_get is None else int(min_get)
            if min_get < 1:
                raise ValueError(f"min_get must be positive, got {min_get}")
            count = -(-min_get // b)
            if max_get is not None and max_get < count * b:
                raise NotImplementedError(
                    f"max_get={max_get} is below {count * b}, the {count} whole batch(es) of "
                    f"{b} envs that min_get={min_get} takes: batches are not split; use "
                    f"max_get >= {count * b}"
                )
            if timeout is not None and timeout < 0:
                raise ValueError(f"timeout must be non-negative, got {timeout}")
            in_flight = len(self._busy)
            if self._kind != kind or count * b > in_flight:
                raise OutOfOrderError(
                    f"{kind} recv of {count * b} envs with {in_flight if self._kind == kind else 0} "
                    f"envs' {kind} in flight: send first"
                )
            deadline = None if timeout is None else time.monotonic() + timeout
            while len(self._ready) < count:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                batch = self.client.recv(timeout=left)  # a timeout keeps self._ready
                self._ready.append([int(i) for i in batch.env_ids])
            got, self._ready = self._ready[:count], self._ready[count:]
            ids = sorted(i for g in got for i in g)
            self._held.extend(frozenset(g) for g in got)
            self._busy.difference_update(ids)
            setattr(self, counters[kind], getattr(self, counters[kind]) - len(ids))
            if not self._busy:
                self._kind = None
            return ids

        def _rows(self, tensor: Any, ids: list) -> Any:
            """Rows ``ids`` (sorted) of a region tensor: a view when adjacent (a copy
            unless ``copy=False``), else a gather."""
            if ids[-1] - ids[0] + 1 == len(ids):
                rows = tensor[ids[0] : ids[-1] + 1]
                return rows.clone() if self._copy else rows
            return tensor[torch.as_tensor(ids, dtype=torch.long, device=tensor.device)]

        def _index(self, ids: list) -> Any:
            return NonTensorStack(*ids)

        def _reset_td(self, ids: list) -> Any:
            zeros = torch.zeros((len(ids), 1), dtype=torch.bool, device=self.device)
            return TensorDict(
                {
                    "observation": self._rows(self._frames.obs, ids),
                    "done": zeros,
                    "terminated": zeros.clone(),
                    "truncated": zeros.clone(),
                    key: self._index(ids),
                },
                batch_size=[len(ids)],
                device=self.device,
            )

        def _step_td(self, ids: list) -> Any:
            frames = self._frames
            terminated = self._rows(frames.terminated, ids).unsqueeze(-1)
            truncated = self._rows(frames.truncated, ids).unsqueeze(-1)
            done = terminated | truncated
            obs = self._rows(frames.obs, ids)
            if frames.same_step and frames.final is not None and bool(done.any()):
                obs = torch.where(done, self._rows(frames.final, ids), obs)
            nxt = TensorDict(
                {
                    "observation": obs,
                    "reward": self._rows(frames.rewards, ids).unsqueeze(-1),
                    "terminated": terminated,
                    "truncated": truncated,
                    "done": done,
                },
                batch_size=[len(ids)],
                device=self.device,
            )
            # The root: what was sent with each env, in the order of ids.
            groups: dict = {}
            for i in ids:
                td, row = self._sent.pop(i)
                groups.setdefault(id(td), (td, []))[1].append((i, row))
            parts, order = [], []
            for td, rows in groups.values():
                parts.append(td[torch.as_tensor([r for _, r in rows], dtype=torch.long)])
                order.extend(i for i, _ in rows)
            root = torch.cat([p.to_tensordict() for p in parts])
            if order != ids:
                pos = {i: k for k, i in enumerate(order)}
                root = root[torch.as_tensor([pos[i] for i in ids], dtype=torch.long)]
            root.set("next", nxt)
            root.set(key, self._index(ids))
            return root

        # -- TorchRL's asynchronous API ---------------------------------------------

        def async_reset_send(self, tensordict: Any = None, env_index: Any = None) -> None:
            if isinstance(env_index, int):
                raise NotImplementedError("per-env resets are not supported: reset every env")
            if env_index is not None or (tensordict is not None and key in tensordict.keys()):
                ids = self._send_ids(tensordict, env_index)
                if sorted(ids) != list(range(self.num_envs)):
                    raise NotImplementedError(
                        "resetting some envs is not supported: asynchronous batches reset every "
                        "env at once (async_reset_send() without env_index)"
                    )
            if self._busy:
                raise OutOfOrderError(
                    f"a reset while envs {sorted(self._busy)} are in flight: receive them first"
                )
            # The first reset without a seed is the one the constructor started.
            if not self._initial_reset or self._seed is not None:
                self.client.async_reset(self.batch_size_envs, self._seed)
                self._seed = None
            self._initial_reset = False
            self._held, self._ready, self._sent = [], [], {}
            self._busy = set(range(self.num_envs))
            self._kind = "reset"
            self._current_step = self._current_step_reset = 0
            self._current_reset = self.num_envs

        def async_reset_recv(self, min_get: Any = None, env_index: Any = None, *, max_get: Any = None,
                             timeout: Any = None) -> Any:
            return self._reset_td(self._recv("reset", min_get, env_index, max_get, timeout))

        def async_step_send(self, tensordict: Any, env_index: Any = None) -> None:
            self._post("step", tensordict, env_index)

        def async_step_recv(self, min_get: Any = None, env_index: Any = None, *, max_get: Any = None,
                            timeout: Any = None) -> Any:
            return self._step_td(self._recv("step", min_get, env_index, max_get, timeout))

        def async_step_and_maybe_reset_send(self, tensordict: Any, env_index: Any = None) -> None:
            self._post("step_reset", tensordict, env_index)

        def async_step_and_maybe_reset_recv(self, min_get: Any = None, env_index: Any = None, *,
                                            max_get: Any = None, timeout: Any = None) -> Any:
            ids = self._recv("step_reset", min_get, env_index, max_get, timeout)
            td = self._step_td(ids)
            root = self._step_mdp(td)
            nxt = td.get("next")
            done = nxt.get("done")
            # Same-step autoreset: a finished env's current row is its next episode's first.
            root.set("observation", self._rows(self._frames.obs, ids) if bool(done.any()) else nxt.get("observation"))
            for flag in ("done", "terminated", "truncated"):
                root.set(flag, torch.zeros_like(done))
            root.set(key, self._index(ids))
            return td, root

        # The synchronous forms go through the asynchronous ones (every env).
        def _reset(self, tensordict: Any = None, **kwargs: Any) -> Any:
            self.async_reset_send()
            return self.async_reset_recv(min_get=self.num_envs)

        def _step(self, tensordict: Any) -> Any:
            tensordict.set(key, torch.arange(self.num_envs))
            self.async_step_send(tensordict)
            return self.async_step_recv(min_get=self.num_envs)

        def shutdown(self) -> None:
            if not getattr(self, "_closed", True):
                self._closed = True
                self._env.close(raise_if_closed=False)

        def __repr__(self) -> str:
            return (f"ShmAsyncEnvPool(num_envs={self.num_envs}, batch_size={self.batch_size_envs}, "
                    f"device={self.device})")

    return ShmAsyncEnvPool


__getattr__ = lazy_classes(__name__, {"TorchRLEnv": _make_class, "ShmAsyncEnvPool": _make_pool_class})
