#!/usr/bin/env bash
# Installs the C library into PREFIX (default /usr/local) with CMake (capi/CMakeLists.txt),
# which builds it with cargo:
#   lib/libshmbridge.so (+ its soname link and versioned file), lib/libshmbridge.a,
#   include/shmbridge.h, lib/pkgconfig/shmbridge.pc, lib/cmake/shmbridge/ (find_package)
# C programs then build with `pkg-config --cflags --libs shmbridge`, CMake projects with
# `find_package(shmbridge)`; docs/c-api.md shows both.
#   bash scripts/install-c.sh                 # /usr/local: builds as you, installs with sudo, ldconfig
#   bash scripts/install-c.sh "$HOME/.local"  # anywhere: PKG_CONFIG_PATH, CMAKE_PREFIX_PATH
#   bash scripts/install-c.sh --install-deps PREFIX   # may apt-get install cmake, pkg-config, cc
# Rust (1.82 or newer: cargo and rustc) is never installed by this script, --install-deps
# or not: install it yourself with rustup (https://rustup.rs); Debian 12's cargo is too old.
# A relative PREFIX is taken from the directory the script is run in. The build runs as
# the user who runs the script (not under sudo: run it as yourself); only the install step
# (and ldconfig) runs with sudo, and only where PREFIX is not writable. Without
# --install-deps nothing is installed from the package manager: a missing tool is named,
# with the command that installs it, and the script stops.
set -euo pipefail
install_deps=
while [ $# -gt 0 ]; do
    case "$1" in
        --install-deps) install_deps=1; shift ;;
        -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --) shift; break ;;
        -*) echo "install-c.sh: unknown option $1 (--install-deps, --help)" >&2; exit 2 ;;
        *) break ;;
    esac
done
if [ $# -gt 1 ]; then
    echo "install-c.sh: one PREFIX at most (got: $*)" >&2
    exit 2
fi
# Before the cd below: a relative prefix is the caller's, not the checkout's. Normalised
# (no trailing slash, no `.` or `..`; symlinks kept), so `/usr/local/` is `/usr/local`.
prefix=$(realpath -ms -- "${1:-/usr/local}")

if [ "$(id -u)" = 0 ] && [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ]; then
    echo "install-c.sh: run by sudo for $SUDO_USER: run it as $SUDO_USER instead (without" >&2
    echo "sudo); it builds as you and runs only the install step with sudo." >&2
    exit 1
fi

cd "$(dirname "$0")/.."
. scripts/lib.sh

rustup_cargo_on_path
if [ -n "$install_deps" ]; then
    ensure_rust
    ensure_cmake
else
    missing=() packages=()
    need_tool() { # need_tool TOOL PACKAGE
        if ! command -v "$1" >/dev/null 2>&1; then
            missing+=("$1")
            packages+=("$2")
        fi
    }
    need_tool cc gcc
    need_tool cmake cmake
    need_tool pkg-config pkg-config
    if [ ${#missing[@]} -gt 0 ]; then
        echo "install-c.sh: missing: ${missing[*]}. Install them, e.g." >&2
        echo "    sudo apt-get install ${packages[*]}" >&2
        echo "or run again with --install-deps to have this script apt-get install them." >&2
        exit 1
    fi
fi
# Rust is the user's to install (rustup), --install-deps or not: this names what to run.
check_rust_version

build=target/cmake-capi
cmake -S capi -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" >/dev/null
cmake --build "$build"

# Writable: the prefix, or else the deepest folder above it that exists.
writable=$prefix
while [ ! -e "$writable" ]; do writable=$(dirname "$writable"); done
# `cmake --install` writes install_manifest.txt into the build folder: one left by an
# earlier install under sudo is root's, and would make this one fail. The folder is
# ours, so the file can go whoever owns it.
rm -f "$build/install_manifest.txt"
if [ -w "$writable" ]; then
    cmake --install "$build" --prefix "$prefix"
else
    echo "install-c.sh: $prefix is not writable by $(id -un): installing with sudo" >&2
    # By its path: sudo's secure_path may not hold a cmake found on the user's PATH.
    sudo "$(command -v cmake)" --install "$build" --prefix "$prefix"
    # The manifest sudo wrote is the user's again, like the rest of the build folder.
    sudo chown "$(id -u):$(id -g)" "$build/install_manifest.txt"
fi
case "$prefix" in
    /usr | /usr/local) as_root ldconfig ;;
esac
