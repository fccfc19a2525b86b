"""`python -m shmbridge.bench step`: the Python `client.step()` round trip on the `null`
engine (sparse: the engine writes the first and last element of each tensor, so this
measures the transport), for a 64 B observation (16 envs × 1 f32) and for 4096×100 f32
observations with 4096×12 f32 actions; beside them, in the same rounds, the raw Python
floor (two counters on a shared page, both sides spinning: what any Python lock-step
transport pays at least).

Each `step()` is timed on its own with `time.perf_counter_ns`. The cases run in
interleaved rounds (each round: a warm-up, then a block of each, the order rotated), so
drift on the machine hits them alike. Zero copy means the two payloads should cost the
same: the ratio of their medians is the figure to watch. The tail is the other: the
report gives p50/p90/p99/p99.9/max and a histogram of the per-step times of every case,
the p99 of shmbridge over the floor's, and, per case, what the scheduler did to the two
processes meanwhile (time runnable but not running, from ``/proc/PID/schedstat``;
context switches, from ``/proc/PID/status``), which tells a preempted spinner from a
futex sleep.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .common import OBS_64B, OBS_4096X100, Stats
from .report import fmt_rate, fmt_ratio, machine_description, machine_header, markdown_table, publish

#: Upper bounds (ns) of the histogram's buckets; the last bucket takes everything above.
BUCKETS_NS = (250, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 1_000_000)
PERCENTILES = (50, 90, 99, 99.9)


def percentiles(samples: List[int]) -> Dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    out = {f"p{p:g}": float(np.percentile(a, p)) for p in PERCENTILES}
    out["max"] = float(a.max())
    return out


def histogram(samples: List[int]) -> List[int]:
    """Counts of steps per bucket of :data:`BUCKETS_NS` (``<= bound``), then above the last."""
    a = np.asarray(samples, dtype=np.int64)
    edges = np.asarray(BUCKETS_NS, dtype=np.int64)
    idx = np.searchsorted(edges, a, side="left")
    return np.bincount(idx, minlength=len(edges) + 1).tolist()


def bucket_labels() -> List[str]:
    def fmt(ns: int) -> str:
        return f"{ns} ns" if ns < 1000 else (f"{ns // 1000} µs" if ns < 1_000_000 else f"{ns // 1_000_000} ms")

    labels = [f"≤ {fmt(BUCKETS_NS[0])}"]
    labels += [f"{fmt(lo)}–{fmt(hi)}" for lo, hi in zip(BUCKETS_NS, BUCKETS_NS[1:])]
    return labels + [f"> {fmt(BUCKETS_NS[-1])}"]


class Sched:
    """What the scheduler did to one process: nanoseconds runnable but waiting for a CPU
    and context switches (voluntary: it slept, e.g. on the futex; involuntary: it was
    preempted or yielded to another task), summed over the blocks measured."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.runqueue_ns = 0
        self.voluntary = 0
        self.involuntary = 0
        self._at: Optional[Tuple[int, int, int]] = None

    def _read(self) -> Optional[Tuple[int, int, int]]:
        try:
            with open(f"/proc/{self.pid}/schedstat") as f:
                waited = int(f.read().split()[1])
            vol = invol = 0
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol = int(line.split()[1])
            return waited, vol, invol
        except (OSError, ValueError, IndexError):
            return None  # no schedstat here (a kernel without it), or the process is gone

    def begin(self) -> None:
        self._at = self._read()

    def end(self) -> None:
        now = self._read()
        if self._at is not None and now is not None:
            self.runqueue_ns += now[0] - self._at[0]
            self.voluntary += now[1] - self._at[1]
            self.involuntary += now[2] - self._at[2]
        self._at = None


class Case:
    """One row: a client that steps, and the process that answers it. ``begin``/``end``
    bracket its blocks (a busy-polling server polls only between them, so that it never
    takes a core from another case's pair)."""

    def __init__(self, label: str, payload: str, step: Any, server_pid: int, close: Any, check: Any,
                 begin: Any = None, end: Any = None) -> None:
        self.label, self.payload = label, payload
        self.step, self.close, self.check = step, close, check
        self.begin = begin or (lambda: None)
        self.end = end or (lambda: None)
        self.samples: List[int] = []
        self.sched = {"client": Sched(os.getpid()), "server": Sched(server_pid)}
        self.steps = 0

    def run(self, n: int, out: Optional[List[int]]) -> None:
        step = self.step
        if out is None:
            for _ in range(n):
                step()
        else:
            pc = time.perf_counter_ns
            app = out.append
            for s in self.sched.values():
                s.begin()
            for _ in range(n):
                t0 = pc()
                step()
                app(pc() - t0)
            for s in self.sched.values():
                s.end()
        self.steps += n


def _shmbridge_case(wl: Any, blocking: bool) -> Case:
    import shmbridge

    c = shmbridge.launch("null", blocking=blocking, **wl.shmbridge_kwargs())
    label = f"shmbridge ({'blocking' if blocking else 'spin'})"
    case = Case(label, wl.label, c.step, c.engine_pid, c.close, None)

    def check() -> None:
        if c.frame != case.steps:
            raise RuntimeError(f"{c.name}: frame {c.frame}, expected {case.steps}")

    case.check = check
    return case


def _floor_case(wl: Any) -> Case:
    from . import floor_peer

    peer = floor_peer.FloorPeer(wl, touch=False)
    peer.launch()
    peer.start()
    # The server polls during this case's blocks only (begin/end around each).
    return Case("raw seq-counter ping-pong (floor)", wl.label, peer.step_once, peer.server.proc.pid, peer.close,
                peer.check, begin=peer.begin, end=peer.end)


def main(args: Any) -> int:
    quick = args.quick
    steps = args.steps or (5_000 if quick else 200_000)
    rounds = args.rounds or (4 if quick else 20)
    per_block = max(1, math.ceil(steps / rounds))
    warmup = 200 if quick else 2_000
    machine = machine_description()
    cases: List[Case] = []
    try:
        cases.append(_shmbridge_case(OBS_64B, args.blocking))
        cases.append(_shmbridge_case(OBS_4096X100, args.blocking))
        if not args.no_floor:
            cases.append(_floor_case(OBS_64B))
        t_start = time.monotonic()
        for r in range(rounds):
            for k in range(len(cases)):
                case = cases[(r + k) % len(cases)]
                case.begin()
                try:
                    case.run(warmup, None)
                    case.run(per_block, case.samples)
                finally:
                    case.end()
        elapsed = time.monotonic() - t_start
        for c in cases:  # every frame arrived and was the right one
            c.check()
    finally:
        for c in cases:
            c.close()
    load_end = ", ".join(f"{x:.2f}" for x in os.getloadavg())

    stats = [Stats.of(c.samples) for c in cases]
    pcts = [percentiles(c.samples) for c in cases]
    policy = "blocking" if args.blocking else "spin"
    rows = [[c.payload, c.label, f"{s.n:,}", f"{s.median_ns:,.0f}", f"{s.p99_ns:,.0f}", fmt_rate(s.steps_per_s)]
            for c, s in zip(cases, stats)]
    small, big = stats[0], stats[1]
    med_ratio = big.median_ns / small.median_ns
    p99_ratio = big.p99_ns / small.p99_ns
    rows.append(["ratio 4096×100 ÷ 64 B", "", "", fmt_ratio(med_ratio), fmt_ratio(p99_ratio), ""])
    worst = max(s.median_ns for s in stats[:2])

    tail_header = ["case", "payload", *[f"p{p:g} ns" for p in PERCENTILES], "max ns"]
    tail_rows = [[c.label, c.payload, *[f"{p[f'p{q:g}']:,.0f}" for q in PERCENTILES], f"{p['max']:,.0f}"]
                 for c, p in zip(cases, pcts)]
    hists = [histogram(c.samples) for c in cases]
    hist_rows = [[label, *[f"{h[i]:,}" for h in hists]] for i, label in enumerate(bucket_labels())]
    sched_rows = []
    for c in cases:
        for who, s in c.sched.items():
            sched_rows.append([c.label, c.payload, who, f"{s.runqueue_ns / 1e6:,.2f}",
                               f"{s.voluntary:,}", f"{s.involuntary:,}"])

    lines = [
        "## client.step() round trip (null engine, sparse)",
        "",
        f"Command: `{args.command_line}` ({'QUICK, ' if quick else ''}{policy} policy; {rounds} interleaved "
        f"rounds of {per_block:,} timed steps per case after {warmup:,} warm-up steps; {elapsed:.1f} s)",
        "",
        *machine_header(machine, [f"- Load average at the end: {load_end}"]),
        "",
        markdown_table(["payload", "case", "steps", "median ns", "p99 ns", "steps/s"], rows, "llrrrr"),
        "",
        "Targets (reported, not asserted):",
        "",
        f"- median ≤ 1 µs: {'met' if worst <= 1000 else 'NOT met'} (worst shmbridge median {worst:,.0f} ns)",
        f"- the two payloads within 1.2× (medians): {'met' if max(med_ratio, 1 / med_ratio) <= 1.2 else 'NOT met'} "
        f"({fmt_ratio(med_ratio)})",
    ]
    floor = next((s for c, s in zip(cases, stats) if "floor" in c.label), None)
    if floor is not None:
        r = small.p99_ns / floor.p99_ns
        lines.append(f"- p99 of shmbridge (64 B) within 2× the floor's in this run: "
                     f"{'met' if r <= 2 else 'NOT met'} ({fmt_ratio(r)}: {small.p99_ns:,.0f} ns against "
                     f"{floor.p99_ns:,.0f} ns)")
    lines += [
        "",
        "### The tail",
        "",
        markdown_table(tail_header, tail_rows, "llrrrrr"),
        "",
        "Steps per bucket of step time:",
        "",
        markdown_table(["step time", *[f"{c.label}, {c.payload.split(' (')[0]}" for c in cases]], hist_rows,
                       "l" + "r" * len(cases)),
        "",
        "What the scheduler did meanwhile (the timed blocks only; from /proc/PID/schedstat and "
        "/proc/PID/status): ms runnable but waiting for a CPU, and context switches (voluntary: "
        "slept, e.g. on the futex; involuntary: preempted, or yielded to another task).",
        "",
        markdown_table(["case", "payload", "process", "runqueue ms", "voluntary", "involuntary"], sched_rows,
                       "lllrrr"),
    ]
    doc = dict(machine=machine, load_average_end=os.getloadavg(), rounds=rounds, per_block=per_block,
               warmup=warmup, policy=policy, buckets_ns=list(BUCKETS_NS),
               cases=[dict(label=c.label, payload=c.payload, **s.to_dict(), **p, histogram=h,
                           sched={k: dict(runqueue_ns=v.runqueue_ns, voluntary=v.voluntary,
                                          involuntary=v.involuntary) for k, v in c.sched.items()})
                      for c, s, p, h in zip(cases, stats, pcts, hists)])
    publish("step", "\n".join(lines) + "\n", args.out, doc)
    return 0
