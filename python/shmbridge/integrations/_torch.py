"""What the torch-based adapters share: an engine's tensors as torch tensors (views of the
region, on its device), actions written in place, a step, and the resets that engines
without same-step autoreset need. Imported by the adapters once their library (and so
torch) is known to be there."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from ..gym import ShmVectorEnv


class TorchFrames:
    """The tensors of ``vec``'s client as torch tensors that *are* the region's memory
    (``torch.from_dlpack``: no copy; ``data_ptr()`` is the client's tensors' address):
    :attr:`obs`, :attr:`actions`, :attr:`rewards`, :attr:`terminated`,
    :attr:`truncated` (``[N]`` bools) and :attr:`final` (the last observations of the
    episodes that ended in the last step, where the engine serves them, else ``None``)."""

    def __init__(self, vec: ShmVectorEnv, clip_actions: bool = True) -> None:
        client = vec.client
        self.vec = vec
        self.num_envs = vec.num_envs
        self.device = torch.device(client.device)
        self.timeout = vec._step_timeout

        def view(name: str) -> torch.Tensor:
            return torch.from_dlpack(client[name])

        self.obs, self.actions = view("obs"), view("actions")
        self.rewards, self.terminated, self.truncated = view("rewards"), view("terminated"), view("truncated")
        for name, flag in (("terminated", self.terminated), ("truncated", self.truncated)):
            if flag.dtype != torch.bool:
                raise ValueError(f"the engine's {name} tensor is {flag.dtype}, not bool")
        final_name = vec.schema["metadata"].get("final_obs") if vec._final_view is not None else None
        self.final = view(final_name) if final_name is not None else None
        #: Whether the engine resets a finished env in the step it finishes.
        self.same_step = vec.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
        self._bounds = None
        act = vec.single_action_space
        if clip_actions and isinstance(act, spaces.Box):
            low, high = np.asarray(act.low, dtype=np.float64), np.asarray(act.high, dtype=np.float64)
            if np.isfinite(low).any() or np.isfinite(high).any():
                shape = tuple(self.actions.shape[1:])
                as_tensor = lambda b: torch.as_tensor(  # noqa: E731
                    np.broadcast_to(b, act.shape).reshape(shape).copy(), dtype=self.actions.dtype, device=self.device
                )
                self._bounds = (as_tensor(low), as_tensor(high))

    def shared(self) -> Dict[str, torch.Tensor]:
        """The engine->client tensors by name (``obs``, ``rewards``, ``terminated``,
        ``truncated``): the region's memory itself."""
        return {"obs": self.obs, "rewards": self.rewards, "terminated": self.terminated, "truncated": self.truncated}

    def step(self, actions: Any) -> None:
        """Writes ``actions`` (any shape with the action tensor's elements) into the
        region's action tensor, clipped to the engine's finite bounds (a ``Box``, with
        ``clip_actions``), and steps the engine."""
        a = actions.reshape(self.actions.shape)
        if self._bounds is not None:
            a = torch.clamp(a, self._bounds[0], self._bounds[1])
        self.actions.copy_(a)
        self.vec._live_client().step(None, self.timeout)

    def reset(self, ids: List[int]) -> None:
        """Resets envs ``ids`` (their generators continue) with one engine reset."""
        if ids:
            self.vec._engine_reset(ids, None)
