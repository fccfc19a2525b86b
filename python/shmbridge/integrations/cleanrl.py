"""CleanRL's own single-file scripts on a shmbridge engine, unchanged but for the one line
that makes their environments::

    python -m shmbridge.integrations.cleanrl ppo.py --gym-id shmbridge/CartPole-v1 [ARGS]

runs the script ``ppo.py`` (from CleanRL's release on PyPI, ``cleanrl==0.4.8``; this
package does not ship it) as ``python ppo.py [ARGS]`` would, with two changes made at run
time, in memory (docs/learners/cleanrl.md shows them):

* its line ``envs = VecPyTorch(DummyVecEnv([make_env(...) ...]), device)`` becomes
  ``envs = VecPyTorch(VecMonitor(shmbridge_vec_env(args.gym_id, args.num_envs,
  args.seed)), device)``: ``SB3VecEnv`` (:mod:`shmbridge.integrations.sb3`) (the script is
  written on Stable-Baselines3's ``VecEnv`` API), under SB3's ``VecMonitor``, which
  gives the ``info["episode"]`` the script logs, as Gym's ``RecordEpisodeStatistics``
  did in ``make_env``;
* in ``ppo_continuous_action.py``, whose ``make_env`` also wraps each env in its
  ``ClipActionsWrapper`` and ``NormalizedEnv`` (OpenAI Baselines' ``VecNormalize``, per
  env), the same line becomes their vector forms around the monitor: actions clipped to
  the bounds (NaNs zeroed, as ``ClipActionsWrapper`` does), and SB3's ``VecNormalize``
  with ``NormalizedEnv``'s settings (observations and returns, clipped at 10, γ 0.99);
  its ``import pybullet_envs`` (which only registers PyBullet's envs) is served by an
  empty module where PyBullet is not installed;
* ``import gym`` finds Gymnasium (the script was written for Gym 0.21, which no longer
  installs beside NumPy 2): ``gym`` is ``gymnasium``, ``gym.spaces`` its spaces and
  ``gym.wrappers`` its wrappers plus a ``Monitor`` that only ``--capture-video`` would
  call (and which then says it is not supported).

A script without the line fails at once, naming it. Extras: ``sb3`` (and ``tensorboard``,
which the script's ``SummaryWriter`` needs: ``rsl_rl`` and ``skrl`` bring it).
"""

from __future__ import annotations

import sys
import types
from typing import Any, Dict, List, Optional

#: CleanRL's line that makes the environments -> the line that runs them on shmbridge.
ENV_LINES: Dict[str, str] = {
    # cleanrl 0.4.8 (PyPI): ppo.py
    "envs = VecPyTorch(DummyVecEnv([make_env(args.gym_id, args.seed+i, i) for i in range(args.num_envs)]), device)":
    "envs = VecPyTorch(VecMonitor(shmbridge_vec_env(args.gym_id, args.num_envs, args.seed)), device)",
}


#: ``ppo_continuous_action.py``'s (cleanrl 0.4.8) line, where the script defines the
#: wrappers its ``make_env`` applies: their vector forms around the monitor.
NORMALIZED_ENV_LINE = (
    "envs = VecPyTorch(VecNormalize(VecMonitor(VecClipActions(shmbridge_vec_env(args.gym_id, args.num_envs, "
    "args.seed))), gamma=0.99, clip_obs=10., clip_reward=10., epsilon=1e-8), device)"
)


def _normalizes(source: str) -> bool:
    """Whether the script's ``make_env`` clips actions and normalizes (ppo_continuous_action.py)."""
    return "class ClipActionsWrapper(" in source and "class NormalizedEnv(" in source


def _vec_clip_actions() -> type:
    from stable_baselines3.common.vec_env import VecEnvWrapper

    class VecClipActions(VecEnvWrapper):
        """ppo_continuous_action.py's ``ClipActionsWrapper`` for a whole ``VecEnv``: NaNs
        become 0 and actions are clipped to the action space's bounds."""

        def step_async(self, actions: Any) -> None:
            import numpy as np

            space = self.action_space
            self.venv.step_async(np.clip(np.nan_to_num(actions), space.low, space.high))

        def reset(self) -> Any:
            return self.venv.reset()

        def step_wait(self) -> Any:
            return self.venv.step_wait()

    return VecClipActions


def shmbridge_vec_env(gym_id: str, num_envs: int, seed: int) -> Any:
    """An ``SB3VecEnv`` (:mod:`shmbridge.integrations.sb3`) of ``num_envs`` envs for the
    Gymnasium id ``gym_id``: a shmbridge engine's id (``shmbridge/CartPole-v1``, the Rust
    engine) or ``shmbridge/<Gymnasium id>`` (that env behind ``launch_gym`` shards)."""
    from .. import launch_gym
    from .._gym_registration import ENVS
    from .sb3 import SB3VecEnv

    if gym_id in ENVS:
        return SB3VecEnv(ENVS[gym_id]["kwargs"]["env"], num_envs, seed=seed)
    prefix = "shmbridge/"
    if not gym_id.startswith(prefix):
        raise ValueError(f"--gym-id {gym_id!r}: a shmbridge id, shmbridge/CartPole-v1 or shmbridge/<Gymnasium id>")
    return SB3VecEnv(client=launch_gym(gym_id[len(prefix):], num_envs=num_envs, seed=seed), close_client=True)


def patch(source: str) -> str:
    """``source`` with its environment line replaced (:data:`ENV_LINES`); ``ValueError``
    if it does not hold one exactly once."""
    for line, replacement in ENV_LINES.items():
        if source.count(line) == 1:
            return source.replace(line, NORMALIZED_ENV_LINE if _normalizes(source) else replacement)
    raise ValueError(
        "not a CleanRL script this runner can patch: it does not hold exactly once the line "
        + " or ".join(repr(line) for line in ENV_LINES)
    )


def _gym_from_gymnasium() -> None:
    """``import gym`` (and ``gym.spaces``, ``gym.wrappers``) served by Gymnasium."""
    import gymnasium
    import gymnasium.spaces
    import gymnasium.wrappers

    def monitor(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("gym.wrappers.Monitor (--capture-video) is not supported on shmbridge")

    wrappers = types.ModuleType("gym.wrappers")
    wrappers.Monitor = monitor  # type: ignore[attr-defined]
    wrappers.__getattr__ = lambda name: getattr(gymnasium.wrappers, name)  # type: ignore[attr-defined]
    sys.modules["gym"] = gymnasium
    sys.modules["gym.spaces"] = gymnasium.spaces
    sys.modules["gym.wrappers"] = wrappers


def main(argv: Optional[List[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        sys.exit("usage: python -m shmbridge.integrations.cleanrl SCRIPT.py [SCRIPT'S ARGUMENTS]")
    path = args[0]
    with open(path) as f:
        try:
            source = patch(f.read())
        except ValueError as e:
            sys.exit(f"{path}: {e}")
    import importlib.util

    from stable_baselines3.common.vec_env import VecMonitor, VecNormalize

    _gym_from_gymnasium()
    if importlib.util.find_spec("pybullet_envs") is None:
        sys.modules["pybullet_envs"] = types.ModuleType("pybullet_envs")  # it only registers envs
    sys.argv = list(args)
    namespace = {"__name__": "__main__", "__file__": path, "VecMonitor": VecMonitor,
                 "VecNormalize": VecNormalize, "VecClipActions": _vec_clip_actions(),
                 "shmbridge_vec_env": shmbridge_vec_env}
    exec(compile(source, path, "exec"), namespace)


if __name__ == "__main__":
    main()
