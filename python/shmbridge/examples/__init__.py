"""Examples that use shmbridge: ``python -m shmbridge.examples.ppo`` trains PPO on the
reference ``cartpole`` engine (the main job), from its state (``ppo.py``) or from the
frames of the ``pixels`` engine or of a native MuJoCo engine's camera (``ppo_pixels.py``);
``ppo_core.py`` holds what both
trainers use. ``python -m shmbridge.examples.ppo_async`` trains the same PPO with
asynchronous batches (``recv``/``send`` over shards, a rollout per env)."""
