"""Engines written against the C ABI, for the tests: builds ``libshmbridge.so`` with cargo
(the `capi` member), compiles ``examples/c/cartpole_engine.c`` with ``cc`` and the C#
binding and engine with Mono's ``mcs``, and steps any of them next to the Rust reference
CartPole, comparing every tensor bit for bit."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

import shmbridge

ROOT = Path(__file__).resolve().parents[2]
TENSORS = ("obs", "rewards", "terminated", "truncated", "final_obs")


def build_capi() -> Path:
    """``cargo build -p shmbridge-capi``; returns the folder holding libshmbridge.so."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug"
    subprocess.run(["cargo", "build", "--locked", "-q", "-p", "shmbridge-capi"], cwd=ROOT, check=True)
    lib = ctypes.CDLL(str(target / "libshmbridge.so"))
    assert lib.shmb_abi_version() == 1, "not the C library (another build wrote libshmbridge.so?)"
    return target


def build_c_engine(lib: Path, out: Path) -> Path:
    exe = out / "cartpole_engine"
    subprocess.run(
        ["cc", "-std=c11", "-D_GNU_SOURCE", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
         "-I", str(ROOT / "include"), str(ROOT / "examples/c/cartpole_engine.c"),
         "-L", str(lib), f"-Wl,-rpath,{lib}", "-lshmbridge", "-lm", "-o", str(exe)],
        check=True,
    )
    return exe


def build_csharp(program: str, out: Path) -> Path:
    """The C# binding and ``program`` (a path under the repository), compiled by Mono's
    mcs into ``out``."""
    mcs = shutil.which("mcs")
    assert mcs, "mcs not found: scripts/test.sh installs mono-mcs and mono-runtime"
    exe = out / (Path(program).stem + ".exe")
    subprocess.run(
        [mcs, "-unsafe", "-langversion:7.2", "-warnaserror", f"-out:{exe}",
         str(ROOT / "bindings/csharp/Shmbridge.cs"), str(ROOT / program)],
        check=True,
    )
    return exe


def build_csharp_engine(out: Path) -> Path:
    """The C# binding and CartPole engine, compiled by Mono's mcs into ``out``."""
    return build_csharp("examples/csharp/CartPoleEngine.cs", out)


def same_frames(engine: shmbridge.Client, reference: shmbridge.Client, step: int) -> None:
    for name in TENSORS:
        a, b = np.asarray(engine[name]), np.asarray(reference[name])
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
        if a.tobytes() != b.tobytes():
            diff = np.argwhere(a != b)[:5].tolist()
            raise AssertionError(f"step {step}: {name!r} differs at {diff}: {a.ravel()[:8]} vs {b.ravel()[:8]}")


def step_side_by_side(engine: shmbridge.Client, reference: shmbridge.Client, steps: int) -> int:
    """Steps both clients with the same actions (a fixed pseudo-random policy, resets by
    mask, by command with seeds, and a pole-length change) and checks that every tensor
    is the same, bit for bit, after every step and command. Returns how many episodes
    ended."""
    n = engine.num_envs
    assert reference.num_envs == n
    rng = np.random.default_rng(1234)
    same_frames(engine, reference, 0)
    episodes = 0
    for step in range(1, steps + 1):
        actions = rng.integers(0, 2, size=(n, 1), dtype=np.int64)
        mask = np.zeros(n, dtype=np.bool_)
        if step % 97 == 0:
            mask[step % n] = True
        for client in (engine, reference):
            np.asarray(client.reset_mask)[:] = mask
            client.step(actions)
        same_frames(engine, reference, step)
        episodes += int(np.asarray(reference.terminated).sum() + np.asarray(reference.truncated).sum())
        if step % 1000 == 500:
            for client in (engine, reference):
                client.reset(seed=step)
            same_frames(engine, reference, step)
        if step % 1000 == 700:
            ids = [n - 1, 0, n - 1]
            for client in (engine, reference):
                client.reset(seed=[step, step + 1, step + 2], env_ids=ids)
            same_frames(engine, reference, step)
        if step == steps // 2:
            replies = [c.call("set_pole_length", length="0.6") for c in (engine, reference)]
            assert replies[0] == replies[1] == {"previous": "0.5"}, replies
    return episodes
