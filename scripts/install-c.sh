#!/usr/bin/env bash
# Installs the C library into PREFIX (default /usr/local) with CMake (capi/CMakeLists.txt),
# which builds it with cargo:
#   lib/libshmbridge.so (+ its soname link and versioned file), lib/libshmbridge.a,
#   include/shmbridge.h, lib/pkgconfig/shmbridge.pc, lib/cmake/shmbridge/ (find_package)
# C programs then build with `pkg-config --cflags --libs shmbridge`, CMake projects with
# `find_package(shmbridge)`; docs/c-api.md shows both.
#   bash scripts/install-c.sh                 # /usr/local (as root), then ldconfig
#   bash scripts/install-c.sh "$HOME/.local"  # anywhere: PKG_CONFIG_PATH, CMAKE_PREFIX_PATH
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_rust
ensure_cmake
prefix=${1:-/usr/local}
case "$prefix" in /*) ;; *) prefix=$PWD/$prefix ;; esac
build=target/cmake-capi
cmake -S capi -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" >/dev/null
cmake --build "$build"
cmake --install "$build" --prefix "$prefix"
case "$prefix" in
    /usr | /usr/local) as_root ldconfig ;;
esac
