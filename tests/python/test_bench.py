"""The benchmark harness (python -m shmbridge.bench) runs end to end in its smoke mode.

No timing is asserted: the point is that the harness cannot rot. A transport is allowed
to be missing from a run only when its Python package is not installed, and the table
says so."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import shmbridge
from conftest import regions

pytest.importorskip("matplotlib")

TIMEOUT = 600

# Transport keys -> the modules they need (mirrors shmbridge.bench.peers).
NEEDS = {
    "grpc-floats": ("grpc", "grpc_tools"),
    "grpc-bytes": ("grpc", "grpc_tools"),
    "iceoryx2-rr": ("iceoryx2",),
    "iceoryx2-ps": ("iceoryx2",),
    "gym-async": ("gymnasium",),
}
PER_WORKLOAD = ("shmbridge-spin", "shmbridge-blocking", "grpc-floats", "grpc-bytes",
                "iceoryx2-rr", "iceoryx2-ps", "shm-pipe", "floor")
CARTPOLE = ("shmbridge-spin", "shmbridge-blocking", "gym-async")


def _missing(key: str) -> list:
    return [m for m in NEEDS.get(key, ()) if importlib.util.find_spec(m) is None]


def _run(*args: str, status: int = 0, cwd=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "shmbridge.bench", *args], capture_output=True,
                          text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL, cwd=cwd)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    assert proc.returncode == status, f"exit status {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc


def _table_rows(text: str) -> list:
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| payload"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_step_quick(tmp_path):
    out = _run("step", "--quick", "--out", str(tmp_path)).stdout
    rows = _table_rows(out)
    payloads = [r[0] for r in rows]
    assert any(p.startswith("obs 64 B") for p in payloads), out
    assert any(p.startswith("obs 4096×100") for p in payloads), out
    assert any(p.startswith("ratio") for p in payloads), out
    for r in rows[:3]:
        assert int(r[2].replace(",", "")) > 0 and float(r[3].replace(",", "")) > 0, r
    assert "p99 of shmbridge (64 B) within 2× the floor's" in out and "### The tail" in out
    doc = json.loads((tmp_path / "step.json").read_text())
    labels = [c["label"] for c in doc["cases"]]
    assert labels == ["shmbridge (spin)", "shmbridge (spin)", "raw seq-counter ping-pong (floor)"]
    for c in doc["cases"]:
        # Every timed step in one bucket of the histogram; percentiles in order.
        assert sum(c["histogram"]) == c["n"] and len(c["histogram"]) == len(doc["buckets_ns"]) + 1
        assert c["p50"] <= c["p90"] <= c["p99"] <= c["p99.9"] <= c["max"]
        assert set(c["sched"]) == {"client", "server"}


def test_step_blocking_without_floor():
    out = _run("step", "--quick", "--blocking", "--no-floor", "--steps", "400").stdout
    assert "blocking policy" in out and "(floor)" not in out


def _iceoryx2_leftovers() -> set:
    """What iceoryx2 leaves behind (its segments in /dev/shm, its folders in /tmp). The
    stream benchmark's segments (``shmbridge-bench-stream-*``), which its own tests,
    running meanwhile on another worker, make and remove, are not the peers'."""
    return ({n for n in os.listdir("/dev/shm")
             if "iox2" in n or (n.startswith("shmbridge-bench-") and not n.startswith("shmbridge-bench-stream-"))}
            | {n for n in os.listdir("/tmp") if n == "iceoryx2" or n.startswith("shmbridge-bench-iceoryx2-")})


@pytest.mark.long
def test_peers_quick(tmp_path):
    out_dir = tmp_path / "results"
    before = _iceoryx2_leftovers()
    proc = _run("peers", "--quick", "--out", str(out_dir))
    # iceoryx2 keeps a management segment after its last node: each peer runs under its
    # own prefix and removes it at close.
    left = _iceoryx2_leftovers()
    assert not [n for n in left if n.startswith("shmbridge-bench-")], left  # our own: never
    assert left <= before, left - before  # iceoryx2's default ones: not made by the bench

    md = (out_dir / "peers.md").read_text()
    png = (out_dir / "peers.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert md.strip() in proc.stdout  # the same table on stdout and in the file

    data = json.loads((out_dir / "peers.json").read_text())
    by_workload = {w["workload"]: {r["key"]: r for r in w["rows"]} for w in data["results"]}
    assert set(by_workload) == {"64B", "4096x100", "images", "cartpole"}
    ran = 0
    for workload, rows in by_workload.items():
        expected = CARTPOLE if workload == "cartpole" else PER_WORKLOAD
        assert set(rows) == set(expected), (workload, sorted(rows))
        for key, row in rows.items():
            assert not row["failed"], f"{workload}/{key} failed: {row['failed']}"
            missing = _missing(key)
            if missing:
                assert row["skipped"] and row["stats"] is None, (workload, key, row)
                print(f"skipped {workload}/{key}: {row['skipped']} (missing modules {missing})")
                continue
            assert row["skipped"] is None, f"{workload}/{key} skipped although installed: {row['skipped']}"
            assert row["stats"]["n"] > 0 and row["stats"]["median_ns"] > 0, (workload, key, row)
            ran += 1
    # One markdown row per transport and workload, measured or marked skipped.
    rows = _table_rows(md)
    assert len(rows) == sum(len(r) for r in by_workload.values()), md
    measured = [r for r in rows if not r[2].startswith(("skipped", "failed"))]
    assert len(measured) == ran
    assert not [r for r in rows if r[2].startswith("failed")], md
    assert "Targets" in md


def test_peers_grpc_seeds_is_an_alias_of_grpc_floats(tmp_path):
    """The key the docs gave before `grpc-floats` still selects that transport, with a warning."""
    out_dir = tmp_path / "results"
    proc = _run("peers", "--quick", "--workloads", "64B", "--transports", "grpc-seeds",
                "--rounds", "1", "--out", str(out_dir))
    assert "'grpc-seeds' is deprecated" in proc.stderr and "grpc-floats" in proc.stderr
    data = json.loads((out_dir / "peers.json").read_text())
    rows = {r["key"]: r for w in data["results"] for r in w["rows"]}
    assert set(rows) == {"shmbridge-spin", "grpc-floats"}, sorted(rows)
    row = rows["grpc-floats"]
    assert not row["failed"], row["failed"]
    if _missing("grpc-floats"):
        assert row["skipped"] and row["stats"] is None, row
    else:
        assert row["skipped"] is None and row["stats"]["n"] > 0, row


# ---------------------------------------------------------------------------------------
# bench gpu: CUDA IPC against host-staged copies.


def _gpu_unusable() -> str:
    """Why `bench gpu` cannot measure here ('' where it can)."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    ok, reason = shmbridge.cuda_status()
    return "" if ok else f"shmbridge.cuda_status(): {reason}"


NO_GPU = _gpu_unusable()


@pytest.mark.skipif(not NO_GPU, reason="a usable GPU is here: bench gpu measures instead of skipping")
def test_gpu_skips_with_status_3_without_a_gpu(tmp_path):
    before = regions()
    out_dir = tmp_path / "results"
    proc = _run("gpu", "--quick", "--out", str(out_dir), status=3, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench gpu: skipped: "), proc.stderr
    reason = lines[0][len("bench gpu: skipped: "):]
    import torch

    if not torch.cuda.is_available():
        assert f"torch {torch.__version__}" in reason and "sees no usable CUDA device" in reason
    else:  # torch has a GPU, shmbridge cannot use it: its probe's reason
        assert shmbridge.cuda_status().reason.splitlines()[0].strip() in reason
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert not regions() - before


def test_gpu_harness_on_host_memory():
    """The harness itself, runnable anywhere: measure() with host memory standing in for
    the GPU (the 'cuda-ipc' engine serves host tensors, the copies go to the CPU). It
    measures nothing about CUDA; it checks the rounds, the zero-copy pointer check, the
    stale-frame check and the report."""
    torch = pytest.importorskip("torch")
    from shmbridge.bench import gpu

    before = regions()
    plan = gpu.Plan(rounds=2, per_block=30, warmup=3)
    results = gpu.measure(plan, torch.device("cpu"), "cpu", pin=False)
    assert [r.workload.key for r in results] == ["4096x100", "images"]
    assert [r.tensor for r in results] == ["obs", "rgb"]
    for r in results:
        assert r.zero_copy and r.view_ptr == r.tensor_ptr != 0, r
        assert r.failures == [], r.failures
        assert {k: len(v) for k, v in r.samples.items()} == {k: 60 for k, _ in gpu.PATHS}
    text, doc = gpu.report(results, plan, [], True, 0.0, "python -m shmbridge.bench gpu --quick")
    assert [p["key"] for p in doc["payloads"]] == ["4096x100", "images"]
    for p in doc["payloads"]:
        assert set(p["paths"]) == {"cuda-ipc", "host-pageable", "host-pinned"}
        assert all(s["n"] == 60 for s in p["paths"].values())
        assert set(p["ratios"]) == {"cuda-ipc", "host-pageable", "host-pinned"}
        assert p["zero_copy"]["equal"] and p["zero_copy"]["ok"]
    assert doc["target"]["ratio"] is not None
    assert text.count("zero copy") == 2 and "Checks failed" not in text
    assert not regions() - before

    # The check reads the device tensor: a frame it was not copied from is reported.
    with shmbridge.launch("null", num_envs=8, obs_dim=5, act_dim=2, sparse=True) as c:
        res = gpu.PayloadResult(gpu.Workload("t", "t", 8, (5,), "float32", 2), "obs", "cpu")
        case = gpu._Case(res, "host-pinned", c, torch.device("cpu"), torch.zeros(()), pin=False)
        case.run(3, res.samples["host-pinned"])
        assert case.check() is None and c.frame == 3
        c.step()  # a new frame the device copy has not seen
        problem = case.check()
        assert problem and "frame 4" in problem, problem


@pytest.mark.skipif(bool(NO_GPU), reason=f"bench gpu needs a usable GPU: {NO_GPU}")
def test_gpu_quick(tmp_path):
    before = regions()
    out_dir = tmp_path / "results"
    proc = _run("gpu", "--quick", "--out", str(out_dir))
    md = (out_dir / "gpu.md").read_text()
    assert md.strip() in proc.stdout
    data = json.loads((out_dir / "gpu.json").read_text())
    payloads = {p["key"]: p for p in data["payloads"]}
    assert set(payloads) == {"4096x100", "images"}
    for key, p in payloads.items():
        assert p["failures"] == [], (key, p["failures"])
        assert set(p["paths"]) == {"cuda-ipc", "host-pageable", "host-pinned"}
        for path, s in p["paths"].items():
            assert s and s["n"] > 0 and s["median_ns"] > 0, (key, path, s)
        z = p["zero_copy"]
        assert z["equal"] and z["ok"] and z["view_data_ptr"] == z["tensor_data_ptr"] != 0, (key, z)
        assert p["engine_device"].startswith("cuda:") and z["view_device"] == p["engine_device"]
        assert set(p["ratios"]) == {"cuda-ipc", "host-pageable", "host-pinned"}
    assert md.count(": zero copy") == 2 and "NOT zero copy" not in md
    assert not regions() - before


# bench vulkan: exported frames against host shared memory.


def test_vulkan_quick_measures_both_paths_zero_copy_or_skips(tmp_path):
    before = regions()
    out_dir = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "shmbridge.bench", "vulkan", "--quick",
                           "--num-envs", "8", "--size", "16x24", "--out", str(out_dir)],
                          capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    sys.stderr.write(proc.stderr)
    if proc.returncode == 3:
        assert proc.stderr.startswith("bench vulkan: skipped: ") and "Vulkan" in proc.stderr
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out_dir / "vulkan.json").read_text())
    assert doc["plan"]["num_envs"] == 8 and doc["plan"]["height"] == 16
    cpu = {k: v for k, v in doc["paths"].items() if k in ("vulkan-export", "host-shm")}
    assert set(cpu) == {"vulkan-export", "host-shm"}
    for key, path in cpu.items():
        assert path["zero_copy"] and path["view_device"] == "cpu" and not path["failures"], key
        assert path["stats"]["n"] == 100 and path["stats"]["median_ns"] > 0
    assert cpu["vulkan-export"]["ratio"]["median"] == 1.0
    assert (out_dir / "vulkan.md").read_text().strip() == proc.stdout.strip()
    assert not regions() - before


def test_vulkan_rejects_a_bad_size():
    proc = _run("vulkan", "--size", "84", status=2)
    assert "expected HxW" in proc.stderr


@pytest.mark.long
def test_vector_quick(tmp_path):
    pytest.importorskip("gymnasium")
    out = tmp_path / "results"
    proc = _run("vector", "--quick", "--workloads", "CartPole-v1", "--envs", "2",
                "--steps", "5", "--rounds", "1", "--out", str(out))
    doc = json.loads((out / "vector.json").read_text())
    rows = doc["results"]["CartPole-v1 N=2"]
    labels = [r["label"] for r in rows]
    assert labels[:2] == ["shmbridge K=1", "shmbridge K=2"]
    assert "AsyncVectorEnv" in labels and "SyncVectorEnv" in labels
    if importlib.util.find_spec("envpool") is not None:
        assert "EnvPool" in labels
    for r in rows:
        assert r["n"] == 5 and r["median_ns"] > 0 and r["env_steps_per_s"] > 0
        if r["label"].startswith("PufferLib"):  # batches of part of the envs: not per step
            assert r["num_envs"] == 1 and "vs_SyncVectorEnv" not in r
            # The learner's idle time, its recv(), timed apart from the step it is part of.
            assert 0 < r["idle_median_ns"] <= r["median_ns"] and 0 < r["idle_p99_ns"] <= r["p99_ns"]
            continue
        assert "vs_AsyncVectorEnv" in r and "vs_SyncVectorEnv" in r
        assert len(r["round_ratios_to_sync"]) == 1
    transport = doc["results"]["null transport N=4"]
    assert [r["label"] for r in transport] == ["one engine", "2 shards"]
    assert (out / "vector.png").stat().st_size > 0
    md = (out / "vector.md").read_text()
    assert "## CartPole-v1 N=2" in md
    assert "- CartPole-v1 N=2: one shard " in md and "Load average at the end" in md
    assert "| shmbridge K=2 |" in proc.stdout


def test_vector_contenders_subset(tmp_path):
    pytest.importorskip("gymnasium")
    out = tmp_path / "results"
    _run("vector", "--quick", "--workloads", "CartPole-v1", "--envs", "1", "--shards", "1",
         "--contenders", "shmbridge,sync", "--steps", "3", "--rounds", "2", "--out", str(out))
    rows = json.loads((out / "vector.json").read_text())["results"]["CartPole-v1 N=1"]
    assert [r["label"] for r in rows] == ["shmbridge K=1", "SyncVectorEnv"]
    assert len(rows[0]["round_ratios_to_sync"]) == 2
    proc = _run("vector", "--contenders", "shmbridge,grpc", status=2)
    assert "unknown contenders ['grpc']" in proc.stderr


def test_vector_envpool_mujoco_sync_at_equal_threads_and_async(tmp_path):
    pytest.importorskip("envpool")
    pytest.importorskip("mujoco")
    out = tmp_path / "results"
    _run("vector", "--quick", "--workloads", "HalfCheetah-v5", "--envs", "4", "--shards", "1",
         "--contenders", "sync,envpool", "--steps", "3", "--rounds", "1", "--out", str(out))
    rows = json.loads((out / "vector.json").read_text())["results"]["HalfCheetah-v5 N=4"]
    assert [r["label"] for r in rows] == ["SyncVectorEnv", "EnvPool T=1", "EnvPool async B=2 T=1"]
    sync, pool, pool_async = rows
    assert pool["num_envs"] == 4 and "vs_SyncVectorEnv" in pool
    # A step of half the envs: counted as 2 env-steps, and not compared per step.
    assert pool_async["num_envs"] == 2 and "vs_SyncVectorEnv" not in pool_async
    # Its idle time is the recv() of each step, part of the step.
    assert 0 < pool_async["idle_median_ns"] <= pool_async["median_ns"]
    assert 0 < pool_async["idle_p99_ns"] <= pool_async["p99_ns"]
    assert all(r["env_steps_per_s"] > 0 for r in rows)


def test_vector_pufferlib_multiprocessing_in_batches(tmp_path):
    pytest.importorskip("pufferlib")
    out = tmp_path / "results"
    _run("vector", "--quick", "--workloads", "CartPole-v1", "--envs", "4", "--shards", "2",
         "--contenders", "sync,pufferlib", "--steps", "3", "--rounds", "1", "--out", str(out))
    rows = json.loads((out / "vector.json").read_text())["results"]["CartPole-v1 N=4"]
    assert [r["label"] for r in rows] == ["SyncVectorEnv", "PufferLib B=2 W=2"]
    puffer = rows[1]
    assert puffer["num_envs"] == 2 and puffer["processes"] == 2 and puffer["env_steps_per_s"] > 0
    assert "vs_SyncVectorEnv" not in puffer


def test_observers_quick_times_every_configuration(tmp_path):
    out = tmp_path / "results"
    _run("observers", "--quick", "--rounds", "1", "--block-seconds", "0.2", "--no-browser",
         "--out", str(out))
    doc = json.loads((out / "observers.json").read_text())
    configs = ["none", "1 observer, 1 Hz", "1 observer, 60 Hz", "4 observers, 60 Hz"]
    assert [c for c in doc if c != "machine"] == configs
    for c in configs:
        assert doc[c]["n"] > 0 and doc[c]["median_ns"] > 0 and doc[c]["steps_per_s"] > 0
    md = (out / "observers.md").read_text()
    rows = {r[0]: r for r in _table_rows(md) if r[0] in configs}
    assert set(rows) == set(configs)
    assert all(len(r) == 8 for r in rows.values()), rows
    assert rows["none"][5] == rows["none"][7] == "1.00×"


@pytest.mark.long
def test_learners_quick(tmp_path):
    for module in ("gymnasium", "stable_baselines3", "torchrl", "skrl"):
        pytest.importorskip(module)
    out = tmp_path / "results"
    proc = _run("learners", "--quick", "--workloads", "CartPole-v1", "--envs", "2", "--steps", "3",
                "--rounds", "1", "--out", str(out))
    rows = json.loads((out / "learners.json").read_text())["rows"]
    assert [(r["library"], r["own"], r["ours"]) for r in rows] == [
        ("sb3", "SubprocVecEnv", "shmbridge K=2"),
        ("torchrl", "GymEnv(num_envs)", "shmbridge K=2"),
        ("skrl", "wrap_env(AsyncVectorEnv)", "shmbridge K=2"),
    ]
    for r in rows:
        assert r["env_id"] == "CartPole-v1" and r["num_envs"] == 2 and r["steps"] == 3
        assert len(r["own_rates"]) == len(r["ours_rates"]) == 1
        assert r["own_median"] > 0 and r["ours_median"] > 0
        assert r["ratio"] == pytest.approx(r["ours_median"] / r["own_median"])
    md = (out / "learners.md").read_text()
    assert "| torchrl | CartPole-v1 | 2 | GymEnv(num_envs) |" in md and "Load average at the end" in md
    assert "| skrl | CartPole-v1 | 2 |" in proc.stdout
    proc = _run("learners", "--libraries", "sb3,rllib", status=2)
    assert "unknown libraries ['rllib']" in proc.stderr


# bench pixels: rendered frames to torch against Gymnasium's rgb_array.


@pytest.mark.long
def test_pixels_quick_measures_every_path_it_can(tmp_path):
    """A tiny run: every path measured or skipped with its reason (Vulkan driver,
    pygame); the shmbridge views are the engine's memory and hold drawn frames."""
    before = regions()
    out_dir = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "shmbridge.bench", "pixels", "--quick",
                           "--num-envs", "3", "--size", "24x32", "--steps", "6", "--out", str(out_dir)],
                          capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    sys.stderr.write(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out_dir / "pixels.json").read_text())
    assert doc["plan"]["num_envs"] == 3 and (doc["plan"]["height"], doc["plan"]["width"]) == (24, 32)
    paths, skipped = doc["paths"], doc["skipped"]
    assert set(paths) | set(skipped) == {"pixels-vulkan", "pixels-host", "pixels-vulkan-stack4",
                                         "gym-sync", "gym-async"}
    assert "pixels-host" in paths  # needs neither Vulkan nor pygame
    for key, why in skipped.items():
        if key.startswith("gym"):
            assert importlib.util.find_spec("pygame") is None, f"{key} skipped: {why}"
        else:
            assert "Vulkan" in why, (key, why)
    for key, path in paths.items():
        assert not path["failures"], (key, path["failures"])
        assert path["stats"]["n"] == 6 and path["frames_per_s"] > 0, key
        if key.startswith("pixels"):
            assert path["zero_copy"] is True, key
    if "gym-async" in paths:
        assert paths["gym-async"]["ratio_to_async"] == 1.0
    assert (out_dir / "pixels.md").read_text().strip() == proc.stdout.strip()
    assert not regions() - before


def test_pixels_rejects_a_bad_size():
    proc = _run("pixels", "--size", "84", status=2)
    assert "expected HxW" in proc.stderr


def _stream_record(content, s):
    """Record ``s`` of a bench stream producer, as the consumer receives it (arrays)."""
    k, score, iid, meta = content.record(s)
    return [content.tokens[k].copy(), content.logprobs[k].copy(), score, iid, content.head(s) + meta]


def test_stream_check_counts_torn_duplicated_and_reordered_records():
    from shmbridge.bench.stream import Content, Tally

    content = Content(1, 64)
    tally = Tally(producers=2, tokens=64)
    for s in (0, 1, 3, 2):  # 2 after 3: reordered
        tally.add(*_stream_record(content, s), t_pop=0)
    tally.add(*_stream_record(content, 1), t_pop=0)  # again: duplicated
    torn = _stream_record(content, 4)
    torn[0][10] += 1  # one token changed
    tally.add(*torn, t_pop=0)
    mixed = _stream_record(content, 5)
    mixed[1] = _stream_record(content, 6)[1]  # another record's logprobs
    tally.add(*mixed, t_pop=0)
    wrong_id = _stream_record(content, 7)
    wrong_id[3] = b"p1-s8"
    tally.add(*wrong_id, t_pop=0)
    garbled = _stream_record(content, 9)
    garbled[4] = garbled[4][:-3]  # meta cut short
    tally.add(*garbled, t_pop=0)
    stranger = _stream_record(Content(5, 64), 0)  # a producer id out of range
    tally.add(*stranger, t_pop=0)
    assert (tally.received, tally.intact, tally.duplicated, tally.torn, tally.reordered) == (10, 4, 1, 5, 1)
    assert sorted(tally.seen[1]) == [0, 1, 2, 3] and len(tally.latencies) == 4


def test_stream_check_compares_every_byte_of_every_field():
    """The check compares each record with the one its header names, rebuilt from the
    producer's seed: one byte off anywhere, a header cut short, a wrong dtype, a record
    of the wrong length, are each torn; the intact record passes after all of them."""
    import struct

    from shmbridge.bench.stream import HEAD, Content, Tally

    content = Content(0, 64)
    tally = Tally(producers=1, tokens=64)
    bad = []
    r = _stream_record(content, 3)
    r[1].view(np.uint8)[-1] ^= 1  # the last byte of the logprobs
    bad.append(r)
    r = _stream_record(content, 3)
    r[0].view(np.uint8)[0] ^= 0x80  # the first byte of the tokens
    bad.append(r)
    r = _stream_record(content, 3)
    r[2] += 0.5  # the score
    bad.append(r)
    r = _stream_record(content, 3)
    r[4] = r[4][:-1] + b"]"  # the last byte of meta's JSON
    bad.append(r)
    r = _stream_record(content, 3)
    r[4] = r[4][:HEAD.size - 1]  # a header cut short
    bad.append(r)
    r = _stream_record(content, 3)
    r[4] = struct.pack("<IIQ", 0, 19, 0) + r[4][HEAD.size:]  # another record's identity (same bank entry)
    bad.append(r)
    r = _stream_record(content, 3)
    r[0] = r[0].astype(np.int64)  # the tokens' dtype
    bad.append(r)
    r = _stream_record(content, 3)
    r[0], r[1] = r[0][:-1], r[1][:-1]  # a record one element short
    bad.append(r)
    r = _stream_record(content, 3)
    r[3] = b"p0-s3\0"  # one byte more of instance_id
    bad.append(r)
    for r in bad:
        tally.add(*r, t_pop=0)
    assert (tally.received, tally.torn, tally.intact) == (len(bad), len(bad), 0)
    tally.add(*_stream_record(content, 3), t_pop=0)
    assert (tally.intact, tally.torn) == (1, len(bad)) and tally.seen[0] == {3}


def test_stream_pr_slots_round_trip_in_one_process():
    """The re-implemented PR buffer carries records intact when nothing races it, and
    refuses a write when full (one slot stays empty, as in the design)."""
    from shmbridge.bench.stream import Content, PrSlots, Tally

    name = f"shmbridge-bench-stream-test-{os.getpid()}"
    ring = PrSlots(name, 4, create=True)
    try:
        content = Content(0, 512)
        assert [ring.write(content, s) for s in range(4)] == [True, True, True, False]
        tally = Tally(producers=1, tokens=512)
        while (rec := ring.read()) is not None:
            tokens, logprobs, score, iid, meta = rec
            tally.add(np.array(tokens, np.int32), np.array(logprobs, np.float32), score, iid, meta, t_pop=0)
        assert (tally.intact, tally.torn, tally.duplicated) == (3, 0, 0)
        assert ring.write(content, 3)
    finally:
        ring.close()
        ring.shm.unlink()


@pytest.mark.long
def test_stream_quick_checks_every_record(tmp_path):
    out = tmp_path / "results"
    proc = _run("stream", "--quick", "--producers", "1,4", "--out", str(out))
    doc = json.loads((out / "stream.json").read_text())
    cases = doc["cases"]
    assert {(c["tokens"], c["producers"]) for c in cases} == {(512, 1), (512, 4), (4096, 1), (4096, 4)}
    by = {}
    for c in cases:
        by.setdefault(c["contender"], []).append(c)
    assert set(by) == {"shmbridge", "shmbridge-reserve", "pr-slots", "mp-queue", "http-json"}
    for key, rows in by.items():
        for c in rows:
            assert not c["failed"], (key, c["failed"])
            if key == "http-json" and importlib.util.find_spec("aiohttp") is None:
                assert c["skipped"], c
                continue
            assert c["skipped"] is None, c
            # Every record sent was received, intact or not, or counted lost.
            assert c["sent"] == c["intact"] + c["lost"] and c["received"] >= c["intact"] > 0, c
            assert c["median_records_per_s"] > 0 and c["latency_p50_ns"] <= c["latency_p99_ns"], c
            if key != "pr-slots":  # a transport that keeps its records: every one checked intact
                assert c["sent"] == c["records"] == c["intact"] == c["received"], c
                assert c["lost"] == c["torn"] == c["duplicated"] == c["reordered"] == 0, c
    md = (out / "stream.md").read_text()
    assert md.strip() in proc.stdout
    assert "### Records of 512 tokens" in md and "### Records of 4096 tokens" in md
    assert len([r for r in _table_rows(md) if r[0] in ("1", "4")]) == len(cases)


def test_stream_blocking_shmbridge_alone(tmp_path):
    out = tmp_path / "results"
    proc = _run("stream", "--quick", "--tokens", "512", "--producers", "2", "--contenders", "shmbridge",
                "--blocking", "--out", str(out))
    assert "shmbridge blocking (never spins)" in proc.stdout
    (case,) = json.loads((out / "stream.json").read_text())["cases"]
    assert case["contender"] == "shmbridge" and case["intact"] == case["sent"] == case["records"] > 0
    assert case["lost"] == case["torn"] == case["duplicated"] == case["reordered"] == 0
