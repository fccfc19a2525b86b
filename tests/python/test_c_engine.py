"""The CartPole engine written in C against the C ABI (examples/c/cartpole_engine.c),
launched and trained against from Python like any engine executable, agrees with the
Rust reference engine bit for bit on the same seeds."""

from __future__ import annotations

import numpy as np
import pytest

import shmbridge

from native_engines import build_c_engine, build_capi, step_side_by_side


@pytest.fixture(scope="module")
def c_engine(tmp_path_factory):
    return build_c_engine(build_capi(), tmp_path_factory.mktemp("c"))


def test_c_engine_matches_the_rust_cartpole_bit_for_bit(c_engine):
    command = [str(c_engine), "--num-envs", "16", "--seed", "7"]
    with shmbridge.launch(command=command) as c, shmbridge.launch("cartpole", num_envs=16, seed=7) as rust:
        assert c.engine_kind == "cartpole-c" and rust.engine_kind == "cartpole"
        assert c.schema()["metadata"] == rust.schema()["metadata"]
        episodes = step_side_by_side(c, rust, 3000)
    assert episodes > 1000, episodes


def test_c_engine_refuses_what_the_rust_one_refuses(c_engine):
    with shmbridge.launch(command=[str(c_engine), "--num-envs", "4"]) as c:
        with pytest.raises(shmbridge.RemoteError, match="out of range"):
            c.reset(env_ids=[4])
        with pytest.raises(shmbridge.RemoteError, match="unknown method 'fly'"):
            c.call("fly")
        with pytest.raises(shmbridge.RemoteError, match=r"\(0, 100\]"):
            c.call("set_pole_length", length="1e9")


def test_a_learner_trains_on_the_c_engine(c_engine):
    """The gym wrapper and a few PPO-style rollouts work on it as on the Rust engine:
    views of the shared memory, episodes that end and restart."""
    with shmbridge.launch(command=[str(c_engine), "--num-envs", "64", "--seed", "1"]) as c:
        obs = np.asarray(c.obs)
        address = obs.__array_interface__["data"][0]
        returns, running = [], np.zeros(64)
        for _ in range(500):
            actions = (obs[:, 2:3] + 0.5 * obs[:, 3:4] > 0).astype(np.int64)
            c.step(actions)
            running += np.asarray(c.rewards)
            done = np.asarray(c.terminated) | np.asarray(c.truncated)
            returns += running[done].tolist()
            running[done] = 0
        assert np.asarray(c.obs).__array_interface__["data"][0] == address, "obs is not a view"
    # The balancing policy does far better than a random one (about 22).
    assert len(returns) > 10 and np.mean(returns) > 100, (len(returns), np.mean(returns))


def test_launching_a_command_checks_it_before_starting(tmp_path):
    with pytest.raises(TypeError, match="list of strings"):
        shmbridge.launch(command="./engine --seed 1")
    with pytest.raises(ValueError, match="empty"):
        shmbridge.launch(command=[])
    with pytest.raises(TypeError, match="every part must be a str"):
        shmbridge.launch(command=["./engine", 3])
    with pytest.raises(TypeError, match="no engine options"):
        shmbridge.launch(command=["./engine"], seed=3)
    with pytest.raises(shmbridge.EngineStartError, match="cannot start"):
        shmbridge.launch(command=[str(tmp_path / "missing")])
    quits = tmp_path / "quits.sh"
    quits.write_text("#!/bin/sh\necho 'no region for you' >&2\nexit 3\n")
    quits.chmod(0o755)
    with pytest.raises(shmbridge.EngineStartError, match="no region for you"):
        shmbridge.launch(command=[str(quits)], timeout=10)
