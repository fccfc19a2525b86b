"""A launched engine never outlives its learner: a learner killed (SIGKILL) while
``launch()`` waits for the engine leaves no engine and no region behind. The engine is
started by the library's one spawning path (``_native._spawn_engine``, also behind
``shmbridge client --launch``), which gives any engine executable that guarantee."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import exited, wait_exited

# A hang guard, not a timing check: before the fix the engine ran on (its idle timeout
# is an hour).
GONE = 60.0


def _children(pid: int) -> list:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def _regions_of(pid: int) -> list:
    names = []
    for name in os.listdir("/dev/shm"):
        if name.startswith("shmbridge-"):
            try:
                with open(f"/dev/shm/{name}", "rb") as f:
                    head = f.read(68)
            except OSError:
                continue
            if len(head) == 68 and int.from_bytes(head[64:68], "little") == pid:
                names.append(name)
    return names


def _learner(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


# launch() whose attach never returns: the learner is "inside launch()" when killed.
_STUCK_IN_LAUNCH = """
import time, shmbridge._launch
class Stuck:
    @staticmethod
    def attach(*args, **kwargs):
        print("attaching", flush=True)
        time.sleep(3600)
shmbridge._launch.Client = Stuck  # the Client that launch() attaches with
shmbridge.launch("null", num_envs=2)
"""


def _kill_learner_then_check(code: str, engine_of) -> int:
    """Runs learner `code`, finds its engine (`engine_of(learner)`), SIGKILLs the learner
    and asserts the engine exits; returns the engine's pid. Kills what is left, if any."""
    learner = _learner(code)
    engine = None
    try:
        engine = engine_of(learner)
        assert not exited(engine)
        learner.kill()
        learner.wait()
        assert wait_exited(engine, GONE), "the engine outlived its learner"
        return engine
    finally:
        learner.kill()
        learner.wait()
        if engine is not None and not exited(engine):
            os.kill(engine, signal.SIGKILL)


def test_a_learner_killed_inside_launch_leaves_no_engine_and_no_region():
    regions = []

    def engine_of(learner):
        assert learner.stdout.readline().strip() == "attaching"
        [engine] = _children(learner.pid)
        regions.extend(_regions_of(engine))
        return engine

    _kill_learner_then_check(_STUCK_IN_LAUNCH, engine_of)
    assert len(regions) == 1, regions
    assert regions[0] not in os.listdir("/dev/shm"), "its region was left behind"


def test_any_engine_executable_launched_dies_with_its_learner():
    """`sleep` stands for an engine in another language: launched through the same path,
    it gets SIGTERM when its learner dies."""
    code = (
        "import time, shmbridge._native as n\n"
        "pid, out, _ = n._spawn_engine(['sleep', '3600'], None, 2)\n"
        "print(pid, flush=True)\n"
        "time.sleep(3600)\n"
    )
    _kill_learner_then_check(code, lambda learner: int(learner.stdout.readline()))


def test_spawning_refuses_an_empty_command_and_reports_a_missing_program():
    import shmbridge

    with pytest.raises(ValueError):
        shmbridge._native._spawn_engine([], None, 2)
    with pytest.raises(shmbridge.ShmBridgeOSError, match="/nonexistent/engine"):
        shmbridge._native._spawn_engine(["/nonexistent/engine"], None, 2)
