"""``shmbridge view NAME``: a page on 127.0.0.1 that shows a running engine live.

The page shows the tiled frames of an image engine (the first envs of its image tensor),
live plots of the episode return and the env steps per second, and, for engines
without images, the live values of chosen observation components. The server is a
read-only observer (``shmbridge.observe``): the engine and the learner never wait for
it and never see it. Frames travel over a WebSocket, the newest only: a slow browser
gets fewer frames, never a queue. A random token in the printed URL keeps other local
users out. When the engine ends the page says so, and it picks up a new engine that
serves the same name.

Needs the ``view`` extra: ``pip install 'shmbridge[view]'`` (aiohttp, Pillow).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

__all__ = ["main", "parser"]


def _components(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated indices, e.g. 0,2") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: one or more non-negative indices")
    return values


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text}: must be positive")
        return value

    return parse


def _in_range(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a whole number from {low} to {high}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text}: must be from {low} to {high}")
        return value

    return parse


def _tensor_name(text: str) -> str:
    if not text.strip() or len(text) > 255:
        raise argparse.ArgumentTypeError(f"{text!r}: the name of one of the engine's tensors, e.g. rgb")
    return text


def parser(prog: str = "shmbridge view") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve a page on 127.0.0.1 that shows the engine serving region NAME live: "
        "its frames, episode returns and step rate (read-only: the engine and learner never wait for it).",
    )
    p.add_argument("name", help="the region name the engine printed")
    p.add_argument("--port", type=_in_range(0, 65535), default=0, help="port on 127.0.0.1 (default: a free one)")
    p.add_argument("--grid", type=_positive(int), default=16, help="image engines: tile the first G envs (default 16)")
    p.add_argument("--fps", type=_positive(float), default=30.0, help="most frames a second sent to the page (default 30)")
    p.add_argument("--tensor", type=_tensor_name, default=None,
                   help="the image tensor (default: rgb, or the first u8 image); one the engine does not serve, "
                        "or that is no image, is said on the page")
    p.add_argument("--obs", default="obs", help="state-only engines: the tensor whose values are plotted (default obs)")
    p.add_argument("--env", type=_in_range(0, 2**32 - 1), default=0,
                   help="state-only engines: the env whose values are plotted (default 0)")
    p.add_argument("--components", type=_components, default=None,
                   help="state-only engines: the components plotted, e.g. 0,2 (default: the first four)")
    p.add_argument("--quality", type=_in_range(1, 95), default=85, help="JPEG quality of the frames, 1 to 95 (default 85)")
    p.add_argument("--open", action="store_true",
                   help="open the page in the default browser (through a file only this user can read: the token "
                        "never appears on a command line)")
    return p


def main(argv: Optional[Sequence[str]] = None, prog: str = "shmbridge view") -> int:
    """Runs the viewer until Ctrl-C; returns the exit status."""
    args = parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        from .server import serve
    except ImportError as e:  # aiohttp or Pillow missing
        print(f"{prog}: {e.name or e} is not installed: pip install 'shmbridge[view]'", file=sys.stderr)
        return 1
    try:
        return serve(args)
    except KeyboardInterrupt:
        return 130
