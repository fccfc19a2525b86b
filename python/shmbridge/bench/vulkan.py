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

With `--c-engine PATH` (an engine built from `examples/c/vulkan_engine.c`, which renders
CartPole frames with its own Vulkan device: `scripts/bench-c.sh vulkan` builds it and runs
this) it measures that engine's two ways of serving its frames instead, the question an
engine with a renderer of its own asks:

- `c-export`: the engine hands the memory its renderer drew into to shmbridge
  (`--frames export`, `shmb_spec_add_vulkan_export`); the client imports and maps it;
- `c-host-shm`: the same engine copies each drawn frame into the region's shared memory
  (`--frames host`), the copy the export removes.

The engine's step is the same either way (CartPole physics, the draw, a wait for the
device); their frames are checked after each block against :func:`cartpole_frames`, the
drawing of the observations the client holds.

Without a Vulkan driver it prints `bench vulkan: skipped: <reason>` on stderr and exits
with status 3, having written nothing.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

import shmbridge

from .common import Stats, pattern
from .report import (
    frame_size,
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
C_PATHS: Tuple[Tuple[str, str], ...] = (
    ("c-export", "C engine: its renderer's own memory, exported (mapped by the client's Vulkan device)"),
    ("c-host-shm", "C engine: the same frames copied into host shared memory"),
)
# The path each half's ratios divide by.
REFERENCE = {"cpu": "vulkan-export", "gpu": "vulkan-cuda", "c": "c-export"}


@dataclass
class Plan:
    rounds: int
    per_block: int
    warmup: int
    num_envs: int
    height: int
    width: int
    c_engine: Optional[str] = None

    @property
    def image(self) -> str:
        return f"{self.height}x{self.width}x4"

    @property
    def label(self) -> str:
        return f"{self.num_envs}×{self.height}×{self.width}×4 u8"


def cartpole_frames(obs: np.ndarray, height: int, width: int) -> np.ndarray:
    """The frames `examples/c/vulkan_frames.comp` draws for CartPole observations ``obs``
    (f32 ``[N, 4]``), byte for byte: u8 ``[N, height, width, 4]``. The host computes two
    integers per env from the observation in float64 (`vf_draw`: the cart's centre column
    and the pole tip's offset, floored and clamped), the shader draws with integer
    arithmetic only; so the same steps here give the same bytes."""
    obs = np.asarray(obs, dtype=np.float32)
    n, h, w = obs.shape[0], height, width

    def clamp_floor(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
        f = np.floor(v)
        return np.clip(np.where(np.isnan(f), 0.0, f), lo, hi).astype(np.int64)

    pole_length = max(h * 2 // 5, 4)
    cx = w // 2 + clamp_floor(obs[:, 0].astype(np.float64) * (w / 4.8), -w, w)
    dx = clamp_floor(obs[:, 2].astype(np.float64) * float(pole_length), -2 * pole_length, 2 * pole_length)
    ground = h * 3 // 4
    pivot = ground - max(h // 10, 3)
    ys, xs = np.arange(h)[None, :, None], np.arange(w)[None, None, :]
    cx, dx = cx[:, None, None], dx[:, None, None]
    frames = np.empty((n, h, w, 4), dtype=np.uint8)
    frames[:] = (255, 255, 255, 255)  # sky
    frames[:, ground] = (0, 0, 0, 255)  # track
    above = pivot - ys
    centre = cx + (dx * above) // pole_length  # floor division, as the shader's floor_div
    pole = (above >= 1) & (above <= pole_length) & (np.abs(xs - centre) <= max(w // 64, 1))
    frames[pole] = (204, 153, 102, 255)
    cart = (ys >= pivot) & (ys < ground) & (np.abs(xs - cx) <= max(w // 16, 2))
    frames[cart] = (60, 60, 200, 255)
    return frames


def frame_bytes(seq: int, n: int) -> np.ndarray:
    """The `null` engine's `rgb` bytes of frame `seq` (src/envs/null.rs `pattern_u8`: the
    pattern's low byte)."""
    return (pattern(seq, np.arange(n, dtype=np.uint64)) & np.uint64(0xFF)).astype(np.uint8)


class Case:
    """One path: a client, a persistent view of its `rgb`, and what a step does."""

    def __init__(self, key: str, half: str, client: "shmbridge.Client", device: Any):
        import torch

        self.key, self.half, self.client = key, half, client
        self.tensor = client["frames" if half == "c" else "rgb"]
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
        if self.half == "c":
            got = self.dev.cpu().numpy()
            want = cartpole_frames(np.asarray(self.client.obs), got.shape[1], got.shape[2])
            got, want = got.ravel(), want.ravel()
        else:
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
        if plan.c_engine:
            for key, frames in (("c-export", "export"), ("c-host-shm", "host")):
                command = [plan.c_engine, "--frames", frames, "--num-envs", str(plan.num_envs),
                           "--size", f"{plan.height}x{plan.width}"]
                c = shmbridge.launch(command=command, blocking=blocking, importer="vulkan")
                clients.append(c)
                cases.append(Case(key, "c", c, None))
            return _rounds(plan, cases, log), "--c-engine measures the C engine's two paths"
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
        return _rounds(plan, cases, log), gpu_skip
    finally:
        for case in cases:
            case.release()
        for c in clients:
            c.close()


def _rounds(plan: Plan, cases: List[Case], log: Callable[[str], None]) -> List[Case]:
    """Times ``cases`` in interleaved rounds (the order rotating), checking each after its
    block."""
    for c in cases:
        log(f"  {c.key}: view data_ptr {c.view_ptr:#x}, tensor data_ptr "
            f"{c.tensor_ptr:#x} ({'equal' if c.zero_copy else 'NOT equal'}), on {c.view_device}")
    for rnd in range(plan.rounds):
        shift = rnd % len(cases)
        for case in cases[shift:] + cases[:shift]:
            warm: List[int] = []
            case.run(plan.warmup * (5 if rnd == 0 else 1), warm)
            case.run(plan.per_block, case.samples)
            case.check()
        log(f"  round {rnd + 1}/{plan.rounds} done")
    return cases


def report(cases: List[Case], gpu_skip: str, plan: Plan, header: List[str], quick: bool,
           elapsed: float, command: str) -> Tuple[str, Dict[str, Any]]:
    """The markdown text and the JSON document of a run."""
    stats = {c.key: Stats.of(c.samples) for c in cases if c.samples}
    labels = dict(CPU_PATHS + GPU_PATHS + C_PATHS)
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
    c_run = bool(plan.c_engine)
    tensor = "frames" if c_run else "rgb"
    zero = [f"- {c.key}: `torch.from_dlpack(client['{tensor}']).data_ptr()` {c.view_ptr:#x} "
            f"{'==' if c.zero_copy else '!='} `client['{tensor}'].data_ptr` {c.tensor_ptr:#x}, on "
            f"{c.view_device}" for c in cases]
    failures = [f for c in cases for f in c.failures]
    if c_run:
        title = "## Vulkan: a C engine's own render target exported against copied into host shared memory"
        step_text = (f"A step: `client.step()`: the engine (`{plan.c_engine}`) steps CartPole, draws every "
                     "env's frame with its compute shader on its own Vulkan device and waits for it, then "
                     "publishes it as the memory it drew into (c-export) or after copying it into shared "
                     "memory (c-host-shm); one consumer op reads the frame through a persistent torch view. "
                     "Ratios divide by c-export. steps/s = 1e9 / mean.")
    else:
        title = "## Vulkan: exported frames against host shared memory"
        step_text = ("A step: `client.step()` (the engine writes every byte of the frame, into its Vulkan "
                     "export or into shared memory), one consumer op reading the frame through a persistent "
                     "torch view (GPU: after `.cuda()` for host-shm-cuda, then a stream synchronisation). "
                     "Ratios divide by the export path of the same half (CPU: vulkan-export; GPU: "
                     "vulkan-cuda). steps/s = 1e9 / mean.")
    lines = [
        title,
        "",
        f"Command: `{command}` ({run_mode(quick)}; frames {plan.label}; {plan.rounds} interleaved rounds of "
        f"{plan.per_block:,} timed steps per path after {plan.warmup:,} warm-up steps; {elapsed:.1f} s)",
        "",
        *header,
        "",
        table,
        "",
        step_text,
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
    size = frame_size("vulkan", args.size, args.num_envs)
    if size is None:
        return 2
    h, w = size
    plan = Plan(rounds=rounds, per_block=max(1, math.ceil(steps / rounds)),
                warmup=args.warmup if args.warmup is not None else (5 if quick else 50),
                num_envs=args.num_envs, height=h, width=w, c_engine=args.c_engine)

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
    end = f"- Load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    text, doc = report(cases, gpu_skip, plan, machine_header(machine, [end]), quick, elapsed, args.command_line)
    doc["machine"] = machine
    publish("vulkan", text, args.out, doc)
    return 1 if any(not c.zero_copy or c.failures for c in cases) else 0
