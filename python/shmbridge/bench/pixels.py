"""`python -m shmbridge.bench pixels`: rendered CartPole frames per second delivered to a
torch consumer, the `pixels` engine against Gymnasium's CartPole-v1 rendered with
`render_mode="rgb_array"`, at the same num_envs and frame size, in one run.

Paths (each steps N envs with the same pre-drawn random actions):

- `pixels-vulkan`: the `pixels` engine draws each env's frame (`HxWx3`, one frame per
  env: `frame_stack=1`) with its compute shader into Vulkan memory it exports; the client
  imports and maps it (lavapipe here: kDLCPU). A persistent `torch.from_dlpack` view.
- `pixels-host`: the same engine drawing on its CPU into the region's shared memory
  (`image_device="host"`): the same bytes, the same persistent view.
- `pixels-vulkan-stack4`: `pixels-vulkan` with `frame_stack=4`: the stack's cost per
  step (the engine shifts 3 frames per env and draws one; frames/s counts new frames).
- `gym-sync`, `gym-async`: `gymnasium.vector.SyncVectorEnv` / `AsyncVectorEnv`
  (`shared_memory=True`, a worker process per env) of `CartPole-v1` with
  `render_mode="rgb_array"`, each env wrapped to return its rendered 400x600x3 frame
  resized to HxW (nearest neighbour, by NumPy indexing: the cheapest resize there is, so
  the comparison favours Gymnasium) as its observation; the batch reaches torch through
  `torch.from_numpy` (no copy).

A step: the step call (`client.step()` or `envs.step(actions)`), then one consumer op
on the frames' torch tensor (`acc += frames[-1, ..., -1]`, the last env's last byte).
Each step is timed on its own with `time.perf_counter_ns`; the paths run in interleaved
rounds (the order rotating), and frames/s = num_envs * 1e9 / mean step time. After each
block the shmbridge paths' frames are checked to be a rendered picture (not blank), and
the views to be the engine's memory (pointer equality).

`--mujoco TASK [--camera NAME]` measures a MuJoCo task's camera instead (set
`MUJOCO_GL=egl` on a machine without a display, as `scripts/test-mujoco.sh` does: it picks
the renderer of Gymnasium's envs):

- `mujoco-native`: the native MuJoCo engine (`launch("mujoco/TASK", camera=NAME,
  camera_size="HxW")`, a build with the `mujoco` feature) renders each env through the
  camera with MuJoCo's renderer into the region's `rgb` (host), a persistent torch view;
  `mujoco-native-k2`: the same as 2 shards, each rendering its half of the envs;
- `gym-sync`, `gym-async`: Gymnasium's `TASK` made with `render_mode="rgb_array"`,
  `width`, `height` and `camera_name`, each env wrapped to return its rendered frame as
  its observation, under `SyncVectorEnv` / `AsyncVectorEnv` as above.

Random actions, uniform in the action space's bounds. Gymnasium's CartPole renders with pygame (`gymnasium[classic-control]`, in the `bench`
extra); without it the Gymnasium paths are reported as skipped. Without a Vulkan driver
the Vulkan paths are skipped; without either the command prints `bench pixels: skipped:
<reason>` on stderr and exits with status 3.
"""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

import shmbridge

from .common import Stats, random_actions
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

PATHS: Tuple[Tuple[str, str], ...] = (
    ("pixels-vulkan", "shmbridge pixels, Vulkan export (lavapipe: kDLCPU)"),
    ("pixels-host", "shmbridge pixels, host shared memory"),
    ("pixels-vulkan-stack4", "shmbridge pixels, Vulkan export, frame_stack=4"),
    ("gym-sync", "Gymnasium SyncVectorEnv, rgb_array"),
    ("gym-async", "Gymnasium AsyncVectorEnv, rgb_array"),
)
MUJOCO_PATHS: Tuple[Tuple[str, str], ...] = (
    ("mujoco-native", "shmbridge native MuJoCo engine, its camera into host shared memory"),
    ("mujoco-native-k2", "shmbridge native MuJoCo engine, 2 shards (2 renderers)"),
    ("gym-sync", "Gymnasium SyncVectorEnv, rgb_array"),
    ("gym-async", "Gymnasium AsyncVectorEnv, rgb_array"),
)
# The path the ratios divide by: what a PyTorch user of Gymnasium would start from.
REFERENCE = "gym-async"


@dataclass
class Plan:
    rounds: int
    per_block: int
    warmup: int
    num_envs: int
    height: int
    width: int
    # A MuJoCo task and its camera (`--mujoco`), or None: CartPole and the pixels engine.
    task: Optional[str] = None
    camera: str = "track"

    def paths(self) -> Tuple[Tuple[str, str], ...]:
        return MUJOCO_PATHS if self.task else PATHS


def _make_mujoco_env(task: str, camera: str, height: int, width: int):
    """Gymnasium's `task` rendering `camera` at `(height, width)`, its observation the
    rendered frame."""
    import gymnasium as gym

    class Rendered(gym.ObservationWrapper):
        def __init__(self, env):
            super().__init__(env)
            self.observation_space = gym.spaces.Box(0, 255, (height, width, 3), np.uint8)

        def observation(self, observation):
            return self.env.render()

    return Rendered(gym.make(task, render_mode="rgb_array", width=width, height=height, camera_name=camera))


def _make_gym_env(height: int, width: int):
    """Gymnasium's CartPole-v1 with `render_mode="rgb_array"`, wrapped so that its
    observation is its rendered frame resized to `(height, width)` by nearest-neighbour
    indexing."""
    import gymnasium as gym

    class ResizedRender(gym.ObservationWrapper):
        def __init__(self, env):
            super().__init__(env)
            self.observation_space = gym.spaces.Box(0, 255, (height, width, 3), np.uint8)
            self._rows = self._cols = None

        def observation(self, observation):
            frame = self.env.render()
            if self._rows is None:
                h, w = frame.shape[:2]
                self._rows = ((np.arange(height) + 0.5) * h / height).astype(np.intp)
                self._cols = ((np.arange(width) + 0.5) * w / width).astype(np.intp)
            return frame[self._rows[:, None], self._cols[None, :]]

    return ResizedRender(gym.make("CartPole-v1", render_mode="rgb_array"))


class _Factory:
    """Picklable `env_fns` entry for AsyncVectorEnv's workers."""

    def __init__(self, plan: "Plan"):
        self.height, self.width, self.task, self.camera = plan.height, plan.width, plan.task, plan.camera

    def __call__(self):
        if self.task:
            return _make_mujoco_env(self.task, self.camera, self.height, self.width)
        return _make_gym_env(self.height, self.width)


def _frames_drawn(frames: np.ndarray, task: Optional[str]) -> bool:
    """Whether `[N, ..., H, W, 3]` frames are drawn pictures: CartPole's white background
    and dark cart in every env; a MuJoCo camera's view, not one colour, in every env."""
    if task:
        # Some channel varies across the pixels of every env's frame (one clear colour
        # does not).
        pixels = frames.reshape(len(frames), -1, 3)
        return bool((pixels.max(axis=1) > pixels.min(axis=1)).any(axis=1).all())
    flat = frames.reshape(len(frames), -1)
    return int(flat.max()) == 255 and int(flat.min(axis=1).max()) < 64


class Case:
    """One path: how to step it, the torch tensor of its frames, and its samples."""

    def __init__(self, key: str):
        self.key = key
        self.samples: List[int] = []
        self.failures: List[str] = []
        self.zero_copy: Optional[bool] = None  # shmbridge paths: view == tensor memory
        self.note = ""

    def run(self, n: int, out: List[int]) -> None:
        raise NotImplementedError

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


class PixelsCase(Case):
    def __init__(self, key: str, plan: Plan, blocking: bool, stack: int, image_device: str):
        super().__init__(key)
        client = shmbridge.launch(
            "pixels", num_envs=plan.num_envs, seed=0, image=f"{plan.height}x{plan.width}x3",
            frame_stack=stack, image_device=image_device, blocking=blocking)
        bank = np.random.default_rng(0).integers(0, 2, size=(1024, plan.num_envs, 1), dtype=np.int64)
        self._watch(client, bank, stacked=True)

    def _watch(self, client: Any, bank: np.ndarray, stacked: bool) -> None:
        """Takes `client`'s frames as a persistent torch view, once (the engine's memory, in
        place; `[N, stack, H, W, 3]`, a stack of one where the engine serves single
        frames), checks it is zero copy, and keeps the actions' view and `bank` of them."""
        import torch

        self.client = client
        self.tensor = client["rgb"]
        view = torch.from_dlpack(self.tensor)
        self.view = view if stacked else view[:, None]
        self.zero_copy = self.view.data_ptr() == self.tensor.data_ptr != 0
        self.note = (f"`torch.from_dlpack(client['rgb'])` {tuple(self.tensor.shape)} at "
                     f"{self.view.data_ptr():#x} {'==' if self.zero_copy else '!='} "
                     f"`client['rgb'].data_ptr` {self.tensor.data_ptr:#x}")
        self.actions = torch.from_dlpack(client.actions)
        self.acc = torch.zeros((), dtype=torch.int64)
        self.bank = torch.from_numpy(bank.reshape(len(bank), *self.actions.shape))
        self.k = 0

    def run(self, n: int, out: List[int]) -> None:
        step, pc, app, add = self.client.step, time.perf_counter_ns, out.append, self.acc.add_
        last = self.view[-1, -1, :, :, -1]
        bank, m, actions = self.bank, len(self.bank), self.actions
        for _ in range(n):
            self.k += 1
            actions.copy_(bank[self.k % m])
            t0 = pc()
            step()
            add(last[-1, -1])
            app(pc() - t0)

    def check(self) -> None:
        newest = self.view[:, -1]
        # A drawn frame: the white background and the dark cart and track in every env.
        if not (int(newest.max()) == 255 and int(newest.amin(dim=(1, 2, 3)).max()) < 64):
            self.failures.append(f"{self.key}: frame {self.client.frame} is not a drawn picture")

    def close(self) -> None:
        self.view = self.actions = None
        self.client.close()


class MujocoCase(PixelsCase):
    """The native MuJoCo engine's camera: `rgb [N, H, W, 3]` in the region."""

    def __init__(self, key: str, plan: Plan, blocking: bool, shards: int = 1):
        import gymnasium as gym

        Case.__init__(self, key)
        self.task = plan.task
        env = gym.make(plan.task)
        space = env.action_space
        env.close()
        client = shmbridge.launch(
            f"mujoco/{plan.task}", num_envs=plan.num_envs, seed=0, camera=plan.camera,
            camera_size=f"{plan.height}x{plan.width}", blocking=blocking, shards=shards)
        self._watch(client, random_actions(space, plan.num_envs, 1024), stacked=False)

    def check(self) -> None:
        if not _frames_drawn(self.view.numpy(), self.task):
            self.failures.append(f"{self.key}: frame {self.client.frame} is not a drawn picture")


class GymCase(Case):
    def __init__(self, key: str, plan: Plan):
        import gymnasium as gym
        import torch

        super().__init__(key)
        self.task = plan.task
        fns = [_Factory(plan) for _ in range(plan.num_envs)]
        if key == "gym-sync":
            self.envs = gym.vector.SyncVectorEnv(fns)
        else:
            # MuJoCo's EGL renderer does not survive a fork of a process that rendered
            # (SyncVectorEnv's envs here): its workers start fresh.
            context = "spawn" if plan.task else None
            self.envs = gym.vector.AsyncVectorEnv(fns, shared_memory=True, context=context)
        obs, _ = self.envs.reset(seed=0)
        self.acc = torch.zeros((), dtype=torch.int64)
        self.from_numpy = torch.from_numpy
        self.bank = random_actions(self.envs.single_action_space, plan.num_envs, 1024)
        self.k = 0
        self.last = obs
        self.note = f"observations {obs.shape} {obs.dtype} through `torch.from_numpy` (no copy)"

    def run(self, n: int, out: List[int]) -> None:
        step, pc, app, add, tensor = self.envs.step, time.perf_counter_ns, out.append, self.acc.add_, self.from_numpy
        bank, m = self.bank, len(self.bank)
        o = self.last
        for _ in range(n):
            self.k += 1
            actions = bank[self.k % m]
            t0 = pc()
            o, _r, _te, _tr, _info = step(actions)
            add(tensor(o)[-1, -1, -1, -1])
            app(pc() - t0)
        self.last = o

    def check(self) -> None:
        if not _frames_drawn(np.asarray(self.last), self.task):
            self.failures.append(f"{self.key}: the observation is not a rendered picture")

    def close(self) -> None:
        self.envs.close()


def _gym_missing(task: Optional[str] = None) -> str:
    """Why the Gymnasium paths cannot run here ('' where they can)."""
    needs = (("gymnasium", "gymnasium"), ("mujoco", "gymnasium[mujoco]")) if task else \
        (("gymnasium", "gymnasium"), ("pygame", "gymnasium[classic-control]"))
    for mod, extra in needs:
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install '{extra}', in the bench extra)"
    return ""


def measure(plan: Plan, blocking: bool = False,
            log: Callable[[str], None] = lambda s: None) -> Tuple[List[Case], Dict[str, str]]:
    """Runs every path that can run here; returns the cases and why the others did not."""
    cases: List[Case] = []
    skipped: Dict[str, str] = {}
    try:
        for key, shards in (("mujoco-native", 1), ("mujoco-native-k2", 2)) if plan.task else ():
            if shards > plan.num_envs:
                skipped[key] = f"{shards} shards need {shards} envs"
                continue
            try:
                cases.append(MujocoCase(key, plan, blocking, shards))
            except shmbridge.EngineStartError as e:
                if "without the `mujoco` feature" not in str(e):
                    raise
                skipped[key] = "shmbridge was built without the `mujoco` feature (docs/mujoco.md)"
        for key, stack, where in () if plan.task else (
                ("pixels-vulkan", 1, "vulkan"), ("pixels-host", 1, "host"), ("pixels-vulkan-stack4", 4, "vulkan")):
            try:
                cases.append(PixelsCase(key, plan, blocking, stack, where))
            except shmbridge.EngineStartError as e:
                if "Vulkan is unavailable" not in str(e):
                    raise
                skipped[key] = "no Vulkan driver: " + " ".join(str(e).split())[-300:]
        why = _gym_missing(plan.task)
        for key in ("gym-sync", "gym-async"):
            if why:
                skipped[key] = why
            else:
                cases.append(GymCase(key, plan))
        for c in cases:
            log(f"  {c.key}: {c.note}")
        for rnd in range(plan.rounds):
            shift = rnd % max(1, len(cases))
            for case in cases[shift:] + cases[:shift]:
                warm: List[int] = []
                case.run(plan.warmup * (5 if rnd == 0 else 1), warm)
                case.run(plan.per_block, case.samples)
                case.check()
            log(f"  round {rnd + 1}/{plan.rounds} done")
    finally:
        for case in cases:
            case.close()
    return cases, skipped


def report(cases: List[Case], skipped: Dict[str, str], plan: Plan, header: List[str], quick: bool,
           elapsed: float, command: str) -> Tuple[str, Dict[str, Any]]:
    """The markdown text and the JSON document of a run."""
    stats = {c.key: Stats.of(c.samples) for c in cases if c.samples}
    fps = {k: plan.num_envs * s.steps_per_s for k, s in stats.items()}
    ref = fps.get(REFERENCE)
    labels = dict(plan.paths())
    rows, ratios = [], {}
    for key, label in plan.paths():
        if key in skipped:
            rows.append([label, f"skipped: {skipped[key]}", "", "", "", ""])
            continue
        s = stats.get(key)
        if s is None:
            rows.append([label, "no samples", "", "", "", ""])
            continue
        ratio = fps[key] / ref if ref else math.nan
        ratios[key] = ratio
        rows.append([label, f"{s.n:,}", fmt_us(s.median_ns), fmt_us(s.p99_ns), fmt_rate(fps[key]),
                     fmt_ratio(ratio) if ref else "n/a"])
    table = markdown_table(["path", "steps", "median µs", "p99 µs", "frames/s",
                            "frames/s ÷ AsyncVectorEnv"], rows, "lrrrrr")
    failures = [f for c in cases for f in c.failures]
    not_zero = [c.key for c in cases if c.zero_copy is False]
    what = f"{plan.task}'s camera `{plan.camera}`, " if plan.task else ""
    lines = [
        "## Pixels: rendered frames to torch, against Gymnasium's rgb_array",
        "",
        f"Command: `{command}` ({run_mode(quick)}; {what}{plan.num_envs} envs, {plan.height}×{plan.width}×3 u8 frames; "
        f"{plan.rounds} interleaved rounds of {plan.per_block:,} timed steps per path after "
        f"{plan.warmup:,} warm-up steps; {elapsed:.1f} s)",
        "",
        *header,
        "",
        table,
        "",
        "A step: the step call, then one consumer op on the frames' torch tensor. "
        "frames/s = num_envs × 1e9 / mean step time; the ratio divides by AsyncVectorEnv's.",
        "",
        *[f"- {c.key}: {c.note}" for c in cases],
    ]
    if not_zero:
        lines += ["", f"**Not zero copy:** {', '.join(not_zero)}"]
    if failures:
        lines += ["", "**Checks failed:**", "", *[f"- {f}" for f in failures]]
    text = "\n".join(lines) + "\n"
    doc = dict(
        command=command, quick=quick, plan=plan.__dict__, elapsed_s=elapsed, skipped=skipped,
        paths={c.key: dict(stats=stats[c.key].to_dict() if c.key in stats else None,
                           frames_per_s=fps.get(c.key), ratio_to_async=ratios.get(c.key),
                           zero_copy=c.zero_copy, failures=c.failures, label=labels[c.key])
               for c in cases},
    )
    return text, doc


def main(args: Any) -> int:
    quick = args.quick
    rounds = args.rounds or (2 if quick else 5)
    steps = args.steps or (20 if quick else 1_000)
    size = frame_size("pixels", args.size, args.num_envs)
    if size is None:
        return 2
    h, w = size
    plan = Plan(rounds=rounds, per_block=max(1, math.ceil(steps / rounds)),
                warmup=args.warmup if args.warmup is not None else (2 if quick else 20),
                num_envs=args.num_envs, height=h, width=w, task=getattr(args, "mujoco", None),
                camera=getattr(args, "camera", "track"))

    log(f"pixels: {plan.task or 'CartPole'}, {plan.num_envs} envs, {h}x{w}x3 frames")
    machine = machine_description()
    t0 = time.monotonic()
    cases, skipped = measure(plan, blocking=args.blocking, log=log)
    if not cases:
        return skip("pixels", "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    elapsed = time.monotonic() - t0
    text, doc = report(cases, skipped, plan, machine_header(machine), quick, elapsed,
                       args.command_line)
    doc["machine"] = machine
    publish("pixels", text, args.out, doc)
    return 1 if any(c.zero_copy is False or c.failures for c in cases) else 0
