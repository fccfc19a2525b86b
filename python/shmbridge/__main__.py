"""The ``shmbridge`` command line: ``engine``, ``client``, ``ls``, ``inspect`` and ``gc``.

``python -m shmbridge`` and the ``shmbridge`` command that ``pip install`` puts on the
PATH run the command line of the Rust binary itself (``shmbridge._native.cli``), so both
take the same options and print the same output.
"""

import sys as _sys

from ._native import cli as _cli


def main(argv=None, prog: str = "shmbridge") -> int:
    """Runs the command line on ``argv`` (default: the process's arguments); returns
    the exit status. Ctrl-C stops it with status 130."""
    args = _sys.argv[1:] if argv is None else list(argv)
    try:
        return _cli([prog, *args])
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    _sys.exit(main(prog="python -m shmbridge"))
