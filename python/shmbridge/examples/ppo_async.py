"""PPO on a shmbridge engine with asynchronous batches (EnvPool's ``recv``/``send``).

    python -m shmbridge.examples.ppo_async            # or: shmbridge-ppo-async
    python -m shmbridge.examples.ppo_async --env mujoco/HalfCheetah-v5 --normalize
    python -m shmbridge.examples.ppo_async --help

``--env``: ``cartpole`` (the default; a categorical policy) or an engine with continuous
actions (a ``box`` action space: the native MuJoCo tasks, ``mujoco/HalfCheetah-v5``, ...,
with the ``mujoco`` feature), for which the agent is CleanRL's Gaussian policy
(:func:`.ppo._agent`, ``--log-std-init``), its actions clipped to the engine's
``action_low``/``action_high`` before they are sent (as Gymnasium's ``ClipAction``: the
engine's reward charges the action it is given). ``--normalize`` normalises the
observations and the rewards with running statistics (after Gymnasium's
``NormalizeObservation`` and ``NormalizeReward``, clipped at 10: the rewards divided by
the deviation of one statistic pooled over every env's discounted return, which restarts
when its episode ends, terminated or truncated; the episode returns logged are the
engine's own).

The engine serves ``--num-envs`` envs from ``--shards`` processes (a sharded region,
``docs/async.md``); the learner never waits for all of them. ``client.recv()`` hands out
the ``--batch-size`` envs of whichever shards answered first; the current policy chooses
their next actions at once, and ``client.send(actions, env_ids)`` steps only those
shards while the others are still stepping. So the envs do not move in lock-step, and
the rollout is kept per env:

- each env has a *pending* step: the observation its last action was chosen on, that
  action, its log-probability and the value of that observation. When the env comes
  back in a batch, its reward and flags complete that step, which is appended to the
  env's own rollout (``length[e]`` steps so far), and a new pending step begins;
- an update runs once the envs' rollouts hold ``num_envs * num_steps`` steps together
  (or one env's reaches ``--max-env-steps``). GAE runs along each env's own steps, and
  each env is bootstrapped from the value of its pending observation, the one its
  rollout ended on (per-env bootstrapping: the envs ended their rollouts at different
  times, some with an action still in flight, which the next rollout completes);
- episodes cut by the time limit are bootstrapped from ``final_obs`` as in the lock-step
  example; the engine resets finished envs in the same step.

The update, GAE's recursion, the agent and the bookkeeping are the lock-step example's
(:mod:`.ppo`, :mod:`.ppo_core`); what differs is the loop and the per-env rollout.
``--check-dynamics`` verifies every completed step against CartPole's equations (the
observation its action was chosen on, the action sent, the state the engine produced):
an env's rows mixed up with another's, or an action sent to the wrong env, fail it.
``--lockstep`` steps every env at once with the same settings (for the curves side by
side): on ``cartpole`` it trains the lock-step example (refusing the flags it does not
have), on another engine (which the lock-step example does not train) this loop over
``client.step()``, every env in each batch (its actions sent before each update, so each
rollout begins with a step of the previous policy, trained on with its own
log-probability); ``--csv`` writes a run's learning curve, after every update.

Needs the ``ppo`` extra: ``torch``, ``tqdm``, ``matplotlib``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

import shmbridge

from . import ppo
from .ppo_core import (Config, Progress, Result, RunningMeanStd, bootstrap_truncated, ppo_update,
                       rollout_buffers, write_csv)


@dataclass
class AsyncConfig(Config):
    """The lock-step example's configuration, plus the asynchronous batches'."""

    num_envs: int = 16
    shards: int = 4
    batch_size: int = 8  # envs per recv(): a multiple of num_envs // shards
    max_env_steps: int = 0  # one env's rollout at most (0: 2 * num_steps)
    check_dynamics: bool = False
    plot: Optional[str] = None
    # A task the lock-step example does not train (continuous actions): this loop with
    # every env stepped at once (client.step()), for the curve beside the asynchronous one.
    lockstep: bool = False
    normalize: bool = False  # observations and rewards (Gymnasium's Normalize* wrappers)
    log_std_init: float = 0.0  # continuous actions: the Gaussian's initial log std
    csv: Optional[str] = None  # the learning curve, rewritten after every update
    log_every: int = 10  # updates between log lines


def cartpole_step(obs: np.ndarray, push_right: np.ndarray) -> np.ndarray:
    """CartPole-v1's Euler step (``src/envs/cartpole.rs``, Gymnasium's equations) from
    observations ``obs`` (m, 4) and actions (m,) (1: push right), in float64."""
    gravity, mass_pole, total_mass, length, force_mag, tau = 9.8, 0.1, 1.1, 0.5, 10.0, 0.02
    x, x_dot, theta, theta_dot = obs.astype(np.float64).T
    force = np.where(push_right != 0, force_mag, -force_mag)
    sin, cos = np.sin(theta), np.cos(theta)
    temp = (force + mass_pole * length * theta_dot ** 2 * sin) / total_mass
    theta_acc = (gravity * sin - cos * temp) / (
        length * (4.0 / 3.0 - mass_pole * cos ** 2 / total_mass))
    x_acc = temp - mass_pole * length * theta_acc * cos / total_mass
    return np.stack([x + tau * x_dot, x_dot + tau * x_acc, theta + tau * theta_dot,
                     theta_dot + tau * theta_acc], axis=1)


def per_env_gae(rewards, values, dones, length, next_value, gamma: float, lam: float):
    """GAE along each env's own steps. ``rewards``, ``values``, ``dones`` are (T, n) with
    env ``e``'s steps in rows ``0 .. length[e]``; ``next_value`` (n,) is V of the
    observation each env's rollout ended on. Returns ``(advantages, returns)``, (T, n),
    0 past each env's length."""
    import torch

    t_len = rewards.shape[0]
    steps = torch.arange(t_len, device=rewards.device).unsqueeze(1)
    valid = (steps < length.unsqueeze(0)).to(rewards.dtype)
    # The value after step t: the next step's, or, at an env's last step, its bootstrap.
    after = torch.cat([values[1:], torch.zeros_like(values[:1])])
    last_step = steps == (length - 1).unsqueeze(0)
    after = torch.where(last_step, next_value.unsqueeze(0), after)
    adv = torch.zeros_like(rewards)
    carry = torch.zeros_like(next_value)
    for t in reversed(range(t_len)):
        live = 1.0 - dones[t]
        delta = rewards[t] + gamma * after[t] * live - values[t]
        carry = (delta + gamma * lam * live * carry) * valid[t]
        adv[t] = carry
    return adv, (adv + values) * valid


class _LockStep:
    """A lock-step client in the shape of an asynchronous one, for ``--lockstep`` on a
    task the lock-step example does not train: every ``recv()`` is every env (the frame of
    the last step), and ``send()`` steps them all (``client.step(actions)``)."""

    def __init__(self, client: "shmbridge.Client") -> None:
        self.client = client
        n = client.num_envs
        self.everyone = shmbridge.Batch(client, range(n), [(0, n)])

    def recv(self) -> "shmbridge.Batch":
        return self.everyone

    def send(self, actions: np.ndarray, env_ids: List[int]) -> None:
        self.client.step(actions)


def _action_space(client: "shmbridge.Client") -> Tuple[tuple, Optional[np.ndarray], Optional[np.ndarray], int]:
    """The engine's actions: ``(shape, low, high, count)``: a Box's shape and bounds
    (``count`` 0), or a discrete action (``()``, ``None``, ``None``, its count), from the
    engine's metadata (``action_space``, ``action_low``, ``action_high``: docs/mujoco.md).
    Without ``action_space``, the ``actions`` tensor's dtype tells: floating point, a Box
    (unbounded where no bounds are given); integer, a discrete action, whose count only
    the metadata can give (``ValueError`` saying so)."""
    meta = client.schema()["metadata"]
    actions = np.asarray(client["actions"])
    kind = meta.get("action_space")
    if kind is None and not np.issubdtype(actions.dtype, np.floating):
        raise ValueError(f"the engine's actions are {actions.dtype} (discrete) but its metadata "
                         "has no action_space (discrete:N) giving their count")
    if kind is not None and kind.startswith("discrete:"):
        return (), None, None, int(kind.split(":", 1)[1])
    shape = tuple(actions.shape[1:])

    def bound(key: str, unbounded: float) -> np.ndarray:
        if key not in meta:
            return np.full(shape, unbounded, np.float32)
        return np.array([float(v) for v in meta[key].split(",")], dtype=np.float32).reshape(shape)

    return shape, bound("action_low", -np.inf), bound("action_high", np.inf), 0


def train(cfg: AsyncConfig, log=print) -> Result:
    """Trains PPO on ``cfg.env`` with asynchronous batches (or, with ``cfg.lockstep``, the
    same loop stepping every env at once); returns the outcome."""
    import torch

    if cfg.check_dynamics and (cfg.env != "cartpole" or cfg.normalize):
        raise ValueError("--check-dynamics checks CartPole's equations: the cartpole engine, "
                         "without --normalize")
    torch.set_num_threads(max(1, cfg.threads))
    torch.manual_seed(cfg.seed)
    n = cfg.num_envs
    b = n if cfg.lockstep else cfg.batch_size
    per_update = n * cfg.num_steps
    t_cap = cfg.max_env_steps or 2 * cfg.num_steps
    num_updates = max(1, math.ceil(cfg.total_steps / per_update))
    log(f"{cfg.env}: {n} envs in {cfg.shards} shards, "
        + ("lock-step" if cfg.lockstep else f"batches of {b}")
        + f"; an update every {per_update} steps (one env's rollout at most {t_cap}), "
          f"up to {num_updates} updates")

    start = time.perf_counter()
    progress = Progress(cfg, num_updates * per_update,
                        f"PPO {cfg.env}, " + ("lock-step" if cfg.lockstep else "async batches"))
    finished: List[float] = []
    update = 0
    with shmbridge.launch(cfg.env, num_envs=n, shards=cfg.shards, seed=cfg.seed,
                          blocking=cfg.blocking) as client:
        act_shape, low, high, count = _action_space(client)
        obs_dim = int(np.asarray(client["obs"]).shape[1])
        continuous = count == 0
        agent = ppo._agent(obs_dim, int(np.prod(act_shape)) if continuous else count,
                           cfg.log_std_init if continuous else None)
        optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)
        (obs_buf, act_buf, logp_buf, rew_buf, done_buf, val_buf, ep_return, _) = rollout_buffers(
            t_cap, n, (obs_dim,), torch.float32, torch.device("cpu"), act_shape,
            torch.float32 if continuous else None)
        length = torch.zeros(n, dtype=torch.long)
        # Each env's pending step: what its action in flight was chosen on (the
        # observation as the agent saw it: normalised with --normalize).
        pend_obs = torch.zeros(n, obs_dim)
        pend_act = torch.zeros((n,) + act_shape, dtype=act_buf.dtype)
        pend_logp = torch.zeros(n)
        pend_val = torch.zeros(n)
        pending = torch.zeros(n, dtype=torch.bool)
        # --normalize: after Gymnasium's NormalizeObservation and NormalizeReward, clipped
        # at 10: the reward divided by the deviation of one running statistic pooled over
        # every env's discounted return (each env's restarts when its episode ends).
        obs_rms = RunningMeanStd((obs_dim,)) if cfg.normalize else None
        ret_rms = RunningMeanStd() if cfg.normalize else None
        discounted = torch.zeros(n, dtype=torch.float64)
        # An engine without final_obs: the truncation bootstrap's stand-in (ppo_core).
        has_final = "final_obs" in client

        def seen(x: "torch.Tensor") -> "torch.Tensor":
            return x if obs_rms is None else obs_rms.normalize(x)

        if cfg.lockstep:
            envs = _LockStep(client)
        else:
            # Every env reset as the launch's frame 0 was (env i with seed + i).
            client.async_reset(b, seed=cfg.seed)
            envs = client
        try:
            while update < num_updates:
                batch = envs.recv()
                ids = torch.from_numpy(batch.env_ids.astype(np.int64))
                # Copies: the rows are the engine's again once their actions are sent.
                raw = np.array(batch.obs, dtype=np.float32)
                if obs_rms is not None:
                    obs_rms.update(torch.from_numpy(raw))
                obs = seen(torch.from_numpy(raw))
                had = pending[ids]
                if had.any():
                    e, h = ids[had], had.numpy()
                    rew = torch.from_numpy(np.array(batch.rewards[h], dtype=np.float32))
                    term = torch.from_numpy(np.array(batch.terminated[h]))
                    trunc = torch.from_numpy(np.array(batch.truncated[h]))
                    final = (torch.from_numpy(np.array(batch["final_obs"][h], dtype=np.float32))
                             if has_final else None)
                    if cfg.check_dynamics:
                        _check_steps(pend_obs[e].numpy(), pend_act[e].numpy(), final.numpy(), e.numpy())
                    reward = rew.clone()
                    if ret_rms is not None:
                        discounted[e] = discounted[e] * cfg.gamma + rew.double()
                        ret_rms.update(discounted[e])
                        reward = ret_rms.scale(reward)
                        discounted[e[term | trunc]] = 0.0
                    if cfg.bootstrap_truncated:
                        bootstrap_truncated(reward, pend_val[e], term, trunc, final,
                                            lambda x: agent.value(seen(x)), cfg.gamma)
                    pos = length[e]
                    obs_buf[pos, e] = pend_obs[e]
                    act_buf[pos, e] = pend_act[e]
                    logp_buf[pos, e] = pend_logp[e]
                    val_buf[pos, e] = pend_val[e]
                    rew_buf[pos, e] = reward
                    done_buf[pos, e] = (term | trunc).float()
                    length[e] += 1
                    ep_return[e] += rew.double()
                    ended = e[term | trunc]
                    finished.extend(ep_return[ended].tolist())
                    ep_return[ended] = 0.0
                # The next actions of these envs, from the current policy.
                with torch.no_grad():
                    head, value = agent(obs)
                    dist = agent.distribution(head)
                    action = dist.sample()
                    pend_logp[ids] = dist.log_prob(action)
                pend_obs[ids] = obs
                pend_act[ids] = action
                pend_val[ids] = value
                pending[ids] = True
                if continuous:
                    # Gymnasium's ClipAction: the engine's reward charges the action sent.
                    sent = np.clip(action.numpy(), low, high)
                else:
                    sent = action.numpy().reshape(b, 1)
                envs.send(sent, batch.env_ids.tolist())

                if int(length.sum()) >= per_update or int(length.max()) >= t_cap:
                    update += 1
                    if cfg.anneal_lr:
                        optimizer.param_groups[0]["lr"] = cfg.lr * (1.0 - (update - 1) / num_updates)
                    steps = int(length.sum())
                    with torch.no_grad():
                        adv, ret = per_env_gae(rew_buf, val_buf, done_buf, length, pend_val,
                                               cfg.gamma, cfg.gae_lambda)
                    keep = torch.arange(t_cap).unsqueeze(1) < length.unsqueeze(0)
                    ppo_update(cfg, agent, optimizer, agent, obs_buf[keep], act_buf[keep],
                               logp_buf[keep], adv[keep], ret[keep], agent.distribution,
                               act_shape)
                    length.zero_()
                    reached = progress.update(steps, finished)
                    finished = []
                    if cfg.csv:
                        write_csv(cfg.csv, progress)
                    if update % cfg.log_every == 0:
                        log(f"update {update}: {progress.env_steps:,} env steps, mean return "
                            f"{progress.mean():.1f} ({progress.episodes:,} episodes), "
                            f"{time.perf_counter() - start:.0f} s")
                    if reached:
                        break
        finally:
            progress.close()
    result = progress.result(time.perf_counter() - start, "cpu", "cpu", [])
    return result


def _check_steps(obs: np.ndarray, actions: np.ndarray, produced: np.ndarray, envs: np.ndarray) -> None:
    """``RuntimeError`` unless each env's step produced (``final_obs``, before any reset)
    what CartPole's equations give from the observation its action was chosen on."""
    expected = cartpole_step(obs, actions)
    # The engine steps in float64 and serves float32: its rounding, and ours of the obs.
    bad = ~np.isclose(produced, expected, rtol=1e-4, atol=1e-5).all(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise RuntimeError(
            f"env {int(envs[i])}: from {obs[i].tolist()} with action {int(actions[i])} the engine "
            f"produced {produced[i].tolist()}, CartPole's equations give {expected[i].tolist()}")


def _parser() -> argparse.ArgumentParser:
    d = AsyncConfig()
    p = argparse.ArgumentParser(
        prog="shmbridge-ppo-async",
        description="PPO on a shmbridge engine with asynchronous batches (recv/send over "
                    "shards, docs/async.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--env", default=d.env,
                   help="the engine: cartpole, or a continuous-action task such as "
                        "mujoco/HalfCheetah-v5 (a Gaussian policy)")
    p.add_argument("--num-envs", type=int, default=d.num_envs)
    p.add_argument("--shards", type=int, default=d.shards, help="engine processes")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="envs per recv()")
    p.add_argument("--num-steps", type=int, default=d.num_steps,
                   help="an update every num_envs * num_steps env steps")
    p.add_argument("--max-env-steps", type=int, default=d.max_env_steps,
                   help="one env's rollout at most (0: 2 * num_steps)")
    p.add_argument("--total-steps", type=int, default=d.total_steps)
    p.add_argument("--target-return", type=float, default=d.target_return,
                   help="stop once the mean return of the last 100 episodes reaches this")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam's, annealed to 0")
    p.add_argument("--num-minibatches", type=int, default=d.num_minibatches)
    p.add_argument("--normalize", action="store_true",
                   help="normalise observations and rewards (running statistics)")
    p.add_argument("--log-std-init", type=float, default=d.log_std_init,
                   help="continuous actions: the Gaussian policy's initial log std")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument("--blocking", action="store_true",
                   help="client and engines sleep on the futex instead of spinning first")
    p.add_argument("--check-dynamics", action="store_true",
                   help="check every step against CartPole's equations")
    p.add_argument("--lockstep", action="store_true",
                   help="step every env at once: on cartpole, train the lock-step example "
                        "(shmbridge.examples.ppo); on another task, this loop over "
                        "client.step(); the same envs, shards and settings")
    p.add_argument("--csv", default=None,
                   help="write the learning curve here (rewritten after every update)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    if a.lockstep and a.env == "cartpole":
        unknown = [flag for flag, given in (
            ("--normalize", a.normalize),
            ("--log-std-init", a.log_std_init != parser.get_default("log_std_init")),
            ("--check-dynamics", a.check_dynamics)) if given]
        if unknown:
            parser.error(f"--lockstep on cartpole trains the lock-step example "
                         f"(shmbridge.examples.ppo), which has no {', '.join(unknown)}")
    cfg = AsyncConfig(env=a.env, num_envs=a.num_envs, shards=a.shards, batch_size=a.batch_size,
                      num_steps=a.num_steps, max_env_steps=a.max_env_steps,
                      total_steps=a.total_steps, target_return=a.target_return, lr=a.lr,
                      num_minibatches=a.num_minibatches, normalize=a.normalize,
                      log_std_init=a.log_std_init, seed=a.seed, threads=a.threads,
                      blocking=a.blocking, check_dynamics=a.check_dynamics,
                      lockstep=a.lockstep and a.env != "cartpole", csv=a.csv,
                      progress=a.progress)
    if a.lockstep and a.env == "cartpole":
        base = {k: getattr(cfg, k) for k in Config.__dataclass_fields__}
        base.update(device="cpu", plot=None)
        r = ppo.train(Config(**base), log=print)
        if a.csv:
            write_csv(a.csv, r)
    else:
        r = train(cfg, log=print)
    print(r.summary())
    print(f"target {cfg.target_return:g} reached: {'yes' if r.reached_target else 'no'} "
          f"({r.env_steps:,} env steps)")
    if a.csv:
        print(f"learning curve: {a.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
