"""``python -m shmbridge._engine ARGS``: the same as ``shmbridge engine ARGS`` (serve a
reference engine; the region name is printed on stdout once frame 0 is published).
Kept for scripts that start engines this way; ``shmbridge.launch()`` runs
``python -m shmbridge engine``.
"""

import sys as _sys

from .__main__ import main as _main

if __name__ == "__main__":
    _sys.exit(_main(["engine", *_sys.argv[1:]], prog="python -m shmbridge._engine"))
