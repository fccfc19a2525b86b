"""The benchmark harness (python -m shmbridge.bench) runs end to end in its smoke mode.

No timing is asserted: the point is that the harness cannot rot. A transport is allowed
to be missing from a run only when its Python package is not installed, and the table
says so."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

TIMEOUT = 600

# Transport keys -> the modules they need (mirrors shmbridge.bench.peers).
NEEDS = {
    "grpc-seeds": ("grpc", "grpc_tools"),
    "grpc-bytes": ("grpc", "grpc_tools"),
    "iceoryx2-rr": ("iceoryx2",),
    "iceoryx2-ps": ("iceoryx2",),
    "gym-async": ("gymnasium",),
}
PER_WORKLOAD = ("shmbridge-spin", "shmbridge-blocking", "grpc-seeds", "grpc-bytes",
                "iceoryx2-rr", "iceoryx2-ps", "shm-pipe", "floor")
CARTPOLE = ("shmbridge-spin", "shmbridge-blocking", "gym-async")


def _missing(key: str) -> list:
    return [m for m in NEEDS.get(key, ()) if importlib.util.find_spec(m) is None]


def _run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "shmbridge.bench", *args], capture_output=True,
                          text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc


def _table_rows(text: str) -> list:
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| payload"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_step_quick():
    out = _run("step", "--quick").stdout
    rows = _table_rows(out)
    payloads = [r[0] for r in rows]
    assert any(p.startswith("obs 64 B") for p in payloads), out
    assert any(p.startswith("obs 4096×100") for p in payloads), out
    assert any(p.startswith("ratio") for p in payloads), out
    for r in rows[:2]:
        assert int(r[1].replace(",", "")) > 0 and float(r[2].replace(",", "")) > 0, r


def test_peers_quick(tmp_path):
    out_dir = tmp_path / "results"
    proc = _run("peers", "--quick", "--out", str(out_dir))

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
