"""``python -m shmbridge._engine``: serve a reference engine, like ``shmbridge engine``.

Prints the region name on stdout once frame 0 is published, then serves until the client
closes. ``shmbridge.launch()`` runs this in a child process.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from . import _native


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shmbridge._engine", description=__doc__)
    p.add_argument("--env", default="cartpole", help="reference env: null or cartpole")
    p.add_argument("--num-envs", type=int, default=256)
    p.add_argument("--name", default=None, help="region name (default: random)")
    p.add_argument("--obs-dim", type=int, default=None, help="null: f32 obs per env")
    p.add_argument("--act-dim", type=int, default=None, help="null: f32 actions per env")
    p.add_argument("--sparse", action="store_true", help="null: write first/last only")
    p.add_argument("--image", default=None, metavar="HxWxC",
                   help="null: also serve rgb, uint8 (num_envs, H, W, C), e.g. 84x84x3")
    p.add_argument("--seed", type=int, default=0, help="cartpole: seed")
    p.add_argument("--spin-us", type=float, default=None, help="spin budget (us)")
    p.add_argument("--blocking", action="store_true", help="never spin")
    p.add_argument("--idle-timeout", type=float, default=3600.0,
                   help="give up after this many seconds without an action")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, cuda:N or auto (CUDA when usable, else host memory)")
    a = p.parse_args(argv)
    try:
        # Every option is a keyword argument of run_engine, under the same name.
        steps = _native.run_engine(**vars(a))
    except Exception as e:  # noqa: BLE001 - report any failure like the CLI does
        print(f"shmbridge: error: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"shmbridge: client closed after {steps} steps", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
