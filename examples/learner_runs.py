"""Full training runs of the learning libraries on shmbridge engines, to the targets of
docs/learners/curves/README.md: each run evaluates its policy (deterministic, on engines of
its own) every --eval-every env steps, writes a row per evaluation to a CSV, and stops at
the target or at --max-steps.

    nice -n 10 python examples/learner_runs.py sb3-ppo-cartpole --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py sb3-sac-pendulum --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py torchrl-ppo-cartpole --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py skrl-ppo-cartpole --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py sb3-ppo-halfcheetah --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py sb3-ppo-hopper --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py cleanrl-ppo-cartpole --script cleanrl-0.4.8/cleanrl/ppo.py \
        --out docs/learners/curves   # ppo.py as docs/learners/cleanrl.md fetches it

The MuJoCo runs (sb3-ppo-halfcheetah, sb3-ppo-hopper) train on the native engine
(``launch("mujoco/<Task>")``, the ``mujoco`` feature: docs/mujoco.md) with RL Baselines3
Zoo's tuned hyperparameters for the ``-v3`` tasks and ``VecNormalize``; the evaluation
envs, 4 of their own, share the training envs' observation statistics; the final policy
is also run on Gymnasium's own env of the task (``gymnasium.make``, 4 episodes), its
return printed. ``--past-target`` trains an SB3 run on to its step budget after it reaches
its target (CSV ``<run>-full.csv``). The CSV is
rewritten after every evaluation, so a run stopped early leaves its curve so far.

Columns: env_steps, seconds (wall time since the start, evaluations included),
eval_mean, eval_std (the evaluation's episodes), train_mean (the last 100 training episodes'
mean return, SB3's ep_info_buffer).

CleanRL's ppo.py has no evaluation of its own: its run (python -m
shmbridge.integrations.cleanrl, 4 envs, the script's defaults) is read from the returns it
logs, a row every 4096 env steps with train_mean the mean of the last 20 logged returns
(eval columns empty); it stops when that mean reaches the target.
"""

from __future__ import annotations

import argparse
import csv
import os
import time

import numpy as np
import torch

import shmbridge
from shmbridge.integrations.sb3 import SB3VecEnv

RUNS = {
    # RL Baselines3 Zoo's hyperparameters for CartPole-v1 (docs/learners/sb3.md's example).
    "sb3-ppo-cartpole": dict(target=475.0, eval_every=4096, max_steps=200_000),
    # RL Baselines3 Zoo's hyperparameters for Pendulum-v1.
    "sb3-sac-pendulum": dict(target=-200.0, eval_every=2000, max_steps=40_000),
    # RL Baselines3 Zoo's hyperparameters for HalfCheetah-v3 and Hopper-v3, 1 M steps.
    "sb3-ppo-halfcheetah": dict(target=1500.0, eval_every=20_000, max_steps=1_000_000),
    "sb3-ppo-hopper": dict(target=1000.0, eval_every=20_000, max_steps=1_000_000),
}

# RL Baselines3 Zoo's PPO hyperparameters (hyperparams/ppo.yml, "Tuned") of the MuJoCo
# runs: one env, VecNormalize, 256x256 ReLU networks.
ZOO_MUJOCO = {
    "sb3-ppo-halfcheetah": ("HalfCheetah-v5", dict(
        batch_size=64, n_steps=512, gamma=0.98, learning_rate=2.0633e-05, ent_coef=0.000401762,
        clip_range=0.1, n_epochs=20, gae_lambda=0.92, max_grad_norm=0.8, vf_coef=0.58096)),
    "sb3-ppo-hopper": ("Hopper-v5", dict(
        batch_size=32, n_steps=512, gamma=0.999, learning_rate=9.80828e-05, ent_coef=0.00229519,
        clip_range=0.2, n_epochs=5, gae_lambda=0.99, max_grad_norm=0.7, vf_coef=0.835671)),
}


def make_mujoco(run: str, seed: int):
    """A MuJoCo run of ZOO_MUJOCO on the native engine."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecMonitor, VecNormalize
    from torch import nn

    task, hyper = ZOO_MUJOCO[run]
    env = VecNormalize(VecMonitor(SB3VecEnv(f"mujoco/{task}", num_envs=1, seed=seed)))
    eval_env = VecNormalize(SB3VecEnv(f"mujoco/{task}", num_envs=4, seed=seed + 1000),
                            training=False, norm_reward=False)
    eval_env.obs_rms = env.obs_rms  # the same statistics object: always in step
    policy_kwargs = dict(log_std_init=-2, ortho_init=False, activation_fn=nn.ReLU,
                         net_arch=dict(pi=[256, 256], vf=[256, 256]))
    model = PPO("MlpPolicy", env, policy_kwargs=policy_kwargs, seed=seed, device="cpu", **hyper)
    return model, env, eval_env, 4


def gymnasium_check(model, env, run: str, episodes: int = 4, seed: int = 2000) -> tuple:
    """The trained policy (deterministic, the training envs' observation statistics) on
    Gymnasium's own env of the task, not the native engine: mean and std of the returns
    and the mean episode length."""
    import gymnasium

    genv = gymnasium.make(ZOO_MUJOCO[run][0])
    returns, lengths = [], []
    for e in range(episodes):
        obs, _ = genv.reset(seed=seed + e)
        total, steps, done = 0.0, 0, False
        while not done:
            action, _ = model.predict(env.normalize_obs(obs[None].astype(np.float32)), deterministic=True)
            obs, reward, terminated, truncated, _ = genv.step(action[0])
            total, steps, done = total + float(reward), steps + 1, terminated or truncated
        returns.append(total)
        lengths.append(steps)
    return float(np.mean(returns)), float(np.std(returns)), float(np.mean(lengths))


def make(run: str, seed: int):
    from stable_baselines3 import PPO, SAC
    from stable_baselines3.common.vec_env import VecMonitor

    if run in ZOO_MUJOCO:
        return make_mujoco(run, seed)
    if run == "sb3-ppo-cartpole":
        env = VecMonitor(SB3VecEnv("cartpole", num_envs=8, seed=seed))
        eval_env = SB3VecEnv("cartpole", num_envs=16, seed=seed + 1000)
        model = PPO(
            "MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98,
            n_epochs=20, ent_coef=0.0, learning_rate=1e-3, clip_range=0.2, seed=seed, device="cpu",
        )
        return model, env, eval_env, 32
    env = VecMonitor(SB3VecEnv(client=shmbridge.launch_gym("Pendulum-v1", num_envs=1, seed=seed), close_client=True))
    eval_env = SB3VecEnv(client=shmbridge.launch_gym("Pendulum-v1", num_envs=8, seed=seed + 1000), close_client=True)
    model = SAC("MlpPolicy", env, learning_rate=1e-3, use_sde=True, seed=seed, device="cpu")
    return model, env, eval_env, 16


def cleanrl_run(script: str, out: str, seed: int, target: float = 475.0, max_steps: int = 500_000) -> None:
    """CleanRL's ppo.py on the cartpole engine, read from its log (see the docstring)."""
    import re
    import subprocess
    import sys
    import tempfile

    path = os.path.join(out, "cleanrl-ppo-cartpole.csv")
    command = [sys.executable, "-m", "shmbridge.integrations.cleanrl", script, "--gym-id",
               "shmbridge/CartPole-v1", "--total-timesteps", str(max_steps), "--cuda", "false",
               "--seed", str(seed)]
    start = time.perf_counter()
    returns, rows, next_row = [], [], 4096
    # The script writes its TensorBoard files into runs/ of its working folder: a temporary one.
    with tempfile.TemporaryDirectory() as cwd, \
            subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=cwd,
                             env=dict(os.environ, PYTHONUNBUFFERED="1")) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.match(r"global_step=(\d+), episode_reward=([-0-9.]+)", line)
            if not m:
                continue
            step = int(m.group(1))
            returns.append(float(m.group(2)))
            mean = float(np.mean(returns[-20:]))
            if step >= next_row or (len(returns) >= 20 and mean >= target):
                next_row = step + 4096
                rows.append((step, round(time.perf_counter() - start, 1), mean))
                print(f"cleanrl-ppo-cartpole: {step} steps, {rows[-1][1]} s: last 20 {mean:.1f}", flush=True)
                if len(returns) >= 20 and mean >= target:
                    proc.terminate()
                    break
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["env_steps", "seconds", "eval_mean", "eval_std", "train_mean"])
        w.writerows((s, t, "", "", f"{m:.1f}") for s, t, m in rows)
    reached = bool(rows) and rows[-1][2] >= target
    print(f"cleanrl-ppo-cartpole: {'reached' if reached else 'did not reach'} {target} ({path})")


def torchrl_run(out: str, seed: int, target: float = 475.0, max_frames: int = 200_000) -> None:
    """TorchRL's PPO (docs/learners/torchrl.md's example) on the cartpole engine, 8 envs,
    evaluated every 8 batches (2048 frames) on 16 envs of its own, deterministic, 1000
    steps; stops at the target."""
    from tensordict.nn import TensorDictModule
    from torch import nn
    from torchrl.collectors import Collector
    from torchrl.envs import ExplorationType, RewardSum, TransformedEnv, set_exploration_type
    from torchrl.modules import ProbabilisticActor, ValueOperator
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE

    from shmbridge.integrations.torchrl import TorchRLEnv

    torch.manual_seed(seed)
    env = TransformedEnv(TorchRLEnv("cartpole", num_envs=8, seed=seed), RewardSum())

    def mlp(outputs: int) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, outputs))

    actor = ProbabilisticActor(
        TensorDictModule(mlp(2), in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"], distribution_class=torch.distributions.Categorical,
        spec=env.action_spec, return_log_prob=True,
    )
    critic = ValueOperator(mlp(1), in_keys=["observation"])
    advantage = GAE(gamma=0.98, lmbda=0.8, value_network=critic)
    loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_coeff=0.0)
    optimizer = torch.optim.Adam(loss.parameters(), lr=1e-3)
    collector = Collector(env, actor, frames_per_batch=256, total_frames=max_frames,
                          auto_register_policy_transforms=True)
    eval_env = TransformedEnv(TorchRLEnv("cartpole", num_envs=16, seed=seed + 1000), RewardSum())
    start = time.perf_counter()
    rows, frames = [], 0
    for k, batch in enumerate(collector, 1):
        frames += batch.numel()
        for _ in range(20):
            advantage(batch)
            losses = loss(batch.reshape(-1))
            (losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]).backward()
            optimizer.step()
            optimizer.zero_grad()
        if k % 8:
            continue
        with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
            rollout = eval_env.rollout(1000, actor, break_when_any_done=False)
        finished = rollout["next", "done"]
        returns = rollout["next", "episode_reward"][finished]
        mean, std = returns.mean().item(), returns.std().item()
        rows.append((frames, round(time.perf_counter() - start, 1), mean, std, float("nan")))
        print(f"torchrl-ppo-cartpole: {frames} steps, {rows[-1][1]} s: eval {mean:.1f} +/- {std:.1f}", flush=True)
        if mean >= target:
            break
    collector.shutdown()
    eval_env.close()
    write_rows(os.path.join(out, "torchrl-ppo-cartpole.csv"), rows)
    reached = bool(rows) and rows[-1][2] >= target
    print(f"torchrl-ppo-cartpole: {'reached' if reached else 'did not reach'} {target}")


def skrl_run(out: str, seed: int, target: float = 475.0, max_timesteps: int = 25_000) -> None:
    """skrl's PPO (docs/learners/skrl.md's example) on the cartpole engine, 8 envs, trained
    in rounds of 256 timesteps (2048 env steps) by its SequentialTrainer, each followed by
    an evaluation (the policy's most likely action, 1000 steps of 16 envs of its own);
    stops at the target."""
    from skrl.agents.torch.ppo import PPO, PPO_CFG
    from skrl.memories.torch import RandomMemory
    from skrl.models.torch import CategoricalMixin, DeterministicMixin, Model
    from skrl.trainers.torch import SequentialTrainer
    from torch import nn

    from shmbridge.integrations.skrl import SkrlEnv

    torch.manual_seed(seed)
    env = SkrlEnv("cartpole", num_envs=8, seed=seed)

    class Policy(CategoricalMixin, Model):
        def __init__(self, observation_space, action_space, device):
            Model.__init__(self, observation_space=observation_space, action_space=action_space, device=device)
            CategoricalMixin.__init__(self, unnormalized_log_prob=True)
            self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

        def compute(self, inputs, role=""):
            return self.net(inputs["observations"]), {}

    class Value(DeterministicMixin, Model):
        def __init__(self, observation_space, action_space, device):
            Model.__init__(self, observation_space=observation_space, action_space=action_space, device=device)
            DeterministicMixin.__init__(self)
            self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

        def compute(self, inputs, role=""):
            return self.net(inputs["observations"]), {}

    models = {"policy": Policy(env.observation_space, env.action_space, env.device),
              "value": Value(env.observation_space, env.action_space, env.device)}
    cfg = PPO_CFG(rollouts=32, learning_epochs=20, mini_batches=1, discount_factor=0.98, gae_lambda=0.8,
                  learning_rate=1e-3, entropy_loss_scale=0.0, value_loss_scale=0.5, time_limit_bootstrap=True)
    cfg.experiment.write_interval = 0
    cfg.experiment.checkpoint_interval = 0
    memory = RandomMemory(memory_size=32, num_envs=env.num_envs, device=env.device)
    agent = PPO(models=models, memory=memory, observation_space=env.observation_space,
                action_space=env.action_space, device=env.device, cfg=cfg)
    eval_env = SkrlEnv("cartpole", num_envs=16, seed=seed + 1000)
    start = time.perf_counter()
    rows, timesteps = [], 0
    while timesteps < max_timesteps:
        # One trainer per round: skrl's trainer runs a fixed number of timesteps; the agent,
        # its memory and its models carry over.
        trainer = SequentialTrainer(env=env, agents=agent, cfg={
            "timesteps": 256, "headless": True, "disable_progressbar": True, "close_environment_at_exit": False})
        trainer.train()
        timesteps += 256
        finished = []
        obs, _ = eval_env.reset()
        episode = torch.zeros(16)
        with torch.no_grad():
            for _ in range(1000):
                obs, rewards, terminated, truncated, _ = eval_env.step(models["policy"].net(obs).argmax(-1, keepdim=True))
                episode += rewards.squeeze(-1)
                done = (terminated | truncated).squeeze(-1)
                finished += episode[done].tolist()
                episode[done] = 0
        mean, std = float(np.mean(finished)), float(np.std(finished))
        rows.append((timesteps * 8, round(time.perf_counter() - start, 1), mean, std, float("nan")))
        print(f"skrl-ppo-cartpole: {timesteps * 8} steps, {rows[-1][1]} s: eval {mean:.1f} +/- {std:.1f}", flush=True)
        if mean >= target:
            break
    eval_env.close()
    env.close()
    write_rows(os.path.join(out, "skrl-ppo-cartpole.csv"), rows)
    reached = bool(rows) and rows[-1][2] >= target
    print(f"skrl-ppo-cartpole: {'reached' if reached else 'did not reach'} {target}")


def write_rows(path: str, rows: list) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["env_steps", "seconds", "eval_mean", "eval_std", "train_mean"])
        out.writerows((s, t, f"{m:.1f}", f"{d:.1f}", "" if r != r else f"{r:.1f}") for s, t, m, d, r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", choices=sorted([*RUNS, "cleanrl-ppo-cartpole", "torchrl-ppo-cartpole", "skrl-ppo-cartpole"]))
    parser.add_argument("--out", default=".")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--script", help="cleanrl-ppo-cartpole: CleanRL's ppo.py")
    parser.add_argument("--past-target", action="store_true",
                        help="SB3 runs: train on to the run's step budget after reaching the target "
                             "(the CSV is then <run>-full.csv)")
    args = parser.parse_args()
    if args.run == "skrl-ppo-cartpole":
        torch.set_num_threads(1)
        skrl_run(args.out, args.seed)
        return
    if args.run == "torchrl-ppo-cartpole":
        torch.set_num_threads(1)
        torchrl_run(args.out, args.seed)
        return
    if args.run == "cleanrl-ppo-cartpole":
        if not args.script:
            parser.error("cleanrl-ppo-cartpole needs --script PATH (CleanRL's ppo.py)")
        cleanrl_run(os.path.abspath(args.script), os.path.abspath(args.out), args.seed or 1)
        return
    spec = RUNS[args.run]
    torch.set_num_threads(1)
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.evaluation import evaluate_policy

    model, env, eval_env, eval_episodes = make(args.run, args.seed)
    start = time.perf_counter()
    rows = []
    path = os.path.join(args.out, f"{args.run}{'-full' if args.past_target else ''}.csv")

    class Evaluate(BaseCallback):
        next_eval = spec["eval_every"]

        def _on_step(self) -> bool:
            if self.num_timesteps < self.next_eval:
                return True
            self.next_eval += spec["eval_every"]
            mean, std = evaluate_policy(self.model, eval_env, n_eval_episodes=eval_episodes, warn=False)
            infos = self.model.ep_info_buffer
            train = float(np.mean([i["r"] for i in infos])) if infos else float("nan")
            rows.append((self.num_timesteps, round(time.perf_counter() - start, 1), mean, std, train))
            print(f"{args.run}: {self.num_timesteps} steps, {rows[-1][1]} s: eval {mean:.1f} +/- {std:.1f}, train {train:.1f}", flush=True)
            write_rows(path, rows)
            return args.past_target or mean < spec["target"]

    try:
        model.learn(total_timesteps=spec["max_steps"], callback=Evaluate())
    finally:
        env.close()
        eval_env.close()
    write_rows(path, rows)
    if args.run in ZOO_MUJOCO:
        mean, std, length = gymnasium_check(model, env, args.run)
        print(f"{args.run}: the final policy on Gymnasium's own {ZOO_MUJOCO[args.run][0]}: "
              f"{mean:.1f} +/- {std:.1f} over 4 episodes of {length:.0f} steps on average", flush=True)
    reached = any(row[2] >= spec["target"] for row in rows)
    print(f"{args.run}: {'reached' if reached else 'did not reach'} {spec['target']} ({path})")


if __name__ == "__main__":
    main()
