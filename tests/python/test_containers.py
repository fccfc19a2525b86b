"""A Python learner and its engine in two containers of one node: the engine (the
``shmbridge`` command line) in PID, network and mount namespaces of its own (``unshare``),
sharing only /dev/shm with the learner, as Docker's ``--ipc=container:ENGINE`` or a
Kubernetes pod whose containers mount one memory-backed emptyDir at /dev/shm do
(``docs/deployment.md``). The learner steps, resets and calls; imports the Vulkan
tensors; is told which side died and where; and a learner in its own namespaces stopped
with Ctrl-C closes first, so its engine ends normally. Skipped, with the reason, where
the namespaces cannot be made (not root)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import shmbridge
from conftest import ISOLATED, descendant_running, namespaces_unavailable, pattern, region_gone

HANG = 60.0

pytestmark = pytest.mark.skipif(bool(namespaces_unavailable()), reason=str(namespaces_unavailable()))


def cli(*args: str) -> list:
    """The ``shmbridge`` command line of this package (``python -m shmbridge``)."""
    return [sys.executable, "-m", "shmbridge", *args]


class IsolatedEngine:
    """``python -m shmbridge engine ARGS`` in namespaces of its own."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(ISOLATED + cli("engine", *args), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.name = self.proc.stdout.readline().strip()
        assert self.name.startswith("shmbridge-"), (self.name, self.proc.stderr.read())

    def end(self) -> tuple:
        out, err = self.proc.communicate(timeout=HANG)
        return self.proc.returncode, err

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def test_a_learner_here_steps_resets_and_calls_an_engine_in_other_namespaces():
    engine = IsolatedEngine("--env", "null", "--num-envs", "4", "--obs-dim", "3", "--blocking")
    try:
        with shmbridge.attach(engine.name, timeout=30) as client:
            obs = np.from_dlpack(client.obs)
            for _ in range(50):
                client.step(timeout=30)
                np.testing.assert_array_equal(obs.ravel(), pattern(client.frame, np.arange(obs.size)))
            client.reset(timeout=30)
            assert client.call("echo", payload=b"x", timeout=30, k="v") == {"k": "v", "payload": b"x"}
        code, err = engine.end()
        assert code == 0 and "client closed after 50 steps" in err, err
    finally:
        engine.close()
    assert region_gone(engine.name)


def test_vulkan_tensors_reach_a_learner_in_other_namespaces():
    engine = IsolatedEngine("--env", "null", "--num-envs", "2", "--obs-dim", "2",
                            "--image", "8x8x4", "--image-device", "vulkan", "--blocking")
    try:
        if not engine.name.startswith("shmbridge-"):
            pytest.skip("no Vulkan driver")
        with shmbridge.attach(engine.name, timeout=30, importer="vulkan") as client:
            rgb = client["rgb"]
            a = np.from_dlpack(rgb)
            assert a.ctypes.data == rgb.data_ptr
            for _ in range(10):
                client.step(timeout=30)
                want = (pattern(client.frame, np.arange(a.size)).astype(np.uint32) & 0xFF).astype(np.uint8)
                np.testing.assert_array_equal(a.ravel(), want)
        code, err = engine.end()
        assert code == 0, err
    finally:
        engine.close()
    assert region_gone(engine.name)


def test_an_engine_dying_in_other_namespaces_is_named_as_such():
    engine = IsolatedEngine("--env", "null", "--num-envs", "2", "--blocking")
    try:
        client = shmbridge.attach(engine.name, timeout=30)
        client.step(timeout=30)
        os.kill(descendant_running(engine.proc.pid, sys.executable), signal.SIGKILL)
        with pytest.raises(shmbridge.EngineDiedError) as info:
            client.step(timeout=30)
        assert info.value.pid_in_other_namespace is True
        assert "in another PID namespace" in str(info.value)
        client.close()
    finally:
        engine.close()
    assert region_gone(engine.name)


def frame_seq(name: str) -> int:
    """The region's `frame_seq`, as ``shmbridge inspect`` reads it."""
    out = subprocess.run(cli("inspect", name), capture_output=True, text=True, timeout=HANG)
    for line in out.stdout.splitlines():
        if line.startswith("frame_seq"):
            return int(line.split()[1])
    raise AssertionError(out.stdout + out.stderr)


def test_ctrl_c_stops_a_learner_in_other_namespaces_which_closes_first():
    """SIGINT to ``python -m shmbridge client`` in namespaces of its own (its
    KeyboardInterrupt closes the client): it ends with 130 and its engine, here, sees it
    close, not die."""
    engine = subprocess.Popen(cli("engine", "--env", "null", "--num-envs", "2", "--blocking"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    learner = None
    try:
        name = engine.stdout.readline().strip()
        learner = subprocess.Popen(
            ISOLATED + cli("client", name, "--steps", "1000000000", "--blocking"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        inner = descendant_running(learner.pid, sys.executable)
        deadline = time.monotonic() + HANG
        while frame_seq(name) < 10:  # it steps
            assert time.monotonic() < deadline, "the learner never stepped"
        os.kill(inner, signal.SIGINT)
        _, err = learner.communicate(timeout=HANG)
        assert learner.returncode == 130, err
        _, err = engine.communicate(timeout=HANG)
        assert engine.returncode == 0 and "client closed after" in err, err
    finally:
        for p in (learner, engine):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert region_gone(name)
