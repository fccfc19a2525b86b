#!/usr/bin/env bash
# Every check that needs a GPU, in one command, for a machine with an NVIDIA GPU and
# driver: the Rust GPU tests (tests/cuda.rs), the Python GPU tests (test_gpu, and the GPU
# tests of test_ppo and test_bench), the Vulkan tests with the CUDA importer and `bench
# vulkan`, `python -m shmbridge.bench gpu` (written to
# bench-results/gpu.{md,json}) and the PPO main job on CUDA end to end. Unlike
# scripts/test.sh, a GPU test that skips here is a failure: on a GPU machine they must run.
# Uses .venv when it exists (as scripts/test.sh leaves it), else installs like test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
[ -x .venv/bin/python ] || ensure_venv ".[test,bench]"

nvidia-smi || { echo "gpu-check: nvidia-smi failed: no usable NVIDIA driver here" >&2; exit 3; }
nvrtc_lib=$(.venv/bin/python -c 'import shmbridge; print(":".join(shmbridge.nvrtc_library_dirs()))')
if [ -n "$nvrtc_lib" ]; then
    export LD_LIBRARY_PATH="${nvrtc_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
.venv/bin/python -c 'import shmbridge; print("shmbridge.cuda_available():", shmbridge.cuda_available())'

log=$(mktemp)
trap 'rm -f "$log"' EXIT

echo "== Rust GPU tests"
cargo test --locked --features cuda --test cuda -- --nocapture --test-threads=1 2>&1 | tee "$log"
if grep -q SKIPPED "$log"; then
    echo "gpu-check: Rust GPU tests skipped on a GPU machine (above)" >&2
    exit 1
fi

echo "== Python GPU tests"
.venv/bin/python -m pytest -rs -v tests/python/test_gpu.py tests/python/test_ppo.py \
    tests/python/test_bench.py 2>&1 | tee "$log"
if grep -E '^SKIPPED .*(CUDA|GPU|cuda|gpu)' "$log" | grep -v 'checks the fallback'; then
    echo "gpu-check: Python GPU tests skipped on a GPU machine (above)" >&2
    exit 1
fi

echo "== Vulkan tests with the CUDA importer (needs the NVIDIA Vulkan driver and a loader)"
cargo test --locked --features cuda,vulkan --test vulkan -- --nocapture --test-threads=1 2>&1 | tee "$log"
if grep -q SKIPPED "$log"; then
    echo "gpu-check: Vulkan tests skipped on a GPU machine (above): is libvulkan.so.1 there," >&2
    echo "and does VK_DRIVER_FILES name the NVIDIA ICD?" >&2
    exit 1
fi

echo "== bench vulkan (the GPU half: Vulkan->CUDA import against host shm + .cuda())"
.venv/bin/python -m shmbridge.bench vulkan --out bench-results

echo "== bench gpu"
.venv/bin/python -m shmbridge.bench gpu --out bench-results

echo "== PPO main job on CUDA"
.venv/bin/python -m shmbridge.examples.ppo --device cuda --plot bench-results/ppo_cuda.png
