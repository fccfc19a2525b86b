"""Client, tensors (DLPack / NumPy / torch zero-copy), step, errors, engine death."""

from __future__ import annotations

import gc as pygc
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import shmbridge
from shmbridge import errors

from conftest import pattern

torch = pytest.importorskip("torch")


# --- zero copy -------------------------------------------------------------------------

def test_zero_copy_torch_data_ptr_is_the_mapped_address(null_client):
    c = null_client
    for t in c.tensors:
        view = torch.from_dlpack(t)
        assert view.data_ptr() == t.data_ptr, t.name
        assert tuple(view.shape) == t.shape


def test_zero_copy_numpy_address_is_the_mapped_address(null_client):
    c = null_client
    for t in c.tensors:
        view = np.from_dlpack(t)
        assert view.ctypes.data == t.data_ptr, t.name
        assert view.shape == t.shape
        assert view.dtype == np.dtype(t.dtype)
        assert np.asarray(t).ctypes.data == t.data_ptr


def _shared_mappings(name: str):
    """(start, end) of this process's mappings of /dev/shm/<name>."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(f"/dev/shm/{name}"):
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                spans.append((start, end))
    return spans


def test_data_ptr_lies_in_a_mapping_of_the_region(null_client):
    # data_ptr is an address inside a MAP_SHARED mapping of the region's file: the views
    # above are the shared bytes themselves.
    c = null_client
    spans = _shared_mappings(c.name)
    assert spans, "the region is not mapped"
    for t in c.tensors:
        assert any(start <= t.data_ptr and t.data_ptr + t.nbytes <= end for start, end in spans), t.name


def test_zero_copy_jax_buffer_is_the_mapped_address(null_client):
    jax = pytest.importorskip("jax")
    c = null_client
    for t in c.tensors:
        view = jax.dlpack.from_dlpack(t)
        assert view.unsafe_buffer_pointer() == t.data_ptr, t.name
        assert tuple(view.shape) == t.shape


def test_copy_keyword_of_dlpack(null_client):
    c = null_client
    c.step()
    shared = np.from_dlpack(c.obs, copy=False)
    assert shared.ctypes.data == c.obs.data_ptr
    owned = np.from_dlpack(c.obs, copy=True)  # the producer copies: another address
    assert owned.ctypes.data != c.obs.data_ptr
    np.testing.assert_array_equal(owned, shared)
    c.step()  # the copy keeps frame 1; the view follows the region
    np.testing.assert_array_equal(shared, pattern(2, np.arange(shared.size)).reshape(shared.shape))
    np.testing.assert_array_equal(owned, pattern(1, np.arange(owned.size)).reshape(owned.shape))
    with pytest.raises(BufferError):
        c.obs.__dlpack__(dl_device=(2, 0))  # to CUDA: no silent transfer


def test_array_protocol(null_client):
    c = null_client
    view = np.asarray(c.obs)
    assert view.ctypes.data == c.obs.data_ptr
    copied = np.array(c.obs, copy=True)
    assert copied.ctypes.data != c.obs.data_ptr and np.array_equal(copied, view)
    as64 = np.asarray(c.obs, dtype=np.float64)
    assert as64.dtype == np.float64 and np.array_equal(as64, view)


def test_both_capsule_abis():
    with shmbridge.launch("null", num_envs=4) as c:
        legacy = c.obs.__dlpack__()
        versioned = c.obs.__dlpack__(max_version=(1, 0))
        assert "dltensor" in repr(legacy) and "versioned" not in repr(legacy)
        assert "dltensor_versioned" in repr(versioned)
        assert c.obs.__dlpack_device__() == (1, 0)
        copied = c.obs.__dlpack__(copy=True, max_version=(1, 0))  # a producer copy
        assert "dltensor_versioned" in repr(copied)
        assert c.obs.__dlpack__(dl_device=(1, 0), copy=False) is not None


def test_tensors_are_persistent_and_values_follow_steps(null_client):
    c = null_client
    obs_obj = c.obs
    assert c.obs is obs_obj and c["obs"] is obs_obj
    obs_t = torch.from_dlpack(c.obs)
    obs_n = np.from_dlpack(c.obs)
    rewards = np.from_dlpack(c.rewards)
    actions = torch.from_dlpack(c.actions)
    idx = np.arange(obs_n.size)
    assert np.array_equal(obs_n.ravel(), pattern(0, idx))
    for k in range(1, 50):
        actions[:, 0] = float(k)
        out = c.step()
        assert out[0] is obs_obj
        assert c.frame == k
        assert np.array_equal(obs_n.ravel(), pattern(k, idx))
        assert torch.equal(obs_t.flatten(), torch.from_numpy(pattern(k, idx)))
        assert (rewards == k).all()


def test_step_returns_the_same_objects(cartpole_client):
    c = cartpole_client
    a = np.zeros(c.actions.shape, dtype=np.int64)
    first = c.step(a)
    assert first == (c.obs, c.rewards, c.terminated, c.truncated)
    second = c.step(a)
    assert all(x is y for x, y in zip(first, second))


def test_step_copies_numpy_torch_and_strided_actions(null_client):
    c = null_client
    rewards = np.from_dlpack(c.rewards)
    n, a = c.actions.shape
    x = np.arange(n * a, dtype=np.float32).reshape(n, a)
    c.step(x)
    assert np.array_equal(rewards, x[:, 0])
    c.step(torch.from_numpy(x + 1))
    assert np.array_equal(rewards, x[:, 0] + 1)
    # A non-contiguous source (a transposed view) is copied element by element.
    y = np.ascontiguousarray((x + 2).T).T
    assert not y.flags["C_CONTIGUOUS"]
    c.step(y)
    assert np.array_equal(rewards, x[:, 0] + 2)
    assert np.array_equal(np.from_dlpack(c.actions), x + 2)
    # Passing the action tensor itself is fine too.
    c.step(c.actions)
    assert np.array_equal(rewards, x[:, 0] + 2)


class _NumpyBefore21:
    """An array as NumPy 1.23-2.0 shows it to DLPack: ``__dlpack_device__``, and a
    ``__dlpack__`` that takes ``stream`` only (``max_version`` is a TypeError)."""

    def __init__(self, array):
        self.array = array

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, *, stream=None):
        return self.array.__dlpack__()


def test_step_takes_arrays_of_numpy_before_2_1(null_client):
    """The package supports NumPy 1.23: its arrays' ``__dlpack__`` has no ``max_version``.
    Before the fix ``step()`` asked with it and raised TypeError (seen in a container with
    Debian's NumPy 1.24)."""
    c = null_client
    rewards = np.from_dlpack(c.rewards)
    n, a = c.actions.shape
    x = np.arange(n * a, dtype=np.float32).reshape(n, a) + 7
    c.step(_NumpyBefore21(x))
    assert np.array_equal(rewards, x[:, 0])
    # A wrong dtype through it is still refused.
    with pytest.raises(TypeError):
        c.step(_NumpyBefore21(x.astype(np.float64)))


def test_views_stay_valid_after_close():
    c = shmbridge.launch("null", num_envs=4, obs_dim=4)
    c.step()
    t = torch.from_dlpack(c.obs)
    n = np.from_dlpack(c.obs)
    capsule = c.obs.__dlpack__()
    expected = pattern(1, np.arange(16)).reshape(4, 4)
    c.close()
    assert c.closed
    assert c.engine_process.returncode == 0
    assert not [r for r in shmbridge.list_regions() if r == c.name]
    # The capsules own the mapping: still readable (the engine is gone, its name too).
    assert np.array_equal(n, expected)
    assert torch.equal(t, torch.from_numpy(expected))
    del capsule
    pygc.collect()
    assert np.array_equal(n, expected)
    with pytest.raises(errors.ClosedError):
        c.step()
    c.close()  # idempotent


# --- bad actions ------------------------------------------------------------------------

@pytest.mark.parametrize(
    "bad, exc",
    [
        (lambda n, a: np.zeros((n, a), dtype=np.float64), TypeError),
        (lambda n, a: np.zeros((n, a), dtype=np.int32), TypeError),
        (lambda n, a: np.zeros((n, a + 1), dtype=np.float32), ValueError),
        (lambda n, a: np.zeros((n * a,), dtype=np.float32), ValueError),
        (lambda n, a: torch.zeros((n, a), dtype=torch.float16), TypeError),
        (lambda n, a: torch.zeros((n + 1, a)), ValueError),
        (lambda n, a: [[0.0] * a] * n, TypeError),
        (lambda n, a: "actions", TypeError),
    ],
)
def test_bad_actions_raise_and_send_nothing(null_client, bad, exc):
    c = null_client
    c.step()
    before_counters = c.counters()
    before_frame = c.frame
    actions_before = np.from_dlpack(c.actions).copy()
    n, a = c.actions.shape
    with pytest.raises(exc):
        c.step(bad(n, a))
    assert c.frame == before_frame
    assert c.counters() == before_counters
    assert np.array_equal(np.from_dlpack(c.actions), actions_before)
    c.step()  # still usable
    assert c.frame == before_frame + 1


# --- errors, death, timeouts, signals ---------------------------------------------------

def test_error_hierarchy():
    assert issubclass(shmbridge.TimeoutError, shmbridge.ShmBridgeError)
    assert issubclass(shmbridge.TimeoutError, TimeoutError)
    assert issubclass(shmbridge.EngineDiedError, shmbridge.ShmBridgeError)
    assert issubclass(shmbridge.NotFoundError, FileNotFoundError)
    # Nothing sent is told from in flight, and still caught as a timeout.
    assert issubclass(shmbridge.NotPostedError, shmbridge.TimeoutError)
    assert "NotPostedError" in shmbridge._native._error_classes()
    # Views without a device side: a neutral error, not a CUDA one.
    assert "NoDeviceSideError" in shmbridge._native._error_classes()
    assert not issubclass(shmbridge.NoDeviceSideError, shmbridge.CudaUnavailableError)
    # A stream's full lane (1.11): its own class.
    assert "FullError" in shmbridge._native._error_classes()
    # Every Rust variant maps to a class that exists and derives from ShmBridgeError.
    names = shmbridge._native._error_classes()
    assert len(names) >= 30
    for name in names:
        assert issubclass(getattr(errors, name), shmbridge.ShmBridgeError), name
    e = shmbridge._native._raise_timeout()
    assert isinstance(e, shmbridge.TimeoutError) and isinstance(e, TimeoutError)
    assert "timed out after 1.5s waiting for a test" in str(e)
    assert e.waited == 1.5


def test_attach_to_missing_region_raises_not_found():
    with pytest.raises(shmbridge.NotFoundError, match="does not exist"):
        shmbridge.attach("shmbridge-doesnotexist0123", timeout=0.5)
    with pytest.raises(errors.InvalidNameError):
        shmbridge.attach("a/b")


def test_engine_killed_raises_engine_died_not_a_timeout():
    c = shmbridge.launch("null", num_envs=4)
    try:
        c.step()
        os.kill(c.engine_pid, signal.SIGKILL)
        c.engine_process.wait(5)
        # EngineDiedError, not TimeoutError: the death is noticed while waiting, long
        # before the step's own deadline (the latency is measured in the Rust tests'
        # output, not asserted).
        with pytest.raises(shmbridge.EngineDiedError, match="died") as info:
            for _ in range(1000):
                c.step(timeout=60)
        assert info.value.pid == c.engine_pid
        assert c.name not in shmbridge.list_regions()
    finally:
        c.close()


def test_engine_closed_raises_engine_closed():
    c = shmbridge.launch("null", num_envs=4)
    try:
        c.engine_process.terminate()  # the engine closes its region on SIGTERM
        c.engine_process.wait(5)
        with pytest.raises((shmbridge.EngineClosedError, shmbridge.EngineDiedError)):
            c.step(timeout=5)
    finally:
        c.close()


def test_step_timeout_then_recovers():
    c = shmbridge.launch("null", num_envs=4)
    try:
        c.step()
        os.kill(c.engine_pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(shmbridge.TimeoutError, match=r"timed out after 200ms waiting for the engine's next frame"):
                c.step(timeout=0.2)
            assert time.monotonic() - t0 >= 0.199  # never gives up before the deadline
            with pytest.raises(TimeoutError):  # the builtin catches it too
                c.step(timeout=0.1)
        finally:
            os.kill(c.engine_pid, signal.SIGCONT)
        # The second timed-out step sent nothing (it was still waiting for frame 2):
        # this one receives frame 2, then sends action 3 and receives its frame.
        c.step(timeout=5)
        assert c.frame == 3
        assert c.counters() == (3, 3)
    finally:
        c.close()


def _when_busy(client, then):
    """Runs `then()` once another thread's call holds the client (counters() refuses
    with "busy" while a step is in progress)."""

    def poll():
        while True:
            try:
                client.counters()
            except RuntimeError:
                break
        then()

    t = threading.Thread(target=poll)
    t.start()
    return t


def test_ctrl_c_during_a_long_wait_raises_keyboard_interrupt():
    c = shmbridge.launch("null", num_envs=4)
    try:
        c.step()
        os.kill(c.engine_pid, signal.SIGSTOP)
        main = threading.main_thread().ident
        t = _when_busy(c, lambda: signal.pthread_kill(main, signal.SIGINT))
        try:
            # A long timeout: a missed signal fails as TimeoutError instead of hanging.
            with pytest.raises(KeyboardInterrupt):
                c.step(timeout=60)
        finally:
            t.join()
            os.kill(c.engine_pid, signal.SIGCONT)
        c.step(timeout=5)
        assert c.frame == 3
    finally:
        c.close()


def test_ctrl_c_during_a_command_raises_keyboard_interrupt():
    # An engine that answers commands only when the test lets it.
    spec = shmbridge.EngineSpec.standard("slow", 2, obs_dim=1, act_dim=1)
    with shmbridge.Engine(spec) as engine:
        engine.publish()
        with shmbridge.attach(engine.name) as c:
            main = threading.main_thread().ident
            t = _when_busy(c, lambda: signal.pthread_kill(main, signal.SIGINT))
            # A long timeout: a missed signal fails as TimeoutError instead of hanging.
            with pytest.raises(KeyboardInterrupt):
                c.ping(b"abandoned", timeout=60)
            t.join()
            assert engine.poll_commands() == 1  # the abandoned ping, answered late
            done = threading.Event()
            answered = []

            def serve():
                while not done.is_set():
                    answered.append(engine.poll_commands())

            server = threading.Thread(target=serve)
            server.start()
            try:
                # The late reply is dropped by id; this call gets its own.
                assert c.ping(b"next", timeout=30) == b"next"
            finally:
                done.set()
                server.join()


def test_close_from_another_thread_ends_a_step_in_progress():
    # An engine that never answers: frame 0 published, no wait_actions().
    spec = shmbridge.EngineSpec.standard("silent", 2, obs_dim=1, act_dim=1)
    with shmbridge.Engine(spec) as engine:
        engine.publish()
        c = shmbridge.attach(engine.name)
        t = _when_busy(c, c.close)
        with pytest.raises(shmbridge.ClosedError):
            c.step(timeout=60)  # must not wait for the timeout, nor deadlock
        t.join()
        assert c.closed


def test_closed_and_repr_answer_while_a_step_waits_in_another_thread():
    spec = shmbridge.EngineSpec.standard("silent", 2, obs_dim=1, act_dim=1)
    with shmbridge.Engine(spec) as engine:
        engine.publish()
        with shmbridge.attach(engine.name) as c:
            seen = []
            t = _when_busy(c, lambda: seen.append((c.closed, repr(c))))
            with pytest.raises(shmbridge.TimeoutError):
                c.step(timeout=1)  # `closed` once waited for the step's lock, holding the GIL
            t.join()
            assert seen == [(False, repr(c))]


def test_launch_refuses_unknown_engine_options_before_starting_anything():
    before = set(shmbridge.list_regions())
    with pytest.raises(TypeError, match=r"unknown engine options \['sed'\]"):
        shmbridge.launch("cartpole", num_envs=4, sed=1)
    assert not set(shmbridge.list_regions()) - before


def test_launch_failure_carries_engine_stderr():
    with pytest.raises(shmbridge.EngineStartError, match="unknown env 'nosuchenv'"):
        shmbridge.launch("nosuchenv", num_envs=4, timeout=20)


def test_attach_to_an_engine_started_elsewhere():
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmbridge._engine", "--env", "cartpole", "--num-envs", "8"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        name = proc.stdout.readline().strip()
        with shmbridge.attach(name) as c:
            assert c.engine_kind == "cartpole" and c.num_envs == 8
            assert c.engine_process is None
            assert "obs" in c and "rgb" not in c
            with pytest.raises(KeyError):
                c["rgb"]
            c.step(np.ones((8, 1), dtype=np.int64))
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_reset_with_seeds_over_the_command_channel() -> None:
    with shmbridge.launch("cartpole", num_envs=6) as client:
        obs = torch.from_dlpack(client.obs)
        assert client.reset(seed=42) == 0
        first = obs.clone()
        client.step(np.ones((6, 1), dtype=np.int64))
        assert not torch.equal(obs, first)
        assert client.reset(seed=42) == 1  # a reset consumes no action
        assert torch.equal(obs, first), "same seed, same initial observations"
        client.reset(seed=[42, 43, 44, 45, 46, 47])
        assert torch.equal(obs, first), "seed s = seeds s, s+1, ... per env"
        before = obs.clone()
        client.reset(seed=7, env_ids=[2])
        assert torch.equal(obs[[0, 1, 3, 4, 5]], before[[0, 1, 3, 4, 5]])
        assert not torch.equal(obs[2], before[2])
        with pytest.raises(shmbridge.errors.RemoteError):
            client.reset(env_ids=[99])
        with pytest.raises(TypeError):
            client.reset(seed="nope")


def test_engine_defined_methods_and_ping() -> None:
    with shmbridge.launch("cartpole", num_envs=2) as client:
        assert client.call("set_pole_length", length=1.5) == {"previous": "0.5"}
        with pytest.raises(shmbridge.errors.RemoteError, match="unknown method"):
            client.call("fly")
        assert client.ping(b"abc") == b"abc"
    with shmbridge.launch("null", num_envs=1) as client:
        reply = client.call("echo", payload=b"\x00\x01", k=3)
        assert reply == {"k": "3", "payload": b"\x00\x01"}


def _attach_then_ctrl_c(name: str) -> str:
    """Runs `attach(name, timeout=3600)` in a child, sends it SIGINT once it has the region
    open (so it is inside the native wait, not before it), and returns what the child
    reports. A hang guard, not a timing check: before the fix Ctrl-C was ignored until
    the attach timed out."""
    code = (
        "import shmbridge, sys\n"
        "try:\n"
        "    shmbridge.attach(sys.argv[1], timeout=3600)\n"
        "except KeyboardInterrupt:\n"
        "    print('KeyboardInterrupt', flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.PIPE, text=True)
    try:
        region = f"/dev/shm/{name}"
        fds = f"/proc/{child.pid}/fd"
        while True:
            try:
                links = [os.readlink(os.path.join(fds, fd)) for fd in os.listdir(fds)]
            except (FileNotFoundError, ProcessLookupError):
                links = []
            if region in links:
                break
            assert child.poll() is None, "the child exited before opening the region"
            time.sleep(0.01)
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        pytest.fail("Ctrl-C was ignored while attach() waited for the engine")
    return out.strip()


def test_ctrl_c_during_attach_to_an_engine_that_never_publishes_frame_zero():
    spec = shmbridge.EngineSpec.standard("silent", 2, 3, 1)
    with shmbridge.Engine(spec) as engine:  # created, frame 0 never published
        assert _attach_then_ctrl_c(engine.name) == "KeyboardInterrupt"


def test_ctrl_c_during_attach_to_a_region_whose_header_is_never_published():
    import fcntl

    name = f"shmbridge-ctrlc-{os.getpid()}"
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        fcntl.flock(fd, fcntl.LOCK_EX)  # an engine stuck before writing its header
        assert _attach_then_ctrl_c(name) == "KeyboardInterrupt"
    finally:
        os.close(fd)
        os.unlink(path)


def test_views_of_what_the_other_side_writes_are_read_only(null_client):
    """Engine→client tensors are read-only on the client: NumPy views (through
    `__array__` or a DLPack 1.x capsule, which carries READ_ONLY) refuse writes; the
    client→engine ones stay writable. torch takes the flagged capsule as the same memory
    (before the fix `np.asarray(client.obs)` was writable)."""
    obs = np.asarray(null_client.obs)
    assert not obs.flags.writeable
    with pytest.raises(ValueError):
        obs[0, 0] = 1.0
    assert not np.from_dlpack(null_client.rewards).flags.writeable
    assert np.asarray(null_client.actions).flags.writeable
    assert np.from_dlpack(null_client.actions).flags.writeable
    torch = pytest.importorskip("torch")
    assert torch.from_dlpack(null_client.obs).data_ptr() == null_client.obs.data_ptr
    # A copy is the caller's own.
    assert np.array(null_client.obs, copy=True).flags.writeable


def test_an_engines_views_of_the_actions_are_read_only():
    with shmbridge.Engine(shmbridge.EngineSpec.standard("ro", 2, 3, 1)) as engine:
        assert not np.asarray(engine.actions).flags.writeable
        assert np.asarray(engine.obs).flags.writeable
