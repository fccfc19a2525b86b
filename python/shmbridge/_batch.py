"""What ``Client.recv()`` returns: the envs of the shards that answered, read in place."""

from typing import Any, Iterator, List, Sequence, Tuple

import numpy as np

__all__ = ["Batch"]


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
