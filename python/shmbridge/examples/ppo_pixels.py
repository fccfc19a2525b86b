"""PPO from pixels on the reference ``pixels`` engine (``shmbridge-ppo --env pixels``).

The engine steps CartPole as the ``cartpole`` engine does and renders each env's state
with a compute shader into ``rgb`` (``[N, H, W, 4]`` u8), Vulkan memory it exports. The
learner reads those frames through a zero-copy ``torch.from_dlpack`` view of the
client's import (kDLCPU through a Vulkan device of its own; kDLCUDA where the CUDA
importer serves it), never the state: a small CNN (two convolutions, one hidden layer,
actor and critic heads) sees the last two frames stacked (six channels, RGB), since one
frame does not show the velocities. Episodes cut by the time limit count as ended (no
bootstrap from a final observation: the engine's ``final_obs`` is a state, not pixels).

An option of the main job, not its target: no return is asserted, it trains for
``--total-steps`` and plots the curve (``--plot``, default ``ppo_pixels.png``).
"""

from __future__ import annotations

import math
import time

import shmbridge

from .ppo_core import (Config, Progress, Result, choose_device, gae, orthogonal_init, plot_curve,
                       ppo_update, rollout_buffers)


def _agent(channels: int, height: int, width: int, num_actions: int):
    import torch
    from torch import nn

    class Agent(nn.Module):
        """Conv 8x8/4 (16), conv 4x4/2 (32), dense 256, then actor and critic heads."""

        def __init__(self) -> None:
            super().__init__()
            self.trunk = nn.Sequential(
                orthogonal_init(nn.Conv2d(channels, 16, 8, stride=4)), nn.ReLU(),
                orthogonal_init(nn.Conv2d(16, 32, 4, stride=2)), nn.ReLU(),
                nn.Flatten(),
            )
            with torch.no_grad():
                flat = self.trunk(torch.zeros(1, channels, height, width)).shape[1]
            self.hidden = nn.Sequential(orthogonal_init(nn.Linear(flat, 256)), nn.ReLU())
            self.actor = orthogonal_init(nn.Linear(256, num_actions), 0.01)
            self.critic = orthogonal_init(nn.Linear(256, 1), 1.0)

        def evaluate(self, x: "torch.Tensor"):
            """``x``: (B, C, H, W) uint8 frames; returns (logits, value)."""
            h = self.hidden(self.trunk(x.float() / 255.0))
            return self.actor(h), self.critic(h).squeeze(-1)

        def value(self, x: "torch.Tensor") -> "torch.Tensor":
            return self.evaluate(x)[1]

    return Agent()


def _views(client: "shmbridge.Client") -> dict:
    """Zero-copy torch views of the engine's tensors this learner uses, each checked to
    be the tensor's own memory (the same ``data_ptr``)."""
    import torch

    views = {}
    for name in ("rgb", "actions", "rewards", "terminated", "truncated"):
        views[name] = torch.from_dlpack(client[name])
        if views[name].data_ptr() != client[name].data_ptr:
            raise RuntimeError(f"torch.from_dlpack(client[{name!r}]) is a copy "
                               f"({views[name].data_ptr():#x} != {client[name].data_ptr:#x})")
    return views


def train(cfg: Config, log=print) -> Result:
    """Trains PPO from the ``pixels`` engine's frames; returns the outcome (and writes
    the plot)."""
    import torch
    from torch.distributions import Categorical

    where, why = choose_device(cfg.device)
    device = torch.device(where)
    log(f"device: {device} for the learner ({why}); the engine steps on the host and "
        f"renders with Vulkan")
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    n, t_len = cfg.num_envs, cfg.num_steps
    batch = n * t_len
    if batch % cfg.num_minibatches:
        raise ValueError(f"num_envs * num_steps ({batch}) is not a multiple of num_minibatches")
    minibatch = batch // cfg.num_minibatches
    num_updates = max(1, math.ceil(cfg.total_steps / batch))

    start = time.perf_counter()
    with shmbridge.launch("pixels", num_envs=n, device="cpu", seed=cfg.seed, image=cfg.image,
                          blocking=cfg.blocking) as client:
        views = _views(client)
        rgb_view = views["rgb"]  # (n, H, W, 4) uint8: the engine's Vulkan frame, imported
        act_view = views["actions"]
        rew_view, term_view, trunc_view = views["rewards"], views["terminated"], views["truncated"]
        _, height, width, _ = rgb_view.shape
        log(f"frames: {tuple(rgb_view.shape)} u8 on {rgb_view.device} ({client.importer}); "
            f"{n} envs x {t_len} steps = {batch} per update, up to {num_updates} updates")

        def frame() -> "torch.Tensor":
            # (n, 3, H, W) uint8 on the learner's device: the one copy, into the learner.
            return rgb_view[..., :3].permute(0, 3, 1, 2).to(device, copy=True)

        agent = _agent(6, height, width, 2).to(device)
        optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)
        (obs_buf, act_buf, logp_buf, rew_buf, done_buf, val_buf, ep_return,
         ret_at_step) = rollout_buffers(t_len, n, (6, height, width), torch.uint8, device)

        cur = frame()
        prev = cur.clone()  # a fresh episode: no motion yet
        progress = Progress(cfg, num_updates * batch, "PPO pixels")
        try:
            for update in range(num_updates):
                if cfg.anneal_lr:
                    optimizer.param_groups[0]["lr"] = cfg.lr * (1.0 - update / num_updates)
                for t in range(t_len):
                    obs_buf[t, :, :3] = prev
                    obs_buf[t, :, 3:] = cur
                    with torch.no_grad():
                        logits, val_buf[t] = agent.evaluate(obs_buf[t])
                    dist = Categorical(logits=logits, validate_args=False)
                    action = dist.sample()
                    act_buf[t] = action
                    logp_buf[t] = dist.log_prob(action)
                    act_view.copy_(action.unsqueeze(1))
                    client.step()  # rgb_view now holds the next frames
                    rew_buf[t].copy_(rew_view)
                    done = (term_view | trunc_view).to(device)
                    done_buf[t].copy_(done)
                    ep_return += rew_buf[t]
                    ret_at_step[t].copy_(ep_return)
                    ep_return.masked_fill_(done, 0.0)
                    new = frame()
                    # An env that was reset starts its stack from its first frame.
                    prev = torch.where(done.view(n, 1, 1, 1), new, cur)
                    cur = new
                finished = ret_at_step[done_buf.bool()].tolist()
                with torch.no_grad():
                    next_obs = torch.cat((prev, cur), dim=1)
                    adv, ret = gae(rew_buf, val_buf, done_buf, agent.value(next_obs),
                                   cfg.gamma, cfg.gae_lambda)
                ppo_update(cfg, agent, optimizer, agent.evaluate,
                           obs_buf.reshape(batch, 6, height, width), act_buf, logp_buf, adv, ret,
                           minibatch)
                if progress.update(batch, finished):
                    break
        finally:
            progress.close()
            views.clear()
            rgb_view = act_view = rew_view = term_view = trunc_view = None
    result = progress.result(time.perf_counter() - start, str(device), "cpu",
                             ["rgb", "actions", "rewards", "terminated", "truncated"])
    if cfg.plot:
        result.plot = plot_curve(cfg, result)
    return result
