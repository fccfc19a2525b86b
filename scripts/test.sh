#!/usr/bin/env bash
# Every test: unit, integration (cross-process, 1M-step stress, hostile headers, peer
# death, the fault matrix, hostile files and scribbled live regions, access control,
# command channel, shards), the C ABI (hostile calls in C, the C null client for
# 100,000 checked steps, the C CartPole engine against the Rust one bit for bit, the C
# programs under AddressSanitizer and UndefinedBehaviorSanitizer), the Python package's
# tests (sharded Gymnasium and MuJoCo envs, two torchrun ranks with gloo, the C and C#
# CartPole engines trained against from Python, the C and C# engines that render with
# Vulkan themselves and hand over their own memory, checked byte for byte on lavapipe,
# and their faults under the sanitizers), the type stubs of the native module
# against the module (mypy's stubtest), property, the loom models of the wait
# handshake, the doorbell and the ring, the checks that the committed FlatBuffers code and
# C header are what flatc and cbindgen generate, 90 s of fuzzing (45 s each for the command
# reader and the header validation, side by side on two cores), smoke runs of the
# benchmarks, a 1-minute soak, and a check that nothing was left in /dev/shm.
# GPU tests (tests/cuda.rs, tests/python/test_gpu.py) run where CUDA is usable and skip
# with the reason elsewhere.
# The Python tests run against the package as users install it: the abi3 manylinux wheel
# (scripts/build-wheel.sh) in a fresh virtual environment, with no cargo or rustc on PATH,
# and the C and C# tests against the C library installed with CMake into a prefix
# (scripts/install-c.sh), as are a C engine built with pkg-config and a C++ one built with
# find_package(shmbridge). The Python API reference (scripts/api-docs.sh) is built with
# warnings as errors. The Python dependencies (several GB on a fresh machine) download
# in the background while the Rust steps compile.
#
# Two lanes run in the background (scripts/lib.sh: lane_start, lane_join), so that both
# cores stay busy where a step keeps one: the wheel beside the Rust steps; and the loom
# models, the fuzz targets' build, the benchmarks' smoke runs, the soak, the Vulkan and GPU
# tests, the build without features and the header check beside cargo test and pytest (see tail_lane for
# where that lane runs in the foreground instead). A lane's output is printed, whole,
# where the script waits for it.
#
# Each step prints "== [T s] ..." (seconds since the start), and the run ends with the wall
# and CPU seconds of every step (scripts/lib.sh: step, steps_summary). What it compiles,
# each graph once:
#   dev, cuda+vulkan      the C ABI's tests (capi with cuda, as installed) and cargo test
#   check, no features    every target, without the cuda and vulkan features
#   release, no features  the loom models (the `loom` feature: cfg(loom) for this crate
#                         alone, on the same dependencies and features: see Cargo.toml's
#                         dev-dependencies), benchmarks, the soak
#   release, cuda+vulkan  the C library installed; release, vulkan (capi's defaults): the
#                         C benchmarks' library
#   wheel profile         the wheel (zig as the linker, for x86_64-unknown-linux-gnu)
#   dev                   the header tool (cbindgen)
#   fuzz/target           the fuzz targets (nightly, sanitizer and coverage flags)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
trap 'lanes_stop; steps_summary' EXIT
# On CI every run starts from an empty target folder: the caches incremental compilation
# writes (for this workspace's crates) would never be read, only written.
if [ -n "${CI:-}" ]; then
    export CARGO_INCREMENTAL=0
fi

step "tools: Rust, Vulkan (lavapipe, headers, glslang), Mono, CMake, namespace tools"
ensure_rust
ensure_vulkan
ensure_vulkan_dev
ensure_mono
ensure_cmake
ensure_namespace_tools
ensure_chromium

before=$(shm_regions)

step "Python dependencies (pyproject.toml: test, bench, docs) into .venv, in the background"
start_deps test bench docs

# Beside the Rust steps below (the wheel's compile is mostly one crate, one core at a time).
wheel() {
    step "the wheel users install: one abi3 manylinux wheel, built from the sdist (scripts/build-wheel.sh)"
    bash scripts/build-wheel.sh --out target/dist
}
lane_start wheel wheel

step "the C ABI (capi/) with the cuda feature, as installed: unit tests, C programs, sanitizers"
# The C programs link the library itself: cargo test builds no cdylib for them. With
# `cuda` (as scripts/install-c.sh builds it), the core crate has the features of the
# `cargo test` below, so its dependencies are compiled once for both. The library with its
# default features alone (vulkan) is built by the C benchmarks' smoke runs below.
cargo build --locked -p shmbridge-capi --features cuda
cargo test --locked -p shmbridge-capi --features cuda

step "src/ has no import cycle and follows the layer order in src/lib.rs"
python3 scripts/layers.py

step "the C library installed with CMake into target/c-prefix (scripts/install-c.sh)"
rm -rf target/c-prefix
# As whoever runs the tests, even under sudo (install-c.sh refuses to build as root for a
# user who ran it with sudo; the tests run everything as root then).
env -u SUDO_USER bash scripts/install-c.sh target/c-prefix
step "scripts/install-c.sh: a relative prefix is the caller's, no package installed unasked, no build under sudo"
bash tests/install_c.sh

step "waiting for lane wheel (the wheel)"
lane_join wheel

step "Python environment: the wheel in a fresh venv, with the dependencies (also NVRTC: the kernels compile here without a GPU)"
wait_deps
fresh_venv_with_wheel target/test-venv target/dist/shmbridge-*.whl
py=target/test-venv/bin/python
use_nvrtc_wheel "$py"
# The kernels compile in CI for real: a missing libnvrtc is a failure there, not a skip.
export SHMBRIDGE_REQUIRE_NVRTC=1

# Beside cargo test and pytest (much of both on one core; pytest runs without Rust on
# PATH): the loom models, the fuzz targets' build, the benchmarks' smoke runs and the soak
# (none checks a time; their cargo builds are release ones, apart from cargo test's), the
# Vulkan and GPU tests, the build without features and the header check. What makes regions runs with
# a /dev/shm of its own (with_private_shm, as root), so pytest's checks of what is left in
# /dev/shm see only its own regions. The lane runs after pytest instead, in the
# foreground, without root, and where an NVIDIA GPU is present (gpu_present): tests on
# both sides compare the device's free memory before and after, and a GPU is one for all
# processes. The fuzzing, which counts executions in a fixed time, runs after both, on
# two free cores.
tail_lane() {
    step "loom models of the real post/wait handshake, doorbell and ring (each prints its interleavings)"
    # The `loom` feature sets cfg(loom) for this crate alone (build.rs), so its dependencies
    # are the release ones the benchmarks and the soak use below, compiled once.
    LOOM_MAX_PREEMPTIONS=3 cargo test --locked --release --features loom --lib loom_tests -- --nocapture

    step "the fuzz targets (scripts/fuzz.sh --build: one codegen unit, one core; in fuzz/target)"
    bash scripts/fuzz.sh --build

    step "benchmark smoke runs (no timing is checked)"
    part "roundtrip, with the C engine's cases (scripts/bench-c.sh)"
    SHMBRIDGE_BENCH_QUICK=1 with_private_shm bash scripts/bench-c.sh
    part "the C engine's own Vulkan memory against a copy (scripts/bench-c-vulkan.sh)"
    # With the package from the wheel (target/test-venv): .venv holds only its dependencies.
    SHMBRIDGE_BENCH_QUICK=1 PYTHON="$py" with_private_shm bash scripts/bench-c-vulkan.sh
    part "commands, shards"
    SHMBRIDGE_BENCH_QUICK=1 with_private_shm cargo bench --locked --bench commands
    SHMBRIDGE_BENCH_QUICK=1 with_private_shm cargo bench --locked --bench shards

    step "soak for ${SHMBRIDGE_SOAK_MINUTES:-1} min: steps, resets, calls, re-attaches, engine restarts and kills, every step checked, resources flat"
    bash scripts/soak.sh "${SHMBRIDGE_SOAK_MINUTES:-1}"

    # Last: by then cargo test has most likely let go of target/debug (if not, cargo's
    # lock makes these wait for it).
    step "the Vulkan and GPU tests of cargo test (cuda and vulkan features), one at a time"
    local t
    for t in vulkan cuda; do
        if [ "$t" = vulkan ]; then
            part "the Vulkan tests (tests/vulkan.rs, on lavapipe), with what each skipped and why"
        else
            part "the GPU tests (tests/cuda.rs), with what each one skipped and why"
        fi
        if ! with_private_shm cargo test --locked --features cuda,vulkan --test "$t" -- --nocapture \
            --test-threads=1 > "target/cargo-test-$t.log" 2>&1; then
            cat "target/cargo-test-$t.log" >&2
            echo "error: tests/$t.rs failed (above)" >&2
            exit 1
        fi
        grep -E 'SKIPPED|^test result' "target/cargo-test-$t.log"
    done

    step "the build without the cuda and vulkan features"
    cargo check --locked --all-targets

    step "include/shmbridge.h is what cbindgen generates from capi/src"
    cargo run --locked -q -p shmbridge-header -- --check
}
tail_beside=""
if can_private_shm && ! gpu_present; then
    tail_beside=1
    lane_start tail tail_lane
fi

step "cargo test (with the cuda and vulkan features)"
# Every target cargo test runs, but the Vulkan and GPU tests, which run once, in tail_lane
# above, one at a time and uncaptured, so that the log shows what each one skipped and why.
tests=()
for f in tests/*.rs; do
    case "$f" in tests/vulkan.rs | tests/cuda.rs) ;; *) tests+=(--test "$(basename "$f" .rs)") ;; esac
done
cargo build --locked --features cuda,vulkan --examples   # as cargo test: built, not run
cargo test --locked --features cuda,vulkan --lib --bins "${tests[@]}"
cargo test --locked --features cuda,vulkan --doc

step "Python package: pytest, against the installed wheel, with no cargo or rustc on PATH"
without_rust sh -c 'if command -v cargo || command -v rustc; then exit 1; fi' \
    || { echo "error: cargo or rustc is still on PATH" >&2; exit 1; }
without_rust target/test-venv/bin/shmbridge --help | sed -n 1,3p
without_rust target/test-venv/bin/shmbridge-ppo --help | sed -n 1p
SHMBRIDGE_C_PREFIX=$PWD/target/c-prefix SHMBRIDGE_EXPECT_WHEEL=1 \
    without_rust "$py" -m pytest -q -rs tests/python 2>&1 | tee target/pytest.log
if grep -q "no Vulkan driver here" target/pytest.log; then
    echo "error: the Vulkan tests skipped: lavapipe (scripts/lib.sh ensure_vulkan) should run them" >&2
    exit 1
fi

step "the native module's type stubs (python/shmbridge/_native.pyi) against the module: mypy's stubtest"
without_rust "$py" -m mypy.stubtest shmbridge._native --allowlist scripts/stubtest-allowlist.txt

step "examples/deploy's Dockerfile, Compose file and Kubernetes Job, run as written with their containers emulated by namespaces (scripts/docker-check.sh --emulate)"
bash scripts/docker-check.sh --emulate target/dist/shmbridge-*.whl

step "the Python API reference (scripts/api-docs.sh: a broken docstring reference fails)"
bash scripts/api-docs.sh "$py"

step "generated FlatBuffers code matches schema/shmbridge.fbs"
bash scripts/gen-flatbuffers.sh --check

if [ -n "$tail_beside" ]; then
    step "waiting for lane tail (loom, fuzz build, benchmarks, soak, the Vulkan and GPU tests, the build without features, the header)"
    lane_join tail
else
    tail_lane
fi

step "fuzz the command-channel reader and the header validation: ${SHMBRIDGE_FUZZ_SECONDS:-90} s in all, side by side"
# Under AddressSanitizer with a nightly toolchain; on stable (a fresh Debian machine)
# without a sanitizer: scripts/fuzz.sh says which.
bash scripts/fuzz.sh "${SHMBRIDGE_FUZZ_SECONDS:-90}"

step "nothing left in /dev/shm (regions and their fd sockets, shmbridge-*.fd) or the socket namespace"
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
