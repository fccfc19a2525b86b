"""The pieces of PPO that both trainers of ``shmbridge-ppo`` use: the state trainer
(:mod:`.ppo`, an MLP on the ``cartpole`` engine's state) and the pixels trainer
(:mod:`.ppo_pixels`, a CNN on the ``pixels`` engine's frames or a MuJoCo engine's camera). Each trainer owns its
agent, its views of the engine's tensors and its rollout loop; what is here knows
nothing of either: the run's configuration and outcome, the device choice, the rollout
buffers, GAE, the bootstrap of episodes cut by the time limit, the clipped-surrogate
update, the episode bookkeeping with its progress bar, and the learning-curve plot.

Needs the ``ppo`` extra: ``torch``, ``tqdm``, ``matplotlib`` (each imported where used).
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Optional, Tuple

import shmbridge


@dataclass
class Config:
    """Hyperparameters and run options; the defaults are the command line's defaults."""

    # cartpole (from the state) | pixels (from rendered frames) | mujoco/<Task> (from the
    # native MuJoCo engine's camera)
    env: str = "cartpole"
    image: str = "48x48x1"  # pixels: the frame shape the engine draws (HxWxC; C 4, 3 or 1: grey; mujoco: HxWx3)
    frame_stack: int = 2  # pixels: frames per env in the engine's stack (mujoco: in the learner's)
    camera: Optional[str] = None  # mujoco/<Task>: the model's camera (None: the task's default)
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


def categorical(logits):
    """The policy of a discrete action: a categorical distribution over ``logits``."""
    from torch.distributions import Categorical

    return Categorical(logits=logits, validate_args=False)


def ppo_update(cfg: "Config", agent, optimizer, evaluate, obs, actions, logp, adv, ret,
               distribution=categorical, action_shape: tuple = ()) -> None:
    """``cfg.update_epochs`` passes of clipped-surrogate PPO over a rollout, each in
    ``cfg.num_minibatches`` shuffled minibatches. ``evaluate(obs) -> (head, value)``;
    ``obs`` is (batch, ...), the other rollout tensors ``(T, n)`` (actions ``(T, n,
    *action_shape)``), flattened here. ``distribution(head)``: the policy's distribution,
    whose ``log_prob`` and ``entropy`` give one number per sample (default:
    :func:`categorical` over the logits ``head``).

    The minibatches are near-equal (``torch.tensor_split`` of the permutation: sizes
    differ by one at most; a batch that divides evenly gives the slices of
    ``batch // num_minibatches`` in order), and never of a single sample, whose
    advantage has no standard deviation to normalise with (fewer minibatches then: at
    most ``batch // 2``). ``ValueError`` for a batch of fewer than 2 samples."""
    import torch

    batch = obs.shape[0]
    if batch < 2:
        raise ValueError(f"a PPO update over {batch} sample(s): the advantages are normalised "
                         "over each minibatch, which needs 2 samples at least")
    chunks = min(cfg.num_minibatches, batch // 2)
    b_act, b_logp = actions.reshape((batch,) + tuple(action_shape)), logp.reshape(batch)
    b_adv, b_ret = adv.reshape(batch), ret.reshape(batch)
    for _ in range(cfg.update_epochs):
        perm = torch.randperm(batch, device=obs.device)
        for mb in torch.tensor_split(perm, chunks):
            head, value = evaluate(obs[mb])
            dist = distribution(head)
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
    shm_ok, shm_why = shmbridge.cuda_status()
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


def orthogonal_init(module, std: float = math.sqrt(2)):
    """``module`` with orthogonal weights of gain ``std`` and zero biases (CleanRL's init)."""
    from torch import nn

    nn.init.orthogonal_(module.weight, std)
    nn.init.zeros_(module.bias)
    return module


def rollout_buffers(t_len: int, n: int, obs_shape: tuple, obs_dtype, device,
                    action_shape: tuple = (), action_dtype=None) -> tuple:
    """A rollout's buffers on the learner's device: observations ``(t_len, n, *obs_shape)``
    of ``obs_dtype``, actions ``(t_len, n, *action_shape)`` of ``action_dtype`` (default
    int64: one discrete action per env), log-probabilities, rewards, dones, values; then the episode
    bookkeeping: each env's return so far and, at each step, that return as it stood
    (kept where the episode ended: read back once per update)."""
    import torch

    steps = (t_len, n)
    return (
        torch.zeros(steps + tuple(obs_shape), dtype=obs_dtype, device=device),
        torch.zeros(steps + tuple(action_shape), dtype=action_dtype or torch.long, device=device),
        torch.zeros(steps, device=device),
        torch.zeros(steps, device=device),
        torch.zeros(steps, device=device),
        torch.zeros(steps, device=device),
        torch.zeros(n, dtype=torch.float64, device=device),
        torch.zeros(steps, dtype=torch.float64, device=device),
    )


class RunningMeanStd:
    """The running mean and variance of the samples seen (batches merged as Chan et al.'s
    parallel algorithm does), as Gymnasium's ``NormalizeObservation`` and
    ``NormalizeReward`` keep them; float64, on the CPU."""

    def __init__(self, shape: tuple = ()) -> None:
        import torch

        self.mean = torch.zeros(shape, dtype=torch.float64)
        self.var = torch.ones(shape, dtype=torch.float64)
        self.count = 1e-4  # Gymnasium's epsilon: the prior (mean 0, variance 1) weighs little

    def update(self, x) -> None:
        """Adds the samples ``x``, ``(m, *shape)``."""
        m = x.shape[0]
        if m == 0:
            return
        x = x.double()
        mean, var = x.mean(0), x.var(0, unbiased=False)
        delta, total = mean - self.mean, self.count + m
        self.mean = self.mean + delta * (m / total)
        self.var = (self.var * self.count + var * m + delta.pow(2) * (self.count * m / total)) / total
        self.count = total

    def normalize(self, x, clip: float = 10.0):
        """``x`` centred and scaled by the statistics so far, clipped to ``[-clip, clip]``; float32."""
        return ((x.double() - self.mean) / (self.var + 1e-8).sqrt()).clamp(-clip, clip).float()

    def scale(self, x, clip: float = 10.0):
        """``x`` divided by the standard deviation so far (not centred), clipped; float32."""
        return (x.double() / (self.var + 1e-8).sqrt()).clamp(-clip, clip).float()


class Progress:
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


def write_csv(path: str, r: Result) -> None:
    """The learning curve: env steps, and the mean return of the last 100 episodes."""
    with open(path, "w") as f:
        f.write("env_steps,train_mean\n")
        for s, m in zip(r.curve_steps, r.curve_returns):
            f.write(f"{s},{m:.1f}\n")


def plot_curve(cfg: Config, r: Result) -> str:
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
    ax.set_ylim(0, 1040 if cfg.env.startswith("mujoco/") else 520)
    what = ("cartpole" if cfg.env == "cartpole"
            else f"{cfg.env.replace('mujoco/', '')} pixels {cfg.image}×{cfg.frame_stack}, CNN")
    ax.set_title(f"PPO on shmbridge {what}\n({cfg.num_envs} envs, seed {cfg.seed}, "
                 f"{r.wall_s:.0f} s, {r.device})", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = os.path.abspath(cfg.plot)
    fig.savefig(path)
    plt.close(fig)
    return path
