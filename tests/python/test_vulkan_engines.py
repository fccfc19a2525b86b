"""Engines that render with Vulkan themselves and hand their own render target to the
learner through the C ABI (``shmb_spec_add_vulkan_export``): ``examples/c/vulkan_engine.c``
(CartPole whose frames a compute shader draws on the engine's own Vulkan device, into
memory the engine exported), the same from C# (``examples/csharp/VulkanCartPoleEngine.cs``
over ``bindings/csharp``, its renderer called through P/Invoke, run by Mono), and the
faults of such an engine (``capi/tests/vulkan_faults.c``, under AddressSanitizer and
UndefinedBehaviorSanitizer).

What is checked: the frames a Python client reads are the engine's memory (a torch view made
once, at an address inside the client's mapping of the imported memory, which the engine maps
too), byte for byte the frames ``tests/python/vulkan_frames.py`` computes on the CPU from the
observations, which are the Rust reference CartPole's bit for bit, over 1,000 steps with
resets by mask and by command; and each fault gives the learner a typed error, or stops
the engine before a learner could see it (what fstat shows), and leaves nothing behind. Every test skips, with the reason, where there is no Vulkan driver."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import shmbridge
from conftest import regions
from native_engines import (
    build_capi,
    build_csharp_vulkan_engine,
    build_vulkan_c,
    lavapipe,
    sanitizer_env,
    sanitizer_reports,
    step_side_by_side,
)
from vulkan_frames import assert_frames, mapping_of, mappings_of_inode, reference_frames

# A hang guard for a process's exit, not a timing check.
HANG = 60.0


@pytest.fixture(scope="module")
def capi():
    return build_capi()


@pytest.fixture(scope="module")
def vulkan_engine(capi, tmp_path_factory):
    return build_vulkan_c("examples/c/vulkan_engine.c", capi, tmp_path_factory.mktemp("vulkan"))


@pytest.fixture(scope="module")
def vulkan_engine_asan(capi, tmp_path_factory):
    return build_vulkan_c("examples/c/vulkan_engine.c", capi, tmp_path_factory.mktemp("vulkan-asan"),
                          sanitize=True)


@pytest.fixture(scope="module")
def faults_asan(capi, tmp_path_factory):
    return build_vulkan_c("capi/tests/vulkan_faults.c", capi, tmp_path_factory.mktemp("faults-asan"),
                          sanitize=True)


def launch_or_skip(command, **kwargs) -> shmbridge.Client:
    try:
        return shmbridge.launch(command=[str(c) for c in command], **kwargs)
    except shmbridge.EngineStartError as e:
        if "Vulkan is unavailable" in str(e):
            pytest.skip(f"no Vulkan driver here: {e}")
        raise


def first_line(proc: subprocess.Popen) -> str:
    """The first line ``proc`` prints on stdout ('' if it exits first); fails rather than
    hangs if nothing comes within HANG seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], HANG)
    if not ready:
        proc.kill()
        raise AssertionError(f"no line from {proc.args} in {HANG} s")
    return proc.stdout.readline().strip()


def same_memory_as_the_engine(client: shmbridge.Client, view: torch.Tensor) -> str:
    """Asserts that ``view`` (a torch view of ``client['frames']``) is the client's mapping of
    the memory the engine exported: its address is the tensor's, it lies inside one shared
    mapping of this process that is not the region, and (where the driver's memory is a
    memfd, as lavapipe's) the engine process maps that same file. Returns what was found."""
    frames = client["frames"]
    ptr = view.data_ptr()
    assert ptr == frames.data_ptr != 0
    start, end, inode, path = mapping_of(ptr)
    assert ptr + view.numel() * view.element_size() <= end, "the view runs past its mapping"
    assert not path.endswith(client.name), "the frames are in the region, not the engine's memory"
    found = f"{ptr:#x} in {start:#x}-{end:#x} ({path or 'anonymous'}, inode {inode})"
    if path.startswith("/memfd:"):
        engine_maps = mappings_of_inode(inode, client.engine_pid)
        assert engine_maps, f"the engine does not map the memory the client reads: {found}"
        found += f"; the engine maps it too: {engine_maps[0].split()[0]}"
    return found


@pytest.fixture(scope="module")
def csharp_vulkan_engine(capi, tmp_path_factory):
    return build_csharp_vulkan_engine(tmp_path_factory.mktemp("csharp-vulkan"))


@pytest.fixture
def csharp_loader_path(capi, csharp_vulkan_engine, monkeypatch):
    """Mono finds libshmbridge.so and libvulkan_frames.so through LD_LIBRARY_PATH."""
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{capi}:{csharp_vulkan_engine.parent}")


def check_render_target_engine(command, kind: str) -> None:
    """Steps the engine of ``command`` 1,000 times next to the Rust CartPole of the same
    seed (resets by mask and by command, a pole-length change): every tensor the same bit
    for bit, and its ``frames``, read through one torch view of the engine's own memory,
    byte for byte the reference drawing of the observations."""
    h, w, n = 48, 64, 8
    before = regions()
    command = [*command, "--num-envs", n, "--seed", 21, "--size", f"{h}x{w}"]
    with launch_or_skip(command, importer="vulkan") as c, \
            shmbridge.launch("cartpole", num_envs=n, seed=21) as rust:
        assert c.engine_kind == kind
        frames = c["frames"]
        assert (frames.shape, frames.dtype) == ((n, h, w, 4), "uint8")
        assert "Vulkan importer" in c.importer
        view = torch.from_dlpack(frames)  # once: every frame is read through it
        print(same_memory_as_the_engine(c, view))
        seen = {"previous": None, "changed": 0, "checked": 0}

        def check(step: int) -> None:
            got, obs = view.numpy(), np.asarray(c.obs)
            assert_frames(got, obs, f"step {step}")
            if seen["previous"] is not None:
                seen["changed"] += not np.array_equal(reference_frames(seen["previous"], h, w), got)
            seen["previous"] = obs.copy()
            seen["checked"] += 1

        episodes = step_side_by_side(c, rust, 1000, check)
        assert torch.from_dlpack(c["frames"]).data_ptr() == view.data_ptr()
    assert episodes > 100, episodes
    assert seen["checked"] > 1000
    # A frame one step late would have failed the check in most steps: the picture moves.
    assert seen["changed"] > 500, seen
    assert regions() <= before


def test_c_engine_frames_are_its_own_export_byte_for_byte_over_1000_steps(vulkan_engine):
    check_render_target_engine([vulkan_engine], "cartpole-vulkan-c")


def test_csharp_engine_frames_are_its_own_export_byte_for_byte_over_1000_steps(csharp_vulkan_engine,
                                                                                csharp_loader_path):
    check_render_target_engine(["mono", csharp_vulkan_engine], "cartpole-vulkan-cs")


def test_csharp_binding_refuses_what_the_c_abi_refuses(csharp_vulkan_engine, csharp_loader_path):
    """--self-check: a binary semaphore and a semaphore value without a semaphore are
    Status.InvalidSpec through the binding; then the engine serves as usual."""
    proc = subprocess.Popen(["mono", str(csharp_vulkan_engine), "--num-envs", "2", "--size", "16x16", "--self-check"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        name = first_line(proc)
        if not name:
            err = proc.communicate(timeout=HANG)[1]
            if "Vulkan is unavailable" in err:
                pytest.skip(f"no Vulkan driver here: {err}")
            raise AssertionError(err)
        with shmbridge.attach(name, importer="vulkan") as c:
            c.step()
            assert_frames(np.from_dlpack(c["frames"]), np.asarray(c.obs), "step 1")
        err = proc.communicate(timeout=HANG)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "self-check: binary semaphore refused: InvalidSpec" in err, err
    assert "self-check: semaphore value refused: InvalidSpec" in err, err
    assert "client closed after 1 steps" in err, err


def test_host_frames_of_the_same_engine_are_the_same_bytes_in_the_region(vulkan_engine):
    """--frames host (the benchmark's other path): the same drawing, copied into the region."""
    h, w, n = 24, 32, 3
    with launch_or_skip([vulkan_engine, "--num-envs", n, "--size", f"{h}x{w}", "--frames", "host"]) as c:
        frames = c["frames"]
        view = np.from_dlpack(frames)
        start, end, _, path = mapping_of(view.ctypes.data)
        assert path.endswith(c.name), "--frames host: the frames are in the region"
        rng = np.random.default_rng(5)
        for step in range(50):
            assert_frames(view, np.asarray(c.obs), f"step {step}")
            c.step(rng.integers(0, 2, size=(n, 1), dtype=np.int64))


def run_sanitized(command, steps: int, **kwargs) -> str:
    """Starts a sanitized engine, steps it ``steps`` times from a Python client (checking
    each frame against the reference), closes, and returns its stderr once it exited 0."""
    if lavapipe() is None:
        pytest.skip("the sanitized runs pin Mesa's lavapipe, which is not installed here")
    proc = subprocess.Popen([str(c) for c in command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=sanitizer_env())
    try:
        name = first_line(proc)
        if not name:
            err = proc.communicate(timeout=HANG)[1]
            if "Vulkan is unavailable" in err:
                pytest.skip(f"no Vulkan driver here: {err}")
            raise AssertionError(f"the engine did not start: {err}")
        with shmbridge.attach(name, importer="vulkan") as c:
            view = np.from_dlpack(c["frames"])
            rng = np.random.default_rng(2)
            for step in range(1, steps + 1):
                c.step(rng.integers(0, 2, size=(c.num_envs, 1), dtype=np.int64))
                assert_frames(view, np.asarray(c.obs), f"step {step}")
                if step % 100 == 50:
                    c.reset(seed=[step, step + 1], env_ids=[1, 0])
                    assert_frames(view, np.asarray(c.obs), f"after the reset at step {step}")
            del view
        err = proc.communicate(timeout=HANG)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not sanitizer_reports(err), err
    assert proc.returncode == 0, f"exit status {proc.returncode}: {err}"
    return err


def test_c_engine_is_clean_under_sanitizers(vulkan_engine_asan):
    err = run_sanitized([vulkan_engine_asan, "--num-envs", 4, "--size", "32x32"], 300)
    assert "client closed after 300 steps" in err


# ---- Faults: the learner gets a typed error; nothing is left behind -----------------------

def memory_inodes(pid: int) -> set:
    """Inodes of the Vulkan memory (memfds) process ``pid`` maps."""
    return {line.split()[4] for line in open(f"/proc/{pid}/maps") if "/memfd:" in line}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class FaultyEngine:
    """``vulkan_faults FAULT`` under the sanitizers, pinned to lavapipe: its region name (or
    None if it did not start) and, at ``finish``, its exit status and stderr."""

    def __init__(self, exe, fault: str):
        if lavapipe() is None:
            pytest.skip("the sanitized runs pin Mesa's lavapipe, which is not installed here")
        self.proc = subprocess.Popen([str(exe), fault], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=sanitizer_env())
        self.name = first_line(self.proc) or None
        self.memory = memory_inodes(self.proc.pid) if self.name else set()

    def finish(self, stop: bool) -> tuple:
        if stop and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            err = self.proc.communicate(timeout=HANG)[1]
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        if "Vulkan is unavailable" in err:
            pytest.skip(f"no Vulkan driver here: {err}")
        return self.proc.returncode, err


@pytest.fixture(scope="module")
def warm_vulkan(faults_asan):
    """One good attach first: the Vulkan loader and driver open what they keep for the
    process, so that fds counted afterwards are the tests' own."""
    engine = FaultyEngine(faults_asan, "none")
    assert engine.name, engine.finish(stop=True)
    with shmbridge.attach(engine.name, importer="vulkan") as c:
        c.step()
    status, err = engine.finish(stop=False)
    assert status == 0 and not sanitizer_reports(err), err


def nothing_left(name: str, memory: set) -> None:
    assert not [n for n in os.listdir("/dev/shm") if name in n], f"{name} left in /dev/shm"
    assert f"@{name}" not in open("/proc/net/unix").read(), f"{name}'s fd socket is still bound"
    ours = {line.split()[4] for line in open("/proc/self/maps")}
    assert not memory & ours, "the client still maps the engine's memory"


@pytest.mark.parametrize("fault, error, words", [
    ("memory-type", shmbridge.InvalidTensorError, "memory type 31 does not exist"),
])
def test_a_lying_engine_gives_the_learner_a_typed_error_and_leaves_nothing(faults_asan, warm_vulkan, fault,
                                                                           error, words):
    engine = FaultyEngine(faults_asan, fault)
    assert engine.name, engine.finish(stop=True)
    fds = open_fds()
    with pytest.raises(error, match=words) as raised:
        shmbridge.attach(engine.name, importer="vulkan")
    assert "'frames'" in str(raised.value)
    assert open_fds() == fds, "the failed attach left fds open"
    # The client let go of the slot: the engine sees it closed, and ends as it does then.
    status, err = engine.finish(stop=False)
    assert not sanitizer_reports(err), err
    assert status == 0, err
    nothing_left(engine.name, engine.memory)


def test_an_engine_that_closed_its_fd_before_declaring_it_does_not_start(faults_asan, tmp_path):
    before = regions()
    engine = FaultyEngine(faults_asan, "closed-fd")
    assert engine.name is None
    status, err = engine.finish(stop=False)
    assert not sanitizer_reports(err), err
    assert status == 1 and "`memory_fd`" in err and "cannot be duplicated" in err and "INVALID_ARGUMENT" in err, err
    assert regions() <= before
    # Launched by a learner, the same engine is a typed error there.
    with pytest.raises(shmbridge.EngineStartError, match="cannot be duplicated"):
        shmbridge.launch(command=[str(faults_asan), "closed-fd"], timeout=HANG)
    assert regions() <= before


@pytest.mark.parametrize("fault, words", [
    ("reused-fd", "memory fd is a pipe"),
    ("size", "fewer than the declared allocation size"),
])
def test_an_engine_whose_fd_the_kernel_shows_is_wrong_does_not_start(faults_asan, fault, words):
    """A pipe where the memory fd was, or an allocation larger than lavapipe's memfd: the
    kernel tells (fstat), so shmb_engine_create refuses before any client sees the fd."""
    before = regions()
    engine = FaultyEngine(faults_asan, fault)
    assert engine.name is None
    status, err = engine.finish(stop=False)
    assert not sanitizer_reports(err), err
    assert status == 1 and words in err and "INVALID_SPEC" in err, err
    assert regions() <= before


def test_an_engine_that_closes_its_fd_after_declaring_it_serves_its_frames(faults_asan, warm_vulkan):
    """The library holds its own copy of the fd: the engine's close changes nothing."""
    engine = FaultyEngine(faults_asan, "closed-after")
    assert engine.name, engine.finish(stop=True)
    with shmbridge.attach(engine.name, importer="vulkan") as c:
        view = np.from_dlpack(c["frames"])
        for step in range(1, 6):
            c.step()
            assert_frames(view, np.asarray(c.obs), f"step {step}")
        del view
    status, err = engine.finish(stop=False)
    assert status == 0 and not sanitizer_reports(err), err
    nothing_left(engine.name, engine.memory)


def test_an_engine_dying_between_render_and_publish_is_engine_died(faults_asan, warm_vulkan):
    engine = FaultyEngine(faults_asan, "die-before-publish")
    assert engine.name, engine.finish(stop=True)
    fds = open_fds()
    c = shmbridge.attach(engine.name, importer="vulkan")
    with pytest.raises(shmbridge.EngineDiedError):
        c.step()
    c.close()
    assert open_fds() == fds, "the client's import left fds open"
    status, err = engine.finish(stop=False)
    assert status == -signal.SIGKILL, err
    assert not sanitizer_reports(err), err
    nothing_left(engine.name, engine.memory)


def test_bench_measures_the_c_engines_export_against_its_copy(vulkan_engine, tmp_path):
    """`bench vulkan --c-engine` (a smoke run): both paths measured in one run, zero copy,
    every block's frames the reference drawing."""
    proc = subprocess.run([sys.executable, "-m", "shmbridge.bench", "vulkan", "--quick", "--c-engine",
                           str(vulkan_engine), "--num-envs", "4", "--size", "24x32", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode == 3:
        assert "Vulkan" in proc.stderr, proc.stderr
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "vulkan.json").read_text())
    assert set(doc["paths"]) == {"c-export", "c-host-shm"}
    for key, path in doc["paths"].items():
        assert path["zero_copy"] and not path["failures"], (key, path)
        assert path["stats"]["n"] == 100, (key, path)
    assert doc["paths"]["c-export"]["ratio"]["median"] == 1.0
    assert "copied into host shared memory" in proc.stdout
