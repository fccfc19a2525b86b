"""Full training runs of the learning libraries on shmbridge engines, to the targets of
docs/learners/curves/README.md: each run evaluates its policy (deterministic, on engines of
its own) every --eval-every env steps, writes a row per evaluation to a CSV, and stops at
the target or at --max-steps.

    nice -n 10 python examples/learner_runs.py sb3-ppo-cartpole --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py sb3-sac-pendulum --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py torchrl-ppo-cartpole --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py skrl-ppo-cartpole --out docs/learners/curves
    GIT_PYTHON_REFRESH=quiet nice -n 10 python examples/learner_runs.py rsl_rl-ppo-cartpole --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py torchrl-sac-pendulum --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py skrl-sac-pendulum --out docs/learners/curves
    GIT_PYTHON_REFRESH=quiet nice -n 10 python examples/learner_runs.py rsl_rl-ppo-pendulum --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py sb3-ppo-halfcheetah --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py sb3-ppo-hopper --out docs/learners/curves
    nice -n 10 python examples/learner_runs.py cleanrl-ppo-cartpole --script cleanrl-0.4.8/cleanrl/ppo.py \
        --out docs/learners/curves   # ppo.py as docs/learners/cleanrl.md fetches it
    nice -n 10 python examples/learner_runs.py cleanrl-ppo-pendulum \
        --script cleanrl-0.4.8/cleanrl/ppo_continuous_action.py --out docs/learners/curves

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

CleanRL's ppo.py and ppo_continuous_action.py have no evaluation of their own: their runs
(python -m shmbridge.integrations.cleanrl, the arguments of CLEANRL_RUNS) are read from
the returns they log, a row every 4096 env steps or more with train_mean the mean of the
last 20 logged returns (eval columns empty); a run stops when that mean reaches the target.
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


#: CleanRL's runs: the script's --gym-id, the target, --total-timesteps and other arguments.
CLEANRL_RUNS = {
    "cleanrl-ppo-cartpole": ("shmbridge/CartPole-v1", 475.0, 500_000, []),
    # ppo_continuous_action.py with RL Baselines3 Zoo's PPO settings for Pendulum-v1 (4 envs,
    # 1024 steps, γ 0.9, lr 1e-3; the Zoo's gSDE the script does not have).
    "cleanrl-ppo-pendulum": ("shmbridge/Pendulum-v1", -200.0, 300_000,
                             ["--num-envs", "4", "--num-steps", "1024", "--gamma", "0.9", "--learning-rate", "1e-3",
                              "--capture-video", "false"]),
}


def cleanrl_run(script: str, out: str, seed: int, run: str = "cleanrl-ppo-cartpole") -> None:
    """CleanRL's ppo.py or ppo_continuous_action.py on a shmbridge engine, read from its
    log (see the docstring)."""
    import re
    import subprocess
    import sys
    import tempfile

    gym_id, target, max_steps, extra = CLEANRL_RUNS[run]
    path = os.path.join(out, f"{run}.csv")
    command = [sys.executable, "-m", "shmbridge.integrations.cleanrl", script, "--gym-id",
               gym_id, "--total-timesteps", str(max_steps), "--cuda", "false",
               "--seed", str(seed), *extra]
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
                print(f"{run}: {step} steps, {rows[-1][1]} s: last 20 {mean:.1f}", flush=True)
                if len(returns) >= 20 and mean >= target:
                    proc.terminate()
                    break
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["env_steps", "seconds", "eval_mean", "eval_std", "train_mean"])
        w.writerows((s, t, "", "", f"{m:.1f}") for s, t, m in rows)
    reached = bool(rows) and rows[-1][2] >= target
    print(f"{run}: {'reached' if reached else 'did not reach'} {target} ({path})")


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
    start = time.perf_counter()
    rows, timesteps = [], 0
    while timesteps < max_timesteps:
        # One trainer per round: skrl's trainer runs a fixed number of timesteps; the agent,
        # its memory and its models carry over.
        trainer = SequentialTrainer(env=env, agents=agent, cfg={
            "timesteps": 256, "headless": True, "disable_progressbar": True, "close_environment_at_exit": False})
        trainer.train()
        timesteps += 256
        finished = cartpole_evaluate(lambda obs: models["policy"].net(obs).argmax(-1), seed + 1000)
        mean, std = float(np.mean(finished)), float(np.std(finished))
        rows.append((timesteps * 8, round(time.perf_counter() - start, 1), mean, std, float("nan")))
        print(f"skrl-ppo-cartpole: {timesteps * 8} steps, {rows[-1][1]} s: eval {mean:.1f} +/- {std:.1f}", flush=True)
        if mean >= target:
            break
    env.close()
    write_rows(os.path.join(out, "skrl-ppo-cartpole.csv"), rows)
    reached = bool(rows) and rows[-1][2] >= target
    print(f"skrl-ppo-cartpole: {'reached' if reached else 'did not reach'} {target}")


def cartpole_evaluate(policy, seed: int, num_envs: int = 16, steps: int = 1000) -> list:
    """The returns of the episodes that ``policy`` (a torch tensor of observations to
    actions) finishes in ``steps`` steps of ``num_envs`` fresh ``cartpole`` envs seeded
    from ``seed``.

    Fresh envs each time: a reused one would start each evaluation where the last stopped
    (an adapter's ``reset()`` may not reset: skrl's resets only the first time, as skrl
    expects of vectorized envs) and count the rest of those episodes as whole ones."""
    from shmbridge.gym import ShmVectorEnv

    finished = []
    env = ShmVectorEnv("cartpole", num_envs, seed=seed)
    try:
        obs, _ = env.reset()
        episode = np.zeros(num_envs)
        with torch.no_grad():
            for _ in range(steps):
                actions = policy(torch.from_numpy(obs)).reshape(num_envs).numpy().astype(np.int64)
                obs, rewards, terminated, truncated, _ = env.step(actions)
                episode += rewards
                done = terminated | truncated
                finished += episode[done].tolist()
                episode[done] = 0
    finally:
        env.close()
    return finished


def rsl_rl_cartpole_run(out: str, seed: int, target: float = 475.0, max_iterations: int = 400) -> None:
    """rsl_rl's OnPolicyRunner (PPO) on the cartpole engine through RslRlVecEnv, 16 envs,
    rsl_rl's MLP actor with shmbridge's CategoricalDistribution, in rounds of 4
    iterations (2048 env steps), each followed by an evaluation of its inference policy
    (the most likely action); stops at the target."""
    from rsl_rl.runners import OnPolicyRunner
    from tensordict import TensorDict

    from shmbridge.integrations.rsl_rl import RslRlVecEnv

    torch.manual_seed(seed)
    env = RslRlVecEnv("cartpole", num_envs=16, seed=seed)
    train_cfg = {
        "num_steps_per_env": 32,
        "save_interval": 10**9,
        "obs_groups": {"actor": ["policy"], "critic": ["policy"]},
        "algorithm": {"class_name": "PPO", "num_learning_epochs": 10, "num_mini_batches": 2,
                      "learning_rate": 1e-3, "schedule": "fixed", "gamma": 0.98, "lam": 0.8,
                      "entropy_coef": 0.0, "clip_param": 0.2},
        "actor": {"class_name": "MLPModel", "hidden_dims": [64, 64], "activation": "tanh",
                  "distribution_cfg": {"class_name": "shmbridge.integrations.rsl_rl:CategoricalDistribution",
                                       "num_categories": 2}},
        "critic": {"class_name": "MLPModel", "hidden_dims": [64, 64], "activation": "tanh"},
    }
    runner = OnPolicyRunner(env, train_cfg, log_dir=None, device="cpu")
    start = time.perf_counter()
    rows, iterations = [], 0
    while iterations < max_iterations:
        runner.learn(num_learning_iterations=4, init_at_random_ep_len=False)
        iterations += 4
        act = runner.get_inference_policy(device="cpu")
        finished = cartpole_evaluate(lambda obs: act(TensorDict({"policy": obs}, batch_size=[obs.shape[0]])), seed + 1000)
        mean, std = float(np.mean(finished)), float(np.std(finished))
        steps = iterations * 32 * 16
        rows.append((steps, round(time.perf_counter() - start, 1), mean, std, float("nan")))
        print(f"rsl_rl-ppo-cartpole: {steps} steps, {rows[-1][1]} s: eval {mean:.1f} +/- {std:.1f}", flush=True)
        if mean >= target:
            break
    env.close()
    write_rows(os.path.join(out, "rsl_rl-ppo-cartpole.csv"), rows)
    reached = bool(rows) and rows[-1][2] >= target
    print(f"rsl_rl-ppo-cartpole: {'reached' if reached else 'did not reach'} {target}")


def pendulum_evaluate(policy, seed: int, num_envs: int = 8) -> list:
    """The returns of ``num_envs`` whole episodes (200 steps) of Gymnasium's Pendulum-v1
    behind fresh ``launch_gym`` shards seeded from ``seed``, ``policy`` mapping a torch
    tensor of observations to actions."""
    from shmbridge.gym import ShmVectorEnv

    env = ShmVectorEnv(client=shmbridge.launch_gym("Pendulum-v1", num_envs=num_envs, seed=seed), close_client=True)
    try:
        obs, _ = env.reset()
        returns = np.zeros(num_envs)
        with torch.no_grad():
            for _ in range(200):
                actions = policy(torch.from_numpy(obs).float()).reshape(num_envs, 1).numpy()
                space = env.single_action_space  # a Gaussian's mean may pass the bounds
                obs, rewards, terminated, truncated, _ = env.step(np.clip(actions, space.low, space.high))
                returns += rewards
        assert bool(truncated.all()), "Pendulum-v1's episodes are 200 steps"
    finally:
        env.close()
    return returns.tolist()


def torchrl_sac_pendulum_run(out: str, seed: int, target: float = -200.0, max_frames: int = 40_000) -> None:
    """TorchRL's SACLoss (its SAC recipe: TanhNormal actor, two Q networks, soft target
    updates) on Pendulum-v1 behind launch_gym shards, 4 envs, one gradient step per env
    step after 1000 random frames, evaluated every 2000 frames (the actor's mode, 8 envs
    of its own, one 200-step episode each); stops at the target."""
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torch import nn
    from torchrl.collectors import Collector
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    from torchrl.envs import ExplorationType, RewardSum, TransformedEnv, set_exploration_type
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import SACLoss, SoftUpdate

    from shmbridge.integrations.torchrl import TorchRLEnv

    torch.manual_seed(seed)

    def pendulum(n: int, s: int):
        return TransformedEnv(
            TorchRLEnv(client=shmbridge.launch_gym("Pendulum-v1", num_envs=n, seed=s), close_client=True), RewardSum())

    def mlp(inputs: int, outputs: int) -> nn.Module:
        return nn.Sequential(nn.Linear(inputs, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, outputs))

    env = pendulum(4, seed)
    spec = env.action_spec_unbatched
    actor = ProbabilisticActor(
        TensorDictModule(nn.Sequential(mlp(3, 2), NormalParamExtractor()), in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], distribution_class=TanhNormal,
        distribution_kwargs={"low": spec.space.low, "high": spec.space.high}, spec=spec,
    )
    # torchrl's MLP takes the observation and the action, concatenated.
    qvalue = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[256, 256], activation_class=nn.ReLU),
                           in_keys=["observation", "action"])
    loss = SACLoss(actor_network=actor, qvalue_network=qvalue, num_qvalue_nets=2, loss_function="l2")
    loss.make_value_estimator(gamma=0.99)
    target_update = SoftUpdate(loss, tau=0.005)
    optimizer = torch.optim.Adam(loss.parameters(), lr=1e-3)
    buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(max_frames), batch_size=256)
    collector = Collector(env, actor, frames_per_batch=64, total_frames=max_frames, init_random_frames=1000)
    eval_env = pendulum(8, seed + 1000)
    start = time.perf_counter()
    rows, frames, next_eval = [], 0, 2000
    for batch in collector:
        frames += batch.numel()
        buffer.extend(batch.reshape(-1))
        if frames < 1000:
            continue
        for _ in range(batch.numel()):
            losses = loss(buffer.sample())
            (losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]).backward()
            optimizer.step()
            optimizer.zero_grad()
            target_update.step()
        collector.update_policy_weights_()
        if frames < next_eval:
            continue
        next_eval += 2000
        with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
            rollout = eval_env.rollout(200, actor, break_when_any_done=False)
        returns = rollout["next", "episode_reward"][rollout["next", "done"]]
        mean, std = returns.mean().item(), returns.std().item()
        rows.append((frames, round(time.perf_counter() - start, 1), mean, std, float("nan")))
        print(f"torchrl-sac-pendulum: {frames} steps, {rows[-1][1]} s: eval {mean:.1f} +/- {std:.1f} "
              f"({returns.numel()} episodes)", flush=True)
        if mean >= target:
            break
    collector.shutdown()
    eval_env.close()
    write_rows(os.path.join(out, "torchrl-sac-pendulum.csv"), rows)
    reached = bool(rows) and rows[-1][2] >= target
    print(f"torchrl-sac-pendulum: {'reached' if reached else 'did not reach'} {target}")


def skrl_sac_pendulum_run(out: str, seed: int, target: float = -200.0, max_timesteps: int = 40_000) -> None:
    """skrl's SAC agent and SequentialTrainer on Pendulum-v1 behind launch_gym shards, 1
    env, with skrl's own Pendulum-v1 SAC example's models and settings; evaluated every 1000
    env steps (the policy's mean action, 8 envs of its own, one 200-step episode each);
    stops at the target."""
    from skrl.agents.torch.sac import SAC, SAC_CFG
    from skrl.memories.torch import RandomMemory
    from skrl.models.torch import DeterministicMixin, GaussianMixin, Model
    from skrl.trainers.torch import SequentialTrainer
    from torch import nn

    from shmbridge.integrations.skrl import SkrlEnv

    torch.manual_seed(seed)
    env = SkrlEnv(client=shmbridge.launch_gym("Pendulum-v1", num_envs=1, seed=seed), close_client=True)

    class Policy(GaussianMixin, Model):
        def __init__(self, observation_space, action_space, device):
            Model.__init__(self, observation_space=observation_space, action_space=action_space, device=device)
            GaussianMixin.__init__(self, clip_actions=False, clip_log_std=True, min_log_std=-20, max_log_std=2)
            self.net = nn.Sequential(nn.Linear(3, 400), nn.ReLU(), nn.Linear(400, 300), nn.ReLU(), nn.Linear(300, 1))
            self.log_std_parameter = nn.Parameter(torch.zeros(1))

        def compute(self, inputs, role=""):
            return 2 * torch.tanh(self.net(inputs["observations"])), {"log_std": self.log_std_parameter}

    class Critic(DeterministicMixin, Model):
        def __init__(self, observation_space, action_space, device):
            Model.__init__(self, observation_space=observation_space, action_space=action_space, device=device)
            DeterministicMixin.__init__(self)
            self.net = nn.Sequential(nn.Linear(4, 400), nn.ReLU(), nn.Linear(400, 300), nn.ReLU(), nn.Linear(300, 1))

        def compute(self, inputs, role=""):
            return self.net(torch.cat([inputs["observations"], inputs["taken_actions"]], dim=1)), {}

    spaces = (env.observation_space, env.action_space, env.device)
    models = {"policy": Policy(*spaces), "critic_1": Critic(*spaces), "critic_2": Critic(*spaces),
              "target_critic_1": Critic(*spaces), "target_critic_2": Critic(*spaces)}
    cfg = SAC_CFG(gradient_steps=1, batch_size=100, discount_factor=0.99, polyak=0.005, learning_rate=5e-4,
                  random_timesteps=80, learning_starts=80, learn_entropy=True)
    cfg.experiment.write_interval = 0
    cfg.experiment.checkpoint_interval = 0
    memory = RandomMemory(memory_size=max_timesteps, num_envs=1, device=env.device)
    agent = SAC(models=models, memory=memory, observation_space=env.observation_space,
                action_space=env.action_space, device=env.device, cfg=cfg)

    class Reached(Exception):
        pass

    start = time.perf_counter()
    rows = []
    post_interaction = agent.post_interaction

    def post_interaction_and_evaluate(*, timestep: int, timesteps: int) -> None:
        # One trainer for the whole run (SAC's random and learning-start timesteps count
        # from the trainer's start), evaluated from its agent's hook.
        post_interaction(timestep=timestep, timesteps=timesteps)
        if (timestep + 1) % 1000:
            return
        returns = pendulum_evaluate(lambda obs: models["policy"].compute({"observations": obs})[0], seed + 1000)
        mean, std = float(np.mean(returns)), float(np.std(returns))
        rows.append((timestep + 1, round(time.perf_counter() - start, 1), mean, std, float("nan")))
        print(f"skrl-sac-pendulum: {timestep + 1} steps, {rows[-1][1]} s: eval {mean:.1f} +/- {std:.1f}", flush=True)
        if mean >= target:
            raise Reached

    agent.post_interaction = post_interaction_and_evaluate
    trainer = SequentialTrainer(env=env, agents=agent, cfg={
        "timesteps": max_timesteps, "headless": True, "disable_progressbar": True, "close_environment_at_exit": False})
    try:
        trainer.train()
    except Reached:
        pass
    env.close()
    write_rows(os.path.join(out, "skrl-sac-pendulum.csv"), rows)
    reached = bool(rows) and rows[-1][2] >= target
    print(f"skrl-sac-pendulum: {'reached' if reached else 'did not reach'} {target}")


def rsl_rl_pendulum_run(out: str, seed: int, target: float = -200.0, max_iterations: int = 150) -> None:
    """rsl_rl's OnPolicyRunner (PPO, its Gaussian policy, its KL-adaptive learning rate)
    on Pendulum-v1 behind launch_gym shards through RslRlVecEnv, 64 envs x 32 steps an
    iteration, γ 0.9 (RL Zoo's for PPO on Pendulum); evaluated every 5 iterations (10,240
    env steps: the policy's mean action, 8 envs of its own, one 200-step episode each);
    stops at the target."""
    from rsl_rl.runners import OnPolicyRunner
    from tensordict import TensorDict

    from shmbridge.integrations.rsl_rl import RslRlVecEnv

    torch.manual_seed(seed)
    env = RslRlVecEnv(client=shmbridge.launch_gym("Pendulum-v1", num_envs=64, shards=2, seed=seed), close_client=True)
    train_cfg = {
        "num_steps_per_env": 32,
        "save_interval": 10**9,
        "obs_groups": {"actor": ["policy"], "critic": ["policy"]},
        "algorithm": {"class_name": "PPO", "num_learning_epochs": 10, "num_mini_batches": 4,
                      "learning_rate": 1e-3, "gamma": 0.9, "lam": 0.95, "entropy_coef": 0.0},
        "actor": {"class_name": "MLPModel", "hidden_dims": [64, 64], "activation": "elu", "obs_normalization": True,
                  "distribution_cfg": {"class_name": "GaussianDistribution", "init_std": 1.0}},
        "critic": {"class_name": "MLPModel", "hidden_dims": [64, 64], "activation": "elu", "obs_normalization": True},
    }
    runner = OnPolicyRunner(env, train_cfg, log_dir=None, device="cpu")
    start = time.perf_counter()
    rows, iterations = [], 0
    while iterations < max_iterations:
        runner.learn(num_learning_iterations=5)
        iterations += 5
        act = runner.get_inference_policy(device="cpu")
        returns = pendulum_evaluate(lambda obs: act(TensorDict({"policy": obs}, batch_size=[obs.shape[0]])), seed + 1000)
        mean, std = float(np.mean(returns)), float(np.std(returns))
        steps = iterations * 32 * 64
        rows.append((steps, round(time.perf_counter() - start, 1), mean, std, float("nan")))
        print(f"rsl_rl-ppo-pendulum: {steps} steps, {rows[-1][1]} s: eval {mean:.1f} +/- {std:.1f}", flush=True)
        if mean >= target:
            break
    env.close()
    write_rows(os.path.join(out, "rsl_rl-ppo-pendulum.csv"), rows)
    reached = bool(rows) and rows[-1][2] >= target
    print(f"rsl_rl-ppo-pendulum: {'reached' if reached else 'did not reach'} {target}")


def write_rows(path: str, rows: list) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["env_steps", "seconds", "eval_mean", "eval_std", "train_mean"])
        out.writerows((s, t, f"{m:.1f}", f"{d:.1f}", "" if r != r else f"{r:.1f}") for s, t, m, d, r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", choices=sorted([*RUNS, "cleanrl-ppo-cartpole", "torchrl-ppo-cartpole", "skrl-ppo-cartpole",
                                               "rsl_rl-ppo-cartpole", "torchrl-sac-pendulum",
                                               "skrl-sac-pendulum", "rsl_rl-ppo-pendulum",
                                               "cleanrl-ppo-pendulum"]))
    parser.add_argument("--out", default=".")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--script", help="cleanrl-ppo-*: CleanRL's ppo.py or ppo_continuous_action.py")
    parser.add_argument("--past-target", action="store_true",
                        help="SB3 runs: train on to the run's step budget after reaching the target "
                             "(the CSV is then <run>-full.csv)")
    args = parser.parse_args()
    if args.run == "skrl-ppo-cartpole":
        torch.set_num_threads(1)
        skrl_run(args.out, args.seed)
        return
    if args.run == "rsl_rl-ppo-cartpole":
        torch.set_num_threads(1)
        rsl_rl_cartpole_run(args.out, args.seed)
        return
    if args.run == "torchrl-sac-pendulum":
        torch.set_num_threads(1)
        torchrl_sac_pendulum_run(args.out, args.seed)
        return
    if args.run == "rsl_rl-ppo-pendulum":
        torch.set_num_threads(1)
        rsl_rl_pendulum_run(args.out, args.seed)
        return
    if args.run == "skrl-sac-pendulum":
        torch.set_num_threads(1)
        skrl_sac_pendulum_run(args.out, args.seed)
        return
    if args.run == "torchrl-ppo-cartpole":
        torch.set_num_threads(1)
        torchrl_run(args.out, args.seed)
        return
    if args.run in CLEANRL_RUNS:
        if not args.script:
            parser.error(f"{args.run} needs --script PATH (CleanRL's ppo.py or ppo_continuous_action.py)")
        cleanrl_run(os.path.abspath(args.script), os.path.abspath(args.out), args.seed or 1, args.run)
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
