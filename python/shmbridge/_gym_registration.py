"""Registers shmbridge's environments with Gymnasium, without importing Gymnasium.

``import shmbridge`` calls :func:`install`: if Gymnasium is already imported the ids are
registered at once; otherwise a one-shot import hook registers them right after
Gymnasium's own import finishes. So ``gymnasium.make_vec("shmbridge/CartPole-v1")`` works
after ``import shmbridge`` in either order, while ``import shmbridge`` stays free of
Gymnasium's import time (about 0.2 s; the engine processes that ``launch`` starts import
the package too) and works where Gymnasium is not installed.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Dict, Optional

#: Gymnasium id -> arguments of ``gymnasium.register`` (besides the entry point).
ENVS: Dict[str, Dict[str, Any]] = {
    "shmbridge/CartPole-v1": {
        "kwargs": {"env": "cartpole"},
        "max_episode_steps": 500,
        "reward_threshold": 475.0,
    },
}

VECTOR_ENTRY_POINT = "shmbridge.gym:ShmVectorEnv"
#: What ``gymnasium.make`` (one env) of an id of :data:`ENVS` makes.
ENTRY_POINT = "shmbridge.gym:ShmEnv"
#: Where ``shmbridge/<any Gymnasium id>`` leads: the env behind sharded engines.
SHARDED_ENTRY_POINT = "shmbridge.gym_shards:make_vec"
#: ``gymnasium.make`` of a sharded id: an error that says what to call instead.
SHARDED_SINGLE_ENTRY_POINT = "shmbridge._gym_registration:no_single_env"


def no_single_env(env_id: str, **kwargs: Any) -> Any:
    """The entry point of ``gymnasium.make("shmbridge/<env_id>")`` for a sharded id: there
    is no one-env form (one env behind a shard process is that env with a process in
    between), so it raises ``gymnasium.error.Error`` naming ``make_vec`` and ``make(env_id)``."""
    import gymnasium

    raise gymnasium.error.Error(
        f"shmbridge/{env_id} is a vector env: use gymnasium.make_vec('shmbridge/{env_id}', "
        f"num_envs=N), or gymnasium.make({env_id!r}) for one env in this process"
    )


def register_sharded(env_id: str) -> str:
    """Registers ``shmbridge/<env_id>``: ``gymnasium.make_vec`` of it runs Gymnasium's
    ``env_id`` behind sharded engines (``shmbridge.gym_shards.make_vec``; keyword
    arguments such as ``shards``, ``seed``, ``autoreset_mode`` pass through). Returns
    the new id. For ids registered after ``import shmbridge`` (ids in a namespace cannot
    be mirrored: call ``shmbridge.gym_shards.make_vec`` with them)."""
    import gymnasium

    sharded_id = f"shmbridge/{env_id}"
    if sharded_id not in gymnasium.registry:
        gymnasium.register(
            id=sharded_id,
            entry_point=SHARDED_SINGLE_ENTRY_POINT,
            vector_entry_point=SHARDED_ENTRY_POINT,
            kwargs={"env_id": env_id},
        )
    return sharded_id


def register_envs() -> None:
    """Registers every id of :data:`ENVS` that Gymnasium does not know yet, and
    ``shmbridge/<id>`` for every Gymnasium id without a namespace it knows now (except
    those of :data:`ENVS`: ``shmbridge/CartPole-v1`` stays the native Rust engine;
    Gymnasium's own CartPole behind shards is ``shmbridge.launch_gym("CartPole-v1")``)."""
    import gymnasium

    for env_id, args in ENVS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=ENTRY_POINT, vector_entry_point=VECTOR_ENTRY_POINT, **args)
    for env_id in list(gymnasium.registry):
        if "/" not in env_id and f"shmbridge/{env_id}" not in ENVS:
            register_sharded(env_id)


def _register_quietly() -> None:
    try:
        register_envs()
    except Exception as e:  # noqa: BLE001 - never break the user's `import gymnasium`
        warnings.warn(f"shmbridge: could not register its Gymnasium environments: {e!r}", stacklevel=2)


class _RegisterAfterGymnasiumImport:
    """A ``sys.meta_path`` finder that finds nothing itself: for ``gymnasium`` it asks the
    other finders for the spec and wraps its loader's ``exec_module`` so that the ids are
    registered once the module has executed; then it removes itself."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[Any]:
        if fullname != "gymnasium" or self._finding:
            return None
        import importlib.util

        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return None  # let the import machinery proceed (and report) as usual

        def exec_module_then_register(module: Any) -> None:
            exec_module(module)
            self.uninstall()
            _register_quietly()

        try:
            loader.exec_module = exec_module_then_register  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            return None
        return spec

    def uninstall(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def install() -> None:
    """Registers now if Gymnasium is imported, else once it is."""
    if sys.modules.get("gymnasium") is not None:
        _register_quietly()
    elif not any(isinstance(f, _RegisterAfterGymnasiumImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterGymnasiumImport())
