"""PPO in PyTorch on the reference ``cartpole`` engine, through shmbridge (the main job).

    python -m shmbridge.examples.ppo            # or: shmbridge-ppo
    python -m shmbridge.examples.ppo --help

The engine (Gymnasium CartPole-v1 dynamics, ``--num-envs`` environments) runs in a child
process started by :func:`shmbridge.launch`. The learner reads observations, rewards and
the terminated/truncated flags through zero-copy ``torch.from_dlpack`` views of the
engine's tensors, created once, and writes its actions into the action tensor in place.

``--device`` says where both the learner and the engine's tensors live: ``cpu`` (shared
memory), ``cuda`` (GPU memory, shared through CUDA IPC: the views are CUDA tensors on the
engine's memory, the engine steps with CUDA kernels, and a step is ordered on torch's
current stream with no host synchronisation), or ``auto`` (the default): ``cuda`` when
torch sees a GPU and ``shmbridge.cuda_available()`` says shmbridge can use it, else
``cpu``; the first line printed says which and why. On a GPU the host reads the
episode returns back once per update, for the log.
The engine resets finished environments in the same step; an episode cut by the 500-step
time limit is bootstrapped from the value of its last observation, which the engine serves
in its ``final_obs`` tensor (read through another such view; Stable-Baselines3's PPO
does the same with the terminal observation in ``infos``). With an engine that has no
``final_obs``, the value of the observation before it stands in for it.
Training stops when the mean return of the last 100 finished episodes reaches
``--target-return`` (475, the CartPole-v1 "solved" threshold; the maximum is 500) or after
``--total-steps`` environment steps. A learning curve (mean return of the last 100
episodes vs environment steps) is written to ``--plot``.

``--shards K`` serves the ``--num-envs`` envs from K engine processes (a sharded region,
protocol 1.4); the learner sees one ``[num_envs, ...]`` tensor as before.

**Several ranks** (``docs/scaling.md``): under ``torchrun`` (``WORLD_SIZE`` > 1) every
rank launches its own engine (sharded with ``--shards``; on its own GPU, ``cuda:LOCAL_RANK``,
where there are GPUs), steps its own envs (env seeds ``seed + rank * num_envs + e``: one
big vector of distinct envs), and the gradients are averaged by
``DistributedDataParallel`` (gloo on CPU, NCCL on GPU), so the parameters stay equal on
every rank. The finished episodes of all ranks are gathered once per update, so every
rank stops at the same update; rank 0 alone prints, shows the progress bar and writes the
curve. ``--total-steps`` counts the steps of all ranks together.

    torchrun --nproc_per_node=2 -m shmbridge.examples.ppo --shards 2

Needs the ``ppo`` extra: ``torch``, ``tqdm``, ``matplotlib``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Iterator, List, Optional, Tuple

import shmbridge


@dataclass
class Config:
    """Hyperparameters and run options; the defaults are the command line's defaults."""

    env: str = "cartpole"  # cartpole (from the state) | pixels (from rendered frames)
    image: str = "48x48x1"  # pixels: the frame shape the engine draws (HxWxC; C 4, 3 or 1: grey)
    frame_stack: int = 2  # pixels: frames per env in the engine's stack
    image_device: str = "vulkan"  # pixels: where the engine draws (vulkan, or host: the region)
    save: Optional[str] = None  # pixels: write the trained agent here (examples/pixels_viewer.py)
    num_envs: int = 16
    total_steps: int = 500_000  # env steps (all envs together); an upper bound
    num_steps: int = 128  # rollout length per env: a batch is num_envs * num_steps
    lr: float = 1e-3
    anneal_lr: bool = True  # linearly to 0 over total_steps
    update_epochs: int = 10
    num_minibatches: int = 4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_coef: float = 0.2
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    bootstrap_truncated: bool = True  # truncated episodes: reward += gamma * V(final obs)
    target_return: Optional[float] = 475.0  # None: run all total_steps
    window: int = 100  # episodes in the running mean
    seed: int = 1
    device: str = "auto"  # auto | cpu | cuda: the learner and the engine's tensors
    threads: int = 1
    blocking: bool = False
    plot: Optional[str] = "ppo_cartpole.png"
    progress: bool = True
    # torch.cuda.set_sync_debug_mode ("warn" or "error") during each rollout's steps on a
    # GPU: any host synchronisation torch makes there is then reported (tests use "error").
    sync_debug: Optional[str] = None
    shards: int = 1  # engine processes serving each rank's envs (host memory)
    # A JSON report of this rank's run: path, with {rank} replaced by the rank.
    report: Optional[str] = None
    # An engine executable serving CartPole-v1 through the C ABI (or any engine that
    # follows the CLI convention of docs/protocol.md §9), started with
    # `--num-envs N --seed S` appended, instead of the reference engine. Host memory.
    engine_command: Optional[str] = None
    # The engine's tensors in host memory while the learner is on a GPU: every step copies
    # the frame to the GPU and the actions back (what a transport without CUDA IPC must
    # do). For comparing with the zero-copy run; the same as without it on a CPU learner.
    host_staged: bool = False


@dataclass
class Result:
    mean_return: float  # mean of the last `window` finished episodes (nan if none)
    window_episodes: int  # how many episodes that mean is over (<= window)
    episodes: int  # finished episodes in all
    env_steps: int
    wall_s: float  # from launching the engine to the end of training
    reached_target: bool
    device: str  # the learner's torch device
    engine_device: str = "cpu"  # client.device: where the engine's tensors live
    # The engine's tensors read and written through torch views that were checked to be
    # the engine's memory on `device` (same data_ptr): obs, actions, rewards, ...
    zero_copy_views: List[str] = field(default_factory=list)
    curve_steps: List[int] = field(default_factory=list)
    curve_returns: List[float] = field(default_factory=list)
    plot: Optional[str] = None

    @property
    def steps_per_s(self) -> float:
        return self.env_steps / self.wall_s if self.wall_s > 0 else float("nan")

    def summary(self) -> str:
        return (
            f"final mean return over the last {self.window_episodes} episodes: "
            f"{self.mean_return:.1f} ({self.episodes:,} episodes, {self.wall_s:.1f} s, "
            f"{self.steps_per_s:,.0f} env-steps/s)"
        )


def _orthogonal(module, std: float = math.sqrt(2)):
    """``module`` with orthogonal weights of gain ``std`` and zero biases (CleanRL's init)."""
    from torch import nn

    nn.init.orthogonal_(module.weight, std)
    nn.init.zeros_(module.bias)
    return module


def _rollout_buffers(t_len: int, n: int, obs_shape: tuple, obs_dtype, device) -> tuple:
    """A rollout's buffers on the learner's device: observations ``(t_len, n, *obs_shape)``
    of ``obs_dtype``, actions, log-probabilities, rewards, dones, values; then the episode
    bookkeeping: each env's return so far and, at each step, that return as it stood
    (kept where the episode ended: read back once per update)."""
    import torch

    steps = (t_len, n)
    return (
        torch.zeros(steps + tuple(obs_shape), dtype=obs_dtype, device=device),
        torch.zeros(steps, dtype=torch.long, device=device),
        torch.zeros(steps, device=device),
        torch.zeros(steps, device=device),
        torch.zeros(steps, device=device),
        torch.zeros(steps, device=device),
        torch.zeros(n, dtype=torch.float64, device=device),
        torch.zeros(steps, dtype=torch.float64, device=device),
    )


def _agent(obs_dim: int, num_actions: int):
    import torch
    from torch import nn

    def layer(n_in: int, n_out: int, std: float = math.sqrt(2)) -> nn.Linear:
        return _orthogonal(nn.Linear(n_in, n_out), std)

    class Agent(nn.Module):
        """Separate actor and critic MLPs, 64x64 tanh, orthogonal init (as in CleanRL)."""

        def __init__(self) -> None:
            super().__init__()
            self.critic = nn.Sequential(
                layer(obs_dim, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, 1, 1.0)
            )
            self.actor = nn.Sequential(
                layer(obs_dim, 64), nn.Tanh(), layer(64, 64), nn.Tanh(),
                layer(64, num_actions, 0.01),
            )

        def value(self, x: "torch.Tensor") -> "torch.Tensor":
            return self.critic(x).squeeze(-1)

        def forward(self, x: "torch.Tensor") -> "Tuple[torch.Tensor, torch.Tensor]":
            """(logits, value): what the update evaluates (through DDP with ranks)."""
            return self.actor(x), self.value(x)

    return Agent()


class _Ranks:
    """This process's place among the ranks ``torchrun`` started (one rank: no
    torch.distributed at all): it joins the process group (gloo on CPU, NCCL on GPU) and
    gathers what every rank needs to decide alike."""

    def __init__(self, device) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.dist = None
        if self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            self.dist = dist

    def wrap(self, agent, device):
        """``agent`` as the update calls it: DistributedDataParallel with ranks (its
        backward averages the gradients over the ranks), else the module itself."""
        if self.dist is None:
            return agent
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(agent, device_ids=ids)

    def gather(self, finished: List[float]) -> List[float]:
        """Every rank's finished episode returns, in rank order, on every rank."""
        if self.dist is None:
            return finished
        out: List[List[float]] = [[] for _ in range(self.world)]
        self.dist.all_gather_object(out, finished)
        return [r for rank in out for r in rank]

    def close(self) -> None:
        if self.dist is not None:
            self.dist.destroy_process_group()


def bootstrap_truncated(rewards, values, terminated, truncated, final_obs, value_fn, gamma: float) -> None:
    """Bootstraps the episodes cut by the time limit this step, in place: for each env
    ``e`` with ``truncated[e]`` and not ``terminated[e]``, ``rewards[e] += gamma *
    V(final_obs[e])``, its episode's last observation. Such an episode did not end in the
    MDP, its return goes on; the step is still marked done, so GAE stops there.

    ``rewards`` (n,) and ``values`` (n,: V of the observations this step's actions were
    chosen on) are on the learner's device; ``terminated``, ``truncated`` (n,) bool and
    ``final_obs`` (n, obs_dim) are the engine's tensors, read before the next step.
    ``final_obs`` is ``None`` for an engine without it: ``values[e]`` then stands in for
    V(final observation), the observation one step before it (the pole is upright near a
    500-step truncation, so the two are close): an approximation.

    Host tensors: nothing happens unless an episode was cut, and ``value_fn`` sees the
    rows concerned only (the boolean index copies them out of ``final_obs``). CUDA
    tensors: no host synchronisation (``cut.any()`` or a boolean index would make the
    host wait for the GPU at every step): ``value_fn`` sees every env's final
    observation, and the bootstrap is added where ``cut``.
    """
    import torch

    cut = truncated & ~terminated
    if cut.device.type == "cuda":
        cut_dev = cut.to(rewards.device)
        if final_obs is not None:
            with torch.no_grad():
                v = value_fn(final_obs.to(rewards.device))
        else:
            v = values
        rewards.add_(torch.where(cut_dev, gamma * v, 0.0))
        return
    if not cut.any():
        return
    cut_dev = cut.to(rewards.device)
    if final_obs is not None:
        with torch.no_grad():
            rewards[cut_dev] += gamma * value_fn(final_obs[cut].to(rewards.device))
    else:
        rewards += gamma * values * cut_dev


def gae(rewards, values, dones, next_value, gamma: float, lam: float):
    """Generalised advantage estimation over a rollout: ``rewards``, ``values``,
    ``dones`` are (T, n); ``next_value`` (n,) is V of the observation after the last
    step. Returns ``(advantages, returns)``, both (T, n)."""
    import torch

    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        nv = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        live = 1.0 - dones[t]
        delta = rewards[t] + gamma * nv * live - values[t]
        last = delta + gamma * lam * live * last
        adv[t] = last
    return adv, adv + values


def ppo_update(cfg: "Config", agent, optimizer, evaluate, obs, actions, logp, adv, ret,
               minibatch: int) -> None:
    """``cfg.update_epochs`` passes of clipped-surrogate PPO over a rollout, in shuffled
    minibatches. ``evaluate(obs) -> (logits, value)``; ``obs`` is (batch, ...), the
    other rollout tensors (T, n), flattened here."""
    import torch
    from torch.distributions import Categorical

    batch = obs.shape[0]
    b_act, b_logp = actions.reshape(batch), logp.reshape(batch)
    b_adv, b_ret = adv.reshape(batch), ret.reshape(batch)
    for _ in range(cfg.update_epochs):
        perm = torch.randperm(batch, device=obs.device)
        for s in range(0, batch, minibatch):
            mb = perm[s:s + minibatch]
            logits, value = evaluate(obs[mb])
            dist = Categorical(logits=logits, validate_args=False)
            ratio = (dist.log_prob(b_act[mb]) - b_logp[mb]).exp()
            a = b_adv[mb]
            a = (a - a.mean()) / (a.std() + 1e-8)
            pg_loss = torch.max(
                -a * ratio, -a * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)
            ).mean()
            v_loss = 0.5 * (value - b_ret[mb]).pow(2).mean()
            loss = pg_loss + cfg.vf_coef * v_loss - cfg.ent_coef * dist.entropy().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
            optimizer.step()


def choose_device(name: str) -> Tuple[str, str]:
    """Where the learner and the engine's tensors live, and why: ``("cpu" or "cuda:N",
    reason)`` for ``name`` auto, cpu or cuda. ``ValueError`` if cuda cannot be had."""
    import torch

    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device {name!r}: expected auto, cpu or cuda")
    if name == "cpu":
        return "cpu", "--device cpu"
    torch_ok = torch.cuda.is_available()
    shm_ok, shm_why = shmbridge.cuda_available()
    if name == "cuda":
        if not torch_ok:
            raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA device")
        if not shm_ok:
            raise ValueError(f"--device cuda: shmbridge cannot use CUDA: {shm_why}")
        return f"cuda:{torch.cuda.current_device()}", "--device cuda"
    if not torch_ok:
        return "cpu", f"auto: torch {torch.__version__} sees no CUDA device"
    if not shm_ok:
        return "cpu", f"auto: torch sees a GPU but shmbridge cannot use CUDA: {shm_why}"
    index = torch.cuda.current_device()
    return f"cuda:{index}", f"auto: torch and shmbridge can both use {torch.cuda.get_device_name(index)}"


@contextlib.contextmanager
def _sync_debug(device, mode: Optional[str]) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` inside, on a CUDA device."""
    if mode is None or device.type != "cuda":
        yield
        return
    import torch

    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


def _engine_views(client: "shmbridge.Client", device) -> dict:
    """``torch.from_dlpack`` of the engine's obs, actions, rewards, terminated, truncated
    and (if served) final_obs, each checked to be the engine's memory on ``device``: the
    same ``data_ptr``, no copy. ``RuntimeError`` otherwise."""
    import torch

    names = ["obs", "actions", "rewards", "terminated", "truncated"]
    if "final_obs" in client:
        names.append("final_obs")
    views = {}
    for name in names:
        views[name] = torch.from_dlpack(client[name])
        ptr, where = views[name].data_ptr(), views[name].device
        if ptr != client[name].data_ptr or where != device:
            raise RuntimeError(
                f"torch.from_dlpack(client[{name!r}]) is not the engine's tensor on {device} "
                f"(data_ptr {ptr:#x} on {where}; the engine's {client[name].data_ptr:#x} on "
                f"{client.device})")
    return views


class _Staging:
    """The tensors the learner reads. The engine's own views when they are on the
    learner's device (zero copy: ``refresh`` does nothing); otherwise a copy of each
    engine→client view on the learner's device, which ``refresh`` rewrites from the host
    after each step, and the engine's host ``actions`` view itself (``copy_`` into it
    moves the actions back)."""

    def __init__(self, views: dict, device) -> None:
        self.engine_views = views
        self.staged = [name for name, v in views.items()
                       if v.device != device and name != "actions"]
        self.learner_views = dict(views)
        for name in self.staged:
            self.learner_views[name] = views[name].to(device)

    def refresh(self) -> None:
        for name in self.staged:
            self.learner_views[name].copy_(self.engine_views[name])

    def close(self) -> None:
        self.engine_views.clear()
        self.learner_views.clear()


class _Progress:
    """A run's episode returns (the last ``cfg.window`` of them), its learning curve and
    its progress bar. ``update`` after each rollout says whether the target is reached."""

    def __init__(self, cfg: Config, total: int, desc: str, show: bool = True) -> None:
        from tqdm import tqdm

        self.cfg = cfg
        self.recent: Deque[float] = deque(maxlen=cfg.window)
        self.episodes = 0
        self.env_steps = 0
        self.reached = False
        self.curve_steps: List[int] = []
        self.curve_returns: List[float] = []
        self.bar = tqdm(total=total, unit="step", unit_scale=True, disable=not (cfg.progress and show),
                        dynamic_ncols=True, desc=desc)

    def mean(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else float("nan")

    def update(self, env_steps: int, finished: List[float]) -> bool:
        """``env_steps`` more steps, in which the episodes with returns ``finished``
        ended (in the order they ended)."""
        self.env_steps += env_steps
        self.recent.extend(finished)
        self.episodes += len(finished)
        mean = self.mean()
        if self.recent:
            self.curve_steps.append(self.env_steps)
            self.curve_returns.append(mean)
        self.bar.update(env_steps)
        self.bar.set_postfix(ret=f"{mean:.1f}", episodes=self.episodes, refresh=False)
        target = self.cfg.target_return
        self.reached = (target is not None and len(self.recent) == self.cfg.window
                        and mean >= target)
        return self.reached

    def close(self) -> None:
        self.bar.close()

    def result(self, wall_s: float, device: str, engine_device: str,
               zero_copy_views: List[str]) -> Result:
        return Result(
            mean_return=self.mean(),
            window_episodes=len(self.recent),
            episodes=self.episodes,
            env_steps=self.env_steps,
            wall_s=wall_s,
            reached_target=self.reached,
            device=device,
            engine_device=engine_device,
            zero_copy_views=zero_copy_views,
            curve_steps=self.curve_steps,
            curve_returns=self.curve_returns,
        )


def train(cfg: Config, log=print) -> Result:
    """Trains PPO on the ``cartpole`` engine; returns the outcome (and writes the plot)."""
    import torch
    from torch.distributions import Categorical

    if cfg.engine_command:
        if cfg.device == "cuda":
            raise ValueError("--engine-command: such an engine's tensors are in host memory; "
                             "train with --device cpu or auto")
        where, why = "cpu", "--engine-command: the engine's tensors are in host memory"
    else:
        where, why = choose_device(cfg.device)
    device = torch.device(where)
    if cfg.host_staged and cfg.sync_debug and device.type == "cuda":
        raise ValueError("--host-staged copies the actions to the host every step (a "
                         "synchronisation): it cannot run under sync_debug")
    if device.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # One GPU per rank of a node.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    ranks = _Ranks(device)
    if ranks.rank != 0:
        log = lambda *_a, **_k: None  # noqa: E731 - rank 0 alone prints
    if cfg.host_staged and device.type != "cpu":
        log(f"device: {device} for the learner ({why}); the engine's tensors in host memory, "
            "copied to it every step (--host-staged)")
    else:
        log(f"device: {device} for the learner and the engine's tensors ({why})")
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    n, t_len = cfg.num_envs, cfg.num_steps
    batch = n * t_len
    if batch % cfg.num_minibatches:
        raise ValueError(f"num_envs * num_steps ({batch}) is not a multiple of num_minibatches")
    minibatch = batch // cfg.num_minibatches
    num_updates = max(1, math.ceil(cfg.total_steps / (batch * ranks.world)))
    log(f"torch device: {device} ({torch.get_num_threads()} CPU threads); "
        f"{n} envs x {t_len} steps = {batch} per update"
        + (f" on each of {ranks.world} ranks" if ranks.world > 1 else "")
        + f", up to {num_updates} updates")

    agent = _agent(4, 2).to(device)
    # Equal initial parameters on every rank (the seed; DDP also broadcasts rank 0's),
    # then each rank samples its own actions and minibatches.
    model = ranks.wrap(agent, device)
    torch.manual_seed(cfg.seed + ranks.rank)
    initial = _param_digest(agent)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)

    (obs_buf, act_buf, logp_buf, rew_buf, done_buf, val_buf,
     ep_return, ret_at_step) = _rollout_buffers(t_len, n, (4,), torch.float32, device)

    start = time.perf_counter()
    # Launched in the engine with the same seed: env k is reset with seed + k. Its tensors
    # live on the learner's device: shared memory, or GPU memory shared through CUDA IPC.
    # Each rank its own engine, its envs seeded after those of the ranks before it.
    if cfg.engine_command:
        command = shlex.split(cfg.engine_command) + ["--num-envs", str(n), "--seed", str(cfg.seed)]
        launched = shmbridge.launch(command=command, blocking=cfg.blocking)
    else:
        engine_on = "cpu" if cfg.host_staged else str(device)
        launched = shmbridge.launch("cartpole", num_envs=n, device=engine_on,
                                    seed=cfg.seed + ranks.rank * n, blocking=cfg.blocking,
                                    shards=cfg.shards)
    with launched as client:
        # Zero-copy views of the engine's tensors, created once and valid for the
        # client's life; the engine overwrites them in place at every step, so each step
        # copies what it needs into the rollout buffers before the next step. On a GPU,
        # client.step() orders everything on torch's current stream: the engine's
        # kernels wait for the work queued before it (the actions written into act_view,
        # the reads of the previous frame), and work queued after it sees the new frame.
        views = _engine_views(client, torch.device(client.device))
        # Host-staged on a GPU learner: the learner reads copies of the engine→client
        # tensors on its device, refreshed after every step; actions are copied to the
        # host view (a synchronous device-to-host copy).
        staging = _Staging(views, device)
        if staging.staged and not cfg.host_staged:
            raise RuntimeError(
                f"the engine's tensors are on {client.device}, not on the learner's {device}: "
                "zero copy needs them on the same device (or pass --host-staged)")
        views = staging.learner_views
        obs_view = views["obs"]  # (n, 4) float32
        act_view = views["actions"]  # (n, 1) int64, written by us
        rew_view = views["rewards"]  # (n,) float32
        term_view = views["terminated"]  # (n,) bool
        trunc_view = views["truncated"]  # (n,) bool
        # (n, 4) float32: each env's state before the engine's autoreset, i.e. the last
        # observation of an episode that ended this step. None: an engine without it.
        final_view = views.get("final_obs")
        # The engine's memory the learner uses in place on its device: every view but
        # the staged copies (and, host-staged, the host actions view).
        engine_device = client.device
        view_names = [name for name, v in views.items()
                      if name not in staging.staged and v.device == device]

        progress = _Progress(cfg, num_updates * batch * ranks.world, "PPO cartpole",
                             show=ranks.rank == 0)
        try:
            for update in range(num_updates):
                if cfg.anneal_lr:
                    optimizer.param_groups[0]["lr"] = cfg.lr * (1.0 - update / num_updates)

                # No host synchronisation in here on a GPU: sync_debug checks that.
                with _sync_debug(device, cfg.sync_debug):
                    for t in range(t_len):
                        obs_buf[t].copy_(obs_view)  # the frame the action is chosen on
                        with torch.no_grad():
                            logits = agent.actor(obs_buf[t])
                            val_buf[t] = agent.value(obs_buf[t])
                        dist = Categorical(logits=logits, validate_args=False)
                        action = dist.sample()
                        act_buf[t] = action
                        logp_buf[t] = dist.log_prob(action)

                        act_view.copy_(action.unsqueeze(1))  # into the engine's tensor, in place
                        client.step()  # the views now hold the next frame
                        staging.refresh()

                        rew_buf[t].copy_(rew_view)
                        done = term_view | trunc_view  # a new tensor, not a view
                        done_buf[t].copy_(done)
                        # Same-step autoreset: obs_view already holds the reset observation
                        # of the envs that ended; final_view their last one, until the next
                        # step. Time-limit truncations are bootstrapped from it (GAE then
                        # treats the step as final). With --no-bootstrap-truncated, truncation
                        # is treated as termination, as CleanRL's ppo.py does.
                        if cfg.bootstrap_truncated:
                            bootstrap_truncated(rew_buf[t], val_buf[t], term_view, trunc_view,
                                                final_view, agent.value, cfg.gamma)

                        ep_return += rew_view
                        ret_at_step[t].copy_(ep_return)
                        ep_return.masked_fill_(done, 0.0)
                # The returns of the episodes that ended in this rollout, in the order
                # they ended (step, then env): the one host read-back per update.
                finished = ranks.gather(ret_at_step[done_buf.bool()].tolist())

                with torch.no_grad():
                    adv, ret = gae(rew_buf, val_buf, done_buf, agent.value(obs_view),
                                   cfg.gamma, cfg.gae_lambda)
                ppo_update(cfg, agent, optimizer, model,
                           obs_buf.reshape(batch, 4), act_buf, logp_buf, adv, ret, minibatch)
                if progress.update(batch * ranks.world, finished):
                    break
            if cfg.report:
                _write_report(cfg, ranks, client, initial, agent, progress.env_steps)
        finally:
            progress.close()
            ranks.close()
            # Drop the views before the client closes: on a GPU the client acknowledges
            # its close (and the engine frees its memory) once no view holds it open.
            views.clear()
            staging.close()
            obs_view = act_view = rew_view = term_view = trunc_view = final_view = None
    result = progress.result(time.perf_counter() - start, str(device), engine_device, view_names)
    if cfg.plot and ranks.rank == 0:
        result.plot = _plot(cfg, result)
    return result


def _param_digest(agent) -> str:
    """SHA-256 of every parameter's bytes, in order: equal digests, equal parameters."""
    import hashlib

    h = hashlib.sha256()
    for p in agent.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _write_report(cfg: Config, ranks: "_Ranks", client, initial: str, agent, env_steps: int) -> None:
    """This rank's run as JSON (what the multi-rank test compares across ranks)."""
    import json

    doc = {
        "rank": ranks.rank,
        "world": ranks.world,
        "region": client.name,
        "shards": client.shards,
        "shard_pids": client.shard_pids,
        "frames": client.frame,  # steps this rank's engine answered
        "env_steps_all_ranks": env_steps,
        "params_initial": initial,
        "params_final": _param_digest(agent),
    }
    with open(cfg.report.format(rank=ranks.rank), "w") as f:
        json.dump(doc, f)


def _plot(cfg: Config, r: Result) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(r.curve_steps, r.curve_returns, label=f"mean return, last {cfg.window} episodes")
    if cfg.target_return is not None:
        ax.axhline(cfg.target_return, color="gray", linestyle="--", linewidth=1,
                   label=f"target {cfg.target_return:g}")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.set_ylim(0, 520)
    what = "cartpole" if cfg.env == "cartpole" else f"pixels {cfg.image}×{cfg.frame_stack}, CNN"
    ax.set_title(f"PPO on shmbridge {what} ({cfg.num_envs} envs, seed {cfg.seed}, "
                 f"{r.wall_s:.0f} s, {r.device})")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = os.path.abspath(cfg.plot)
    fig.savefig(path)
    plt.close(fig)
    return path


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where it does not depend on ``--env`` (those are None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(
        prog="shmbridge-ppo",
        description="PPO in PyTorch on the shmbridge cartpole engine (CartPole-v1 dynamics), "
                    "from its state or (--env pixels) from the frames the pixels engine renders.",
        formatter_class=_Help,
    )
    p.add_argument("--env", choices=["cartpole", "pixels"], default=d.env,
                   help="cartpole: an MLP on the state; pixels: a small CNN on the frames the "
                        "pixels engine draws (defaults then: --lr "
                        f"{PIXELS['lr']:g}, --total-steps {PIXELS['total_steps']:,}, --ent-coef "
                        f"{PIXELS['ent_coef']:g}, --update-epochs {PIXELS['update_epochs']}, "
                        f"--target-return {PIXELS['target_return']:g}, --plot {PIXELS['plot']})")
    p.add_argument("--image", default=d.image, help="pixels: the frame shape, HxWxC (C: 4 RGBA, "
                                                    "3 RGB or 1 grey)")
    p.add_argument("--frame-stack", type=int, default=d.frame_stack,
                   help="pixels: the last frames of each env the engine serves (the network's input)")
    p.add_argument("--image-device", choices=["vulkan", "host"], default=d.image_device,
                   help="pixels: where the engine draws its frames (Vulkan memory it exports, or "
                        "the region's shared memory)")
    p.add_argument("--save", default=None,
                   help="pixels: write the trained agent (torch state_dict and frame shape) here, "
                        "for examples/pixels_viewer.py ('' for none) [pixels: ppo_pixels.pt]")
    p.add_argument("--num-envs", type=int, default=d.num_envs, help="parallel environments")
    p.add_argument("--total-steps", type=int, default=None,
                   help=f"most environment steps (all envs together) [cartpole: {d.total_steps:,}]")
    p.add_argument("--seed", type=int, default=d.seed, help="torch seed and engine seed")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device,
                   help="where the learner and the engine's tensors live (cuda: GPU memory "
                        "shared through CUDA IPC, no host round trip); auto: cuda when torch "
                        "sees a GPU and shmbridge.cuda_available() says it can use it, else cpu")
    p.add_argument("--host-staged", action="store_true",
                   help="cartpole on a GPU learner: the engine's tensors in host memory, each "
                        "step copied to the GPU and the actions back (for comparing with CUDA IPC)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch CPU threads (the engine process takes a core too); 0: torch's default")
    p.add_argument("--lr", type=float, default=None, help=f"Adam learning rate [cartpole: {d.lr:g}]")
    p.add_argument("--no-anneal-lr", dest="anneal_lr", action="store_false",
                   help="keep the learning rate constant (default: linear decay to 0 over --total-steps)")
    p.add_argument("--num-steps", type=int, default=d.num_steps, help="rollout length per env")
    p.add_argument("--update-epochs", "--epochs", type=int, default=None,
                   help=f"passes over each rollout [cartpole: {d.update_epochs}]")
    p.add_argument("--num-minibatches", "--minibatches", type=int, default=d.num_minibatches)
    p.add_argument("--gamma", type=float, default=d.gamma)
    p.add_argument("--gae-lambda", type=float, default=d.gae_lambda)
    p.add_argument("--clip-coef", "--clip", type=float, default=d.clip_coef)
    p.add_argument("--ent-coef", type=float, default=None, help=f"[cartpole: {d.ent_coef:g}]")
    p.add_argument("--vf-coef", type=float, default=d.vf_coef)
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm)
    p.add_argument("--no-bootstrap-truncated", dest="bootstrap_truncated", action="store_false",
                   help="treat time-limit truncation as termination (CleanRL); default: bootstrap "
                        "from V(the episode's final observation, the engine's final_obs)")
    p.add_argument("--target-return", type=float, default=None,
                   help="stop once the mean return of the last 100 episodes reaches this; "
                        f"a negative value: never stop early [cartpole: {d.target_return:g}]")
    p.add_argument("--blocking", action="store_true",
                   help="client and engine sleep on the futex instead of spinning first")
    p.add_argument("--plot", default=None, help=f"learning-curve PNG ('' for none) [cartpole: {d.plot}]")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    p.add_argument("--shards", type=int, default=d.shards,
                   help="engine processes serving each rank's envs (cartpole, host memory)")
    p.add_argument("--engine-command", default=None,
                   help="train against this engine executable instead of the reference one "
                        "(e.g. examples/c/cartpole_engine built against libshmbridge; "
                        "'--num-envs N --seed S' is appended; host memory)")
    p.add_argument("--report", default=None,
                   help="write this rank's run as JSON to this path ({rank}: the rank)")
    return p


# `--env pixels`: the defaults that differ from CartPole's (a CNN learns slower and wants
# a smaller step; the target is a mean return of 400 within 2M steps).
PIXELS = dict(lr=7e-4, total_steps=2_000_000, ent_coef=0.01, update_epochs=4,
              target_return=400.0, plot="ppo_pixels.png", save="ppo_pixels.pt")


def main(argv: Optional[List[str]] = None) -> int:
    a = vars(_parser().parse_args(argv))
    defaults = vars(Config()) if a["env"] == "cartpole" else {**vars(Config()), **PIXELS}
    for key, value in list(a.items()):
        if value is None:
            a[key] = defaults[key]
    cfg = Config(**a)
    if cfg.target_return is not None and cfg.target_return < 0:
        cfg.target_return = None
    if not cfg.plot:
        cfg.plot = None
    if not cfg.save:
        cfg.save = None
    if cfg.engine_command and (cfg.env != "cartpole" or cfg.shards > 1
                               or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        print("shmbridge-ppo: error: --engine-command trains cartpole on one engine "
              "(no --env pixels, --shards or several ranks)", file=sys.stderr)
        return 2
    if cfg.env == "pixels" and (cfg.shards > 1 or cfg.host_staged
                                or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        print("shmbridge-ppo: error: --shards, --host-staged and several ranks train cartpole "
              "(not pixels)", file=sys.stderr)
        return 2
    try:
        if cfg.env == "pixels":
            from .ppo_pixels import train as train_pixels

            r = train_pixels(cfg)
        else:
            r = train(cfg)
    except (ValueError, shmbridge.CudaUnavailableError, shmbridge.EngineStartError) as e:
        print(f"shmbridge-ppo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shmbridge-ppo: interrupted", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # rank 0 reports the run (every rank saw the same episodes)
    if r.plot:
        print(f"learning curve: {r.plot}")
    if cfg.env == "pixels" and cfg.save:
        print(f"agent: {os.path.abspath(cfg.save)}")
    if cfg.target_return is not None:
        how = "reached" if r.reached_target else "not reached"
        print(f"target {cfg.target_return:g} {how} after {r.env_steps:,} env steps")
    print(r.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
