"""The multi-node command of ``docs/scaling.md``, as written there, on two "nodes" of this
machine: two network namespaces joined by a veth pair (loopback-free addresses of their
own, nothing else reachable), each in a mount namespace of its own with a fresh
``/dev/shm``. ``torchrun --nnodes=2`` with gloo: every rank steps its own sharded engine
in its node's ``/dev/shm``, DDP keeps the parameters of all ranks equal. Bounded:
``--total-steps`` and friends are appended to the documented command. Skipped, with the
reason, where the namespaces and the veth pair cannot be made (not root)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parents[2]
HANG = 600.0
SUBNET = "10.211.0"
PORT = 29500


def _unavailable():
    if os.geteuid() != 0:
        return "network and mount namespaces and a veth pair need root"
    for tool in (["unshare", "--version"], ["ip", "-V"]):
        try:
            subprocess.run(tool, capture_output=True, check=True, timeout=60)
        except (OSError, subprocess.CalledProcessError) as e:
            return f"{tool[0]} cannot run: {e}"
    return None


pytestmark = pytest.mark.skipif(bool(_unavailable()), reason=str(_unavailable()))


def documented_command() -> list:
    """The multi-node command of docs/scaling.md: its shell block with `--nnodes=2`."""
    text = (ROOT / "docs" / "scaling.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    block = next(b for b in blocks if "--nnodes=2" in b)
    return shlex.split(block.replace("\\\n", " "))


# Each node: a fresh tmpfs on /dev/shm, loopback up, then (once the test has put the veth
# end into its network namespace and said so on stdin) its address, then the command.
NODE = """set -e
mount -t tmpfs -o size=1g,mode=1777 shmbridge-node /dev/shm
ip link set lo up
read go
ip addr add "$ADDR/24" dev "$GLOO_SOCKET_IFNAME"
ip link set "$GLOO_SOCKET_IFNAME" up
exec "$@"
"""


def netns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


@pytest.mark.long
def test_the_documented_multi_node_command_runs_on_two_nodes(tmp_path):
    documented = documented_command()
    assert documented[0] == "torchrun" and "--node_rank=0" in documented, documented
    assert "--master_addr=node0" in documented, documented
    n, t_len, updates, per_node = 8, 16, 2, 2
    world = 2 * per_node
    bounded = [
        "--num-envs", str(n), "--num-steps", str(t_len), "--update-epochs", "1",
        "--total-steps", str(world * n * t_len * updates), "--target-return", "-1",
        "--blocking", "--no-progress", "--plot", "",
        "--report", str(tmp_path / "rank{rank}.json"),
    ]
    nodes = []
    try:
        for k in range(2):
            # `torchrun` is torch.distributed.run's console script.
            command = [sys.executable, "-m", "torch.distributed.run"] + [
                a.replace("--node_rank=0", f"--node_rank={k}")
                .replace("--master_addr=node0", f"--master_addr={SUBNET}.1")
                for a in documented[1:]
            ] + bounded
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "ADDR": f"{SUBNET}.{k + 1}",
                "GLOO_SOCKET_IFNAME": f"shmb-node{k}",
            }
            nodes.append(subprocess.Popen(
                ["unshare", "--net", "--mount", "--propagation", "private", "--pid", "--fork",
                 "--mount-proc", "--kill-child", "sh", "-c", NODE, "sh", *command],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, env=env, cwd=tmp_path,
            ))
        ours = netns(os.getpid())
        deadline = time.monotonic() + 60
        while any(netns(p.pid) == ours for p in nodes):  # each has its namespaces
            assert time.monotonic() < deadline, "unshare never made the namespaces"
            os.sched_yield()
        subprocess.run(
            ["ip", "link", "add", "shmb-node0", "netns", str(nodes[0].pid), "type", "veth",
             "peer", "name", "shmb-node1", "netns", str(nodes[1].pid)],
            check=True, capture_output=True, text=True,
        )
        for p in nodes:
            p.stdin.write("go\n")
            p.stdin.flush()
        outputs = [p.communicate(timeout=HANG) for p in nodes]
        for k, (p, (out, err)) in enumerate(zip(nodes, outputs)):
            assert p.returncode == 0, f"node {k}: {err[-4000:]}"
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.communicate()
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in reports] == list(range(world))
    assert {r["world"] for r in reports} == {world}
    # Every rank stepped an engine of its own, in its node's /dev/shm (none of which is
    # this one's), and every engine answered every step of its rank's rollouts.
    assert len({r["region"] for r in reports}) == world
    for r in reports:
        assert r["frames"] == updates * t_len
        assert r["env_steps_all_ranks"] == world * n * t_len * updates
        assert r["shards"] == [[0, n // 2], [n // 2, n]]
        assert not os.path.exists(f"/dev/shm/{r['region']}")
    # DDP over gloo, across the veth pair: equal parameters at the start and after the
    # updates, which moved them.
    assert len({r["params_initial"] for r in reports}) == 1
    assert len({r["params_final"] for r in reports}) == 1
    assert reports[0]["params_final"] != reports[0]["params_initial"]
    # Rank 0 alone logs.
    assert outputs[0][0].count("final mean return") == 1, outputs[0][0]
    assert "final mean return" not in outputs[1][0]
