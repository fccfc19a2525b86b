"""shmbridge.integrations.sb3.SB3VecEnv: Stable-Baselines3's VecEnv contract (against SB3's
own DummyVecEnv of Gymnasium's CartPole-v1, step for step), its check_env on the one-env
view, its wrappers, the command channel, rendering, and PPO training to a threshold."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import shmbridge

gym = pytest.importorskip("gymnasium")
pytest.importorskip("stable_baselines3")

from stable_baselines3.common import env_checker  # noqa: E402
from stable_baselines3.common.vec_env import (  # noqa: E402
    DummyVecEnv,
    VecEnv,
    VecFrameStack,
    VecMonitor,
    VecNormalize,
)

from conftest import doc_example  # noqa: E402
from shmbridge.errors import RemoteError  # noqa: E402
from shmbridge.gym import ShmVectorEnv  # noqa: E402
from shmbridge.integrations.sb3 import SB3VecEnv  # noqa: E402


def balancing(obs: np.ndarray) -> np.ndarray:
    """A policy that keeps CartPole's pole up for 500 steps from every start."""
    return (10 * obs[:, 2] + 2 * obs[:, 3] > 0).astype(np.int64)


def test_module_imports_without_stable_baselines3_and_names_the_extra():
    code = """
import sys
sys.modules["stable_baselines3"] = None
import shmbridge.integrations.sb3 as m
try:
    m.SB3VecEnv
except ImportError as e:
    assert "shmbridge[sb3]" in str(e), e
    print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_sb3_check_env_on_the_one_env_view():
    env = gym.make("shmbridge/CartPole-v1")
    try:
        env_checker.check_env(env.unwrapped, warn=True)
    finally:
        env.close()


def test_steps_as_sb3s_dummy_vec_env_over_gymnasium_cartpole():
    """Gymnasium's CartPole-v1 behind launch_gym shards (next-step autoreset underneath)
    and in SB3's DummyVecEnv, same seeds and actions: the same observations, rewards,
    dones and infos (terminal observations, TimeLimit.truncated), exactly. Envs 0 and 1
    balance (their episodes are truncated at 500 steps), the others act at random."""
    n, steps = 4, 620
    client = shmbridge.launch_gym("CartPole-v1", num_envs=n, shards=2, seed=100)
    ours = SB3VecEnv(client=client, close_client=True)
    ref = DummyVecEnv([lambda: gym.make("CartPole-v1") for _ in range(n)])
    rng = np.random.default_rng(0)
    truncations = terminations = 0
    try:
        assert isinstance(ours, VecEnv)
        assert ours.observation_space == ref.observation_space
        assert ours.action_space == ref.action_space
        ours.seed(7)
        ref.seed(7)
        obs = ours.reset()
        np.testing.assert_array_equal(obs, ref.reset())
        for t in range(steps):
            actions = np.where(np.arange(n) < 2, balancing(obs), rng.integers(0, 2, size=n))
            obs, rewards, dones, infos = ours.step(actions)
            r_obs, r_rewards, r_dones, r_infos = ref.step(actions)
            np.testing.assert_array_equal(obs, r_obs)
            np.testing.assert_array_equal(rewards, r_rewards)
            np.testing.assert_array_equal(dones, r_dones)
            assert dones.dtype == np.bool_ and rewards.shape == (n,) and len(infos) == n
            for i in range(n):
                assert sorted(infos[i]) == sorted(r_infos[i]), (t, i)
                assert infos[i]["TimeLimit.truncated"] == r_infos[i]["TimeLimit.truncated"]
                if dones[i]:
                    np.testing.assert_array_equal(
                        infos[i]["terminal_observation"], r_infos[i]["terminal_observation"]
                    )
                    truncations += infos[i]["TimeLimit.truncated"]
                    terminations += not infos[i]["TimeLimit.truncated"]
    finally:
        ours.close()
        ref.close()
    assert truncations == 2 and terminations > 20, (truncations, terminations)
    assert client.closed


def test_same_step_engine_terminal_observations_are_gymnasiums_steps():
    """The native cartpole engine (same-step autoreset, final_obs): a finished env's
    observation starts a new episode and its terminal_observation is Gymnasium's step
    from the previous observation; a balanced episode is cut at 500 steps with
    TimeLimit.truncated."""
    n = 16
    env = SB3VecEnv("cartpole", num_envs=n, seed=3)
    ref = gym.make("CartPole-v1").unwrapped
    ref.reset(seed=0)
    rng = np.random.default_rng(1)
    finished = truncated = 0
    try:
        obs = env.reset()
        for t in range(1, 501):
            actions = np.where(np.arange(n) < n // 2, balancing(obs), rng.integers(0, 2, size=n))
            before = obs
            obs, rewards, dones, infos = env.step(actions)
            assert (rewards == 1.0).all()
            for i in np.flatnonzero(dones):
                ref.state = before[i].astype(np.float64)
                ref.steps_beyond_terminated = None
                expected, _, terminated, _, _ = ref.step(int(actions[i]))
                np.testing.assert_allclose(infos[i]["terminal_observation"], expected, rtol=1e-6, atol=1e-6)
                assert infos[i]["TimeLimit.truncated"] == (not terminated)
                assert (np.abs(obs[i]) < 0.05).all()
                finished += 1
                truncated += infos[i]["TimeLimit.truncated"]
            assert all("terminal_observation" not in infos[i] for i in np.flatnonzero(~dones))
    finally:
        env.close()
    # The balancing half was cut at step 500 (and only then); the random half fell often.
    assert [infos[i]["TimeLimit.truncated"] for i in range(n // 2)] == [True] * (n // 2)
    assert truncated == n // 2 and finished > n


def test_seeding_follows_sb3s_convention():
    a = SB3VecEnv("cartpole", num_envs=3, seed=5)
    b = SB3VecEnv("cartpole", num_envs=3)
    c = ShmVectorEnv("cartpole", num_envs=3)
    try:
        first = a.reset()  # the constructor's seed
        assert b.seed(5) == [5, 6, 7]
        np.testing.assert_array_equal(b.reset(), first)
        np.testing.assert_array_equal(c.reset(seed=5)[0], first)
        # The seeds serve one reset: the next continues each env's generator.
        assert not np.array_equal(b.reset(), first)
        b.seed(5)
        np.testing.assert_array_equal(b.reset(), first)
    finally:
        a.close()
        b.close()
        c.close()


def test_sb3_wrappers_on_top():
    env = SB3VecEnv("cartpole", num_envs=8, seed=0)
    stacked = VecFrameStack(env, n_stack=2)
    monitored = VecMonitor(stacked)
    normalized = VecNormalize(monitored, norm_reward=True)
    rng = np.random.default_rng(2)
    episodes = []
    try:
        obs = normalized.reset()
        assert obs.shape == (8, 8)
        for _ in range(200):
            obs, rewards, dones, infos = normalized.step(rng.integers(0, 2, size=8))
            assert obs.shape == (8, 8) and np.isfinite(obs).all()
            episodes += [infos[i]["episode"] for i in np.flatnonzero(dones)]
            for i in np.flatnonzero(dones):
                assert infos[i]["terminal_observation"].shape == (8,)
    finally:
        normalized.close()
    assert len(episodes) > 20
    # CartPole: one reward per step, so each episode's return is its length.
    assert all(e["r"] == e["l"] and 8 <= e["l"] < 500 for e in episodes)
    assert env._vec.closed  # closing the outermost wrapper stopped the engine


def test_env_method_get_attr_set_attr():
    env = SB3VecEnv("cartpole", num_envs=4, seed=0)
    try:
        assert env.env_method("set_pole_length", length=2.0) == [{"previous": "0.5"}] * 4
        assert env.env_method("set_pole_length", length=0.5, indices=range(4)) == [{"previous": "2"}] * 4
        with pytest.raises(ValueError, match="whole shards"):
            env.env_method("set_pole_length", length=1.0, indices=[1])
        with pytest.raises(TypeError, match="keyword"):
            env.env_method("set_pole_length", 1.0)
        with pytest.raises(RemoteError, match="unknown method"):
            env.env_method("no_such_method")
        assert env.get_attr("render_mode") == [None] * 4
        assert env.get_attr("max_episode_steps", indices=[0, 2]) == [500, 500]
        assert env.get_attr("action_space") == [gym.spaces.Discrete(2)] * 4
        assert env.get_attr("env_id") == ["CartPole-v1"] * 4  # the engine's metadata
        assert env.has_attr("final_obs") and not env.has_attr("no_such_attribute")
        with pytest.raises(AttributeError):
            env.set_attr("max_episode_steps", 10)
        assert env.env_is_wrapped(VecMonitor) == [False] * 4
        with pytest.warns(UserWarning, match="render_mode"):
            assert env.render() is None  # no render_mode: SB3 warns and returns None
    finally:
        env.close()


def test_env_method_on_a_sharded_engine_calls_the_shards_of_the_indices():
    env = SB3VecEnv("cartpole", num_envs=4, shards=2, seed=0)
    try:
        assert env.client.shards == [(0, 2), (2, 4)]
        assert env.env_method("set_pole_length", length=1.5, indices=[2, 3]) == [{"previous": "0.5"}] * 2
        replies = env.env_method("set_pole_length", length=1.0)
        assert replies == [{"previous": "0.5"}] * 2 + [{"previous": "1.5"}] * 2
        with pytest.raises(ValueError, match="whole shards"):
            env.env_method("set_pole_length", length=1.0, indices=[0, 1, 2])
    finally:
        env.close()


def test_render_rgb_array_tiles_the_engines_frames():
    env = SB3VecEnv("null", num_envs=4, obs_dim=3, act_dim=2, image="6x5x3", render_mode="rgb_array")
    try:
        env.reset()
        env.step(np.zeros((4, 2), dtype=np.float32))
        frames = np.asarray(env.client["rgb"])
        images = env.get_images()
        assert len(images) == 4 and all(np.array_equal(im, f) for im, f in zip(images, frames))
        big = env.render()
        assert big.shape == (12, 10, 3)
        np.testing.assert_array_equal(big[:6, 5:], frames[1])
    finally:
        env.close()
    with pytest.raises(ValueError, match="'rgb'"):
        SB3VecEnv("cartpole", num_envs=2, render_mode="rgb_array")


@pytest.mark.long
def test_guide_example_trains_ppo_past_the_threshold(capsys):
    """docs/learners/sb3.md's example, as written: SB3's PPO on the cartpole engine
    (25k steps), evaluated over 16 episodes; random actions average about 22."""
    namespace: dict = {}
    exec(compile(doc_example("docs/learners/sb3.md"), "docs/learners/sb3.md", "exec"), namespace)
    assert namespace["mean_return"] >= 150, capsys.readouterr().out
