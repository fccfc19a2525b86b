#!/usr/bin/env bash
# Builds the Python package as users install it, into dist/ (or --out DIR):
#   shmbridge-<version>.tar.gz                             the sdist: `pip install` builds it
#                                                          with cargo (Rust >= 1.82) alone
#   shmbridge-<version>-cp39-abi3-manylinux_2_17_<arch>.whl
#                                                          one wheel for every CPython >= 3.9
#                                                          (abi3), installable without Rust
# The wheel is built from the unpacked sdist, so the sdist is known to hold everything a
# build needs. maturin links it with zig (`--zig`) against glibc 2.17's symbols, which
# makes a manylinux2014 wheel without a manylinux container. `auditwheel show` must then
# report manylinux_2_17 or manylinux_2_28, and no library to bundle: the extension needs
# only libc, libm, libpthread and libdl. The Vulkan loader and the CUDA driver are opened
# at run time (dlopen), so the wheel imports on a machine with neither.
# The tools (maturin, ziglang, auditwheel) are pinned in scripts/lib.sh and installed into
# target/build-tools; the compiled crates stay in target/ between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

out=dist
case "${1:-}" in
    "") ;;
    --out) out="${2:?--out needs a folder}" ;;
    *) echo "usage: bash scripts/build-wheel.sh [--out DIR]" >&2; exit 2 ;;
esac

ensure_rust
ensure_build_tools
tools=$PWD/target/build-tools/bin
target=$PWD/target
arch=$(uname -m)
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -f "$out"/shmbridge-"$version"*.whl "$out"/shmbridge-"$version".tar.gz

echo "build-wheel: sdist"
"$tools/maturin" sdist --out "$out"
sdist="$out/shmbridge-$version.tar.gz"
src=$target/sdist
rm -rf "$src"
mkdir -p "$src"
# --touch: the sdist's files carry one fixed old mtime, which cargo would take for
# unchanged sources and reuse the extension built from the previous sdist in target/.
tar -xzf "$sdist" -C "$src" --touch

echo "build-wheel: abi3 wheel from the sdist (maturin --zig, manylinux2014, $arch)"
# zig as the linker needs its own folder for its caches; `python -m ziglang` is how
# maturin finds the pinned zig (PATH gives it the venv's).
export ZIG_GLOBAL_CACHE_DIR=$target/zig-cache ZIG_LOCAL_CACHE_DIR=$target/zig-cache
# Not --locked: the sdist's Cargo.lock is the workspace's, and cargo drops the entries of
# the other members (capi, its header tool); the versions of what the wheel uses stay.
(cd "$src/shmbridge-$version" &&
    PATH="$tools:$PATH" maturin build --zig --compatibility manylinux2014 \
        --target "$arch-unknown-linux-gnu" --target-dir "$target" --out "$out")
wheel=$(ls "$out"/shmbridge-"$version"-cp39-abi3-*.whl)

echo "build-wheel: auditwheel show"
"$tools/auditwheel" show "$wheel"
# The same report as JSON: the tag, and what auditwheel repair would have to bundle
# (libraries outside the manylinux policy's list): it must be nothing.
"$tools/auditwheel" show --json "$wheel" | "$tools/python" -c '
import json, sys
report, arch = json.load(sys.stdin), sys.argv[1]
tag, external = report["overall_tag"], report["external_libs"]
if tag not in (f"manylinux_2_17_{arch}", f"manylinux_2_28_{arch}"):
    sys.exit(f"error: auditwheel gives {tag}, not manylinux_2_17 or manylinux_2_28 for {arch}")
if external:
    sys.exit(f"error: the wheel needs libraries outside the manylinux policy: {sorted(external)}")
print(f"build-wheel: {tag}, no library to bundle")
' "$arch"
echo "build-wheel: $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB), $(basename "$sdist") ($(du -k "$sdist" | cut -f1) KiB)"
