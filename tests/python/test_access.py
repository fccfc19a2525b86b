"""Access control from Python: a region of another user is refused with
PermissionDeniedError (root included: the library opens only regions of its own uid),
``ls`` lists it as unreadable, and ``gc`` leaves it alone, even once its engine is dead.
Needs root, to run an engine as ``nobody``; skipped with the reason elsewhere. The test's
``gc`` sweeps its own region namespace (conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import shmbridge

NOBODY = 65534

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="running an engine as another user needs root"
)


def engine_as_nobody():
    """Forks a child that becomes ``nobody`` and serves an engine; returns its pid and
    the region name. The child blocks until killed."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup on the way out
        try:
            os.close(read)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            engine = shmbridge.Engine(shmbridge.EngineSpec.standard("access", 2, obs_dim=3, act_dim=1))
            engine.publish()
            os.write(write, engine.name.encode() + b"\n")
            signal.pause()
        finally:
            os._exit(1)
    os.close(write)
    with os.fdopen(read) as r:
        name = r.readline().strip()
    assert name.startswith("shmbridge-"), "the engine as nobody did not start"
    return pid, name


def test_another_users_region_is_refused_listed_unreadable_and_left_by_gc():
    pid, name = engine_as_nobody()
    path = os.path.join("/dev/shm", name)
    try:
        assert os.stat(path).st_uid == NOBODY
        with pytest.raises(shmbridge.PermissionDeniedError, match="permission denied"):
            shmbridge.attach(name, timeout=5)
        ls = subprocess.run([sys.executable, "-m", "shmbridge", "ls"], capture_output=True, text=True)
        assert ls.returncode == 0, ls.stderr
        line = next(line for line in ls.stdout.splitlines() if line.startswith(name))
        assert "unreadable" in line and "permission denied" in line, line
        # Dead, its region is still nobody's: refused again (not judged dead and
        # removed), and gc leaves it.
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pid = None
        with pytest.raises(shmbridge.PermissionDeniedError):
            shmbridge.attach(name, timeout=5)
        assert name not in shmbridge.gc()
        assert os.path.exists(path)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        if os.path.exists(path):
            os.remove(path)
