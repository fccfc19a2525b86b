"""`python -m shmbridge.bench step`: the Python `client.step()` round trip on the `null`
engine (sparse: the engine writes the first and last element of each tensor, so this
measures the transport), for a 64 B observation (16 envs × 1 f32) and for 4096×100 f32
observations with 4096×12 f32 actions.

Each `step()` is timed on its own with `time.perf_counter_ns`. The two cases run in
interleaved rounds (each round: a warm-up, then a block of each, in alternating order),
so that drift on the machine hits both alike. Zero copy means the two should cost the
same: the ratio of their medians is the figure to watch.
"""

from __future__ import annotations

import math
import time
from typing import Any, List

import shmbridge

from .common import OBS_64B, OBS_4096X100, Stats
from .report import fmt_rate, fmt_ratio, machine_description, machine_header, markdown_table, publish


def main(args: Any) -> int:
    quick = args.quick
    steps = args.steps or (5_000 if quick else 200_000)
    rounds = args.rounds or (4 if quick else 20)
    per_block = max(1, math.ceil(steps / rounds))
    warmup = 200 if quick else 2_000
    cases = [OBS_64B, OBS_4096X100]
    machine = machine_description()
    clients = []
    try:
        for wl in cases:
            kw = wl.shmbridge_kwargs()
            clients.append(shmbridge.launch("null", blocking=args.blocking, **kw))
        samples: List[List[int]] = [[] for _ in cases]
        pc = time.perf_counter_ns
        t_start = time.monotonic()
        for r in range(rounds):
            order = list(range(len(cases)))
            if r % 2:
                order.reverse()
            for i in order:
                step = clients[i].step
                for _ in range(warmup):
                    step()
                out = samples[i]
                app = out.append
                for _ in range(per_block):
                    t0 = pc()
                    step()
                    app(pc() - t0)
        elapsed = time.monotonic() - t_start
        for c in clients:  # every frame arrived and was the right one
            if c.frame != rounds * (warmup + per_block):
                raise RuntimeError(f"{c.name}: frame {c.frame}, expected {rounds * (warmup + per_block)}")
    finally:
        for c in clients:
            c.close()

    stats = [Stats.of(s) for s in samples]
    policy = "blocking" if args.blocking else "spin"
    rows = [[wl.label, f"{s.n:,}", f"{s.median_ns:,.0f}", f"{s.p99_ns:,.0f}", fmt_rate(s.steps_per_s)]
            for wl, s in zip(cases, stats)]
    small, big = stats
    med_ratio = big.median_ns / small.median_ns
    p99_ratio = big.p99_ns / small.p99_ns
    rows.append(["ratio 4096×100 ÷ 64 B", "", fmt_ratio(med_ratio), fmt_ratio(p99_ratio), ""])
    worst = max(s.median_ns for s in stats)
    lines = [
        "## client.step() round trip (null engine, sparse)",
        "",
        f"Command: `{args.command_line}` ({'QUICK, ' if quick else ''}{policy} policy; {rounds} interleaved "
        f"rounds of {per_block:,} timed steps per payload after {warmup:,} warm-up steps; {elapsed:.1f} s)",
        "",
        *machine_header(machine),
        "",
        markdown_table(["payload", "steps", "median ns", "p99 ns", "steps/s"], rows, "lrrrr"),
        "",
        "Targets (reported, not asserted):",
        "",
        f"- median ≤ 1 µs: {'met' if worst <= 1000 else 'NOT met'} (worst median {worst:,.0f} ns)",
        f"- the two payloads within 1.2× (medians): {'met' if max(med_ratio, 1 / med_ratio) <= 1.2 else 'NOT met'} "
        f"({fmt_ratio(med_ratio)})",
    ]
    publish("step", "\n".join(lines) + "\n", args.out)
    return 0
