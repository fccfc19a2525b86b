#!/usr/bin/env bash
# Every test: unit, integration (cross-process, 1M-step stress, hostile headers, peer
# death, the fault matrix, hostile files and scribbled live regions, access control,
# command channel, shards), the C ABI (hostile calls in C, the C null client for
# 100,000 checked steps, the C CartPole engine against the Rust one bit for bit, the C
# programs under AddressSanitizer and UndefinedBehaviorSanitizer), the Python package's
# tests (sharded Gymnasium and MuJoCo envs, two torchrun ranks with gloo, the C and C#
# CartPole engines trained against from Python), the type stubs of the native module
# against the module (mypy's stubtest), property, the loom models of the wait
# handshake, the doorbell and the ring, the checks that the committed FlatBuffers code and
# C header are what flatc and cbindgen generate, a 90 s fuzz run of the command reader and
# the header validation, smoke runs of the benchmarks, a 1-minute soak, and a check that
# nothing was left in /dev/shm.
# GPU tests (tests/cuda.rs, tests/python/test_gpu.py) run where CUDA is usable and skip
# with the reason elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
ensure_vulkan
ensure_mono
ensure_chromium

before=$(shm_regions)

echo "== Python environment (also provides NVRTC: the kernels compile here without a GPU)"
ensure_venv ".[test,bench]"
use_nvrtc_wheel .venv/bin/python

echo "== cargo test (with the cuda and vulkan features)"
cargo test --locked --features cuda,vulkan
echo "-- the Vulkan tests (tests/vulkan.rs, on lavapipe) again, with what each skipped and why"
cargo test --locked --features cuda,vulkan --test vulkan -- --nocapture --test-threads=1 2>&1 \
    | grep -E 'SKIPPED|^test result' || true
echo "-- the GPU tests (tests/cuda.rs) again, with what each one skipped and why"
cargo test --locked --features cuda,vulkan --test cuda -- --nocapture --test-threads=1 2>&1 \
    | grep -E 'SKIPPED|^test result' || true

echo "== the C ABI (capi/): unit tests, C programs, sanitizers; then with the cuda feature"
# The C programs link the library itself: cargo test builds no cdylib for them.
cargo build --locked -p shmbridge-capi
cargo test --locked -p shmbridge-capi
cargo check --locked -p shmbridge-capi --features cuda

echo "== the build without the cuda and vulkan features"
cargo check --locked --all-targets

echo "== loom models of the real post/wait handshake, doorbell and ring (each prints its interleavings)"
LOOM_MAX_PREEMPTIONS=3 RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
    cargo test --locked --release --lib loom_tests -- --nocapture

echo "== Python package: pytest"
.venv/bin/python -m pytest -q -rs tests/python

echo "== the native module's type stubs (python/shmbridge/_native.pyi) against the module: mypy's stubtest"
.venv/bin/python -m mypy.stubtest shmbridge._native --allowlist scripts/stubtest-allowlist.txt

echo "== src/ has no import cycle and follows the layer order in src/lib.rs"
python3 scripts/layers.py

echo "== generated FlatBuffers code matches schema/shmbridge.fbs"
bash scripts/gen-flatbuffers.sh --check

echo "== include/shmbridge.h is what cbindgen generates from capi/src"
cargo run --locked -q -p shmbridge-header -- --check

echo "== benchmark smoke runs (no timing is checked)"
SHMBRIDGE_BENCH_QUICK=1 bash scripts/bench-c.sh   # roundtrip, with the C engine's cases
SHMBRIDGE_BENCH_QUICK=1 cargo bench --locked --bench commands
SHMBRIDGE_BENCH_QUICK=1 cargo bench --locked --bench shards

echo "== soak for ${SHMBRIDGE_SOAK_MINUTES:-1} min: steps, resets, calls, re-attaches, engine restarts and kills, every step checked, resources flat"
bash scripts/soak.sh "${SHMBRIDGE_SOAK_MINUTES:-1}"

echo "== fuzz the command-channel reader and the header validation for ${SHMBRIDGE_FUZZ_SECONDS:-90} s"
# Under AddressSanitizer with a nightly toolchain; on stable (a fresh Debian machine)
# without a sanitizer: scripts/fuzz.sh says which.
bash scripts/fuzz.sh "${SHMBRIDGE_FUZZ_SECONDS:-90}"

echo "== nothing left in /dev/shm or the socket namespace"
if grep -q '@shmbridge-' /proc/net/unix; then
    echo "error: the tests left these fd sockets bound:" >&2
    grep '@shmbridge-' /proc/net/unix >&2
    exit 1
fi
after=$(shm_regions)
leaked=$(comm -13 <(echo "$before" | sort) <(echo "$after" | sort) | grep . || true)
if [ -n "$leaked" ]; then
    echo "error: the tests left these regions in /dev/shm:" >&2
    echo "$leaked" >&2
    exit 1
fi
echo "no region left"
