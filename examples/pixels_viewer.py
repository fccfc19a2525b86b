"""The ``pixels`` engine's frames, read through shmbridge: a PNG grid of a few envs, or a
video (GIF or MP4) of a trained policy balancing from pixels.

    python examples/pixels_viewer.py                         # docs/pixels_grid.png
    python examples/pixels_viewer.py --steps 40 --out grid.png
    shmbridge-ppo --env pixels                               # trains, writes ppo_pixels.pt
    python examples/pixels_viewer.py --policy ppo_pixels.pt --video docs/pixels_policy.gif

The engine steps CartPole and draws each env's cart, pole and track with a Vulkan compute
shader into ``rgb``, memory it exports; ``client["rgb"]`` is this process's import of
that memory (kDLCPU on a machine without a GPU: Mesa's lavapipe), viewed here by NumPy
without a copy.

Without ``--policy`` each step pushes the carts with random actions, so the poles lean;
the PNG is the frame after ``--steps`` steps, with each env's state (cart x, pole angle)
printed on stdout.

With ``--policy`` (an agent ``shmbridge-ppo --env pixels`` saved), the policy acts on the
stacks of the engine it was trained on (its frame shape and stack, e.g. 48x48 grey, two
frames) while a second engine with the same seed, fed the same actions, draws the same
episodes in colour at ``--image`` for the video: both engines are deterministic, so
their envs stay in step (checked every frame against the first engine's observations).
``--video`` writes the colour frames of the first ``--num-envs`` envs, tiled, through
imageio: ``.gif`` with Pillow, ``.mp4`` with imageio-ffmpeg (the ``video`` extra).
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
    """(n, H, W, C) frames (C: 1, 3 or 4) tiled `cols` wide, each scaled up `scale`
    times, RGB."""
    n, h, w, c = frames.shape
    rows = -(-n // cols)
    hs, ws = h * scale, w * scale
    out = np.full((rows * hs + (rows + 1) * gap, cols * ws + (cols + 1) * gap, 3), 40, np.uint8)
    for i in range(n):
        r, col = divmod(i, cols)
        rgb = np.repeat(frames[i], 3, axis=2) if c == 1 else frames[i, :, :, :3]
        tile = rgb.repeat(scale, axis=0).repeat(scale, axis=1)
        y, x = gap + r * (hs + gap), gap + col * (ws + gap)
        out[y:y + hs, x:x + ws] = tile
    return out


def snapshot(a: argparse.Namespace) -> int:
    """The PNG grid after `a.steps` random steps."""
    rng = np.random.default_rng(a.seed)
    with shmbridge.launch("pixels", num_envs=a.num_envs, seed=a.seed, image=a.image,
                          frame_stack=1, image_device=a.image_device) as client:
        rgb = np.from_dlpack(client["rgb"])  # the import of the engine's frames: no copy
        assert rgb.ctypes.data == client["rgb"].data_ptr
        print(f"rgb {rgb.shape} {rgb.dtype}: {client.importer}")
        actions = np.from_dlpack(client.actions)
        for _ in range(a.steps):
            actions[:] = rng.integers(0, 2, size=actions.shape)
            client.step()
        obs = np.asarray(client.obs)
        states = ", ".join(f"{i}: x {o[0]:+.2f} θ {o[2]:+.3f}" for i, o in enumerate(obs[:4]))
        print(f"frame {client.frame}; {states}, ...")
        image = grid(rgb[:16, -1], cols=4, scale=a.scale)
    out = os.path.normpath(a.out)
    write_png(out, image)
    print(f"wrote {out} ({image.shape[1]}x{image.shape[0]})")
    return 0


def video(a: argparse.Namespace) -> int:
    """A video of the policy in `a.policy` acting on `a.num_envs` envs for `a.steps` steps."""
    import imageio.v3 as iio
    import torch

    from shmbridge.examples.ppo_pixels import load_agent, stack_channels

    agent, image, stack = load_agent(a.policy)
    n = a.num_envs
    frames, returns, ret = [], [], np.zeros(n)
    with shmbridge.launch("pixels", num_envs=n, seed=a.seed, image=image, frame_stack=stack,
                          image_device=a.image_device) as seen, \
            shmbridge.launch("pixels", num_envs=n, seed=a.seed, image=a.image, frame_stack=1,
                             image_device=a.image_device) as shown:
        policy_in = stack_channels(torch.from_dlpack(seen["rgb"]))  # the agent's input, in place
        _, k, c, h, w = policy_in.shape
        colour = np.from_dlpack(shown["rgb"])  # (n, 1, H, W, 4): the video's frames, in place
        acts = [torch.from_dlpack(x.actions) for x in (seen, shown)]
        obs = [np.from_dlpack(x.obs) for x in (seen, shown)]
        terminated, truncated = (np.from_dlpack(seen[name]) for name in ("terminated", "truncated"))
        print(f"policy {a.policy}: {image} frames, stack {stack}; video {a.image} ({shown.importer})")
        for step in range(a.steps):
            frames.append(grid(colour[:, 0], cols=a.cols, scale=a.scale))
            with torch.no_grad():
                logits, _ = agent.evaluate(policy_in.reshape(n, k * c, h, w))
            action = logits.argmax(-1, keepdim=True)
            for act in acts:
                act.copy_(action)
            seen.step()
            shown.step()
            if not np.array_equal(obs[0], obs[1]):
                raise RuntimeError(f"step {step}: the two engines' envs are not in step")
            ret += 1
            ended = terminated.astype(bool) | truncated.astype(bool)
            returns += ret[ended].tolist()
            ret[ended] = 0
    out = os.path.normpath(a.video)
    if out.lower().endswith(".gif"):
        iio.imwrite(out, np.stack(frames), extension=".gif", duration=1000 // a.fps, loop=0)
    else:
        iio.imwrite(out, np.stack(frames), plugin="FFMPEG", fps=a.fps)
    finished = f"episodes ended: {returns}" if returns else "no episode ended"
    print(f"wrote {out} ({len(frames)} frames of {frames[0].shape[1]}x{frames[0].shape[0]}, "
          f"{os.path.getsize(out):,} bytes); {finished}; returns so far {ret.tolist()}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-envs", type=int, default=None,
                   help="envs shown (default: 16 in the PNG, 4 in a video)")
    p.add_argument("--steps", type=int, default=None,
                   help="random steps before the PNG (default 24); frames in a video (default 300)")
    p.add_argument("--image", default="84x84x4", help="frame shape HxWxC of the picture shown")
    p.add_argument("--scale", type=int, default=2, help="pixel scale")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--image-device", choices=["vulkan", "host"], default="vulkan",
                   help="where the engines draw: Vulkan memory they export, or shared memory")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs",
                                                 "pixels_grid.png"), help="the PNG")
    p.add_argument("--policy", default=None, help="an agent shmbridge-ppo --env pixels saved: "
                                                  "write a video of it (--video)")
    p.add_argument("--video", default="pixels_policy.gif", help="the video: .gif or .mp4")
    p.add_argument("--fps", type=int, default=25, help="video frames per second")
    p.add_argument("--cols", type=int, default=2, help="envs per row in the video")
    a = p.parse_args(argv)
    if a.policy:
        a.num_envs = a.num_envs or 4
        a.steps = a.steps or 300
        return video(a)
    a.num_envs = a.num_envs or 16
    a.steps = a.steps if a.steps is not None else 24
    return snapshot(a)


if __name__ == "__main__":
    sys.exit(main())
