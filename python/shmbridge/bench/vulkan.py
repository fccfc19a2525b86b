"""`python -m shmbridge.bench vulkan`: the per-step round trip of rendered frames
(64×84×84×4 u8 by default) exported as Vulkan memory, against the same frames written
into host shared memory, in one run.

The `null` engine writes every byte of `rgb` each step (not sparse: the frame is really
written, into whichever memory it lives in). Paths:

- `vulkan-export`: `rgb` lives in Vulkan memory the engine allocated and exported
  (`image_device="vulkan"`); the client imports it into a Vulkan device of its own and
  maps it (`importer="vulkan"`, kDLCPU). A persistent `torch.from_dlpack` view, created
  once; that it is the imported memory is shown by pointer equality.
- `host-shm`: `rgb` in the region's shared memory, the same persistent view.

On a machine where the CUDA importer works (torch with CUDA, a CUDA device with the
engine's Vulkan device UUID), the GPU half adds:

- `vulkan-cuda`: the same export imported into CUDA (`importer="cuda"`, kDLCUDA): a
  persistent view on the GPU, no copy;
- `host-shm-cuda`: the frame in host shared memory (the readback a renderer without
  export does), then `.cuda()` (a pageable copy).

A step is `client.step()`, then one consumer op reading the frame's last element
(`acc += view[-1]` on the view's device) and, on the GPU, a synchronisation of torch's
current stream. Each step is timed on its own with `time.perf_counter_ns`. The paths run
in interleaved rounds (each round a warm-up and a block of each, the order rotating).
After each block the whole frame the client holds is compared with the engine's pattern
for its `frame` (the data is the new frame, not a stale one).

Without a Vulkan driver it prints `bench vulkan: skipped: <reason>` on stderr and exits
with status 3, having written nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

import shmbridge

from .common import Stats, pattern
from .report import (
    fmt_rate,
    fmt_ratio,
    fmt_us,
    log,
    machine_description,
    machine_header,
    markdown_table,
    publish,
    run_mode,
    skip,
)

CPU_PATHS: Tuple[Tuple[str, str], ...] = (
    ("vulkan-export", "Vulkan export, mapped by the client's Vulkan device (kDLCPU)"),
    ("host-shm", "host shared memory"),
)
GPU_PATHS: Tuple[Tuple[str, str], ...] = (
    ("vulkan-cuda", "Vulkan export imported into CUDA (kDLCUDA)"),
    ("host-shm-cuda", "host shared memory → .cuda()"),
)
# The path each half's ratios divide by.
REFERENCE = {"cpu": "vulkan-export", "gpu": "vulkan-cuda"}


@dataclass
class Plan:
    rounds: int
    per_block: int
    warmup: int
    num_envs: int
    height: int
    width: int

    @property
    def image(self) -> str:
        return f"{self.height}x{self.width}x4"

    @property
    def label(self) -> str:
        return f"{self.num_envs}×{self.height}×{self.width}×4 u8"


def frame_bytes(seq: int, n: int) -> np.ndarray:
    """The `null` engine's `rgb` bytes of frame `seq` (src/envs/null.rs `pattern_u8`: the
    pattern's low byte)."""
    return (pattern(seq, np.arange(n, dtype=np.uint64)) & np.uint64(0xFF)).astype(np.uint8)


class Case:
    """One path: a client, a persistent view of its `rgb`, and what a step does."""

    def __init__(self, key: str, half: str, client: "shmbridge.Client", device: Any):
        import torch

        self.key, self.half, self.client = key, half, client
        self.tensor = client["rgb"]
        self.view = torch.from_dlpack(self.tensor)  # once: the engine's memory or the region
        self.view_ptr = self.view.data_ptr()
        self.tensor_ptr = self.tensor.data_ptr
        self.view_device = str(self.view.device)
        self.device = device
        self.dev = self.view
        self.acc = torch.zeros((), dtype=torch.int64, device=device if half == "gpu" else "cpu")
        self.sync: Callable[[], None] = (
            torch.cuda.current_stream(device).synchronize if half == "gpu" else (lambda: None)
        )
        self.samples: List[int] = []
        self.failures: List[str] = []

    @property
    def zero_copy(self) -> bool:
        return self.view_ptr == self.tensor_ptr != 0

    def run(self, n: int, out: List[int]) -> None:
        step, sync, pc, app = self.client.step, self.sync, time.perf_counter_ns, out.append
        add = self.acc.add_
        if self.key == "host-shm-cuda":
            view, device = self.view, self.device
            for _ in range(n):
                t0 = pc()
                step()
                dev = view.to(device)  # .cuda() from pageable memory
                add(dev.view(-1)[-1])
                sync()
                app(pc() - t0)
            self.dev = dev
            return
        flat = self.view.view(-1)
        for _ in range(n):
            t0 = pc()
            step()
            add(flat[-1])
            sync()
            app(pc() - t0)

    def check(self) -> None:
        seq = self.client.frame
        got = self.dev.cpu().numpy().ravel()
        want = frame_bytes(seq, got.size)
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            self.failures.append(
                f"{self.key}: frame {seq}: byte {bad} reads {got[bad]}, the engine wrote {want[bad]}"
            )

    def release(self) -> None:
        self.view = self.dev = None


def _launch(plan: Plan, blocking: bool, **kw: Any) -> "shmbridge.Client":
    return shmbridge.launch("null", num_envs=plan.num_envs, obs_dim=1, act_dim=1,
                            image=plan.image, blocking=blocking, **kw)


def measure(plan: Plan, blocking: bool = False,
            log: Callable[[str], None] = lambda s: None) -> Tuple[List[Case], str]:
    """Runs every path; returns the cases and why the GPU half did not run ('' if it
    did). Raises `EngineStartError` if the engine cannot export Vulkan memory."""
    import torch

    clients: List[shmbridge.Client] = []
    cases: List[Case] = []
    gpu_skip = ""
    try:
        vk = _launch(plan, blocking, image_device="vulkan", importer="vulkan")
        clients.append(vk)
        cases.append(Case("vulkan-export", "cpu", vk, None))
        log(f"  importer: {vk.importer}")
        host = _launch(plan, blocking)
        clients.append(host)
        cases.append(Case("host-shm", "cpu", host, None))
        if not torch.cuda.is_available():
            gpu_skip = "torch sees no usable CUDA device"
        else:
            device = torch.device("cuda", torch.cuda.current_device())
            try:
                vc = _launch(plan, blocking, image_device="vulkan", importer="cuda")
            except (shmbridge.CudaUnavailableError, shmbridge.CudaError) as e:
                gpu_skip = f"the CUDA importer is unavailable: {e}"
            else:
                clients.append(vc)
                log(f"  importer: {vc.importer}")
                cases.append(Case("vulkan-cuda", "gpu", vc, device))
                hc = _launch(plan, blocking)
                clients.append(hc)
                cases.append(Case("host-shm-cuda", "gpu", hc, device))
        for c in cases:
            log(f"  {c.key}: view data_ptr {c.view_ptr:#x}, client['rgb'].data_ptr "
                f"{c.tensor_ptr:#x} ({'equal' if c.zero_copy else 'NOT equal'}), on {c.view_device}")
        for rnd in range(plan.rounds):
            shift = rnd % len(cases)
            for case in cases[shift:] + cases[:shift]:
                warm: List[int] = []
                case.run(plan.warmup * (5 if rnd == 0 else 1), warm)
                case.run(plan.per_block, case.samples)
                case.check()
            log(f"  round {rnd + 1}/{plan.rounds} done")
    finally:
        for case in cases:
            case.release()
        for c in clients:
            c.close()
    return cases, gpu_skip


def report(cases: List[Case], gpu_skip: str, plan: Plan, header: List[str], quick: bool,
           elapsed: float, command: str) -> Tuple[str, Dict[str, Any]]:
    """The markdown text and the JSON document of a run."""
    stats = {c.key: Stats.of(c.samples) for c in cases if c.samples}
    labels = dict(CPU_PATHS + GPU_PATHS)
    rows, ratios = [], {}
    for c in cases:
        s, ref = stats.get(c.key), stats.get(REFERENCE[c.half])
        if s is None:
            rows.append([labels[c.key], "no samples", "", "", "", "", ""])
            continue
        rm, rp = (s.median_ns / ref.median_ns, s.p99_ns / ref.p99_ns) if ref else (math.nan, math.nan)
        ratios[c.key] = dict(median=rm, p99=rp)
        rows.append([labels[c.key], f"{s.n:,}", fmt_us(s.median_ns), fmt_us(s.p99_ns),
                     fmt_rate(s.steps_per_s), fmt_ratio(rm), fmt_ratio(rp)])
    table = markdown_table(["path", "steps", "median µs", "p99 µs", "steps/s", "median ÷ export",
                            "p99 ÷ export"], rows, "lrrrrrr")
    zero = [f"- {c.key}: `torch.from_dlpack(client['rgb']).data_ptr()` {c.view_ptr:#x} "
            f"{'==' if c.zero_copy else '!='} `client['rgb'].data_ptr` {c.tensor_ptr:#x}, on "
            f"{c.view_device}" for c in cases]
    failures = [f for c in cases for f in c.failures]
    lines = [
        "## Vulkan: exported frames against host shared memory",
        "",
        f"Command: `{command}` ({run_mode(quick)}; frames {plan.label}; {plan.rounds} interleaved rounds of "
        f"{plan.per_block:,} timed steps per path after {plan.warmup:,} warm-up steps; {elapsed:.1f} s)",
        "",
        *header,
        "",
        table,
        "",
        "A step: `client.step()` (the engine writes every byte of the frame, into its Vulkan "
        "export or into shared memory), one consumer op reading the frame through a persistent "
        "torch view (GPU: after `.cuda()` for host-shm-cuda, then a stream synchronisation). "
        "Ratios divide by the export path of the same half (CPU: vulkan-export; GPU: "
        "vulkan-cuda). steps/s = 1e9 / mean.",
        "",
        "Zero copy (pointer equality of the view and the tensor):",
        "",
        *zero,
        "",
        f"GPU half: {'measured' if not gpu_skip else 'not run: ' + gpu_skip}",
    ]
    if failures:
        lines += ["", "**Checks failed:**", "", *[f"- {f}" for f in failures]]
    text = "\n".join(lines) + "\n"
    doc = dict(
        command=command, quick=quick, plan=plan.__dict__, elapsed_s=elapsed, gpu_skip=gpu_skip,
        paths={c.key: dict(stats=stats[c.key].to_dict() if c.key in stats else None,
                           ratio=ratios.get(c.key), view_device=c.view_device,
                           zero_copy=c.zero_copy, failures=c.failures) for c in cases},
    )
    return text, doc


def main(args: Any) -> int:
    quick = args.quick
    rounds = args.rounds or (2 if quick else 10)
    steps = args.steps or (100 if quick else 5_000)
    try:
        h, w = (int(v) for v in args.size.lower().split("x"))
        if h <= 0 or w <= 0 or args.num_envs <= 0:
            raise ValueError
    except ValueError:
        log(f"bench vulkan: --size {args.size} --num-envs {args.num_envs}: expected HxW and "
            "positive integers")
        return 2
    plan = Plan(rounds=rounds, per_block=max(1, math.ceil(steps / rounds)),
                warmup=args.warmup if args.warmup is not None else (5 if quick else 50),
                num_envs=args.num_envs, height=h, width=w)

    log(f"vulkan: frames {plan.label}")
    machine = machine_description()
    t0 = time.monotonic()
    try:
        cases, gpu_skip = measure(plan, blocking=args.blocking, log=log)
    except shmbridge.EngineStartError as e:
        if "Vulkan is unavailable" in str(e):
            return skip("vulkan", " ".join(str(e).split()))
        raise
    elapsed = time.monotonic() - t0
    text, doc = report(cases, gpu_skip, plan, machine_header(machine), quick, elapsed, args.command_line)
    doc["machine"] = machine
    publish("vulkan", text, args.out, doc)
    return 1 if any(not c.zero_copy or c.failures for c in cases) else 0
