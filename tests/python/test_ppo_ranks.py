"""shmbridge-ppo on two ranks (torchrun, gloo on CPU): each rank steps its own sharded
engine, DDP averages the gradients, and the parameters stay equal after the updates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("tqdm")


@pytest.mark.long
def test_two_ranks_step_their_own_engines_and_keep_equal_parameters(tmp_path):
    n, t_len, updates = 8, 32, 3
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "shmbridge.examples.ppo",
        "--device", "cpu", "--num-envs", str(n), "--num-steps", str(t_len), "--shards", "2",
        "--total-steps", str(2 * n * t_len * updates), "--target-return", "-1",
        "--update-epochs", "2", "--no-progress", "--plot", "",
        "--report", str(tmp_path / "rank{rank}.json"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1] and {r["world"] for r in reports} == {2}
    # Each rank stepped an engine of its own: two regions, four shard processes, and
    # every engine answered every step of its rank's rollouts.
    assert reports[0]["region"] != reports[1]["region"]
    pids = reports[0]["shard_pids"] + reports[1]["shard_pids"]
    assert len(set(pids)) == 4
    for r in reports:
        assert r["shards"] == [[0, n // 2], [n // 2, n]]
        assert r["frames"] == updates * t_len
        assert r["env_steps_all_ranks"] == 2 * n * t_len * updates
    # DDP: equal parameters at the start and after the updates, which moved them.
    assert reports[0]["params_initial"] == reports[1]["params_initial"]
    assert reports[0]["params_final"] == reports[1]["params_final"]
    assert reports[0]["params_final"] != reports[0]["params_initial"]
    # Rank 0 alone logs.
    assert proc.stdout.count("final mean return") == 1, proc.stdout
    for r in reports:
        assert not os.path.exists(f"/dev/shm/{r['region']}")
