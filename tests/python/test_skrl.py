"""shmbridge.integrations.skrl.SkrlEnv: skrl's PPO agent and SequentialTrainer start, step,
store what the engine produced and train CartPole past a threshold; the region's tensors
by address; next-step engines against Gymnasium's CartPole-v1 stepped directly."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import shmbridge

gym = pytest.importorskip("gymnasium")
torch = pytest.importorskip("torch")
pytest.importorskip("skrl")

from skrl.envs.wrappers.torch import Wrapper  # noqa: E402

from conftest import doc_example  # noqa: E402
from shmbridge.integrations.skrl import SkrlEnv  # noqa: E402


def test_module_imports_without_skrl_and_names_the_extra():
    code = """
import sys
sys.modules["skrl"] = None
import shmbridge.integrations.skrl as m
try:
    m.SkrlEnv
except ImportError as e:
    assert "shmbridge[skrl]" in str(e), e
    print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.long
def test_guide_example_trains_ppo_past_the_threshold_and_stores_the_engines_observations(capsys):
    """docs/learners/skrl.md's example, as written, with env.step recorded: skrl's memory
    holds, for each step of the last rollout, the observations the agent acted on; the
    trained policy's mean return is at least 150."""
    code = doc_example("docs/learners/skrl.md")
    recorded = []

    def record(env):
        reset, step = env.reset, env.step

        def reset_and_record():
            out = reset()
            recorded.append(out[0].clone())
            return out

        def step_and_record(actions):
            out = step(actions)
            recorded.append(out[0].clone())
            return out

        env.reset, env.step = reset_and_record, step_and_record
        return env

    code = code.replace("SequentialTrainer(\n    env=env,", "SequentialTrainer(\n    env=record(env),")
    assert "record(env)" in code
    namespace: dict = {"record": record}
    exec(compile(code, "docs/learners/skrl.md", "exec"), namespace)
    assert namespace["mean_return"] >= 150, capsys.readouterr().out
    memory = namespace["memory"].get_tensor_by_name("observations")  # [32, 8, 4]
    steps = namespace["trainer"].cfg.timesteps
    assert memory.shape == (32, 8, 4) and len(recorded) == steps + 1
    for t in range(32):
        assert torch.equal(memory[t], recorded[steps - 32 + t]), t


def test_region_tensors_by_address():
    env = SkrlEnv("cartpole", num_envs=8, seed=0, copy=False)
    client = env.client
    try:
        assert isinstance(env, Wrapper) and env.num_envs == 8 and env.num_agents == 1
        assert env.observation_space.shape == (4,) and env.action_space.n == 2
        assert env.device == torch.device("cpu") and env.state() is None
        for name, tensor in (("obs", client.obs), ("rewards", client.rewards),
                             ("terminated", client.terminated), ("truncated", client.truncated)):
            assert env.shared[name].data_ptr() == tensor.data_ptr, name
        obs, _ = env.reset()
        assert obs.data_ptr() == client.obs.data_ptr
        actions = torch.tensor([[0], [1]] * 4)
        obs, rewards, terminated, truncated, infos = env.step(actions)
        assert np.array_equal(np.asarray(client.actions).reshape(-1), actions.reshape(-1).numpy())
        assert obs.data_ptr() == client.obs.data_ptr and rewards.shape == (8, 1)
        assert rewards.data_ptr() == client.rewards.data_ptr
        assert terminated.data_ptr() == client.terminated.data_ptr
        assert truncated.data_ptr() == client.truncated.data_ptr
    finally:
        env.close()
    env = SkrlEnv("cartpole", num_envs=8, seed=0)
    try:
        assert env.reset()[0].data_ptr() != env.client.obs.data_ptr
    finally:
        env.close()


def test_next_step_engine_is_autoreset_as_gymnasiums_cartpole():
    """launch_gym's CartPole-v1 (next-step autoreset underneath) through the wrapper and
    Gymnasium's CartPole-v1 stepped directly: the same observations, rewards and flags;
    a finished env's observation is what reset() gives next."""
    n, seed = 4, 50
    env = SkrlEnv(client=shmbridge.launch_gym("CartPole-v1", num_envs=n, shards=1, seed=seed), close_client=True)
    refs = [gym.make("CartPole-v1") for _ in range(n)]
    rng = np.random.default_rng(3)
    finished = 0
    try:
        for i, r in enumerate(refs):
            r.reset(seed=seed + i)  # the engine's frame 0
        expected = np.stack([r.reset()[0] for r in refs])  # the wrapper's first reset()
        obs, _ = env.reset()
        np.testing.assert_array_equal(obs.numpy(), expected)
        np.testing.assert_array_equal(env.reset()[0].numpy(), expected)  # later: no reset
        for _ in range(150):
            actions = rng.integers(0, 2, size=n)
            obs, rewards, terminated, truncated, _ = env.step(torch.from_numpy(actions).unsqueeze(-1))
            for i, r in enumerate(refs):
                o, rew, te, tr, _ = r.step(int(actions[i]))
                assert (rewards[i, 0].item(), terminated[i, 0].item(), truncated[i, 0].item()) == (rew, te, tr)
                if te or tr:
                    o, _ = r.reset()
                    finished += 1
                np.testing.assert_array_equal(obs[i].numpy(), o)
    finally:
        env.close()
    assert finished > 10


def test_learner_runs_evaluation_counts_whole_episodes_of_fresh_envs():
    """examples/learner_runs.py's evaluation of the skrl (and rsl_rl) runs: each evaluation
    starts fresh envs, so a policy that balances the pole to the time limit scores
    CartPole's maximum, 500, in every episode it finishes, the second time too (the skrl
    run's, reusing one SkrlEnv, whose reset() resets only the first time, started the
    second where the first stopped and counted the rest of those episodes, 300 steps, as
    whole ones)."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("learner_runs", os.path.join(root, "examples/learner_runs.py"))
    runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runs)

    def balance(obs):  # push toward where the pole falls: reaches the time limit
        return (obs[:, 2] + 0.5 * obs[:, 3] > 0).long()

    # 700 steps: one whole episode per env, and 200 steps into the next.
    first = runs.cartpole_evaluate(balance, seed=3, num_envs=4, steps=700)
    second = runs.cartpole_evaluate(balance, seed=3, num_envs=4, steps=700)
    assert first == [500.0] * 4, first
    assert second == first
