"""A child forked from a learner or an engine (os.fork, multiprocessing's fork context, a
DataLoader worker) that drops or closes its inherited copies leaves the parent's session
alone, and keeps none of the parent's liveness locks: a learner that dies is reported
dead even while a child it forked lives on."""

from __future__ import annotations

import gc
import multiprocessing
import os
import select
import signal
import subprocess
import sys

import pytest

import shmbridge


def _close_and_drop(client) -> None:
    client.close()
    del client
    gc.collect()


def test_a_child_from_os_fork_closing_the_client_leaves_the_parents_session():
    with shmbridge.launch("null", num_envs=4) as c:
        c.step()
        pid = os.fork()
        if pid == 0:  # the child: close and drop its copy, exit without cleanup
            try:
                _close_and_drop(c)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        for _ in range(3):
            c.step()
        assert c.frame == 4 and not c.closed
    assert c.engine_process.returncode == 0


def test_a_multiprocessing_fork_child_closing_the_client_leaves_the_parents_session():
    ctx = multiprocessing.get_context("fork")
    with shmbridge.launch("null", num_envs=4) as c:
        p = ctx.Process(target=_close_and_drop, args=(c,))
        p.start()
        p.join()
        assert p.exitcode == 0
        c.step()
        assert c.frame == 1
    assert c.engine_process.returncode == 0


def test_a_forked_child_closing_an_engine_leaves_it_serving():
    spec = shmbridge.EngineSpec.standard("forked", 2, 3, 1)
    with shmbridge.Engine(spec) as engine:
        engine.publish()
        pid = os.fork()
        if pid == 0:
            try:
                engine.close()
                gc.collect()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert engine.name in shmbridge.list_regions()
        with shmbridge.attach(engine.name) as client:
            assert client.frame == 0
    assert engine.name not in shmbridge.list_regions()


_LEARNER = r"""
import os, sys, time, shmbridge
client = shmbridge.attach(sys.argv[1])
child = os.fork()
if child == 0:
    sys.stdin.buffer.read(1)  # lives until the test closes our stdin
    os._exit(0)
print(child, flush=True)
time.sleep(3600)
"""


def test_a_learner_that_dies_is_dead_while_a_child_it_forked_lives():
    """Before the fix the child shared the client's lock (one open file description), so
    the dead learner still looked alive: the engine waited until its timeout."""
    spec = shmbridge.EngineSpec.standard("orphaned", 2, 3, 1)
    with shmbridge.Engine(spec, blocking=True) as engine:
        engine.publish()
        learner = subprocess.Popen(
            [sys.executable, "-c", _LEARNER, engine.name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        try:
            child = int(learner.stdout.readline())
            assert engine.client_attached
            learner.send_signal(signal.SIGKILL)
            learner.wait()
            with pytest.raises(shmbridge.ClientDiedError):
                engine.wait_actions(timeout=60)
            os.kill(child, 0)  # the child still lives
        finally:
            learner.kill()
            learner.stdin.close()  # the child reads EOF and exits
            learner.wait()


def test_a_forked_child_still_reads_the_live_frames():
    """The child's copy of the mapping is re-made through a new file description (so it
    holds no lock), of the same object: it sees the frames the parent steps to."""
    import numpy as np

    from conftest import pattern

    with shmbridge.launch("null", num_envs=4, obs_dim=8) as c:
        stepped_r, stepped_w = os.pipe()
        result_r, result_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            ok = 0
            try:
                os.read(stepped_r, 1)  # the parent stepped to frame 1
                obs = np.asarray(c.obs)
                ok = int(np.array_equal(obs.ravel(), pattern(1, np.arange(obs.size))))
            finally:
                os.write(result_w, bytes([ok]))
                os._exit(0)
        c.step()
        os.write(stepped_w, b"x")
        assert os.read(result_r, 1) == b"\x01", "the child did not see frame 1"
        os.waitpid(pid, 0)
        c.step()
        assert c.frame == 2


def test_a_forked_child_launches_its_own_engine():
    """The parent launched before forking: the child inherited no spawning thread (fork
    copies only the calling thread) and must start its own, not wait on the parent's."""
    with shmbridge.launch("null", num_envs=2) as c:
        c.step()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read)
                with shmbridge.launch("null", num_envs=3, timeout=20) as mine:
                    mine.step()
                    code = 0 if mine.frame == 1 and mine.num_envs == 3 else 2
            finally:
                os.write(write, bytes([code]))
                os._exit(code)
        os.close(write)
        try:
            ready, _, _ = select.select([read], [], [], 60)
            if not ready:
                os.kill(pid, signal.SIGKILL)
            word = os.read(read, 1) if ready else b""
        finally:
            os.close(read)
            os.waitpid(pid, 0)
        assert ready, "the forked child's launch() hung"
        assert word == b"\x00", word
        c.step()
        assert c.frame == 2
    assert c.engine_process.returncode == 0
