"""The CartPole engine written in C# over the C# binding (examples/csharp, bindings/csharp),
run by Mono: stepped by a Python client for 10,000 steps next to the Rust reference
engine, every tensor compared bit for bit after every step; its observation span is the
shared memory itself (addresses compared)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import shmbridge

from native_engines import build_capi, build_csharp_engine, step_side_by_side


def _status_count() -> int:
    """The number of shmb_status constants in the C header (the C# enum must have them
    all: the engine's self-check compares each with the library's name for it)."""
    header = (Path(__file__).resolve().parents[2] / "include" / "shmbridge.h").read_text()
    body = header[: header.index("} shmb_status;")]
    body = body[body.rindex("typedef enum {") :]
    return len(re.findall(r"^\s*SHMB_[A-Z_]+ = ", body, re.M))


@pytest.fixture(scope="module")
def csharp_engine(tmp_path_factory):
    return build_csharp_engine(tmp_path_factory.mktemp("csharp"))


@pytest.fixture
def capi_on_loader_path(monkeypatch):
    """Mono finds libshmbridge.so (DllImport "shmbridge") through LD_LIBRARY_PATH."""
    lib = build_capi()
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib))
    return lib


def test_csharp_engine_matches_the_rust_cartpole_for_10000_steps(csharp_engine, capi_on_loader_path):
    command = ["mono", str(csharp_engine), "--num-envs", "16", "--seed", "11"]
    with shmbridge.launch(command=command) as cs, shmbridge.launch("cartpole", num_envs=16, seed=11) as rust:
        assert cs.engine_kind == "cartpole-cs"
        assert cs.schema()["metadata"] == rust.schema()["metadata"]
        episodes = step_side_by_side(cs, rust, 10_000)
    assert episodes > 5000, episodes


def test_csharp_spans_are_the_shared_memory(csharp_engine, capi_on_loader_path):
    """--self-check: the span's address is the C ABI's pointer and lies in the mapping
    of the region's /dev/shm file; the binding's status codes are the library's."""
    proc = subprocess.Popen(
        ["mono", str(csharp_engine), "--num-envs", "4", "--self-check"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith("shmbridge-"), (name, proc.stderr.read() if proc.poll() is not None else "")
        with shmbridge.attach(name) as client:
            client.step(np.ones((4, 1), dtype=np.int64))
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert ": same memory" in err, err
    assert f"status codes: {_status_count()} checked against the library" in err, err
    assert "client closed after 1 steps" in err, err
