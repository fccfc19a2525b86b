"""CleanRL's ppo.py, unchanged but for its env construction (docs/learners/cleanrl.md),
trains on the cartpole engine past a mean return of 150."""

from __future__ import annotations

import hashlib
import os
import runpy
import shlex
import sys

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")
torch = pytest.importorskip("torch")
pytest.importorskip("tyro")
pytest.importorskip("tensorboard")

from conftest import doc_example  # noqa: E402
from shmbridge.gym import ShmVectorEnv  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GUIDE = "docs/learners/cleanrl.md"
# CleanRL's cleanrl/ppo.py at commit fe8d8a03c41a7ef5b523e2e354bd01c363e786bb.
PPO_SHA256 = "d8dfbb7ac0b21e747b77d6e6673e566db4d6cdacc83bcebcd19cf87ad0e459ae"
ENV_CONSTRUCTION = """    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, i, args.capture_video, run_name) for i in range(args.num_envs)],
    )
"""


def guide_command() -> list:
    """The arguments of the guide's `python ppo.py ...` command."""
    with open(os.path.join(HERE, "..", "..", GUIDE)) as f:
        text = f.read()
    start = text.index("```sh\npython ppo.py ") + len("```sh\n")
    words = shlex.split(text[start:text.index("\n", start)])
    assert words[:2] == ["python", "ppo.py"]
    return words[2:]


def test_cleanrl_ppo_trains_on_the_cartpole_engine(tmp_path, monkeypatch):
    with open(os.path.join(HERE, "cleanrl", "ppo.py"), "rb") as f:
        original = f.read()
    assert hashlib.sha256(original).hexdigest() == PPO_SHA256, "tests/python/cleanrl/ppo.py is not CleanRL's"
    source = original.decode()
    assert source.count(ENV_CONSTRUCTION) == 1
    script = tmp_path / "ppo.py"
    script.write_text(source.replace(ENV_CONSTRUCTION, doc_example(GUIDE)))

    monkeypatch.chdir(tmp_path)  # its TensorBoard logs go to runs/ here
    monkeypatch.setattr(sys, "argv", ["ppo.py", *guide_command()])
    torch.set_num_threads(1)
    script_globals = runpy.run_path(str(script), run_name="__main__")
    assert type(script_globals["envs"]).__name__ == "ShmVectorEnv"
    assert script_globals["global_step"] == 51200
    agent = script_globals["agent"]

    env = ShmVectorEnv(num_envs=16, seed=1)
    finished = []
    episode = np.zeros(16)
    try:
        obs, _ = env.reset()
        with torch.no_grad():
            for _ in range(1000):
                actions = agent.actor(torch.as_tensor(obs)).argmax(-1).numpy()
                obs, rewards, terminated, truncated, _ = env.step(actions)
                episode += rewards
                done = terminated | truncated
                finished += episode[done].tolist()
                episode[done] = 0
    finally:
        env.close()
    assert len(finished) >= 16 and np.mean(finished) >= 150, (np.mean(finished), len(finished))
