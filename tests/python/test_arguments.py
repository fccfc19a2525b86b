"""Bad arguments to `launch()` raise TypeError/ValueError before any process starts."""

from __future__ import annotations

import os
import subprocess

import pytest

import shmbridge
from conftest import needs_root, run_in_private_shm


@pytest.fixture
def no_process(monkeypatch):
    """Fails the test if `launch()` starts a process (it starts its engine through the
    library's one spawning path, `_process.EngineProcess`)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(shmbridge._launch, "EngineProcess", refuse)


@pytest.mark.parametrize("num_envs, error", [
    (1.9, TypeError), ("4", TypeError), (True, TypeError), (None, TypeError),
    (0, ValueError), (-3, ValueError), (2**32, ValueError), (2**63, ValueError),
])
def test_num_envs_must_be_a_positive_int(no_process, num_envs, error):
    with pytest.raises(error, match="num.envs"):
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
    # Past what the engine's parser takes: refused by that parser, before a process.
    (dict(seed=2**64), ValueError, "seed"),
    (dict(obs_dim=2**64), ValueError, "obs.dim"),
    (dict(spin_us=-1), ValueError, "spin.us"),
    (dict(image="0x0x0"), ValueError, "image"),
    (dict(image="84x84"), ValueError, "image"),
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


# Run in a private 64 MB /dev/shm with a 4 GiB address-space cap: what would eat the
# machine must fail, and fail with a typed error.
_ABSURD = r'''
import os, shmbridge
from shmbridge import EngineSpec, Engine

TYPED = (shmbridge.ShmBridgeError, TypeError, ValueError)
seen = []

def expect(what, f, kind=TYPED):
    try:
        f()
    except kind as e:
        # An engine's stderr travels in EngineStartError: no panic or abort in it either.
        for crash in ("panicked", "memory allocation of", "RUST_BACKTRACE"):
            assert crash not in str(e), f"{what}: {e}"
        seen.append(f"{what}: {type(e).__name__}")
        return
    except BaseException as e:  # a pyo3 PanicException is a BaseException
        raise AssertionError(f"{what}: {type(e).__name__}: {e}") from None
    raise AssertionError(f"{what}: no error")

expect("launch cartpole 10**9", lambda: shmbridge.launch("cartpole", num_envs=10**9), shmbridge.EngineStartError)
expect("launch null 2**32", lambda: shmbridge.launch("null", num_envs=2**32), ValueError)
expect("launch obs_dim 2**64", lambda: shmbridge.launch("null", 4, obs_dim=2**64), ValueError)
expect("launch image", lambda: shmbridge.launch("null", 4, image="4294967296x4294967296x4294967296"), shmbridge.EngineStartError)
expect("spec num_envs 2**32", lambda: EngineSpec("k", 2**32), ValueError)
expect("spec num_envs 0", lambda: Engine(EngineSpec.standard("k", 0, 1, 1)), shmbridge.InvalidSpecError)
expect("spec shape", lambda: Engine(EngineSpec("k", 4).tensor("obs", "float32", [2**62, 2**62])), shmbridge.InvalidSpecError)
expect("spec huge", lambda: Engine(EngineSpec.standard("k", 10**9, 10**9, 10**9)), (shmbridge.InvalidSpecError, shmbridge.NoSpaceError))
expect("spec big", lambda: Engine(EngineSpec.standard("k", 10**6, 10**3, 1)), shmbridge.NoSpaceError)
expect("ring 3", lambda: Engine(EngineSpec("k", 4, ring_capacity=3).tensor("o", "float32", [4])), shmbridge.InvalidSpecError)
expect("ring 2**40", lambda: Engine(EngineSpec("k", 4, ring_capacity=2**40).tensor("o", "float32", [4])), shmbridge.NoSpaceError)
expect("ring 2**64", lambda: EngineSpec("k", 4, ring_capacity=2**64), ValueError)
expect("attach long name", lambda: shmbridge.attach("x" * 5000, timeout=1e300), shmbridge.InvalidNameError)
expect("attach absent", lambda: shmbridge.attach("shmbridge-absent", timeout=1e300), shmbridge.NotFoundError)

with Engine(EngineSpec.standard("k", 4, 3, 1), spin_us=1e300) as e:
    e.publish()
with shmbridge.launch("cartpole", 4, timeout=1e300, idle_timeout=1e300, spin_us=1e300) as c:
    c.step(timeout=1e300)
    expect("reset seed 2**64", lambda: c.reset(seed=2**64), ValueError)
    expect("reset env_ids 2**32", lambda: c.reset(env_ids=[2**32]), ValueError)
    expect("reset env_ids 10**6", lambda: c.reset(env_ids=[10**6]), shmbridge.RemoteError)
    expect("call payload", lambda: c.call("set_pole_length", payload=b"x" * (64 << 20)), shmbridge.RecordTooLargeError)
    expect("step timeout nan", lambda: c.step(timeout=float("nan")), ValueError)
    c.reset(seed=1, timeout=1e300)
    c.step()
assert os.listdir("/dev/shm") == [], os.listdir("/dev/shm")
print("\n".join(seen))
print("typed errors only")
'''


@needs_root
def test_absurd_sizes_at_every_python_entry_point_are_typed_errors():
    """Absurd sizes at `launch()`, `EngineSpec`/`Engine`, `attach()` and a client's calls:
    a typed exception each, never a Rust panic (pyo3's PanicException), an abort or a
    signal. Before the fix `launch("cartpole", num_envs=10**9)` ended in an engine panic."""
    out = run_in_private_shm(_ABSURD, "64m", memory_kib=4 << 20)
    assert out.returncode == 0 and "typed errors only" in out.stdout, (out.returncode, out.stdout, out.stderr)
    assert "panicked" not in out.stderr, out.stderr


@pytest.mark.parametrize("kwargs, error", [
    (dict(blocking="yes"), TypeError), (dict(blocking=1), TypeError), (dict(importer=3), TypeError),
])
def test_wait_and_importer_options_of_launch_are_checked_first(no_process, kwargs, error):
    with pytest.raises(error):
        shmbridge.launch("null", num_envs=2, **kwargs)


def _own_regions() -> set:
    """Regions whose engine is this process (other tests on the machine make their own)."""
    own = set()
    for name in shmbridge.list_regions():
        try:
            with open(f"/dev/shm/{name}", "rb") as f:
                head = f.read(68)
        except OSError:
            continue
        if len(head) == 68 and int.from_bytes(head[64:68], "little") == os.getpid():
            own.add(name)
    return own


def _spec(**kw):
    return shmbridge.EngineSpec.standard("toy", 2, 3, 1, **kw)


# Each callable must raise before anything is created. Python's True == 1: a bool is not
# taken for a count or a number of seconds, nor a float for a count.
@pytest.mark.parametrize("call, error", [
    (lambda: shmbridge.EngineSpec("k", True), TypeError),
    (lambda: shmbridge.EngineSpec("k", 2.0), TypeError),
    (lambda: shmbridge.EngineSpec("k", "2"), TypeError),
    (lambda: shmbridge.EngineSpec("k", -2), ValueError),
    (lambda: shmbridge.EngineSpec("k", 2, ring_capacity=True), TypeError),
    (lambda: shmbridge.EngineSpec("k", 2, ring_capacity=4096.0), TypeError),
    (lambda: shmbridge.EngineSpec.standard("k", 2, True, 1), TypeError),
    (lambda: shmbridge.EngineSpec.standard("k", 2, 3, 1.5), TypeError),
    (lambda: shmbridge.EngineSpec("k", 2).tensor("obs", "float32", [2, True]), TypeError),
    (lambda: shmbridge.EngineSpec("k", 2).tensor("obs", "float32", [2, 3.0]), TypeError),
    (lambda: shmbridge.EngineSpec("k", 2).tensor("obs", "float32", "23"), TypeError),
    (lambda: shmbridge.Engine(_spec(), spin_us=True), TypeError),
    (lambda: shmbridge.Engine(_spec(), spin_us="5"), TypeError),
    (lambda: shmbridge.Engine(_spec(), spin_us=-1.0), ValueError),
    (lambda: shmbridge.Engine(_spec(), spin_us=float("nan")), ValueError),
    (lambda: shmbridge.Engine(_spec(), blocking=1), TypeError),
    (lambda: shmbridge.Engine("spec"), TypeError),
    (lambda: shmbridge.attach(3), TypeError),
    (lambda: shmbridge.attach("shmbridge-absent", timeout=True), TypeError),
    (lambda: shmbridge.attach("shmbridge-absent", timeout="5"), TypeError),
    (lambda: shmbridge.attach("shmbridge-absent", timeout=-1), ValueError),
    (lambda: shmbridge.attach("shmbridge-absent", timeout=float("nan")), ValueError),
    (lambda: shmbridge.attach("shmbridge-absent", spin_us=True), TypeError),
    (lambda: shmbridge.attach("shmbridge-absent", spin_us=-3), ValueError),
    (lambda: shmbridge.attach("shmbridge-absent", blocking="no"), TypeError),
    (lambda: shmbridge.attach("shmbridge-absent", importer=1), TypeError),
    (lambda: shmbridge.attach("shmbridge-absent", importer="opengl"), ValueError),
])
def test_bad_arguments_to_engines_and_attach_raise_before_anything_is_created(call, error):
    before = _own_regions()
    with pytest.raises(error):
        call()
    assert _own_regions() <= before


@pytest.mark.parametrize("call, message", [
    (lambda: shmbridge.EngineSpec("k", 2**32), "4294967296 is too large: at most 4294967295"),
    (lambda: shmbridge.EngineSpec("k", -2), "expected a non-negative int, got -2"),
    (lambda: shmbridge.EngineSpec("k", 2, ring_capacity=2**64), "18446744073709551616 is too large: at most 18446744073709551615"),
    (lambda: shmbridge.EngineSpec("k", 2).tensor("obs", "float32", [2, -3]), "expected a non-negative int, got -3"),
])
def test_an_int_out_of_range_is_a_value_error_naming_the_value_and_the_bound(call, message):
    with pytest.raises(ValueError) as raised:
        call()
    assert str(raised.value) == message


@pytest.mark.parametrize("method, kwargs, error", [
    ("step", dict(timeout=True), TypeError),
    ("step", dict(timeout="1"), TypeError),
    ("step", dict(timeout=-1), ValueError),
    ("reset", dict(seed=True), TypeError),
    ("reset", dict(seed=1.5), TypeError),
    ("reset", dict(seed=[1, True]), TypeError),
    ("reset", dict(seed="7"), TypeError),
    ("reset", dict(seed=2**64), ValueError),
    ("reset", dict(seed=[1, 2**64]), ValueError),
    ("reset", dict(seed=-1), ValueError),
    ("reset", dict(env_ids=[-1]), ValueError),
    ("call", dict(method="ping", shard=2**40), ValueError),
    ("call", dict(method="ping", shard=1.0), TypeError),
    ("reset", dict(env_ids=[True]), TypeError),
    ("reset", dict(env_ids=[0.0]), TypeError),
    ("reset", dict(timeout=False), TypeError),
    ("ping", dict(timeout=True), TypeError),
    ("schema", dict(timeout=float("nan")), ValueError),
])
def test_bad_arguments_to_a_client_raise_and_the_client_keeps_stepping(null_client, method, kwargs, error):
    frame = null_client.frame
    with pytest.raises(error):
        getattr(null_client, method)(**kwargs)
    assert null_client.counters() == (frame, frame), "something was sent"
    null_client.step()
    assert null_client.frame == frame + 1


@pytest.mark.parametrize("args", [
    ["engine", "--num-envs", "1.9"], ["engine", "--num-envs", "true"], ["engine", "--num-envs", "0x10"],
    ["engine", "--obs-dim", "-1"], ["engine", "--seed", "1.5"], ["engine", "--spin-us", "fast"],
    ["engine", "--idle-timeout", "-1"], ["engine", "--device", "gpu"], ["engine", "--image", "84x84"],
    ["client", "x", "--steps", "1e3"], ["client", "x", "--timeout", "nan"], ["client", "--launch", "null", "y"],
])
def test_the_cli_refuses_loose_arguments_with_status_2(args):
    """clap parses strictly: what is not exactly an int (or a number of seconds) is a usage
    error before anything runs (the last case, a name and --launch, is the CLI's own: 1)."""
    status = shmbridge._native.cli(["shmbridge", *args])
    assert status == (1 if "--launch" in args else 2)
