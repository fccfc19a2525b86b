"""Fixtures for the Python tests: engines launched per test, and a check that nothing is
left in /dev/shm by the whole session; and the helpers the test files share (one copy
each): the regions in /dev/shm, whether a process has exited, the `null` engine's
pattern, a private /dev/shm."""

from __future__ import annotations

import itertools
import math
import os
import signal
import time

import pytest

import shmbridge

# One thread per process for torch's (OpenMP's) parallel regions, here and in every
# process the tests start: pytest-xdist runs a worker per core or more, and many tests run a
# learner beside its engine, so more threads only wait on each other (OpenMP's threads
# spin at each barrier: on two busy cores, a learning test ran 10 times slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# The tests that press Ctrl-C model a program a terminal runs in the foreground: a test
# run started in the background of a non-interactive shell ignores SIGINT, and its
# children would inherit that (Python then installs no KeyboardInterrupt handler).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "long: runs for seconds (a learning run, a benchmark's quick run): started first")


def pytest_collection_modifyitems(items):
    """The `long` tests first, in file order, the rest after them as collected: under
    pytest-xdist's `--dist load --maxschedchunk 1` (scripts/test.sh) each worker holds two
    tests and gets the next, in this order, whenever it ends one, so the long ones run from
    the start and the run does not end with one worker on a long test and the others idle."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


# Region namespaces (docs/protocol.md 1.1): this process (a pytest-xdist worker, or
# pytest alone) names its regions in one of its own, under the one it was given, and each
# test in one under that (the autouse fixture `region_namespace`): an engine's start, `ls`
# and `gc` then see only that test's regions, whatever else runs on the machine.
WORKER_NAMESPACE = f"{os.environ.get('SHMBRIDGE_NAMESPACE') or 'py'}_{os.getpid()}"
os.environ["SHMBRIDGE_NAMESPACE"] = WORKER_NAMESPACE
_tests_run = itertools.count()


@pytest.fixture(autouse=True)
def region_namespace(monkeypatch):
    """Each test's own region namespace: ``<worker's>_<n>``; yields the prefix of its
    names (``shmbridge-<namespace>-``), and sweeps the namespace when the test ends."""
    ns = f"{WORKER_NAMESPACE}_{next(_tests_run)}"
    monkeypatch.setenv("SHMBRIDGE_NAMESPACE", ns)
    yield f"shmbridge-{ns}-"
    # The regions of the engines the test killed: no later engine start of this
    # namespace would sweep them. A live engine's region stays (no_region_left sees it).
    shmbridge.gc()


# Where CartPole ends an episode: |x| > 2.4 or |theta| > 12 degrees (Gymnasium's
# `theta_threshold_radians`, 0.2094...; not 0.2095). Less a margin for the float32 of an
# observation of a state just past a bound.
CARTPOLE_BOUNDS = (2.4 - 1e-6, 12 * 2 * math.pi / 360 - 1e-6)


def regions() -> set:
    """The names of the shmbridge regions in /dev/shm now of this process's namespaces
    (its own and its tests')."""
    return {n for n in os.listdir("/dev/shm")
            if n.startswith(f"shmbridge-{WORKER_NAMESPACE}-") or n.startswith(f"shmbridge-{WORKER_NAMESPACE}_")}


def region_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


def region_gone(name: str) -> bool:
    """Neither the region ``name`` nor its fd socket (``<name>.fd``, 1.6) is left."""
    return not region_exists(name) and not region_exists(name + ".fd")


def exited(pid: int) -> bool:
    """Process ``pid`` is gone, or a zombie (exited; its parent has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_exited(pid: int, limit: float) -> bool:
    """Whether process ``pid`` has exited within ``limit`` seconds: a bounded poll of a
    condition, not a sleep standing in for one."""
    deadline = time.monotonic() + limit
    while not exited(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture(scope="session", autouse=True)
def no_region_left():
    before = regions()
    yield
    leaked = regions() - before
    assert not leaked, f"the Python tests left regions in /dev/shm: {sorted(leaked)}"


@pytest.fixture(scope="session", autouse=True)
def sb3_log_folder(tmp_path_factory):
    """Stable-Baselines3 makes a folder for its logger on every ``learn`` (an empty
    ``SB3-<date>`` in /tmp unless ``SB3_LOGDIR`` names one): the tests' go under pytest's
    own temporary folder (this process's and the learners it starts)."""
    os.environ.setdefault("SB3_LOGDIR", str(tmp_path_factory.mktemp("sb3-logs")))


@pytest.fixture
def null_client():
    """`null` engine: frame k holds pattern(k, i) in obs, rewards echo actions[:, 0]."""
    with shmbridge.launch("null", num_envs=16, obs_dim=8, act_dim=3) as c:
        yield c


@pytest.fixture
def cartpole_client():
    with shmbridge.launch("cartpole", num_envs=32, seed=1) as c:
        yield c


def pattern(seq: int, index):
    """The `null` engine's obs value (src/envs/null.rs `pattern`)."""
    import numpy as np

    index = np.asarray(index, dtype=np.uint64)
    return ((np.uint64(seq) * np.uint64(2_654_435_761) + index) & np.uint64(0xFFFFFF)).astype(np.float32)


def run_in_private_shm(code: str, size: str, memory_kib: int | None = None, timeout: float = 600):
    """Runs ``python -c code`` in a private mount namespace with a fresh tmpfs of ``size``
    on /dev/shm (``unshare -m``: needs root), under an address-space cap of
    ``memory_kib`` if given, so a test that fills or sweeps /dev/shm, or asks for absurd
    sizes, touches nothing of anyone else's. Returns the CompletedProcess."""
    import subprocess
    import sys

    cap = f"ulimit -v {memory_kib} && " if memory_kib else ""
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o size={size},mode=1777 shmbridge-test /dev/shm && {cap}exec "$0" "$@"',
         sys.executable, "-c", code],
        capture_output=True, text=True, timeout=timeout,
    )


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a private /dev/shm needs root (unshare -m, mount)")


# A program in new PID, network and mount namespaces, as a container runs it: the mount
# namespace a copy of this one (so /dev/shm is shared), /proc of the new PID namespace;
# `sh` is the namespace's first process and runs the program as its child (the first
# process of a PID namespace ignores the signals it has no handler for, SIGTERM).
ISOLATED = ["unshare", "--pid", "--fork", "--net", "--mount-proc", "--kill-child", "--",
            "sh", "-c", '"$@"; exit $?', "sh"]


def namespaces_unavailable():
    """Why PID, network and mount namespaces cannot be made here, or None."""
    import subprocess

    if os.geteuid() != 0:
        return "PID, network and mount namespaces need root (unshare)"
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--net", "--mount-proc", "true"],
                              capture_output=True, text=True, timeout=60)
    except OSError as e:
        return f"unshare (util-linux) cannot run: {e}"
    if done.returncode != 0:
        return f"unshare --pid --fork --net --mount-proc failed: {done.stderr.strip()}"
    return None


def descendant_running(root: int, exe: str, hang: float = 60.0) -> int:
    """The pid here of the descendant of ``root`` that runs ``exe`` (a program an
    ``ISOLATED`` command started in its namespaces); waits for it."""
    import time

    exe = os.path.realpath(exe)
    deadline = time.monotonic() + hang
    while True:
        todo = [root]
        while todo:
            pid = todo.pop()
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                children = []
            for c in children:
                try:
                    if os.readlink(f"/proc/{c}/exe") == exe:
                        return c
                except OSError:
                    pass
                todo.append(c)
        assert time.monotonic() < deadline, f"no process of {exe} under pid {root}"
        os.sched_yield()


def doc_example(path: str, lang: str = "python", after: str = "") -> str:
    """The first ```<lang> block after the text ``after`` of the markdown file ``path``
    (relative to the repository's root): guides' examples are tested as written."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, path)) as f:
        text = f.read()
    fence = f"```{lang}\n"
    start = text.index(fence, text.index(after)) + len(fence)
    return text[start:text.index("\n```", start) + 1]
