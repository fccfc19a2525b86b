"""What the tests check of the frames examples/c/vulkan_frames.comp draws on the device:
that they are, byte for byte, the CPU reference of the drawing
(``shmbridge.bench.vulkan.cartpole_frames``, which the benchmark checks them with too), and
where a client sees them. The shader draws each env's CartPole picture from two integers
the host computes from the observation (examples/c/vulkan_frames.c, ``vf_draw``); the
reference computes them the same way, in float64 from the float32 observation, and the
drawing is integer arithmetic only, so no rounding can differ between the device and
NumPy."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np

from shmbridge.bench.vulkan import cartpole_frames as reference_frames

__all__ = ["assert_frames", "mapping_of", "mappings_of_inode", "reference_frames"]


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
