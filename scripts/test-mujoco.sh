#!/usr/bin/env bash
# The native MuJoCo engine (cargo feature `mujoco`, docs/mujoco.md): installs MuJoCo
# (PyPI's mujoco==3.17.0 wheel) and Gymnasium into target/mujoco-venv, builds the Python
# extension with the feature into that venv, and runs its tests (the alignment with
# Gymnasium's envs, a raw MJCF file, PPO learning InvertedPendulum, the package's PPO from
# the camera's pixels), after the engine's Rust
# unit tests. `--release`: the extension in the wheel's release profile (for
# benchmarks; minutes longer to build), else the dev profile. Extra arguments go to pytest.
#
#   bash scripts/test-mujoco.sh [--release] [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

profile=dev
if [ "${1:-}" = "--release" ]; then
    profile=wheel
    shift
fi
venv=target/mujoco-venv
step "rust, python, build tools"
# mujoco-rs 7 needs Rust 1.95 (the crate without the feature: 1.82).
RUST_MIN=1.95.0
ensure_rust
ensure_python
ensure_build_tools
step "mujoco and gymnasium into $venv, Mesa's EGL (the camera), lavapipe (its frames in Vulkan memory)"
# Where scripts/test.sh made .venv (torch, Stable-Baselines3, Gymnasium: several GB), this
# venv reaches its packages through a .pth line after its own, as the test venv does: only
# what differs (the pinned mujoco) is installed here, and its own copy comes first.
if [ -x .venv/bin/python ] && [ ! -e "$venv/bin/python" ]; then
    make_venv "$venv"
    own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    .venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > "$own/zz_deps_from_dot_venv.pth"
fi
ensure_mujoco "$venv"
ensure_mesa
ensure_vulkan
export MUJOCO_GL=egl
step "Stable-Baselines3, torch and tqdm into $venv (the learning tests: the sb3 and ppo extras)"
# shellcheck disable=SC2046
"$venv/bin/python" -m pip install -q $(PROJECT_PYTHON="$venv/bin/python" project_requirements sb3 ppo) \
    2>&1 | { grep -v "Running pip as the 'root' user" || true; }
step "the engine's unit tests and the registry's with its tasks (cargo test --features mujoco)"
# Gymnasium's model files, as `python -m shmbridge engine` finds them.
SHMBRIDGE_MUJOCO_ASSETS=$("$venv/bin/python" -c 'import os, gymnasium; print(os.path.join(os.path.dirname(gymnasium.__file__), "envs", "mujoco", "assets"))')
export SHMBRIDGE_MUJOCO_ASSETS
cargo test --locked --features mujoco --lib envs::
step "the extension with --features mujoco ($profile profile)"
rm -rf target/mujoco-wheel
# --auditwheel skip: libmujoco.so stays the mujoco wheel's (found through the run path
# $ORIGIN/../mujoco), not copied into this wheel.
target/build-tools/bin/maturin build --locked --profile "$profile" -F python,cuda,vulkan,mujoco \
    --auditwheel skip --out target/mujoco-wheel
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps target/mujoco-wheel/shmbridge-*.whl \
    2>&1 | { grep -v "Running pip as the 'root' user" || true; }
step "pytest tests/python/test_mujoco.py"
export SHMBRIDGE_NAMESPACE=${SHMBRIDGE_NAMESPACE:-mujoco}
cd tests/python
# A worker per core: the tests are many short comparisons and two long runs, which come
# first (`long`, tests/python/conftest.py; with --dist load --maxschedchunk 1 each worker
# holds two tests and gets the next in order when it ends one), not last.
"../../$venv/bin/python" -m pytest -q -rs -n auto --dist load --maxschedchunk 1 --durations 5 test_mujoco.py "$@"
