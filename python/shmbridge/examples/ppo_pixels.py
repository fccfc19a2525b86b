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

``--env mujoco/<Task>`` (a build with the ``mujoco`` feature, docs/mujoco.md) trains from
the native MuJoCo engine's camera instead: ``rgb`` (``[N, H, W, 3]`` u8, the region's
memory, read through a zero-copy view as above) holds each env's current frame only, so
the learner keeps the stack of the last ``--frame-stack`` frames itself (a new episode's
stack holds only its first frame, as the ``pixels`` engine's does), and the actions are
continuous: a Gaussian head (a state-independent log standard deviation per action, the
mean from the network), sampled as they are (MuJoCo clamps ``ctrl`` to the actuators'
``ctrlrange``). InvertedPendulum-v5's model has no camera: for it the learner serves the
engine Gymnasium's ``inverted_pendulum.xml`` with one camera added, ``cart`` (on the
cart, 1.6 m in front of it, looking at it: it follows the cart, and the rail's ends come
into view near the rail's limits), through ``SHMBRIDGE_MUJOCO_ASSETS``; a camera moves
nothing, so the task is Gymnasium's. ``MUJOCO_PIXELS`` in ``ppo.py`` has the defaults.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from typing import Iterator

import shmbridge

from .ppo_core import (Config, Progress, Result, bootstrap_truncated, categorical,
                       choose_device, gae, orthogonal_init, plot_curve, ppo_update,
                       rollout_buffers)

# The camera the learner adds to InvertedPendulum-v5's model (which has none): on the cart,
# 1.6 m in front of it at 0.25 m (the pole's middle), looking at it (+y, z up).
PENDULUM_CAMERA = '<camera name="cart" pos="0 -1.6 0.25" xyaxes="1 0 0 0 0 1"/>'
_CART_BODY = '<body name="cart" pos="0 0 0">'


def _agent(channels: int, height: int, width: int, num_actions: int, continuous: bool = False):
    """The CNN. ``continuous``: a Gaussian policy over ``num_actions`` numbers (the actor's
    output is the mean; ``log_std`` a parameter of its own), for frames on a black
    background (MuJoCo's); else logits over ``num_actions`` choices, for the ``pixels``
    engine's frames on white."""
    import torch
    from torch import nn
    from torch.distributions import Independent, Normal

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
            if continuous:
                self.log_std = nn.Parameter(torch.zeros(num_actions))

        def evaluate(self, x: "torch.Tensor"):
            """``x``: (B, C, H, W) uint8 frames; returns (logits or mean, value). The
            background is 0 (a white one inverted, what is drawn positive): it learns
            sooner."""
            x = x.float() / 255.0
            h = self.hidden(self.trunk(x if continuous else 1.0 - x))
            return self.actor(h), self.critic(h).squeeze(-1)

        def distribution(self, head: "torch.Tensor"):
            """The policy of :meth:`evaluate`'s first output."""
            if continuous:
                return Independent(Normal(head, self.log_std.exp(), validate_args=False), 1)
            return categorical(head)

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


def _pendulum_with_camera(folder: str) -> str:
    """Writes InvertedPendulum-v5's model file (Gymnasium's, from the folder the engine
    reads) with :data:`PENDULUM_CAMERA` added on the cart into ``folder``; returns it."""
    from shmbridge.__main__ import mujoco_assets

    assets = mujoco_assets()
    if assets is None:
        raise ValueError("mujoco/InvertedPendulum-v5 from pixels: no gymnasium installed and "
                         "SHMBRIDGE_MUJOCO_ASSETS not set (the model file is Gymnasium's)")
    with open(os.path.join(assets, "inverted_pendulum.xml")) as f:
        xml = f.read()
    if xml.count(_CART_BODY) != 1:
        raise ValueError(f"{assets}/inverted_pendulum.xml: no {_CART_BODY} to put the camera on")
    with open(os.path.join(folder, "inverted_pendulum.xml"), "w") as f:
        f.write(xml.replace(_CART_BODY, _CART_BODY + PENDULUM_CAMERA))
    return folder


@contextlib.contextmanager
def _launch(cfg: Config, n: int) -> Iterator["shmbridge.Client"]:
    """The engine of ``cfg.env``: the ``pixels`` engine, or the MuJoCo task with its
    camera at ``cfg.image``'s size (InvertedPendulum-v5: :data:`PENDULUM_CAMERA`, its
    model read from a folder of its own while the engine starts)."""
    if cfg.env == "pixels":
        with shmbridge.launch("pixels", num_envs=n, device="cpu", seed=cfg.seed, image=cfg.image,
                              frame_stack=cfg.frame_stack, image_device=cfg.image_device,
                              blocking=cfg.blocking) as client:
            yield client
        return
    h, w, c = (int(v) for v in cfg.image.split("x"))
    if c != 3:
        raise ValueError(f"--image {cfg.image}: the MuJoCo camera draws RGB (HxWx3)")
    pendulum = cfg.env == "mujoco/InvertedPendulum-v5"
    camera = cfg.camera or ("cart" if pendulum else "track")
    args = dict(num_envs=n, seed=cfg.seed, camera=camera, camera_size=f"{h}x{w}",
                blocking=cfg.blocking)
    if pendulum and camera == "cart":
        with tempfile.TemporaryDirectory() as folder, \
                _environ("SHMBRIDGE_MUJOCO_ASSETS", _pendulum_with_camera(folder)):
            client = shmbridge.launch(cfg.env, **args)  # it has read the model when it returns
    else:
        client = shmbridge.launch(cfg.env, **args)
    with client:
        yield client


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` (what a started engine inherits) while in the block."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


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
    """Trains PPO from the frames of ``cfg.env`` (the ``pixels`` engine, or a MuJoCo
    task's camera); returns the outcome (and writes the plot)."""
    import torch

    mujoco = cfg.env.startswith("mujoco/")
    if mujoco and cfg.save:
        raise ValueError("--save keeps an agent of the pixels engine (for examples/pixels_viewer.py), "
                         f"not of {cfg.env}")
    where, why = choose_device(cfg.device)
    device = torch.device(where)
    drawn = ("by MuJoCo's renderer into the region" if mujoco
             else "on the host" if cfg.image_device == "host" else "with Vulkan")
    log(f"device: {device} for the learner ({why}); the engine steps on the host and "
        f"draws its frames {drawn}")
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    n, t_len = cfg.num_envs, cfg.num_steps
    batch = n * t_len
    if batch % cfg.num_minibatches:
        raise ValueError(f"num_envs * num_steps ({batch}) is not a multiple of num_minibatches")
    num_updates = max(1, math.ceil(cfg.total_steps / batch))

    start = time.perf_counter()
    with _launch(cfg, n) as client:
        views = _views(client)
        rgb_view = views["rgb"]  # pixels: (n, K, H, W, C) stacks; mujoco: (n, H, W, 3) frames
        act_view = views["actions"]
        rew_view, term_view, trunc_view = views["rewards"], views["terminated"], views["truncated"]
        if mujoco:
            # (n, 1, 3, H, W): a view of the engine's frame; the learner's stack of the
            # last K of them, oldest first, is what the network sees.
            frames = stack_channels(rgb_view.unsqueeze(1))
            k = cfg.frame_stack
            if k < 1:
                raise ValueError(f"--frame-stack {k}: at least 1")
            seen = frames.repeat(1, k, 1, 1, 1).to(device)
        else:
            frames = stack_channels(rgb_view)  # (n, K, C', H, W): a view of the same memory
            seen = frames
        _, k, per_frame, height, width = seen.shape
        channels = k * per_frame
        act_shape = tuple(act_view.shape[1:]) if mujoco else ()
        num_actions = act_shape[0] if mujoco else 2
        where = client.importer or "the region's shared memory"
        log(f"frames: {tuple(rgb_view.shape)} u8 on {rgb_view.device} ({where}): "
            f"{channels} input channels of {height}x{width}"
            f"{f' (the last {k} frames, stacked by the learner)' if mujoco else ''}; "
            f"{n} envs x {t_len} steps = {batch} per update, up to {num_updates} updates")

        agent = _agent(channels, height, width, num_actions, continuous=mujoco).to(device)
        optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)
        (obs_buf, act_buf, logp_buf, rew_buf, done_buf, val_buf, ep_return,
         ret_at_step) = rollout_buffers(t_len, n, (channels, height, width), torch.uint8, device,
                                        act_shape, torch.float32 if act_shape else None)

        progress = Progress(cfg, num_updates * batch, "PPO pixels")
        try:
            for update in range(num_updates):
                if cfg.anneal_lr:
                    optimizer.param_groups[0]["lr"] = cfg.lr * (1.0 - update / num_updates)
                for t in range(t_len):
                    # The stacks the action is chosen on, into the rollout (uint8, the one
                    # copy: the engine draws the next frame into the same memory).
                    obs_buf[t].view(n, k, per_frame, height, width).copy_(seen)
                    with torch.no_grad():
                        head, val_buf[t] = agent.evaluate(obs_buf[t])
                        dist = agent.distribution(head)
                        action = dist.sample()
                        act_buf[t] = action
                        logp_buf[t] = dist.log_prob(action)
                    act_view.copy_(action if mujoco else action.unsqueeze(1))
                    client.step()  # rgb_view now holds the next frames
                    rew_buf[t].copy_(rew_view)
                    ended = term_view | trunc_view
                    done = ended.to(device)
                    done_buf[t].copy_(done)
                    if mujoco:
                        # The next stack: shifted by one, the new frame last; an env reset
                        # in this step starts its stack afresh from its first frame.
                        seen[:, :-1] = seen[:, 1:].clone()
                        seen[:, -1:] = frames
                        if ended.any():
                            seen[done] = frames[ended].to(device).expand(-1, k, -1, -1, -1)
                    if cfg.bootstrap_truncated:
                        bootstrap_truncated(rew_buf[t], val_buf[t], term_view, trunc_view, None,
                                            agent.value, cfg.gamma)
                    ep_return += rew_view.to(device)
                    ret_at_step[t].copy_(ep_return)
                    ep_return.masked_fill_(done, 0.0)
                finished = ret_at_step[done_buf.bool()].tolist()
                with torch.no_grad():
                    next_value = agent.value(seen.reshape(n, channels, height, width).to(device))
                    adv, ret = gae(rew_buf, val_buf, done_buf, next_value, cfg.gamma, cfg.gae_lambda)
                ppo_update(cfg, agent, optimizer, agent.evaluate,
                           obs_buf.reshape(batch, channels, height, width), act_buf, logp_buf,
                           adv, ret, agent.distribution, act_shape)
                if progress.update(batch, finished):
                    break
        finally:
            progress.close()
            views.clear()
            rgb_view = frames = seen = act_view = rew_view = term_view = trunc_view = None
    result = progress.result(time.perf_counter() - start, str(device), "cpu",
                             ["rgb", "actions", "rewards", "terminated", "truncated"])
    if cfg.save:
        save_agent(cfg.save, agent, cfg)
    if cfg.plot:
        result.plot = plot_curve(cfg, result)
    return result
