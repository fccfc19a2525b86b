"""The ``shmbridge`` command line: ``engine``, ``client``, ``ls``, ``inspect``, ``gc`` and
``view``.

``python -m shmbridge`` and the ``shmbridge`` command that ``pip install`` puts on the
PATH run the command line of the Rust binary itself (``shmbridge._native.cli``), so both
take the same options and print the same output; ``view`` (a web page, served by
Python) goes to ``shmbridge.view``. The Rust parser lists it in ``--help``.
"""

import sys as _sys

from ._native import cli as _cli


def main(argv=None, prog: str = "shmbridge") -> int:
    """Runs the command line on ``argv`` (default: the process's arguments); returns
    the exit status. Ctrl-C stops it with status 130."""
    args = _sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["view"]:
        from .view import main as _view

        return _view(args[1:], prog=f"{prog} view")
    if args[:1] == ["engine"]:
        _mujoco_assets()
    try:
        return _cli([prog, *args])
    except KeyboardInterrupt:
        return 130


def mujoco_assets() -> "str | None":
    """The folder of the model files the native MuJoCo engines (``--env mujoco/<Task>``)
    read: ``SHMBRIDGE_MUJOCO_ASSETS`` where set, else the installed ``gymnasium``
    package's (found without importing it); ``None`` if neither."""
    import os
    from importlib.util import find_spec

    if "SHMBRIDGE_MUJOCO_ASSETS" in os.environ:
        return os.environ["SHMBRIDGE_MUJOCO_ASSETS"]
    spec = find_spec("gymnasium")
    if spec is not None and spec.submodule_search_locations:
        folder = os.path.join(list(spec.submodule_search_locations)[0], "envs", "mujoco", "assets")
        if os.path.isdir(folder):
            return folder
    return None


def _mujoco_assets() -> None:
    """The native MuJoCo engines read Gymnasium's model files at run time:
    ``SHMBRIDGE_MUJOCO_ASSETS`` names their folder (:func:`mujoco_assets`)."""
    import os

    folder = mujoco_assets()
    if folder is not None:
        os.environ["SHMBRIDGE_MUJOCO_ASSETS"] = folder


if __name__ == "__main__":
    _sys.exit(main(prog="python -m shmbridge"))
