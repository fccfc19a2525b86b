"""Saves a PNG grid of the first 16 envs' frames of the ``pixels`` engine, read through
shmbridge.

    python examples/pixels_viewer.py                         # docs/pixels_grid.png
    python examples/pixels_viewer.py --steps 40 --out grid.png

The engine steps CartPole and renders each env's cart, pole and track with a Vulkan
compute shader into ``rgb``, memory it exports; ``client["rgb"]`` is this process's
import of that memory (kDLCPU on a machine without a GPU: Mesa's lavapipe), viewed here by
NumPy without a copy. Each step pushes the carts with random actions, so the poles lean;
the grid is the frame after ``--steps`` steps, with the step and each env's state
(cart x, pole angle) in the title line printed on stdout.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import zlib

import numpy as np

import shmbridge


def write_png(path: str, rgb: np.ndarray) -> None:
    """Writes an (H, W, 3) uint8 image as an 8-bit RGB PNG (no dependency but zlib)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
        f.write(chunk(b"IEND", b""))


def grid(frames: np.ndarray, cols: int, scale: int, gap: int = 4) -> np.ndarray:
    """(n, H, W, 4) frames tiled `cols` wide, each scaled up `scale` times, RGB."""
    n, h, w, _ = frames.shape
    rows = -(-n // cols)
    hs, ws = h * scale, w * scale
    out = np.full((rows * hs + (rows + 1) * gap, cols * ws + (cols + 1) * gap, 3), 40, np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        tile = frames[i, :, :, :3].repeat(scale, axis=0).repeat(scale, axis=1)
        y, x = gap + r * (hs + gap), gap + c * (ws + gap)
        out[y:y + hs, x:x + ws] = tile
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-envs", type=int, default=16, help="envs in the grid")
    p.add_argument("--steps", type=int, default=24, help="random steps before the snapshot")
    p.add_argument("--image", default="84x84x4", help="frame size HxWx4")
    p.add_argument("--scale", type=int, default=2, help="pixel scale in the PNG")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs",
                                                 "pixels_grid.png"))
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    with shmbridge.launch("pixels", num_envs=a.num_envs, seed=a.seed, image=a.image) as client:
        rgb = np.from_dlpack(client["rgb"])  # the import of the engine's frame: no copy
        assert rgb.ctypes.data == client["rgb"].data_ptr
        print(f"rgb {rgb.shape} {rgb.dtype}: {client.importer}")
        actions = np.from_dlpack(client.actions)
        for _ in range(a.steps):
            actions[:] = rng.integers(0, 2, size=actions.shape)
            client.step()
        obs = np.asarray(client.obs)
        states = ", ".join(f"{i}: x {o[0]:+.2f} θ {o[2]:+.3f}" for i, o in enumerate(obs[:4]))
        print(f"frame {client.frame}; {states}, ...")
        image = grid(rgb[:16], cols=4, scale=a.scale)
    out = os.path.normpath(a.out)
    write_png(out, image)
    print(f"wrote {out} ({image.shape[1]}x{image.shape[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
