"""`python -m shmbridge.bench peers`: the same lock-step workload through every transport,
side by side, in one run on one machine.

For each workload, every transport's server is started, then the transports take turns
in rounds: each round gives each transport a block of steps (after a short warm-up),
in an order that rotates from round to round, so that whatever the machine does meanwhile
(other jobs, frequency changes, a VM's vCPUs moving) hits all of them alike. Every round
trip is timed on its own; the table gives the median, the 99th percentile, steps/s
(1e9 / mean) and the median's ratio to shmbridge's (spin policy, same workload).

A block is capped in time (`--block-seconds`): the slow transports (gRPC with large
messages, AsyncVectorEnv) get fewer steps, and the table says how many each one ran.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .common import WORKLOADS, Peer, Stats
from .report import (
    fmt_rate,
    fmt_ratio,
    fmt_time,
    fmt_us,
    log,
    machine_description,
    machine_header,
    markdown_table,
    publish,
    run_mode,
)

# Python module -> the package that provides it.
PACKAGE_OF = {"grpc": "grpcio", "grpc_tools": "grpcio-tools", "iceoryx2": "iceoryx2",
              "gymnasium": "gymnasium"}

TRANSPORT_KEYS = ("shmbridge-spin", "shmbridge-blocking", "grpc-floats", "grpc-bytes",
                  "iceoryx2-rr", "iceoryx2-ps", "shm-pipe", "floor", "gym-async")
# Deprecated keys -> the key they now name (still accepted by --transports, with a warning).
DEPRECATED_KEYS = {"grpc-seeds": "grpc-floats"}


@dataclass
class Plan:
    rounds: int
    block: int  # measured steps per block (upper bound)
    warmup: int  # unmeasured steps before each block (upper bound)
    block_seconds: float  # a block stops growing past this
    min_steps: int  # ... but has at least this many steps
    cartpole_envs: int


QUICK = Plan(rounds=2, block=150, warmup=20, block_seconds=0.25, min_steps=3, cartpole_envs=4)
FULL = Plan(rounds=10, block=1000, warmup=200, block_seconds=2.0, min_steps=10, cartpole_envs=16)


@dataclass
class Row:
    workload: str
    key: str
    label: str
    stats: Optional[Stats] = None
    skipped: Optional[str] = None
    failed: Optional[str] = None
    reference: bool = False


def _missing(needs: Sequence[str]) -> Optional[str]:
    for mod in needs:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):  # a parent package missing, or sys.modules[mod] = None
            found = False
        if not found:
            return f"{PACKAGE_OF.get(mod, mod)} not installed"
    return None


def _make_peers(wl_key: str, plan: Plan, only: Optional[Sequence[str]]) -> List[Tuple[str, str, Sequence[str], Callable[[], Peer]]]:
    """(key, label, needs, factory) for each transport of a workload, in table order."""
    from . import floor_peer, grpc_peer, gym_peer, iceoryx2_peer, pipe_peer, shmbridge_peer

    out: List[Tuple[str, str, Sequence[str], Callable[[], Peer]]] = []
    if wl_key == "cartpole":
        n = plan.cartpole_envs
        S = shmbridge_peer.ShmbridgeCartPole
        out = [
            ("shmbridge-spin", S.label, (), lambda: S(n)),
            ("shmbridge-blocking", S.blocking_label, (), lambda: S(n, blocking=True)),
            ("gym-async", gym_peer.AsyncVectorEnvPeer.label, gym_peer.AsyncVectorEnvPeer.needs,
             lambda: gym_peer.AsyncVectorEnvPeer(n)),
        ]
    else:
        wl = WORKLOADS[wl_key]
        S = shmbridge_peer.ShmbridgePeer
        for key, cls, args in (
            ("shmbridge-spin", S, {}),
            ("shmbridge-blocking", S, {"blocking": True}),
            ("grpc-floats", grpc_peer.GrpcSeeds, {}),
            ("grpc-bytes", grpc_peer.GrpcBytes, {}),
            ("iceoryx2-rr", iceoryx2_peer.Iceoryx2RequestResponse, {}),
            ("iceoryx2-ps", iceoryx2_peer.Iceoryx2PubSub, {}),
            ("shm-pipe", pipe_peer.PipePeer, {}),
            ("floor", floor_peer.FloorPeer, {}),
        ):
            label = cls.blocking_label if args.get("blocking") else cls.label
            out.append((key, label, cls.needs, lambda cls=cls, args=args: cls(wl, **args)))
    if only:
        out = [t for t in out if t[0] in only or t[0] == "shmbridge-spin"]
    return out


def _timed(peer: Peer, n: int, sink: List[int]) -> float:
    """Runs n steps into `sink`; returns the mean seconds per step."""
    before = len(sink)
    t0 = time.perf_counter()
    peer.run(n, sink)
    dt = time.perf_counter() - t0
    return dt / max(1, len(sink) - before)


def run_workload(wl_key: str, label: str, plan: Plan, only: Optional[Sequence[str]],
                 verbose: bool = True) -> List[Row]:
    specs = _make_peers(wl_key, plan, only)
    rows = [Row(wl_key, key, lbl, reference=(key == "shmbridge-spin")) for key, lbl, _n, _f in specs]
    live: List[Tuple[Row, Peer]] = []
    for row, (key, _lbl, needs, factory) in zip(rows, specs):
        why = _missing(needs)
        if why:
            row.skipped = why
            log(f"  {label}: skipping {row.label}: {why}")
            continue
        live.append((row, factory()))

    def fail(row: Row, peer: Peer, what: str) -> None:
        row.failed = what.strip().splitlines()[-1][:200] if what.strip() else "failed"
        log(f"  {label}: {row.label} FAILED:\n{what}")
        try:
            peer.close()
        except Exception:  # noqa: BLE001 - already failing
            pass

    # Launch every server first (they start in parallel), then connect to each.
    started: List[Tuple[Row, Peer]] = []
    for row, peer in live:
        try:
            peer.launch()
        except Exception:  # noqa: BLE001 - reported in the table
            fail(row, peer, traceback.format_exc())
    for row, peer in live:
        if row.failed:
            continue
        try:
            peer.start()
            started.append((row, peer))
        except Exception:  # noqa: BLE001
            fail(row, peer, traceback.format_exc())

    samples: Dict[str, List[int]] = {row.key: [] for row, _ in started}
    est: Dict[str, float] = {}
    scratch: List[int] = []
    try:
        for r in range(plan.rounds):
            active = [(row, p) for row, p in started if not row.failed]
            if not active:
                break
            shift = r % len(active)
            for row, peer in active[shift:] + active[:shift]:
                try:
                    peer.begin()
                    try:
                        scratch.clear()
                        if row.key not in est:
                            est[row.key] = _timed(peer, 2, scratch)
                        warm = plan.warmup * (5 if r == 0 else 1)
                        warm = max(2, min(warm, int(0.2 * plan.block_seconds / max(est[row.key], 1e-9))))
                        est[row.key] = _timed(peer, warm, scratch)
                        n = max(plan.min_steps, min(plan.block, int(plan.block_seconds / max(est[row.key], 1e-9))))
                        peer.run(n, samples[row.key])
                    finally:
                        peer.end()
                    peer.check()
                except Exception:  # noqa: BLE001 - reported in the table
                    fail(row, peer, traceback.format_exc())
            if verbose:
                log(f"  {label}: round {r + 1}/{plan.rounds} done")
    finally:
        for row, peer in started:
            if not row.failed:
                try:
                    peer.close()
                except Exception:  # noqa: BLE001
                    log(f"  {label}: closing {row.label}: {traceback.format_exc()}")
    for row, _ in started:
        if not row.failed and samples[row.key]:
            row.stats = Stats.of(samples[row.key])
    return rows


def _payload_label(wl_key: str, plan: Plan) -> str:
    if wl_key == "cartpole":
        return f"CartPole-v1, {plan.cartpole_envs} envs"
    return WORKLOADS[wl_key].label


def table(results: List[Tuple[str, List[Row]]], plan: Plan) -> str:
    body = []
    for wl_key, rows in results:
        ref = next((r.stats for r in rows if r.reference and r.stats), None)
        payload = _payload_label(wl_key, plan)
        for row in rows:
            if row.stats is None:
                note = f"skipped: {row.skipped}" if row.skipped else f"failed: {row.failed or 'no samples'}"
                body.append([payload, row.label, note, "", "", "", ""])
                continue
            s = row.stats
            ratio = fmt_ratio(s.median_ns / ref.median_ns) if ref else "n/a"
            body.append([payload, row.label, f"{s.n:,}", fmt_us(s.median_ns), fmt_us(s.p99_ns),
                         fmt_rate(s.steps_per_s), ratio])
    return markdown_table(["payload", "transport", "steps", "median µs", "p99 µs", "steps/s",
                           "median ÷ shmbridge"], body, "llrrrrr")


def _median(results: List[Tuple[str, List[Row]]], wl_key: str, key: str) -> Optional[float]:
    for w, rows in results:
        if w == wl_key:
            for row in rows:
                if row.key == key and row.stats:
                    return row.stats.median_ns
    return None


def targets(results: List[Tuple[str, List[Row]]]) -> str:
    lines = []

    def ratio_line(what: str, wl_key: str, other: str, goal: float) -> None:
        shm, peer = _median(results, wl_key, "shmbridge-spin"), _median(results, wl_key, other)
        if shm is None or peer is None:
            lines.append(f"- {what}: not measured in this run")
            return
        r = peer / shm
        lines.append(f"- {what}: {fmt_ratio(r)} faster (target ≥ {goal:g}×): {'met' if r >= goal else 'NOT met'}")

    ratio_line("shmbridge vs iceoryx2 request/response, 4096×100", "4096x100", "iceoryx2-rr", 5)
    ratio_line("shmbridge vs gRPC with a repeated-float proto, 4096×100", "4096x100", "grpc-floats", 500)
    for wl_key, _rows in results:
        if wl_key == "cartpole":
            continue
        shm, floor = _median(results, wl_key, "shmbridge-spin"), _median(results, wl_key, "floor")
        if shm is None or floor is None:
            continue
        r = shm / floor
        lines.append(f"- shmbridge ÷ raw Python floor, {WORKLOADS[wl_key].label}: {fmt_ratio(r)} "
                     f"(target ≤ 2×): {'met' if r <= 2 else 'NOT met'}")
    return "\n".join(lines)


def plot(results: List[Tuple[str, List[Row]]], plan: Plan, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(wl, [r for r in rows if r.stats]) for wl, rows in results]
    groups = [(wl, rows) for wl, rows in groups if rows]
    if not groups:
        return
    heights = [max(1, len(rows)) for _, rows in groups]
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 1.2 + 0.42 * sum(heights) + 0.6 * len(groups)),
                             gridspec_kw={"height_ratios": heights}, sharex=True, squeeze=False)
    keys = list(TRANSPORT_KEYS)
    cmap = plt.get_cmap("tab10")
    for ax, (wl, rows) in zip(axes[:, 0], groups):
        y = list(range(len(rows)))[::-1]
        med = [r.stats.median_ns / 1e3 for r in rows]
        p99 = [r.stats.p99_ns / 1e3 for r in rows]
        colors = [cmap(keys.index(r.key) % 10 if r.key in keys else 9) for r in rows]
        ax.barh(y, med, color=colors, height=0.7, label="median")
        ax.scatter(p99, y, marker="|", s=300, color="black", zorder=3, label="p99")
        for yi, m, p in zip(y, med, p99):
            ax.annotate(fmt_time(m * 1e3), (max(m, p), yi), xytext=(8, 0), textcoords="offset points",
                        va="center", fontsize=8, color="black")
        ax.set_yticks(y)
        ax.set_yticklabels([r.label for r in rows], fontsize=8)
        ax.set_xscale("log")
        ax.set_title(_payload_label(wl, plan), fontsize=10, loc="left")
        ax.grid(axis="x", which="both", alpha=0.3)
    lo = min(r.stats.median_ns for _, rows in groups for r in rows) / 1e3
    hi = max(r.stats.p99_ns for _, rows in groups for r in rows) / 1e3
    axes[0, 0].set_xlim(lo / 2, hi * 12)  # room for the labels right of the p99 ticks
    axes[0, 0].legend(loc="lower right", fontsize=8)
    axes[-1, 0].set_xlabel("round-trip latency per step, µs (log scale; bar: median, tick: p99)")
    fig.suptitle("Lock-step round trip by transport and payload", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: Any) -> int:
    plan = replace(QUICK if args.quick else FULL)  # a copy: the options change it
    if args.rounds:
        plan.rounds = args.rounds
    if args.steps:
        plan.block = max(1, math.ceil(args.steps / plan.rounds))
    if args.block_seconds:
        plan.block_seconds = args.block_seconds
    if args.cartpole_envs:
        plan.cartpole_envs = args.cartpole_envs
    wl_keys = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in wl_keys:
        if w not in WORKLOADS and w != "cartpole":
            raise SystemExit(f"unknown workload {w!r}: choose from {', '.join(list(WORKLOADS) + ['cartpole'])}")
    only = [t.strip() for t in args.transports.split(",")] if args.transports else None
    if only:
        for i, t in enumerate(only):
            if t in DEPRECATED_KEYS:
                log(f"warning: transport key {t!r} is deprecated: use {DEPRECATED_KEYS[t]!r}")
                only[i] = t = DEPRECATED_KEYS[t]
            if t not in TRANSPORT_KEYS:
                raise SystemExit(f"unknown transport {t!r}: choose from {', '.join(TRANSPORT_KEYS)}")

    machine = machine_description()
    t_start = time.monotonic()
    results: List[Tuple[str, List[Row]]] = []
    for w in wl_keys:
        label = _payload_label(w, plan)
        log(f"peers: {label}")
        results.append((w, run_workload(w, label, plan, only)))
    elapsed = time.monotonic() - t_start
    try:
        load_end = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load_end = []

    command = args.command_line
    lines = [
        "## Peers: lock-step round trip by transport",
        "",
        f"Command: `{command}` ({run_mode(args.quick)}; {plan.rounds} interleaved rounds, blocks of up to "
        f"{plan.block:,} steps or {plan.block_seconds:g} s after a warm-up; {elapsed:.0f} s in all)",
        "",
        *machine_header(machine, [f"- Load average at the end: {', '.join(str(x) for x in load_end)}"]),
        "",
        table(results, plan),
        "",
        "Median ÷ shmbridge: the transport's median over shmbridge's (spin policy, same payload); "
        "for CartPole, over the shmbridge `cartpole` engine's. steps/s = 1e9 / mean round trip "
        f"(for CartPole, steps of the whole vector: × {plan.cartpole_envs} for env steps). "
        "Every server writes the first and last element of each tensor (gRPC: builds the whole "
        "message); the client touches the first and last element of each tensor it receives. "
        "gRPC, founding proto: `repeated float` actions and observations as in the founding API's "
        "`AgentService.Step` (images: one `CameraFrame` with a `bytes` payload per env); "
        "gRPC, bytes fields: each tensor as one `bytes` field.",
        "",
        "Targets (ratios from this run):",
        "",
        targets(results),
    ]
    figures = dict(command=command, quick=bool(args.quick), plan=plan.__dict__,
                   machine=machine, load_end=load_end, elapsed_s=elapsed,
                   results=[dict(workload=w, rows=[dict(key=r.key, label=r.label,
                                                        skipped=r.skipped, failed=r.failed,
                                                        stats=r.stats.to_dict() if r.stats else None)
                                                   for r in rows]) for w, rows in results])
    publish("peers", "\n".join(lines) + "\n", args.out, figures,
            plot=lambda path: plot(results, plan, path))
    failed = [r for _, rows in results for r in rows if r.failed]
    return 1 if failed else 0
