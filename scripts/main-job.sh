#!/usr/bin/env bash
# The main job: PPO in PyTorch on the reference CartPole engine through shmbridge
# (python -m shmbridge.examples.ppo). Installs what it needs (Rust, a virtual environment
# in .venv with the package and its `ppo` extra), then trains until the mean return of
# the last 100 episodes reaches 475. Options go to the trainer (see --help); the device is
# auto: the learner and the engine's tensors on CUDA when torch and shmbridge.cuda_available()
# both can use a GPU, else the CPU.
# On a fresh machine the two long parts run side by side: pip downloads the dependencies
# (torch from PyPI brings its CUDA libraries, several GB) while cargo compiles the
# extension; then the package is installed from the wheel built.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
echo "main-job: installing the dependencies (pyproject.toml: ppo) in the background"
start_deps ppo
echo "main-job: building the extension module (cargo, release)"
rm -rf target/main-job-wheel
.venv/bin/python -m pip wheel -q --no-deps -w target/main-job-wheel .
echo "main-job: waiting for the dependencies"
wait_deps
.venv/bin/python -m pip install -q --no-deps --force-reinstall target/main-job-wheel/shmbridge-*.whl
echo "main-job: training"
exec .venv/bin/shmbridge-ppo "$@"
