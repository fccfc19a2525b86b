"""A Gymnasium vector environment over shmbridge: :class:`ShmVectorEnv`.

    import gymnasium as gym
    import shmbridge                       # registers "shmbridge/CartPole-v1"

    envs = gym.make_vec("shmbridge/CartPole-v1", num_envs=256)
    obs, infos = envs.reset(seed=42)
    for _ in range(1000):
        obs, rewards, terminated, truncated, infos = envs.step(envs.action_space.sample())
    envs.close()                           # stops the engine; nothing is left in /dev/shm

or, explicitly: ``shmbridge.gym.ShmVectorEnv("cartpole", num_envs=256, seed=42)``, or
around a client attached elsewhere: ``ShmVectorEnv(client=shmbridge.attach(name))``.
``gymnasium.make("shmbridge/CartPole-v1")`` makes one env (:class:`ShmEnv`, an engine of
one env, for single-env tools and checkers); ``gymnasium.make("shmbridge/<Gymnasium id>")``
of a sharded id raises an error that names ``make_vec``.

Semantics, where they differ from or refine Gymnasium's:

* **Autoreset** follows the engine's ``autoreset_mode`` metadata, exposed as
  ``metadata["autoreset_mode"]``. The ``cartpole`` engine resets a finished env in the
  same step (:attr:`AutoresetMode.SAME_STEP`): the observation returned for an env whose
  ``terminated`` or ``truncated`` flag is set is already the first observation of its
  next episode. The finished episode's last observation comes in ``infos``, as
  Gymnasium's own SAME_STEP vector envs (``SyncVectorEnv``) give it, when the engine
  serves it (metadata ``final_obs``: the name of an engine→client tensor of the
  observations' dtype and shape holding each env's state before any autoreset, as
  ``cartpole`` does): in a step where some env ``i`` finished, ``infos["final_obs"]`` is
  an object array of ``num_envs`` entries, ``None`` except a copy (a fresh array, never a
  view of the shared memory, also with ``copy=False``) of env ``i``'s last observation,
  ``infos["_final_obs"]`` the bool mask ``terminated | truncated``, ``infos["final_info"]``
  ``{}`` (the engine has no per-env infos) and ``infos["_final_info"]`` the same mask; in
  a step where none finished ``infos`` is ``{}``. Bootstrap a truncated episode's value
  from ``infos["final_obs"][i]``. An engine without that metadata (or with another
  autoreset mode) gives ``infos == {}`` always: the final observation is then not
  available (bootstrap from the observation before it, or not at all).
  An engine that declares no mode (the ``null`` engine, or an engine of your own without
  that metadata) is taken as :attr:`AutoresetMode.DISABLED`: the safe assumption, since
  resetting finished envs yourself with ``reset(options={"reset_mask": done})`` is right
  whether or not the engine also resets them.
* **Returned arrays** are fresh NumPy copies by default (``copy=True``), as Gymnasium
  expects: you may keep them (in a replay buffer, say) across steps. With ``copy=False``
  ``step``/``reset`` return read-only views of the shared memory instead, the same array
  objects every call, overwritten in place by the next ``step``/``reset``: zero copies,
  for loops that consume each frame before stepping again.
* **dtypes** are the engine's: ``cartpole`` gives float32 observations and rewards, bool
  flags. ``infos`` is an empty dict but for the final observations (above); ``reset``
  always returns ``{}``.
* **Seeding**: ``reset(seed=s)`` seeds env ``i`` with ``s + i`` and ``reset(seed=[s0,
  s1, ...])`` env ``i`` with ``s_i``, as Gymnasium's vector envs do (``None`` entries: that
  env keeps its generator); the random generators live in the engine. ``reset()`` without
  a seed continues each env's generator. The ``seed`` argument of the constructor is used
  by the first ``reset()`` called without one (so ``ShmVectorEnv(seed=s).reset()`` equals
  ``ShmVectorEnv().reset(seed=s)``); a launched engine is also started with it, or with a
  seed from the OS when it is ``None``. ``np_random`` is Gymnasium's: seeded by an ``int``
  seed passed to ``reset`` (not by a list), unused by the environment itself. An engine
  that takes no seeds (``null``: it has no randomness) is reset without them, with a
  warning.
* **Actions** must lie in ``action_space``: for ``Discrete(n)`` an integer array of shape
  ``(num_envs,)`` (or ``(num_envs, 1)``) with values in ``[0, n)``; for a ``Box`` an array
  of the batched shape. Anything else raises :class:`ValueError` and nothing is sent.
  NumPy arrays, CPU torch tensors and lists are accepted; valid actions are written once,
  straight into the shared action tensor.
* ``render()`` is not supported (``render_mode`` must be ``None``).
"""

from __future__ import annotations

import secrets
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

import gymnasium
from gymnasium import spaces
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from . import _gym_registration
from ._native import Client
from .errors import RemoteError

__all__ = ["ShmEnv", "ShmVectorEnv", "AUTORESET_MODES"]

#: Engine metadata ``autoreset_mode`` values and the Gymnasium modes they mean.
AUTORESET_MODES: Dict[str, AutoresetMode] = {
    "same-step": AutoresetMode.SAME_STEP,
    "next-step": AutoresetMode.NEXT_STEP,
    "disabled": AutoresetMode.DISABLED,
}

# The engine's error code for "this engine does not support that request" (protocol §6.4).
_UNSUPPORTED = 4

Seed = Union[None, int, Sequence[Optional[int]]]


def _space_bounds(text: str, what: str, size: int) -> np.ndarray:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"engine metadata {what}={text!r}: not a comma-separated list of floats") from None
    if len(values) != size:
        raise ValueError(f"engine metadata {what} has {len(values)} values for a space of {size}")
    return np.asarray(values, dtype=np.float64)


def _box(dtype: np.dtype, shape: Tuple[int, ...], low: Any = None, high: Any = None) -> spaces.Box:
    """A Box of ``dtype``: the given bounds, else the widest the dtype allows."""
    if low is None or high is None:
        if np.issubdtype(dtype, np.floating):
            low, high = -np.inf, np.inf
        elif np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            low, high = info.min, info.max
        elif dtype == np.bool_:
            low, high = 0, 1
        else:
            raise ValueError(f"no Box space for dtype {dtype}")
    if np.ndim(low) > 0:
        # Cast here: Box warns when it has to lower the bounds' precision itself.
        low = np.asarray(low).astype(dtype).reshape(shape)
        high = np.asarray(high).astype(dtype).reshape(shape)
    return spaces.Box(low=low, high=high, shape=shape, dtype=dtype)


def _read_only_view(client: Client, name: str) -> np.ndarray:
    """A read-only NumPy view (never a copy) of the client's tensor ``name``."""
    view = np.asarray(client[name])
    view.flags.writeable = False
    return view


#: Up to this many action elements, the bounds are checked on a Python list (``tolist()``
#: and a comparison per value: a few hundred nanoseconds), past it with NumPy reductions
#: (about a microsecond each, whatever the size).
_SMALL = 32


class _ActionCheck:
    """Checks actions against the action space before anything is written or sent, with
    the fewest NumPy calls (each costs about a microsecond, as much as a CartPole step):
    ``Discrete(n)``: the smallest and largest value (past :data:`_SMALL` elements, one
    reduction: the largest value read as unsigned, so that a negative one is too large as
    well); a ``Box`` with one bound for every element: every value against it (past
    :data:`_SMALL`, ``min`` and ``max``: a NaN fails both); other Boxes: Gymnasium's
    ``Box.contains``."""

    def __init__(self, space: spaces.Space, n: int, shape: Tuple[int, ...], dtype: np.dtype) -> None:
        self.n, self.shape, self.dtype = n, shape, dtype
        self.discrete = isinstance(space, spaces.Discrete)
        if self.discrete:
            self.count = int(space.n)
            self.accepted = ((n,), (n, 1))
            return
        self.single = tuple(space.shape)
        self.batched = batch_space(space, n)
        low, high = np.asarray(space.low), np.asarray(space.high)
        self.uniform = None
        if low.size and (low == low.flat[0]).all() and (high == high.flat[0]).all():
            self.uniform = (low.flat[0], high.flat[0])

    def __call__(self, actions: Any) -> np.ndarray:
        try:
            a = actions if type(actions) is np.ndarray else np.asarray(actions)
        except Exception as e:  # noqa: BLE001 - e.g. a CUDA tensor
            raise ValueError(f"actions: cannot be read as an array ({e})") from e
        n = self.n
        if self.discrete:
            if a.shape not in self.accepted:
                raise ValueError(f"actions must have shape ({n},) or ({n}, 1), not {a.shape}")
            kind = a.dtype.kind
            if kind not in "iu":
                raise ValueError(f"actions must be integers for Discrete({self.count}), not {a.dtype}")
            if a.size <= _SMALL:
                values = a.ravel().tolist()
                outside = min(values) < 0 or max(values) >= self.count
            else:
                unsigned = a.view(a.dtype.str.replace("i", "u")) if kind == "i" else a
                outside = np.maximum.reduce(unsigned, axis=None) >= self.count
            if outside:
                bad = np.flatnonzero(((a < 0) | (a >= self.count)).ravel())
                i = int(bad[0])
                raise ValueError(f"actions[{i}] = {a.ravel()[i]} is not in Discrete({self.count}) (and maybe others)")
            return a.reshape(self.shape)
        single = self.single
        if a.shape != (n, *single) and not (single == (1,) and a.shape == (n,)):
            raise ValueError(f"actions must have shape {(n, *single)}, not {a.shape}")
        if a.dtype.kind not in "fiu":
            raise ValueError(f"actions must be numbers, not {a.dtype}")
        cast = a.astype(self.dtype, copy=False).reshape(self.shape)
        if self.uniform is not None:
            low, high = self.uniform
            if cast.size <= _SMALL:
                values = cast.ravel().tolist()
                # min/max of Python floats skip a NaN: compare every value instead.
                inside = all(low <= v <= high for v in values)
            else:
                inside = bool(np.minimum.reduce(cast, axis=None) >= low) and bool(
                    np.maximum.reduce(cast, axis=None) <= high
                )
        else:
            inside = self.batched.contains(cast.reshape(self.batched.shape))
        if not inside:
            raise ValueError(f"actions are not in {self.batched}")
        return cast


class ShmVectorEnv(VectorEnv):
    """A :class:`gymnasium.vector.VectorEnv` whose environments run in a shmbridge engine.

    Args:
        env: the reference engine to launch (``"cartpole"``, ``"null"``); ignored with
            ``client``.
        num_envs: number of environments. Launching: default 256 (``shmbridge.launch``'s).
            With ``client``: ``None`` or the client's ``num_envs``.
        client: an attached :class:`shmbridge.Client` to use instead of launching.
        seed: used by the first ``reset()`` called without a seed (and, when launching, to
            start the engine; ``None``: a seed from the OS).
        copy: return fresh arrays (default) or read-only views of the shared memory that
            the next ``step``/``reset`` overwrites.
        close_client: whether ``close()`` closes the client. Default: ``True`` for an
            engine this env launched (closing it stops the engine and removes its region),
            ``False`` for a ``client`` passed in (its owner closes it).
        timeout: seconds ``step`` waits for a frame (``None``: no limit; a dead engine is
            reported anyway) and ``reset`` for its reply (``None``: 10 s).
        max_episode_steps: accepted for Gymnasium's ``make_vec``; must be ``None`` or
            the engine's own limit (metadata ``max_episode_steps``): the engine truncates.
        render_mode: must be ``None``.
        **launch_args: passed to :func:`shmbridge.launch` (``spin_us``, ``blocking``,
            ``obs_dim``, ``act_dim``, ...).

    Attributes beyond Gymnasium's: :attr:`client`, ``schema`` (the engine's schema).
    """

    metadata: Dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        env: str = "cartpole",
        num_envs: Optional[int] = None,
        *,
        client: Optional[Client] = None,
        seed: Optional[int] = None,
        copy: bool = True,
        close_client: Optional[bool] = None,
        timeout: Optional[float] = None,
        max_episode_steps: Optional[int] = None,
        render_mode: Optional[str] = None,
        **launch_args: Any,
    ) -> None:
        if render_mode is not None:
            raise ValueError(f"render_mode={render_mode!r}: ShmVectorEnv does not render")
        if seed is not None:
            self._check_seed(seed)
        self._client: Optional[Client] = None
        self.closed = True  # until the client is in hand: close() is then a no-op
        if client is None:
            from . import launch

            engine_seed = seed if seed is not None else secrets.randbits(63)
            if num_envs is not None:
                launch_args["num_envs"] = num_envs
            client = launch(env, seed=engine_seed, **launch_args)
            owned = True
        else:
            if launch_args:
                raise TypeError(f"with client=, launch arguments make no sense: {sorted(launch_args)}")
            if num_envs is not None and num_envs != client.num_envs:
                raise ValueError(f"num_envs={num_envs} but the client's engine has {client.num_envs}")
            owned = False
        self._client = client
        self._close_client = owned if close_client is None else bool(close_client)
        self.closed = False
        try:
            self._setup(seed, copy, timeout, max_episode_steps)
        except BaseException:
            self.close()
            raise

    def _setup(
        self, seed: Optional[int], copy: bool, timeout: Optional[float], max_episode_steps: Optional[int]
    ) -> None:
        client = self.client
        self.num_envs = n = client.num_envs
        self._copy = bool(copy)
        self._step_timeout = timeout
        self._reset_timeout = 10.0 if timeout is None else timeout
        self._pending_seed = seed
        self._warned_unseeded = False
        self.schema: Dict[str, Any] = client.schema(self._reset_timeout)
        meta: Dict[str, str] = dict(self.schema.get("metadata", {}))
        tensors = {t["name"]: t for t in self.schema["tensors"]}
        for name in ("obs", "actions", "rewards", "terminated", "truncated"):
            if name not in tensors:
                raise ValueError(f"engine {client.engine_kind!r} serves no {name!r} tensor: not a Gymnasium-style env")

        # Observations.
        obs_t = tensors["obs"]
        obs_shape = tuple(obs_t["shape"][1:])
        obs_dtype = np.dtype(obs_t["dtype"])
        if "observation_low" in meta and "observation_high" in meta:
            size = int(np.prod(obs_shape, dtype=np.int64))
            low = _space_bounds(meta["observation_low"], "observation_low", size)
            high = _space_bounds(meta["observation_high"], "observation_high", size)
            self.single_observation_space = _box(obs_dtype, obs_shape, low, high)
        else:
            self.single_observation_space = _box(obs_dtype, obs_shape)

        # Actions.
        act_t = tensors["actions"]
        act_shape = tuple(act_t["shape"][1:])
        self._act_dtype = np.dtype(act_t["dtype"])
        kind = meta.get("action_space", "box")
        if kind.startswith("discrete:"):
            try:
                count = int(kind.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"engine metadata action_space={kind!r}: expected 'discrete:<n>'") from None
            if count < 1 or act_shape not in ((), (1,)) or not np.issubdtype(self._act_dtype, np.integer):
                raise ValueError(
                    f"engine metadata action_space={kind!r} but its actions tensor is "
                    f"{act_t['dtype']} {tuple(act_t['shape'])}: expected integers, one per env"
                )
            self.single_action_space = spaces.Discrete(count)
        elif kind == "box":
            if "action_low" in meta and "action_high" in meta:
                size = int(np.prod(act_shape, dtype=np.int64))
                low = _space_bounds(meta["action_low"], "action_low", size)
                high = _space_bounds(meta["action_high"], "action_high", size)
                self.single_action_space = _box(self._act_dtype, act_shape, low, high)
            else:
                self.single_action_space = _box(self._act_dtype, act_shape)
        else:
            raise ValueError(f"engine metadata action_space={kind!r}: expected 'discrete:<n>' or 'box'")
        self.observation_space = batch_space(self.single_observation_space, n)
        self.action_space = batch_space(self.single_action_space, n)

        # Autoreset, episode limit.
        mode = meta.get("autoreset_mode")
        if mode is None:
            autoreset = AutoresetMode.DISABLED
        elif mode in AUTORESET_MODES:
            autoreset = AUTORESET_MODES[mode]
        else:
            raise ValueError(f"engine metadata autoreset_mode={mode!r}: expected one of {sorted(AUTORESET_MODES)}")
        engine_limit = int(meta["max_episode_steps"]) if "max_episode_steps" in meta else None
        if max_episode_steps is not None and max_episode_steps != engine_limit:
            raise ValueError(
                f"max_episode_steps={max_episode_steps}: the engine truncates episodes itself "
                f"({'at ' + str(engine_limit) + ' steps' if engine_limit else 'never'}); it cannot be changed here"
            )
        self.max_episode_steps = engine_limit
        self.metadata = {**type(self).metadata, "autoreset_mode": autoreset}
        if "env_id" in meta:
            self.metadata["engine_env_id"] = meta["env_id"]
        self.render_mode = None

        # Persistent views of the shared tensors (never copies).
        self._views: Dict[str, np.ndarray] = {
            name: _read_only_view(client, name) for name in ("obs", "rewards", "terminated", "truncated")
        }
        self._step_views = tuple(self._views[name] for name in ("obs", "rewards", "terminated", "truncated"))
        self._actions_view = np.asarray(client.actions)
        if self._actions_view.shape != tuple(act_t["shape"]):
            raise ValueError(f"actions tensor has shape {self._actions_view.shape}, schema says {act_t['shape']}")
        self._action_check = _ActionCheck(self.single_action_space, n, self._actions_view.shape, self._act_dtype)

        # The finished episodes' last observations (metadata `final_obs` names the tensor):
        # returned in `infos` only under same-step autoreset, as Gymnasium's vector envs do.
        self._final_view: Optional[np.ndarray] = None
        final_name = meta.get("final_obs")
        if final_name is not None and autoreset is AutoresetMode.SAME_STEP:
            final_t = tensors.get(final_name)
            if final_t is None:
                raise ValueError(f"engine metadata final_obs={final_name!r} names no tensor of the engine")
            if (final_t["dtype"], tuple(final_t["shape"]), final_t["direction"]) != (
                obs_t["dtype"], tuple(obs_t["shape"]), obs_t["direction"]
            ):
                raise ValueError(
                    f"engine metadata final_obs={final_name!r}: that tensor is {final_t['dtype']} "
                    f"{tuple(final_t['shape'])} {final_t['direction']}, the observations "
                    f"{obs_t['dtype']} {tuple(obs_t['shape'])} {obs_t['direction']}"
                )
            self._final_view = _read_only_view(client, final_name)

    # --- properties ----------------------------------------------------------------------

    @property
    def client(self) -> Client:
        """The shmbridge client (its other tensors, ``call``, ``ping``, ...)."""
        if self._client is None:
            raise gymnasium.error.ClosedEnvironmentError("ShmVectorEnv has no client")
        return self._client

    def _live_client(self) -> Client:
        if self.closed:
            raise gymnasium.error.ClosedEnvironmentError("this ShmVectorEnv is closed")
        return self.client

    def _out(self, name: str) -> np.ndarray:
        view = self._views[name]
        return np.array(view) if self._copy else view

    # --- reset ---------------------------------------------------------------------------

    @staticmethod
    def _check_seed(seed: Any) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, not {seed!r}")

    def _seeds(self, seed: Seed) -> Optional[List[Optional[int]]]:
        """``None`` (no seeds) or one seed (or None) per env, as Gymnasium's vector envs."""
        if seed is None:
            return None
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            self._check_seed(seed)
            return [int(seed) + i for i in range(self.num_envs)]
        if isinstance(seed, (str, bytes)) or not isinstance(seed, Sequence) and not isinstance(seed, np.ndarray):
            raise TypeError(f"seed must be None, an int or a list of num_envs ints/None, not {type(seed).__name__}")
        seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise ValueError(f"a list of seeds must have num_envs={self.num_envs} entries, not {len(seeds)}")
        for s in seeds:
            if s is not None:
                self._check_seed(s)
        return [None if s is None else int(s) for s in seeds]

    def _engine_reset(self, ids: List[int], seeds: Optional[List[Optional[int]]]) -> None:
        """Resets envs ``ids`` (all: ``range(num_envs)``) with their seeds (by env id)."""
        client = self._live_client()
        everyone = len(ids) == self.num_envs
        env_ids = None if everyone else ids
        if seeds is None or all(seeds[i] is None for i in ids):
            client.reset(None, env_ids, self._reset_timeout)
            return
        seeded = [i for i in ids if seeds[i] is not None]
        unseeded = [i for i in ids if seeds[i] is None]
        if unseeded:
            client.reset(None, unseeded, self._reset_timeout)
        try:
            client.reset(
                [seeds[i] for i in seeded],
                None if len(seeded) == self.num_envs else seeded,
                self._reset_timeout,
            )
        except RemoteError as e:
            if getattr(e, "code", None) != _UNSUPPORTED:
                raise
            # An engine without seeds (null: nothing random). Reset without them.
            if not self._warned_unseeded:
                warnings.warn(
                    f"engine {client.engine_kind!r} takes no seeds ({e}); resetting without them",
                    stacklevel=3,
                )
                self._warned_unseeded = True
            client.reset(None, env_ids, self._reset_timeout)

    def reset(
        self,
        *,
        seed: Seed = None,
        options: Optional[Dict[str, Any]] = None,
    ) -> Tuple[np.ndarray, Dict[str, Any]]:
        """Resets every env, or those of ``options["reset_mask"]`` (a bool array of shape
        ``(num_envs,)`` with at least one ``True``), and returns ``(obs, {})``: the
        observations of all envs, the others unchanged.

        ``seed``: ``None``, an ``int`` ``s`` (env ``i`` gets ``s + i``), or one seed (or
        ``None``) per env; with a mask only the masked envs' seeds are used.
        """
        self._live_client()
        if seed is None and self._pending_seed is not None:
            seed = self._pending_seed
        seeds = self._seeds(seed)
        options = dict(options or {})
        mask = options.pop("reset_mask", None)
        if options:
            raise ValueError(f"unsupported reset options {sorted(options)}: only 'reset_mask'")
        if mask is None:
            ids = list(range(self.num_envs))
        else:
            if not isinstance(mask, np.ndarray):
                raise TypeError(f"options['reset_mask'] must be a numpy array, got {type(mask).__name__}")
            if mask.shape != (self.num_envs,):
                raise ValueError(f"options['reset_mask'] must have shape ({self.num_envs},), got {mask.shape}")
            if mask.dtype != np.bool_:
                raise TypeError(f"options['reset_mask'] must have dtype bool, got {mask.dtype}")
            if not mask.any():
                raise ValueError("options['reset_mask'] must have at least one True value")
            ids = [int(i) for i in np.flatnonzero(mask)]
        self._engine_reset(ids, seeds)
        self._pending_seed = None
        if isinstance(seed, (int, np.integer)):
            self._np_random, self._np_random_seed = seeding.np_random(int(seed))
        return self._out("obs"), {}

    # --- step ----------------------------------------------------------------------------

    def _final_infos(self) -> Dict[str, Any]:
        """``infos`` of the frame just stepped: ``{}``, or the finished envs' final
        observations laid out as ``SyncVectorEnv`` (SAME_STEP) lays them out through
        ``VectorEnv._add_info``: ``final_obs`` an object array (``None`` or a copy of the
        env's last observation), ``final_info`` a dict (here empty: no per-env infos),
        each with its ``_``-prefixed bool mask."""
        if self._final_view is None:
            return {}
        done = np.logical_or(self._views["terminated"], self._views["truncated"])
        ids = np.flatnonzero(done)
        if ids.size == 0:
            return {}
        final_obs = np.full(self.num_envs, fill_value=None, dtype=object)
        for i in ids:
            final_obs[i] = np.array(self._final_view[i])  # a copy, not a view of the region
        return {
            "final_obs": final_obs,
            "_final_obs": done,
            "final_info": {},
            "_final_info": done.copy(),
        }

    def step(
        self, actions: Any
    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Dict[str, Any]]:
        """Sends ``actions`` (validated first: ValueError, nothing sent) and returns
        ``(obs, rewards, terminated, truncated, infos)`` of the engine's next frame;
        ``infos`` is ``{}`` unless the engine serves final observations and some env
        finished (see the module's docstring)."""
        client = self._live_client()
        self._actions_view[...] = self._action_check(actions)
        client.step(None, self._step_timeout)
        # One attribute lookup per output (this runs every step: each Python-level call
        # or dict lookup is a sizeable part of a one-env CartPole step).
        views = self._step_views
        infos = {} if self._final_view is None else self._final_infos()
        if self._copy:
            return views[0].copy(), views[1].copy(), views[2].copy(), views[3].copy(), infos
        return views[0], views[1], views[2], views[3], infos

    # --- the rest ------------------------------------------------------------------------

    def render(self) -> None:
        """Not supported: the engines render nothing for Gymnasium."""
        raise NotImplementedError("ShmVectorEnv does not render")

    def close_extras(self, **kwargs: Any) -> None:
        """Closes the client if this env owns it (see ``close_client``)."""
        client, self._client = self._client, None
        if client is not None and self._close_client:
            client.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "closed", True):
                self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        base = super().__repr__()
        return base if self.closed else base[:-1] + f", engine={self.schema.get('engine_kind')!r})"


class ShmEnv(gymnasium.Env):
    """A one-env :class:`gymnasium.Env` over a shmbridge engine of one env: what
    ``gymnasium.make("shmbridge/CartPole-v1")`` makes (wrapped, as ``make`` wraps every env,
    in ``TimeLimit`` at the engine's own limit, ``OrderEnforcing`` and the passive checker).
    For many envs use :class:`ShmVectorEnv` (``gymnasium.make_vec``): one env per engine
    round trip is the slowest way to use an engine.

    It is :class:`ShmVectorEnv` with ``num_envs=1`` underneath (same arguments, spaces,
    seeding and action checks), returning Gymnasium's single-env values: the observation
    of the env (a fresh array), the reward as a ``float``, the flags as ``bool``, ``{}``
    as infos. When an episode ends, ``step`` returns its last observation (the engine's
    ``final_obs`` under same-step autoreset, the frame itself otherwise) and the next
    call must be ``reset()``: a ``step`` before it raises ``gymnasium.error.ResetNeeded``
    (the engine may already have started the next episode, or would start it in place of
    that step). An engine that resets in the same step but serves no final observations
    is refused (``ValueError``): its last observations are lost.

    Args: those of :class:`ShmVectorEnv` but ``num_envs`` (always 1) and ``copy``; a
    ``client`` passed in must serve exactly one env.
    """

    metadata: Dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        env: str = "cartpole",
        *,
        client: Optional[Client] = None,
        seed: Optional[int] = None,
        close_client: Optional[bool] = None,
        timeout: Optional[float] = None,
        max_episode_steps: Optional[int] = None,
        render_mode: Optional[str] = None,
        **launch_args: Any,
    ) -> None:
        if "num_envs" in launch_args:
            raise TypeError("ShmEnv serves one env: no num_envs (use ShmVectorEnv for more)")
        if client is not None and client.num_envs != 1:
            raise ValueError(
                f"ShmEnv serves one env but the client's engine has {client.num_envs}: use ShmVectorEnv"
            )
        self._done = False
        self._vec = ShmVectorEnv(
            env,
            None if client is not None else 1,
            client=client,
            seed=seed,
            copy=True,
            close_client=close_client,
            timeout=timeout,
            max_episode_steps=max_episode_steps,
            render_mode=render_mode,
            **launch_args,
        )
        vec = self._vec
        try:
            mode = vec.metadata["autoreset_mode"]
            self._final = mode is AutoresetMode.SAME_STEP
            if self._final and vec._final_view is None:
                raise ValueError(
                    f"engine {vec.client.engine_kind!r} resets an env in the step it finishes but serves "
                    "no final observations (metadata final_obs): a one-env view would lose every "
                    "episode's last observation; use ShmVectorEnv (gymnasium.make_vec)"
                )
        except BaseException:
            vec.close()
            raise
        self.observation_space = vec.single_observation_space
        self.action_space = vec.single_action_space
        self.metadata = dict(vec.metadata)
        self.render_mode = None
        self.max_episode_steps = vec.max_episode_steps

    @property
    def client(self) -> Client:
        """The shmbridge client (its other tensors, ``call``, ``ping``, ...)."""
        return self._vec.client

    @property
    def schema(self) -> Dict[str, Any]:
        return self._vec.schema

    def reset(
        self, *, seed: Optional[int] = None, options: Optional[Dict[str, Any]] = None
    ) -> Tuple[np.ndarray, Dict[str, Any]]:
        """Resets the env (with ``seed``, if given: the engine's generator for it, and
        ``np_random``) and returns ``(obs, {})``. ``options`` must be empty."""
        if seed is not None:
            ShmVectorEnv._check_seed(seed)
        if options:
            raise ValueError(f"unsupported reset options {sorted(options)}: ShmEnv takes none")
        super().reset(seed=seed)
        obs, _ = self._vec.reset(seed=seed)
        self._done = False
        return obs[0], {}

    def step(self, action: Any) -> Tuple[np.ndarray, float, bool, bool, Dict[str, Any]]:
        """Sends ``action`` (an element of ``action_space``; anything else raises
        ``ValueError`` and nothing is sent) and returns ``(obs, reward, terminated,
        truncated, {})``."""
        if self._done:
            raise gymnasium.error.ResetNeeded("the episode has ended: call reset() before step()")
        obs, rewards, terminated, truncated, infos = self._vec.step(np.asarray(action)[None])
        term, trunc = bool(terminated[0]), bool(truncated[0])
        self._done = term or trunc
        last = infos["final_obs"][0] if self._done and self._final else obs[0]
        return last, float(rewards[0]), term, trunc, {}

    def render(self) -> None:
        """Not supported: the engines render nothing for Gymnasium."""
        raise NotImplementedError("ShmEnv does not render")

    def close(self) -> None:
        """Closes the vector env underneath (and so the client, if it owns it)."""
        self._vec.close()

    def __repr__(self) -> str:
        return f"ShmEnv({self._vec!r})"


# `import shmbridge.gym` registers the ids too (a no-op if `import shmbridge` already did),
# so "shmbridge.gym:shmbridge/CartPole-v1" works with gymnasium.make_vec as well.
_gym_registration.register_envs()
