#!/usr/bin/env bash
# Builds, on a machine with the registries (this one), everything `scripts/gpu-check.sh
# --bundle DIR` needs on a GPU machine that has a driver, Python with torch and pytest,
# and nothing else: no Rust toolchain, no network. Into DIR (default .gpu, ignored by git):
#   bin/       the Rust GPU test binaries (tests/cuda.rs, tests/vulkan.rs) and the
#              `shmbridge` CLI they spawn, without debug info; bin/cli-path: where the
#              tests look for the CLI (an absolute path fixed when they were compiled)
#   wheels/    shmbridge (abi3, features python+cuda+vulkan) and what the GPU tests import
#              that such a machine lacks (Gymnasium and its small dependencies), for
#              CPython 3.12 on manylinux x86_64
#   debs/      the Vulkan and EGL loaders (libvulkan1, libglvnd...), unpacked there over /
#              when the machine has no libvulkan.so.1
# and prints its size: it travels with the working tree (64 MiB in all).
# Usage: bash scripts/gpu-bundle.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
[ -x .venv/bin/python ] || ensure_venv ".[test,bench]"

dir=${1:-.gpu}
# Ignored by git, so that the device tool carries it as a build folder.
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
case "$dir" in /*) ;; *) grep -qxF "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >>"$exclude" ;; esac
# Only ever a folder this script made (it leaves a marker) is replaced.
if [ -e "$dir" ] && [ ! -e "$dir/.gpu-bundle" ]; then
    echo "gpu-bundle: $dir exists and is not a bundle this script wrote: give another folder" >&2
    exit 2
fi
rm -rf "$dir"
mkdir -p "$dir/bin" "$dir/wheels" "$dir/debs"
touch "$dir/.gpu-bundle"

echo "== the Rust GPU tests and the CLI (no debug info: they travel)"
target=target/gpu-bundle
export CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_TEST_DEBUG=0
CARGO_TARGET_DIR=$target cargo build --locked --features cuda,vulkan --bin shmbridge
# Compiler errors go to stderr as usual (json-render-diagnostics); jq reads artifacts.
CARGO_TARGET_DIR=$target cargo test --locked --features cuda,vulkan --no-run \
    --test cuda --test vulkan --message-format=json-render-diagnostics \
    | jq -r 'select(.reason == "compiler-artifact" and .profile.test and .executable != null)
             | "\(.target.name) \(.executable)"' \
    | while read -r name exe; do cp "$exe" "$dir/bin/$name"; done
cp "$target/debug/shmbridge" "$dir/bin/shmbridge"
# tests/common's BIN is env!("CARGO_BIN_EXE_shmbridge"): this absolute path.
realpath "$target/debug/shmbridge" >"$dir/bin/cli-path"
strip "$dir/bin/"{cuda,vulkan,shmbridge}

echo "== wheels: shmbridge, and what the GPU tests import that the GPU machine lacks"
.venv/bin/python -m pip wheel -q --no-deps -w "$dir/wheels" .
# Gymnasium (shmbridge.gym, the PPO example's env checks) and its pure-Python needs; the
# machine has numpy, torch, pytest, cloudpickle and typing-extensions of its own. NVRTC
# for CUDA 12 (what the `cuda` extra installs): 12.4 is the newest whose wheel fits the
# size limit (25 MB; 12.9's is 90 MB), and it compiles for sm_90.
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir/wheels" gymnasium farama-notifications \
    nvidia-cuda-nvrtc-cu12==12.4.127

echo "== the Vulkan and EGL loaders (unpacked on the GPU machine when it has none)"
lists=$(mktemp -d)
trap 'rm -rf "$lists"' EXIT
mkdir -p "$lists/partial"
apt=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists="$lists"
     -oAPT::Sandbox::User=root)
as_root apt-get "${apt[@]}" update -q >/dev/null
(cd "$dir/debs" && apt-get "${apt[@]}" download -q libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 >/dev/null)

ls -l "$dir"/bin "$dir"/wheels "$dir"/debs
echo "gpu-bundle: $(du -sh "$dir" | cut -f1) in $dir (with the working tree: 64 MiB at most)"
