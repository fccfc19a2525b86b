#!/usr/bin/env bash
# Every test, one named step after another (each prints "== [T s] NAME", T the seconds
# since the start); the checks after the Python tests (generated code, models and fuzzing,
# smoke runs, MuJoCo, stubs, deployment files, API reference) are make targets
# (scripts/checks.mk), run as many at once as there are cores. What runs:
#   rust tests      cargo-nextest (installed if missing): unit, integration (cross-process,
#                   1M-step stress, hostile headers, peer death, the fault matrix, hostile
#                   files and scribbled live regions, access control, command channel,
#                   shards), the device contract suite (tests/contract.rs: host, Vulkan on
#                   lavapipe, CUDA where a GPU is), the Vulkan and GPU suites; then the
#                   doc tests. Each test is a process with a region namespace of its own
#                   (tests/common/mod.rs); .config/nextest.toml says what must run alone.
#   C ABI           capi/'s tests (hostile calls in C, the C null client for 100,000
#                   checked steps, the C CartPole engine against the Rust one bit for bit,
#                   the C programs under AddressSanitizer and UndefinedBehaviorSanitizer);
#                   the C library installed with CMake (scripts/install-c.sh), which the C
#                   and C# tests use, as do a C engine built with pkg-config and a C++ one
#                   built with find_package(shmbridge).
#   python          pytest under pytest-xdist (a worker per core and one more; each test a
#                   region namespace of its own: tests/python/conftest.py) against the abi3
#                   manylinux wheel
#                   (scripts/build-wheel.sh) in a fresh venv with no cargo or rustc on PATH:
#                   sharded Gymnasium and MuJoCo envs, two torchrun ranks with gloo, the C
#                   and C# CartPole engines, the C and C# engines that render with Vulkan,
#                   checked byte for byte on lavapipe, and their faults under the
#                   sanitizers; the GPU tests alone after them (they compare the device's
#                   free memory); mypy's stubtest of the native module; the API reference
#                   (warnings are errors).
#   generated code  the committed FlatBuffers code and C header are what flatc and
#                   cbindgen generate; src/ follows the layer order of src/lib.rs.
#   models, fuzz    the loom models of the wait handshake, the doorbell, the ring and the
#                   stream lanes; 90 s of fuzzing (the command reader, the header
#                   validation and the stream record decoder).
#   smoke runs      the benchmarks (no timing checked), a 1-minute soak, the build without
#                   the cuda and vulkan features.
#   mujoco          the native MuJoCo engine built with the `mujoco` feature, against
#                   Gymnasium's envs for 1,000 steps per task (scripts/test-mujoco.sh).
#   leftovers       nothing of this run left in /dev/shm or bound as an fd socket.
# Everything runs in the region namespace SHMBRIDGE_NAMESPACE (docs/protocol.md 1.1) given
# to the script, or a fresh one, so two runs on one machine never touch each other's
# regions. The Python dependencies (several GB on a fresh machine) and the wheel build in
# the background while the Rust steps run.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
# On CI every run starts from an empty target folder: the caches incremental compilation
# writes (for this workspace's crates) would never be read, only written.
# Nor is the debug info of its release builds (the C library, the loom models, the
# benchmarks, the soak, the fuzz targets) read there: without it they build a tenth faster.
if [ -n "${CI:-}" ]; then
    export CARGO_INCREMENTAL=0 CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_BENCH_DEBUG=0
fi
# Steps print their times from here (scripts/lib.sh `step`), also those make runs.
export STEPS_T0=$(date +%s)
export SHMBRIDGE_NAMESPACE="${SHMBRIDGE_NAMESPACE:-run$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')}"
echo "region namespace: $SHMBRIDGE_NAMESPACE"

step "tools: Rust, cargo-nextest, Vulkan (lavapipe, headers, glslang), Mono, CMake, namespace tools, Chromium, git, libFuzzer, make"
ensure_rust
ensure_nextest
ensure_vulkan
ensure_vulkan_dev
ensure_mono
ensure_cmake
ensure_namespace_tools
ensure_chromium
ensure_git
ensure_libfuzzer
ensure_make

step "in the background: the Python dependencies (pyproject.toml: test, bench, docs) into .venv, and the wheel users install"
start_deps test bench docs
mkdir -p target
bash scripts/build-wheel.sh --out target/dist > target/wheel.log 2>&1 &
wheel_pid=$!

step "src/ has no import cycle and follows the layer order in src/lib.rs"
python3 scripts/layers.py

step "the C ABI (capi/) with the cuda feature, as installed: unit tests, C programs, sanitizers"
# The C programs link the library itself (cargo test builds no cdylib for them); with
# `cuda`, the core crate has the features of the Rust tests below: one build for both.
cargo build --locked -p shmbridge-capi --features cuda
cargo test --locked -p shmbridge-capi --features cuda

step "the C library installed with CMake into target/c-prefix (scripts/install-c.sh)"
rm -rf target/c-prefix
# As whoever runs the tests, even under sudo (install-c.sh refuses to build as root for a
# user who ran it with sudo; the tests run everything as root then).
env -u SUDO_USER bash scripts/install-c.sh target/c-prefix
step "scripts/install-c.sh: a relative prefix is the caller's, no package installed unasked, no build under sudo"
bash tests/install_c.sh

step "the Rust tests and examples built (cuda and vulkan features), while the wheel may still build"
cargo build --locked --features cuda,vulkan --examples --lib --bins --tests

step "the Python environment: the wheel (built in the background) in a fresh venv, with the dependencies and NVRTC (the Rust tests compile their kernels with it too)"
if ! wait "$wheel_pid"; then
    cat target/wheel.log >&2
    echo "error: scripts/build-wheel.sh failed (above)" >&2
    exit 1
fi
tail -n 3 target/wheel.log
wait_deps
fresh_venv_with_wheel target/test-venv target/dist/shmbridge-*.whl
py=target/test-venv/bin/python
use_nvrtc_wheel "$py"
# The kernels compile in CI for real: a missing libnvrtc is a failure there, not a skip.
export SHMBRIDGE_REQUIRE_NVRTC=1

step "rust tests under cargo-nextest (cuda and vulkan features)"
profile=default
if [ -e /dev/nvidiactl ]; then profile=gpu; fi   # .config/nextest.toml: GPU tests alone
cargo nextest run --locked --features cuda,vulkan --profile "$profile" --lib --bins --tests

step "rust doc tests"
cargo test --locked --features cuda,vulkan --doc

step "python tests: pytest-xdist against the installed wheel, with no cargo or rustc on PATH"
without_rust sh -c 'if command -v cargo || command -v rustc; then exit 1; fi' \
    || { echo "error: cargo or rustc is still on PATH" >&2; exit 1; }
without_rust target/test-venv/bin/shmbridge --help | sed -n 1,3p
without_rust target/test-venv/bin/shmbridge-ppo --help | sed -n 1p
export SHMBRIDGE_C_PREFIX=$PWD/target/c-prefix SHMBRIDGE_EXPECT_WHEEL=1
# A worker more than cores: some tests wait (for a process to start, for idle connections
# to be dropped), and the extra worker uses that time. --dist load --maxschedchunk 1: each
# worker holds two tests and gets the next one, in order, whenever it ends one; the tests
# marked `long` come first (tests/python/conftest.py), so they run from the start, two per
# worker, and not at the end beside idle workers. The slowest tests are listed at the end.
without_rust "$py" -m pytest -q -rs -n $(( $(nproc) + 1 )) --dist load --maxschedchunk 1 --durations 15 \
    --ignore tests/python/test_gpu.py tests/python 2>&1 | tee target/pytest.log
if grep -q "no Vulkan driver here" target/pytest.log; then
    echo "error: the Vulkan tests skipped: lavapipe (scripts/lib.sh ensure_vulkan) should run them" >&2
    exit 1
fi

step "python GPU tests, alone (they compare the device's free memory; they skip without a GPU)"
without_rust "$py" -m pytest -q -rs tests/python/test_gpu.py

step "the checks after the Python tests, as many at once as cores (scripts/checks.mk): the loom models, the fuzz targets built and run, the MuJoCo engine, benchmark smoke runs, the soak, the build without the device features, generated code, type stubs, the deployment files, the API reference"
export PY="$PWD/$py"
if ! make -f scripts/checks.mk -j"$(nproc)" --output-sync=recurse -k; then
    echo "error: a check failed (above: its output, which ends with the error, and make's summary)" >&2
    exit 1
fi

step "nothing of this run left in /dev/shm (regions and their fd sockets) or the socket namespace"
no_region_left "$SHMBRIDGE_NAMESPACE"
