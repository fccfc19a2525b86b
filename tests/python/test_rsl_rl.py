"""shmbridge.integrations.rsl_rl.RslRlVecEnv: rsl_rl's OnPolicyRunner starts, steps and
stores what the engine produced; the region's tensors by address; episodes against
Gymnasium's Pendulum-v1 stepped directly."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import shmbridge

gym = pytest.importorskip("gymnasium")
torch = pytest.importorskip("torch")
pytest.importorskip("rsl_rl")

from rsl_rl.runners import OnPolicyRunner  # noqa: E402

from conftest import doc_example  # noqa: E402
from shmbridge.integrations.rsl_rl import RslRlVecEnv  # noqa: E402


def test_module_imports_without_rsl_rl_and_names_the_extra():
    code = """
import sys
sys.modules["rsl_rl"] = None
import shmbridge.integrations.rsl_rl as m
try:
    m.RslRlVecEnv
except ImportError as e:
    assert "shmbridge[rsl_rl]" in str(e), e
    print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def pendulum(num_envs: int, seed: int = 0, **kwargs) -> "RslRlVecEnv":
    client = shmbridge.launch_gym("Pendulum-v1", num_envs=num_envs, shards=1, seed=seed)
    return RslRlVecEnv(client=client, close_client=True, **kwargs)


def test_guide_example_runner_starts_steps_and_stores_the_engines_observations():
    """docs/learners/rsl_rl.md's example, as written, with env.step recorded: rsl_rl's
    rollout storage holds, for every step, the observations the policy acted on."""
    namespace: dict = {"__name__": "__example__"}
    code = doc_example("docs/learners/rsl_rl.md")
    recorded = []

    def recording(env):
        step = env.step
        recorded.append(env.get_observations()["policy"].clone())

        def step_and_record(actions):
            out = step(actions)
            recorded.append(out[0]["policy"].clone())
            return out

        env.step = step_and_record
        return env

    namespace["record"] = recording
    code = code.replace("runner = OnPolicyRunner(env,", "runner = OnPolicyRunner(record(env),")
    assert "record(env)" in code
    exec(compile(code, "docs/learners/rsl_rl.md", "exec"), namespace)
    runner, cfg = namespace["runner"], namespace["train_cfg"]
    assert runner.current_learning_iteration == namespace["iterations"] - 1
    steps = cfg["num_steps_per_env"]
    assert len(recorded) == namespace["iterations"] * steps + 1
    stored = runner.alg.storage.observations["policy"]  # the last iteration's rollout
    assert stored.shape == (steps, 16, 3)
    first = len(recorded) - 1 - steps
    for t in range(steps):
        assert torch.equal(stored[t], recorded[first + t]), t
    assert not torch.equal(stored[0], stored[1])
    assert namespace["env"]._vec.closed


def test_region_tensors_by_address_and_actions_written_in_place():
    env = RslRlVecEnv("null", num_envs=8, obs_dim=3, act_dim=2, copy=False)
    client = env.client
    try:
        assert env.num_actions == 2 and env.device == torch.device("cpu")
        assert env.shared["obs"].data_ptr() == client.obs.data_ptr
        assert env.shared["rewards"].data_ptr() == client.rewards.data_ptr
        assert env.shared["terminated"].data_ptr() == client.terminated.data_ptr
        assert env.shared["truncated"].data_ptr() == client.truncated.data_ptr
        assert env.get_observations()["policy"].data_ptr() == client.obs.data_ptr
        actions = torch.arange(16, dtype=torch.float32).reshape(8, 2)
        obs, rewards, dones, extras = env.step(actions)
        assert obs["policy"].data_ptr() == client.obs.data_ptr
        assert rewards.data_ptr() == client.rewards.data_ptr
        assert torch.equal(torch.from_numpy(np.asarray(client.actions)), actions)
        # The null engine echoes actions[:, 0] as rewards.
        assert torch.equal(rewards, actions[:, 0])
        assert not dones.any() and not extras["time_outs"].any()
    finally:
        env.close()
    env = RslRlVecEnv("null", num_envs=8, obs_dim=3, act_dim=2)
    try:
        assert env.get_observations()["policy"].data_ptr() != env.client.obs.data_ptr
    finally:
        env.close()


def test_episodes_match_gymnasium_pendulum_and_actions_are_clipped():
    """Pendulum-v1 under next-step autoreset: at step 200 every env is cut by the time
    limit (dones and time_outs), and its observation is already its next episode's first,
    as Gymnasium's own Pendulum-v1 gives after reset(); actions of 5 act as Pendulum's
    bound, 2."""
    n, seed = 4, 30
    env = pendulum(n, seed=seed)
    refs = [gym.make("Pendulum-v1") for _ in range(n)]
    try:
        expected = np.stack([r.reset(seed=seed + i)[0] for i, r in enumerate(refs)])
        np.testing.assert_array_equal(env.get_observations()["policy"].numpy(), expected)
        assert env.max_episode_length == 200
        for t in range(1, 202):
            obs, rewards, dones, extras = env.step(torch.full((n, 1), 5.0))
            assert torch.equal(torch.from_numpy(np.asarray(env.client.actions)), torch.full((n, 1), 2.0))
            steps = [r.step(np.array([2.0], dtype=np.float32)) for r in refs]
            r = rewards.numpy()  # the shard's dtype (float64: Pendulum's rewards are)
            np.testing.assert_array_equal(r, np.array([s[1] for s in steps]).astype(r.dtype))
            assert dones.tolist() == [t == 200] * n and extras["time_outs"].tolist() == [t == 200] * n
            if t == 200:
                assert all(s[3] for s in steps)
                expected = np.stack([r.reset()[0] for r in refs])
                assert env.episode_length_buf.tolist() == [0] * n
            else:
                expected = np.stack([s[0] for s in steps])
            np.testing.assert_array_equal(obs["policy"].numpy(), expected)
        assert env.episode_length_buf.tolist() == [1] * n
    finally:
        env.close()


def test_categorical_distribution_is_torchs_categorical_over_one_index():
    from shmbridge.integrations.rsl_rl import CategoricalDistribution

    dist = CategoricalDistribution(1, num_categories=3)
    assert dist.input_dim == 3
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]])
    dist.update(logits)
    reference = torch.distributions.Categorical(logits=logits)
    sample = dist.sample()
    assert sample.shape == (2, 1) and sample.dtype == logits.dtype
    assert set(sample.flatten().tolist()) <= {0.0, 1.0, 2.0}
    outputs = torch.tensor([[2.0], [0.0]])
    assert torch.allclose(dist.log_prob(outputs), reference.log_prob(torch.tensor([2, 0])))
    assert torch.allclose(dist.entropy, reference.entropy())
    assert torch.equal(dist.deterministic_output(logits), torch.tensor([[2.0], [0.0]]))
    assert torch.equal(dist.kl_divergence(dist.params, dist.params), torch.zeros(2))
    with pytest.raises(ValueError, match="output_dim"):
        CategoricalDistribution(2, num_categories=3)


def test_runner_trains_ppo_on_a_discrete_engine_with_categorical_actions():
    """cartpole (Discrete(2)): one action per env, the index rsl_rl's policy samples with
    CategoricalDistribution, written into the engine's actions; rsl_rl's own PPO runner
    trains it past 150 (random actions average about 22)."""
    from tensordict import TensorDict

    torch.manual_seed(0)
    torch.set_num_threads(1)
    env = RslRlVecEnv("cartpole", num_envs=16, seed=0)
    try:
        assert env.num_actions == 1
        cfg = {
            "num_steps_per_env": 32, "save_interval": 10**9,
            "obs_groups": {"actor": ["policy"], "critic": ["policy"]},
            "algorithm": {"class_name": "PPO", "num_learning_epochs": 10, "num_mini_batches": 2,
                          "learning_rate": 1e-3, "schedule": "fixed", "gamma": 0.98, "lam": 0.8,
                          "entropy_coef": 0.0, "clip_param": 0.2},
            "actor": {"class_name": "MLPModel", "hidden_dims": [64, 64], "activation": "tanh",
                      "distribution_cfg": {"class_name": "shmbridge.integrations.rsl_rl:CategoricalDistribution",
                                           "num_categories": 2}},
            "critic": {"class_name": "MLPModel", "hidden_dims": [64, 64], "activation": "tanh"},
        }
        runner = OnPolicyRunner(env, cfg, log_dir=None, device="cpu")
        runner.learn(num_learning_iterations=28)
        stored = runner.alg.storage.actions  # the last rollout's actions: indices
        assert stored.shape == (32, 16, 1) and set(stored.unique().tolist()) == {0.0, 1.0}
        assert torch.equal(torch.from_numpy(np.asarray(env.client.actions)), stored[-1].long())
        policy = runner.get_inference_policy(device="cpu")
        episode, finished = torch.zeros(16), []  # the first episodes counted from mid-way: a lower bound
        obs = env.get_observations()
        with torch.no_grad():
            for _ in range(1000):
                obs, rewards, dones, _ = env.step(policy(TensorDict(obs, batch_size=[16])))
                episode += rewards
                finished += episode[dones].tolist()
                episode[dones] = 0
        assert finished and sum(finished) / len(finished) >= 150, finished
    finally:
        env.close()
