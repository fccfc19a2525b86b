"""shmbridge: zero-copy tensors between a simulator ("engine") and a learner ("client").

    import shmbridge, torch

    with shmbridge.launch("cartpole", num_envs=256) as client:
        obs = torch.from_dlpack(client.obs)          # a view of the shared memory
        actions = torch.from_dlpack(client.actions)  # write actions in place ...
        for _ in range(1000):
            actions.random_(0, 2)
            client.step()                            # ... or client.step(my_actions)
            # obs (and rewards, terminated, truncated) now hold the new frame

``attach(name)`` joins an engine started elsewhere (``shmbridge engine`` prints its name).
A simulator written in Python serves with ``Engine(EngineSpec(...))``: see
``examples/python_engine.py``.
``observe(name)`` watches a running engine read-only (frames, episode stats, video), and
``shmbridge view NAME`` serves a page that shows it live.
``shmbridge.gym.ShmVectorEnv`` is a Gymnasium vector env over a client; ``import shmbridge``
registers ``gymnasium.make_vec("shmbridge/CartPole-v1", num_envs=N)`` (and ``gymnasium.make``
of it: one env, ``shmbridge.gym.ShmEnv``). ``shmbridge.integrations`` adapts engines to the
learning libraries (``shmbridge.integrations.sb3``, ``.torchrl``, ``.rsl_rl``, ``.skrl``).
``shmbridge.stream`` carries records (LLM rollouts, transitions) from many producer
processes to a trainer, written and read in place (``import shmbridge.stream``).
"""

# The face of the package: the native types, the exceptions and the launchers, re-exported.
# `import shmbridge` exposes only `__all__` (and its submodules); the launching code is in
# `_launch`, the engine process in `_process`.
from . import errors
from ._batch import AsyncEnvPool, Batch
from ._launch import CudaStatus, attach, cuda_status, launch, launch_gym, nvrtc_library_dirs
from ._native import Client, Engine, EngineSpec, Tensor, __version__, cuda_available, gc, list_regions
from .errors import *  # noqa: F401,F403 - every exception class at the top level
from .observe import Observer, observe

__all__ = [
    "AsyncEnvPool",
    "Batch",
    "Client",
    "Engine",
    "EngineSpec",
    "Tensor",
    "Observer",
    "observe",
    "attach",
    "launch",
    "launch_gym",
    "cuda_available",
    "cuda_status",
    "CudaStatus",
    "nvrtc_library_dirs",
    "list_regions",
    "gc",
    "errors",
    "__version__",
    *errors.__all__,
]

# Gymnasium: after `import shmbridge`, `gymnasium.make_vec("shmbridge/CartPole-v1",
# num_envs=N)` makes a `shmbridge.gym.ShmVectorEnv`. Registered without importing
# gymnasium here (it may be absent, and costs ~0.2 s): see `_gym_registration`.
from . import _gym_registration

_gym_registration.install()
