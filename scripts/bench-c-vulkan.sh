#!/usr/bin/env bash
# A C engine's own Vulkan render target exported, against the same engine copying each
# frame into host shared memory: builds the C library in release mode (capi/), compiles
# the shader of examples/c/vulkan_frames.comp with glslangValidator and
# examples/c/vulkan_engine.c against the library, and runs
# `python -m shmbridge.bench vulkan --c-engine` on it (64x84x84x4 frames by default), both
# paths interleaved in one run. Arguments go to the bench (e.g. --out docs/benchmarks);
# SHMBRIDGE_BENCH_QUICK=1 makes it a smoke run. PYTHON: the interpreter with shmbridge
# installed (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
ensure_vulkan
ensure_vulkan_dev
# The features of the library as installed (scripts/install-c.sh): the same build.
cargo build --locked --release -q -p shmbridge-capi --features cuda
lib=$PWD/target/release
out=$lib/c
mkdir -p "$out"
glslangValidator -V --target-env vulkan1.1 --vn vulkan_frames_spv -o "$out/vulkan_frames.spv.h" \
    examples/c/vulkan_frames.comp >/dev/null
cc -std=c11 -D_GNU_SOURCE -O2 -ffp-contract=off -Wall -Wextra -Werror -Iinclude -Iexamples/c -I"$out" \
    examples/c/vulkan_engine.c examples/c/vulkan_frames.c -L"$lib" -Wl,-rpath,"$lib" \
    -lshmbridge -lvulkan -lm -o "$out/vulkan_engine"
quick=()
if [ -n "${SHMBRIDGE_BENCH_QUICK:-}" ]; then quick=(--quick); fi
"${PYTHON:-.venv/bin/python}" -m shmbridge.bench vulkan --c-engine "$out/vulkan_engine" "${quick[@]}" "$@"
