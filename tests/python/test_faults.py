"""The fault matrix from Python: a Python engine or a Python client killed with SIGKILL,
SIGTERM, and SIGSTOP then SIGKILL, at each phase (before attach, in attach, in step, in
reset, in call; for the engine, reset and call are inside its command handler). The
survivor gets the typed error of that death, nothing is left in /dev/shm under the
region's name, and an engine whose client died serves a new client.

Phases are reached deterministically: the victim is a peer process that prints when it is
inside the phase and then blocks reading its stdin, or a state the survivor sees (an
engine that received action n has a client inside step). Nothing sleeps to get there.

Detection times (from the fatal signal to the survivor's exception) are printed in a
table at the end of the run against a bound that is reported, never asserted.

Every case runs twice: with the victim in this process's namespaces, and in PID, network
and mount namespaces of its own (``unshare``, sharing /dev/shm), as in two containers of
one node (skipped, with the reason, where the namespaces cannot be made).
"""

from __future__ import annotations

import os
import queue
import select
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest

import shmbridge
from conftest import ISOLATED, descendant_running, namespaces_unavailable, region_exists

# A hang guard, not a timing check.
HANG = 60.0
# The survivors' call timeout: far past any detection, so a timeout means a miss.
LONG = 30.0
# What detection is compared with in the printed table (not asserted).
BOUND_MS = 100.0

PHASES = ["before-attach", "attach", "step", "reset", "call"]
FAULTS = ["SIGKILL", "SIGTERM", "SIGSTOP+KILL"]
ISOLATIONS = ["shared", "namespaces"]
NAMESPACES_UNAVAILABLE = namespaces_unavailable()


def _until_stopped(pid: int) -> None:
    """Waits until process ``pid`` (not a child of ours) is stopped."""
    deadline = time.monotonic() + HANG
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = ""
        if state == "T":
            return
        assert time.monotonic() < deadline, f"process {pid} never stopped"
        os.sched_yield()

_PEER_COMMON = r"""
import os, sys
import shmbridge

def say(line):
    print("FAULT " + line, flush=True)

def block():
    sys.stdin.read()  # until the test closes it or dies
    sys.exit(3)
"""

ENGINE_PEER = _PEER_COMMON + r"""
phase, simulator = sys.argv[1], sys.argv[2]
if simulator == "torch":
    # A simulator as some are: torch loaded, its thread pool started.
    import torch
    x = torch.randn(256, 256)
    x @ x
engine = shmbridge.Engine(
    shmbridge.EngineSpec.standard("faults", 4, obs_dim=4, act_dim=1, act_dtype="float32")
)
if phase == "attach":
    # Frame 0 never comes: once the client holds the slot it is inside attach.
    say("created " + engine.name)
    while not engine.client_attached:
        os.sched_yield()
    say("client-inside")
    block()
engine.publish()
say("served " + engine.name)

class Holding:
    def reset(self, env_ids, seeds, options):
        say("in-reset")
        block()

    def call(self, method, args, payload):
        say("in-call")
        block()

if phase == "before-attach":
    block()
engine.wait_actions(timeout=60, handler=Holding())
say("in-step")
block()
"""

CLIENT_PEER = _PEER_COMMON + r"""
phase, name, learner = sys.argv[1], sys.argv[2], sys.argv[3] == "torch"
if learner:
    # A learner as users run one: torch loaded, its thread pool started.
    import torch
    x = torch.randn(256, 256)
    x @ x
if phase == "before-attach":
    say("ready")
    block()
say("attaching")
client = shmbridge.attach(name, timeout=60)
say("attached")
if phase == "step":
    client.step(timeout=60)
elif phase == "reset":
    client.reset(seed=7, timeout=60)
elif phase == "call":
    client.call("hold", timeout=60)
say("returned")
block()
"""

ROWS: list = []


class Peer:
    """A peer process that reports its phase on stdout; killed and reaped at the end.
    ``isolated``: in namespaces of its own; ``pid`` is then its pid here."""

    def __init__(self, code: str, *args: str, isolated: bool = False):
        command = [sys.executable, "-c", code, *args]
        self.proc = subprocess.Popen(
            ISOLATED + command if isolated else command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.isolated = isolated
        self.pid = descendant_running(self.proc.pid, sys.executable) if isolated else self.proc.pid
        self.exited_at = None
        self._watch = None
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.decode().strip())
        self._lines.put("(end of output)")

    def expect(self, word: str) -> str:
        try:
            line = self._lines.get(timeout=HANG)
        except queue.Empty:
            raise AssertionError(f"the peer never said {word!r}") from None
        assert line.startswith("FAULT " + word), f"peer said {line!r}, expected {word!r}"
        return line[len("FAULT " + word):].strip()

    def _watch_exit(self) -> None:
        def watch():
            if self.isolated:
                # Not our child: a pidfd turns readable when it exits.
                try:
                    fd = os.pidfd_open(self.pid)
                except ProcessLookupError:  # gone already
                    self.exited_at = time.monotonic()
                    return
                try:
                    poller = select.poll()
                    poller.register(fd, select.POLLIN)
                    poller.poll()
                finally:
                    os.close(fd)
                self.exited_at = time.monotonic()
                return
            try:
                os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:  # reaped already, after a failure
                return
            self.exited_at = time.monotonic()

        self._watch = threading.Thread(target=watch, daemon=True)
        self._watch.start()

    def fault(self, fault: str, watch: bool = True) -> float:
        """Applies ``fault``; returns when the fatal signal was sent. ``watch``: note when
        the peer exits (``exit_ms``); not for a peer the test reaps itself."""
        if watch:
            self._watch_exit()
        pid = self.pid
        if fault == "SIGKILL":
            os.kill(pid, signal.SIGKILL)
        elif fault == "SIGTERM":
            os.kill(pid, signal.SIGTERM)
        else:
            os.kill(pid, signal.SIGSTOP)
            if self.isolated:  # stopped for sure
                _until_stopped(pid)
            else:
                os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOWAIT)
            os.kill(pid, signal.SIGKILL)
        return time.monotonic()

    def exit_ms(self, since: float):
        if self._watch is None:
            return None
        self._watch.join(HANG)
        return None if self.exited_at is None else (self.exited_at - since) * 1e3

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()


def in_thread(call):
    """Runs ``call`` in a thread; returns a function giving (exception, when it ended)."""
    out = {}

    def run():
        try:
            call()
            out["error"] = None
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e
        out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def result():
        t.join(HANG)
        assert not t.is_alive(), "the survivor hung"
        return out["error"], out["at"]

    return result


def record(case: str, error, detect_ms, exit_ms) -> None:
    ROWS.append((case, type(error).__name__ if error else "no error", detect_ms, exit_ms))


@pytest.fixture(scope="module", autouse=True)
def print_the_table(request):
    yield
    if not ROWS:
        return
    # Past pytest's capture, so the table shows in every run's output.
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is None or request.config.getoption("capture") == "no":  # pytest -s
        print_rows()
        return
    with capture.global_and_fixture_disabled():
        print_rows()


def print_rows() -> None:
    print(f"\n== fault matrix from Python (bound {BOUND_MS:.0f} ms, reported, not asserted)")
    print(f"{'case':<62} {'survivor got':<22} {'detected':>10} {'exited':>10}")
    fmt = lambda v: "-" if v is None else f"{v:.1f} ms"  # noqa: E731
    for case, got, detect, exit_ in ROWS:
        over = "  (over bound)" if detect is not None and detect > BOUND_MS else ""
        print(f"{case:<62} {got:<22} {fmt(detect):>10} {fmt(exit_):>10}{over}")
    for where, rows in [
        ("in this process's namespaces", [r for r in ROWS if "(other namespaces)" not in r[0]]),
        ("in namespaces of its own", [r for r in ROWS if "(other namespaces)" in r[0]]),
    ]:
        times = [d for _, _, d, _ in rows if d is not None]
        if times:
            print(f"detection, victim {where}, over {len(times)} cases: "
                  f"median {statistics.median(times):.1f} ms, max {max(times):.1f} ms")


def engine_case(phase: str, fault: str, simulator: str, isolation: str = "shared") -> None:
    """The Python engine (``simulator``: "plain", or "torch" for one with torch loaded;
    in namespaces of its own with ``isolation`` "namespaces") is killed by ``fault`` in
    ``phase``; the client gets EngineDiedError."""
    isolated = isolation == "namespaces"
    peer = Peer(ENGINE_PEER, phase, simulator, isolated=isolated)
    label = "python engine" if simulator == "plain" else f"{simulator} engine"
    if isolated:
        label += " (other namespaces)"
    try:
        name = peer.expect("created" if phase == "attach" else "served")
        killed = None
        if phase == "before-attach":
            peer.fault(fault, watch=False)
            peer.proc.wait()
            start = time.monotonic()
            with pytest.raises(shmbridge.EngineDiedError) as info:
                shmbridge.attach(name, timeout=LONG)
            error, detect = info.value, (time.monotonic() - start) * 1e3
        elif phase == "attach":
            result = in_thread(lambda: shmbridge.attach(name, timeout=LONG))
            peer.expect("client-inside")
            killed = peer.fault(fault)
            error, at = result()
            detect = (at - killed) * 1e3
        else:
            client = shmbridge.attach(name, timeout=LONG)
            calls = {
                "step": lambda: client.step(timeout=LONG),
                "reset": lambda: client.reset(seed=7, timeout=LONG),
                "call": lambda: client.call("hold", timeout=LONG),
            }
            result = in_thread(calls[phase])
            peer.expect("in-" + phase)
            killed = peer.fault(fault)
            error, at = result()
            detect = (at - killed) * 1e3
            client.close()
        record(f"{label} {fault} in {phase}", error, detect, killed and peer.exit_ms(killed))
        assert isinstance(error, shmbridge.EngineDiedError), repr(error)
        assert not region_exists(name), f"{name} left in /dev/shm"
    finally:
        peer.close()


# A process with torch loaded (as learners and some simulators are) takes long to exit:
# its death must be noticed when it starts, not when the kernel has torn it down.
HEAVY_PHASES = ["step", "reset", "call"]
CASES = [
    (p, f, kind, iso)
    for iso in ISOLATIONS
    for (p, f, kind) in [(p, f, "plain") for p in PHASES for f in FAULTS]
    + [(p, f, "torch") for p in HEAVY_PHASES for f in FAULTS]
]


def case_id(case) -> str:
    return "-".join(case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_python_engine_killed_client_gets_engine_died(case):
    phase, fault, simulator, isolation = case
    if isolation == "namespaces" and NAMESPACES_UNAVAILABLE:
        pytest.skip(NAMESPACES_UNAVAILABLE)
    if simulator == "torch":
        pytest.importorskip("torch")
    engine_case(phase, fault, simulator, isolation)


class Holding:
    """The surviving engine's handler: says it is inside the command, then waits until
    the test lets it go (after the client was killed)."""

    def __init__(self):
        self.inside = threading.Event()
        self.go = threading.Event()

    def _hold(self):
        self.inside.set()
        self.go.wait(HANG)

    def reset(self, env_ids, seeds, options):
        self._hold()

    def call(self, method, args, payload):
        self._hold()
        return {}


def serves_a_new_client(engine: shmbridge.Engine) -> None:
    """The engine whose client died takes a new one: attach, one step, close. It waits
    once the new client holds the slot (a wait before reports the dead one again)."""

    def new_client():
        with shmbridge.attach(engine.name, timeout=LONG) as c:
            c.step(timeout=LONG)

    result = in_thread(new_client)
    deadline = time.monotonic() + HANG
    while not engine.client_attached:
        assert time.monotonic() < deadline, "the new client never attached"
        os.sched_yield()
    engine.wait_actions(timeout=LONG)
    engine.publish()
    with pytest.raises(shmbridge.ClientClosedError):
        engine.wait_actions(timeout=LONG)
    error, _ = result()
    assert error is None, repr(error)


def spec() -> shmbridge.EngineSpec:
    return shmbridge.EngineSpec.standard("faults", 4, obs_dim=4, act_dim=1, act_dtype="float32")


def client_case(phase: str, fault: str, learner: str, isolation: str = "shared") -> None:
    """The client (``learner``: "plain", or "torch" for one with torch loaded; in
    namespaces of its own with ``isolation`` "namespaces") is killed by ``fault`` in
    ``phase``; the engine gets ClientDiedError and serves a new client."""
    isolated = isolation == "namespaces"
    engine = shmbridge.Engine(spec())
    name = engine.name
    if phase != "attach":
        engine.publish()
    peer = Peer(CLIENT_PEER, phase, name, learner, isolated=isolated)
    label = "python client" if learner == "plain" else f"{learner} learner"
    if isolated:
        label += " (other namespaces)"
    try:
        if phase == "before-attach":
            peer.expect("ready")
            peer.fault(fault, watch=False)
            peer.proc.wait()
            # No client came: the engine keeps waiting (a timeout, not a death).
            with pytest.raises(shmbridge.TimeoutError):
                engine.wait_actions(timeout=0.1)
            record(f"{label} {fault} in {phase}", None, None, None)
        else:
            peer.expect("attaching")
            if phase == "attach":
                deadline = time.monotonic() + HANG
                while not engine.client_attached:  # it holds the slot, waits for frame 0
                    assert time.monotonic() < deadline, "the client never claimed the slot"
                    os.sched_yield()
                killed = peer.fault(fault)
                engine.publish()
                survivor = lambda: engine.wait_actions(timeout=LONG)  # noqa: E731
            elif phase == "step":
                peer.expect("attached")
                engine.wait_actions(timeout=LONG)  # the client's step 1 is in flight
                killed = peer.fault(fault)
                engine.publish()
                survivor = lambda: engine.wait_actions(timeout=LONG)  # noqa: E731
            else:
                peer.expect("attached")
                handler = Holding()
                when = {}

                def killer():
                    handler.inside.wait(HANG)
                    when["killed"] = peer.fault(fault)
                    handler.go.set()

                k = threading.Thread(target=killer, daemon=True)
                k.start()
                survivor = lambda: engine.wait_actions(timeout=LONG, handler=handler)  # noqa: E731
            try:
                survivor()
                error = None
            except shmbridge.ShmBridgeError as e:
                error = e
            at = time.monotonic()
            if phase in ("reset", "call"):
                k.join(HANG)
                killed = when["killed"]
            record(f"{label} {fault} in {phase}", error, (at - killed) * 1e3, peer.exit_ms(killed))
            assert isinstance(error, shmbridge.ClientDiedError), repr(error)
        serves_a_new_client(engine)
    finally:
        peer.close()
        engine.close()
    assert not region_exists(name), f"{name} left in /dev/shm"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_python_client_killed_engine_gets_client_died_and_serves_again(case):
    phase, fault, learner, isolation = case
    if isolation == "namespaces" and NAMESPACES_UNAVAILABLE:
        pytest.skip(NAMESPACES_UNAVAILABLE)
    if learner == "torch":
        pytest.importorskip("torch")
    client_case(phase, fault, learner, isolation)


# ---- Observers (protocol 1.7): killed anywhere, nothing changes for engine and learner ----

OBSERVER_PEER = _PEER_COMMON + r"""
phase, name = sys.argv[1], sys.argv[2]
say("attaching")
observer = shmbridge.observe(name, timeout=60)
say("attached")
if phase == "idle":
    block()
say("reading")
while True:  # copies, stats and frame numbers, as a viewer polls them, without pause
    observer.latest(timeout=None)
    observer.stats(timeout=None)
"""

OBSERVER_PHASES = ["attach", "idle", "reading"]


def observer_case(phase: str, fault: str) -> None:
    """A Python observer is killed by ``fault`` while attaching (before frame 0), attached,
    or reading in a loop; the engine (the `null` reference engine) and its learner go on
    exactly as without it: every frame holds its pattern, nothing is reported dead or
    closed, gc leaves the region, and closing removes it."""
    from conftest import pattern

    engine = shmbridge.Engine(shmbridge.EngineSpec.standard("observed", 4, obs_dim=8, act_dim=1))
    name = engine.name
    peer = Peer(OBSERVER_PEER, phase, name)
    stop = threading.Event()
    try:
        obs = __import__("numpy").asarray(engine.obs)
        obs[:] = pattern(0, range(32)).reshape(4, 8)
        peer.expect("attaching")
        if phase == "attach":
            # It has the region open and waits for frame 0 (its descriptor is in /proc).
            deadline = time.monotonic() + HANG
            while not any(os.readlink(f"/proc/{peer.proc.pid}/fd/{fd}").endswith(name)
                          for fd in os.listdir(f"/proc/{peer.proc.pid}/fd")
                          if os.path.islink(f"/proc/{peer.proc.pid}/fd/{fd}")):
                assert time.monotonic() < deadline, "the observer never opened the region"
                time.sleep(0.001)
        engine.publish()
        if phase != "attach":
            peer.expect("attached")
        if phase == "reading":
            peer.expect("reading")

        def serve():
            while not stop.is_set():
                try:
                    n = engine.wait_actions(timeout=LONG)
                except shmbridge.ClientClosedError:
                    return
                obs[:] = pattern(n, range(32)).reshape(4, 8)
                engine.publish()

        server = in_thread(serve)
        client = shmbridge.attach(name, timeout=LONG)
        killed = None
        for k in range(1, 201):
            if k == 50:
                killed = peer.fault(fault)
            client.step(timeout=LONG)
            assert (__import__("numpy").asarray(client.obs) == pattern(k, range(32)).reshape(4, 8)).all()
        swept = shmbridge.gc()
        assert name not in swept, "gc judged a live engine by a dead observer"
        client.close()
        error, _ = server()
        assert error is None, f"the engine saw {error!r}"
        record(f"observer {fault} in {phase}", None, None, peer.exit_ms(killed))
    finally:
        stop.set()
        peer.close()
        engine.close()
    assert not region_exists(name), f"{name} left in /dev/shm"


@pytest.mark.parametrize("phase", OBSERVER_PHASES)
@pytest.mark.parametrize("fault", FAULTS)
def test_an_observer_killed_anywhere_changes_nothing_for_engine_and_learner(phase, fault):
    observer_case(phase, fault)
