#!/usr/bin/env bash
# The main job: PPO in PyTorch on the reference CartPole engine through shmbridge
# (python -m shmbridge.examples.ppo). Installs what it needs (Rust, a virtual environment
# in .venv with the package and its `ppo` extra), then trains until the mean return of
# the last 100 episodes reaches 475. Options go to the trainer (see --help); the device is
# auto: the learner and the engine's tensors on CUDA when torch and shmbridge.cuda_available()
# both can use a GPU, else the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
ensure_venv ".[ppo]"
exec .venv/bin/shmbridge-ppo "$@"
