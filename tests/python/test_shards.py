"""Sharded engines (protocol 1.4) from Python: Engine.join, launch_gym over Gymnasium's
CartPole-v1 and MuJoCo's HalfCheetah-v5, checked step for step against SyncVectorEnv,
zero copies, and failures that are errors, never hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import shmbridge

gymnasium = pytest.importorskip("gymnasium")
torch = pytest.importorskip("torch")

from shmbridge.gym import ShmVectorEnv  # noqa: E402
from shmbridge.gym_shards import env_slice  # noqa: E402
from conftest import region_exists, wait_exited  # noqa: E402


# ---- the core from Python --------------------------------------------------------------


def test_python_shards_serve_one_contiguous_region():
    n, k = 5, 2
    spec = shmbridge.EngineSpec.standard("py-shards", n, 3, 1).shards(k)
    creator = shmbridge.Engine(spec)
    joined = shmbridge.Engine.join(creator.name, 1)
    assert (creator.shard, creator.shard_envs, creator.num_envs) == (0, (0, 3), 3)
    assert (joined.shard, joined.shard_envs, joined.num_envs) == (1, (3, 5), 2)
    errors = []

    def serve(engine):
        obs, actions = np.from_dlpack(engine.obs), np.from_dlpack(engine.actions)
        first = engine.shard_envs[0]
        obs[:] = np.arange(first, first + engine.num_envs)[:, None]
        engine.publish()
        try:
            while True:
                seq = engine.wait_actions(timeout=30)
                obs[:, 0] = actions[:, 0] * 10 + seq
                obs[:, 1] = np.arange(first, first + engine.num_envs)
                engine.publish()
        except shmbridge.ClientClosedError:
            pass
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(e,)) for e in (creator, joined)]
    for t in threads:
        t.start()
    client = shmbridge.attach(creator.name)
    assert client.shards == [(0, 3), (3, 5)]
    assert client.shard_pids == [os.getpid(), os.getpid()]
    obs = torch.from_dlpack(client.obs)
    # One contiguous [N, 3] tensor over the region's bytes: no gather, whichever shard
    # writes a row. The engines' views are rows of the same tensor (their own mappings,
    # at the same offsets in the region).
    assert obs.shape == (n, 3) and obs.is_contiguous()
    assert obs.data_ptr() == client.obs.data_ptr
    assert joined.obs.data_ptr - creator.obs.data_ptr != 0
    for step in range(1, 200):
        actions = np.arange(n, dtype=np.float32).reshape(n, 1) + step
        client.step(actions)
        assert np.array_equal(obs[:, 0].numpy(), (np.arange(n) + step) * 10 + step)
        assert np.array_equal(obs[:, 1].numpy(), np.arange(n))
    client.close()
    for t in threads:
        t.join(30)
    assert not errors, errors
    creator.close()
    joined.close()
    assert not region_exists(creator.name)


def test_env_slices_match_the_core():
    # The Python split and the Rust one (the region's table) agree.
    spec = shmbridge.EngineSpec.standard("split", 10, 1, 1).shards(4)
    creator = shmbridge.Engine(spec)
    try:
        joined = [shmbridge.Engine.join(creator.name, k) for k in (1, 2, 3)]
        for k, e in enumerate([creator, *joined]):
            start, count = env_slice(10, 4, k)
            assert e.shard_envs == (start, start + count)
        for e in joined:
            e.close()
    finally:
        creator.close()


# ---- Gymnasium envs behind shards ------------------------------------------------------


def lockstep_against_sync(env_id: str, n: int, shards: int, steps: int, seed: int) -> None:
    """The same seeds and the same actions give the same observations, rewards and flags
    as SyncVectorEnv, every step (next-step autoreset, as SyncVectorEnv's default)."""
    ours = ShmVectorEnv(client=shmbridge.launch_gym(env_id, n, shards), close_client=True)
    sync = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make(env_id) for _ in range(n)])
    try:
        assert ours.single_observation_space == sync.single_observation_space
        assert ours.single_action_space == sync.single_action_space
        assert ours.metadata["autoreset_mode"] == gymnasium.vector.AutoresetMode.NEXT_STEP
        obs, _ = ours.reset(seed=seed)
        ref, _ = sync.reset(seed=seed)
        assert obs.dtype == ref.dtype and np.array_equal(obs, ref), "first observations"
        sync.action_space.seed(seed)
        finished = 0
        for t in range(steps):
            a = sync.action_space.sample()
            o1, r1, te1, tr1, _ = ours.step(a)
            o2, r2, te2, tr2, _ = sync.step(a)
            assert np.array_equal(o1, o2), f"obs at step {t}"
            assert np.array_equal(r1, r2), f"rewards at step {t}"
            assert np.array_equal(te1, te2) and np.array_equal(tr1, tr2), f"flags at step {t}"
            finished += int(te1.sum() + tr1.sum())
        return finished
    finally:
        ours.close()
        sync.close()


def test_cartpole_shards_match_sync_vector_env_step_for_step():
    finished = lockstep_against_sync("CartPole-v1", n=6, shards=3, steps=300, seed=123)
    assert finished > 0, "episodes ended (and were autoreset) during the run"


def test_halfcheetah_shards_match_sync_vector_env_step_for_step():
    pytest.importorskip("mujoco")
    lockstep_against_sync("HalfCheetah-v5", n=4, shards=2, steps=60, seed=7)


def test_make_vec_any_id_and_same_step_final_obs():
    envs = gymnasium.make_vec(
        "shmbridge/Acrobot-v1",
        num_envs=4,
        shards=2,
        autoreset_mode="same-step",
        seed=3,
    )
    try:
        assert envs.num_envs == 4
        assert envs.metadata["autoreset_mode"] == gymnasium.vector.AutoresetMode.SAME_STEP
        envs.reset(seed=3)
        envs.action_space.seed(0)
        saw_final = False
        for _ in range(600):
            obs, _, term, trunc, infos = envs.step(envs.action_space.sample())
            if np.any(term | trunc):
                done = term | trunc
                assert np.array_equal(infos["_final_obs"], done)
                for i in np.flatnonzero(done):
                    assert infos["final_obs"][i].shape == obs[i].shape
                saw_final = True
                break
        assert saw_final
    finally:
        envs.close()


def test_a_factory_function_and_its_kwargs_reach_the_shards():
    client = shmbridge.launch_gym(
        lambda **kw: gymnasium.make("CartPole-v1", **kw), num_envs=2, shards=2, max_episode_steps=3
    )
    try:
        schema = client.schema()
        assert schema["metadata"]["max_episode_steps"] == "3"
        assert schema["num_envs"] == 2 and client.shards == [(0, 1), (1, 2)]
    finally:
        client.close()


# ---- failures --------------------------------------------------------------------------


def test_a_dead_shard_is_engine_died_naming_it_and_nothing_is_left():
    client = shmbridge.launch_gym("CartPole-v1", num_envs=4, shards=2)
    name, pids = client.name, client.shard_pids
    actions = np.zeros(4, dtype=np.int64)
    client.step(actions)
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(shmbridge.EngineDiedError) as e:
        client.step(actions)
    assert e.value.shard == 1 and e.value.envs == (2, 4)
    assert "shard 1" in str(e.value) and "envs 2..4" in str(e.value)
    # Shard 0 stops by itself (it checks its siblings) and removes the region.
    assert wait_exited(pids[0], 15.0)
    assert not region_exists(name)
    client.close()


LEARNER = textwrap.dedent(
    """
    import sys, numpy, shmbridge
    client = shmbridge.launch_gym("CartPole-v1", num_envs=4, shards=2)
    client.step(numpy.array([0, 1, 0, 1]))
    print(client.name, *client.shard_pids, flush=True)
    sys.stdin.read()  # until killed
    """
)


def test_killing_the_learner_stops_every_shard():
    learner = subprocess.Popen(
        [sys.executable, "-c", LEARNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        name, *pids = learner.stdout.readline().split()
        assert len(pids) == 2, "the learner started its shards"
        learner.kill()
        learner.wait()
        for pid in pids:
            assert wait_exited(int(pid), 15.0), f"shard pid {pid} outlived its learner"
        assert not region_exists(name)
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()


def test_native_cartpole_sharded_equals_unsharded_step_for_step():
    # The Rust engines behind shards (`launch(shards=3)`): env e is seeded seed + e by
    # whichever shard owns it, so the sharded region steps exactly as one engine does.
    one = shmbridge.launch("cartpole", num_envs=6, seed=5)
    three = shmbridge.launch("cartpole", num_envs=6, seed=5, shards=3)
    try:
        assert three.shards == [(0, 2), (2, 4), (4, 6)] and one.shards == [(0, 6)]
        assert np.array_equal(np.asarray(one.obs), np.asarray(three.obs))
        rng = np.random.default_rng(0)
        for t in range(300):
            a = rng.integers(0, 2, size=(6, 1))
            one.step(a)
            three.step(a)
            for name in ("obs", "rewards", "terminated", "truncated", "final_obs"):
                assert np.array_equal(np.asarray(one[name]), np.asarray(three[name])), (name, t)
        one.reset(seed=[1, 2, 3, 4, 5, 6], env_ids=None)
        three.reset(seed=[1, 2, 3, 4, 5, 6], env_ids=None)
        assert np.array_equal(np.asarray(one.obs), np.asarray(three.obs))
        three.reset(seed=9, env_ids=[5, 0])
        one.reset(seed=9, env_ids=[5, 0])
        assert np.array_equal(np.asarray(one.obs), np.asarray(three.obs))
        assert three.call("set_pole_length", shard="all", length=0.7) == [{"previous": "0.5"}] * 3
    finally:
        one.close()
        three.close()
    assert not region_exists(three.name)


ORPHANING_LAUNCHER = textwrap.dedent(
    """
    import os, sys, cloudpickle, shmbridge
    name = "shmbridge-gym-orphan-" + os.urandom(8).hex()
    base = [sys.executable, "-m", "shmbridge.gym_shards", "--name", name, "--shards", "2",
            "--num-envs", "2"]
    procs = shmbridge._launch._start_shards([base + ["--shard", str(k)] for k in (0, 1)], 60.0, "test",
                                            stdin=cloudpickle.dumps(("CartPole-v1", {})))
    print(name, *(p.pid for p, _ in procs), flush=True)
    os._exit(0)  # dies without attaching a client and without stopping its shards
    """
)


def test_shards_whose_launcher_dies_before_attaching_exit():
    out = subprocess.run([sys.executable, "-c", ORPHANING_LAUNCHER], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    name, *pids = out.stdout.split()
    assert len(pids) == 2
    # No client will ever come: each shard notices its parent is gone and exits; shard 0
    # removes the region.
    for pid in pids:
        assert wait_exited(int(pid), 15.0), f"shard pid {pid} outlived its launcher"
    assert not region_exists(name)
