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

``--env pixels`` trains from rendered frames instead (:mod:`.ppo_pixels`), and
``--env mujoco/<Task>`` from the native MuJoCo engine's camera (the same module; a build
with the ``mujoco`` feature, docs/mujoco.md). ``--csv`` writes the learning curve. What the two
trainers share (the configuration, GAE, the truncation bootstrap, the update, the episode
bookkeeping, the plot) is in :mod:`.ppo_core`; this module is the state trainer and the
command line.

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
from typing import Iterator, List, Optional, Tuple

import shmbridge

from .ppo_core import (Config, Progress, Result, bootstrap_truncated, choose_device, gae,
                       orthogonal_init, plot_curve, ppo_update, rollout_buffers, write_csv)
from .ppo_pixels import train as train_pixels


def _agent(obs_dim: int, num_actions: int, log_std_init: Optional[float] = None):
    """CleanRL's agent: a categorical policy over ``num_actions`` actions or, with
    ``log_std_init``, a Gaussian one over ``num_actions`` continuous action dimensions
    (ppo_continuous_action's: the actor's output is the mean, the log standard deviation
    a parameter of its own, independent of the state, starting at ``log_std_init``)."""
    import torch
    from torch import nn
    from torch.distributions import Categorical, Independent, Normal

    def layer(n_in: int, n_out: int, std: float = math.sqrt(2)) -> nn.Linear:
        return orthogonal_init(nn.Linear(n_in, n_out), std)

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
            self.log_std = None if log_std_init is None else nn.Parameter(
                torch.full((num_actions,), float(log_std_init)))

        def value(self, x: "torch.Tensor") -> "torch.Tensor":
            return self.critic(x).squeeze(-1)

        def forward(self, x: "torch.Tensor") -> "Tuple[torch.Tensor, torch.Tensor]":
            """(logits or the Gaussian's mean, value): what the update evaluates (through
            DDP with ranks)."""
            return self.actor(x), self.value(x)

        def distribution(self, head: "torch.Tensor"):
            """The policy at ``head`` (``forward``'s first output); ``log_prob`` and
            ``entropy`` one number per sample (a Gaussian's summed over its dimensions)."""
            if self.log_std is None:
                return Categorical(logits=head, validate_args=False)
            std = self.log_std.exp().expand_as(head)
            return Independent(Normal(head, std, validate_args=False), 1, validate_args=False)

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
     ep_return, ret_at_step) = rollout_buffers(t_len, n, (4,), torch.float32, device)

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

        progress = Progress(cfg, num_updates * batch * ranks.world, "PPO cartpole",
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
                           obs_buf.reshape(batch, 4), act_buf, logp_buf, adv, ret)
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
        result.plot = plot_curve(cfg, result)
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
                    "from its state, (--env pixels) from the frames the pixels engine renders or "
                    "(--env mujoco/<Task>) from the native MuJoCo engine's camera.",
        formatter_class=_Help,
    )
    p.add_argument("--env", type=_env_name, default=d.env,
                   help="cartpole: an MLP on the state; pixels: a small CNN on the frames the "
                        "pixels engine draws (defaults then: --lr "
                        f"{PIXELS['lr']:g}, --total-steps {PIXELS['total_steps']:,}, --ent-coef "
                        f"{PIXELS['ent_coef']:g}, --update-epochs {PIXELS['update_epochs']}, "
                        f"--target-return {PIXELS['target_return']:g}, --plot {PIXELS['plot']}); "
                        "mujoco/<Task> (a build with the mujoco feature): the same CNN with a "
                        "Gaussian head on the native MuJoCo engine's camera (defaults then: "
                        + ", ".join(f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float)
                                    else f"--{k.replace('_', '-')} {v}"
                                    for k, v in MUJOCO_PIXELS.items() if v != "") + ")")
    p.add_argument("--image", default=None, help="pixels: the frame shape, HxWxC (C: 4 RGBA, "
                                                 f"3 RGB or 1 grey) [{d.image}]; mujoco: the "
                                                 "camera's, HxWx3")
    p.add_argument("--frame-stack", type=int, default=d.frame_stack,
                   help="pixels: the last frames of each env the engine serves (the network's "
                        "input); mujoco: those the learner stacks")
    p.add_argument("--camera", default=None,
                   help="mujoco: the model's camera (default: track; InvertedPendulum-v5: cart, "
                        "a camera the learner adds to its model)")
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
    p.add_argument("--num-steps", type=int, default=None, help=f"rollout length per env [{d.num_steps}]")
    p.add_argument("--update-epochs", "--epochs", type=int, default=None,
                   help=f"passes over each rollout [cartpole: {d.update_epochs}]")
    p.add_argument("--num-minibatches", "--minibatches", type=int, default=None,
                   help=f"[{d.num_minibatches}]")
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
    p.add_argument("--csv", default=None,
                   help="write the learning curve here (env_steps, train_mean: the mean return "
                        "of the last 100 episodes after each update)")
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
# `--env mujoco/<Task>`: InvertedPendulum-v5 from its 64x64 camera (docs/mujoco.md).
MUJOCO_PIXELS = dict(image="64x64x3", lr=3e-4, total_steps=1_000_000, ent_coef=0.0,
                     update_epochs=10, num_minibatches=8, num_steps=64, target_return=400.0,
                     plot="ppo_pixels_mujoco.png", save="")


def _env_name(name: str) -> str:
    """``--env``: cartpole, pixels or mujoco/<Task>."""
    if name in ("cartpole", "pixels") or (name.startswith("mujoco/") and len(name) > 7):
        return name
    raise argparse.ArgumentTypeError(f"{name!r}: expected cartpole, pixels or mujoco/<Task>")


def main(argv: Optional[List[str]] = None) -> int:
    a = vars(_parser().parse_args(argv))
    csv = a.pop("csv")
    defaults = {**vars(Config()), **{"cartpole": {}, "pixels": PIXELS}.get(a["env"], MUJOCO_PIXELS)}
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
    if cfg.env != "cartpole" and (cfg.shards > 1 or cfg.host_staged
                                  or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        print("shmbridge-ppo: error: --shards, --host-staged and several ranks train cartpole "
              "(not pixels)", file=sys.stderr)
        return 2
    try:
        if cfg.env != "cartpole":
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
    if csv:
        write_csv(csv, r)
        print(f"learning curve: {csv}")
    if cfg.env == "pixels" and cfg.save:
        print(f"agent: {os.path.abspath(cfg.save)}")
    if cfg.target_return is not None:
        how = "reached" if r.reached_target else "not reached"
        print(f"target {cfg.target_return:g} {how} after {r.env_steps:,} env steps")
    print(r.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
