"""Vulkan tensors from Python: until the binding can lease an import, attaching to an
engine that exports one is refused with a typed error, the client closes cleanly, and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import shmbridge


def regions():
    return {f for f in os.listdir("/dev/shm") if f.startswith("shmbridge")}


def test_a_vulkan_tensor_is_refused_with_a_typed_error():
    before = regions()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmbridge", "engine", "--env", "null", "--num-envs", "4",
         "--image", "8x8x4", "--image-device", "vulkan"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        name = proc.stdout.readline().strip()
        if not name:
            proc.wait(30)
            err = proc.stderr.read()
            if "Vulkan is unavailable" in err:
                pytest.skip(f"no Vulkan driver here: {err.strip()}")
            pytest.fail(f"the engine did not serve: {err}")
        with pytest.raises(shmbridge.VulkanUnavailableError, match="'rgb' is a Vulkan export"):
            shmbridge.attach(name)
        # The refused client closed cleanly: the engine sees a close, not a death, and
        # ends as it does after any client (the CLI serves one).
        assert proc.wait(30) == 0
        assert "client closed" in proc.stderr.read()
    finally:
        proc.terminate()
        proc.wait(30)
    assert regions() <= before
