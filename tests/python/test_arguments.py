"""Bad arguments to `launch()` raise TypeError/ValueError before any process starts."""

from __future__ import annotations

import os
import subprocess

import pytest

import shmbridge


@pytest.fixture
def no_process(monkeypatch):
    """Fails the test if `launch()` starts a process."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("num_envs, error", [
    (1.9, TypeError), ("4", TypeError), (True, TypeError), (None, TypeError),
    (0, ValueError), (-3, ValueError),
])
def test_num_envs_must_be_a_positive_int(no_process, num_envs, error):
    with pytest.raises(error, match="num_envs"):
        shmbridge.launch("null", num_envs=num_envs)


@pytest.mark.parametrize("kwargs, error, what", [
    (dict(seed=1.5), TypeError, "seed"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(obs_dim="8"), TypeError, "obs_dim"),
    (dict(obs_dim=0), ValueError, "obs_dim"),
    (dict(act_dim=2.0), TypeError, "act_dim"),
    (dict(sparse="yes"), TypeError, "sparse"),
    (dict(image=(84, 84, 3)), TypeError, "image"),
    (dict(idle_timeout="5"), TypeError, "idle_timeout"),
    (dict(idle_timeout=float("nan")), ValueError, "idle_timeout"),
    (dict(timeout=0), ValueError, "timeout"),
    (dict(timeout="30"), TypeError, "timeout"),
    (dict(spin_us=float("inf")), ValueError, "spin_us"),
    (dict(device=0), TypeError, "device"),
])
def test_engine_options_are_checked_before_a_process_starts(no_process, kwargs, error, what):
    with pytest.raises(error, match=what):
        shmbridge.launch("null", num_envs=2, **kwargs)


def test_env_must_be_a_str(no_process):
    with pytest.raises(TypeError, match="env must be a str"):
        shmbridge.launch(3)


def test_good_arguments_still_launch():
    with shmbridge.launch("null", num_envs=2, obs_dim=3, seed=0, idle_timeout=5, timeout=30.0) as c:
        assert c.num_envs == 2 and tuple(c.obs.shape) == (2, 3)
    assert not any(n.startswith("shmbridge-") and n == c.name for n in os.listdir("/dev/shm"))
