# Shared by the scripts: make sure the tools the project builds with are here.
# Sourced, not run.

# A command that fails under `set -e` says which it was and where, once, before the script
# exits (without this, a failure in a sourced function or a command substitution ends the
# script with nothing said). -E: functions and subshells inherit the trap.
set -E
trap '_on_error $? "$BASH_COMMAND" "${BASH_SOURCE[0]:-?}" "$LINENO"' ERR
_on_error() {
    if [ -z "${_ERROR_SHOWN:-}" ]; then
        _ERROR_SHOWN=1
        echo "error: $3:$4: \`$2\` exited with status $1" >&2
    fi
}

# `step TEXT` starts a step of a script: prints "== [T s] TEXT", T the seconds since the
# run began (STEPS_T0, epoch seconds, where a caller set it: scripts/test.sh does, for
# its own steps and those of the scripts and checks it runs) or else since this script
# began (bash's SECONDS), so a log shows where the time went.
step() {
    local t=$SECONDS
    if [ -n "${STEPS_T0:-}" ]; then t=$(( $(date +%s) - STEPS_T0 )); fi
    printf '== [%4d s] %s\n' "$t" "$*"
}

# Rust >= 1.82 (rust-version in Cargo.toml) is the one thing the scripts cannot install:
# Debian 12's own cargo is 1.63, too old, so a machine without rustup's toolchain stops
# here, in its first second, with what to install.
RUST_MIN=1.82.0

# rustup's cargo on PATH when no other is.
rustup_cargo_on_path() {
    if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
}

ensure_rust() {
    rustup_cargo_on_path
    check_rust_version
    # C compiler for build scripts; C++ for libFuzzer (cargo fuzz) and the GPU kernel
    # compiled for the host (tests/cartpole_kernel.rs).
    if ! command -v cc >/dev/null 2>&1 || ! command -v c++ >/dev/null 2>&1; then
        echo "no C/C++ compiler (cc, c++): installing Debian's gcc and g++" >&2
        apt_install gcc g++
    fi
}

# Exits, saying what to install, unless cargo and a rustc >= RUST_MIN are on PATH.
check_rust_version() {
    local v=""
    if command -v rustc >/dev/null 2>&1 && command -v cargo >/dev/null 2>&1; then
        v=$(rustc --version | awk '{print $2}')
    fi
    if [ -z "$v" ] || [ "$(printf '%s\n%s\n' "$v" "$RUST_MIN" | sort -V | head -n1)" != "$RUST_MIN" ]; then
        echo "error: shmbridge needs a Rust toolchain >= $RUST_MIN (cargo and rustc on PATH); found: ${v:-none}." >&2
        echo "       Install one with rustup (https://rustup.rs): curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh" >&2
        echo "       then run this command again in a new shell (or after: . \"\$HOME/.cargo/env\")." >&2
        exit 1
    fi
}

# cargo-nextest, the runner of the Rust tests (scripts/test.sh, .config/nextest.toml): each
# test in a process of its own. Where it is missing, `cargo install --locked` builds it from
# crates.io into ~/.cargo/bin (minutes on a fresh machine, once; prebuilt binaries would
# come from GitHub, which this project does not download from).
ensure_nextest() {
    if ! cargo nextest --version >/dev/null 2>&1; then
        echo "no cargo-nextest: building it from crates.io (cargo install --locked cargo-nextest)" >&2
        cargo install --locked cargo-nextest
    fi
}

# python3 with venv and pip. `python3 -m venv --help` is not enough: Debian's python3
# (which other packages, Chromium's among them, bring in) has the venv module without
# ensurepip, so a venv made there has no pip.
ensure_python() {
    if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
        echo "python3 with venv and ensurepip not found" >&2
        apt_install python3 python3-venv python3-pip
    fi
}

# `make_venv DIR`: a virtual environment with pip in DIR, made anew where one is there
# without pip (an earlier run's, made before python3-venv was installed).
make_venv() {
    ensure_python
    if [ -x "$1/bin/python" ] && "$1/bin/python" -m pip --version >/dev/null 2>&1; then
        return
    fi
    rm -rf "$1"
    python3 -m venv "$1"
}

# A virtual environment in .venv with the package built from this checkout and what
# its tests need. Prints nothing on success but pip's errors.
ensure_venv() {
    make_venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "$@"
}

# The requirements of pyproject.toml: [project] dependencies and those of the extras
# named, one a line, so they can be installed while the extension compiles.
project_requirements() {
    "${PROJECT_PYTHON:-python3}" - "$@" <<'PY'
import sys
try:
    import tomllib  # Python >= 3.11
except ImportError:  # Python 3.9, 3.10: the TOML parser pip carries
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
extras = project.get("optional-dependencies", {})
unknown = [e for e in sys.argv[1:] if e not in extras]
if unknown:
    sys.exit(f"pyproject.toml has no extra {unknown}")
print("\n".join([*project["dependencies"], *(r for e in sys.argv[1:] for r in extras[e])]))
PY
}

# Starts installing the requirements of the extras named into .venv in the background
# (pip's output in target/deps.log); `wait_deps` waits for it and fails with that output.
start_deps() {
    make_venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    mkdir -p target
    local reqs
    reqs=$(PROJECT_PYTHON=.venv/bin/python project_requirements "$@")
    # shellcheck disable=SC2086
    (echo "$reqs" | xargs .venv/bin/python -m pip install -q) > target/deps.log 2>&1 &
    DEPS_PID=$!
}
wait_deps() {
    if ! wait "$DEPS_PID"; then
        cat target/deps.log >&2
        echo "error: installing the Python dependencies failed (above)" >&2
        exit 1
    fi
    grep -v "Running pip as the 'root' user" target/deps.log || true
}

# The tools that build the distributed wheel (scripts/build-wheel.sh), pinned, in their own
# virtual environment target/build-tools (apart from .venv, which holds what the tests
# import): maturin, zig as its linker (ziglang 0.14 broke maturin --zig builds: 0.13 is
# the pin) and auditwheel, which checks the wheel's manylinux tag.
BUILD_TOOLS="maturin==1.16.0 ziglang==0.13.0.post1 auditwheel==6.8.2"
ensure_build_tools() {
    local venv=target/build-tools
    if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/pins" 2>/dev/null)" != "$BUILD_TOOLS" ]; then
        ensure_python
        rm -rf "$venv"
        python3 -m venv "$venv"
        # shellcheck disable=SC2086
        "$venv/bin/python" -m pip install -q $BUILD_TOOLS
        echo "$BUILD_TOOLS" > "$venv/pins"
    fi
}

# The native MuJoCo engine's library (the `mujoco` cargo feature, docs/mujoco.md):
# `ensure_mujoco VENV` installs PyPI's mujoco wheel, which ships libmujoco.so.3.17.0 and
# its headers, and Gymnasium (the model files and the reference the alignment tests
# compare with) into VENV, links the library into target/mujoco-lib under the names
# mujoco-rs's build script and the loader look for, and exports MUJOCO_DYNAMIC_LINK_DIR.
MUJOCO_PIN="mujoco==3.17.0"
ensure_mujoco() {
    local venv=$1 lib
    make_venv "$venv"
    "$venv/bin/python" -m pip install -q "$MUJOCO_PIN" "gymnasium[mujoco]>=1.0" numpy pytest "pytest-xdist>=3.3" \
        2>&1 | { grep -v "Running pip as the 'root' user" || true; }
    lib=$("$venv/bin/python" -c 'import glob, os, mujoco; print(glob.glob(os.path.join(os.path.dirname(mujoco.__file__), "libmujoco.so.*"))[0])')
    mkdir -p target/mujoco-lib
    ln -sf "$lib" target/mujoco-lib/libmujoco.so
    ln -sf "$lib" "target/mujoco-lib/$(basename "$lib")"
    export MUJOCO_DYNAMIC_LINK_DIR=$PWD/target/mujoco-lib
}

# Mesa's EGL and its OpenGL drivers (llvmpipe on a machine without a GPU), which MuJoCo's
# offscreen renderer draws the native engine's camera with (docs/mujoco.md), and which
# `mujoco.Renderer` (MUJOCO_GL=egl) draws the frames the tests compare with.
ensure_mesa() {
    if [ ! -e /usr/share/glvnd/egl_vendor.d/50_mesa.json ] || \
       ! ls /usr/lib/*/dri/swrast_dri.so >/dev/null 2>&1; then
        apt_install libegl1 libegl-mesa0 libgl1 libgl1-mesa-dri
    fi
}

# A Vulkan loader and Mesa's CPU driver lavapipe, so the Vulkan tests (tests/vulkan.rs)
# run on a machine without a GPU.
ensure_vulkan() {
    if [ ! -e /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ] && \
       [ ! -e /usr/share/vulkan/icd.d/lvp_icd.aarch64.json ]; then
        apt_install mesa-vulkan-drivers libvulkan1
    fi
}

# CMake and pkg-config: what C and C++ projects build with, for installing the C library
# (scripts/install-c.sh) and building the examples against it (examples/cpp, examples/c).
ensure_cmake() {
    if ! command -v cmake >/dev/null 2>&1 || ! command -v pkg-config >/dev/null 2>&1; then
        apt_install cmake pkg-config
    fi
}

# What a C engine that renders with Vulkan itself is built with (examples/c/vulkan_engine.c,
# examples/c/vulkan_frames.c): the Vulkan headers and the loader to link (libvulkan-dev),
# and glslangValidator (glslang-tools), which compiles its compute shader to SPIR-V.
ensure_vulkan_dev() {
    if [ ! -e /usr/include/vulkan/vulkan.h ] || ! command -v glslangValidator >/dev/null 2>&1; then
        apt_install libvulkan-dev glslang-tools
    fi
}

# Debian's Mono C# compiler and runtime, so the C# binding and engine
# (bindings/csharp, examples/csharp) build and run in the tests. Mono 6.8's mscorlib has
# Span<T>: nothing from another registry is needed.
ensure_mono() {
    if ! command -v mcs >/dev/null 2>&1 || ! command -v mono >/dev/null 2>&1; then
        apt_install mono-mcs mono-runtime
    fi
}

# apt-get install, with one apt-get update per script run (a fresh machine needs one).
apt_install() {
    echo "installing Debian's $* (apt-get install)" >&2
    if [ -z "${APT_UPDATED:-}" ]; then
        as_root apt-get update -q
        APT_UPDATED=1
    fi
    as_root apt-get install -y -q "$@"
}

# libFuzzer as the distribution's LLVM ships it prebuilt (libclang-rt-NN-dev), for cargo
# fuzz (scripts/fuzz.sh) to link in place of the copy libfuzzer-sys compiles from its C++
# sources: that compile was a third of the fuzz build, and LLVM's build of it runs about
# 1.8 times the executions per second here. Where none is installed, Debian's is (LLVM
# 19's where the release has it); where that cannot be had, libfuzzer-sys builds its own.
# Exports CUSTOM_LIBFUZZER_PATH when one is found.
find_libfuzzer() {
    local found=() f
    for f in /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-"$(uname -m)".a; do
        [ -e "$f" ] && found+=("$f")
    done
    [ ${#found[@]} -eq 0 ] || printf '%s\n' "${found[@]}" | sort -V | tail -n1
}
ensure_libfuzzer() {
    local libfuzzer
    libfuzzer=$(find_libfuzzer)
    if [ -z "$libfuzzer" ] && command -v apt-get >/dev/null 2>&1; then
        echo "no prebuilt libFuzzer (/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-$(uname -m).a): installing Debian's libclang-rt-19-dev (or libclang-rt-dev)" >&2
        mkdir -p target
        if { apt_install libclang-rt-19-dev || apt_install libclang-rt-dev; } > target/fuzz-apt.log 2>&1; then
            libfuzzer=$(find_libfuzzer)
        else
            echo "installing it failed (target/fuzz-apt.log): cargo fuzz builds libfuzzer-sys's own libFuzzer instead" >&2
        fi
    fi
    if [ -n "$libfuzzer" ]; then
        export CUSTOM_LIBFUZZER_PATH=$libfuzzer
    fi
}

# GNU make, which runs scripts/test.sh's last checks side by side (scripts/checks.mk).
ensure_make() {
    if ! command -v make >/dev/null 2>&1; then
        apt_install make
    fi
}

# unshare (util-linux) and ip (iproute2), for the tests that run engine and learner in
# namespaces of their own (tests/containers.rs, tests/python/test_containers.py) and two
# "nodes" joined by a veth pair (tests/python/test_multinode.py).
ensure_namespace_tools() {
    if ! command -v unshare >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then
        apt_install util-linux iproute2
    fi
}

# Debian's headless-capable Chromium and its WebDriver, so the viewer's browser test
# (tests/python/test_view.py, selenium from the test extra) drives a real browser.
# git, which rsl_rl's runner imports (GitPython, to log the repository's state) and which
# fails at import without it: a machine that got the checkout some other way may have none.
ensure_git() {
    if ! command -v git >/dev/null 2>&1; then
        apt_install git
    fi
}

ensure_chromium() {
    if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
        apt_install chromium chromium-driver
    fi
}

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# Fails, with what it found, if anything of the region namespace NS (docs/protocol.md 1.1)
# is left: a name in /dev/shm starting `shmbridge-NS-` or `shmbridge-NS_` (the namespaces
# the tests make under it), or such an abstract socket bound.
no_region_left() {
    local ns=$1 left sockets
    left=$(ls /dev/shm 2>/dev/null | grep -E "^shmbridge-${ns}[-_]" || true)
    sockets=$(grep -E "@shmbridge-${ns}[-_]" /proc/net/unix || true)
    if [ -n "$left$sockets" ]; then
        echo "error: left in /dev/shm or bound by the tests (namespace $ns):" >&2
        echo "$left$sockets" >&2
        exit 1
    fi
    echo "nothing left (namespace $ns)"
}

# Puts the NVRTC wheel's folder (found by `python`'s shmbridge) on LD_LIBRARY_PATH, so
# the Rust tests and CLI engines compile their kernels without a CUDA toolkit.
use_nvrtc_wheel() {
    local dirs
    dirs=$("$1" -c 'import shmbridge; print(":".join(shmbridge.nvrtc_library_dirs()))')
    if [ -n "$dirs" ]; then
        export LD_LIBRARY_PATH="${dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
}

# A new virtual environment in $1 (removed first) with the wheel $2 installed as users
# install it (no source tree, no editable install). Its third-party packages are those in
# .venv (start_deps), reached through a .pth line after its own site-packages, so a run
# does not copy several GB again.
fresh_venv_with_wheel() {
    local venv=$1 wheel=$2 own deps
    rm -rf "$venv"
    python3 -m venv "$venv"
    own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    deps=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    echo "$deps" > "$own/zz_deps_from_dot_venv.pth"
    # --ignore-installed: a shmbridge in .venv (the main job installs one there) is seen
    # through the .pth line; without it pip would call the wheel installed and skip it.
    "$venv/bin/python" -m pip install -q --no-deps --no-index --ignore-installed "$wheel" 2>&1 \
        | { grep -v "Running pip as the 'root' user" || true; }
    "$venv/bin/python" - "$venv" <<'PY'
import pathlib, sys
import shmbridge
where = pathlib.Path(shmbridge.__file__).resolve()
venv = pathlib.Path(sys.argv[1]).resolve()
assert venv in where.parents, f"shmbridge comes from {where}, not the wheel installed in {venv}"
print(f"shmbridge {shmbridge.__version__} from {where.parent}")
PY
}

# Runs a command where no cargo or rustc can be found: PATH without the folders that hold
# them (rustup's ~/.cargo/bin). Where one is a folder the command needs as well (Debian's
# cargo package installs into /usr/bin), the command runs in a private mount namespace in
# which they are hidden (root only).
without_rust() {
    local dir keep=() hide=() parts
    IFS=: read -ra parts <<< "$PATH"
    for dir in "${parts[@]}"; do
        if [ -e "$dir/cargo" ] || [ -e "$dir/rustc" ]; then
            case "$dir" in
                /usr/bin | /bin | /usr/sbin | /sbin | /usr/local/bin)
                    keep+=("$dir")
                    hide+=("$dir/cargo" "$dir/rustc" "$dir/rustup" "$dir/rustdoc")
                    ;;
            esac
        else
            keep+=("$dir")
        fi
    done
    local path
    path=$(IFS=:; echo "${keep[*]}")
    if [ ${#hide[@]} -eq 0 ]; then
        env -u CARGO -u RUSTC -u RUSTUP_TOOLCHAIN PATH="$path" "$@"
    else
        env -u CARGO -u RUSTC -u RUSTUP_TOOLCHAIN PATH="$path" \
            unshare -m --propagation private sh -c \
            'for f in '"${hide[*]}"'; do if [ -e "$f" ]; then mount --bind /dev/null "$f"; fi; done; exec "$@"' \
            sh "$@"
    fi
}
