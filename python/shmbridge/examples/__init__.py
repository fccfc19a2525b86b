"""Examples that use shmbridge: ``python -m shmbridge.examples.ppo`` trains PPO on the
reference ``cartpole`` engine (the main job)."""
