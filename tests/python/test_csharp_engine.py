"""The CartPole engine written in C# over the C# binding (examples/csharp, bindings/csharp),
run by Mono: stepped by a Python client for 10,000 steps next to the Rust reference
engine, every tensor compared bit for bit after every step; its observation span is the
shared memory itself (addresses compared). And the binding's client
(tests/csharp/ClientCheck.cs) driving the Rust engine, frame for frame with a Python
client."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shmbridge

from native_engines import build_capi, build_csharp, build_csharp_engine, step_side_by_side


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


def _python_lines(name_steps: int, num_envs: int, seed: int) -> list:
    """What ClientCheck.exe must print after its zero-copy line, computed by a Python
    client on an engine of the same seed with the same actions and commands."""
    lines = []
    hexes = lambda *ts: " ".join(np.asarray(t).tobytes().hex() for t in ts)
    with shmbridge.launch("cartpole", num_envs, seed=seed) as c:
        for k in range(2 * name_steps):
            if k == name_steps:
                at = c.reset(seed=42, env_ids=[1, 3])
                lines.append(f"reset {at} {hexes(c.obs)}")
                reply = c.call("set_pole_length", length="0.75")
                lines.append(f"set_pole_length previous={reply['previous']} payload=0")
                with pytest.raises(shmbridge.RemoteError) as refused:
                    c.call("no_such_method", payload=bytes([1, 2, 3]))
                lines.append(f"refused Remote: {refused.value}")
            actions = np.array([[1 if (k * 7 + i * 3) % 5 < 2 else 0] for i in range(num_envs)], dtype=np.int64)
            c.step(actions)
            lines.append(f"frame {c.frame} {hexes(c.obs, c.rewards, c.terminated, c.truncated)}")
    return lines


def test_csharp_client_steps_resets_and_calls_frame_for_frame_with_a_python_client(tmp_path, capi_on_loader_path):
    client = build_csharp("tests/csharp/ClientCheck.cs", tmp_path)
    engine = subprocess.Popen(
        [sys.executable, "-m", "shmbridge", "engine", "--env", "cartpole", "--num-envs", "8", "--seed", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        name = engine.stdout.readline().strip()
        assert name.startswith("shmbridge-"), engine.stderr.read() if engine.poll() is not None else name
        out = subprocess.run(["mono", str(client), name, "60"], capture_output=True, text=True, timeout=120)
    finally:
        engine.terminate()
        _, engine_err = engine.communicate(timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "zero-copy same memory", lines[0]
    assert lines[-1] == "closed"
    expected = _python_lines(60, 8, 5)
    assert len(lines[1:-1]) == len(expected) == 123
    for got, want in zip(lines[1:-1], expected):
        assert got == want
    # The episodes ended and restarted in those 120 frames: the check covers autoreset.
    assert any(line.startswith("frame ") and line.split()[4].strip("0") for line in lines), "no episode ended"
    assert "client closed after 120 steps" in engine_err, engine_err
    assert name not in shmbridge.list_regions()


def test_each_status_throws_its_exception_and_a_step_not_posted_is_a_timeout(tmp_path, capi_on_loader_path):
    """Native.Check's status -> exception table, as Python's errors.py has it: NotPosted (a
    step that timed out before its action was sent) is its own class, caught by a
    `catch (TimeoutException)` as Python's NotPostedError is by `except TimeoutError`."""
    client = build_csharp("tests/csharp/ClientCheck.cs", tmp_path)
    out = subprocess.run(["mono", str(client), "--exceptions"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    thrown = {status: rest for status, rest in (line.split(" ", 1) for line in out.stdout.splitlines())}
    assert thrown["NotPosted"] == "NotPostedException timeout=True"
    assert thrown["Timeout"] == "TimeoutException timeout=True"
    assert thrown["EngineDied"] == thrown["ClientDied"] == "PeerDiedException timeout=False"
    assert thrown["EngineClosed"] == thrown["ClientClosed"] == "PeerClosedException timeout=False"
    assert thrown["NoSuchTensor"] == "NotFoundException timeout=False"
    # Every other status is still an exception (nothing returns quietly), and only those two are timeouts.
    assert all(" timeout=" in rest for rest in thrown.values()), out.stdout
    assert sorted(s for s, rest in thrown.items() if rest.endswith("timeout=True")) == ["NotPosted", "Timeout"]


def test_the_engine_references_the_binding_assembly_and_finds_the_library_by_the_loader_rules(tmp_path, monkeypatch):
    """The engine is built against Shmbridge.dll (mcs -r:), not the binding's source;
    DllImport("shmbridge") finds libshmbridge.so where docs/c-api.md says: through
    LD_LIBRARY_PATH (capi_on_loader_path, the other tests), or beside the assembly, and
    fails with DllNotFoundException where it is neither."""
    exe = build_csharp_engine(tmp_path)
    dll = tmp_path / "Shmbridge.dll"
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    command = ["mono", str(exe), "--num-envs", "4", "--seed", "1"]
    dll.rename(tmp_path / "elsewhere.dll")
    no_assembly = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert no_assembly.returncode != 0 and "Could not load file or assembly 'Shmbridge" in no_assembly.stderr, \
        no_assembly.stderr
    (tmp_path / "elsewhere.dll").rename(dll)
    no_library = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert no_library.returncode != 0 and "DllNotFoundException" in no_library.stderr, no_library.stderr
    shutil.copy(build_capi() / "libshmbridge.so", tmp_path / "libshmbridge.so")
    with shmbridge.launch(command=command) as cs:
        assert cs.engine_kind == "cartpole-cs"
        cs.step(np.zeros((4, 1), dtype=np.int64))
        assert cs.frame == 1
