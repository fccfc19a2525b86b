"""The main job's PPO example (shmbridge.examples.ppo) on a short budget: it learns,
writes its learning curve, and leaves nothing in /dev/shm."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

from shmbridge.examples import ppo  # noqa: E402

# A random policy averages about 22 on CartPole-v1. With the defaults and 24,576 env
# steps (12 updates, about 3 s), seeds 1-10 ended at a mean return (last 100 episodes)
# of 126-147; 3x random leaves a margin of about 2x below the worst of them.
RANDOM_RETURN = 22.0
THRESHOLD = 3 * RANDOM_RETURN
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _regions() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("shmbridge-")}


def test_ppo_learns_on_a_short_budget(tmp_path, capsys):
    before = _regions()
    plot = tmp_path / "curve.png"
    rc = ppo.main([
        "--total-steps", "24576", "--seed", "1", "--device", "cpu",
        "--plot", str(plot), "--no-progress",
    ])
    out = capsys.readouterr().out
    assert rc == 0, out

    m = re.search(r"^final mean return over the last (\d+) episodes: ([0-9.]+) "
                  r"\(([0-9,]+) episodes, [0-9.]+ s, [0-9,]+ env-steps/s\)$", out, re.M)
    assert m, out
    window, mean, episodes = int(m.group(1)), float(m.group(2)), int(m.group(3).replace(",", ""))
    assert window == 100 and episodes >= 100, out
    assert mean >= THRESHOLD, out
    assert "torch device: cpu" in out

    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert f"learning curve: {plot}" in out
    assert _regions() == before


def test_train_returns_the_result(tmp_path):
    before = _regions()
    cfg = ppo.Config(total_steps=2048, num_steps=64, num_envs=8, seed=3, device="cpu",
                     plot=str(tmp_path / "c.png"), progress=False)
    r = ppo.train(cfg, log=lambda *a: None)
    assert r.env_steps == 2048 and not r.reached_target
    assert r.episodes > 0 and r.window_episodes == min(r.episodes, 100)
    assert len(r.curve_steps) == len(r.curve_returns) == 4
    assert r.curve_steps[-1] == 2048
    assert r.plot == str(tmp_path / "c.png") and (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC
    assert r.summary().startswith(f"final mean return over the last {r.window_episodes} episodes: ")
    assert _regions() == before


def test_module_help_and_bad_device():
    # -m entry point; --help needs neither torch nor an engine.
    p = subprocess.run([sys.executable, "-m", "shmbridge.examples.ppo", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for opt in ("--num-envs", "--total-steps", "--target-return", "--plot", "--threads"):
        assert opt in p.stdout

    import torch

    if not torch.cuda.is_available():
        assert ppo.main(["--device", "cuda", "--plot", "", "--no-progress"]) == 2
