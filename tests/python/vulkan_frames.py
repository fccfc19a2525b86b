"""The CPU reference of the frames examples/c/vulkan_frames.comp draws on the device, byte
for byte, and what the tests check of the memory a client sees them in.

The shader draws each env's CartPole picture from two integers the host computes from the
observation (examples/c/vulkan_frames.c, ``vf_draw``): the cart's centre column and the
pole tip's offset. Both are computed here the same way, in float64 from the float32
observation, with the same rounding (floor) and clamping; the drawing is integer
arithmetic only, so no rounding can differ between the device and NumPy."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np

SKY = (255, 255, 255, 255)
TRACK = (0, 0, 0, 255)
POLE = (204, 153, 102, 255)
CART = (60, 60, 200, 255)


def _clamp_floor(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    f = np.floor(v)
    f = np.where(np.isnan(f), 0.0, f)
    return np.clip(f, lo, hi).astype(np.int64)


def reference_frames(obs: np.ndarray, height: int, width: int) -> np.ndarray:
    """The frames ``vf_draw`` draws for observations ``obs`` (f32 ``[N, 4]``): u8
    ``[N, height, width, 4]``."""
    obs = np.asarray(obs, dtype=np.float32)
    n, h, w = obs.shape[0], height, width
    pole_length = max(h * 2 // 5, 4)
    cx = w // 2 + _clamp_floor(obs[:, 0].astype(np.float64) * (w / 4.8), -w, w)
    dx = _clamp_floor(obs[:, 2].astype(np.float64) * float(pole_length), -2 * pole_length, 2 * pole_length)
    ground = h * 3 // 4
    pivot = ground - max(h // 10, 3)
    cart_half_width = max(w // 16, 2)
    pole_half_width = max(w // 64, 1)

    ys = np.arange(h)[None, :, None]
    xs = np.arange(w)[None, None, :]
    cx, dx = cx[:, None, None], dx[:, None, None]
    frames = np.empty((n, h, w, 4), dtype=np.uint8)
    frames[:] = SKY
    frames[:, ground] = TRACK
    above = pivot - ys
    centre = cx + (dx * above) // pole_length  # floor division, as the shader's floor_div
    pole = (above >= 1) & (above <= pole_length) & (np.abs(xs - centre) <= pole_half_width)
    frames[pole] = POLE
    frames[(ys >= pivot) & (ys < ground) & (np.abs(xs - cx) <= cart_half_width)] = CART
    return frames


def assert_frames(frames: np.ndarray, obs: np.ndarray, what: str) -> None:
    """``frames`` are the reference frames of ``obs``, byte for byte."""
    want = reference_frames(obs, frames.shape[1], frames.shape[2])
    if not np.array_equal(frames, want):
        bad = np.argwhere(frames != want)[:5].tolist()
        raise AssertionError(f"{what}: frames differ from the reference at {bad} "
                             f"(obs {np.asarray(obs)[bad[0][0]]})")


def mapping_of(address: int, pid: Optional[int] = None) -> Tuple[int, int, str, str]:
    """The mapping of process ``pid`` (this one by default) that holds ``address``: its
    start, end, inode and path, from /proc/PID/maps."""
    for line in open(f"/proc/{pid or 'self'}/maps"):
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return start, end, fields[4], fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is in no mapping of process {pid or os.getpid()}")


def mappings_of_inode(inode: str, pid: Optional[int] = None) -> list:
    """The lines of /proc/PID/maps that map the file with ``inode``."""
    return [line for line in open(f"/proc/{pid or 'self'}/maps") if line.split()[4] == inode]
