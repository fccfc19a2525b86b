"""What ``Client.recv()`` returns: the envs of the shards that answered, read in place."""

from typing import Any, Iterator, List, Sequence, Tuple

import numpy as np

__all__ = ["AsyncEnvPool", "Batch"]


class Batch:
    """The ``batch_size`` envs handed out by one ``Client.recv()`` (docs/async.md).

    ``env_ids``: their ids (int32), shard by shard. ``views(name)``: one numpy view per
    shard of tensor ``name``'s rows, in the region (no copy). ``obs``, ``rewards``,
    ``terminated``, ``truncated`` (and ``batch[name]``): the batch's rows as one array:
    a view into the region when its shards are adjacent in env order (``contiguous``),
    else a gather of the views into a new array. Unpacks as EnvPool's ``recv()``:
    ``obs, rewards, terminated, truncated, env_ids = client.recv()``. The rows stay
    valid until their actions are sent.
    """

    __slots__ = ("_client", "env_ids", "spans")

    def __init__(self, client: Any, env_ids: Sequence[int], spans: Sequence[Tuple[int, int]]):
        self._client = client
        self.env_ids = np.asarray(env_ids, dtype=np.int32)
        self.spans: List[Tuple[int, int]] = [tuple(s) for s in spans]

    def __len__(self) -> int:
        return len(self.env_ids)

    @property
    def contiguous(self) -> bool:
        """Whether the shards' rows are adjacent in env order (the batch is one view)."""
        return all(a[1] == b[0] for a, b in zip(self.spans, self.spans[1:]))

    def views(self, name: str) -> List[np.ndarray]:
        """Tensor ``name``'s rows of each shard of the batch: views into the region."""
        whole = np.asarray(self._client[name])
        return [whole[start:end] for start, end in self.spans]

    def __getitem__(self, name: str) -> np.ndarray:
        if self.contiguous:
            whole = np.asarray(self._client[name])
            return whole[self.spans[0][0] : self.spans[-1][1]]
        return np.concatenate(self.views(name))

    @property
    def obs(self) -> np.ndarray:
        return self["obs"]

    @property
    def rewards(self) -> np.ndarray:
        return self["rewards"]

    @property
    def terminated(self) -> np.ndarray:
        return self["terminated"]

    @property
    def truncated(self) -> np.ndarray:
        return self["truncated"]

    def __iter__(self) -> Iterator[Any]:
        return iter((self.obs, self.rewards, self.terminated, self.truncated, self.env_ids))

    def __repr__(self) -> str:
        return f"Batch(env_ids={self.env_ids.tolist()}, spans={self.spans})"


class AsyncEnvPool:
    """EnvPool's asynchronous API (``async_reset``/``recv``/``send``, ``reset``/``step`` in
    its ``gymnasium`` shape) over a sharded engine (docs/async.md).

        pool = shmbridge.AsyncEnvPool("cartpole", num_envs=64, shards=8, batch_size=32)
        pool.async_reset()
        obs, rew, term, trunc, info = pool.recv()       # info["env_id"]: whose rows
        pool.send(actions, info["env_id"])

    ``reset()`` is ``async_reset()`` then ``recv()`` (returning ``(obs, info)``; every env
    is reset: ``reset(env_id)`` raises ``NotImplementedError``); ``step(a,
    env_id)`` is ``send`` then ``recv``. Autoreset is the engine's (``cartpole``: in the
    same step). Arrays are copies by default (``copy=True``), yours to keep; with
    ``copy=False`` they are the batch's rows (views into the region when its shards are
    adjacent), valid until their actions are sent. ``client=``: a client attached
    elsewhere, asynchronous already or started here with ``batch_size``; closing the
    pool closes it.
    """

    def __init__(self, env: str = "cartpole", num_envs: int = 64, *, batch_size: int,
                 shards: int = 2, copy: bool = True, client: Any = None, **launch_args: Any):
        if client is None:
            from ._launch import launch

            client = launch(env, num_envs, shards=shards, batch_size=batch_size, **launch_args)
        else:
            client.async_reset(batch_size)
        self.client = client
        self.num_envs = client.num_envs
        self.batch_size = batch_size
        self._copy = copy
        self._reset_done = True  # launch/async_reset above reset every env

    def async_reset(self) -> None:
        # The first call right after the construction's reset is that reset; any other
        # resets every env.
        if not self._reset_done:
            self.client.async_reset(self.batch_size)
        self._reset_done = False

    def recv(self, timeout: Any = None) -> Tuple[Any, Any, Any, Any, dict]:
        self._reset_done = False
        obs, rew, term, trunc, env_ids = self.client.recv(timeout=timeout)
        if self._copy:
            obs, rew, term, trunc = (np.array(a, copy=True) for a in (obs, rew, term, trunc))
        return obs, rew, term, trunc, {"env_id": env_ids}

    def send(self, action: Any, env_id: Any = None) -> None:
        self._reset_done = False
        self.client.send(action, None if env_id is None else np.asarray(env_id).tolist())

    def reset(self, env_id: Any = None) -> Tuple[Any, dict]:
        if env_id is not None:
            raise NotImplementedError(
                "reset(env_id): resetting some envs is not supported; reset() resets every env"
            )
        self.async_reset()
        obs, _, _, _, info = self.recv()
        return obs, info

    def step(self, action: Any, env_id: Any = None) -> Tuple[Any, Any, Any, Any, dict]:
        self.send(action, env_id)
        return self.recv()

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "AsyncEnvPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
