"""`python -m shmbridge.bench gpu`: what a torch CUDA consumer pays per step to get the new
frame onto the GPU, CUDA IPC against staging through host memory.

Two payloads (obs 4096×100 f32, images 64×84×84×3 u8) on the `null` engine (sparse: it
writes the first and last element of each tensor, so its own work is O(1) either way),
three paths each:

- `cuda-ipc`: the engine's tensors live on the GPU (`launch(..., device="cuda:N")`); a
  persistent `torch.from_dlpack` view of them, created once. A step is `client.step()`
  (the current stream then waits on the engine's event), the consumer op and a
  synchronisation of the current stream. That the view is the engine's memory is shown by
  pointer equality (`view.data_ptr() == tensor.data_ptr`), checked once per payload.
- `host-pageable`: the engine's tensors in shared memory (`device="cpu"`); a step is
  `client.step()`, `view.to(device)` (`.cuda()`: a copy from pageable memory, staged by
  the driver), the consumer op and the synchronisation.
- `host-pinned`: the same engine; a step is `client.step()`, a host memcpy of the frame
  into a preallocated pinned buffer, `copy_(pinned, non_blocking=True)` into a
  preallocated device tensor (the DMA), the consumer op and the synchronisation. Both
  copies are timed: a pinned buffer cannot be filled by the engine, so this is what the
  pinned path costs.

The consumer op is the same in every path: the last element of the frame's device tensor
added into a device accumulator on the current stream. Every step is timed on its own
with `time.perf_counter_ns`, ending once the current stream has finished, so each
time covers the frame being usable on the GPU. The six cases run in interleaved rounds
(each round a warm-up and a block of each, the order rotating) and after each block the
first and last element of the device tensor are checked against the engine's pattern
for the client's frame (the data was the new frame, not a stale one).

Without a usable GPU (torch without CUDA, `shmbridge.cuda_available()` false, or the
engine refusing CUDA), it prints `bench gpu: skipped: <reason>` on stderr and exits with
status 3 (SKIPPED), having written nothing and leaving no region behind.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import shmbridge

from .common import IMAGES, OBS_4096X100, Stats, Workload
from .report import (
    fmt_rate,
    fmt_ratio,
    fmt_us,
    log,
    machine_description,
    machine_header,
    markdown_table,
    one_line,
    publish,
    run_mode,
)
from .report import skip as _skip

PAYLOADS: Tuple[Workload, ...] = (OBS_4096X100, IMAGES)
PATHS: Tuple[Tuple[str, str], ...] = (
    ("cuda-ipc", "CUDA IPC: engine on the GPU, persistent view"),
    ("host-pageable", "host shm → .cuda() (pageable H2D)"),
    ("host-pinned", "host shm → pinned (memcpy) → device (DMA)"),
)
REFERENCE = "cuda-ipc"
# The target: the pageable host-staged path at least this many times slower than
# CUDA IPC (medians) at 4096×100 f32.
TARGET_RATIO = 10.0


@dataclass
class Plan:
    rounds: int
    per_block: int  # timed steps per case and round
    warmup: int  # untimed steps before each block (5x in the first round)


@dataclass
class PayloadResult:
    workload: Workload
    tensor: str  # the tensor the consumer reads: obs or rgb
    engine_device: str  # client.device of the CUDA-IPC engine
    view_ptr: int = 0
    tensor_ptr: int = 0
    view_device: str = ""
    samples: Dict[str, List[int]] = field(default_factory=dict)
    failures: List[str] = field(default_factory=list)

    @property
    def zero_copy(self) -> bool:
        return self.view_ptr == self.tensor_ptr != 0 and self.view_device == self.engine_device

    def stats(self) -> Dict[str, Stats]:
        return {k: Stats.of(v) for k, v in self.samples.items() if v}


def probe() -> Optional[str]:
    """Why this machine cannot run the benchmark, or None if it can."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not installed ({e}); pip install torch (a CUDA build)"
    with warnings.catch_warnings():  # torch warns when a driver is there but unusable
        warnings.simplefilter("ignore")
        usable = torch.cuda.is_available()
    if not usable:
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        return f"torch {torch.__version__} ({built}) sees no usable CUDA device"
    ok, reason = shmbridge.cuda_status()
    if not ok:
        return f"shmbridge cannot use CUDA: {one_line(reason)}"
    return None


def skip(reason: str) -> int:
    """``bench gpu: skipped: <reason>`` on stderr; returns :data:`.report.SKIPPED`."""
    return _skip("gpu", reason)


class _Case:
    """One payload through one path: `run(n, out)` times n steps, `check()` compares the
    first and last element of the device tensor with the engine's pattern."""

    def __init__(self, res: PayloadResult, path: str, client: "shmbridge.Client",
                 device: Any, acc: Any, pin: bool):
        import torch

        self.res, self.path, self.client = res, path, client
        wl, name = res.workload, res.tensor
        shm = client[name]
        view = torch.from_dlpack(shm)  # created once, a view of the engine's memory
        self.sync: Callable[[], None] = (torch.cuda.current_stream(device).synchronize
                                         if device.type == "cuda" else (lambda: None))
        self.acc = acc
        if path == "cuda-ipc":
            res.view_ptr, res.tensor_ptr, res.view_device = view.data_ptr(), shm.data_ptr, str(view.device)
            self.dev = view
        elif path == "host-pageable":
            self.host = view
            self.dev = view.to(device)
        elif path == "host-pinned":
            self.host = view
            self.pinned = torch.empty(view.shape, dtype=view.dtype, pin_memory=pin)
            self.dev = torch.empty(view.shape, dtype=view.dtype, device=device)
        else:
            raise ValueError(path)
        self.device = device
        self.n_elem = math.prod(view.shape)
        self.wl = wl
        res.samples.setdefault(path, [])

    def run(self, n: int, out: List[int]) -> None:
        step = self.client.step
        sync = self.sync
        add = self.acc.add_
        pc = time.perf_counter_ns
        app = out.append
        if self.path == "cuda-ipc":
            dev = self.dev
            for _ in range(n):
                t0 = pc()
                step()
                add(dev.view(-1)[-1])
                sync()
                app(pc() - t0)
        elif self.path == "host-pageable":
            host, device = self.host, self.device
            dev = self.dev
            for _ in range(n):
                t0 = pc()
                step()
                dev = host.to(device)  # .cuda(): from pageable memory
                add(dev.view(-1)[-1])
                sync()
                app(pc() - t0)
            self.dev = dev
        else:
            host, pinned, dev = self.host, self.pinned, self.dev
            for _ in range(n):
                t0 = pc()
                step()
                pinned.copy_(host)  # host memcpy into pinned memory
                dev.copy_(pinned, non_blocking=True)  # DMA on the current stream
                add(dev.view(-1)[-1])
                sync()  # also: the pinned buffer is free again for the next step
                app(pc() - t0)

    def release(self) -> None:
        """Drops the tensors: a CUDA client acknowledges its close (and its engine frees
        the memory) once no view holds the memory open."""
        self.dev = self.host = self.pinned = None

    def check(self) -> Optional[str]:
        seq = self.client.frame
        flat = self.dev.view(-1)
        got = (int(flat[0].item()), int(flat[-1].item()))
        want = (self.wl.obs_value(seq, 0), self.wl.obs_value(seq, self.n_elem - 1))
        if got != want:
            return (f"{self.wl.label}, {self.path}: frame {seq} reads {got} as its first and last "
                    f"element on the GPU, the engine wrote {want}")
        return None


def measure(plan: Plan, device: Any, engine_device: str, pin: bool = True,
            blocking: bool = False, log: Callable[[str], None] = lambda s: None) -> List[PayloadResult]:
    """Runs every payload through every path; `engine_device` is where the CUDA-IPC
    engine's tensors live ("cuda:N"), `device` the torch device the consumer uses.
    Raises `shmbridge.CudaUnavailableError` if the engine cannot use CUDA, having closed
    whatever it launched."""
    import torch

    clients: List[shmbridge.Client] = []
    results: List[PayloadResult] = []
    cases: List[_Case] = []
    try:
        # The CUDA engines first: a refusal then costs nothing else.
        gpu_clients = []
        for wl in PAYLOADS:
            c = shmbridge.launch("null", device=engine_device, blocking=blocking, **wl.shmbridge_kwargs())
            clients.append(c)
            gpu_clients.append(c)
        for wl, gc in zip(PAYLOADS, gpu_clients):
            host = shmbridge.launch("null", device="cpu", blocking=blocking, **wl.shmbridge_kwargs())
            clients.append(host)
            res = PayloadResult(wl, "rgb" if wl.image else "obs", gc.device)
            acc = torch.zeros((), dtype=torch.float32, device=device)
            cases.append(_Case(res, "cuda-ipc", gc, device, acc, pin))
            cases.append(_Case(res, "host-pageable", host, device, acc, pin))
            cases.append(_Case(res, "host-pinned", host, device, acc, pin))
            results.append(res)
        for r in results:
            log(f"  {r.workload.label}: CUDA IPC view data_ptr {r.view_ptr:#x}, "
                f"client[{r.tensor!r}].data_ptr {r.tensor_ptr:#x}: "
                f"{'equal (zero copy)' if r.zero_copy else 'NOT equal'}, on {r.view_device}")

        for rnd in range(plan.rounds):
            shift = rnd % len(cases)
            for case in cases[shift:] + cases[:shift]:
                warm: List[int] = []
                case.run(plan.warmup * (5 if rnd == 0 else 1), warm)
                case.run(plan.per_block, case.res.samples[case.path])
                problem = case.check()
                if problem:
                    case.res.failures.append(problem)
            log(f"  round {rnd + 1}/{plan.rounds} done")
    finally:
        for case in cases:
            case.release()
        for c in clients:
            c.close()
    return results


def _gpu_lines(device: Any, engine_reason: str) -> List[str]:
    import torch

    props = torch.cuda.get_device_properties(device)
    return [
        f"- GPU: {props.name} ({device}, {props.total_memory / 2**30:.0f} GiB); torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}, {torch.get_num_threads()} CPU threads); "
        f"shmbridge.cuda_status(): {one_line(engine_reason)}",
    ]


def report(results: List[PayloadResult], plan: Plan, header: List[str], quick: bool,
           elapsed: float, command: str) -> Tuple[str, Dict[str, Any]]:
    """The markdown text and the JSON document of a run."""
    rows = []
    ratios: Dict[str, Dict[str, Dict[str, float]]] = {}
    stats = {r.workload.key: r.stats() for r in results}
    for r in results:
        st = stats[r.workload.key]
        ref = st.get(REFERENCE)
        ratios[r.workload.key] = {}
        for key, label in PATHS:
            s = st.get(key)
            if s is None:
                rows.append([r.workload.label, label, "no samples", "", "", "", "", ""])
                continue
            if ref is not None:
                rm, rp = s.median_ns / ref.median_ns, s.p99_ns / ref.p99_ns
                ratios[r.workload.key][key] = dict(median=rm, p99=rp)
                rm_s, rp_s = fmt_ratio(rm), fmt_ratio(rp)
            else:
                rm_s = rp_s = "n/a"
            rows.append([r.workload.label, label, f"{s.n:,}", fmt_us(s.median_ns), fmt_us(s.p99_ns),
                         fmt_rate(s.steps_per_s), rm_s, rp_s])
    table = markdown_table(["payload", "path", "steps", "median µs", "p99 µs", "steps/s",
                            "median ÷ CUDA IPC", "p99 ÷ CUDA IPC"], rows, "llrrrrrr")
    zero = [f"- {r.workload.label}: `torch.from_dlpack(client[{r.tensor!r}]).data_ptr()` "
            f"{r.view_ptr:#x} {'==' if r.view_ptr == r.tensor_ptr else '!='} "
            f"`client[{r.tensor!r}].data_ptr` {r.tensor_ptr:#x}, view on {r.view_device}, engine on "
            f"{r.engine_device}: {'zero copy' if r.zero_copy else 'NOT zero copy'}" for r in results]
    targets = []
    for r in results:
        rr = ratios[r.workload.key]
        for key in ("host-pageable", "host-pinned"):
            if key in rr:
                targets.append(f"- {r.workload.label}: {key} ÷ CUDA IPC: {fmt_ratio(rr[key]['median'])} "
                               f"(median), {fmt_ratio(rr[key]['p99'])} (p99)")
    main_r = ratios.get(OBS_4096X100.key, {}).get("host-pageable")
    if main_r is None:
        goal = f"- target: host-pageable ÷ CUDA IPC ≥ {TARGET_RATIO:g}× at 4096×100 f32: not measured"
    else:
        goal = (f"- target: host-pageable ÷ CUDA IPC ≥ {TARGET_RATIO:g}× at 4096×100 f32 (medians): "
                f"{fmt_ratio(main_r['median'])}, {'met' if main_r['median'] >= TARGET_RATIO else 'NOT met'}")
    failures = [f for r in results for f in r.failures]
    lines = [
        "## GPU: CUDA IPC against host-staged copies",
        "",
        f"Command: `{command}` ({run_mode(quick)}; {plan.rounds} interleaved rounds of {plan.per_block:,} timed "
        f"steps per payload and path after {plan.warmup:,} warm-up steps; {elapsed:.1f} s)",
        "",
        *header,
        "",
        table,
        "",
        "A step: `client.step()`, then what makes the frame usable by a torch consumer on the GPU "
        "(CUDA IPC: nothing, the current stream waits on the engine's event; pageable: `.cuda()` of "
        "the shared-memory view; pinned: host memcpy into a pinned buffer, then a non-blocking copy "
        "into a preallocated device tensor), one consumer op reading the frame on the current "
        "stream, and `torch.cuda.current_stream().synchronize()`. steps/s = 1e9 / mean.",
        "",
        "Zero copy (CUDA IPC path, checked once per payload):",
        "",
        *zero,
        "",
        "Ratios (this run):",
        "",
        *targets,
        goal,
    ]
    if failures:
        lines += ["", "**Checks failed:**", "", *[f"- {f}" for f in failures]]
    text = "\n".join(lines) + "\n"
    doc = dict(
        command=command, quick=quick, plan=plan.__dict__, elapsed_s=elapsed,
        target=dict(path="host-pageable", payload=OBS_4096X100.key, min_ratio=TARGET_RATIO,
                    ratio=main_r["median"] if main_r else None,
                    met=bool(main_r and main_r["median"] >= TARGET_RATIO)),
        payloads=[dict(
            workload=r.workload.to_dict(), key=r.workload.key, tensor=r.tensor,
            engine_device=r.engine_device,
            zero_copy=dict(equal=r.view_ptr == r.tensor_ptr, view_data_ptr=r.view_ptr,
                           tensor_data_ptr=r.tensor_ptr, view_device=r.view_device, ok=r.zero_copy),
            paths={key: (stats[r.workload.key][key].to_dict() if key in stats[r.workload.key] else None)
                   for key, _ in PATHS},
            ratios=ratios[r.workload.key],
            failures=r.failures,
        ) for r in results],
    )
    return text, doc


def main(args: Any) -> int:
    reason = probe()
    if reason:
        return skip(reason)
    import torch

    quick = args.quick
    rounds = args.rounds or (2 if quick else 10)
    steps = args.steps or (200 if quick else 10_000)
    plan = Plan(rounds=rounds, per_block=max(1, math.ceil(steps / rounds)),
                warmup=args.warmup if args.warmup is not None else (10 if quick else 100))
    device = torch.device(args.device)
    if device.type != "cuda":
        log(f"bench gpu: --device {args.device}: expected cuda or cuda:N")
        return 2
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        log(f"bench gpu: --device {args.device}: torch sees {torch.cuda.device_count()} CUDA device(s)")
        return 2
    torch.cuda.set_device(device)  # torch's current stream is the one client.step() uses
    engine_reason = shmbridge.cuda_status().reason
    machine = machine_description()

    log(f"gpu: {', '.join(w.label for w in PAYLOADS)}; on {device}")
    t0 = time.monotonic()
    try:
        results = measure(plan, device, str(device), pin=True, blocking=args.blocking, log=log)
    except shmbridge.CudaUnavailableError as e:
        return skip(f"the engine cannot use CUDA: {e}")
    elapsed = time.monotonic() - t0

    header = machine_header(machine, _gpu_lines(device, engine_reason))
    text, doc = report(results, plan, header, quick, elapsed, args.command_line)
    doc["machine"] = machine
    publish("gpu", text, args.out, doc)
    bad = [r for r in results if not r.zero_copy or r.failures]
    return 1 if bad else 0
