"""shmbridge.integrations.torchrl.TorchRLEnv: TorchRL's check_env_specs, the shared-memory
entries (by address), rollouts against the engine stepped directly, partial resets through
"_reset" masks, seeding."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import shmbridge

gym = pytest.importorskip("gymnasium")
torch = pytest.importorskip("torch")
pytest.importorskip("torchrl")

from torchrl.envs.utils import check_env_specs  # noqa: E402

from conftest import CARTPOLE_BOUNDS, doc_example  # noqa: E402
from shmbridge.gym import ShmVectorEnv  # noqa: E402
from shmbridge.integrations.torchrl import TorchRLEnv  # noqa: E402


def test_module_imports_without_torchrl_and_names_the_extra():
    code = """
import sys
sys.modules["torchrl"] = None
import shmbridge.integrations.torchrl as m
try:
    m.TorchRLEnv
except ImportError as e:
    assert "shmbridge[torchrl]" in str(e), e
    print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("copy", [True, False])
def test_check_env_specs(copy):
    env = TorchRLEnv("cartpole", num_envs=8, seed=0, copy=copy)
    try:
        check_env_specs(env, break_when_any_done="both")
        assert env.batch_size == torch.Size([8])
        assert env.observation_spec["observation"].shape == (8, 4)
        assert env.action_spec.n == 2 and env.action_spec.shape == (8,)
        assert env.reward_spec.shape == (8, 1)
    finally:
        env.close()


def test_check_env_specs_over_launch_gym_shards():
    client = shmbridge.launch_gym("Pendulum-v1", num_envs=4, shards=2, seed=0)
    env = TorchRLEnv(client=client, close_client=True)
    try:
        check_env_specs(env, break_when_any_done="both")
        assert env.action_spec.shape == (4, 1) and float(env.action_spec.space.high.max()) == 2.0
        # Pendulum's observations are bounded: a Bounded spec, Gymnasium's bounds.
        assert float(env.observation_spec["observation"].space.high[0, 2]) == 8.0
    finally:
        env.close()
    assert client.closed


def test_shared_entries_are_the_regions_tensors():
    env = TorchRLEnv("cartpole", num_envs=8, seed=0, copy=False)
    client = env.client
    try:
        shared = env.shared
        assert shared["observation"].data_ptr() == client.obs.data_ptr
        assert shared["reward"].data_ptr() == client.rewards.data_ptr
        assert shared["terminated"].data_ptr() == client.terminated.data_ptr
        assert shared["truncated"].data_ptr() == client.truncated.data_ptr
        td = env.reset()
        assert td["observation"].data_ptr() == client.obs.data_ptr
        action = torch.tensor([0, 1] * 4)
        out = env.step(td.set("action", action))["next"]
        # The actions went straight into the region's action tensor.
        assert np.array_equal(np.asarray(client.actions).reshape(-1), action.reshape(-1).numpy())
        assert not out["done"].any()  # a few steps in: nobody fell yet
        for key, tensor in (("observation", client.obs), ("reward", client.rewards),
                            ("terminated", client.terminated), ("truncated", client.truncated)):
            assert out[key].data_ptr() == tensor.data_ptr, key
        before = out["observation"].clone()
        env.step(td.set("action", action))
        assert not torch.equal(out["observation"], before), "the shared entries follow the frames"
    finally:
        env.close()
    # The default copies once per step: what TorchRL keeps stays as it was.
    env = TorchRLEnv("cartpole", num_envs=8, seed=0)
    try:
        assert env.shared["observation"].data_ptr() == env.client.obs.data_ptr
        out = env.rand_step(env.reset())["next"]
        assert out["observation"].data_ptr() != env.client.obs.data_ptr
    finally:
        env.close()


def test_rollout_equals_the_engine_stepped_directly():
    """A TorchRL rollout (TorchRL resetting finished envs through "_reset" masks) and a
    ShmVectorEnv on the same seed and actions: the same data step by step; a finished env's
    "next" observation is its episode's last, the following root observation its new
    episode's first."""
    n, steps = 8, 300
    actions = torch.from_numpy(np.random.default_rng(0).integers(0, 2, size=(steps, n)))
    env = TorchRLEnv("cartpole", num_envs=n, seed=11)
    t = [0]

    def policy(td):
        td.set("action", actions[t[0]].clone())
        t[0] += 1
        return td

    try:
        rollout = env.rollout(steps, policy, break_when_any_done=False)
    finally:
        env.close()
    ref = ShmVectorEnv(num_envs=n, seed=11)
    try:
        obs, _ = ref.reset()
        finished = 0
        for k in range(steps):
            np.testing.assert_array_equal(rollout["observation"][:, k].numpy(), obs)
            obs, rewards, terminated, truncated, infos = ref.step(actions[k].numpy().reshape(n))
            step = rollout["next"][:, k]
            done = terminated | truncated
            last = np.stack([infos["final_obs"][i] if done[i] else obs[i] for i in range(n)])
            np.testing.assert_array_equal(step["observation"].numpy(), last)
            np.testing.assert_array_equal(step["reward"].numpy().reshape(n), rewards)
            np.testing.assert_array_equal(step["terminated"].numpy().reshape(n), terminated)
            np.testing.assert_array_equal(step["done"].numpy().reshape(n), done)
            finished += int(done.sum())
    finally:
        ref.close()
    assert finished > 50


def test_partial_reset_through_the_reset_mask():
    env = TorchRLEnv("cartpole", num_envs=6, seed=1)
    try:
        td = env.reset()
        for _ in range(5):
            td = env.step(td.set("action", torch.ones(6, dtype=torch.int64)))["next"].clone()
        moved = td["observation"]
        assert (moved.abs() > 0.05).any(dim=1).all()  # five pushes right: off the start
        mask = torch.tensor([True, False, True, False, False, False]).unsqueeze(-1)
        # As step_and_maybe_reset calls it: the current data and the mask.
        after = env.reset(td.set("_reset", mask))
        obs = after["observation"]
        assert (obs[[0, 2]].abs() < 0.05).all()  # new episodes
        assert torch.equal(obs[[1, 3, 4, 5]], moved[[1, 3, 4, 5]])
        # The engine reset envs 0 and 2 only: the others' state is as it was.
        assert torch.equal(torch.from_numpy(np.array(env.client.obs)), obs)
        assert not after["done"].any()
    finally:
        env.close()


def test_next_step_engine_finished_envs_are_reset_by_torchrl():
    """launch_gym's next-step autoreset: the engine leaves a finished env as it ended;
    TorchRL's "_reset" mask resets it (one engine reset of its id) before the next step."""
    env = TorchRLEnv(client=shmbridge.launch_gym("CartPole-v1", num_envs=4, shards=1, seed=0), close_client=True)
    try:
        rollout = env.rollout(120, break_when_any_done=False)
    finally:
        env.close()
    done = rollout["next", "done"].squeeze(-1)
    assert done.sum() > 4
    for i, k in done[:, :-1].nonzero().tolist():
        last = rollout["next", "observation"][i, k]
        assert abs(last[0]) > CARTPOLE_BOUNDS[0] or abs(last[2]) > CARTPOLE_BOUNDS[1], (i, k, last)
        assert (rollout["observation"][i, k + 1].abs() < 0.05).all(), (i, k)
        assert rollout["next", "reward"][i, k + 1] == 1.0  # a real step, not a reset step


def test_set_seed_seeds_the_next_reset():
    a = TorchRLEnv("cartpole", num_envs=3)
    b = ShmVectorEnv(num_envs=3)
    try:
        a.set_seed(5)
        first = a.reset()["observation"]
        np.testing.assert_array_equal(first.numpy(), b.reset(seed=5)[0])
        assert not torch.equal(a.reset()["observation"], first)  # the seed served one reset
        a.set_seed(5)
        assert torch.equal(a.reset()["observation"], first)
    finally:
        a.close()
        b.close()


@pytest.mark.long
def test_guide_example_trains_ppo_past_the_threshold(capsys):
    """docs/learners/torchrl.md's example, as written: TorchRL's PPO on the cartpole engine
    (25,600 steps), evaluated deterministically on 16 envs for 1000 steps."""
    namespace: dict = {}
    exec(compile(doc_example("docs/learners/torchrl.md"), "docs/learners/torchrl.md", "exec"), namespace)
    assert namespace["mean_return"] >= 150, capsys.readouterr().out
