"""Adapters from shmbridge engines to the learning libraries people train with, one module
each, importable without its library (which is imported when an adapter is first used):

* :mod:`shmbridge.integrations.sb3`: a Stable-Baselines3 ``VecEnv`` (extra ``sb3``);
* :mod:`shmbridge.integrations.torchrl`: a TorchRL ``EnvBase`` (extra ``torchrl``);
* :mod:`shmbridge.integrations.rsl_rl`: an rsl_rl ``VecEnv`` (extra ``rsl_rl``);
* :mod:`shmbridge.integrations.skrl`: an skrl environment wrapper (extra ``skrl``).
* :mod:`shmbridge.integrations.cleanrl`: runs CleanRL's own ``ppo.py`` on an engine
  (``python -m shmbridge.integrations.cleanrl``; extra ``sb3``).

Each adapter takes the name of a reference engine to launch with its arguments, or any
:class:`shmbridge.Client` (``shmbridge.launch``, ``shmbridge.launch_gym`` shards, an engine
of your own attached with ``shmbridge.attach``). Guides: ``docs/learners/``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Dict


def require(module: str, extra: str, what: str) -> ModuleType:
    """Imports ``module``, or raises :class:`ImportError` naming the package extra that
    installs it (``pip install 'shmbridge[extra]'``) and what needed it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs {module.split('.')[0]}, which is not installed ({e}): "
            f"pip install 'shmbridge[{extra}]'"
        ) from e


def lazy_classes(module: str, makers: Dict[str, Callable[[], type]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving each class named in ``makers``, made by its maker
    on first use (it subclasses the library's, imported then) and kept: the module
    imports without its library."""
    made: Dict[str, type] = {}

    def __getattr__(attr: str) -> Any:
        if attr not in makers:
            raise AttributeError(f"module {module!r} has no attribute {attr!r}")
        if attr not in made:
            made[attr] = makers[attr]()
        return made[attr]

    return __getattr__


def lazy_class(module: str, name: str, make: Callable[[], type]) -> Callable[[str], Any]:
    """[`lazy_classes`] of one class."""
    return lazy_classes(module, {name: make})
