"""CleanRL's own ppo.py on the cartpole engine (docs/learners/cleanrl.md): the guide's
commands as written (they fetch the script from CleanRL's release on PyPI), and the
runner's patch."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("stable_baselines3")
pytest.importorskip("tensorboard")

from conftest import doc_example  # noqa: E402
from shmbridge.integrations import cleanrl  # noqa: E402

GUIDE = "docs/learners/cleanrl.md"
# sha256 of cleanrl-0.4.8.tar.gz on PyPI: the script the guide's patch was written against.
SDIST_SHA256 = "947a5b4c006f43cf90be03b90c5345d118468260c7269c11e5d795954a2effa5"


@pytest.mark.long
def test_guide_commands_train_cleanrls_ppo_past_the_threshold(tmp_path):
    """The guide's commands, as written, in a folder of their own: CleanRL's ppo.py, 40k
    steps on the cartpole engine; the mean of the last 20 episode returns it logs must be
    at least 150 (random actions average about 22)."""
    commands = doc_example(GUIDE, "sh", after="## Train CleanRL's PPO")
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    sdist = tmp_path / "cleanrl-sdist" / "cleanrl-0.4.8.tar.gz"
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == SDIST_SHA256
    log = (tmp_path / "ppo.log").read_text()
    returns = [float(r) for r in re.findall(r"episode_reward=([0-9.]+)", log)]
    assert len(returns) >= 100, log[-2000:]
    last = sum(returns[-20:]) / 20
    assert last >= 150, f"mean of the last 20 returns {last:.1f}; first 20: {sum(returns[:20]) / 20:.1f}"
    assert any((tmp_path / "runs").iterdir())  # the script's own TensorBoard files


def test_patch_replaces_the_env_line_once_and_refuses_other_scripts():
    line = next(iter(cleanrl.ENV_LINES))
    script = f"import x\n{line}\nprint(envs)\n"
    assert cleanrl.patch(script) == f"import x\n{cleanrl.ENV_LINES[line]}\nprint(envs)\n"
    for other in ("envs = gym.vector.SyncVectorEnv([make_env()])\n", script + line + "\n"):
        with pytest.raises(ValueError, match="DummyVecEnv"):
            cleanrl.patch(other)


@pytest.mark.long
def test_runner_gives_ppo_continuous_action_its_make_env_wrappers_as_vector_wrappers(tmp_path):
    """A script shaped as ppo_continuous_action.py (it imports pybullet_envs, and its
    make_env wraps each env in its ClipActionsWrapper and NormalizedEnv): the env line
    becomes VecNormalize over VecMonitor over VecClipActions over shmbridge's VecEnv, and
    actions of 5 and NaN reach the Pendulum-v1 shards as its bound, 2, and 0."""
    line = next(iter(cleanrl.ENV_LINES))
    script = tmp_path / "continuous.py"
    script.write_text(f"""
import numpy as np
import pybullet_envs
import gym
class ClipActionsWrapper(gym.Wrapper):
    pass
class NormalizedEnv(gym.core.Wrapper):
    pass
class VecPyTorch:
    def __init__(self, venv, device):
        self.venv = venv
class args:
    gym_id, num_envs, seed = "shmbridge/Pendulum-v1", 2, 0
device = "cpu"
make_env = None
{line}
chain, venv = [], envs.venv
while hasattr(venv, "venv"):
    chain.append(type(venv).__name__)
    venv = venv.venv
print(" ".join(chain))
print(envs.venv.norm_obs, envs.venv.norm_reward, envs.venv.clip_obs, envs.venv.clip_reward, envs.venv.gamma)
envs.venv.reset()
envs.venv.step(np.array([[5.0], [np.nan]], dtype=np.float32))
print(np.asarray(venv.client.actions).ravel().tolist())
envs.venv.close()
""")
    run = subprocess.run([sys.executable, "-m", "shmbridge.integrations.cleanrl", str(script)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "VecNormalize VecMonitor VecClipActions", "True True 10.0 10.0 0.99", "[2.0, 0.0]"], run.stdout


def test_runner_refuses_a_script_without_the_line_before_running_it(tmp_path):
    script = tmp_path / "other.py"
    script.write_text("open('ran', 'w').close()\n")
    run = subprocess.run([sys.executable, "-m", "shmbridge.integrations.cleanrl", str(script)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "not a CleanRL script" in run.stderr, run.stderr
    assert not (tmp_path / "ran").exists()


def test_vec_env_serves_the_engine_ids_and_gymnasium_ids_behind_shards():
    env = cleanrl.shmbridge_vec_env("shmbridge/CartPole-v1", 2, 0)
    try:
        assert env.client.engine_kind == "cartpole" and env.num_envs == 2
    finally:
        env.close()
    env = cleanrl.shmbridge_vec_env("shmbridge/Acrobot-v1", 2, 0)
    try:
        assert env.action_space.n == 3 and env.observation_space.shape == (6,)
        assert env.reset().shape == (2, 6)
    finally:
        env.close()
    with pytest.raises(ValueError, match="shmbridge/CartPole-v1 or shmbridge/<Gymnasium id>"):
        cleanrl.shmbridge_vec_env("CartPole-v1", 2, 0)
