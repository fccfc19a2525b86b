"""shmbridge.Engine: a simulator written in Python serving a client."""

from __future__ import annotations

import importlib.util
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import shmbridge
from conftest import needs_root, run_in_private_shm

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "python_engine.py"


def toy_spec(n: int = 4) -> shmbridge.EngineSpec:
    return (
        shmbridge.EngineSpec.standard("toy", n, obs_dim=3, act_dim=2, act_dtype="float32")
        .tensor("rgb", "uint8", (n, 2, 2, 3))
        .metadata("action_space", "box")
    )


class Doubler:
    """Engine loop in a thread: obs = 2 * actions[:, :1]; rgb = step number."""

    def __init__(self, engine: shmbridge.Engine, handler=None):
        self.engine = engine
        self.handler = handler
        self.error: BaseException | None = None
        self.obs = np.from_dlpack(engine.obs)
        self.rgb = np.from_dlpack(engine["rgb"])
        self.actions = np.from_dlpack(engine.actions)
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        try:
            while True:
                seq = self.engine.wait_actions(timeout=30, handler=self.handler)
                self.obs[:] = 2 * self.actions[:, :1]
                self.rgb[:] = seq % 256
                self.engine.publish()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            self.error = e


@pytest.fixture
def served():
    engine = shmbridge.Engine(toy_spec())
    np.from_dlpack(engine.obs)[:] = 7.0
    engine.publish()
    loop = Doubler(engine)
    loop.thread.start()
    client = shmbridge.attach(engine.name)
    yield engine, client, loop
    client.close()
    loop.thread.join()
    engine.close()


def test_engine_views_are_zero_copy_and_reach_the_client(served):
    engine, client, loop = served
    assert engine.obs.writable and not engine.actions.writable
    assert engine.obs.direction == "engine->client"
    # The engine's NumPy views are its mapping of the shared bytes, not copies.
    assert loop.obs.__array_interface__["data"][0] == engine.obs.data_ptr
    assert loop.actions.__array_interface__["data"][0] == engine.actions.data_ptr
    assert np.all(np.asarray(client.obs) == 7.0)  # frame 0 as the engine wrote it
    for k in range(1, 50):
        actions = np.full((4, 2), k, dtype=np.float32)
        obs, _, _, _ = client.step(actions)
        assert np.all(np.asarray(obs) == 2 * k)
        assert np.all(np.asarray(client["rgb"]) == k)
    assert engine.frame == 49
    assert engine.client_attached


def test_schema_reports_the_spec_and_metadata(served):
    engine, client, _ = served
    schema = client.schema()
    assert schema["engine_kind"] == "toy" and schema["num_envs"] == 4
    assert [t["name"] for t in schema["tensors"]] == [
        "obs", "actions", "rewards", "terminated", "truncated", "reset_mask", "rgb",
    ]
    assert schema["tensors"][-1]["shape"] == (4, 2, 2, 3)
    assert schema["metadata"] == {"action_space": "box"}
    assert repr(engine).startswith("<shmbridge.Engine 'shmbridge-")


class Handler:
    def __init__(self, engine):
        self.obs = np.from_dlpack(engine.obs)
        self.resets = []

    def reset(self, env_ids, seeds, options):
        self.resets.append((env_ids, seeds, options))
        if env_ids == [99]:
            raise ValueError("no env 99")
        self.obs[:] = -1.0

    def call(self, method, args, payload):
        if method == "add":
            return {"sum": int(args["a"]) + int(args["b"])}
        if method == "reverse":
            return payload[::-1]
        if method == "both":
            return {"n": len(payload)}, payload * 2
        if method == "todo":
            raise NotImplementedError("later")
        if method == "crash":
            raise RuntimeError("kaboom")
        return NotImplemented


def test_commands_reach_the_python_handler():
    engine = shmbridge.Engine(toy_spec())
    engine.publish()
    handler = Handler(engine)
    loop = Doubler(engine, handler)
    loop.thread.start()
    try:
        with shmbridge.attach(engine.name) as client:
            assert client.reset(seed=[5, 6], env_ids=[1, 2]) == 0
            assert handler.resets == [([1, 2], [5, 6], {})]
            assert np.all(np.asarray(client.obs) == -1.0)
            assert client.call("add", a=2, b=40) == {"sum": "42"}
            assert client.call("reverse", payload=b"abc") == {"payload": b"cba"}
            assert client.call("both", payload=b"xy") == {"n": "2", "payload": b"xyxy"}
            expected = {"todo": 4, "crash": 3, "nosuch": 1}  # wire codes: unsupported, engine error, unknown
            for method, code in expected.items():
                with pytest.raises(shmbridge.RemoteError) as info:
                    client.call(method)
                assert info.value.code == code, info.value
            with pytest.raises(shmbridge.RemoteError, match="no env 99") as info:
                client.reset(env_ids=[99])
            assert info.value.code == 2  # bad request
            # The engine kept serving through every refusal.
            obs, _, _, _ = client.step(np.ones((4, 2), np.float32))
            assert np.all(np.asarray(obs) == 2.0)
        loop.thread.join()
        assert isinstance(loop.error, shmbridge.ClientClosedError)
    finally:
        engine.close()


def test_reset_without_a_handler_is_unsupported(served):
    _, client, _ = served
    with pytest.raises(shmbridge.RemoteError, match="no reset") as info:
        client.reset()
    assert info.value.code == 4


def test_wait_actions_times_out_and_publish_out_of_order_is_refused():
    with shmbridge.Engine(toy_spec()) as engine:
        with pytest.raises(shmbridge.OutOfOrderError):
            engine.wait_actions(timeout=0.01)  # frame 0 not published
        engine.publish()
        with pytest.raises(shmbridge.OutOfOrderError):
            engine.publish()  # no action pending
        with pytest.raises(shmbridge.TimeoutError) as info:
            engine.wait_actions(timeout=0.05)
        assert isinstance(info.value, TimeoutError)  # the builtin too
    assert engine.closed
    with pytest.raises(shmbridge.ClosedError):
        engine.publish()


def test_ctrl_c_during_wait_actions_raises_keyboard_interrupt():
    with shmbridge.Engine(toy_spec()) as engine:
        engine.publish()
        main = threading.main_thread().ident

        def interrupt_once_waiting():
            # poll_commands() refuses with "busy" while the main thread is inside
            # wait_actions().
            while True:
                try:
                    engine.poll_commands()
                except RuntimeError:
                    break
            signal.pthread_kill(main, signal.SIGINT)

        t = threading.Thread(target=interrupt_once_waiting)
        t.start()
        # A long timeout, so a missed signal fails as TimeoutError rather than hanging.
        with pytest.raises(KeyboardInterrupt):
            engine.wait_actions(timeout=60)
        t.join()
        # Still usable afterwards.
        with pytest.raises(shmbridge.TimeoutError):
            engine.wait_actions(timeout=0.01)


def test_close_from_another_thread_ends_a_wait_in_progress():
    engine = shmbridge.Engine(toy_spec())
    engine.publish()
    outcome = []

    def wait():
        try:
            engine.wait_actions(timeout=60)
        except shmbridge.ShmBridgeError as e:
            outcome.append(e)

    t = threading.Thread(target=wait)
    t.start()
    while True:  # until the other thread is inside wait_actions()
        try:
            engine.poll_commands()
        except RuntimeError:
            break
    engine.close()  # must neither deadlock on the GIL nor wait for the 60 s timeout
    t.join()
    assert len(outcome) == 1 and isinstance(outcome[0], shmbridge.ClosedError)
    assert engine.name not in shmbridge.list_regions()


def test_client_killed_is_client_died_and_engine_closed_is_seen_by_client():
    engine = shmbridge.Engine(toy_spec())
    engine.publish()
    code = (
        "import sys, shmbridge; c = shmbridge.attach(sys.argv[1]); "
        "print('attached', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, engine.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline().strip() == b"attached"
        assert engine.client_attached
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with pytest.raises(shmbridge.ClientDiedError):
            engine.wait_actions(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    # A new client may attach after the dead one, and sees the engine close.
    client = shmbridge.attach(engine.name)
    view = np.from_dlpack(client.obs)
    engine.close()
    with pytest.raises(shmbridge.EngineClosedError):
        client.step(timeout=30)
    assert view.shape == (4, 3)  # the view outlives both sides' handles
    client.close()


@pytest.mark.parametrize(
    "build, exc, match",
    [
        (lambda: shmbridge.EngineSpec("x", 2).tensor("a", "float32", (2,)).tensor("a", "float32", (2,)),
         shmbridge.InvalidSpecError, "a"),
        (lambda: shmbridge.EngineSpec("x", 2).tensor("a", "complex64", (2,)), TypeError, "unsupported dtype"),
        (lambda: shmbridge.EngineSpec("x", 2).tensor("a", "float32", (2,), "sideways"), ValueError, "direction"),
        (lambda: shmbridge.EngineSpec("x", 2).tensor("a", "float32", ()), shmbridge.InvalidSpecError, None),
        (lambda: shmbridge.EngineSpec("x", 0).tensor("a", "float32", (1,)), shmbridge.InvalidSpecError, None),
        (lambda: shmbridge.EngineSpec("x", 2, name="../etc").tensor("a", "float32", (2,)),
         shmbridge.InvalidNameError, None),
    ],
)
def test_bad_specs_raise_and_create_nothing(build, exc, match):
    before = set(shmbridge.list_regions())
    with pytest.raises(exc, match=match):
        shmbridge.Engine(build())
    assert not set(shmbridge.list_regions()) - before


def test_dtypes_may_be_given_as_numpy_or_torch_dtypes():
    torch = pytest.importorskip("torch")
    spec = (
        shmbridge.EngineSpec("x", 2)
        .tensor("a", np.float16, (2,))
        .tensor("b", np.dtype("int32"), (2,))
        .tensor("c", torch.bfloat16, (2,), "client->engine")
    )
    assert [t[1] for t in spec.tensors] == ["float16", "int32", "bfloat16"]
    with shmbridge.Engine(spec) as engine:
        assert torch.from_dlpack(engine["c"]).dtype == torch.bfloat16


def _load_example():
    spec = importlib.util.spec_from_file_location("python_engine_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_python_engine_serves_pendulum_dynamics():
    example = _load_example()
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--num-envs", "8", "--seed", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith("shmbridge-"), proc.stderr.read()
        with shmbridge.attach(name) as client:
            assert client.schema()["metadata"]["env_id"] == "Pendulum-v1"
            obs = np.asarray(client.obs).astype(np.float64)
            rng = np.random.default_rng(0)
            for _ in range(150):  # < MAX_STEPS: no autoreset in between
                u = rng.uniform(-2, 2, (8, 1)).astype(np.float32)
                th = np.arctan2(obs[:, 1], obs[:, 0])
                want_th, want_thdot, want_r = example.pendulum_step(th, obs[:, 2], u[:, 0].astype(np.float64), 10.0)
                new_obs, rewards, terminated, truncated = client.step(u)
                new_obs = np.asarray(new_obs).astype(np.float64)
                np.testing.assert_allclose(new_obs, example.observe(want_th, want_thdot), rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(np.asarray(rewards), want_r, rtol=1e-4, atol=1e-4)
                assert not np.asarray(terminated).any() and not np.asarray(truncated).any()
                obs = new_obs
            assert client.call("set_gravity", g=3.5) == {"previous": "10.0"}
            client.reset(seed=11)
            first = np.asarray(client.obs).copy()
            client.reset(seed=11)
            np.testing.assert_array_equal(np.asarray(client.obs), first)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_engine_start_and_region_tools_do_not_block_on_a_fifo(region_namespace):
    """A FIFO named like a region of this test's namespace (any local user can make one in
    /dev/shm): `Engine()` (whose start sweeps the namespace), `list_regions()` and `gc()`
    neither block on it nor remove it. Run in a child process, so a hang fails the test
    instead of stalling it."""
    fifo = f"/dev/shm/{region_namespace}pyfifo-{os.getpid()}"
    os.mkfifo(fifo, 0o666)
    try:
        code = (
            "import shmbridge, sys\n"
            "e = shmbridge.Engine(shmbridge.EngineSpec.standard('toy', 2, 3, 1))\n"
            "assert sys.argv[1] in shmbridge.list_regions()\n"
            "assert sys.argv[1] not in shmbridge.gc()\n"
            "e.close()\n"
            "print('served')\n"
        )
        try:
            out = subprocess.run(
                [sys.executable, "-c", code, os.path.basename(fifo)],
                capture_output=True, text=True, timeout=120,
            )
        except subprocess.TimeoutExpired:
            pytest.fail("Engine(), list_regions() or gc() blocked on a FIFO in /dev/shm")
        assert out.returncode == 0 and "served" in out.stdout, out.stderr
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    finally:
        os.unlink(fifo)


@needs_root
def test_a_region_larger_than_dev_shm_raises_in_process_and_from_launch():
    """In an 8 MB tmpfs (a small Docker /dev/shm): an in-process `Engine()` of 21.7 MB
    raises `NoSpaceError` naming the sizes and `--shm-size` (before the fix it returned an
    engine whose first write past 8 MB killed the interpreter with SIGBUS), `launch()`
    raises `EngineStartError` carrying the same message, and nothing is left in /dev/shm."""
    code = (
        "import os, shmbridge\n"
        "spec = shmbridge.EngineSpec('big', 1024).tensor('rgb', 'uint8', [1024, 84, 84, 3])\n"
        "spec.tensor('actions', 'float32', [1024, 1], 'client->engine')\n"
        "try:\n"
        "    shmbridge.Engine(spec)\n"
        "except shmbridge.NoSpaceError as e:\n"
        "    assert isinstance(e, OSError) and '--shm-size' in str(e) and '21.7 MiB' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('Engine() did not raise')\n"
        "assert os.listdir('/dev/shm') == [], os.listdir('/dev/shm')\n"
        "try:\n"
        "    shmbridge.launch('null', 1024, obs_dim=4, act_dim=1, image='84x84x3')\n"
        "except shmbridge.EngineStartError as e:\n"
        "    assert 'no room in /dev/shm' in str(e) and '--shm-size' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('launch() did not raise')\n"
        "assert os.listdir('/dev/shm') == [], os.listdir('/dev/shm')\n"
        "print('raised')\n"
    )
    out = run_in_private_shm(code, "8m")
    assert out.returncode == 0 and "raised" in out.stdout, (out.returncode, out.stdout, out.stderr)


def test_a_command_backlog_is_typed_and_the_session_keeps_stepping():
    """Calls time out while the engine's handler is held, until the request ring is full
    (`CommandBacklogError`, nothing sent); released, the engine drops every reply nobody
    waits for instead of waiting for room, and the session steps on."""
    spec = shmbridge.EngineSpec("backlog", 2, ring_capacity=4096)
    spec.tensor("obs", "float32", [2, 3]).tensor("actions", "float32", [2, 1], "client->engine")
    gate = threading.Event()

    class Held:
        def call(self, method, args, payload):
            if method == "slow":
                gate.wait()
            return payload

    with shmbridge.Engine(spec) as engine:
        engine.publish()

        def serve():
            while True:
                try:
                    engine.wait_actions(timeout=30, handler=Held())
                except shmbridge.ClientClosedError:
                    return
                engine.publish()

        server = threading.Thread(target=serve)
        server.start()
        with shmbridge.attach(engine.name) as client:
            sent = 0
            with pytest.raises(shmbridge.CommandBacklogError):
                while sent < 100:
                    with pytest.raises(shmbridge.TimeoutError):
                        client.call("slow", payload=b"x" * 1000, timeout=0.02)
                    sent += 1
            assert 3 <= sent < 100
            gate.set()
            for k in range(1, 6):
                client.step(timeout=30)
                assert client.frame == k
            assert client.ping(b"fresh", timeout=30) == b"fresh"
        server.join()
        assert engine.dropped_replies in (sent - 1, sent)


def test_an_engine_serves_one_client_after_another_and_waits_without_spinning():
    """After reporting its client's end once, `wait_actions` waits for a new client (and
    its action) instead of raising again at once, and `wait_for_client` blocks until one
    attaches. Before the fix every later `wait_actions` raised `ClientClosedError` at
    once: a loop waiting for the next client burnt a core."""
    with shmbridge.Engine(toy_spec()) as engine:
        engine.publish()
        shmbridge.attach(engine.name).close()
        with pytest.raises(shmbridge.ClientClosedError):
            engine.wait_actions(timeout=30)
        # Reported once: with no new client, the next wait times out.
        with pytest.raises(shmbridge.TimeoutError):
            engine.wait_actions(timeout=0.2)

        def one_step():
            with shmbridge.attach(engine.name) as client:
                client.step(timeout=30)

        second = threading.Thread(target=one_step)
        second.start()
        assert engine.wait_actions(timeout=60) == 1
        engine.publish()
        second.join()
        with pytest.raises(shmbridge.ClientClosedError):
            engine.wait_actions(timeout=30)

        attached, release = threading.Event(), threading.Event()

        def stay_attached():
            with shmbridge.attach(engine.name):
                attached.set()
                release.wait(60)

        third = threading.Thread(target=stay_attached)
        third.start()
        engine.wait_for_client(timeout=60)
        assert engine.client_attached
        release.set()
        third.join()
        with pytest.raises(shmbridge.TimeoutError):
            engine.wait_for_client(timeout=0.2)


def test_example_python_engine_keeps_serving_one_learner_after_another():
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--num-envs", "4", "--keep-serving", "--idle-timeout", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith("shmbridge-"), proc.stderr.read()
        for learner in range(3):
            with shmbridge.attach(name) as client:
                for _ in range(5):
                    client.step(np.zeros((4, 1), np.float32))
                assert client.frame == 5 * (learner + 1)
        # No fourth learner within the idle timeout: the engine closes and exits.
        assert proc.wait(60) == 0
        assert name not in shmbridge.list_regions()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cuda_sharing_is_auto_ipc_or_fd_and_nothing_else():
    # Host tensors only: the choice concerns nothing, and each valid value is taken.
    for sharing in ("auto", "ipc", "FD"):
        with shmbridge.Engine(toy_spec(), cuda_sharing=sharing) as engine:
            assert engine.frame == 0
    with pytest.raises(shmbridge.InvalidSpecError, match="auto, ipc or fd"):
        shmbridge.Engine(toy_spec(), cuda_sharing="vmm")
