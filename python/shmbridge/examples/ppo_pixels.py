"""PPO from pixels on the reference ``pixels`` engine (``shmbridge-ppo --env pixels``).

The engine steps CartPole as the ``cartpole`` engine does and draws each env's state into
a stack of its last ``--frame-stack`` frames, ``rgb`` (``[N, K, H, W, C]`` u8, oldest
first; a new episode's stack holds only its own frames), with a compute shader in Vulkan
memory it exports (or, ``--image-device host``, in the region). The learner reads that
stack through a zero-copy ``torch.from_dlpack`` view of the client's import (kDLCPU
through a Vulkan device of its own; kDLCUDA where the CUDA importer serves it), never the
state, and feeds it to a small CNN (two convolutions, one hidden layer, actor and critic
heads) as ``K * C'`` uint8 channels (RGB without alpha, or grey): the stack shows the
velocities one frame cannot. The one copy per step is the uint8 stack into the rollout
buffer (the engine overwrites its memory at the next step); the network converts to
float on use. Episodes cut by the time limit are bootstrapped from the value of the
observation before the cut (the engine's ``final_obs`` is a state, not pixels).

The defaults (``--image 48x48x1 --frame-stack 2``, see ``PIXELS`` in ``ppo.py``) train
to a mean return of 400 over the last 100 episodes on a 2-core CPU; ``README.md`` gives
the figures.
"""

from __future__ import annotations

import math
import time

import shmbridge

from .ppo_core import (Config, Progress, Result, bootstrap_truncated, choose_device, gae,
                       orthogonal_init, plot_curve, ppo_update, rollout_buffers)


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
            """``x``: (B, C, H, W) uint8 frames; returns (logits, value). The input is
            inverted (the white background 0, what is drawn positive): it learns sooner."""
            h = self.hidden(self.trunk(1.0 - x.float() / 255.0))
            return self.actor(h), self.critic(h).squeeze(-1)

        def value(self, x: "torch.Tensor") -> "torch.Tensor":
            return self.evaluate(x)[1]

    return Agent()


def save_agent(path: str, agent, cfg: Config) -> None:
    """Writes the agent's parameters and what it was trained on (the engine's frame shape
    and stack), for :func:`load_agent`."""
    import torch

    torch.save({"state_dict": agent.state_dict(), "image": cfg.image,
                "frame_stack": cfg.frame_stack, "seed": cfg.seed}, path)


def load_agent(path: str):
    """``(agent, image, frame_stack)`` from a file :func:`save_agent` wrote (the agent on
    the CPU, in eval mode)."""
    import torch

    saved = torch.load(path, map_location="cpu", weights_only=True)
    h, w, c = (int(v) for v in saved["image"].split("x"))
    agent = _agent(saved["frame_stack"] * min(c, 3), h, w, 2)
    agent.load_state_dict(saved["state_dict"])
    return agent.eval(), saved["image"], saved["frame_stack"]


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


def stack_channels(rgb: "torch.Tensor") -> "torch.Tensor":
    """The engine's ``[N, K, H, W, C]`` stack as ``[N, K, C', H, W]``: a view of the same
    memory (no copy), RGB without alpha for colour frames, the grey channel alone for
    C = 1. Flattened to ``[N, K * C', H, W]`` it is the network's input: still a view for
    grey frames; the rollout buffer's copy gathers colour ones."""
    c = rgb.shape[-1]
    return rgb[..., :min(c, 3)].permute(0, 1, 4, 2, 3)


def train(cfg: Config, log=print) -> Result:
    """Trains PPO from the ``pixels`` engine's frames; returns the outcome (and writes
    the plot)."""
    import torch
    from torch.distributions import Categorical

    where, why = choose_device(cfg.device)
    device = torch.device(where)
    log(f"device: {device} for the learner ({why}); the engine steps on the host and "
        f"draws its frames {'on the host' if cfg.image_device == 'host' else 'with Vulkan'}")
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    n, t_len = cfg.num_envs, cfg.num_steps
    batch = n * t_len
    if batch % cfg.num_minibatches:
        raise ValueError(f"num_envs * num_steps ({batch}) is not a multiple of num_minibatches")
    num_updates = max(1, math.ceil(cfg.total_steps / batch))

    start = time.perf_counter()
    with shmbridge.launch("pixels", num_envs=n, device="cpu", seed=cfg.seed, image=cfg.image,
                          frame_stack=cfg.frame_stack, image_device=cfg.image_device,
                          blocking=cfg.blocking) as client:
        views = _views(client)
        rgb_view = views["rgb"]  # (n, K, H, W, C) uint8: the engine's stacks, in place
        act_view = views["actions"]
        rew_view, term_view, trunc_view = views["rewards"], views["terminated"], views["truncated"]
        frames = stack_channels(rgb_view)  # (n, K, C', H, W): a view of the same memory
        _, k, per_frame, height, width = frames.shape
        channels = k * per_frame
        where = client.importer or "the region's shared memory"
        log(f"frames: {tuple(rgb_view.shape)} u8 on {rgb_view.device} ({where}): "
            f"{channels} input channels of {height}x{width}; {n} envs x {t_len} steps = "
            f"{batch} per update, up to {num_updates} updates")

        agent = _agent(channels, height, width, 2).to(device)
        optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)
        (obs_buf, act_buf, logp_buf, rew_buf, done_buf, val_buf, ep_return,
         ret_at_step) = rollout_buffers(t_len, n, (channels, height, width), torch.uint8, device)

        progress = Progress(cfg, num_updates * batch, "PPO pixels")
        try:
            for update in range(num_updates):
                if cfg.anneal_lr:
                    optimizer.param_groups[0]["lr"] = cfg.lr * (1.0 - update / num_updates)
                for t in range(t_len):
                    # The stacks the action is chosen on, into the rollout (uint8, the one
                    # copy: the engine draws the next frame into the same memory).
                    obs_buf[t].view(n, k, per_frame, height, width).copy_(frames)
                    with torch.no_grad():
                        logits, val_buf[t] = agent.evaluate(obs_buf[t])
                    dist = Categorical(logits=logits, validate_args=False)
                    action = dist.sample()
                    act_buf[t] = action
                    logp_buf[t] = dist.log_prob(action)
                    act_view.copy_(action.unsqueeze(1))
                    client.step()  # rgb_view now holds the next stacks
                    rew_buf[t].copy_(rew_view)
                    done = (term_view | trunc_view).to(device)
                    done_buf[t].copy_(done)
                    if cfg.bootstrap_truncated:
                        bootstrap_truncated(rew_buf[t], val_buf[t], term_view, trunc_view, None,
                                            agent.value, cfg.gamma)
                    ep_return += rew_view.to(device)
                    ret_at_step[t].copy_(ep_return)
                    ep_return.masked_fill_(done, 0.0)
                finished = ret_at_step[done_buf.bool()].tolist()
                with torch.no_grad():
                    next_value = agent.value(frames.reshape(n, channels, height, width).to(device))
                    adv, ret = gae(rew_buf, val_buf, done_buf, next_value, cfg.gamma, cfg.gae_lambda)
                ppo_update(cfg, agent, optimizer, agent.evaluate,
                           obs_buf.reshape(batch, channels, height, width), act_buf, logp_buf,
                           adv, ret)
                if progress.update(batch, finished):
                    break
        finally:
            progress.close()
            views.clear()
            rgb_view = frames = act_view = rew_view = term_view = trunc_view = None
    result = progress.result(time.perf_counter() - start, str(device), "cpu",
                             ["rgb", "actions", "rewards", "terminated", "truncated"])
    if cfg.save:
        save_agent(cfg.save, agent, cfg)
    if cfg.plot:
        result.plot = plot_curve(cfg, result)
    return result
