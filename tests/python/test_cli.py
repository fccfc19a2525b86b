"""The `shmbridge` command line from the installed package: the `shmbridge` command and
`python -m shmbridge` run the Rust binary's CLI (`shmbridge._native.cli`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import shmbridge

# The console script pip installs next to this interpreter.
COMMAND = os.path.join(os.path.dirname(sys.executable), "shmbridge")
MODULE = [sys.executable, "-m", "shmbridge"]


def run(args, timeout=60):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def start_engine(*options):
    """`python -m shmbridge engine`, and the region name it prints once it serves."""
    proc = subprocess.Popen(
        [*MODULE, "engine", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    name = proc.stdout.readline().strip()
    if not name:
        proc.wait(10)
        pytest.fail(f"the engine did not serve: {proc.stderr.read()}")
    return proc, name


def stop(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_the_installed_command_lists_regions():
    assert os.access(COMMAND, os.X_OK), f"pip install did not put {COMMAND} on the PATH"
    out = run([COMMAND, "ls"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:4] == ["name", "engine", "client", "state"]


def test_python_m_shmbridge_help_names_every_command():
    out = run([*MODULE, "--help"])
    assert out.returncode == 0, out.stderr
    assert "Usage: python -m shmbridge <COMMAND>" in out.stdout
    commands = re.findall(r"^  (\w+) ", out.stdout, flags=re.M)
    assert {"engine", "client", "ls", "inspect", "gc"} <= set(commands)
    assert out.stdout == run([COMMAND, "--help"]).stdout.replace(
        "Usage: shmbridge", "Usage: python -m shmbridge"
    )


def test_bad_arguments_exit_2_with_clap_s_message():
    out = run([COMMAND, "client", "--steps", "many"])
    assert out.returncode == 2
    assert "invalid value 'many' for '--steps <STEPS>'" in out.stderr


def test_engine_and_client_through_the_package():
    engine, name = start_engine("--env", "null", "--num-envs", "4", "--obs-dim", "3")
    try:
        inspected = run([*MODULE, "inspect", name])
        assert inspected.returncode == 0, inspected.stderr
        assert f"region        {name}" in inspected.stdout
        assert "engine kind   null" in inspected.stdout
        assert name in run([COMMAND, "ls"]).stdout
        client = run([COMMAND, "client", name, "--steps", "25"])
        assert client.returncode == 0, client.stderr
        assert client.stdout.startswith("null: 25 steps x 4 envs in ")
        assert engine.wait(30) == 0
        assert "client closed after 25 steps" in engine.stderr.read()
    finally:
        stop(engine)
    assert name not in shmbridge.list_regions()


def test_client_launches_its_engine_through_python_m_shmbridge():
    before = set(shmbridge.list_regions())
    out = run([*MODULE, "client", "--launch", "cartpole", "--num-envs", "4", "--steps", "30"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("cartpole: 30 steps x 4 envs in ")
    assert "client closed after 30 steps" in out.stderr  # the launched engine's report
    assert set(shmbridge.list_regions()) == before


def test_client_launch_reports_an_engine_that_refused_to_start():
    before = set(shmbridge.list_regions())
    out = run([*MODULE, "client", "--launch", "cartpole", "--num-envs", "0", "--steps", "1"])
    assert out.returncode == 1, out.stderr
    lines = out.stderr.splitlines()
    # The engine's own reason first (its stderr is the client's), then the client's
    # summary with the engine's exit status as a person reads it.
    assert lines[0] == "shmbridge: error: invalid engine spec: num_envs must be at least 1", lines
    assert lines[-1] == (
        "shmbridge: error: the launched engine: exited before serving (exit status: 1); "
        "its error is above"
    ), lines
    assert set(shmbridge.list_regions()) == before


def frame_seq(name: str) -> int:
    out = run([*MODULE, "inspect", name])
    assert out.returncode == 0, out.stderr
    return int(re.search(r"^frame_seq\s+(\d+)$", out.stdout, flags=re.M).group(1))


def test_ctrl_c_stops_the_client_which_closes_cleanly():
    engine, name = start_engine("--env", "null", "--num-envs", "4")
    client = subprocess.Popen(
        [COMMAND, "client", name, "--steps", str(10**12)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Interrupt it while it steps: once the engine has published frames.
        deadline = time.monotonic() + 30
        while frame_seq(name) == 0:
            assert client.poll() is None, client.stderr.read()
            assert time.monotonic() < deadline, "the client never stepped"
        client.send_signal(signal.SIGINT)
        assert client.wait(30) == 130
        # Closed, not died: the engine reports the steps it served and exits 0.
        assert engine.wait(30) == 0
        assert "client closed after" in engine.stderr.read()
    finally:
        stop(client)
        stop(engine)
    assert name not in shmbridge.list_regions()


def test_ctrl_c_stops_the_engine_which_removes_its_region():
    engine, name = start_engine("--env", "null", "--num-envs", "4")
    try:
        engine.send_signal(signal.SIGINT)
        assert engine.wait(30) == 128 + signal.SIGINT
    finally:
        stop(engine)
    assert name not in shmbridge.list_regions()


def test_import_shmbridge_exposes_only_its_api():
    public = {n for n in dir(shmbridge) if not n.startswith("_")}
    submodules = {n for n in public if getattr(getattr(shmbridge, n), "__name__", "").startswith("shmbridge.")}
    assert public - submodules <= set(shmbridge.__all__), sorted(public - submodules - set(shmbridge.__all__))
    for helper in ("os", "sys", "subprocess", "time", "tempfile", "selectors", "Any", "Optional", "annotations"):
        assert not hasattr(shmbridge, helper), helper
    for name in shmbridge.__all__:
        assert hasattr(shmbridge, name), name


def test_the_installed_package_carries_its_types():
    """PEP 561: type checkers read the package's annotations (``py.typed``) and the native
    module's stubs (``_native.pyi``) from the installed package."""
    from importlib.resources import files

    package = files("shmbridge")
    assert package.joinpath("py.typed").is_file()
    assert "class Client:" in package.joinpath("_native.pyi").read_text()
